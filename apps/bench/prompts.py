"""Prompt classes: code, prose and chat text when the model has a tokenizer, token-id
prompts (the fixture's own prompt, random ids, a repetitive pattern) when it has none."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Optional

import numpy as np

PROSE = [
    "The river had been rising for three days before anyone in the village thought to move the "
    "grain out of the low barns. By the time the first carts were loaded, the water had reached the "
    "mill wheel, and the miller stood on the bridge counting the sacks as they passed.",
    "A good benchmark measures one thing at a time, reports the conditions it ran under, and says "
    "plainly which of its numbers were measured and which were projected from a model of the costs.",
    "Speculative decoding lets a small model propose several tokens that a large model then checks "
    "in a single forward pass; when the guesses are right, the large model advances several steps "
    "for roughly the price of one.",
    "In the morning the market opened late. Fishermen argued about the price of ice, children ran "
    "between the stalls, and an old woman sold bread that was still warm from the oven.",
]

QUESTIONS = [
    "How do I read a CSV file in Python and print the sum of one column?",
    "Write a function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "What does the `with` statement do, and when should I use it?",
    "How can I reverse a linked list in place?",
    "Write a Python function `flatten` that flattens a nested list.",
    "What is a generator, and how is it different from a list comprehension?",
    "How do I sort a dictionary by its values?",
]


def _held_out(rel: str) -> bool:
    try:  # the demo pair's own split, so code prompts were never trained on
        from apps.demo_pair.data import is_held_out

        return is_held_out(rel)
    except Exception:
        return int(hashlib.md5(rel.encode()).hexdigest(), 16) % 50 == 0


def code_snippets(n: int, chars: int = 400) -> list[str]:
    """Code from the Python standard library on this machine, held-out files first."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    held = [p for p in files if _held_out(p.relative_to(root).as_posix())]
    out = []
    for path in held + files:
        text = path.read_text(errors="ignore")
        start = text.find("\ndef ")
        if start < 0 or len(text) - start < chars:
            continue
        out.append(text[start + 1 : start + 1 + chars])
        if len(out) == n:
            break
    return out


def prose_texts(n: int) -> list[str]:
    return [PROSE[i % len(PROSE)] for i in range(n)]


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    # Gemma 4 turn markers (what the demo pair is trained on)
    return tokenizer.encode(f"<|turn>user\n{question}<turn|>\n<|turn>model\n")


def text_prompts(tokenizer, rows: int) -> dict[str, list[list[int]]]:
    return {
        "code": [tokenizer.encode(t) for t in code_snippets(rows)],
        "prose": [tokenizer.encode(t) for t in prose_texts(rows)],
        "chat": [chat_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)]) for i in range(rows)],
    }


def id_prompts(vocab: int, rows: int, length: int = 24, fixture: Optional[Path] = None) -> dict[str, list[list[int]]]:
    """Token-id prompts for tokenizer-less models; row r of a class differs from row 0."""
    rng = np.random.default_rng(0)
    out = {}
    if fixture is not None and fixture.exists():
        base = np.load(fixture)["prompt"].tolist()
        out["fixture"] = [base[r % len(base):] + base[: r % len(base)] for r in range(rows)]
    out["random"] = [rng.integers(4, vocab, length).tolist() for _ in range(rows)]
    out["repeat"] = []
    for r in range(rows):
        motif = rng.integers(4, vocab, 5).tolist()
        out["repeat"].append((motif * length)[:length])
    return out


def prompt_sets(loaded, model_dir: Path, rows: int, classes: Optional[list[str]] = None) -> dict:
    if loaded.tokenizer is not None:
        sets = text_prompts(loaded.tokenizer, rows)
    else:
        sets = id_prompts(loaded.target.vocab_size, rows, fixture=Path(model_dir).parent / "reference.npz")
    if classes:
        missing = [c for c in classes if c not in sets]
        if missing:
            raise SystemExit(f"prompt classes {missing} not available here (have {sorted(sets)})")
        sets = {c: sets[c] for c in classes}
    return sets
