"""The planner's loss term for our chunked loss (plan/loss_memory.py, through plan/memory.py `stage_extras`,
cross_entropy="chunked") is what `models/loss.py` allocates, to the byte (the profiler's allocation events on
the CPU allocator): its CPU form measured as it runs, its CUDA form by the same run with the chunk's logits
written in fp32 without a low-precision copy (`torch.mm(..., out_dtype=float32)` has no CPU kernel in torch
2.13) and by the blocked dW accumulation's own temporaries."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pentatron.models.loss as loss_module
from pentatron.hardware.catalogue import get_gpu
from pentatron.models.loss import WGRAD_ROWS, linear_cross_entropy
from pentatron.models.registry import get_model_config
from pentatron.observe.profiler import peak_allocation_growth
from pentatron.plan import loss_memory
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.loss_memory import chunked_loss_bytes
from pentatron.plan.memory import memory_for_rank, stage_extras

N, H, CHUNK = 1024, 32, 128
SCALARS = 12  # the mean's fp32 sum and int64 token count (plan/verify.py counts them beside the loss too)


def _peak(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return peak_allocation_growth(prof, torch.device("cpu"))


def _measured_peak(dtype: torch.dtype, vocab: int, n: int = N, h: int = H, chunk: int = CHUNK,
                   fp32_written: bool = False) -> int:
    """The loss's forward + backward peak; `fp32_written`: each chunk's logits made in fp32 with no
    low-precision copy, as CUDA's `out_dtype` matmul writes them (from fp32 copies of the operands made
    before the measurement)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, h, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    x32, w32 = x.detach().float(), w.detach().float()

    def logits_in_fp32(xc: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        lo = xc.storage_offset() // xc.shape[1]  # the chunk is a row slice of x
        return x32[lo:lo + xc.shape[0]] @ w32.t()

    with pytest.MonkeyPatch.context() as mp:
        if fp32_written:
            mp.setattr(loss_module, "_logits", logits_in_fp32)
        return _peak(lambda: linear_cross_entropy(x, w, t, chunk).backward())


def _planned(precision: str, vocab: int, tokens: int = N, chunk: int = CHUNK) -> float:
    cfg = dataclasses.replace(get_model_config("debug"), vocab_size=vocab, hidden_size=H)
    return sum(stage_extras(cfg, tokens, first=False, last=True, precision=precision, cross_entropy="chunked",
                            loss_chunk_tokens=chunk, device="cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_peak_per_vocabulary_entry_is_the_planners(dtype):
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    v1, v2 = 4096, 8192  # the per-token terms cancel in the difference
    measured = (_measured_peak(dtype, v2) - _measured_peak(dtype, v1)) / (v2 - v1)
    planned = (_planned(precision, v2) - _planned(precision, v1)) / (v2 - v1)
    assert planned == CHUNK * (4 + (2 if precision == "bf16" else 0)) + H * 4
    assert measured == planned


# (dtype, tokens, vocabulary, hidden, chunk), each with the peak it makes the largest (plan/loss_memory.py)
SHAPES = {"fp32": (torch.float32, 256, 4096, 32, 64),
          "cast": (torch.bfloat16, 256, 4096, 32, 64),
          "block": (torch.bfloat16, 64, 2 * WGRAD_ROWS, 64, 8),  # two dW blocks, the small chunk: CPU only
          "end": (torch.bfloat16, 64, 4 * WGRAD_ROWS, 128, 16)}  # dW cast beside its fp32 accumulator


def _formula(dtype: torch.dtype, n: int, v: int, h: int, chunk: int, device: str) -> float:
    return sum(chunked_loss_bytes(n, v, h, chunk, 2 if dtype == torch.bfloat16 else 4, device)) + SCALARS


@pytest.mark.parametrize("peak", list(SHAPES))
def test_the_cpu_form_is_the_allocators_to_the_byte(peak):
    dtype, n, v, h, chunk = SHAPES[peak]
    assert _measured_peak(dtype, v, n, h, chunk) == _formula(dtype, n, v, h, chunk, "cpu")
    if peak == "block":  # the CPU's mixed-dtype add copies the block; the CUDA form has no copy there
        assert _formula(dtype, n, v, h, chunk, "cuda") < _formula(dtype, n, v, h, chunk, "cpu")


@pytest.mark.parametrize("peak", ["cast", "end"])
def test_the_cuda_form_with_the_logits_written_in_fp32(peak):
    """Where the cast or the end peak is the largest the device does not matter; forward's fp32-written
    logits (no low-precision copy) stay below it."""
    dtype, n, v, h, chunk = SHAPES[peak]
    assert _measured_peak(dtype, v, n, h, chunk, fp32_written=True) == _formula(dtype, n, v, h, chunk, "cuda")


def test_the_blocked_dw_accumulations_temporaries():
    """One dW block: its bf16 product gᵀ·x (the CUDA form's block term, l·B·h), and on the CPU an fp32 copy
    of it made by the in-place add into the fp32 accumulator (+4·B·h: TensorIterator's CPU path casts a
    mismatched input first; CUDA's kernel casts as it reads)."""
    c, v, h = 8, 2 * WGRAD_ROWS, 64
    g = torch.randn(c, v).to(torch.bfloat16)
    x = torch.randn(c, h).to(torch.bfloat16)
    grad_w = torch.zeros(v, h)
    product = g[:, :WGRAD_ROWS].t() @ x
    assert _peak(lambda: grad_w[:WGRAD_ROWS].add_(product)) == 4 * WGRAD_ROWS * h  # the CPU's copy
    # two blocks, one at a time: the product and its copy (the matmul's own CPU buffers stay below them)
    assert _peak(lambda: loss_module._add_wgrad(grad_w, g, x)) == (2 + 4) * WGRAD_ROWS * h
    assert loss_memory.WGRAD_ROWS == WGRAD_ROWS


def test_the_plan_counts_the_form_of_the_hardware_it_plans_for():
    """The device comes from the GPUSpec (`device_type`): at tp 8, vocab 128k, a dW block outweighs the
    chunk, and the CPU's copy of it is in a CPU plan's loss only."""
    w = Workload(get_model_config("llama3-8b"), 8192, 64)
    lay = Layout(tp=8, sp=True, micro_batch=1)
    h100 = get_gpu("h100")
    cpu = dataclasses.replace(h100, name="cpu")
    gap = memory_for_rank(w, lay, cpu, 0).logits_loss - memory_for_rank(w, lay, h100, 0).logits_loss
    v_local, h, c = 128256 / 8, 4096, 1024
    cast, chunk_gone = 2 * c * v_local, -2 * c * v_local
    cuda_peak = max(cast, chunk_gone + 2 * WGRAD_ROWS * h, 2 * v_local * h - 4 * c * v_local)
    cpu_peak = max(cuda_peak, chunk_gone + 6 * WGRAD_ROWS * h)
    assert gap == cpu_peak - cuda_peak > 0


def test_the_term_grows_with_the_chunk_not_the_tokens():
    per_vocab = [(_planned("bf16", 16384, tokens=n) - _planned("bf16", 8192, tokens=n)) / 8192 for n in (4096, 8192)]
    assert per_vocab[0] == per_vocab[1]  # more tokens: same logits peak (the per-token terms cancel)
    eager = dataclasses.replace(get_model_config("debug"), vocab_size=128256)
    full = sum(stage_extras(eager, 4096, first=False, last=True, precision="bf16"))
    chunked = sum(stage_extras(eager, 4096, first=False, last=True, precision="bf16", cross_entropy="chunked"))
    assert chunked < full / 3
