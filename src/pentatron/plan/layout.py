"""What the planner plans: a workload (model, sequence, batch) and a layout (mesh + training knobs).

Rank order follows `distributed/context.py`: mesh dims ("pp", "dp", "cp", "tp") outermost first, so
a tensor-parallel group is consecutive ranks (one node) and pipeline neighbours are dp*cp*tp apart.
Expert parallelism borrows its ranks from dp x cp.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

from pentatron.models.config import ModelConfig
from pentatron.plan.flops import RECOMPUTE_MODES, MoESpec, moe_of
from pentatron.plan.hardware import GPUSpec

# fp16 runs like bf16 (same tensor-core peak on A100/H100) plus dynamic loss scaling (one extra pass over
# the gradients for the inf/nan check, modelled with the optimizer); fp8: Transformer-Engine style GEMMs.
PRECISIONS: tuple[str, ...] = ("bf16", "fp32", "fp8", "fp16")
# attention kernels: FlashAttention-2 (what torch SDPA runs), FlashAttention-3 (Hopper), cuDNN fused
# attention, or the unfused math path (scores materialised: Megatron before 2022, BLOOM).
ATTENTION_KERNELS: tuple[str, ...] = ("flash2", "flash3", "cudnn", "math")
PP_SCHEDULES: tuple[str, ...] = ("afab", "1f1b", "interleaved", "zb")


@dataclass(frozen=True)
class Workload:
    cfg: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    moe: MoESpec | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def moe_spec(self) -> MoESpec | None:
        return moe_of(self.cfg, self.moe)


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    precision: str = "bf16"
    attention: str = "flash2"
    # dtype of the gradient buffer that is accumulated and reduced: our trainer keeps fp32; Megatron's
    # default distributed optimizer and FSDP with a bf16 reduce dtype keep bf16 (2 bytes/param less)
    grad_precision: str = "fp32"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def microbatches(self, w: Workload) -> int:
        """Micro-batches per step on each pipeline (gradient-accumulation steps)."""
        return w.global_batch // (self.dp * self.micro_batch)

    def short(self) -> str:
        s = f"dp{self.dp} tp{self.tp}{'+sp' if self.sp else ''} pp{self.pp} cp{self.cp}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.pp > 1:
            s += f" {self.pp_schedule}" + (f"/v{self.pp_virtual}" if self.pp_schedule == "interleaved" else "")
        return s + f" z{self.zero} mb{self.micro_batch} rc:{self.recompute}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **kw: Any) -> Layout:
        return replace(self, **kw)


def kv_heads_per_tp_rank(cfg: ModelConfig, tp: int) -> int:
    """KV heads each TP rank holds: n_kv/tp, or 1 (replicated) when tp > n_kv (Megatron's GQA rule)."""
    return max(1, cfg.n_kv_heads // tp)


def problems(w: Workload, lay: Layout, gpu: GPUSpec, gpus: int | None = None) -> list[str]:
    """Every reason this layout cannot run this workload (empty when it can). Messages name the flag."""
    out: list[str] = []
    cfg, moe = w.cfg, w.moe_spec
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "pp_virtual"):
        v = getattr(lay, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            out.append(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if out:
        return out
    if gpus is not None and lay.world != gpus:
        out.append(f"dp*tp*pp*cp = {lay.dp}*{lay.tp}*{lay.pp}*{lay.cp} = {lay.world} does not equal --gpus {gpus}")
    if lay.zero not in (0, 1, 2, 3):
        out.append(f"--zero must be 0, 1, 2 or 3, got {lay.zero}")
    if lay.recompute not in RECOMPUTE_MODES:
        out.append(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {lay.recompute!r}")
    if lay.precision not in PRECISIONS:
        out.append(f"--precision must be one of {', '.join(PRECISIONS)}, got {lay.precision!r}")
    elif lay.precision not in ("fp32",) and _dtype_key(lay.precision) not in gpu.peak_flops:
        out.append(f"--precision {lay.precision}: {gpu.name} has no {lay.precision} tensor cores")
    # tensor parallel: inside one node, dividing heads and widths
    if lay.tp > gpu.gpus_per_node:
        out.append(f"tp={lay.tp} exceeds the {gpu.gpus_per_node} GPUs of a node (TP must stay on NVLink)")
    if cfg.n_heads % lay.tp:
        out.append(f"tp={lay.tp} does not divide the {cfg.n_heads} attention heads")
    if lay.tp > cfg.n_kv_heads and lay.tp % cfg.n_kv_heads:
        out.append(f"tp={lay.tp} > {cfg.n_kv_heads} KV heads must be a multiple of them (KV heads are replicated)")
    elif lay.tp <= cfg.n_kv_heads and cfg.n_kv_heads % lay.tp:
        out.append(f"tp={lay.tp} does not divide the {cfg.n_kv_heads} KV heads")
    if cfg.ffn_hidden_size % lay.tp or (moe and moe.expert_ffn_hidden_size % lay.tp):
        out.append(f"tp={lay.tp} does not divide the MLP width {cfg.ffn_hidden_size}")
    if cfg.vocab_size % lay.tp:
        out.append(f"tp={lay.tp} does not divide the vocabulary {cfg.vocab_size} (vocab-parallel embedding)")
    if lay.sp and lay.tp == 1:
        out.append("--sp (sequence parallel) needs tp > 1")
    if lay.sp and w.seq_len % (lay.tp * lay.cp):
        out.append(f"--sp: tp*cp={lay.tp * lay.cp} does not divide --seq {w.seq_len}")
    # context parallel: the load-balanced ring splits each sequence into 2*cp chunks
    if lay.cp > 1 and w.seq_len % (2 * lay.cp):
        out.append(f"cp={lay.cp}: --seq {w.seq_len} must be divisible by 2*cp={2 * lay.cp} (load-balanced ring)")
    # expert parallel
    if lay.ep > 1 and moe is None:
        out.append(f"ep={lay.ep} needs a mixture-of-experts model")
    if moe is not None and moe.num_experts % lay.ep:
        out.append(f"ep={lay.ep} does not divide the {moe.num_experts} experts")
    if (lay.dp * lay.cp) % lay.ep:
        out.append(f"ep={lay.ep} must divide dp*cp={lay.dp * lay.cp} (experts borrow those ranks)")
    # pipeline
    chunks = lay.pp * lay.pp_virtual
    if chunks > cfg.n_layers:
        out.append(f"pp*v={chunks} pipeline chunks exceed the {cfg.n_layers} layers")
    elif lay.pp_virtual > 1 and cfg.n_layers % chunks:
        out.append(f"interleaved: the {cfg.n_layers} layers do not divide into pp*v={chunks} equal chunks")
    if lay.pp_schedule not in PP_SCHEDULES:
        out.append(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {lay.pp_schedule!r}")
    if lay.pp_virtual > 1 and lay.pp_schedule != "interleaved":
        out.append(f"--pp-virtual {lay.pp_virtual} needs --pp-schedule interleaved")
    if lay.pp_schedule == "interleaved" and lay.pp > 1 and lay.pp_virtual < 2:
        out.append("--pp-schedule interleaved needs --pp-virtual >= 2")
    if lay.zero == 3 and lay.pp > 1:
        out.append("zero=3 with pp>1 is not supported (parameters would be re-gathered every micro-batch); "
                   "use zero<=2 with pipeline parallelism")
    # batch
    if w.global_batch % (lay.dp * lay.micro_batch):
        out.append(f"global batch of {w.global_batch} sequences is not divisible by dp*micro_batch = "
                   f"{lay.dp}*{lay.micro_batch}")
    else:
        m = lay.microbatches(w)
        if lay.pp > 1 and m < lay.pp:
            out.append(f"{m} micro-batches < pp={lay.pp}: the pipeline never fills (need m >= pp)")
        if lay.pp_schedule == "interleaved" and lay.pp > 1 and m % lay.pp:
            out.append(f"interleaved schedule needs micro-batches m={m} to be a multiple of pp={lay.pp}")
    return out


def _dtype_key(precision: str) -> str:
    return {"fp32": "tf32"}.get(precision, precision)


def compute_dtype(precision: str) -> str:
    """Which peak the matmuls run at: fp32 training uses TF32 tensor cores."""
    return _dtype_key(precision)


@lru_cache(maxsize=1024)
def layers_per_chunk(cfg: ModelConfig, seq_len: int, pp: int, v: int = 1) -> tuple[int, ...]:
    """Decoder layers of each pipeline chunk (global stage order), exactly as the pipeline engine will
    partition them (`parallel/pipeline/stages.py`): equal chunks for interleaving, otherwise balanced by
    its cost estimate, in which the embedding and the LM head count like layers."""
    from pentatron.parallel.pipeline.stages import StageCosts, partition

    chunks = pp * v
    if chunks <= 1:
        return (cfg.n_layers,)
    if v > 1 or cfg.n_layers < chunks:
        base, extra = divmod(cfg.n_layers, chunks)  # only reached for layouts `problems` rejects, or even
        return tuple(base + (1 if i < extra else 0) for i in range(chunks))
    return tuple(len(r) for r in partition(cfg.n_layers, chunks, costs=StageCosts.of(cfg, seq_len)))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def nodes_spanned(size: int, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) for a group of `size` ranks `stride` apart in the global rank order."""
    if size <= 1:
        return 1, 1
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return per_node, math.ceil(size / per_node)
