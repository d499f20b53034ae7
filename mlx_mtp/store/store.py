"""The store: where models live, what is in it, and the operations that change it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Union

from .catalog import Catalog, Entry
from .checkpoint import Checkpoint, Inspector
from .errors import NotFound, Refused, StoreError
from .places import discard, hf_cache, models_dir
from .pull import Puller, PullEvent
from .settings import Settings

ENV = "MLX_MTP_MODELS"  # the models dir, as --models-dir sets it
_DEFAULT = object()


def default_models_dir() -> Path:
    """$MLX_MTP_MODELS, else `mlx_mtp/models` under the user's cache ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "mlx_mtp" / "models"


def default_hf_cache() -> Path:
    """huggingface_hub's cache, found as it finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    `huggingface/hub` under the user's cache. Read now, not when huggingface_hub was imported."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    return Path(home).expanduser() / "hub"


class Store:
    """The models an app can name: targets paired with their drafters, in a models dir and the
    Hugging Face cache. Listing re-reads the disk at most every `rescan_s` seconds (and after each
    pull or delete here); a checkpoint's headers are read again only when its files change.
    Safe to share between threads."""

    def __init__(self, models_dir: Union[str, Path, None] = None, hf_cache: Union[str, Path, None] = _DEFAULT,
                 endpoint: Optional[str] = None, rescan_s: float = 2.0):
        """
        Args:
            models_dir: where pulls go (default: `default_models_dir()`).
            hf_cache: a Hugging Face cache to list too (default: `default_hf_cache()`; None: none).
            endpoint: the Hub to pull from (default: $HF_ENDPOINT, else huggingface_hub's).
            rescan_s: how long one look at the disk serves `entries`, `resolve` and `problems`.
        """
        self.models_dir = Path(models_dir).expanduser() if models_dir else default_models_dir()
        self.hf_cache = default_hf_cache() if hf_cache is _DEFAULT else (Path(hf_cache) if hf_cache else None)
        self.endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
        self.rescan_s = rescan_s
        self._inspect = Inspector()
        self._lock = threading.Lock()
        self._seen: Optional[tuple[float, Catalog]] = None

    def catalog(self) -> Catalog:
        """One consistent look at the store (entries, names, problems)."""
        with self._lock:
            if self._seen is None or time.monotonic() - self._seen[0] > self.rescan_s:
                self._seen = (time.monotonic(), self._scan())
            return self._seen[1]

    def refresh(self) -> None:
        """Forget the last look: the next call reads the disk (for changes made by another process)."""
        with self._lock:
            self._seen = None

    def entries(self) -> list[Entry]:
        """The usable models, by name."""
        return self.catalog().entries

    def problems(self) -> list[Refused]:
        """What was refused (a truncated or foreign file, an unsupported config, a bad models.json):
        one line each (`str()`), none of it listed."""
        return self.catalog().problems

    def resolve(self, name: str) -> Entry:
        """The entry `name` names: its store name or an alias, in Ollama's `name:tag` form. A name the
        last look lacks gets a fresh look (another process may have just pulled it). Raises
        NotFound (a LookupError), whose one line gives the reason or the names near it."""
        try:
            return self.catalog().resolve(name)
        except NotFound:
            self.refresh()
            return self.catalog().resolve(name)

    def pull(self, name: str, progress: Optional[Callable[[PullEvent], None]] = None,
             quantize: Optional[str] = None) -> Entry:
        """Fetch `name` from the Hub with its drafter and install it (see `pull.py`). `progress` is
        called with each PullEvent, from the pulling threads, one at a time. Raises PullError."""
        settings, _ = Settings.read(self.models_dir)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        stored = Puller(self.models_dir, self.endpoint, settings).pull(name, progress, quantize)
        self.refresh()
        return self.resolve(stored)

    def delete(self, name: str) -> Entry:
        """Remove the entry `name` names: its target, and its drafter where it lives in the same
        place and no other entry uses it. In-flight readers keep the files they have open."""
        entry = self.resolve(name)
        others = [e for e in self.entries() if e.name != entry.name and e.drafter is not None]
        doomed = [entry.target]
        if entry.drafter is not None and entry.drafter.where == entry.target.where and \
                all(e.drafter.path != entry.drafter.path for e in others):
            doomed.append(entry.drafter)
        for checkpoint in doomed:
            self._remove(checkpoint)
        self.refresh()
        return entry

    def _remove(self, checkpoint: Checkpoint) -> None:
        if checkpoint.where == "models":
            discard(self.models_dir, checkpoint.path)
            parent = checkpoint.path.parent
            if parent != self.models_dir and not any(parent.iterdir()):
                parent.rmdir()  # the org's last repo
            return
        from huggingface_hub import scan_cache_dir

        cache = scan_cache_dir(self.hf_cache)
        repos = [r for r in cache.repos if r.repo_type == "model" and r.repo_id == checkpoint.name]
        if not repos:
            raise StoreError(f"{checkpoint.name} is no longer in the Hugging Face cache")
        cache.delete_revisions(*(r.commit_hash for repo in repos for r in repo.revisions)).execute()

    def _scan(self) -> Catalog:
        settings, bad = Settings.read(self.models_dir)
        mine, refused = models_dir(self.models_dir, self._inspect)
        theirs, refused_there = hf_cache(self.hf_cache, self._inspect)
        return Catalog(mine + theirs, refused + refused_there + ([bad] if bad else []), settings)


def named(model: Optional[str], drafter: Optional[str] = None,
          store: Optional[Store] = None) -> tuple[Optional[str], Optional[str]]:
    """`--model` (and `--drafter`) as the chat and the server take them: a directory as it is, else a
    name in the store (`gemma4:e2b`, `google/gemma-4-E2B-it`, an alias): its target's directory and,
    unless `drafter` names one, its drafter's. A name with an org the store lacks stays a hub id for
    `load`; one without stays an error, said in one line with the store's nearest names.

    Raises:
        NotFound: a bare name (no org) that the store does not hold.
    """
    if model is None or Path(model).expanduser().exists():
        return model, drafter
    from .errors import NotFound

    try:
        entry = (store or Store()).resolve(model)
    except NotFound as e:
        if "/" in model.split(":")[0]:  # `org/name`: a hub id, fetched by `load`
            return model, drafter
        raise NotFound(f"{e}; pull it (mlx-mtp pull {model}) or pass a directory") from None
    if drafter is None and entry.drafter is not None:
        drafter = str(entry.drafter.path)
    return str(entry.target.path), drafter
