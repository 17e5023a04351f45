"""Wall time and CPU time of a pytest run, every process it started included — the suite's cost on a
shared machine, where wall time follows the neighbours' load but CPU seconds mostly do not.

    python benchmarks/suite_cpu.py tests/checkpoint/test_reshard.py tests/parallel -k "not demo"

The arguments go to `python -m pytest -q -p no:cacheprovider`. This process becomes a child subreaper, so
processes orphaned on the way (a fork server, a launcher's ranks) are reparented to it and reaped here:
their CPU time is counted too, which plain `time` misses. Prints the load average before and after.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(args: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    load_before = os.getloadavg()
    start = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args])
    wall = time.monotonic() - start
    while True:  # reap the orphans that pytest left behind
        try:
            os.wait()
        except ChildProcessError:
            break
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"suite_cpu: wall {wall:.1f} s, cpu {use.ru_utime + use.ru_stime:.1f} s (user {use.ru_utime:.1f}, "
          f"sys {use.ru_stime:.1f}), load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}, exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
