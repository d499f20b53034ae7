"""Quantized compute that is fast on the backend it runs on.

A GPU (`fused_kernels()`) keeps MLX's own paths. MLX's CPU backend differs in three measured ways
(apps/README.md, "realsize"): its quantized matmul is ~10x slower with bf16 activations than with
fp32 ones (~50x with fp16), its cost grows with every row (no row shares a weight read), and
`gather_qmm` grows with the square of the rows. So on the CPU:

- quantized layers compute with fp32 activations and return their input's dtype;
- MoE experts group the rows by expert and run one matmul per used expert;
- in a prompt chunk (more than `ROW_EXACT_TOKENS` tokens per row), a weight that many rows use
  is dequantised once (fp32) and multiplied through the BLAS, where the BLAS shares the weight
  read among rows (MKL, Accelerate): from `dequantize_rows()` rows;
- the quantized kernel runs on one thread per stream, so the work is spread over one CPU stream per
  core (`cpu_streams()`; MLX runs each stream on a thread of its own): a large weight's output
  features are split between them, MoE experts dealt out to them. Every output is still computed
  by the same kernel from the same inputs, so results do not depend on how many streams there are.

A decode step or a verify (at most `ROW_EXACT_TOKENS` tokens per row) never shares a weight: a
BLAS such as MKL rounds a row differently with the number of rows in the product, so a verify
whose rows shared a weight would differ in the last bits from the decode steps it stands for,
and bf16 activations and near-tied logits turn that into different tokens (greedy MTP != plain
at B=4 on 26B-A4B). The per-row kernel computes each row alone, however many share it.

A ragged forward (the prompts of several sequences side by side, `cache.Ragged`) makes each of
these choices per sequence, as that sequence's forward alone would: the per-row kernel takes every
sequence's rows in one product; where a sequence would share a weight, and in every unquantized
product (`Linear`, `Embedding`: a BLAS such as MKL rounds by the number of rows), its rows are
multiplied apart from the others' (`ragged_sizes`).

Both branches give the same results to fp32 rounding; `force_fused` and `dequantizing_from`
force each choice so tests run all of them on one machine.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU, _gather_sort, _scatter_unsort

from .. import kernels
from .base import cpu_stream_count, fused_kernels

CHUNK_BYTES = 64 << 20  # largest dequantised fp32 block: the tied 262144-row head is 2.9 GB whole
# Forwards of at most this many tokens per row compute each row alone (decode steps and verifies:
# speculative.K_MAX + 1 <= ROW_EXACT_TOKENS, a test holds it).
ROW_EXACT_TOKENS = 8

# A product over fewer weights stays on one stream: handing work to another thread costs ~0.1 ms.
SPLIT_WEIGHTS = 1 << 20

_forced_rows: Optional[float] = None  # set by `dequantizing_from` (process-wide: tests and probes)
# Per thread (generators on two threads, e.g. two Engines, run forwards at once): `tokens`, per row
# of the running forward, for layers that see (B * L, D) rows; `streams`, the thread's extra streams.
_forward = threading.local()
# Every stream made, for the life of the process: a compiled trace that used a stream must not
# outlive it (MLX aborts at exit if a thread's streams went with the thread before its traces).
_made: list = []


@contextmanager
def forward_tokens(n: int, sizes: Optional[Sequence[int]] = None) -> Iterator[None]:
    """A target forward of `n` tokens per row runs inside: its layers see the rows flattened. A
    ragged forward (`sizes`: the tokens of each of its sequences, side by side) computes each
    sequence's products as that sequence's forward alone would (`ragged_sizes`)."""
    before = getattr(_forward, "tokens", 1), getattr(_forward, "sizes", None)
    _forward.tokens, _forward.sizes = n, None if sizes is None else tuple(sizes)
    try:
        yield
    finally:
        _forward.tokens, _forward.sizes = before


def ragged_sizes(rows: int) -> Optional[tuple]:
    """Each sequence's rows among `rows` rows of the running ragged forward (None: not ragged).
    Its products see all its tokens, or, past the point where only the wanted sequences' last
    positions go on (`cache.Ragged.last`), one token per sequence: the count tells which."""
    sizes = getattr(_forward, "sizes", None)
    if sizes is None:
        return None
    return sizes if rows == sum(sizes) else (1,) * rows


def _alone(sizes: Sequence[int]) -> bool:
    """Whether no sequence of a ragged forward would share a weight among its rows alone: then
    one product on the per-row kernel serves them all, each row exactly as alone."""
    return not any(_shares_weight(n, n) for n in sizes)


def _by_sequence(fn, sizes: Sequence[int], *arrays: mx.array) -> mx.array:
    """`fn(*parts, n)` for each sequence's rows of `arrays` (n of them), concatenated: a product
    whose rounding depends on its number of rows (the BLAS after dequantising) sees each
    sequence's rows as its forward alone would."""
    ends = np.cumsum(sizes).tolist()
    return mx.concatenate([fn(*(a[e - n : e] for a in arrays), n) for e, n in zip(ends, sizes)])


