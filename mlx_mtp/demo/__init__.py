"""The bundled demo pair: a tiny Gemma-4-architecture target trained on the CPython standard
library sources and its MTP drafter, in MLX format (bf16 weights, ~20 MB), with a
SentencePiece tokenizer and a Gemma-4-style chat template. Made by `apps/demo_pair/make_demo_pair.py`,
then trained further (apps/demo_pair/README.md, "Continued training"). Runs offline.

    from mlx_mtp.demo import load_demo
    loaded = load_demo()          # mlx_mtp.Loaded(target, tokenizer, drafter, eos_ids)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

DEMO_DIR = Path(__file__).resolve().parent
TARGET_DIR = DEMO_DIR / "target"
DRAFTER_DIR = DEMO_DIR / "drafter"


def pair() -> Optional[tuple[Path, Optional[Path]]]:
    """(target dir, drafter dir or None) of the shipped pair; None when its target is missing."""
    if not TARGET_DIR.is_dir():
        return None
    return TARGET_DIR, DRAFTER_DIR if DRAFTER_DIR.is_dir() else None


def available() -> bool:
    """True when the shipped pair's files are present (e.g. not stripped from a wheel)."""
    return (TARGET_DIR / "config.json").exists() and (DRAFTER_DIR / "config.json").exists()


def load_demo(dtype=None, mtp: bool = True):
    """Load the demo pair. Weights are stored in bf16; they are computed in float32 by default
    (exact and fastest on CPU). Pass `dtype=False` to keep the stored bf16."""
    import mlx.core as mx

    from ..loading import load

    if dtype is None:
        dtype = mx.float32
    return load(TARGET_DIR, DRAFTER_DIR if mtp else None, dtype=dtype or None)
