"""Resume into another layout (and another number of processes): 2 steps + save in one layout, then
resume to step 4 in another — dp2 ZeRO-1 → tp2×pp2, tp2 → dp4 ZeRO-3, pp2 → 1 process, and out of and into
context parallelism (cp2 ZeRO-1 → dp4 ZeRO-2, dp2 → cp2 Ulysses × dp2 ZeRO-3), the 8-rank
dp2 × tp2 × pp2 ZeRO-2 (SP) → dp4 ZeRO-3, and MoE models into and out of expert parallelism (ep2 × dp2
ZeRO-1 → tp2 × dp2 ZeRO-2 with the aux-free router biases; pp2 → ep4 × dp4 ZeRO-3), HSDP to and from plain
ZeRO-3 (dp2 ZeRO-3 → 2 replicas × 2 shards; 2 × 2 shards × tp2 → dp4 ZeRO-3), and a weighted mixture
of two sources (data.sources, document masking, per-source validation) dp2 ZeRO-1 → tp2 × pp2, whose
validation losses match too. Every run is float64
(model, gradients, optimizer state, collectives): the four losses and the final parameters match an
uninterrupted 1-process run of the same model to `EXACT_RTOL` (1e-10) relative, and every step reads exactly
the same global samples. Model and optimizer state (exp_avg, exp_avg_sq, step) are re-sharded from the
pieces' descriptions (checkpoint/reshard.py).

The reference is the trainer in 1 process, not tests/reference_loop.py: two of the models are MoE (router,
load-balancing loss, aux-free selection biases), which the plain loop does not implement, and the sample
check needs the trainer's loader. tests/train/test_reference_loop.py pins that 1-process trainer to the
plain loop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pentatron.config import load_config
from pentatron.precision import wide
from tests.documents_data import write_documents_dataset
from tests.multiprocess import run_ranks
from tests.reference_loop import EXACT_RTOL, FP64, relative_error

MOE, AUXFREE = "model.name='debug-moe'", "model.name='debug-moe-auxfree'"
# two document datasets under the run's root (`runs` writes them), 3:1, masked, validated per source
MIX = ["data.sources=[{{path='{root}/mix/web', weight=3}}, {{path='{root}/mix/code', weight=1}}]",
       "data.document_mask=true", "eval.every=2", "eval.holdout_tokens=288"]
# source label → (source world, source overrides, target world, target overrides)
MOVES = {
    "dp2 zero1 -> tp2 pp2": (2, ["parallel.dp=2", "parallel.zero=1"], 4, ["parallel.tp=2", "parallel.pp=2"]),
    "tp2 -> dp4 zero3": (2, ["parallel.tp=2"], 4, ["parallel.dp=4", "parallel.zero=3"]),
    "pp2 -> 1 process": (2, ["parallel.pp=2"], 1, []),
    "cp2 ring zero1 -> dp4 zero2": (2, ["parallel.cp=2", "parallel.zero=1"], 4, ["parallel.dp=4", "parallel.zero=2"]),
    "dp2 -> cp2 ulysses x dp2 zero3": (2, ["parallel.dp=2"], 4, ["parallel.dp=2", "parallel.cp=2",
                                                                "parallel.cp_mode='ulysses'", "parallel.zero=3"]),
    "dp2 tp2 pp2 zero2 -> dp4 zero3": (8, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sp=true",
                                           "parallel.zero=2"], 4, ["parallel.dp=4", "parallel.zero=3"]),
    "moe auxfree ep2 zero1 -> tp2 dp2 zero2": (2, [AUXFREE, "parallel.dp=2", "parallel.ep=2", "parallel.zero=1"],
                                               4, [AUXFREE, "parallel.tp=2", "parallel.dp=2", "parallel.zero=2"]),
    "moe pp2 -> ep4 dp4 zero3": (2, [MOE, "parallel.pp=2"], 4, [MOE, "parallel.dp=4", "parallel.ep=4",
                                                                  "parallel.zero=3"]),
    # HSDP (2 replicas × 2-rank shard groups) from and to plain ZeRO-3; the source composes it with tp2
    "dp2 zero3 -> hsdp dp4 2x2 zero3": (2, ["parallel.dp=2", "parallel.zero=3"], 4,
                                        ["parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=2"]),
    "hsdp dp4 2x2 tp2 zero3 -> dp4 zero3": (8, ["parallel.dp=4", "parallel.tp=2", "parallel.zero=3",
                                                "parallel.dp_shard=2"], 4, ["parallel.dp=4", "parallel.zero=3"]),
    "mixture dp2 zero1 -> tp2 pp2": (2, [*MIX, "parallel.dp=2", "parallel.zero=1"], 4,
                                     [*MIX, "parallel.tp=2", "parallel.pp=2"]),
}
STEPS, SAVED_AT = 4, 2
_TIED = {"lm_head.weight": "embed.weight", "embed.weight": "lm_head.weight"}


def _model(label: str) -> tuple[str, ...]:
    """The source's model and data overrides (none for the default dense debug model on the default
    corpus): the reference run's."""
    return tuple(o for o in MOVES[label][1] if o.startswith(("model.name=", "data.", "eval.")))