def _streams_for(weights: int) -> list:
    """The streams to spread work over `weights` weights: this thread's CPU streams, or only its
    default one for work too small to pay for the hand-over (no extra stream is made for it)."""
    return cpu_streams() if weights >= SPLIT_WEIGHTS else [mx.default_stream(mx.cpu)]


def cpu_streams() -> list:
    """This thread's CPU streams for quantized work, `cpu_stream_count()` of them: its default one
    and more (MLX streams belong to the thread that made them, so each thread makes its own, once)."""
    count = cpu_stream_count()
    extra = getattr(_forward, "streams", [])
    while len(extra) < count - 1:
        _made.append(mx.new_stream(mx.cpu))
        extra = _forward.streams = [*extra, _made[-1]]
    return [mx.default_stream(mx.cpu), *extra[: count - 1]]


def dequantize_rows() -> float:
    """Rows from which a CPU quantized matmul dequantises its weight once and shares it among the
    rows (inf: never). Measured once per process unless forced."""
    return _measured_rows() if _forced_rows is None else _forced_rows


@contextmanager
def dequantizing_from(rows: float) -> Iterator[None]:
    """Force `dequantize_rows()` (1: always dequantise, inf: never)."""
    global _forced_rows
    before, _forced_rows = _forced_rows, rows
    try:
        yield
    finally:
        _forced_rows = before


def _shares_weight(rows: int, tokens_per_row: int) -> bool:
    if tokens_per_row <= ROW_EXACT_TOKENS:
        return False
    if _forced_rows is not None:
        return rows >= _forced_rows
    return rows > 1 and rows >= _measured_rows()  # one row never pays for a dequantisation: no probe


@lru_cache(maxsize=None)
def _measured_rows(rows: int = 4, repeats: int = 3) -> float:
    """Per row, MLX's CPU quantized matmul costs q and an fp32 matmul g; dequantising costs d
    once. Sharing pays from d / (q - g) rows if the BLAS is clearly cheaper per row than the
    quantized kernel (the reference BLAS of Linux `mlx[cpu]` wheels is not). A weight as large
    as a real layer's (32 MiB in fp32: dequantising a cache-resident one is several times
    cheaper per weight); the fastest of interleaved repeats, so a busy machine slows every
    candidate alike."""
    key = mx.random.key(0)
    w = mx.random.randint(0, 1 << 30, (4096, 256), key=key).astype(mx.uint32)  # 4-bit codes, packed
    scales, biases = mx.random.uniform(shape=(2, 4096, 32), key=key)
    x = mx.random.normal((rows, 2048), key=key)
    dense = mx.dequantize(w, scales, biases, 64, 4)
    mx.eval(w, scales, biases, x, dense)

    def fastest(*fns) -> list:
        best = [math.inf] * len(fns)
        for _ in range(repeats):
            for i, fn in enumerate(fns):
                start = time.perf_counter()
                mx.eval(fn())
                best[i] = min(best[i], time.perf_counter() - start)
        return best

    q, g = fastest(lambda: mx.quantized_matmul(x[:1], w, scales, biases, True, 64, 4), lambda: x @ dense.T)
    g /= rows
    if g >= 0.8 * q:
        return math.inf
    d = fastest(lambda: mx.dequantize(w, scales, biases, 64, 4))[0]
    return max(2, math.ceil(d / (q - g)))


