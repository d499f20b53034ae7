"""The joined projections' layout: each layer's q/k/v as one product, its MLP's gate/up as another, and its
MoE experts' gate/up as a third (one gather product: (E, 2I, H), each expert's gate rows then its up rows).

Checkpoints (HF, mlx-lm, what `convert` writes) keep the projections apart; models hold them joined,
joined at load (`join`, from `sanitize`) and written back apart (`unjoin`). Joining along the output axis
is exact for quantized weights too: their groups run along the input axis.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional, Sequence

import mlx.core as mx

from .base import ConfigError

# (block, joined projection, its parts in order): every layer's q/k/v, the MLP's gate/up, the experts' gate/up
JOINS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
         ("experts.switch_glu", "gate_up_proj", ("gate_proj", "up_proj")))
_BLOCKS = r"self_attn|mlp|experts\.switch_glu"


def output_axis(suffix: str) -> int:
    """The output axis of a projection's `suffix` array (weight, scales, biases: (..., N, K'); bias: (..., N))."""
    return -1 if suffix == "bias" else -2


def join(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Each layer's q/k/v projections as one `qkv_proj` (q's rows, then k's, then v's: the ones the
    layer has) and its MLP's gate/up as one `gate_up_proj` (gate's rows, then up's): weights, scales,
    biases and bias concatenated along the output axis, exact for quantized weights too (their groups
    run along the input axis). Joined keys are kept as they are (idempotent)."""
    out = dict(weights)
    for key in weights:
        m = re.match(rf"(.*)\.({_BLOCKS})\.(q_proj|gate_proj)\.weight$", key)
        if m is None:
            continue
        block = f"{m.group(1)}.{m.group(2)}"
        name, parts = next((name, parts) for b, name, parts in JOINS if b == m.group(2))
        for suffix in ("weight", "scales", "biases", "bias"):
            arrays = [out.pop(f"{block}.{p}.{suffix}") for p in parts if f"{block}.{p}.{suffix}" in out]
            axis = output_axis(suffix)
            if len({(_without(a.shape, axis), a.dtype) for a in arrays}) > 1:
                raise ConfigError(f"{block}: {', '.join(parts)} are stored differently (quantized with different "
                                  "bits or group sizes?) and cannot be joined")
            if arrays:
                out[f"{block}.{name}.{suffix}"] = arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=axis)
                if _kept is not None:
                    _kept[f"{block}.{name}.{suffix}"] = arrays
    return out


_kept: Optional[dict] = None  # set by `keeping_parts`


@contextlib.contextmanager
def keeping_parts() -> Iterator[dict]:
    """Within the block `join` records the parts of every tensor it joins, by name: `unjoin` then
    writes those (lazily loaded) instead of slices of the joined tensor, whose evaluation would hold
    every part at once (the converter's one-shard memory bound)."""
    global _kept
    saved, _kept = _kept, {}
    try:
        yield _kept
    finally:
        _kept = saved


def _without(shape: tuple, axis: int) -> tuple:
    return tuple(n for i, n in enumerate(shape) if i != axis % len(shape))


def parts(path: str, layers: Sequence) -> list[tuple[str, int]]:
    """(checkpoint module path, output rows) of each part of a joined module's path (`join`), in
    order; [(path, None)] for any other path. `layers`: the model's decoder layers."""
    m = re.match(rf"(.*\blayers\.(\d+)\.({_BLOCKS}))\.(qkv_proj|gate_up_proj)$", path)
    if m is None:
        return [(path, None)]
    layer, block = layers[int(m.group(2))], m.group(1)
    if m.group(3) != "self_attn":
        glu = layer.mlp if m.group(3) == "mlp" else layer.experts.switch_glu
        half = glu.gate_up_proj.weight.shape[-2] // 2
        return [(f"{block}.gate_proj", half), (f"{block}.up_proj", half)]
    attn = layer.self_attn
    return [(f"{block}.{name}", n * attn.head_dim) for name, n in zip(JOINS[0][2], attn.heads) if n]


def unjoin(weights: dict[str, mx.array], layers: Sequence, kept: Optional[dict] = None) -> dict[str, mx.array]:
    """`join`'s inverse: joined tensors back in the checkpoint's layout (q/k/v_proj, gate/up_proj), as
    HF and mlx-lm name and load them. `layers`: the model's decoder layers; `kept`: the parts `join`
    joined (`keeping_parts`), used (in the tensor's dtype) where the tensor is still their concatenation."""
    out = {}
    for key, value in weights.items():
        path, _, suffix = key.rpartition(".")
        split = parts(path, layers)
        axis = output_axis(suffix)
        mine = (kept or {}).get(key)
        if mine is not None and [a.shape[axis] for a in mine] == [rows for _, rows in split] and \
                _without(mine[0].shape, axis) == _without(value.shape, axis):
            out.update({f"{name}.{suffix}": a.astype(value.dtype) for (name, _), a in zip(split, mine)})
            continue
        start = 0
        for name, rows in split:
            out[f"{name}.{suffix}"] = value if rows is None else _rows(value, start, rows, axis)
            start += rows or 0
    return out


def _rows(a: mx.array, start: int, n: int, axis: int) -> mx.array:
    """Rows start .. start + n - 1 of `a` along `axis`."""
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, start + n)
    return a[tuple(index)]


def joined_name(path: str) -> str:
    """A module path of the checkpoint's layout under the joined one (`join`): for quantization records."""
    path = re.sub(r"\.self_attn\.[qkv]_proj$", ".self_attn.qkv_proj", path)
    return re.sub(rf"\.(mlp|experts\.switch_glu)\.(gate|up)_proj$", r".\1.gate_up_proj", path)


def checkpoint_weights(model) -> dict[str, mx.array]:
    """A Gemma 4 target's or drafter's tensors under the checkpoint's names and layout (`unjoin`): what
    HF, mlx-lm and mlx-vlm load, and this package too."""
    from mlx.utils import tree_flatten

    return unjoin(dict(tree_flatten(model.parameters())), model.model.layers)