def _config(world: int, root: Path, tag: str, steps: int, extra: list[str], ckpt: str | None,
            precision: str = FP64):
    over = [precision, f"train.steps={steps}", "train.seq_len=32", "train.micro_batch=2", "train.global_batch=8",
            "train.warmup=2", "train.schedule='cosine'", "train.peak_tflops=1.0", "parallel.bucket_mb=0.05",
            "log.progress=false", "log.tensorboard=false", f"log.dir={json.dumps(str(root / 'log' / tag))}",
            *(o.format(root=root) for o in extra)]
    if ckpt:
        over.append(f"checkpoint.dir={json.dumps(str(root / 'ckpt' / ckpt))}")
    return load_config(None, over, world_size=world)


def _train(world: int, root: str, dataset: str, tag: str, steps: int, extra: list[str], ckpt: str | None,
           precision: str = FP64) -> dict[str, Any]:
    """Fit; the losses, the sample indices this rank read per step, and the final full parameters (fp64 as
    they are; bf16 widened to fp32 for numpy)."""
    from pentatron.train.trainer import Trainer

    cfg = _config(world, Path(root), tag, steps, extra, ckpt, precision)
    trainer = Trainer(cfg, dataset_dir=None if cfg.data.sources else Path(dataset))
    loaded = {k: wide(v).numpy() for k, v in trainer.runner.full_parameters().items()}  # as resumed
    reads: list[list[int]] = []
    sample, next_step = trainer.loader.sample, trainer.loader.next_step

    def recording_step():  # noqa: ANN202
        reads.append([])
        return next_step()

    def recording_sample(index: int):  # noqa: ANN202
        reads[-1].append(int(index))
        return sample(index)

    trainer.loader.sample, trainer.loader.next_step = recording_sample, recording_step
    records = trainer.fit()
    params = {k: wide(v).numpy() for k, v in trainer.runner.full_parameters().items()}
    trainer.engine.close()
    return {"steps": [r["step"] for r in records], "losses": [r["loss"] for r in records], "reads": reads,
            "vals": [(r["step"], r["val"]["loss"], r["val"].get("sources")) for r in records if "val" in r],
            "data_tokens": [r.get("data_tokens") for r in records],
            "params": params, "loaded": loaded}


def _source_ranks(rank: int, world: int, dataset: str, root: str) -> dict[str, Any]:
    return {label: _train(world, root, dataset, f"src-{i}", SAVED_AT, MOVES[label][1], f"c{i}")
            for i, label in enumerate(MOVES) if MOVES[label][0] == world}


def _target_ranks(rank: int, world: int, dataset: str, root: str) -> dict[str, Any]:
    return {label: _train(world, root, dataset, f"dst-{i}", STEPS, MOVES[label][3], f"c{i}")
            for i, label in enumerate(MOVES) if MOVES[label][2] == world}


