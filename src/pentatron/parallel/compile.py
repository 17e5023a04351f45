"""Regional compilation (`train.compile`): `torch.compile` over each decoder block's compute, never over
a collective.

Every collective stays an eager call of `distributed/comm.py` (so the comm ledger and the flight
recorder see each one, as without compile); what is compiled is the compute *between* them, found
structurally on each block after tensor/context/expert parallelism replaced its pieces:

* a block that holds no communicating module (no module with a `comm`, no MoE layer) and no hooks inside
  is compiled whole (dp, ZeRO-0..3, pp, ep's dense layers): torchtitan's per-block regional compile. A
  block's own hooks (ZeRO-3's gather/free) stay outside, because the region is the block's `forward`.
* otherwise each maximal communication-free piece is compiled on its own: the norms, the attention
  core when it is the plain one (cp replaces it with ring/Ulysses attention, which stays eager), RoPE
  (`Attention.rotate`), the MLP's activation (`MLP.activate`) or a whole MLP that does not communicate,
  an MoE layer's shared experts; bare (column/row-parallel) linears gain nothing and stay eager. The
  routed experts and the router stay eager: their shapes follow the routing (data-dependent).
* train.fp8's linears (parallel/fp8.py) compile inside their block, attention or MLP, which fuses their
  casts, unless their casts all-reduce an amax (cp; tp's are column/row-parallel): those stay eager.
* with document masking (`eager_attention`) the attention core stays eager, and so no block is compiled
  whole: its documents are host-side offsets that change every micro-batch (a graph per batch otherwise).
* under the zero-bubble schedule (split backward) only weight-free elementwise regions and the norms are
  compiled: a compiled region's backward is one autograd node that yields input and weight gradients
  together, so a region holding a GEMM would run its whole backward again in W.

Regions are compiled before activation checkpointing wraps them (`parallel/recompute.py`), so a
recomputed block reruns its compiled code. Each region is compiled with `fullgraph=True` (a graph
break would be a collective or a host read hidden in compute: an error, not a silent slowdown).
A compile failure surfaces as one `CompileError` line naming the region and what to set; with
`train.compile = "try"` the region warns once and runs eagerly instead. AOTAutograd would compile a
region's backward lazily, inside the first `backward()`, where a failure is a raw traceback out of the
autograd engine and the forward already ran compiled (no eager fallback left for that step); so each region's
backward is compiled with its forward (`force_non_lazy_backward_lowering`): any failure, forward's or
backward's, happens at the region's first call, where it is caught (under zb, whose B keeps the graph for W,
without donated buffers: the lazy compile turned them off itself). `CompileReport` counts the graphs dynamo
built, the recompilations (graphs of a region after its first) and the seconds spent compiling (from
`torch._dynamo.utils`), for the run summary and the no-recompilation test.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._functorch.config as aot_config
from torch import nn

from pentatron.config import compile_enabled
from pentatron.models.llama import MLP, Attention, AttentionCore, RMSNorm
from pentatron.models.moe import MoE
from pentatron.parallel.fp8_stats import fp8_gemm

# AOTAutograd's switch that compiles the backward inside the forward's compile (absent: the lazy backward).
_EAGER_BACKWARD = "force_non_lazy_backward_lowering"
# torch's compile-time timers: dynamo + AOTAutograd + inductor (the backward too when compiled eagerly), and
# the lazily compiled backward (only where torch lacks _EAGER_BACKWARD: it is inside compile_inner otherwise).
_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
# Injected failures for tests ("forward" or "backward": that compile of every region raises), set by a test.
TEST_FAIL: str | None = None


class CompileError(RuntimeError):
    """A region failed to compile (train.compile = true); one line, without torch's log hints."""


# torch._dynamo is read from sys.modules, never imported here: its import is ~1 s of every rank's start-up,
# paid only by a run that compiles (torch.compile imports it); before that, nothing was compiled.
def _dynamo_utils() -> Any:
    return sys.modules.get("torch._dynamo.utils")


def _compile_seconds() -> float:
    utils = _dynamo_utils()
    if utils is None:
        return 0.0
    timers = _TIMERS[:1] if hasattr(aot_config, _EAGER_BACKWARD) else _TIMERS
    return sum(sum(utils.compilation_time_metrics.get(k, ())) for k in timers)


