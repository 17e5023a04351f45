"""Prepared GPU check (issue 10's memory target): pipeline rank 0 of torchtitan's Llama 3.1 405B runs
(docs/performance.md, FSDP 8, TP 8, PP 8, full recompute; published memory is the caching allocator's
peak *reserved* bytes) rebuilt at full size on one GPU, to measure what no CPU can: how far the
allocator's reserved peak lies above its allocated peak for each allocation pattern, and the allocated
peak against the planner's live tensors for the same state. Three patterns, one per published row the
planner is furthest from or has to tell apart:

* `405b`: Table 5's 1F1B row (82.5 GiB; planner -15.6 %), stage 0: 15 layers, 8 micro-batches of 4 x 8,192.
* `405b-interleaved`: Table 5's interleaved row (72.7 GiB), rank 0's stages 0 (7 layers) and 8 (8 layers).
  The planner counts both chunks' fp32 gradients at the activation peak; FSDP2 makes a chunk's at its first
  backward (measured at toy size by research/torch_pp_memory.py), so the allocated peak may lie ~8 GiB
  lower, and the reserved one anywhere between.
* `405b-cp1`: Table 6's CP 1 row (75.3 GiB), stage 0 with 8 micro-batches of 1 x 32,768: the same tensor
  bytes as `405b`, published 7.2 GiB lower. Does the allocator alone tell the two shapes apart?

One GPU stands in for one rank of that mesh. Its decoder layers have the shapes one tensor-parallel rank
holds (16 query heads, 1 KV head, ffn 6,656 of 53,248, the embedding's 16,032 of 128,256 rows); sequence
parallelism is emulated where it moves memory: each block receives its sequence shard, all-gathers it
(concatenated copies) before attention and the MLP and keeps a shard of their outputs (as the
reduce-scatter does). FSDP2 is the real one, on a 1-rank mesh, as torchtitan applies it under PP (one root
per stage, bf16 parameters, fp32 reduce, reshard_after_forward=False, every block in checkpoint_wrapper),
driven in the order `pentatron.schedules` generates for rank 0 (torch's ScheduleInterleaved1F1B at m = pp
runs every forward first there, as our generator does with all_warmup=False) with gradient sync off and
FSDP's post-backward by hand after each stage's last backward (stage.py perform_reduce_grad). The receive
buffers are torch's: one activation buffer per micro-batch of every stage but stage 0, one gradient
buffer per micro-batch of every stage, allocated once and kept. Not reproduced: float8, AsyncTP,
torch.compile, the real TP collectives, and the optimizer (Adam's and the masters' 1/8 shards are static
allocations the planner counts exactly; at FSDP 1 here the fp32 parameters are the whole stage, reported
apart).

    python research/gpu_stage_memory.py                 # on a GPU: the three 405B patterns, both allocator modes
    PYTHONPATH=src python3 research/gpu_stage_memory.py # the same where the project is not installed
    python research/gpu_stage_memory.py --shape toy     # anywhere (CPU: no allocator statistics)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pentatron.models.llama import RMSNorm

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int  # query heads per tp rank
    head_dim: int
    kv_heads: int  # per tp rank
    ffn: int  # per tp rank
    vocab: int  # per tp rank
    chunks: tuple[int, ...]  # decoder layers of each stage rank 0 holds, stage 0 (with the embedding) first
    micro_batch: int
    seq: int
    tp: int
    micro_batches: int  # m = pp, as in every row here
    pp_layers: tuple[int, ...] | None = None  # the whole pipeline's split, where not the planner's own

    @property
    def schedule(self) -> str:
        return "interleaved" if len(self.chunks) > 1 else "1f1b"


_405B = dict(hidden=16384, heads=16, head_dim=128, kv_heads=1, ffn=6656, vocab=16032, tp=8, micro_batches=8)
SHAPES = {
    "405b": Shape(**_405B, chunks=(15,), micro_batch=4, seq=8192),
    "405b-interleaved": Shape(**_405B, chunks=(7, 8), micro_batch=4, seq=8192,
                              pp_layers=(7,) + (8,) * 14 + (7,)),  # torchtitan's split of 126 layers
    "405b-cp1": Shape(**_405B, chunks=(15,), micro_batch=1, seq=32768),
    "toy": Shape(hidden=256, heads=4, head_dim=16, kv_heads=1, ffn=128, vocab=64, chunks=(3,), micro_batch=2,
                 seq=64, tp=4, micro_batches=4),
    "toy-interleaved": Shape(hidden=256, heads=4, head_dim=16, kv_heads=1, ffn=128, vocab=64, chunks=(1, 2),
                             micro_batch=2, seq=64, tp=4, micro_batches=4),
}
GPU_SHAPES = ("405b", "405b-interleaved", "405b-cp1")


class ShardedBlock(nn.Module):
    """One tensor-parallel rank's share of a Llama block under sequence parallelism."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.attn_norm, self.mlp_norm = RMSNorm(s.hidden, 1e-5), RMSNorm(s.hidden, 1e-5)
        self.wq = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.wk = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.wv = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.w1 = nn.Linear(s.hidden, s.ffn, bias=False)
        self.w3 = nn.Linear(s.hidden, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.hidden, bias=False)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:  # the all-gather's output: tp shards side by side
        return torch.cat([x] * self.s.tp, dim=1)

    def _scatter(self, y: torch.Tensor) -> torch.Tensor:  # the reduce-scatter's output: this rank's shard
        return y[:, : y.shape[1] // self.s.tp].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[0], x.shape[1] * self.s.tp
        h = self._gather(self.attn_norm(x))
        q = self.wq(h).view(b, n, self.s.heads, self.s.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, n, self.s.kv_heads, self.s.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, n, self.s.kv_heads, self.s.head_dim).transpose(1, 2)
        rep = self.s.heads // self.s.kv_heads  # torchtitan expands K/V to the query heads (repeat_kv)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)
        x = x + self._scatter(self.wo(a))
        h = self._gather(self.mlp_norm(x))
        return x + self._scatter(self.w2(F.silu(self.w1(h)) * self.w3(h)))


class Stage(nn.Module):
    """One pipeline stage's share on this tp rank: the embedding (stage 0 only) and its decoder layers."""

    def __init__(self, s: Shape, layers: int, embed: bool) -> None:
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.hidden) if embed else None  # row-parallel, then reduce-scattered
        self.layers = nn.ModuleList(ShardedBlock(s) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:  # token ids in, this rank's sequence shard out
            e = self.embed(x % self.s.vocab)
            x = e[:, : e.shape[1] // self.s.tp].contiguous()
        for layer in self.layers:
            x = layer(x)
        return x


def _fsdp_post_backward(stage: nn.Module) -> None:
    """What torch.distributed.pipelining does after the last micro-batch (stage.py perform_reduce_grad)."""
    from torch.distributed.fsdp import fully_shard

    stage.set_is_last_backward(True)
    stage.set_reshard_after_backward(True)
    stage.set_requires_gradient_sync(True)
    state = fully_shard.state(stage)
    for s in state._state_ctx.all_states:
        groups = getattr(s, "_fsdp_param_groups", None)
        if groups is None:  # torch <= 2.11: one group per state
            groups = [s._fsdp_param_group] if s._fsdp_param_group is not None else []
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def measure(shape: Shape, device: torch.device, steps: int = 2) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from pentatron.schedules import BW, make_schedule

    tmp = tempfile.mkdtemp(prefix="gpu_stage_memory_")
    store = os.path.join(tmp, "store")  # a file store: no port to clash with
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stages = []
    for c, layers in enumerate(shape.chunks):  # as torchtitan: every block, then each stage, its own FSDP unit
        with torch.device("meta"):
            stage = Stage(shape, layers, embed=c == 0)
        for i, layer in enumerate(stage.layers):
            stage.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
            fully_shard(stage.layers[i], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        fully_shard(stage, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        stage.to_empty(device=device)
        with torch.no_grad():
            for p in stage.parameters():
                p.normal_(0.0, 0.02)
        stages.append(stage)
    params = [p for stage in stages for p in stage.parameters()]
    fp32_params = sum(p.to_local().nbytes for p in params)
    m, b, n, v = shape.micro_batches, shape.micro_batch, shape.seq, len(shape.chunks)
    actions = make_schedule(shape.schedule, m, m, v, all_warmup=False).actions[0]  # rank 0's, p = m

    def boundary(requires_grad: bool = False) -> torch.Tensor:  # one micro-batch's sequence shard
        t = torch.randn(b, n // shape.tp, shape.hidden, device=device, dtype=torch.bfloat16) * 1e-3
        return t.requires_grad_(requires_grad)

    # torch's receive buffers, made at the first step and kept: activations for every stage but stage 0,
    # output gradients for every stage that is not the last (all of rank 0's)
    recv_act = [[boundary(True) for _ in range(m)] if c > 0 else [] for c in range(v)]
    recv_grad = [[boundary() for _ in range(m)] for _ in range(v)]
    tokens = torch.randint(0, shape.vocab, (m, b, n), device=device)
    cuda = device.type == "cuda"
    for step in range(steps):
        if cuda and step == steps - 1:  # the steady-state step alone
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for stage in stages:
            stage.set_is_last_backward(False)
            stage.set_reshard_after_backward(False)
            stage.set_requires_gradient_sync(False)
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        backwards = [0] * v
        for a in actions:
            c, i = a.chunk, a.microbatch
            if a.kind != BW:
                outputs[c, i] = stages[c](tokens[i] if c == 0 else recv_act[c][i])
                continue
            torch.autograd.backward(outputs.pop((c, i)), recv_grad[c][i])
            if c > 0:
                recv_act[c][i].grad = None  # the input gradient, sent to the previous stage
            backwards[c] += 1
            if backwards[c] == m:  # the stage's last micro-batch: its gradients are reduced
                _fsdp_post_backward(stages[c])
        reduced = all(p.grad is not None for p in params)  # every stage's post-backward made its shards
        for p in params:  # the optimizer consumes the sharded gradients
            p.grad = None
    out = {"fp32_params_bytes": fp32_params, "gradients_reduced": reduced,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    if cuda:
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        out.update(allocated_peak=st["allocated_bytes.all.peak"], reserved_peak=st["reserved_bytes.all.peak"],
                   active_peak=st["active_bytes.all.peak"], device=torch.cuda.get_device_name(),
                   torch=torch.__version__, alloc_retries=st.get("num_alloc_retries", 0))
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def planner_live_bytes(shape: Shape, fp32_params: int) -> dict:
    """The planner's live tensors for this rank, with this run's state: its rank-0 breakdown of the 405B
    layout in bf16 (no float8 here), receive buffers per micro-batch as torch keeps them, the masters and
    Adam moments left out (no optimizer runs) and the fp32 parameters at FSDP 1 instead (measured above)."""
    from pentatron.hardware.catalogue import get_gpu
    from pentatron.models.registry import get_model_config
    from pentatron.plan.layout import Layout, Workload
    from pentatron.plan.memory import memory_for_rank
    from pentatron.plan.recipes import Recipe

    cfg = get_model_config("llama3.1-405b")
    w = Workload(cfg, seq_len=shape.seq, global_batch=shape.micro_batch * shape.micro_batches * 8)
    lay = Layout(dp=8, tp=8, pp=shape.micro_batches, zero=1, sp=True, micro_batch=shape.micro_batch,
                 recompute="full", precision="bf16", pp_schedule=shape.schedule, pp_virtual=len(shape.chunks),
                 pp_layers=shape.pp_layers,
                 recipe=Recipe(param_shard="fp32", pp_all_warmup=False, pp_buffers="per_microbatch"))
    br = memory_for_rank(w, lay, get_gpu("h100"), 0, kernels="eager")
    live = br.total - br.reserved - br.master_weights - br.optimizer + fp32_params
    return {"live": live, "parameters": br.parameters, "gradients": br.gradients, "activations": br.activations,
            "working": br.recompute_working, "comm_buffers": br.comm_buffers, "fp32 parameters": fp32_params}


def report(name: str, rows: list[dict]) -> None:
    shape = SHAPES[name]
    print(f"{name}: rank 0 ({shape.schedule}, stages of {', '.join(map(str, shape.chunks))} layers), "
          f"{shape.micro_batches} micro-batches of {shape.micro_batch} x {shape.seq}; "
          f"{rows[0]['device']}, torch {rows[0]['torch']}")
    for r in rows:
        print(f"  {r['alloc_conf'] or 'default allocator':26s} allocated peak {r['allocated_peak'] / GiB:6.2f} GiB, "
              f"reserved peak {r['reserved_peak'] / GiB:6.2f} GiB (x{r['reserved_peak'] / r['allocated_peak']:.3f}), "
              f"retries {r['alloc_retries']}")
    if name.startswith("405b"):
        plan = planner_live_bytes(shape, rows[0]["fp32_params_bytes"])
        print(f"  planner's live tensors for the same state: {plan['live'] / GiB:6.2f} GiB "
              f"(allocated / planner {rows[0]['allocated_peak'] / plan['live']:.3f}); "
              + ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.items() if k != "live"), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="one pattern (default: the three 405B ones on a GPU)")
    ap.add_argument("--one", action="store_true", help="one measurement in this process (used internally)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.one or device.type == "cpu":
        print(json.dumps(measure(SHAPES[args.shape or "toy"], device)))
        return 0
    for name in [args.shape] if args.shape else GPU_SHAPES:  # printed as each finishes
        rows = []
        for conf in ("", "expandable_segments:True"):  # the allocator's mode is read once, at CUDA's start
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
            done = subprocess.run([sys.executable, __file__, "--shape", name, "--one"], env=env,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name} with PYTORCH_CUDA_ALLOC_CONF={conf!r} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
                return 1
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        report(name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
