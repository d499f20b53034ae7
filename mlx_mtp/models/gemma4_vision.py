"""Gemma 4 vision encoder (`gemma4_vision`) and the embedder of its soft tokens into the text model.

An image's 16x16 patches (`mlx_mtp.formats.images`) become soft tokens: a linear patch embedding plus a
learned (x, y) position table, a ViT with 2D rotary attention over the image's own patches, 3x3
average pooling, then an RMSNorm without scale and a projection to the text width (`embed_vision`).
Each image runs alone over its real patches only: transformers pads images to one length and masks
the padding keys, which gives the same values (padding rows are dropped after pooling).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, NamedTuple, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .base import BaseConfig, ConfigError, fill, gelu_tanh_glu, rms_norm
from .gemma4 import attention


@dataclasses.dataclass
class VisionConfig(BaseConfig):
    """`vision_config` of a `gemma4` checkpoint; defaults are transformers' where one may be omitted."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    rms_norm_eps: float = 1e-6
    rope_parameters: Optional[dict] = None
    standardize: bool = False
    use_clipped_linears: bool = False
    hidden_activation: str = "gelu_pytorch_tanh"
    # read by nothing here: the soft-token budget is the image processor's
    default_output_length: Optional[int] = None
    global_head_dim: Optional[int] = None
    attention_bias: bool = False
    max_position_embeddings: Optional[int] = None

    def __post_init__(self):
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 100.0}
        if self.rope_parameters.get("rope_type", "default") not in ("default", "axial"):
            raise ConfigError(f"unsupported vision rope_type {self.rope_parameters.get('rope_type')!r}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"unsupported vision hidden_activation {self.hidden_activation!r}")
        if self.head_dim % 4:
            raise ConfigError(f"vision head_dim {self.head_dim} is not a multiple of 4 (2D rotary halves)")

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 100.0))


