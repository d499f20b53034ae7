"""Attention on NVIDIA GPUs (`sdpa.cuh`) at any head_dim multiple of 64 (Gemma 4: 256 and 512): for
decode and verify steps (1-8 query positions per sequence), and for prompt chunks at the head_dims
cuDNN does not take (over 128: MLX's composed path would hold the whole score matrix), each query
row reduced in an order that depends only on the key slots: a verify's row equals the decode step it
stands for, and a prompt's rows are the same however it is cut into chunks. `reference` is what it
computes, in MLX ops, to test against.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .qmm import name
from .source import Kernel

MAX_QUERIES = 8  # a decode step or a verify; more: a prompt chunk
PROMPT_HEAD_DIM = 256  # from this head_dim a prompt chunk takes this kernel too
DTYPES = (mx.bfloat16, mx.float16)
ROWS = 8  # query rows (warps) per block
WHOLE = 1 << 30  # a prompt chunk's split: every key slot (its rows fill the GPU without splitting the keys)

_SPLIT = Kernel("mtp_attention", "sdpa.cuh", ["q", "keys", "values", "mask"], ["out", "stats", "acc"],
                "mtp_attention_split<T, D, SPLIT, ROWS, MASK, SINGLE>(q, keys, values, mask, out, stats, acc, "
                "q_shape[1], keys_shape[1], q_shape[2], keys_shape[2]);")
_COMBINE = Kernel("mtp_attention_combine", "sdpa.cuh", ["stats", "acc"], ["out"],
                  "mtp_attention_combine<T, D>(stats, acc, out, stats_shape[0], stats_shape[1]);")


def split(head_dim: int) -> int:
    """Key slots per split: fixed per head_dim (never per buffer length: see sdpa.cuh)."""
    return 256 if head_dim <= 256 else 128


def supports(q: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array], scale: float) -> str:
    """Why this kernel cannot take an attention ('' when it can)."""
    B, Hq, L, D = q.shape
    if not 0 < L <= MAX_QUERIES and not (L > 0 and D >= PROMPT_HEAD_DIM) or keys.shape[2] == 0:
        return f"{L} query positions over {keys.shape[2]} slots at head_dim {D}"
    if q.dtype not in DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        return f"{name(q.dtype)} queries with {name(keys.dtype)} keys"
    if D % 64 or D > 512 or values.shape[-1] != D or keys.shape[0] != B or Hq % keys.shape[1]:
        return f"head_dim {D}, {Hq} heads over {keys.shape[1]} K/V heads"
    if scale != 1.0:
        return f"scale {scale}"
    if mask is not None and (mask.dtype != mx.bool_ or mask.shape != (B, 1, L, keys.shape[2])):
        return f"a {name(mask.dtype)} mask of shape {mask.shape}"
    return ""


def attention(q: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array],
              shape: Optional[tuple] = None) -> mx.array:
    """softmax(q @ keys.T, masked) @ values, scale 1: q (B, Hq, L, D), keys/values (B, Hkv, T, D),
    mask (B, 1, L, T) bool or None. Returns (B, Hq, L, D), written as `shape` if given (its size:
    the same memory, no reshape node)."""
    B, Hq, L, D = q.shape
    shape = q.shape if shape is None else shape
    Hkv, T = keys.shape[1], keys.shape[2]
    size = split(D) if L <= MAX_QUERIES else WHOLE
    splits = -(-T // size)
    single = splits == 1  # the output itself; else each split's partial results, then `_COMBINE`
    rows = Hq // Hkv * L
    masked = mask is not None
    template = [("T", q.dtype), ("D", D), ("SPLIT", size), ("ROWS", ROWS), ("MASK", masked), ("SINGLE", single)]
    mask = mask if masked else mx.zeros((1,), dtype=mx.bool_)
    shapes = [shape, (1,), (1,)] if single else [(1,), (B * Hq * L, splits, 2), (B * Hq * L, splits, D)]
    out, stats, acc = _SPLIT([q, keys, values, mask], template,
                             grid=(splits * 32 * ROWS, -(-rows // ROWS), B * Hkv), threadgroup=(32 * ROWS, 1, 1),
                             output_shapes=shapes, output_dtypes=[q.dtype, mx.float32, mx.float32])
    if single:
        return out
    threads = min(D, 256)
    return _COMBINE([stats, acc], [("T", q.dtype), ("D", D)], grid=(D, B * Hq * L, 1), threadgroup=(threads, 1, 1),
                    output_shapes=[shape], output_dtypes=[q.dtype])[0]


def reference(q: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array]) -> mx.array:
    """fp32 attention with `attention`'s semantics (scale 1; a row with no visible key gives 0)."""
    B, Hq, L, D = q.shape
    Hkv = keys.shape[1]
    k = mx.repeat(keys.astype(mx.float32), Hq // Hkv, axis=1)
    v = mx.repeat(values.astype(mx.float32), Hq // Hkv, axis=1)
    scores = q.astype(mx.float32) @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    top = mx.max(scores, axis=-1, keepdims=True)
    p = mx.exp(scores - mx.where(mx.isinf(top), 0, top))
    total = p.sum(axis=-1, keepdims=True)
    return ((p @ v) / mx.where(total > 0, total, 1)).astype(q.dtype)
