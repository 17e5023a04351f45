"""Device→host synchronisations per optimizer step stay within a fixed budget, whatever the layout.

On real gloo ranks, a few steps of the debug models through the step runner — `forward_backward`, `clip_grads`,
`step` and the one read of the loss and the norm the trainer makes (`host_scalars`) — under `SyncCounter`
(tests/parallel/sync_counter.py: Pentatron's own `.item()`, `.tolist()`, `.cpu()`, `float(t)`, `int(t)`,
`bool(t)`, `.to("cpu")` and data-dependent ops). Budget per step:
- dense: 2 (loss and norm);
- MoE: 2 + one per MoE layer of this rank per micro-batch (the split sizes an expert grouping / the uneven
  all-to-all needs on the host) + 1 (the step's load statistics, for the metrics).
One 2-rank launch runs every layout in sequence. CPU ranks cannot show a GPU stall; the count is the proxy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pentatron.config import load_config
from tests.multiprocess import run_ranks
from tests.parallel.sync_counter import SyncCounter

STEPS, SEQ, MICRO, GLOBAL = 2, 16, 2, 8

LAYOUTS: dict[str, list[str]] = {
    "dense pp2": ["parallel.pp=2"],
    "dense tp2": ["parallel.tp=2"],
    "dense dp2 zero1": ["parallel.dp=2", "parallel.zero=1"],
    "dense dp2 zero3": ["parallel.dp=2", "parallel.zero=3"],
    "moe ep2": ["model.name='debug-moe'", "parallel.dp=2", "parallel.ep=2"],
    "moe ep2 capacity": ["model.name='debug-moe'", "parallel.dp=2", "parallel.ep=2", "moe.capacity_factor=1.0"],
    "moe pp2": ["model.name='debug-moe'", "parallel.pp=2"],
    "moe tp2": ["model.name='debug-moe'", "parallel.tp=2"],
    "moe tp2 sp capacity": ["model.name='debug-moe'", "parallel.tp=2", "parallel.sp=true", "moe.capacity_factor=1.0"],
    "moe cp2 aux-free": ["model.name='debug-moe-auxfree'", "parallel.dp=1", "parallel.cp=2"],
    "moe cp2 ulysses capacity": ["model.name='debug-moe'", "parallel.dp=1", "parallel.cp=2",
                                 "parallel.cp_mode='ulysses'", "moe.capacity_factor=1.0"],
}


def _count_steps(rank: int, world: int, dataset_dir: Path, log_dir: str) -> dict[str, dict[str, Any]]:
    from pentatron.models.moe import moe_layers
    from pentatron.train.trainer import Trainer

    try:
        from pentatron.parallel.step_runner import host_scalars
    except ImportError:  # the code before this test: the trainer read float(loss) and float(norm) twice each
        host_scalars = None
    out = {}
    for label, extra in LAYOUTS.items():
        cfg = load_config(None, [f"train.steps={STEPS}", f"train.seq_len={SEQ}", f"train.micro_batch={MICRO}",
                                 f"train.global_batch={GLOBAL}", "train.warmup=1", "train.clip=1.0",
                                 "parallel.bucket_mb=0.25", "log.progress=false", "log.tensorboard=false",
                                 f"log.dir={log_dir!r}",
                                 *extra], world_size=world)
        trainer = Trainer(cfg, dataset_dir=dataset_dir)
        runner = trainer.runner
        steps = []
        for _ in range(STEPS):
            batches = trainer.loader.next_step()
            with SyncCounter() as c:
                loss = runner.forward_backward(batches)
                norm = runner.clip_grads(cfg.train.clip)
                runner.step(1e-3)
                if host_scalars is not None:
                    loss_f, norm_f = host_scalars(loss, norm)
                else:
                    c.sites["train/trainer.py float(loss), float(norm) twice each"] += 4
            steps.append({"total": c.total, "sites": dict(c.sites)})
        out[label] = {"steps": steps, "micro_batches": len(batches), "moe_layers": len(moe_layers(runner.model))}
        trainer.engine.close()
    return out


@pytest.fixture(scope="module")
def counts(default_dataset, tmp_path_factory) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_count_steps, 2, args=(default_dataset, str(tmp_path_factory.mktemp("syncs"))), timeout=600)


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_syncs_per_step_within_budget(counts, label) -> None:
    for rank, res in enumerate(counts):
        r = res[label]
        budget = 2 + (r["moe_layers"] * r["micro_batches"] + 1 if r["moe_layers"] else 0)
        for step, s in enumerate(r["steps"], 1):
            assert s["total"] <= budget, f"{label} rank {rank} step {step}: {s['total']} > {budget}: {s['sites']}"
        if label.startswith("moe"):
            assert r["moe_layers"] > 0, label


def table(results: list[dict[str, dict[str, Any]]]) -> str:
    """Markdown: layout, micro-batches, MoE layers per rank, syncs per step (max over ranks and steps)."""
    lines = ["| layout | m | MoE layers / rank | syncs / step | budget |", "|---|---|---|---|---|"]
    for label in LAYOUTS:
        per_rank = [res[label] for res in results]
        worst = max(s["total"] for r in per_rank for s in r["steps"])
        layers = max(r["moe_layers"] for r in per_rank)
        m = per_rank[0]["micro_batches"]
        budget = 2 + (layers * m + 1 if layers else 0)
        lines.append(f"| {label} | {m} | {layers} | {worst} | {budget} |")
    return "\n".join(lines)


if __name__ == "__main__":  # the BENCHMARKS.md table: python -m tests.parallel.test_host_syncs
    import json
    import sys
    import tempfile

    from pentatron.data.tokenize import ensure_default_dataset
    from tests.conftest import SMALL_CORPUS_BYTES

    with tempfile.TemporaryDirectory() as tmp:
        data = ensure_default_dataset(Path(tmp) / "data", vocab_size=4096, max_bytes=SMALL_CORPUS_BYTES,
                                      progress=False)
        results = run_ranks(_count_steps, 2, args=(data, tmp), timeout=600)
    print(table(results))
    if "--sites" in sys.argv:
        print(json.dumps({label: results[0][label]["steps"][-1]["sites"] for label in LAYOUTS}, indent=1))


def test_the_counter_sees_our_syncs_and_not_torchs() -> None:
    """The proxy itself: a sync in Pentatron's code counts once, with its site; torch's own and the
    test's do not; `host_scalars` reads two numbers with one copy; the patches are undone."""
    from pentatron.models.moe import dispatch_order
    from pentatron.parallel.step_runner import host_scalars

    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    counts = torch.bincount(experts.flatten(), minlength=4)
    with SyncCounter() as c:
        dispatch_order(experts, weights, counts, cap=2)  # reads the kept count on the host: int(t)
        float(torch.ones(()))  # the test's own: not counted
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()  # torch reads its step counter with .item(): not ours
    assert c.total == 1 and [k.split()[-1] for k in c.sites] == ["__int__"], c.sites
    assert next(iter(c.sites)).startswith("models/moe.py:")
    with SyncCounter() as c:
        assert host_scalars(torch.tensor(2.5), torch.tensor(0.5, dtype=torch.float64)) == [2.5, 0.5]
    assert c.total == 1
    assert "__getitem__" not in vars(torch.Tensor) and torch.Tensor.tolist is torch._C.TensorBase.tolist
