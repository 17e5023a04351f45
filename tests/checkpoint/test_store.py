"""The checkpoint store's atomicity rules, on a 1-process DCP save/load."""

import torch

from pentatron.checkpoint.store import CheckpointStore


def _save(store: CheckpointStore, step: int, value: float):
    return store.save(step, {"w": torch.full((4,), value)}, {"step": step})


def test_latest_points_to_the_newest_complete_checkpoint_and_old_ones_are_pruned(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        _save(store, step, float(step))
    assert (tmp_path / "latest").read_text() == "step_00000003"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    state = {"w": torch.zeros(4)}
    assert store.load(store.latest(), state)["step"] == 3 and torch.equal(state["w"], torch.full((4,), 3.0))


def test_saving_a_step_again_never_removes_the_checkpoint_latest_names(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    first = _save(store, 2, 1.0)
    again = _save(store, 2, 5.0)
    assert first.name == "step_00000002" and again.name == "step_00000002-r1"
    assert first.is_dir() and (tmp_path / "latest").read_text() == again.name
    state = {"w": torch.zeros(4)}
    store.load(store.latest(), state)
    assert torch.equal(state["w"], torch.full((4,), 5.0))


def test_an_unreadable_checkpoint_file_is_named_by_the_verification(tmp_path, unreadable):
    """Every reader (resume, convert, generate, export-hf) verifies the files first: a file of mode 000 is its
    one line, a CheckpointError (exit 2), not a PermissionError traceback from the checksum."""
    import pytest

    from pentatron.checkpoint import manifest
    from pentatron.checkpoint.errors import CheckpointError

    path = _save(CheckpointStore(tmp_path, keep=2), 1, 1.0)
    shard = next(path.glob("*.distcp"))
    unreadable(shard)
    with pytest.raises(CheckpointError, match=rf"{shard}: cannot be read \(Permission denied\); make the checkpoint "
                                              "readable"):
        manifest.verify(path)


def test_a_save_that_cannot_create_its_directory_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """The save's `.tmp` directory and its pieces are written inside the save's error handling: a checkpoint.dir
    under a regular file, or a full disk while the pieces are written, is the CheckpointWriteError line (was a
    traceback, and the `.tmp` stayed)."""
    import errno
    import os

    import pytest

    from pentatron.checkpoint import store as store_module
    from pentatron.checkpoint.errors import CheckpointWriteError

    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointWriteError, match=r"checkpoint of step 1 not saved in .*afile/ck \(.*Error"):
        CheckpointStore(tmp_path / "afile" / "ck").save(1, {"w": {"x": torch.ones(4)}}, {"step": 1})

    def full_disk(tmp, rank, pieces):
        (tmp / "pieces").mkdir()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "pieces" / "rank0.json"))

    monkeypatch.setattr(store_module, "write_pieces", full_disk)
    store = CheckpointStore(tmp_path / "ck")
    with pytest.raises(CheckpointWriteError, match=r"step 1 not saved .*no space left.*latest stays none"):
        store.save(1, {"w": {"x": torch.ones(4)}}, {"step": 1}, pieces={"x": []})
    assert list((tmp_path / "ck").iterdir()) == []
