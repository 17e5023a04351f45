"""(d) Gradient scale bugs: a pipeline loss not divided by the number of micro-batches (gradient ×m),
and data-parallel gradients summed instead of averaged (×dp), the latter on real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

from pentatron.distributed.context import ParallelContext
from pentatron.lab.common import MarkovCorpus, Verdict, debug_model, grad_vector, lm_loss, save_plot
from pentatron.lab.ranks import RankGroup
from pentatron.layout import ParallelLayout


def _accumulated_norm(m: int, divide: bool) -> float:
    """Gradient norm after accumulating m micro-batches, as a pipeline schedule does (one backward each)."""
    model = debug_model()
    data = MarkovCorpus(seed=0)
    for _ in range(m):
        loss = lm_loss(model, *data.batch(2, 32))
        (loss / m if divide else loss).backward()
    return float(grad_vector(model).norm())


def _dp_worker(rank: int, world: int, out: str) -> None:
    ctx = ParallelContext.from_layout(ParallelLayout(dp=world), "cpu")
    model = debug_model()
    lm_loss(model, *MarkovCorpus(seed=rank).batch(2, 32)).backward()  # each rank its own data
    local = grad_vector(model).float()
    summed = local.clone()
    ctx.comm.all_reduce(summed, "dp")  # the bug: forgetting to divide by dp
    averaged = summed / ctx.dp_size
    if rank == 0:
        Path(out).write_text(json.dumps({"summed": float(summed.norm()), "averaged": float(averaged.norm()),
                                         "local": float(local.norm())}))


def grad_scale(out: Path, quick: bool) -> Verdict:
    ms = [1, 2, 4] if quick else [1, 2, 4, 8]
    ratios = [_accumulated_norm(m, divide=False) / _accumulated_norm(m, divide=True) for m in ms]
    dp = 2
    result = out / "lab_grad_scale_dp.json"
    result.unlink(missing_ok=True)
    group = RankGroup(_dp_worker, dp, out / "lab_grad_scale_ranks", args=(str(result),))
    codes = group.wait(timeout_s=300)
    if codes != [0] * dp or not result.exists():
        raise RuntimeError(f"data-parallel ranks failed: {group.failure(codes)}")
    d = json.loads(result.read_text())
    dp_ratio = d["summed"] / d["averaged"]
    plot = save_plot(out / "lab_grad_scale.png", "gradient norm with the bug / without", [
        {"title": "loss not divided by m (pipeline)", "xlabel": "micro-batches m", "ylabel": "norm ratio",
         "logx": True, "series": {"measured": (ms, ratios), "expected: = m": (ms, [float(m) for m in ms])},
         "expected": ["expected: = m"]},
        {"kind": "bar", "title": f"dp={dp} gradients summed, not averaged", "ylabel": "gradient norm",
         "categories": ["rank 0's own", "summed over dp (the bug)", "averaged over dp"],
         "series": {"‖g‖": [d["local"], d["summed"], d["averaged"]]}}])
    reproduced = all(abs(r - m) < 1e-3 * m for r, m in zip(ratios, ms)) and abs(dp_ratio - dp) < 1e-3 * dp
    text = (f"gradient norm without ÷m over norm with it, for m={ms}: {', '.join(f'{r:.4f}' for r in ratios)} "
            f"(= m); dp={dp} real gloo ranks, all-reduce sum vs average: {d['summed']:.4f} / {d['averaged']:.4f}"
            f" = {dp_ratio:.4f} (= dp). With clipping or SGD this multiplies the step; Adam mostly normalises it "
            "away, so the bug hides until clipping or a change of m/dp alters the dynamics")
    return Verdict("grad-scale", reproduced, text, {"m": ms, "m_ratios": ratios, "dp": dp, "dp_ratio": dp_ratio},
                   plot)
