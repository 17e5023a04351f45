"""Results computed once per test run and read by every pytest-xdist worker that asks for them.

`make test` runs two workers; a session cache (functools.cache) is per process, so two test files that read
the same multi-process runs (test_data.py and test_zero.py read dp_harness's) paid for them twice, once in
each worker: ~1 minute of the 2-core machine. `shared(key, compute)` computes under a file lock in a
directory of this run (named by xdist's run id, which the controller fixes and removes at the end:
tests/conftest.py); the worker that asks second waits for the first and unpickles its result. Without xdist
it just computes. A failed computation leaves nothing behind (the next asker computes, and fails, itself).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
RUN_ID_ENV = "PYTEST_XDIST_TESTRUNUID"  # set by pytest-xdist in each worker


def shared_dir(run_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"pentatron-tests-{run_id}"


def shared(key: str, compute: Callable[[], T]) -> T:
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        return compute()
    root = shared_dir(run_id)
    root.mkdir(exist_ok=True)
    path = root / f"{key}.pkl"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the holder dies
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(value))
        tmp.replace(path)
        return value
