"""The store's errors, each said in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


class StoreError(Exception):
    """A store operation that cannot be done; `str()` is one line for a terminal or an API error."""


class NotFound(StoreError, LookupError):
    """No stored model answers to `name` (`near`: names that look like it)."""

    def __init__(self, name: str, near: Sequence[str] = (), why: Optional[str] = None):
        self.name, self.near, self.why = name, tuple(near), why
        hint = f"; near: {', '.join(self.near)}" if self.near else ""
        super().__init__(f"model '{name}' not found{' (' + why + ')' if why else ''}{hint}")


class Refused(StoreError):
    """A checkpoint in the store that cannot be used (a truncated or foreign file, a config we do
    not serve); it is never listed as a model. `name` is the store name it would have had."""

    def __init__(self, name: str, path: Path, reason: str):
        self.name, self.path, self.reason = name, Path(path), reason
        super().__init__(f"{name}: {reason}")


class PullError(StoreError):
    """A pull that failed; what it had fetched stays in the models dir's `.partial/` for the next one."""


class NotOnHub(PullError):
    """A pull of a repo the Hub does not have."""
