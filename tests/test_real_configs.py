"""The real released Gemma 4 configs (tests/fixtures/real_configs, provenance in its SOURCES.md).

Checks that every config parses, that the derived geometry is what the checkpoints ship,
that shape-only builds have the published parameter counts, that drafters accept their own
target and reject a foreign one, and that mlx-community `quantization` records land on the
right layers.

"Shape-only": MLX arrays are lazy, so a model built without weights allocates nothing as
long as its parameters are never evaluated. Even the 31B builds in milliseconds here; the
test below guards that. Parameter counts use `.size`, which needs no evaluation.

Counting conventions (checked offline against transformers 5.23 models built on the meta
device from these same configs):
* our text-model count equals transformers' `model.language_model` parameters **plus one
  per layer**: `layer_scalar` is a parameter here and a (persistent) buffer there;
* embeddings are tied, so the LM head adds nothing;
* the multimodal towers are not built here. Where a published number includes them, their
  size is computed from `vision_config` (exact) or taken from transformers (audio, below).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import sys
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.cache.kv import FULL, SLIDING
from mlx_mtp.loading import build_model
from mlx_mtp.models import gemma4, gemma4_assistant, gemma4_unified, model_module

REAL = Path(__file__).parent / "fixtures" / "real_configs"

E2B, E4B = "google--gemma-4-E2B-it", "google--gemma-4-E4B-it"
MOE_BASE, MOE = "google--gemma-4-26B-A4B", "google--gemma-4-26B-A4B-it"
DENSE, DENSE_QAT = "google--gemma-4-31B-it", "google--gemma-4-31B-it-qat-q4_0-unquantized"
UNIFIED, UNIFIED_IT = "google--gemma-4-12B", "google--gemma-4-12B-it"
E2B_ASSISTANT = "google--gemma-4-E2B-it-assistant"
E4B_ASSISTANT_PARTIAL = "google--gemma-4-E4B-it-assistant"  # config.partial.json only
DENSE_ASSISTANT = "google--gemma-4-31B-it-assistant"
DENSE_QAT_ASSISTANT = "google--gemma-4-31B-it-qat-q4_0-unquantized-assistant"
UNIFIED_ASSISTANT = "google--gemma-4-12B-it-assistant"
MLX_E2B, MLX_E4B = "mlx-community--gemma-4-e2b-it-4bit", "mlx-community--gemma-4-e4b-it-4bit"
MLX_MOE, MLX_MOE_QAT = "mlx-community--gemma-4-26b-a4b-it-4bit", "mlx-community--gemma-4-26B-A4B-it-qat-4bit"
NV_MOE, NV_DENSE = "nvidia--Gemma-4-26B-A4B-NVFP4", "nvidia--Gemma-4-31B-IT-NVFP4"

TARGETS = [E2B, E4B, MOE_BASE, MOE, DENSE, DENSE_QAT, UNIFIED, UNIFIED_IT,
           MLX_E2B, MLX_E4B, MLX_MOE, MLX_MOE_QAT, NV_MOE, NV_DENSE]
ASSISTANTS = [E2B_ASSISTANT, DENSE_ASSISTANT, DENSE_QAT_ASSISTANT, UNIFIED_ASSISTANT]

# The same text model under another name: parsed configs must be identical.
SAME_TEXT_MODEL = [
    (E2B, MLX_E2B), (E4B, MLX_E4B), (MOE, MOE_BASE), (MOE, MLX_MOE), (MOE, MLX_MOE_QAT),
    (MOE, NV_MOE), (DENSE, DENSE_QAT), (DENSE, NV_DENSE), (UNIFIED_IT, UNIFIED),
]


def config(name: str, file: str = "config.json") -> dict:
    return json.loads((REAL / name / file).read_text())


@lru_cache(maxsize=None)
def built(name: str) -> nn.Module:
    return build_model(config(name))


def n_params(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def text_cfg(name: str) -> gemma4.Config:
    return gemma4.Config.from_dict(config(name))


# ---- sizes of what we do not build, for comparing like with like ----------------------


def vision_params(cfg: dict) -> int:
    """`gemma4_vision` tower + `embed_vision` projection, from config.json.

    Equals transformers 5.23's count for E2B, E4B, 26B-A4B and 31B (no biases; q/k norms
    over head_dim, v norm without weight; 4 RMSNorms per layer; gated MLP; a patch
    projection and a 2 x position_embedding_size x hidden position table).
    """
    v = cfg["vision_config"]
    H, I, L = v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"]
    nh, nkv, d = v["num_attention_heads"], v["num_key_value_heads"], v["head_dim"]
    attn = 2 * H * nh * d + 2 * H * nkv * d + 2 * d
    layer = attn + 3 * H * I + 4 * H
    patches = 3 * v["patch_size"] ** 2 * H + 2 * v["position_embedding_size"] * H
    return L * layer + patches + H * cfg["text_config"]["hidden_size"]


def vision_buffers(cfg: dict) -> int:
    """Persistent vision buffers saved in the checkpoint: `std_bias`, `std_scale`."""
    v = cfg["vision_config"]
    return 2 * v["hidden_size"] if v.get("standardize") else 0


# The E2B/E4B conformer audio tower (`audio_tower.*`), as counted by transformers 5.23 from
# these configs (identical audio_config in both). Google's model card: "Audio Encoder
# Parameters ~300M"; Google's launch blog: 305M.
AUDIO_TOWER = 304_824_608


def audio_params(cfg: dict) -> int:
    """Audio tower + `embed_audio` projection (audio output_proj_dims -> text hidden)."""
    return AUDIO_TOWER + cfg["audio_config"]["output_proj_dims"] * cfg["text_config"]["hidden_size"]


def unified_embedder_params(cfg: dict) -> int:
    """`gemma4_unified` (12B) has no towers, only `embed_vision` and `embed_audio`
    (matches transformers 5.23's Gemma4UnifiedModel count)."""
    v, a, H = cfg["vision_config"], cfg["audio_config"], cfg["text_config"]["hidden_size"]
    P, D = 3 * v["model_patch_size"] ** 2, v["mm_embed_dim"]
    vision = (
        P * D + D  # patch_dense (with bias)
        + 2 * P + 2 * D + 2 * D  # patch_ln1, patch_ln2, pos_norm (LayerNorms with bias)
        + v["mm_posemb_size"] * 2 * D  # factorised 2-D position embedding
        + v["output_proj_dims"] * H  # multimodal_embedder.embedding_projection
    )
    return vision + a["output_proj_dims"] * H


# ---- parsing ---------------------------------------------------------------------------


def all_config_dirs() -> list[str]:
    return sorted(p.parent.name for p in REAL.glob("*/config.json"))


def test_fixture_set_is_complete():
    assert set(all_config_dirs()) == set(TARGETS) | set(ASSISTANTS)


@pytest.mark.parametrize("name", TARGETS + ASSISTANTS)
def test_config_parses_without_unknown_keys(name, caplog):
    raw = config(name)
    module = model_module(raw["model_type"])
    with caplog.at_level(logging.DEBUG, logger="mlx_mtp"):
        module.Config.from_dict(raw)
    # Every key of the released files is either used or deliberately ignored.
    assert not [r for r in caplog.records if "ignoring config keys" in r.getMessage()]


@pytest.mark.parametrize("a, b", SAME_TEXT_MODEL)
def test_variants_share_the_text_config(a, b):
    # QAT, base/-it, mlx-community and NVFP4 repacks describe the same text model. (The 31B
    # QAT file replaces `expert_intermediate_size: null` by `moe_intermediate_size: null`.)
    assert dataclasses.asdict(text_cfg(a)) == dataclasses.asdict(text_cfg(b))


def test_unknown_key_is_logged_not_fatal(caplog):
    raw = config(E2B)
    raw["text_config"] = {**raw["text_config"], "brand_new_knob": 3}
    with caplog.at_level(logging.INFO, logger="mlx_mtp"):
        cfg = gemma4.Config.from_dict(raw)
    assert cfg.num_hidden_layers == 35
    hits = [r for r in caplog.records if "brand_new_knob" in r.getMessage()]
    assert hits and all(r.name == "mlx_mtp" and r.levelno == logging.INFO for r in hits)

    caplog.clear()
    raw = {**config(DENSE_ASSISTANT), "assistant_knob": True}
    with caplog.at_level(logging.INFO, logger="mlx_mtp"):
        gemma4_assistant.Config.from_dict(raw)
    assert any(r.name == "mlx_mtp" and r.levelno == logging.INFO and "assistant_knob" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("name", [UNIFIED, UNIFIED_IT, UNIFIED_ASSISTANT])
def test_gemma4_unified_builds_with_its_own_defaults(name):
    model = built(name)
    cfg = model.config.text if name == UNIFIED_ASSISTANT else model.config
    assert type(cfg) is gemma4_unified.Config and type(model) is model_module(config(name)["model_type"]).Model


def test_gemma4_unified_text_config_is_plain_gemma4():
    """12B's text decoder (`gemma4_unified_text`) is the 31B-style dense k_eq_v decoder:
    transformers 5.23 builds it from Gemma4TextAttention / Gemma4TextMLP with no PLE or MoE,
    and the assistant class is Gemma4AssistantForCausalLM unchanged. The released file spells out
    every key, so gemma4's defaults parse it as the unified ones do."""
    t = gemma4_unified.Config.from_dict(config(UNIFIED_IT))
    assert dataclasses.asdict(t) == dataclasses.asdict(text_cfg(UNIFIED_IT))
    assert (t.num_hidden_layers, t.hidden_size, t.intermediate_size) == (48, 3840, 15360)
    assert t.attention_k_eq_v and not t.enable_moe_block and t.hidden_size_per_layer_input == 0
    assert (t.layer_kv_heads(0), t.layer_kv_heads(5)) == (8, 1)
    assert (t.layer_head_dim(0), t.layer_head_dim(5)) == (256, 512)
    assert (t.store_layer(SLIDING), t.store_layer(FULL)) == (46, 47)
    assert (t.sliding_window, t.max_position_embeddings, t.use_bidirectional_attention) == (1024, 262144, "vision")
    assert "embed_tokens_per_layer" not in built(UNIFIED_IT).model  # vocab_size_per_layer_input 262144 is dead
    assert built(UNIFIED_ASSISTANT).config.backbone_hidden_size == 3840


def test_gemma4_unified_defaults_where_keys_are_absent():
    """transformers' `Gemma4UnifiedTextConfig` defaults, not `Gemma4TextConfig`'s: a unified config
    that omits them gets no per-layer embeddings (gemma4's default is 256), window 1024 and 262144
    positions; its PLE and MoE keys are read by nothing, as in transformers."""
    text = {k: v for k, v in config(UNIFIED_IT)["text_config"].items()
            if k not in ("sliding_window", "max_position_embeddings", "hidden_size_per_layer_input",
                         "global_head_dim", "use_bidirectional_attention")}
    t = gemma4_unified.Config.from_dict(text)
    assert (t.sliding_window, t.max_position_embeddings, t.hidden_size_per_layer_input) == (1024, 262144, 0)
    assert t.layer_head_dim(5) == 512 and t.use_bidirectional_attention == "vision"
    assert gemma4.Config.from_dict(text).hidden_size_per_layer_input == 256  # why the unified class exists
    dead = gemma4_unified.Config.from_dict({**text, "hidden_size_per_layer_input": 256, "enable_moe_block": True})
    assert dead.hidden_size_per_layer_input == 0 and not dead.enable_moe_block


# ---- derived geometry ------------------------------------------------------------------


def test_e2b_geometry():
    c = text_cfg(E2B)
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.sliding_window) == (35, 1536, 262144, 512)
    assert c.first_shared_layer == 15
    assert (c.store_layer(SLIDING), c.store_layer(FULL)) == (13, 14)
    assert c.layer_types[:5] == [SLIDING] * 4 + [FULL]
    assert (c.layer_head_dim(0), c.layer_head_dim(4)) == (256, 512)
    assert {c.layer_kv_heads(i) for i in range(35)} == {1}
    assert [c.kv_source(i) for i in (14, 15, 19, 33, 34)] == [14, 13, 14, 13, 14]
    assert c.hidden_size_per_layer_input == 256 and c.final_logit_softcapping == 30.0

    layers = built(E2B).model.layers
    assert layers[14].mlp.gate_up_proj.weight.shape == (2 * 6144, 1536)  # gate and up joined at load
    assert layers[15].mlp.gate_up_proj.weight.shape == (2 * 12288, 1536)  # double-wide in shared layers
    assert layers[14].self_attn.heads == (8, 1, 1) and layers[15].self_attn.heads == (8, 0, 0)  # q, k, v heads
    assert layers[14].self_attn.qkv_proj.weight.shape == ((8 + 1 + 1) * 512, 1536)  # a full layer: head_dim 512
    assert built(E2B).model.embed_tokens_per_layer.weight.shape == (262144, 35 * 256)


def test_e4b_geometry():
    c = text_cfg(E4B)
    assert (c.num_hidden_layers, c.hidden_size, c.first_shared_layer) == (42, 2560, 24)
    assert (c.store_layer(SLIDING), c.store_layer(FULL)) == (22, 23)
    assert {c.layer_kv_heads(i) for i in range(42)} == {2}
    assert (c.layer_head_dim(22), c.layer_head_dim(23)) == (256, 512)


def test_26b_a4b_geometry():
    c = text_cfg(MOE)
    assert c.enable_moe_block and (c.num_experts, c.top_k_experts, c.moe_intermediate_size) == (128, 8, 704)
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 2816, 2112)
    assert c.attention_k_eq_v and c.num_kv_shared_layers == 0 and c.first_shared_layer == 30
    assert (c.layer_kv_heads(0), c.layer_kv_heads(5)) == (8, 2)
    assert (c.layer_head_dim(0), c.layer_head_dim(5)) == (256, 512)
    assert (c.store_layer(SLIDING), c.store_layer(FULL)) == (28, 29)
    assert c.sliding_window == 1024

    layer = built(MOE).model.layers[5]
    assert layer.self_attn.heads == (16, 2, 0)  # k_eq_v: V is the raw k_proj output
    assert built(MOE).model.layers[4].self_attn.heads == (16, 8, 8)
    assert layer.self_attn.qkv_proj.weight.shape == (16 * 512 + 2 * 512, 2816)
    glu = layer.experts.switch_glu
    assert glu.gate_up_proj.weight.shape == (128, 2 * 704, 2816)  # the experts' gate and up joined at load
    assert glu.down_proj.weight.shape == (128, 2816, 704)
    assert layer.router.proj.weight.shape == (128, 2816)
    assert layer.mlp.down_proj.weight.shape == (2816, 2112)


