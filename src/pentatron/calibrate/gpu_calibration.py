"""A GPU's calibration from what `benchmarks/gpu_check.py` measured on it (issue 48, item 3).

Three things the check measures become `Efficiency` fields of that GPU (hardware/catalogue.py), written as a
hardware file (`base` = the catalogue entry, `pentatron plan --hardware-profile FILE`) or copied into the
catalogue, as the H100/H200 entries were from the H200 run of 2026-12-04 (benchmarks/measured/):

- `attention_by_seq`: each SDPA backend's forward and backward fraction of the dense peak by sequence length,
  from part kernel_rates' attention sweep (the shapes that share heads and head dim, at several lengths);
- `sdpa_kernel`: the kernel SDPA ran in training (part sdpa_backend);
- `our_step`: Pentatron's own step against the time model with those kernels, per kernel mode ("fused":
  compiled blocks, part train; "eager": part compile's eager run): (measured step - the model's optimizer) /
  the model's stage phases, i.e. what the model does not yet attribute, applied to our recipe's phases.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from pentatron.hardware.catalogue import Efficiency, GPUSpec
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.timing import step_time

# SDPA backend names (torch.nn.attention.SDPBackend) -> the planner's attention kernels
SDPA_BACKENDS = {"FLASH_ATTENTION": "flash2", "CUDNN_ATTENTION": "cudnn"}
# part sdpa_backend's verdict -> the planner's kernel
SDPA_VERDICTS = {"flash": "flash2", "cudnn": "cudnn"}


def attention_by_seq(kernel_rates: dict[str, Any]) -> dict[str, tuple[tuple[float, ...], ...]]:
    """Per planner kernel, (seq lengths, forward, backward) efficiencies from the attention sweep: the rows of
    the most common (heads, kv heads, head dim) shape, ordered by length (3 decimals)."""
    rows = kernel_rates["attention"]
    shape = Counter((r["bhkvsd"][1], r["bhkvsd"][2], r["bhkvsd"][4]) for r in rows).most_common(1)[0][0]
    sweep = sorted((r for r in rows if (r["bhkvsd"][1], r["bhkvsd"][2], r["bhkvsd"][4]) == shape),
                   key=lambda r: r["bhkvsd"][3])
    out: dict[str, tuple[tuple[float, ...], ...]] = {}
    for backend, kernel in SDPA_BACKENDS.items():
        got = [(r["bhkvsd"][3], *r["backends"][backend]["efficiency"]) for r in sweep
               if "efficiency" in r["backends"].get(backend, {})]
        if len(got) >= 2:
            out[kernel] = tuple(tuple(round(float(x), 3) if i else float(x) for x in col)
                                for i, col in enumerate(zip(*got, strict=True)))
    return out


def sdpa_kernel(sdpa_part: dict[str, Any]) -> str | None:
    """The planner kernel SDPA ran in training, None when the check saw neither flash nor cuDNN."""
    return SDPA_VERDICTS.get(sdpa_part.get("backend", ""))


def with_kernels(gpu: GPUSpec, curves: dict[str, tuple[tuple[float, ...], ...]], sdpa: str | None) -> GPUSpec:
    """`gpu` with the measured attention and none of its own step calibration (the model before `our_step`)."""
    eff = dataclasses.replace(gpu.efficiency, attention_by_seq={**gpu.efficiency.attention_by_seq, **curves},
                              sdpa_kernel=sdpa or gpu.efficiency.sdpa_kernel, our_step={})
    return dataclasses.replace(gpu, efficiency=eff)


def measured_over_model(measured_step_s: float, w: Workload, lay: Layout, gpu: GPUSpec, kernels: str) -> float:
    """(measured step - the model's optimizer) / the model's pipeline of stage phases, on an uncalibrated
    `gpu` (one GPU: no communication in the step)."""
    st = step_time(w, lay, gpu, kernels=kernels)
    return round((measured_step_s - st.optimizer) / st.pipeline, 3)


def calibrated(gpu: GPUSpec, curves: dict[str, tuple[tuple[float, ...], ...]], sdpa: str | None,
               our_step: dict[str, float]) -> Efficiency:
    """The calibrated efficiencies of `gpu`."""
    return dataclasses.replace(with_kernels(gpu, curves, sdpa).efficiency, our_step=dict(our_step))


def hardware_toml(base: str, eff: Efficiency, source: str) -> str:
    """A hardware file for `pentatron plan --hardware-profile`: the catalogue entry `base` with the measured
    attention, SDPA kernel and our step."""
    lines = [f'base = "{base}"', f'name = "{base}-measured"', f'source = "{source}"',
             f'sdpa_kernel = "{eff.sdpa_kernel}"', "",
             "[our_step]", *(f"{k} = {v}" for k, v in eff.our_step.items()), ""]
    for kernel, (seqs, fwd, bwd) in eff.attention_by_seq.items():
        lines += [f"[attention_by_seq.{kernel}]", f"seq = {[int(s) for s in seqs]}", f"forward = {list(fwd)}",
                  f"backward = {list(bwd)}", ""]
    return "\n".join(lines)
