"""The chunked LM-head loss (models/loss.py): F.cross_entropy's values and gradients, and at most one
chunk's logits alive at any time (forward and backward)."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pentatron.models.llama import LMHead
from pentatron.models.loss import linear_cross_entropy


def _case(n: int = 37, h: int = 16, v: int = 50, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, v, (2, n), generator=g)
    t[0, 3] = t[1, 0] = -100  # ignored targets
    return x, w, t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("chunk", [1, 10, 37, 1000])
def test_chunked_loss_equals_cross_entropy_of_full_logits(chunk):
    x, w, t = _case()
    ref = F.cross_entropy(F.linear(x, w).float().flatten(0, 1), t.flatten())
    ref_grads = torch.autograd.grad(ref, [x, w])
    got = linear_cross_entropy(x, w, t, chunk)
    grads = torch.autograd.grad(got, [x, w])
    assert _rel(got.detach(), ref.detach()) <= 1e-6
    for a, b in zip(grads, ref_grads, strict=True):
        assert _rel(a, b) <= 1e-6


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
    head = LMHead(16, 50)
    head.chunk_tokens = 7
    x, _, t = _case()
    with torch.no_grad():
        logits = head(x)
        assert logits.shape == (2, 37, 50)
        loss = head(x, t)
    assert float(loss) == pytest.approx(float(F.cross_entropy(logits.flatten(0, 1), t.flatten())), rel=1e-6)


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


def test_a_split_backward_gets_dx_from_b_and_dw_from_w_each_once():
    """Zero-bubble's B asks for the input gradient only and W for the weights only: the loss's backward
    serves each half alone, and the two halves sum to the unsplit gradients."""
    from pentatron.parallel.pipeline.split_backward import SplitBackward

    x0, w, t = _case()
    norm_w = torch.randn(16, 16, generator=torch.Generator().manual_seed(5)).requires_grad_()

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
    for got, ref in zip([dx, w.grad, norm_w.grad], want, strict=True):
        assert _rel(got, ref) <= 1e-6


def test_train_loss_chunk_tokens_is_validated_and_both_settings_train_alike(tmp_path, default_dataset):
    """The knob: negative is a config error; a chunked run (chunks of 40 tokens over 4×32 per micro-batch)
    and a full-logits run (0) give the same losses and gradient norms."""
    import json

    from pentatron.config import ConfigError, load_config
    from pentatron.train.trainer import Trainer

    with pytest.raises(ConfigError, match="train.loss_chunk_tokens must be ≥ 0"):
        load_config(None, ["train.loss_chunk_tokens=-1"], world_size=1)
    runs = {}
    for chunk in (40, 0):
        cfg = load_config(None, ["train.seq_len=32", "train.micro_batch=4", "train.global_batch=8", "train.steps=2",
                                 "train.warmup=1", f"train.loss_chunk_tokens={chunk}", "log.progress=false",
                                 "log.tensorboard=false", f"log.dir={json.dumps(str(tmp_path / str(chunk)))}"],
                          world_size=1)
        runs[chunk] = [(r["loss"], r["grad_norm"]) for r in Trainer(cfg, dataset_dir=default_dataset).fit()]
    for (a_loss, a_norm), (b_loss, b_norm) in zip(runs[40], runs[0], strict=True):
        assert a_loss == pytest.approx(b_loss, rel=1e-6) and a_norm == pytest.approx(b_norm, rel=1e-5)


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
