"""Each kind of checkpoint damage from the issue gives one clear line naming the file and exit code 2
(truncated shard, deleted file, edited meta.json, one flipped bit, another model shape); with
checkpoint.fallback=true the run resumes from the previous good checkpoint instead; DCP's own
failures (a BaseException) become the same kind of error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.store import CheckpointStore
from pentatron.cli import main

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.toml")


def _flags(tmp: Path, dataset: Path, ck: Path, *extra: str) -> list[str]:
    return [CONFIG, f"--set=data.path={json.dumps(str(dataset))}", f"--set=log.dir={json.dumps(str(tmp / 'runs'))}",
            "--set=log.progress=false", "--set=log.tensorboard=false", "--set=train.steps=2",
            "--set=checkpoint.every=1", f"--set=checkpoint.dir={json.dumps(str(ck))}", *extra]


@pytest.fixture(scope="module")
def pristine(default_dataset, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("integrity")
    ck = tmp / "ck"
    assert main(["train", *_flags(tmp, default_dataset, ck)]) == 0
    assert (ck / "latest").read_text() == "step_00000002" and (ck / "step_00000001").is_dir()
    return ck


def _shard(ck: Path) -> Path:
    return next((ck / "step_00000002").glob("*.distcp"))


def _truncate(ck: Path) -> str:
    f = _shard(ck)
    f.write_bytes(f.read_bytes()[:-100])
    return f.name


def _delete(ck: Path) -> str:
    (ck / "step_00000002" / ".metadata").unlink()
    return ".metadata"


def _edit_meta(ck: Path) -> str:
    meta = ck / "step_00000002" / "meta.json"
    meta.write_text(meta.read_text().replace('"step": 2', '"step": 7'))
    return "meta.json"


def _flip_bit(ck: Path) -> str:
    f = _shard(ck)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    return f.name


DAMAGE = {"truncated shard": (_truncate, "truncated"), "deleted file": (_delete, "missing"),
          "edited meta": (_edit_meta, "checksum"), "flipped bit": (_flip_bit, "checksum")}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_one_line_naming_the_file_and_exit_2(pristine, tmp_path, default_dataset, capsys, kind):
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    damage, words = DAMAGE[kind]
    name = damage(ck)
    assert main(["train", *_flags(tmp_path, default_dataset, ck, "--set=train.steps=3")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert name in err and "step_00000002" in err and words in err and "checkpoint.fallback=true" in err, err


def test_another_model_shape_is_refused_naming_the_field(pristine, tmp_path, default_dataset, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    assert main(["train", *_flags(tmp_path, default_dataset, ck, "--set=model.n_layers=1")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "n_layers" in err and "step_00000002" in err, err


def test_fallback_resumes_from_the_previous_good_checkpoint_only_when_asked(pristine, tmp_path, default_dataset,
                                                                               capsys):
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    _flip_bit(ck)
    flags = _flags(tmp_path, default_dataset, ck, "--set=train.steps=3", "--set=checkpoint.keep=5")
    assert main(["train", *flags, "--set=checkpoint.fallback=true"]) == 0
    out = capsys.readouterr().out
    assert "skipped damaged checkpoint" in out and "resumed from" in out and "step_00000001" in out, out
    assert (ck / "latest").read_text() == "step_00000003"
    assert json.loads((ck / "step_00000002-r1" / "meta.json").read_text())["step"] == 2  # redone, not overwritten


def test_dcp_failures_become_one_line_checkpoint_errors(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(1, {"w": torch.ones(64)}, {"step": 1})
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError) as info:
        store.load(path, {"w": torch.zeros(64)})
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg


def test_a_manifest_merged_from_the_ranks_shares_equals_one_checksummed_by_rank_0(pristine, tmp_path):
    """Each rank of a save checksums every world-th file (`write_share`); rank 0 merges the shares, and
    checksums what no share holds (meta.json) or what changed size since."""
    from pentatron.checkpoint import manifest

    source = pristine / (pristine / "latest").read_text()
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    for d in (alone, shared):
        shutil.copytree(source, d)
        (d / manifest.MANIFEST).unlink()
    want = manifest.write(alone)
    (shared / "meta.json").rename(tmp_path / "meta.json")  # written by rank 0 after the shares
    for rank in range(3):
        manifest.write_share(shared, rank, 3)
    (tmp_path / "meta.json").rename(shared / "meta.json")
    shares = [json.loads(p.read_text()) for p in sorted((shared / manifest.SHARES_DIR).glob("rank*.json"))]
    assert len(shares) == 3 and sum(len(s) for s in shares) == len(want["files"]) - 1  # all but meta.json
    assert manifest.write(shared) == want
    assert not (shared / manifest.SHARES_DIR).exists()
    manifest.verify(shared)


@pytest.mark.parametrize("share", [0, 1])
def test_two_ranks_divide_the_verification_and_rank_0_names_the_damaged_file(pristine, tmp_path, default_dataset,
                                                                              share):
    """A resume on 2 ranks (re-sharding the 1-process checkpoint to dp2): each rank checks every other file
    of the manifest; damage in either rank's share is one line on stderr, naming the file, exit 2."""
    from pentatron.checkpoint import manifest
    from tests.launchers import pentatron_nproc

    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    step = ck / "step_00000002"
    names = sorted(json.loads((step / manifest.MANIFEST).read_text())["files"])
    name = next(n for n in names[share::2] if n != "meta.json")
    data = bytearray((step / name).read_bytes())
    data[len(data) // 2] ^= 0x10
    (step / name).write_bytes(bytes(data))
    out = pentatron_nproc(_flags(tmp_path, default_dataset, ck, "--set=train.steps=3"), 2, tmp_path / "cwd")
    assert out.codes == [2], out.output
    errors = [line for line in out.output.splitlines() if line.startswith("pentatron: error:")]
    assert len(errors) == 1 and name in errors[0] and "checksum" in errors[0], out.output
    assert "Traceback" not in out.output


class _Payload:
    """What an attacker pickles into `.metadata`: unpickling it writes `marker` (any code could run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _craft_reduce(step: Path, marker: Path) -> None:
    import pickle

    (step / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))


def _craft_bytes_entry(step: Path, marker: Path) -> None:
    """A genuine DCP index whose first tensor is declared a "bytes" entry: DCP would hand that file to
    `torch.load(weights_only=False)`, which unpickles the payload."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = pickle.loads((step / ".metadata").read_bytes())  # our own, untampered file
    fqn = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[fqn] = BytesStorageMetadata()
    blob = pickle.dumps(_Payload(marker))
    (step / "__evil.distcp").write_bytes(blob)
    md.storage_data = {MetadataIndex(fqn): _StorageInfo("__evil.distcp", 0, len(blob)),
                       **{k: v for k, v in md.storage_data.items() if k.fqn != fqn}}
    (step / ".metadata").write_bytes(pickle.dumps(md))


@pytest.fixture(scope="module")
def crafted(pristine, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per kind of crafted index: (checkpoint dir, marker file the payload would create), with the manifest
    recomputed over the crafted files, as an attacker would."""
    from pentatron.checkpoint import manifest

    out = {}
    for kind, craft in {"reduce": _craft_reduce, "bytes entry": _craft_bytes_entry}.items():
        root = tmp_path_factory.mktemp("crafted")
        ck, marker = root / "ck", root / "payload-ran"
        shutil.copytree(pristine, ck)
        craft(ck / "step_00000002", marker)
        manifest.write(ck / "step_00000002")
        out[kind] = ck, marker
    return out


def _readers(ck: Path, tmp: Path, dataset: Path) -> dict[str, list[str]]:
    return {"train (resume)": ["train", *_flags(tmp, dataset, ck, "--set=train.steps=3")],
            "generate": ["generate", str(ck), "--prompt", "def ", "--max-new-tokens", "4"],
            "export-hf": ["checkpoint", "export-hf", str(ck), str(tmp / "hf")],
            "convert": ["checkpoint", "convert", str(ck), str(tmp / "converted"), CONFIG,
                        f"--set=data.path={json.dumps(str(dataset))}",
                        f"--set=log.dir={json.dumps(str(tmp / 'runs'))}"]}


@pytest.mark.parametrize("kind", ["reduce", "bytes entry"])
def test_a_crafted_index_is_refused_by_every_reader_and_its_payload_never_runs(crafted, tmp_path, default_dataset,
                                                                               capsys, kind):
    ck, marker = crafted[kind]
    for reader, argv in _readers(ck, tmp_path, default_dataset).items():
        assert main(argv) == 2, reader
        err = capsys.readouterr().err.strip()
        assert not marker.exists(), f"{reader} ran the checkpoint's code"
        assert "Traceback" not in err and len(err.splitlines()) == 1, (reader, err)
        assert ".metadata" in err and "refused" in err, (reader, err)


def test_the_checked_index_reads_what_dcp_writes(tmp_path):
    """Every dtype and shape a run saves passes the check unchanged (0-d step counters, bf16, int64)."""
    from pentatron.checkpoint.safe_metadata import read_metadata

    store = CheckpointStore(tmp_path)
    state = {"model": {"w": torch.randn(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
             "optim": {"step": torch.tensor(7), "ids": torch.arange(5)}}
    path = store.save(1, state, {"step": 1})
    assert set(read_metadata(path).state_dict_metadata) == {"model.w", "model.b", "optim.step", "optim.ids"}
    back = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
            "optim": {"step": torch.tensor(0), "ids": torch.zeros(5, dtype=torch.int64)}}
    store.load(path, back)
    assert all(torch.equal(back[p][k], state[p][k]) for p in state for k in state[p])


def _no_latest(ck: Path) -> None:
    (ck / "latest").unlink()


def _latest_is_a_directory(ck: Path) -> None:
    (ck / "latest").unlink()
    (ck / "latest").mkdir()


def _latest_is_garbage(ck: Path) -> None:
    (ck / "latest").write_bytes(bytes(range(190, 256)))  # 66 bytes, not UTF-8


POINTERS = {"missing": (_no_latest, "no `latest` pointer"), "a directory": (_latest_is_a_directory, "is not the"),
            "garbage": (_latest_is_garbage, "unreadable")}


@pytest.mark.parametrize("kind", list(POINTERS))
def test_latest_is_never_guessed(pristine, tmp_path, default_dataset, capsys, kind):
    """Step checkpoints without a usable `latest`: one line before any step, naming the newest complete
    checkpoint and the three ways on; nothing on disk changes (a fresh run would have repointed `latest`)."""
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    damage, words = POINTERS[kind]
    damage(ck)
    before = sorted(p.name for p in ck.iterdir())
    assert main(["train", *_flags(tmp_path, default_dataset, ck, "--set=train.steps=3")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert words in err and "step_00000002" in err and "--resume-from" in err, err
    assert "checkpoint.fallback=true" in err and "--force-new" in err, err
    assert sorted(p.name for p in ck.iterdir()) == before and not (tmp_path / "runs").exists()


def test_resume_from_and_fallback_choose_a_checkpoint_without_latest(pristine, tmp_path, default_dataset, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    _no_latest(ck)
    flags = _flags(tmp_path, default_dataset, ck, "--set=train.steps=3", "--set=checkpoint.keep=5")
    assert main(["train", *flags, "--resume-from", "1"]) == 0
    assert "resumed from" in (out := capsys.readouterr().out) and "step_00000001 at step 1" in out, out
    (ck / "latest").unlink()
    assert main(["train", *flags, "--set=checkpoint.fallback=true"]) == 0
    assert "step_00000003 at step 3" in (out := capsys.readouterr().out), out  # the newest complete one
    assert main(["train", *flags, "--resume-from", "step_00000009"]) == 2
    err = capsys.readouterr().err.strip()
    assert "step_00000009 is not a complete checkpoint" in err and len(err.splitlines()) == 1, err


def test_a_checkpoint_of_the_same_shape_under_another_name_resumes(pristine, tmp_path, default_dataset, capsys):
    """`checkpoint import-hf` writes model.name="custom": the shape decides, in preflight as on resume."""
    from pentatron.checkpoint import manifest

    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    step = ck / "step_00000002"
    meta = json.loads((step / "meta.json").read_text())
    meta["model"]["name"] = "custom"
    (step / "meta.json").write_text(json.dumps(meta))
    manifest.write(step)
    assert main(["train", *_flags(tmp_path, default_dataset, ck, "--set=train.steps=3")]) == 0
    assert "resumed from" in capsys.readouterr().out


@pytest.fixture(scope="module")
def nan_weights(pristine, tmp_path_factory) -> Path:
    """step 2 rewritten with one weight NaN, its manifest recomputed: a checkpoint that verifies by files."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from pentatron.checkpoint import manifest
    from pentatron.checkpoint.safe_metadata import read_metadata

    ck = tmp_path_factory.mktemp("nan") / "ck"
    shutil.copytree(pristine, ck)
    step = ck / "step_00000002"
    entries = read_metadata(step).state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in entries.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        dcp.load(state, checkpoint_id=step, no_dist=True)
        key = next(k for k in state if k.startswith("model.") and state[k].ndim == 2)
        state[key][0, 0] = float("nan")
        for f in step.glob("*.distcp"):
            f.unlink()
        dcp.save(state, checkpoint_id=step, no_dist=True)
    manifest.write(step)
    return ck


def test_non_finite_weights_are_refused_by_every_reader_and_never_written_on(nan_weights, tmp_path, default_dataset,
                                                                             capsys):
    for reader, argv in _readers(nan_weights, tmp_path, default_dataset).items():
        assert main(argv) == 2, reader
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, (reader, err)
        assert "NaN or infinite" in err and "step_00000002" in err, (reader, err)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "converted" / "latest").exists()
    assert (nan_weights / "latest").read_text() == "step_00000002"  # the resume saved nothing


def test_a_meta_json_without_a_model_is_one_line(pristine, tmp_path, capsys):
    from pentatron.checkpoint import manifest

    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    step = ck / "step_00000002"
    meta = json.loads((step / "meta.json").read_text())
    del meta["model"]
    (step / "meta.json").write_text(json.dumps(meta))
    manifest.write(step)
    assert main(["generate", str(ck), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no model config" in err and len(err.splitlines()) == 1, err


def test_a_garbage_tokenizer_is_one_line(pristine, tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(bytes(range(256)) * 4)
    assert main(["generate", str(pristine), "--tokenizer", str(bad), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a tokenizer.json" in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
