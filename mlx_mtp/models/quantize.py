"""Quantization recipes: bits, group size and mode per layer, on top of mlx-lm's `quantize_model`."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .quantized import adopt

# Modes whose group size and bits are fixed by the format.
FIXED_MODES = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
PRESETS = ("mixed_4_8",)


@lru_cache(maxsize=None)
def available_modes() -> tuple[str, ...]:
    """`affine` plus the microscaling formats this MLX build can quantize to."""
    modes = ["affine"]
    for mode, (group_size, bits) in FIXED_MODES.items():
        try:
            mx.eval(mx.quantize(mx.zeros((32, 64)), group_size=group_size, bits=bits, mode=mode))
            modes.append(mode)
        except (ValueError, RuntimeError, TypeError):
            pass
    return tuple(modes)


def base_params(bits: Optional[int], group_size: Optional[int], mode: str = "affine") -> dict[str, Any]:
    """Validated defaults for one quantization run (None picks the mode's default)."""
    if mode not in available_modes():
        have = ", ".join(available_modes())
        raise ValueError(f"quantization mode {mode!r} unavailable (this MLX has: {have})")
    if mode in FIXED_MODES:
        fixed_gs, fixed_bits = FIXED_MODES[mode]
        if group_size not in (None, fixed_gs) or bits not in (None, fixed_bits):
            raise ValueError(f"mode {mode} fixes group_size={fixed_gs} and bits={fixed_bits}")
        return {"group_size": fixed_gs, "bits": fixed_bits, "mode": mode}
    bits = 4 if bits is None else bits
    group_size = 64 if group_size is None else group_size
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, not {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, not {group_size}")
    return {"group_size": group_size, "bits": bits, "mode": mode}


def _layer_index(path: str) -> Optional[int]:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", path)
    return int(m.group(1)) if m else None


def recipe(model: nn.Module, params: dict[str, Any], preset: Optional[str] = None) -> Callable:
    """The per-layer predicate: the model's own default (`quant_predicate`: e.g. the MoE router
    at 8 bits), then the preset.

    Returns full parameter dicts (mode included) for every override so that the saved record
    needs no defaults to be read back.
    """
    default = getattr(model, "quant_predicate", None) or (lambda path, module: True)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        if params["mode"] != "affine":
            raise ValueError(f"preset {preset} mixes bit widths; it needs mode affine, not {params['mode']}")
    last = len(getattr(getattr(model, "model", None), "layers", [])) - 1
    high = {**params, "bits": 8}

    def fit(choice: dict, module: nn.Module):
        """An override whose group size does not divide the input dim falls back to the run's."""
        dim = module.weight.shape[-1]
        for group_size in (choice["group_size"], params["group_size"]):
            if dim % group_size == 0:
                return {**choice, "group_size": group_size}
        return False

    def predicate(path: str, module: nn.Module):
        choice = default(path, module)
        if isinstance(choice, dict):
            return fit({"mode": "affine", **choice}, module)
        if choice and preset == "mixed_4_8" and _layer_index(path) in (0, last):
            return dict(high)
        return choice

    return predicate


def quantize(
    model: nn.Module,
    config: dict[str, Any],
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    mode: str = "affine",
    preset: Optional[str] = None,
) -> dict[str, Any]:
    """Quantize `model` in place (lazily) and return `config` with its `quantization` record."""
    from mlx_lm.utils import quantize_model

    if "quantization" in config:
        raise ValueError("the checkpoint is already quantized; convert from the unquantized weights")
    if preset == "mixed_4_8" and bits not in (None, 4):
        raise ValueError("preset mixed_4_8 sets the bits itself (4, with 8 for the first and last layers)")
    params = base_params(bits, group_size, mode)
    _, config = quantize_model(
        model, config, params["group_size"], params["bits"], mode=params["mode"],
        quant_predicate=recipe(model, params, preset),
    )
    adopt(model)
    return config
