"""A measured profile: what `pentatron bench` (pentatron.calibrate) measured on one machine, apart from the
datasheet (`catalogue.GPUSpec`). The planner's measured speeds (`speeds.Measured`) read it; every curve is
optional, and what a profile lacks falls back to the datasheet roofline.

The file (TOML or JSON) has its own versioned schema:

    schema = "pentatron.profile/1"
    [hardware]  # the datasheet, in the keys of a `--hardware` file (catalogue.hardware_from_dict)
    [profile]   # the measured curves below, in human units (PROFILE_KEYS)
    [measured]  # free-form metadata: host, date, torch version, ...

Units in the file: bytes, GB/s, GFLOP/s, microseconds; converted to SI (bytes/s, FLOP/s, seconds) here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pentatron.hardware.kernel_tables import AttentionGrid, parse_attention_grid

PROFILE_SCHEMA = "pentatron.profile/1"
GB = 1e9
US = 1e-6

Curve = tuple[tuple[float, float], ...]  # (size, value) points, increasing size
# Collective name -> ((message bytes, bus bandwidth B/s), ...) measured by `pentatron bench`.
BusBwTable = dict[str, Curve]


@dataclass(frozen=True)
class Profile:
    """Measured speeds of one machine (all optional; empty = not measured)."""

    # collective (and "p2p", "exchange") bus bandwidth by message bytes, inside the node
    busbw: BusBwTable = field(default_factory=dict)
    # ((nodes, bus bandwidth B/s), ...) of an all-reduce over every GPU of that many nodes: a ceiling on any
    # all-reduce spanning that many nodes (what the fabric carried when all GPUs reduced at once)
    allreduce_busbw_by_nodes: Curve = ()
    copy_bw: Curve = ()  # copy bandwidth (read + write, B/s) by buffer bytes: small buffers stay in the caches
    matmul_fp32: Curve = ()  # fp32 GEMM FLOP/s by the FLOPs of one call, its per-call cost included
    # an LM head's GEMMs, a wide output off a narrow input: (FLOPs of one call, forward, dX, dW FLOP/s)
    head_fp32: tuple[tuple[float, float, float, float], ...] = ()
    # host seconds per micro-batch outside the arithmetic (eager dispatch, autograd; serial with compute
    # on a CPU): per decoder layer and for embedding + head + loss, (forward, backward)
    host_layer_s: tuple[float, float] = (0.0, 0.0)
    host_ends_s: tuple[float, float] = (0.0, 0.0)
    host_optimizer_per_tensor_s: float = 0.0  # optimizer step (norm, clip, AdamW) per parameter tensor
    stream_bw: Curve = ()  # an out-of-place elementwise op's bytes/s inside a step, by operand bytes
    attention_fp32: AttentionGrid | None = None  # causal attention FLOP/s by (seq, head dim)
    optimizer_per_element_s: float = 0.0  # the optimizer step's seconds per parameter element
    # how much slower each process computes when every process of the node computes at once:
    # {"matmul", "stream", "host"} -> factor >= 1 (CPU cores share units, caches, bandwidth)
    node_slowdown: dict[str, float] = field(default_factory=dict)
    # the tensor-parallel step as its ranks ran it (calibrate/tp_step.py): host seconds per TP layer and
    # for the vocab-parallel ends, and one tp all-reduce as the step meets it by activation bytes
    host_tp_layer_s: tuple[float, float] = (0.0, 0.0)
    host_tp_ends_s: tuple[float, float] = (0.0, 0.0)
    host_tp_compiled_layer_s: tuple[float, float] = (0.0, 0.0)  # the TP layer under train.compile (fwd, bwd)
    tp_collective: Curve = ()  # ((bytes, seconds), ...)
    # the data-parallel step's synchronisations (calibrate/dp_step.py): the gradient all-reduce after a
    # backward by bytes, and one scalar all-reduce right after it
    dp_collective: Curve = ()  # ((bytes, seconds), ...)
    scalar_collective_s: float = 0.0
    # the pipeline hop between two computing neighbours by message bytes (calibrate/pp_step.py)
    pp_hop: Curve = ()  # ((bytes, seconds), ...)
    # train.compile's kernels (calibrate/compiled_kernels.py, from the measured saving of compiling a layer):
    # the compiled elementwise rate, B/s in the planner's fused bytes by operand bytes, and host seconds per
    # compiled decoder layer (fwd, bwd)
    fused_bw: Curve = ()
    host_compiled_layer_s: tuple[float, float] = (0.0, 0.0)

    def shared(self, matmul: float, stream: float, host: float) -> Profile:
        """This profile with compute rates divided and host times multiplied by the given slowdowns
        (`catalogue.GPUSpec.sharing`). Communication and the in-step tp/dp/pp terms are left alone: bench
        measured them with every process running."""
        att = self.attention_fp32
        if att is not None:
            att = replace(att, fwd=tuple(x / matmul for x in att.fwd), bwd=tuple(x / matmul for x in att.bwd))
        return replace(
            self, matmul_fp32=tuple((f, r / matmul) for f, r in self.matmul_fp32),
            head_fp32=tuple((f, *(r / matmul for r in rates)) for f, *rates in self.head_fp32),
            attention_fp32=att, copy_bw=tuple((n, b / stream) for n, b in self.copy_bw),
            stream_bw=tuple((n, b / stream) for n, b in self.stream_bw),
            fused_bw=tuple((n, b / stream) for n, b in self.fused_bw),
            host_compiled_layer_s=(self.host_compiled_layer_s[0] * host, self.host_compiled_layer_s[1] * host),
            optimizer_per_element_s=self.optimizer_per_element_s * stream,
            host_layer_s=(self.host_layer_s[0] * host, self.host_layer_s[1] * host),
            host_ends_s=(self.host_ends_s[0] * host, self.host_ends_s[1] * host),
            host_optimizer_per_tensor_s=self.host_optimizer_per_tensor_s * host, node_slowdown={})


def interp_log(table: Curve, x: float) -> float:
    """Linear interpolation of (size, value) points in log(size); clamped at both ends."""
    sizes = [s for s, _ in table]
    i = bisect.bisect_left(sizes, x)
    if i == 0:
        return table[0][1]
    if i >= len(table):
        return table[-1][1]
    (s0, b0), (s1, b1) = table[i - 1], table[i]
    f = (math.log(x) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return b0 + f * (b1 - b0)


def measured_then_curve(pts: Curve, x: float, curve: Callable[[float], float]) -> float:
    """Seconds at `x` from measured (x, seconds) points: log-linear between them and the smallest's below
    them; beyond the largest, its seconds plus what the model `curve` adds from there."""
    top_x, top = pts[-1]
    if x <= top_x:
        return interp_log(pts, x)
    return top + max(0.0, curve(x) - curve(top_x))


# ---------------------------------------------------------------- reading the [profile] table
class _Bad(ValueError):
    """One table is malformed: what it needs (after its key), or with `named` the whole text."""

    def __init__(self, message: str, named: bool = False) -> None:
        super().__init__(message)
        self.named = named


def _points(xs: Any, ys: Any, x_scale: float, y_scale: float) -> Curve:
    """Sorted (x, y) points from two equally long, non-empty lists of numbers."""
    if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys) or not xs:
        raise ValueError
    return tuple(sorted((float(x) * x_scale, float(y) * y_scale) for x, y in zip(xs, ys, strict=True)))


def _curve(keys: tuple[str, str], x_scale: float = 1.0, y_scale: float = GB) -> Callable[[Any], Curve]:
    """A reader of `{<x key> = [...], <y key> = [...]}`."""
    def read(t: Any) -> Curve:
        try:
            return _points(t.get(keys[0]), t.get(keys[1]), x_scale, y_scale)
        except (AttributeError, TypeError, ValueError):
            raise _Bad(f"needs equal-length lists `{keys[0]}` and `{keys[1]}`") from None
    return read


def _busbw(t: Any) -> BusBwTable:
    if not isinstance(t, dict):
        raise _Bad("must be a table of collectives")
    read = _curve(("bytes", "gb_s"))
    out: BusBwTable = {}
    bad = []
    for op, pts in t.items():
        try:
            out[op] = read(pts)
        except _Bad:
            bad.append(f"busbw.{op} needs equal-length lists `bytes` and `gb_s`")
    if bad:
        raise _Bad("; ".join(bad), named=True)
    return out


def _host_us(t: Any) -> dict[str, Any]:
    try:
        return {"host_layer_s": (float(t["layer_fwd"]) * US, float(t["layer_bwd"]) * US),
                "host_ends_s": (float(t["ends_fwd"]) * US, float(t["ends_bwd"]) * US),
                "host_optimizer_per_tensor_s": float(t.get("optimizer_per_tensor", 0.0)) * US}
    except (TypeError, KeyError, ValueError, AttributeError):
        raise _Bad("needs numbers layer_fwd, layer_bwd, ends_fwd, ends_bwd") from None


def _head(t: Any) -> tuple[tuple[float, float, float, float], ...]:
    try:
        rows = sorted(zip(t["flops"], t["fwd_gflop_s"], t["dx_gflop_s"], t["dw_gflop_s"], strict=True))
        table = tuple((float(f), *(float(r) * GB for r in rates)) for f, *rates in rows)
        if not table or any(x <= 0 for row in table for x in row):
            raise ValueError
        return table  # type: ignore[return-value]
    except (TypeError, KeyError, ValueError):
        raise _Bad("needs equally long, non-empty lists of positive flops, fwd_gflop_s, dx_gflop_s, "
                   "dw_gflop_s") from None


def _in_step(t: Any, name: str) -> Curve:
    """A bench step table's in-step times, ((bytes, seconds), ...), from its lists `<name>_bytes` and
    `<name>_us`: equally long, non-empty and positive."""
    pts = _points(t[f"{name}_bytes"], t[f"{name}_us"], 1.0, US)
    if any(b <= 0 or s <= 0 for b, s in pts):
        raise ValueError
    return pts


def _tp_step(t: Any) -> dict[str, Any]:
    try:
        return {"host_tp_layer_s": (float(t["layer_fwd_us"]) * US, float(t["layer_bwd_us"]) * US),
                "host_tp_ends_s": (float(t["ends_fwd_us"]) * US, float(t["ends_bwd_us"]) * US),
                "host_tp_compiled_layer_s": (float(t.get("compiled_layer_fwd_us", 0.0)) * US,
                                             float(t.get("compiled_layer_bwd_us", 0.0)) * US),
                "tp_collective": _in_step(t, "collective")}
    except (TypeError, KeyError, ValueError):
        raise _Bad("needs numbers layer_fwd_us, layer_bwd_us, ends_fwd_us, ends_bwd_us and equally long "
                   "lists of positive collective_bytes, collective_us") from None


def _dp_step(t: Any) -> dict[str, Any]:
    try:
        scalar = float(t["scalar_us"]) * US
        if scalar <= 0:
            raise ValueError
        return {"dp_collective": _in_step(t, "collective"), "scalar_collective_s": scalar}
    except (TypeError, KeyError, ValueError):
        raise _Bad("needs a positive number scalar_us and equally long lists of positive collective_bytes, "
                   "collective_us") from None


def _pp_step(t: Any) -> Curve:
    try:
        return _in_step(t, "hop")
    except (TypeError, KeyError, ValueError):
        raise _Bad("needs equally long lists of positive hop_bytes, hop_us") from None


def _compiled(t: Any) -> dict[str, Any]:
    """{layer_fwd_us, layer_bwd_us, chain_bytes = [...], chain_gb_s = [...]}: positive numbers."""
    try:
        host = (float(t["layer_fwd_us"]) * US, float(t["layer_bwd_us"]) * US)
        chain = _points(t["chain_bytes"], t["chain_gb_s"], 1.0, GB)
        if min(host) < 0 or any(b <= 0 or r <= 0 for b, r in chain):
            raise ValueError
        return {"host_compiled_layer_s": host, "fused_bw": chain}
    except (TypeError, KeyError, ValueError):
        raise _Bad("needs numbers layer_fwd_us, layer_bwd_us >= 0 and equally long, non-empty lists of positive "
                   "chain_bytes, chain_gb_s") from None


def _slowdown(t: Any) -> dict[str, float]:
    if isinstance(t, dict) and all(isinstance(v, int | float) and v >= 1 for v in t.values()):
        return {str(k): float(v) for k, v in t.items()}
    raise _Bad("must be a table of factors >= 1, like { matmul = 2.0 }")


def _optimizer_ns(v: Any) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise _Bad(f"must be a number, got {v!r}")
    return float(v) * 1e-9


def _by_nodes(t: Any) -> Curve:
    """{nodes = [...], gb_s = [...]}: the same shape as a bandwidth curve."""
    try:
        return _points(t.get("nodes"), t.get("gb_s"), 1.0, GB)
    except (AttributeError, TypeError, ValueError):
        raise _Bad("needs equal-length lists `nodes` and `gb_s`") from None


# file key -> (Profile field, reader); a reader returning a dict sets several fields
_READERS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "busbw": ("busbw", _busbw),
    "allreduce_busbw_by_nodes": ("allreduce_busbw_by_nodes", _by_nodes),
    "copy_bw": ("copy_bw", _curve(("bytes", "gb_s"))),
    "stream_bw": ("stream_bw", _curve(("bytes", "gb_s"))),
    "matmul_fp32": ("matmul_fp32", _curve(("flops", "gflop_s"))),
    "lm_head_fp32": ("head_fp32", _head),
    "host_us": ("", _host_us),
    "tp_step": ("", _tp_step),
    "dp_step": ("", _dp_step),
    "pp_step": ("pp_hop", _pp_step),
    "compiled": ("", _compiled),
    "node_slowdown": ("node_slowdown", _slowdown),
    "optimizer_ns_per_element": ("optimizer_per_element_s", _optimizer_ns),
}
PROFILE_KEYS = frozenset(_READERS) | {"attention_fp32"}


def profile_from_dict(d: dict[str, Any], where: str, problems: list[str]) -> Profile | None:
    """A Profile from the [profile] keys of `d` (PROFILE_KEYS; others are ignored); None when it has none.
    Malformed tables are appended to `problems`, one line each."""
    kw: dict[str, Any] = {}
    for key, (attr, read) in _READERS.items():
        if key not in d:
            continue
        try:
            value = read(d[key])
        except _Bad as e:
            problems.append(f"{where}: {e}" if e.named else f"{where}: {key} {e}")
            continue
        if attr:
            kw[attr] = value
        else:
            kw.update(value)
    if "attention_fp32" in d:
        kw["attention_fp32"] = parse_attention_grid(d["attention_fp32"], where, problems)
    return Profile(**kw) if any(k in d for k in PROFILE_KEYS) else None
