"""Predict, then measure: `pentatron plan` with a `pentatron bench` profile of this machine predicts the
step time, the per-rank model state and the peak of tensor memory of debug-model runs (1 process, dp2,
tp2, pp2), then
`pentatron train` runs them and the two are printed side by side. The "(alone)" column is the same
prediction without `node_slowdown` (as if each rank had its cores to itself); the "(hot)" column is
also without the in-step CPU terms (elementwise ops at the hot copy curve, attention at the
default efficiency, the optimizer as memory traffic, the LM head's GEMMs at the square curve, the
pipeline hop at the ping-pong): what the profile predicted before those were
measured; "(no TP step)", "(no DP step)" and "(no PP step)" leave out tp_step's tensor-parallel step,
dp_step's in-step gradient and scalar collectives (with the tied gradients' measured exchange) and
pp_step's in-step pipeline hop (the ping-pong curve prices it instead). Under the table,
each prediction's parts: per micro-batch forward / backward (+ weight
gradients) on the busiest stage, exposed data-parallel communication, optimizer, overlapped
communication charged as contention (all of it on a CPU: the cores that compute also communicate).

Each layout runs eager (`train.compile=false`, predicted with `--kernels eager`) and compiled
(`train.compile=true`, predicted with `--kernels fused`: the profile's compiled rate and compiled layer
host, from what bench measured compiling saves, calibrate/compiled_kernels.py), or one of them
(`--compile`). The steps of `--warmup` are left out of the median: under compile they include inductor
compiling each region (forward, then backward).

    python benchmarks/predict_vs_measure.py [--profile cpu.toml] [--steps 12] [--warmup 3] [--rounds N]
                                            [--compile {eager,compiled,both}] [--memory-layouts]

Without `--profile` it first runs `pentatron bench --nproc 2` into a temporary profile (each round:
the profile and the runs then see the machine in the same minute). Measured step
time is the median over the steps after `--warmup` (rank 0's wall time per step, as the trainer logs
it), and the fastest of them (bench keeps its fastest timing windows: on a shared machine the best is
the comparable figure); model state is the trainer's per-rank accounting (parameters, gradients, optimizer state, master
weights). Peak tensor memory: the last step runs under `log.profile`, whose allocator events give each
rank's most bytes of tensors allocated during the step and live at once; plus that rank's model state,
this is the rank's peak of tensor memory (a CPU allocator keeps no statistics), compared, busiest rank
against busiest rank, with the planner's memory less its CUDA context and fragmentation reserve; that
step is left out of the step times. Peak RSS is printed for context (it includes the Python process and
torch, which the planner does not model). Training runs in fp32 on CPU (train.precision auto), as
predicted, one thread per rank (the bench profile should be measured the same way: OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pentatron.hardware.catalogue import load_hardware_toml, with_profile
from pentatron.hardware.profile import Profile
from pentatron.models.registry import get_model_config
from pentatron.observe.profiler import summary_tensor_peak
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.search import predict

ROOT = Path(__file__).resolve().parents[1]
SEQ, MICRO, GLOBAL = 64, 4, 8  # configs/debug.toml

RUNS: dict[str, tuple[Layout, list[str]]] = {
    "1 process": (Layout(dp=1, micro_batch=MICRO, precision="fp32"), []),
    "dp2": (Layout(dp=2, micro_batch=MICRO, precision="fp32"), ["parallel.dp=2"]),
    "tp2": (Layout(dp=1, tp=2, micro_batch=MICRO, precision="fp32"), ["parallel.tp=2"]),
    "pp2": (Layout(dp=1, pp=2, micro_batch=1, precision="fp32"), ["parallel.pp=2", "train.micro_batch=1"]),
}

# Memory only (`--memory-layouts`): the planner's peak tensor memory for more of training's layouts, each
# run once for 3 steps (the third profiled), rank 0 against the planner's rank 0.
MEMORY_RUNS: dict[str, tuple[Layout, list[str]]] = {
    "zero1 dp2": (Layout(dp=2, zero=1, micro_batch=MICRO, precision="fp32"), ["parallel.dp=2", "parallel.zero=1"]),
    "zero2 dp2": (Layout(dp=2, zero=2, micro_batch=MICRO, precision="fp32"), ["parallel.dp=2", "parallel.zero=2"]),
    "zero3 dp2": (Layout(dp=2, zero=3, micro_batch=MICRO, precision="fp32"), ["parallel.dp=2", "parallel.zero=3"]),
    "dp2 m2": (Layout(dp=2, micro_batch=2, precision="fp32"), ["parallel.dp=2", "train.micro_batch=2"]),
    "tp2 sp": (Layout(dp=1, tp=2, sp=True, micro_batch=MICRO, precision="fp32"), ["parallel.tp=2", "parallel.sp=true"]),
    "cp2": (Layout(dp=1, cp=2, micro_batch=MICRO, precision="fp32"), ["parallel.cp=2"]),
    "full recompute": (Layout(dp=1, micro_batch=MICRO, recompute="full", precision="fp32"),
                       ["train.recompute='full'"]),
    "selective recompute": (Layout(dp=1, micro_batch=MICRO, recompute="selective", precision="fp32"),
                            ["train.recompute='selective'"]),
}


@dataclass
class Measured:
    step_s: float
    best_s: float  # the fastest step: the least contended, as bench's best-of windows
    model_state: float
    tensor_peak: float  # max over ranks of (model state + tensor memory allocated during the step, at its peak)
    peak_rss: float


def _train(overrides: list[str], nproc: int, steps: int, warmup: int, logdir: Path) -> Measured:
    cmd = [sys.executable, "-m", "pentatron.cli", "train", str(ROOT / "configs" / "debug.toml"),
           "--nproc", str(nproc), "--set", f"train.steps={steps}", "--set", "train.warmup=1",
           "--set", f"log.dir={json.dumps(str(logdir))}", "--set", "log.progress=false",
           "--set", "log.tensorboard=false", "--set", f"log.profile='{steps}:{steps}'"]
    for o in overrides:
        cmd += ["--set", o]
    # one intra-op thread per rank, as torchrun sets it for --nproc > 1: on a shared 2-core machine a
    # 1-process run with 2 threads is oversubscribed (6x slower at load ~12, measured)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(f"training failed ({' '.join(overrides) or '1 process'}):\n{done.stderr[-2000:]}")
    # runs write <log.dir>/<timestamp>/ and point <log.dir>/latest at it
    recs = [json.loads(x) for x in (logdir / "latest" / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in recs[warmup:-1]]  # the last step ran under the profiler
    ranks = [json.loads(f.read_text()) for f in sorted((logdir / "latest" / "profile").glob("rank*.summary.json"))]
    tensor_peak = max(summary_tensor_peak(r) for r in ranks)
    return Measured(statistics.median(times), min(times), float(recs[0]["memory"]["total"]), tensor_peak,
                    max(r["peak_mem_bytes"] for r in recs))


def _bench(out: str) -> None:
    subprocess.run([sys.executable, "-m", "pentatron.cli", "bench", "--nproc", "2", "--device", "cpu",
                    "--out", out], check=True, cwd=ROOT, capture_output=True, timeout=900,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


MODES = {"eager": ("eager", []), "compiled": ("fused", ["train.compile=true"])}  # mode -> (kernels, overrides)


def _runs(compile_: str) -> list[tuple[str, Layout, list[str], str]]:
    """(name, layout, overrides, the planner's kernels) of every run of `--compile`."""
    modes = list(MODES) if compile_ == "both" else [compile_]
    return [(name if mode == "eager" else f"{name} comp", lay, overrides + MODES[mode][1], MODES[mode][0])
            for mode in modes for name, (lay, overrides) in RUNS.items()]


def _round(profile: str, steps: int, warmup: int, tmp: Path, compile_: str) -> dict[str, tuple[float, ...]]:
    """One profile, the runs of `compile_`; prints the table; returns run -> (predicted, median, fastest,
    predicted without the TP step) s, predicted / measured peak tensor memory, and the predictions
    without the DP step (dp_step's in-step gradient and scalar collectives, the measured exchange) and
    without the PP step (pp_step's in-step hop)."""
    gpu = load_hardware_toml(profile)
    w = Workload(get_model_config("debug"), SEQ, GLOBAL)
    print(f"profile: {gpu.name} ({gpu.source}); fp32 matmul {gpu.flops('fp32') / 1e9:.1f} GFLOP/s, "
          f"copy {gpu.hbm_bandwidth / 1e9:.1f} GB/s")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} CPUs)")
    prof = gpu.profile or Profile()
    hot = with_profile(gpu, stream_bw=(), attention_fp32=None, optimizer_per_element_s=0.0, node_slowdown={},
                       tp_collective=(), pp_hop=(), head_fp32=())
    alone = with_profile(gpu, node_slowdown={})
    no_tp_step = with_profile(gpu, tp_collective=())
    no_dp_step = with_profile(gpu, dp_collective=(), scalar_collective_s=0.0,
                              busbw={k: v for k, v in prof.busbw.items() if k != "exchange"})
    no_pp_step = with_profile(gpu, pp_hop=())
    if any(prof.host_compiled_layer_s):
        print(f"compiled (compiled_kernels): host per layer fwd {1e6 * prof.host_compiled_layer_s[0]:.0f} / bwd "
              f"{1e6 * prof.host_compiled_layer_s[1]:.0f} us (eager {1e6 * prof.host_layer_s[0]:.0f} / "
              f"{1e6 * prof.host_layer_s[1]:.0f}); fused rate "
              + ", ".join(f"{b / 1e9:.1f} GB/s at {n / 1024:g} KiB" for n, b in prof.fused_bw))
    if prof.node_slowdown:
        print("node slowdown (every process busy): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in prof.node_slowdown.items()))
    head = (f"{'run':<14} {'pred step ms':>12} {'(alone)':>8} {'(hot)':>8} {'(no TP step)':>12} {'(no DP step)':>12} "
            f"{'(no PP step)':>12} {'meas step ms':>12} {'ratio':>6} "
            f"{'best ms':>8} {'ratio':>6}   "
            f"{'pred state KiB':>14} {'meas state KiB':>14} {'ratio':>6}   "
            f"{'pred tensors KiB':>16} {'meas tensors KiB':>16} {'ratio':>6}   {'peak RSS MiB':>12}")
    print(head)
    print("-" * len(head))
    parts, out = [], {}
    for i, (name, lay, overrides, kernels) in enumerate(_runs(compile_)):
        pred = predict(w, lay, gpu, kernels=kernels)
        pred_flat = predict(w, lay, hot, kernels=kernels)
        pred_alone = predict(w, lay, alone, kernels=kernels)
        pred_no_tp = predict(w, lay, no_tp_step, kernels=kernels)
        pred_no_dp = predict(w, lay, no_dp_step, kernels=kernels)
        pred_no_pp = predict(w, lay, no_pp_step, kernels=kernels)
        m = _train(overrides, lay.world, steps, warmup, tmp / f"run{i}")
        mem = pred.memory
        state = mem.model_state
        print(f"{name:<14} {1e3 * pred.step.step:>12.2f} {1e3 * pred_alone.step.step:>8.2f} "
              f"{1e3 * pred_flat.step.step:>8.2f} {1e3 * pred_no_tp.step.step:>12.2f} "
              f"{1e3 * pred_no_dp.step.step:>12.2f} {1e3 * pred_no_pp.step.step:>12.2f} "
              f"{1e3 * m.step_s:>12.2f} {pred.step.step / m.step_s:>6.2f} {1e3 * m.best_s:>8.2f} "
              f"{pred.step.step / m.best_s:>6.2f}"
              f"   {state / 1024:>14.1f} {m.model_state / 1024:>14.1f} {state / m.model_state:>6.2f}"
              f"   {mem.tensors / 1024:>16.1f} {m.tensor_peak / 1024:>16.1f} {mem.tensors / m.tensor_peak:>6.2f}"
              f"   {m.peak_rss / 2**20:>12.0f}", flush=True)
        out[name] = (pred.step.step, m.step_s, m.best_s, pred_no_tp.step.step, mem.tensors / m.tensor_peak,
                     pred_no_dp.step.step, pred_no_pp.step.step)
        st = pred.step
        ph = max(st.phases, key=lambda p: p.total)
        parts.append(f"{name:<14} {lay.microbatches(w)} x (f {1e3 * ph.f:.2f} + b {1e3 * ph.b:.2f} "
                     f"+ w {1e3 * ph.w:.2f}) -> pipeline {1e3 * st.pipeline:.2f} "
                     f"(bubble {100 * st.bubble_fraction:.0f} %), dp exposed "
                     f"{1e3 * st.dp_exposed:.2f}, optimizer {1e3 * st.optimizer:.2f}, contention "
                     f"{1e3 * st.contention:.2f}, tied grads {1e3 * st.tied_grads:.2f}, step scalars "
                     f"{1e3 * st.scalars:.2f} ms")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if prof.tp_collective:
        print(f"tp step (tp_step): host per TP layer fwd {1e6 * prof.host_tp_layer_s[0]:.0f} / bwd "
              f"{1e6 * prof.host_tp_layer_s[1]:.0f} us (plain layer {1e6 * prof.host_layer_s[0]:.0f} / "
              f"{1e6 * prof.host_layer_s[1]:.0f}), ends {1e6 * prof.host_tp_ends_s[0]:.0f} / "
              f"{1e6 * prof.host_tp_ends_s[1]:.0f} us, compiled TP layer "
              f"{1e6 * prof.host_tp_compiled_layer_s[0]:.0f} / "
              f"{1e6 * prof.host_tp_compiled_layer_s[1]:.0f} us, tp all-reduce in step "
              + ", ".join(f"{1e6 * t:.0f} us at {b / 1024:g} KiB" for b, t in prof.tp_collective))
    if prof.dp_collective:
        print("dp step (dp_step): gradient all-reduce in step "
              + ", ".join(f"{1e3 * t:.2f} ms at {b / 2**20:g} MiB" for b, t in prof.dp_collective)
              + f"; a scalar all-reduce {1e3 * prof.scalar_collective_s:.2f} ms; tied-gradient exchange "
              + ("measured" if "exchange" in prof.busbw else "not measured"))
    print("predicted parts (busiest stage, per micro-batch):\n" + "\n".join(parts), flush=True)
    return out


def _memory_layouts(tmp: Path) -> None:
    """Peak tensor memory of rank 0, predicted vs measured, for MEMORY_RUNS."""
    from pentatron.hardware.catalogue import get_gpu
    from pentatron.plan.memory import memory_for_rank

    w = Workload(get_model_config("debug"), SEQ, GLOBAL)
    gpu = get_gpu("h100")  # memory does not depend on the machine's speed
    print(f"\n{'layout':<20} {'pred tensors KiB':>16} {'meas tensors KiB':>16} {'ratio':>6}   "
          f"{'pred state KiB':>14} {'meas state KiB':>14}")
    for i, (name, (lay, overrides)) in enumerate(MEMORY_RUNS.items()):
        pred = memory_for_rank(w, lay, gpu, 0, "eager")
        tensors = pred.tensors
        state = pred.model_state
        logdir = tmp / f"mem{i}"
        _train(overrides, lay.world, 3, 1, logdir)
        s = json.loads((logdir / "latest" / "profile" / "rank0.summary.json").read_text())
        meas = summary_tensor_peak(s)
        print(f"{name:<20} {tensors / 1024:>16.1f} {meas / 1024:>16.1f} {tensors / meas:>6.2f}   "
              f"{state / 1024:>14.1f} {s['model_state_bytes'] / 1024:>14.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="a `pentatron bench` profile (default: measure one now, each round)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat (bench, then the four runs) this many times and summarise the ratios: on a "
                         "shared machine one round measures the neighbours as much as the model")
    ap.add_argument("--compile", choices=("eager", "compiled", "both"), default="both",
                    help="the runs eager (train.compile=false), compiled (train.compile=true) or both (default)")
    ap.add_argument("--memory-layouts", action="store_true",
                    help="then peak tensor memory only, rank 0, for zero 1/2/3, 2 micro-batches, tp2+sp, cp2 and "
                         "full / selective recompute (one 3-step run each)")
    args = ap.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="pentatron-pvm-") as tmp:
        for r in range(args.rounds):
            profile = args.profile
            if profile is None:
                profile = str(Path(tmp) / f"cpu{r}.toml")
                _bench(profile)
            print(f"round {r + 1}/{args.rounds}, {time.strftime('%H:%M:%S')}")
            rounds.append(_round(profile, args.steps, args.warmup, Path(tmp) / f"r{r}", args.compile))
        if args.memory_layouts:
            _memory_layouts(Path(tmp))
    if len(rounds) > 1:
        print("\npredicted / measured over the rounds (median [min .. max]):")
        for name in rounds[0]:
            med = [x[name][0] / x[name][1] for x in rounds]
            best = [x[name][0] / x[name][2] for x in rounds]
            pre = [x[name][3] / x[name][1] for x in rounds]
            mem = [x[name][4] for x in rounds]
            no_dp = [x[name][5] / x[name][1] for x in rounds]
            no_pp = [x[name][6] / x[name][1] for x in rounds]
            within = sum(abs(r - 1) <= 0.25 for r in med)
            print(f"{name:<14} median step {statistics.median(med):.2f} [{min(med):.2f} .. {max(med):.2f}] "
                  f"({within}/{len(med)} within 25 %)   "
                  f"fastest step {statistics.median(best):.2f} [{min(best):.2f} .. {max(best):.2f}]   "
                  f"without the TP step {statistics.median(pre):.2f} [{min(pre):.2f} .. {max(pre):.2f}]   "
                  f"without the DP step {statistics.median(no_dp):.2f} [{min(no_dp):.2f} .. {max(no_dp):.2f}]   "
                  f"without the PP step {statistics.median(no_pp):.2f} [{min(no_pp):.2f} .. {max(no_pp):.2f}]   "
                  f"peak tensors {min(mem):.2f} .. {max(mem):.2f} "
                  f"({sum(abs(r - 1) <= 0.10 for r in mem)}/{len(mem)} within 10 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
