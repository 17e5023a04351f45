"""`pentatron checkpoint export-hf` on a checkpoint sharded by ZeRO-1 and tensor parallelism together
(dp2 × tp2, 4 ranks; `pentatron generate`'s key reader cannot assemble that): the exported directory
loads in `transformers`, whose logits match ours, and the assembled parameters are bitwise the run's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pentatron.cli import main
from pentatron.config import load_config
from pentatron.generate import load_any_model
from tests.multiprocess import run_ranks

transformers = pytest.importorskip("transformers")


def _rank_fn(rank: int, world: int, dataset: str, root: str) -> dict[str, np.ndarray]:
    from pentatron.train.trainer import Trainer

    cfg = load_config(None, ["train.steps=1", "train.seq_len=32", "train.micro_batch=2", "train.global_batch=8",
                             "train.warmup=1", "train.peak_tflops=1.0", "parallel.dp=2", "parallel.tp=2",
                             "parallel.zero=1", "parallel.bucket_mb=0.05", "log.progress=false",
                             "log.tensorboard=false", f"log.dir={json.dumps(root + '/log')}",
                             f"checkpoint.dir={json.dumps(root + '/ck')}"], world_size=world)
    trainer = Trainer(cfg, dataset_dir=Path(dataset))
    trainer.fit()
    full = {k: v.numpy() for k, v in trainer.runner.full_parameters().items()}
    trainer.engine.close()
    return full


def test_export_hf_of_a_zero_and_tp_sharded_checkpoint_matches_transformers(default_dataset, tmp_path, capsys):
    trained = run_ranks(_rank_fn, 4, args=(str(default_dataset), str(tmp_path)), timeout=600)[0]
    model, _, _ = load_any_model(tmp_path / "ck")
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), trained[name], err_msg=name)

    # no run.json names the dataset (the trainer ran without the runner): the weights, and a warning
    assert main(["checkpoint", "export-hf", str(tmp_path / "ck"), str(tmp_path / "bare")]) == 0
    assert "no tokenizer written" in capsys.readouterr().err
    out = tmp_path / "hf"
    assert main(["checkpoint", "export-hf", str(tmp_path / "ck"), str(out), "--tokenizer", str(default_dataset)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.eos_token == "<|endoftext|>" and tok("def f(x):")["input_ids"]
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, local_files_only=True,
                                                           attn_implementation="eager").eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, hf = model(tokens), theirs(tokens).logits
    torch.testing.assert_close(hf, ours, rtol=0, atol=1e-5)
    assert main(["checkpoint", "export-hf", str(tmp_path / "nothing"), str(tmp_path / "hf2")]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
