"""Model registry: HF `model_type` -> module. Explicit, so an unknown type fails loudly."""

import importlib

from .base import ConfigError

_REGISTRY = {
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "gemma4_assistant": "gemma4_assistant",
    "gemma4_unified": "gemma4_unified",
    "gemma4_unified_text": "gemma4_unified",
    "gemma4_unified_assistant": "gemma4_unified_assistant",
}
DRAFTER_TYPES = frozenset({"gemma4_assistant", "gemma4_unified_assistant"})  # MTP drafters, not targets


def model_module(model_type: str):
    """The module implementing `model_type` (it exposes `Config` and `Model`)."""
    if model_type not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: {known})")
    return importlib.import_module(f"{__name__}.{_REGISTRY[model_type]}")