def _graphs() -> int:
    utils = _dynamo_utils()
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]


@dataclass
class CompileReport:
    """What was compiled in this process, and what compiling cost since (process-wide dynamo counters,
    read as differences from when the regions were installed)."""

    backend: str | Callable[..., Any]  # a name, or a callable (tests)
    fallback: bool
    regions: list[str] = field(default_factory=list)  # module paths, e.g. "layers.0" or "layers.0.attn.rotate"
    failed: list[str] = field(default_factory=list)  # regions running eagerly after a failure ("try")
    recompiles: int = 0  # graphs dynamo built for a region that already had one (a guard failed)
    _graphs0: int = field(default_factory=_graphs)
    _seconds0: float = field(default_factory=_compile_seconds)

    def graphs(self) -> int:
        """Graphs dynamo has compiled since (a recompilation adds one)."""
        return _graphs() - self._graphs0

    def seconds(self) -> float:
        return _compile_seconds() - self._seconds0

    def summary(self) -> dict[str, Any]:
        backend = self.backend if isinstance(self.backend, str) else repr(self.backend)
        return {"backend": backend, "regions": len(self.regions), "graphs": self.graphs(),
                "recompiles": self.recompiles, "compile_s": round(self.seconds(), 2), "failed": list(self.failed)}


def _one_line(e: BaseException) -> str:
    """The root cause's first line (a backend's own error, not dynamo's wrapper), without torch's hints about
    TORCH_LOGS / TORCHDYNAMO_VERBOSE."""
    root = getattr(e, "inner_exception", None) or e
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip() and "TORCH_LOGS" not in ln
             and "TORCHDYNAMO" not in ln and not ln.strip().startswith(("Set ", "For more", "Developer debug"))]
    return f"{type(root).__name__}: {lines[0] if lines else ''}"[:300]


class _Region:
    """One compiled region, installed as a module's `forward` (or `rotate` / `activate`): parameter
    names, hooks and checkpoints of the module are unchanged."""

    def __init__(self, name: str, eager: Callable[..., Any], report: CompileReport) -> None:
        self.name, self.eager, self.report = name, eager, report
        # static shapes: a layout has one shape per region; automatic dynamic shapes would retrace symbolically
        self.compiled = torch.compile(eager, backend=_backend(report.backend), fullgraph=True, dynamic=False)
        self.failed = False
        self.graphs = 0  # graphs dynamo built for this region

    def __call__(self, *args: Any) -> Any:
        if self.failed:
            return self.eager(*args)
        before = _graphs()
        try:
            out = self.compiled(*args)
        except Exception as e:
            from torch._dynamo.exc import TorchDynamoException  # loaded: torch.compile imported dynamo

            if not isinstance(e, TorchDynamoException):
                raise
            msg = f"train.compile: compiling {self.name} failed: {_one_line(e)}"
            if not self.report.fallback:
                raise CompileError(msg + "; set train.compile = false, or \"try\" to run it eagerly") from None
            warnings.warn(msg + "; running it eagerly (train.compile = \"try\")", RuntimeWarning, stacklevel=2)
            self.failed = True
            self.report.failed.append(self.name)
            return self.eager(*args)
        built = _graphs() - before  # a dict read: no cost worth counting per call
        if built:
            self.report.recompiles += built - (self.graphs == 0)
            self.graphs += built
        return out


def _backend(backend: str | Callable[..., Any]) -> str | Callable[..., Any]:
    """`backend`, or under `TEST_FAIL` one whose forward or backward compile raises (AOTAutograd's own
    pipeline with a failing compiler: the failure torch itself would raise, not a stand-in for it)."""
    if TEST_FAIL is None:
        return backend
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def ok(gm: torch.fx.GraphModule, _: list[torch.Tensor]) -> Callable[..., Any]:
        return make_boxed_func(gm.forward)

    def fail(gm: torch.fx.GraphModule, _: list[torch.Tensor]) -> Callable[..., Any]:
        raise RuntimeError(f"injected {TEST_FAIL} compile failure (pentatron.parallel.compile.TEST_FAIL)")

    return aot_autograd(fw_compiler=fail if TEST_FAIL == "forward" else ok,
                        bw_compiler=fail if TEST_FAIL == "backward" else ok)


