"""The MLX audio tower (`gemma4_audio`) and `embed_audio` reproduce transformers 5.23's
`get_audio_features` in fp32 (fixtures: tests/reference/make_audio_tower_fixtures.py)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import BOTH_KERNELS
from mlx.utils import tree_flatten

from mlx_mtp.models.base import rms_norm
from mlx_mtp.models.gemma4_audio import (Audio, AudioConfig, audio_from_weights, local_mask, relative_index,
                                         relative_positions)

FIXTURES = Path(__file__).parent / "fixtures"
AUDIO = FIXTURES / "audio_tower"
ATOL = 1e-5  # absolute, fp32 against transformers' fp32 forward (values are O(1))
CASES = ["t1", "t11", "t12", "t13", "t37", "batch"]
STAGES = ("sscp", "layer0", "tower", "embed")


def config() -> dict:
    return json.loads((AUDIO / "config.json").read_text())


def weights() -> dict:
    return mx.load(str(AUDIO / "model.safetensors"))


def audio(dtype=mx.float32) -> Audio:
    return audio_from_weights(config(), weights(), dtype=dtype)


def reference() -> dict:
    return dict(np.load(AUDIO / "reference.npz"))


def stages(model: Audio, features, valid) -> dict:
    """Our outputs at the fixture's checkpoints."""
    tower = model.audio_tower
    x, sscp_valid = tower.subsample_conv_projection(mx.array(features), mx.array(valid))
    layer0 = tower.layers[0](x, relative_positions(tower.config), local_mask(tower.config, sscp_valid))
    states, tower_valid = tower(mx.array(features), mx.array(valid))
    return {"sscp": x, "sscp_mask": sscp_valid, "layer0": layer0, "tower": states, "tower_mask": tower_valid,
            "embed": model.embed_audio(states)}


def abs_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


@pytest.mark.usefixtures("fused")
@BOTH_KERNELS
@pytest.mark.parametrize("case", CASES)
def test_stages_match_transformers(case):
    """SSCP, conformer layer 0, tower and embed_audio at T' = 1, 11, 12, 13, 37 (below, at and past
    one attention chunk of 12, and three chunks plus one), and a padded 2-clip batch (junk in the
    padding; padding rows compared too, as transformers leaves them)."""
    ref = reference()
    got = stages(audio(), ref[f"{case}_features"], ref[f"{case}_mask"])
    for key in ("sscp_mask", "tower_mask"):
        np.testing.assert_array_equal(np.array(got[key]), ref[f"{case}_{key}"])
    for key in STAGES:
        assert got[key].dtype == mx.float32
        assert abs_diff(got[key], ref[f"{case}_{key}"]) <= ATOL, key


