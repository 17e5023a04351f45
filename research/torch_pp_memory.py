"""The planner against torch's own pipeline stack, per pipeline rank: peak tensor memory on CPU.

torchtitan's 405B rows (benchmarks/published_runs.toml) ran torch.distributed.pipelining's schedules
over FSDP2 with fp32 gradient reduction, parameters kept gathered through the step, and every block
checkpointed. This builds that stack at toy size on gloo (dp x pp processes): each stage a run of our
Llama decoder blocks, each block in torch's checkpoint_wrapper and `fully_shard`-ed (bf16 parameters,
fp32 reduce, reshard_after_forward=False), Schedule1F1B or ScheduleInterleaved1F1B with as many
micro-batches as pipeline ranks (torchtitan's default, m = pp), AdamW. It trains three steps
and follows every storage the process's ops create (live_tensors.py); each rank's peak is
its parameter shards (there before the first step) plus the most that was live at once.

The planner evaluates the same workload as it evaluates those rows (zero 1: gathered bf16 parameters,
unsharded fp32 gradients, sharded fp32 master and Adam state; pp_all_warmup False), with its pipeline
receive buffers counted per message (ours) and per micro-batch (torch's), and prints the ratio of its
live tensors (no CUDA context, no fragmentation margin) to the measured peak. A fifth layout has no
pipeline: torchtitan's FSDP recipe of its 8B rows (each block but the last resharded after its forward,
the root too; gradients set to None after each step), against the planner's zero 3 with an fp32 shard.

    python research/torch_pp_memory.py            # five layouts, about 2 minutes on 2 cores
    python research/torch_pp_memory.py --detail   # and what was live at the busiest rank's peak
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the product's ranks.py
from live_tensors import LiveTensors  # noqa: E402
from ranks import run_on_ranks  # noqa: E402

from pentatron.hardware.catalogue import get_gpu  # noqa: E402
from pentatron.models.config import ModelConfig  # noqa: E402
from pentatron.models.llama import DecoderBlock, RMSNorm, Rotary, decoder_forward  # noqa: E402
from pentatron.plan.layout import Layout, Workload  # noqa: E402
from pentatron.plan.memory import memory_for_rank  # noqa: E402
from pentatron.plan.recipes import Recipe

# Layers dominate, as in the 405B (vocabulary 2x hidden here, 7.8x there); 16 layers split evenly.
CFG = ModelConfig(vocab_size=512, hidden_size=256, n_layers=16, n_heads=8, n_kv_heads=2, ffn_hidden_size=832,
                  max_seq_len=512)
SEQ, MICRO_BATCH, DP, STEPS = 256, 4, 2, 3
FSDP_RANKS = 4  # the layout without a pipeline shards over this many ranks
LAYOUTS = (("1f1b", 2), ("1f1b", 4), ("interleaved", 2), ("interleaved", 4), ("fsdp", 1))


class Stage(nn.Module):
    """Decoder layers [lo, hi) of the model, with the embedding on the first stage and the final norm
    and LM head on the last (torchtitan's split: each stage a copy of the model with the rest removed)."""

    def __init__(self, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.rotary = Rotary(CFG.head_dim, CFG.max_seq_len, CFG.rope_theta, None)
        self.embed = nn.Embedding(CFG.vocab_size, CFG.hidden_size) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderBlock(CFG, i) for i in range(lo, hi)})
        self.norm = RMSNorm(CFG.hidden_size, CFG.norm_eps) if last else None
        self.lm_head = nn.Linear(CFG.hidden_size, CFG.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decoder_forward(x, None, self.rotary, self.layers.values(), self.embed, self.norm, self.lm_head)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))  # torchtitan's loss


