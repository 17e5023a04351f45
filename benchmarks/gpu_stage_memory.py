"""Prepared GPU check (issue 10's memory target): the first pipeline stage of torchtitan's Llama 3.1 405B
1F1B run (docs/performance.md Table 5: FSDP 8, TP 8, PP 8, 8 micro-batches of 4 x 8,192, full
recompute; 82.5 GiB published, the caching allocator's peak *reserved* bytes) rebuilt at full size on
one GPU, to measure what no CPU can: how far the allocator's reserved peak lies above its allocated peak
for this allocation pattern, and the allocated peak against the planner's live tensors.

One GPU stands in for one rank of that mesh. Its 15 decoder layers have the shapes one tensor-parallel
rank holds (16 query heads, 1 KV head, ffn 6,656 of 53,248, the embedding's 16,032 of 128,256 rows);
sequence parallelism is emulated where it moves memory: each block receives its 1,024-token sequence
shard, all-gathers it to 8,192 tokens (concatenated copies) before attention and the MLP and keeps a
shard of their outputs (as the reduce-scatter does). FSDP2 is the real one, on a 1-rank mesh, as
torchtitan applies it under PP (bf16 parameters, fp32 reduce, reshard_after_forward=False, every block
in checkpoint_wrapper), driven as torch.distributed.pipelining drives stage 0 of 1F1B when m = pp: all 8
forwards, then 8 backwards from received gradients with gradient sync off, then FSDP's post-backward by
hand on the last (stage.py perform_reduce_grad). Not reproduced: float8, AsyncTP, torch.compile, the
real TP collectives, and the optimizer (Adam's and the masters' 1/8 shards are static allocations the
planner counts exactly; at FSDP 1 here the fp32 parameters are the whole stage, reported apart).

    python benchmarks/gpu_stage_memory.py                 # on a GPU: 405B stage 0, both allocator modes
    python benchmarks/gpu_stage_memory.py --shape toy     # anywhere (CPU: no allocator statistics)
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

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int  # query heads per tp rank
    head_dim: int
    kv_heads: int  # per tp rank
    ffn: int  # per tp rank
    vocab: int  # per tp rank
    layers: int
    micro_batch: int
    seq: int
    tp: int
    micro_batches: int  # all in flight on stage 0 (1F1B with m = pp)


SHAPES = {
    "405b": Shape(hidden=16384, heads=16, head_dim=128, kv_heads=1, ffn=6656, vocab=16032, layers=15,
                  micro_batch=4, seq=8192, tp=8, micro_batches=8),
    "toy": Shape(hidden=256, heads=4, head_dim=16, kv_heads=1, ffn=128, vocab=64, layers=3, micro_batch=2,
                 seq=64, tp=4, micro_batches=4),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


class ShardedBlock(nn.Module):
    """One tensor-parallel rank's share of a Llama block under sequence parallelism."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.attn_norm, self.mlp_norm = RMSNorm(s.hidden), RMSNorm(s.hidden)
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


class FirstStage(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.hidden)  # row-parallel: partial sums, then reduce-scattered
        self.layers = nn.ModuleList(ShardedBlock(s) for _ in range(s.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embed(tokens % self.s.vocab)
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

    tmp = tempfile.mkdtemp(prefix="gpu_stage_memory_")
    store = os.path.join(tmp, "store")  # a file store: no port to clash with
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    with torch.device("meta"):
        stage = FirstStage(shape)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(stage.layers):
        stage.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
        fully_shard(stage.layers[i], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(stage, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    stage.to_empty(device=device)
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_(0.0, 0.02)
    fp32_params = sum(p.to_local().nbytes for p in stage.parameters())
    m, b, n = shape.micro_batches, shape.micro_batch, shape.seq
    tokens = torch.randint(0, shape.vocab, (m, b, n), device=device)
    grad = torch.randn(b, n // shape.tp, shape.hidden, device=device, dtype=torch.bfloat16) * 1e-3
    cuda = device.type == "cuda"
    for step in range(steps):
        if cuda and step == steps - 1:  # the steady-state step alone
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)
        outputs = [stage(tokens[i]) for i in range(m)]  # all in flight, as on stage 0 of 1F1B at m = pp
        for i in range(m):
            torch.autograd.backward(outputs[i], grad)  # the gradient received from stage 1
            outputs[i] = None
        _fsdp_post_backward(stage)
        for p in stage.parameters():  # the optimizer consumes the sharded gradients
            p.grad = None
    out = {"fp32_params_bytes": fp32_params, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
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
    """The planner's live tensors for this rank, with this run's state: its stage-0 breakdown of the
    405B 1F1B layout in bf16 (no float8 here), the masters and Adam moments left out (no optimizer
    runs) and the fp32 parameter shard at FSDP 1 instead (measured above)."""
    from pentatron.models.registry import get_model_config
    from pentatron.plan.hardware import get_gpu
    from pentatron.plan.layout import Layout, Workload
    from pentatron.plan.memory import memory_for_rank, pipeline_receive_bytes

    cfg = get_model_config("llama3.1-405b")
    w = Workload(cfg, seq_len=shape.seq, global_batch=shape.micro_batch * shape.micro_batches * 8)
    lay = Layout(dp=8, tp=8, pp=8, zero=1, sp=True, micro_batch=shape.micro_batch, recompute="full",
                 precision="bf16", param_shard="fp32", pp_all_warmup=False, pp_buffers="per_microbatch")
    br = memory_for_rank(w, lay, get_gpu("h100"), 0, kernels="eager")
    receive = pipeline_receive_bytes(w, lay, 0, br.in_flight, shape.micro_batches)  # no neighbour here
    live = br.total - br.reserved - br.master_weights - br.optimizer - receive + fp32_params
    return {"live": live, "parameters": br.parameters, "gradients": br.gradients, "activations": br.activations,
            "working": br.recompute_working, "comm_buffers": br.comm_buffers - receive,
            "fp32 parameters": fp32_params}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="405b")
    ap.add_argument("--one", action="store_true", help="one measurement in this process (used internally)")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.one or device.type == "cpu":
        print(json.dumps(measure(shape, device)))
        return 0
    rows = []
    for conf in ("", "expandable_segments:True"):  # the allocator's mode is read once, at CUDA's start
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        done = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--one"], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"the run with PYTORCH_CUDA_ALLOC_CONF={conf!r} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{rows[0]['device']}, torch {rows[0]['torch']}: stage 0 of the 405B 1F1B run, one tp rank's shapes")
    for r in rows:
        print(f"  {r['alloc_conf'] or 'default allocator':26s} allocated peak {r['allocated_peak'] / GiB:6.2f} GiB, "
              f"reserved peak {r['reserved_peak'] / GiB:6.2f} GiB (x{r['reserved_peak'] / r['allocated_peak']:.3f}), "
              f"retries {r['alloc_retries']}")
    if args.shape == "405b":
        plan = planner_live_bytes(shape, rows[0]["fp32_params_bytes"])
        print(f"  planner's live tensors for the same state: {plan['live'] / GiB:6.2f} GiB "
              f"(allocated / planner {rows[0]['allocated_peak'] / plan['live']:.3f}); "
              + ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.items() if k != "live"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
