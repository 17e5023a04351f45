"""A checkpoint that cannot be written — the disk fills up while DCP writes the tensors — ends the run with
one line naming the directory and the cause ("no space left: N MiB free, … needs ≈ M MiB"), exit code 1,
sync and async alike; the previous checkpoint stays `latest` and no partial directory is left behind.

The full disk is made where the operating system reports it, at the write: each write of DCP's tensor
files raises ENOSPC once the save of step 2 begins (root ignores permission bits and this machine has no
small file system to fill, so the fault is injected at that one call)."""

from __future__ import annotations

import errno
import io
from contextlib import contextmanager
from pathlib import Path

import pytest
from torch.distributed.checkpoint import filesystem

from pentatron.cli import main
from tests.checkpoint.test_integrity import _flags


class _FullDisk(io.RawIOBase):
    """A file on a full disk: opens, tells its position, fails every write with ENOSPC."""

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return 0

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0

    def write(self, b) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def disk_full_at_step_2(monkeypatch):
    real = filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and "step_00000002" in str(path) and str(path).endswith(".distcp"):
            yield _FullDisk()
        else:
            with real(self, path, mode) as stream:
                yield stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_is_one_line_exit_1_and_latest_stays(disk_full_at_step_2, tmp_path, default_dataset, capsys,
                                                         mode):
    ck = tmp_path / "ck"
    flags = _flags(tmp_path, default_dataset, ck, f"--set=checkpoint.async_save={str(mode == 'async').lower()}")
    assert main(["train", *flags]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("pentatron: error")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert "no space left" in errors[0] and "MiB free" in errors[0] and str(ck) in errors[0], errors[0]
    assert "latest stays step_00000001" in errors[0] or mode == "async", errors[0]
    assert (ck / "latest").read_text() == "step_00000001"
    assert sorted(p.name for p in Path(ck).glob("step_*")) == ["step_00000001"]


def test_an_async_run_stops_at_its_first_lost_save(disk_full_at_step_2, tmp_path, default_dataset, capsys):
    """Step 2's background write fails; steps 3 and 4 would save. The run used to train on and exit 0 (its
    last save succeeded), the lost save said only in passing; now, as a synchronous save, it stops at the next
    save with the one line, exit 1."""
    ck = tmp_path / "ck"
    flags = _flags(tmp_path, default_dataset, ck, "--set=checkpoint.async_save=true", "--set=train.steps=4",
                   "--set=train.peak_tflops=1.0")
    assert main(["train", *flags]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("pentatron")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith("pentatron: error: checkpoint of step 2 not saved") and "no space left" in errors[0]
    assert (ck / "latest").read_text() == "step_00000001"
    assert sorted(p.name for p in Path(ck).glob("step_*")) == ["step_00000001"]
