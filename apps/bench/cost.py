"""The released Gemma 4 shapes' configs (tests/fixtures/real_configs), which `realsize`, `primitives`
and `learn --real-step` build with random weights.

The `cost` mode that lived here (per-layer step costs at the released shapes and a PROJECTED MTP
speed-up) was removed in issue 45, its figures kept in apps/README.md; its code is at commit d1a4d89
(`git show d1a4d89:apps/bench/cost.py`).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "real_configs"
TINY = ROOT / "tests" / "fixtures" / "tiny"

TARGETS = {"e2b": "google--gemma-4-E2B-it", "e4b": "google--gemma-4-E4B-it",
           "26b-a4b": "google--gemma-4-26B-A4B-it", "31b": "google--gemma-4-31B-it"}
ASSISTANTS = {  # (path, provenance)
    "e2b": (CONFIGS / "google--gemma-4-E2B-it-assistant" / "config.json", "official config"),
    "e4b": (CONFIGS / "google--gemma-4-E4B-it-assistant" / "config.partial.json",
            "PARTIAL config (fields from transformers' converter)"),
    "26b-a4b": (CONFIGS / "google--gemma-4-26B-A4B-it-assistant" / "config.DERIVED-UNVERIFIED.json",
                "DERIVED-UNVERIFIED config (31B assistant with 26B-A4B widths)"),
    "31b": (CONFIGS / "google--gemma-4-31B-it-assistant" / "config.json", "official config"),
}
