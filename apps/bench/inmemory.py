"""A released Gemma 4 shape with random weights, built in memory on the device, quantized the
way the converter writes it; and the same weights loaded into mlx-lm and mlx-vlm, so the three
run on one copy of the weights on one device.

The converter's shapes-only plan (`convert.plan(..., shapes_only=True)`) says which tensors the
checkpoint holds, their shapes and their quantization (4-bit affine, group 64; the MoE router
and dense MLP as `mlx_mtp.models.quantize` chooses). Its lazily initialised arrays are never evaluated:
each tensor is drawn again directly in its stored form (random packed codes, scales and biases
that give weights of standard deviation 1 / sqrt(fan-in)), one tensor at a time, so memory holds
the quantized model and nothing more. Nothing is written to disk but two small config files
for the peers' loaders, which read the arrays through a patched reader.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import types
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from convert.convert import plan
from mlx_mtp.loading import model_from_weights

from .speed import mlxlm_config

GROUP = 64  # the converter's default group size
ORDERING = "masked_embedding.token_ordering"  # a centroid head's token order: a permutation


def random_checkpoint(config: dict, bits: int, seed: int) -> tuple[dict, dict]:
    """(converter output config, tensors under their saved names) of `config`'s model, random."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        _, out_config, weights = plan(tmp, shapes_only=True, quantize=bool(bits), bits=bits or None,
                                      quantize_drafter=True, dtype="bfloat16", progress=False)
    mx.random.seed(seed)
    for name in sorted(weights):
        weights[name] = _drawn(name, weights)
        mx.eval(weights[name])
    return out_config, weights


def _drawn(name: str, weights: dict) -> mx.array:
    """`weights[name]` drawn again in its stored form (the lazy original is dropped unevaluated)."""
    lazy = weights[name]
    base, _, kind = name.rpartition(".")
    scales = weights.get(f"{base}.scales")
    if name == ORDERING:
        return mx.random.permutation(lazy.size).astype(lazy.dtype)
    if scales is None or kind not in ("weight", "scales", "biases"):
        return lazy  # norms, scalars, unquantized layers: their own small initial values
    bits = weights[f"{base}.weight"].shape[-1] * 32 // (scales.shape[-1] * GROUP)
    if kind == "weight":  # uniform codes in [0, 2^bits): two uniform 16-bit halves of each word
        low, high = (mx.random.randint(0, 1 << 16, lazy.shape, dtype=mx.uint32) for _ in range(2))
        return low | (high << 16)
    levels = 2**bits
    step = 1 / (math.sqrt((levels**2 - 1) / 12) * math.sqrt(scales.shape[-1] * GROUP))  # std 1/sqrt(fan-in)
    value = step if kind == "scales" else -step * (levels - 1) / 2  # codes centred on zero
    return mx.full(lazy.shape, value, dtype=lazy.dtype)


def build(config: dict, bits: int, seed: int) -> tuple[nn.Module, dict, dict]:
    """(our model, its output config, its tensors) for a random checkpoint of `config`."""
    out_config, weights = random_checkpoint(config, bits, seed)
    return model_from_weights(out_config, dict(weights), where="random weights"), out_config, weights


# ---- the same weights in mlx-lm and mlx-vlm -----------------------------------------------------------


@contextlib.contextmanager
def _reading(weights: dict, config: dict) -> Iterator[Path]:
    """A directory holding `config`, an empty `model.safetensors` and an index naming every
    tensor (so mlx-vlm drops the towers a text-only checkpoint has no weights for), while every
    safetensors read (mlx-lm's `mx.load`, mlx-vlm's `_load_safetensors`) returns `weights`."""
    try:
        import mlx_vlm.utils as vlm_utils
    except ImportError:  # mlx-lm alone
        vlm_utils = types.SimpleNamespace(_load_safetensors=None)
    saved = mx.load, vlm_utils._load_safetensors
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        (Path(tmp) / "model.safetensors").touch()
        index = {"weight_map": {name: "model.safetensors" for name in weights}}
        (Path(tmp) / "model.safetensors.index.json").write_text(json.dumps(index))
        mx.load = vlm_utils._load_safetensors = lambda *a, **k: dict(weights)
        try:
            yield Path(tmp)
        finally:
            mx.load, vlm_utils._load_safetensors = saved


def mlxlm_model(config: dict, weights: dict) -> nn.Module:
    """mlx-lm's model of the target, holding the same arrays."""
    from mlx_lm.utils import load_model

    with _reading(weights, mlxlm_config(config)) as path:
        return load_model(path)[0]


def mlxvlm_pair(target: tuple, drafter: tuple) -> tuple:
    """mlx-vlm's target and MTP drafter, each given as (config, weights)."""
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    config, weights = multimodal(*target)
    with _reading(weights, mlxlm_config(config)) as path:
        model = load_model(path)
    with _reading(drafter[1], drafter[0]) as path:
        draft, kind = load_drafter(str(path), kind="mtp")
    if kind != "mtp":
        raise RuntimeError(f"mlx-vlm loaded the assistant as a {kind!r} drafter")
    return model, draft


def multimodal(config: dict, weights: dict) -> tuple[dict, dict]:
    """A text-only (`gemma4_text`) checkpoint as the `gemma4` wrapper holds it: mlx-vlm's Gemma 4
    MTP runs on the wrapper's language model only."""
    if config["model_type"] != "gemma4_text":
        return config, weights
    text = {k: v for k, v in config.items() if k != "quantization"}
    outer = dict(model_type="gemma4", text_config=text, vocab_size=text["vocab_size"])
    if "quantization" in config:
        outer["quantization"] = {k if not isinstance(v, (dict, bool)) else f"language_model.{k}": v
                                 for k, v in config["quantization"].items()}
    return outer, {f"language_model.{k}": v for k, v in weights.items()}
