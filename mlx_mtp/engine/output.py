"""What one request streams, made from its row's tokens: text (`text.Detokenizer`), parsed into
content, reasoning and tool calls where the request is a chat (`chat_format.OutputParser`), its
content cut at the request's stop strings, and only its first tool call where parallel calls are
off; then `TokenEvent`s and the `DoneEvent` that sums them up.

A stop string ends the reply at the token that completed it: that token's event carries the text
before the string, and the tokens after it (the rest of its speculative round) are never turned
into events; the engine then takes the row out (`stopped`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..decode.batch import RowEvent
from ..formats import chat as chat_format
from ..formats.chat import Delta, OutputParser, Reply
from .requests import DoneEvent, TokenEvent, TokenLogprob
from ..decode.stats import Stats
from ..decode.text import Detokenizer, StopMatcher, TextEvent


class Output:
    """One request's output as it streams.

    Args:
        loaded: the model (its tokenizer and stop tokens).
        parser: the chat reply's parser; None: a raw prompt, all content (its control tokens as
            the model wrote them; a chat reply's are no text but for those the parser reads).
        stop: the request's stop strings.
        parallel_tool_calls: False keeps only the reply's first tool call.
        spell: a token's (text, bytes), for log-probabilities.
    """

    def __init__(self, loaded, parser: Optional[OutputParser], stop: Sequence[str] = (),
                 parallel_tool_calls: bool = True, spell: Callable[[int], tuple] = lambda t: ("", b"")):
        hidden = chat_format.hidden_ids(loaded.tokenizer) if parser is not None else frozenset()
        self.detok = Detokenizer(loaded, hidden)
        self.parser = parser
        self.matcher = StopMatcher(stop)
        self.parallel = parallel_tool_calls
        self.spell = spell
        self.reply = Reply()
        self.tokens: list[int] = []  # every token turned into an event
        self.calls = 0

    @property
    def stopped(self) -> Optional[str]:
        """The stop string that ended the reply, once one did."""
        return self.matcher.hit

    def events(self, event: RowEvent) -> list[TokenEvent]:
        """The token events of one step's tokens of the row, up to a stop string."""
        out = []
        for e in self.detok.events(event):
            out.append(self._event(e))
            if self.stopped:
                break
        return out

    def done(self, finish_reason: str, stats: Stats) -> DoneEvent:
        r = self.reply
        return DoneEvent("stop" if self.stopped else finish_reason, r.content, tuple(self.tokens), stats,
                         r.reasoning, tuple(r.tool_calls), self.stopped)

    def _event(self, e: TextEvent) -> TokenEvent:
        finish = e.finish_reason
        if self.parser is None:
            parts = [Delta("content", e.text)] if e.text else []
        else:  # a call the budget cuts short is dropped
            parts = self.parser.feed(e.text) + (self.parser.finish(cut=finish == "length") if finish else [])
        parts = self._cut(parts)
        if self.stopped:
            finish = "stop"
        elif finish and (rest := self.matcher.flush()):
            parts.append(Delta("content", rest))
        self.reply.add(parts)
        self.tokens.append(e.token)
        text = "".join(p.text for p in parts if p.kind == "content")
        logprob = self._logprob(e.token, e.logprob)
        return TokenEvent(text, e.token, e.from_draft, tuple(parts), logprob, finish)

    def _cut(self, parts: list) -> list:
        """`parts` with their content passed through the stop strings (looked for in the content
        only: held-back content goes out before a part of another kind), and tool calls past the
        first dropped where parallel calls are off."""
        out = []
        for part in parts:
            if part.kind == "content":
                if text := self.matcher.feed(part.text):
                    out.append(Delta("content", text))
                if self.stopped:
                    break
                continue
            if rest := self.matcher.flush():
                out.append(Delta("content", rest))
            if part.kind == "tool_call":
                if self.calls and not self.parallel:
                    continue
                self.calls += 1
            out.append(part)
        return out

    def _logprob(self, token: int, entry: Optional[tuple]) -> Optional[TokenLogprob]:
        if entry is None:
            return None
        logprob, top = entry
        return TokenLogprob(token, *self.spell(token), logprob,
                            tuple(TokenLogprob(t, *self.spell(t), value) for t, value in top))
