"""`writes.py`, the one wrapper of the commands' write paths: a failed write is one line naming the destination
and the cause, and leaves nothing it created behind. The disk cannot be filled here: ENOSPC is raised by a
patched write inside the wrapper's block, where a real one would come from."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from pentatron.writes import WriteError, created_dirs, staged_dir


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "afile").write_text("x")
    return tmp_path / "afile" / "out"


def _unwritable(tmp_path: Path) -> Path:
    """A directory no one may create entries in: mode 555, or under root (which ignores permission bits)
    a kernel file system that refuses mkdir."""
    if os.geteuid() == 0:
        return Path("/sys/pentatron-out")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    return ro / "out"


def test_a_path_under_a_regular_file_is_named(tmp_path):
    dest = _under_a_file(tmp_path)
    for wrapper in (staged_dir, created_dirs):
        with pytest.raises(WriteError) as e, wrapper(dest / "deeper", "the export"):
            pytest.fail("the block never runs")
        assert str(e.value) == (f"cannot write the export {str(dest / 'deeper')!r}: {str(tmp_path / 'afile')!r} is a "
                                "file, not a directory; choose another path") and e.value.code == 2


def test_an_unwritable_directory_is_named(tmp_path):
    dest = _unwritable(tmp_path)
    with pytest.raises(WriteError, match=r"cannot write the dataset .*: (permission denied|read-only file system|"
                                         r"Operation not permitted).*choose another path") as e, \
            staged_dir(dest, "the dataset"):
        pytest.fail("the block never runs")
    assert e.value.code == 2


def test_a_full_disk_mid_write_leaves_nothing_behind(tmp_path):
    dest = tmp_path / "new" / "parents" / "out"
    with pytest.raises(WriteError, match=r"cannot write the export .*out': no space left on the device "
                                         r"\([\d,]+ MiB free\); free some space") as e, \
            staged_dir(dest, "the export") as tmp:
        (tmp / "half.safetensors").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "half.safetensors"))
    assert e.value.code == 1
    assert list(tmp_path.iterdir()) == []  # neither the temporary sibling nor the parents it created


def test_a_completed_write_keeps_what_it_made(tmp_path):
    dest = tmp_path / "a" / "out"
    with staged_dir(dest, "the export") as tmp:
        (tmp / "f").write_text("ok")
        tmp.rename(dest)
    assert (dest / "f").read_text() == "ok" and sorted(p.name for p in dest.parent.iterdir()) == ["out"]
    with created_dirs(tmp_path / "b" / "c", "x") as made:
        assert made.is_dir()
    assert (tmp_path / "b" / "c").is_dir()


def test_other_failures_pass_through_and_still_clean_up(tmp_path):
    with pytest.raises(KeyError), created_dirs(tmp_path / "new", "x"):
        raise KeyError("not a write")
    assert not (tmp_path / "new").exists()
