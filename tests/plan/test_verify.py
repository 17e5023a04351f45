"""The planner's formulas against the real model, built on the meta device."""

from __future__ import annotations

import pytest

from pentatron.models.registry import get_model_config
from pentatron.plan.verify import TOLERANCE, verify_model


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_debug_model_matches(recompute):
    checks = verify_model(get_model_config("debug"), 256, micro_batch=2, recompute=recompute)
    assert len(checks) == 4
    for c in checks:
        assert c.traced > 0 and c.rel_error <= TOLERANCE, c


def test_fp32_untied():
    for c in verify_model(get_model_config("debug-untied"), 128, precision="fp32"):
        assert c.ok, c


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b"])
def test_llama3_matches(name):
    checks = verify_model(get_model_config(name), 4096, micro_batch=1)
    for c in checks:
        assert c.ok, c
    saved = checks[-1].traced
    assert saved > 10 * 2**30  # tens of GiB of activations per 4k sequence: really traced, not zero


def test_disagreement_is_detected(monkeypatch):
    import pentatron.plan.verify as v

    real = v.llama_layer_activation_bytes

    def off_by_five_percent(*a, **k):
        r = real(*a, **k)
        return type(r)(r.saved * 1.05, r.working)

    monkeypatch.setattr(v, "llama_layer_activation_bytes", off_by_five_percent)
    checks = v.verify_model(get_model_config("debug"), 128)
    assert not checks[-1].ok and all(c.ok for c in checks[:-1])


def test_verify_traces_the_given_layout():
    """Issue 39: --verify traces the rank of the layout it is given (tp +- SP through the real tensor-parallel
    block, the last stage for pp > 1), not tp = 1: the bytes differ from tp 1's and agree with the formula."""
    cfg = get_model_config("debug")
    saved = {}
    for kw in ({}, {"tp": 2}, {"tp": 2, "sp": True}, {"pp": 2}):
        checks = verify_model(cfg, 128, **kw)
        for c in checks:
            assert c.traced > 0 and c.ok, (kw, c)
        assert (len(checks) == 5) == bool(kw)  # + the traced rank's parameters
        saved[tuple(kw.items())] = checks[-1].traced
    assert len(set(saved.values())) == 4, saved
    assert max(saved.values()) == saved[()]
