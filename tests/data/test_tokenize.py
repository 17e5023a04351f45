"""Text → token shards: formats, tokenizer training/loading, the index, atomic writes, clear errors, CLI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from pentatron.data import tokenize as tk
from pentatron.data.corpus import default_corpus_files, stdlib_dir
from pentatron.data.errors import DataError
from pentatron.data.index import INDEX_VERSION, read_index
from pentatron.data.tokenize import (
    EOS_TOKEN,
    TokenizeSettings,
    add_tokenize_parser,
    ensure_default_dataset,
    tokenize_to_shards,
)
from pentatron.writes import WriteError

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
         "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on"]
VOCAB = 320  # 256 bytes + EOS + a few merges: trains in milliseconds


def make_text(seed: int, n_words: int = 400) -> str:
    rng = np.random.default_rng(seed)
    words = rng.choice(WORDS, size=n_words)
    lines = [" ".join(words[i:i + 12]) for i in range(0, n_words, 12)]
    return "\n".join(lines) + "\n"


def write_texts(directory: Path, n: int = 3) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = directory / f"doc{i}.txt"
        p.write_text(make_text(i), encoding="utf-8")
        paths.append(p)
    return paths


def stream(out: Path) -> np.ndarray:
    index = read_index(out)
    return np.concatenate([np.fromfile(out / s.file, dtype=index.dtype) for s in index.shards])


def documents(out: Path) -> list[str]:
    """Decode the stream back into documents by splitting on EOS."""
    index = read_index(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = stream(out).tolist()
    assert ids[-1] == index.eos_id
    docs, cur = [], []
    for t in ids:
        if t == index.eos_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return docs


def settings(**kw) -> TokenizeSettings:
    return TokenizeSettings(vocab_size=kw.pop("vocab_size", VOCAB), **kw)


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------ plain text, index, shards


def test_text_files_roundtrip_through_shards_and_index(tmp_path):
    files = write_texts(tmp_path / "in")
    out = tmp_path / "ds"
    index = tokenize_to_shards(files, out, settings(shard_tokens=500), progress=False)

    assert index == read_index(out)
    on_disk = json.loads((out / "index.json").read_text())
    assert on_disk["version"] == INDEX_VERSION and on_disk["dtype"] == "uint16"
    assert index.eos_id == 0 and index.eos_token == EOS_TOKEN and index.vocab_size <= VOCAB
    assert index.num_documents == 3 and len(index.shards) > 1
    assert [s.file for s in index.shards] == [f"shard_{i:05d}.bin" for i in range(len(index.shards))]
    assert all(s.tokens == 500 for s in index.shards[:-1]) and 0 < index.shards[-1].tokens <= 500
    ids = stream(out)
    assert index.total_tokens == len(ids) == sum(s.tokens for s in index.shards)
    assert index.max_token_id == ids.max() < index.vocab_size
    assert int((ids == index.eos_id).sum()) == 3
    # Byte-level BPE is lossless: decoding each EOS-separated run gives back each file exactly.
    assert documents(out) == [f.read_text() for f in files]
    assert no_leftovers(tmp_path)


def test_directories_expand_recursively_sorted_and_skip_hidden_and_output(tmp_path):
    src = tmp_path / "corpus"
    (src / "b").mkdir(parents=True)
    (src / "a").mkdir()
    (src / "b" / "z.txt").write_text("zzz doc")
    (src / "a" / "y.txt").write_text("yyy doc")
    (src / "x.txt").write_text("xxx doc")
    (src / ".hidden").write_text("never read")
    out = src / "tok"  # output inside the input directory
    tokenize_to_shards([src], out, settings(), progress=False)
    assert documents(out) == ["yyy doc", "zzz doc", "xxx doc"]  # a/y, b/z, x (sorted relative paths)
    # Re-running must not read its own shards back as input: same inputs, same dataset.
    first = read_index(out)
    assert tokenize_to_shards([src], out, settings(), progress=False) == first


def test_training_is_deterministic_across_runs_and_processes(tmp_path):
    files = write_texts(tmp_path / "in")
    a = tokenize_to_shards(files, tmp_path / "a", settings(vocab_size=400), progress=False)
    b = tokenize_to_shards(files, tmp_path / "b", settings(vocab_size=400), progress=False)
    # A fresh interpreter has different hash seeds, the usual source of trainer non-determinism.
    code = ("import sys; from pathlib import Path; from pentatron.data.tokenize import *; "
            "tokenize_to_shards([Path(p) for p in sys.argv[2:]], Path(sys.argv[1]), "
            "TokenizeSettings(vocab_size=400), progress=False)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c"), *map(str, files)], check=True,
                   env={**os.environ, "PYTHONHASHSEED": "12345"}, timeout=120)
    for other in ("b", "c"):
        tok_a, tok_other = (tmp_path / d / "tokenizer.json" for d in ("a", other))
        assert tok_a.read_bytes() == tok_other.read_bytes()
        assert np.array_equal(stream(tmp_path / "a"), stream(tmp_path / other))
    assert a.fingerprint == b.fingerprint == read_index(tmp_path / "c").fingerprint
    # A changed input or setting is a different dataset.
    files[0].write_text(make_text(99))
    fp400 = tk.dataset_fingerprint(files, settings(vocab_size=400))
    assert fp400 != a.fingerprint and tk.dataset_fingerprint(files, settings(vocab_size=401)) != fp400


def test_existing_tokenizer_is_used_as_is(tmp_path):
    files = write_texts(tmp_path / "in")
    tokenize_to_shards(files, tmp_path / "first", settings(vocab_size=400), progress=False)
    tok_path = tmp_path / "first" / "tokenizer.json"
    other = tmp_path / "other.txt"
    other.write_text("gamma delta unseen-word ünïcödé ✓\n")

    index = tokenize_to_shards([other], tmp_path / "second",
                               settings(vocab_size=400, tokenizer_path=tok_path), progress=False)
    assert (tmp_path / "second" / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    tok = Tokenizer.from_file(str(tok_path))
    assert stream(tmp_path / "second").tolist() == tok.encode(other.read_text()).ids + [index.eos_id]
    assert documents(tmp_path / "second") == [other.read_text()]
    # A directory holding tokenizer.json (a HF model dir) works too.
    again = tokenize_to_shards([other], tmp_path / "third",
                               settings(vocab_size=400, tokenizer_path=tok_path.parent), progress=False)
    assert again.total_tokens == index.total_tokens


def test_existing_tokenizer_errors(tmp_path):
    files = write_texts(tmp_path / "in", n=1)
    tokenize_to_shards(files, tmp_path / "t", settings(vocab_size=400), progress=False)
    tok_path = tmp_path / "t" / "tokenizer.json"
    with pytest.raises(DataError, match=r"more than the requested vocab_size=300; pass --vocab-size"):
        tokenize_to_shards(files, tmp_path / "o1", settings(vocab_size=300, tokenizer_path=tok_path),
                           progress=False)
    with pytest.raises(DataError, match=r"tokenizer .*nope.json does not exist"):
        tokenize_to_shards(files, tmp_path / "o2", settings(tokenizer_path=tmp_path / "nope.json"),
                           progress=False)
    junk = tmp_path / "junk.json"
    junk.write_text("{not a tokenizer")
    with pytest.raises(DataError, match="is not a Hugging Face tokenizers tokenizer.json"):
        tokenize_to_shards(files, tmp_path / "o3", settings(tokenizer_path=junk), progress=False)
    # A tokenizer whose end-of-document token has another name needs --eos-token.
    tokenize_to_shards(files, tmp_path / "sep", settings(eos_token="<sep>"), progress=False)
    sep_tok = tmp_path / "sep" / "tokenizer.json"
    with pytest.raises(DataError, match="no end-of-document token .*--eos-token"):
        tokenize_to_shards(files, tmp_path / "o4", settings(tokenizer_path=sep_tok), progress=False)
    index = tokenize_to_shards(files, tmp_path / "o5", settings(tokenizer_path=sep_tok, eos_token="<sep>"),
                               progress=False)
    assert index.eos_token == "<sep>" and index.eos_id == 0
    assert not (tmp_path / "o1").exists() and no_leftovers(tmp_path)


# ------------------------------------------------------------------ JSONL and Parquet


def test_jsonl_documents_and_text_field(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"text": "first doc", "id": 1}, {"text": "second doc"}, {"text": None}, {"text": ""},
            {"text": "third ✓ doc", "extra": [1, 2]}]
    lines = [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines[:2] + [""] + lines[2:]))  # with a blank line
    index = tokenize_to_shards([path], tmp_path / "ds", settings(), progress=False)
    assert index.num_documents == 3  # null and empty text are skipped, blank lines ignored
    assert documents(tmp_path / "ds") == ["first doc", "second doc", "third ✓ doc"]

    custom = tmp_path / "custom.jsonl"
    custom.write_text('{"body": "one"}\n{"body": "two"}\n')
    tokenize_to_shards([custom], tmp_path / "ds2", settings(text_field="body"), progress=False)
    assert documents(tmp_path / "ds2") == ["one", "two"]


@pytest.mark.parametrize(("content", "message"), [
    ('{"text": "ok"}\n{"body": "x"}\n', r"bad.jsonl:2: no 'text' field \(found: body\); pass --text-field"),
    ('{"text": "ok"}\n{"text": 5}\n', r"bad.jsonl:2: field 'text' holds int, not text"),
    ('{"text": "ok"}\n{"text": "unterminated\n', r"bad.jsonl:2: not valid JSON"),
    ('["a", "list"]\n', r"bad.jsonl:1: no 'text' field \(found: list\)"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        tokenize_to_shards([path], tmp_path / "ds", settings(), progress=False)
    assert not (tmp_path / "ds").exists() and no_leftovers(tmp_path)


def test_parquet_documents(tmp_path, capfd):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"content": ["parquet one", None, "parquet two", ""], "n": [1, 2, 3, 4]}), path)
    index = tokenize_to_shards([path], tmp_path / "ds", settings(text_field="content"), progress=False)
    assert index.num_documents == 2
    assert documents(tmp_path / "ds") == ["parquet one", "parquet two"]

    with pytest.raises(DataError, match=r"has no column 'text' \(columns: content, n\); pass --text-field"):
        tokenize_to_shards([path], tmp_path / "x1", settings(), progress=False)
    with pytest.raises(DataError, match=r"Parquet column 'n' .* not text"):
        tokenize_to_shards([path], tmp_path / "x2", settings(text_field="n"), progress=False)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not really parquet")
    capfd.readouterr()
    with pytest.raises(DataError, match=r"cannot read Parquet file .*broken.parquet"):
        tokenize_to_shards([broken], tmp_path / "x3", settings(), progress=False)
    assert capfd.readouterr().err == ""  # no library's own line ahead of ours (datasets logged one)
    # the command, progress on (its default) into a log (not a terminal): the error is its one line
    from pentatron.cli import main

    assert main(["tokenize", str(broken), "--out", str(tmp_path / "x4")]) == 2
    err = capfd.readouterr().err
    assert err.startswith("pentatron tokenize: error: cannot read Parquet file") and err.count("\n") == 1, err
    assert no_leftovers(tmp_path)


def test_mixed_formats_keep_input_order(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("from text")
    jl = tmp_path / "b.jsonl"
    jl.write_text('{"text": "from jsonl"}\n')
    pqf = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["from parquet"]}), pqf)
    tokenize_to_shards([pqf, txt, jl], tmp_path / "ds", settings(), progress=False)
    assert documents(tmp_path / "ds") == ["from parquet", "from text", "from jsonl"]


# ------------------------------------------------------------------ bad inputs, atomicity


def test_empty_corpus_and_bad_inputs_are_clear_errors(tmp_path):
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(DataError, match=r"no text found in inputs: .*empty"):
        tokenize_to_shards([empty_dir], tmp_path / "o", settings(), progress=False)
    with pytest.raises(DataError, match=r"no text found in inputs: .*blank.txt"):
        tokenize_to_shards([tmp_path / "blank.txt"], tmp_path / "o", settings(), progress=False)
    with pytest.raises(DataError, match=r"input .*missing.txt does not exist"):
        tokenize_to_shards([tmp_path / "missing.txt"], tmp_path / "o", settings(), progress=False)
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt is not UTF-8 text \(bad byte at offset 3\)"):
        tokenize_to_shards([binary], tmp_path / "o", settings(), progress=False)
    with pytest.raises(DataError, match=r"vocab_size=100 is too small .* use at least 257"):
        tokenize_to_shards([binary], tmp_path / "o", settings(vocab_size=100), progress=False)
    with pytest.raises(DataError, match=r"shard_tokens must be a positive integer"):
        tokenize_to_shards([binary], tmp_path / "o", settings(shard_tokens=0), progress=False)
    assert not (tmp_path / "o").exists() and no_leftovers(tmp_path)


def test_crash_midway_leaves_no_dataset_but_its_work_to_continue(tmp_path, monkeypatch):
    """A failed write (here: a full disk) publishes nothing and keeps the work done in a hidden directory
    named by the fingerprint; tests/data/test_tokenize_sources.py continues such jobs."""
    files = write_texts(tmp_path / "in")
    calls = []

    def failing_flush(self):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return original(self)

    original = tk._ShardWriter.flush
    monkeypatch.setattr(tk._ShardWriter, "flush", failing_flush)
    with pytest.raises(WriteError, match=r"cannot write the dataset .*ds': disk full \(simulated\); the work done "
                                         r"is kept in .*\.ds\.partial-[0-9a-f]{16}: run the same command again"):
        tokenize_to_shards(files, tmp_path / "ds", settings(shard_tokens=300), progress=False)
    assert not (tmp_path / "ds").exists()
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # one batch: the first shard was written, the checkpoint after its batch never came (the rerun redoes it)
    assert sorted(p.name for p in partial.iterdir()) == ["lock", "progress.json", "shard_00000.bin", "tokenizer.json"]


def test_existing_output_is_reused_or_refused(tmp_path):
    files = write_texts(tmp_path / "in")
    out = tmp_path / "ds"
    first = tokenize_to_shards(files, out, settings(), progress=False)
    stamp = (out / "index.json").stat().st_mtime_ns
    assert tokenize_to_shards(files, out, settings(), progress=False) == first
    assert (out / "index.json").stat().st_mtime_ns == stamp  # not rewritten
    with pytest.raises(DataError, match="already exists and holds something else"):
        tokenize_to_shards(files[:1], out, settings(), progress=False)
    # An empty directory (e.g. made by a job script) is filled in.
    (tmp_path / "empty_out").mkdir()
    assert tokenize_to_shards(files, tmp_path / "empty_out", settings(), progress=False) == first


def test_losing_a_publish_race_keeps_the_winners_dataset(tmp_path):
    """Several processes building the same dataset: the second rename finds the first's result."""
    files = write_texts(tmp_path / "in")
    out = tmp_path / "ds"
    index = tokenize_to_shards(files, out, settings(), progress=False)
    loser = tmp_path / ".ds.tmp-loser"
    loser.mkdir()
    (loser / "index.json").write_text("{}")
    assert tk._publish(loser, out, index.fingerprint) == index
    assert not loser.exists() and read_index(out) == index


