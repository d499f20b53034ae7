"""Prompts with images: the text model with soft tokens at the placeholders and transformers' mask
(an image's tokens see each other on sliding layers of the 26B/31B-like model, causal elsewhere)
reproduces transformers 5.23's logits for prompts with 1-3 images (make_vision_fixtures.py)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import BOTH_KERNELS

from mlx_mtp.loading import load_model, load_weights, weight_files
from mlx_mtp.models.gemma4_vision import PromptImages, placeholder_runs, vision_from_weights

VISION = Path(__file__).parent / "fixtures" / "vision"
IMAGE = 121  # the fixtures' image token id
TOL = 1e-4  # fp32 against float64 references, as tests/test_gemma4_parity.py
pytestmark = [pytest.mark.usefixtures("fused"), BOTH_KERNELS]
_LOADED = {}


def loaded(variant):
    if variant not in _LOADED:
        model, config, _ = load_model(VISION / variant)
        vision = vision_from_weights(config, load_weights(weight_files(VISION / variant)))
        _LOADED[variant] = model, vision, np.load(VISION / variant / "reference.npz")
    return _LOADED[variant]


def prompt(variant, n):
    """The n-image prompt's ids and its images' soft tokens, placed."""
    _, vision, ref = loaded(variant)
    ids = ref[f"prompt_{n}"]
    feats = []
    for i in ref[f"images_{n}"]:
        keep = ref["image_position_ids"][i][:, 0] >= 0
        feats.append(vision(ref["pixel_values"][i][keep], ref["image_position_ids"][i][keep]))
    return ids, PromptImages(tuple(s for s, _ in placeholder_runs(ids, IMAGE)), tuple(feats))


def chunked_logits(model, ids, images, chunk):
    """Prefill in chunks of about `chunk` tokens, each end moved off any image (`PromptImages.cut`)."""
    cache, start, out = model.make_cache(), 0, []
    while start < len(ids):
        end = images.cut(start, min(start + chunk, len(ids)))
        out.append(model(mx.array(ids[None, start:end]), cache, images=images.rows(start, end - start)).logits[0])
        start = end
    return np.concatenate([np.array(o) for o in out])


@pytest.mark.parametrize("variant", ["bidir", "causal"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_logits_match_transformers(variant, n):
    model, _, ref = loaded(variant)
    ids, images = prompt(variant, n)
    logits = model(mx.array(ids[None]), images=images.rows(0, len(ids))).logits[0]
    assert np.abs(np.array(logits) - ref[f"logits_{n}_exact"]).max() <= TOL


@pytest.mark.parametrize("variant", ["bidir", "causal"])
@pytest.mark.parametrize("chunk", [1, 5, 9])
def test_chunks_never_cut_an_image(variant, chunk):
    """Chunks that would end inside an image end before it (or after it): the same logits. Image 2
    (12 tokens) is longer than the window (8), so chunk 1 and 9 take it whole past the ring."""
    model, _, ref = loaded(variant)
    ids, images = prompt(variant, 3)
    assert np.abs(chunked_logits(model, ids, images, chunk) - ref["logits_3_exact"]).max() <= TOL


def test_bidirectional_overlay_matters():
    """Cutting an image on the 26B/31B-like model changes its logits (the mask is really there):
    a forward per token sees no later token of its image."""
    model, _, ref = loaded("bidir")
    ids, images = prompt("bidir", 1)
    cache, out = model.make_cache(), []
    for t in range(len(ids)):
        out.append(np.array(model(mx.array(ids[None, t : t + 1]), cache, images=images.rows(t, 1)).logits[0]))
    assert np.abs(np.concatenate(out) - ref["logits_1_exact"]).max() > 1e-2


def test_cut_snaps_outside_images():
    images = PromptImages((4, 20), (mx.zeros((6, 2)), mx.zeros((12, 2))))
    assert images.cut(0, 7) == 4  # would cut image 0: end before it
    assert images.cut(4, 7) == 10  # starts at image 0: take it whole
    assert images.cut(0, 10) == 10 and images.cut(10, 25) == 20
