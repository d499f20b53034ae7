"""How many primitives a forward evaluates: counted in its unevaluated graph (`mx.export_to_dot`).

A step's cost on a GPU is set by its number of primitives as much as by its weights (each one is
host work: the eval walk, a buffer, a command or CUDA graph node), so the count is a figure of its
own. Counted for the path a model takes on each backend, on any machine, without evaluating:

- `cpu`: MLX's CPU backend (the compiled-ops branch of `models.base.fused_kernels`);
- `metal`: MLX's GPU kernels as Metal runs them: the `mx.fast` branch, each `mx.fast` op one node
  (on the CPU, MLX would split it into many: here it is stood in by one);
- `cuda`: the `mx.fast` branch with mlx_mtp's kernels where `kernels.dispatch` takes them on an
  NVIDIA GPU (the device faked, each kernel launch stood in by one node).

A stand-in is one `Depends` node on the op's inputs (reported as `Kernel`); graphs built under one
are never evaluated, and compiled forwards are traced apart from the real ones (`base.compiled`).
"""

from __future__ import annotations

import collections
import contextlib
import io
import re
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np

from .. import kernels
from ..cache.kv import FULL, KVCache
from ..kernels import dispatch, source
from ..models import base, quantized
from ..decode.sample import SamplingParams
from ..decode.speculative import MAX_ROLLBACK, BatchState, Plan, run_round

PATHS = ("cpu", "metal", "cuda")
VIEWS = {"Reshape", "Transpose", "Slice", "Broadcast", "ExpandDims", "Squeeze", "Flatten", "Unflatten", "AsStrided"}
STAND_IN = "Kernel"  # how a stood-in mx.fast op or custom kernel is reported


def node_kinds(*arrays: Optional[mx.array]) -> collections.Counter:
    """Primitive nodes in the unevaluated graph behind `arrays`, by primitive name."""
    out = io.StringIO()
    mx.export_to_dot(out, *[a for a in arrays if a is not None])
    kinds = collections.Counter(re.findall(r'label ="(\w+)", shape=rectangle', out.getvalue()))
    if "Depends" in kinds and base.graph_only():
        kinds[STAND_IN] = kinds.pop("Depends")
    return kinds


def split(kinds: collections.Counter) -> tuple[int, int, int]:
    """(matmuls, views, the rest) of a count: views move no data."""
    products = ("Matmul", "AddMM", "QuantizedMatmul", "GatherQMM", "GatherMM")
    matmuls = sum(n for name, n in kinds.items() if name in products)
    views = sum(n for name, n in kinds.items() if name in VIEWS)
    return matmuls, views, sum(kinds.values()) - matmuls - views


# ---- stand-ins: one node per mx.fast op or custom kernel ----------------------------------------

_ZEROS: dict = {}


def _zeros(shape: tuple, dtype: mx.Dtype) -> mx.array:
    """Evaluated zeros without memory (a broadcast scalar): a stand-in's value, never read."""
    key = (tuple(shape), dtype)
    if key not in _ZEROS:
        _ZEROS[key] = mx.broadcast_to(mx.zeros((), dtype), shape)
        mx.eval(_ZEROS[key])
    return _ZEROS[key]


def _node(outputs: list, inputs: list) -> list:
    """One node with these outputs' shapes and dtypes, depending on `inputs`."""
    return mx.depends([_zeros(s, d) for s, d in outputs], [a for a in inputs if isinstance(a, mx.array)])


def _rms_norm(x, weight, eps, **_):
    return _node([(x.shape, x.dtype)], [x, weight])[0]


def _rope(x, dims, *, traditional=False, base=None, scale=1.0, offset=0, freqs=None, **_):
    return _node([(x.shape, x.dtype)], [x, offset, freqs])[0]


def _sdpa(q, k, v, *, scale=1.0, mask=None, **_):
    return _node([((*q.shape[:-1], v.shape[-1]), q.dtype)], [q, k, v, mask])[0]


def _kernel_factory(**_):
    def launch(inputs, output_shapes, output_dtypes, **__):
        return _node(list(zip(output_shapes, output_dtypes)), list(inputs))
    return launch


@contextlib.contextmanager
def path(name: str) -> Iterator[None]:
    """Within the block, forwards build the graph `name` (one of PATHS) would run. Process-wide,
    like `base.force_fused`: for benchmarks, tests and the selftest; evaluate nothing built inside
    under `metal` or `cuda` (the stand-ins' values are zeros)."""
    if name not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, not {name!r}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(base.force_fused(name != "cpu"))
        if name != "cpu":
            stack.enter_context(_patched(mx.fast, rms_norm=_rms_norm, rope=_rope,
                                         scaled_dot_product_attention=_sdpa))
            stack.enter_context(base.graph_only_block())
        if name == "cuda":
            stack.enter_context(_patched(dispatch, cuda=lambda: True))
            stack.enter_context(source.use_factory(_kernel_factory))
            stack.enter_context(kernels.using("auto"))
        yield


