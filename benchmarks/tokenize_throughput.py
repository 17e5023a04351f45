"""Tokens/s of `pentatron tokenize` against a plain `tokenizers` batch loop, on the same local corpus, in one run.

The corpus: this Python's standard-library source (the built-in corpus's files, cut at blank lines into ~4 KB
documents), repeated up to `--mb` MB, as one local Parquet file (one document per row), or a `save_to_disk`
directory with `--format saved`. The tokenizer: a byte-level BPE of `--vocab` tokens trained here on the first
2 MB (or `--tokenizer` PATH).

- plain loop: pyarrow reads the column in batches of `--batch` rows, `Tokenizer.encode_batch` (all cores, the
  Rust side), ids + the end-of-document token into one numpy array per batch; nothing written.
- pentatron tokenize: the command (`pentatron tokenize CORPUS --out DIR --tokenizer T`), end to end: input
  hashing (the fingerprint), reading, encoding, shards written and fsynced, the index.

Each is run `--repeats` times, alternating; the fastest of each is reported, and the ratio is the median of the
pairs' ratios (each pair ran back to back, under the same load: the machine may be shared). Both must produce the
same number of tokens (checked).

    PYTHONPATH=src python benchmarks/tokenize_throughput.py --mb 8 --repeats 7
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pentatron.cli import main as cli
from pentatron.data.corpus import default_corpus_files
from pentatron.data.index import read_index
from pentatron.data.tokenize import EOS_TOKEN, _train_tokenizer, load_tokenizer


def make_corpus(root: Path, mb: int, fmt: str) -> tuple[Path, list[str]]:
    files = default_corpus_files(6_000_000)
    texts, size = [], 0
    while size < mb * 2**20:
        for f in files:
            for t in _documents(f.read_text(encoding="utf-8", errors="replace")):
                texts.append(t)
                size += len(t.encode())
            if size >= mb * 2**20:
                break
    if fmt == "saved":
        from datasets import Dataset

        path = root / "corpus_saved"
        Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    else:
        path = root / "corpus.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=4096)
    return path, texts


def _documents(source: str, size: int = 4096) -> list[str]:
    """A source file cut at blank lines into documents of about `size` characters (web-page-sized, rather than
    whole modules: the batches then hold many documents, as in a real corpus)."""
    out, cur = [], ""
    for block in source.split("\n\n"):
        cur = f"{cur}\n\n{block}" if cur else block
        if len(cur) >= size:
            out.append(cur)
            cur = ""
    return [*out, cur] if cur else out


def plain_loop(path: Path, tok_path: Path, batch: int) -> tuple[int, float]:
    tok = load_tokenizer(tok_path)
    eos = np.array([tok.token_to_id(EOS_TOKEN)], dtype=np.uint32)
    start = time.perf_counter()
    total = 0
    if path.is_dir():
        from datasets import load_from_disk

        batches = (b["text"] for b in load_from_disk(str(path)).iter(batch_size=batch))
    else:
        batches = (b.column(0).to_pylist() for b in pq.ParquetFile(path).iter_batches(batch_size=batch,
                                                                                        columns=["text"]))
    for texts in batches:
        parts = []
        for enc in tok.encode_batch([t for t in texts if t], add_special_tokens=False):
            parts += (np.asarray(enc.ids, dtype=np.uint32), eos)
        total += np.concatenate(parts).size
    return total, time.perf_counter() - start


def pentatron_tokenize(path: Path, tok_path: Path, out: Path) -> tuple[int, float]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(["tokenize", str(path), "--out", str(out), "--tokenizer", str(tok_path), "--no-progress"])
    elapsed = time.perf_counter() - start
    assert code == 0, code
    return read_index(out).total_tokens, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=32, help="corpus size in MB (default %(default)s)")
    ap.add_argument("--format", choices=("parquet", "saved"), default="parquet")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokenizer", type=Path, help="an existing tokenizer.json (default: train one here)")
    ap.add_argument("--batch", type=int, default=1024, help="rows per encode_batch in the plain loop")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        path, texts = make_corpus(tmp, args.mb, args.format)
        tok_path = args.tokenizer
        if tok_path is None:
            head, size = [], 0
            for t in texts:
                head.append(t)
                size += len(t)
                if size > 2 * 2**20:
                    break
            tok_path = tmp / "tokenizer.json"
            _train_tokenizer(iter(head), args.vocab, EOS_TOKEN).save(str(tok_path))
        plain, ours = [], []
        for _ in range(args.repeats):
            plain.append(plain_loop(path, tok_path, args.batch))
            ours.append(pentatron_tokenize(path, tok_path, tmp / "out"))
        (tp, sp), (to, so) = min(plain, key=lambda r: r[1]), min(ours, key=lambda r: r[1])
        assert tp == to, f"token counts differ: plain loop {tp}, pentatron tokenize {to}"
        # each pair ran back to back, under the same load: the median of their ratios is the figure
        pairs = [p_s / o_s for (_, p_s), (_, o_s) in zip(plain, ours)]
        result = {"corpus_mb": args.mb, "format": args.format, "documents": len(texts), "tokens": tp,
                  "cpus": os.cpu_count(), "rayon_threads": os.environ.get("RAYON_NUM_THREADS", "all"),
                  "plain_loop_tokens_per_s": tp / sp, "pentatron_tokens_per_s": to / so,
                  "ratio_median_of_pairs": statistics.median(pairs), "ratio_of_bests": (to / so) / (tp / sp),
                  "plain_s": [round(s, 3) for _, s in plain], "pentatron_s": [round(s, 3) for _, s in ours]}
    print(f"corpus: {args.mb} MB, {len(texts):,} documents ({args.format}), {tp:,} tokens, {os.cpu_count()} CPUs")
    print(f"plain tokenizers batch loop: {result['plain_loop_tokens_per_s']:,.0f} tokens/s (best of {args.repeats})")
    print(f"pentatron tokenize:          {result['pentatron_tokens_per_s']:,.0f} tokens/s (best of {args.repeats}, "
          "end to end: hashing, reading, encoding, shards fsynced)")
    print(f"ratio pentatron / plain loop: {result['ratio_median_of_pairs']:.3f} (median over {args.repeats} pairs run "
          f"back to back; ratio of the bests {result['ratio_of_bests']:.3f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
