"""An MoE layer's router on NVIDIA GPUs in one kernel (`routing.cuh`, issue 42): the router's RMSNorm
(its `scale` as the weight) and 1/sqrt(H), the experts' scores as one quantized product (rounded to the
activations' dtype, as the product's output), the top k of them, a softmax over those and each chosen
expert's scale. For decode and verify steps (1-64 rows), every row computed as if alone; the experts
come in order of score (ties: the lower expert first). `reference` is what it computes, in fp32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import qmm
from .attn_input import constant, rms
from .source import Kernel

MAX_EXPERTS = 1024  # a lane's chosen experts are bits of one word: 32 per lane
MAX_TOP_K = 32

_KERNEL = Kernel("mtp_router", ("qmm.cuh", "proj.cuh", "routing.cuh"),
                 ["x", "scale", "w", "scales", "biases", "per_expert", "eps"], ["ids", "weights", "part", "done"],
                 "mtp_router<T, BITS, GROUP, MT, NW, DEPTH, E, TOP_K>(x, scale, w, scales, biases, per_expert, ids, "
                 "weights, part, done, x_shape[0], x_shape[1], eps[0]);")


def supports(x: mx.array, scale: mx.array, proj, per_expert: mx.array, top_k: int) -> str:
    """Why the kernel cannot take this router ('' when it can)."""
    rows = x.size // x.shape[-1]
    reason = "" if 0 < rows <= qmm.MAX_ROWS else f"{rows} rows"
    if not reason and ("scales" not in proj or "bias" in proj):
        reason = "an unquantized or biased router"
    reason = reason or qmm.supports_layer(x.dtype, proj)
    if reason:
        return reason
    E = proj["weight"].shape[0]
    if E > MAX_EXPERTS or not 0 < top_k <= min(E, MAX_TOP_K):
        return f"top {top_k} of {E} experts"
    if scale.dtype != x.dtype or scale.shape != (x.shape[-1],) or per_expert.dtype != x.dtype:
        return "router scales not in the activations' dtype"
    return ""


def router(x: mx.array, scale: mx.array, proj, per_expert: mx.array, top_k: int, eps: float) -> tuple:
    """(ids (M, top_k) int32, weights (M, top_k) float32) of x (M, H): each row's top_k experts in order
    of score and their weights (softmax over the chosen scores, times the expert's scale)."""
    M, K = x.size // x.shape[-1], x.shape[-1]
    w = proj["weight"]
    E = w.shape[0]
    nw = qmm.warps(E, K, proj.bits)
    template = [("T", x.dtype), ("BITS", proj.bits), ("GROUP", proj.group_size), ("MT", -(-M // 8)), ("NW", nw),
                ("DEPTH", qmm.DEPTH), ("E", E), ("TOP_K", top_k)]
    inputs = [x.reshape(M, K), scale, w, proj["scales"], proj["biases"], per_expert, constant(eps)]
    ids, weights, _, _ = _KERNEL(inputs, template, grid=(E // 16 * 32 * nw, 1, 1), threadgroup=(32 * nw, 1, 1),
                                 output_shapes=[(M, top_k), (M, top_k), (M, E), (1,)],
                                 output_dtypes=[mx.int32, mx.float32, mx.float32, mx.int32], init_value=0)
    return ids, weights


# ---- what it computes -----------------------------------------------------------------------------------


def scores(x: mx.array, scale: mx.array, proj, eps: float) -> mx.array:
    """The experts' scores (M, E) in fp32, rounded to x's dtype as the product's output."""
    w = qmm.weights(proj["weight"], proj["scales"], proj["biases"], proj.group_size, proj.bits)
    z = rms(x.astype(mx.float32), scale, eps) * x.shape[-1] ** -0.5
    return (z @ w.T).astype(x.dtype).astype(mx.float32)


def reference(x: mx.array, scale: mx.array, proj, per_expert: mx.array, top_k: int, eps: float) -> tuple:
    """`router` in fp32 MLX ops (the order of the experts: by score, ties the lower expert first)."""
    s = scores(x, scale, proj, eps)
    ids = mx.array(np.argsort(-np.array(s), axis=-1, kind="stable")[:, :top_k].astype(np.int32))
    top = mx.take_along_axis(s, ids, axis=-1)
    return ids, mx.softmax(top, axis=-1, precise=True) * per_expert.astype(mx.float32)[ids]
