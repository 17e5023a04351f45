"""Compiled blocks (`train.compile`, parallel/compile.py) train as the plain single-process loop does.

One 2-rank launch runs every 2-rank case in sequence (compiling dominates on the 2-core CI machine, and the
inductor cache lets later cases reuse kernels of earlier ones): dp2 with ZeRO-0 (the MoE case), ZeRO-1 and
ZeRO-2 without recompute and ZeRO-3 with full recompute, tp2 sp, pp2 1F1B with selective recompute, pp2
interleaved (2 virtual stages), pp2 zero-bubble (split backward), cp2 ring, cp2 Ulysses, MoE ep2. Hybrid cp
needs cp=4, so a second launch of 4 ranks runs it (Ulysses 2 × ring 2) at twice the sequence, which gives each
rank the 16 tokens of the cp2 cases: the same region shapes, so it compiles nothing the cache lacks; with half
the global batch (2 micro-batches a step), as its 4 processes cost twice a 2-rank case's.
Each trains 4 steps through the real `Trainer` and must match the reference (`tests/reference_loop.py`,
the MoE one for ep) in the loss and gradient norm of every step, in float64 on both sides (inductor's CPU
code keeps double), to `EXACT_RTOL` (1e-10). Every region must have a compiled graph in
dynamo's cache (a case with an earlier case's code and shapes reuses its graphs and builds none), steps 3..4
must compile nothing (dynamo's graph count after step 2 stays), and where collectives run inside a block (tp,
cp2) the comm ledger's calls of a compiled step equal an eager step's: the collectives stay visible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pentatron.config import load_config
from tests.multiprocess import run_ranks
from tests.parallel.moe_reference import moe_reference_run
from tests.reference_loop import EXACT_RTOL, FP64, reference_run
from tests.strict_comm import strict_comm_fixture

strict_comm = strict_comm_fixture("module")  # NCCL's ordering and device rules on gloo

STEPS, SEQ, MICRO, GLOBAL, LR, EPS, WARMUP = 4, 32, 2, 8, 1e-3, 1e-4, 2
MOE = "model.name='debug-moe'"
CASES: dict[str, list[str]] = {
    "dp2 zero1": ["parallel.dp=2", "parallel.zero=1"],  # recompute none (the default)
    "dp2 zero2": ["parallel.dp=2", "parallel.zero=2"],
    "dp2 zero3 full recompute": ["parallel.dp=2", "parallel.zero=3", "train.recompute=full"],
    "tp2 sp": ["parallel.dp=1", "parallel.tp=2", "parallel.sp=true"],
    "pp2 1f1b selective": ["parallel.dp=1", "parallel.pp=2", "train.recompute=selective"],
    "pp2 interleaved v2": ["parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule=interleaved",
                           "parallel.pp_virtual=2"],
    "pp2 zb": ["parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule=zb"],
    "cp2 ring": ["parallel.dp=1", "parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2 ulysses": ["parallel.dp=1", "parallel.cp=2", "parallel.cp_mode=ulysses"],
    "ep2 moe": ["parallel.dp=2", "parallel.ep=2", MOE],  # ZeRO-0
}
HYBRID_SEQ, HYBRID_GLOBAL = 2 * SEQ, GLOBAL // 2  # 16 tokens per rank, as in the cp2 cases
HYBRID: dict[str, list[str]] = {
    "cp4 hybrid u2": ["parallel.dp=1", "parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2",
                      f"train.seq_len={HYBRID_SEQ}", f"train.global_batch={HYBRID_GLOBAL}"],
}
# collectives inside the blocks: the ledger of a compiled step must equal an eager one's (hybrid's all-to-all
# and ring are the ones the cp2 cases check)
LEDGER_CASES = ("tp2 sp", "cp2 ring", "cp2 ulysses")


def _train(extra: list[str], dataset_dir: Path, log_dir: str, steps: int, compile_: bool, world: int
           ) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    cfg = load_config(None, [f"train.steps={steps}", f"train.seq_len={SEQ}", f"train.micro_batch={MICRO}",
                             f"train.global_batch={GLOBAL}", f"train.lr={LR}", f"train.eps={EPS}",
                             f"train.warmup={WARMUP}", "train.schedule='cosine'", "train.clip=1.0",
                             f"train.compile={'true' if compile_ else 'false'}", "train.peak_tflops=1.0",
                             "log.progress=false", "log.tensorboard=false", f"log.dir={log_dir!r}",
                             "distributed.timeout_s=1500", *extra],  # a cold compile on a loaded CI box is slow
                      world_size=world)
    trainer = Trainer(cfg, dataset_dir=dataset_dir)
    report = trainer.runner.compiled
    out: dict[str, Any] = {"losses": [], "norms": [], "calls": [], "graphs": []}
    for _ in range(steps):
        record = trainer.train_step()
        out["losses"].append(record["loss"])
        out["norms"].append(record["grad_norm"])
        out["calls"].append(record["comm_calls"])
        out["graphs"].append(report.graphs() if report is not None else 0)
    if report is not None:
        out["regions"], out["compile_s"] = list(report.regions), report.seconds()
        out["uncompiled"] = _uncompiled(trainer.runner.model)
    trainer.engine.close()
    return out


def _uncompiled(model: Any) -> list[str]:
    """Regions whose code has no compiled graph in dynamo's cache. A case whose regions all match an earlier
    case's code and shapes builds no graph of its own (the cache's guards pass): it runs the earlier graphs."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from pentatron.parallel.compile import _Region

    regions = [v for m in model.modules() for v in vars(m).values() if isinstance(v, _Region)]
    return [r.name for r in regions if not _debug_get_cache_entry_list(r.eager.__code__)]


