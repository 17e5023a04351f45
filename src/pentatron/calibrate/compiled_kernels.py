"""Compiled (inductor) decoder layers as `train.compile` runs them, for `pentatron bench` on a CPU.

Compiling a decoder block changes two things the eager measurements (`cpu_kernels.py`, `bench.
measure_host_overhead`) price: the elementwise ops between the GEMMs fuse into a few kernels, and the
block's host work (op dispatch, autograd nodes) becomes one compiled call forward and one backward. What
that saves is measured as training meets it, not assembled from parts: priced from an elementwise chain
compiled and timed on its own (the earlier measurement), the planner's saving per layer was 1.5-1.7x the
whole compiled block's at 64 and 256 tokens (in a block the fused kernels also save activations for the
backward and recompute some of them there).

So `measure_compiled_saving` times the model's own decoder layers (the debug model's proportions), eager
and compiled by `parallel/compile.apply_compile` as training compiles them, interleaved (both see the
machine in the same seconds), forward and forward + backward, at TINY_TOKENS (the arithmetic negligible)
and at each of LAYER_TOKENS (a CPU run's micro-batch x sequence). A model of LAYERS layers is timed both
ways: its embedding, head and loss are the same eager code in each, so the difference per layer is what
compiling one layer saves. The profile states that saving in the planner's terms (`compiled_profile`):

* the compiled layer's host seconds: the eager layer's (bench.measure_host_overhead) less the saving at
  TINY_TOKENS;
* the compiled elementwise rate by operand size, in the bytes the planner charges fused kernels
  (`timing._elementwise_bytes(..., "fused")`, forward + 2x backward): the rate at which the planner's
  compiled layer costs its eager layer (the profile's eager elementwise curve) less the measured saving at
  that size. The planner then reproduces the measured saving at these shapes and scales it by bytes
  elsewhere.

Compiling costs seconds per shape (once: inductor caches its code across processes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from pentatron.calibrate.timers import sync
from pentatron.hardware.profile import interp_log

LAYER_TOKENS = (64, 256, 1024)  # rows per call: a CPU run's micro-batch x sequence
TINY_TOKENS = 4  # the host work's shape: arithmetic negligible
LAYERS = 6  # per model; the ends (embedding, head, loss) are the same eager code in both and cancel
MIN_ROUNDS = 5  # calls of each model and measurement at least (alternating); the fastest is kept
# a Llama block's proportions (the debug model's): hidden, query heads, kv heads, MLP width
LAYER_HIDDEN, LAYER_HEADS, LAYER_KV_HEADS, LAYER_FFN = 128, 4, 2, 256
# the compiled elementwise seconds kept from the eager ones at least and at most: bounds, not measurements
FUSED_FLOOR, FUSED_CEILING = 0.1, 2.0


def layer_config() -> Any:
    """The ModelConfig whose layers are timed (the planner's bytes are read for it)."""
    from pentatron.models.config import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=LAYER_HIDDEN, n_layers=LAYERS, n_heads=LAYER_HEADS,
                       n_kv_heads=LAYER_KV_HEADS, ffn_hidden_size=LAYER_FFN, max_seq_len=max(LAYER_TOKENS))


def elementwise_bytes_per_token(kernels: str) -> float:
    """Bytes per token the planner charges one layer's elementwise work, forward + backward (3x the
    forward's: backward ~2x), in fp32, with `kernels` ("eager" or "fused")."""
    from pentatron.plan.layout import Layout, Workload
    from pentatron.plan.timing import _elementwise_bytes  # the planner's own byte model, not a copy of it

    w = Workload(layer_config(), max(LAYER_TOKENS), max(LAYER_TOKENS))
    return 3 * _elementwise_bytes(w, Layout(dp=1, micro_batch=1, precision="fp32"), kernels)


