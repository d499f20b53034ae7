"""Gemma 4 text model (`gemma4_text`, and the text part of the `gemma4` wrapper).

Every released variant is a config flag of one model: the dense 31B-style target
(`attention_k_eq_v`), the 26B-A4B MoE (`enable_moe_block`), and E2B/E4B (per-layer
embeddings, KV-shared tail layers, `use_double_wide_mlp`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from functools import partial
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import kernels
from ..cache.kv import FULL, SLIDING, KVCache, Ragged, Step
from ..runtime.jit import small
from . import moe as moe_block
from .base import (BaseConfig, ConfigError, TargetOutput, compiled, fused_kernels, gelu_tanh_glu, log, one_by_one,
                   rms_norm, rows_apart)
from .layout import JOINS, join, joined_name, keeping_parts, parts, unjoin  # noqa: F401 (the module's layout API)
from .moe import Experts, GeGLU, Router  # noqa: F401 (the MoE layers' modules, as they were here)
from .quantized import Embedding, Linear, forward_tokens
from .rope import Rope


@dataclasses.dataclass
class Config(BaseConfig):
    """`gemma4_text` config; defaults are transformers' where config.json may omit a key."""

    vocab_size: int = 262144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: Optional[int] = None
    num_global_key_value_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    attention_bias: bool = False
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    rope_parameters: Optional[dict] = None
    sliding_window: int = 512
    layer_types: Optional[list] = None
    final_logit_softcapping: Optional[float] = None
    hidden_size_per_layer_input: int = 256
    vocab_size_per_layer_input: int = 262144
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: Optional[int] = None
    top_k_experts: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    use_bidirectional_attention: Optional[str] = None
    tie_word_embeddings: bool = True
    per_layer_config: Optional[dict] = None
    sliding_window_pattern: Optional[int] = None
    suppress_tokens: tuple = ()  # never generated (generation_config.json's, which the loader reads)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "Config":
        params = dict(params.get("text_config", params))
        if params.get("moe_intermediate_size") is None and "expert_intermediate_size" in params:
            params["moe_intermediate_size"] = params.pop("expert_intermediate_size")
        params.pop("expert_intermediate_size", None)
        return super().from_dict(params)

    def __post_init__(self):
        if self.layer_types is None:
            period = self.sliding_window_pattern or 6
            self.layer_types = [SLIDING if (i + 1) % period else FULL for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"{len(self.layer_types)} layer_types for {self.num_hidden_layers} layers")
        if self.layer_types[-1] != FULL:
            self.layer_types = [*self.layer_types[:-1], FULL]  # transformers forces this too
        self._apply_per_layer_config()
        if self.rope_parameters is None:
            self.rope_parameters = {
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            }
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"unsupported hidden_activation {self.hidden_activation!r}")
        if self.use_bidirectional_attention == "all":
            raise ConfigError("use_bidirectional_attention='all' (non-causal Gemma 4) is not supported")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ConfigError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        if not 0 <= (self.num_kv_shared_layers or 0) <= self.num_hidden_layers:
            raise ConfigError(f"num_kv_shared_layers {self.num_kv_shared_layers} out of range")

    def _apply_per_layer_config(self):
        """Fold transformers-5.23's `per_layer_config` back into the released keys."""
        for idx, over in (self.per_layer_config or {}).items():
            idx = int(idx)
            if self.layer_types[idx] != FULL:
                raise ConfigError(f"per_layer_config overrides sliding layer {idx}; unsupported")
            for key, value in over.items():
                if key == "head_dim":
                    self.global_head_dim = value
                elif key == "num_key_value_heads":
                    if value != self.num_key_value_heads:
                        self.num_global_key_value_heads = value
                else:
                    raise ConfigError(f"unsupported per_layer_config key {key!r} for layer {idx}")
        self.per_layer_config = None

    # ---- derived geometry --------------------------------------------------------------

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - (self.num_kv_shared_layers or 0)

    def layer_head_dim(self, i: int) -> int:
        full = self.layer_types[i] == FULL
        return self.global_head_dim if full and self.global_head_dim else self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        if self.layer_types[i] == FULL and self.attention_k_eq_v and self.num_global_key_value_heads:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def kv_source(self, i: int) -> int:
        """Layer whose K/V layer i attends to: itself, or for a shared layer the last
        non-shared layer of the same type (also the drafter's "store" layer)."""
        first = self.first_shared_layer
        if i < first:
            return i
        return self.store_layer(self.layer_types[i])

    def store_layer(self, layer_type: str) -> int:
        """Last non-shared layer of `layer_type`: the K/V the MTP drafter reads."""
        for j in range(self.first_shared_layer - 1, -1, -1):
            if self.layer_types[j] == layer_type:
                return j
        raise ConfigError(f"no non-shared {layer_type} layer to share K/V from")


