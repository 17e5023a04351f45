from __future__ import annotations

import dataclasses

import pytest

from pentatron.hardware.catalogue import get_gpu
from pentatron.models.registry import get_model_config
from pentatron.plan.flops import total_params
from pentatron.plan.layout import Layout, Workload, trainable_problems
from pentatron.plan.memory import (
    PLAYBOOK_16,
    PLAYBOOK_20,
    STATE_PRECISIONS,
    llama_layer_activation_bytes,
    memory_for_rank,
    memory_per_gpu,
    model_state_bytes,
    rank_params,
    state_precision,
)
from pentatron.plan.recipes import Recipe

H100 = get_gpu("h100")


@pytest.mark.parametrize(("billions", "gb16", "gb20"), [(1, 16, 20), (7, 112, 140), (70, 1120, 1400),
                                                          (405, 6480, 8100)])
def test_playbook_bytes_per_param(billions, gb16, gb20):
    n = billions * 1e9
    assert model_state_bytes(n, PLAYBOOK_16).total / 1e9 == pytest.approx(gb16)
    assert model_state_bytes(n, PLAYBOOK_20).total / 1e9 == pytest.approx(gb20)
    assert STATE_PRECISIONS["bf16"].total == 18  # our trainer: bf16 weights, fp32 grads/master/Adam


@pytest.mark.parametrize("nd", [2, 8, 64])
def test_zero_stage_formulas(nd):
    # ZeRO paper / playbook, k = 12 (fp32 master + Adam): 2Ψ + 2Ψ + kΨ sharded progressively
    psi, k = 1e9, 12
    expect = {0: 2 * psi + 2 * psi + k * psi, 1: 2 * psi + 2 * psi + k * psi / nd,
              2: 2 * psi + (2 * psi + k * psi) / nd, 3: (2 * psi + 2 * psi + k * psi) / nd}
    for stage, v in expect.items():
        assert model_state_bytes(psi, PLAYBOOK_16, stage, nd).total == pytest.approx(v)


def test_llama_activation_terms_shard_with_tp_and_sp():
    cfg = get_model_config("llama3-70b")
    s = 4096
    rope = 4 * s * cfg.head_dim * 2  # [s, head_dim] casts, independent of TP and batch
    full = llama_layer_activation_bytes(cfg, s, s).saved - rope
    sp8 = llama_layer_activation_bytes(cfg, s, s, tp=8, sp=True).saved - rope
    tp8 = llama_layer_activation_bytes(cfg, s, s, tp=8).saved - rope
    # with SP every per-token term is sharded (8 KV heads / 8) except the two block inputs, which our
    # column-parallel layers keep all-gathered (the runtime's formula, parallel/activation_memory.py)
    inputs = 2 * 2 * cfg.hidden_size * s
    assert sp8 == pytest.approx((full - inputs) / 8 + inputs)
    assert sp8 < tp8 < full  # without SP the norms stay replicated too
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    assert full == pytest.approx(s * (20 * h + 4 * cfg.kv_dim + 8 + 4 * cfg.n_heads + 8 * f))
    sel = llama_layer_activation_bytes(cfg, s, s, recompute="selective").saved - rope
    assert full - sel == pytest.approx(s * 4 * cfg.n_heads)  # only the logsumexp goes
    assert llama_layer_activation_bytes(cfg, 2 * s, s, recompute="full").saved == 2 * s * 2 * h


def test_nanotrons_packed_qkv_keeps_two_more_kv_widths_without_gqa():
    """nanotron writes q|k|v packed and attention keeps q as a view of it, so the packed k and v stay beside
    the k|v copy attention reads: 2 * 2 bytes * kv width per token, per tp rank; with GQA it copies q apart."""
    gqa = get_model_config("llama3-8b")  # 32 heads of 128, 8 KV heads
    mha = dataclasses.replace(gqa, n_kv_heads=32)  # the playbook's 8B
    s, tp = 4096, 4
    kv_width = 32 * 128 // tp  # per tp rank
    for model, extra in ((mha, s * 2 * 2 * kv_width), (gqa, 0)):
        separate = llama_layer_activation_bytes(model, s, s, tp=tp, sp=True).saved
        packed = llama_layer_activation_bytes(model, s, s, tp=tp, sp=True, qkv_saved="packed").saved
        assert packed - separate == extra
    assert s * 2 * 2 * kv_width == 16 * 2**20  # 16 MiB a layer at 4,096 tokens and tp 4


def test_a_bf16_copy_beside_the_fp32_gradients_adds_two_bytes_a_parameter():
    """grad_precision="bf16+fp32": DeepSpeed's .grad or torch DDP's bucket beside the fp32 sum (20 bytes a
    parameter with Adam and fp32 masters, the playbook's figure); the reduction still moves the fp32 sum."""
    lay = Layout(dp=8, recipe=Recipe(grad_precision="bf16+fp32"))
    assert state_precision(lay).total == 20 and state_precision(Layout(dp=8)).total == 18
    assert lay.grad_bytes == 4