def test_31b_geometry():
    c = text_cfg(DENSE)
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (60, 5376, 21504)
    assert (c.store_layer(SLIDING), c.store_layer(FULL)) == (58, 59)
    assert (c.layer_kv_heads(0), c.layer_kv_heads(5)) == (16, 4)
    assert c.attention_k_eq_v and not c.enable_moe_block and c.moe_intermediate_size is None
    # Checkpoint shapes (shared SOURCES.md section 13).
    sliding, full = built(DENSE).model.layers[0].self_attn, built(DENSE).model.layers[5].self_attn
    # q_proj (8192 | 16384 rows), k_proj (4096 | 2048), v_proj (4096 | none: k_eq_v), joined at load
    assert sliding.qkv_proj.weight.shape == (8192 + 2 * 4096, 5376) and full.qkv_proj.weight.shape == (16384 + 2048, 5376)


def test_assistant_geometry():
    d = gemma4_assistant.Config.from_dict(config(DENSE_ASSISTANT))
    assert (d.backbone_hidden_size, d.text.hidden_size, d.use_ordered_embeddings) == (5376, 1024, False)
    assert d.text.num_kv_shared_layers == d.text.num_hidden_layers == 4
    assert d.text.layer_types == [SLIDING] * 3 + [FULL] and d.text.final_logit_softcapping is None
    e = gemma4_assistant.Config.from_dict(config(E2B_ASSISTANT))
    assert (e.backbone_hidden_size, e.text.hidden_size, e.use_ordered_embeddings) == (1536, 256, True)
    assert (e.num_centroids, e.centroid_intermediate_top_k) == (2048, 32)
    model = built(E2B_ASSISTANT)
    assert model.masked_embedding.token_ordering.shape == (262144,)
    assert model.pre_projection.weight.shape == (256, 2 * 1536)
    assert model.model.layers[0].self_attn.heads[1:] == (0, 0)  # no K/V of its own