# ------------------------------------------------------------------ default corpus


def test_default_corpus_selection_is_deterministic_and_skips_tests():
    files = default_corpus_files(300_000)
    assert files == default_corpus_files(300_000)
    assert 0 < sum(f.stat().st_size for f in files) <= 300_000
    rel = [f.relative_to(stdlib_dir()).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    skipped = {"test", "tests", "idle_test", "site-packages"}
    big = [f.relative_to(stdlib_dir()).parts for f in default_corpus_files(6_000_000)]
    assert not any(skipped & set(parts[:-1]) for parts in big)
    with pytest.raises(DataError, match="must be positive"):
        default_corpus_files(0)


def test_default_dataset_is_built_once_then_cached(tmp_path):
    path = ensure_default_dataset(tmp_path / "cache", vocab_size=512, max_bytes=300_000, progress=False)
    index = read_index(path)
    assert path.parent == tmp_path / "cache" and path.name == index.fingerprint
    assert index.vocab_size == 512 and index.total_tokens > 50_000 and index.num_documents > 5
    stamp = (path / "index.json").stat().st_mtime_ns

    again = ensure_default_dataset(tmp_path / "cache", vocab_size=512, max_bytes=300_000, progress=False)
    assert again == path
    assert (path / "index.json").stat().st_mtime_ns == stamp  # read from the cache, not rebuilt
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]