def test_nanotrons_zero1_step_holds_two_and_a_shard_copies_of_the_parameters():
    """zero1_gather="copies": the optimizer step holds the states plus 2 + 1/dp bf16 copies of the stage's
    parameters. Where that exceeds the forward/backward peak (a big model, little activation), the excess
    is the `optimizer_step` component; in place (ours) there is none."""
    w = Workload(get_model_config("llama3-70b"), 512, 64)
    lay = Layout(dp=8, tp=8, zero=1, micro_batch=1, recompute="full")
    copies = lay.with_recipe(zero1_gather="copies")
    base, step = memory_for_rank(w, lay, H100, 0), memory_for_rank(w, copies, H100, 0)
    params = rank_params(w, lay, 0).dense  # per GPU after tp 8
    live = base.tensors  # the forward/backward peak: states, one layer input per layer, the loss
    states = base.model_state
    assert params * 2 == base.parameters  # bf16
    assert step.optimizer_step == pytest.approx(states + params * 2 * (2 + 1 / 8) - live)
    assert step.optimizer_step > 0 and base.optimizer_step == 0
    assert step.tensors == pytest.approx(states + params * 2 * (2 + 1 / 8))  # the step's peak is the peak
    # a long sequence's activations outweigh the copies: the forward/backward peak stays the peak
    long = Workload(get_model_config("llama3-70b"), 8192, 64)
    assert memory_for_rank(long, dataclasses.replace(copies, recompute="none"), H100, 0).optimizer_step == 0


def _w(name: str = "llama3-70b", seq: int = 4096, gb: int = 1024) -> Workload:
    return Workload(get_model_config(name), seq, gb)


def test_params_per_rank_add_up():
    w = _w("debug-untied", 256, 64)
    for pp in (1, 2, 4):
        lay = Layout(dp=1, pp=pp)
        assert sum(rank_params(w, lay, r).dense for r in range(pp)) == total_params(w.cfg)
    tied = _w("debug", 256, 64)
    emb = tied.cfg.vocab_size * tied.cfg.hidden_size
    # tied embeddings: the last stage keeps its own copy of the shared matrix (gradients summed)
    assert sum(rank_params(tied, Layout(pp=2), r).dense for r in range(2)) == total_params(tied.cfg) + emb


def test_schedule_sets_in_flight_activations():
    w = _w()
    base = Layout(dp=4, tp=8, pp=8, sp=True, zero=1, micro_batch=1)
    m = base.microbatches(w)
    afab = memory_for_rank(w, base.with_(pp_schedule="afab"), H100, 0)
    ofob = memory_for_rank(w, base.with_(pp_schedule="1f1b"), H100, 0)
    assert afab.in_flight == m and ofob.in_flight == 8
    assert afab.activations == pytest.approx(ofob.activations * m / 8, rel=1e-3)
    last = memory_for_rank(w, base, H100, 7)
    assert last.in_flight == 1 and last.logits_loss > ofob.logits_loss


