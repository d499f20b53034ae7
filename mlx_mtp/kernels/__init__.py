"""mlx_mtp's own GPU kernels, where MLX's miss what speculative decoding needs: on NVIDIA GPUs (MLX's
CUDA backend) the products of decode and verify steps, each weight read once for all rows and every
row computed as if alone, so a verify costs about one decode step and equals the steps it stands for.

One module per kernel family, the CUDA source beside it (`qmm`: quantized matmuls and MoE experts,
`sdpa`: attention); `dispatch` decides which product takes which kernel and says why. The entry points
below return None where MLX's kernel is the one to run; models call them on the GPU path only.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import sdpa
from . import dispatch, qmm
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
    ids = idx.reshape(-1).astype(mx.int32)
    h = qmm.experts(x.reshape(tokens, x.shape[-1]), ids, glu.gate_proj, k, glu=True, second=glu.up_proj)
    y = qmm.experts(h, ids, glu.down_proj, 1)
    return y.reshape(*idx.shape, y.shape[-1])


def attention(q: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array],
              scale: float = 1.0) -> Optional[mx.array]:
    """softmax(q keys^T * scale, mask) values for decode and verify steps, or None."""
    if dispatch.attention(q, keys, values, mask, scale):
        return None
    return sdpa.attention(q, keys, values, mask)


__all__ = ["attention", "dispatch", "glu_experts", "linear", "matmul", "mode", "prefill_experts", "qmm", "switch_glu",
           "using"]