# ---- shape-only builds: cheap, and the published parameter counts ------------------------


def test_building_31b_allocates_nothing():
    def peak_rss_mb() -> float:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**20 if sys.platform == "darwin" else rss / 2**10

    build_model(config(DENSE))  # warm up imports and compiled helpers
    active, peak = mx.get_active_memory(), peak_rss_mb()
    model = build_model(config(DENSE))
    assert n_params(model) > 30e9
    assert mx.get_active_memory() - active < 2**20  # nothing evaluated
    assert peak_rss_mb() - peak < 256  # bf16 weights would be 61 GB


# Exact counts of our shape-only models, pinned. Checked offline against transformers 5.23
# on the meta device: targets = its `language_model` parameters + one `layer_scalar` per
# layer; assistants (built with the kv_sharing_modes workaround, research notes §6) = its
# parameters + 4 `layer_scalar`s + the 262,144-entry `token_ordering` buffer (E2B).
OUR_COUNTS = {
    E2B: 4_628_569_379,
    E4B: 7_463_013_418,
    MOE: 25_233_141_790,
    DENSE: 30_697_345_340,
    E2B_ASSISTANT: 77_993_476,
    DENSE_ASSISTANT: 469_518_596,
    UNIFIED_IT: 11_907_350_320,  # research gemma4-audio-unified.md §1.8 (formula run against transformers)
    UNIFIED_ASSISTANT: 422_856_964,  # ibid. §1.9
}


