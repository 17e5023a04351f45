"""Every failure-lab experiment at its --quick size: each verdict asserted from the measured numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pentatron.cli import main
from pentatron.distributed.launch import file_init_method
from pentatron.lab import cli as lab_cli
from pentatron.lab import common
from pentatron.lab.collective import collective_mismatch
from pentatron.lab.common import Verdict
from pentatron.lab.divergence import lr_spike
from pentatron.lab.fp8 import fp8_outlier
from pentatron.lab.precision import grad_accumulation, loss_scaling, master_weights
from pentatron.lab.scaling import grad_scale
from pentatron.observe.watchdog import HANG_EXIT_CODE


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The panel kinds of each figure an experiment draws (categories must be bars, numbers lines)."""
    kinds: list[list[str]] = []
    real = common.plot_figure

    def record(title: str, panels: list[dict]):
        kinds.append([p.get("kind", "line") for p in panels])
        return real(title, panels)

    monkeypatch.setattr(common, "plot_figure", record)
    return kinds


def test_master_weights(tmp_path: Path, drawn: list[list[str]]):
    v = master_weights(tmp_path, quick=True)
    assert drawn == [["line", "bar"]]  # loss per step; the share of unchanged weights per run
    n = v.numbers
    assert n["unchanged_bf16"] > 0.5 and n["unchanged_fp32"] < 0.01  # most bf16 updates round away
    assert n["drop_fp32"] > 0 and n["progress_ratio"] < 0.5
    assert v.reproduced and v.plot is not None and v.plot.stat().st_size > 0


def test_grad_accumulation(tmp_path: Path):
    v = grad_accumulation(tmp_path, quick=True)
    n = v.numbers
    assert n["err_bf16"] > 100 * n["err_fp32"] and n["err_fp32"] < 1e-6
    assert n["errs_bf16"][-1] > n["errs_bf16"][0]  # grows with the number of additions
    assert v.reproduced


def test_loss_scaling(tmp_path: Path):
    v = loss_scaling(tmp_path, quick=True)
    n = v.numbers
    i = n["m"].index(64)
    assert n["zero_plain"][i] > 0.1 and n["zero_scaled"][i] < 0.001
    assert n["zero_plain"][-1] >= n["zero_plain"][i]  # the smaller the loss, the more underflows
    assert n["err_scaled"][i] < n["err_plain"][i] / 10
    assert v.reproduced


def test_grad_scale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drawn: list[list[str]]):
    # A relative directory, as `pentatron lab`'s default --out runs/lab: its FileStore URL must not read
    # "runs" as a host name (the ranks then waited 300 s for a store no one creates).
    monkeypatch.chdir(tmp_path)
    v = grad_scale(Path("runs/lab"), quick=True)
    n = v.numbers
    # Exactly m and dp, on any CPU: m and dp are powers of two, and scaling by one is exact in binary floating
    # point through every product and sum of the backward and the norm (same kernels on both sides).
    assert n["m_ratios"] == [float(m) for m in n["m"]] and n["dp_ratio"] == n["dp"]
    assert v.reproduced and drawn == [["line", "bar"]]  # ratio over m; the norms summed / averaged


def test_lr_spike(tmp_path: Path):
    v = lr_spike(tmp_path, quick=True)
    n = v.numbers
    assert n["good_spikes"] == 0 and n["first_spike_step"] == n["jump_at"] + 1
    assert n["final_bad"] > n["final_good"] + 1.0
    assert v.reproduced


def test_collective(tmp_path: Path, drawn: list[list[str]]):
    v = collective_mismatch(tmp_path, quick=True)
    assert drawn == [["bar"]]  # the time to a named failure in each mode
    n = v.numbers
    assert n["check_codes"] == [1, 1] and n["watchdog_codes"] == [HANG_EXIT_CODE, HANG_EXIT_CODE]
    assert n["stuck"] == "1" and "rank 1 has not entered dp all_reduce #8" in v.text
    assert v.reproduced


def test_fp8_outlier(tmp_path: Path):
    v = fp8_outlier(tmp_path, quick=True)
    n = v.numbers
    i, none = n["ratios"].index(n["headline"]), n["ratios"].index(0.0)
    # no outlier: both recipes are e4m3's own rounding, and rowwise never sees the outlier's row
    assert abs(n["tensorwise_err"][none] - n["rowwise_err"][none]) < 0.01 and max(n["rowwise_subnormal"]) < 0.01
    assert n["tensorwise_subnormal"][i] > 0.9 and n["tensorwise_err"][i] > 10 * n["rowwise_err"][i]
    assert n["tensorwise_subnormal"] == sorted(n["tensorwise_subnormal"])  # the larger the outlier, the worse
    assert v.reproduced and v.plot is not None and v.plot.stat().st_size > 0


def test_groups_and_defaults():
    table = lab_cli.experiments()
    assert lab_cli.selected("fp8", table) == ["fp8-outlier", "fp8-edges"]
    assert "fp8-outlier" in lab_cli.selected(None, table) and "fp8-edges" not in lab_cli.selected(None, table)
    assert lab_cli.selected("fp8-edges", table) == ["fp8-edges"] and lab_cli.selected("fp9", table) is None


def test_file_init_method_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    assert file_init_method("runs/lab/store") == "file://" + str(tmp_path.resolve() / "runs/lab/store")


def test_a_failed_experiment_is_one_line_and_the_others_run(monkeypatch: pytest.MonkeyPatch, capsys):
    def broken(out: Path, quick: bool) -> Verdict:
        raise RuntimeError("data-parallel ranks failed:\nrank 0 exit code 1")

    def fine(out: Path, quick: bool) -> Verdict:
        return Verdict("fine", True, "ok")

    monkeypatch.setattr(lab_cli, "experiments", lambda: {"broken": ("broken", broken), "fine": ("fine", fine)})
    assert main(["lab", "--out", "unused"]) == 1
    out, err = capsys.readouterr()
    failed = [line for line in out.splitlines() if "FAILED" in line]
    assert failed == [failed[0]] and failed[0].startswith("[broken] FAILED: RuntimeError: data-parallel ranks "
                                                          "failed: rank 0 exit code 1 (")
    assert "Traceback" not in out + err and "[fine] REPRODUCED" in out and "broken" in err


def test_unknown_experiment_is_an_input_error(capsys):
    assert main(["lab", "no-such"]) == 2
    assert "choose one of master-weights" in capsys.readouterr().err
