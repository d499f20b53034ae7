"""Gemma 4 MTP drafter (`gemma4_assistant`), as transformers' `Gemma4AssistantForCausalLM`.

The drafter has no K/V of its own: every layer is KV-shared and cross-attends to the
target's last sliding and last full "store" layers, read in place from the target's cache.
One draft step: x = pre_projection(concat(target_embed(token), h)) -> 4 decoder layers at a
constant query position p (the position of the last target-chosen token) -> norm ->
logits (tied head, or the E2B/E4B centroid head) and h' = post_projection(.) for the next step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import FULL, SLIDING, Step
from ..runtime.jit import small
from . import gemma4
from .base import BaseConfig, ConfigError, DraftOutput, SharedKV, TargetModel, compiled, fused_kernels
from .quantized import Embedding, Linear


@dataclasses.dataclass
class Config(BaseConfig):
    text_config: Optional[dict] = None
    backbone_hidden_size: int = 1536
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    _IGNORED = BaseConfig._IGNORED | {
        "audio_token_id", "boa_token_id", "boi_token_id", "eoa_token_id", "eoi_token_id",
        "image_token_id", "eoa_token_index", "video_token_id",
    }
    _TEXT = gemma4.Config  # the text config's class (the 12B's drafter: `gemma4_unified_text`)

    def __post_init__(self):
        text = dict(self.text_config or {})
        n = text.get("num_hidden_layers", 4)
        text["num_kv_shared_layers"] = n  # every drafter layer reads the target's K/V
        text.setdefault("hidden_size_per_layer_input", 0)
        text.setdefault("vocab_size_per_layer_input", 0)
        self.text = self._TEXT.from_dict(text)
        t = self.text
        if t.hidden_size_per_layer_input or t.enable_moe_block or t.use_double_wide_mlp:
            raise ConfigError("gemma4_assistant text_config must have no PLE, MoE or double-wide MLP")
        if self.use_ordered_embeddings and t.vocab_size % self.num_centroids:
            raise ConfigError(f"vocab_size {t.vocab_size} not divisible by num_centroids {self.num_centroids}")


# The checkpoint's layout of the joined projections (loading, convert): as the target's.
joined_name, parts, unjoin, keeping_parts = gemma4.joined_name, gemma4.parts, gemma4.unjoin, gemma4.keeping_parts


class MaskedEmbedder(nn.Module):
    """Centroid-routed sparse LM head: only the tokens of the top-k clusters get logits."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.centroids = Linear(cfg.text.hidden_size, cfg.num_centroids, bias=False)
        self.token_ordering = mx.zeros((cfg.text.vocab_size,), dtype=mx.int32)
        self.freeze(keys=["token_ordering"], recurse=False)  # an index table, never trained
        self.top_k = cfg.centroid_intermediate_top_k
        self.num_centroids = cfg.num_centroids

    def __call__(self, h: mx.array, embedding: nn.Module) -> tuple[mx.array, mx.array]:
        """(B, h_a) -> (logits (B, n), token ids (B, n)), n = top_k * V / C."""
        scores = self.centroids(h)
        top = mx.argpartition(-scores, self.top_k - 1, axis=-1)[..., : self.top_k]  # (B, k)
        clusters = self.token_ordering.reshape(self.num_centroids, -1)
        ids = clusters[top].reshape(h.shape[0], -1)  # (B, n)
        # Embedding rows via the layer itself, so a QuantizedEmbedding works too.
        rows = embedding(ids)  # (B, n, h_a)
        logits = (rows @ h[:, :, None].astype(rows.dtype))[..., 0]
        return logits, ids


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.config = cfg
        t = cfg.text
        self.model = _DraftBody(t)
        self.pre_projection = Linear(2 * cfg.backbone_hidden_size, t.hidden_size, bias=False)
        self.post_projection = Linear(t.hidden_size, cfg.backbone_hidden_size, bias=False)
        if cfg.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(cfg)

    def draft_step(
        self, token_embed: mx.array, hidden: mx.array, shared_kv: dict[str, SharedKV], position: mx.array,
        step: Optional[Step] = None,
    ) -> DraftOutput:
        """One draft step for B rows.

        Args:
            token_embed: (B, H_t) the target's scaled embedding of the last token.
            hidden: (B, H_t) target hidden state (first step) or the previous step's output.
            shared_kv: the target's store-layer K/V, holding exactly positions < `position`.
            position: (B,) int32 query position p, constant within a draft block.
            step: `self.step(shared_kv, position[:, None])`, made once for a block's steps.
        """
        step = step if step is not None else self.step(shared_kv, position[:, None])
        return self._draft(token_embed, hidden, shared_kv, step)

    @compiled  # every step of every round has the same shapes: one compiled graph
    def _draft(self, token_embed: mx.array, hidden: mx.array, shared_kv: dict[str, SharedKV], step: Step) -> DraftOutput:
        h = self.trunk(token_embed, hidden, shared_kv, step)
        next_hidden = self.post_projection(h)
        if "masked_embedding" in self:
            logits, ids = self.masked_embedding(h, self.model.embed_tokens)
            return DraftOutput(logits, next_hidden, ids)
        return DraftOutput(self.model.embed_tokens.as_linear(h), next_hidden)

    def step(self, shared_kv: dict[str, SharedKV], positions: mx.array) -> Step:
        """Masks and RoPE tables for (B, T) queries at consecutive positions over the target's
        K/V: the same for every step of a draft block."""
        masks = {kind: self.model.mask(kind, kv.positions, positions) for kind, kv in shared_kv.items()}
        step = Step(positions, positions[:, 0], masks, {}, {})
        if not fused_kernels():
            for layer in self.model.layers:
                layer.self_attn.rope.table(step)
            for kind, kv in shared_kv.items():  # every step's layers of a type read these K: one transpose
                step.scratch[("keys_t", kind)] = kv.keys.swapaxes(-1, -2)
                if positions.shape[1] == 1:  # one mask, as the scores' addend (one grouped query a row)
                    group = self.config.text.num_attention_heads // kv.keys.shape[1]
                    step.scratch[("bias", kind)] = gemma4.mask_bias(masks[kind], kv.keys, group)
        return step

    def trunk(self, token_embed: mx.array, hidden: mx.array, shared_kv: dict[str, SharedKV], step: Step) -> mx.array:
        """Pre-projection and decoder layers for (B, T) queries at `step.positions`: a whole text
        chunk at once when training, inputs (B, T, H_t); one query per row when drafting, (B, H_t).
        Returns (B, T, H) or (B, H) likewise."""
        x = mx.concatenate([token_embed, hidden.astype(token_embed.dtype)], -1)
        x = self.pre_projection(x.reshape(step.positions.size, x.shape[-1]))  # tokens as rows
        return self.model(x, shared_kv, step).reshape(*token_embed.shape[:-1], x.shape[-1])

    def check_target(self, target: TargetModel) -> None:
        """Raise ValueError unless this drafter can read `target`'s hidden state and K/V."""
        cfg, t, tc = self.config, self.config.text, target.config
        problems = []
        if cfg.backbone_hidden_size != tc.hidden_size:
            problems.append(f"backbone_hidden_size {cfg.backbone_hidden_size} != target hidden {tc.hidden_size}")
        if t.vocab_size != tc.vocab_size:
            problems.append(f"vocab {t.vocab_size} != target vocab {tc.vocab_size}")
        for kind in (SLIDING, FULL):
            src = tc.store_layer(kind)
            mine = next(i for i, k in enumerate(t.layer_types) if k == kind)
            if t.layer_head_dim(mine) != tc.layer_head_dim(src):
                problems.append(f"{kind} head_dim {t.layer_head_dim(mine)} != target {tc.layer_head_dim(src)}")
            if t.layer_kv_heads(mine) != tc.layer_kv_heads(src):
                problems.append(f"{kind} kv heads {t.layer_kv_heads(mine)} != target {tc.layer_kv_heads(src)}")
            if t.num_attention_heads % tc.layer_kv_heads(src):
                problems.append(f"{t.num_attention_heads} heads not divisible by target {kind} kv heads")
        if t.sliding_window != tc.sliding_window:
            problems.append(f"sliding_window {t.sliding_window} != target {tc.sliding_window}")
        if problems:
            raise ValueError("drafter does not match its target: " + "; ".join(problems))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for key, value in weights.items():
            if key.startswith("lm_head.") or "rotary_emb" in key:
                continue  # tied to model.embed_tokens
            if key.endswith("token_ordering"):
                value = value.astype(mx.int32)
            out[key] = value
        return gemma4.join(out)

    @staticmethod
    def quant_predicate(path: str, module: nn.Module):
        return True


