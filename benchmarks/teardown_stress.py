"""Multi-process runs must exit with their own code every time: run `pentatron train --nproc N` many
times and count the runs that did not (or that printed a C++ abort at shutdown). Finished runs (a few
steps) must exit 0; with `--damaged-resume` each run resumes a checkpoint with one bit flipped, which
every rank learns from a broadcast just before they all stop: exit 2 and one error line. `--busy K`
keeps K busy loops running beside the runs (a loaded machine is where a late exit races).

    PYTHONPATH=src python benchmarks/teardown_stress.py --runs 30 --nproc 2
    PYTHONPATH=src python benchmarks/teardown_stress.py --runs 30 --nproc 4 \
        --set train.micro_batch=2 --set parallel.zero=1
    PYTHONPATH=src python benchmarks/teardown_stress.py --runs 20 --nproc 2 --damaged-resume --busy 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(workdir: Path, nproc: int | None, steps: int, sets: list[str]) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pentatron.cli", "train", str(ROOT / "configs" / "debug.toml"),
           *([f"--nproc={nproc}"] if nproc else []), f"--set=train.steps={steps}", "--set=log.progress=false",
           f"--set=log.dir={json.dumps(str(workdir / 'runs'))}",
           f"--set=data.cache_dir={json.dumps(str(workdir / 'data'))}", *(f"--set={x}" for x in sets)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=workdir,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


def damaged_copy(pristine: Path, dest: Path) -> None:
    """`pristine` copied to `dest` with one bit flipped in the middle of its newest step's DCP metadata."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(pristine, dest)
    target = dest / (dest / "latest").read_text().strip() / ".metadata"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--damaged-resume", action="store_true",
                        help="resume a damaged checkpoint in every run (expect exit 2 and one error line)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops to run beside the runs")
    args = parser.parse_args()
    want = 2 if args.damaged_resume else 0
    bad = 0
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="pentatron-stress-") as tmp:
            sets, pristine, ck = list(args.set), Path(tmp) / "pristine", Path(tmp) / "ck"
            if args.damaged_resume:  # one checkpointed 1-process run; every run below resumes a damaged copy
                code, out, _ = one_run(Path(tmp), None, 2, [*sets, "checkpoint.every=1",
                                                            f"checkpoint.dir={json.dumps(str(pristine))}"])
                if code != 0:
                    print(out[-3000:])
                    return 1
                sets += [f"checkpoint.dir={json.dumps(str(ck))}"]
            for i in range(1, args.runs + 1):
                if args.damaged_resume:
                    damaged_copy(pristine, ck)
                code, out, seconds = one_run(Path(tmp), args.nproc, args.steps, sets)
                aborted = "terminate called" in out or "Aborted" in out
                errors = [line for line in out.splitlines() if line.startswith("pentatron: error:")]
                ok = code == want and not aborted and (want == 0 or len(errors) == 1)
                bad += not ok
                print(f"run {i:3d}: exit {code}{' (abort at shutdown)' if aborted else ''} in {seconds:.1f} s",
                      flush=True)
                if not ok:
                    print(out[-3000:], flush=True)
    finally:
        for p in busy:
            p.kill()
    what = "resumes of a damaged checkpoint" if args.damaged_resume else f"runs of {args.steps} steps"
    print(f"{args.runs - bad}/{args.runs} {what} with --nproc {args.nproc} exited {want} without an abort"
          f"{f' ({args.busy} busy loops beside them)' if args.busy else ''}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
