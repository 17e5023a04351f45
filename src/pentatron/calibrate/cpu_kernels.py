"""CPU kernels as an eager training step runs them, for `pentatron bench` on a CPU.

Inside a step autograd keeps every activation for the backward: each op writes memory no other op
touched recently and reads inputs written long before, beyond the L2 cache. A hot loop over the same
buffers measures the caches instead (a 128 KiB add can run ~10x faster hot than with its operands
out of the L2). So every measurement here draws its inputs from a pool of
`POOL_BYTES` and keeps its outputs alive in a ring of the same size, as a step does:

* `measure_stream_curve`: an out-of-place add by operand size (elementwise ops, the loss, the optimizer);
* `measure_matmul_curve`: fp32 GEMM FLOP/s by FLOPs per call (activation cached, weights not);
* `measure_head_curve`: the same for an LM head's three GEMMs (a wide output off a narrow input);
* `measure_attention_grid`: causal SDPA forward and backward by (sequence length, head dim);
* `measure_optimizer_per_element`: the optimizer step's cost per parameter element.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

POOL_BYTES = 32 * 2**20  # beyond a server core's L2 (1-2 MiB): what a step's activations span
STREAM_BYTES = tuple(2**k for k in range(14, 25, 2))  # one operand: 16 KiB .. 16 MiB
ATTN_SEQ = (16, 64, 256, 1024)
ATTN_HEAD_DIM = (32, 64, 128)
ATTN_POOL_BYTES = 8 * 2**20  # 4x a core's L2 is out of it too, and keeps the 12 shapes quick
ATTN_HEADS, ATTN_KV_HEADS = 8, 4  # per call (batch 1): grouped-query, as Llama-style models run it


def _windows(call: Callable[[int], Any], seconds: float, repeats: int = 3, min_iters: int = 2) -> float:
    """Fastest of `repeats` windows, seconds per call; call(i) runs the i-th call of the sequence (its
    operands rotate through the pool). Best-of: on a shared machine the other windows measure the load."""
    call(0)
    best, i = float("inf"), 1
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while n < min_iters or time.perf_counter() - t0 < seconds / repeats:
            call(i)
            i, n = i + 1, n + 1
        best = min(best, (time.perf_counter() - t0) / n)
    return best


class _Pool:
    """Operand sets cut from one flat fp32 buffer of POOL_BYTES (views made up front: slicing inside the
    timed call would add its own cost), and a ring that keeps the last outputs alive (about POOL_BYTES)."""

    def __init__(self, shapes: list[tuple[int, ...]], out_numel: int, device: torch.device) -> None:
        sizes = [math.prod(s) for s in shapes]
        per_set = sum(sizes)
        sets = max(2, POOL_BYTES // (4 * per_set))
        self.data = torch.empty(sets * per_set, device=device).uniform_(-1, 1)
        self.sets: list[list[torch.Tensor]] = []
        for i in range(sets):
            off, views = i * per_set, []
            for shape, n in zip(shapes, sizes, strict=True):
                views.append(self.data[off: off + n].view(shape))
                off += n
            self.sets.append(views)
        self.ring: list[Any] = [None] * max(2, POOL_BYTES // (4 * max(1, out_numel)))

    def take(self, i: int) -> list[torch.Tensor]:
        return self.sets[i % len(self.sets)]

    def keep(self, i: int, x: Any) -> None:
        self.ring[i % len(self.ring)] = x


def measure_stream_curve(device: torch.device, seconds: float) -> list[tuple[int, float]]:
    """[(bytes of one operand, bytes moved per second)]: c = a + b reads two operands and writes one."""
    out = []
    for nbytes in STREAM_BYTES:
        n = nbytes // 4
        pool = _Pool([(n,), (n,)], n, device)

        def call(i: int, pool: _Pool = pool) -> None:
            a, b = pool.take(i)
            pool.keep(i, a + b)

        out.append((nbytes, 3 * nbytes / _windows(call, seconds)))
    return out


MATMUL_N = (32, 64, 128, 256, 512, 1024)  # square fp32 GEMMs: a debug model's shapes up to the plateau


def measure_matmul_curve(device: torch.device, seconds: float) -> list[tuple[int, float]]:
    """[(FLOPs of one call, FLOP/s)] of y = x·Wᵀ on [n, n] operands as a layer runs them: x is in the
    cache (the layer's input feeds several linears), W comes from the pool (a step's weights are not
    cache-resident), y is new memory kept alive (autograd saves it)."""
    out = []
    for n in MATMUL_N:
        pool = _Pool([(n, n)], n * n, device)
        x = torch.empty(n, n, device=device).uniform_(-1, 1)

        def call(i: int, pool: _Pool = pool, x: torch.Tensor = x) -> None:
            (w,) = pool.take(i)
            pool.keep(i, torch.mm(x, w.t()))

        out.append((2 * n**3, 2 * n**3 / _windows(call, seconds, min_iters=3)))
    return out


HEAD_TOKENS = (16, 64, 256, 1024)  # rows per call: micro-batch x sequence of a CPU run
HEAD_HIDDEN, HEAD_VOCAB = 128, 4096  # an LM head: the vocabulary 32x the hidden size (Llama 3 8B: 128256/4096)


def measure_head_curve(device: torch.device, seconds: float) -> list[tuple[int, float, float, float]]:
    """[(FLOPs of one call, forward, input-gradient, weight-gradient FLOP/s)] of an LM head's three GEMMs
    on [t, HEAD_HIDDEN] rows and a [HEAD_VOCAB, HEAD_HIDDEN] weight, as a step runs them: y = x·Wᵀ and
    dX = dY·W read the weight from the pool, dW = dYᵀ·X reads the saved input from it; dY is in the cache
    (the loss has just written it); outputs are new memory kept alive. A wide output off a narrow input
    runs below the square GEMMs of `measure_matmul_curve` at the same FLOPs; the decoder layers' GEMMs,
    near square, keep that curve."""
    h, v = HEAD_HIDDEN, HEAD_VOCAB
    out = []
    for t in HEAD_TOKENS:
        weights = _Pool([(v, h)], t * v, device)
        inputs = _Pool([(t, h)], v * h, device)
        x = torch.empty(t, h, device=device).uniform_(-1, 1)
        dy = torch.empty(t, v, device=device).uniform_(-1, 1)

        def fwd(i: int, weights: _Pool = weights, x: torch.Tensor = x) -> None:
            (w,) = weights.take(i)
            weights.keep(i, torch.mm(x, w.t()))

        def dx(i: int, weights: _Pool = weights, dy: torch.Tensor = dy) -> None:
            (w,) = weights.take(i)
            weights.keep(i, torch.mm(dy, w))

        def dw(i: int, inputs: _Pool = inputs, dy: torch.Tensor = dy) -> None:
            (xs,) = inputs.take(i)
            inputs.keep(i, torch.mm(dy.t(), xs))

        flops = 2 * t * h * v
        out.append((flops, *(flops / _windows(call, seconds, min_iters=3) for call in (fwd, dx, dw))))
    return out


def attention_flops(heads: int, seq: int, head_dim: int, batch: int = 1) -> float:
    """Causal attention forward FLOPs: QKᵀ and PV over the s(s+1)/2 query-key pairs kept by the mask."""
    return 4 * batch * heads * head_dim * seq * (seq + 1) / 2


def measure_attention_grid(device: torch.device, seconds: float) -> list[tuple[int, int, float, float]]:
    """[(seq, head_dim, forward FLOP/s, backward FLOP/s)] of causal `scaled_dot_product_attention`
    (ATTN_HEADS query heads, ATTN_KV_HEADS key/value heads), both rates over the forward's FLOPs.
    Like a step: a window runs every forward (graphs kept), then every backward."""
    import torch.nn.functional as F

    out = []
    for seq in ATTN_SEQ:
        for d in ATTN_HEAD_DIM:
            q_shape, kv_shape = (1, ATTN_HEADS, seq, d), (1, ATTN_KV_HEADS, seq, d)
            per_set = 4 * d * seq * (2 * ATTN_HEADS + 2 * ATTN_KV_HEADS)  # q, k, v, out
            sets = max(2, ATTN_POOL_BYTES // per_set)
            qkv = [tuple(torch.empty(s, device=device).uniform_(-1, 1).requires_grad_()
                         for s in (q_shape, kv_shape, kv_shape)) for _ in range(sets)]
            grad = torch.ones(q_shape, device=device)
            best_f = best_b = float("inf")
            for window in range(4):  # the first window warms up
                t0 = time.perf_counter()
                outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) for q, k, v in qkv]
                t1 = time.perf_counter()
                grads = [torch.autograd.grad(o, x, grad) for o, x in zip(outs, qkv, strict=True)]
                t2 = time.perf_counter()
                best_f, best_b = min(best_f, (t1 - t0) / sets), min(best_b, (t2 - t1) / sets)
                del outs, grads
                if window and t2 - t0 > seconds:
                    break
            flops = attention_flops(ATTN_HEADS, seq, d)
            out.append((seq, d, flops / best_f, flops / best_b))
    return out


def measure_optimizer_per_element(device: torch.device, seconds: float, per_tensor_s: float) -> float:
    """Seconds per parameter element of an optimizer step (gradient norm, clipping, torch's AdamW, as
    the trainer runs them) on 8 tensors of 256 Ki elements (32 MiB of parameters, gradients and moments:
    out of the caches), less the per-tensor host cost measured on tiny tensors."""
    n_tensors, numel = 8, 2**18
    params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step(_: int) -> None:
        norm = torch.stack([(p.grad.float() ** 2).sum() for p in params]).sum().sqrt()
        for p in params:
            p.grad.mul_(1.0 / (norm + 1e-6))
        opt.step()

    t = _windows(step, 3 * seconds)
    return max(0.0, (t - n_tensors * per_tensor_s) / (n_tensors * numel))


def step_compute(device: torch.device) -> Callable[[], None]:
    """About 0.5 ms of a layer's work on one core (two 256² GEMMs, weights rotating through the pool):
    what a rank does between two collectives of a step, for timing collectives in context."""
    pool = _Pool([(256, 256)], 256 * 256, device)
    x = torch.empty(256, 256, device=device).uniform_(-1, 1)
    i = [0]

    def run() -> None:
        for _ in range(2):
            i[0] += 1
            pool.keep(i[0], torch.mm(x, pool.take(i[0])[0].t()))

    return run


def agreed_compute(comm: Any, dim: str, compute: Callable[[], None], seconds: float) -> Callable[[], None]:
    """`compute` repeated to take about `seconds`, the same count on every rank of `dim` (a collective
    call: the largest count any rank needs), so that ranks meeting after it ran the same work."""
    t0 = time.perf_counter()
    for _ in range(4):
        compute()
    per = max((time.perf_counter() - t0) / 4, 1e-6)
    reps = torch.tensor([float(max(1, round(seconds / per)))], dtype=torch.float64)
    comm.all_reduce(reps, dim, op="max")
    n = int(reps.item())

    def run() -> None:
        for _ in range(n):
            compute()

    return run


def reference_kernels(device: torch.device, seconds: float) -> dict[str, float]:
    """Seconds per call of three reference loads, run alone and then in every process of the node at
    once (`node_slowdown`): CPU cores of a node may share execution units, caches and memory bandwidth
    (two processes of a 2-core node each run about 2x slower), GPUs do not.
    matmul: a 256² in-step GEMM; stream: a 256 KiB in-step add; host: an add of two 64-element tensors
    (op dispatch)."""
    out = {}
    pool = _Pool([(256, 256)], 256 * 256, device)
    x = torch.empty(256, 256, device=device).uniform_(-1, 1)
    # best of 5 windows: a neighbour's burst must hit every window to count
    out["matmul"] = _windows(lambda i: pool.keep(i, torch.mm(x, pool.take(i)[0].t())), seconds, repeats=5)
    n = 2**16
    spool = _Pool([(n,), (n,)], n, device)
    out["stream"] = _windows(lambda i: spool.keep(i, spool.take(i)[0] + spool.take(i)[1]), seconds, repeats=5)
    a, b = torch.ones(64, device=device), torch.ones(64, device=device)
    out["host"] = _windows(lambda i: a + b, seconds, repeats=5, min_iters=100)
    return out


def measure_cpu_kernels(device: torch.device, seconds: float, per_tensor_s: float) -> dict[str, Any]:
    """Everything above, keyed as `BenchResult` stores it."""
    return {"stream_curve": measure_stream_curve(device, seconds),
            "matmul_curve": measure_matmul_curve(device, seconds),
            "head_curve": measure_head_curve(device, seconds),
            "attention_grid": measure_attention_grid(device, seconds),
            "optimizer_per_element": measure_optimizer_per_element(device, seconds, per_tensor_s)}
