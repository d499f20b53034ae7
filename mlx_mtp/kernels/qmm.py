"""Quantized matmuls of 1-32 rows on NVIDIA GPUs (`qmm.cuh`): a dense layer's and the MoE experts'.

Each weight is read once for all rows and every row is computed as if alone (row-invariant), so a
K + 1-token verify costs about one decode step and equals, row for row, the steps it stands for.
`dense` and `experts` launch them; `reference_dense` and `reference_experts` are what they compute,
in MLX ops (weights dequantised to the activations' type, products summed in fp32), to test against.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .source import Kernel

MAX_ROWS = 64  # rows (tokens) the kernels take, MT <= 8 tiles of 8: a verify of 8 rows x (K_MAX + 1)
MAX_PAIRS = 512  # (token, expert) pairs of one expert call (qmm.cuh MTP_QMM_MAX_PAIRS)
BITS = (4, 8)
GROUPS = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16)
MAX_WARPS = 8  # 256 threads: a block fits an SM's registers at any tile count (up to 255 per thread)
WARPS_WANTED = 2048  # warps in flight that hide the weight stream's latency on an H100/H200
DEPTH = 2  # chunks of K each warp has in flight ahead of its products (any depth gives the same sums)

_DENSE = Kernel("mtp_qmm_dense", "qmm.cuh", ["x", "w", "scales", "biases"], ["y"],
                "mtp_qmm_dense<T, BITS, GROUP, MT, NW, DEPTH>(x, w, scales, biases, y, x_shape[0], w_shape[0], "
                "x_shape[1]);")
_EXPERTS = Kernel("mtp_qmm_experts", "qmm.cuh",
                  ["x", "ids", "w", "scales", "biases", "w2", "scales2", "biases2"], ["y"],
                  "mtp_qmm_experts<T, BITS, GROUP, MT, NW, DEPTH, XDIV, GLU>(x, ids, w, scales, biases, w2, scales2, "
                  "biases2, y, ids_shape[0] * (ids_ndim > 1 ? ids_shape[1] : 1), w_shape[1], x_shape[x_ndim - 1]);")


def warps(n: int, k: int, bits: int) -> int:
    """Warps per block (they split K) for an (N, K) weight: enough blocks x warps to keep the weight
    stream in flight, at least two chunks of K per warp. A function of the weight's shape only, never
    of the rows: the order in which a row's partial sums are added must not change with them."""
    tiles, chunks = n // 16, -(-k * bits // 512)
    nw = 1
    while nw < MAX_WARPS and tiles * nw < WARPS_WANTED and chunks >= 4 * nw:
        nw *= 2
    return nw


def supports(x_dtype: mx.Dtype, w: mx.array, scales: mx.array, biases, group_size: int, bits: int,
             mode: str) -> str:
    """Why these kernels cannot take a quantized weight ('' when they can)."""
    if mode != "affine" or biases is None:
        return f"{mode} quantization"
    if bits not in BITS or group_size not in GROUPS:
        return f"{bits}-bit, group {group_size}"
    if x_dtype not in DTYPES or scales.dtype != x_dtype:
        return f"{name(x_dtype)} activations with {name(scales.dtype)} scales"
    if w.shape[-2] % 16:
        return f"{w.shape[-2]} output features (not a multiple of 16)"
    return ""


def supports_layer(x_dtype: mx.Dtype, layer) -> str:
    """`supports` for a quantized layer (`QuantizedLinear`, `QuantizedSwitchLinear`): its arrays and settings."""
    return supports(x_dtype, layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits,
                    layer.mode)


def dense(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
          depth: int = DEPTH, nw: Optional[int] = None) -> mx.array:
    """x (M, K) @ W.T for M <= MAX_ROWS rows: (M, N) in x's dtype. `depth`, `nw`: the launch shape
    (default: this module's choice; `nw` changes the sums' order, for benchmarks only)."""
    M, K = x.shape
    N = w.shape[0]
    nw = nw or warps(N, K, bits)
    template = [("T", x.dtype), ("BITS", bits), ("GROUP", group_size), ("MT", -(-M // 8)), ("NW", nw),
                ("DEPTH", depth)]
    return _DENSE([x, w, scales, biases], template, grid=(N // 16 * 32 * nw, 1, 1), threadgroup=(32 * nw, 1, 1),
                  output_shapes=[(M, N)], output_dtypes=[x.dtype])[0]


def experts(x: mx.array, ids: mx.array, layer, top_k: int, glu: bool = False, second=None) -> mx.array:
    """Pair p of `ids` (P,) through its expert of a QuantizedSwitchLinear `layer` (E, N, K): (P, N); ids
    (tokens, k), pairs in row order, give (tokens, k, N). x holds a row per token (row p // top_k;
    top_k=1: a row per pair). `glu`: gelu_tanh(x @ layer) * (x @ second), `second` the up projection
    beside `layer`, the gate."""
    P, K = ids.size, x.shape[-1]
    E, N = layer["weight"].shape[:2]
    tokens = -(-P // top_k)
    nw = warps(N, K, layer.bits)
    up = second if glu else layer
    tiles = -(-min(tokens, MAX_ROWS) // 8)  # an expert's rows: at most one per token
    template = [("T", x.dtype), ("BITS", layer.bits), ("GROUP", layer.group_size), ("MT", tiles), ("NW", nw),
                ("DEPTH", DEPTH), ("XDIV", top_k), ("GLU", glu)]
    inputs = [x, ids, layer["weight"], layer["scales"], layer["biases"], up["weight"], up["scales"], up["biases"]]
    return _EXPERTS(inputs, template, grid=(N // 16 * 32 * nw, min(P, E), 1), threadgroup=(32 * nw, 1, 1),
                    output_shapes=[(*ids.shape, N)], output_dtypes=[x.dtype])[0]


def name(dtype: mx.Dtype) -> str:
    return str(dtype).rpartition(".")[2]


# ---- what they compute ----------------------------------------------------------------------------


def weights(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """The weights as the kernels see them: q * scale + bias in the scales' type, as fp32."""
    dense_w = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    return dense_w.astype(scales.dtype).astype(mx.float32)


def reference_dense(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                    bits: int) -> mx.array:
    """fp32 x @ W.T with W as the kernels dequantise it, rounded to x's dtype."""
    y = x.astype(mx.float32) @ weights(w, scales, biases, group_size, bits).T
    return y.astype(x.dtype)


def reference_experts(x: mx.array, ids: mx.array, layer, top_k: int, glu: bool = False, second=None) -> mx.array:
    """`experts` in MLX ops, pair by pair."""
    rows = []
    for p, e in enumerate(ids.tolist()):
        xp = x[p // top_k][None]
        out = reference_dense(xp, layer["weight"][e], layer["scales"][e], layer["biases"][e], layer.group_size,
                              layer.bits)
        if glu:
            up = reference_dense(xp, second["weight"][e], second["scales"][e], second["biases"][e],
                                 second.group_size, second.bits)
            gate = out.astype(mx.float32)
            out = (gelu_tanh(gate) * up.astype(mx.float32)).astype(x.dtype)
        rows.append(out)
    return mx.concatenate(rows)


def gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))
