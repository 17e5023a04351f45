"""Fixtures shared by the trainer-level parity tests of this directory."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.parallel.moe_reference import moe_reference_run
from tests.parallel.test_composition_parity import EPS, GLOBAL, LR, MICRO, SEQ, STEPS, WARMUP
from tests.reference_loop import reference_run


@pytest.fixture(scope="session")
def references(default_dataset) -> dict[str, dict[str, Any]]:
    """The plain-loop reference runs (debug, debug-untied and debug-qwen3, float64) that every composition must
    match."""
    common = dict(steps=STEPS, seq_len=SEQ, global_batch=GLOBAL, lr=LR, eps=EPS, warmup=WARMUP, dtype=torch.float64)
    return {m: reference_run(default_dataset, model=m, **common) for m in ("debug", "debug-untied", "debug-qwen3")}


@pytest.fixture(scope="session")
def qwen3_moe_reference(default_dataset) -> dict[str, Any]:
    """debug-qwen3-moe's reference: the MoE loop over the compositions' micro-batches (its balancing loss is per
    forward); apart from `references`, whose other users need not pay for it."""
    return moe_reference_run(default_dataset, model="debug-qwen3-moe", micro_batch=MICRO, **_common())


def _common() -> dict[str, Any]:
    return dict(steps=STEPS, seq_len=SEQ, global_batch=GLOBAL, lr=LR, eps=EPS, warmup=WARMUP, dtype=torch.float64)


@pytest.fixture(scope="session")
def document_reference(documents_dataset) -> dict[str, Any]:
    """Each packed document of tests/documents_data.py run alone (the document-masking reference)."""
    return reference_run(documents_dataset, documents=True, **_common())


@pytest.fixture(scope="session")
def unmasked_document_reference(documents_dataset) -> dict[str, Any]:
    """The same data trained packed, without masking: its first step (the loss before any update)."""
    return reference_run(documents_dataset, **{**_common(), "steps": 1})
