"""apps/vision_ttft.py's demo at budget 280: the fixture copied with the released 10240-entry position
table takes a 280-token image the fixture itself refuses, and keeps the fixture's soft tokens where
the fixture's 32 entries reach."""

import json

import mlx.core as mx
import numpy as np
import pytest

from apps.vision_ttft import BIG, DEMO, demo_checkpoint, picture
from mlx_mtp import load
from mlx_mtp.formats.vision import encoder


def soft_tokens(vision, image, budget):
    patches = vision.process(image, budget)
    return patches.tokens, np.array(vision.load()(mx.array(patches.pixels), mx.array(patches.positions)))


def test_demo_checkpoint_takes_a_280_token_image(tmp_path):
    path = demo_checkpoint(tmp_path / "demo280")
    big, small = encoder(load(path, load_vision=True)), encoder(load(DEMO, load_vision=True))
    assert big.budget == 280
    assert json.loads((path / "config.json").read_text())["text_config"]["global_head_dim"] == 32
    tokens, out = soft_tokens(big, picture(*BIG, seed=0), 280)
    assert tokens == 280 and out.shape == (280, 64) and np.isfinite(out).all()
    with pytest.raises(ValueError, match="position table"):
        soft_tokens(small, picture(*BIG, seed=0), 280)
    image = picture(40, 30, seed=1)  # 63 tokens at budget 70: within both tables, the same rows read
    np.testing.assert_array_equal(soft_tokens(big, image, 70)[1], soft_tokens(small, image, 70)[1])
