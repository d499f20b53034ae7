"""Rotary position embeddings of Gemma 4's layer types (default and proportional RoPE): `mx.fast.rope`
on GPUs, a cos/sin table per forward and a compiled rotation elsewhere."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..cache.kv import Step
from ..runtime.jit import small
from .base import ConfigError, fused_kernels


def rope_periods(params: dict, head_dim: int) -> np.ndarray:
    """(D/2,) rotation periods of the pairs (i, i + D/2) from one layer type's `rope_parameters`
    (inf: a pair that does not rotate). Built on the host: a lazy table would tie the model to
    the thread that loaded it."""
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10000.0))
    factor = float(params.get("factor", 1.0))
    if kind == "default" and factor == 1.0:
        return theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if kind == "proportional":
        # Only the first partial*D/2 pairs rotate, with exponent denominator D.
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        periods = factor * theta ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / head_dim)
        return np.concatenate([periods, np.full((head_dim // 2 - angles,), np.inf)])
    raise ConfigError(f"unsupported rope_type {kind!r}")


class Rope:
    """Rotary embedding of one layer type. GPUs get `mx.fast.rope`; elsewhere the cos/sin table
    of a forward's positions is built once per layer type (in the step's scratch), and a layer
    rotates with one gather of the swapped halves (signed: exact) and one compiled elementwise
    function, instead of splitting, casting and concatenating halves."""

    def __init__(self, params: dict, head_dim: int):
        periods = rope_periods(params, head_dim)
        self.dims, self.key = head_dim, ("rope", head_dim, tuple(periods))
        self.base = float(params.get("rope_theta", 10000.0)) if params.get("rope_type", "default") == "default" else None
        self.freqs = None if self.base is not None else mx.array(periods.astype(np.float32))
        inverse = (1.0 / periods).astype(np.float32)
        self.inverse = mx.array(np.concatenate([inverse, inverse]))  # each pair's angle in both its halves
        self.pairs = mx.array(inverse)  # one per pair (0: not rotating), as the fused CUDA kernel takes them

    def __call__(self, x: mx.array, step: Step) -> mx.array:
        if fused_kernels():
            return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=1.0, offset=step.offset,
                                freqs=self.freqs)
        return _rotate(x, *self.table(step), _swap_index(self.dims, x.dtype, x.shape), _half_turn(self.dims, x.dtype)[1])

    def table(self, step: Step) -> tuple[mx.array, mx.array]:
        """(cos, sin) of `step`'s positions, (B, 1, L, D), each pair's angle in both its halves:
        made once per step and layer type."""
        table = step.scratch.get(self.key)
        if table is None:
            table = step.scratch[self.key] = _table(step.positions, self.inverse)
        return table


@small
def _table(positions: mx.array, inverse: mx.array) -> tuple[mx.array, mx.array]:
    angles = positions[:, None, :, None].astype(mx.float32) * inverse
    return mx.cos(angles), mx.sin(angles)


@mx.compile
def _rotate(x: mx.array, cos: mx.array, sin: mx.array, swap: mx.array, sign: mx.array) -> mx.array:
    # rotate_half(x) = concat(-x2, x1) = x[..., swap] * sign: exact, one gather per entry
    return (x * cos + (mx.take_along_axis(x, swap, axis=-1) * sign) * sin).astype(x.dtype)


@lru_cache(maxsize=256)
def _swap_index(dims: int, dtype: mx.Dtype, shape: tuple) -> mx.array:
    """`_half_turn`'s swap broadcast to x's shape, evaluated (a constant, even inside a trace): a
    gather along the last axis with an index of x's own shape is one graph node."""
    index = mx.broadcast_to(_half_turn(dims, dtype)[0], shape)  # a view: no memory
    mx.eval(index)
    return index


_HALF_TURNS: dict = {}


def _half_turn(dims: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(swap, sign) with x[..., swap] * sign = concat(-x[D/2:], x[:D/2]), per size and dtype (built
    on the host: evaluated arrays, usable from any thread)."""
    key = (dims, dtype)
    if key not in _HALF_TURNS:
        half = dims // 2
        swap = np.concatenate([np.arange(half, dims), np.arange(half)]).astype(np.int32)
        sign = np.concatenate([-np.ones(half), np.ones(half)]).astype(np.float32)
        _HALF_TURNS[key] = (mx.array(swap), mx.array(sign, dtype=dtype))
    return _HALF_TURNS[key]
