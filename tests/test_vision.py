"""The MLX vision encoder reproduces transformers 5.23's `get_image_features`
(fixtures: tests/reference/make_vision_fixtures.py)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import BOTH_KERNELS

from mlx_mtp.loading import load_weights, read_config, weight_files
from mlx_mtp.models.gemma4_vision import Vision, vision_from_weights

VISION = Path(__file__).parent / "fixtures" / "vision"
TOL = 1e-4  # relative to the largest reference value; references are float64 forwards
pytestmark = [pytest.mark.usefixtures("fused"), BOTH_KERNELS]


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def vision(variant: str) -> Vision:
    path = VISION / variant
    return vision_from_weights(read_config(path), load_weights(weight_files(path)))


def real(ref, i):
    keep = ref["image_position_ids"][i][:, 0] >= 0
    return ref["pixel_values"][i][keep], ref["image_position_ids"][i][keep]


@pytest.mark.parametrize("variant", ["bidir", "causal"])
def test_image_features_match_transformers(variant):
    """Both flavours (standardized 26B/31B-like; clipped-linear E2B-like), three grid shapes, each
    image over its real patches only (transformers ran them padded to one length)."""
    model, ref = vision(variant), np.load(VISION / variant / "reference.npz")
    for i in range(3):
        pixels, positions = real(ref, i)
        tower = model.vision_tower(mx.array(pixels), positions)
        assert rel_diff(tower, ref[f"tower_{i}_exact"]) <= TOL
        assert rel_diff(model(pixels, positions), ref[f"features_{i}_exact"]) <= TOL


def test_patch_order_does_not_matter():
    """Pooling goes by the (x, y) positions, not by row order: a shuffled image gives the same tokens."""
    model, ref = vision("bidir"), np.load(VISION / "bidir" / "reference.npz")
    pixels, positions = real(ref, 0)
    order = np.random.default_rng(0).permutation(len(pixels))
    a, b = model(pixels, positions), model(pixels[order], positions[order])
    assert rel_diff(b, a) <= 1e-5


def test_clipping_bounds_are_used():
    """The clipped-linear bounds change the output (so the test above exercises them)."""
    model, ref = vision("causal"), np.load(VISION / "causal" / "reference.npz")
    pixels, positions = real(ref, 2)
    clipped = np.array(model(pixels, positions))
    for _, module in model.named_modules():
        if "input_min" in module:
            module.input_min = module.output_min = mx.array(-np.inf)
            module.input_max = module.output_max = mx.array(np.inf)
    assert rel_diff(model(pixels, positions), clipped) > 1e-3


REAL_VISION = ["google--gemma-4-E2B-it", "google--gemma-4-E4B-it", "google--gemma-4-26B-A4B-it", "google--gemma-4-31B-it",
               "mlx-community--gemma-4-e4b-it-4bit", "mlx-community--gemma-4-26b-a4b-it-4bit"]


@pytest.mark.parametrize("name", REAL_VISION)
def test_released_vision_configs_build_with_the_published_sizes(name):
    """Shape-only builds (nothing evaluated) of every released tower: transformers' parameter count
    (tests/test_real_configs.py), plus the clipped-linear scalars (4 per linear, 7 linears a layer)
    and the standardize buffers the checkpoints ship. The 12B's `gemma4_unified_vision` is another
    front end (not built here)."""
    from mlx.utils import tree_flatten
    from test_real_configs import config, vision_buffers, vision_params

    cfg = config(name)
    model = Vision.from_config(cfg)
    clip = 28 * cfg["vision_config"]["num_hidden_layers"] if cfg["vision_config"]["use_clipped_linears"] else 0
    assert sum(v.size for _, v in tree_flatten(model.parameters())) == vision_params(cfg) + clip + vision_buffers(cfg)
    assert Vision.from_config(cfg).vision_tower.encoder.layers[0].self_attn.head_dim == cfg["vision_config"]["head_dim"]
