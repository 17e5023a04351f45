"""The plain loop MoE parity tests compare against: `tests/reference_loop.py`'s loop (torch's AdamW, the
same decay groups, clipping and schedule) over the global batch cut into its micro-batches — the
balancing losses are computed per forward, so a micro-batch of 2 sequences is not the same as one batch
of 8 — each micro-batch's loss divided by their number, and after each optimizer step the model's
`finish_step` (aux-free bias update from the step's summed loads). Shares no code with the parallel
runtime; only the model, its MoE helpers and the data loader are Pentatron's. `dtype`: the model,
gradients, optimizer state and loss (float64: the exact parity suite). `documents`: document masking, the
model's one-process masked attention on this loop's own cut of each sample (at its first token and each EOS
input) — the balancing losses are per forward over the whole micro-batch, so the MoE reference cannot run
documents alone; that kernel equals every document run alone (test_document_parity.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pentatron.data.loader import TokenDataset, TokenLoader
from pentatron.models.documents import Documents
from pentatron.models.llama import build_model
from pentatron.models.moe import finish_step, moe_layers, set_aux_loss_scale
from pentatron.models.registry import get_model_config
from tests.reference_loop import _clip_grad_norm, adamw, cosine_lr, once_per_session


@once_per_session
def moe_reference_run(dataset_dir: Path, *, model: str, steps: int, seq_len: int, global_batch: int,
                      micro_batch: int, lr: float, eps: float, warmup: int, clip: float = 1.0,
                      weight_decay: float = 0.1, min_ratio: float = 0.1, seed: int = 0,
                      capacity_factor: float | None = None, dtype: torch.dtype = torch.float32,
                      documents: bool = False) -> dict[str, Any]:
    torch.manual_seed(seed)
    cfg = get_model_config(model)
    if capacity_factor is not None:
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=capacity_factor))
    net = build_model(cfg, seed=seed, dtype=dtype)
    named = list(net.named_parameters())
    opt = adamw(named, lr=lr, eps=eps, weight_decay=weight_decay)
    loader = TokenLoader(TokenDataset(dataset_dir), seq_len=seq_len, micro_batch=micro_batch,
                         global_batch=global_batch, seed=seed)
    chunks = global_batch // micro_batch
    set_aux_loss_scale(net, 1 / chunks)
    out: dict[str, Any] = {"losses": [], "norms": [], "grads": {}, "loads": [], "dropped": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in loader.next_step():
            if documents:
                eos = loader.dataset.eos_id
                docs = Documents(tuple((0, *(j for j in range(1, x.shape[1]) if int(row[j]) == eos)) for row in x),
                                 x.shape[1])
                logits = net(x, docs.positions(), None, docs)
            else:
                logits = net(x)
            logits = logits if logits.dtype == torch.float64 else logits.float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            (loss / chunks).backward()
            total += float(loss.detach())
        norm = _clip_grad_norm(net.parameters(), clip)
        if step == 0:
            out["grads"] = {n: p.grad.detach().numpy().copy() for n, p in named}
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, lr=lr, warmup=warmup, steps=steps, min_ratio=min_ratio)
        opt.step()
        metrics = finish_step(net)
        out["loads"].append({n: m["tokens_per_expert"] for n, m in metrics.items()})
        out["dropped"].append({n: m["dropped_frac"] for n, m in metrics.items()})
        out["losses"].append(total / chunks)
        out["norms"].append(float(norm))
    out["params"] = {n: p.detach().numpy().copy() for n, p in named}
    out["biases"] = {n: m.router.expert_bias.numpy().copy() for n, m in moe_layers(net).items()}
    return out
