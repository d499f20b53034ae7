"""Generating one sequence: `stream_generate`, `generate` and `generate_tokens`, all on the one
batched driver (`BatchGenerator`) with a batch of one."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence, Union

from . import memory
from .batch import BatchGenerator, ContextLengthError, RowEvent
from .models.base import TargetModel
from .sample import SamplingParams
from .stats import Stats

__all__ = ["ContextLengthError", "Event", "Result", "generate", "generate_tokens", "stream_generate"]


@dataclasses.dataclass
class Event:
    """One streamed token: the new text and the token that produced it."""

    text: str
    token: int
    from_draft: bool
    finish_reason: Optional[str]  # None while streaming, then "stop" or "length"
    stats: Stats
    logprob: Optional[tuple] = None  # (logprob, ((token, logprob), ...)) when asked for


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
) -> Iterator[tuple[int, bool]]:
    """Yield (token, from_draft) for one sequence of token ids; plain decoding without a drafter.
    The output equals plain decoding's exactly (greedy) or in distribution (sampling)."""
    gen = BatchGenerator(target, drafter, draft_tokens=draft_tokens)
    uid = gen.insert(prompt, max_tokens=max_tokens, sampling=sampling, seed=seed, stop_ids=stop_ids, stats=stats)
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
) -> Iterator[Event]:
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


def encode(loaded, prompt: Union[str, Sequence[int]]) -> list[int]:
    if isinstance(prompt, str):
        if loaded.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        return list(loaded.tokenizer.encode(prompt))
    return list(prompt)


class Detokenizer:
    """Turns one row's `RowEvent`s into per-token `Event`s with streamed text."""

    def __init__(self, loaded):
        self.eos = loaded.eos_ids
        self.detok = loaded.tokenizer.detokenizer if loaded.tokenizer is not None else None  # a fresh copy

    def events(self, event: RowEvent) -> list[Event]:
        out = []
        logprobs = event.logprobs or [None] * len(event.tokens)
        for i, (token, from_draft, logprob) in enumerate(zip(event.tokens, event.from_draft, logprobs)):
            finish = event.finish_reason if i == len(event.tokens) - 1 else None
            text = ""
            if self.detok is not None:
                if token not in self.eos:  # a stop token adds no text
                    self.detok.add_token(token)
                if finish:
                    self.detok.finalize()
                text = self.detok.last_segment
            out.append(Event(text, token, from_draft, finish, event.stats, logprob))
        return out


def token_piece(tokenizer, token: int) -> tuple[str, bytes]:
    """What one token spells: its text and its bytes (a byte-fallback token `<0xNN>` is that
    one byte, which may be part of a character)."""
    name = tokenizer.convert_ids_to_tokens(token)
    if isinstance(name, str) and len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
        try:
            raw = bytes([int(name[3:5], 16)])
            return raw.decode("utf-8", "replace"), raw
        except ValueError:
            pass
    text = tokenizer.decode([token])
    return text, text.encode()


def text_events(loaded, events: Iterator[RowEvent]) -> Iterator[Event]:
    """Per-token `Event`s with streamed text for one row's events."""
    detok = Detokenizer(loaded)
    for event in events:
        yield from detok.events(event)


def generate(loaded, prompt: Union[str, Sequence[int]], **kwargs) -> Result:
    """Generate a whole completion; see `stream_generate` for the arguments."""
    text, tokens, event = [], [], None
    for event in stream_generate(loaded, prompt, **kwargs):
        text.append(event.text)
        tokens.append(event.token)
    return Result("".join(text), tokens, event.finish_reason or "length", event.stats)