def _fastest_calls(fns: list[Callable[[], Any]], seconds: float) -> list[float]:
    """The fastest single call of each of `fns`, called in turn (so that each sees the machine in the
    same seconds) until `seconds` are spent and at least MIN_ROUNDS times. Single calls, not a window's
    mean: this VM's calls jitter by ~5 %, more than compiling saves at these shapes."""
    best = [math.inf] * len(fns)
    end, rounds = time.perf_counter() + seconds, 0
    while rounds < MIN_ROUNDS or time.perf_counter() < end:
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
        rounds += 1
    return best


def _saving(tokens: int, device: torch.device, seconds: float) -> tuple[float, float]:
    """Seconds per layer that compiling saves at `tokens` rows (forward, backward): the eager model's time
    less the compiled one's, over LAYERS."""
    from pentatron.models.llama import Llama
    from pentatron.parallel.compile import apply_compile

    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    fns: list[Callable[[], Any]] = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Llama(layer_config()).to(device)
        if compiled:
            apply_compile(model, True, device)

        def fwd(model: torch.nn.Module = model) -> None:
            model(ids).detach()
            sync(device)

        def fwd_bwd(model: torch.nn.Module = model) -> None:
            model(ids).sum().backward()
            sync(device)

        fwd_bwd()  # compiles forward and backward before anything is timed
        fns += [fwd, fwd_bwd]
    ef, efb, cf, cfb = _fastest_calls(fns, seconds)
    return (ef - cf) / LAYERS, ((efb - ef) - (cfb - cf)) / LAYERS


def measure_compiled_saving(device: torch.device, seconds: float) -> dict[int, tuple[float, float]]:
    """{tokens: (forward, backward) seconds per layer compiling saves} at TINY_TOKENS and LAYER_TOKENS."""
    return {t: _saving(t, device, 10 * seconds) for t in (TINY_TOKENS, *LAYER_TOKENS)}


def compiled_profile(saving: dict[int, tuple[float, float]], host_layer: tuple[float, float],
                     stream_curve: list[tuple[int, float]]) -> dict[str, Any]:
    """The profile's compiled terms from the measured saving: "host" (the compiled layer's forward and
    backward host seconds) and "chain" [(operand bytes, B/s in the planner's fused bytes)]."""
    # the host work's saving, within [0, 90 %] of the eager host work (bounds: a compiled call is not free,
    # and one that costs more host time than eager ops is noise)
    host_saved = [min(max(s, 0.0), (1 - FUSED_FLOOR) * h) for s, h in zip(saving[TINY_TOKENS], host_layer, strict=True)]
    host = (host_layer[0] - host_saved[0], host_layer[1] - host_saved[1])
    eager_bytes, fused_bytes = elementwise_bytes_per_token("eager"), elementwise_bytes_per_token("fused")
    chain = []
    for t in LAYER_TOKENS:
        operand = t * LAYER_HIDDEN * 4
        eager_s = t * eager_bytes / interp_log(stream_curve, operand)  # as the planner prices it
        kernels_saved = sum(saving[t]) - sum(host_saved)  # the saving beyond the host work's
        fused_s = min(max(eager_s - kernels_saved, FUSED_FLOOR * eager_s), FUSED_CEILING * eager_s)
        chain.append((operand, t * fused_bytes / fused_s))
    return {"host": host, "chain": chain}


def measure_compiled(device: torch.device, seconds: float, host_layer: tuple[float, float],
                     stream_curve: list[tuple[int, float]]) -> dict[str, Any]:
    """`compiled_profile` of a measured saving, keyed as `BenchResult.compiled` stores it; empty (and one
    line on stderr) when inductor cannot compile here (no C++ compiler, say): the planner then prices
    fused kernels without it."""
    import sys

    from torch._dynamo.exc import TorchDynamoException

    try:
        return compiled_profile(measure_compiled_saving(device, seconds), host_layer, stream_curve)
    except (TorchDynamoException, RuntimeError, OSError) as e:
        print(f"pentatron bench: compiled kernels not measured: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              file=sys.stderr)
        return {}
