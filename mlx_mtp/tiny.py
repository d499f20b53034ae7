"""Tiny random Gemma 4 pairs (a target and its MTP drafter) built in-process, for the selftest.

The configs (`tiny_configs.json`) are those of the transformers-made test fixtures in
tests/fixtures/tiny: a dense target, a MoE one, and an E2B-style one with per-layer inputs,
KV-shared layers and a centroid-head drafter, all with a sliding window of 8. The fixtures
themselves are not shipped; the weights here are drawn from a seed instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .loading import Loaded, build_model

CONFIGS = Path(__file__).with_name("tiny_configs.json")
VARIANTS = ("dense", "moe", "e2b")


def tiny_pair(variant: str, seed: int = 0) -> Loaded:
    """A random target and an independently random drafter (so drafts are often rejected)."""
    configs = json.loads(CONFIGS.read_text())[variant]
    target, drafter = build_model(configs["target"]), build_model(configs["drafter"])
    randomize(target, seed)
    randomize(drafter, seed + 1)
    drafter.check_target(target)
    return Loaded(target, None, drafter, frozenset())


def randomize(model: nn.Module, seed: int) -> None:
    """Overwrite every array with well-scaled random values, so that no path is near identity:
    matrices ~ N(0, 1/fan_in), scales (1-d) ~ 1 + 0.3 N(0, 1), index tables a permutation."""
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    drawn = []
    for (name, a), key in zip(params, keys):
        if not mx.issubdtype(a.dtype, mx.floating):
            value = mx.random.permutation(a.size, key=key).reshape(a.shape).astype(a.dtype)
        elif a.ndim == 1:
            value = 1.0 + 0.3 * mx.random.normal(a.shape, key=key)
        else:
            value = mx.random.normal(a.shape, key=key) / math.sqrt(a.shape[-1])
        drawn.append((name, value.astype(a.dtype)))
    model.update(tree_unflatten(drawn))
    mx.eval(model.parameters())
    model.eval()
