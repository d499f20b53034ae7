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
# A checkpoint's media towers: (module, the function that builds one from the checkpoint's config and
# weights) by the model_type of its `vision_config` / `audio_config`; the 12B's encoder-free embedders
# serve both kinds.
_TOWERS = {
    "gemma4_vision": ("gemma4_vision", "vision_from_weights"),
    "gemma4_audio": ("gemma4_audio", "audio_from_weights"),
    "gemma4_unified": ("gemma4_unified", "embedders_from_weights"),
}
MEDIA = ("vision", "audio")


def model_module(model_type: str):
    """The module implementing `model_type` (it exposes `Config` and `Model`)."""
    if model_type not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: {known})")
    return importlib.import_module(f"{__name__}.{_REGISTRY[model_type]}")


def tower_builder(config: dict, kind: str):
    """The function that builds the checkpoint's `kind` ("vision" or "audio") tower from its config
    and weights (`(config, weights) -> nn.Module`), or None where it has none."""
    if not config.get(f"{kind}_config"):
        return None
    owner = config.get("model_type") if config.get("model_type") == "gemma4_unified" else \
        config[f"{kind}_config"].get("model_type", f"gemma4_{kind}")
    if owner not in _TOWERS:
        raise ConfigError(f"unsupported {kind} tower {owner!r} (supported: {', '.join(sorted(_TOWERS))})")
    module, function = _TOWERS[owner]
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)
