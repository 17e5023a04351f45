"""research/fit_ring_alpha_beta.py, the network fit behind the playbook rows' hardware override, recovers a
known latency and bandwidth from ring times it generated."""

from __future__ import annotations

import fit_ring_alpha_beta as fit
import numpy as np
import pytest


def test_ring_fit_recovers_latency_and_bandwidth():
    ranks = np.array([16.0, 32, 64, 128, 256, 512])
    alpha, busbw, size = 30e-6, 300e9, 256e6
    seconds = (ranks - 1) * alpha + (ranks - 1) / ranks * size / busbw
    a, b = fit.fit(ranks, seconds, size)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(busbw, rel=1e-9)
