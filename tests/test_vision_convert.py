"""The converter keeps the vision tower (mlx-community's names, the LM quantized as before, the
tower in --dtype unless --quantize-vision), and such a checkpoint loads and sees images as the source."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from convert import convert
from mlx_mtp.loading import load, load_weights, read_config, weight_files
from mlx_mtp.models.gemma4_vision import vision_from_weights

VISION = Path(__file__).parent / "fixtures" / "vision"


def features(path, pixels, positions):
    model = vision_from_weights(read_config(path), load_weights(weight_files(path)))
    return np.array(model(pixels, positions).astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("variant, quantize_vision", [("bidir", False), ("causal", True)])
def test_converted_checkpoint_keeps_the_tower(tmp_path, variant, quantize_vision):
    src = VISION / variant
    out = convert(src, tmp_path / "out", quantize=True, group_size=32, bits=8, quantize_vision=quantize_vision,
                  progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] \
        if (out / "model.safetensors.index.json").exists() else {k: None for k in mx.load(str(out / "model.safetensors"))}
    names = set(index)
    assert "vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight" in names
    assert "vision_tower.patch_embedder.position_embedding_table" in names
    # --quantize-vision quantizes only layers whose width the group divides: none of the tiny tower's (24, 48)
    assert not any(k.startswith(("vision_tower.", "embed_vision.")) and k.endswith(".scales") for k in names)
    assert any(k.startswith("language_model.model.layers.0.") and k.endswith(".scales") for k in names)
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"] == json.loads((src / "config.json").read_text())["vision_config"]
    ref = np.load(src / "reference.npz")
    keep = ref["image_position_ids"][2][:, 0] >= 0
    pixels, positions = ref["pixel_values"][2][keep], ref["image_position_ids"][2][keep]
    got, exact = features(out, pixels, positions), ref["features_2_exact"]
    err = np.abs(got - exact).max() / np.abs(exact).max()
    assert err < 0.08  # a bf16 tower (and 8-bit layers) against float64: the right features, roughly
    loaded = load(out)
    assert loaded.vision is not None and not loaded.vision.loaded  # read with the first image only


def test_mlx_community_names_load_as_they_are(tmp_path):
    """A checkpoint whose vision tensors have no `model.` prefix (mlx-community's) gives the same soft tokens."""
    src = VISION / "causal"
    weights = {k[len("model."):] if k.startswith("model.vision") or k.startswith("model.embed_vision") else k: v
               for k, v in load_weights(weight_files(src)).items()}
    assert "vision_tower.patch_embedder.input_proj.weight" in weights
    ref = np.load(src / "reference.npz")
    keep = ref["image_position_ids"][0][:, 0] >= 0
    a = vision_from_weights(read_config(src), weights)(ref["pixel_values"][0][keep], ref["image_position_ids"][0][keep])
    assert np.abs(np.array(a) - ref["features_0_exact"]).max() <= 1e-4 * np.abs(ref["features_0_exact"]).max()


def test_a_quantized_embedder_loads_as_mlx_community_ships_it():
    """mlx-community's 4-bit checkpoints quantize `embed_vision.embedding_projection` (the tower stays
    bf16): its `.scales`/`.biases` load into a quantized layer that computes what was saved."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_mtp.models.gemma4_vision import Vision, VisionConfig

    vision_config = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, patch_size=4, position_embedding_size=16)
    config = {"vision_config": vision_config, "text_config": {"hidden_size": 32},
              "quantization": {"group_size": 32, "bits": 4}}
    source = Vision.from_config(config)
    nn.quantize(source.embed_vision, group_size=32, bits=4)
    saved = dict(tree_flatten(source.parameters()))
    assert "embed_vision.embedding_projection.scales" in saved
    loaded = vision_from_weights(config, saved)
    rng = np.random.default_rng(0)
    pixels = rng.random((36, 48)).astype(np.float32)
    positions = np.stack(np.meshgrid(np.arange(6), np.arange(6), indexing="xy"), -1).reshape(-1, 2)
    assert np.array_equal(np.array(loaded(pixels, positions)), np.array(source(pixels, positions)))
    assert isinstance(loaded.embed_vision.embedding_projection, nn.QuantizedLinear)