def dense(mask: np.ndarray, cfg: AudioConfig, T: int) -> np.ndarray:
    """A blocked `local_mask` (B, 1, n, chunk, context) as (B, T, T) query x key."""
    B, _, n, C, W = mask.shape
    out = np.zeros((B, T, T), dtype=bool)
    for b, i, j in zip(*np.nonzero(mask[:, 0].reshape(B, n * C, W))):
        q, k = i, (i // C) * C - cfg.past + j
        if q < T:
            assert 0 <= k < T
            out[b, q, k] = True
    return out


def test_mask_sees_itself_and_11_past_frames():
    """Each frame attends to itself and the 11 frames before it (12 keys, the released config), never
    to padding; exactly transformers' mask of the padded batch. The distance-12 row of the relative
    table is never used."""
    cfg, ref = AudioConfig.from_dict(config()["audio_config"]), reference()
    assert (cfg.attention_chunk_size, cfg.past, cfg.context) == (12, 12, 24)
    T = 37
    q, k = np.arange(T)[:, None], np.arange(T)
    band = (q - k >= 0) & (q - k <= 11)
    got = dense(np.array(local_mask(cfg, mx.ones((1, T), dtype=mx.bool_))), cfg, T)[0]
    np.testing.assert_array_equal(got, band)
    assert (got.sum(axis=1)[11:] == 12).all() and (got.sum(axis=1)[:11] == np.arange(1, 12)).all()

    valid = ref["batch_sscp_mask"]
    blocked = np.array(local_mask(cfg, mx.array(valid)))
    np.testing.assert_array_equal(dense(blocked, cfg, T), ref["batch_attention"])
    assert not dense(blocked, cfg, T)[1][:, 16:].any()  # the short clip has 16 real frames

    rows = np.broadcast_to(np.array(relative_index(cfg)), blocked.shape)[blocked]
    distances = cfg.context // 2 - rows
    assert set(distances.tolist()) == set(range(12))  # rows of the 13-row table, distance 12 unused
    assert np.array(relative_positions(cfg)).shape == (13, cfg.hidden_size)


def test_padded_batch_equals_single_runs():
    """A padded clip's real rows equal the clip run alone (the short clip: its 61 frames, 16 soft
    tokens); `soft_tokens` keeps exactly the real rows."""
    model, ref = audio(), reference()
    features, valid = ref["batch_features"], ref["batch_mask"]
    batch = model.soft_tokens(mx.array(features), mx.array(valid))
    assert [t.shape[0] for t in batch] == [37, 16]
    for row, frames in ((0, 147), (1, 61)):
        alone, alone_valid = model(mx.array(features[row : row + 1, :frames]))
        assert bool(np.array(alone_valid).all()) and alone.shape[1] == batch[row].shape[0]
        assert abs_diff(batch[row], alone[0]) <= 1e-6


def test_a_clip_under_one_frame_has_no_soft_tokens():
    """0 mel frames (under 161 samples) give 0 soft tokens, as the processor counts them."""
    tokens, valid = audio()(mx.zeros((2, 0, 128)))
    assert tokens.shape == (2, 0, 48) and valid.shape == (2, 0)


def mlx_community_weights(hf: dict, group_size: int = 64, bits: int = 4) -> dict:
    """The fixture's tensors as mlx-community's converter writes them: no `model.` prefix, convs
    channel-last, `embed_audio.embedding_projection` quantized (the tower stays float)."""
    out = {}
    for key, value in hf.items():
        key = key[len("model."):]
        if value.ndim >= 3:
            value = value.transpose(0, *range(2, value.ndim), 1)
        if key == "embed_audio.embedding_projection.weight":
            w, scales, biases = mx.quantize(value, group_size=group_size, bits=bits)
            out |= {key: w, key.replace("weight", "scales"): scales, key.replace("weight", "biases"): biases}
            continue
        out[key] = value
    return out


def test_mlx_community_names_build_the_same_model():
    """mlx-community's names and layouts (see `mlx_community_weights`) give the same tower, and a
    quantized `embed_audio`; sanitize is idempotent."""
    hf, cfg = weights(), config()
    ours = audio()
    sanitized = ours.sanitize(hf)
    assert ours.sanitize(sanitized).keys() == sanitized.keys()
    again = ours.sanitize(sanitized)
    assert all(np.array_equal(np.array(again[k]), np.array(v)) for k, v in sanitized.items())

    community = audio_from_weights({**cfg, "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}},
                                   mlx_community_weights(hf), dtype=None)
    ref = reference()
    features, valid = mx.array(ref["batch_features"]), mx.array(ref["batch_mask"])
    a, b = ours.audio_tower(features, valid)[0], community.audio_tower(features, valid)[0]
    assert abs_diff(a, b) == 0.0
    proj = community.embed_audio.embedding_projection
    assert "scales" in proj
    w = mx.dequantize(proj.weight, proj.scales, proj.biases, group_size=64, bits=4)
    expected = rms_norm(a, None, 1e-6) @ w.T
    assert abs_diff(community.embed_audio(a), expected) <= 1e-5


def test_params_are_bf16_by_default():
    """Floating params load as bf16 unless told otherwise; the bf16 tower stays near the fp32 reference."""
    model, ref = audio(dtype=mx.bfloat16), reference()
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}
    tokens, _ = model(mx.array(ref["t37_features"]), mx.array(ref["t37_mask"]))
    assert tokens.dtype == mx.bfloat16
    assert abs_diff(tokens.astype(mx.float32), ref["t37_embed"]) <= 0.1 * np.abs(ref["t37_embed"]).max()


REAL = ["google--gemma-4-E2B-it", "google--gemma-4-E4B-it", "mlx-community--gemma-4-e2b-it-4bit",
        "mlx-community--gemma-4-e4b-it-4bit"]


@pytest.mark.parametrize("name", REAL)
def test_released_audio_configs_build_with_the_published_size(name):
    """Shape-only builds (nothing evaluated, nothing allocated) of the released tower: transformers'
    count, recorded by the fixture script from the E2B config on torch's meta device (304,824,608),
    plus 4 clip scalars for each of the 10 clipped linears a layer; embed_audio is output_proj_dims x
    the text width."""
    meta = json.loads((AUDIO / "meta.json").read_text())
    assert meta["real_e2b_audio_tower_params"] == 304_824_608
    assert meta["real_e2b_audio_tower_clip_buffers"] == 480
    cfg = json.loads((FIXTURES / "real_configs" / name / "config.json").read_text())
    before = mx.get_active_memory()
    model = Audio.from_config(cfg)
    tower = tree_flatten(model.audio_tower.parameters())
    count = sum(v.size for k, v in tower if not k.endswith(("_min", "_max")))
    clips = sum(v.size for k, v in tower if k.endswith(("_min", "_max")))
    assert (count, clips) == (meta["real_e2b_audio_tower_params"], meta["real_e2b_audio_tower_clip_buffers"])
    embed = sum(v.size for _, v in tree_flatten(model.embed_audio.parameters()))
    assert embed == 1536 * cfg["text_config"]["hidden_size"]
    if name == "google--gemma-4-E2B-it":
        assert embed == meta["real_e2b_embed_audio_params"]
    assert mx.get_active_memory() - before < 1 << 20
