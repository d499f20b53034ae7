"""Tiny random Gemma 4 pairs (a target and its MTP drafter) built in-process, for the selftest.

The configs (`tiny_configs.json`) are those of the transformers-made test fixtures in
tests/fixtures/tiny: a dense target, a MoE one, and an E2B-style one with per-layer inputs,
KV-shared layers and a centroid-head drafter, all with a sliding window of 8. The fixtures
themselves are not shipped; the weights here are drawn from a seed instead. `quantized_pair` is
the MoE pair reshaped for GPU kernels (bf16, 4 bits, head_dim 64 and 128, 16 experts), on which
mlx_mtp's CUDA kernels run.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..loading import Loaded, build_model

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


def quantized_pair(seed: int = 11) -> Loaded:
    """The tiny MoE pair at sizes mlx_mtp's CUDA kernels take (head_dim 64, 128 in the full layer; 16
    experts; two layers), in bf16 and quantized to 4 bits (group 32; the router and dense MLP at 8),
    target and drafter independently random. Seed 11's greedy output does not fall into a repeat at once."""
    configs = json.loads(CONFIGS.read_text())["moe"]
    layers = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], head_dim=64,
                  per_layer_config={"1": {"head_dim": 128, "num_key_value_heads": 1}})
    target_config, drafter_config = copy.deepcopy(configs["target"]), copy.deepcopy(configs["drafter"])
    target_config.update(layers, num_experts=16, intermediate_size=128)
    drafter_config["text_config"].update(layers, num_kv_shared_layers=2)
    from ..models.quantize import quantize

    models = []
    for config, offset in ((target_config, 0), (drafter_config, 1)):
        model = build_model(config)
        randomize(model, seed + offset)
        model.set_dtype(mx.bfloat16)
        with contextlib.redirect_stdout(io.StringIO()):  # (mlx-lm prints the bits per weight)
            quantize(model, {}, bits=4, group_size=32)
        mx.eval(model.parameters())
        models.append(model)
    models[1].check_target(models[0])
    return Loaded(models[0], None, models[1], frozenset())


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