@pytest.mark.parametrize("name", sorted(OUR_COUNTS))
def test_exact_parameter_counts(name):
    assert n_params(built(name)) == OUR_COUNTS[name]


@pytest.mark.parametrize("a, b", [(MOE, MOE_BASE), (DENSE, DENSE_QAT), (DENSE, NV_DENSE), (MOE, NV_MOE),
                                  (DENSE_ASSISTANT, DENSE_QAT_ASSISTANT), (UNIFIED_IT, UNIFIED)])
def test_variant_counts_match(a, b):
    assert n_params(built(a)) == n_params(built(b))


def test_26b_a4b_matches_checkpoint_index_exactly():
    """google/gemma-4-26B-A4B-it `model.safetensors.index.json` metadata (shared SOURCES.md §4):
    total_parameters 26,544,131,376 and total_size 51,611,872,412 (bf16 bytes). Both include the
    vision tower. `total_parameters` also counts the tied LM head a second time and does not
    count buffers (layer_scalar); `total_size` covers every saved tensor once, buffers included."""
    cfg, ours = config(MOE), n_params(built(MOE))
    t = cfg["text_config"]
    vision = vision_params(cfg)
    assert vision == 572_792_112
    tied_head = t["vocab_size"] * t["hidden_size"]
    assert ours - t["num_hidden_layers"] + vision + tied_head == 26_544_131_376
    assert 2 * (ours + vision + vision_buffers(cfg)) == 51_611_872_412


