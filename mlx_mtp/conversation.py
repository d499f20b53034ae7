"""A multi-turn chat whose KV cache carries over from turn to turn.

Each turn renders the whole conversation with the tokenizer's chat template and feeds the model
only what its cache does not already hold: the cache keeps the longest common token prefix of
what it holds and the new rendering. Chat templates re-render history (Gemma's trim messages,
drop a reply's thinking), so that prefix often ends inside the last reply, long after the
sliding window has moved past it. The cache is then brought back to a snapshot of the sliding
layers taken when the last reply began (full-attention layers keep every position anyway), and
only the re-rendered reply and the new message are fed: exactly what a fresh prefill gives.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from . import chat_format
from .batch import BatchGenerator, ContextLengthError, Left
from .cache import CacheError, KVCache, Snapshot
from .generate import Event, row_events, text_events
from .speculative import MAX_ROLLBACK
from .stats import Stats


@dataclasses.dataclass
class Turn:
    """A turn being generated: feed `prompt[keep:]` after `cache` (which holds `prompt[:keep]`)."""

    message: dict
    prompt: list
    keep: int
    cache: Optional[KVCache]
    max_tokens: int


class Conversation:
    """Messages, the tokens the model has read and written, and their KV cache.

    Args:
        loaded: a `load()`ed model with a tokenizer that has a chat template.
        system: optional system message.
        enable_thinking: the template's switch for reasoning before the answer.

    `messages` is a plain list of {"role", "content"} dicts, replies as the model wrote them
    (the template drops earlier reasoning): callers may edit it between turns (drop the last
    exchange, edit a message); the next `reply` reuses whatever prefix of the cache still matches.
    """

    def __init__(self, loaded, system: Optional[str] = None, enable_thinking: bool = False):
        if loaded.tokenizer is None:
            raise ValueError("a conversation needs a tokenizer: the model directory has none")
        self.loaded = loaded
        self.system = system
        self.enable_thinking = enable_thinking
        self.messages: list[dict] = []
        self.tokens: list[int] = []  # the conversation as the model saw it, replies included
        self.last_stats: Optional[Stats] = None
        self._cache: Optional[KVCache] = None  # made on first use, on the thread that generates
        self._cached = 0  # leading entries of `tokens` the cache holds
        self._snapshot: Optional[Snapshot] = None
        self._busy = False
        self._version = 0  # bumped by every turn and reset: a reply() made before is stale
        self.reset()

    @property
    def cache(self) -> Optional[KVCache]:
        """The KV cache (None until the first reply); it holds all but the last of `tokens`."""
        return self._cache

    @property
    def cached(self) -> int:
        return self._cached

    def reset(self) -> None:
        """Forget every turn (the system message stays) and free the cache."""
        self._check_idle()
        self._version += 1
        self.messages[:] = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens = []
        self.last_stats = None
        self._drop_cache()

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the model's generation prompt."""
        return chat_format.render(self.loaded.tokenizer, messages, enable_thinking=self.enable_thinking).tokens

    def reply(self, text: str, max_tokens: int = 256, **kwargs) -> Iterator[Event]:
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

    def _stream(self, message: dict, prompt: list, max_tokens: int, kwargs: dict, version: int) -> Iterator[Event]:
        if version != self._version:
            raise RuntimeError("the conversation changed after this reply was made; call reply() again")
        turn = self.begin(message, prompt, max_tokens)
        mtp, draft = kwargs.pop("mtp", True), kwargs.pop("draft_tokens", "auto")
        gen = BatchGenerator(self.loaded.target, self.loaded.drafter if mtp else None, draft_tokens=draft)
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
            # On an exception (Ctrl-C inside a forward, a failure) the cache may be half
            # updated: the streamed reply is kept and the cache rebuilt next turn.
            left = gen.remove(uid, len(reply)) if clean and uid is not None else None
            self.end(turn, reply, left)

    # ---- for drivers that run the turn themselves (the Engine) ---------------------------------

    def prepare(self, text: str, max_tokens: int) -> Turn:
        """Render the next turn and take the cache over for it (see `insert` and `end`)."""
        return self.begin(*self._render_turn(text), max_tokens)

    def begin(self, message: dict, prompt: list, max_tokens: int) -> Turn:
        self._check_idle()
        keep = self._reuse(prompt)
        limit = self.loaded.target.config.max_position_embeddings
        turn = Turn(message, prompt, keep, self._cache, min(max_tokens, limit - len(prompt)))
        self._cache, self._busy = None, True
        return turn

    def insert(self, gen: BatchGenerator, turn: Turn, **kwargs) -> int:
        """Insert the turn's row into `gen` (the cache goes with it); returns its uid."""
        return gen.insert(turn.prompt[turn.keep :], max_tokens=turn.max_tokens, stop_ids=self.loaded.eos_ids,
                          cache=turn.cache, keep_cache=True, snapshot=True, context=turn.prompt[: turn.keep],
                          **kwargs)

    def end(self, turn: Turn, reply: list[int], left: Optional[Left]) -> None:
        """Finish a turn: keep the reply as streamed and the cache its row left (None: rebuild)."""
        self._busy = False
        self._version += 1
        self.tokens = turn.prompt + reply
        if reply:
            text = reply[:-1] if reply[-1] in self.loaded.eos_ids else reply
            reply_text = self.loaded.tokenizer.decode(text)
            self.messages += [turn.message, {"role": "assistant", "content": reply_text}]
        if left is None or left.cache is None or left.length > max(len(self.tokens) - 1, 0):
            self._drop_cache()
            return
        self._cache, self._cached = left.cache, left.length
        self._snapshot = left.snapshot or self._snapshot

    # ---- the cache ------------------------------------------------------------------------------

    def _reuse(self, prompt: list[int]) -> int:
        """Make the cache hold the longest usable prefix of `prompt`; return its length."""
        if self._cache is None:
            self._cache = self.loaded.target.make_cache(1, max_rollback=MAX_ROLLBACK)
            self._cached, self._snapshot = 0, None
        keep = min(common_prefix(self.tokens[: self._cached], prompt), len(prompt) - 1)
        if keep < self._cached:
            try:
                self._cache.truncate([keep])
            except CacheError:  # past what the sliding window retains: back to the snapshot
                snap = self._snapshot
                if snap is None or snap.offset > keep:
                    self._drop_cache()
                    return self._reuse(prompt)
                self._cache.restore(snap)
                keep = snap.offset
            if self._snapshot is not None and self._snapshot.offset > keep:
                self._snapshot = None  # it describes tokens that are no longer there
        self._cached = keep
        return keep

    def _drop_cache(self) -> None:
        self._cache, self._cached, self._snapshot = None, 0, None

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


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
