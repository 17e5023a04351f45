"""Chips of one SKU do not run equally fast, and a synchronous training step waits for the slowest.

Sinha et al., "Not All GPUs Are Created Equal: Characterizing Variability in Large-Scale, Accelerator-Rich
Systems" (SC22, arXiv:2208.11035) ran compute-bound kernels (SGEMM among them) on over 90 % of the GPUs of
five clusters (V100 on Summit, Vortex, Longhorn; RTX 5000 on Frontera; MI60 on Corona; 18,800 GPU-hours):
"8% (max 22%) average performance variation" between GPUs of the same SKU, from manufacturing variability
and each chip's power management, "with outliers up to 1.5X slower than the median GPU". We read that 8 % as
the spread between the box plots' whiskers (Tukey's, 1.5 IQR past the quartiles), outliers excluded: for
normally distributed chip speeds the whiskers of a large sample sit at +/-2.698 sigma, so sigma = 8 % / 5.396
= 1.48 % of the median chip's speed (`CHIP_SPREAD`). Outliers are left out: large runs find and drain them.

The time model's kernel rates are one (median) chip's, so on n chips that wait for each other every step
(tensor and pipeline groups every micro-batch, data parallelism every step) the compute runs at the expected
slowest of n draws: 1 + sigma * E[max of n standard normals] (Blom's approximation of the order statistic):
+2.1 % on 8 GPUs, +4.2 % on 256, +5.8 % on 12,288. Applied on every datasheet GPU (A100, Hopper, Blackwell
alike; the measurement is of V100/MI60-era power management, inferred to hold); 0 on CPUs and for one chip.
`benchmarks/gpu_check.py` part chip_spread measures the spread of a host's GPUs against this model.
"""

from __future__ import annotations

from statistics import NormalDist

PUBLISHED_RANGE = 0.08  # Sinha et al.'s average whisker-to-whisker spread of chip speeds, over the median
_TUKEY_WHISKER_SIGMAS = 2.698  # a normal sample's 1.5-IQR whisker, in sigma (0.6745 + 1.5 x 1.349)


def spread_from_range(whisker_range: float) -> float:
    """sigma from a whisker-to-whisker spread of chip speeds (fraction of the median): `CHIP_SPREAD` from 0.08."""
    return whisker_range / (2 * _TUKEY_WHISKER_SIGMAS)


CHIP_SPREAD = spread_from_range(PUBLISHED_RANGE)  # 0.0148: sigma of a chip's speed over the median chip's


def slowest_chip(chips: int, spread: float) -> float:
    """The expected slowest of `chips` chips' compute time over the median chip's (>= 1; 1 for one chip)."""
    if chips <= 1 or spread <= 0:
        return 1.0
    return 1.0 + spread * NormalDist().inv_cdf((chips - 0.375) / (chips + 0.25))
