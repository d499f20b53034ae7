"""Generating one sequence: `stream_generate`, `generate` and `generate_tokens`, all on the one
batched driver (`BatchGenerator`) with a batch of one."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence, Union

from ..runtime import memory
from .batch import BatchGenerator, ContextLengthError, RowEvent
from ..models.base import TargetModel
from .sample import SamplingParams
from .stats import Stats
from .text import TextEvent, encode, text_events

__all__ = ["ContextLengthError", "Result", "TextEvent", "generate", "generate_tokens", "stream_generate"]


@dataclasses.dataclass
class Result:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats


def row_events(gen: BatchGenerator, uid: int) -> Iterator[RowEvent]:
    """Step `gen` until row `uid` finishes, yielding that row's events. Closing the iterator
    early leaves the row in `gen` (call `gen.remove(uid)`)."""
    while True:
        for event in gen.step():
            if event.uid == uid:
                yield event
                if event.finish_reason:
                    return


def generate_tokens(
    target: TargetModel,
    prompt: Sequence[int],
    *,
    drafter=None,
    sampling: SamplingParams = SamplingParams(),
    draft_tokens: Union[int, str] = "auto",
    max_tokens: int = 256,
    stop_ids: Sequence[int] = (),
    seed: Optional[int] = None,
    stats: Optional[Stats] = None,
    images=None,
) -> Iterator[tuple[int, bool]]:
    """Yield (token, from_draft) for one sequence of token ids; plain decoding without a drafter.
    The output equals plain decoding's exactly (greedy) or in distribution (sampling). `images`:
    the prompt's images (`gemma4_vision.PromptImages`)."""
    gen = BatchGenerator(target, drafter, draft_tokens=draft_tokens)
    uid = gen.insert(prompt, max_tokens=max_tokens, sampling=sampling, seed=seed, stop_ids=stop_ids, stats=stats,
                     images=images)
    try:
        with memory.generating(target, drafter):
            for event in row_events(gen, uid):
                yield from zip(event.tokens, event.from_draft)
    finally:
        gen.remove(uid)


def stream_generate(
    loaded,
    prompt: Union[str, Sequence[int]],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    draft_tokens: Union[int, str] = "auto",
    mtp: bool = True,
    seed: Optional[int] = None,
) -> Iterator[TextEvent]:
    """Stream a completion of `prompt` (text, or token ids) from a `load()`ed model.

    Each event carries the new text, the token, whether it came from an accepted draft, and
    the running statistics; the last one has `finish_reason` "stop" or "length".
    """
    prompt = encode(loaded, prompt)
    gen = BatchGenerator(loaded.target, loaded.drafter if mtp else None, draft_tokens=draft_tokens)
    uid = gen.insert(prompt, max_tokens=max_tokens, sampling=sampling, seed=seed, stop_ids=loaded.eos_ids)
    try:
        with memory.generating(loaded.target, loaded.drafter):
            yield from text_events(loaded, row_events(gen, uid))
    finally:
        gen.remove(uid)


def generate(loaded, prompt: Union[str, Sequence[int]], **kwargs) -> Result:
    """Generate a whole completion; see `stream_generate` for the arguments."""
    text, tokens, event = [], [], None
    for event in stream_generate(loaded, prompt, **kwargs):
        text.append(event.text)
        tokens.append(event.token)
    return Result("".join(text), tokens, event.finish_reason or "length", event.stats)
