"""Start-up memory of sharded initialisation: each rank's peak RSS, launch → end of the run, on 8 CPU ranks.

    python benchmarks/startup_memory.py [--layers 16] [--phases train,resume,import] [--src DIR] [--out DIR]

A ~1B Llama (h 2048, ffn 5632, vocab 32000, 32 heads / 8 kv heads, untied; 16 layers ≈ 0.85B parameters)
trained by `pentatron train --nproc 8` in dp2 × tp2 (+sp) × pp2, ZeRO-3, fp32, seq 128, micro-batch 1, one
micro-batch per step (global batch 2: with more, pipelined ZeRO-3 keeps the stage's gradients unsharded
until the step's last backward — one more copy of the stage's parameters, which 8 ranks of this model
cannot afford on a 24 GiB machine):

- train:  1 step from sharded init, a checkpoint saved at the end;
- resume: the same run resumed from that checkpoint (same layout: DCP's local-shard load), 1 more step;
- import: `checkpoint export-hf` of that checkpoint, `checkpoint import-hf` of the HF directory (both one
  process, measured too), then a run resumed from the imported step-0 checkpoint (a re-sharding load
  from the 1-process layout), 1 step.

Each worker's VmHWM (/proc/<pid>/status: the kernel's peak resident set) is polled every 0.2 s until it
exits. The bound compared against: 1.3 × (the rank's model state — parameters, gradients and AdamW
state of its stage's layers / tp / dp, counted from the model's shapes, plus ZeRO-3's working set, the
gathered units and gradient buckets in flight, as rank 0's engine measured it — plus its activations (the
planner's per-layer formula, one micro-batch in flight, the last stage's logits) plus the process baseline, the
peak of the same 8-rank run of a 2-layer, h 64, 4096-vocab model, which holds the interpreter, torch, gloo and the
data loader). `--src DIR` runs another source tree (e.g. the
code before sharded init, `git archive <commit> src | tar -x -C DIR`) with the train phase only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHAPE = {"vocab_size": 32000, "hidden_size": 2048, "ffn_hidden_size": 5632, "n_heads": 32, "n_kv_heads": 8}
LAYOUT = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sp=true", "parallel.zero=3"]


def _model_sets(layers: int, shape: dict[str, int]) -> list[str]:
    return ["model.name='smollm-1.7b'", f"model.n_layers={layers}", "model.tie_embeddings=false",
            "model.max_seq_len=512", *(f"model.{k}={v}" for k, v in shape.items())]


def _workers(root: int) -> list[int]:
    """Descendant pids of `root` that are rank processes (RANK in their environment)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            todo.append(c)
            try:
                if b"\0RANK=" in b"\0" + Path(f"/proc/{c}/environ").read_bytes():
                    out.append(c)
            except OSError:
                pass
    return out


