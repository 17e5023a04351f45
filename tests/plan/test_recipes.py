"""Recipes (issue 39 items 1 and 6, issue 36 item 5): `pentatron plan --recipe NAME` predicts another
framework's run exactly as benchmarks/planner_accuracy.py does for that source's rows; only our recipe
is emitted; the planner's default kernels follow `pentatron train`'s train.compile default."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from pentatron.config import TrainConfig, load_config
from pentatron.hardware.catalogue import get_gpu
from pentatron.models.config import ModelConfig
from pentatron.models.registry import get_model_config
from pentatron.plan.emit import training_config_text
from pentatron.plan.layout import Layout, Workload, problems, trainable_problems
from pentatron.plan.recipes import (
    PENTATRON,
    RECIPES,
    TORCHTITAN,
    RecipeError,
    get_recipe,
    kernels_for_compile,
    resolve_kernels,
    training_kernels,
)
from pentatron.plan.search import predict
from tests.plan.test_cli import run

# one row per recipe: torchtitan (A100, FSDP + op SAC, eager), megatron (NeMo, fp8, cp2), nanotron (the
# playbook's cluster network, pp2 with its split)
ROWS = {"torchtitan": "torchtitan-llama3-8b-sac-op", "megatron": "nemo2412-llama3-8b", "nanotron": "playbook-1b-1n"}


@pytest.fixture(scope="module")
def rows(accuracy: Any) -> dict[str, Any]:
    return {r.id: r for r in accuracy.load_rows()}


def _model_flags(cfg: ModelConfig) -> list[str]:
    try:
        if get_model_config(cfg.name) == cfg:
            return ["--model", cfg.name]
    except KeyError:
        pass
    return ["--layers", str(cfg.n_layers), "--hidden", str(cfg.hidden_size), "--heads", str(cfg.n_heads),
            "--kv-heads", str(cfg.n_kv_heads), "--ffn-hidden", str(cfg.ffn_hidden_size), "--vocab",
            str(cfg.vocab_size), "--mlp", cfg.mlp, "--tie-embeddings" if cfg.tie_embeddings else "--no-tie-embeddings"]


def _toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


@pytest.mark.parametrize("recipe", sorted(ROWS))
def test_the_cli_with_a_recipe_reproduces_planner_accuracy(recipe, accuracy, rows, tmp_path, capsys):
    """`pentatron plan --recipe NAME ... --json` (the CLI, its search of the pinned layout) predicts what
    planner_accuracy.py predicts for that source's row, which builds its layout through the CLI's parser."""
    row = rows[ROWS[recipe]]
    assert row.args[row.args.index("--recipe") + 1] == recipe
    expected = accuracy.evaluate([row])[0]
    hw = ["--gpu", row.gpu.name]
    src = accuracy.tomllib.loads(accuracy.DEFAULT_FILE.read_text())
    raw = {r["id"]: r for r in src["run"]}[row.id]
    overrides = {**src["sources"][raw["source"]].get("defaults", {}), **raw}.get("hw")
    if overrides:  # the source's measured network: a hardware file on the command line
        path = tmp_path / "hw.toml"
        path.write_text("\n".join(f"{k} = {_toml(v)}" for k, v in {"base": raw["gpu"], **overrides}.items()))
        hw = ["--hardware", str(path)]
    w = row.workload
    argv = ["plan", *_model_flags(w.cfg), "--seq", str(w.seq_len), "--global-batch", str(w.global_batch), *hw,
            *row.args, "--json", "--top", "1"]
    assert run(argv) == 0
    got = json.loads(capsys.readouterr().out)["predictions"][0]
    assert got["layout"]["recipe"] == recipe
    assert got["tokens_per_s_per_gpu"] == pytest.approx(expected.pred.rate.tokens_per_s_per_gpu, rel=1e-9)
    assert got["memory_bytes"]["total"] == pytest.approx(expected.pred.memory.total, rel=1e-9)
    assert any(recipe in n and "never emitted" in n for n in got["notes"]), got["notes"]


def test_presets_are_valid_and_overrides_are_checked_by_the_config_checker():
    assert {"pentatron", "megatron", "nanotron", "torchtitan", "deepspeed"} <= set(RECIPES)
    assert all(r.problems() == [] for r in RECIPES.values())
    assert get_recipe("megatron", {"tp_overlap": True}).tp_overlap
    with pytest.raises(RecipeError, match="recipe.pp_p2p must be one of 'async', 'blocking', got 'sync'"):
        get_recipe("megatron", {"pp_p2p": "sync"})
    with pytest.raises(RecipeError, match="recipe.tp_overlap must be true or false"):
        get_recipe("megatron", {"tp_overlap": "yes"})
    with pytest.raises(RecipeError, match="unknown recipe field"):
        get_recipe("megatron", {"sp_input": "sharded"})
    # torchtitan's "selective" is its op-level SAC
    assert TORCHTITAN.recompute_mode("selective") == "selective-op" and PENTATRON.recompute_mode("selective") == (
        "selective")


def test_only_our_recipe_is_trainable_or_emitted(tmp_path, capsys):
    """One rule: a layout under another recipe is evaluated (problems: none), not trainable, and
    --emit-config refuses it with one message before searching."""
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    ours, titan = Layout(dp=8, zero=3), Layout(dp=8, zero=3, recipe=TORCHTITAN)
    assert problems(w, titan, get_gpu("h100"), 8) == [] and trainable_problems(w, ours, 8) == []
    assert trainable_problems(w, titan, 8) == [
        "recipe 'torchtitan' predicts a torchtitan run; `pentatron train` runs the pentatron recipe (evaluated, "
        "never emitted as a training config)"]
    changed = trainable_problems(w, ours.with_recipe(pp_p2p="blocking"), 8)
    assert changed == ["the pentatron recipe with pp_p2p='blocking' changed is evaluated, not what "
                       "`pentatron train` runs"]
    path = tmp_path / "run.toml"
    rc = run(["plan", "--model", "llama3-8b", "--gpus", "8", "--recipe", "torchtitan", "--emit-config", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--emit-config: recipe 'torchtitan' predicts" in err
    assert not path.exists()
    rc = run(["plan", "--model", "llama3-8b", "--gpus", "8", "--recipe-set", "pp_p2p=sync"])
    assert rc == 2 and "recipe.pp_p2p must be one of" in capsys.readouterr().err


def test_the_planner_default_kernels_follow_train_compile(monkeypatch, tmp_path):
    """The pentatron recipe's kernels are train.compile's default on the planned device ("auto": compiled,
    fused, on a GPU; eager on a CPU), read from TrainConfig when asked; --kernels eager/fused is
    train.compile false/true in the emitted config."""
    w = Workload(get_model_config("debug"), 64, 8)
    lay, gpu = Layout(dp=2, micro_batch=4, precision="fp32"), get_gpu("h100")
    field = {f.name: f for f in dataclasses.fields(TrainConfig)}["compile"]
    assert field.default == "auto" and training_kernels() == "fused"
    assert kernels_for_compile("auto", "cpu") == "eager" and kernels_for_compile("try", "cpu") == "fused"
    # a CPU (the built-in calibration's or a CPU bench profile's name) plans the eager run CPU training runs
    cpu = dataclasses.replace(gpu, name="bench-cpu")
    assert (gpu.device_type, cpu.device_type) == ("cuda", "cpu")
    assert resolve_kernels(PENTATRON, None, cpu.device_type) == "eager" == training_kernels("cpu")
    fused = predict(w, lay, gpu)
    assert fused.step.step == predict(w, lay, gpu, kernels="fused").step.step
    assert "compile = true" in training_config_text(w, lay)
    path = tmp_path / "eager.toml"
    path.write_text(training_config_text(w, lay, kernels="eager"))
    assert load_config(path, ['data.path=""', 'checkpoint.dir=""'], world_size=2).train.compile is False
    monkeypatch.setattr(field, "default", False)  # the training default changes: the planner's follows
    assert training_kernels() == "eager" and resolve_kernels(PENTATRON) == "eager"
    eager = predict(w, lay, gpu)
    assert eager.step.step == predict(w, lay, gpu, kernels="eager").step.step != fused.step.step
    assert "compile = false" in training_config_text(w, lay)
    assert resolve_kernels(TORCHTITAN) == "fused" and resolve_kernels(get_recipe("nanotron")) == "eager"
