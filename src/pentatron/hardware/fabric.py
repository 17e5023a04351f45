"""A cluster fabric's measured all-reduce: NCCL bus bandwidth by node count and message size, the default
network of the catalogue GPUs it was measured on (in place of the link peak x collective efficiency, for
what it measured: an all-reduce over every GPU of each node, across nodes).

H100 (8 x 400 Gb/s NDR per 8-GPU node): NVIDIA, GTC 2024 session S62129, slide 35, "NCCL Allreduce BusBW,
ALGO=NVLSTree, 32 to 8K GPUs" (nccl-tests all_reduce_perf; the chart is reproduced in stas00/ml-engineering
network/README.md at 744d01e, network/images/nccl-all-reduce-scan-nvlstree.png). The same talk's slide 12
gives 380 GB/s for "NVL4 + 8x 400Gb RDMA (DGX H100)" and 480 with SHARP. Values read off the chart's pixels
(line colour per GPU count, 1.586 px per GB/s) at 32, 128, 1024 and 8192 GPUs, i.e. 4, 16, 128 and 1024
nodes; where another line hides one (4 nodes at 8 and 16 GiB; 16 nodes at 8 MiB) the neighbouring reading is
carried over. Large messages keep ~92 % of the NICs' line rate at every scale; a 128 MiB all-reduce falls
from 276 GB/s at 4 nodes to 157 at 1024 (the chunked tree's fill, not a per-hop alpha).
"""

from __future__ import annotations

from dataclasses import dataclass

from pentatron.hardware.kernel_tables import log_grid_value

GB = 1e9
MiB = 2**20


@dataclass(frozen=True)
class FabricCurve:
    """Bus bandwidth (B/s) of an all-reduce over every GPU of `nodes[i]` nodes at message bytes `sizes[j]`
    (node-major), measured on nodes of `gpus_per_node` GPUs with one NIC of `nic_bandwidth` B/s each."""

    nodes: tuple[float, ...]
    sizes: tuple[float, ...]
    busbw: tuple[float, ...]
    gpus_per_node: int
    nic_bandwidth: float

    def applies(self, gpus_per_node: int, nics: int, nic_bandwidth: float, per_node: int, payload: float) -> bool:
        """Only what was measured: the same node and NICs, the group holding every GPU of each node, and a
        message no smaller than the smallest measured (below it the link model's latency is the better guess;
        above the largest, and outside the node counts, the edge values hold)."""
        return (gpus_per_node == self.gpus_per_node == nics == per_node and nic_bandwidth == self.nic_bandwidth
                and payload >= self.sizes[0])

    def bus_bandwidth(self, nodes: int, payload: float) -> float:
        """Between the measured points: linear in log(bus bandwidth) over log(nodes) and log(bytes)."""
        return log_grid_value(self.busbw, ((self.nodes, nodes), (self.sizes, payload)))


_SIZES = tuple(float(MiB * 2**k) for k in range(15))  # 1 MiB .. 16 GiB
_H100_GB_S = {  # nodes -> GB/s at _SIZES
    4: (15, 28, 53, 74, 125, 148, 229, 276, 314, 338, 352, 361, 365, 365, 365),
    16: (9, 11, 29, 37, 71, 125, 175, 242, 297, 329, 350, 365, 372, 372, 379),
    128: (5, 9, 18, 26, 46, 78, 122, 180, 254, 298, 331, 347, 359, 368, 370),
    1024: (2, 5, 12, 17, 31, 60, 106, 157, 217, 266, 307, 328, 348, 365, 367),
}
H100_NDR_ALLREDUCE = FabricCurve(
    nodes=tuple(float(n) for n in _H100_GB_S), sizes=_SIZES,
    busbw=tuple(v * GB for row in _H100_GB_S.values() for v in row), gpus_per_node=8, nic_bandwidth=50 * GB)
