"""Where checkpoints are found: the models dir and the Hugging Face cache.

The models dir holds `<org>/<name>/` (a pulled Hub repo) or `<name>/` (a directory put there by
hand), each a checkpoint. Names starting with a dot are the store's own work and never listed:
`.partial/` (pulls in flight), `.trash/` (deletions), a conversion's `.<name>.partial-<pid>/`.
Anything else that is not a checkpoint is refused with its name. In the Hugging Face cache only
repos whose config names a model type this project loads are ours to list or refuse.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Optional

from ..models import model_module
from ..models.base import ConfigError
from .checkpoint import Checkpoint
from .errors import Refused
from .settings import FILE

Inspect = Callable[[str, Path, str], Checkpoint]


def models_dir(root: Path, inspect: Inspect) -> tuple[list[Checkpoint], list[Refused]]:
    found: list[Checkpoint] = []
    refused: list[Refused] = []
    if not root.is_dir():
        return found, refused
    for item in _visible(root):
        if item.name == FILE and item.is_file():
            continue
        if item.is_dir() and not any(c.is_file() for c in _visible(item)):  # an org: its repos inside
            candidates = [(f"{item.name}/{c.name}", c) for c in _visible(item)]
        else:
            candidates = [(item.name, item)]
        for name, path in candidates:
            if not path.is_dir():
                refused.append(Refused(name, path, "a foreign file, not a model directory"))
                continue
            try:
                found.append(inspect(name, path, "models"))
            except Refused as e:
                refused.append(e)
    return found, refused


def discard(root: Path, path: Path) -> None:
    """Remove a directory of the models dir: first renamed into `.trash/` (one step, so no listing
    sees it half removed), then deleted. What a killed deletion left there goes with the next one."""
    trash = root / ".trash"
    trash.mkdir(parents=True, exist_ok=True)
    os.replace(path, trash / uuid.uuid4().hex)
    for item in trash.iterdir():
        shutil.rmtree(item, ignore_errors=True)


def _visible(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if not p.name.startswith("."))


def hf_cache(cache: Optional[Path], inspect: Inspect) -> tuple[list[Checkpoint], list[Refused]]:
    found: list[Checkpoint] = []
    refused: list[Refused] = []
    if cache is None or not cache.is_dir():
        return found, refused
    from huggingface_hub import scan_cache_dir

    for repo in scan_cache_dir(cache).repos:
        snapshot = _snapshot(repo) if repo.repo_type == "model" else None
        if snapshot is None or not _ours(snapshot):
            continue
        try:
            found.append(inspect(repo.repo_id, snapshot, "hf-cache"))
        except Refused as e:
            refused.append(e)
    return found, refused


def _snapshot(repo) -> Optional[Path]:
    """The revision `main` points at, else the one modified last."""
    revisions = sorted(repo.revisions, key=lambda r: r.last_modified)
    main = [r for r in revisions if "main" in r.refs]
    chosen = (main or revisions or [None])[-1]
    return None if chosen is None else Path(chosen.snapshot_path)


def _ours(snapshot: Path) -> bool:
    try:
        model_module(json.loads((snapshot / "config.json").read_text())["model_type"])
        return True
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return False
