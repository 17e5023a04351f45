"""NCCL's contract on gloo (distributed/nccl_contract.py), a rule per test, on real gloo ranks: each runs
the same program with the emulation off (gloo's own behaviour) and on (strict mode), and the rule changes
the outcome. Rule c (no CPU tensor on a non-CPU run) is test_comm.py's device test."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pentatron.distributed import nccl_contract
from pentatron.distributed.comm import P2P, Comm, CommLedger, Work
from pentatron.observe.flight_recorder import FlightRecorder
from tests.multiprocess import run_ranks


@dataclass
class _Mesh:
    """One real process group, as the only mesh dimension ("g")."""

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device = torch.device("cpu")

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.pg

    def size(self, dim: str) -> int:
        return self.world_size

    def local_rank(self, dim: str) -> int:
        return self.rank

    def group_ranks(self, dim: str) -> list[int]:
        return list(range(self.world_size))


def _batch_works(rank: int, world: int) -> dict[bool, tuple[int, list[float], bool]]:
    out = {}
    for emulate in (False, True):
        mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, mine, 1 - rank), dist.P2POp(dist.irecv, theirs, 1 - rank)])
        if emulate:  # what Comm hands its callers: NCCL's shape
            works = [nccl_contract.one_work(works)]
        for w in works:
            w.wait()  # emulated: the one work, and with it every op of the batch
        out[emulate] = (len(works), theirs.tolist(), all(w.is_completed() for w in works))
    return out


def _batch_handle(rank: int, world: int) -> dict[bool, tuple[bool, int, int, list[float]]]:
    """Comm.batch_p2p in both modes, with a flight recorder attached: one handle, records done with it."""
    out = {}
    for strict in (False, True):
        comm = Comm(_Mesh(dist.group.WORLD, rank, 2), CommLedger(), strict=strict)
        comm.recorder = FlightRecorder(rank)
        mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
        batch = comm.batch_p2p([P2P("send", mine, 1 - rank), P2P("recv", theirs, 1 - rank)], "g")
        pending_at_return = comm.recorder.pending
        batch.wait()
        out[strict] = (isinstance(batch, Work), pending_at_return, comm.recorder.pending, theirs.tolist())
    return out


def test_a_batch_is_one_work_that_covers_all_its_ops():
    for rank, out in enumerate(run_ranks(_batch_works, 2)):
        assert out[False][0] == 2  # gloo: a work per op
        n, received, done = out[True]
        assert n == 1 and done and received == [float(1 - rank)] * 3  # NCCL: one, and waiting it waits all


def test_a_batch_p2p_hands_callers_one_handle_per_batch_in_both_modes():
    for rank, out in enumerate(run_ranks(_batch_handle, 2)):
        msg = [float(1 - rank)] * 3
        assert out[False] == (True, 2, 0, msg)  # both records pending until the handle's wait
        assert out[True] == (True, 0, 0, msg)  # strict: waited before batch_p2p returned


def _send_before_collective(rank: int, world: int, timeout_s: float) -> dict[bool, str]:
    """Rank 0 sends, then all-reduces; rank 1 all-reduces, then receives the message."""
    out = {}
    for strict in (False, True):
        pg = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))
        comm = Comm(_Mesh(pg, rank, 2), CommLedger(), strict=strict)
        msg = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)
        try:
            if rank == 0:
                batch = comm.batch_p2p([P2P("send", msg, 1)], "g")  # gloo's send is asynchronous...
                comm.all_reduce(torch.ones(1), "g")
                batch.wait()
            else:
                comm.all_reduce(torch.ones(1), "g")
                comm.recv(msg, "g", 0)  # ...NCCL's may wait until this runs, which waits for rank 0
            out[strict] = f"done {msg.tolist()}"
        except RuntimeError as e:
            out[strict] = f"failed: {e}"
    return out


def test_b_a_send_completes_only_when_its_receive_runs():
    outs = run_ranks(_send_before_collective, 2, args=(5.0,))
    assert [o[False] for o in outs] == ["done [7.0, 7.0, 7.0]"] * 2, outs
    assert all(o[True].startswith("failed:") for o in outs), outs  # deadlocked: gloo's timeout ends it
    assert "send" in outs[0][True], outs


def _pair_first(rank: int, world: int, timeout_s: float) -> dict[bool, str]:
    """Ranks 0 and 1 exchange over a group of ranks 0-2 as its first op; rank 2 never uses it."""
    nccl_contract.FIRST_USE_TIMEOUT_S = timeout_s
    out = {}
    for strict in (False, True):
        pg = dist.new_group([0, 1, 2], timeout=timedelta(seconds=2 * timeout_s))
        if rank == 2:
            out[strict] = "idle"
            continue
        comm = Comm(_Mesh(pg, rank, 3), CommLedger(), strict=strict)
        mine, theirs = torch.full((2,), float(rank)), torch.empty(2)
        try:
            comm.batch_p2p([P2P("send", mine, 1 - rank), P2P("recv", theirs, 1 - rank)], "g").wait()
            out[strict] = f"done {theirs.tolist()}"
        except RuntimeError as e:
            out[strict] = f"failed: {type(e).__name__}: {e}"
    return out


def test_d_a_groups_first_op_is_joined_by_all_its_ranks():
    outs = run_ranks(_pair_first, 3, args=(3.0,))
    assert [o[False] for o in outs] == ["done [1.0, 1.0]", "done [0.0, 0.0]", "idle"], outs
    # rank 0 (the group's first) names the rank that never came; rank 1 is left waiting for rank 0
    assert outs[0][True].startswith("failed: CommFirstUseError: send over 'g' is this rank's first op"), outs
    assert "the group of ranks [0, 1, 2]" in outs[0][True] and "2" in outs[0][True].split("(", 1)[1], outs
    assert outs[1][True].startswith("failed:"), outs
