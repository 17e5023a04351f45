"""`pentatron tokenize` on Hugging Face `datasets` sources held locally (save_to_disk directories, .json records;
Parquet and JSONL beside them) and continuing interrupted jobs — Ctrl-C, a failed write, kill -9 — into the very
bytes an uninterrupted job writes. Corpora are made here, tiny."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pentatron.cli import main
from pentatron.data import tokenize as tk
from pentatron.data.errors import DataError
from pentatron.data.index import read_index
from pentatron.data.tokenize import TokenizeSettings, tokenize_to_shards
from pentatron.writes import WriteError
from tests.data.test_tokenize import VOCAB, documents, make_text, stream

TEXTS = [make_text(i, 60 + 7 * i) for i in range(40)]
ROWS = [{"text": t, "n": i} for i, t in enumerate(TEXTS)] + [{"text": None, "n": -1}, {"text": "", "n": -2}]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The same 40 documents (plus an empty and a null text) in every format, and a tokenizer trained on them."""
    from datasets import Dataset, DatasetDict

    root = tmp_path_factory.mktemp("sources")
    cols = {"text": [r["text"] for r in ROWS], "n": [r["n"] for r in ROWS]}
    Dataset.from_dict(cols).save_to_disk(str(root / "saved"))
    DatasetDict({"train": Dataset.from_dict(cols), "test": Dataset.from_dict({"text": ["held out"], "n": [0]})}
                ).save_to_disk(str(root / "splits"))
    pq.write_table(pa.table(cols), root / "rows.parquet")
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "rows.json").write_text(json.dumps(ROWS))
    ref = root / "ref"
    tokenize_to_shards([root / "rows.jsonl"], ref, TokenizeSettings(vocab_size=VOCAB), progress=False)
    return root


def _with(root: Path, **kw) -> TokenizeSettings:
    return TokenizeSettings(vocab_size=VOCAB, tokenizer_path=root / "ref" / "tokenizer.json", **kw)


def test_saved_datasets_json_parquet_and_jsonl_give_the_same_tokens(corpora, tmp_path):
    ref = stream(corpora / "ref")
    for name, kw in [("saved", {}), ("splits", {"split": "train"}), ("rows.json", {}), ("rows.parquet", {})]:
        out = tmp_path / name
        index = tokenize_to_shards([corpora / name], out, _with(corpora, **kw), progress=False)
        assert np.array_equal(stream(out), ref), name
        assert index.num_documents == len(TEXTS)
    assert documents(tmp_path / "saved") == TEXTS
    # a directory holding a saved dataset: read as one input, through `datasets` (its Arrow files are not text)
    (tmp_path / "tree").mkdir()
    os.symlink(corpora / "saved", tmp_path / "tree" / "saved")
    (tmp_path / "tree" / "zz.txt").write_text("last")
    tokenize_to_shards([tmp_path / "tree"], tmp_path / "tree_ds", _with(corpora), progress=False)
    assert documents(tmp_path / "tree_ds") == [*TEXTS, "last"]
    tokenize_to_shards([corpora / "splits"], tmp_path / "test_split", _with(corpora, split="test"), progress=False)
    assert documents(tmp_path / "test_split") == ["held out"]


def test_source_errors_are_one_clear_line(corpora, tmp_path, capsys):
    for kw, message in [({}, r"saved dataset .*splits holds the splits train, test: pass --split NAME"),
                        ({"split": "dev"}, r"has no split 'dev' \(splits: train, test\)"),
                        ({"split": "train", "text_field": "body"}, r"has no column 'body' \(columns: text, n\)"),
                        ({"split": "train", "text_field": "n"}, r"column 'n' of saved dataset .* not text")]:
        with pytest.raises(DataError, match=message):
            tokenize_to_shards([corpora / "splits"], tmp_path / "x", _with(corpora, **kw), progress=False)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"text": "a"}, {"text": ')
    assert main(["tokenize", str(bad), "--out", str(tmp_path / "y"), "--tokenizer",
                 str(corpora / "ref" / "tokenizer.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pentatron tokenize: error: cannot read JSON file") and err.count("\n") == 1, err
    with pytest.raises(DataError, match=r"JSON file .*rows.json has no field 'body' \(fields: text, n\)"):
        tokenize_to_shards([corpora / "rows.json"], tmp_path / "z", _with(corpora, text_field="body"), progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # bad input: no work kept


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# A job killed by SIGKILL (no handler runs) right after its third shard reached the disk, before its checkpoint.
KILLED_JOB = """
import os, signal, sys
from pentatron.data import tokenize as tk
flush, calls = tk._ShardWriter.flush, []
def dying_flush(self):
    flush(self)
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
tk._ShardWriter.flush = dying_flush
tk.tokenize_to_shards(sys.argv[2:], sys.argv[1], tk.TokenizeSettings(vocab_size=%d, shard_tokens=500, batch_docs=3),
                      progress=False)
"""


def test_interrupted_jobs_continue_into_the_same_bytes(corpora, tmp_path, monkeypatch, capsys):
    """kill -9, then a failed write, then Ctrl-C, then the end: the dataset equals an uninterrupted job's, file
    for file (tokenizer trained in the first job and kept; shards; index)."""
    src = [corpora / "rows.parquet", corpora / "saved"]
    argv = ["tokenize", *map(str, src), "--vocab-size", str(VOCAB), "--shard-tokens", "500", "--no-progress"]
    settings = TokenizeSettings(vocab_size=VOCAB, shard_tokens=500, batch_docs=3)
    whole = tokenize_to_shards(src, tmp_path / "whole", settings, progress=False)
    assert len(whole.shards) > 8

    out = tmp_path / "ds"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tk.__file__).parents[2]), *sys.path])}
    killed = subprocess.run([sys.executable, "-c", KILLED_JOB % VOCAB, str(out), *map(str, src)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ds.partial-")]
    assert not out.exists() and "shard_00002.bin" in os.listdir(partial)  # written after the last checkpoint

    flush, calls = tk._ShardWriter.flush, []

    def failing(self, fail_at: int, error: BaseException):
        flush(self)
        calls.append(1)
        if len(calls) == fail_at:
            raise error

    stats: dict = {}
    monkeypatch.setattr(tk._ShardWriter, "flush", lambda self: failing(self, 2, OSError("disk full (simulated)")))
    with pytest.raises(WriteError, match="the work done is kept in"):
        tokenize_to_shards(src, out, settings, progress=False, stats=stats)
    calls.clear()
    monkeypatch.setattr(tk._ShardWriter, "flush", lambda self: failing(self, 2, KeyboardInterrupt()))
    assert main([*argv, "--out", str(out)]) == 130  # the command: Ctrl-C is one line, exit 130
    assert "interrupted; run the same command again" in capsys.readouterr().err
    monkeypatch.setattr(tk._ShardWriter, "flush", flush)
    index = tokenize_to_shards(src, out, settings, progress=False, stats=stats)
    assert 0 < stats["resumed_documents"] < whole.num_documents
    assert stats["documents"] == whole.num_documents - stats["resumed_documents"]
    assert index == whole and _files(out) == _files(tmp_path / "whole")
    assert not partial.exists() and read_index(out).num_documents == 2 * len(TEXTS)
