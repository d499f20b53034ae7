"""One look at the store: its entries (each a target with its drafter), the names they answer
to, and what was refused."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Optional, Sequence

from .checkpoint import Checkpoint, KVShape
from .errors import NotFound, Refused, StoreError
from .names import DEFAULT_TAG, Name, derived_aliases, key
from .pairing import choose, mismatch
from .settings import FILE, Settings


@dataclass(frozen=True)
class Entry:
    """A model as the store serves it: a target and the drafter paired with it (None: plain decoding)."""

    name: str  # the target's store name ("google/gemma-4-31B-it"); it answers to `name:latest` too
    target: Checkpoint
    drafter: Optional[Checkpoint]
    paired_by: str = ""  # "models.json", "name", "family", or "" without a drafter
    aliases: tuple[str, ...] = ()  # the other names it answers to ("gemma4:31b", ...)

    @property
    def bytes(self) -> int:
        """The weights a load allocates: target and drafter tensors (media towers included)."""
        return self.target.bytes + (self.drafter.bytes if self.drafter else 0)

    @property
    def kv(self) -> KVShape:
        return self.target.kv

    @property
    def where(self) -> str:
        return self.target.where


class Catalog:
    """The entries of one scan, indexed by every name they answer to; what was refused."""

    def __init__(self, checkpoints: Sequence[Checkpoint], refused: Sequence[Refused], settings: Settings):
        # one checkpoint per name: the models dir's copy over the Hugging Face cache's
        unique: dict[str, Checkpoint] = {}
        for c in sorted(checkpoints, key=lambda c: c.where != "models"):
            unique.setdefault(c.name.casefold(), c)
        self._drafters = {k: c for k, c in unique.items() if c.is_drafter}
        self.problems: list[Refused] = list(refused)
        self._refused = {r.name.casefold(): r for r in refused}
        paired = [self._pair(t, settings) for t in unique.values() if not t.is_drafter]
        self._ambiguous: dict[str, list[str]] = {}
        self.entries = self._name(sorted(paired, key=lambda e: e.name.casefold()), settings)

    def _pair(self, target: Checkpoint, settings: Settings) -> Entry:
        explicit, drafter_name = settings.pair(target.name)
        if not explicit:
            drafter, how = choose(target, list(self._drafters.values()))
            return Entry(target.name, target, drafter, how)
        if drafter_name is None:
            return Entry(target.name, target, None, "models.json")
        drafter = self._drafters.get(drafter_name.casefold())
        why = f"{drafter_name} is not a drafter in the store" if drafter is None else \
            mismatch(target.config, drafter.config)
        if why:
            self.problems.append(Refused(FILE, settings.path, f"pairs {target.name} with {drafter_name}: "
                                                              f"{why}"))
            return Entry(target.name, target, None, "")
        return Entry(target.name, target, drafter, "models.json")

    def _name(self, entries: list[Entry], settings: Settings) -> list[Entry]:
        """Index every entry under its name, models.json's aliases, then the derived aliases that
        only one entry claims; returns the entries with their aliases."""
        names: dict[str, str] = {}  # key -> entry name
        for e in entries:
            try:
                names[key(e.name)] = e.name
            except StoreError:
                self.problems.append(Refused(e.name, e.target.path, "not a valid model name (name:tag)"))
        known = {e.name.casefold(): e.name for e in entries}
        claims: dict[str, list[tuple[str, str]]] = {}  # key -> [(alias, entry name)], models.json's first
        for alias, name in settings.aliases.items():
            if name.casefold() in known:
                claims.setdefault(key(alias), []).append((alias, known[name.casefold()]))
            else:
                why = f"alias {alias} names {name}, which is not in the store"
                self.problems.append(Refused(FILE, settings.path, why))
        explicit = set(claims)
        for e in entries:
            for alias in derived_aliases(e.name):
                claims.setdefault(key(alias), []).append((alias, e.name))
        aliases: dict[str, list[str]] = {e.name: [] for e in entries}
        for k, claimants in claims.items():
            if k in names:
                continue  # a store name is never an alias of another entry
            if k in explicit or len({name for _, name in claimants}) == 1:
                alias, name = claimants[0]
                names[k] = name
                aliases[name].append(alias)
            else:
                self._ambiguous[k] = sorted({name for _, name in claimants})
        final = {e.name: dataclasses.replace(e, aliases=tuple(aliases[e.name])) for e in entries}
        self._index = {k: final[name] for k, name in names.items()}
        return list(final.values())

    def resolve(self, text: str) -> Entry:
        """The entry `text` names (an Ollama name, a store name, an alias). Raises NotFound with the
        reason where one is known (ambiguous, a drafter, refused files) or the names near it."""
        k = key(text)
        if k in self._index:
            return self._index[k]
        if k in self._ambiguous:
            raise NotFound(text, self._ambiguous[k], "it could name several models")
        name = Name.parse(text)
        if name.tag == DEFAULT_TAG and name.path.casefold() in self._drafters:
            raise NotFound(text, why="it is an MTP drafter; name the model it drafts for")
        refused = self._refused.get(name.path.casefold()) if name.tag == DEFAULT_TAG else None
        if refused is not None:
            raise NotFound(text, why=f"refused: {refused.reason}")
        raise NotFound(text, self.near(text))

    def names(self) -> list[str]:
        """Every name the entries answer to, store names first."""
        return [e.name for e in self.entries] + [a for e in self.entries for a in e.aliases]

    def near(self, text: str, n: int = 3) -> list[str]:
        names = self.names()
        folded = {s.casefold(): s for s in names}
        found = difflib.get_close_matches(text.casefold(), list(folded), n=n, cutoff=0.6)
        return [folded[f] for f in found]
