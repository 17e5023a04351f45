"""Compiled vs eager training, Pentatron vs Hugging Face `transformers`, side by side in one process (CPU).

    python benchmarks/compile_speed.py [--steps 3] [--repeats 3] [--seq-len 512] [--threads 2] [--profile]

Four training loops over the same ≈25M-parameter Llama shape (hidden 512, 5 layers, 8 heads, SwiGLU 1536,
vocab 8192, untied), fp32, the same random token batches:
  pentatron-eager     Pentatron's step runner (1-process layout), train.compile = false
  pentatron-compiled  the same, train.compile = true (regional: each decoder block compiled, inductor)
  hf-eager            LlamaForCausalLM (sdpa attention) + torch AdamW + clip_grad_norm_
  hf-compiled         the same under torch.compile(model) (the whole model, inductor)
Every loop is built and warmed up first (compilation happens there and is reported apart), then the
timed rounds run interleaved — round r times every loop once — and each loop keeps its best round, so
load drift from the other users of the machine hits all four alike. The 1-minute load average is
recorded before and after. Beside wall tokens/s it reports tokens per CPU-second of the process (steadier
under load with --threads 1). --profile then buckets each loop's step time (benchmarks/step_profile.py):
GEMMs and attention are library kernels compile leaves alone, which bounds what compiling can gain.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

SHAPE = dict(vocab_size=8192, hidden_size=512, n_layers=5, n_heads=8, n_kv_heads=8, ffn_hidden_size=1536)
LOOPS = ("pentatron-eager", "pentatron-compiled", "hf-eager", "hf-compiled")
Step = Callable[[torch.Tensor], None]


def _pentatron(compiled: bool, args: argparse.Namespace) -> tuple[Step, int]:
    from pentatron.config import load_config
    from pentatron.distributed.context import ParallelContext
    from pentatron.layout import ParallelLayout
    from pentatron.models.llama import build_meta_model
    from pentatron.parallel.parallelize import parallelize
    from pentatron.precision import resolve_precision

    shape = [f"model.{k}={v}" for k, v in SHAPE.items()]
    cfg = load_config(None, [*shape, f"model.max_seq_len={args.seq_len}", "model.tie_embeddings=false",
                             f"train.seq_len={args.seq_len}", f"train.micro_batch={args.micro_batch}",
                             f"train.global_batch={args.micro_batch}", f"train.compile={str(compiled).lower()}"],
                      world_size=1)
    model = build_meta_model(cfg.model_config())
    n_params = sum(p.numel() for p in model.parameters())
    ctx = ParallelContext.from_layout(ParallelLayout(), "cpu")
    runner = parallelize(model, ctx, cfg, resolve_precision("fp32", torch.device("cpu")))

    def step(tokens: torch.Tensor) -> None:
        with record_function("forward_backward"):
            runner.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
        with record_function("clip"):
            runner.clip_grads(cfg.train.clip)
        with record_function("optimizer"):
            runner.step(cfg.train.lr)

    return step, n_params


def _hf(compiled: bool, args: argparse.Namespace) -> tuple[Step, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"],
                         intermediate_size=SHAPE["ffn_hidden_size"], num_hidden_layers=SHAPE["n_layers"],
                         num_attention_heads=SHAPE["n_heads"], num_key_value_heads=SHAPE["n_kv_heads"],
                         max_position_embeddings=args.seq_len, tie_word_embeddings=False, use_cache=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(hf_cfg).train()
    n_params = sum(p.numel() for p in model.parameters())
    forward = torch.compile(model) if compiled else model
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)

    def step(tokens: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with record_function("forward_backward"):
            logits = forward(input_ids=tokens[:, :-1]).logits
            with record_function("linear_cross_entropy"):  # the loss bucket of step_profile.py
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        with record_function("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with record_function("optimizer"):
            opt.step()

    return step, n_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per loop per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per loop first (compilation happens here)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each loop keeps its best")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--profile", action="store_true",
                    help="then profile the timed steps of each loop and print where the time goes (step_profile.py)")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    load_before = os.getloadavg()[0]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, SHAPE["vocab_size"], (args.micro_batch, args.seq_len + 1), generator=g)
               for _ in range(args.warmup + args.steps)]
    loops = args.loops.split(",")
    steps: dict[str, Step] = {}
    out: dict[str, dict[str, Any]] = {}
    for name in loops:
        torch.manual_seed(0)
        build = _pentatron if name.startswith("pentatron") else _hf
        steps[name], n_params = build(name.endswith("compiled"), args)
        start = time.perf_counter()
        for tokens in batches[: args.warmup]:
            steps[name](tokens)
        out[name] = {"params": n_params, "warmup_s": time.perf_counter() - start, "tokens_per_s": 0.0,
                     "tokens_per_cpu_s": 0.0}
        print(f"{name}: {n_params / 1e6:.1f}M parameters, warm-up {out[name]['warmup_s']:.1f} s", flush=True)
    tokens_per_round = args.steps * args.micro_batch * args.seq_len
    for r in range(args.repeats):
        for name in loops:
            start, cpu = time.perf_counter(), time.process_time()
            for tokens in batches[args.warmup:]:
                steps[name](tokens)
            tps = tokens_per_round / (time.perf_counter() - start)
            # CPU seconds of all the process's threads: less hit by other users of the machine than wall time
            # (with --threads 1; more threads add OpenMP's spin-waiting, which grows under load)
            tpc = tokens_per_round / (time.process_time() - cpu)
            out[name]["tokens_per_s"] = max(out[name]["tokens_per_s"], tps)
            out[name]["tokens_per_cpu_s"] = max(out[name]["tokens_per_cpu_s"], tpc)
            print(f"round {r + 1} {name}: {tps:,.0f} tokens/s, {tpc:,.0f} tokens/CPU-s", flush=True)
    load_after = os.getloadavg()[0]
    print(f"\nload average (1 min) {load_before:.1f} before, {load_after:.1f} after; {os.cpu_count()} cores, "
          f"{args.threads} threads; seq {args.seq_len}, micro-batch {args.micro_batch}, fp32, best of {args.repeats}")
    print(f"{'loop':<20} {'tokens/s':>10} {'tokens/CPU-s':>13} {'warm-up s':>10}")
    for name in loops:
        o = out[name]
        print(f"{name:<20} {o['tokens_per_s']:>10,.0f} {o['tokens_per_cpu_s']:>13,.0f} {o['warmup_s']:>10.1f}")
    ratio, ratio_cpu = {}, {}
    for label, a, b in (("compiled/eager (pentatron)", "pentatron-compiled", "pentatron-eager"),
                        ("pentatron compiled / hf compiled", "pentatron-compiled", "hf-compiled"),
                        ("pentatron eager / hf eager", "pentatron-eager", "hf-eager"),
                        ("compiled/eager (hf)", "hf-compiled", "hf-eager")):
        if a in out and b in out:
            ratio[label] = out[a]["tokens_per_s"] / out[b]["tokens_per_s"]
            ratio_cpu[label] = out[a]["tokens_per_cpu_s"] / out[b]["tokens_per_cpu_s"]
    for k, v in ratio.items():
        print(f"{k}: {v:.2f}x wall, {ratio_cpu[k]:.2f}x CPU time")
    if args.profile:
        from step_profile import profile_steps, table

        rows = {}
        for name in loops:
            rows[name] = profile_steps([lambda t=t, name=name: steps[name](t) for t in batches[args.warmup:]])
            out[name]["profile"] = rows[name]
        print(f"\nwhere a step's time goes, per loop: the {args.steps} timed steps once more, each under the "
              f"profiler (self time of the main thread's events in the fastest one; ceiling = 1 / share of gemm + "
              f"gemm-head + attention, the most that removing all else could gain)\n{table(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loops": out, "ratios": ratio, "ratios_cpu": ratio_cpu, "load": [load_before, load_after],
                       "args": vars(args)}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
