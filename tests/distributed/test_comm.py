"""The comm layer on 4 gloo ranks (in strict mode): every op's result, and the ledger's bytes for each (ring
volumes); strict mode's switch, and its device check on a context declaring a device the tensors are not
on (no communication needed: the check comes first), which is what catches a CPU tensor handed to an
NCCL collective, such as the pipeline's bubble measurement before issue 35."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from pentatron.distributed import comm as comm_mod
from pentatron.distributed.comm import P2P, STRICT_ENV, Comm, CommDeviceError, CommLedger, ring_bytes
from pentatron.distributed.context import ParallelContext
from pentatron.layout import ParallelLayout
from pentatron.parallel.pipeline.engine import PipelineStepResult, measured_bubble
from pentatron.schedules import Action, Kind, Slot
from tests.multiprocess import run_ranks
from tests.strict_comm import strict_comm_fixture

strict_comm = strict_comm_fixture("module")


def test_ring_volumes():
    assert ring_bytes("all_reduce", 400, 4) == 600  # 2(N−1)/N·S
    assert ring_bytes("reduce_scatter", 400, 4) == ring_bytes("all_gather", 400, 4) == 300
    assert ring_bytes("send", 400, 4) == ring_bytes("recv", 400, 4) == 400
    assert ring_bytes("all_reduce", 400, 1) == 0


def test_single_process_ops_are_local_and_record_nothing():
    ctx = ParallelContext.single()
    t = torch.arange(4.0)
    ctx.comm.all_reduce(t, "dp")
    out = torch.empty(4)
    ctx.comm.reduce_scatter(out, t, "dp")
    gathered = torch.empty(4)
    ctx.comm.all_gather(gathered, out, "dp", async_op=True).wait()
    assert torch.equal(t, torch.arange(4.0)) and torch.equal(gathered, t)
    assert ctx.comm.ledger.events == [] and ctx.comm.ledger.summary().table().endswith("(no communication)")
    with pytest.raises(ValueError, match="must be exactly 1× output"):
        ctx.comm.reduce_scatter(torch.empty(3), t, "dp")


def _ops(rank: int, world: int) -> dict:
    ctx = ParallelContext.from_layout(ParallelLayout(dp=4), "cpu")
    comm, ledger = ctx.comm, ctx.comm.ledger
    out: dict = {}
    ledger.begin_step()
    t = torch.full((10,), float(rank))
    comm.all_reduce(t, "dp")
    out["sum"] = t.tolist()
    m = torch.tensor([float(rank)])
    comm.all_reduce(m, "dp", op="max")
    out["max"] = float(m)
    full = torch.arange(8.0) + rank  # 4 chunks of 2
    shard = torch.empty(2)
    comm.reduce_scatter(shard, full, "dp")
    out["rs"] = shard.tolist()
    gathered = torch.empty(8)
    comm.all_gather(gathered, torch.tensor([rank, rank + 0.5]), "dp")
    out["ag"] = gathered.tolist()
    b = torch.tensor([float(rank)] * 3)
    comm.broadcast(b, "dp", src=1)
    out["bcast"] = b.tolist()
    works = [comm.all_reduce(torch.ones(5) * (i + 1), "dp", async_op=True) for i in range(3)]
    for w in works:
        w.wait()
    send, recv = torch.full((6,), float(rank)), torch.empty(6)
    out["strict"] = comm.strict
    batch = comm.batch_p2p([P2P("send", send, (rank + 1) % 4), P2P("recv", recv, (rank - 1) % 4)], "dp")
    out["p2p"] = recv.tolist()  # strict: the batch is done when batch_p2p returns
    batch.wait()  # and waiting again is harmless
    summary = ledger.end_step()
    out["by_dim"] = summary.by_dim
    out["table"] = summary.table()
    out["bytes_map"] = summary.bytes_map()
    # A 2×2 (dp, tp) grid: point-to-point along tp goes to the tp partner.
    grid = ParallelContext.from_layout(ParallelLayout(dp=2, tp=2), "cpu")
    x = torch.tensor([float(rank)])
    y = torch.empty(1)
    partner = 1 - grid.local_rank("tp")
    if grid.local_rank("tp") == 0:
        grid.comm.send(x, "tp", partner)
        grid.comm.recv(y, "tp", partner)
    else:
        grid.comm.recv(y, "tp", partner)
        grid.comm.send(x, "tp", partner)
    out["tp_partner"] = float(y)
    grid.comm.barrier("world")
    try:
        comm.all_gather(torch.empty(7), torch.empty(2), "dp")
        out["size_error"] = None
    except ValueError as e:
        out["size_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def ops():
    return run_ranks(_ops, 4)


def test_collectives_compute_the_right_values(ops):
    for rank, r in enumerate(ops):
        assert r["sum"] == [6.0] * 10 and r["max"] == 3.0
        assert r["rs"] == [float(sum(2 * rank + i + k for k in range(4))) for i in range(2)]
        assert r["ag"] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
        assert r["bcast"] == [1.0] * 3
        assert r["p2p"] == [float((rank - 1) % 4)] * 6 and r["strict"]
        assert r["tp_partner"] == float(rank ^ 1)
        assert "output must be exactly 4× input" in r["size_error"]


def test_ledger_records_ring_bytes_per_op_and_dimension(ops):
    dp = ops[0]["by_dim"]["dp"]
    # all_reduce: 10 + 1 + 3×5 fp32 elements; each 2(N−1)/N of its payload on the wire.
    assert dp["all_reduce"] == {"calls": 5, "payload_bytes": 4 * 26,
                                "bytes": sum(ring_bytes("all_reduce", 4 * n, 4) for n in (10, 1, 5, 5, 5))}
    assert dp["reduce_scatter"] == {"calls": 1, "payload_bytes": 32, "bytes": 24}  # full input 8 floats
    assert dp["all_gather"] == {"calls": 1, "payload_bytes": 32, "bytes": 24}  # full output 8 floats
    assert dp["broadcast"] == {"calls": 1, "payload_bytes": 12, "bytes": 9}
    assert dp["send"] == dp["recv"] == {"calls": 1, "payload_bytes": 24, "bytes": 24}
    assert ops[0]["bytes_map"]["dp"]["reduce_scatter"] == 24
    assert "reduce_scatter" in ops[0]["table"] and "wire bytes/rank" in ops[0]["table"]


def test_ledger_steps_start_empty():
    ledger = CommLedger()
    ledger.record("all_reduce", "dp", torch.float32, 400, 4)
    assert ledger.summary().bytes("dp", "all_reduce") == 600
    ledger.begin_step()
    assert ledger.end_step().bytes() == 0


def test_strict_mode_is_switched_by_the_environment(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    assert not ParallelContext.single().comm.strict
    monkeypatch.setenv(STRICT_ENV, "1")
    assert ParallelContext.single().comm.strict
    assert not Comm(ParallelContext.single(), CommLedger(), strict=False).strict


@dataclass
class _Declared:
    """A 2-rank mesh whose run's device is `device`; its groups are stand-ins, never communicated on."""

    device: torch.device
    world_size: int = 2

    def group(self, dim: str) -> object:
        return object()

    def size(self, dim: str) -> int:
        return 2

    def local_rank(self, dim: str) -> int:
        return 0

    def group_ranks(self, dim: str) -> list[int]:
        return [0, 1]


