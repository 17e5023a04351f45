"""Measured host work (CPU bench profiles) and the fits / tight / does-not-fit verdict (issue 10)."""

from __future__ import annotations

import dataclasses

import pytest

from pentatron.hardware.catalogue import get_gpu, with_profile
from pentatron.models.registry import get_model_config
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.memory import FRAGMENTATION, RUNTIME_RESERVED, memory_per_gpu
from pentatron.plan.search import predict
from pentatron.plan.timing import layer_phase, stage_phases, step_time
from tests.plan.conftest import uncalibrated

H100 = uncalibrated(get_gpu("h100"))  # the host terms on the datasheet model alone
W = Workload(get_model_config("debug"), 64, 8)  # 4 layers, tied embeddings
HOST = with_profile(H100, host_layer_s=(1e-3, 2e-3), host_ends_s=(3e-3, 4e-3), host_optimizer_per_tensor_s=1e-4)


def test_host_work_per_layer_and_ends():
    lay = Layout(dp=1, micro_batch=4)
    plain, host = layer_phase(W, lay, H100, 0), layer_phase(W, lay, HOST, 0)
    assert host.f - plain.f == pytest.approx(1e-3) and host.b - plain.b == pytest.approx(2e-3)
    assert host.w == plain.w
    full = dataclasses.replace(lay, recompute="full")  # the replayed forward dispatches its ops again
    assert layer_phase(W, full, HOST, 0).b - layer_phase(W, full, H100, 0).b == pytest.approx(3e-3)
    (p0,), (h0,) = stage_phases(W, lay, H100), stage_phases(W, lay, HOST)
    assert h0.f - p0.f == pytest.approx(4 * 1e-3 + 3e-3) and h0.b - p0.b == pytest.approx(4 * 2e-3 + 4e-3)


def test_host_work_per_optimizer_tensor():
    lay = Layout(dp=1, micro_batch=4)
    # 9 tensors per layer x 4 layers + the (tied) embedding + the final norm = 38 tensors
    extra = step_time(W, lay, HOST).optimizer - step_time(W, lay, H100).optimizer
    assert extra == pytest.approx(38 * 1e-4)


def test_fits_tight_and_does_not_fit():
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    lay = Layout(dp=8, zero=1, micro_batch=1)
    mem = memory_per_gpu(w, lay, H100, kernels="fused")  # as predict() evaluates it
    live = mem.total - mem.reserved
    assert mem.reserved == pytest.approx(RUNTIME_RESERVED + FRAGMENTATION * live)
    assert mem.required == pytest.approx(live + RUNTIME_RESERVED)
    roomy = dataclasses.replace(H100, hbm_bytes=int(mem.total) + 1)
    tight = dataclasses.replace(H100, hbm_bytes=int((mem.required + mem.total) / 2))
    small = dataclasses.replace(H100, hbm_bytes=int(mem.required) - 1)
    p = predict(w, lay, roomy, kernels="fused")
    assert p.fits and not p.tight
    p = predict(w, lay, tight, kernels="fused")
    assert p.fits and p.tight and any(n.startswith("tight:") for n in p.notes)
    p = predict(w, lay, small, kernels="fused")
    assert not p.fits and not p.tight
