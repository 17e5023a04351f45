"""The Ultra-Scale Playbook's memory, replayed: the allocation sequence of nanotron's Llama training step,
read from its code, run through PyTorch's caching allocator (caching_allocator.py), against the two
memory figures the sweep's jobs logged and against the planner.

    python research/nanotron_replay.py                 # about 70 s
    python research/nanotron_replay.py --jobs          # and every job
    python research/nanotron_replay.py --capacity 74   # on a device that lets the allocator have 74 GiB

The planner predicts live tensors plus a margin; a job logs `torch.cuda.max_memory_reserved()` (`Mem Res`,
what the playbook plots), which also holds what the allocator cached and could not reuse, and
`torch.cuda.max_memory_allocated()` (`Mem Alloc`), both at iteration 3 (helpers.py `create_table_log`).
Over the first five iterations nanotron's `training_step` calls `log_memory` before and after the
forward/backward pass (trainer.py L492-513), which resets the peak statistics (logging.py L259): so
`Mem Alloc` is the optimizer step's live peak (what the states and the step's buffers hold), and `Mem Res`
what was reserved at or after that step (the run's highest unless the allocator released cached blocks
on a full device). The replay resets its allocator at the same points. It replays, for world rank 0 (the
rank the CSV records), every allocation and free of nanotron's step in program order, at the job's shapes, so
the reserved peak comes out of the allocator's own rules instead of a margin. Where the replay meets a
published figure, the tensors and their order are right; where it does not, something outside program
order is at work (streams, run-to-run differences), which no per-tensor model can reproduce either.

The sequence is nanotron's at huggingface/nanotron nouamane/bench2 67c5ebb6a9, the benchmark's code:
* model states (trainer.py, optim/gradient_accumulator.py): bf16 parameters, tensor by tensor; torch DDP's
  bf16 buckets at ZeRO-0 with dp > 1 (trainer.py L860: 1 MiB, then 25 MiB); the fp32 gradient buffer and
  the fp32 master buffer (ZeRO-1: its shard), each one flat tensor; AdamW's two fp32 moments per parameter
  (its dp shard under ZeRO-1), allocated at the first optimizer step; the half gradients live from their
  backward until the end of that micro-batch's backward (`_accumulate_grad` L217-228 sets them to None).
* a decoder layer (models/llama.py, parallel/tensor_parallel/functional.py), TP with SP in nanotron's
  REDUCE_SCATTER mode with async linears and tp_recompute_allgather: each column-parallel linear gathers
  its input into one `MemoryBuffer` kept for the run (L154; backward re-gathers into it, L286) and writes a
  full-sequence output; each row-parallel linear writes a full-sequence output and reduce-scatters it
  (L453-471), its backward gathers the output gradient into a second buffer (L491). Attention without GQA
  (the sweep's models): the packed q/k/v copy (llama.py L471, whose q view FlashAttention keeps, so all of
  it stays), a cat of k and v and its contiguous permutation (L655-657), FlashAttention's output and fp32
  logsumexp, and at micro-batch > 1 the transposed output copied for o_proj (L688, functional.py L566).
  Norms keep their input and fp32 rstd (TritonRMSNorm); SwiGLU keeps gate|up, silu and the product.
* the last stage: the bf16 logits, their fp32 copy (llama.py L876), the shifted copy the loss keeps
  (functional.py L43); its backward makes the bf16 logits gradient.
* schedules (parallel/pipeline_parallel/engine.py L224-): pp = 1 runs each micro-batch forward then
  backward; stage 0 of pp > 1 runs 1F1B with pp - 1 warm-up forwards, keeping the activation it sent
  until the gradient for it arrives.
* the optimizer phase: ZeRO-1's all-gather of the updated bf16 shards (optim/zero.py `_all_gather_params`):
  `all_gather_coalesced` (distributed.py L153-) flattens this rank's shards into one input and each dp
  rank's shards into one output of their own, and torch's `ProcessGroupNCCL::allgather`, given outputs of
  one size, gathers into a flat output it allocates (`newLikeFlat`) and copies out of: two bf16 copies of
  the stage's parameters beside the states, the first in dp pieces.
The sweep's first batch of jobs is replayed with each column-parallel linear keeping a fresh gathered
input instead (`keep_gathered`; playbook_sweep.FIRST_BATCH_END), and its TP jobs both ways in the report.
Three iterations are replayed (the CSV row is logged at iteration 3), with up to max(4, pp + 2)
micro-batches each: the replayed peak does not move with more.

The device is taken as 79 GiB for the allocator (`--capacity` changes it): where a request does not fit
beside what is reserved, the allocator releases its wholly free segments and retries, as PyTorch's does.
The report ends with the published playbook rows' own jobs.

Covered: the sweep's models without GQA (1B, 3B, 8B and the 80B at 64 KV heads), pipeline stage 0 or
pp = 1, ZeRO-0 and ZeRO-1. Not modelled: streams (a block the NCCL stream still uses is reused only after
the collective ends), small-pool traffic below 1 MiB other than what is listed, the CUDA context (not
part of reserved memory).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import tomllib
from caching_allocator import CachingAllocator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the product's planner_accuracy
from planner_accuracy import DEFAULT_FILE  # noqa: E402
from playbook_sweep import Job, error_stats, first_batch, load_jobs  # noqa: E402

from pentatron.hardware.catalogue import get_gpu  # noqa: E402
from pentatron.models.config import ModelConfig  # noqa: E402
from pentatron.plan.memory import RUNTIME_RESERVED  # noqa: E402

GiB = 1 << 30
DEVICE = get_gpu("h100").hbm_bytes - RUNTIME_RESERVED  # the H100 less the CUDA context, as the planner takes it


@dataclass(frozen=True)
class ReplayJob:
    cfg: ModelConfig
    tp: int
    dp: int
    zero: int
    micro_batch: int
    seq: int
    accumulation: int
    pp: int = 1
    stage0_layers: int = 0  # pp > 1: decoder layers on stage 0
    keep_gathered: bool = False  # column-parallel linears keep their gathered input (tp_recompute_allgather off)


class _Trace:
    """Named allocations on one simulated allocator."""

    def __init__(self, alloc: CachingAllocator):
        self.alloc = alloc
        self.live: dict[str, int] = {}
        self._n = 0

    def new(self, name: str, nbytes: float) -> str:
        assert name not in self.live, name
        self.live[name] = self.alloc.malloc(int(nbytes))
        return name

    def transient(self, nbytes: float) -> None:
        self._n += 1
        self.free(self.new(f"transient{self._n}", nbytes))

    def free(self, *names: str) -> None:
        for n in names:
            self.alloc.free(self.live.pop(n))

    def has(self, name: str) -> bool:
        return name in self.live


def covered(cfg: ModelConfig) -> bool:
    return cfg.n_kv_heads == cfg.n_heads and cfg.mlp == "swiglu"


def replay(job: ReplayJob, iterations: int = 3, capacity: int = DEVICE) -> CachingAllocator:
    """Rank 0's allocator after `iterations` training steps of `job`; raises MemoryError if it runs out."""
    cfg = job.cfg
    if not covered(cfg):
        raise ValueError(f"{cfg.name}: the replay covers Llama models without GQA")
    tp, a = job.tp, 2
    h, hq, f, vocab = cfg.hidden_size, cfg.n_heads * cfg.head_dim // tp, cfg.ffn_hidden_size // tp, cfg.vocab_size // tp
    tokens = job.micro_batch * job.seq
    shard = tokens // tp  # a sequence-parallel activation's tokens
    last = job.pp == 1
    layers = cfg.n_layers if last else job.stage0_layers
    alloc = CachingAllocator(capacity)
    tr = _Trace(alloc)

    params = [("emb", vocab * h)]
    for i in range(layers):
        params += [(f"l{i}.qkv", 3 * hq * h), (f"l{i}.o", h * hq), (f"l{i}.gu", 2 * f * h), (f"l{i}.down", h * f),
                   (f"l{i}.n1", h), (f"l{i}.n2", h)]
    if last:
        params += [("final_norm", h)] + ([] if cfg.tie_embeddings else [("head", vocab * h)])
    n_params = sum(n for _, n in params)
    for name, n in params:
        tr.new(f"param.{name}", a * n)
    if job.zero == 0 and job.dp > 1:  # torch DDP's buckets of bf16 gradients
        left, i = n_params * a, 0
        while left > 0:
            size = min(left, (1 if i == 0 else 25) << 20)
            tr.new(f"ddp_bucket{i}", size)
            left, i = left - size, i + 1
    tr.new("fp32_grads", 4 * n_params)
    tr.new("fp32_master", 4 * (n_params if job.zero == 0 else math.ceil(n_params / job.dp)))

    def gather_buffer(name: str) -> None:
        if tp > 1 and not tr.has(name):
            tr.new(name, a * tokens * h)

    keep = tp > 1 and job.keep_gathered

    def column_forward(out: str, cols: int) -> None:
        if keep:  # a fresh gathered input, saved for backward
            tr.new(out + ".input", a * tokens * h)
        else:
            gather_buffer("allgather")
        tr.new(out, a * tokens * cols)

    def column_saved(out: str, shard_input: str) -> str:
        """What the column-parallel linear that wrote `out` keeps of its input."""
        return out + ".input" if keep else shard_input

    def row_forward(out: str) -> None:
        if tp > 1:
            tr.new(out + ".full", a * tokens * h)
            tr.new(out, a * shard * h)
            tr.free(out + ".full")
        else:
            tr.new(out, a * tokens * h)

    def column_backward(grad_in: str, weight: str, numel: int) -> None:
        if not keep:
            gather_buffer("allgather")
        if tp > 1:
            tr.new(grad_in + ".full", a * tokens * h)
        tr.new(grad_in, a * shard * h)
        tr.new(f"grad.{weight}", a * numel)
        if tp > 1:
            tr.free(grad_in + ".full")

    def row_backward(grad_in: str, cols: int, weight: str, numel: int) -> None:
        gather_buffer("allgather2")
        tr.new(grad_in, a * tokens * cols)
        tr.new(f"grad.{weight}", a * numel)

    def layer_forward(p: str) -> str:
        tr.new(p + "norm1", a * shard * h)
        tr.new(p + "rstd1", 4 * shard)
        column_forward(p + "qkv", 3 * hq)
        tr.new(p + "qkv_packed", a * tokens * 3 * hq)
        tr.new(p + "kv_cat", a * tokens * 2 * hq)
        tr.new(p + "kv", a * tokens * 2 * hq)
        tr.free(p + "kv_cat")
        tr.new(p + "attn_out", a * tokens * hq)
        tr.new(p + "lse", 4 * tokens * cfg.n_heads // tp)
        if job.micro_batch > 1:
            tr.transient(a * tokens * hq)
        row_forward(p + "o")
        tr.free(p + "qkv")
        if keep:  # the norm's output is no longer referenced once the attention returns
            tr.free(p + "norm1")
        tr.new(p + "h1", a * shard * h)
        tr.new(p + "norm2", a * shard * h)
        tr.new(p + "rstd2", 4 * shard)
        column_forward(p + "gate_up", 2 * f)
        tr.new(p + "silu", a * tokens * f)
        tr.new(p + "prod", a * tokens * f)
        row_forward(p + "down")
        tr.new(p + "out", a * shard * h)
        tr.free(p + "down", p + "o")
        if keep:
            tr.free(p + "norm2")
        return p + "out"

    def norm_backward(g_out: str, rstd: str, g_residual: str, x: str, g_x: str) -> str:
        """A norm's input gradient plus the residual branch's: the gradient of the sublayer input `x`."""
        tr.new(g_x + ".norm", a * shard * h)
        tr.free(g_out, rstd)
        tr.new(g_x, a * shard * h)
        tr.free(g_x + ".norm", g_residual, x)
        return g_x

    def layer_backward(p: str, i: int, grad: str, x: str) -> str:
        row_backward(p + "g_prod", f, f"l{i}.down", h * f)
        tr.free(p + "prod")
        tr.new(p + "g_silu", a * tokens * f)
        tr.new(p + "g_up", a * tokens * f)
        tr.free(p + "g_prod", p + "silu")
        tr.new(p + "g_gate", a * tokens * f)
        tr.free(p + "g_silu")
        tr.new(p + "g_gate_up", a * tokens * 2 * f)
        tr.free(p + "g_gate", p + "g_up", p + "gate_up")
        column_backward(p + "g_norm2", f"l{i}.gu", 2 * f * h)
        tr.free(p + "g_gate_up", column_saved(p + "gate_up", p + "norm2"))
        g_h1 = norm_backward(p + "g_norm2", p + "rstd2", grad, p + "h1", p + "g_h1")
        row_backward(p + "g_attn", hq, f"l{i}.o", h * hq)
        g_attn = p + "g_attn"
        if job.micro_batch > 1:
            tr.transient(a * tokens * hq)
            tr.new(p + "g_attn_copy", a * tokens * hq)
            tr.free(g_attn)
            g_attn = p + "g_attn_copy"
        tr.new(p + "dq", a * tokens * hq)
        tr.new(p + "dk", a * tokens * hq)
        tr.new(p + "dv", a * tokens * hq)
        tr.transient(4 * (tokens + 128 * job.micro_batch) * hq)  # FlashAttention's fp32 dq accumulator
        tr.free(g_attn, p + "attn_out", p + "lse")
        tr.new(p + "dkv", a * tokens * 2 * hq)
        tr.free(p + "dk", p + "dv", p + "kv")
        tr.new(p + "dqkv", a * tokens * 3 * hq)
        tr.free(p + "dq", p + "dkv", p + "qkv_packed")
        column_backward(p + "g_norm1", f"l{i}.qkv", 3 * hq * h)
        tr.free(p + "dqkv", column_saved(p + "qkv", p + "norm1"))
        return norm_backward(p + "g_norm1", p + "rstd1", g_h1, x, p + "g_x")

    def forward(k: int) -> list[str]:
        m = f"mb{k}."
        tr.new(m + "ids", 8 * tokens)
        if tp > 1:
            tr.new(m + "emb.full", a * tokens * h)
        xs = [tr.new(m + "emb", a * shard * h)]
        if tp > 1:
            tr.free(m + "emb.full")
        for i in range(layers):
            xs.append(layer_forward(f"{m}l{i}."))
        if last:
            tr.new(m + "final_norm", a * shard * h)
            tr.new(m + "final_rstd", 4 * shard)
            column_forward(m + "logits", vocab)
            tr.new(m + "logits_fp32", 4 * tokens * vocab)
            tr.free(m + "logits")
            if keep:
                tr.free(m + "final_norm")
            tr.new(m + "softmax", 4 * tokens * vocab)
            tr.free(m + "logits_fp32")
        return xs

    def backward(k: int, xs: list[str]) -> None:
        m = f"mb{k}."
        if last:
            tr.new(m + "g_logits", a * tokens * vocab)
            tr.free(m + "softmax")
            column_backward(m + "g_final_norm", "emb" if cfg.tie_embeddings else "head", vocab * h)
            tr.free(m + "g_logits", column_saved(m + "logits", m + "final_norm"))
            grad = tr.new(m + "g_top", a * shard * h)
            tr.free(m + "g_final_norm", m + "final_rstd", xs[-1])
        else:
            grad = tr.new(m + "g_received", a * shard * h)
            tr.free(xs[-1])
        for i in reversed(range(layers)):
            grad = layer_backward(f"{m}l{i}.", i, grad, xs[i])
        if tp > 1:
            tr.new(m + "g_emb.full", a * tokens * h)
        tr.free(grad)
        if tr.has("grad.emb"):  # tied: the embedding's gradient is added to the LM head's
            tr.transient(a * vocab * h)
        else:
            tr.new("grad.emb", a * vocab * h)
        if tp > 1:
            tr.free(m + "g_emb.full")
        tr.free(m + "ids")
        for name, _ in params:
            if tr.has(f"grad.{name}"):
                tr.free(f"grad.{name}")

    micro_batches = min(job.accumulation, max(4, job.pp + 2))
    for step in range(iterations):
        alloc.reset_peak_stats()  # log_memory, before the forward/backward pass and after it
        in_flight: dict[int, list[str]] = {}
        for k in range(micro_batches):
            in_flight[k] = forward(k)
            if len(in_flight) >= job.pp:  # 1F1B: pp - 1 forwards ahead (none at pp = 1)
                oldest = min(in_flight)
                backward(oldest, in_flight.pop(oldest))
        while in_flight:
            oldest = min(in_flight)
            backward(oldest, in_flight.pop(oldest))
        alloc.reset_peak_stats()
        if step == 0:
            for name, n in params:
                shard_n = n if job.zero == 0 else math.ceil(n / job.dp)
                tr.new(f"adam_m.{name}", 4 * shard_n)
                tr.new(f"adam_v.{name}", 4 * shard_n)
        if job.zero == 1 and job.dp > 1:
            # all_gather_coalesced flattens this rank's shards into one input and each rank's shards into one
            # output; torch's allgather then gathers into a flat output of its own and copies out of it
            shard_bytes = a * math.ceil(n_params / job.dp)
            gathered = [tr.new("allgather_in", shard_bytes)]
            gathered += [tr.new(f"allgather_out{r}", shard_bytes) for r in range(job.dp)]
            gathered.append(tr.new("allgather_flat", shard_bytes * job.dp))
            tr.free(*gathered)
    return alloc


# ---------------------------------------------------------------- the sweep
def replay_job(job: Job) -> ReplayJob | None:
    """The sweep job as the replay runs it (None where the replay does not cover it)."""
    row = job.result.row
    lay, w = row.layout, row.workload
    if not covered(w.cfg) or lay.zero > 1 or lay.cp > 1:
        return None
    return ReplayJob(w.cfg, lay.tp, lay.dp, lay.zero, lay.micro_batch, w.seq_len, lay.microbatches(w), lay.pp,
                     lay.pp_layers[0] if lay.pp > 1 and lay.pp_layers else 0, lay.recipe.sp_inputs == "gathered")


@dataclass(frozen=True)
class Replayed:
    job: Job
    spec: ReplayJob
    replay: CachingAllocator | None  # None: the replay ran out of memory

    @property
    def accumulation(self) -> int:
        return self.spec.accumulation

    @property
    def published(self) -> float:
        return self.job.result.row.published_memory

    @property
    def replay_error(self) -> float:
        return self.replay.peak_reserved / self.published - 1 if self.replay else math.nan

    @property
    def step_live_error(self) -> float:
        """The optimizer step's live peak against the CSV's `Mem Alloc`."""
        return self.replay.peak_allocated / (self.job.mem_alloc_gib * GiB) - 1 if self.replay else math.nan

    @property
    def planner_error(self) -> float:
        return self.job.result.memory_error

    @property
    def first_batch(self) -> bool:
        return first_batch(self.job.id)


def replay_sweep(jobs: list[Job], capacity: int = DEVICE) -> list[Replayed]:
    out = []
    for j in jobs:
        rj = replay_job(j) if j.status == "Success" else None
        if rj is None:
            continue
        try:
            out.append(Replayed(j, rj, replay(rj, capacity=capacity)))
        except MemoryError:
            out.append(Replayed(j, rj, None))
    return out


def first_batch_both_ways(rs: list[Replayed]) -> list[tuple[int, list[float], list[float]]]:
    """Per tp, the replay errors of the first batch's TP jobs with the gathered inputs kept (as replayed)
    and re-gathered in backward: the evidence for `playbook_sweep.FIRST_BATCH_END`."""
    by_tp: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in rs:
        if not r.first_batch or r.spec.tp == 1:
            continue
        try:
            other = replay(replace(r.spec, keep_gathered=False)).peak_reserved / r.published - 1
        except MemoryError:
            continue
        by_tp[r.spec.tp][0].append(r.replay_error)
        by_tp[r.spec.tp][1].append(other)
    return [(tp, *by_tp[tp]) for tp in sorted(by_tp)]


def published_jobs(rs: list[Replayed]) -> list[tuple[str, Replayed]]:
    """Each published playbook row (published_runs.toml) beside the sweep job its note names ("job N")."""
    by_job = {r.job.id.split("#")[0]: r for r in rs}
    out = []
    for run in tomllib.loads(DEFAULT_FILE.read_text())["run"]:
        job = re.search(r"job (\d+)", run["note"]).group(1) if run["source"] == "playbook" else None
        if job in by_job:
            out.append((run["id"], by_job[job]))
    return out


def report(rs: list[Replayed], every: bool = False) -> str:
    ok = [r for r in rs if r.replay is not None]
    head = f"{'':<44} {'n':>5} {'med|err|':>8} {'p90|err|':>8} {'signed':>8} {'<=10%':>6}"
    lines = [f"{len(rs)} trained jobs replayed ({len(rs) - len(ok)} ran out of memory in the replay); peak reserved "
             "memory of rank 0 against the published, replay | planner", head]
    tp_jobs = [r for r in ok if r.job.result.row.layout.tp > 1]
    groups = {
        "all": ok,
        "pp = 1": [r for r in ok if r.job.result.row.layout.pp == 1],
        "pp > 1 (stage 0)": [r for r in ok if r.job.result.row.layout.pp > 1],
        "one micro-batch per step": [r for r in ok if r.accumulation == 1],
        "gradient accumulation": [r for r in ok if r.accumulation > 1],
        "tp > 1, the first batch": [r for r in tp_jobs if r.first_batch],
        "tp > 1, the later batches": [r for r in tp_jobs if not r.first_batch],
    }
    for name, g in groups.items():
        lines.append(f"  {name:<42} {error_stats([r.replay_error for r in g])}   |  "
                     f"{error_stats([r.planner_error for r in g])}")
    lines.append("the first batch's TP jobs replayed both ways, by tp: gathered inputs kept | re-gathered in backward "
                 "(tp_recompute_allgather, as the code at 67c5ebb6a9 reads)")
    for tp, kept, regathered in first_batch_both_ways(ok):
        lines.append(f"  tp {tp:<40} {error_stats(kept)}   |  {error_stats(regathered)}")
    lines.append("the optimizer step's live peak (the replay's allocated peak after the backward) against Mem Alloc")
    for z in (0, 1):
        g = [r.step_live_error for r in ok if r.spec.zero == z]
        lines.append(f"  ZeRO-{z:<38} {error_stats(g)}")
    lines.append(f"  {'all':<42} {error_stats([r.step_live_error for r in ok])}")
    pub = published_jobs(ok)
    lines.append(f"the published playbook rows' jobs ({len(pub)}): Mem Res published, replay, planner (GiB)")
    lines.append(f"  {'all':<42} {error_stats([r.replay_error for _, r in pub])}   |  "
                 f"{error_stats([r.planner_error for _, r in pub])}")
    lines += [f"  {row:<18} {r.job.id:<16} {r.published / GiB:6.2f} {r.replay.peak_reserved / GiB:6.2f} "
              f"({100 * r.replay_error:+5.1f} %) {r.job.result.memory.total / GiB:6.2f} "
              f"({100 * r.planner_error:+5.1f} %)" for row, r in pub]
    if every:
        lines.append("every job: id, layout, accumulation, Mem Res published | replay | planner, "
                     "Mem Alloc published | replay (GiB)")
        for r in sorted(ok, key=lambda r: r.job.id):
            lay = r.job.result.row.layout
            lines.append(f"  {r.job.id:<16} {lay.short()[:52]:<52} acc {r.accumulation:<4} {r.published / GiB:6.1f} "
                         f"{r.replay.peak_reserved / GiB:6.1f} {r.job.result.memory.total / GiB:6.1f}   "
                         f"{r.job.mem_alloc_gib:6.2f} {r.replay.peak_allocated / GiB:6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", action="store_true", help="also list every replayed job")
    ap.add_argument("--capacity", type=float, default=DEVICE / GiB,
                    help="GiB the device lets the allocator reserve (default: %(default)s); a full device makes "
                         "the allocator release its cached blocks, which lowers the reserved peak")
    args = ap.parse_args(argv)
    jobs, _ = load_jobs()
    print(report(replay_sweep(jobs, int(args.capacity * GiB)), args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
