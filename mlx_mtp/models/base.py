"""The contract between models and the generation loop, plus small shared helpers.

The loop in `decode/generate.py` / `decode/speculative.py` only ever sees `TargetModel` and `Drafter`;
nothing outside `models/` names a Gemma class.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import weakref
from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..cache.kv import KVCache, SharedKV, Step
from ..runtime.jit import Bounded

log = logging.getLogger("mlx_mtp")


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


@dataclasses.dataclass
class BaseConfig:
    """Dataclass configs built from HF `config.json` dicts.

    Unknown keys are logged once (not fatal) so a renamed HF field is noticed.
    """

    # Keys HF writes that carry no architecture meaning for us.
    _IGNORED = frozenset(
        {
            "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
            "id2label", "label2id", "problem_type", "return_dict", "output_hidden_states",
            "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder", "use_cache",
            "initializer_range", "attention_dropout", "tie_word_embeddings", "model_type",
            "pad_token_id", "bos_token_id", "eos_token_id", "quantization", "quantization_config",
        }
    )

    @classmethod
    def from_dict(cls, params: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in params if k not in names and k not in cls._IGNORED)
        if unknown:
            log.info("%s: ignoring config keys %s", cls.__name__, ", ".join(unknown))
        return cls(**{k: v for k, v in params.items() if k in names})


class TargetOutput(NamedTuple):
    logits: Optional[mx.array]  # (B, L, V), after the final softcap
    hidden: Optional[mx.array]  # (B, L, H), post final norm: the lm_head input
    shared_kv: dict[str, SharedKV]  # layer type -> store layer K/V


class DraftOutput(NamedTuple):
    """One draft step. With a sparse head (E2B/E4B centroids) `logits` covers only the
    selected `token_ids`; every other token has probability zero under the drafter."""

    logits: mx.array  # (B, V), or (B, n) over token_ids
    hidden: mx.array  # (B, H_target): feeds the next draft step
    token_ids: Optional[mx.array] = None  # (B, n) or None for a dense head

    def full_logits(self, vocab_size: int) -> mx.array:
        """(B, V) logits, -inf outside a sparse head's selection."""
        if self.token_ids is None:
            return self.logits
        B = self.logits.shape[0]
        out = mx.full((B, vocab_size), -mx.inf, dtype=self.logits.dtype)
        return mx.put_along_axis(out, self.token_ids, self.logits, axis=-1)

    def argmax(self, keepdims: bool = False) -> mx.array:
        """(B,) greedy draft tokens without building full-vocabulary logits ((B, 1) with `keepdims`)."""
        best = mx.argmax(self.logits, axis=-1, keepdims=True)
        if self.token_ids is not None:
            best = mx.take_along_axis(self.token_ids, best, axis=-1)
        return best if keepdims else best[:, 0]


class TargetModel(Protocol):
    """What the generation loop needs from a target model."""

    vocab_size: int
    config: Any  # read for max_position_embeddings
    pipeline: Any  # None, or this process's pipeline stage, which also keeps the ranks' drivers in step

    def __call__(self, tokens: mx.array, cache: Optional[KVCache] = None, keep: Optional[int] = None) -> TargetOutput:
        """Forward after what `cache` holds; `keep`: outputs wanted only for the last `keep` positions."""
        ...

    def ragged(self, chunks: Sequence[mx.array], caches: Sequence[KVCache],
               wanted: Sequence[bool]) -> TargetOutput:
        """Forward each one-row cache's next tokens `chunks[i]` (1, L_i) in one forward, each row
        exactly as its own forward; logits and hidden (R, 1, ...) of the wanted rows' last positions."""
        ...

    def make_cache(self, batch_size: int = 1, max_rollback: int = 0) -> KVCache: ...

    def shared_kv(self, cache: KVCache) -> dict[str, SharedKV]:
        """Current views of the K/V the drafter reads."""
        ...

    def logits(self, hidden: mx.array) -> mx.array: ...

    def embed(self, tokens: mx.array) -> mx.array:
        """Scaled input embedding, (B, L) -> (B, L, H) (or (B,) -> (B, H)): the drafter's token input."""
        ...


def one_by_one(target: TargetModel, chunks: Sequence[mx.array], caches: Sequence[KVCache],
               wanted: Sequence[bool]) -> TargetOutput:
    """`TargetModel.ragged`'s result from one forward per row (where rows may not share one)."""
    outs = [target(c, cache, keep=1 if w else 0) for c, cache, w in zip(chunks, caches, wanted)]
    kept = [out for out, w in zip(outs, wanted) if w]
    if not kept:
        return TargetOutput(None, None, {})
    logits = None if kept[0].logits is None else mx.concatenate([out.logits[:, -1:] for out in kept])
    return TargetOutput(logits, mx.concatenate([out.hidden[:, -1:] for out in kept]), {})