class _DraftBody(nn.Module):
    """The assistant's `model`: decoder layers without K/V projections, embed, norm."""

    def __init__(self, t: gemma4.Config):
        super().__init__()
        self.cfg = t
        self.embed_tokens = Embedding(t.vocab_size, t.hidden_size)  # only the tied LM head
        self.layers = [gemma4.DecoderLayer(t, i) for i in range(t.num_hidden_layers)]
        self.norm = gemma4.RMSNorm(t.hidden_size, t.rms_norm_eps)

    def __call__(self, x: mx.array, shared_kv: dict[str, SharedKV], step: Step) -> mx.array:
        """x: (B * T, H), the rows' queries in order."""
        for layer, kind in zip(self.layers, self.cfg.layer_types):
            kv = shared_kv[kind]
            x, _ = layer(x, step, shared_kv=(kv.keys, kv.values))
        return self.norm(x)

    def mask(self, kind: str, kpos: mx.array, positions: mx.array) -> mx.array:
        """(B, 1, T, T_kv) for queries at `positions` (B, T): full sees every position < p;
        sliding the last W + 1 of them (transformers' flipped bidirectional window, checked
        against its outputs)."""
        return _visible(kpos, positions, self.cfg.sliding_window if kind == SLIDING else None)


@small  # one kernel for the comparisons, per block and attention type
def _visible(kpos: mx.array, positions: mx.array, window: Optional[int]) -> mx.array:
    k, p = kpos[:, None, :], positions[:, :, None]
    visible = (k >= 0) & (k < p)
    if window is not None:
        visible = visible & (k >= p - window - 1)
    return visible[:, None]

