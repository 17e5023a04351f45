"""Where one training step's CPU time goes: torch.profiler's op events, bucketed (compile_speed.py --profile).

Each op event's *self* time goes to one bucket, chosen from the event and its callers (nearest first):

  gemm         mm / addmm / bmm / linear / matmul, forward and backward, of the decoder blocks
  gemm-head    the same inside the loss (the LM head's matmuls: Pentatron's chunked loss or HF's logits)
  attention    scaled_dot_product_attention's kernels, forward and backward
  elementwise  every other ATen op of forward/backward: norms, RoPE, SwiGLU, residual adds, casts, embedding
  loss         the loss's non-GEMM work (softmax statistics, exp, gather; HF's log_softmax / nll_loss)
  optimizer    gradient clipping and the AdamW step
  grads        zeroing and accumulating the gradients (AccumulateGrad and its hooks)
  compiled     inductor's generated kernels (self time of a compiled graph's call): fused elementwise work
  overhead     autograd engine, dispatch and Python between ops (self time of non-ATen events)

GEMMs and attention are library kernels that compile does not make faster, so the rest of the step bounds
what compiling can win (Amdahl): with a share `r` of the step in those buckets, removing everything else
gives at most 1/r.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch.profiler import ProfilerActivity, profile

BUCKETS = ("gemm", "gemm-head", "attention", "elementwise", "loss", "optimizer", "grads", "compiled", "overhead")
LIBRARY = ("gemm", "gemm-head", "attention")  # what compile leaves as it is
GEMM = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}
HF_LOSS = ("aten::cross_entropy", "aten::log_softmax", "aten::_log_softmax", "aten::nll_loss", "LogSoftmaxBackward",
           "NllLossBackward")
# The phases that benchmarks label with record_function, and the names torch gives its optimizer and our loss.
OPTIMIZER = ("optimizer", "clip", "Optimizer.")
LOSS = ("linear_cross_entropy", "_LinearCrossEntropy")


def _bucket(chain: list[str]) -> str:
    """chain: the event's name, then its callers' (nearest first)."""
    if any(n.startswith(OPTIMIZER) for n in chain):
        return "optimizer"
    in_loss = any(n.startswith(LOSS) or any(k in n for k in HF_LOSS) for n in chain)
    for n in chain:
        if n in GEMM:
            return "gemm-head" if in_loss else "gemm"
        if "scaled_dot_product" in n or "flash_attention" in n:
            return "attention"
        if "AccumulateGrad" in n:
            return "grads"
        if "CompiledFxGraph" in n:
            return "compiled"
    if in_loss:
        return "loss"
    name = chain[0]
    if name.startswith("aten::"):
        # an ATen op called outside autograd and any other op: the gradient buffer's zeroing
        return "grads" if name in ("aten::zero_", "aten::fill_") and len(chain) <= 3 else "elementwise"
    return "overhead"


def _buckets(prof: profile) -> dict[str, float]:
    out = dict.fromkeys(BUCKETS, 0.0)
    for ev in prof.events():
        chain, e = [], ev
        while e is not None:
            chain.append(e.name)
            e = e.cpu_parent
        out[_bucket(chain)] += ev.self_cpu_time_total / 1e6
    return out


def profile_steps(steps: Sequence[Callable[[], None]]) -> dict[str, float]:
    """Run each of `steps` under the CPU profiler and return the seconds per bucket of the fastest one: self
    times are wall times, so a step the machine's other users preempted less is the truer split. The buckets
    add up to the profiled time of the step's events on the main thread."""
    best: dict[str, float] | None = None
    for step in steps:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        got = _buckets(prof)
        if best is None or sum(got.values()) < sum(best.values()):
            best = got
    assert best is not None, "no step to profile"
    return best


def table(rows: dict[str, dict[str, float]]) -> str:
    """Seconds and shares per bucket for each profiled loop, and the Amdahl bound 1 / (library share)."""
    names = list(rows)
    lines = [f"{'bucket':<12}" + "".join(f" {n:>26}" for n in names)]
    totals = {n: sum(rows[n].values()) or 1.0 for n in names}
    for b in BUCKETS:
        if any(rows[n][b] for n in names):
            lines.append(f"{b:<12}" + "".join(
                f" {rows[n][b] * 1e3:>14.1f} ms {100 * rows[n][b] / totals[n]:>6.1f}%" for n in names))
    lines.append(f"{'total':<12}" + "".join(f" {totals[n] * 1e3:>14.1f} ms {100.0:>6.1f}%" for n in names))
    lib = {n: sum(rows[n][b] for b in LIBRARY) / totals[n] for n in names}
    lines.append(f"{'ceiling':<12}" + "".join(f" {1 / lib[n]:>24.2f}x" for n in names))
    return "\n".join(lines)
