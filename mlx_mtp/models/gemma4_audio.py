"""Gemma 4 audio encoder (`gemma4_audio`, E2B/E4B) and the embedder of its soft tokens into the text model.

Log-mel frames (B, T, 128) become soft tokens at a quarter of the frame rate: a subsample conv
projection (two 3x3 stride-2 convs, each with a LayerNorm over channels and a ReLU), USM conformer
layers (half feed-forward, local self-attention with relative positions, light causal conv, half
feed-forward), `output_proj`, then `embed_audio` (an RMSNorm without scale and a projection to the
text width). Padding frames (`valid` false) never reach a real frame: the convs read them zeroed,
attention masks them as keys, and the light conv only looks back.

Attention follows transformers 5.23's blocked form: queries in chunks of `attention_chunk_size`,
each chunk against a context of keys from `attention_context_left - 1` frames before it. A frame
attends to itself and the 11 frames before it (12 keys), although the relative-position table has
13 distances (the 13th is never used).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .base import BaseConfig, ConfigError, fill
from .gemma4_vision import ClippableLinear, MultimodalEmbedder, RMSNorm

# transformers builds these RMSNorms with its default eps, not the config's `rms_norm_eps`
NORM_EPS = 1e-6


@dataclasses.dataclass
class AudioConfig(BaseConfig):
    """`audio_config` of a `gemma4` checkpoint; defaults are transformers' (the released E2B/E4B values)."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: Sequence[int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ConfigError(f"unsupported audio hidden_act {self.hidden_act!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"audio hidden_size {self.hidden_size} is not a multiple of "
                              f"its {self.num_attention_heads} heads")
        if len(self.subsampling_conv_channels) != 2:
            raise ConfigError("the audio subsample projection has exactly two conv layers")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def past(self) -> int:
        """Frames before a query that it may see (11 released: `attention_context_left` counts the query)."""
        return self.attention_context_left - 1

    @property
    def context(self) -> int:
        """Keys per chunk of queries: the chunk plus its past and future horizons."""
        return self.attention_chunk_size + self.past + self.attention_context_right


def clamp(x: mx.array, limit: float) -> mx.array:
    """transformers' `gradient_clipping` (1e10: a no-op unless activations blow up), in the dtype's range."""
    limit = min(limit, float(mx.finfo(x.dtype).max))
    return mx.clip(x, -limit, limit)


