"""Compiled (inductor) kernels as `train.compile` runs them, for `pentatron bench` on a CPU.

Compiling a decoder block changes two things the eager measurements (`cpu_kernels.py`, `bench.
measure_host_overhead`) price: the elementwise ops between the GEMMs fuse into a few kernels, and the
block's host work (op dispatch, autograd nodes) becomes one compiled call forward and one backward. So
bench measures both, each the way its eager counterpart is measured:

* `measure_fused_chain`: a block's elementwise chain (both RMSNorms, RoPE on q and k, SwiGLU's
  silu(gate)·up, both residual adds; the model's own code) compiled as one region, forward + backward,
  by token count. Its rate is stated in the bytes the planner charges for fused kernels
  (`timing._elementwise_bytes(..., "fused")`, forward + 2x backward), so the planner reproduces the
  measured seconds at these shapes and scales them by bytes elsewhere. The chain's own per-call cost
  (timed on a tiny shape) comes off: the compiled layer's host term below carries it.
* `measure_compiled_host`: host seconds per compiled decoder layer, as `measure_host_overhead` measures
  the eager one (a tiny Llama at 2 and 6 layers, the difference per layer, less the tiny attention call),
  with every block compiled by `parallel/compile.apply_compile` as training compiles it.

Compiling costs seconds per shape (once: inductor caches its code across processes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pentatron.calibrate.cpu_kernels import POOL_BYTES, _windows
from pentatron.calibrate.timers import ATTEMPTS

CHAIN_TOKENS = (64, 256, 1024)  # rows per call: a CPU run's micro-batch x sequence
TINY_TOKENS = 4  # the per-call cost's shape: arithmetic negligible
# a Llama block's proportions (the debug model's): hidden, query heads, kv heads, head dim, MLP width
CHAIN_HIDDEN, CHAIN_HEADS, CHAIN_KV_HEADS, CHAIN_HEAD_DIM, CHAIN_FFN = 128, 4, 2, 32, 256


def chain_config() -> Any:
    """The ModelConfig whose block the chain is (the planner's fused bytes are read for it)."""
    from pentatron.models.config import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=CHAIN_HIDDEN, n_layers=1, n_heads=CHAIN_HEADS,
                       n_kv_heads=CHAIN_KV_HEADS, ffn_hidden_size=CHAIN_FFN, max_seq_len=max(CHAIN_TOKENS))


def chain_bytes_per_token() -> float:
    """Bytes per token the planner charges one fused layer's elementwise work, forward + backward (3x
    the forward's: backward ~2x), in fp32: what a measured second of the chain is worth."""
    from pentatron.plan.layout import Layout, Workload
    from pentatron.plan.timing import _elementwise_bytes  # the planner's own byte model, not a copy of it

    w = Workload(chain_config(), max(CHAIN_TOKENS), max(CHAIN_TOKENS))
    return 3 * _elementwise_bytes(w, Layout(dp=1, micro_batch=1, precision="fp32"), "fused")


