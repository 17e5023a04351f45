"""Document masking equals training every packed document alone: the one-process run.

`data.document_mask=true` through the real `Trainer` in float64 against `reference_run(documents=True)`
(tests/reference_loop.py: each document unpacked through the plain model, positions from 0, per-token losses
summed — no mask and no document code shared), on `tests/documents_data.py`'s short documents (1–3-token
ones, ones crossing sample boundaries, samples that are one document): every step's loss and gradient norm,
the step-1 gradients and the final parameters at `EXACT_RTOL`. The unmasked run on the same data is
measurably different (masking is not a no-op). The run validates after its last step on the same data
(`eval.path`), and the validation loss is the reference's final model scoring every held-out document alone.
The layouts (DDP/ZeRO, TP+SP, PP, MoE+EP, cp ring, Ulysses,
hybrid) are cases of the multi-process parity launches (test_context_parity.py, test_composition_parity.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pentatron.data.loader import TokenDataset
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from tests.parallel.test_composition_parity import GLOBAL, SEQ, STEPS, _config, _train
from tests.reference_loop import EXACT_RTOL, _per_document_loss, relative_error

DOCS = ["data.document_mask=true"]


@pytest.fixture(scope="module")
def masked_run(documents_dataset, tmp_path_factory) -> dict[str, Any]:
    val = [f"eval.every={STEPS}", f"eval.path={str(documents_dataset)!r}"]  # eval.batches: 1
    return _train(_config(1, [*DOCS, *val], str(tmp_path_factory.mktemp("logs"))), documents_dataset, validate=True)


def test_one_process_masked_run_equals_each_document_alone(masked_run, document_reference):
    ref = document_reference
    assert len(masked_run["losses"]) == STEPS
    np.testing.assert_allclose(masked_run["losses"], ref["losses"], rtol=EXACT_RTOL)
    np.testing.assert_allclose(masked_run["norms"], ref["norms"], rtol=EXACT_RTOL)
    for key in ("grads", "params"):
        got = {("embed.weight" if n == "lm_head.weight" else n): t for n, t in masked_run[key].items()}
        assert got.keys() == ref[key].keys()
        for name, t in got.items():
            err = relative_error(t, ref[key][name])
            assert err <= EXACT_RTOL, f"{key} of {name} off by {err:.2e}"


def test_masking_changes_the_loss(masked_run, unmasked_document_reference):
    """The same data unmasked (cross-document context, positions running on): another loss from step 1 (the
    same weights: only the masking differs), far above rounding."""
    unmasked = unmasked_document_reference["losses"][0]
    diff = abs(masked_run["losses"][0] - unmasked) / unmasked
    assert diff > 1e4 * EXACT_RTOL, diff  # rounding sits near 1e-15; measured 7.6e-5


def test_validation_scores_each_document_alone(masked_run, document_reference, documents_dataset):
    """The masked validation loss (the first global batch of eval.path, packed in order) equals the reference's
    final model run on every document of those samples alone."""
    net = build_model(get_model_config("debug"), dtype=torch.float64)
    net.load_state_dict({n: torch.from_numpy(t) for n, t in document_reference["params"].items()}, strict=False)
    dataset = TokenDataset(documents_dataset)
    tokens = torch.from_numpy(dataset.read(0, GLOBAL * SEQ + 1).astype("int64"))
    samples = torch.stack([tokens[j * SEQ: j * SEQ + SEQ + 1] for j in range(GLOBAL)])
    with torch.no_grad():
        ref = float(_per_document_loss(net, samples[:, :-1], samples[:, 1:], dataset.eos_id))
    np.testing.assert_allclose(masked_run["val"]["loss"], ref, rtol=EXACT_RTOL)