def test_strict_mode_refuses_tensors_off_the_run_device():
    comm = Comm(_Declared(torch.device("cuda", 0)), CommLedger(), strict=True)
    t = torch.zeros(4)
    calls = {"all_reduce": lambda: comm.all_reduce(t, "pp"),
             "reduce_scatter": lambda: comm.reduce_scatter(torch.zeros(2), t, "dp"),
             "all_gather": lambda: comm.all_gather(torch.zeros(8), t, "tp"),
             "all_to_all": lambda: comm.all_to_all(torch.zeros(4), t, "ep"),
             "broadcast": lambda: comm.broadcast(t, "dp"),
             "send": lambda: comm.batch_p2p([P2P("send", t, 1)], "pp"),
             "recv": lambda: comm.batch_p2p([P2P("recv", t, 1)], "cp")}
    for op, call in calls.items():
        with pytest.raises(CommDeviceError) as e:
            call()
        assert f"{op} over '" in str(e.value) and "float32 tensor on cpu" in str(e.value), op
        assert "the run's device is cuda:0" in str(e.value)
    assert comm.ledger.events == []  # refused before anything was recorded or issued


class _Reached(Exception):
    """The collective itself was called: the device check let its tensors through."""


def test_measured_bubble_hands_the_collective_tensors_on_the_run_device(monkeypatch):
    """An NCCL group has no CPU backend: the bubble's tensors must be built on the run's device. The run
    here declares `meta`; before issue 35 measured_bubble built CPU float64 tensors and all-reduced them
    three times, which this check refuses (CommDeviceError) on the first."""
    def reached(*tensors: torch.Tensor) -> None:
        raise _Reached([t.device.type for t in tensors])

    monkeypatch.setattr(comm_mod, "_all_gather", lambda out, inp, **kw: reached(out, inp))
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: reached(t))
    comm = Comm(_Declared(torch.device("meta")), CommLedger(), strict=True)
    result = PipelineStepResult(None, [Slot(0, Action(Kind.F, 0), 1.0, 2.0)], 1)
    with pytest.raises(_Reached) as e:
        measured_bubble(result, comm)
    assert set(e.value.args[0]) == {"meta"}
    assert [(ev.op, ev.dim) for ev in comm.ledger.events] == [("all_gather", "pp")]  # one collective
