"""Gemma 4 12B (`gemma4_unified`, and its text config `gemma4_unified_text`).

The text decoder is `gemma4`'s: transformers' `Gemma4UnifiedTextModel` has the same weights and
computes the same outputs, so only the config defaults differ here (`Config`). The 12B has no vision
or audio tower: an image's raw 48x48 pixel patches and an audio clip's raw 640-sample frames are
embedded by a few row-wise layers (`Embedders`), whose rows then replace the placeholder tokens'
embeddings. The image arithmetic (48-pixel patches in raster order, their (x, y)) is here too; the
resize and the soft-token count are `gemma4`'s (`formats.images.target_size`, same 16 x 3 pixel grid),
the audio framing is `formats.audio.unified_frames`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import gemma4
from .base import BaseConfig, ConfigError, fill, rms_norm
from .quantized import Linear

# The text model and the checkpoint layout API (loading, convert) are gemma4's.
Model = gemma4.Model
rename, join, joined_name, parts, unjoin, keeping_parts = (
    gemma4.rename, gemma4.join, gemma4.joined_name, gemma4.parts, gemma4.unjoin, gemma4.keeping_parts)

RESCALE = np.float32(0.00392156862745098)  # the processor's x * (1/255), in float32 arithmetic


@dataclasses.dataclass
class Config(gemma4.Config):
    """`gemma4_unified_text` (transformers' `Gemma4UnifiedTextConfig` defaults where a key is absent)."""

    sliding_window: int = 1024
    max_position_embeddings: int = 262144
    global_head_dim: Optional[int] = 512
    use_bidirectional_attention: Optional[str] = "vision"
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0

    def __post_init__(self):
        # transformers' unified decoder has no per-layer embeddings or MoE block: the released files
        # spell out `vocab_size_per_layer_input: 262144` and `enable_moe_block: false`, read by nothing
        self.hidden_size_per_layer_input = 0
        self.enable_moe_block = False
        super().__post_init__()


# ---- the encoder-free embedders --------------------------------------------------------------


@dataclasses.dataclass
class VisionConfig(BaseConfig):
    """`vision_config` of a `gemma4_unified` checkpoint."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    mm_embed_dim: int = 3840
    mm_posemb_size: int = 1120
    output_proj_dims: int = 3840  # the projection's input width (it reads mm_embed_dim rows), despite the name
    rms_norm_eps: float = 1e-6
    model_patch_size: Optional[int] = None  # patch_size * pooling_kernel_size
    _IGNORED = BaseConfig._IGNORED | {"num_soft_tokens"}  # the budget is the processor's

    def __post_init__(self):
        if self.model_patch_size not in (None, self.patch):
            raise ConfigError(f"model_patch_size {self.model_patch_size} != patch_size * pooling_kernel_size")
        if self.output_proj_dims != self.mm_embed_dim:
            raise ConfigError(f"output_proj_dims {self.output_proj_dims} != mm_embed_dim {self.mm_embed_dim}")

    @property
    def patch(self) -> int:
        """Side of the pixel square one soft token embeds (48)."""
        return self.patch_size * self.pooling_kernel_size


@dataclasses.dataclass
class AudioConfig(BaseConfig):
    """`audio_config` of a `gemma4_unified` checkpoint: one width, under four names in transformers."""

    audio_embed_dim: int = 640
    rms_norm_eps: float = 1e-6
    hidden_size: Optional[int] = None
    output_proj_dims: Optional[int] = None
    audio_samples_per_token: Optional[int] = None

    def __post_init__(self):
        for name in ("hidden_size", "output_proj_dims", "audio_samples_per_token"):
            if getattr(self, name) not in (None, self.audio_embed_dim):
                raise ConfigError(f"audio_config {name} {getattr(self, name)} != audio_embed_dim {self.audio_embed_dim}")


class Projection(nn.Module):
    """RMSNorm without scale, then a Linear to the text width (transformers' `MultimodalEmbedder`)."""

    def __init__(self, dims: int, hidden: int, eps: float):
        super().__init__()
        self.embedding_projection = Linear(dims, hidden, bias=False)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(rms_norm(x, None, self.eps))


class LayerNorm(nn.LayerNorm):
    """LayerNorm with a second pass over the mean, in float32. A flat patch (a white background) has zero
    variance, so eps sets the scale and (x - mean) / sqrt(eps) magnifies any error in the mean ~300x:
    a one-pass float32 mean over 6912 pixels is off by far more than transformers' (5e-2 in the
    embedding, measured); the corrected one is exact on a flat patch."""

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(mx.float32)
        mean = mx.mean(y, axis=-1, keepdims=True)
        mean = mean + mx.mean(y - mean, axis=-1, keepdims=True)
        d = y - mean
        y = d * mx.rsqrt(mx.mean(mx.square(d), axis=-1, keepdims=True) + self.eps)
        return (y * self.weight.astype(mx.float32) + self.bias.astype(mx.float32)).astype(x.dtype)


class PatchEmbedder(nn.Module):
    """Raw 48x48x3 patches -> LayerNorm -> Linear -> LayerNorm -> + (x, y) position rows -> LayerNorm."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width, dims = 3 * cfg.patch**2, cfg.mm_embed_dim
        self.patch_ln1 = LayerNorm(width, eps=1e-5)
        self.patch_dense = Linear(width, dims, bias=True)
        self.patch_ln2 = LayerNorm(dims, eps=1e-5)
        self.pos_embedding = mx.zeros((cfg.mm_posemb_size, 2, dims))  # (position, axis x / y, dims)
        self.pos_norm = LayerNorm(dims, eps=1e-5)

    def __call__(self, pixels: mx.array, positions: mx.array) -> mx.array:
        # pixels are rounded to the weights' dtype before the first norm, as transformers does
        x = self.patch_ln2(self.patch_dense(self.patch_ln1(pixels.astype(self.patch_ln1.weight.dtype))))
        where = self.pos_embedding[positions, mx.arange(2)]  # (n, 2, dims): x's row, then y's
        return self.pos_norm(x + (where[:, 0] + where[:, 1]))


class Embedders(nn.Module):
    """The 12B's image and audio embedders, named as its checkpoint is (`model.` dropped): an image's
    soft tokens are `embed_vision(vision_embedder(pixels, positions))`, a clip's `embed_audio(frames)`.
    Every op is row-wise, so each image or clip runs alone over its real rows."""

    def __init__(self, vision: Optional[VisionConfig], audio: Optional[AudioConfig], hidden: int):
        super().__init__()
        if vision is not None:
            self.vision_embedder = PatchEmbedder(vision)
            self.embed_vision = Projection(vision.mm_embed_dim, hidden, vision.rms_norm_eps)
        if audio is not None:
            self.embed_audio = Projection(audio.audio_embed_dim, hidden, audio.rms_norm_eps)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Embedders":
        """From a `gemma4_unified` config.json dict."""
        vision, audio = config.get("vision_config"), config.get("audio_config")
        if not vision and not audio:
            raise ConfigError("this checkpoint has neither vision_config nor audio_config")
        return cls(VisionConfig.from_dict(vision) if vision else None, AudioConfig.from_dict(audio) if audio else None,
                   config.get("text_config", config)["hidden_size"])

    def image(self, pixels, positions) -> mx.array:
        """(n, text hidden) soft tokens of one image: pixels (n, 6912) in [0, 1] (`image_patches`),
        positions (n, 2) (x, y) of its real patches."""
        if "vision_embedder" not in self:
            raise ConfigError("this checkpoint has no vision_config: it takes no images")
        return self.embed_vision(self.vision_embedder(mx.array(pixels), mx.array(np.asarray(positions))))

    def audio(self, frames) -> mx.array:
        """(n, text hidden) soft tokens of one clip's frames (n, 640): consecutive 16 kHz samples, the
        last frame zero-padded (`formats.audio.unified_frames`)."""
        if "embed_audio" not in self:
            raise ConfigError("this checkpoint has no audio_config: it takes no audio")
        return self.embed_audio(mx.array(frames).astype(_dtype(self.embed_audio.embedding_projection)))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The embedders' tensors of a checkpoint (as released, `model.vision_embedder.*` /
        `model.embed_{vision,audio}.*`, or transformers' in-memory names, with or without `model.`),
        under our names; every other tensor dropped."""
        out = {}
        for key, value in weights.items():
            bare = key[len("model."):] if key.startswith("model.") else key
            bare = bare.replace("embed_vision.multimodal_embedder.", "embed_vision.")
            for part in ("patch_ln1", "patch_dense", "patch_ln2", "pos_embedding", "pos_norm"):
                bare = bare.replace(f"embed_vision.{part}", f"vision_embedder.{part}")
            if bare.startswith(("vision_embedder.", "embed_vision.", "embed_audio.")):
                out[bare] = value
        return out


def _dtype(layer: nn.Module) -> mx.Dtype:
    """A (possibly quantized) layer's compute dtype: transformers rounds the samples to it first."""
    return layer.scales.dtype if "scales" in layer else layer.weight.dtype


def embedders_from_weights(config: dict[str, Any], weights: dict[str, mx.array], evaluate: bool = True) -> Embedders:
    """The image and audio embedders of a `gemma4_unified` checkpoint from its config.json dict and its
    tensors (others ignored). Layers whose `.scales` the checkpoint has are quantized, with the
    record's bits and group size."""
    embedders = Embedders.from_config(config)
    return fill(embedders, embedders.sanitize(weights), config, evaluate)


# ---- pixels in ---------------------------------------------------------------------------------


def image_patches(codes: np.ndarray, patch: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """An image already at its target size (`formats.images.target_size`) as the 12B's processor
    gives it, without torch: (pixels (n, patch * patch * 3) float32, positions (n, 2) int32 (x, y)).

    codes: (H, W, 3) uint8 RGB, sides multiples of `patch`. transformers cuts 16-pixel patches and
    merges each 3x3 block (`patches_merge`): that is a plain raster of 48-pixel patches, rows of
    blocks top to bottom, each block's pixels row by row with RGB innermost, rescaled as x * fp32(1/255).
    """
    H, W, C = codes.shape
    if H % patch or W % patch or C != 3:
        raise ValueError(f"an image of {H}x{W}x{C} is not made of {patch}-pixel RGB patches")
    rows, cols = H // patch, W // patch
    blocks = codes.reshape(rows, patch, cols, patch, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
    x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    positions = np.stack([x, y], axis=-1).reshape(-1, 2).astype(np.int32)
    return blocks.astype(np.float32) * RESCALE, positions

