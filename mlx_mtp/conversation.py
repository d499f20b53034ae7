"""A multi-turn chat whose KV cache carries over from turn to turn.

Each turn renders the whole conversation with the tokenizer's chat template and feeds the model
only what no stored state covers: a conversation is a client of a prefix cache (`PrefixCache`)
that pins the states its latest turn left (before and after the prompt's last token, after each
turn of the rendering, after the reply). Chat templates re-render history (Gemma's trim
messages, drop a reply's thinking), so the next prompt often parts ways with the last one inside
the last reply, long after the sliding window has moved past it; it then resumes from the state
at the end of the prompt before, and only the re-rendered reply and the new message are fed:
exactly what a fresh prefill gives. Inside an `Engine` the prefix cache is the engine's, shared
with every other request; a conversation used on its own keeps a private one.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Optional

from . import chat_format
from .batch import BatchGenerator, ContextLengthError
from .generate import row_events
from .prefix_cache import PrefixCache
from .stats import Stats
from .text import TextEvent, text_events

_KEYS = itertools.count()


@dataclasses.dataclass
class Turn:
    """A turn being generated: its rendered prompt and where the prompt's turns end."""

    message: dict
    prompt: list
    boundaries: list
    max_tokens: int


class Conversation:
    """Messages, the tokens the model has read and written, and the states their turns left.

    Args:
        loaded: a `load()`ed model with a tokenizer that has a chat template.
        system: optional system message.
        enable_thinking: the template's switch for reasoning before the answer.

    `messages` is a plain list of {"role", "content"} dicts, replies as the model wrote them
    (the template drops earlier reasoning): callers may edit it between turns (drop the last
    exchange, edit a message); the next `reply` reuses whatever stored state still matches.
    """

    def __init__(self, loaded, system: Optional[str] = None, enable_thinking: bool = False):
        if loaded.tokenizer is None:
            raise ValueError("a conversation needs a tokenizer: the model directory has none")
        self.loaded = loaded
        self.system = system
        self.key = f"conversation-{next(_KEYS)}"  # what pins its states in a prefix cache
        self.enable_thinking = enable_thinking
        self.messages: list[dict] = []
        self.tokens: list[int] = []  # the conversation as the model saw it, replies included
        self.last_stats: Optional[Stats] = None
        self.prefix_cache: Optional[PrefixCache] = None  # for `reply`: made on the thread that generates
        self._busy = False
        self._version = 0  # bumped by every turn and reset: a reply() made before is stale
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system message stays) and what `reply` kept of them."""
        self._check_idle()
        self._version += 1
        self.messages[:] = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens = []
        self.last_stats = None
        self.prefix_cache = None

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the model's generation prompt."""
        return chat_format.render(self.loaded.tokenizer, messages, enable_thinking=self.enable_thinking).tokens

    def reply(self, text: str, max_tokens: int = 256, **kwargs) -> Iterator[TextEvent]:
        """Add a user message and stream the model's reply.

        Args:
            text: the user's message.
            max_tokens: reply length limit; a reply that fills the context ends there too
                (finish_reason "length").
            kwargs: sampling, draft_tokens, mtp, seed, as for `stream_generate`.

        Returns:
            An iterator of events. The reply joins the conversation as streamed: whole when the
            iterator is exhausted, the part streamed so far when it is closed early (`close()`,
            a `break`) or interrupted. A turn that streamed nothing is dropped.

        Raises:
            ContextLengthError: the conversation does not fit the model's context; nothing changes.
        """
        message, prompt = self._render_turn(text)
        return self._stream(message, prompt, max_tokens, dict(kwargs), self._version)

    def _stream(self, message: dict, prompt: list, max_tokens: int, kwargs: dict, version: int) -> Iterator[TextEvent]:
        if version != self._version:
            raise RuntimeError("the conversation changed after this reply was made; call reply() again")
        turn = self.begin(message, prompt, max_tokens)
        mtp, draft = kwargs.pop("mtp", True), kwargs.pop("draft_tokens", "auto")
        if self.prefix_cache is None:  # keeps only what this conversation pins
            self.prefix_cache = PrefixCache(self.loaded.target, budget=0)
        gen = BatchGenerator(self.loaded.target, self.loaded.drafter if mtp else None, draft_tokens=draft,
                             prefix_cache=self.prefix_cache)
        uid, reply, clean = None, [], False
        try:
            uid = self.insert(gen, turn, **kwargs)
            for event in text_events(self.loaded, row_events(gen, uid)):
                reply.append(event.token)
                self.last_stats = event.stats
                yield event
            clean = True
        except GeneratorExit:
            clean = True  # closed by the consumer: keep what was streamed
        finally:
            if clean and uid is not None:
                gen.remove(uid, len(reply))  # the state after the reply, as streamed, stays for the next turn
            elif uid is not None:
                # Interrupted inside a step (Ctrl-C in a forward, a failure): the states may be
                # half stored. The streamed reply is kept; the next turn prefills afresh.
                self.prefix_cache = None
            self.end(turn, reply)

    # ---- for drivers that run the turn themselves (the Engine) ---------------------------------

    def prepare(self, text: str, max_tokens: int) -> Turn:
        """Render the next turn and mark the conversation busy with it (see `insert` and `end`)."""
        return self.begin(*self._render_turn(text), max_tokens)

    def begin(self, message: dict, prompt: list, max_tokens: int) -> Turn:
        self._check_idle()
        limit = self.loaded.target.config.max_position_embeddings
        boundaries = chat_format.turn_ends(prompt, self.loaded.eos_ids)
        turn = Turn(message, prompt, boundaries, min(max_tokens, limit - len(prompt)))
        self._busy = True
        return turn

    def insert(self, gen: BatchGenerator, turn: Turn, **kwargs) -> int:
        """Insert the turn's row into `gen`; its states stay pinned for this conversation."""
        return gen.insert(turn.prompt, max_tokens=turn.max_tokens, stop_ids=self.loaded.eos_ids,
                          boundaries=turn.boundaries, owner=self.key, **kwargs)

    def end(self, turn: Turn, reply: list[int]) -> None:
        """Finish a turn: keep the reply as streamed."""
        self._busy = False
        self._version += 1
        self.tokens = turn.prompt + reply
        if reply:
            text = reply[:-1] if reply[-1] in self.loaded.eos_ids else reply
            reply_text = self.loaded.tokenizer.decode(text)
            self.messages += [turn.message, {"role": "assistant", "content": reply_text}]

    def _check_idle(self) -> None:
        if self._busy:
            raise RuntimeError("a reply is still streaming; exhaust or close it first")

    def _render_turn(self, text: str) -> tuple[dict, list]:
        self._check_idle()
        message = {"role": "user", "content": text}
        prompt = self.render([*self.messages, message])
        self._check_context(prompt)
        return message, prompt

    def _check_context(self, prompt: list) -> None:
        limit = self.loaded.target.config.max_position_embeddings
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"the conversation ({len(prompt)} tokens) does not fit the model's context of {limit} tokens")