def test_31b_matches_checkpoint_bytes():
    """google/gemma-4-31B-it shards are 49,784,788,364 + 12,761,549,884 bytes (shared
    SOURCES.md §3): bf16 text + vision + buffers, plus two safetensors JSON headers."""
    cfg = config(DENSE)
    data = 2 * (n_params(built(DENSE)) + vision_params(cfg) + vision_buffers(cfg))
    header = 49_784_788_364 + 12_761_549_884 - data
    assert 0 < header < 2**20


def test_12b_text_decoder_matches_checkpoint_bytes():
    """google/gemma-4-12B-it: one model.safetensors of 23,919,549,408 bytes, 677 tensors (shared
    SOURCES.md §5). Our 12B decoder and embedders built from its config fill it up to the header:
    the unified text decoder is parameter-for-parameter ours, and so are its embedders."""
    cfg = config(UNIFIED_IT)
    embedders = gemma4_unified.Embedders.from_config(cfg)
    assert n_params(embedders) == unified_embedder_params(cfg) == 49_922_304 + 2_457_600  # research §1.8
    assert len(tree_flatten(embedders.parameters())) == 10 + 1  # the checkpoint's vision and audio tensors
    header = 23_919_549_408 - 2 * (n_params(built(UNIFIED_IT)) + n_params(embedders))
    assert 0 < header < 2**20


