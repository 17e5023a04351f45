"""`pentatron checkpoint convert`, run as a user runs it (real processes, the CLI): a dp2 ZeRO-2 checkpoint
re-written by 4 ranks as tp2 × pp2 (interleaved, 2 virtual stages), then by 1 process back to one
process. The converted checkpoints hold bitwise the same parameters and AdamW state, the same step, data
position and lineage; a run in the target layout resumes the converted checkpoint as saved (no
re-sharding at resume) and its losses continue the uninterrupted 1-process run's, in float64 to `EXACT_RTOL`.

What runs on one process (the reference run, the conversion back to one process, the refusals) calls the
CLI's `main` in this process: the same code as `python -m pentatron.cli`, without a fresh interpreter
importing torch for each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pentatron.checkpoint import manifest
from pentatron.checkpoint.reshard import assembled, read_pieces
from tests.launchers import Outcome, in_process, pentatron
from tests.reference_loop import EXACT_RTOL, FP64

TARGET = ["tp=2", "pp=2", "pp_schedule=interleaved", "pp_virtual=2"]


def _common(dataset: Path) -> list[str]:
    return [f"--set={o}" for o in ("train.seq_len=32", "train.micro_batch=2", "train.global_batch=8",
                                   "train.warmup=2", "train.schedule='cosine'", "train.peak_tflops=1.0",
                                   "parallel.bucket_mb=0.05", "log.progress=false", "log.tensorboard=false",
                                   f"data.path={json.dumps(str(dataset))}", FP64)]


def _ok(outcome: Outcome) -> str:
    assert outcome.codes == [0], outcome.output
    return outcome.output


def _losses(log_dir: Path) -> dict[int, float]:
    (metrics,) = [p for p in log_dir.glob("*/metrics.jsonl") if p.parent.name != "latest"]
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def _latest(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


def _full_state(step_dir: Path) -> dict[tuple[str, str], np.ndarray]:
    """Every (parameter, field) of a checkpoint as a full tensor; a tied head is its embedding."""
    saved = read_pieces(step_dir)
    keys = [k for k in saved if k[0] != "lm_head.weight" or ("embed.weight", k[1]) not in saved]
    return {k: full.numpy() for k, full in zip(keys, assembled(step_dir, [saved[k] for k in keys]), strict=True)}


@pytest.fixture(scope="module")
def runs(default_dataset, tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("convert")
    common = _common(default_dataset)
    _ok(in_process(["train", *common, "--set=train.steps=4", f"--set=log.dir={root / 'ref'}"], root))
    _ok(pentatron(["train", *common, "--set=train.steps=2", "--set=parallel.zero=2", f"--set=log.dir={root / 'a'}",
                   f"--set=checkpoint.dir={root / 'src'}", "--nproc=2"], root))
    converted = _ok(pentatron(["checkpoint", "convert", str(root / "src"), str(root / "dst"), *common,
                               f"--to-layout={','.join(TARGET)}", "--nproc=4"], root))
    resumed = _ok(pentatron(["train", *common, "--set=train.steps=4", f"--set=log.dir={root / 'b'}",
                             *[f"--parallel.{kv}" for kv in TARGET], f"--set=checkpoint.dir={root / 'dst'}",
                             "--nproc=4"], root))
    # Back to one process, from the converted checkpoint's step directory (kept beside the resumed run's).
    _ok(in_process(["checkpoint", "convert", str(root / "dst" / "step_00000002"), str(root / "one"), *common], root))
    return {"root": root, "converted": converted, "resumed": resumed}


def test_the_converted_checkpoint_holds_the_same_state_step_data_position_and_lineage(runs):
    root = runs["root"]
    src, dst, one = _latest(root / "src"), root / "dst" / "step_00000002", _latest(root / "one")
    assert src.name == one.name == "step_00000002"
    assert "re-sharded" in runs["converted"] and "converted" in runs["converted"]
    metas = [json.loads((d / "meta.json").read_text()) for d in (src, dst, one)]
    for meta in metas[1:]:
        assert meta["step"] == 2 and meta["loader"] == metas[0]["loader"] and meta["model"] == metas[0]["model"]
        assert meta["run_id"] == metas[0]["run_id"]
    assert metas[1]["layout"]["tp"] == 2 and metas[1]["layout"]["pp_virtual"] == 2
    assert metas[2]["layout"]["tp"] == 1 and metas[2]["layout"]["zero"] == 0
    assert len(list(dst.glob("*.distcp"))) == 4
    saved = _full_state(src)
    assert {field for _, field in saved} >= {"param", "exp_avg", "exp_avg_sq", "step"}
    for other in (dst, one):
        manifest.verify(other)
        state = _full_state(other)
        assert state.keys() == saved.keys()
        for key, value in saved.items():
            np.testing.assert_array_equal(state[key], value, err_msg=f"{other}: {key}")


def test_a_run_in_the_target_layout_resumes_it_as_saved_and_continues_the_run(runs):
    root = runs["root"]
    assert "resumed from" in runs["resumed"] and "re-sharded" not in runs["resumed"]
    ref, first, then = _losses(root / "ref"), _losses(root / "a"), _losses(root / "b")
    assert list(first) == [1, 2] and list(then) == [3, 4]
    np.testing.assert_allclose([*first.values(), *then.values()], list(ref.values()), rtol=EXACT_RTOL, atol=0)


def test_convert_refuses_bad_input_before_any_rank_starts(runs, default_dataset):
    root = runs["root"]
    common = _common(default_dataset)
    cases = [
        (["checkpoint", "convert", str(root / "src"), str(root / "dst"), *common],
         "already holds checkpoints; give a new"),
        (["checkpoint", "convert", str(root / "missing"), str(root / "x1"), *common], "no such checkpoint directory"),
        (["checkpoint", "convert", str(root / "src"), str(root / "x2"), *common, "--to-layout=tp"],
         "expected KEY=VALUE pairs"),
        (["checkpoint", "convert", str(root / "src"), str(root / "x3"), *common, "--to-layout=tp=3", "--nproc=3"],
         "tp=3 does not divide"),
        (["checkpoint", "convert", str(root / "src"), str(root / "x4"), *common, "--set=model.n_layers=2"],
         "holds another model (n_layers=4 vs 2 here)"),
    ]
    for args, expected in cases:
        outcome = in_process(args, root)
        assert outcome.codes == [2], outcome.output
        assert expected in outcome.output and "Traceback" not in outcome.output, outcome.output
        assert outcome.output.count("pentatron: error:") == 1, outcome.output


def test_convert_refuses_a_destination_that_is_not_empty(tmp_path):
    """The help says DST is a new (empty) directory; one holding anything but checkpoints was written into."""
    from pentatron.config import load_config
    from pentatron.preflight import convert_problems

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "meta.json").write_text("{}")
    dst.mkdir()
    cfg = load_config(None, [f"checkpoint.dir={json.dumps(str(dst))}", "checkpoint.resume=false"], world_size=1)
    (dst / ".lock").write_text("")  # this job's own lock (rank 0 takes it before the other ranks look) is no content
    assert convert_problems(cfg, src, 1, rank=1) == []
    (dst / "notes.txt").write_text("mine")
    assert convert_problems(cfg, src, 1, rank=1) == [f"the destination {dst} is not empty; give a new (or empty) "
                                                     "directory"]


def _edit_pieces(step: Path) -> None:
    """A piece's range moved past its tensor (lo > hi), in every rank's file that describes it."""
    for f in (step / "pieces").glob("rank*.json"):
        records = json.loads(f.read_text())
        for d in records.values():
            if d["field"] == "param":
                d["lo"] = d["hi"] + 1
        f.write_text(json.dumps(records))


def _path_typed_storage_meta(step: Path) -> None:
    """The genuine index re-pickled with a path where DCP's storage record belongs (the unpickler allows
    paths: DCP's own records hold them)."""
    import pickle

    md = pickle.loads((step / ".metadata").read_bytes())  # our own, untampered file
    md.storage_meta = Path("/etc/passwd")
    (step / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize(("edit", "expected"), [
    (_edit_pieces, "pieces: model/"), (_path_typed_storage_meta, ".metadata: refused: its storage_meta is a"),
])
def test_convert_of_an_edited_checkpoint_is_one_line(runs, default_dataset, tmp_path, edit, expected):
    """Edited (manifest recomputed, as an editor would) and converted into one process, so re-sharded from
    its pieces: a traceback from deep in the join (pieces) or in DCP's loader (storage_meta) before."""
    import shutil

    src = tmp_path / "src" / "step_00000002"
    shutil.copytree(_latest(runs["root"] / "src"), src)
    edit(src)
    manifest.write(src)
    outcome = in_process(["checkpoint", "convert", str(src), str(tmp_path / "dst"), *_common(default_dataset)],
                         tmp_path)
    assert outcome.codes == [2], outcome.output
    assert expected in outcome.output and "Traceback" not in outcome.output, outcome.output
    assert outcome.output.count("pentatron: error:") == 1 and not (tmp_path / "dst" / "latest").exists()
