"""The validation split (data/eval_split.py) and [eval]'s configuration: held-out tokens are never read by
training, no holdout leaves training's data exactly as without [eval], validation samples are the same
whatever the dp layout, a resume across a changed holdout is refused, and bad settings are one clear error.
(The forward-only pipeline schedule's validity: at the end.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pentatron.config import ConfigError, EvalConfig, load_config
from pentatron.data.errors import DataError
from pentatron.data.eval_split import EvalSet, eval_data_problems, eval_set, training_tokens
from pentatron.data.loader import TokenDataset, TokenLoader
from pentatron.schedules import Kind, Schedule, ScheduleError, forward_only, p2p_plan, validate
from tests.data.test_loader import write_dataset

SEQ, GLOBAL = 8, 4


@pytest.fixture
def raw() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 1000, size=1001)


@pytest.fixture
def dataset(tmp_path, raw) -> TokenDataset:
    return TokenDataset(write_dataset(tmp_path / "ds", raw, shard_tokens=300))


def _loader(dataset: TokenDataset, ev: EvalConfig, **kw) -> TokenLoader:
    return TokenLoader(dataset, seq_len=SEQ, micro_batch=2, global_batch=GLOBAL, seed=3,
                       train_tokens=training_tokens(ev, len(dataset)), **kw)


def test_without_a_holdout_training_reads_what_it_read_before_eval_existed(dataset):
    for ev in (EvalConfig(), EvalConfig(every=5, path="elsewhere")):
        with_eval, before = _loader(dataset, ev), TokenLoader(dataset, seq_len=SEQ, micro_batch=2,
                                                              global_batch=GLOBAL, seed=3)
        assert with_eval.num_samples == before.num_samples == (len(dataset) - 1) // SEQ
        for _ in range(40):  # past an epoch (125 samples)
            for (x, y), (x0, y0) in zip(with_eval.next_step(), before.next_step(), strict=True):
                assert torch.equal(x, x0) and torch.equal(y, y0)


@pytest.mark.parametrize("ev", [EvalConfig(holdout=0.2), EvalConfig(holdout_tokens=203)])
def test_held_out_tokens_are_never_trained_on(dataset, raw, ev):
    split = training_tokens(ev, len(dataset))
    assert split == len(raw) - (203 if ev.holdout_tokens else round(0.2 * len(raw)))
    loader = _loader(dataset, ev)
    seen = np.zeros(len(raw), dtype=bool)  # every token position a training step reads, input or target
    for _ in range(2 * loader.num_samples // GLOBAL + 1):  # two epochs and more
        first = loader.consumed_samples
        for i in loader.sample_ids(first, GLOBAL):
            seen[i * SEQ: i * SEQ + SEQ + 1] = True
        loader.next_step()
    assert seen[:split - SEQ].all() and not seen[split:].any()
    held = eval_set(ev, dataset, SEQ, 1000)
    assert held.start == split and held.num_samples == (len(raw) - split - 1) // SEQ
    np.testing.assert_array_equal(held.sample(0), raw[split: split + SEQ + 1])
    np.testing.assert_array_equal(held.sample(held.num_samples - 1)[-1], raw[split + held.num_samples * SEQ])


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_validation_batches_are_the_first_held_out_samples_split_over_dp(dataset, raw, dp):
    held = EvalSet(dataset, 500, SEQ)
    batches = 2
    ranks = [list(held.steps(batches, GLOBAL, 1, r, dp)) for r in range(dp)]
    for b in range(batches):
        inputs = torch.cat([x for r in range(dp) for x, _ in ranks[r][b]])
        targets = torch.cat([y for r in range(dp) for _, y in ranks[r][b]])
        for k in range(GLOBAL):
            start = 500 + (b * GLOBAL + k) * SEQ
            assert inputs[k].tolist() == raw[start: start + SEQ].tolist()
            assert targets[k].tolist() == raw[start + 1: start + SEQ + 1].tolist()


def test_eval_path_is_validated_on_whole_and_checked_against_the_vocabulary(dataset, tmp_path, raw):
    other = write_dataset(tmp_path / "other", raw[:300], shard_tokens=100)
    ev = EvalConfig(every=1, path=str(other))
    assert training_tokens(ev, len(dataset)) == len(dataset)
    held = eval_set(ev, dataset, SEQ, 1000)
    assert held.start == 0 and held.num_samples == 299 // SEQ
    np.testing.assert_array_equal(held.sample(1), raw[SEQ: 2 * SEQ + 1])
    with pytest.raises(DataError, match="model.vocab_size=500"):
        eval_set(ev, dataset, SEQ, 500)


def test_a_resume_with_another_holdout_is_refused(dataset):
    saved = _loader(dataset, EvalConfig(holdout=0.1))
    saved.next_step()
    other = _loader(dataset, EvalConfig(holdout=0.3))
    with pytest.raises(DataError, match="eval.holdout"):
        other.load_state_dict(saved.state_dict())
    same = _loader(dataset, EvalConfig(holdout=0.1))
    same.load_state_dict(saved.state_dict())
    assert same.consumed_samples == GLOBAL


def test_sizes_that_cannot_work_are_said_before_training(dataset):
    assert eval_data_problems(EvalConfig(), dataset, SEQ, GLOBAL, 1000) == []
    (short,) = eval_data_problems(EvalConfig(every=1, batches=3, holdout_tokens=90), dataset, SEQ, GLOBAL, 1000)
    assert "11 validation sequences" in short and "3 × 4 = 12" in short and "lower eval.batches" in short
    (greedy,) = eval_data_problems(EvalConfig(holdout=0.995), dataset, SEQ, GLOBAL, 1000)
    assert "hold out less" in greedy
    assert "eval.path" in eval_data_problems(EvalConfig(every=1, path=str(dataset.path / "nope")), dataset, SEQ,
                                             GLOBAL, 1000)[0]


@pytest.mark.parametrize("overrides, message", [
    (["eval.every=10"], "no validation data: set eval.holdout"),
    (["eval.every=-1"], "eval.every must be ≥ 0"),
    (["eval.batches=0"], "eval.batches must be ≥ 1"),
    (["eval.holdout=1.0"], "eval.holdout must be within [0, 1)"),
    (["eval.holdout_tokens=-5"], "eval.holdout_tokens must be ≥ 0"),
    (["eval.holdout=0.1", "eval.path='x'"], "eval.holdout and eval.path are both set"),
    (["eval.path='/no/such/dir'"], "eval.path '/no/such/dir' does not exist"),
    (["eval.evry=3"], "did you mean eval.every?"),
])
def test_bad_eval_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides, world_size=1)
    assert message in str(e.value)


@pytest.mark.parametrize("p, m, v", [(2, 4, 1), (4, 3, 1), (2, 4, 2), (4, 8, 3), (3, 1, 2)])
def test_the_forward_only_schedule_is_valid_and_runs_every_forward_once(p, m, v):
    s = forward_only(p, m, v)
    validate(s)  # dependencies, completion, and its p2p plan under NCCL's rules
    assert all(a.kind == Kind.F for acts in s.actions for a in acts)
    assert sorted((s.stage(r, a.chunk), a.microbatch) for r in range(p) for a in s.actions[r]) == \
        [(st, i) for st in range(p * v) for i in range(m)]
    sends = [op for batches in p2p_plan(s) for b in batches for op in b.ops if op.op == "send"]
    assert all(op.msg[0] == "act" for op in sends) and len(sends) == (p * v - 1) * m


def test_a_training_schedule_without_its_backwards_is_still_refused():
    from pentatron.schedules import Action, one_f_one_b

    s = one_f_one_b(2, 2)
    broken = Schedule(2, 2, 1, [s.actions[0], [a for a in s.actions[1] if a != Action(Kind.BW, 1)]])
    with pytest.raises(ScheduleError, match="needs exactly one BW"):
        validate(broken)