def _ranks(rank: int, world: int, dataset_dir: Path, log_dir: str, cases: dict[str, list[str]]
           ) -> dict[str, dict[str, Any]]:
    out = {label: _train([*extra, FP64], dataset_dir, log_dir, STEPS, True, world) for label, extra in cases.items()}
    for label in LEDGER_CASES:
        if label in cases:
            out[f"{label} eager"] = _train([*cases[label], FP64], dataset_dir, log_dir, WARMUP + 1, False, world)
    return out


def test_compiled_blocks_equal_the_plain_loop(default_dataset, tmp_path):
    runs = run_ranks(_ranks, 2, args=(default_dataset, str(tmp_path), CASES), timeout=1500)
    hybrid = run_ranks(_ranks, 4, args=(default_dataset, str(tmp_path), HYBRID), timeout=1500)
    common = dict(steps=STEPS, lr=LR, eps=EPS, warmup=WARMUP)
    dense = reference_run(default_dataset, model="debug", seq_len=SEQ, global_batch=GLOBAL, dtype=torch.float64,
                          **common)
    dense_long = reference_run(default_dataset, model="debug", seq_len=HYBRID_SEQ, global_batch=HYBRID_GLOBAL,
                               dtype=torch.float64, **common)
    moe = moe_reference_run(default_dataset, model="debug-moe", micro_batch=MICRO, seq_len=SEQ, global_batch=GLOBAL,
                            dtype=torch.float64, **common)
    worst: dict[str, float] = {}
    for cases, results in ((CASES, runs), (HYBRID, hybrid)):
        for label, extra in cases.items():
            ref = moe if MOE in extra else dense_long if label in HYBRID else dense
            for rank, res in enumerate(results):
                got = res[label]
                assert got["regions"], f"{label}: nothing compiled"
                for key in ("losses", "norms"):
                    np.testing.assert_allclose(got[key], ref[key], rtol=EXACT_RTOL,
                                               err_msg=f"{label} rank {rank}: {key}")
                    err = np.abs(np.subtract(got[key], ref[key])) / np.abs(ref[key])
                    worst[label] = max(worst.get(label, 0.0), float(np.max(err)))
                assert not got["uncompiled"], f"{label} rank {rank}: no compiled graph for {got['uncompiled']}"
                assert got["graphs"][-1] == got["graphs"][1], \
                    f"{label} rank {rank}: graphs compiled after each step {got['graphs']} (recompiled after step 2)"
                if label == next(iter(cases)):  # the launch's first case compiles (later ones may reuse its graphs)
                    assert got["graphs"][1] > 0, f"{label} rank {rank}: no graph compiled"
                if label in LEDGER_CASES:
                    assert got["calls"][0] == res[f"{label} eager"]["calls"][0], f"{label}: the ledger lost collectives"
    graphs = {label: res[label]["graphs"][-1] for res in (runs[0], hybrid[0]) for label in res if label in worst}
    print("compiled vs reference, max relative loss/grad-norm error (rank 0's new graphs): "
          + ", ".join(f"{label} {e:.1e} ({graphs[label]})" for label, e in worst.items()))
