"""research/korthikanti_activation.py reproduces the Ultra-Scale Playbook's activation figures and
Korthikanti et al.'s TP and SP formulas."""

from __future__ import annotations

import pytest
from korthikanti_activation import korthikanti_layer_activation_bytes

GiB = 1 << 30


def test_playbook_activation_figures():
    # 8B-like: L=32, h=4096, a=32, s=1024, b=1 -> 9.25 / 4.25 / 0.25 GiB (mixed precision, GPT layer)
    per = {rc: 32 * korthikanti_layer_activation_bytes(1024, 1, 4096, 32, recompute=rc) / GiB
           for rc in ("none", "selective", "full")}
    assert per == {"none": 9.25, "selective": 4.25, "full": 0.25}


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tp_and_sp_activation_formulas(t):
    s, b, h, a = 4096, 1, 8192, 64
    sbh = s * b * h
    assert korthikanti_layer_activation_bytes(s, b, h, a, tp=t) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_activation_bytes(s, b, h, a, tp=t, sp=True) == pytest.approx(
        sbh / t * (34 + 5 * a * s / h))
    assert korthikanti_layer_activation_bytes(s, b, h, a, tp=t, sp=True, recompute="full") == 2 * sbh / t
