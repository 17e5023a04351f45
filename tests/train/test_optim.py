import math

import pytest
import torch
from torch import nn

from pentatron.config import TrainConfig
from pentatron.optim import MixedPrecisionAdamW, clip_by_total_norm, grad_norm_squared
from pentatron.parallel.grad_buffer import GradBuffer
from pentatron.train.lr_schedule import lr_at


def test_cosine_schedule_warmup_peak_and_floor():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1, schedule="cosine")
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(100, cfg) == pytest.approx(0.1)


def test_wsd_schedule_is_flat_then_decays_linearly():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert [lr_at(s, cfg) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_at(80, cfg) == pytest.approx(1 - 1 / 20)
    assert lr_at(99, cfg) == pytest.approx(0.0)


def test_clipping_scales_to_max_norm_and_leaves_small_grads():
    grads = [torch.full((3,), 3.0, dtype=torch.float64), torch.full((4,), 4.0, dtype=torch.float64)]
    norm = grad_norm_squared(grads, dtype=torch.float64).sqrt()
    assert float(norm) == pytest.approx(math.sqrt(27 + 64), rel=1e-15)
    clip_by_total_norm(grads, norm, 1.0)
    # clip_grad_norm_'s formula: scaled by max_norm / (norm + 1e-6), exact in float64
    expected = float(norm) / (float(norm) + 1e-6)
    assert float(grad_norm_squared(grads, dtype=torch.float64).sqrt()) == pytest.approx(expected, rel=1e-12)
    small = [torch.full((2,), 0.1)]
    clip_by_total_norm(small, grad_norm_squared(small).sqrt(), 1.0)
    assert torch.equal(small[0], torch.full((2,), 0.1))


def test_bf16_params_step_fp32_master_with_fp32_accumulation():
    """The bf16 path must equal an fp32 AdamW on the fp32 master, with grads accumulated in fp32."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 4, bias=False)
    model = nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(ref.weight)
        ref.weight.copy_(model.weight.float())  # both start from the bf16-representable value
    cfg = TrainConfig(lr=1e-2, weight_decay=0.0)
    buf = GradBuffer([model.weight])
    opt = MixedPrecisionAdamW([model.weight], cfg, torch.float32)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    x = torch.randn(2, 5, 8)
    for micro in x:  # two micro-batches accumulate
        model(micro.bfloat16()).float().pow(2).mean().backward()
    assert model.weight.grad is None and model.weight.main_grad.dtype == torch.float32
    expected = sum(torch.autograd.grad(nn.functional.linear(m.bfloat16(), model.weight).float().pow(2).mean(),
                                       model.weight)[0].float() for m in x)
    torch.testing.assert_close(model.weight.main_grad, expected)
    ref.weight.grad = model.weight.main_grad.clone()
    opt.step(1e-2)
    ref_opt.step()
    torch.testing.assert_close(opt.master[0], ref.weight.detach())
    assert model.weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.weight.float(), ref.weight.detach().bfloat16().float())
    buf.remove_hooks()


def test_fp64_policy_keeps_every_state_in_float64_and_wide_never_rounds_it():
    """train.precision='fp64' (the exact parity suite): parameters, gradients and master in float64; `wide`
    upcasts bf16/fp32 to fp32 but leaves float64 alone (`.float()` would round it)."""
    import torch

    from pentatron.precision import resolve_precision, wide, wide_dtype

    policy = resolve_precision("fp64", torch.device("cpu"))
    assert (policy.param_dtype, policy.grad_dtype, policy.master_dtype) == (torch.float64,) * 3
    assert not policy.needs_master_copy
    x = torch.tensor([1 + 2**-40], dtype=torch.float64)
    assert wide(x) is x and float(wide(x)) == 1 + 2**-40
    assert wide(x.bfloat16()).dtype == wide(x.float()).dtype == torch.float32
    assert [wide_dtype(d) for d in (torch.bfloat16, torch.float32, torch.float64)] == [
        torch.float32, torch.float32, torch.float64]


def test_model_copies_refreshed_by_one_foreach_copy_are_bitwise_the_per_slot_copy():
    """After the step the bf16 parameters (whole, and ZeRO-like views of one flat buffer) are the fp32
    masters rounded exactly as `copy_` rounds them; fp32 parameters (master is the parameter) untouched."""
    torch.manual_seed(0)
    flat = torch.zeros(40, dtype=torch.bfloat16)
    params = [nn.Parameter(torch.randn(6, 5).bfloat16()), nn.Parameter(torch.randn(7).bfloat16()),
              nn.Parameter(flat[:24].view(4, 6)), nn.Parameter(flat[24:].view(16)), nn.Parameter(torch.randn(3, 3))]
    with torch.no_grad():
        params[2].normal_(), params[3].normal_()
    for p in params:
        p.main_grad = torch.randn(p.shape)
    opt = MixedPrecisionAdamW(params, TrainConfig(lr=0.3, weight_decay=0.1), torch.float32)
    assert [s.model is not None for s in opt.slots] == [True, True, True, True, False]
    opt.step(0.3)
    for s in opt.slots:
        expected = torch.empty_like(s.master, dtype=torch.bfloat16).copy_(s.master)
        if s.model is not None:
            assert torch.equal(s.model, expected) and not torch.equal(s.model.float(), s.master)
    assert torch.equal(flat, torch.cat([opt.slots[2].master.flatten(), opt.slots[3].master]).bfloat16())
    with torch.no_grad():  # a restore into the masters refreshes the copies the same way
        torch._foreach_add_(opt.master, 1.0)
    opt.load_named_state()
    assert all(torch.equal(s.model, s.master.bfloat16()) for s in opt.slots if s.model is not None)