# Published sizes. Google's Gemma 4 model card (huggingface.co/google/gemma-4-*-it; same table
# reproduced at huggingface.co/zeromodels/gemma-4-e4b-it, tpsreport.news/news/google-gemma-4-
# 31b-mtp-assistant-release, docs.voxel51.com google_gemma_4_26B_A4B_it):
#   E2B "2.3B effective (5.1B with embeddings)"; E4B "4.5B effective (8B with embeddings)";
#   26B A4B "25.2B total, 3.8B active"; 31B "30.7B"; 12B Unified "11.95B";
#   "Vision Encoder Parameters ~150M (E2B/E4B), ~550M (26B/31B)"; "Audio ~300M (E2B/E4B)".
# What the numbers cover was worked out from the exact counts: "with embeddings" = text model +
# vision + audio towers; "effective" = that text model without the per-layer-embedding table;
# 26B/31B totals = text model only (the towers would make them 25.8B / 31.3B); 12B = text +
# its embedders. All are rounded, so they get a tolerance of about one unit in the last digit.


def test_published_e2b():
    cfg, ours = config(E2B), n_params(built(E2B))
    t = cfg["text_config"]
    ple_table = t["vocab_size_per_layer_input"] * t["num_hidden_layers"] * t["hidden_size_per_layer_input"]
    with_embeddings = ours - t["num_hidden_layers"] + vision_params(cfg) + audio_params(cfg)
    assert with_embeddings == pytest.approx(5.1e9, rel=0.01)  # 5,104,297,504
    assert ours - ple_table == pytest.approx(2.3e9, rel=0.015)  # 2,279,759,139


def test_published_e4b():
    cfg, ours = config(E4B), n_params(built(E4B))
    t = cfg["text_config"]
    ple_table = t["vocab_size_per_layer_input"] * t["num_hidden_layers"] * t["hidden_size_per_layer_input"]
    with_embeddings = ours - t["num_hidden_layers"] + vision_params(cfg) + audio_params(cfg)
    assert with_embeddings == pytest.approx(8e9, rel=0.01)  # 7,941,100,832
    # 4,644,441,130: 3.2 % above the card's "4.5B". The same rule gives E2B's 2.3B within
    # 1 %, so the card's E4B figure is looser than its rounding; do not tighten this.
    assert ours - ple_table == pytest.approx(4.5e9, rel=0.04)


def test_published_26b_a4b():
    cfg, ours = config(MOE), n_params(built(MOE))
    t = cfg["text_config"]
    assert ours == pytest.approx(25.2e9, rel=0.005)
    experts = t["num_hidden_layers"] * t["num_experts"] * 3 * t["hidden_size"] * t["moe_intermediate_size"]
    idle = experts * (t["num_experts"] - t["top_k_experts"]) // t["num_experts"]
    assert ours - idle == pytest.approx(3.8e9, rel=0.015)  # 3,822,530,590 active per token
    assert vision_params(cfg) == pytest.approx(550e6, rel=0.05)  # card: "~550M"


