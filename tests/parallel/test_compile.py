"""parallel/compile.py on one process: which regions are compiled, the setting, and what a failure looks like.
(Parity of compiled training in every layout: test_compile_parity.py.)"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from pentatron.config import compile_enabled
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.compile import CompileError, apply_compile

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


def test_a_failure_is_one_line_or_falls_back_when_asked():
    tokens = torch.randint(0, 4096, (1, 8))
    expected = _model(1)(tokens)
    strict = _model(1)
    apply_compile(strict, True, CPU, backend=_failing_backend)
    with pytest.raises(CompileError) as err:
        strict(tokens)
    text = str(err.value)
    assert "\n" not in text and "TORCH_LOGS" not in text and "layers.0" in text and "backend exploded" in text
    lenient = _model(1)
    report = apply_compile(lenient, "try", CPU, backend=_failing_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(lenient(tokens), expected, rtol=0, atol=0)
        lenient(tokens)
    assert report.failed == ["layers.0"] and len([w for w in caught if "eagerly" in str(w.message)]) == 1


def test_the_summary_reports_compilation():
    from pentatron.observe.summary import compile_text

    model = _model(1)
    report = apply_compile(model, True, CPU, backend="aot_eager")
    model(torch.randint(0, 4096, (1, 8))).sum().backward()
    s = report.summary()
    assert s["regions"] == 1 and s["graphs"] >= 1 and s["compile_s"] > 0 and s["failed"] == []
    assert compile_text(s).startswith("aot_eager: 1 regions, ") and compile_text(None) == "off (train.compile)"
