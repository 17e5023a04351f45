"""The run report on real debug runs (1 process, dp2, tp2 and pp2 with the profiler, tp2 with SP, cp2, MoE
with ep2 and with tp2 + SP): its communication bytes are the ledger's, the planner predicts them byte for byte (the MoE
all-to-alls within 10 %: tokens go where they are routed), and the predicted-vs-measured table is there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pentatron.cli import main
from pentatron.config import load_config
from pentatron.observe.report import comm_sent_series, load_records
from pentatron.train.trainer import Trainer
from tests.multiprocess import run_ranks


def _train(rank: int, world: int, run_dir: str, dataset: str, extra: list[str]) -> dict:
    cfg = load_config(None, ["train.steps=3", "train.warmup=1", "train.seq_len=32", "train.micro_batch=2",
                             "train.global_batch=8", "train.device='cpu'", f"log.dir='{run_dir}'",
                             "log.tensorboard=false", "log.progress=false", *extra], world_size=world)
    trainer = Trainer(cfg, dataset_dir=Path(dataset))
    trainer.fit()
    # every op the run issued was waited on: nothing left pending for the watchdog to misread
    assert trainer.comm.recorder.pending == 0 and (world == 1 or trainer.comm.recorder.records)
    ledger = trainer.last_comm.bytes_map()
    if "parallel.tp=2" in extra and any(e.startswith("log.profile") for e in extra):
        _gloo_lets_go_before_the_comm_layer_returns(trainer.comm)
    return ledger


def _gloo_lets_go_before_the_comm_layer_returns(comm) -> None:
    """While profiling, an all-reduce returns once gloo's worker thread has dropped the op's work, so the
    caller's reference to the buffer is the last and its free is seen by the profiler (issue 46: without
    the wait, a fifth to two fifths of the returns found gloo still holding it)."""
    from pentatron.device_clock import DeviceClock
    from pentatron.observe.profiler import CommTimer

    comm.recorder.timer = CommTimer(DeviceClock(torch.device("cpu")))  # as StepProfiler sets it
    try:
        for _ in range(32):
            out = torch.ones(4096)
            comm.all_reduce(out, "tp")
            assert out._use_count() == 1 and comm.recorder.timer.late == 0
    finally:
        comm.recorder.timer = None


@pytest.mark.parametrize("world,extra", [
    (1, []),
    (2, ["parallel.dp=2"]),
    (2, ["parallel.tp=2", "log.profile='2:3'"]),
    (2, ["parallel.tp=2", "parallel.sp=true"]),
    (2, ["parallel.pp=2", "log.profile='2:3'"]),
    (2, ["parallel.cp=2"]),
    (2, ["model.name='debug-moe'", "parallel.dp=2", "parallel.ep=2"]),
    # each tp rank routes its sequence shard: per micro-batch the router counts and the attention's
    # collectives of an MoE layer, once per step its gradients' tp sum with the norms'
    (2, ["model.name='debug-moe'", "parallel.tp=2", "parallel.sp=true"]),
], ids=["1proc", "dp2", "tp2", "tp2sp", "pp2", "cp2", "moe-ep2", "moe-tp2sp"])
def test_report_matches_the_ledger(tmp_path: Path, default_dataset, world: int, extra: list[str]):
    run_dir = tmp_path / "run"
    if world == 1:
        ledgers = [_train(0, 1, str(run_dir), str(default_dataset), extra)]
    else:
        ledgers = run_ranks(_train, world, args=(str(run_dir), str(default_dataset), extra))
    report = json.loads((run_dir / "report.json").read_text())
    meas, pred = report["measured"], report["predicted"]
    # rank 0's last step, as the ledger summarised it: the report copies it, nothing recomputed
    assert meas["comm_bytes_last_step"] == ledgers[0]
    per_step = {d: sum(ops.values()) for d, ops in ledgers[0].items()}
    # every step moves the same bytes here, but the all-to-alls, which carry the tokens as routed
    steady = {d: b for d, b in per_step.items() if d != "ep"}
    assert {d: b for d, b in meas["comm_bytes_per_step"].items() if d != "ep"} == pytest.approx(steady)
    assert "error" not in pred, pred
    md = (run_dir / "report.md").read_text()
    assert "| quantity | predicted | measured | error |" in md and "| step time" in md
    assert "model states per rank" in md
    sent, pred_bytes = meas["comm_sent_per_step"], pred["comm_bytes_per_step"]
    for d in sent:  # what each rank sends, under the planner's dimension names (dp_cp -> dp, cp_ring -> cp)
        assert f"| comm bytes per step, {d} |" in md
    assert (run_dir / "report.png").stat().st_size > 0 and "![report.png](report.png)" in md
    # a CPU run is predicted on this CPU (its calibration), every row compared, its dp the actual one
    assert "n/a" not in md and "(cpu)" in md and "built-in CPU calibration" in md, md
    assert "dp=auto" not in md and pred["same_machine"]
    assert "| step time |" in md and "| peak resident set, rank 0" in md
    # the PNG draws what the table counts: rank 0's sends (a pipeline's receives left out)
    drawn = comm_sent_series(load_records(run_dir))
    assert {d: ys[-1] for d, ys in drawn.items()} == {
        d: b for d, b in _sent_by_report_dim(ledgers[0]).items()}
    if world == 1:
        assert per_step == {} and meas["model_state_bytes"] == pytest.approx(pred["model_state_bytes"], rel=0.01)
    if "parallel.pp=2" in extra:  # measured and predicted: the pp ranks' idle share of the step, in [0, 1]
        assert "| pipeline bubble (idle / (busy + idle) of the pp ranks) |" in md
        assert 0 < meas["bubble"] < 1 and 0 < pred["bubble"] < 1, (meas["bubble"], pred["bubble"])
        bubbles = [r["bubble"] for r in load_records(run_dir)]
        assert len(bubbles) == 3 and all(0 <= b <= 1 for b in bubbles), bubbles
    # the planner counts every byte training sends, the step's scalars included (the loss's mean over
    # dp, the squared gradient norm's sums, the pipeline's loss broadcast and statistics)
    for d in ("dp", "tp", "cp", "pp"):
        assert sent.get(d, 0.0) == pytest.approx(pred_bytes.get(d, 0.0)), (d, sent, pred_bytes)
    if "parallel.ep=2" in extra:  # the all-to-alls carry the tokens as routed, the plan as if balanced
        assert sent["ep"] == pytest.approx(pred_bytes["ep"], rel=0.10), (sent, pred_bytes)
    if "log.profile='2:3'" in extra:
        dim = "tp" if "parallel.tp=2" in extra else "pp"
        summary = json.loads((run_dir / "profile" / "rank1.summary.json").read_text())
        assert summary["steps"] == [2, 3] and summary["comm_calls"][dim] > 0 and summary["comm_s"][dim] > 0
        # the phases are timed on every layout (a pipeline rank's forward hooks sit on its stages)
        assert set(summary["compute_s"]) == {"forward", "backward", "optimizer"}
        assert summary["compute_s"]["forward"] > 0 and summary["compute_s"]["backward"] > 0
        # the profiled steps' tensor memory: rank 0's model state + what the steps allocated at once,
        # against the planner's live tensors for rank 0
        assert summary["tensor_memory_growth_bytes"] > 0
        if dim == "tp":  # tp ranks hold equal shards: rank 1's state is rank 0's
            assert summary["model_state_bytes"] == meas["model_state_bytes"]
        assert meas["tensor_peak_bytes_rank0"] == pytest.approx(pred["tensor_bytes_rank0"], rel=0.10)
        assert "| tensor memory at its peak, rank 0" in md
        trace = json.loads((run_dir / "profile" / "rank0.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"pentatron/forward", "pentatron/backward", "pentatron/optimizer"} <= names
        assert any(str(n).startswith(f"comm/{dim}/") for n in names)
    # and again from the command line
    assert main(["report", str(run_dir)]) == 0


def _sent_by_report_dim(ledger: dict[str, dict[str, int]]) -> dict[str, float]:
    from pentatron.plan.comm import report_dim

    out: dict[str, float] = {}
    for dim, ops in ledger.items():
        out[report_dim(dim)] = out.get(report_dim(dim), 0.0) + sum(b for op, b in ops.items() if op != "recv")
    return out


def test_report_of_a_missing_run_is_an_input_error(tmp_path: Path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_a_moe_run_with_dp_left_to_the_world_size_is_evaluated():
    """run.json keeps dp unset (the world size decides): the planner's layout is built with the run's world
    size, so ep=2 borrows from dp=2 as in training (it was refused: "ep=2 must divide dp×cp = 1×1")."""
    from pentatron.observe.report import layout_and_workload

    cfg = load_config(None, ["model.name='debug-moe'", "parallel.ep=2", "train.micro_batch=2",
                             "train.global_batch=8"], world_size=2).to_dict()
    assert cfg["parallel"]["dp"] is None
    lay, w = layout_and_workload(cfg, 2, "cpu")
    assert (lay.dp, lay.ep) == (2, 2) and w.moe_spec is not None


@pytest.mark.parametrize("world,extra,field,value", [
    (2, ["parallel.cp=2", "parallel.cp_mode='ulysses'"], "cp_mode", "ulysses"),
    (4, ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.zero3_gather='step'"],
     "zero3_gather", "step"),
], ids=["ulysses-cp2", "zero3-step"])
def test_the_prediction_uses_the_runs_parallel_modes(world: int, extra: list[str], field: str, value: str):
    """The report predicts the run's own `ParallelLayout` (`Config.layout`): a Ulysses cp2 run is predicted
    as Ulysses, not ring, and a ZeRO-3 pipeline that keeps its stages gathered as such (both were dropped
    when the planner's layout was copied field by field)."""
    from dataclasses import replace

    from pentatron.hardware.catalogue import detect_gpu
    from pentatron.observe.report import planner_layout, predicted
    from pentatron.plan.comm import bytes_by_dim
    from pentatron.plan.layout import parallel_layout
    from pentatron.plan.search import predict

    cfg = load_config(None, ["train.seq_len=64", "train.micro_batch=1", "train.global_batch=8", *extra],
                      world_size=world)
    lay, w = planner_layout(cfg, world, "cuda")
    assert getattr(lay, field) == value and parallel_layout(w, lay) == cfg.layout(world)
    info = {"config": cfg.to_dict(), "world_size": world, "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
    pred = predicted(info, None)
    assert "error" not in pred, pred
    gpu = detect_gpu(info["device_name"])

    def comm(layout) -> dict[str, float]:
        return bytes_by_dim(list(predict(w, layout, gpu).step.collectives))

    default = {"cp_mode": "ring", "zero3_gather": "micro_batch"}[field]
    assert pred["comm_bytes_per_step"] == pytest.approx(comm(lay))
    assert pred["comm_bytes_per_step"] != pytest.approx(comm(replace(lay, par=replace(lay.par, **{field: default}))))


def test_an_fp8_run_is_predicted_as_the_planners_fp8_on_a_gpu():
    """train.fp8 on CUDA is priced with the planner's FP8 GEMMs and casts at the run's scaling; on CPU (no FP8
    units to model) at the run's precision; its records are keyed apart from the same run without FP8."""
    from pentatron.observe.report import layout_key, planner_layout, predicted

    common = ["train.seq_len=64", "train.micro_batch=1", "train.global_batch=8", "train.precision='bf16'"]
    cfg = load_config(None, [*common, "train.fp8='rowwise'"], world_size=1)
    lay, _ = planner_layout(cfg, 1, "cuda")
    assert (lay.precision, lay.fp8_scaling) == ("fp8", "rowwise")
    assert planner_layout(cfg, 1, "cpu")[0].precision == "bf16"
    info = {"config": cfg.to_dict(), "world_size": 1, "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
    fp8_time = predicted(info, None)["step_time_s"]
    bf16 = load_config(None, common, world_size=1)
    assert fp8_time != predicted({**info, "config": bf16.to_dict()}, None)["step_time_s"]
    assert layout_key(cfg, 1) != layout_key(bf16, 1) and "fp8:rowwise" in layout_key(cfg, 1)


def test_an_fp64_run_is_not_priced_by_the_planner():
    """The planner prices bf16/fp32/fp8 runs; an fp64 run (the parity tests' mode) gets no prediction rather
    than one of a 2-byte run."""
    from pentatron.observe.report import ReportError, planner_layout

    with pytest.raises(ReportError, match="fp64"):
        planner_layout(load_config(None, ["train.precision='fp64'"], world_size=1), 1, "cpu")


def _segment(layout: str, start: int, steps: int, comm: dict, state_bytes: int, **extra) -> list[dict]:
    """Records of one start of a run: `steps` steps from `start`, the first carrying the memory accounting."""
    rows = [{"step": start + i, "loss": 5.0, "step_time_s": 0.1, "tokens_per_s": 1000.0, "peak_mem_bytes": 1 << 20,
             "comm_bytes": comm, "layout": layout, "start_step": start, **extra} for i in range(1, steps + 1)]
    rows[0]["memory"] = {"params": state_bytes, "grads": 0, "optimizer": 0, "master": 0}
    return rows


def test_a_run_resumed_in_another_layout_is_compared_over_that_layouts_steps():
    """Issue 52: trained at tp2, resumed at pp2, the report set the pp2 prediction against the model state
    of step 1 (tp2) and comm means over all steps (+74.9 %, +298 %), and after resuming back at tp2 it
    compared a bubble of 0 with the pp2 steps' bubble. Now each comparison uses that layout's steps."""
    from pentatron.observe.report import measured

    tp2 = _segment("dp1 tp2 pp1 cp1 zero0", 0, 4, {"tp": {"all_reduce": 1000}}, 400)
    pp2 = _segment("dp1 tp1 pp2 cp1 1f1b zero0", 4, 4, {"pp": {"send": 300, "recv": 300}}, 700, bubble=0.25)
    m = measured(tp2 + pp2)
    assert m["model_state_bytes"] == 700 and m["comm_sent_per_step"] == {"pp": 300}
    assert m["bubble"] == 0.25 and m["compared_steps"] == "6..8" and m["steps"] == 8
    back = _segment("dp1 tp2 pp1 cp1 zero0", 8, 2, {"tp": {"all_reduce": 1000}}, 400)
    m = measured(tp2 + pp2 + back)
    assert "bubble" not in m and m["comm_sent_per_step"] == {"tp": 1000} and m["model_state_bytes"] == 400
    assert m["compared_steps"] == "2..4, 10"
    old = [{k: v for k, v in r.items() if k not in ("layout", "start_step")} for r in tp2]  # records before the fields
    assert measured(old)["compared_steps"] == "2..4"