def test_published_31b():
    cfg, ours = config(DENSE), n_params(built(DENSE))
    assert ours == pytest.approx(30.7e9, rel=0.005)  # text only; with vision 31.27e9
    assert vision_params(cfg) == pytest.approx(550e6, rel=0.05)


def test_published_e2b_vision_tower():
    assert vision_params(config(E2B)) == pytest.approx(150e6, rel=0.15)  # 168.5M incl. projection


def test_published_12b():
    cfg = config(UNIFIED_IT)
    text = n_params(built(UNIFIED_IT)) - cfg["text_config"]["num_hidden_layers"]
    assert text + unified_embedder_params(cfg) == pytest.approx(11.95e9, rel=0.005)  # 11,959,730,176


def _expected_assistant(cfg: dict) -> int:
    """Assistant size from the documented tensor shapes (shared SOURCES.md §13, research
    notes §3.2): tied embed [V, h], pre_projection [h, 2B], post_projection [B, h], 4 layers
    of q/o projections, q_norm, MLP, 4 norms and layer_scalar, final norm, and for
    ordered-embedding drafters centroids [C, h] plus token_ordering [V]."""
    t, B = cfg["text_config"], cfg["backbone_hidden_size"]
    h, V, heads, I = t["hidden_size"], t["vocab_size"], t["num_attention_heads"], t["intermediate_size"]
    total = V * h + 2 * B * h + B * h + h
    for kind in t["layer_types"]:
        d = t["global_head_dim"] if kind == FULL else t["head_dim"]
        total += 2 * heads * d * h + d + 3 * h * I + 4 * h + 1
    if cfg.get("use_ordered_embeddings"):
        total += cfg["num_centroids"] * h + V
    return total


@pytest.mark.parametrize("name", ASSISTANTS)
def test_assistant_counts_match_documented_shapes(name):
    assert n_params(built(name)) == _expected_assistant(config(name))


def test_published_assistant_sizes():
    # 31B assistant: the bf16 MLX conversion NeoRoth/gemma-4-31b-it-assistant-mlx lists
    # "0.94 GB" of weights (third-party; the HF hub shows "0.5B params").
    assert 2 * n_params(built(DENSE_ASSISTANT)) == pytest.approx(0.94e9, rel=0.01)
    # E4B assistant: "about 78.5 M params" (research notes gemma4-architecture.md §5, [3p]).
    # Built from the PARTIAL config (fields attested by transformers' conversion script),
    # which holds every field that sets a tensor shape. Ours: 78,779,908.
    partial = config(E4B_ASSISTANT_PARTIAL, "config.partial.json")
    drafter = gemma4_assistant.Model(gemma4_assistant.Config.from_dict(partial))
    assert n_params(drafter) == pytest.approx(78.5e6, rel=0.01)


# ---- drafter <-> target ---------------------------------------------------------------


@pytest.mark.parametrize("drafter, target", [(E2B_ASSISTANT, E2B), (DENSE_ASSISTANT, DENSE),
                                             (DENSE_QAT_ASSISTANT, DENSE_QAT), (DENSE_ASSISTANT, NV_DENSE),
                                             (E2B_ASSISTANT, MLX_E2B), (UNIFIED_ASSISTANT, UNIFIED_IT),
                                             (UNIFIED_ASSISTANT, UNIFIED)])
def test_check_target_accepts_its_target(drafter, target):
    built(drafter).check_target(built(target))