def _communicates(m: nn.Module) -> bool:
    """Holds a module that must stay eager: a collective's, an MoE layer, a core marked `eager_only`, or an FP8
    linear whose casts all-reduce their amax (parallel/fp8.py's `gemm.reduce`: cp's token split)."""
    return any(hasattr(x, "comm") or isinstance(x, MoE) or getattr(x, "eager_only", False) or _fp8_reduces(x)
               for x in m.modules())


def _fp8_reduces(m: nn.Module) -> bool:
    return (gemm := fp8_gemm(m)) is not None and any(gemm.reduce.values())


def _hooked_inside(m: nn.Module) -> bool:
    return any(x._forward_hooks or x._forward_pre_hooks for x in m.modules() if x is not m)


def _install(m: nn.Module, attr: str, name: str, report: CompileReport) -> None:
    setattr(m, attr, _Region(name, getattr(m, attr), report))
    report.regions.append(name)


def _elementwise(m: nn.Module, name: str, report: CompileReport) -> None:
    """The weight-free regions (and the norms) of `m`'s subtree."""
    for sub_name, sub in m.named_modules(prefix=name):
        if isinstance(sub, RMSNorm) or (type(sub) is AttentionCore and not getattr(sub, "eager_only", False)):
            _install(sub, "forward", sub_name, report)
        elif isinstance(sub, Attention):
            _install(sub, "rotate", f"{sub_name}.rotate", report)
        elif isinstance(sub, MLP):
            _install(sub, "activate", f"{sub_name}.activate", report)


def _regions(m: nn.Module, name: str, report: CompileReport) -> None:
    """Compile the maximal communication-free pieces of `m` (see the module docstring)."""
    bare = isinstance(m, (nn.Linear, nn.Embedding))  # one GEMM / gather: nothing to fuse
    if bare or (next(m.parameters(), None) is None and type(m) is not AttentionCore):
        return
    if not _communicates(m) and not _hooked_inside(m) and not isinstance(m, MoE):
        _install(m, "forward", name, report)
        return
    if isinstance(m, MoE):
        if m.shared is not None:
            _regions(m.shared, f"{name}.shared", report)
        return
    if isinstance(m, Attention):
        _install(m, "rotate", f"{name}.rotate", report)
    elif isinstance(m, MLP):
        _install(m, "activate", f"{name}.activate", report)
    for child_name, child in m.named_children():
        _regions(child, f"{name}.{child_name}", report)


def eager_fp8_linears(model: nn.Module) -> list[str]:
    """train.fp8's linears (parallel/fp8_stats.fp8_gemm) inside no compiled region: their casts run eagerly
    (train.compile off; tp / cp's reducing casts; the zero-bubble schedule's regions)."""
    inside = {id(x) for m in model.modules() if isinstance(vars(m).get("forward"), _Region) for x in m.modules()}
    return [n for n, m in model.named_modules() if fp8_gemm(m) is not None and id(m) not in inside]


def apply_compile(model: nn.Module, setting: bool | str, device: torch.device,
                  backend: str | Callable[..., Any] = "inductor",
                  split_backward: bool = False, eager_attention: bool = False) -> CompileReport | None:
    """Compile the regions of every decoder block of `model` (a pipeline rank's stages keep their layers in a
    dict); None when train.compile is off on this device. Call after tensor/context/expert parallelism and
    before activation checkpointing. `eager_attention`: leave every attention core eager (document masking)."""
    if not compile_enabled(setting, device.type):
        return None
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks if eager_attention else ():
        block.attn.core.eager_only = True
    if hasattr(aot_config, _EAGER_BACKWARD):  # process-wide, but only compiling pays: the same work, earlier
        setattr(aot_config, _EAGER_BACKWARD, True)
        if split_backward:
            # B's autograd.grad(retain_graph=True) keeps the saved tensors for W: a backward compiled ahead may
            # not reuse (donate) them. The lazy compile saw retain_graph and turned donation off by itself.
            aot_config.donated_buffer = False
    report = CompileReport(backend, fallback=setting == "try")
    items = model.layers.items() if isinstance(model.layers, nn.ModuleDict) else enumerate(model.layers)
    for i, block in items:
        name = f"layers.{i}"
        if split_backward:
            _elementwise(block, name, report)
        else:
            _regions(block, name, report)
    return report