@partial(mx.compile, shapeless=True)
def softcap(x: mx.array, cap: float) -> mx.array:
    return mx.tanh(x / cap) * cap


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        self.index = i
        self.layer_type = cfg.layer_types[i]
        self.head_dim = hd = cfg.layer_head_dim(i)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.layer_kv_heads(i)
        self.k_eq_v = cfg.attention_k_eq_v and self.layer_type == FULL
        self.eps = cfg.rms_norm_eps
        own = i < cfg.first_shared_layer
        # The joined projection's heads: q's, then k's and v's where the layer has them (`join`).
        self.heads = (self.n_heads, self.n_kv if own else 0, self.n_kv if own and not self.k_eq_v else 0)
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.heads) * hd, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        if own:
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.o_proj = Linear(self.n_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.rope = Rope(cfg.rope_parameters[self.layer_type], hd)

    def __call__(self, x: mx.array, norm: RMSNorm, step: Union[Step, Ragged], shared_kv=None):
        """x: (B * L, H), the rows' tokens in order, before the input norm `norm`. Returns (output, kv):
        kv is the (keys, values) attended over, which a KV-shared layer passes in as `shared_kv`
        instead of computing (and storing) its own. A ragged step's rows attend one by one, each
        through its own step (kv: one per row)."""
        if isinstance(step, Ragged):
            return self._ragged(x, norm, step, shared_kv)
        B, L = step.positions.shape
        heads = self._fused(x, norm, step.positions, shared_kv is None)
        if heads is None:  # MLX's ops
            heads = self._rotate(*self._project(norm(x), B, L, shared_kv is None), step)
        out, kv = self._attend(*heads, step, shared_kv, flat=L == 1)
        if L > 1:  # (B, heads, L, D) -> the rows' tokens in order
            out = out.transpose(0, 2, 1, 3).reshape(B * L, self.n_heads * self.head_dim)
        return self.o_proj(out), kv

    def _fused(self, x: mx.array, norm: RMSNorm, positions: mx.array, own_kv: bool) -> Optional[tuple]:
        """(q, k, v) as `_rotate` gives them, from the input norm to RoPE in one CUDA kernel
        (`kernels.attention_input`), or None where MLX's ops run."""
        kv = (1 if self.k_eq_v else 2) if own_kv else 0
        return kernels.attention_input(x, norm.weight, self.qkv_proj, self.q_norm.weight,
                                       self.k_norm.weight if own_kv else None, positions, self.rope.pairs,
                                       self.n_heads, self.head_dim, kv, self.eps)

    def _project(self, x: mx.array, B: int, L: int, own_kv: bool, grouped: bool = True) -> tuple:
        """Normalised heads in attention's layout (B, heads, L, head_dim), not rotated: the ones to
        rotate (q's and k's side by side on the CPU: one rotation; apart where mx.fast's rope runs)
        and v (None where the K/V are shared). One product over the joined weight; one token per row
        needs no transpose. `grouped`: a shared layer's one query per row may come grouped by K/V
        head instead (not for a ragged step, which slices the token axis)."""
        nq, nk, nv = self.heads
        y = self.qkv_proj(x)
        if grouped and not own_kv and L == 1 and not fused_kernels():  # q's heads grouped by K/V head (`attention`)
            return [self.q_norm(y.reshape(B, self.n_kv, nq // self.n_kv, self.head_dim))], None
        heads = (y.reshape(B, nq + nk + nv, 1, self.head_dim) if L == 1
                 else y.reshape(B, L, nq + nk + nv, self.head_dim).transpose(0, 2, 1, 3))
        if not own_kv:
            return [self.q_norm(heads)], None
        if fused_kernels():  # mx.fast's norm takes one weight: a norm per projection
            q, k, v = mx.split(heads, [nq, nq + nk], axis=1)
            return [self.q_norm(q), self.k_norm(k)], rms_norm(k if self.k_eq_v else v, None, self.eps)
        # One norm for every head, each head's weight picked elementwise (1 for v: no weight).
        weights = _head_weights(self.heads, self.q_norm.weight, self.k_norm.weight)
        if self.k_eq_v:  # V is the raw K, normalised without weight
            normed = rms_norm(heads, None, self.eps)
            return [normed * weights], normed[:, nq:]
        qk, v = mx.split(rms_norm(heads, weights, self.eps), [nq + nk], axis=1)
        return [qk], v

    def _rotate(self, parts: list, v: Optional[mx.array], step: Step) -> tuple:
        """`_project`'s heads with q and k rotated: (q, k, v), k and v None where the K/V are shared."""
        rotated = [self.rope(p, step) for p in parts]
        if v is None:
            return rotated[0], None, None
        q, k = rotated if len(rotated) == 2 else mx.split(rotated[0], [self.n_heads], axis=1)
        return q, k, v

    def _attend(self, q: mx.array, k, v, step: Step, shared_kv, flat: bool = False) -> tuple:
        """Store the K/V in the cache (unless shared) and attend: (B, heads, L, head_dim), or with one
        token per row and `flat` (B, heads * head_dim), and the kv."""
        if shared_kv is None:
            shared_kv = step.store(self.index, k, v)
            keys_t = None
        else:  # K/V shared by every layer of the type: their K may be transposed once (the drafter's `step`)
            keys_t = step.scratch.get(("keys_t", self.layer_type))
        bias = step.scratch.get(("bias", self.layer_type)) if keys_t is not None else None
        mask = step.masks[self.layer_type]
        return attention(q, *shared_kv, mask, step.scratch, flat, keys_t, bias), shared_kv

    def _ragged(self, x: mx.array, norm: RMSNorm, ragged: Ragged, shared: Optional[list]) -> tuple:
        """Projections over every row's tokens at once; attention row by row (its own cache's slots,
        masks and RoPE offsets, the shapes of its own forward)."""
        positions = mx.concatenate([step.positions for step in ragged.steps], axis=1)  # (computed where used)
        fused = self._fused(x, norm, positions, shared is None)
        parts, v = (self._project(norm(x), 1, x.shape[0], shared is None, grouped=False) if fused is None
                    else (None, None))
        outs, kvs = [], []
        for i, (step, (a, b)) in enumerate(zip(ragged.steps, ragged.bounds)):
            if fused is None:
                mine = self._rotate([t[:, :, a:b] for t in parts], None if v is None else v[:, :, a:b], step)
            else:  # each token's heads as its own forward's kernel makes them
                mine = [None if t is None else t[:, :, a:b] for t in fused]
            out, kv = self._attend(*mine, step, None if shared is None else shared[i])
            outs.append(out.transpose(0, 2, 1, 3))
            kvs.append(kv)
        out = mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
        return self.o_proj(out.reshape(x.shape[0], self.n_heads * self.head_dim)), kvs


_HEAD_INDEX: dict = {}


def _head_weights(heads: tuple, q_weight: mx.array, k_weight: mx.array) -> mx.array:
    """(heads, 1, head_dim) norm weights of a joined projection's heads: q's weight on q's heads, k's on
    k's, 1 on v's; picked elementwise (fused into the norm) by a head index built on the host."""
    nq, nk, nv = heads
    if heads not in _HEAD_INDEX:  # (heads, 1, 1): heads lie on axis 1 of (B, heads, L, head_dim)
        _HEAD_INDEX[heads] = mx.array(np.arange(nq + nk + nv, dtype=np.int32)[:, None, None])
    index = _HEAD_INDEX[heads]
    w = mx.where(index < nq, q_weight, k_weight)
    return mx.where(index < nq + nk, w, 1.0) if nv else w


def attention(q: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array],
              scratch: Optional[dict] = None, flat: bool = False, keys_t: Optional[mx.array] = None,
              bias: Optional[mx.array] = None) -> mx.array:
    """Softmax attention (scale 1) of q (B, n, L, D) over K/V (B, n_kv, T, D), mask (B, 1, L, T):
    (B, n, L, D), or (B, n * D) with `flat` (one query per row: the same order, one reshape).
    GPUs run `mx.fast`'s kernel (or, on NVIDIA GPUs, decode and verify steps mlx_mtp's: `kernels`);
    elsewhere (where that kernel is split into many ops) the heads sharing a K/V head attend as one
    matrix, with no broadcast copies of the K/V; the mask repeated for a group's heads is made once
    per forward where `scratch` (the step's) is given. `keys_t`: the keys' transpose, where made already.
    One query per row may come grouped, (B, n_kv, heads per K/V head, D) (`flat` then). `bias`: the mask
    as the scores' addend (0 or the dtype's lowest), of their shape (`mask_bias`): no select per layer."""
    if fused_kernels():
        out = kernels.attention(q, keys, values, mask, flat=flat)
        if out is not None:
            return out
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
        return out.reshape(q.shape[0], -1) if flat else out
    B, n, L, D = q.shape
    n_kv, T = keys.shape[1], keys.shape[2]
    rows = n // n_kv * L
    keys_t = keys.swapaxes(-1, -2) if keys_t is None else keys_t
    if bias is not None:  # the same scores, the hidden ones at the lowest value as `where` puts them
        scores = mx.addmm(bias, q.reshape(B, n_kv, rows, D), keys_t)
    else:
        scores = q.reshape(B, n_kv, rows, D) @ keys_t  # (B, n_kv, heads per K/V head * L, T)
    if mask is not None and bias is None:
        if rows != L and L > 1:  # the same mask for every head of a group (one query: it broadcasts)
            key = ("group mask", id(mask), rows)
            grouped = None if scratch is None else scratch.get(key)
            if grouped is None:
                grouped = mx.broadcast_to(mask[:, :, None], (B, 1, n // n_kv, L, T)).reshape(B, 1, rows, T)
                if scratch is not None:
                    scratch[key] = grouped
            mask = grouped
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return (mx.softmax(scores, axis=-1, precise=True) @ values).reshape(*((B, -1) if flat else (B, n, L, D)))


@small  # one kernel
def mask_bias(mask: mx.array, keys: mx.array, group: int) -> mx.array:
    """One query's mask (B, 1, 1, T) as the addend of its scores over `keys` (B, n_kv, T, D) with `group`
    heads per K/V head, (B, n_kv, group, T): 0 where visible, the dtype's lowest where not."""
    B, n_kv, T, _ = keys.shape
    low = mx.array(mx.finfo(keys.dtype).min, keys.dtype)
    return mx.broadcast_to(mx.where(mask, mx.array(0, keys.dtype), low), (B, n_kv, group, T))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)  # gate's rows, then up's (`join`)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array, norm: RMSNorm) -> mx.array:
        """The MLP of norm(x): the norm, gate/up and GLU in one CUDA kernel where it applies."""
        glu = kernels.mlp_input(x, norm.weight, self.gate_up_proj, eps=norm.eps)
        if glu is None:  # MLX's ops
            gate, up = mx.split(self.gate_up_proj(norm(x)), 2, axis=-1)
            glu = gelu_tanh_glu(gate, up)
        return self.down_proj(glu)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, i)
        wide = cfg.use_double_wide_mlp and i >= cfg.first_shared_layer
        self.mlp = MLP(H, cfg.intermediate_size * (2 if wide else 1))
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.layer_scalar = mx.ones((1,))
        if cfg.enable_moe_block:
            self.router = Router(cfg)
            self.experts = Experts(cfg)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
        if cfg.hidden_size_per_layer_input:
            P = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = Linear(H, P, bias=False)
            self.per_layer_projection = Linear(P, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def __call__(self, x, step: Step, shared_kv=None, per_layer_input=None):
        """One residual block; returns (output, kv) as `Attention` does. Each norm goes to the op that
        reads it: on NVIDIA GPUs, fused into mlx_mtp's kernels (`kernels`) where they apply."""
        attn, kv = self.self_attn(x, self.input_layernorm, step, shared_kv)
        h = residual(x, attn, self.post_attention_layernorm)
        f = self.mlp(h, self.pre_feedforward_layernorm)
        moe = None
        if "router" in self:
            idx, weights = self.router(h)
            experts = self.experts(h, self.pre_feedforward_layernorm_2, idx)
            moe = (self.post_feedforward_layernorm_1, experts, self.post_feedforward_layernorm_2, weights)
        if per_layer_input is None:
            return residual(h, f, self.post_feedforward_layernorm, moe, self.layer_scalar), kv
        h = residual(h, f, self.post_feedforward_layernorm, moe)
        g = gelu_tanh_glu(self.per_layer_input_gate(h), per_layer_input)
        h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar, kv


def residual(x: mx.array, y: mx.array, norm: RMSNorm, moe: Optional[tuple] = None,
             scalar: Optional[mx.array] = None) -> mx.array:
    """(x + norm(y)) * scalar, with an MoE layer's `moe` = (norm1, y2, norm2, weights): y is then norm1(y) +
    norm2(y2 summed with the experts' weights). In one CUDA kernel where it applies (`kernels.residual`),
    else MLX's ops."""
    second = moe and (moe[0].weight, moe[1], moe[2].weight)
    fused = kernels.residual(x, y, norm.weight, norm.eps, scalar, second, route=moe and moe[3])
    if fused is not None:
        return fused
    if moe is not None:
        y = moe[0](y) + moe[2](moe_block.weighted(moe[1], moe[3]))
    h = x + norm(y)
    return h if scalar is None else h * scalar


def scaled_embed(embedding: nn.Module, ids: mx.array, scale: float) -> mx.array:
    """Embedding times `scale`, rounded to the embedding dtype as transformers does. A free
    function (not a subclass) so that nn.quantize's QuantizedEmbedding keeps the scale."""
    x = embedding(ids)
    return _scaled(x, mx.array(scale, dtype=x.dtype))


@partial(mx.compile, shapeless=True)
def _scaled(x: mx.array, scale: mx.array) -> mx.array:
    return x * scale  # compiled: the scalar's broadcast is no node of its own


class TextModel(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sources = {cfg.kv_source(i) for i in range(cfg.first_shared_layer, cfg.num_hidden_layers)}
        self.pipeline = None  # this process's stage (`distributed.pipeline.Stage`); None: all layers here
        if cfg.hidden_size_per_layer_input:
            n, P = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = Embedding(cfg.vocab_size_per_layer_input, n * P)
            self.per_layer_model_projection = Linear(cfg.hidden_size, n * P, bias=False)
            self.per_layer_projection_norm = RMSNorm(P, cfg.rms_norm_eps)

    def embed(self, ids: mx.array) -> mx.array:
        return scaled_embed(self.embed_tokens, ids, math.sqrt(self.cfg.hidden_size))

    def per_layer_inputs(self, ids: mx.array, x: mx.array) -> mx.array:
        """(N, layers, P) per-layer embedding signal for E2B/E4B, of ids (N,) embedded as x (N, H)."""
        cfg = self.cfg
        shape = (*ids.shape, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
        tok = scaled_embed(self.embed_tokens_per_layer, ids, math.sqrt(shape[-1])).reshape(shape)
        ctx = self.per_layer_model_projection(x) * (cfg.hidden_size**-0.5)
        ctx = self.per_layer_projection_norm(ctx.reshape(shape))
        return (ctx + tok) * (2.0**-0.5)

    @property
    def span(self) -> tuple[int, int]:
        """The layers this process computes: all of them, or its pipeline stage's."""
        return (0, self.cfg.num_hidden_layers) if self.pipeline is None else self.pipeline.span

    def __call__(self, ids: mx.array, step: Union[Step, Ragged],
                 keep: Optional[int] = None, images=None) -> Optional[mx.array]:
        """Hidden states of ids (B, L) as (B * L, H) rows, or of only the last `keep` positions of
        each row (None for keep=0). Tokens stay rows of a 2D array from layer to layer (a Linear
        of a 3D array flattens and unflattens it: two more graph nodes). A pipeline stage before
        the last hands its output to the next rank and returns None. A ragged step (B = 1: several
        sequences side by side) keeps the last position of each wanted sequence instead. `images`
        (`gemma4_vision.ImageRows`): soft tokens that replace the embeddings of some rows."""
        cfg = self.cfg
        B, L = ids.shape
        H = cfg.hidden_size
        first, end = self.span
        flat = ids.reshape(B * L)
        if images is not None:  # an image's rows embed as the pad id (0), then take its soft tokens
            flat[images.rows] = 0
        x = self.embed(flat) if first == 0 else self.pipeline.receive((B, L, H)).reshape(B * L, H)
        if images is not None and first == 0:
            x[images.rows] = images.features.astype(x.dtype)
        ple = self.per_layer_inputs(flat, x) if cfg.hidden_size_per_layer_input else None
        shared = max(first, min(end, cfg.first_shared_layer))
        x, kvs = self._layers(range(first, shared), x, step, ple, {})
        if shared < end:  # KV-shared layers store nothing: run them only where their output is used
            narrowed = _narrow(step, B, keep, x, ple, kvs)
            if narrowed is None:
                return None
            step, x, ple, kvs = narrowed
            x, _ = self._layers(range(shared, end), x, step, ple, kvs)
        if end < cfg.num_hidden_layers:
            self.pipeline.send(x.reshape(B, -1, H))
            return None
        narrowed = _narrow(step, B, keep, x)
        return None if narrowed is None else self.norm(narrowed[1])

    def _layers(self, layers: range, x: mx.array, step, ple: Optional[mx.array], kvs: dict) -> tuple:
        """Run `layers` on x; `kvs`: the K/V of the layers KV-shared layers read, kept as they run."""
        if ple is not None:  # each layer's (N, P) signal: one split, not a slice and a squeeze per layer
            ple = mx.split(ple.reshape(ple.shape[0], -1), self.cfg.num_hidden_layers, axis=-1)
        for i in layers:
            src = self.cfg.kv_source(i)
            x, kv = self.layers[i](x, step, kvs.get(src), ple[i] if ple is not None else None)
            if src == i and i in self.sources:
                kvs[i] = kv
        return x, kvs


def _narrow(step, rows: int, keep: Optional[int], x: mx.array, ple: Optional[mx.array] = None,
            kvs: Optional[dict] = None) -> Optional[tuple]:
    """The forward from here on over only the positions whose output is wanted: (step, x, ple, kvs)
    cut to them (x and ple: (rows * L, ...)), or None when none is (keep=0, or no wanted row)."""
    if isinstance(step, Ragged):
        if not any(step.wanted):
            return None
        if all(step.wanted) and all(n == 1 for n in step.sizes):
            return step, x, ple, kvs
        index = mx.array(step.last_tokens())
        kvs = kvs and {i: [kv for kv, w in zip(per_row, step.wanted) if w] for i, per_row in kvs.items()}
        return step.last(), x[index], None if ple is None else ple[index], kvs
    if keep == 0:
        return None
    if keep is None or keep == step.positions.shape[1]:
        return step, x, ple, kvs
    return step.last(keep), _last(x, rows, keep), None if ple is None else _last(ple, rows, keep), kvs


def _last(x: mx.array, rows: int, n: int) -> mx.array:
    """The last `n` tokens of each of `rows` rows of x (rows * L, ...)."""
    x = x.reshape(rows, -1, *x.shape[1:])
    return x[:, x.shape[1] - n :].reshape(rows * n, *x.shape[2:])


class Model(nn.Module):
    """Gemma 4 text target. Returns logits, the post-norm hidden state, and the store
    layers' K/V (a view into the cache) for the MTP drafter."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def __call__(self, tokens: mx.array, cache: Optional[KVCache] = None, keep: Optional[int] = None,
                 images=None) -> TargetOutput:
        """Forward `tokens` (B, L) after what `cache` holds. `keep`: only the last `keep`
        positions' outputs are wanted (prompt processing); keep=0 returns logits=hidden=None.
        `images` (`gemma4_vision.ImageRows`): image soft tokens in this forward's rows."""
        cache = cache if cache is not None else self.make_cache(tokens.shape[0])
        if images is not None:
            return self._with_images(tokens, cache, keep, images)
        step = cache.begin(tokens.shape[1])
        # Pipeline sends and the router record are side effects, and the CPU's grouped experts read
        # the routing on the host (models/quantized.py): they run uncompiled.
        grouped = self.config.enable_moe_block and not fused_kernels()
        compilable = step.fixed and self.pipeline is None and moe_block.ROUTER_RECORD is None and not grouped
        with forward_tokens(tokens.shape[1]):
            logits, hidden, keys, values = (self._compiled_forward if compilable else self._forward)(tokens, step, keep)
        cache.keys[:], cache.values[:] = keys, values  # (what a compiled forward returns: new buffers)
        if self.model.span[1] < self.config.num_hidden_layers:
            return self._elsewhere(tokens.shape, keep)
        return TargetOutput(logits, hidden, self.shared_kv(cache))

    def ragged(self, chunks: Sequence[mx.array], caches: Sequence[KVCache],
               wanted: Sequence[bool]) -> TargetOutput:
        """Forward each one-row cache's next tokens `chunks[i]` (1, L_i) in one forward, the rows side
        by side (`cache.Ragged`), each row's K/V and output exactly its own forward's: attention row
        by row, every other op row-wise, products over all rows where each row is computed as if
        alone (`base.rows_apart`; elsewhere each row runs a forward of its own). Returns the logits
        and hidden states (R, 1, ...) of the last position of each of the R wanted rows, in order."""
        if len(chunks) == 1 or not rows_apart():
            return one_by_one(self, chunks, caches, wanted)
        sizes = [c.shape[1] for c in chunks]
        step = Ragged.begin(caches, sizes, wanted)
        with forward_tokens(1, sizes):
            hidden = self.model(mx.concatenate(chunks, axis=1), step)
            logits = None if hidden is None else self.logits(hidden)
        if self.model.span[1] < self.config.num_hidden_layers:
            return self._elsewhere((sum(step.wanted), 1), 1 if any(step.wanted) else 0)
        if hidden is None:
            return TargetOutput(None, None, {})
        return TargetOutput(logits[:, None], hidden[:, None], {})

    def _with_images(self, tokens: mx.array, cache: KVCache, keep: Optional[int], images) -> TargetOutput:
        """A forward whose rows hold image soft tokens: uncompiled, and on the 26B/31B (flag "vision")
        each image's tokens see each other on sliding layers (transformers' mask; full layers causal)."""
        if self.pipeline is not None:
            raise ValueError("images are not supported across a pipeline group")
        bidirectional = self.config.use_bidirectional_attention == "vision"
        step = cache.begin(tokens.shape[1], images.blocks if bidirectional else None)
        with forward_tokens(tokens.shape[1]):
            logits, hidden, keys, values = self._forward(tokens, step, keep, images)
        cache.keys[:], cache.values[:] = keys, values
        return TargetOutput(logits, hidden, self.shared_kv(cache))

    def _forward(self, tokens: mx.array, step: Step, keep: Optional[int], images=None) -> tuple:
        """(logits, hidden, K buffers, V buffers) of one forward."""
        hidden = self.model(tokens, step, keep, images)
        if hidden is None:
            return None, None, step.keys, step.values
        shape = (tokens.shape[0], hidden.shape[0] // tokens.shape[0])
        return self.logits(hidden).reshape(*shape, -1), hidden.reshape(*shape, -1), step.keys, step.values

    # A step that keeps its shapes (decoding, verifying) runs as one compiled graph.
    _compiled_forward = compiled(_forward)

    def _elsewhere(self, shape: tuple[int, int], keep: Optional[int]) -> TargetOutput:
        """An earlier pipeline stage's output: logits and hidden states live on the last rank.
        Zeros stand in for the hidden state the driver carries (only the last rank's drafter reads it)."""
        n = shape[1] if keep is None else keep
        hidden = mx.zeros((shape[0], n, self.config.hidden_size), self.pipeline.dtype) if n else None
        return TargetOutput(None, hidden, {})

    @property
    def pipeline(self):
        """This process's pipeline stage (see `keep_stage`), or None."""
        return self.model.pipeline

    def keep_stage(self, stage) -> None:
        """Become pipeline stage `stage` (duck-typed: `span`, `last`, `dtype`, `receive`, `send`):
        keep only the weights it computes with (its layers; the embedding on the first rank and,
        for the tied head and the drafter's input, on the last; the final norm and head on the
        last) and pass activations to and from its neighbours."""
        first, end = stage.span
        m = self.model
        m.layers = [layer if first <= i < end else None for i, layer in enumerate(m.layers)]
        if first > 0 and not stage.last:
            m.pop("embed_tokens")
        if not stage.last:
            m.pop("norm")
            self.pop("lm_head", None)
        m.pipeline = stage

    def shared_kv(self, cache: KVCache) -> dict:
        """Views of the store layers' K/V (last sliding, last full non-shared layer)."""
        return {t: cache.shared_kv(self.config.store_layer(t)) for t in (SLIDING, FULL)}

    def logits(self, hidden: mx.array) -> mx.array:
        if "lm_head" in self:
            out = self.lm_head(hidden)
        else:
            out = self.model.embed_tokens.as_linear(hidden)
        cap = self.config.final_logit_softcapping
        return softcap(out, cap) if cap else out

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed(tokens)

    def make_cache(self, batch_size: int = 1, max_rollback: int = 0) -> KVCache:
        cfg = self.config
        types = cfg.layer_types[: cfg.first_shared_layer]
        return KVCache(types, cfg.sliding_window, batch_size, max_rollback)

    # ---- weights -------------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF / mlx-community names -> ours. Pure and idempotent."""
        out = {}
        first = self.config.first_shared_layer
        for key, value in weights.items():
            key = rename(key)
            if key is None:
                continue
            m = re.match(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.", key + ".")
            if m and int(m.group(1)) >= first:
                continue  # KV-shared layers ship unused K/V weights
            if key.endswith("experts.gate_up_proj"):  # (E, 2I, H): gate's rows, then up's, as `join` keeps them
                out[key.replace("gate_up_proj", "switch_glu.gate_up_proj.weight")] = value
                continue
            if key.endswith("experts.down_proj"):
                key += ".weight"
                key = key.replace("experts.down_proj", "experts.switch_glu.down_proj")
            if key == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            out[key] = value
        return join(out)

    def quant_predicate(self, path: str, module: nn.Module):
        """Default recipe: the MoE router, and the MoE layers' small always-on dense MLP, stay
        at 8 bits (as mlx-community's 26B-A4B conversion); norms and scalars are not modules."""
        if path.endswith("router.proj"):
            return {"group_size": 64, "bits": 8}
        if self.config.enable_moe_block and re.search(r"layers\.\d+\.mlp\.(gate_up|gate|up|down)_proj$", path):
            return {"group_size": 64, "bits": 8}
        return True


_DROPPED = re.compile(
    r"^(vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector|vision_embedder)\."
)


def rename(key: str) -> Optional[str]:
    """One checkpoint key to our name, None to drop. Shared with quantization records."""
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if key.startswith(prefix):
            key = "model." + key[len(prefix) :]
            break
    bare = key[len("model.") :] if key.startswith("model.") else key
    if _DROPPED.match(bare) or "rotary_emb" in key or re.search(r"\.(input|output)_(min|max)$", key):
        return None
    if key.startswith("lm_head"):
        return key
    if not key.startswith("model."):
        log.debug("unexpected key %s", key)
    return key
