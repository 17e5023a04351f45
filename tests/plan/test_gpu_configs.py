"""The example configs for real models on GPUs (configs/gpu/, written by `pentatron plan --emit-config`; the
commands are in configs/gpu/README.md) stay valid: each loads through the trainer's validation on the GPU
count its header names, and the planner, given the file's own layout, predicts that it fits (with the plan's
default memory headroom), with the layout and memory the header states."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pentatron.config import load_config
from pentatron.hardware.catalogue import GiB, get_gpu, with_overrides
from pentatron.observe.report import planner_layout
from pentatron.plan.cli import DEFAULT_HEADROOM
from pentatron.plan.emit import _PLACEHOLDERS
from pentatron.plan.recipes import kernels_for_compile
from pentatron.plan.search import memory_budget, predict

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "gpu").glob("*.toml"))
HEADER = re.compile(r"# written by `pentatron plan` for (\S+) on (\d+) x (\S+): (.+)\n"
                    r"# predicted .* ([\d.]+) GiB per GPU")


def test_the_examples_cover_a_dense_8b_70b_a_qwen3_and_an_moe():
    names = {p.stem for p in CONFIGS}
    assert {"llama3-8b-8xh100", "llama3.1-70b-64xh100", "qwen3-32b-32xh100", "mixtral-8x7b-32xh100"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_a_gpu_example_loads_and_fits_as_its_header_says(path):
    m = HEADER.match(path.read_text())
    assert m, f"{path}: no `pentatron plan` header"
    model, gpus, gpu_name, layout, gib = m.group(1), int(m.group(2)), m.group(3), m.group(4), float(m.group(5))
    unset = [f'{section}.{name}=""' for section, name, _ in _PLACEHOLDERS]  # the placeholders a user fills
    cfg = load_config(path, unset, world_size=gpus)
    assert cfg.model_config().name == model
    lay, w = planner_layout(cfg, gpus, "cuda")
    gpu = with_overrides(get_gpu(gpu_name), headroom=DEFAULT_HEADROOM)
    pred = predict(w, lay, gpu, kernels=kernels_for_compile(cfg.train.compile, "cuda"))
    assert lay.world == gpus and lay.short() == layout
    assert pred.fits and not pred.tight and pred.memory.total <= memory_budget(gpu)
    assert pred.memory.total / GiB == pytest.approx(gib, abs=0.051)
    assert not pred.notes or all("training cannot run" not in n for n in pred.notes)
