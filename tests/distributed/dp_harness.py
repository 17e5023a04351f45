"""Shared multi-process runs for the data-parallel / ZeRO tests.

Starting gloo ranks is the expensive part on the 2-core CI machine, so one `run_ranks` call per world
size runs every configuration in sequence inside the ranks (ZeRO 0–3 × with/without gradient
accumulation, plus the overlap probes, checkpoint round trips and bf16 memory accounting) and the
results are cached for the whole test run (shared by the xdist workers: tests/shared_runs.py); test_data.py
and test_zero.py read them.

The runs train in float64 (`train.precision='fp64'`: parameters, gradients, optimizer state and the
collectives) and are compared with the plain-loop reference (`tests/reference_loop.py`, which shares no
code with the parallel runtime) also in float64, to `EXACT_RTOL` (1e-10): rounding sits near 1e-15 on any
CPU, a real defect at 1e-6 or more. Element sizes in the byte and memory formulas are therefore 8.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pentatron.config import Config, load_config
from tests.multiprocess import run_ranks
from tests.reference_loop import EXACT_RTOL, FP64, reference_run
from tests.shared_runs import shared

STEPS = 4  # exact (float64) parity: a defect shows from the first steps (docs/testing.md)
SEQ_LEN = 32
GLOBAL_BATCH = 8
BUCKET_MB = 1.0  # several buckets for the 1.1M-parameter debug model (the default 25 MB would be one)
STAGES = (0, 1, 2, 3)
ELEMENT_BYTES = 8  # fp64 parameters, gradients and collectives
# lr and eps: the TrainConfig defaults these runs keep, which the plain-loop reference must be given too;
# 2 warmup steps, then the cosine decay
LR, EPS, WARMUP = 3e-3, 1e-8, 2


def micro_batch(world: int, accumulate: bool) -> int:
    """Per-rank micro-batch: the whole local batch at once, or two micro-steps of half of it."""
    local = GLOBAL_BATCH // world
    return local // 2 if accumulate else local


def make_config(world: int, zero: int = 0, micro: int = GLOBAL_BATCH, *extra: str) -> Config:
    overrides = [f"train.seq_len={SEQ_LEN}", f"train.global_batch={GLOBAL_BATCH}", f"train.micro_batch={micro}",
                 f"train.steps={STEPS}", f"train.warmup={WARMUP}", "train.peak_tflops=1.0", f"parallel.zero={zero}",
                 f"parallel.bucket_mb={BUCKET_MB}", "log.progress=false", "log.tensorboard=false", FP64, *extra]
    return load_config(None, overrides, world_size=world)


def _train(cfg: Config, dataset: str, want_params: bool) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    trainer = Trainer(cfg, dataset_dir=Path(dataset))
    memory_before = trainer.runner.memory().to_dict()
    records = [trainer.train_step()]
    grads = trainer.runner.full_gradients()  # step 1, after clipping (a collective: every rank calls it)
    records += [trainer.train_step() for _ in range(cfg.train.steps - 1)]
    params = trainer.engine.full_parameters()
    digest = float(sum(p.double().sum() * (i + 1) for i, p in enumerate(params.values())))
    trainer.engine.close()
    return {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records],
            "comm": trainer.last_comm.by_dim, "calls": records[-1]["comm_calls"],
            "memory": trainer.runner.memory().to_dict(), "memory_before": memory_before,
            "numel": trainer.engine.layout.total, "n_params": trainer.n_params, "digest": digest,
            # numpy, not tensors: tensors would cross the result queue as shared memory that dies with the rank
            "params": {n: p.numpy() for n, p in params.items()} if want_params else None,
            "grads": {n: g.numpy() for n, g in grads.items()} if want_params else None}


def _overlap_probe(world: int, dataset: str) -> dict[str, Any]:
    """DDP: no communication during an accumulation micro-step; on the last one, how many bucket
    all-reduces were issued by the time backward reaches the embedding (its last module)."""
    from pentatron.train.trainer import Trainer

    trainer = Trainer(make_config(world, 0, micro_batch(world, True), "parallel.bucket_mb=0.5"),
                      dataset_dir=Path(dataset))
    engine, ledger = trainer.engine, trainer.comm.ledger
    (x1, y1), (x2, y2) = trainer.loader.next_step()
    ledger.begin_step()
    engine.zero_grad()
    engine.before_backward(0, last=False)
    trainer.runner.loss_fn(trainer.model(x1), y1).backward()
    during_accumulation = len(ledger.events)
    engine.before_backward(0, last=True)
    seen: dict[str, list[str]] = {}

    def snapshot(grad: torch.Tensor) -> None:
        seen.setdefault("ops", [e.op for e in ledger.events])

    def at_embedding(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(snapshot)

    handle = trainer.model.embed.register_forward_hook(at_embedding)
    trainer.runner.loss_fn(trainer.model(x2), y2).backward()
    handle.remove()
    issued_by_end_of_backward = len(ledger.events)
    engine.finish_grad_sync()
    engine.close()
    return {"during_accumulation": during_accumulation, "before_embedding_backward": seen["ops"],
            "by_end_of_backward": issued_by_end_of_backward, "buckets": len(engine.layout.buckets)}


def _prefetch_probe(world: int, dataset: str) -> dict[str, Any]:
    """ZeRO-3: when layers[1] starts computing, which all-gathers have been issued and which units are
    held (our hooks were registered first, so they have already run)."""
    from pentatron.train.trainer import Trainer

    trainer = Trainer(make_config(world, 3, micro_batch(world, False)), dataset_dir=Path(dataset))
    engine, ledger = trainer.engine, trainer.comm.ledger
    (x, y), = trainer.loader.next_step()
    seen: dict[str, Any] = {}

    def held() -> int:  # gathered units, counted on the parameters' real storages (one per unit)
        return len({p.data.untyped_storage().data_ptr() for p in trainer.model.parameters() if p.data.numel()})

    def before_layer1(module: torch.nn.Module, args: Any) -> None:
        seen["all_gathers"] = sum(e.op == "all_gather" for e in ledger.events)
        seen["held"] = held()
        seen["param_numel"] = trainer.model.layers[1].mlp.up_proj.weight.numel()
        seen["later_layer_numel"] = trainer.model.layers[3].mlp.up_proj.weight.numel()

    handle = trainer.model.layers[1].register_forward_pre_hook(before_layer1)
    ledger.begin_step()
    engine.zero_grad()
    engine.before_backward(0, last=True)
    trainer.runner.loss_fn(trainer.model(x), y).backward()
    handle.remove()
    seen["held_after_backward"] = held()
    engine.finish_grad_sync()
    seen["units"] = len(engine.units)
    engine.close()
    return seen


def _param_gather_probe(world: int, dataset: str, zero: int) -> dict[str, Any]:
    """ZeRO-1/2 overlapped parameter gather: over two steps of two micro-batches, the order of the gather
    buckets' issues and waits (the engine's events) and of every top-level module's forward pre-hook
    (registered after the engine's, so a wait in a module's hook comes before that module's entry)."""
    from pentatron.parallel.zero import _hook_modules
    from pentatron.train.trainer import Trainer

    trainer = Trainer(make_config(world, zero, micro_batch(world, True), "parallel.bucket_mb=0.25"),
                      dataset_dir=Path(dataset))
    engine = trainer.engine
    events: list[tuple[str, Any]] = []
    engine.on_gather_event = lambda kind, g: events.append((kind, g))
    names = {id(m): n for n, m in trainer.model.named_modules()}
    modules = _hook_modules(trainer.model)
    handles = [m.register_forward_pre_hook(lambda m, a: events.append(("module", names[id(m)]))) for m in modules]
    group_of = {p: g for g, bs in enumerate(engine.gather_buckets) for b in bs for p in b.params}
    uses = {names[id(m)]: sorted({group_of[p] for p in m.parameters() if p in group_of}) for m in modules}
    for _ in range(2):
        trainer.train_step()
        events.append(("step", None))
    for h in handles:
        h.remove()
    in_flight_at_end = len(engine._gathers)
    trainer.runner.wait_param_gather()
    engine.close()
    return {"events": events, "uses": uses, "in_flight_at_end": in_flight_at_end,
            "groups": [[b.padded for b in bs] for bs in engine.gather_buckets],
            "grad_buckets": [b.padded for b in engine.layout.buckets]}


def _checkpoint_round_trips(world: int, dataset: str, root: Path) -> dict[str, Any]:
    """Each stage: 4 straight steps vs 2 steps + save + resume + 2 steps (same layout). Then a ZeRO-1
    checkpoint opened by a ZeRO-2 run must fail with a clear message."""
    from pentatron.train.trainer import Trainer

    out: dict[str, Any] = {}
    # Resumed in the middle of the cosine decay: the schedule, the loader and Adam's step count all matter.
    common = ("train.schedule='cosine'", "train.warmup=1", f"log.dir={json.dumps(str(root / 'log'))}")

    def fit(zero: int, *extra: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        trainer = Trainer(make_config(world, zero, micro_batch(world, True), *extra, *common), Path(dataset))
        records = trainer.fit()
        state = {f"{part}/{k}": t.detach().clone().numpy() for part, tensors in trainer.state_dict().items()
                 for k, t in tensors.items()}
        trainer.engine.close()
        return records, state

    for zero in STAGES:
        ckpt = f"checkpoint.dir={json.dumps(str(root / f'zero{zero}'))}"
        straight, straight_state = fit(zero, "train.steps=4")
        first, _ = fit(zero, "train.steps=2", ckpt)
        resumed, resumed_state = fit(zero, "train.steps=4", ckpt)
        out[zero] = {"straight": [r["loss"] for r in straight], "resumed": [r["loss"] for r in first + resumed],
                     "steps": [r["step"] for r in first + resumed], "state": (straight_state, resumed_state)}
    lines = (root / "log" / "metrics.jsonl").read_text().splitlines() if (root / "log").exists() else []
    out["first_metrics"] = json.loads(lines[0]) if lines else None
    try:
        Trainer(make_config(world, 2, micro_batch(world, True), "train.steps=4", *common,
                            f"checkpoint.dir={json.dumps(str(root / 'zero1'))}"), Path(dataset))
        out["layout_error"] = None
    except RuntimeError as e:
        out["layout_error"] = str(e)
    return out


def _bf16_memory(world: int, dataset: str) -> dict[int, dict[str, int]]:
    """Memory accounting with bf16 parameters (fp32 master weights appear), measured after one step."""
    from pentatron.train.trainer import Trainer

    out = {}
    for zero in STAGES:
        trainer = Trainer(make_config(world, zero, micro_batch(world, False), "train.precision='bf16'",
                                      "train.steps=1", "train.warmup=1"), Path(dataset))
        trainer.train_step()
        out[zero] = {**trainer.runner.memory().to_dict(), "numel": trainer.engine.layout.total}
        trainer.engine.close()
    return out


def _rank_main(rank: int, world: int, dataset: str, root: str) -> dict[str, Any]:
    # The runs' default log.dir (runs/default) under this launch's own directory: test_data.py and
    # test_zero.py run in two processes at once, and two runs sharing one run directory and flight
    # recorder delete each other's heartbeat files.
    os.chdir(root)
    results: dict[str, Any] = {"parity": {}}
    for zero in STAGES:
        for accumulate in (False, True):
            cfg = make_config(world, zero, micro_batch(world, accumulate))
            results["parity"][zero, accumulate] = _train(cfg, dataset, want_params=rank == 0)
    if world == 2:
        # ZeRO-3 under full activation recompute: the recomputed forward runs inside backward and
        # must find its layer gathered by the pre-backward hook.
        results["recompute"] = _train(make_config(world, 3, micro_batch(world, True), "train.recompute='full'"),
                                      dataset, want_params=rank == 0)
        results["overlap"] = _overlap_probe(world, dataset)
        # ZeRO-1 with the parameter gather waited right after the step (the switch off): the same numbers
        cfg = make_config(world, 1, micro_batch(world, True), "parallel.overlap_param_gather=false")
        results["gather_off"] = _train(cfg, dataset, want_params=rank == 0)
        results["param_gather"] = {zero: _param_gather_probe(world, dataset, zero) for zero in (1, 2)}
        results["prefetch"] = _prefetch_probe(world, dataset)
        results["checkpoint"] = _checkpoint_round_trips(world, dataset, Path(root))
        results["bf16_memory"] = _bf16_memory(world, dataset)
    return results


@functools.cache
def dp_runs(world: int, dataset: str) -> list[dict[str, Any]]:
    """Every rank's results for `world` ranks, computed once per test run whichever worker asks first
    (tests/shared_runs.py; the dataset directory is named by its content's hash, so the key names the data)."""
    def compute() -> list[dict[str, Any]]:
        root = tempfile.mkdtemp(prefix=f"pentatron-dp{world}-")
        try:
            return run_ranks(_rank_main, world, args=(dataset, root), timeout=600)
        finally:
            shutil.rmtree(root, True)

    return shared(f"dp_runs-{world}-{Path(dataset).name}", compute)


@functools.cache
def reference(dataset: str) -> dict[str, Any]:
    """The plain float64 loop every configuration is compared with (whole batch in one micro-batch), with
    the trainer's defaults these runs keep (cosine schedule, clip 1.0, weight decay 0.1)."""
    ref = reference_run(Path(dataset), steps=STEPS, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, lr=LR, eps=EPS,
                        warmup=WARMUP, dtype=torch.float64)
    return {**ref, "grad_norms": ref["norms"]}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def assert_parity(got: dict[str, Any], ref: dict[str, Any], rtol: float = EXACT_RTOL) -> None:
    """Same loss and gradient norm at every step, the same step-1 gradient of every parameter and the same
    final parameters as the 1-process plain loop (float64, to 1e-10)."""
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), start=1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs 1-process {b}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], ref["grad_norms"]), start=1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: gradient norm {a} vs 1-process {b}"
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        err = relative_error(torch.from_numpy(got["grads"][name]), torch.from_numpy(g))
        assert err <= rtol, f"step-1 gradient of {name}: relative error {err:.2e}"
    assert got["params"].keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        err = relative_error(torch.from_numpy(got["params"][name]), torch.from_numpy(p))
        assert err <= rtol, f"final {name}: relative error {err:.2e}"
