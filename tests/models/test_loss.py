"""The chunked LM-head loss (models/loss.py): F.cross_entropy's values and gradients, whole or with the
vocabulary sharded, and at most one chunk's logits alive at any time (forward and backward). The
comparisons with full-logit F.cross_entropy run in float64 on both sides, to `EXACT_RTOL` (1e-10):
rounding sits near 1e-15 whatever kernels the CPU picks, a real defect shows at 1e-6 or more."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pentatron.models import loss as loss_module
from pentatron.models.llama import LMHead
from pentatron.models.loss import linear_cross_entropy
from tests.reference_loop import EXACT_RTOL, FP64


def _case(n: int = 37, h: int = 16, v: int = 50, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, v, (2, n), generator=g)
    t[0, 3] = t[1, 0] = -100  # ignored targets
    return x, w, t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _exact(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """float64 on both sides: ‖got − want‖/‖want‖ within EXACT_RTOL."""
    assert got.dtype == want.dtype == torch.float64, what
    err = _rel(got, want)
    assert err <= EXACT_RTOL, f"{what} off by {err:.2e}"


def _full_logits_reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
    """F.cross_entropy of the whole logits: the loss, dX, dW."""
    ref = F.cross_entropy(F.linear(x, w).flatten(0, 1), t.flatten())
    return [ref.detach(), *torch.autograd.grad(ref, [x, w])]


@pytest.mark.parametrize("chunk", [1, 10, 37, 1000])
def test_chunked_loss_equals_cross_entropy_of_full_logits(chunk):
    x, w, t = _case(dtype=torch.float64)
    want = _full_logits_reference(x, w, t)
    got = linear_cross_entropy(x, w, t, chunk)
    for a, b, what in zip([got.detach(), *torch.autograd.grad(got, [x, w])], want, ("loss", "dX", "dW"), strict=True):
        _exact(a, b, f"chunk {chunk} {what}")


class _ThreadShards:
    """`VocabShards` for `tp` threads of one process, each holding a slice of the vocabulary: a reduction
    waits for all of them and combines their tensors in rank order."""

    def __init__(self, rank: int, vocab_start: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.vocab_start, self.slots, self.barrier = rank, vocab_start, slots, barrier

    def _reduce(self, t: torch.Tensor, op) -> None:  # noqa: ANN001
        self.slots[self.rank] = t.clone()
        self.barrier.wait()
        total = self.slots[0]
        for other in self.slots[1:]:
            total = op(total, other)
        self.barrier.wait()  # all have read before anyone writes the next reduction's slot
        t.copy_(total)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        self._reduce(t, torch.maximum)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        self._reduce(t, torch.add)


@pytest.mark.parametrize("chunk", [10, 1000])
def test_vocab_parallel_chunked_loss_equals_cross_entropy_of_full_logits(chunk):
    """Two vocabulary shards (as tp=2's head): every shard's loss is the whole loss; their input gradients
    sum (as tp's reduction does) and their weight gradients stack to the full-logit ones."""
    tp = 2
    x, w, t = _case(dtype=torch.float64)
    want = _full_logits_reference(x, w, t)
    per = w.shape[0] // tp
    xs = [x.detach().clone().requires_grad_() for _ in range(tp)]
    ws = [w.detach()[r * per:(r + 1) * per].clone().requires_grad_() for r in range(tp)]
    slots, barrier = [None] * tp, threading.Barrier(tp, timeout=60)
    losses: list = [None] * tp

    def shard(r: int) -> None:
        try:
            losses[r] = linear_cross_entropy(xs[r], ws[r], t, chunk, _ThreadShards(r, r * per, slots, barrier))
        except BaseException as e:  # noqa: BLE001 - reported below; the other shard's barrier breaks
            losses[r] = e
            barrier.abort()

    threads = [threading.Thread(target=shard, args=(r,)) for r in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r, loss in enumerate(losses):
        assert isinstance(loss, torch.Tensor), f"shard {r}: {loss!r}"
        _exact(loss.detach(), want[0], f"vocab-parallel chunk {chunk} loss, shard {r}")
        loss.backward()
    _exact(sum(xi.grad for xi in xs), want[1], f"vocab-parallel chunk {chunk} dX")
    _exact(torch.cat([wi.grad for wi in ws]), want[2], f"vocab-parallel chunk {chunk} dW")


def test_bf16_weights_get_a_gradient_accumulated_in_fp32():
    x, w, t = _case(dtype=torch.bfloat16)
    got = linear_cross_entropy(x, w, t, 8)
    gx, gw = torch.autograd.grad(got, [x, w])
    assert gx.dtype == gw.dtype == torch.bfloat16
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(F.linear(x32, w32).flatten(0, 1), t.flatten())
    rx, rw = torch.autograd.grad(ref, [x32, w32])
    same_logits = F.cross_entropy(F.linear(x, w).float().flatten(0, 1), t.flatten())  # bf16 logits, fp32 loss
    assert float(got.detach()) == pytest.approx(float(same_logits.detach()), rel=1e-6)
    assert float(got.detach()) == pytest.approx(float(ref), rel=1e-3)
    assert _rel(gx, rx) <= 1e-2 and _rel(gw, rw) <= 1e-2  # bf16 rounding of the operands only


def test_the_head_returns_logits_without_targets_and_the_loss_with_them():
    head = LMHead(16, 50).double()
    head.chunk_tokens = 7
    x, _, t = _case(dtype=torch.float64)
    with torch.no_grad():
        logits = head(x)
        assert logits.shape == (2, 37, 50)
        loss = head(x, t)
    _exact(loss, F.cross_entropy(logits.flatten(0, 1), t.flatten()), "head's loss")


class _Live(TorchDispatchMode):
    """The bytes of the storages the ops create, while alive; the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                st = o.untyped_storage()
                key = id(st)
                if key not in self.live and st.nbytes():
                    self.live[key] = st.nbytes()
                    self.current += st.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(st, self._gone, key)
        return out

    def _gone(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def test_peak_memory_is_one_chunk_of_logits_not_the_full_logits():
    n, h, v, chunk = 256, 8, 2048, 16
    x, w, t = _case(n=n, h=h, v=v)
    with _Live() as meter:
        linear_cross_entropy(x, w, t, chunk).backward()
    full = 2 * n * v * 4  # one fp32 copy of the whole logits
    one_chunk = chunk * v * 4
    dw = v * h * 4
    # the chunk's logits (+ the matmul's transient), the fp32 dW accumulator, per-token vectors, the inputs' grads
    assert meter.peak <= 2 * one_chunk + 2 * dw + 64 * 2 * n + 2 * x.numel() * 4
    assert meter.peak < full / 10


def test_bf16_dw_is_added_in_vocabulary_blocks_with_one_blocks_temporary(monkeypatch):
    """Under bf16 dW's per-chunk product is a temporary beside the fp32 accumulator: added WGRAD_ROWS
    vocabulary rows at a time it is one block's, not [V, h] (the largest matmul output, and a lower peak);
    the gradients are bitwise the unblocked ones."""
    n, h, v, chunk = 64, 64, 4096, 16
    x, w, t = _case(n=n, h=h, v=v, dtype=torch.bfloat16)

    class Largest(_Live):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = super().__torch_dispatch__(func, types, args, kwargs)
            # dW's products [rows, h] (and dX's, [chunk, h]: fewer rows)
            if func.overloadpacket is torch.ops.aten.mm and out.shape[1] == h:
                self.largest = max(self.largest, out.shape[0])
            return out

    def run(rows: int) -> tuple[Largest, list[torch.Tensor]]:
        monkeypatch.setattr(loss_module, "WGRAD_ROWS", rows)
        with Largest() as meter:
            grads = torch.autograd.grad(linear_cross_entropy(x, w, t, chunk), [x, w])
        return meter, grads

    whole, (gx, gw) = run(v)
    blocked, (bx, bw) = run(256)
    assert torch.equal(bx, gx) and torch.equal(bw, gw)
    assert (whole.largest, blocked.largest) == (v, 256)
    assert blocked.peak < whole.peak


def test_on_cuda_bf16_logits_come_out_of_the_matmul_in_fp32(monkeypatch):
    """The decision (CUDA and bf16/fp16 only), and the CUDA call's signature and result checked on meta
    tensors (torch's meta kernels carry its dtype rules); the CUDA kernel itself is unrun without a GPU."""
    cuda = torch.empty(0, dtype=torch.bfloat16, device="meta")
    assert not loss_module._fp32_out(cuda)  # meta is not CUDA
    assert not loss_module._fp32_out(torch.empty(0, dtype=torch.bfloat16))  # CPU widens
    monkeypatch.setattr(loss_module, "_fp32_out", lambda x: x.dtype in (torch.bfloat16, torch.float16))
    x, w = torch.empty(8, 16, dtype=torch.bfloat16, device="meta"), torch.empty(50, 16, dtype=torch.bfloat16,
                                                                                 device="meta")
    logits = loss_module._logits(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (8, 50)


def test_a_split_backward_gets_dx_from_b_and_dw_from_w_each_once():
    """Zero-bubble's B asks for the input gradient only and W for the weights only: the loss's backward
    serves each half alone, and the two halves sum to the unsplit gradients."""
    from pentatron.parallel.pipeline.split_backward import SplitBackward

    x0, w, t = _case(dtype=torch.float64)
    norm_w = torch.randn(16, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64).requires_grad_()

    def loss() -> torch.Tensor:
        return linear_cross_entropy(F.linear(x0, norm_w), w, t, 9)

    loss().backward()
    want = [x0.grad.clone(), w.grad.clone(), norm_w.grad.clone()]
    x0.grad = w.grad = norm_w.grad = None
    split = SplitBackward([loss()], [None], [x0])
    (dx,) = split.backward_input()
    assert w.grad is None and norm_w.grad is None  # B computed no weight gradient
    split.backward_weight()
    assert split.split
    for got, ref, what in zip([dx, w.grad, norm_w.grad], want, ("dX", "dW", "dW before"), strict=True):
        _exact(got, ref, f"split backward {what}")


def test_train_loss_chunk_tokens_is_validated_and_both_settings_train_alike(tmp_path, default_dataset):
    """The knob: negative is a config error; a chunked run (chunks of 40 tokens over 4×32 per micro-batch)
    and a full-logits run (0), both in float64, give the same losses and gradient norms."""
    import json

    from pentatron.config import ConfigError, load_config
    from pentatron.train.trainer import Trainer

    with pytest.raises(ConfigError, match="train.loss_chunk_tokens must be ≥ 0"):
        load_config(None, ["train.loss_chunk_tokens=-1"], world_size=1)
    runs = {}
    for chunk in (40, 0):
        cfg = load_config(None, ["train.seq_len=32", "train.micro_batch=4", "train.global_batch=8", "train.steps=2",
                                 "train.warmup=1", f"train.loss_chunk_tokens={chunk}", FP64, "log.progress=false",
                                 "log.tensorboard=false", f"log.dir={json.dumps(str(tmp_path / str(chunk)))}"],
                          world_size=1)
        runs[chunk] = [(r["loss"], r["grad_norm"]) for r in Trainer(cfg, dataset_dir=default_dataset).fit()]
    for (a_loss, a_norm), (b_loss, b_norm) in zip(runs[40], runs[0], strict=True):
        assert a_loss == pytest.approx(b_loss, rel=EXACT_RTOL) and a_norm == pytest.approx(b_norm, rel=EXACT_RTOL)


class _Matmuls(TorchDispatchMode):
    """How many matmuls run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("chunk", "chunks"), [(1000, 1), (10, 8)])
def test_backward_recomputes_the_logits_of_every_chunk_but_the_last(chunk, chunks):
    """Forward keeps the last chunk's exponentials: backward runs dX and dW per chunk and the forward
    matmul again only for the chunks before it (none when the tokens fit in one chunk)."""
    x, w, t = _case()  # 74 tokens
    loss = linear_cross_entropy(x, w, t, chunk)
    with _Matmuls() as mm:
        loss.backward()
    assert mm.count == 2 * chunks + (chunks - 1)
