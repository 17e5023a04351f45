"""The inter-node latency and bandwidth of a cluster from its own collective measurement.

A ring all-gather or reduce-scatter of S bytes over n ranks takes (n - 1) alpha + (n - 1)/n S / B:
n - 1 steps, each waiting for the slowest (inter-node) hop, plus the bytes at the bus bandwidth B of
a group holding every GPU of its nodes. This fits alpha and B to measured bus bandwidths by node count
(relative least squares: each point weighs the same whatever its time) and prints the
`published_runs.toml` hardware override they imply: `inter_node_latency_us` = alpha and
`inter_node_bandwidth_gb_s` = B / (gpus_per_node x collective_efficiency), the planner's link model
for a node-full group (comm.bus_bandwidth).

The built-in data is the Ultra-Scale Playbook's own measurement on the cluster its benchmark runs used
(figure "Communication Bandwidth by Number of Nodes (size=256MB)", plot data
assets/data/benchmarks/pp_comm_bandwidth.html of the playbook space, median of each node count, 8 H100
per node). All-reduce is left out: NCCL switches it between ring and tree, so it is not one ring (the same
figure's all-reduce serves as a ceiling instead: `allreduce_busbw_by_nodes` in published_runs.toml).

    python research/fit_ring_alpha_beta.py
"""

from __future__ import annotations

import numpy as np

from pentatron.hardware.catalogue import get_gpu

PLAYBOOK_NODES = (2, 4, 8, 16, 32, 64)
PLAYBOOK_BUSBW_GB_S = {  # median bus bandwidth, GB/s, 256 MB messages
    "all_gather": (184.6, 119.0, 69.0, 55.0, 28.0, 11.0),
    "reduce_scatter": (181.6, 115.8, 68.6, 54.5, 27.9, 11.1),
}
MESSAGE_BYTES = 256e6


def ring_seconds(ranks: np.ndarray, busbw: np.ndarray, nbytes: float) -> np.ndarray:
    """Time of one ring all-gather / reduce-scatter that ran at `busbw` (bus bandwidth, B/s)."""
    return (ranks - 1) / ranks * nbytes / busbw


def fit(ranks: np.ndarray, seconds: np.ndarray, nbytes: float) -> tuple[float, float]:
    """(alpha seconds per ring step, B bytes/s) minimising the squared relative error of the times."""
    design = np.stack([ranks - 1, (ranks - 1) / ranks * nbytes], axis=1) / seconds[:, None]
    (alpha, inv_b), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    return float(alpha), float(1 / inv_b)


def main() -> int:
    gpu = get_gpu("h100")
    per_node = gpu.gpus_per_node
    ranks = np.array(PLAYBOOK_NODES, dtype=float) * per_node
    xs, ts = [], []
    for bw in PLAYBOOK_BUSBW_GB_S.values():
        xs.append(ranks)
        ts.append(ring_seconds(ranks, np.array(bw) * 1e9, MESSAGE_BYTES))
    r, t = np.concatenate(xs), np.concatenate(ts)
    alpha, busbw = fit(r, t, MESSAGE_BYTES)
    model = (r - 1) * alpha + (r - 1) / r * MESSAGE_BYTES / busbw
    print(f"alpha = {alpha * 1e6:.1f} us per ring step, B = {busbw / 1e9:.0f} GB/s (node-full group)")
    print("nodes  measured ms  model ms  model/measured")
    for n, tm, tp in zip(np.concatenate([np.array(PLAYBOOK_NODES)] * len(xs)), t, model, strict=True):
        print(f"{n:5d}  {tm * 1e3:11.2f}  {tp * 1e3:8.2f}  {tp / tm:14.2f}")
    nic = busbw / (per_node * gpu.collective_efficiency)
    print(f"hw = {{ inter_node_latency_us = {alpha * 1e6:.1f}, inter_node_bandwidth_gb_s = {nic / 1e9:.1f} }}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