def _hwm(pid: int) -> tuple[int | None, int]:
    """(RANK, VmHWM bytes) of a live process."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return rank, int(line.split()[1]) * 1024
    return rank, 0


def run_measured(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run `cmd`; the peak RSS of every rank process (by RANK), or of the process itself when it has none."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        peaks: dict[int, int] = {}
        own = 0
        while proc.poll() is None:
            for pid in _workers(proc.pid):
                try:
                    rank, hwm = _hwm(pid)
                except OSError:
                    continue
                if rank is not None:
                    peaks[rank] = max(peaks.get(rank, 0), hwm)
            with contextlib.suppress(OSError):
                own = max(own, _hwm(proc.pid)[1])
            time.sleep(0.2)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}")
    return {"peaks": dict(sorted(peaks.items())), "own": own, "seconds": round(time.perf_counter() - start, 1)}


def _zero3_transient(log: Path) -> int:
    """Rank 0's ZeRO-3 working set as its engine measured it (gathered units + gradient buckets in flight:
    `memory.transient_peak` of the run's metrics), from the metrics file the run's summary names."""
    for line in log.read_text().splitlines():
        if line.strip().startswith("metrics "):
            records = [json.loads(r) for r in Path(line.split(None, 1)[1]).read_text().splitlines() if r.strip()]
            return max((r["memory"]["transient_peak"] for r in records if "memory" in r), default=0)
    return 0


def model_state_bytes(layers: int, shape: dict[str, int], seq: int) -> tuple[dict[int, int], dict[int, int]]:
    """Per rank: fp32 parameters + gradients + AdamW (exp_avg, exp_avg_sq) of its pipeline stage, split over
    tp (every matrix; the norms replicated) and ZeRO-3 over dp — 16 B per element it owns; and its
    activations (`parallel/activation_memory.layer_activation_bytes`, the formula the planner uses)."""
    import dataclasses

    sys.path.insert(0, str(REPO / "src"))
    from pentatron.models.registry import get_model_config
    from pentatron.parallel.activation_memory import layer_activation_bytes
    from pentatron.parallel.pipeline.stages import stage_layers

    cfg = dataclasses.replace(get_model_config("smollm-1.7b"), n_layers=layers, tie_embeddings=False,
                              max_seq_len=512, **shape)
    h, kv, f, v = cfg.hidden_size, cfg.kv_dim, cfg.ffn_hidden_size, cfg.vocab_size
    layer = (2 * h * h + 2 * h * kv + 3 * h * f) / 2 + 2 * h  # tp2 matrices + replicated norms
    out, act = {}, {}
    per_layer = layer_activation_bytes(cfg, seq, 1, tp=2, sp=True)
    for pp_rank, lay in enumerate(stage_layers(cfg, 2, 1, seq)):
        n = len(lay) * layer + (v * h / 2 if pp_rank == 0 else v * h / 2 + h)
        # one micro-batch in flight: its layers' saved activations, and on the last stage the fp32 logits
        # of this rank's vocabulary slice (the logits, their softmax and its gradient)
        a = len(lay) * per_layer + (3 * 4 * seq * v // 2 if pp_rank == 1 else 0)
        for dp in range(2):
            for tp in range(2):
                out[pp_rank * 4 + dp * 2 + tp] = int(16 * n / 2)  # ZeRO-3 over dp=2
                act[pp_rank * 4 + dp * 2 + tp] = int(a)
    return out, act


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--phases", default="train,resume,import")
    ap.add_argument("--src", default="", help="another source tree to run (train phase only)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--baseline-bytes", type=int, default=0, help="with --no-baseline: the baseline to use")
    ap.add_argument("--out", default="")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and the HF directory")
    ap.add_argument("--hf", default="", help="import phase: an existing HF directory (no export-hf)")
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="pentatron-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    src = Path(args.src).resolve() / "src" if args.src else REPO / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    py = sys.executable
    common = [f"train.seq_len={args.seq}", "train.micro_batch=1", "train.global_batch=2", "train.precision='fp32'",
              "train.warmup=0", "log.tensorboard=false", "log.progress=false", *LAYOUT]

    def train(tag: str, layers: int, shape: dict[str, int], steps: int, ckpt: Path | None) -> dict[str, Any]:
        sets = [*common, *_model_sets(layers, shape), f"train.steps={steps}", f"log.dir='{work / tag}'"]
        if ckpt is not None:
            sets.append(f"checkpoint.dir='{ckpt}'")
        cmd = [py, "-m", "pentatron.cli", "train", "--nproc", "8", *(f"--set={s}" for s in sets)]
        res = run_measured(cmd, env, work / f"{tag}.log")
        res["zero3_transient"] = _zero3_transient(work / f"{tag}.log")
        print(f"{tag}: {res}", flush=True)
        return res

    results: dict[str, Any] = {"layers": args.layers, "seq": args.seq, "src": str(src)}
    if not args.no_baseline:
        results["baseline"] = train("baseline", 2, {"vocab_size": 4096, "hidden_size": 64, "ffn_hidden_size": 64,
                                                    "n_heads": 4, "n_kv_heads": 2}, 1, None)
    phases = args.phases.split(",")
    ckpt = work / "ckpt"
    if "train" in phases:
        results["train"] = train("train", args.layers, SHAPE, 1, None if args.src else ckpt)
    if "resume" in phases:
        results["resume"] = train("resume", args.layers, SHAPE, 2, ckpt)
    if "import" in phases:
        hf, ckpt2 = (Path(args.hf) if args.hf else work / "hf"), work / "ckpt_imported"
        shutil.rmtree(ckpt2, ignore_errors=True)
        if not args.hf:
            results["export_hf"] = run_measured([py, "-m", "pentatron.cli", "checkpoint", "export-hf", str(ckpt),
                                                 str(hf), "--overwrite"], env, work / "export.log")
        results["import_hf"] = run_measured([py, "-m", "pentatron.cli", "checkpoint", "import-hf", str(hf),
                                             str(ckpt2)], env, work / "import.log")
        print(f"export-hf: {results.get('export_hf')}\nimport-hf: {results['import_hf']}", flush=True)
        if not args.keep and ckpt.exists():
            shutil.rmtree(ckpt)  # the disk: a 1B fp32 training checkpoint is 13.6 GB
        results["imported"] = train("imported", args.layers, SHAPE, 1, ckpt2)
    if not args.keep:
        for d in (ckpt, work / "ckpt_imported", *([] if args.hf else [work / "hf"])):
            shutil.rmtree(d, ignore_errors=True)
    state, act = model_state_bytes(args.layers, SHAPE, args.seq)
    n_full = 4 * (2 * SHAPE["vocab_size"] * SHAPE["hidden_size"] + args.layers * (
        2 * SHAPE["hidden_size"] ** 2 + 2 * SHAPE["hidden_size"] * SHAPE["hidden_size"] // 4
        + 3 * SHAPE["hidden_size"] * SHAPE["ffn_hidden_size"]))
    results["full_fp32_model_bytes"] = n_full
    results["model_state_bytes"], results["activation_bytes"] = state, act
    base = max(results["baseline"]["peaks"].values()) if "baseline" in results else 0
    gib = 2**30
    print(f"\nfull fp32 model: {n_full / gib:.2f} GiB; process baseline (peak of a tiny run): {base / gib:.2f} GiB")
    if not base and args.baseline_bytes:
        base = args.baseline_bytes
    print(f"{'phase':<10} {'rank':>4} {'peak RSS GiB':>13} {'state GiB':>10} {'zero3 GiB':>8} {'act GiB':>8} "
          f"{'bound GiB':>10} {'peak/bound':>10}")
    for phase in ("train", "resume", "imported"):
        if phase not in results:
            continue
        z3 = results[phase].get("zero3_transient", 0)
        for rank, peak in results[phase]["peaks"].items():
            bound = 1.3 * (state[rank] + z3 + act[rank] + base)
            print(f"{phase:<10} {rank:>4} {peak / gib:>13.2f} {state[rank] / gib:>10.2f} {z3 / gib:>8.2f} "
                  f"{act[rank] / gib:>8.2f} {bound / gib:>10.2f} {peak / bound:>10.2f}")
    (work / "startup_memory.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults: {work / 'startup_memory.json'}")


if __name__ == "__main__":
    main()
