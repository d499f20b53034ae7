"""A multi-turn chat whose KV cache carries over from turn to turn: a client of an `Engine`.

Each reply is a request in one of the engine's conversations (`history.History`): the engine
renders the whole conversation with the chat template, resumes from the deepest state its
prefix cache holds (the conversation pins its latest turn's), and streams the reply. On its own a
`Conversation` runs on a private engine (one row, a prefix cache that keeps only what the
conversation pins), started with it and closed by `close()` or when the conversation is
collected; `Conversation(loaded, engine=engine)` shares an app's engine instead, whose batch,
prefix cache and memory limit it then uses.
"""

from __future__ import annotations

import weakref
from typing import Iterator, Optional

from .engine import Engine
from .requests import DoneEvent, Request, TokenEvent
from ..decode.stats import Stats


class Conversation:
    """Messages, the tokens the model has read and written, and the states their turns left.

    Args:
        loaded: a `load()`ed model with a tokenizer that has a chat template.
        system: optional system message.
        enable_thinking: the template's switch for reasoning before the answer.
        engine: the engine to run on (default: a private one).
        keep_thinking: earlier replies keep their reasoning in later prompts (by default it is left
            out once the next user message follows, as Gemma 4's model card asks).

    `messages` is a plain list of {"role", "content"} dicts, replies as assistant messages
    (`content`, `reasoning_content`, `tool_calls`): callers may edit it between turns (drop the
    last exchange, edit a message); the next `reply` reuses whatever stored state still matches.
    """

    def __init__(self, loaded, system: Optional[str] = None, enable_thinking: bool = False,
                 engine: Optional[Engine] = None, keep_thinking: bool = False):
        if loaded.tokenizer is None:
            raise ValueError("a conversation needs a tokenizer: the model directory has none")
        self.loaded = loaded
        self.engine = engine if engine is not None else Engine(loaded, max_batch=1, prompt_cache_bytes=0)
        self.id = self.engine.conversations.new(system, enable_thinking, keep_thinking)
        self.history = self.engine.conversations.history(self.id)
        self.last_stats: Optional[Stats] = None
        self.last_done: Optional[DoneEvent] = None  # how the last reply ended
        self._streaming = False
        owned = self.engine if engine is None else None
        self._finalizer = weakref.finalize(self, _close, self.engine, self.id, owned)

    @property
    def messages(self) -> list[dict]:
        return self.history.messages

    @property
    def tokens(self) -> list[int]:
        """The conversation as the model saw it, the last reply included."""
        return self.history.tokens

    @property
    def system(self) -> Optional[str]:
        return self.history.system

    @property
    def enable_thinking(self) -> bool:
        return self.history.enable_thinking

    @property
    def keep_thinking(self) -> bool:
        return self.history.keep_thinking

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the model's generation prompt."""
        return self.history.render(messages)

    def cached_tokens(self) -> int:
        """How many tokens of the conversation the next turn resumes from (the prefix cache's)."""
        return self.engine.cached(self.tokens)

    def reset(self) -> None:
        """Forget every turn (the system message stays) and the states they left."""
        self._check_idle()
        self.history.reset()  # now, so that `messages` show it; the engine releases the states in turn
        self.engine.conversations.reset(self.id)
        self.last_stats = self.last_done = None

    def close(self) -> None:
        """Close the conversation (and its private engine)."""
        self._finalizer()

    def reply(self, text: str, max_tokens: int = 256, **kwargs) -> Iterator[TokenEvent]:
        """Add a user message and stream the model's reply.

        Args:
            text: the user's message.
            max_tokens: reply length limit; a reply that fills the context ends there too
                (finish_reason "length").
            kwargs: more `Request` fields: sampling, draft_tokens, mtp, seed, stop, penalties, ...

        Returns:
            An iterator of the reply's `TokenEvent`s (the last one has `finish_reason`). The reply
            joins the conversation as streamed: whole when the iterator is exhausted, the part
            read so far when it is closed early (`close()`, a `break`) or interrupted. A turn that
            streamed nothing is dropped.

        Raises:
            ContextLengthError: the conversation does not fit the model's context; nothing changes.
        """
        self._check_idle()
        self.history.check(text)
        request = Request(text, conversation=self.id, max_tokens=max_tokens, **kwargs)
        request.check()
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[TokenEvent]:
        self._check_idle()
        self._streaming = True
        handle, read, done = None, 0, None
        try:
            handle = self.engine.submit(request)
            self.last_stats = handle.stats  # the reply's, as it runs
            for event in handle:
                if event.kind == "error":
                    raise event.error
                if event.kind == "done":
                    done = event
                    break
                read += 1
                yield event
        finally:
            try:
                if handle is not None and done is None:  # closed early or interrupted: keep what was read
                    handle.cancel()
                    done = _last(handle)
                    if done is not None and read < len(done.tokens):  # the engine had streamed further
                        self.history.keep(read)
            finally:
                self._streaming = False
                self.last_done = done
                if done is not None:
                    self.last_stats = done.stats

    def _check_idle(self) -> None:
        if self._streaming:
            raise RuntimeError("a reply is still streaming; exhaust or close it first")


def _last(handle) -> Optional[DoneEvent]:
    """The handle's final event once its request has ended (the engine has ended its turn)."""
    last = None
    for last in handle:
        pass
    return last if last is not None and last.kind == "done" else None


def _close(engine: Engine, conversation_id: int, owned: Optional[Engine]) -> None:
    if owned is not None:
        owned.close()
    elif engine.running:
        try:
            engine.conversations.close(conversation_id)
        except (KeyError, RuntimeError):  # already closed
            pass