class ClippableLinear(nn.Module):
    """A bias-free Linear (`.linear`), its input and output clamped to the checkpoint's scalars
    when the config says so (E2B/E4B)."""

    def __init__(self, cfg: VisionConfig, dims_in: int, dims_out: int):
        super().__init__()
        self.linear = nn.Linear(dims_in, dims_out, bias=False)
        if cfg.use_clipped_linears:
            self.input_min, self.input_max = mx.array(-math.inf), mx.array(math.inf)
            self.output_min, self.output_max = mx.array(-math.inf), mx.array(math.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if "input_min" not in self:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        y = self.linear(x)
        return mx.clip(y, self.output_min.astype(y.dtype), self.output_max.astype(y.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight, self.eps)


class Rope2D:
    """Axial 2D rotary embedding: a head's first half rotates by the patch's x, its second half by
    its y, each half by `rotate_half` within itself. Tables are built on the host in float64 from the
    float32 angles transformers computes (positions are host data: they come from the processor)."""

    def __init__(self, head_dim: int, theta: float):
        quarter = head_dim // 4
        exponent = np.arange(0, 2 * quarter, 2, dtype=np.float32) / np.float32(2 * quarter)
        self.inv_freq = (1.0 / (np.float64(theta) ** exponent.astype(np.float64))).astype(np.float32)
        half, idx = head_dim // 2, np.arange(head_dim)
        # rotate_half within each half: (a, b) -> (-b, a)
        within = idx % half
        self.perm = mx.array(np.where(within < half // 2, idx + half // 2, idx - half // 2).astype(np.int32))
        self.sign = mx.array(np.where(within < half // 2, -1.0, 1.0).astype(np.float32))

    def table(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        """(cos, sin), each (n, head_dim), of patch positions (n, 2) as (x, y)."""
        angles = positions[:, :, None].astype(np.float32) * self.inv_freq  # (n, 2, hd/4), float32 as torch
        angles = np.concatenate([angles[:, 0], angles[:, 0], angles[:, 1], angles[:, 1]], axis=-1)
        angles = angles.astype(np.float64)
        return mx.array(np.cos(angles).astype(np.float32)), mx.array(np.sin(angles).astype(np.float32))

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """x (n, heads, head_dim) rotated; cos/sin (n, head_dim)."""
        rotated = mx.take(x, self.perm, axis=-1) * self.sign.astype(x.dtype)
        return (x * cos[:, None].astype(x.dtype) + rotated * sin[:, None].astype(x.dtype)).astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = cfg.num_attention_heads, cfg.num_key_value_heads, hd, cfg.rms_norm_eps
        self.q_proj = ClippableLinear(cfg, D, self.heads * hd)
        self.k_proj = ClippableLinear(cfg, D, self.kv_heads * hd)
        self.v_proj = ClippableLinear(cfg, D, self.kv_heads * hd)
        self.o_proj = ClippableLinear(cfg, self.heads * hd, D)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, rope: Rope2D, cos: mx.array, sin: mx.array) -> mx.array:
        n, hd = x.shape[0], self.head_dim
        q = rope(self.q_norm(self.q_proj(x).reshape(n, self.heads, hd)), cos, sin)
        k = rope(self.k_norm(self.k_proj(x).reshape(n, self.kv_heads, hd)), cos, sin)
        v = rms_norm(self.v_proj(x).reshape(n, self.kv_heads, hd), None, self.eps)
        q, k, v = (t.transpose(1, 0, 2)[None] for t in (q, k, v))
        out = attention(q, k, v, None)  # every patch sees every patch of its image, scale 1
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(n, self.heads * hd))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = ClippableLinear(cfg, cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x):
        return self.down_proj(gelu_tanh_glu(self.gate_proj(x), self.up_proj(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.pre_feedforward_layernorm = RMSNorm(D, eps)
        self.post_feedforward_layernorm = RMSNorm(D, eps)

    def __call__(self, x, rope, cos, sin):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, cfg.position_embedding_size, cfg.hidden_size))

    def __call__(self, pixels: mx.array, positions: mx.array) -> mx.array:
        """pixels (n, 3 * patch^2) in [0, 1], positions (n, 2) as (x, y) -> (n, hidden)."""
        w = self.input_proj.weight
        x = self.input_proj((2 * (pixels - 0.5)).astype(w.dtype))  # the model, not the processor, centres pixels
        table = self.position_embedding_table
        return x + (table[0][positions[:, 0]] + table[1][positions[:, 1]]).astype(x.dtype)


class VisionTower(nn.Module):
    """`vision_tower`: patches of one image -> its pooled, standardized soft tokens (N, hidden)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg.standardize:
            self.std_bias = mx.zeros((cfg.hidden_size,))
            self.std_scale = mx.ones((cfg.hidden_size,))
        self.rope = Rope2D(cfg.head_dim, cfg.rope_theta)

    def __call__(self, pixels: mx.array, positions: np.ndarray) -> mx.array:
        if positions.min() < 0 or positions.max() >= self.config.position_embedding_size:
            raise ValueError(f"patch positions must lie in 0..{self.config.position_embedding_size - 1} "
                             "(the encoder's position table)")
        cos, sin = self.rope.table(positions)
        x = self.patch_embedder(pixels, mx.array(positions.astype(np.int32)))
        for layer in self.encoder.layers:
            x = layer(x, self.rope, cos, sin)
        pooled = pool(x, positions, self.config.pooling_kernel_size) * math.sqrt(self.config.hidden_size)
        if "std_bias" in self:  # in float32: the bias cancels large values
            pooled = (pooled - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return pooled.astype(x.dtype)


def pool(x: mx.array, positions: np.ndarray, k: int) -> mx.array:
    """Average of each k x k block of patches, in float32, blocks in row-major order (as
    transformers' bins x//k + (width/k)*(y//k)): (n, D) -> (n / k^2, D)."""
    width = int(positions[:, 0].max()) + 1
    bins = positions[:, 0] // k + (width // k) * (positions[:, 1] // k)
    counts = np.bincount(bins)
    if (counts != k * k).any() or len(bins) % (k * k):
        raise ValueError(f"patch grid does not tile into {k}x{k} blocks")
    order = mx.array(np.argsort(bins, kind="stable").astype(np.int32))
    blocks = x[order].astype(mx.float32).reshape(len(counts), k * k, x.shape[-1])
    return (blocks * (1.0 / (k * k))).sum(axis=1)


class MultimodalEmbedder(nn.Module):
    """`embed_vision`: an RMSNorm without scale, then a projection to the text width."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float):
        super().__init__()
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(rms_norm(x, None, self.eps))


class Vision(nn.Module):
    """The image path of a `gemma4` checkpoint: `vision_tower` and `embed_vision`. Called on one
    processed image (`mlx_mtp.formats.images.Patches`), returns its soft tokens (N, text hidden)."""

    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        self.config = cfg
        self.vision_tower = VisionTower(cfg)
        self.embed_vision = MultimodalEmbedder(cfg.hidden_size, text_hidden, cfg.rms_norm_eps)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Vision":
        """From a `gemma4` config.json dict (its `vision_config` and `text_config`)."""
        if not config.get("vision_config"):
            raise ConfigError("this checkpoint has no vision_config: it takes no images")
        text = config.get("text_config", config)
        return cls(VisionConfig.from_dict(config["vision_config"]), text["hidden_size"])

    def __call__(self, pixels, positions: np.ndarray) -> mx.array:
        """Soft tokens of one image: pixels (n, 3 * patch^2) floats in [0, 1], positions (n, 2) (x, y)
        of its real patches (no padding)."""
        return self.embed_vision(self.vision_tower(mx.array(pixels), np.asarray(positions)))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The vision tensors of a checkpoint (HF `model.vision_tower.*` / `model.embed_vision.*`, or
        mlx-community's without `model.`), under our names; every other tensor dropped."""
        out = {}
        for key, value in weights.items():
            bare = key[len("model."):] if key.startswith("model.") else key
            if bare.startswith(("vision_tower.", "embed_vision.")):
                out[bare] = value
        return out


def vision_from_weights(config: dict[str, Any], weights: dict[str, mx.array], evaluate: bool = True) -> Vision:
    """The image path of a `gemma4` checkpoint from its config.json dict and its tensors (any other
    tensors are ignored). `embed_vision` may be quantized (mlx-community's 4-bit checkpoints): its
    `.scales` say so, with the record's group size and bits."""
    vision = Vision.from_config(config)
    return fill(vision, vision.sanitize(weights), config, evaluate)


class ImageRows(NamedTuple):
    """The media soft tokens of one forward, as `gemma4.Model` takes them (`images=`)."""

    rows: mx.array  # (n,) int32: flat token rows (b * L + i) that take a soft token
    features: mx.array  # (n, text hidden): their soft tokens, in row order
    blocks: Optional[tuple]  # (starts, ends), (B, M) int32 absolute positions of each image's run
    # (KVCache.begin); None where only causal media (audio) are in the forward


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImages:
    """The media of one prompt (images, audio clips): where each one's soft tokens start (absolute
    position of its first placeholder) and the soft tokens themselves, in prompt order."""

    starts: tuple
    features: tuple  # (N_i, text hidden) each
    digests: tuple = ()  # each one's content key (`images.Patches.digest`, a clip's samples' hash)
    causal: tuple = ()  # each one's soft tokens stay causal (audio); images' see each other (26B/31B)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """[start, end) of each image's soft tokens."""
        return [(s, s + int(f.shape[0])) for s, f in zip(self.starts, self.features)]

    def rows(self, start: int, length: int) -> Optional[ImageRows]:
        """The soft tokens among positions start .. start + length - 1 of a one-row forward (None:
        no image there). An image cut by the forward's ends contributes its rows inside it."""
        rows, feats, starts, ends = [], [], [], []
        for i, ((s, e), f) in enumerate(zip(self.spans, self.features)):
            a, b = max(s, start), min(e, start + length)
            if a >= b:
                continue
            rows.append(np.arange(a - start, b - start, dtype=np.int32))
            feats.append(f[a - s : b - s])
            if not (i < len(self.causal) and self.causal[i]):
                starts.append(s)
                ends.append(e)
        if not rows:
            return None
        blocks = (mx.array([starts], dtype=mx.int32), mx.array([ends], dtype=mx.int32)) if starts else None
        return ImageRows(mx.array(np.concatenate(rows)), mx.concatenate(feats, axis=0), blocks)

    def keyed(self, prompt: Sequence[int]) -> list:
        """`prompt` with each image's placeholders replaced by ids drawn from the image's content (its
        digest, else its soft tokens' bytes): negative, so never a token, and equal only for the same
        image at the same place (what the prefix cache keys states by)."""
        out = list(prompt)
        for i, ((s, e), f) in enumerate(zip(self.spans, self.features)):
            digest = self.digests[i] if i < len(self.digests) else hashlib.sha256(np.array(f).tobytes()).hexdigest()
            draws = np.random.default_rng(int(digest[:32], 16)).integers(0, 2**31 - 1, e - s)
            out[s:e] = (-1 - draws).tolist()
        return out

    def cut(self, start: int, end: int) -> int:
        """Where a forward that starts at `start` and would end before `end` should end so that it cuts
        no image: `end` itself, or the start of the image it would cut (the end of that image when
        the image started at `start` or before, so that the forward still moves on)."""
        for s, e in self.spans:
            if s < end < e:
                return s if s > start else e
        return end


def placeholder_runs(ids: Sequence[int], image_token: int) -> list[tuple[int, int]]:
    """[start, end) of each run of `image_token` in ids."""
    ids = np.asarray(ids)
    hit = np.concatenate([[False], ids == image_token, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def expand_placeholders(ids: Sequence[int], counts: Sequence[int], boi: int, image: int, eoi: int) -> list[int]:
    """ids with the i-th lone `image` token (a chat template's placeholder) replaced by boi, counts[i]
    image tokens and eoi, as transformers' `Gemma4Processor` expands them."""
    out, used = [], 0
    for t in ids:
        if t != image:
            out.append(int(t))
            continue
        if used == len(counts):
            raise ValueError(f"the prompt has more image placeholders than the {len(counts)} image(s) given")
        out += [boi] + [image] * counts[used] + [eoi]
        used += 1
    if used != len(counts):
        raise ValueError(f"{len(counts)} image(s) given for {used} image placeholder(s) in the prompt")
    return out
