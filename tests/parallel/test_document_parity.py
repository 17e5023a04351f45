"""Document masking equals training every packed document alone: the one-process run.

`data.document_mask=true` through the real `Trainer` in float64 against `reference_run(documents=True)`
(tests/reference_loop.py: each document unpacked through the plain model, positions from 0, per-token losses
summed — no mask and no document code shared), on `tests/documents_data.py`'s short documents (1–3-token
ones, ones crossing sample boundaries, samples that are one document): every step's loss and gradient norm,
the step-1 gradients and the final parameters at `EXACT_RTOL`. The unmasked run on the same data is
measurably different (masking is not a no-op). The layouts (DDP/ZeRO, TP+SP, PP, MoE+EP, cp ring, Ulysses,
hybrid) are cases of the multi-process parity launches (test_context_parity.py, test_composition_parity.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.multiprocess import rank_threads
from tests.parallel.test_composition_parity import STEPS, _config, _train
from tests.reference_loop import EXACT_RTOL, relative_error

DOCS = ["data.document_mask=true"]


@pytest.fixture(scope="module")
def masked_run(documents_dataset, tmp_path_factory) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads())  # as the ranks run: 1 intra-op thread unless set (no idle spinning)
    try:
        return _train(_config(1, DOCS, str(tmp_path_factory.mktemp("logs"))), documents_dataset)
    finally:
        torch.set_num_threads(threads)


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
