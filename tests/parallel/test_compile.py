"""parallel/compile.py on one process: which regions are compiled, the setting, and what a failure looks like
(at the first forward or in the backward's compile, in a module and under the CLI), and the run summary's
compile line. (Parity of compiled training in every layout: test_compile_parity.py.)"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

from pentatron.config import compile_enabled
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel import compile as compile_mod
from pentatron.parallel.compile import CompileError, apply_compile, eager_fp8_linears
from tests.launchers import in_process

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.toml")

CPU = torch.device("cpu")


def _model(layers: int = 2) -> torch.nn.Module:
    return build_model(dataclasses.replace(get_model_config("debug"), n_layers=layers), seed=0)


def _failing_backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> None:
    raise RuntimeError("backend exploded\nSet TORCH_LOGS=+dynamo for more")


@pytest.mark.parametrize("setting,device,expected", [("auto", "cuda", True), ("auto", "cpu", False),
                                                     (True, "cpu", True), ("try", "cpu", True), (False, "cuda", False)])
def test_setting(setting, device, expected):
    assert compile_enabled(setting, device) is expected


def test_regions_follow_the_collectives():
    model = _model()
    assert apply_compile(model, False, CPU) is None
    assert apply_compile(model, True, CPU).regions == ["layers.0", "layers.1"]  # no collective: whole blocks
    model = _model(1)
    model.layers[0].attn.o_proj.comm = object()  # as a row-parallel linear: the attention communicates
    names = apply_compile(model, True, CPU).regions
    assert names == ["layers.0.attn_norm", "layers.0.attn.rotate", "layers.0.attn.core", "layers.0.mlp_norm",
                     "layers.0.mlp"]
    split = apply_compile(_model(1), True, CPU, split_backward=True).regions  # zb: no GEMM in a region
    assert split == ["layers.0.attn_norm", "layers.0.attn.rotate", "layers.0.attn.core", "layers.0.mlp_norm",
                     "layers.0.mlp.activate"]
    # document masking: the core's documents change per micro-batch, so it (and so no whole block) is compiled
    masked = apply_compile(_model(1), True, CPU, eager_attention=True).regions
    assert masked == ["layers.0.attn_norm", "layers.0.attn.rotate", "layers.0.mlp_norm", "layers.0.mlp"]
    masked = apply_compile(_model(1), True, CPU, split_backward=True, eager_attention=True).regions
    assert masked == ["layers.0.attn_norm", "layers.0.attn.rotate", "layers.0.mlp_norm", "layers.0.mlp.activate"]


def test_fp8_linears_compile_inside_their_block_unless_their_casts_reduce():
    """train.fp8's linears sit inside compiled blocks (their casts fuse); cp's amax all-reduce keeps them eager."""
    from pentatron.parallel.fp8 import apply_fp8

    model = _model(1)
    names = apply_fp8(model, "tensorwise")
    assert eager_fp8_linears(model) == names  # train.compile off: every cast eager
    assert apply_compile(model, True, CPU).regions == ["layers.0"] and eager_fp8_linears(model) == []
    model = _model(1)
    apply_fp8(model, "tensorwise", cp=2)  # every cast spans the tokens: its amax is MAX-reduced over cp
    assert apply_compile(model, True, CPU).regions == ["layers.0.attn_norm", "layers.0.attn.rotate",
                                                       "layers.0.attn.core", "layers.0.mlp_norm",
                                                       "layers.0.mlp.activate"]
    assert eager_fp8_linears(model) == names


def test_a_failure_is_one_line_or_falls_back_when_asked():
    tokens = torch.randint(0, 4096, (1, 8))
    expected = _model(1)(tokens)
    strict = _model(1)
    apply_compile(strict, True, CPU, backend=_failing_backend)
    with pytest.raises(CompileError) as err:
        strict(tokens)
    text = str(err.value)
    assert "\n" not in text and "TORCH_LOGS" not in text and "layers.0" in text and "backend exploded" in text
    assert "train.compile = false" in text and '"try"' in text  # what to set
    lenient = _model(1)
    report = apply_compile(lenient, "try", CPU, backend=_failing_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(lenient(tokens), expected, rtol=0, atol=0)
        lenient(tokens)
    assert report.failed == ["layers.0"] and len([w for w in caught if "eagerly" in str(w.message)]) == 1


def _grads(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    model(tokens).square().mean().backward()
    return [p.grad for p in model.parameters()]


def test_a_backward_compile_failure_is_one_line_at_the_first_call(monkeypatch):
    """AOTAutograd compiles a backward lazily, inside the first backward(); compile.py has it compiled with the
    forward, so a failing backward compile is caught where a forward's is: one line naming the region, or
    ("try") the region runs eagerly, forward and backward, with the eager gradients."""
    monkeypatch.setattr(compile_mod, "TEST_FAIL", "backward")
    tokens = torch.randint(0, 4096, (1, 8))
    strict = _model(1)
    apply_compile(strict, True, CPU)
    with pytest.raises(CompileError) as err:
        strict(tokens)  # the forward: nothing has run compiled yet
    text = str(err.value)
    assert "\n" not in text and "TORCH_LOGS" not in text and "layers.0" in text
    assert "injected backward compile failure" in text and "train.compile = false" in text
    lenient = _model(1)
    report = apply_compile(lenient, "try", CPU)
    with pytest.warns(RuntimeWarning, match="layers.0 failed: .*backward.*eagerly"):
        got = _grads(lenient, tokens)
    assert report.failed == ["layers.0"]
    for g, want in zip(got, _grads(_model(1), tokens)):
        torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_a_backward_compile_failure_exits_2_under_the_cli(monkeypatch, tmp_path, default_dataset):
    monkeypatch.setattr(compile_mod, "TEST_FAIL", "backward")
    args = ["train", CONFIG, f"--set=data.path={json.dumps(str(default_dataset))}", "--set=train.steps=1",
            "--set=train.warmup=0", "--set=train.compile=true", "--set=log.tensorboard=false",
            "--set=log.progress=false"]
    out = in_process(args, tmp_path)
    errors = [ln for ln in out.output.splitlines() if "error" in ln]
    assert out.codes == [2], out.output[-2000:]
    assert len(errors) == 1 and "compiling layers.0 failed" in errors[0] and "train.compile = false" in errors[0]
    assert "Traceback" not in out.output and "TORCH_LOGS" not in out.output


def test_the_summary_reports_compilation():
    from pentatron.observe.summary import compile_text

    model = _model(1)
    report = apply_compile(model, True, CPU, backend="aot_eager")
    model(torch.randint(0, 4096, (1, 8))).sum().backward()
    s = report.summary()
    assert s["regions"] == 1 and s["graphs"] >= 1 and s["compile_s"] > 0 and s["failed"] == []
    assert s["recompiles"] == 0
    with torch.no_grad():  # grad mode is guarded: a new graph for the same region, counted as a recompilation
        model(torch.randint(0, 4096, (1, 8)))
    s = report.summary()
    assert s["recompiles"] == 1 and s["graphs"] == 2
    assert compile_text(s).startswith("aot_eager: 1 regions, 2 graphs (1 recompiles), ")
    assert compile_text(None) == "off (train.compile)"
