"""The models dir's `models.json`: explicit pairings and aliases, which win over the derived ones.

    {"pairs":   {"google/gemma-4-31B-it-4bit": "google/gemma-4-31B-it-assistant",
                 "my/target": null},                      # null: no drafter
     "aliases": {"chat": "google/gemma-4-E2B-it"}}         # an Ollama name -> a store name
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import Refused
from .names import key

FILE = "models.json"


@dataclass(frozen=True)
class Settings:
    pairs: dict = field(default_factory=dict)  # target store name -> drafter store name, or None
    aliases: dict = field(default_factory=dict)  # Ollama name -> store name
    path: Path = Path(FILE)

    @classmethod
    def read(cls, root: Path) -> tuple["Settings", Optional[Refused]]:
        """The settings in `root` (empty without the file), and a Refused for a file that is not
        the shape above (which is then ignored)."""
        path = root / FILE
        try:
            data = json.loads(path.read_text())
            pairs, aliases = data.get("pairs", {}), data.get("aliases", {})
            if not all(isinstance(v, (str, type(None))) for v in pairs.values()) or \
                    not all(isinstance(v, str) for v in aliases.values()):
                raise ValueError("values must be store names")
            for alias in aliases:
                key(alias)  # an alias that is no Ollama name refuses the file
            return cls(dict(pairs), dict(aliases), path), None
        except FileNotFoundError:
            return cls(path=path), None
        except Exception as e:  # JSON, shape or name: one line, and the store carries on without it
            return cls(path=path), Refused(FILE, path, f"ignored: {str(e).splitlines()[0]}")

    def pair(self, target: str) -> tuple[bool, Optional[str]]:
        """(whether models.json pairs `target`, the drafter it names or None)."""
        for name, drafter in self.pairs.items():
            if name.casefold() == target.casefold():
                return True, drafter
        return False, None
