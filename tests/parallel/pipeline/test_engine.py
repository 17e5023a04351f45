"""The engine on one process (chunks hand activations to each other locally): it runs any valid schedule,
including hand-written ones, equals plain gradient accumulation, frees activations as soon as their
backward is done, and records every action; plus the recorded timeline and its Chrome trace."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import types
import weakref

import pytest
import torch

from pentatron.distributed.context import ParallelContext
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.pipeline import engine as engine_mod
from pentatron.parallel.pipeline.engine import PipelineEngine
from pentatron.parallel.pipeline.stages import build_stages, partition
from pentatron.parallel.pipeline.trace import read_chrome_trace, recorded_timeline, write_chrome_trace, write_rank_trace
from pentatron.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    Slot,
    afab,
    busy_window,
    interleaved_1f1b,
    make_schedule,
    p2p_plan,
    peak_in_flight,
    zero_bubble_h1,
)
from tests.parallel.pipeline.harness import loss_fn
from tests.reference_loop import EXACT_RTOL

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def _setup(v: int, n_layers: int = 4):
    cfg = dataclasses.replace(get_model_config("debug"), n_layers=n_layers, hidden_size=64, n_heads=2,
                              n_kv_heads=1, ffn_hidden_size=128)
    # float64 both sides (the exact parity suite): the engine reorders nothing but the accumulation
    ref = build_model(cfg, seed=0, dtype=torch.float64)
    stages = build_stages(build_model(cfg, seed=0, dtype=torch.float64), 1, 0, partition(n_layers, v, uniform=True))
    torch.manual_seed(0)
    mbs = [(torch.randint(0, cfg.vocab_size, (2, 16)), torch.randint(0, cfg.vocab_size, (2, 16))) for _ in range(4)]
    return ref, stages, mbs


def _reference(model, mbs):
    total = 0.0
    for x, y in mbs:
        loss = loss_fn(model(x), y)
        (loss / len(mbs)).backward()
        total += loss.item()
    return total / len(mbs), {n: p.grad for n, p in model.named_parameters()}


def _check(stages, ref_grads, ref_loss, result):
    assert abs(result.loss.item() - ref_loss) <= EXACT_RTOL * abs(ref_loss)
    for st in stages:
        for n, p in st.named_parameters():
            # With both ends on one rank the LM head *is* the embedding (one tied Parameter).
            want = ref_grads["embed.weight" if n == "lm_head.weight" else n]
            torch.testing.assert_close(p.grad, want, rtol=EXACT_RTOL, atol=0.0, msg=n)


# A hand-written valid schedule: 2 chunks on one rank, every forward first, backwards split and with
# the weight passes in reverse order — nothing any generator produces.
CUSTOM = Schedule(1, 4, 2, [[Action(F, i, c) for c in (0, 1) for i in range(4)]
                            + [Action(B, i, c) for i in range(4) for c in (1, 0)]
                            + [Action(W, i, c) for i in reversed(range(4)) for c in (0, 1)]], "custom")


@pytest.mark.parametrize("schedule", [afab(1, 4), make_schedule("1f1b", 1, 4), zero_bubble_h1(1, 4),
                                      interleaved_1f1b(1, 4, 2), CUSTOM], ids=lambda s: s.name)
def test_any_valid_schedule_equals_gradient_accumulation(schedule):
    ref, stages, mbs = _setup(schedule.v)
    ref_loss, ref_grads = _reference(ref, mbs)
    eng = PipelineEngine(stages, schedule, ParallelContext.single().comm, 0, loss_fn)
    result = eng.step(mbs)
    _check(stages, ref_grads, ref_loss, result)
    assert result.peak_in_flight == peak_in_flight(schedule)[0]
    assert [s.action for s in result.slots] == schedule.actions[0]


def test_activations_are_freed_when_their_backward_is_done(monkeypatch):
    """Each (chunk, micro-batch)'s output (and with it the autograd graph holding its activations) dies at
    its last backward action, not at the end of the step."""
    ref, stages, mbs = _setup(1)
    schedule = make_schedule("1f1b", 1, 4)
    refs: dict[tuple[int, int], weakref.ref] = {}
    alive_later: list[int] = []
    real = {name: getattr(PipelineEngine, name) for name in ("_free", "_forward", "_backward")}

    def free(self, key):
        refs[key] = weakref.ref(self._saved[key].output)
        real["_free"](self, key)

    def on_next_action(name):
        def wrapped(self, a):
            gc.collect()
            alive_later.append(sum(r() is not None for r in refs.values()))
            return real[name](self, a)
        return wrapped

    monkeypatch.setattr(engine_mod.PipelineEngine, "_free", free)
    for name in ("_forward", "_backward"):
        monkeypatch.setattr(engine_mod.PipelineEngine, name, on_next_action(name))
    PipelineEngine(stages, schedule, ParallelContext.single().comm, 0, loss_fn).step(mbs)
    gc.collect()
    assert len(refs) == 4 and all(r() is None for r in refs.values())
    assert alive_later == [0] * 8  # by the next action, every finished micro-batch's graph is gone


def test_bad_inputs_are_rejected():
    ref, stages, mbs = _setup(1)
    comm = ParallelContext.single().comm
    with pytest.raises(ScheduleError):  # validated before anything runs: W before its B
        PipelineEngine(stages, Schedule(1, 1, 1, [[Action(F, 0), Action(W, 0), Action(B, 0)]]), comm, 0, loss_fn)
    with pytest.raises(ValueError, match="v=2"):
        PipelineEngine(stages, interleaved_1f1b(1, 4, 2), comm, 0, loss_fn)
    eng = PipelineEngine(stages, afab(1, 2), comm, 0, loss_fn)
    with pytest.raises(ValueError, match="2 micro-batches"):
        eng.step(mbs)


def test_p2p_plan_follows_the_schedule():
    """Messages per neighbour, in the order the sender issues them: activations downstream, gradients up,
    and for interleaving the wrap-around from the last rank to rank 0's next chunk; 1F1B's steady state
    pairs each send with the opposite-direction message of the same slot in one batch."""
    s = interleaved_1f1b(2, 2, 2)
    plan = p2p_plan(s)
    sends = [op.msg for b in plan[1] for op in b.ops if op.op == "send"]
    assert {op.peer for b in plan[1] for op in b.ops} == {0}
    assert [k for k in sends if k[0] == "act"] == [("act", 2, 0), ("act", 2, 1)]  # stage 1 -> stage 2
    assert sorted(k for k in sends if k[0] == "grad") == [("grad", 0, 0), ("grad", 0, 1), ("grad", 2, 0),
                                                          ("grad", 2, 1)]
    # what rank 1 receives from rank 0 is what rank 0 sends it, in the same order
    recvd = [op.msg for b in plan[1] for op in b.ops if op.op == "recv"]
    assert recvd == [op.msg for b in plan[0] for op in b.ops if op.op == "send"]
    one = p2p_plan(make_schedule("1f1b", 2, 3))
    assert [op.msg for b in one[0] for op in b.ops if op.op == "send"] == [("act", 1, i) for i in range(3)]
    mixed = [b for b in one[1] if {op.op for op in b.ops} == {"send", "recv"}]
    assert [str(op) for op in mixed[0].ops] == ["recv act(stage 1, mb 2) from rank 0",
                                                 "send grad(stage 0, mb 1) to rank 0"]


def test_recorded_timeline_and_chrome_trace_round_trip(tmp_path):
    slots = [[Slot(0, Action(F, 0), 10.0, 11.0), Slot(0, Action(BW, 0), 13.0, 15.0)],
             [Slot(1, Action(F, 0), 11.0, 12.0), Slot(1, Action(BW, 0), 12.0, 14.0)]]
    tl = recorded_timeline(slots, "1f1b")
    assert tl.makespan == 5.0 and tl.busy == [3.0, 3.0]
    # the bubble is idle / (busy + idle) over 2 ranks × 5 s (issue 46: was idle / busy, 4/6 here)
    assert tl.bubble_fraction == pytest.approx((2 * 5 - 6) / (2 * 5)) and tl.bubble_ratio == pytest.approx(4 / 6)
    path = write_chrome_trace(tmp_path / "t.json", tl, stage_of={0: [0], 1: [1]})
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 4 and {e["pid"] for e in xs} == {0, 1} and xs[0]["args"]["stage"] == 0
    back = read_chrome_trace(path)
    assert [[s.action for s in r] for r in back.slots] == [[s.action for s in r] for r in slots]
    assert back.bubble_fraction == pytest.approx(tl.bubble_fraction)
    # One file per rank on the absolute clock merges into the same picture.
    files = [write_rank_trace(tmp_path / f"r{r}.json", slots[r], r, 2, "1f1b") for r in range(2)]
    merged = read_chrome_trace(files)
    assert merged.makespan == pytest.approx(5.0) and merged.busy == pytest.approx([3.0, 3.0])
    with pytest.raises(ValueError, match="no pipeline actions"):
        (tmp_path / "empty.json").write_text("{}")
        read_chrome_trace(tmp_path / "empty.json")


class _PipelineGroup:
    """Stands in for the pp group of `measured_bubble`: its all-gather hands back this rank's statistics
    followed by those of `others`, as each of those ranks computes its own (`busy_window` of its slots)."""

    def __init__(self, others: list[list[Slot]]) -> None:
        self.others = others
        self.ctx = types.SimpleNamespace(device=torch.device("cpu"), size=lambda dim: 1 + len(others))

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor, dim: str) -> None:
        rows = [mine, *(torch.tensor(busy_window(slots), dtype=torch.float64) for slots in self.others)]
        out.copy_(torch.cat(rows))


def _measured(*ranks: list[tuple[float, float]]) -> float:
    slots = [[Slot(r, Action(F, i), t0, t1) for i, (t0, t1) in enumerate(spans)] for r, spans in enumerate(ranks)]
    return engine_mod.measured_bubble(engine_mod.PipelineStepResult(None, slots[0], 1), _PipelineGroup(slots[1:]))


def test_the_measured_bubble_is_the_idle_share_of_the_step_at_its_bounds():
    """Issue 46: the measured bubble was (p·makespan − Σ busy) / Σ busy, 1.0355 on a loaded machine; it is
    idle / (busy + idle), each rank's busy time taken inside its own window, so in [0, 1] by construction."""
    assert _measured([(0.0, 4.0), (4.0, 10.0)], [(0.0, 10.0)]) == 0.0  # every rank busy the whole window
    # idle all the window but for one short action each: near 1 (the old ratio: 9999)
    assert _measured([(0.0, 1e-3)], [(10.0 - 1e-3, 10.0)]) == pytest.approx(1 - 1e-4)
    assert _measured([(0.0, 1.0)], [(9.0, 10.0)]) == pytest.approx(0.9)  # the old ratio: 9.0
    # timestamps of a loaded machine: overlapping marks (the old formula went negative), a slot ending a
    # tick before it starts; a rank without actions is idle throughout
    assert _measured([(0.0, 5.1), (5.0, 10.0)], [(0.0, 10.0)]) == 0.0
    assert _measured([(0.0, 10.0), (3.0, 3.0 - 1e-6)], [(0.0, 10.0)]) == 0.0
    assert _measured([(0.0, 10.0)], []) == 0.5
    rng = random.Random(46)
    for _ in range(300):  # jittered, overlapping, skewed: always a share
        starts = [[rng.uniform(0, 10) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 4))]
        ranks = [sorted((t, t + rng.uniform(-0.01, 1.0)) for t in ts) for ts in starts]
        assert 0.0 <= _measured(*ranks) <= 1.0, ranks
