"""Finished multi-process runs must exit 0 every time: run `pentatron train --nproc N` many times with
a few steps and count the runs that did not (or that printed a C++ abort at shutdown).

    PYTHONPATH=src python benchmarks/teardown_stress.py --runs 30 --nproc 2
    PYTHONPATH=src python benchmarks/teardown_stress.py --runs 30 --nproc 4 \
        --set train.micro_batch=2 --set parallel.zero=1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(workdir: Path, nproc: int, steps: int, i: int, sets: list[str]) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pentatron.cli", "train", str(ROOT / "configs" / "debug.toml"),
           f"--nproc={nproc}", f"--set=train.steps={steps}", "--set=log.progress=false",
           f"--set=log.dir={json.dumps(str(workdir / 'runs'))}",
           f"--set=data.cache_dir={json.dumps(str(workdir / 'data'))}", *(f"--set={x}" for x in sets)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=workdir,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every run (repeatable)")
    args = parser.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory(prefix="pentatron-stress-") as tmp:
        for i in range(1, args.runs + 1):
            code, out, seconds = one_run(Path(tmp), args.nproc, args.steps, i, args.set)
            aborted = "terminate called" in out or "Aborted" in out
            ok = code == 0 and not aborted
            bad += not ok
            print(f"run {i:3d}: exit {code}{' (abort at shutdown)' if aborted else ''} in {seconds:.1f} s",
                  flush=True)
            if not ok:
                print(out[-3000:], flush=True)
    print(f"{args.runs - bad}/{args.runs} runs of --nproc {args.nproc} × {args.steps} steps exited 0 "
          f"without an abort")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
