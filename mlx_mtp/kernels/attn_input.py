"""An attention layer's input on NVIDIA GPUs in one kernel (`attn_input.cuh`, issue 42): the input
RMSNorm, q/k/v as one quantized product over their joined weight, the per-head norms and RoPE, the
results head-major as attention and the K/V cache take them. For decode and verify steps (1-64 rows),
every row computed as if alone. `reference` is what it computes, in fp32 MLX ops, to test against.

The joined weight (`self_attn.qkv_proj`): q_proj's output rows, then k_proj's, then v_proj's; no v
where v is k before its norm (`kv=1`: attention_k_eq_v full layers), and q alone on layers that read
another layer's K/V (`kv=0`).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import qmm
from .source import Kernel

MAX_HEAD_DIM = 512

_KERNEL = Kernel("mtp_attention_input", ("qmm.cuh", "proj.cuh", "attn_input.cuh"),
                 ["x", "norm_w", "w", "scales", "biases", "q_norm", "k_norm", "positions", "inverse", "eps"],
                 ["q", "k", "v", "part", "done"],
                 "mtp_attention_input<T, BITS, GROUP, MT, NW, DEPTH, D, HQ, KV>(x, norm_w, w, scales, biases, "
                 "q_norm, k_norm, positions, inverse, q, k, v, part, done, x_shape[0], w_shape[0], x_shape[1], "
                 "positions_shape[1], eps[0]);")

_CONSTANTS: dict = {}


def constant(value: float) -> mx.array:
    """A float32 (1,) array of `value`, made once (an evaluated array: usable from any thread)."""
    if value not in _CONSTANTS:
        _CONSTANTS[value] = mx.array([value], dtype=mx.float32)
        mx.eval(_CONSTANTS[value])
    return _CONSTANTS[value]


def kv_heads(n: int, head_dim: int, n_heads: int, kv: int) -> int:
    return (n // head_dim - n_heads) // (2 if kv == 2 else 1) if kv else 0


def supports(x: mx.array, norm_w: mx.array, qkv, q_norm: mx.array, k_norm: Optional[mx.array],
             inverse: mx.array, n_heads: int, head_dim: int, kv: int) -> str:
    """Why the kernel cannot take this attention input ('' when it can)."""
    rows = x.size // x.shape[-1]
    reason = "" if 0 < rows <= qmm.MAX_ROWS else f"{rows} rows"
    if not reason and "scales" not in qkv:
        reason = "an unquantized projection"
    reason = reason or qmm.supports_layer(x.dtype, qkv)
    if reason:
        return reason
    n = qkv["weight"].shape[0]
    if "bias" in qkv:
        return "a biased projection"
    if head_dim % 64 or head_dim > MAX_HEAD_DIM or n % head_dim or n // head_dim < n_heads + (kv > 0):
        return f"head_dim {head_dim} with {n} joined output features"
    if kv == 2 and (n // head_dim - n_heads) % 2:
        return f"{n // head_dim - n_heads} K/V heads for k and v"
    norms = [norm_w, q_norm] + ([k_norm] if kv else [])
    if any(w is None or w.dtype != x.dtype for w in norms) or norm_w.shape != (x.shape[-1],):
        return "norm weights not in the activations' dtype"
    if inverse.dtype != mx.float32 or inverse.shape != (head_dim // 2,):
        return f"RoPE frequencies of shape {inverse.shape}"
    return ""


def attention_input(x: mx.array, norm_w: mx.array, qkv, q_norm: mx.array, k_norm: Optional[mx.array],
                    positions: mx.array, inverse: mx.array, n_heads: int, head_dim: int, kv: int,
                    eps: float) -> tuple:
    """q (B, n_heads, L, D), k and v (B, kv heads, L, D) (None for kv=0) of x (B * L, H), positions
    (B, L) int32, `inverse` the (D/2,) inverse RoPE periods (0: a pair that does not rotate)."""
    M, K = x.size // x.shape[-1], x.shape[-1]
    B, L = positions.shape
    w = qkv["weight"]
    N = w.shape[0]
    hkv = kv_heads(N, head_dim, n_heads, kv)
    nw = qmm.warps(N, K, qkv.bits)
    template = [("T", x.dtype), ("BITS", qkv.bits), ("GROUP", qkv.group_size), ("MT", -(-M // 8)), ("NW", nw),
                ("DEPTH", qmm.DEPTH), ("D", head_dim), ("HQ", n_heads), ("KV", kv)]
    kv_shape = (B, hkv, L, head_dim) if kv else (1,)
    inputs = [x.reshape(M, K), norm_w, w, qkv["scales"], qkv["biases"], q_norm,
              q_norm if k_norm is None else k_norm, positions.astype(mx.int32), inverse, constant(eps)]
    q, k, v, _, _ = _KERNEL(inputs, template, grid=(N // 16 * 32 * nw, 1, 1), threadgroup=(32 * nw, 1, 1),
                            output_shapes=[(B, n_heads, L, head_dim), kv_shape, kv_shape, (M, N), (N // head_dim,)],
                            output_dtypes=[x.dtype, x.dtype, x.dtype, mx.float32, mx.int32], init_value=0)
    return (q, k, v) if kv else (q, None, None)


# ---- what it computes -----------------------------------------------------------------------------------


def rms(x: mx.array, weight: Optional[mx.array], eps: float) -> mx.array:
    """fp32 RMSNorm over the last axis (weight None: none)."""
    y = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight.astype(mx.float32)


def rope(x: mx.array, positions: mx.array, inverse: mx.array) -> mx.array:
    """fp32 RoPE of x (B, heads, L, D), pairs (i, i + D/2), angles positions (B, L) x inverse."""
    angles = positions.astype(mx.float32)[:, None, :, None] * inverse
    cos, sin = mx.cos(angles), mx.sin(angles)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def reference(x: mx.array, norm_w: mx.array, qkv, q_norm: mx.array, k_norm: Optional[mx.array],
              positions: mx.array, inverse: mx.array, n_heads: int, head_dim: int, kv: int, eps: float) -> tuple:
    """`attention_input` in fp32 MLX ops (weights dequantised as the kernels see them)."""
    B, L = positions.shape
    w = qmm.weights(qkv["weight"], qkv["scales"], qkv["biases"], qkv.group_size, qkv.bits)
    y = rms(x.astype(mx.float32), norm_w, eps) @ w.T
    heads = y.reshape(B, L, -1, head_dim).transpose(0, 2, 1, 3)
    hkv = kv_heads(w.shape[0], head_dim, n_heads, kv)
    q = rope(rms(heads[:, :n_heads], q_norm, eps), positions, inverse).astype(x.dtype)
    if not kv:
        return q, None, None
    raw_k = heads[:, n_heads : n_heads + hkv]
    raw_v = heads[:, n_heads + hkv :] if kv == 2 else raw_k
    k = rope(rms(raw_k, k_norm, eps), positions, inverse)
    return q, k.astype(x.dtype), rms(raw_v, None, eps).astype(x.dtype)