# ------------------------------------------------------------------ CLI


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pentatron")
    add_tokenize_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_tokenize_success_and_input_errors(tmp_path, capsys):
    files = write_texts(tmp_path / "in")
    args = parse(["tokenize", *map(str, files), "--out", str(tmp_path / "ds"), "--vocab-size", "300",
                  "--shard-tokens", "400", "--no-progress"])
    assert args.func(args) == 0
    assert "3 documents" in capsys.readouterr().out
    assert read_index(tmp_path / "ds").vocab_size <= 300 and len(read_index(tmp_path / "ds").shards) > 1

    # --tokenizer without --vocab-size takes the tokenizer's own vocabulary.
    args = parse(["tokenize", str(files[0]), "--out", str(tmp_path / "ds2"), "--no-progress",
                  "--tokenizer", str(tmp_path / "ds" / "tokenizer.json")])
    assert args.func(args) == 0
    assert read_index(tmp_path / "ds2").vocab_size == read_index(tmp_path / "ds").vocab_size
    capsys.readouterr()

    for argv, message in [
        ([str(tmp_path / "nope.txt")], "nope.txt does not exist"),
        ([str(files[0]), "--default-corpus"], "not both"),
        ([str(files[0]), "--vocab-size", "10"], "too small"),
    ]:
        args = parse(["tokenize", *argv, "--out", str(tmp_path / "bad"), "--no-progress"])
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("pentatron tokenize: error: ") and message in err
        assert "Traceback" not in err and err.count("\n") == 1


def test_cli_tokenize_into_a_path_it_cannot_write_is_one_line(tmp_path, capsys):
    """--out under a regular file (was a FileExistsError traceback) or in a directory no one may write."""
    files = write_texts(tmp_path / "in")
    (tmp_path / "afile").write_text("x")
    unwritable = Path("/sys/pentatron-ds") if os.geteuid() == 0 else tmp_path / "ro" / "ds"
    if os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o555)
    for out, message in [(tmp_path / "afile" / "ds", "afile' is a file, not a directory"),
                         (unwritable, "choose another path")]:
        args = parse(["tokenize", *map(str, files), "--out", str(out), "--vocab-size", "300", "--no-progress"])
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pentatron tokenize: error: cannot write the dataset {str(out)!r}: "), err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in"] + (["ro"] if os.geteuid() else [])


def test_cli_defaults_to_the_builtin_corpus():
    args = parse(["tokenize", "--out", "x"])
    assert args.inputs == [] and args.vocab_size is None and args.text_field == "text"
    assert args.func is tk.run_tokenize
