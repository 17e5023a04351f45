"""`pentatron checkpoint import-hf`: a Hugging Face Llama directory (built here, never downloaded) becomes a
step-0 checkpoint that `pentatron train` resumes from in another layout (1 process with ZeRO-3: the
re-sharded path) — the run's parameters before its first step are bitwise the Hugging Face weights,
and training goes on from them. A non-empty target directory is refused with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pentatron.cli import main
from pentatron.config import load_config
from pentatron.models.hf import hf_to_pentatron_name

transformers = pytest.importorskip("transformers")


def _hf_debug_model(d: Path, layers: int = 4, ffn: int = 256) -> dict[str, np.ndarray]:
    """A random HF Llama of the `debug` registry shape (or another depth and width), saved to `d`; its
    weights under our names."""
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=ffn, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(d, safe_serialization=True)
    return {hf_to_pentatron_name(n): p.detach().numpy().copy() for n, p in model.named_parameters()}


def test_an_imported_hugging_face_model_is_where_training_starts(default_dataset, tmp_path, capsys):
    from pentatron.train.trainer import Trainer

    # not the registry's debug shape: model.hf_config reads it from config.json (no [model] field copied)
    weights = _hf_debug_model(tmp_path / "hf", layers=3, ffn=192)
    ck = tmp_path / "ck"
    assert main(["checkpoint", "import-hf", str(tmp_path / "hf"), str(ck)]) == 0
    assert "step 0" in capsys.readouterr().out
    cfg = load_config(None, [f"model.hf_config={json.dumps(str(tmp_path / 'hf'))}",
                             "train.steps=2", "train.seq_len=32", "train.micro_batch=2", "train.global_batch=2",
                             "train.warmup=1", "train.peak_tflops=1.0", "parallel.zero=3", "log.progress=false",
                             "log.tensorboard=false", f"log.dir={json.dumps(str(tmp_path / 'log'))}",
                             f"checkpoint.dir={json.dumps(str(ck))}"])
    trainer = Trainer(cfg, dataset_dir=Path(default_dataset))
    assert trainer.step == 0
    for name, value in trainer.runner.full_parameters().items():
        np.testing.assert_array_equal(value.numpy(), weights[name], err_msg=name)
    records = trainer.fit()
    trainer.engine.close()
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)
    assert main(["checkpoint", "import-hf", str(tmp_path / "hf"), str(ck)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_non_finite_hugging_face_weights_are_not_imported(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    _hf_debug_model(tmp_path / "hf")
    f = next((tmp_path / "hf").glob("*.safetensors"))
    tensors = load_file(f)
    name = next(n for n in tensors if n.endswith("down_proj.weight"))
    tensors[name][0, 0] = float("inf")
    save_file(tensors, f, metadata={"format": "pt"})
    capsys.readouterr()  # transformers' progress bars
    assert main(["checkpoint", "import-hf", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert "NaN or infinite" in err and "down_proj" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "ck" / "latest").exists()


@pytest.mark.parametrize("name", ["debug", "debug-moe"])
def test_the_step0_state_is_what_a_one_process_runner_saves(name):
    """import-hf writes the state without building the runner (its gradient buffer and fresh moments would
    be three more copies of the model): the same keys, shapes, values and piece descriptions as the runner."""
    from pentatron.checkpoint.import_hf import step0_state
    from pentatron.checkpoint.reshard import describe_state
    from pentatron.config import Config
    from pentatron.distributed.context import ParallelContext
    from pentatron.models.llama import build_model
    from pentatron.models.registry import get_model_config
    from pentatron.parallel.parallelize import parallelize
    from pentatron.precision import resolve_precision

    model = build_model(get_model_config(name), seed=1)
    state, placements = step0_state(model)
    cfg = Config()
    cfg.train.precision = "fp32"
    runner = parallelize(model, ParallelContext.single(), cfg, resolve_precision("fp32", torch.device("cpu")))
    want = runner.state_dict()
    assert state.keys() == want.keys()
    for part in want:
        assert state[part].keys() == want[part].keys(), part
        for key, t in want[part].items():
            assert torch.equal(state[part][key], t), f"{part}/{key}"
    assert describe_state(state, placements) == describe_state(want, list(runner.engine.place.values()))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "hf"
    _hf_debug_model(d)
    return d


def test_import_and_export_into_a_path_they_cannot_write_are_one_line(hf_dir, tmp_path, capsys):
    """A destination under a regular file (was a NotADirectoryError / FileExistsError traceback) or in a directory
    no one may write (a PermissionError traceback): one line naming it, exit 2, nothing left behind."""
    import os

    (tmp_path / "afile").write_text("x")
    unwritable = Path("/sys/pentatron-out") if os.geteuid() == 0 else tmp_path / "ro" / "out"
    if os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o555)
    ck = tmp_path / "ck"
    assert main(["checkpoint", "import-hf", str(hf_dir), str(ck)]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    for action, src in [("import-hf", hf_dir), ("export-hf", ck)]:
        for dest, message in [(tmp_path / "afile" / "out", "afile' is a file, not a directory"),
                              (unwritable, "choose another path")]:
            assert main(["checkpoint", action, str(src), str(dest)]) == 2, (action, dest)
            err = capsys.readouterr().err
            assert message in err and str(dest) in err and "Traceback" not in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_model_hf_config_takes_the_shape_from_config_json(tmp_path):
    """The shape of a Hugging Face directory without copying its fields into [model]: the directory or its
    config.json, the [model] fields still override it, and an unreadable one is a config error naming it."""
    from pentatron.config import ConfigError
    from pentatron.models.hf import read_hf_config

    hf = tmp_path / "SmolThing"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 96, "intermediate_size": 256,
        "num_hidden_layers": 5, "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 384,
        "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}))
    for where in (hf, hf / "config.json"):
        shape = load_config(None, [f"model.hf_config={json.dumps(str(where))}", "train.seq_len=64"]).model_config()
        assert shape == read_hf_config(hf) and shape.name == "SmolThing"
    deeper = load_config(None, [f"model.hf_config={json.dumps(str(hf))}", "model.n_layers=2", "train.seq_len=64"])
    assert deeper.model_config().n_layers == 2 and deeper.model_config().hidden_size == 96
    with pytest.raises(ConfigError, match=r"model\.hf_config: .*config\.json: missing"):
        load_config(None, [f"model.hf_config={json.dumps(str(tmp_path))}"])