class SubsampleLayer(nn.Module):
    """3x3 stride-2 conv (no bias), LayerNorm over channels (weight only), ReLU; channel-last (B, T, F, C)."""

    def __init__(self, dims_in: int, dims_out: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(dims_in, dims_out, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(dims_out, eps=eps, bias=False)

    def __call__(self, x: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
        x = x * valid[:, :, None, None].astype(x.dtype)  # the conv reads padding frames as zeros
        return nn.relu(self.norm(self.conv(x))), valid[:, ::2]


class SubsampleConvProjection(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        c0, c1 = cfg.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, c0, cfg.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, cfg.rms_norm_eps)
        # transformers sizes this from c0 // 4, which is the mel bins / 4 only because both are 128
        self.input_proj_linear = nn.Linear(c0 // 4 * c1, cfg.hidden_size, bias=False)

    def __call__(self, features: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
        """features (B, T, mel) -> (B, ceil(ceil(T/2)/2), hidden); rows flatten as (freq, channel)."""
        x, valid = self.layer0(features[..., None], valid)
        x, valid = self.layer1(x, valid)
        B, T, F, C = x.shape
        return self.input_proj_linear(x.reshape(B, T, F * C)), valid


def relative_positions(cfg: AudioConfig) -> mx.array:
    """Sinusoidal table (context // 2 + 1, hidden), rows for distances context // 2 down to 0,
    each row [sin(d * tau), cos(d * tau)] with tau_i = 1e4^(-i / (hidden / 2 - 1))."""
    half = cfg.hidden_size // 2
    inv = mx.exp(mx.arange(half, dtype=mx.float32) * -(math.log(1e4) / max(half - 1, 1)))
    scaled = mx.arange(cfg.context // 2, -1, -1, dtype=mx.float32)[:, None] * inv
    return mx.concatenate([mx.sin(scaled), mx.cos(scaled)], axis=-1)


def chunks(x: mx.array, size: int) -> mx.array:
    """(B, T, ...) -> (B, ceil(T / size), size, ...), zero-padded at the end."""
    n = -(-x.shape[1] // size)
    x = mx.pad(x, [(0, 0), (0, n * size - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], n, size, *x.shape[2:])


def contexts(x: mx.array, cfg: AudioConfig) -> mx.array:
    """(B, T, ...) -> (B, chunks, context, ...): each query chunk's keys, from `past` frames before
    the chunk to `attention_context_right` after it, zero (or false) outside 0 .. T - 1."""
    C, P = cfg.attention_chunk_size, cfg.past
    n = -(-x.shape[1] // C)
    x = mx.pad(x, [(0, 0), (P, cfg.context - C - P + n * C - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    index = np.arange(n)[:, None] * C + np.arange(cfg.context)
    return x[:, mx.array(index)]


def local_mask(cfg: AudioConfig, valid: mx.array) -> mx.array:
    """(B, 1, chunks, chunk, context) bool: which keys each query may see. Query i of chunk n is frame
    n * chunk + i; context slot j is frame n * chunk - past + j, so their distance is past + i - j.
    transformers' window: distance 0 .. past - 1 (or down to -(context_right - 1)), and a valid key."""
    i = np.arange(cfg.attention_chunk_size)[:, None]
    dist = cfg.past + i - np.arange(cfg.context)
    band = ((dist >= 0) & (dist < cfg.past)) | ((dist < 0) & (-dist < cfg.attention_context_right))
    return (mx.array(band) & contexts(valid, cfg)[:, :, None, :])[:, None]


def relative_index(cfg: AudioConfig) -> mx.array:
    """(chunk, context) int32: for query i and context slot j, the row j - i of the positions table
    (distance context // 2 - (j - i)), or one past the table (a zero logit) where there is no row.
    This is transformers' Transformer-XL `_rel_shift` wherever the mask lets a key in."""
    rows = cfg.context // 2 + 1
    shift = np.arange(cfg.context) - np.arange(cfg.attention_chunk_size)[:, None]
    return mx.array(np.where((shift >= 0) & (shift < rows), shift, rows).astype(np.int32))


class Attention(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        D = cfg.hidden_size
        self.cfg, self.heads, self.head_dim = cfg, cfg.num_attention_heads, cfg.head_dim
        self.q_proj = ClippableLinear(cfg, D, D)
        self.k_proj = ClippableLinear(cfg, D, D)
        self.v_proj = ClippableLinear(cfg, D, D)
        self.post = ClippableLinear(cfg, D, D)
        self.relative_k_proj = nn.Linear(D, D, bias=False)
        self.per_dim_scale = mx.zeros((cfg.head_dim,))
        self.q_scale = cfg.head_dim**-0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)

    def __call__(self, x: mx.array, positions: mx.array, mask: mx.array) -> mx.array:
        """x (B, T, D), positions (rows, D) the sinusoid table, mask from `local_mask`."""
        cfg, (B, T, D) = self.cfg, x.shape
        shape = (B, T, self.heads, self.head_dim)
        # in float32 from the projections on, as transformers
        q = self.q_proj(x).astype(mx.float32).reshape(shape) * self.q_scale * nn.softplus(self.per_dim_scale)
        k = self.k_proj(x).astype(mx.float32).reshape(shape) * self.k_scale
        v = self.v_proj(x).astype(mx.float32).reshape(shape)
        q = chunks(q, cfg.attention_chunk_size).transpose(0, 3, 1, 2, 4)  # (B, H, n, chunk, hd)
        k = contexts(k, cfg).transpose(0, 3, 1, 4, 2)  # (B, H, n, hd, context)
        v = contexts(v, cfg).transpose(0, 3, 1, 2, 4)  # (B, H, n, context, hd)
        rel = self.relative_k_proj(positions).astype(mx.float32).reshape(-1, self.heads, self.head_dim)
        by_distance = q @ rel.transpose(1, 2, 0)[None, :, None]  # (B, H, n, chunk, rows)
        by_distance = mx.pad(by_distance, [(0, 0)] * 4 + [(0, 1)])
        scores = q @ k + mx.take_along_axis(by_distance, relative_index(cfg)[None, None, None], axis=-1)
        cap = cfg.attention_logit_cap
        scores = mx.tanh(scores / cap) * cap
        scores = mx.where(mask, scores, cfg.attention_invalid_logits_value)
        out = mx.softmax(scores, axis=-1) @ v  # (B, H, n, chunk, hd)
        out = out.transpose(0, 2, 3, 1, 4).reshape(B, -1, D)[:, :T]
        return self.post(out.astype(x.dtype))


class FeedForward(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        D = cfg.hidden_size
        self.pre_layer_norm = RMSNorm(D, NORM_EPS)
        self.ffw_layer_1 = ClippableLinear(cfg, D, 4 * D)
        self.ffw_layer_2 = ClippableLinear(cfg, 4 * D, D)
        self.post_layer_norm = RMSNorm(D, NORM_EPS)
        self.clip, self.scale = cfg.gradient_clipping, cfg.residual_weight

    def __call__(self, x: mx.array) -> mx.array:
        h = self.ffw_layer_2(nn.silu(self.ffw_layer_1(self.pre_layer_norm(clamp(x, self.clip)))))
        return x + self.post_layer_norm(clamp(h, self.clip)) * self.scale


class LightConv1d(nn.Module):
    """GLU, a causal depthwise conv (a frame sees itself and the kernel - 1 before it), SiLU."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        D, K = cfg.hidden_size, cfg.conv_kernel_size
        self.pre_layer_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.linear_start = ClippableLinear(cfg, D, 2 * D)
        self.depthwise_conv1d = nn.Conv1d(D, D, K, groups=D, bias=False)
        self.conv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.linear_end = ClippableLinear(cfg, D, D)
        self.clip, self.kernel = cfg.gradient_clipping, K

    def __call__(self, x: mx.array) -> mx.array:
        h, gate = mx.split(self.linear_start(self.pre_layer_norm(x)), 2, axis=-1)
        h = self.depthwise_conv1d(mx.pad(h * mx.sigmoid(gate), [(0, 0), (self.kernel - 1, 0), (0, 0)]))
        return x + self.linear_end(nn.silu(self.conv_norm(clamp(h, self.clip))))


class ConformerLayer(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        D = cfg.hidden_size
        self.feed_forward1 = FeedForward(cfg)
        self.norm_pre_attn = RMSNorm(D, NORM_EPS)
        self.self_attn = Attention(cfg)
        self.norm_post_attn = RMSNorm(D, NORM_EPS)
        self.lconv1d = LightConv1d(cfg)
        self.feed_forward2 = FeedForward(cfg)
        self.norm_out = RMSNorm(D, NORM_EPS)
        self.clip = cfg.gradient_clipping

    def __call__(self, x: mx.array, positions: mx.array, mask: mx.array) -> mx.array:
        h = self.feed_forward1(x)
        attn = self.self_attn(self.norm_pre_attn(clamp(h, self.clip)), positions, mask)
        h = h + self.norm_post_attn(clamp(attn, self.clip))
        h = self.feed_forward2(self.lconv1d(h))
        return self.norm_out(clamp(h, self.clip))


class AudioTower(nn.Module):
    """`audio_tower`: log-mel frames -> encoder states (B, T', output_proj_dims) and their validity."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.config = cfg
        self.subsample_conv_projection = SubsampleConvProjection(cfg)
        self.layers = [ConformerLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True)

    def __call__(self, features: mx.array, valid: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
        """features (B, T, mel), valid (B, T) bool (None: every frame) -> states (B, T', out) and
        valid (B, T') with T' = ceil(ceil(T / 2) / 2). States of invalid rows are not zeroed."""
        B, T = features.shape[:2]
        if valid is None:
            valid = mx.ones((B, T), dtype=mx.bool_)
        dtype = self.subsample_conv_projection.layer0.conv.weight.dtype  # convs are never quantized
        if T == 0:  # a clip under one frame (< 161 samples): no soft tokens
            return mx.zeros((B, 0, self.config.output_proj_dims), dtype=dtype), valid.astype(mx.bool_)
        x, valid = self.subsample_conv_projection(features.astype(dtype), valid.astype(mx.bool_))
        positions, mask = relative_positions(self.config).astype(x.dtype), local_mask(self.config, valid)
        for layer in self.layers:
            x = layer(x, positions, mask)
        return self.output_proj(x), valid


class Audio(nn.Module):
    """The audio path of an E2B/E4B `gemma4` checkpoint: `audio_tower` and `embed_audio`."""

    def __init__(self, cfg: AudioConfig, text_hidden: int):
        super().__init__()
        self.config = cfg
        self.audio_tower = AudioTower(cfg)
        self.embed_audio = MultimodalEmbedder(cfg.output_proj_dims, text_hidden, cfg.rms_norm_eps)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Audio":
        """From a `gemma4` config.json dict (its `audio_config` and `text_config`)."""
        if not config.get("audio_config"):
            raise ConfigError("this checkpoint has no audio_config: it takes no audio")
        text = config.get("text_config", config)
        return cls(AudioConfig.from_dict(config["audio_config"]), text["hidden_size"])

    def __call__(self, features: mx.array, valid: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
        """Soft tokens (B, T', text hidden) of log-mel `features` (B, T, mel), and which rows are real
        (B, T'); a padded clip's rows equal those of the clip run alone."""
        states, valid = self.audio_tower(features, valid)
        return self.embed_audio(states), valid

    def soft_tokens(self, features: mx.array, valid: Optional[mx.array] = None) -> list[mx.array]:
        """Each clip's real soft tokens (n_i, text hidden): what its audio placeholders take."""
        tokens, valid = self(features, valid)
        rows = [np.flatnonzero(np.array(v)) for v in valid]
        return [t[mx.array(r.astype(np.int32))] for t, r in zip(tokens, rows)]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The audio tensors of a checkpoint under our names, every other tensor dropped. HF names are
        `model.audio_tower.*` / `model.embed_audio.*`; MLX conversions drop `model.` and store the
        convs channel-last, which is ours: a conv whose shape differs from ours is transposed."""
        shapes = {k: v.shape for k, v in tree_flatten(self.parameters())}
        out = {}
        for key, value in weights.items():
            bare = key[len("model."):] if key.startswith("model.") else key
            if not bare.startswith(("audio_tower.", "embed_audio.")):
                continue
            if value.ndim >= 3 and value.shape != shapes.get(bare, value.shape):
                value = value.transpose(0, *range(2, value.ndim), 1)  # torch (out, in, *k) -> (out, *k, in)
            out[bare] = value
        return out


def audio_from_weights(config: dict[str, Any], weights: dict[str, mx.array],
                       dtype: Optional[mx.Dtype] = mx.bfloat16, evaluate: bool = True) -> Audio:
    """The audio path of a `gemma4` checkpoint from its config.json dict and its tensors (any other
    tensors are ignored), floating tensors cast to `dtype` (None: as stored). Layers with `.scales`
    (mlx-community quantizes `embed_audio`) are built quantized, with the record's group size and bits."""
    audio = Audio.from_config(config)
    weights = audio.sanitize(weights)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    return fill(audio, weights, config, evaluate)
