"""A multi-turn chat whose KV cache carries over from turn to turn.

Each turn renders the whole conversation with the tokenizer's chat template and feeds the
model only what its cache does not already hold: the longest common token prefix of the
cache's contents and the new rendering is kept, the rest is rolled back (or, when rollback
is impossible, the cache is rebuilt). So a template that re-renders earlier turns differently
(e.g. dropping a reply's thinking) still gives exactly what a fresh prefill would.
"""

from __future__ import annotations

from typing import Iterator, Optional

from .cache import CacheError, KVCache
from .generate import ContextLengthError, Event, stream_generate
from .speculative import DraftLength
from .stats import Stats


class Conversation:
    """Messages, the tokens the model has read and written, and their KV cache.

    Args:
        loaded: a `load()`ed model with a tokenizer that has a chat template.
        system: optional system message.
        max_rollback: tokens the cache can always roll back; at least `k_max + 1` of the
            draft lengths used (7 covers "auto"). More also lets a re-rendered turn roll back
            further without re-prefill once the sliding window has wrapped.

    `messages` is a plain list of {"role", "content"} dicts: callers may edit it between
    turns (drop the last exchange, edit a message); the next `reply` reuses whatever prefix
    of the cache still matches.
    """

    def __init__(self, loaded, system: Optional[str] = None, max_rollback: Optional[int] = None):
        if loaded.tokenizer is None:
            raise ValueError("a conversation needs a tokenizer: the model directory has none")
        self.loaded = loaded
        self.system = system
        self.max_rollback = max_rollback if max_rollback is not None else DraftLength().k_max + 1
        self.messages: list[dict] = []
        self.tokens: list[int] = []  # the conversation as the model saw it, replies included
        self.last_stats: Optional[Stats] = None
        self._cache: Optional[KVCache] = None  # made on first use, on the thread that generates
        self._cached = 0  # leading entries of `tokens` held by the cache
        self._busy = False
        self._turns = 0  # bumped by every commit and reset: an iterator older than that is stale
        self.reset()

    @property
    def cache(self) -> Optional[KVCache]:
        """The KV cache (None until the first reply); it holds all but the last of `tokens`."""
        return self._cache

    def reset(self) -> None:
        """Forget every turn (the system message stays) and free the cache."""
        if self._busy:
            raise RuntimeError("a reply is still streaming; exhaust or close it first")
        self.messages[:] = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens = []
        self.last_stats = None
        self._turns += 1
        self._drop_cache()

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the model's generation prompt."""
        return list(self.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def reply(self, text: str, max_tokens: int = 256, **kwargs) -> Iterator[Event]:
        """Add a user message and stream the model's reply.

        Args:
            text: the user's message.
            max_tokens: reply length limit; a reply that fills the context ends there too
                (finish_reason "length").
            kwargs: other `stream_generate` options (sampling, draft_tokens, mtp, seed).

        Returns:
            An iterator of events. When it is exhausted the reply (with its stop token) is part
            of the conversation. Closed early (`close()`, or a `break` out of a `for`), the
            partial reply is kept, as streamed. If generation raises, the turn is dropped.

        Raises:
            ContextLengthError: the conversation does not fit the model's context; nothing changes.
        """
        if self._busy:
            raise RuntimeError("a reply is still streaming; exhaust or close it first")
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.render(messages)
        limit = self.loaded.target.config.max_position_embeddings
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"the conversation ({len(prompt)} tokens) does not fit the model's context of {limit} tokens"
            )
        kwargs["max_tokens"] = min(max_tokens, limit - len(prompt))
        return self._stream(messages[-1], prompt, self._turns, kwargs)

    def _stream(self, message: dict, prompt: list[int], turn: int, kwargs: dict) -> Iterator[Event]:
        if self._busy or turn != self._turns:
            raise RuntimeError("another reply started after this one was made; call reply() again")
        self._busy = True
        reply: list[int] = []
        keep = None
        try:
            keep = self._reuse(prompt)
            events = stream_generate(self.loaded, prompt[keep:], cache=self._cache, **kwargs)
            try:
                for event in events:
                    reply.append(event.token)
                    self.last_stats = event.stats
                    yield event
            finally:
                events.close()
        except GeneratorExit:
            pass  # closed by the consumer: keep what was streamed
        except BaseException:
            reply = []
            raise
        finally:
            self._busy = False
            if reply:
                self._commit(message, prompt, reply)
            elif keep is not None:
                self._drop_cache()  # a forward may have failed half-way: rebuild next turn

    def _reuse(self, prompt: list[int]) -> int:
        """Make the cache hold the longest usable prefix of `prompt`; return its length."""
        if self._cache is None:
            self._cache = self.loaded.target.make_cache(1, max_rollback=self.max_rollback)
            self._cached = 0
        keep = min(common_prefix(self.tokens[: self._cached], prompt), len(prompt) - 1)
        if keep < self._cached:
            try:
                self._cache.trim(self._cached - keep)
            except CacheError:  # past what a sliding window retains: prefill again
                self._drop_cache()
                return self._reuse(prompt)
        self._cached = keep
        return keep

    def _commit(self, message: dict, prompt: list[int], reply: list[int]) -> None:
        text = reply[:-1] if reply[-1] in self.loaded.eos_ids else reply
        self.messages += [message, {"role": "assistant", "content": self.loaded.tokenizer.decode(text)}]
        self.tokens = prompt + reply
        self._turns += 1
        if int(self._cache.offset[0]) == len(self.tokens) - 1:  # generate_tokens keeps this on close
            self._cached = len(self.tokens) - 1
        else:
            self._drop_cache()

    def _drop_cache(self) -> None:
        self._cache, self._cached = None, 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