def _tokens_per_row(x: mx.array) -> int:
    return x.shape[-2] if x.ndim > 2 else getattr(_forward, "tokens", 1)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int,
                     bits: int, mode: str, tokens_per_row: Optional[int] = None, split: bool = True) -> mx.array:
    """x @ W.T for a quantized W on the CPU backend, in fp32 (returns fp32). x is (..., L, D), L
    tokens per row, or (N, D) rows of the running `forward_tokens` (of each sequence, in a ragged
    one); `tokens_per_row` overrides L.
    `split`: spread the output features over this thread's CPU streams (callers that spread
    whole products themselves, such as the experts, say no)."""
    x = x.astype(mx.float32)
    sizes = ragged_sizes(x.shape[0]) if tokens_per_row is None and x.ndim == 2 else None
    if sizes is not None and not _alone(sizes):
        def each(part: mx.array, n: int) -> mx.array:
            return quantized_matmul(part, w, scales, biases, group_size, bits, mode, n, split)

        return _by_sequence(each, sizes, x)
    streams = _streams_for(w.shape[0] * x.shape[-1] if split else 0)
    rows = x.size // x.shape[-1]
    if sizes is not None or not _shares_weight(rows, tokens_per_row or _tokens_per_row(x)):
        step = -(-w.shape[0] // len(streams))

        def product(part: slice) -> mx.array:
            return mx.quantized_matmul(x, w[part], scales[part], None if biases is None else biases[part], True,
                                       group_size, bits, mode=mode)

        return _spread(product, w.shape[0], step, streams, evaluate=False)
    if mx.issubdtype(scales.dtype, mx.floating):  # fp32 scales: fp32 weights out of dequantize
        scales = scales.astype(mx.float32)
        biases = None if biases is None else biases.astype(mx.float32)

    def product(part: slice) -> mx.array:
        dense = mx.dequantize(w[part], scales[part], None if biases is None else biases[part], group_size, bits,
                              mode=mode)
        return x @ dense.astype(mx.float32).T

    step = max(1, min(CHUNK_BYTES // (4 * x.shape[-1]), -(-w.shape[0] // len(streams))))  # features per block
    return _spread(product, w.shape[0], step, streams, evaluate=split)


def _spread(product, features: int, step: int, streams: list, evaluate: bool) -> mx.array:
    """`product(part)` for every block of `step` output features, block i on stream i mod n,
    concatenated. `evaluate`: each round of n blocks is evaluated before the next is built, so
    that MLX does not schedule the dequantisations ahead of the products and hold most of them at
    once (a layer's experts, the tied head: GBs at real size)."""
    outs = []
    for i, start in enumerate(range(0, features, step)):
        with mx.stream(streams[i % len(streams)]):
            outs.append(product(slice(start, start + step)))
        if evaluate and len(outs) % len(streams) == 0:
            mx.eval(outs[-len(streams):])
    if evaluate:
        mx.eval(outs)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


def _layer_matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """A quantized layer's product on the CPU backend, fp32."""
    return quantized_matmul(x, layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits,
                            layer.mode)


class Linear(nn.Linear):
    """nn.Linear whose product, in a ragged forward, takes each sequence's rows apart: a BLAS may
    round a row differently with the number of rows in the product (MKL does, at any size). In a
    compiled forward it reads its weight's transpose handed in (`base.compiled`): no Transpose node."""

    reads_transpose = True

    def __call__(self, x: mx.array) -> mx.array:
        return _per_sequence(self._product, x)

    def _product(self, x: mx.array) -> mx.array:
        w = _transposed(self)
        return x @ w if "bias" not in self else mx.addmm(self["bias"], x, w)


class Embedding(nn.Embedding):
    """nn.Embedding whose `as_linear` (a tied head) takes each sequence's rows apart, as `Linear`, and
    reads its weight's transpose as `Linear` does."""

    reads_transpose = True

    def as_linear(self, x: mx.array) -> mx.array:
        return _per_sequence(lambda rows: rows @ _transposed(self), x)


def _transposed(layer: nn.Module) -> mx.array:
    """W^T of a layer: the view a compiled forward hands in, else a Transpose of its own."""
    view = layer.__dict__.get("weight_t")
    return layer["weight"].T if view is None else view


def _per_sequence(product, x: mx.array) -> mx.array:
    """`product(x)`, taken a sequence's rows at a time when `x` holds a ragged forward's rows."""
    sizes = ragged_sizes(x.shape[0]) if x.ndim == 2 else None
    if sizes is None or len(sizes) == 1:
        return product(x)
    return _by_sequence(lambda part, n: product(part), sizes, x)


class QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if fused_kernels():
            y = kernels.linear(self, x)  # None: MLX's kernel
            return super().__call__(x) if y is None else y
        y = _layer_matmul(self, x)
        if "bias" in self:
            y = y + self["bias"]
        return y.astype(x.dtype)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        if fused_kernels():
            y = kernels.matmul(self, x)
            return super().as_linear(x) if y is None else y
        return _layer_matmul(self, x).astype(x.dtype)


_BACKEND_AWARE = {nn.QuantizedLinear: QuantizedLinear, nn.QuantizedEmbedding: QuantizedEmbedding}


def adopt(model: nn.Module) -> nn.Module:
    """Give the quantized layers `nn.quantize` made in `model` the backend-aware forward above:
    the same layout and parameters, only `__call__` / `as_linear` differ."""
    for _, module in model.named_modules():
        cls = _BACKEND_AWARE.get(type(module))
        if cls is not None:
            module.__class__ = cls
    return model


def switch_glu(glu: SwitchGLU, x: mx.array, idx: mx.array) -> mx.array:
    """(..., H) tokens through their experts `idx` (..., k) -> (..., k, H), in x's dtype."""
    w = glu.down_proj.weight
    floating = mx.issubdtype(w.dtype, mx.floating)
    if fused_kernels():
        if floating:  # float32 where loading widened it for the backend
            return gathered_glu(glu, x.astype(w.dtype), idx).astype(x.dtype)
        y = kernels.switch_glu(glu, x, idx)
        if y is None and kernels.prefill_experts(glu, idx):  # a prompt chunk on CUDA: grouped by expert
            return grouped_glu(glu, x, idx, x.dtype, gpu=True)
        return gathered_glu(glu, x, idx) if y is None else y
    dtype = w.dtype if floating else mx.float32
    sizes = ragged_sizes(idx.size // idx.shape[-1])
    if sizes is None:
        return grouped_glu(glu, x, idx, dtype).astype(x.dtype)
    if not floating and _alone(sizes):  # every row on the per-row kernel (tokens=1: no rows share a weight)
        return grouped_glu(glu, x, idx, dtype, tokens=1).astype(x.dtype)
    y = _by_sequence(lambda rows, ids, n: grouped_glu(glu, rows, ids, dtype, tokens=n), sizes,
                     x.reshape(-1, x.shape[-1]), idx.reshape(-1, idx.shape[-1]))
    return y.reshape(*idx.shape, -1).astype(x.dtype)


def gathered_glu(glu: SwitchGLU, x: mx.array, idx: mx.array) -> mx.array:
    """mlx-lm's SwitchGLU forward (MLX's gather products; rows sorted by expert from 64 pairs), with the
    products' row indices handed in as constants: MLX makes them with an Arange per product, and a reshape
    and a broadcast where the rows are not sorted (8 graph nodes a decode step's layer). The same products
    of the same rows: bitwise its output."""
    k = idx.shape[-1]
    x = mx.expand_dims(x, (-2, -3))
    ids = mx.stop_gradient(idx)
    ordered = ids.size >= 64  # as mlx-lm's SwitchGLU decides
    if ordered:  # x and h: a row per pair
        x, ids, inverse = _gather_sort(x, ids)
        tokens = pairs = _row_index((ids.size,), 1)
    else:  # x: a row per token, h: a row per pair
        tokens, pairs = _row_index(ids.shape, k), _row_index(ids.shape, 1)
    gate, up = kernels.gate_up(glu)
    if up is None:  # the joined gate/up: one product, then its two halves
        gate, up = mx.split(_gathered(gate, x, tokens, ids, ordered), 2, axis=-1)
        h = glu.activation(up, gate)
    else:
        h = glu.activation(_gathered(up, x, tokens, ids, ordered), _gathered(gate, x, tokens, ids, ordered))
    y = _gathered(glu.down_proj, h, pairs, ids, ordered)
    if ordered:
        y = _scatter_unsort(y, inverse, idx.shape)
    return y.squeeze(-2)


@lru_cache(maxsize=None)
def _row_index(shape: tuple, k: int) -> mx.array:
    """The row of each (token, expert) pair of `shape` in a product's input of one row per `k` pairs: an
    evaluated constant (no graph node)."""
    index = mx.array((np.arange(math.prod(shape), dtype=np.uint32) // k).reshape(shape))
    mx.eval(index)
    return index


def _gathered(layer: nn.Module, x: mx.array, rows: mx.array, ids: mx.array, ordered: bool) -> mx.array:
    """A (Quantized)SwitchLinear's forward (mlx-lm's) with the row indices given."""
    if "scales" in layer:
        y = mx.gather_qmm(x, layer["weight"], layer["scales"], layer.get("biases"), lhs_indices=rows, rhs_indices=ids,
                          transpose=True, group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                          global_scale=getattr(layer, "global_scale", None), sorted_indices=ordered)
    else:
        y = mx.gather_mm(x, layer["weight"].swapaxes(-1, -2), lhs_indices=rows, rhs_indices=ids,
                         sorted_indices=ordered)
    return y if "bias" not in layer else y + mx.expand_dims(layer["bias"][ids], -2)


def grouped_glu(glu: SwitchGLU, x: mx.array, idx: mx.array, dtype: mx.Dtype,
                tokens: Optional[int] = None, gpu: bool = False) -> mx.array:
    """`switch_glu` with the rows grouped by expert, one product per used expert and projection, so
    the cost follows the rows (gather_qmm's grows with their square, and on CUDA it launches past the
    grid's limit from 8,192 tokens x top-8). The CPU's path (the experts dealt out to this thread's
    CPU streams), and a GPU's for prompt chunks (`gpu`: MLX's quantized matmul in the activations'
    dtype). Reads the router's choice on the host: the forward waits for it here. `tokens`: per row
    of the forward (default: the running forward's)."""
    k, tokens = idx.shape[-1], tokens or _tokens_per_row(idx)
    flat = np.array(idx).reshape(-1)
    order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
    experts, starts = np.unique(flat[order], return_index=True)
    ends = [*starts[1:].tolist(), len(order)]
    rows = x.reshape(-1, x.shape[-1])[mx.array(order // k)].astype(dtype)
    expert = _expert_gpu if gpu else _expert
    weights = glu.down_proj.input_dims * glu.down_proj.output_dims  # one expert projection's
    streams = [mx.default_stream(mx.default_device())] if gpu else _streams_for(weights)
    used = experts.tolist()
    gate, up = (None if p is None else _ByExpert(p, used) for p in kernels.gate_up(glu))
    down = _ByExpert(glu.down_proj, used)
    outs = []
    for i, (e, start, end) in enumerate(zip(used, starts.tolist(), ends)):
        with mx.stream(streams[i % len(streams)]):
            xe = rows[start:end]
            if up is None:  # the joined gate/up: one product, then its two halves
                g, u = mx.split(expert(gate, e, xe, tokens), 2, axis=-1)
                h = glu.activation(u, g)
            else:
                h = glu.activation(expert(up, e, xe, tokens), expert(gate, e, xe, tokens))
            outs.append(expert(down, e, h, tokens))
        if not gpu and tokens > ROW_EXACT_TOKENS and len(outs) % len(streams) == 0:
            mx.eval(outs[-len(streams):])  # a prompt chunk's dequantised experts: a round at a time
    y = mx.concatenate(outs)[mx.array(np.argsort(order))]  # back to (token, slot) order
    return y.reshape(*idx.shape, -1)


class _ByExpert:
    """The `used` experts' parts of a (Quantized)SwitchLinear's arrays (E, N, ...): each array as E runs of N
    rows (a reshape), cut at the used experts' bounds (one Split), so that an expert's are views, not copies
    (a gather and a squeeze each): two nodes an array, not two an expert and array."""

    def __init__(self, layer: nn.Module, used: Sequence[int]):
        self.layer, n, E = layer, layer["weight"].shape[1], layer["weight"].shape[0]
        cuts = sorted({b for e in used for b in (e * n, (e + 1) * n)} - {0, E * n})
        starts = [0, *cuts]
        self.part = {e: starts.index(e * n) for e in used}
        self.parts = {}
        for k in ("weight", "scales", "biases", "bias"):
            if layer.get(k) is not None:
                rows = layer[k].reshape(E * n, *layer[k].shape[2:])
                self.parts[k] = mx.split(rows, cuts, axis=0) if cuts else [rows]

    def __call__(self, name: str, e: int) -> Optional[mx.array]:
        """Expert e's `name` array (None where the layer has none)."""
        parts = self.parts.get(name)
        return None if parts is None else parts[self.part[e]]


def _expert_gpu(experts: _ByExpert, e: int, x: mx.array, tokens_per_row: int) -> mx.array:
    """One quantized expert of a QuantizedSwitchLinear on rows x, on MLX's GPU kernels."""
    layer = experts.layer
    return mx.quantized_matmul(x, experts("weight", e), experts("scales", e), experts("biases", e), True,
                               layer.group_size, layer.bits, mode=layer.mode)


def _expert(experts: _ByExpert, e: int, x: mx.array, tokens_per_row: int) -> mx.array:
    """One expert of a (Quantized)SwitchLinear on rows x (of a forward of `tokens_per_row`)."""
    layer = experts.layer
    if "scales" in layer:
        y = quantized_matmul(x, experts("weight", e), experts("scales", e), experts("biases", e), layer.group_size,
                             layer.bits, layer.mode, tokens_per_row, split=False)
    else:
        y = x @ experts("weight", e).T
    if "bias" in layer:
        y = y + experts("bias", e)
    return y