def _merge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per label: losses (rank 0's; every rank logs the same), samples per step over all ranks, params
    (each pipeline rank holds its stages')."""
    out = {}
    for label in ranks[0]:
        per = [r[label] for r in ranks]
        steps = len(per[0]["reads"])
        out[label] = {"steps": per[0]["steps"], "losses": per[0]["losses"], "vals": per[0]["vals"],
                      "data_tokens": per[0]["data_tokens"],
                      "samples": [sorted({i for r in per for i in r["reads"][s]}) for s in range(steps)],
                      "params": {k: v for r in per for k, v in r["params"].items()},
                      "loaded": {k: v for r in per for k, v in r["loaded"].items()},
                      "all_losses": [r["losses"] for r in per]}
    return out


@pytest.fixture(scope="module")
def runs(default_dataset, tmp_path_factory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("reshard"))
    data = str(default_dataset)
    write_documents_dataset(Path(root) / "mix" / "web", total_tokens=32 * 80 + 1, seed=0)
    write_documents_dataset(Path(root) / "mix" / "code", total_tokens=32 * 16 + 1, seed=1)
    models = {_model(label) for label in MOVES}
    reference = {m: _merge([{"ref": _train(1, root, data, f"ref-{i}", STEPS, list(m), None)}])["ref"]
                 for i, m in enumerate(sorted(models))}
    sources = _merge(run_ranks(_source_ranks, 2, args=(data, root), timeout=600))
    sources.update(_merge(run_ranks(_source_ranks, 8, args=(data, root), timeout=600)))
    targets = _merge(run_ranks(_target_ranks, 4, args=(data, root), timeout=600))
    targets.update(_merge([_target_ranks(0, 1, data, root)]))
    return {"reference": reference, "sources": sources, "targets": targets}


@pytest.mark.parametrize("label", list(MOVES))
def test_resume_into_another_layout_continues_the_same_run(runs, label):
    ref, src, dst = runs["reference"][_model(label)], runs["sources"][label], runs["targets"][label]
    assert src["steps"] == [1, 2] and dst["steps"] == [3, 4]
    assert all(losses == dst["losses"] for losses in dst["all_losses"])
    np.testing.assert_allclose(src["losses"] + dst["losses"], ref["losses"], rtol=EXACT_RTOL, atol=0, err_msg=label)
    assert src["samples"] + dst["samples"] == ref["samples"], f"{label}: another set of samples was read"
    # [eval] (the mixture: per source, and their weighted mean) and data.sources' per-source token counts,
    # the resumed run's restored from the checkpoint
    assert [v[0] for v in src["vals"] + dst["vals"]] == [v[0] for v in ref["vals"]]
    assert len(ref["vals"]) == (2 if "eval.every=2" in MOVES[label][1] else 0)
    for (_, got, got_src), (_, want, want_src) in zip(src["vals"] + dst["vals"], ref["vals"], strict=True):
        assert got == pytest.approx(want, rel=EXACT_RTOL, abs=0), label
        assert (got_src or {}).keys() == (want_src or {}).keys()
        for name in got_src or {}:
            assert got_src[name] == pytest.approx(want_src[name], rel=EXACT_RTOL, abs=0), (label, name)
    assert src["data_tokens"] + dst["data_tokens"] == ref["data_tokens"], label
    if "mixture" in label:  # 3:1 over 32 samples: both sources read, the smaller one (7 samples) past an epoch
        assert set(ref["vals"][-1][2]) == {"web", "code"} and sum(ref["data_tokens"][-1].values()) == 32 * 32
        assert ref["data_tokens"][-1]["code"] > 7 * 32
    # Re-sharding moves values only: the resumed parameters are bitwise the saved ones.
    assert set(src["params"]) <= set(dst["loaded"]) | {"lm_head.weight"}
    for name, value in dst["loaded"].items():  # a tied head held by the last pipeline stage is the embedding
        saved = src["params"].get(name, src["params"].get(_TIED.get(name, "")))
        np.testing.assert_array_equal(value, saved, err_msg=f"{label}: {name}")
    # After 3 more steps the parameters equal the 1-process run's (relative in the norm sense: AdamW's
    # 1/(sqrt(v) + eps) magnifies reduction-order noise where a gradient is ~0, but fp64 noise stays far
    # below 1e-10 of the tensor).
    assert set(ref["params"]) <= set(dst["params"])
    for name in dst["params"]:
        want = ref["params"].get(name, ref["params"].get(_TIED.get(name, "")))
        err = relative_error(dst["params"][name], want)
        assert err <= EXACT_RTOL, f"{label}: {name} off by {err:.2e}"


def test_bf16_masters_reshard_in_one_process(default_dataset, tmp_path):
    """bf16 parameters with fp32 masters: the masters (not the rounded parameters) are what a re-sharded
    resume restores — ZeRO-0 → ZeRO-3 (dp = 1) continues bitwise like the uninterrupted run."""
    # What this test is about: not the fp64 parity mode. Clipping off: the gradient norm is the one thing
    # ZeRO-0 and ZeRO-3 compute in another order (whole parameters or 16 Ki-element pieces, in fp32), and its
    # last-bit difference in the clip factor moved the step-4 loss by 4.7e-6; without it the runs are
    # the same arithmetic, so any master restored from a rounded bf16 parameter shows as a difference.
    bf16 = ["train.precision='bf16'", "train.clip=0"]
    straight = _train(1, str(tmp_path), str(default_dataset), "bf16-straight", 4, bf16[1:], None, bf16[0])
    first = _train(1, str(tmp_path), str(default_dataset), "bf16-a", 2, bf16[1:], "bf16", bf16[0])
    resumed = _train(1, str(tmp_path), str(default_dataset), "bf16-b", 4, ["parallel.zero=3", *bf16[1:]], "bf16",
                     bf16[0])
    assert resumed["steps"] == [3, 4]
    assert first["losses"] + resumed["losses"] == straight["losses"]
    assert set(resumed["params"]) == set(straight["params"])
    for name, p in straight["params"].items():
        np.testing.assert_array_equal(resumed["params"][name], p, err_msg=name)
