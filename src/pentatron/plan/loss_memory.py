"""Bytes of our chunked loss (models/loss.py `linear_cross_entropy`) on the last pipeline stage, per micro-batch,
on the device the plan is for (`GPUSpec.device_type`: a CUDA GPU from the catalogue, or the CPU).

N tokens, the local vocabulary V (V/tp), the head's input width h (gathered under SP), c = min(N, chunk)
rows per chunk, B = min(V, WGRAD_ROWS) rows per dW block, e the activations' bytes, l = e when e < 4
(the low-precision copy of a chunk's gradient; 0 in fp32, where `.to` copies nothing).

Kept from forward for backward: per token the fp32 log-sum-exp, the int64 local target and two 1-byte
masks, 14·N, and the last chunk's fp32 exp(logit − max) with its row max, c·(4V + 4).

Backward allocates, beside those, for its whole run: dX (e·N·h, `empty_like`), the fp32 per-token scale
(4·N), one chunk's row indices (8·c) and the fp32 dW accumulator (4·V·h); and at its three candidate peaks:
  cast   a chunk's fp32 gradient (the kept chunk, or a recomputed one in its room) and its cast to e,
         l·c·V on top of the kept chunk;
  block  the fp32 chunk is gone (−4·c·V), its cast l·c·V and one dW block's product gᵀ·x, l·B·h. On the
         CPU the in-place add of that bf16 product into the fp32 accumulator goes through TensorIterator's
         CPU path, which copies a mismatched input to the common dtype first: + 4·B·h. On CUDA the add
         casts inside the kernel: no copy;
  end    the chunks are done (−4·c·V) and dW is cast to the weight's dtype for autograd, l·V·h beside
         the fp32 accumulator.
The transient is the largest of them. Forward's own peak, one chunk's fp32 logits (the kept chunk) and, on
the CPU under bf16, the matmul's low-precision output they are widened from (l·c·V; on CUDA the matmul
writes fp32 itself, `torch.mm(..., out_dtype=float32)`), is below the cast peak, which adds the
accumulator and dX to the same chunk. So the two devices differ only at the block peak; it is the
largest when B·h·(l + 4) (CPU) or B·h·l (CUDA) exceeds 4·c·V: a small chunk or a small local vocabulary
(tp 8 at vocab 128k). In fp32 (l = 0) the cast and `.to` copy nothing and the add is in place (addmm):
the transient is the accumulator alone (and, with more than one chunk, a second chunk's row indices: 8·c,
below the cast peak under bf16).

Not modelled: a CPU BLAS's own packing buffers. With a skinny chunk the CPU's bf16 matmul for dX packs the
weight (measured at chunk 4, vocabulary 32k: a bf16 copy of it per thread); from chunk 16 up no matmul
buffer reaches a peak (the tests' shapes), and cuBLAS works in its preallocated workspace.

Measured on the CPU allocator (tests/plan/test_chunked_loss_memory.py): equal to the byte, every shape,
with each of the three peaks the largest; the CUDA form by the same run with the chunk's logits written in
fp32 without a low-precision copy (`out_dtype` has no CPU kernel in torch 2.13), where the cast or end peak
is the largest, and the block's product alone.
"""

from __future__ import annotations

from pentatron.hardware.catalogue import DeviceType

# models/loss.py's WGRAD_ROWS (this module imports no torch; a test holds the two equal)
WGRAD_ROWS = 8192


def last_chunk_bytes(tokens: float, vocab: float, chunk: int) -> float:
    """The last chunk's fp32 exp(logit − max) over `vocab` local rows and its fp32 row max, kept from forward
    (backward takes it first)."""
    return min(tokens, chunk) * (4 * vocab + 4)


def chunked_loss_bytes(tokens: float, vocab: float, hidden: float, chunk: int, act_bytes: int,
                       device: DeviceType) -> tuple[float, float]:
    """(kept, transient) bytes of the chunked loss for `tokens` tokens over `vocab` local vocabulary rows of
    width `hidden` (the derivation above). kept: what forward keeps for backward; transient: what backward
    adds at its peak."""
    n, v, h, e = tokens, vocab, hidden, act_bytes
    c = min(n, chunk)
    low = e if e < 4 else 0
    kept = n * (4 + 8 + 2) + last_chunk_bytes(n, v, chunk)
    whole_backward = e * n * h + 4 * n + 8 * c + 4 * v * h
    if not low:  # a recomputed chunk's row indices are made while the previous chunk's are alive
        return kept, whole_backward + (8 * c if n > c else 0)
    block = min(v, WGRAD_ROWS) * h * (low + (4 if device == "cpu" else 0))
    peaks = (low * c * v, low * c * v - 4 * c * v + block, low * v * h - 4 * c * v)
    return kept, whole_backward + max(peaks)
