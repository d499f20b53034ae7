"""The 12B's MTP drafter (`gemma4_unified_assistant`).

transformers' `Gemma4UnifiedAssistantForCausalLM` is `Gemma4AssistantForCausalLM` under another name:
the same weights and forward, with a `gemma4_unified_text` text config. So the model is
`gemma4_assistant`'s and only the config's defaults differ.
"""

from __future__ import annotations

import dataclasses

from . import gemma4_assistant, gemma4_unified

Model = gemma4_assistant.Model
joined_name, parts, unjoin, keeping_parts = (
    gemma4_assistant.joined_name, gemma4_assistant.parts, gemma4_assistant.unjoin, gemma4_assistant.keeping_parts)


@dataclasses.dataclass
class Config(gemma4_assistant.Config):
    backbone_hidden_size: int = 3840
    _TEXT = gemma4_unified.Config
