"""Training time blocked per checkpoint save, synchronous vs asynchronous (`checkpoint.async_save`).

One process, CPU, fp32: for each model and mode, `--saves` rounds of (one training step, one save), as
in a run with checkpoint.every=1 — so an async save overlaps the next step and the next save waits for
whatever is left of it. Prints, per save, the seconds the trainer was blocked (the finite check, the
wait for the previous save, staging to CPU, and for sync the write, manifest and publish) and, for
async, the seconds until the checkpoint was published.

    PYTHONPATH=src python benchmarks/checkpoint_save.py --models debug smollm-135m --saves 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pentatron.config import load_config
from pentatron.data.tokenize import ensure_default_dataset


def measure(model: str, mode: str, saves: int, dataset: Path, tmp: Path) -> dict[str, float]:
    from pentatron.train.trainer import Trainer

    cfg = load_config(None, [f"model.name='{model}'", "train.steps=1000", "train.seq_len=32", "train.micro_batch=1",
                             "train.global_batch=1", "train.precision='fp32'", "train.device='cpu'",
                             "train.peak_tflops=1.0", "log.progress=false", "log.tensorboard=false",
                             f"log.dir={json.dumps(str(tmp / 'log' / mode))}", "checkpoint.keep=1",
                             f"checkpoint.dir={json.dumps(str(tmp / 'ck' / (model + mode)))}",
                             f"checkpoint.async_save={'true' if mode == 'async' else 'false'}"])
    trainer = Trainer(cfg, dataset_dir=dataset)
    step_s = []
    for _ in range(saves):
        start = time.perf_counter()
        trainer.train_step()
        step_s.append(time.perf_counter() - start)
        trainer.save_checkpoint()
    start = time.perf_counter()
    if trainer.async_saver is not None:
        trainer.async_saver.wait()
    tail = time.perf_counter() - start
    size = sum(f.stat().st_size for f in (tmp / "ck" / (model + mode)).rglob("*") if f.is_file())
    trainer.engine.close()
    return {"blocked_median_s": statistics.median(trainer.save_blocked_s), "blocked_max_s": max(trainer.save_blocked_s),
            "step_median_s": statistics.median(step_s), "final_wait_s": tail, "dir_bytes": size,
            "params": trainer.n_params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["debug", "smollm-135m"])
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pentatron-ckpt-bench-") as tmp:
        dataset = ensure_default_dataset(Path(tmp) / "data", vocab_size=4096, max_bytes=400_000, progress=False)
        print("| model | params | mode | blocked per save (median / max) | train step | last save's remaining write "
              "| checkpoint dir |")
        print("|---|---|---|---|---|---|---|")
        for model in args.models:
            for mode in ("sync", "async"):
                r = measure(model, mode, args.saves, dataset, Path(tmp))
                print(f"| {model} | {r['params'] / 1e6:.1f}M | {mode} | {r['blocked_median_s']:.3f} s / "
                      f"{r['blocked_max_s']:.3f} s | {r['step_median_s']:.2f} s | {r['final_wait_s']:.3f} s | "
                      f"{r['dir_bytes'] / 2**20:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
