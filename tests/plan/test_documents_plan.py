"""Packed documents in the planner (`plan/flops.DocumentLengths`): attention FLOPs and time follow the
document lengths, the count equals a hand count of a known document layout, the run's measured figures feed
it unchanged, and the MFU convention is stated in the same words by the planner as by the run summary
(tests/test_run_lifecycle.py checks the summary and the run report)."""

from __future__ import annotations

import json

import pytest

from pentatron.hardware.catalogue import get_gpu
from pentatron.models.documents import Documents, documents_record
from pentatron.models.registry import get_model_config
from pentatron.plan.emit import training_config_text
from pentatron.plan.flops import MFU_CONVENTION, DocumentLengths, flop_breakdown, matmul_params, model_flops_per_token
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.timing import attention_times
from tests.plan.test_cli import run

CFG = get_model_config("llama3-8b")


def test_flops_of_a_known_document_layout_equal_a_hand_count():
    # two samples of 10 tokens: documents of 3, 4 and 3 tokens, then one document filling the sample
    docs = Documents(starts=((0, 3, 7), (0,)), seq_len=10)
    causal_pairs = (3 * 4 + 4 * 5 + 3 * 4) // 2 + 10 * 11 // 2  # Σ L(L+1)/2 = 6 + 10 + 6 + 55 = 77
    squares = 3 * 3 + 4 * 4 + 3 * 3 + 10 * 10  # Σ L² = 134
    assert docs.pairs() == causal_pairs
    record = documents_record([docs])  # what a run logs: mean 20/4 tokens, mean square 134/4
    assert record["mean_tokens"] == 5 and record["mean_sq_tokens"] == 33.5
    d = DocumentLengths(record["mean_tokens"], record["mean_sq_tokens"])
    hq, layers = CFG.n_heads * CFG.head_dim, CFG.n_layers
    # forward attention: 2 matmuls of 2·h_q FLOPs per causal pair and layer, over the 20 tokens
    assert flop_breakdown(CFG, 10, causal=True, documents=d).attention == pytest.approx(
        4 * layers * hq * causal_pairs / 20, rel=1e-12)
    # the MFU numerator: each document's full square (one document per sample: the usual 12·L·h·s)
    assert model_flops_per_token(CFG, 10, documents=d) == pytest.approx(
        6 * matmul_params(CFG) + 12 * layers * hq * squares / 20, rel=1e-12)
    whole = DocumentLengths(10.0)
    assert model_flops_per_token(CFG, 10, documents=whole) == model_flops_per_token(CFG, 10)
    assert flop_breakdown(CFG, 10, causal=True, documents=whole) == flop_breakdown(CFG, 10, causal=True)
    assert record["attention_pairs"] == pytest.approx(d.pair_share(10), rel=1e-12)  # the run's share, the same


def test_attention_time_follows_the_causal_pairs():
    gpu, lay = get_gpu("h100"), Layout(dp=8)
    plain = Workload(CFG, 8192, 64)
    docs = Workload(CFG, 8192, 64, documents=DocumentLengths(1024, 1024**2 * 1.5))
    share = docs.documents.pair_share(8192)
    assert 0.1 < share < 0.2
    for masked, dense in zip(attention_times(docs, lay, gpu), attention_times(plain, lay, gpu), strict=True):
        assert masked == pytest.approx(share * dense, rel=1e-12)  # no cp: no launches, time ∝ pairs
    assert "document_mask = true" in training_config_text(docs, lay)  # an emitted job trains them masked
    assert "document_mask" not in training_config_text(plain, lay)


def test_the_plan_takes_document_lengths_and_states_the_mfu_convention(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--dp", "8", "--zero", "2",
            "--micro-batch", "1", "--recompute", "none", "--top", "1"]
    assert run([*base, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert run([*base, "--json", "--mean-doc-tokens", "1024"]) == 0
    masked = json.loads(capsys.readouterr().out)
    assert plain["mfu_convention"] == masked["mfu_convention"] == MFU_CONVENTION
    assert masked["workload"]["documents"]["causal_pair_share"] == pytest.approx(1025 / 8193)
    p, m = plain["predictions"][0], masked["predictions"][0]
    assert m["step_time_s"] < p["step_time_s"] and m["model_flops_per_token"] < p["model_flops_per_token"]
    assert 0 < m["mfu"] <= 1
    assert run([*base, "--mean-doc-tokens", "1024", "--mean-sq-doc-tokens", "2e6"]) == 0
    text = capsys.readouterr().out
    assert "documents: masked, mean 1,024 tokens, mean square 2,000,000" in text and MFU_CONVENTION in text
    for bad, why in ((["--mean-doc-tokens", "9000"], "exceeds --seq 8192"),
                     (["--mean-doc-tokens", "100", "--mean-sq-doc-tokens", "50"], "never below the square"),
                     (["--mean-sq-doc-tokens", "50"], "needs --mean-doc-tokens")):
        assert run([*base, *bad]) == 2
        assert why in capsys.readouterr().err
