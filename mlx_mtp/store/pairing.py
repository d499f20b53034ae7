"""Which drafter a target gets: the one models.json names, else one whose name and config say
they belong together.

By name: the drafter's repo is the target's plus `-assistant` (`google/gemma-4-31B-it` and
`google/gemma-4-31B-it-assistant`), or, for a converted or re-published target, the two names
agree once the format's suffixes are dropped and the org ignored (`mlx-community/gemma-4-e2b-it-4bit`
and `google/gemma-4-E2B-it-assistant`). By config: the drafter is a `gemma4_assistant` /
`gemma4_unified_assistant` whose backbone, vocabulary, window and the K/V heads and head dims it
reads are the target's (the check `load` makes, run here on the configs alone).
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from ..models import DRAFTER_TYPES, model_module
from ..models.base import ConfigError
from .checkpoint import Checkpoint

# the suffixes a conversion or a re-publication adds to a repo's name
_FORMAT = re.compile(r"(?:-(?:mlx|qat|bf16|fp16|f16|fp32|unquantized|\d+-?bits?|q\d(?:_\d)?|mxfp\d|nvfp4|"
                     r"mixed_\d_\d|dwq))+\Z", re.IGNORECASE)
_ASSISTANT = "-assistant"


def stem(name: str) -> str:
    """A repo's name without its org, case, or format suffixes."""
    return _FORMAT.sub("", name.rsplit("/", 1)[-1]).casefold()


def mismatch(target: dict[str, Any], drafter: dict[str, Any]) -> Optional[str]:
    """Why the drafter config cannot draft for the target config (None: it can)."""
    if drafter.get("model_type") not in DRAFTER_TYPES:
        return f"{drafter.get('model_type')!r} is not an MTP drafter"
    module = model_module(drafter["model_type"])
    try:
        mine = SimpleNamespace(config=module.Config.from_dict(drafter))
        theirs = SimpleNamespace(config=model_module(target["model_type"]).Config.from_dict(target))
        module.Model.check_target(mine, theirs)  # reads only the two configs
    except (ValueError, ConfigError, AttributeError) as e:
        return str(e)
    return None


def choose(target: Checkpoint, drafters: Sequence[Checkpoint]) -> tuple[Optional[Checkpoint], str]:
    """The drafter the names and configs pair with `target`, and how ("name", "family"; "" for none).
    Ties go to the exact name, then the same org, then a drafter whose name has no format suffix,
    then the models dir over the Hugging Face cache."""
    exact = f"{target.name}{_ASSISTANT}".casefold()
    want = stem(target.name) + _ASSISTANT
    found = [d for d in drafters if (d.name.casefold() == exact or _drafter_stem(d.name) == want)
             and mismatch(target.config, d.config) is None]
    if not found:
        return None, ""
    org = target.name.rsplit("/", 1)[0].casefold() if "/" in target.name else ""

    def rank(d: Checkpoint):
        plain = _FORMAT.search(d.name[: -len(_ASSISTANT)] if d.name.lower().endswith(_ASSISTANT) else d.name)
        same_org = "/" in d.name and d.name.rsplit("/", 1)[0].casefold() == org
        return (d.name.casefold() != exact, not same_org, plain is not None, d.where != "models", d.name)

    best = min(found, key=rank)
    return best, "name" if best.name.casefold() == exact else "family"


def _drafter_stem(name: str) -> Optional[str]:
    """`<stem of the target's name>-assistant` for a drafter's repo name (format suffixes dropped
    on either side of `-assistant`)."""
    base = _FORMAT.sub("", name.rsplit("/", 1)[-1])
    if not base.lower().endswith(_ASSISTANT):
        return None
    return stem(base[: -len(_ASSISTANT)]) + _ASSISTANT