@contextlib.contextmanager
def _patched(owner, **attrs) -> Iterator[None]:
    saved = {k: getattr(owner, k) for k in attrs}
    try:
        for k, v in attrs.items():
            setattr(owner, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(owner, k, v)


@contextlib.contextmanager
def _host_reads(tally: collections.Counter) -> Iterator[None]:
    """The CPU's MoE experts read the router's choice on the host mid-forward, evaluating what it
    needs: that part of the graph is counted into `tally` before it goes."""
    original = quantized.grouped_glu

    def counted(glu, x, idx, *args, **kwargs):
        tally.update(node_kinds(idx))
        return original(glu, x, idx, *args, **kwargs)

    with _patched(quantized, grouped_glu=counted):
        yield


# ---- what is counted ------------------------------------------------------------------------------


def activation_dtype(model) -> mx.Dtype:
    """The dtype a model's activations run in: its embedding's (scales' when quantized)."""
    embed = model.model.embed_tokens
    return embed.scales.dtype if "scales" in embed else embed.weight.dtype


def filled_cache(target, rows: int, length: int) -> KVCache:
    """A cache of `rows` rows holding `length` positions each (zero K/V), evaluated, as a decoding
    batch's cache is between rounds."""
    cfg, dtype = target.config, activation_dtype(target)
    caches = []
    for _ in range(rows):
        one = target.make_cache(1, MAX_ROLLBACK)
        full, sliding = {}, {}
        for i, kind in enumerate(one.layer_types):
            held = length if kind == FULL else min(length, cfg.sliding_window + 1)
            kv = mx.zeros((1, cfg.layer_kv_heads(i), held, cfg.layer_head_dim(i)), dtype)
            (full if kind == FULL else sliding)[i] = (kv, kv)
        one.resume(length, full, sliding)
        caches.append(one)
    cache = caches[0]
    for other in caches[1:]:
        cache.extend(other)
    mx.eval(cache.offset, [a for a in cache.keys + cache.values if a is not None],
            [t.pos for t in cache.tracks.values()])
    return cache


def round_kinds(target, drafter, rows: int, k: int, length: int = 64) -> collections.Counter:
    """Primitives of one greedy round of `k` drafts (0: a plain decoding step) over `rows` rows of
    `length` positions: the drafter's steps, the verify, acceptance and the cache's updates."""
    from ..decode.drafters import MTPProposer

    cache = filled_cache(target, rows, length)
    hidden_size = target.config.hidden_size
    state = BatchState(mx.zeros((rows,), mx.int32), mx.zeros((rows, hidden_size), activation_dtype(target)),
                       mx.zeros((rows,), mx.uint32))
    mx.eval(state.tokens, state.hidden, state.seeds)
    plan = Plan(tuple(SamplingParams() for _ in range(rows)), (k,) * rows)
    tally: collections.Counter = collections.Counter()
    with _host_reads(tally):
        state, out = run_round(target, MTPProposer(drafter, target) if k else None, cache, state, plan)
        tally.update(node_kinds(out.tokens, out.accepted, out.drafted, state.tokens, state.hidden, cache.offset,
                                *cache.keys, *cache.values, *[t.pos for t in cache.tracks.values()]))
    return tally


def forward_kinds(target, rows: int, tokens: int, length: int = 64) -> collections.Counter:
    """Primitives of the target's forward alone over `tokens` new tokens per row (logits, hidden
    state and the cache's K/V)."""
    cache = filled_cache(target, rows, length)
    ids = mx.array(np.zeros((rows, tokens), dtype=np.int32))
    tally: collections.Counter = collections.Counter()
    with _host_reads(tally):
        out = target(ids, cache)
        tally.update(node_kinds(out.logits, out.hidden, *cache.keys, *cache.values))
    return tally


def device_path() -> str:
    """The path forwards take here: `cuda` on an NVIDIA GPU with mlx_mtp's kernels on, `metal` where
    the `mx.fast` branch runs (a GPU, or forced), else `cpu`."""
    if base.fused_kernels():
        return "cuda" if dispatch.cuda() and kernels.mode() == "auto" else "metal"
    return "cpu"


def summary(target, drafter, rows: int = 1, k: int = 3) -> tuple[int, Optional[int]]:
    """(primitives of a plain step, of a K-draft round) at `rows` rows on this device's path."""
    with path(device_path()):
        plain = sum(round_kinds(target, drafter, rows, 0).values())
        spec = sum(round_kinds(target, drafter, rows, k).values()) if drafter is not None else None
    return plain, spec
