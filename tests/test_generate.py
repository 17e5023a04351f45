"""`pentatron generate`'s reading of checkpoint keys: ZeRO ranges, tensor-parallel shards (split along
whichever dimension differs), replicated tensors; and its decoding."""

from __future__ import annotations

import pytest
import torch

from pentatron.generate import CheckpointError, assemble, generate


def test_assemble_joins_zero_ranges_and_tp_shards():
    col, row, norm, flat = torch.randn(8, 4), torch.randn(4, 8), torch.randn(4), torch.randn(6, 5)
    pieces = {
        "col|tp0/2": col[:4], "col|tp1/2": col[4:],  # column parallel: split along dim 0
        "row|tp1/2": row[:, 4:], "row|tp0/2": row[:, :4],  # row parallel: dim 1, keys in any order
        "norm": norm,  # replicated
        "flat[10:30]": flat.flatten()[10:30], "flat[0:10]": flat.flatten()[:10],  # ZeRO ranges
        "optim.step": torch.zeros(()),  # not a parameter: ignored
    }
    shapes = {"col": col.shape, "row": row.shape, "norm": norm.shape, "flat": flat.shape}
    out = assemble(pieces, shapes)
    for name, want in (("col", col), ("row", row), ("norm", norm), ("flat", flat)):
        assert torch.equal(out[name], want), name


def test_assemble_refuses_zero_ranges_of_tp_shards():
    with pytest.raises(CheckpointError, match="ZeRO and tensor parallelism"):
        assemble({"w|tp0/2[0:4]": torch.zeros(4)}, {"w": torch.Size((4, 2))})


class _Counter(torch.nn.Module):
    """Logits that always favour (last token + 1) mod vocab."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((tokens + 1) % 10, 10).float() * 5


def test_greedy_and_top_k_decoding_stop_at_eos():
    model = _Counter()
    assert generate(model, [3], 4, top_k=1, temperature=1.0, max_seq_len=8, eos_id=None, seed=0) == [4, 5, 6, 7]
    assert generate(model, [3], 10, top_k=1, temperature=1.0, max_seq_len=8, eos_id=6, seed=0) == [4, 5]
    sampled = generate(model, [3], 20, top_k=3, temperature=1.0, max_seq_len=8, eos_id=None, seed=1)
    assert len(sampled) == 20 and all(0 <= t < 10 for t in sampled)
