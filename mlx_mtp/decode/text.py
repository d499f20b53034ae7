"""Tokens to text and back, shared by every front end: a prompt's token ids (`encode`), one row's
streamed text (`Detokenizer`, `TextEvent`), what a single token spells (`token_piece`), and
stop strings cut out of streamed text (`StopMatcher`).

A model's vocabulary may be larger than its tokenizer's (padded embeddings): an id the tokenizer
cannot spell is text "" here, never an error that would stop the generation it came from.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence, Union

from .batch import RowEvent
from .stats import Stats


@dataclasses.dataclass
class TextEvent:
    """One streamed token: the new text and the token that produced it."""

    text: str
    token: int
    from_draft: bool
    finish_reason: Optional[str]  # None while streaming, then "stop" or "length"
    stats: Stats
    logprob: Optional[tuple] = None  # (logprob, ((token, logprob), ...)) when asked for


def encode(loaded, prompt: Union[str, Sequence[int]]) -> list[int]:
    if isinstance(prompt, str):
        if loaded.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        return list(loaded.tokenizer.encode(prompt))
    return list(prompt)


class Detokenizer:
    """Turns one row's `RowEvent`s into per-token `TextEvent`s with streamed text; the tokens in
    `hidden` (a chat reply's control tokens that are no text) add none."""

    def __init__(self, loaded, hidden: frozenset = frozenset()):
        self.eos = loaded.eos_ids
        self.hidden = hidden
        tokenizer = loaded.tokenizer
        self.detok = tokenizer.detokenizer if tokenizer is not None else None  # a fresh copy
        self.size = len(tokenizer) if tokenizer is not None else 0  # ids it can spell

    def events(self, event: RowEvent) -> list[TextEvent]:
        out = []
        logprobs = event.logprobs or [None] * len(event.tokens)
        for i, (token, from_draft, logprob) in enumerate(zip(event.tokens, event.from_draft, logprobs)):
            finish = event.finish_reason if i == len(event.tokens) - 1 else None
            out.append(TextEvent(self._text(token, finish), token, from_draft, finish, event.stats, logprob))
        return out

    def _text(self, token: int, finish: Optional[str]) -> str:
        if self.detok is None:
            return ""
        # A stop token adds no text; an id past the tokenizer's end has none to add.
        if token not in self.eos and token not in self.hidden and 0 <= token < self.size:
            self.detok.add_token(token)
        if finish:
            self.detok.finalize()
        return self.detok.last_segment


def text_events(loaded, events: Iterator[RowEvent]) -> Iterator[TextEvent]:
    """Per-token `TextEvent`s with streamed text for one row's events."""
    detok = Detokenizer(loaded)
    for event in events:
        yield from detok.events(event)


def token_piece(tokenizer, token: int) -> tuple[str, bytes]:
    """What one token spells: its text and its bytes (a byte-fallback token `<0xNN>` is that
    one byte, which may be part of a character; an id the tokenizer lacks spells nothing)."""
    if not 0 <= token < len(tokenizer):
        return "", b""
    name = tokenizer.convert_ids_to_tokens(token)
    if isinstance(name, str) and len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
        try:
            raw = bytes([int(name[3:5], 16)])
            return raw.decode("utf-8", "replace"), raw
        except ValueError:
            pass
    text = tokenizer.decode([token])
    return text, text.encode()


class StopMatcher:
    """Cuts streamed text at the first stop string. A tail that could still grow into a stop
    string is held back, so text past a stop string is never released, even when the string is
    split across tokens (or across a speculative round's tokens)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""
        self.hit: Optional[str] = None  # the stop string found

    def feed(self, text: str) -> str:
        """Add streamed text; returns what is safe to release now (`hit` is set at a stop string)."""
        self.pending += text
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            at, self.hit = min(found)
            out, self.pending = self.pending[:at], ""
            return out
        safe = len(self.pending) - self._partial()
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out

    def flush(self) -> str:
        """The held-back text, once the stream ended (or paused) without completing a stop string."""
        out, self.pending = self.pending, ""
        return out

    def _partial(self) -> int:
        """Length of the longest tail of `pending` that starts some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best