def test_zero_stages_reduce_memory():
    w = _w("llama3-8b", 4096, 256)
    totals = [memory_per_gpu(w, Layout(dp=64, zero=z, recompute="full"), H100).total for z in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    z3 = memory_per_gpu(w, Layout(dp=64, zero=3, recompute="full"), H100)
    assert z3.parameters == pytest.approx(w.cfg.num_params() * 2 / 64)


def test_70b_fits_only_when_sharded():
    w = _w()
    assert memory_per_gpu(w, Layout(dp=4, tp=8, pp=8, sp=True, zero=1), H100).total < H100.hbm_bytes
    assert memory_per_gpu(w, Layout(dp=256), H100).total > 10 * H100.hbm_bytes


def test_fp32_states():
    w = _w("debug", 256, 8)
    m32 = memory_per_gpu(w, Layout(precision="fp32"), H100)
    assert m32.master_weights == 0 and m32.parameters == pytest.approx(4 * total_params(w.cfg))
    w2 = dataclasses.replace(w, seq_len=128)
    assert memory_per_gpu(w2, Layout(precision="fp32"), H100).activations < m32.activations


def test_data_parallel_buckets_cost_memory_only_where_they_are_transient():
    """ZeRO-0/1 reduce each bucket in place in the persistent gradient buffer (parallel/data.py, zero.py):
    no memory beyond the gradients, as predict_vs_measure measures at dp2. ZeRO-2's buckets are transient:
    two in flight, none larger than the rank's gradients (the debug model's 4.25 MiB of fp32 gradients is
    below one 25 MiB bucket, so two of them: 8.5 MiB). They fill from the first parameter gradient on,
    after the loss's backward has dropped its transient peak, so on a rank with the loss only what exceeds
    that peak adds (predict_vs_measure --memory-layouts: zero2 measured 1.27x below the sum). ZeRO-3's
    buckets are its units."""
    from pentatron.plan.memory import DP_BUCKET, memory_for_rank, rank_params
    w = Workload(get_model_config("debug"), 64, 8)
    full_logits = Recipe(cross_entropy="eager")  # the loss's transient peak below: full fp32 logits
    comm = {z: memory_for_rank(w, Layout(dp=2, zero=z, micro_batch=4, precision="fp32", recipe=full_logits), H100,
                               0).comm_buffers for z in (0, 1, 2)}
    rp = rank_params(w, Layout(dp=2, micro_batch=4, precision="fp32"), 0)
    grads = 4 * (rp.dense + rp.expert)
    loss_peak = 4 * 64 * 4096 * 8  # 256 tokens x 4096 vocabulary x 8 bytes (fp32: the two gradients)
    assert comm[0] == comm[1] == 0
    assert grads < DP_BUCKET and comm[2] == pytest.approx(2 * grads - loss_peak) == 533504
    big = Workload(get_model_config("llama3-8b"), 4096, 64)
    assert memory_for_rank(big, Layout(dp=8, zero=2, micro_batch=1), H100, 0).comm_buffers == 0  # 4 GB loss peak
    # a stage without the loss holds both buckets
    assert memory_for_rank(big, Layout(dp=4, pp=2, zero=2, micro_batch=1), H100, 0).comm_buffers == (
        2 * DP_BUCKET + 2 * 4096 * 4096 * 2)  # + the next activation and gradient received
    # ZeRO-3: a bucket per unit, so none bigger than the largest unit's gradients (here within the loss's
    # peak); besides them the current and the prefetched unit are gathered (4 bytes each in fp32)
    z3 = memory_for_rank(w, Layout(dp=2, zero=3, micro_batch=4, precision="fp32"), H100, 0).comm_buffers
    # the largest unit is the embedding with its tied LM head (zero3_units), 4096 x 128, gathered for the loss
    assert rp.largest_unit == 4096 * 128
    assert 2 * rp.largest_unit * 4 < loss_peak and z3 == pytest.approx(2 * rp.largest_unit * 4)


def _trainer_rank_params(cfg, tp: int, pp: int, ep: int) -> int:
    """Elements one rank of the last pipeline stage holds as training builds it: the real model on the
    meta device, split into its stage and tensor-parallel shards by the runtime's own code; the routed
    experts' stacks (split over ep by `parallel/expert.py`, dim 0) divided by ep."""
    import torch

    from pentatron.plan.verify import _meta_model

    model, _ = _meta_model(cfg, torch.bfloat16, "none", tp, tp > 1, pp, 128)
    return sum(p.numel() // (ep if ".moe.experts." in n else 1) for n, p in model.named_parameters())


@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, 1), (2, 2, 1), (2, 2, 2), (1, 2, 2)])
def test_moe_tp_model_state_is_the_trainers(tp, pp, ep):
    """Training keeps an MoE layer (router, routed and shared experts) whole on every tp rank, the routed
    experts split over ep only (parallel/moe_tokens.py): the planner's model state per rank follows (it
    sharded them over tp: the demo's rank was 19.6 % low). Other frameworks' recipes keep tp-sharded
    experts (Megatron-Core's expert tensor parallelism)."""
    cfg = get_model_config("debug-moe")
    lay = Layout(dp=2, tp=tp, pp=pp, ep=ep, sp=tp > 1, precision="bf16")
    w = Workload(cfg, 128, 8)
    rp = rank_params(w, lay, pp - 1)
    assert rp.dense + rp.expert == _trainer_rank_params(cfg, tp, pp, ep)
    mem = memory_for_rank(w, lay, H100, pp - 1)
    assert mem.model_state == pytest.approx(18 * (rp.dense + rp.expert))  # bf16 weights, fp32 grads/master/Adam
    sharded = rank_params(w, lay.with_recipe(moe_tp="sharded"), pp - 1)
    assert (sharded.dense + sharded.expert < rp.dense + rp.expert) == (tp > 1)
    # modelled as trained, so the planner recommends MoE under tp (± sp) like any other layout
    assert trainable_problems(w, lay, 2 * tp * pp) == []


def test_the_demo_configs_model_state_is_the_trainers():
    """configs/demo.toml (pp2 × tp2+sp × cp2, ep2 over dp×cp, debug-moe) as the report predicts it."""
    from pathlib import Path

    from pentatron.config import load_config
    from pentatron.observe.report import planner_layout

    cfg = load_config(Path(__file__).parents[2] / "configs" / "demo.toml", [], world_size=8)
    lay, w = planner_layout(cfg, 8, "cpu")
    last = rank_params(w, lay, lay.pp - 1)
    assert (lay.tp, lay.pp, lay.ep) == (2, 2, 2)
    assert last.dense + last.expert == _trainer_rank_params(w.cfg, lay.tp, lay.pp, lay.ep)
    fp32 = memory_for_rank(w, lay, H100, lay.pp - 1, "eager")  # a CPU run: fp32 weights, no master copy
    assert fp32.model_state == pytest.approx(16 * (last.dense + last.expert))
