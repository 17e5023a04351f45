import os
import shutil
import uuid

import pytest
import torch

from tests.multiprocess import rank_threads
from tests.shared_runs import shared_dir

# Every test process computes with the ranks' intra-op threads (1 unless PENTATRON_TEST_RANK_THREADS says), and
# so do the commands the tests start (OMP_NUM_THREADS): `make test` runs 2 workers on 2 cores, and a process of
# 2 OpenMP threads whose peer thread is descheduled waits for it at every parallel region. Measured under load:
# bench's host-overhead measurement 23 s with 2 threads against 3 s with 1; the bench test 281 s against 132 s.
os.environ.setdefault("OMP_NUM_THREADS", str(rank_threads()))
torch.set_num_threads(rank_threads())

# A small slice of the built-in corpus (Python's standard library): big enough for the loss to fall,
# small enough to tokenize in seconds on the 2-core CI machine.
SMALL_CORPUS_BYTES = 400_000

# The costliest files, costliest first (per-file time of a whole `make test`, BENCHMARKS.md "Test suite").
# `make test` hands whole files to 2 workers in collection order (`--dist loadfile --no-loadscope-reorder`):
# started first, the long files end before the many short ones do, and the two workers finish together
# (longest-first scheduling). xdist's own order (most tests first) left single-test files of 1-2 minutes
# for last, on one worker, with the other idle.
LONGEST_FIRST = (
    "tests/checkpoint/test_reshard.py", "tests/plan/test_cli.py", "tests/parallel/test_compile_parity.py",
    "tests/test_readme.py", "tests/test_entrypoint_errors.py", "tests/parallel/test_context_parity.py",
    "tests/parallel/test_moe_parity.py", "tests/plan/test_verify.py", "tests/test_multinode.py",
    "tests/checkpoint/test_async_save.py", "tests/test_job_signals.py", "tests/parallel/test_composition_parity.py",
    "tests/checkpoint/test_convert.py", "tests/test_run_lifecycle.py", "tests/parallel/pipeline/test_engine.py",
    "tests/plan/test_emit.py", "tests/checkpoint/test_integrity.py", "tests/train/test_trainer.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # The controller fixes xdist's run id (which every worker reads as PYTEST_XDIST_TESTRUNUID), so that it
    # knows which directory of shared results (tests/shared_runs.py) to remove when the run ends.
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None) \
            and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config: pytest.Config) -> None:
    run_id = getattr(config.option, "testrunuid", None)
    if not hasattr(config, "workerinput") and run_id:
        shutil.rmtree(shared_dir(run_id), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = [path for path in LONGEST_FIRST if not (config.rootpath / path).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def default_dataset(tmp_path_factory):
    from pentatron.data.tokenize import ensure_default_dataset

    return ensure_default_dataset(tmp_path_factory.mktemp("data-cache"), vocab_size=4096,
                                  max_bytes=SMALL_CORPUS_BYTES, progress=False)


@pytest.fixture(scope="session")
def documents_dataset(tmp_path_factory):
    """Short packed documents (tests/documents_data.py): the document-masking parity data."""
    from tests.documents_data import write_documents_dataset

    return write_documents_dataset(tmp_path_factory.mktemp("documents") / "ds")


@pytest.fixture
def unreadable(monkeypatch):
    """`deny(path)`: make a file unreadable (mode 000). Root ignores permission bits, so under root opening a
    denied file also raises EACCES here, at `open` (what pathlib, numpy and every reader call), as the kernel
    does for anyone else."""
    import builtins
    import errno
    import io
    import os

    denied: set[str] = set()

    def deny(path) -> None:
        os.chmod(path, 0)
        denied.add(os.path.abspath(path))

    if os.geteuid() == 0:
        real_open = builtins.open

        def guarded_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) in denied:
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", guarded_open)
        monkeypatch.setattr(io, "open", guarded_open)
    yield deny
    for path in denied:
        os.chmod(path, 0o644)
