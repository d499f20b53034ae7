"""A residual block's glue on NVIDIA GPUs in one kernel (`glue.cuh`, issue 42):

    h = (x + rms(y) * w) * scalar        y = rms(y1) * w1 + rms(y2) * w2 for an MoE layer's two outputs
                                         (y2: the row's k expert outputs' sum weighted by `route`, if given)
    hn = rms(h) * w_next                 optional: the next product's input, where it has no norm prologue

each step rounded to the activations' dtype as MLX's separate ops round it, one block per row (every
row its own). `reference` computes it in fp32.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .attn_input import constant, rms
from .qmm import DTYPES
from .source import Kernel

THREADS = 256  # glue.cuh MTP_RESIDUAL_THREADS
MAX_HIDDEN = 6016  # two rows of fp32 in a block's 48 KB of static shared memory

MAX_TOP_K = 32

_KERNEL = Kernel("mtp_residual", "glue.cuh",
                 ["x", "y1", "w1", "y2", "route", "w2", "w", "scalar", "w_next", "eps"], ["h", "hn"],
                 "mtp_residual<T, S, H, TWO, TOP_K, SCALAR, NEXT>(x, y1, w1, y2, route, w2, w, scalar, w_next, h, hn, "
                 "eps[0]);")


def supports(x: mx.array, y: mx.array, w: mx.array, scalar: Optional[mx.array] = None, *more,
             route: Optional[mx.array] = None) -> str:
    """Why the kernel cannot take this glue ('' when it can); `more`: the other weights and outputs;
    `route`: the experts' weights (M, k) where the second output is their k outputs (M, k, H)."""
    H = x.shape[-1]
    if x.dtype not in DTYPES or H > MAX_HIDDEN:
        return f"{H} {x.dtype} features"
    if route is not None and (route.dtype != mx.float32 or route.ndim != 2 or not 0 < route.shape[1] <= MAX_TOP_K
                              or route.shape[0] != x.size // H):
        return f"experts' weights of shape {route.shape} and dtype {route.dtype}"
    if any(a is not None and (a.dtype != x.dtype or a.shape[-1] != H) for a in (y, w, *more)):
        return "operands of other dtypes or sizes"
    if scalar is not None and (scalar.size != 1 or scalar.dtype not in (x.dtype, mx.float32)):
        return f"a layer scalar of {scalar.size} {scalar.dtype}"
    if scalar is not None and scalar.dtype == mx.float32:
        return "a float32 layer scalar (MLX's product would be float32)"
    return ""


def residual(x: mx.array, y: mx.array, w: mx.array, eps: float, scalar: Optional[mx.array] = None,
             second: Optional[tuple] = None, w_next: Optional[mx.array] = None, route: Optional[mx.array] = None):
    """h (and hn when `w_next` is given) of x, y (M, H); `second` = (w1, y2, w2): y is then
    rms(y) * w1 + rms(y2) * w2 (an MoE layer's dense and expert outputs); with `route` (M, k) float32,
    y2 is the k experts' outputs (M, k, H), summed with those weights first."""
    H = x.shape[-1]
    M = x.size // H
    w1, y2, w2 = second if second is not None else (w, y, w)
    top_k = 0 if route is None else route.shape[-1]
    template = [("T", x.dtype), ("S", x.dtype if scalar is None else scalar.dtype), ("H", H),
                ("TWO", second is not None), ("TOP_K", top_k), ("SCALAR", scalar is not None),
                ("NEXT", w_next is not None)]
    inputs = [x, y, w1, y2, constant(eps) if route is None else route, w2, w, w if scalar is None else scalar,
              w if w_next is None else w_next, constant(eps)]
    shapes = [x.shape, x.shape if w_next is not None else (1,)]
    h, hn = _KERNEL(inputs, template, grid=(M * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=shapes,
                    output_dtypes=[x.dtype, x.dtype])
    return (h, hn) if w_next is not None else h


def reference(x: mx.array, y: mx.array, w: mx.array, eps: float, scalar: Optional[mx.array] = None,
              second: Optional[tuple] = None, w_next: Optional[mx.array] = None, route: Optional[mx.array] = None):
    """`residual` in fp32 MLX ops."""
    f32 = mx.float32
    if second is not None:
        w1, y2, w2 = second
        if route is not None:
            y2 = (y2.astype(f32) * route[..., None]).sum(axis=-2)
        y = rms(y.astype(f32), w1, eps) + rms(y2.astype(f32), w2, eps)
    h = x.astype(f32) + rms(y.astype(f32), w, eps)
    if scalar is not None:
        h = h * scalar.astype(f32)
    if w_next is None:
        return h.astype(x.dtype)
    return h.astype(x.dtype), rms(h, w_next, eps).astype(x.dtype)
