"""`pentatron plan` / `pentatron bench` through their argparse registration, as the top-level CLI uses them."""

from __future__ import annotations

import argparse
import json

import pytest

from pentatron.calibrate.cli import add_bench_parser
from pentatron.plan.cli import add_plan_parser, parse_count


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pentatron")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_the_70b_example_prints_a_ranked_table(capsys):
    rc = run(["plan", "--model", "llama3-70b", "--gpus", "256", "--gpu", "h100", "--seq", "4096",
              "--global-batch-tokens", "4M"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tok/s/GPU" in out and "\n 1 " in out and "\n10 " in out
    assert "why the best layout" in out and "MFU" in out and "total" in out
    rows = [line.split() for line in out.splitlines() if line[:2].strip().isdigit()][:10]
    assert len(rows) == 10, rows
    # the table says what it ranks by (a cp row may sit below a faster one) and how accurate it is
    assert "ranked by predicted tokens/s per GPU" in out and "must beat the others by 5 %" in out
    from pentatron.plan.report import ACCURACY_COMMAND, MEASURED_ACCURACY  # held-out: tests/plan/test_heldout.py
    assert f"measured accuracy on {MEASURED_ACCURACY}" in out and ACCURACY_COMMAND in out
    # ranked by throughput, context-parallel rows handicapped by CP_MARGIN (search.cp_handicapped)
    from pentatron.plan.search import CP_MARGIN
    ranked = [float(r[14].replace(",", "")) / (1 + CP_MARGIN if r[6] != "1" else 1) for r in rows]
    assert all(a >= b * 0.999 for a, b in zip(ranked, ranked[1:], strict=False)), rows


def test_json_keys_are_stable(capsys, tmp_path):
    chart = tmp_path / "mem.png"
    rc = run(["plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch-tokens", "1M", "--json",
              "--top", "3", "--train-tokens", "1T", "--price", "2.5", "--chart", str(chart)])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "pentatron.plan/1"
    assert {"model", "hardware", "workload", "predictions", "search", "reasons", "problems"} <= set(d)
    p = d["predictions"][0]
    for key in ("layout", "fits", "memory_bytes", "step_time_s", "bubble_fraction", "tokens_per_s_per_gpu",
                "mfu", "hfu", "comm", "train", "model_flops_per_token"):
        assert key in p
    assert p["memory_bytes"]["total"] == pytest.approx(sum(v for k, v in p["memory_bytes"].items() if k != "total"))
    assert p["train"]["cost_usd"] == pytest.approx(p["train"]["gpu_hours"] * 2.5)
    assert d["workload"]["global_batch_tokens"] == 2**20
    assert chart.read_bytes()[:4] == b"\x89PNG"


def test_evaluate_one_layout(capsys):
    rc = run(["plan", "--model", "llama3-70b", "--gpus", "256", "--global-batch-tokens", "4M", "--dp", "4",
              "--tp", "8", "--pp", "8", "--zero", "1", "--sp", "--pp-schedule", "interleaved", "--pp-virtual", "5",
              "--micro-batch", "1", "--recompute", "none"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "dp4 tp8+sp pp8 cp1 interleaved/v5 z1 mb1" in out
    for word in ("parameters", "activations", "communication per GPU", "bubble", "HFU", "tokens/s/GPU"):
        assert word in out


def test_cross_entropy_flag_sets_the_loss_evaluated_and_searched(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch-tokens", "1M", "--json"]
    pinned = ["--dp", "8", "--tp", "2", "--pp", "1", "--zero", "1", "--micro-batch", "1", "--recompute", "none"]
    logits = {}
    for ce in ("eager", "loss_parallel"):
        assert run([*base, *pinned, "--cross-entropy", ce]) == 0
        p = json.loads(capsys.readouterr().out)["predictions"][0]
        assert p["layout"]["cross_entropy"] == ce
        logits[ce] = p["memory_bytes"]["logits_loss"]
    # torch's loss_parallel holds 12 bytes per token and local vocabulary entry at its peak, our bf16
    # vocab-parallel loss 10 (memory.loss_transient_per_entry): the flag reaches the memory model
    assert logits["loss_parallel"] > logits["eager"]
    assert run([*base, "--top", "3", "--cross-entropy", "loss_parallel"]) == 0
    preds = json.loads(capsys.readouterr().out)["predictions"]
    assert preds and all(p["layout"]["cross_entropy"] == "loss_parallel" and p["layout"]["tp"] > 1 for p in preds)


def test_layout_that_does_not_fit_explains(capsys):
    rc = run(["plan", "--model", "llama3-70b", "--gpus", "256", "--dp", "32", "--tp", "8", "--pp", "1",
              "--cp", "1", "--zero", "0", "--micro-batch", "1", "--recompute", "none"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "needs" in out and "h100-sxm has 80 GiB (76.2 GiB with the 5% headroom): try" in out and "zero=" in out


def test_explicit_shape_and_model_file(capsys, tmp_path):
    rc = run(["plan", "--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "4", "--ffn-hidden",
              "1536", "--vocab", "32000", "--seq", "1024", "--global-batch", "32", "--gpus", "2", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] > 0
    f = tmp_path / "m.toml"
    f.write_text("[model]\nname = \"llama3-8b\"\nn_layers = 4\n")
    assert run(["plan", "--model-file", str(f), "--gpus", "8", "--global-batch", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["n_layers"] == 4


def test_verify_flag(capsys):
    rc = run(["plan", "--model", "debug", "--seq", "256", "--verify"])
    out = capsys.readouterr().out
    assert rc == 0 and "bytes saved for backward" in out and "FAIL" not in out
    assert "the loss in chunks of 1024 tokens" in out  # training's default loss
    # a loss from full logits is traced as such, and its formulas agree with that trace
    rc = run(["plan", "--model", "debug", "--seq", "256", "--verify", "--cross-entropy", "eager"])
    eager = capsys.readouterr().out
    assert rc == 0 and "the loss from full fp32 logits" in eager and "FAIL" not in eager
    saved = [ln for ln in (out + eager).splitlines() if "bytes saved for backward" in ln]
    assert len(saved) == 2 and saved[0] != saved[1]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--model", "llama9", "--gpus", "8"], "unknown model 'llama9'"),
    (["--model", "debug", "--gpus", "8", "--gpu", "v100"], "unknown GPU 'v100'"),
    (["--model", "debug", "--gpus", "0"], "--gpus must be within 1 … 1,048,576"),
    (["--model", "debug", "--gpus", "1000000000"], "--gpus must be within 1 … 1,048,576"),
    (["--model", "debug", "--seq", "256", "--global-batch-tokens", "nan", "--gpus", "2"], "'nan' must be a positive"),
    (["--model", "debug", "--seq", "256", "--global-batch-tokens", "inf", "--gpus", "2"], "'inf' must be a positive"),
    (["--model", "debug", "--seq", "256", "--global-batch-tokens", "1000"], "not a multiple of --seq 256"),
    (["--model", "debug", "--seq", "256", "--global-batch-tokens", "lots", "--gpus", "2"], "cannot read 'lots'"),
    (["--model", "llama3-70b", "--gpus", "256", "--tp", "3"], "parallel.tp=3 does not divide model.n_heads=64"),
    (["--model", "debug", "--gpus", "8", "--seq", "256", "--global-batch", "4", "--dp", "8"], "not divisible"),
    (["--gpus", "8"], "no model"),
    (["--model", "debug", "--model-file", "x.toml", "--gpus", "2"], "not both"),
    (["--model", "debug", "--gpus", "2", "--hardware", "/nonexistent.toml"], "does not exist"),
    (["--model", "llama3-8b", "--gpus", "8", "--fp8-scaling", "rowwise"], "rowwise applies to --precision fp8"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "b200", "--precision", "fp8", "--fp8-scaling", "rowwise"],
     "no row-wise FP8 measurement for b200"),
    (["--model", "llama3-8b", "--gpus", "8", "--tp", "1", "--cross-entropy", "loss_parallel"],
     "with tp=1 use 'eager'"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    assert run(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_parse_count():
    assert parse_count("4M", "x") == 4 * 2**20
    assert parse_count("4Mi", "x") == 4 * 2**20
    assert parse_count("1048576", "x") == 2**20
    assert parse_count("4e6", "x") == 4_000_000
    assert parse_count("15T", "x", binary=False) == 15 * 10**12


def test_bench_writes_a_profile_the_planner_reads(capsys, tmp_path):
    out = tmp_path / "prof.toml"
    assert run(["bench", "--nproc", "2", "--max-bytes", "64K", "--seconds", "0.02", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "all_reduce" in text and out.exists()
    from pentatron.hardware.catalogue import load_hardware_toml

    prof = load_hardware_toml(out)
    assert set(prof.profile.busbw) == {"all_reduce", "all_gather", "reduce_scatter", "p2p", "exchange"}
    assert all(b > 0 for pts in prof.profile.busbw.values() for _, b in pts)
    # CPU: the in-step kernels (calibrate/cpu_kernels.py) and the node sharing of 2 processes, capped at 2
    assert prof.profile.stream_bw and prof.profile.matmul_fp32 and prof.profile.optimizer_per_element_s > 0
    assert prof.profile.attention_fp32 is not None and min(prof.profile.attention_fp32.bwd) > 0
    assert len(prof.profile.head_fp32) == 4 and all(x > 0 for row in prof.profile.head_fp32 for x in row)
    assert set(prof.profile.node_slowdown) == {"matmul", "stream", "host"}
    assert all(1.0 <= v <= 2.0 for v in prof.profile.node_slowdown.values())
    # the tp2 step as the ranks ran it (calibrate/tp_step.py): activations of 16, 128, 1024 tokens x 64 x 4 B
    assert [b for b, _ in prof.profile.tp_collective] == [4096, 32768, 262144] and prof.profile.host_tp_layer_s[0] > 0
    assert all(t > 0 for _, t in prof.profile.tp_collective)
    # train.compile's kernels (calibrate/compiled_kernels.py): the compiled rate by size, the compiled layers
    fused = prof.profile.fused_bw
    assert [n for n, _ in fused] == [32768, 131072, 524288] and min(b for _, b in fused) > 0
    assert any(prof.profile.host_compiled_layer_s) and any(prof.profile.host_tp_compiled_layer_s)
    # the dp2 step's synchronisations (calibrate/dp_step.py): gradient all-reduces after a backward's compute
    assert [b for b, _ in prof.profile.dp_collective] == [256 * 2**10, 2**20, 4 * 2**20]
    assert all(t > 0 for _, t in prof.profile.dp_collective) and prof.profile.scalar_collective_s > 0
    # the pp2 hop (calibrate/pp_step.py): both ranks compute, then swap a message of 4 KiB .. 1 MiB
    assert [b for b, _ in prof.profile.pp_hop] == [4096, 32768, 262144, 2**20]
    assert all(t > 0 for _, t in prof.profile.pp_hop)
    assert run(["plan", "--model", "debug", "--seq", "256", "--global-batch", "8", "--gpus", "2",
                "--hardware-profile", str(out), "--precision", "fp32"]) == 0
    assert run(["bench", "--out", str(tmp_path / "p.yaml")]) == 2


def test_batch_evaluates_every_layout_in_one_process(capsys, tmp_path):
    f = tmp_path / "sweep.toml"
    f.write_text('[[layout]]\ndp = 8\nzero = 1\n\n[[layout]]\ndp = 2\ntp = 4\n\n[[layout]]\ndp = 3\n\n'
                 '[[layout]]\ndp = 4\ncp = 2\n')
    rc = run(["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch", "64",
              "--batch", str(f), "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["batch"]
    assert [r["prediction"] is not None for r in rows] == [True, True, False, True]
    assert rows[1]["layout"]["sp"] is True and "does not equal the world size 8" in rows[2]["problems"][0]
    assert not any("training cannot run this yet" in n for n in rows[3]["prediction"]["notes"])  # cp trains
    f.write_text("[[layout]]\ndp = 2\npp = 4\npp_layers = [7, 8, 9, 8]\n")  # an explicit split of the 32 layers
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch", "64",
                "--batch", str(f), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["batch"][0]
    assert row["layout"]["pp_layers"] == [7, 8, 9, 8] and row["prediction"] is not None, row["problems"]
    f.write_text("[[layout]]\ndp = 8\npp_layers = 8\n")
    assert run(["plan", "--model", "llama3-8b", "--batch", str(f)]) == 2
    assert "pp_layers must be a list of integers" in capsys.readouterr().err
    f.write_text("[[layout]]\ndp = 8\nbogus = 1\n")
    assert run(["plan", "--model", "llama3-8b", "--batch", str(f)]) == 2
    assert "unknown key(s) bogus" in capsys.readouterr().err


def test_plan_through_the_top_level_cli_imports_no_torch():
    """Issues 10 and 39: evaluating one layout costs no more than importing the package, also with pp > 1
    (the engine's balanced split comes from the torch-free parallel/pipeline/partition.py)."""
    import subprocess
    import sys

    code = ("import sys; from pentatron.cli import main; "
            "rc = main(['plan', '--model', 'llama3-8b', '--gpus', '8', '--seq', '4096', '--global-batch', '64', "
            "'--dp', '8', '--tp', '1', '--pp', '1', '--cp', '1', '--zero', '3', '--micro-batch', '1', "
            "'--recompute', 'none']); "
            "rc2 = main(['plan', '--model', 'llama3-8b', '--gpus', '8', '--seq', '4096', '--global-batch', '64', "
            "'--dp', '2', '--tp', '2', '--sp', '--pp', '2', '--pp-schedule', '1f1b', '--cp', '1', '--zero', '1', "
            "'--micro-batch', '1', '--recompute', 'none']); print('torch' in sys.modules, rc, rc2)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False 0 0"
