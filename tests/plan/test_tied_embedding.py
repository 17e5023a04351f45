"""The tied embedding's gradient swap between the first and the last pipeline stage (issue 10)."""

from __future__ import annotations

import dataclasses

from pentatron.hardware.catalogue import get_gpu
from pentatron.models.config import ModelConfig
from pentatron.plan.comm import TIED_WHERE, step_collectives
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.timing import step_time

H100 = get_gpu("h100")
TIED = ModelConfig(vocab_size=32000, hidden_size=1024, n_layers=8, n_heads=8, n_kv_heads=8,
                   ffn_hidden_size=4096, tie_embeddings=True)


def _tied(w: Workload, lay: Layout, first: bool = True):
    colls = step_collectives(w, lay, H100, 1e8, 0.0, 4, 0, first=first, last=not first)
    return [c for c in colls if c.where == TIED_WHERE]


def test_hand_computed_bytes_and_time():
    w = Workload(TIED, 2048, 64)
    # dp2 x pp2 on one node (pp ranks 2 apart), ZeRO-1: each rank owns 1/2 of the fp32 gradient
    lay = Layout(dp=2, pp=2, zero=1, micro_batch=1)
    (c,) = _tied(w, lay)
    nbytes = 32000 * 1024 * 4 / 2
    assert c.payload == nbytes and c.count == 1 and c.dim == "pp"
    # inside a node: alpha 2 us + bytes / (450 GB/s NVLink x 0.8)
    assert c.time == 2e-6 + nbytes / (450e9 * 0.8)
    st = step_time(w, lay.with_recipe(fused_scope="everywhere"), H100)  # reduced in place (Megatron): the swap only
    assert st.tied_grads == c.time
    assert st.step == st.pipeline + st.dp_exposed + st.optimizer + st.contention + st.tied_grads + st.scalars
    assert step_time(w, lay, H100).tied_grads > c.time  # ours packs and adds back with eager ops
    # ZeRO-0 swaps the whole gradient; bf16 gradients half of it; tp shards the vocabulary
    assert _tied(w, dataclasses.replace(lay, zero=0))[0].payload == 32000 * 1024 * 4
    assert _tied(w, lay.with_recipe(grad_precision="bf16").with_(zero=0))[0].payload == 32000 * 1024 * 2
    assert _tied(w, Layout(dp=1, tp=2, pp=2))[0].payload == 32000 * 1024 * 4 / 2
    # the last stage swaps the same bytes
    assert _tied(w, lay, first=False)[0].payload == nbytes


def test_absent_without_pipeline_or_tying():
    w = Workload(TIED, 2048, 64)
    assert not _tied(w, Layout(dp=4, zero=1))
    assert step_time(w, Layout(dp=4, zero=1), H100).tied_grads == 0.0
    untied = Workload(dataclasses.replace(TIED, tie_embeddings=False), 2048, 64)
    assert not _tied(untied, Layout(dp=2, pp=2, zero=1))
