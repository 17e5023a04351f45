"""research/playbook_sweep.py: nanotron's pipeline split as its build_model places blocks (hand-counted
against the rank-0 parameters its jobs recorded), and the sweep's data loading and evaluation on a few
of its own rows."""

from __future__ import annotations

from pathlib import Path

import playbook_sweep
import pytest

RESEARCH = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    return playbook_sweep


def _llama(layers: int, h: int, f: int, vocab: int = 131072):
    from pentatron.models.config import ModelConfig

    return ModelConfig(name="t", n_layers=layers, hidden_size=h, n_heads=32, n_kv_heads=32, ffn_hidden_size=f,
                       vocab_size=vocab)


def test_nanotron_split_by_cumulative_cost(sweep):
    # 3B: a layer costs 4 h^2 + 3 h f = 113.2M, the head V h = 402.7M (3.56 layers): 31.56 layers in all,
    # 15.78 per stage at pp 2; stage 0 takes layers until it reaches that, the 16th included
    assert sweep.nanotron_split(_llama(28, 3072, 8192), 2) == (16, 12)
    # 8B at pp 4: 243.3M per layer, the head 537M (2.21 layers): a quarter is 8.55 layers' cost, so the
    # stages end where the cumulative count reaches 8.55, 17.1 and 25.7: after layers 9, 18 and 26
    assert sweep.nanotron_split(_llama(32, 4096, 14336), 4) == (9, 9, 8, 6)
    # 1B: the head is exactly 4 layers, half of 20 is 10: a tie, which the jobs resolve to 10 layers (940M
    # parameters recorded) and the `>` as written to 11; `stage0` pins what a job recorded
    one_b = _llama(16, 2048, 8192)
    assert sweep.nanotron_split(one_b, 2) == (10, 6)
    assert sweep.nanotron_split(one_b, 2, stage0=11) == (11, 5)
    assert sweep._stage0_layers(one_b, "940000000", 1) == 10  # 131072 x 2048 + 10 x 67.1M
    assert sweep._stage0_layers(one_b, "470000000", 2) == 10  # the same under tp 2


def test_sweep_rows_load_evaluate_and_pick(sweep, tmp_path):
    lines = (RESEARCH / "playbook_sweep.csv").read_text().splitlines()
    header = lines[0]
    ids = {"14113488", "13436292", "14098541"}  # 1B on one node: dp8 mb2, dp8 mb1, dp4 pp2 mb4
    picked = [ln for ln in lines[1:] if ln.split(",")[0] in ids]
    oom = next(ln for ln in lines[1:] if ",OOM," in ln and ln.split(",")[1] == "1.34G")
    (tmp_path / "few.csv").write_text("\n".join([header, *picked, oom]) + "\n")
    jobs, skipped = sweep.load_jobs(tmp_path / "few.csv")
    assert skipped == 0 and len(jobs) == 4
    ran = [j for j in jobs if j.status == "Success"]
    assert len(ran) == 3 and all(j.result.memory_error is not None for j in ran)
    pp2 = next(j for j in ran if j.result.row.layout.pp == 2)
    assert pp2.result.row.layout.pp_layers == (10, 6)
    cell = sweep.cells(jobs)[("1.34G", 1)]
    assert len(cell) == 3 and sweep.planners_pick(cell) in cell
    assert "ran out of memory: 1 jobs" in sweep.report(jobs)


def test_published_playbook_rows_carry_nanotrons_split(sweep):
    import planner_accuracy

    rows = [r for r in planner_accuracy.load_rows() if r.source == "playbook" and r.layout.pp > 1]
    assert len(rows) >= 10
    for r in rows:
        assert r.layout.pp_layers == sweep.nanotron_split(r.workload.cfg, r.layout.pp), r.id


def test_outcome_by_predicted_peak_bands_each_job_by_its_share_of_the_device(sweep):
    from types import SimpleNamespace

    from pentatron.hardware.catalogue import get_gpu

    gpu = get_gpu("h100")
    budget = gpu.hbm_bytes

    def job(share: float, status: str):
        pred = SimpleNamespace(memory=SimpleNamespace(required=share * budget))
        return SimpleNamespace(status=status, result=SimpleNamespace(pred=pred, row=SimpleNamespace(gpu=gpu)))

    jobs = [job(0.50, "Success"), job(0.75, "OOM"), job(0.80, "Success"), job(0.80, "OOM"), job(0.88, "OOM"),
            job(0.93, "Success"), job(0.99, "OOM"), job(1.00, "OOM"), job(1.20, "OOM"), job(1.01, "Success")]
    assert sweep.outcome_by_predicted_peak(jobs) == [
        ("<= 75 %", 1, 1), ("75-85 %", 1, 1), ("85-90 %", 0, 1), ("90-95 %", 1, 0), ("95-100 %", 0, 2),
        ("> 100 %", 1, 1)]
