"""Expert parallelism pieces: the ep/edp groups carved from dp×cp, the all-to-all bytes of a real
forward+backward against what the routers' measured, uneven per-expert counts imply, and bad layouts
refused before any process starts (exit 2, one message, no traceback). End-to-end training parity is
in test_moe_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.distributed.context import ParallelContext
from pentatron.layout import ParallelLayout
from pentatron.models.llama import build_model
from pentatron.models.moe import moe_layers
from pentatron.models.registry import get_model_config
from pentatron.parallel.expert import apply_expert_parallel
from tests.launchers import in_process
from tests.multiprocess import run_ranks


def test_expert_groups_are_carved_from_dp_cp():
    # dp×cp = 4 ranks q = 0..3 per (pp, tp); ep blocks of consecutive q, edp strides
    ctx = ParallelContext(ParallelLayout(pp=1, dp=2, cp=2, tp=2, ep=2), rank=6, device=torch.device("cpu"), groups={})
    assert ctx.local_rank("dp_cp") == 3
    assert ctx.group_ranks("ep") == [4, 6] and ctx.local_rank("ep") == 1
    assert ctx.group_ranks("edp") == [2, 6] and ctx.local_rank("edp") == 1
    assert ctx.size("ep") == 2 and ctx.size("edp") == 2


def _a2a_bytes(rank: int, world: int) -> dict:
    cfg = get_model_config("debug-moe")
    ctx = ParallelContext.from_layout(ParallelLayout(dp=world, ep=world), "cpu")
    model = build_model(cfg, seed=0)
    shards = apply_expert_parallel(model, ctx)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(rank))
    ctx.comm.ledger.begin_step()
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    summary = ctx.comm.ledger.end_step()
    # The routers' counts on every rank, gathered with plain torch.distributed (not our comm layer).
    counts = []
    for layer in moe_layers(model).values():
        mine = layer.stats.counts.to(torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        counts.append(torch.stack(everyone))  # [source rank, expert]
    return {"ledger": summary.bytes("ep", "all_to_all"), "calls": summary.calls("ep", "all_to_all"),
            "counts": [c.tolist() for c in counts], "shards": shards,
            "local_experts": [m.experts.gate_proj.shape[0] for m in moe_layers(model).values()]}


@pytest.mark.parametrize("world", [2])
def test_all_to_all_bytes_equal_the_measured_counts(world):
    out = run_ranks(_a2a_bytes, world)
    h, fp32, n_experts, local = 128, 4, 8, 8 // world
    for rank, res in enumerate(out):
        assert res["local_experts"] == [local] * 3
        assert all(v == (rank, world) for v in res["shards"].values()) and len(res["shards"]) == 9
        want = 0
        for c in map(torch.tensor, res["counts"]):
            to_rank = c.view(world, world, local).sum(-1)  # [source, destination] tokens
            sent = int(to_rank[rank].sum() - to_rank[rank, rank])
            received = int(to_rank[:, rank].sum() - to_rank[rank, rank])
            # forward: dispatch sends `sent` rows, combine sends `received` back; backward the reverse;
            # plus the counts themselves (E int64, minus this rank's own share) once per forward
            want += 2 * (sent + received) * h * fp32 + (n_experts - local) * 8
        assert want > 0 and res["ledger"] == want, f"rank {rank}: ledger {res['ledger']} B, counts imply {want} B"
        assert res["calls"] == 3 * 5  # per layer: counts, dispatch, combine, and the two backward ones


@pytest.mark.parametrize("args,message", [
    (["parallel.dp=4", "parallel.ep=3"], "parallel.ep=3 must divide dp×cp = 4×1 = 4"),
    (["parallel.dp=4", "parallel.ep=4", "moe.n_experts=6"], "parallel.ep=4 does not divide moe.n_experts=6"),
    (["parallel.dp=4", "moe.top_k=9"], "moe.top_k=9 is larger than moe.n_experts=8"),
])
def test_bad_layouts_exit_2(args, message, tmp_path):
    # The CLI's main in this process (no ~3 s interpreter start per case): a refusal returns before any rank
    # would start. The same exit 2 from a real `--nproc` process: tests/test_entrypoint_errors.py.
    sets = [f"--set={a}" for a in ["model.name='debug-moe'", "train.micro_batch=2", "log.progress=false",
                                   f"log.dir={json.dumps(str(tmp_path))}", *args]]
    outcome = in_process(["train", "--nproc", "4", *sets], tmp_path)
    stderr = outcome.output[len(outcome.stdout):]
    assert outcome.codes == [2], outcome.output
    assert stderr.count(message) == 1, outcome.output
    assert "Traceback" not in outcome.output
