"""`pentatron checkpoint convert SRC DST`: a checkpoint re-written in another parallel layout.

Every rank of the target layout builds the model as a training run in that layout would (the run's
config with the new parallel settings), loads SRC into it — re-sharded from the pieces every saved tensor
is described by (`checkpoint/reshard.py`) — and saves it into DST at the same step, with the same data
position and the same lineage. A run in the target layout then resumes DST as saved (DCP's plain
collective load) and continues exactly as it would have from SRC. Nothing is trained and no data is read.
"""

from __future__ import annotations

import time
from pathlib import Path

from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.resume import agreed_checkpoint, resume_target
from pentatron.checkpoint.store import CheckpointStore
from pentatron.config import Config
from pentatron.train.model_state import ModelState


def convert_checkpoint(cfg: Config, src: Path) -> Path:
    """Every rank: SRC's checkpoint in this run's layout, saved to checkpoint.dir; returns its directory."""
    started = time.perf_counter()
    state = ModelState(cfg, flight_recorder=False)
    try:
        comm, rank = state.ctx.comm, state.rank
        model = state.model_cfg.to_dict()
        if (src / "meta.json").is_file():  # one step directory
            source = agreed_checkpoint([src], model, None, comm, rank, state.device)
        else:
            source = resume_target(src, model, cfg.checkpoint.fallback, comm, rank, state.device)
        if source is None:
            raise CheckpointError(f"{src}: holds no checkpoint to convert")
        meta = state.load(source, CheckpointStore(source.parent))
        store = CheckpointStore(Path(cfg.checkpoint.dir), keep=cfg.checkpoint.keep, barrier=comm.barrier)
        store.clean_stale()  # a conversion killed mid-save left a `.tmp` directory in DST
        # The same lineage: resuming the converted checkpoint continues the run (its metrics, its retention).
        if isinstance(meta.get("run_id"), str):
            store.run_id, store.parent = meta["run_id"], meta.get("parent")
        tensors, new_meta, pieces = state.checkpoint(meta["step"], meta.get("loader"))
        new_meta["converted_from"] = str(source.resolve())
        if "schedule" in meta:  # the run's LR schedule goes on as it was (train/lr_schedule.py)
            new_meta["schedule"] = meta["schedule"]
        path = store.save(meta["step"], tensors, new_meta, pieces)
        if rank == 0:
            print(f"pentatron: converted {source} (layout {meta.get('layout')}) to {path} (layout "
                  f"{new_meta['layout']}, {state.ctx.world_size} rank(s)) in {time.perf_counter() - started:.1f} s",
                  flush=True)
        return path
    finally:
        state.close()
