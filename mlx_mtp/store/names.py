"""Model names in Ollama's `name:tag` form, and the aliases a stored model answers to.

Ollama's rules, as its clients send names: a missing tag is `latest`; a name may carry Ollama's
default host and namespace (`registry.ollama.ai/library/gemma4:31b` is `gemma4:31b`); a Hugging Face
repo may be named `hf.co/org/name`; names compare without case. A stored model answers to its
Hub id (`google/gemma-4-31B-it`, tag `latest`) and, for the Gemma 4 family, to Ollama's tag for it
(`gemma4:31b`; `gemma4:latest` is `gemma4:e4b`, as in Ollama's library).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .errors import StoreError

DEFAULT_TAG = "latest"
FAMILY = "gemma4"
# Ollama's gemma4 tags and the Hugging Face repos that hold them (the drafter: the repo + "-assistant")
CATALOG = {
    "e2b": "google/gemma-4-E2B-it", "e4b": "google/gemma-4-E4B-it", "12b": "google/gemma-4-12B-it",
    "26b": "google/gemma-4-26B-A4B-it", "31b": "google/gemma-4-31B-it",
}
LATEST = "e4b"  # what Ollama's gemma4:latest is
_PREFIXES = ("registry.ollama.ai/library/", "registry.ollama.ai/", "library/", "hf.co/", "huggingface.co/")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
# gemma-4-<size>[-A<active>B][-it][-<rest>]: the tag is the size, "-pt" for a base model, then the rest
_GEMMA = re.compile(r"gemma-4-(e?\d+b)(?:-a\d+b)?(-it)?(?:-(.+))?\Z", re.IGNORECASE)


@dataclass(frozen=True)
class Name:
    """A parsed name: `path` ("gemma4", "google/gemma-4-31B-it") and `tag` ("latest" if none)."""

    path: str
    tag: str = DEFAULT_TAG

    @classmethod
    def parse(cls, text: str) -> "Name":
        """Raises StoreError for a name Ollama would refuse."""
        rest = text.strip()
        for prefix in _PREFIXES:
            if rest.lower().startswith(prefix):
                rest = rest[len(prefix):]
                break
        head, _, last = rest.rpartition("/")
        last, colon, tag = last.partition(":")
        path = f"{head}/{last}" if head else last
        tag = tag if colon else DEFAULT_TAG
        if not all(_PART.match(p) for p in path.split("/")) or not _PART.match(tag) or path.count("/") > 1:
            raise StoreError(f"invalid model name {text!r}: expected name[:tag] or org/repo[:tag]")
        return cls(path, tag)

    @property
    def key(self) -> str:
        """The form two names are compared in."""
        return f"{self.path}:{self.tag}".casefold()

    def __str__(self) -> str:
        return f"{self.path}:{self.tag}"


def key(text: str) -> str:
    return Name.parse(text).key


def family_tag(repo: str) -> Optional[str]:
    """Ollama's gemma4 tag for a repo's name (`gemma-4-31B-it` -> "31b", `gemma-4-e2b-it-4bit` ->
    "e2b-4bit", `gemma-4-31B` -> "31b-pt"), None for other names."""
    found = _GEMMA.match(repo.rsplit("/", 1)[-1])
    if found is None:
        return None
    size, it, rest = found.groups()
    return size.lower() + ("" if it else "-pt") + (f"-{rest.lower()}" if rest else "")


def derived_aliases(repo: str) -> list[str]:
    """The Ollama names a stored repo answers to besides its id: `gemma4:<tag>`, and `gemma4:latest`
    for the tag Ollama's latest is."""
    tag = family_tag(repo)
    if tag is None:
        return []
    return [f"{FAMILY}:{tag}"] + ([f"{FAMILY}:{DEFAULT_TAG}"] if tag == LATEST else [])
