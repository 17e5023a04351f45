"""How long `pentatron plan` takes, start-up and import included: the 70B / 256-GPU search and fully given
layouts (pp = 1 and pp = 2), each run N times as its own process; prints min and median wall and CPU
(user + sys) seconds. `--src DIR` times another source tree (e.g. a `git archive` of an older commit) the
same way; given twice or more, the trees' runs alternate (A B A B ...), so that a loaded machine slows them
alike and their ratio is fair. CPU seconds are the robust figure when other processes share the cores.

    python benchmarks/plan_speed.py --runs 5 [--src /tmp/old/src [--src src]]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "search llama3-70b on 256 h100": ["--model", "llama3-70b", "--gpus", "256", "--gpu", "h100", "--seq", "4096",
                                      "--global-batch-tokens", "4M"],
    "fixed llama3-8b tp2+sp pp1": ["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq", "4096", "--tp", "2",
                                   "--sp", "--pp", "1", "--dp", "4", "--cp", "1", "--zero", "1", "--micro-batch", "1",
                                   "--recompute", "none"],
    "fixed llama3-8b tp2+sp pp2": ["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq", "4096", "--tp", "2",
                                   "--sp", "--pp", "2", "--pp-schedule", "1f1b", "--dp", "2", "--cp", "1",
                                   "--zero", "1", "--micro-batch", "1", "--recompute", "none"],
}


def _once(argv: list[str], src: str) -> tuple[float, float]:
    """(wall, user + sys CPU) seconds of one `pentatron plan` process."""
    env = {**os.environ, "PYTHONPATH": src}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pentatron.cli", "plan", *argv], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--src", action="append", help="source tree to time (repeat to compare, interleaved)")
    args = p.parse_args()
    srcs = args.src or [str(Path(__file__).resolve().parents[1] / "src")]
    names = [f"{chr(65 + i)}={src}" for i, src in enumerate(srcs)] if len(srcs) > 1 else srcs
    print(f"src {', '.join(names)}, load {os.getloadavg()[0]:.1f}")
    tree = "  tree" if len(srcs) > 1 else ""
    print(f"{'case':<32}{tree} {'wall min':>9} {'median':>8} {'cpu min':>8} {'median':>8}")
    for name, argv in CASES.items():
        runs: dict[str, list[tuple[float, float]]] = {src: [] for src in srcs}
        for _ in range(args.runs):
            for src in srcs:
                runs[src].append(_once(argv, src))
        for i, src in enumerate(srcs):
            walls, cpus = [r[0] for r in runs[src]], [r[1] for r in runs[src]]
            label = f"  {chr(65 + i):>4}" if tree else ""
            print(f"{name:<32}{label} {min(walls):>9.2f} {statistics.median(walls):>8.2f} {min(cpus):>8.2f} "
                  f"{statistics.median(cpus):>8.2f}")
    print(f"load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