class Drafter(Protocol):
    """What the speculative loop needs from an MTP drafter."""

    def draft_step(
        self,
        token_embed: mx.array,
        hidden: mx.array,
        shared_kv: dict[str, SharedKV],
        position: mx.array,
        step: Optional[Step] = None,
    ) -> DraftOutput: ...

    def step(self, shared_kv: dict[str, SharedKV], positions: mx.array) -> Step:
        """What every draft step of a block at `positions` shares (masks, RoPE tables)."""
        ...

    def check_target(self, target: TargetModel) -> None:
        """Raise ValueError if this drafter cannot read `target`'s K/V."""
        ...


_forced_fused: Optional[bool] = None  # set by `force_fused`


def fused_kernels() -> bool:
    """True where MLX's kernels are a GPU's: `mx.fast` ops are single kernels, quantized matmuls
    are fast in any activation dtype and `gather_qmm` serves many rows. On the CPU they are not
    (split into many small ops; see `models/quantized.py`), so models build cheaper equivalents."""
    if _forced_fused is not None:
        return _forced_fused
    return mx.default_device() == mx.gpu


def rows_apart() -> bool:
    """Whether every product computes each row of its input as if alone, whatever the other rows,
    so that the prompts of several sequences may share a forward exactly (`Model.ragged`): on MLX's
    CPU backend, whose quantized kernel works row by row and whose BLAS (the reference BLAS of its
    Linux build) sums each row in one fixed order; the one choice that follows the number of rows,
    sharing a dequantised weight, is made per sequence (`quantized.py`). A GPU's kernels are
    chosen by the number of rows (a vector kernel for a few, tiles for more): not relied on."""
    return mx.default_device() == mx.cpu


@contextlib.contextmanager
def force_fused(on: Optional[bool]) -> Iterator[None]:
    """Within the block models take the `mx.fast` branch (True), the compiled-ops branch (False)
    or the device's choice (None), so tests and the selftest run either branch on any device.
    Process-wide: meant for tests and the selftest, not for threads serving requests."""
    global _forced_fused
    saved, _forced_fused = _forced_fused, on
    try:
        yield
    finally:
        _forced_fused = saved


_graph_only = False  # set by `graph_only_block`


def graph_only() -> bool:
    """Whether forwards are being built only to be counted (`primitives.path`): `mx.fast` ops and
    custom kernels stood in by one node each, so compiled traces are kept apart from real ones."""
    return _graph_only


@contextlib.contextmanager
def graph_only_block() -> Iterator[None]:
    global _graph_only
    saved, _graph_only = _graph_only, True
    try:
        yield
    finally:
        _graph_only = saved


MAX_STREAMS = 8
_forced_streams: Optional[int] = None  # set by `using_streams`


def cpu_stream_count() -> int:
    """CPU streams that quantized work is spread over (`models/quantized.py`): one per core the
    process may use, up to MAX_STREAMS (MLX's CPU quantized kernel runs on its stream's thread)."""
    if _forced_streams is not None:
        return _forced_streams
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_STREAMS, cores)


@contextlib.contextmanager
def using_streams(count: Optional[int]) -> Iterator[None]:
    """Within the block quantized work uses `count` CPU streams (None: one per core). Process-wide,
    like `force_fused`: for tests and benchmarks."""
    global _forced_streams
    saved, _forced_streams = _forced_streams, count
    try:
        yield
    finally:
        _forced_streams = saved


def compiled(method: Callable) -> Callable:
    """`mx.compile` a module method, traced once per set of argument shapes, dtypes and constants.

    The other arguments must be trees (tuples, lists, dicts) of arrays and constants (ints,
    floats, strings, None). The module's own arrays are inputs of every call, never constants
    captured at the first trace, so weights loaded or changed later are the ones used; and the
    trace runs on a copy of the module's structure holding the tracers, so the module itself never
    holds one (another thread may be running it). Whether `mx.fast` kernels are used and how many
    CPU streams quantized work is spread over, whether mlx_mtp's GPU kernels are on (and on CUDA),
    and whether the graph is only counted (`graph_only`), are part of the key. Compiled functions are per
    module object and per thread (MLX keeps traces per thread), their traces bounded in number
    (`jit.Bounded`).
    """

    @functools.wraps(method)
    def call(self, *args):
        mine = self.__dict__.get("_compiled")
        if mine is None:  # an attribute, not a child: the module's dict holds its arrays only
            mine = _Compiled()
            object.__setattr__(self, "_compiled", mine)
        fn = mine.get(method)
        if fn is None:
            fn = mine[method] = _compile(method, weakref.ref(self))
        backend = (fused_kernels(), cpu_stream_count(), kernels.mode(), kernels.dispatch.cuda(), _graph_only)
        return fn(self, mine.transposed(self), backend, *args)

    return call


