"""Context parallelism, alone and composed, equals a plain single-process PyTorch loop.

Ring, Ulysses and hybrid at cp 2 and 4; cp × tp with sequence parallelism; cp × dp under ZeRO-3 (the
shards span dp×cp); cp × pp; and the 8-rank cp2 × tp2 × dp2. Each run trains 10 steps through the real
`Trainer` on real gloo ranks and must match `tests/reference_loop.py` (no shared code) in every step's
loss and gradient norm, every parameter's step-1 gradient and the final parameters, with every replica
bitwise identical — the harness of `test_composition_parity.py`. Both sides run in float64, so the bar is
`EXACT_RTOL` (1e-10 relative; rounding sits near 1e-15, a wrong shard or a dropped 1/cp shows at ≥ 1e-6).

The "docs" cases train with document masking on short packed documents (tests/documents_data.py: documents of
1–3 tokens, shorter than a ring chunk — 16 tokens at cp2, 8 in the hybrid —, ones crossing sample boundaries,
samples that are one document) and must equal every document trained alone (`reference_run(documents=True)`):
ring (masked block pieces, skipped pairs), Ulysses, hybrid, composed with tp+sp and pp, and without cp: dp ×
ZeRO-2, pp zero-bubble × dp ZeRO-3 (MoE + EP: the "docs" case of test_moe_parity.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.multiprocess import run_ranks
from tests.parallel.test_composition_parity import STEPS, _config, _merged, _train
from tests.reference_loop import EXACT_RTOL, relative_error
from tests.strict_comm import strict_comm_fixture

strict_comm = strict_comm_fixture("module")  # NCCL's p2p ordering and device rules on gloo

RING2, ULY2 = ["parallel.cp=2"], ["parallel.cp=2", "parallel.cp_mode='ulysses'"]
# Without dp or pp, 2 micro-batches of 4 sequences instead of 4 of 2: gradient accumulation is still exercised
# and the reference (one batch of 8) is the same, at half the ring/all-to-all exchanges. dp and pp layouts keep
# micro-batches of 2 (2 per dp rank; 4 for the pipeline schedule).
M4 = ["train.micro_batch=4"]
CASES: dict[int, dict[str, list[str]]] = {
    2: {
        "cp2 ring": [*RING2, *M4],
        "cp2 ulysses": [*ULY2, *M4],
    },
    4: {
        "cp4 ring": ["parallel.cp=4", *M4],
        "cp4 ulysses": ["parallel.cp=4", "parallel.cp_mode='ulysses'", *M4],
        "cp4 hybrid (ulysses 2 × ring 2) selective": ["parallel.cp=4", "parallel.cp_mode='hybrid'",
                                                      "parallel.cp_ulysses=2", "train.recompute=selective", *M4],
        "cp2 ring × tp2 sp": [*RING2, "parallel.tp=2", "parallel.sp=true", *M4],
        "cp2 ulysses × tp2 sp": [*ULY2, "parallel.tp=2", "parallel.sp=true", *M4],
        "cp2 ring × dp2 zero3 full recompute": [*RING2, "parallel.dp=2", "parallel.zero=3", "train.recompute=full"],
        "cp2 ring × pp2 1f1b": [*RING2, "parallel.pp=2"],
        "cp2 ulysses × pp2 zb zero1": [*ULY2, "parallel.pp=2", "parallel.pp_schedule=zb", "parallel.zero=1"],
    },
    8: {
        "cp2 ring × tp2 sp × dp2 zero2": [*RING2, "parallel.tp=2", "parallel.sp=true", "parallel.dp=2",
                                         "parallel.zero=2"],
    },
}
DOCS = ["data.document_mask=true"]
CASES[2] |= {"docs cp2 ring": [*RING2, *M4, *DOCS], "docs cp2 ulysses": [*ULY2, *M4, *DOCS],
             "docs dp2 zero2": ["parallel.dp=2", "parallel.zero=2", *DOCS]}  # launched here to share the ranks
CASES[4] |= {
    "docs cp4 hybrid (ulysses 2 × ring 2) selective": ["parallel.cp=4", "parallel.cp_mode='hybrid'",
                                                       "parallel.cp_ulysses=2", "train.recompute=selective",
                                                       *M4, *DOCS],
    "docs cp2 ring × tp2 sp full recompute": [*RING2, "parallel.tp=2", "parallel.sp=true", "train.recompute=full", *M4,
                                              *DOCS],
    "docs cp2 ulysses × pp2 1f1b": [*ULY2, "parallel.pp=2", *DOCS],
    "docs pp2 zb × dp2 zero3": ["parallel.pp=2", "parallel.pp_schedule=zb", "parallel.dp=2", "parallel.zero=3", *DOCS],
}


def _ranks(rank: int, world: int, dataset_dir: Path, documents_dir: Path, log_dir: str
           ) -> dict[str, dict[str, Any]]:
    return {label: _train(_config(world, extra, log_dir), documents_dir if label.startswith("docs") else dataset_dir)
            for label, extra in CASES[world].items()}


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_equals_a_plain_loop(world, references, document_reference, default_dataset,
                                              documents_dataset, tmp_path):
    runs = run_ranks(_ranks, world, args=(default_dataset, documents_dataset, str(tmp_path)), timeout=900)
    for label in CASES[world]:
        ref = document_reference if label.startswith("docs") else references["debug"]
        for rank, res in enumerate(runs):
            assert len(res[label]["losses"]) == STEPS
            np.testing.assert_allclose(res[label]["losses"], ref["losses"], rtol=EXACT_RTOL,
                                       err_msg=f"{label} rank {rank}: losses")
            np.testing.assert_allclose(res[label]["norms"], ref["norms"], rtol=EXACT_RTOL,
                                       err_msg=f"{label} rank {rank}: grad norms")
        for key in ("grads", "params"):
            got = _merged(runs, label, key, tied=True)
            assert got.keys() == ref[key].keys(), label
            for name, t in got.items():
                err = relative_error(t, ref[key][name])
                assert err <= EXACT_RTOL, f"{label}: {key} of {name} off by {err:.2e}"
