"""Peak bytes of the loss (LM head + cross-entropy, forward + backward) at vocab 128256, seq 4096, micro-batch 1,
on CPU: the full-logits loss (before) against the chunked one (models/loss.py, now), plain and tp2.

    python benchmarks/loss_memory.py --chunk 1024

The meter follows every storage the loss's ops create (research/live_tensors.py, a TorchDispatchMode),
the head's input and weight excluded; the weight's gradient (vocab x hidden fp32, which any loss produces)
is reported apart. tp2 is the shard math of one rank (rank 0 of 2: the head's vocabulary half, targets
anywhere in the full vocabulary) on a 1-process comm: its collectives carry per-token vectors only, which
the peak barely sees. The hidden size only sets the input's and weight's size, so it is kept small.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "research"))  # the meter lives with the studies
from live_tensors import LiveTensors  # noqa: E402

from pentatron.distributed.context import ParallelContext  # noqa: E402
from pentatron.models.loss import linear_cross_entropy  # noqa: E402
from pentatron.parallel.tensor import _TPVocab, vocab_parallel_cross_entropy  # noqa: E402


def measure(kind: str, tp: int, vocab: int, seq: int, hidden: int, chunk: int) -> int:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab // tp, hidden, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (1, seq), generator=g)
    comm = ParallelContext.single().comm
    with LiveTensors(already_counted=[x, w]) as meter:
        if kind == "full logits":
            logits = F.linear(x, w)
            loss = (F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) if tp == 1
                    else vocab_parallel_cross_entropy(logits.float(), targets, comm))
            del logits
        else:
            loss = linear_cross_entropy(x, w, targets, chunk, None if tp == 1 else _TPVocab(0, comm))
        loss.backward()
    return meter.peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024)
    args = p.parse_args()
    gib = 2 ** 30
    rows = []
    for tp in (1, 2):
        v_local = args.vocab // tp
        one_chunk = args.chunk * v_local * 4
        dw = v_local * args.hidden * 4
        for kind in ("full logits", "chunked"):
            peak = measure(kind, tp, args.vocab, args.seq, args.hidden, args.chunk)
            rows.append((tp, kind, peak, peak - dw, one_chunk, args.seq * v_local * 4))
    print(f"\nLoss peak (LM head + cross-entropy, fwd + bwd), vocab {args.vocab}, seq {args.seq}, micro-batch 1, fp32, "
          f"hidden {args.hidden}, chunk {args.chunk} tokens; CPU, load {os.getloadavg()[0]:.2f}\n")
    print("| tp | loss | peak (GiB) | peak without dW (GiB) | one chunk's fp32 logits (GiB) | full fp32 logits (GiB) |")
    print("|---:|---|---:|---:|---:|---:|")
    for tp, kind, peak, no_dw, one, full in rows:
        print(f"| {tp} | {kind} | {peak / gib:.3f} | {no_dw / gib:.3f} | {one / gib:.3f} | {full / gib:.3f} |")
    print(json.dumps({"command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