class _Compiled(dict):
    """A module's compiled methods, and the transposed views of its unquantized product weights
    (`transposed`). A copy of the module compiles its own (these hold the module they were made for)."""

    def __init__(self):
        super().__init__()
        self.readers: Optional[list] = None  # the modules that read a transposed weight, in tree order
        self.views: list = []  # [(weight, its transpose, evaluated)] per reader

    def transposed(self, module: nn.Module) -> list:
        """The transposes of the readers' weights, evaluated views of them (no copy), made again for
        a weight that changed: compile inputs, so a product reads W^T without a Transpose node. The
        readers are found again where one was replaced (quantized, dropped by a pipeline stage)."""
        if self.readers is None or any(parent[key] is not m for parent, key, m in self.readers):
            self.readers = _readers(module)
            self.views = [(None, None)] * len(self.readers)
        out = []
        for i, (_, _, m) in enumerate(self.readers):
            w = m["weight"]
            if self.views[i][0] is not w:
                view = w.T
                mx.eval(view)
                self.views[i] = (w, view)
            out.append(self.views[i][1])
        return out

    def __copy__(self):
        return _Compiled()

    def __deepcopy__(self, memo):
        return _Compiled()


def _readers(module: nn.Module) -> list:
    """(container, key, module) of each module of a tree whose product reads a transposed weight handed to
    it (`reads_transpose`), in a fixed order (the same for a trace's copy of the tree)."""
    out = []

    def walk(node) -> None:
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, nn.Module):
                if getattr(type(value), "reads_transpose", False) and "weight" in value:
                    out.append((node, key, value))
                walk(value)
            elif isinstance(value, (list, tuple, dict)):
                walk(value)

    walk(module)
    return out


def _compile(method: Callable, module: weakref.ref) -> Callable:
    def traced(arrays, views, backend, *args):  # arrays: the module's dict, as compile's tracers
        held = _holding(module(), arrays)
        readers = _readers(held)
        if len(readers) == len(views):  # (else a reader was added since: each transposes its own weight)
            for (_, _, m), view in zip(readers, views):
                object.__setattr__(m, "weight_t", view)  # an attribute of the trace's copy, not a parameter
        return method(held, *args)

    traced.__qualname__ = method.__qualname__  # what `jit.counting` names

    return Bounded(traced, skip=2)  # refers to the module weakly: it holds this function


def _holding(structure, arrays):
    """A copy of a module tree's structure (modules, lists, dicts) with `arrays`' leaves."""
    if isinstance(structure, nn.Module):
        out = copy.copy(structure)
        for key, value in structure.items():
            dict.__setitem__(out, key, _holding(value, arrays[key]))
        return out
    if isinstance(structure, (list, tuple)):
        return type(structure)(_holding(s, a) for s, a in zip(structure, arrays))
    if isinstance(structure, dict):
        return {key: _holding(value, arrays[key]) for key, value in structure.items()}
    return arrays


@functools.partial(mx.compile, shapeless=True)
def gelu_tanh_glu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float) -> mx.array:
    """Gemma 4 RMSNorm: plain `x * rsqrt(mean(x^2) + eps) * w` (no `1 + w`)."""
    if fused_kernels():
        return mx.fast.rms_norm(x, weight, eps)
    return _rms_norm(x, eps) if weight is None else _rms_norm_weighted(x, weight, eps)


@mx.compile
def _rms_norm(x: mx.array, eps: float) -> mx.array:
    # As mx.fast.rms_norm computes it: in float32, then the input's dtype. The squares are of |x| (the
    # same values): one cast of x per use, so that each fuses with its use (a cast read twice is a
    # graph node of its own, and its square another).
    squares = mx.square(mx.abs(x).astype(mx.float32))
    return (x.astype(mx.float32) * mx.rsqrt(mx.mean(squares, axis=-1, keepdims=True) + eps)).astype(x.dtype)


@mx.compile
def _rms_norm_weighted(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return _rms_norm(x, eps) * weight


def fill(module: nn.Module, weights: dict, config: dict, evaluate: bool = True) -> nn.Module:
    """Load a tower's (sanitized) `weights` into `module`, strictly; layers whose `.scales` the
    checkpoint has are built quantized first, with its quantization record's group size, bits and
    mode (mlx-community quantizes the embedders). `evaluate=False` keeps them lazy (the converter
    writes one shard at a time)."""
    record = config.get("quantization") or {}
    if any(k.endswith(".scales") for k in weights):
        nn.quantize(module, group_size=record.get("group_size", 64), bits=record.get("bits", 4),
                    mode=record.get("mode", "affine"), class_predicate=lambda p, m: f"{p}.scales" in weights)
    module.load_weights(list(weights.items()), strict=True)
    if evaluate:
        mx.eval(module.parameters())
    module.eval()
    return module
