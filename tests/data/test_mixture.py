"""Weighted mixtures (data.sources, data/mixture.py) without a model: the sources' shares follow the weights
within sampling error, every sample is its source's tokens in that source's own order, a dp=N layout (any
micro-batching) reads the dp=1 run's samples, a resume in another layout continues the same sequence, a source
that runs out is said (wrap) or ends the run (stop), per-source holdouts are never trained on, and bad settings
are one clear error. (The trained parity of a mixture resumed in another layout: tests/checkpoint/test_reshard.py.)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from pentatron.config import ConfigError, EvalConfig, load_config
from pentatron.data.errors import DataError
from pentatron.data.eval_split import eval_sets, mixture_eval_problems, training_tokens
from pentatron.data.loader import TokenDataset, TokenLoader
from pentatron.data.mixture import MixtureLoader, exhaustion, mixture_problems
from tests.data.test_loader import write_dataset

SEQ = 8
NAMES, WEIGHTS = ["web", "code", "math"], [5.0, 3.0, 2.0]
SIZES = (801, 401, 161)  # 100, 50 and 20 samples of SEQ


@pytest.fixture(scope="module")
def raws() -> list[np.ndarray]:
    # disjoint id ranges: a sample's tokens say which source they came from
    return [np.random.default_rng(k).integers(300 * k + 1, 300 * k + 300, size=n) for k, n in enumerate(SIZES)]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, raws) -> list[TokenDataset]:
    root = tmp_path_factory.mktemp("mix")
    return [TokenDataset(write_dataset(root / n, r, shard_tokens=150, fingerprint=f"{k:016d}"))
            for k, (n, r) in enumerate(zip(NAMES, raws, strict=True))]


def _mix(datasets, **kw) -> MixtureLoader:
    kw = {"seq_len": SEQ, "micro_batch": 2, "global_batch": 8, "seed": 7, **kw}
    return MixtureLoader(datasets, NAMES, WEIGHTS, **kw)


def _source_of(tokens: np.ndarray) -> int:
    return int(tokens.max()) // 300


def test_the_shares_follow_the_weights_within_sampling_error(datasets):
    """Each position draws its source independently with probability p_k = w_k / Σw, so after P positions
    source k's count is Binomial(P, p_k): within 5 standard deviations √(P p_k (1 − p_k)) — a bound a fair
    draw breaks with probability below 6e-7 per source (and the draw is seeded: the verdict never changes)."""
    loader = _mix(datasets)
    positions = 50_000  # 13 blocks of draws, and 250+ epochs of the smallest source
    counts = loader.source_samples(positions)
    assert counts.sum() == positions
    for k, w in enumerate(WEIGHTS):
        p = w / sum(WEIGHTS)
        sigma = math.sqrt(positions * p * (1 - p))
        assert abs(counts[k] - positions * p) <= 5 * sigma, (NAMES[k], counts[k], positions * p, sigma)
    # per step, as the trainer logs them: the counts are the draws' bincount (one sample each)
    choices = loader.choices(0, positions)
    np.testing.assert_array_equal(np.bincount(choices, minlength=3), counts)


def test_each_sample_is_its_sources_tokens_in_that_sources_own_order(datasets, raws):
    loader = _mix(datasets)
    steps = 40  # 320 samples: past an epoch of every source (web 160, code 96, math 64 expected)
    ids = loader.sample_ids(0, steps * 8)
    choices = loader.choices(0, steps * 8)
    per_source: list[list[int]] = [[], [], []]
    for _ in range(steps):
        for x, y in loader.next_step():
            for xi, yi in zip(x, y, strict=True):
                k = _source_of(xi.numpy())
                raw = raws[k]
                start = int(np.flatnonzero([np.array_equal(raw[i * SEQ: i * SEQ + SEQ], xi.numpy())
                                            for i in range(len(raw) // SEQ)])[0])
                assert yi.tolist() == raw[start * SEQ + 1: start * SEQ + SEQ + 1].tolist()
                per_source[k].append(start)
    assert [_source_of(loader.sample(int(i))) for i in ids] == choices.tolist()
    for k, ds in enumerate(datasets):  # the order of a lone source of the same stream number, epoch after epoch
        alone = TokenLoader(ds, SEQ, 1, 1, seed=7, stream=k)
        assert per_source[k] == alone.sample_ids(0, len(per_source[k])).tolist(), NAMES[k]
        assert len(per_source[k]) > alone.num_samples  # wrapped at least once
    state = loader.state_dict()
    assert [s["samples"] for s in state["sources"]] == [len(p) for p in per_source]


@pytest.mark.parametrize("dp, micro", [(2, 1), (4, 2)])
def test_a_dp_layout_reads_the_samples_of_one_process(datasets, dp, micro):
    one = _mix(datasets)
    ranks = [_mix(datasets, dp_rank=r, dp_size=dp, micro_batch=micro) for r in range(dp)]
    for _ in range(15):
        want = torch.cat([x for x, _ in one.next_step()])
        got = torch.cat([x for rank in ranks for x, _ in rank.next_step()])
        assert torch.equal(got, want)


def test_a_resume_in_another_layout_continues_the_same_sequence(datasets):
    straight = _mix(datasets)
    want = [torch.cat([x for x, _ in straight.next_step()]) for _ in range(12)]
    first = _mix(datasets)
    for _ in range(5):
        first.next_step()
    state = first.state_dict()
    assert state["consumed_samples"] == 40 and sum(s["samples"] for s in state["sources"]) == 40
    # dp=2 ranks with another micro-batch, freshly built (no memory of the draws before the resume)
    ranks = [_mix(datasets, dp_rank=r, dp_size=2, micro_batch=4) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(state)
        np.testing.assert_array_equal(rank.source_samples(40), [s["samples"] for s in state["sources"]])
    for step in range(5, 12):
        assert torch.equal(torch.cat([x for rank in ranks for x, _ in rank.next_step()]), want[step]), step
    # a global batch that changes at the resume keeps the sequence of positions: 12 samples per step now
    wide = _mix(datasets, global_batch=12, micro_batch=4)
    wide.load_state_dict(state)
    flat = torch.cat(want[5:11])  # positions 40 … 88
    assert torch.equal(torch.cat([x for _ in range(4) for x, _ in wide.next_step()]), flat)


def test_a_resume_with_other_sources_or_weights_or_a_data_path_state_is_refused(datasets):
    saved = _mix(datasets)
    saved.next_step()
    state = saved.state_dict()
    other = MixtureLoader(datasets, NAMES, [5.0, 3.0, 1.0], SEQ, 2, 8, seed=7)
    with pytest.raises(DataError, match="math weight 2, 20 samples.*math weight 1, 20 samples"):
        other.load_state_dict(state)
    held = MixtureLoader(datasets, NAMES, WEIGHTS, SEQ, 2, 8, seed=7,
                         train_tokens=[training_tokens(EvalConfig(holdout=0.2), len(d)) for d in datasets])
    with pytest.raises(DataError, match="same sources, weights, datasets and \\[eval\\] holdout"):
        held.load_state_dict(state)
    single = TokenLoader(datasets[0], SEQ, 2, 8, seed=7)
    with pytest.raises(DataError, match="mixture of 3 data.sources"):
        single.load_state_dict(state)
    with pytest.raises(DataError, match="one dataset \\(data.path\\)"):
        saved.load_state_dict(single.state_dict())
    broken = {**state, "consumed_samples": 9}
    with pytest.raises(DataError, match="do not add up to consumed_samples=9"):
        saved.load_state_dict(broken)


def test_a_source_that_runs_out_is_said_and_stop_ends_before_it(datasets):
    loader = _mix(datasets)
    said: list[tuple[int, str]] = []
    for step in range(1, 30):
        lines, stop = exhaustion(loader, step, "wrap")
        assert not stop
        said += [(step, line) for line in lines]
        before = loader.source_samples(loader.consumed_samples)
        loader.next_step()
        after = loader.source_samples(loader.consumed_samples)
        for k, num in enumerate(loader.source_num_samples):  # said exactly at the step that crosses an epoch
            crossed = (after[k] - 1) // num > max(before[k] - 1, 0) // num
            assert crossed == any(f"'{NAMES[k]}' ran out at step {step}:" in line for line in lines), (k, step)
    first = next(s for s, line in said if "'math'" in line)
    assert any("'math'" in line and "trained once" in line and 'epoch 2 of it begins' in line for _, line in said)
    # "stop" says the same thing and stops before that step, on every rank alike
    stopping = _mix(datasets, dp_rank=1, dp_size=2)
    for step in range(1, first):
        assert exhaustion(stopping, step, "stop") == ([], False)
        stopping.next_step()
    lines, stop = exhaustion(stopping, first, "stop")
    assert stop and lines[0].endswith(f'data.on_exhausted = "stop": the run ends after step {first - 1}')
    # the data.path loader: the same rule on its one source
    single = TokenLoader(datasets[2], SEQ, 2, 8, seed=7)
    events = []
    for step in range(1, 8):
        events += [step for _ in exhaustion(single, step, "wrap")[0]]
        single.next_step()
    assert events == [3, 6]  # 20 samples, 8 a step: positions 20 (step 3) and 40 (step 6) begin epochs 2 and 3


def test_per_source_holdouts_are_never_trained_and_validated_apart(datasets, raws):
    ev = EvalConfig(every=1, holdout=0.25)
    keep = [training_tokens(ev, len(d)) for d in datasets]
    loader = MixtureLoader(datasets, NAMES, WEIGHTS, SEQ, 2, 8, seed=7, train_tokens=keep)
    bases = np.cumsum([0] + loader.source_num_samples)
    ids = loader.sample_ids(0, 400)  # every source past an epoch
    for i in ids:
        k = int(np.searchsorted(bases, i, side="right")) - 1
        # the window [j·L, j·L + L + 1) ends at or before the split: no held-out token is an input or a target
        assert (i - bases[k]) * SEQ + SEQ + 1 <= keep[k], NAMES[k]
    assert {int(np.searchsorted(bases, i, side="right")) - 1 for i in ids} == {0, 1, 2}
    sets = eval_sets(ev, datasets, NAMES, WEIGHTS, SEQ, 1000)
    assert [(n, w) for n, w, _ in sets] == list(zip(NAMES, WEIGHTS, strict=True))
    for (_, _, held), raw, k in zip(sets, raws, keep, strict=True):
        assert held.start == k
        np.testing.assert_array_equal(held.sample(0), raw[k: k + SEQ + 1])
    (short,) = mixture_eval_problems(EvalConfig(every=1, holdout=0.25), datasets, NAMES, SEQ, 8, 1000)
    assert short.startswith("data source 'math': the held-out split holds 40 tokens = 4 validation sequences")


def test_sources_must_share_a_tokenizer(datasets, raws, tmp_path):
    other = TokenDataset(write_dataset(tmp_path / "other", raws[0], shard_tokens=500))
    other.index = dataclasses.replace(other.index, eos_id=5, eos_token="</s>")
    (p,) = mixture_problems([datasets[0], other], ["web", "other"])
    assert "ends documents with '</s>' = id 5" in p and "pentatron tokenize --tokenizer" in p
    (datasets[0].path / "tokenizer.json").write_text("{}")
    (datasets[1].path / "tokenizer.json").write_text('{"model": 1}')
    try:
        (p,) = mixture_problems(datasets[:2], NAMES[:2])
        assert "another tokenizer.json" in p
    finally:
        for ds in datasets[:2]:
            (ds.path / "tokenizer.json").unlink()
    assert mixture_problems(datasets, NAMES) == []


@pytest.mark.parametrize("overrides, message", [
    (["data.path='{a}'", "data.sources=[{{path='{a}'}}]"], "data.path and data.sources are both set"),
    (["data.sources=[{{path='{a}', weight=0}}]"], "data.sources[0].weight must be > 0"),
    (["data.sources=[{{path='{a}', weight=-1.5}}]"], "data.sources[0].weight must be > 0"),
    (["data.sources=[{{path='{a}', weight=nan}}]"], "data.sources[0].weight"),
    (["data.sources=[{{path='{a}/nope'}}]"], "data.sources[0].path '{a}/nope' does not exist"),
    (["data.sources=[{{weight=2.0}}]"], "data.sources[0].path is empty"),
    (["data.sources=[{{path='{a}'}}, {{path='{a}'}}]"], "data.sources[0], data.sources[1] are all named 'web'"),
    (["data.sources=[{{path='{a}', wieght=2}}]"], "did you mean data.sources[0].weight?"),
    (["data.sources=['{a}']"], "data.sources[0] must be a table"),
    (["data.sources='{a}'"], "data.sources must be a list"),
    (["data.on_exhausted='repeat'"], "data.on_exhausted must be one of 'wrap', 'stop'"),
])
def test_bad_mixture_settings_are_one_clear_error(datasets, overrides, message):
    a = str(datasets[0].path)
    with pytest.raises(ConfigError) as e:
        load_config(None, [o.format(a=a) for o in overrides])
    assert message.format(a=a) in str(e.value)


def test_a_mixture_config_loads_back_as_itself(datasets):
    a, b = (str(d.path) for d in datasets[:2])
    cfg = load_config(None, [f"data.sources=[{{path='{a}', weight=2}}, {{path='{b}', name='py'}}]"], world_size=1)
    assert [(s.label(), s.weight) for s in cfg.data.sources] == [("web", 2.0), ("py", 1.0)]
    again = load_config(None, [f"data.sources={_toml(cfg.resolved_dict(1)['data']['sources'])}"], world_size=1)
    assert again.data.sources == cfg.data.sources


def _toml(rows: list[dict]) -> str:
    return "[" + ", ".join("{" + ", ".join(f"{k}={v!r}" for k, v in r.items()) + "}" for r in rows) + "]"