def test_check_target_rejects_a_foreign_target():
    with pytest.raises(ValueError, match="drafter does not match its target") as err:
        built(E2B_ASSISTANT).check_target(built(DENSE))
    msg = str(err.value)
    assert "backbone_hidden_size 1536 != target hidden 5376" in msg
    assert "sliding_window 512 != target 1024" in msg
    assert "not divisible by target sliding_attention kv heads" in msg  # 4 heads vs 16 kv

    with pytest.raises(ValueError, match="backbone_hidden_size 5376 != target hidden 1536"):
        built(DENSE_ASSISTANT).check_target(built(E2B))
    with pytest.raises(ValueError, match="backbone_hidden_size 5376 != target hidden 2816"):
        built(DENSE_ASSISTANT).check_target(built(MOE))
    with pytest.raises(ValueError, match="backbone_hidden_size 3840 != target hidden 5376"):
        built(UNIFIED_ASSISTANT).check_target(built(DENSE))


# ---- mlx-community quantization records -------------------------------------------------


def _quantized(module) -> tuple[int, int, str]:
    assert hasattr(module, "bits"), f"{type(module).__name__} is not quantized"
    return module.bits, module.group_size, module.mode


def _unquantized_layers(model: nn.Module) -> list[str]:
    return [path for path, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding)) and not hasattr(m, "bits")]


def test_record_paths_map_to_our_names():
    record_key = "language_model.model.layers.7.router.proj"
    assert gemma4.rename(record_key + ".weight") == "model.layers.7.router.proj.weight"
    assert gemma4.rename("language_model.model.embed_tokens.weight") == "model.embed_tokens.weight"
    # Record keys with a vision/audio prefix are dropped, not applied to the text model.
    assert gemma4.rename("vision_tower.encoder.layers.0.mlp.gate_proj.weight") is None


@pytest.mark.parametrize("name", [MLX_MOE, MLX_MOE_QAT])
def test_26b_record_puts_mlp_and_router_at_8_bits(name):
    record = config(name)["quantization"]
    assert (record["bits"], record["group_size"]) == (4, 64)
    assert record["language_model.model.layers.0.router.proj"] == {"group_size": 64, "bits": 8}
    model = built(name)
    assert _unquantized_layers(model) == []
    for i in (0, 5, 29):
        layer = model.model.layers[i]
        for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.router.proj):
            assert _quantized(m) == (8, 64, "affine")
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                  layer.experts.switch_glu.gate_up_proj, layer.experts.switch_glu.down_proj):
            assert _quantized(m) == (4, 64, "affine")
    assert _quantized(model.model.embed_tokens) == (4, 64, "affine")


@pytest.mark.parametrize("name", [MLX_E2B, MLX_E4B])
def test_e2b_e4b_records_are_uniform_4_bit(name):
    assert config(name)["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model = built(name)
    assert _unquantized_layers(model) == []
    layer = model.model.layers[0]
    for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.per_layer_input_gate,
              model.model.embed_tokens, model.model.embed_tokens_per_layer,
              model.model.per_layer_model_projection):
        assert _quantized(m) == (4, 64, "affine")


@pytest.mark.parametrize("name", [NV_MOE, NV_DENSE])
def test_nvfp4_configs_build_unquantized(name):
    # Only `quantization_config` (ModelOpt NVFP4, quant_method "modelopt"), no MLX record:
    # build_model makes the bf16 model; the NVFP4 weights themselves are not loadable.
    assert config(name)["quantization_config"]["quant_method"] == "modelopt"
    assert not [p for p, m in built(name).named_modules() if hasattr(m, "bits")]


def test_12b_takes_an_mlx_community_record():
    """A 4-bit mlx-community-style record on the 12B (mlx-vlm / mlx-lm names, `language_model.model.*`
    overrides, as for the 26B): every text layer quantized, the override where it names a layer."""
    raw = config(UNIFIED_IT)
    raw["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine",
                           "language_model.model.layers.47.mlp.down_proj": {"group_size": 64, "bits": 8}}
    model = build_model(raw)
    assert _unquantized_layers(model) == []
    layers = model.model.layers
    assert _quantized(layers[47].mlp.down_proj) == (8, 64, "affine")
    for m in (layers[0].self_attn.qkv_proj, layers[47].self_attn.qkv_proj, layers[0].mlp.down_proj,
              model.model.embed_tokens):
        assert _quantized(m) == (4, 64, "affine")

