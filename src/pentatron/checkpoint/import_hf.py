"""`pentatron checkpoint import-hf HF_DIR CKPT_DIR`: a Hugging Face Llama (or Mixtral) directory as a
step-0 training checkpoint — the weights, fresh AdamW state, and each tensor's piece description — so
that `pentatron train` with `checkpoint.dir = CKPT_DIR` starts from those weights in any layout (the
resume re-shards it like any other checkpoint). It records no data position: the run starts at the
first sample of its own dataset.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.layout import layout_record
from pentatron.checkpoint.reshard import describe_state
from pentatron.checkpoint.store import CheckpointStore
from pentatron.checkpoint.verified import refuse_nonfinite


def import_hf_checkpoint(hf_dir: Path, ckpt_dir: Path) -> Path:
    """Write the step-0 checkpoint; returns its directory."""
    import torch

    from pentatron.config import Config
    from pentatron.distributed.context import ParallelContext
    from pentatron.models.hf import import_hf
    from pentatron.parallel.parallelize import parallelize
    from pentatron.precision import resolve_precision

    if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        raise CheckpointError(f"{ckpt_dir} is not empty: import into a new checkpoint directory")
    model = import_hf(hf_dir, dtype=torch.float32)
    refuse_nonfinite(hf_dir, model.named_parameters(), "nothing was imported (a checkpoint never holds them)")
    cfg = Config()  # one process, ZeRO-0, fp32: the simplest layout; a resume re-shards it
    cfg.train.precision, cfg.train.seq_len = "fp32", min(cfg.train.seq_len, model.cfg.max_seq_len)
    runner = parallelize(model, ParallelContext.single(), cfg, resolve_precision("fp32", torch.device("cpu")))
    state = runner.state_dict()
    meta = {"step": 0, "loader": None, "model": model.cfg.to_dict(), "imported_from": str(hf_dir),
            "layout": layout_record(runner.layout, runner.engine.layout_meta(), cfg.parallel.bucket_mb),
            "parallel_layout": dataclasses.asdict(runner.layout)}
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    return CheckpointStore(ckpt_dir).save(0, state, meta, describe_state(state, list(runner.engine.place.values())))
