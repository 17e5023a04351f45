"""Precision failures: (a) bf16 weights without fp32 master weights, (b) bf16 gradient accumulation,
(c) fp16 without loss scaling."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from pentatron.lab.common import MarkovCorpus, Verdict, debug_model, grad_vector, lm_loss, save_plot


def _eval(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(lm_loss(model, *batch))


def master_weights(out: Path, quick: bool) -> Verdict:
    """(a) AdamW at a small learning rate (the tail of a cosine schedule) on fp32 weights vs on bf16
    weights with no fp32 copy: an update smaller than half a bf16 ulp of the weight rounds away."""
    steps, lr = (30, 1e-5) if quick else (80, 1e-5)
    held_out = MarkovCorpus(seed=99).batch(16, 64)
    curves, lost = {}, {}
    for name, dtype in (("fp32 master weights", torch.float32), ("bf16 weights, no master", torch.bfloat16)):
        model = debug_model(dtype=dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        data = MarkovCorpus(seed=0)
        evals, unchanged = [_eval(model, held_out)], []
        for _ in range(steps):
            loss = lm_loss(model, *data.batch(8, 64))
            opt.zero_grad()
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            same = sum(int((p.detach() == b).sum()) for p, b in zip(model.parameters(), before))
            unchanged.append(same / sum(b.numel() for b in before))
            evals.append(_eval(model, held_out))
        curves[name] = evals
        lost[name] = sum(unchanged) / len(unchanged)
    fp32, bf16 = curves.values()
    drop32, drop16 = fp32[0] - fp32[-1], bf16[0] - bf16[-1]
    lost16 = lost["bf16 weights, no master"]
    ratio = drop16 / drop32 if drop32 > 0 else float("nan")
    reproduced = lost16 > 0.5 and drop32 > 0 and ratio < 0.5
    xs = list(range(steps + 1))
    plot = save_plot(out / "lab_master_weights.png", f"AdamW lr={lr:g}: bf16 weights without fp32 masters", [
        {"title": "held-out loss", "xlabel": "step", "ylabel": "loss",
         "series": {k: (xs, v) for k, v in curves.items()}},
        {"kind": "bar", "title": "weights unchanged by a step (mean over steps)", "ylabel": "fraction of elements",
         "categories": list(lost), "series": {"unchanged": list(lost.values())}}])
    text = (f"lr={lr:g}, {steps} steps: with bf16 weights {100 * lost16:.1f}% of weight elements are left "
            f"unchanged by each step (fp32: {100 * lost['fp32 master weights']:.4f}%); held-out loss fell by "
            f"{drop16:.4f} vs {drop32:.4f} with fp32 masters ({ratio:.2f}× the progress)")
    return Verdict("master-weights", reproduced, text,
                   {"unchanged_bf16": lost16, "unchanged_fp32": lost["fp32 master weights"], "drop_bf16": drop16,
                    "drop_fp32": drop32, "progress_ratio": ratio}, plot)


def grad_accumulation(out: Path, quick: bool) -> Verdict:
    """(b) Accumulating m micro-batch gradients in a bf16 buffer vs an fp32 one, against an fp64 sum."""
    m_max = 16 if quick else 64
    model = debug_model()
    data = MarkovCorpus(seed=0)
    acc64 = acc32 = acc16 = None
    marks, err32, err16 = [], [], []
    for i in range(1, m_max + 1):
        model.zero_grad()
        (lm_loss(model, *data.batch(1, 64)) / m_max).backward()
        g = grad_vector(model).float()
        acc64 = g.double() if acc64 is None else acc64 + g.double()
        acc32 = g.clone() if acc32 is None else acc32 + g
        acc16 = g.bfloat16() if acc16 is None else acc16 + g.bfloat16()  # the .grad += of a bf16 model
        if i & (i - 1) == 0:  # powers of two
            ref = acc64.norm()
            marks.append(i)
            err32.append(float((acc32.double() - acc64).norm() / ref))
            err16.append(float((acc16.double() - acc64).norm() / ref))
    plot = save_plot(out / "lab_grad_accumulation.png", "gradient accumulation: bf16 vs fp32 buffer", [
        {"title": "relative error of the accumulated gradient vs fp64", "xlabel": "micro-batches m",
         "ylabel": "‖acc − ref‖ / ‖ref‖", "logy": True, "logx": True,
         "series": {"fp32 buffer": (marks, err32), "bf16 buffer": (marks, err16)}}])
    growth = err16[-1] / err16[0]
    reproduced = err16[-1] > 100 * err32[-1] and growth > 1.5
    text = (f"after m={m_max} micro-batches the bf16-accumulated gradient is off by {err16[-1]:.2e} (relative), "
            f"fp32 by {err32[-1]:.2e} ({err16[-1] / err32[-1]:.0f}×); the bf16 error grew {growth:.1f}× from m=1 "
            "as each addition rounds to 8 mantissa bits")
    return Verdict("grad-accumulation", reproduced, text,
                   {"m": m_max, "err_bf16": err16[-1], "err_fp32": err32[-1], "bf16_growth": growth,
                    "marks": marks, "errs_bf16": err16, "errs_fp32": err32}, plot)


class DynamicLossScaler:
    """Scale the loss so small gradients stay representable in fp16: start high, halve on overflow
    (skipping that step), double after `interval` clean steps (the scheme of Micikevicius et al., 2018)."""

    def __init__(self, scale: float = 2.0**24, interval: int = 1000) -> None:
        self.scale = scale
        self.interval = interval
        self.good = 0
        self.skipped = 0

    def update(self, finite: bool) -> bool:
        if not finite:
            self.scale /= 2
            self.good = 0
            self.skipped += 1
            return False
        self.good += 1
        if self.good % self.interval == 0:
            self.scale *= 2
        return True


def loss_scaling(out: Path, quick: bool) -> Verdict:
    """(c) fp16 backward of a micro-batch loss divided by the accumulation count m: the gradients
    underflow to zero without loss scaling; dynamic loss scaling keeps them."""
    ms = [1, 64, 512] if quick else [1, 8, 64, 512, 4096]
    master = debug_model()
    half = copy.deepcopy(master).half()
    batch = MarkovCorpus(seed=0).batch(8, 64)
    zero_plain, zero_scaled, err_plain, err_scaled, scales = [], [], [], [], []
    skipped = 0
    for m in ms:
        master.zero_grad()
        (lm_loss(master, *batch) / m).backward()
        ref = grad_vector(master)
        nonzero = ref != 0
        half.zero_grad()
        (lm_loss(half, *batch) / m).backward()
        plain = grad_vector(half)
        scaler = DynamicLossScaler()
        while True:  # find a scale that does not overflow, as the first steps of a run would
            half.zero_grad()
            (lm_loss(half, *batch) / m * scaler.scale).backward()
            g = grad_vector(half)
            if scaler.update(bool(torch.isfinite(g).all())):
                break
        skipped += scaler.skipped
        scaled = g / scaler.scale
        scales.append(scaler.scale)
        for g_, zeros, errs in ((plain, zero_plain, err_plain), (scaled, zero_scaled, err_scaled)):
            zeros.append(float(((g_ == 0) & nonzero).sum() / nonzero.sum()))
            errs.append(float((g_ - ref).norm() / ref.norm()))
    plot = save_plot(out / "lab_loss_scaling.png", "fp16 gradients of loss / m", [
        {"title": "gradient elements flushed to zero", "xlabel": "loss divided by m", "ylabel": "fraction",
         "logx": True, "series": {"fp16, no scaling": (ms, zero_plain), "fp16, dynamic loss scale": (ms, zero_scaled)}},
        {"title": "relative gradient error vs fp32", "xlabel": "loss divided by m", "ylabel": "relative error",
         "logx": True, "logy": True,
         "series": {"fp16, no scaling": (ms, err_plain), "fp16, dynamic loss scale": (ms, err_scaled)}}])
    i = ms.index(64)
    reproduced = zero_plain[i] > 0.1 and zero_scaled[i] < 0.01 and err_scaled[i] < err_plain[i] / 10
    text = (f"loss/64 (64 accumulated micro-batches): {100 * zero_plain[i]:.1f}% of the non-zero fp32 gradient "
            f"elements are zero in fp16 (relative error {err_plain[i]:.3f}); with dynamic loss scaling "
            f"(scale settled at 2^{int(torch.tensor(scales[i]).log2())} after {skipped} overflow steps over all m) "
            f"{100 * zero_scaled[i]:.4f}% (error {err_scaled[i]:.4f}). At m={ms[-1]}: {100 * zero_plain[-1]:.1f}% "
            f"vs {100 * zero_scaled[-1]:.4f}%")
    return Verdict("loss-scaling", reproduced, text,
                   {"m": ms, "zero_plain": zero_plain, "zero_scaled": zero_scaled, "err_plain": err_plain,
                    "err_scaled": err_scaled, "scales": scales}, plot)
