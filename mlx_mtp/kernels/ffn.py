"""A feed-forward block's input on NVIDIA GPUs in one kernel (`ffn.cuh`, issue 42): the
pre-feed-forward RMSNorm, gate and up in one pass over their weights, gelu_tanh(gate) * up: for the
dense MLP (`dense`) and the MoE experts (`experts`, each used expert read once for all its rows).
Gate and up are one joined weight (`mlp.gate_up_proj`: gate rows, then up rows) or two layers. For
decode and verify steps, every row computed as if alone. `reference_*`: what they compute, in fp32.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import qmm
from .attn_input import constant, rms
from .source import Kernel

MAX_TILES = 4  # tiles of 8 rows a pass: a gate's and an up's sums for more would not fit the registers

_DENSE = Kernel("mtp_mlp_input", ("qmm.cuh", "proj.cuh", "ffn.cuh"),
                ["x", "norm_w", "w", "scales", "biases", "w2", "scales2", "biases2", "eps"], ["y"],
                "mtp_mlp_input<T, BITS, GROUP, MT, NW, DEPTH, NORM, JOINED>(x, norm_w, w, scales, biases, w2, "
                "scales2, biases2, y, x_shape[0], JOINED ? w_shape[0] / 2 : w_shape[0], x_shape[1], eps[0]);")
_EXPERTS = Kernel("mtp_experts_input", ("qmm.cuh", "proj.cuh", "ffn.cuh"),
                  ["x", "norm_w", "ids", "w", "scales", "biases", "w2", "scales2", "biases2", "eps"], ["y"],
                  "mtp_experts_input<T, BITS, GROUP, MT, NW, DEPTH, TOP_K, NORM, JOINED>(x, norm_w, ids, w, scales, "
                  "biases, w2, scales2, biases2, y, ids_shape[0] * (ids_ndim > 1 ? ids_shape[1] : 1), w_shape[1], "
                  "x_shape[1], eps[0]);")


def supports(rows: int, x_dtype: mx.Dtype, norm_w: Optional[mx.array], gate, up=None) -> str:
    """Why the kernels cannot take this gate/up ('' when they can); `gate` the joined layer if `up` is None."""
    reason = "" if 0 < rows <= qmm.MAX_ROWS else f"{rows} rows"
    layers = [gate] if up is None else [gate, up]
    if not reason and any("scales" not in p or "bias" in p for p in layers):
        reason = "unquantized or biased projections"
    if not reason and len({(p.bits, p.group_size, p.mode, p["weight"].shape) for p in layers}) > 1:
        reason = "gate and up quantized differently"
    for p in layers:
        reason = reason or qmm.supports_layer(x_dtype, p)
    n = gate["weight"].shape[-2]
    if not reason and up is None and n % 32:
        reason = f"{n} joined output features (not two multiples of 16)"
    if not reason and norm_w is not None and norm_w.dtype != x_dtype:
        reason = "a norm weight not in the activations' dtype"
    return reason


def _shape(gate, up, x: mx.array):
    n = gate["weight"].shape[-2]
    inter = n if up is not None else n // 2
    other = gate if up is None else up
    template = [("T", x.dtype), ("BITS", gate.bits), ("GROUP", gate.group_size)]
    inputs = [gate["weight"], gate["scales"], gate["biases"], other["weight"], other["scales"], other["biases"]]
    return n, inter, template, inputs


def dense(x: mx.array, norm_w: Optional[mx.array], gate, up=None, eps: float = 1e-6) -> mx.array:
    """gelu_tanh(gate(xn)) * up(xn) of x (M, K), xn = rms(x) * norm_w (None: x as given): (M, I)."""
    M, K = x.shape
    n, inter, template, weights = _shape(gate, up, x)
    nw = qmm.warps(inter, K, gate.bits)
    template += [("MT", min(-(-M // 8), MAX_TILES)), ("NW", nw), ("DEPTH", qmm.DEPTH), ("NORM", norm_w is not None),
                 ("JOINED", up is None)]
    inputs = [x, x if norm_w is None else norm_w, *weights, constant(eps)]
    return _DENSE(inputs, template, grid=(inter // 16 * 32 * nw, 1, 1), threadgroup=(32 * nw, 1, 1),
                  output_shapes=[(M, inter)], output_dtypes=[x.dtype])[0]


def experts(x: mx.array, norm_w: Optional[mx.array], ids: mx.array, top_k: int, gate, up=None,
            eps: float = 1e-6) -> mx.array:
    """Pair p of `ids` (P,), or (tokens, top_k) in row order: token row p // top_k of x (tokens, K), normed
    (norm_w None: as given), through its expert's gate and up (QuantizedSwitchLinear layers (E, I, K);
    `gate` the joined (E, 2I, K) one if `up` is None), gelu_tanh(gate) * up: (P, I)."""
    P, K = ids.size, x.shape[-1]
    E = gate["weight"].shape[0]
    n, inter, template, weights = _shape(gate, up, x)
    nw = qmm.warps(inter, K, gate.bits)
    tiles = min(-(-min(-(-P // top_k), qmm.MAX_ROWS) // 8), MAX_TILES)  # an expert's rows: one per token at most
    template += [("MT", tiles), ("NW", nw), ("DEPTH", qmm.DEPTH), ("TOP_K", top_k), ("NORM", norm_w is not None),
                 ("JOINED", up is None)]
    inputs = [x, x if norm_w is None else norm_w, ids.astype(mx.int32), *weights, constant(eps)]
    return _EXPERTS(inputs, template, grid=(inter // 16 * 32 * nw, min(P, E), 1), threadgroup=(32 * nw, 1, 1),
                    output_shapes=[(P, inter)], output_dtypes=[x.dtype])[0]


# ---- what they compute ----------------------------------------------------------------------------------


def _glu(xn: mx.array, w_gate: mx.array, w_up: mx.array, dtype: mx.Dtype) -> mx.array:
    gate, up = (xn @ w_gate.T).astype(dtype).astype(mx.float32), (xn @ w_up.T).astype(dtype).astype(mx.float32)
    return (qmm.gelu_tanh(gate) * up).astype(dtype)


def _weights(gate, up, e=None):
    pick = (lambda a: a) if e is None else (lambda a: a[e])
    layers = [gate] if up is None else [gate, up]
    ws = [qmm.weights(pick(p["weight"]), pick(p["scales"]), pick(p["biases"]), p.group_size, p.bits) for p in layers]
    if up is None:
        half = ws[0].shape[0] // 2
        return ws[0][:half], ws[0][half:]
    return ws[0], ws[1]


def reference_dense(x: mx.array, norm_w: Optional[mx.array], gate, up=None, eps: float = 1e-6) -> mx.array:
    xn = x.astype(mx.float32) if norm_w is None else rms(x.astype(mx.float32), norm_w, eps)
    return _glu(xn, *_weights(gate, up), x.dtype)


def reference_experts(x: mx.array, norm_w: Optional[mx.array], ids: mx.array, top_k: int, gate, up=None,
                      eps: float = 1e-6) -> mx.array:
    xn = x.astype(mx.float32) if norm_w is None else rms(x.astype(mx.float32), norm_w, eps)
    return mx.concatenate([_glu(xn[p // top_k][None], *_weights(gate, up, e), x.dtype)
                           for p, e in enumerate(ids.tolist())])