def _chain() -> Callable[..., tuple[torch.Tensor, ...]]:
    """The elementwise chain of one block, the model's code between its GEMMs."""
    from pentatron.models.llama import RMSNorm, apply_rope

    norm1, norm2 = RMSNorm(CHAIN_HIDDEN, 1e-5), RMSNorm(CHAIN_HIDDEN, 1e-5)

    def chain(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor,
              up: torch.Tensor, mlp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
        h = x + attn  # the attention's residual
        return norm1(x), apply_rope(q, cos, sin), apply_rope(k, cos, sin), norm2(h), F.silu(gate) * up, h + mlp

    return chain


def _chain_seconds(tokens: int, device: torch.device, seconds: float) -> float:
    """Seconds of one compiled chain's forward + backward on `tokens` rows; inputs rotate through sets
    spanning POOL_BYTES (a step's activations are out of the caches)."""
    chain = torch.compile(_chain(), fullgraph=True, dynamic=False)
    shapes = [(1, tokens, CHAIN_HIDDEN), (1, tokens, CHAIN_HEADS, CHAIN_HEAD_DIM),
              (1, tokens, CHAIN_KV_HEADS, CHAIN_HEAD_DIM), (1, tokens, CHAIN_HIDDEN), (1, tokens, CHAIN_FFN),
              (1, tokens, CHAIN_FFN), (1, tokens, CHAIN_HIDDEN)]
    per_set = 4 * sum(math.prod(s) for s in shapes)
    sets = [[torch.empty(s, device=device).uniform_(-1, 1).requires_grad_() for s in shapes]
            for _ in range(max(2, min(64, POOL_BYTES // per_set)))]
    angles = torch.arange(tokens, device=device, dtype=torch.float32)[:, None] * torch.linspace(
        0, 1, CHAIN_HEAD_DIM, device=device)
    cos, sin = angles.cos(), angles.sin()

    def call(i: int) -> None:
        leaves = sets[i % len(sets)]
        outs = chain(*leaves, cos, sin)
        torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])

    return _windows(call, seconds, min_iters=3)


def measure_fused_chain(device: torch.device, seconds: float) -> list[tuple[int, float]]:
    """[(bytes of one hidden-sized operand, bytes/s in the planner's fused bytes)] of the compiled chain,
    its tiny-shape per-call cost taken off (at least a tenth of each time is kept: a floor, not a
    measurement)."""
    tiny = _chain_seconds(TINY_TOKENS, device, seconds)
    per_token = chain_bytes_per_token()
    out = []
    for t in CHAIN_TOKENS:
        s = _chain_seconds(t, device, seconds)
        out.append((t * CHAIN_HIDDEN * 4, t * per_token / max(s - tiny, s / 10)))
    return out


def measure_compiled_host(device: torch.device, seconds: float, tiny_attention: tuple[float, float]
                          ) -> tuple[float, float]:
    """Host seconds per compiled decoder layer (forward, backward), as `bench.measure_host_overhead`
    measures the eager layer's, less `tiny_attention` (its model's attention call, charged at the run's
    shape from the attention grid)."""
    from pentatron.calibrate.timers import best_of
    from pentatron.models.config import ModelConfig
    from pentatron.models.llama import Llama
    from pentatron.parallel.compile import apply_compile

    def run(n_layers: int) -> tuple[float, float]:
        cfg = ModelConfig(vocab_size=64, hidden_size=64, n_layers=n_layers, n_heads=2, n_kv_heads=1,
                          ffn_hidden_size=128, max_seq_len=16)
        model = Llama(cfg).to(device)
        apply_compile(model, True, device)
        tokens = torch.zeros(1, 4, dtype=torch.long, device=device)

        def fwd() -> torch.Tensor:
            return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

        fwd().backward()  # compiles forward and backward before anything is timed
        t_f = best_of(lambda: fwd().detach(), device, 3 * seconds, min_iters=10)
        t_fb = best_of(lambda: fwd().backward(), device, 3 * seconds, min_iters=10)
        return t_f, t_fb - t_f

    af, ab = tiny_attention
    for _ in range(ATTEMPTS):  # a term ≤ 0 is noise (another process took the core): measured again
        (f2, b2), (f6, b6) = run(2), run(6)
        terms = (f6 - f2) / 4 - af, (b6 - b2) / 4 - ab
        if min(terms) > 0:
            break
    return max(0.0, terms[0]), max(0.0, terms[1])


def measure_compiled(device: torch.device, seconds: float, tiny_attention: tuple[float, float]) -> dict[str, Any]:
    """Both measurements, keyed as `BenchResult.compiled` stores them; empty (and one line on stderr) when
    inductor cannot compile here (no C++ compiler, say): the planner then prices fused kernels without them."""
    import sys

    from torch._dynamo.exc import TorchDynamoException

    try:
        return {"host": measure_compiled_host(device, seconds, tiny_attention),
                "chain": measure_fused_chain(device, 3 * seconds)}
    except (TorchDynamoException, RuntimeError, OSError) as e:
        print(f"pentatron bench: compiled kernels not measured: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              file=sys.stderr)
        return {}
