"""Bytes on the wire per rank for each collective under the bandwidth-optimal ring algorithm (the
Ultra-Scale Playbook's volumes, what the comm ledger records; see `comm.py`). Pure arithmetic, shared
by the comm layer and the planner (which must not import torch)."""

from __future__ import annotations


def ring_bytes(op: str, payload_bytes: int, n: int) -> int:
    """Bytes one rank sends (= receives) for `op` on a ring of n ranks: all-reduce 2(n−1)/n·S,
    reduce-scatter / all-gather / broadcast (n−1)/n·S, all-to-all of S evenly split (n−1)/n·S (every
    chunk but its own leaves the rank, whatever the algorithm), send / recv S."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * payload_bytes // n
    if op in ("reduce_scatter", "all_gather", "broadcast", "all_to_all"):
        return (n - 1) * payload_bytes // n
    if op in ("send", "recv"):
        return payload_bytes
    return 0