def _stage(lo: int, hi: int, first: bool, last: bool, mesh: Any, pipelined: bool) -> Stage:
    """A stage with torchtitan's FSDP (apply_fsdp at 9dec370): every block in checkpoint_wrapper and
    `fully_shard`-ed, bf16 parameters, fp32 reduce; kept gathered under PP, else each block but the last
    resharded after its forward, the root too."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = Stage(lo, hi, first, last)
    m.rotary.reset_parameters()
    names = list(m.layers.keys())
    for i, name in enumerate(names):
        m.layers[name] = checkpoint_wrapper(m.layers[name], preserve_rng_state=False)
        fully_shard(m.layers[name], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=not pipelined and i < len(names) - 1)
    fully_shard(m, mesh=mesh, mp_policy=policy, reshard_after_forward=not pipelined)
    return m


def _train_tracked(modules: list[Stage], forward_backward: Callable[[], None], pp_rank: int) -> dict:
    """STEPS steps of forward_backward + AdamW (gradients set to None after each), every storage followed:
    the peak is the parameter shards (there before the first step) plus the most live at once."""
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-4, foreach=True)
    existing = [t for m in modules for t in [*m.parameters(), *m.buffers()]]
    before = sum(getattr(t, "_local_tensor", t).nbytes for t in existing)
    live = LiveTensors(already_counted=existing)
    with live:
        for step in range(STEPS):
            live.step = step
            forward_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"pp_rank": pp_rank, "peak": before + live.peak, "at_peak": live.at_peak.most_common(12)}


def measure_rank(rank: int, world: int, schedule_name: str, pp: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    torch.set_num_threads(1)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if schedule_name == "fsdp":  # torchtitan's recipe without a pipeline: one micro-batch per step
        model = _stage(0, CFG.n_layers, True, True, init_device_mesh("cpu", (world,)), pipelined=False)
        tokens = torch.randint(0, CFG.vocab_size, (MICRO_BATCH, SEQ + 1), generator=generator)
        return _train_tracked([model], lambda: loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward(), 0)
    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    v = 2 if schedule_name == "interleaved" else 1
    n_stages, n_micro = pp * v, pp
    per_stage = CFG.n_layers // n_stages
    modules, stages = [], []
    for chunk in range(v):
        s = chunk * pp + pp_rank
        m = _stage(s * per_stage, (s + 1) * per_stage, s == 0, s == n_stages - 1, mesh["dp"], pipelined=True)
        modules.append(m)
        stages.append(PipelineStage(m, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    schedule = (Schedule1F1B(stages[0], n_microbatches=n_micro, loss_fn=loss_fn) if v == 1
                else ScheduleInterleaved1F1B(stages, n_microbatches=n_micro, loss_fn=loss_fn))
    tokens = torch.randint(0, CFG.vocab_size, (MICRO_BATCH * n_micro, SEQ + 1), generator=generator)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def forward_backward() -> None:
        schedule.step(tokens[:, :-1] if first else None, target=tokens[:, 1:] if last else None,
                      losses=[] if last else None)

    return _train_tracked(modules, forward_backward, pp_rank)


def predicted(schedule_name: str, pp: int, receive: str) -> list[float]:
    v = 2 if schedule_name == "interleaved" else 1
    if schedule_name == "fsdp":  # as the planner evaluates torchtitan's FSDP rows
        w = Workload(cfg=CFG, seq_len=SEQ, global_batch=MICRO_BATCH * FSDP_RANKS)
        lay = Layout(dp=FSDP_RANKS, zero=3, micro_batch=MICRO_BATCH, recompute="full", precision="bf16",
                     recipe=Recipe(param_shard="fp32"))
    else:
        w = Workload(cfg=CFG, seq_len=SEQ, global_batch=MICRO_BATCH * pp * DP)
        lay = Layout(dp=DP, pp=pp, zero=1, pp_schedule=schedule_name, pp_virtual=v, micro_batch=MICRO_BATCH,
                     recompute="full", precision="bf16",
                     recipe=Recipe(grad_precision="fp32", pp_all_warmup=False, pp_buffers=receive))
    gpu = get_gpu("h100")  # memory does not depend on it
    out = []
    for r in range(pp):
        b = memory_for_rank(w, lay, gpu, r, kernels="eager")
        out.append(b.total - b.reserved)
    return out


def _row(label: str, measured: float, per_message: float, per_micro: float) -> str:
    return (f"  {label:8s} measured {measured / 1024:9,.1f} | {per_message / 1024:9,.1f} ({per_message / measured:.3f})"
            f"  {per_micro / 1024:9,.1f} ({per_micro / measured:.3f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--detail", action="store_true", help="what was live at the busiest rank's peak")
    args = ap.parse_args(argv)
    print("peak tensor memory per pipeline rank, KiB: measured (torch's stack, rank of dp 0) | planner "
          "live tensors with receive buffers per message / per micro-batch, and its ratio to measured")
    for schedule_name, pp in LAYOUTS:
        world = FSDP_RANKS if schedule_name == "fsdp" else pp * DP
        results = run_on_ranks(measure_rank, world, (schedule_name, pp), f"{schedule_name} pp{pp}")
        measured = {}
        for r in results:
            measured[r["pp_rank"]] = max(measured.get(r["pp_rank"], 0), r["peak"])
        per_message, per_micro = predicted(schedule_name, pp, "per_message"), predicted(schedule_name, pp,
                                                                                         "per_microbatch")
        if schedule_name == "fsdp":
            print(f"\nFSDP over {world} ranks, no pipeline, 1 micro-batch of {MICRO_BATCH} x {SEQ} (receive "
                  "buffers do not apply: both planner columns are the same)")
        else:
            print(f"\n{schedule_name} pp{pp} dp{DP}, {pp} micro-batches of {MICRO_BATCH} x {SEQ}")
        for r in range(pp):
            print(_row(f"rank {r}", measured[r], per_message[r], per_micro[r]))
        print(_row("busiest", max(measured.values()), max(per_message), max(per_micro)))
        if args.detail:
            top = max(results, key=lambda r: r["peak"])
            print(f"  live at the peak of pipeline rank {top['pp_rank']} (besides its parameter shards):")
            for label, nbytes in top["at_peak"]:
                print(f"    {nbytes / 1024:9,.1f}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
