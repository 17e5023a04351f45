"""Problems found before step 1 instead of at the first save or mid-run: an unwritable checkpoint
directory, one without room for (keep + 1) checkpoints of the predicted size, and token ids beyond the
vocabulary in a shard whose index says otherwise — on 1 process and on tp=2 (where the vocabulary-
parallel embedding used to embed them silently as zeros). Each is exit 2, one message, no step run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pentatron.checkpoint.space import predicted_checkpoint_bytes
from pentatron.cli import main
from pentatron.data.errors import DataError
from pentatron.data.index import read_index
from pentatron.data.loader import TokenDataset, TokenLoader
from tests.launchers import pentatron_nproc

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.toml")


def _flags(tmp: Path, dataset: Path, ck: Path | str, *extra: str) -> list[str]:
    return [CONFIG, f"--set=data.path={json.dumps(str(dataset))}", f"--set=log.dir={json.dumps(str(tmp / 'runs'))}",
            "--set=log.progress=false", "--set=log.tensorboard=false", "--set=train.steps=2",
            f"--set=checkpoint.dir={json.dumps(str(ck))}", *extra]


def _no_step_ran(tmp: Path) -> bool:
    return not list((tmp / "runs").rglob("metrics.jsonl"))


def test_unwritable_checkpoint_dir_fails_before_step_1(tmp_path, default_dataset, capsys):
    if os.geteuid() == 0:  # root ignores permission bits: a kernel file system refuses mkdir instead
        ck = Path("/sys/pentatron-checkpoints")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        ck = ro / "ck"
    assert main(["train", *_flags(tmp_path, default_dataset, ck)]) == 2
    err = capsys.readouterr().err
    assert "is not writable" in err and str(ck) in err and "Traceback" not in err, err
    assert _no_step_ran(tmp_path)


def test_a_directory_without_room_for_keep_plus_one_checkpoints_fails_before_step_1(tmp_path, default_dataset,
                                                                                    capsys):
    free = shutil.disk_usage(tmp_path).free
    layers = 8
    # A model whose (keep + 1) predicted checkpoints exceed this disk's free space (it is never built).
    while 3 * predicted_checkpoint_bytes(layers * 12 * 4096**2, torch.float32) <= free:
        layers *= 2
    extra = ["--set=model.hidden_size=4096", "--set=model.n_heads=32", "--set=model.n_kv_heads=32",
             "--set=model.ffn_hidden_size=16384", f"--set=model.n_layers={layers}", "--set=checkpoint.keep=2"]
    assert main(["train", *_flags(tmp_path, default_dataset, tmp_path / "ck", *extra)]) == 2
    err = capsys.readouterr().err
    assert "free but" in err and "(checkpoint.keep + 1)" in err and "Traceback" not in err, err
    assert _no_step_ran(tmp_path)


def test_predicted_size_is_close_to_a_real_checkpoint(tmp_path, default_dataset):
    ck = tmp_path / "ck"
    assert main(["train", *_flags(tmp_path, default_dataset, ck)]) == 0
    real = sum(f.stat().st_size for f in (ck / (ck / "latest").read_text()).rglob("*") if f.is_file())
    from pentatron.config import load_config

    n = load_config(CONFIG).model_config().num_params()
    predicted = predicted_checkpoint_bytes(n, torch.float32)
    assert real <= predicted <= 1.1 * real, (real, predicted)


BAD_ID_OFFSET = 1234


@pytest.fixture(scope="module")
def bad_dataset(default_dataset, tmp_path_factory) -> tuple[Path, str, int]:
    """A copy of the dataset with one id ≥ vocab in its first shard; index.json still says all fit."""
    out = tmp_path_factory.mktemp("bad-data") / "ds"
    shutil.copytree(default_dataset, out)
    index = read_index(out)
    shard = index.shards[0]
    data = np.memmap(out / shard.file, dtype=index.dtype, mode="r+", shape=(shard.tokens,))
    data[BAD_ID_OFFSET] = index.vocab_size + 3
    data.flush()
    return out, shard.file, index.vocab_size


@pytest.mark.parametrize("nproc", [1, 2])
def test_token_ids_beyond_the_vocabulary_are_named_with_shard_and_offset(bad_dataset, tmp_path, nproc, capsys):
    ds, shard, vocab = bad_dataset
    flags = [CONFIG, f"--set=data.path={json.dumps(str(ds))}", f"--set=log.dir={json.dumps(str(tmp_path / 'runs'))}",
             "--set=log.progress=false", "--set=log.tensorboard=false", "--set=train.steps=2"]
    if nproc == 1:
        code, err = main(["train", *flags]), capsys.readouterr().err
    else:
        done = pentatron_nproc([*flags, "--set=parallel.tp=2"], 2, tmp_path)
        code, err = done.codes[0], done.output
    assert code == 2, err[-2000:]
    assert shard in err and f"token id {vocab + 3} at offset {BAD_ID_OFFSET}" in err and "Traceback" not in err, err
    assert _no_step_ran(tmp_path)


def test_the_loader_checks_every_sample_it_reads(bad_dataset):
    ds, shard, vocab = bad_dataset
    dataset = TokenDataset(ds)
    dataset.check_vocab(vocab)  # the index's maximum fits: only the data shows the bad id
    loader = TokenLoader(dataset, seq_len=64, micro_batch=1, global_batch=1)
    bad_sample = BAD_ID_OFFSET // 64
    with pytest.raises(DataError, match=f"{shard}.*offset {BAD_ID_OFFSET}"):
        loader.sample(bad_sample)
    loader.sample(bad_sample + 2)  # a clean sample reads fine
