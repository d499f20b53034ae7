"""mlx_mtp's own GPU kernels, where MLX's miss what speculative decoding needs: on NVIDIA GPUs (MLX's
CUDA backend) the products of decode and verify steps, each weight read once for all rows and every
row computed as if alone, so a verify costs about one decode step and equals the steps it stands for.

One module per kernel family, the CUDA source beside it (`qmm`: quantized matmuls and MoE experts,
`sdpa`: attention; issue 42's fused ones, each a few of a layer's ops in one kernel: `attn_input`,
`ffn`, `glue`, `routing`); `dispatch` decides which product takes which kernel and says why. The entry points
below return None where MLX's kernel is the one to run (at once off CUDA): models call the fused ones on
every backend, the others on the GPU path.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import attn_input as _attn_input
from . import ffn as _ffn
from . import glue as _glue
from . import routing as _routing
from . import dispatch, qmm, sdpa
from .dispatch import mode, using


def linear(layer, x: mx.array) -> Optional[mx.array]:
    """A QuantizedLinear's forward (bias included), or None (MLX's kernel)."""
    y = matmul(layer, x)
    if y is not None and "bias" in layer:
        y = y + layer["bias"]
    return y


def matmul(layer, x: mx.array) -> Optional[mx.array]:
    """x @ W.T for a quantized layer's W (a QuantizedLinear, a tied QuantizedEmbedding), or None."""
    K = x.shape[-1]
    rows = x.size // K
    if dispatch.quantized(rows, x.dtype, layer):
        return None
    y = qmm.dense(x.reshape(rows, K), layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def switch_glu(glu, x: mx.array, idx: mx.array) -> Optional[mx.array]:
    """mlx-lm's SwitchGLU forward: (..., H) tokens through their experts `idx` (..., k) -> (..., k, H),
    or None."""
    k = idx.shape[-1]
    if dispatch.experts(idx.size // k, k, x.dtype, glu):
        return None
    return glu_experts(glu, x, idx)


def prefill_experts(glu, idx: mx.array) -> bool:
    """Whether a SwitchGLU's experts over a prompt chunk go by expert (one product per used expert)
    instead of MLX's gather_qmm, which re-reads an expert per (token, expert) pair on CUDA."""
    k = idx.shape[-1]
    return not dispatch.prefill_experts(idx.size // k, glu)


def glu_experts(glu, x: mx.array, idx: mx.array) -> mx.array:
    """`switch_glu` on mlx_mtp's kernels, whatever the dispatch would say: gate and up in one pass
    with the activation, then down."""
    k = idx.shape[-1]
    tokens = idx.size // k
    ids = _pairs(idx)
    gate, up = gate_up(glu)
    x = x.reshape(tokens, x.shape[-1])
    h = (qmm.experts(x, ids, gate, k, glu=True, second=up) if up is not None
         else _ffn.experts(x, None, ids, k, gate))  # the joined gate/up: the fused kernel, without a norm
    y = qmm.experts(h, ids, glu.down_proj, 1)
    return y.reshape(*idx.shape, y.shape[-1])


def gate_up(glu) -> tuple:
    """A SwitchGLU's (gate, up) projections, or (gate_up, None) where they are joined (`models.moe.SwitchGLU`)."""
    return (glu.gate_up_proj, None) if "gate_up_proj" in glu else (glu.gate_proj, glu.up_proj)


def _pairs(idx: mx.array) -> mx.array:
    """The (token, expert) pairs of idx (..., k) as the experts' kernels take them: (tokens, k) int32 (no
    node where idx is that already)."""
    k = idx.shape[-1]
    return idx.reshape(idx.size // k, k).astype(mx.int32)  # (an explicit shape: -1 always makes a node)


def attention(q: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array],
              scale: float = 1.0, flat: bool = False) -> Optional[mx.array]:
    """softmax(q keys^T * scale, mask) values for decode and verify steps (with one query per row and
    `flat`: as (B, heads * D)), or None."""
    if dispatch.attention(q, keys, values, mask, scale):
        return None
    return sdpa.attention(q, keys, values, mask, (q.shape[0], q.size // q.shape[0]) if flat else None)


def attention_input(x: mx.array, norm_w: mx.array, qkv, q_norm: mx.array, k_norm: Optional[mx.array],
                    positions: mx.array, inverse: mx.array, n_heads: int, head_dim: int, kv: int,
                    eps: float) -> Optional[tuple]:
    """An attention layer's input in one kernel: (q, k, v) head-major, (B, heads, L, D), of x (B * L, H)
    through the input norm `norm_w`, the joined q/k/v layer `qkv` (kv=2: q, k, v rows; 1: q, k, v = k
    before its norm; 0: q only, k and v None), the head norms and RoPE at `positions` (B, L) with the
    (D/2,) inverse periods `inverse`. None: MLX's ops are the ones to run."""
    if dispatch.attention_input(x, norm_w, qkv, q_norm, k_norm, inverse, n_heads, head_dim, kv):
        return None
    return _attn_input.attention_input(x, norm_w, qkv, q_norm, k_norm, positions, inverse, n_heads, head_dim, kv,
                                       eps)


def mlp_input(x: mx.array, norm_w: Optional[mx.array], gate, up=None, eps: float = 1e-6) -> Optional[mx.array]:
    """gelu_tanh(gate(xn)) * up(xn), xn = rms(x) * norm_w (None: x), in one kernel; `gate` the joined
    gate/up layer (gate rows, then up rows) when `up` is None. None: MLX's ops."""
    K = x.shape[-1]
    rows = x.size // K
    if dispatch.mlp_input(rows, x.dtype, norm_w, gate, up):
        return None
    y = _ffn.dense(x.reshape(rows, K), norm_w, gate, up, eps)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def experts_input(glu, x: mx.array, norm_w: Optional[mx.array], idx: mx.array, eps: float = 1e-6) -> Optional[mx.array]:
    """A SwitchGLU's forward of rms(x) * norm_w (..., H) through experts `idx` (..., k) -> (..., k, H):
    the norm, gate/up and GLU in one kernel, then down. None: MLX's ops."""
    k = idx.shape[-1]
    tokens = idx.size // k
    if dispatch.experts_input(tokens, k, x.dtype, norm_w, glu):
        return None
    ids = _pairs(idx)
    h = _ffn.experts(x.reshape(tokens, x.shape[-1]), norm_w, ids, k, *gate_up(glu), eps)
    y = qmm.experts(h, ids, glu.down_proj, 1)
    return y.reshape(*idx.shape, y.shape[-1])


def router(x: mx.array, scale: mx.array, proj, per_expert: mx.array, top_k: int, eps: float) -> Optional[tuple]:
    """An MoE router in one kernel: (ids (M, top_k) int32, weights (M, top_k) float32) of x (M, H), the
    experts of rms(x) * scale / sqrt(H) through `proj` with the top_k scores, in order of score, weighted by
    a softmax over those times `per_expert` (E,). None: MLX's ops."""
    if dispatch.router(x, scale, proj, per_expert, top_k):
        return None
    return _routing.router(x, scale, proj, per_expert, top_k, eps)


def residual(x: mx.array, y: mx.array, w: mx.array, eps: float, scalar: Optional[mx.array] = None,
             second: Optional[tuple] = None, w_next: Optional[mx.array] = None, route: Optional[mx.array] = None):
    """(x + rms(y) * w) * scalar in one kernel (`second` = (w1, y2, w2): y is rms(y) * w1 + rms(y2) * w2;
    with `route` (M, k), y2 (M, k, H) is summed with those weights first), and with `w_next` also
    rms(h) * w_next: h or (h, hn). None: MLX's ops."""
    more = (*(second or ()), w_next)
    if dispatch.residual(x, y, w, scalar, *more, route=route):
        return None
    return _glue.residual(x, y, w, eps, scalar, second, w_next, route)


__all__ = ["attention_input", "experts_input", "mlp_input", "residual", "router", "attention", "dispatch", "gate_up", "glu_experts", "linear", "matmul", "mode", "prefill_experts", "qmm", "switch_glu",
           "using"]
