"""The loader's contract: packing, deterministic order, exact resume, DP sharding equal to 1 process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pentatron.data.errors import DataError
from pentatron.data.index import INDEX_VERSION, DatasetIndex, ShardInfo, token_dtype
from pentatron.data.loader import TokenDataset, TokenLoader
from pentatron.data.tokenize import TokenizeSettings, tokenize_to_shards


def write_dataset(directory: Path, tokens: np.ndarray, shard_tokens: int, vocab_size: int = 1000,
                  fingerprint: str = "f" * 16) -> Path:
    """A dataset directory in the on-disk format, with exactly the given token stream."""
    directory.mkdir(parents=True)
    dtype = token_dtype(vocab_size)
    shards = []
    for i, start in enumerate(range(0, len(tokens), shard_tokens)):
        chunk = tokens[start:start + shard_tokens].astype(dtype)
        chunk.tofile(directory / f"shard_{i:05d}.bin")
        shards.append(ShardInfo(f"shard_{i:05d}.bin", len(chunk)))
    index = DatasetIndex(version=INDEX_VERSION, dtype=dtype.name, vocab_size=vocab_size, eos_id=0,
                         eos_token="<|endoftext|>", shards=tuple(shards), total_tokens=len(tokens),
                         num_documents=1, max_token_id=int(tokens.max()), fingerprint=fingerprint)
    (directory / "index.json").write_text(json.dumps(index.to_json()))
    return directory


@pytest.fixture
def raw() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 1000, size=2003)


@pytest.fixture
def dataset(tmp_path, raw) -> TokenDataset:
    # 97-token shards: many samples straddle a shard boundary.
    return TokenDataset(write_dataset(tmp_path / "ds", raw, shard_tokens=97))


def steps(loader: TokenLoader, n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [loader.next_step() for _ in range(n)]


def flat(step: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for sa, sb in zip(a, b, strict=True):
        assert len(sa) == len(sb)
        for (xa, ya), (xb, yb) in zip(sa, sb, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ------------------------------------------------------------------ packing


def test_packing_matches_the_raw_stream(dataset, raw):
    seq = 16
    loader = TokenLoader(dataset, seq_len=seq, micro_batch=2, global_batch=8, seed=3)
    assert len(dataset) == len(raw) and loader.num_samples == (len(raw) - 1) // seq
    for i in range(loader.num_samples):  # every sample, including those crossing shards
        assert np.array_equal(loader.sample(i), raw[i * seq:i * seq + seq + 1])
    for _ in range(3):
        first = loader.consumed_samples
        ids = loader.sample_ids(first, 8)
        micro = loader.next_step()
        assert len(micro) == 4
        for x, y in micro:
            assert x.shape == y.shape == (2, seq) and x.dtype == y.dtype == torch.int64
        x, y = flat(micro)
        for row, i in enumerate(ids):
            window = torch.from_numpy(raw[i * seq:i * seq + seq + 1].astype(np.int64))
            assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])
        assert loader.consumed_samples == first + 8


def test_read_spans_shards_and_checks_bounds(dataset, raw):
    assert np.array_equal(dataset.read(90, 300), raw[90:300])
    assert np.array_equal(dataset.read(0, len(raw)), raw)
    assert dataset.read(5, 5).size == 0
    with pytest.raises(IndexError):
        dataset.read(0, len(raw) + 1)


def test_uint32_datasets_for_large_vocabularies(tmp_path):
    tokens = np.arange(69_990, 70_000).repeat(3)
    ds = TokenDataset(write_dataset(tmp_path / "big", tokens, shard_tokens=7, vocab_size=70_000))
    assert ds.index.dtype == "uint32" and np.array_equal(ds.read(0, len(tokens)), tokens)
    ds.check_vocab(70_000)
    with pytest.raises(DataError, match="token ids up to 69999 but model.vocab_size=65536"):
        ds.check_vocab(65_536)


# ------------------------------------------------------------------ order, determinism, epochs


def test_same_seed_same_batches_different_seed_different(dataset):
    a = steps(TokenLoader(dataset, 16, 2, 8, seed=7), 5)
    b = steps(TokenLoader(dataset, 16, 2, 8, seed=7), 5)
    c = steps(TokenLoader(dataset, 16, 2, 8, seed=8), 5)
    assert_same(a, b)
    assert not all(torch.equal(flat(sa)[0], flat(sc)[0]) for sa, sc in zip(a, c, strict=True))


def test_each_epoch_is_a_permutation_and_epochs_continue_seamlessly(dataset):
    loader = TokenLoader(dataset, seq_len=16, micro_batch=1, global_batch=7, seed=1)
    n = loader.num_samples  # 125: not a multiple of 7, so steps straddle epochs
    order = loader.sample_ids(0, 3 * n)
    epochs = order.reshape(3, n)
    for e in range(3):
        assert sorted(epochs[e].tolist()) == list(range(n))
    assert not np.array_equal(epochs[0], epochs[1])
    assert np.array_equal(epochs[1], np.random.default_rng([1, 1]).permutation(n))

    seen = []
    for _ in range(40):  # 280 samples: through epoch 0 and 1 into 2
        x, _ = flat(loader.next_step())
        seen.append(x)
    expected = torch.stack([torch.from_numpy(loader.sample(int(i))[:-1].astype(np.int64)) for i in order[:280]])
    assert torch.equal(torch.cat(seen), expected)
    assert loader.epoch == 280 // n


# ------------------------------------------------------------------ resume


def test_resume_from_state_dict_is_exact(dataset):
    uninterrupted = steps(TokenLoader(dataset, 16, 2, 8, seed=5), 10)

    first = TokenLoader(dataset, 16, 2, 8, seed=5)
    assert_same(steps(first, 5), uninterrupted[:5])
    state = first.state_dict()
    assert state["consumed_samples"] == 40 and state["seed"] == 5

    resumed = TokenLoader(dataset, 16, 2, 8, seed=0)  # the state's seed wins
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert_same(steps(resumed, 5), uninterrupted[5:])

    by_constructor = TokenLoader(dataset, 16, 2, 8, seed=5, consumed_samples=5 * 8)
    assert_same(steps(by_constructor, 5), uninterrupted[5:])


def test_resume_refuses_a_different_order(dataset, tmp_path, raw):
    state = TokenLoader(dataset, 16, 2, 8).state_dict()
    with pytest.raises(DataError, match="seq_len=16 but this run uses seq_len=32"):
        TokenLoader(dataset, 32, 2, 8).load_state_dict(state)
    other = TokenDataset(write_dataset(tmp_path / "other", raw, shard_tokens=500, fingerprint="0" * 16))
    with pytest.raises(DataError, match="resume with the same dataset"):
        TokenLoader(other, 16, 2, 8).load_state_dict(state)
    with pytest.raises(DataError, match="malformed"):
        TokenLoader(dataset, 16, 2, 8).load_state_dict({"seed": 0})


# ------------------------------------------------------------------ data parallel


@pytest.mark.parametrize(("dp", "micro_batch"), [(2, 2), (2, 4), (4, 1), (8, 1)])
def test_dp_ranks_together_equal_the_single_process_batch(dataset, dp, micro_batch):
    global_batch = 8
    single = steps(TokenLoader(dataset, 16, micro_batch=4, global_batch=global_batch, seed=2), 20)
    ranks = [steps(TokenLoader(dataset, 16, micro_batch, global_batch, dp_rank=r, dp_size=dp, seed=2), 20)
             for r in range(dp)]
    for s in range(20):
        assert all(len(ranks[r][s]) == global_batch // dp // micro_batch for r in range(dp))
        x1, y1 = flat(single[s])
        xs, ys = zip(*(flat(ranks[r][s]) for r in range(dp)), strict=True)
        assert torch.equal(torch.cat(xs), x1) and torch.equal(torch.cat(ys), y1)  # in rank order


def test_resume_onto_a_different_dp_layout(dataset):
    """The state is rank-independent: a dp=1 checkpoint continues exactly on dp=2."""
    single = TokenLoader(dataset, 16, 4, 8, seed=4)
    steps(single, 3)
    state = single.state_dict()
    expected = steps(single, 3)
    ranks = []
    for r in range(2):
        loader = TokenLoader(dataset, 16, 2, 8, dp_rank=r, dp_size=2)
        loader.load_state_dict(state)
        ranks.append(steps(loader, 3))
    for s in range(3):
        assert torch.equal(torch.cat([flat(ranks[0][s])[0], flat(ranks[1][s])[0]]), flat(expected[s])[0])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"global_batch": 10, "micro_batch": 2, "dp_size": 2}, r"global_batch=10 must be divisible by dp\*micro"),
    ({"dp_rank": 2, "dp_size": 2}, r"dp_rank=2 is outside \[0, dp_size=2\)"),
    ({"micro_batch": 0}, "micro_batch must be a positive integer"),
    ({"seed": -1}, "seed must be a non-negative integer"),
])
def test_bad_batch_settings(dataset, kwargs, message):
    args = {"seq_len": 16, "micro_batch": 2, "global_batch": 8} | kwargs
    with pytest.raises(DataError, match=message):
        TokenLoader(dataset, **args)


# ------------------------------------------------------------------ bad data


def test_missing_index_suggests_tokenize(tmp_path):
    with pytest.raises(DataError, match=r"no tokenized dataset in .*nothing: index.json is missing.*tokenize"):
        TokenDataset(tmp_path / "nothing")


def test_missing_and_truncated_shards_are_named(tmp_path, raw):
    path = write_dataset(tmp_path / "ds", raw, shard_tokens=500)
    shard = path / "shard_00002.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"shard .*shard_00002.bin has 990 bytes but index.json expects 1000"):
        TokenDataset(path)
    shard.unlink()
    with pytest.raises(DataError, match=r"shard .*shard_00002.bin is missing"):
        TokenDataset(path)


def test_an_unreadable_shard_is_named(tmp_path, raw, unreadable):
    path = write_dataset(tmp_path / "ds", raw, shard_tokens=500)
    training = TokenDataset(path)
    unreadable(path / "shard_00001.bin")  # was numpy's PermissionError traceback
    # made unreadable while training: what the run opened stays readable, the run goes on
    np.testing.assert_array_equal(training.read(400, 600), raw[400:600])
    with pytest.raises(DataError, match=r"shard .*shard_00001.bin cannot be read \(Permission denied\); make the "
                                        r"dataset readable"):
        TokenDataset(path)


def test_malformed_index(tmp_path, raw):
    path = write_dataset(tmp_path / "ds", raw, shard_tokens=500)
    (path / "index.json").write_text("{truncated")
    with pytest.raises(DataError, match="is not readable JSON"):
        TokenDataset(path)
    (path / "index.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(DataError, match="format version 99"):
        TokenDataset(path)
    (path / "index.json").write_text(json.dumps({"version": INDEX_VERSION, "dtype": "uint16"}))
    with pytest.raises(DataError, match="malformed"):
        TokenDataset(path)


def test_token_ids_beyond_model_vocab(dataset):
    dataset.check_vocab(1000)
    with pytest.raises(DataError, match=r"token ids up to 999 but model.vocab_size=512.*at least 1000"):
        dataset.check_vocab(512)


def test_too_few_tokens_for_one_sample(tmp_path):
    ds = TokenDataset(write_dataset(tmp_path / "tiny", np.arange(1, 17), shard_tokens=100))
    TokenLoader(ds, seq_len=15, micro_batch=1, global_batch=1)  # 16 tokens = exactly one sample
    with pytest.raises(DataError, match=r"has 16 tokens, fewer than seq_len\+1 = 17"):
        TokenLoader(ds, seq_len=16, micro_batch=1, global_batch=1)


# ------------------------------------------------------------------ end to end with real tokenization


def test_tokenized_text_loads_back(tmp_path):
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text(text.upper())
    out = tmp_path / "ds"
    tokenize_to_shards([tmp_path / "a.txt", tmp_path / "b.txt"], out,
                       TokenizeSettings(vocab_size=300, shard_tokens=1000), progress=False)
    ds = TokenDataset(out)
    ds.check_vocab(300)
    loader = TokenLoader(ds, seq_len=32, micro_batch=4, global_batch=8)
    stream = ds.read(0, len(ds)).astype(np.int64)
    assert int((stream == ds.eos_id).sum()) == 2 and stream[-1] == ds.eos_id
    for x, y in loader.next_step():
        assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) <= ds.max_token_id


def test_a_shard_truncated_while_training_is_named_not_a_sigbus(tmp_path):
    """Reading a memory-mapped shard past its new end is a SIGBUS that kills the process silently (exit 135);
    a size check before each read left a window (the data is touched after the check). Shards are read with
    pread now: tokens already read are the process's own, and a read past the new end is a short read, named.
    Run in a child process, so that a regression is a failed assertion, not a dead test runner."""
    import subprocess
    import sys

    tokens = np.random.default_rng(0).integers(0, 1000, size=40_000)
    path = write_dataset(tmp_path / "ds", tokens, shard_tokens=20_000)  # 40 KB a shard: pages past the cut
    script = (f"from pentatron.data.loader import TokenDataset\nfrom pentatron.data.errors import DataError\n"
              f"ds = TokenDataset({str(path)!r})\nbefore = ds.read(35_000, 35_100)\n"
              f"open({str(path / 'shard_00001.bin')!r}, 'r+b').truncate(100)\n"
              "print('kept', int(before.sum()))\n"  # read before the cut, used after it (the window)
              "try:\n    ds.read(35_000, 35_100).sum()\nexcept DataError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert f"kept {int(tokens[35_000:35_100].sum())}" in done.stdout, done.stdout
    assert "shard_00001.bin shrank to 100 bytes while training" in done.stdout, done.stdout
