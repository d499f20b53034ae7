"""The conversations an `Engine` keeps: `engine.conversations.new()` opens one; a `Request` with
`conversation=id` is its next user message, and the reply joins it.

Each conversation is a `history.History` (its messages, the tokens the model read and wrote, the
turn in progress). Resetting or closing one is queued in the conversation's own line: it happens
once the requests queued for it before have run. Any thread may call these methods; the worker
starts and ends turns.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Optional

from .history import History, Turn

# forget(conversation_id, history): on the worker, once the conversation's earlier requests have run, reset
# the history and release the states it pins
Forget = Callable[[int, History], None]


class Conversations:
    """A registry of open conversations (id -> `History`) for one loaded model."""

    def __init__(self, loaded, forget: Forget):
        self.loaded, self._forget = loaded, forget
        self._open: dict[int, History] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def new(self, system: Optional[str] = None, enable_thinking: bool = False, keep_thinking: bool = False) -> int:
        """Start a conversation (optionally with a system message, thinking, earlier thinking kept
        in its prompts: `History`); returns its id."""
        history = History(self.loaded, system=system, enable_thinking=enable_thinking, keep_thinking=keep_thinking)
        with self._lock:
            self._check_open()
            conversation_id = next(self._ids)
            self._open[conversation_id] = history
        return conversation_id

    def history(self, conversation_id: int) -> History:
        """A conversation's live state (`messages`, `tokens`): read or edit it only while none of
        its requests is queued or running (`messages` returns a copy at any time)."""
        with self._lock:
            return self._get(conversation_id)

    def messages(self, conversation_id: int) -> list[dict]:
        """A copy of a conversation's messages as of now."""
        with self._lock:
            return [dict(m) for m in list(self._get(conversation_id).messages)]

    def reset(self, conversation_id: int) -> None:
        """Forget a conversation's turns once the requests queued before this call have run."""
        with self._lock:
            self._check_open()
            self._forget(conversation_id, self._get(conversation_id))

    def close(self, conversation_id: int) -> None:
        """Forget a conversation; requests already queued for it still run, then its states are
        released (left to the prefix cache's budget)."""
        with self._lock:
            self._check_open()
            history = self._get(conversation_id)
            del self._open[conversation_id]
            self._forget(conversation_id, history)

    def check(self, conversation_id: int) -> None:
        """Raises KeyError unless the conversation is open (a request for it may be queued)."""
        with self._lock:
            self._get(conversation_id)

    # ---- the worker's side ---------------------------------------------------------------

    def start(self, conversation_id: int, request) -> tuple[History, Turn]:
        """The turn a request for this conversation starts (KeyError if it was closed meanwhile)."""
        with self._lock:
            history = self._open.get(conversation_id)
        if history is None:
            raise KeyError(f"conversation {conversation_id} was closed")
        return history, history.prepare(request.prompt, request.max_tokens)

    def end(self, history: History, turn: Turn, reply: list[int]) -> None:
        """A turn ended with `reply` (empty: it never ran, the conversation is as it was)."""
        with self._lock:  # `messages` copies them on other threads
            history.end(turn, reply)

    def shut(self) -> None:
        """The engine stopped: forget every conversation; opening one fails from now on."""
        with self._lock:
            self._closed = True
            self._open.clear()

    def _get(self, conversation_id: int) -> History:
        if conversation_id not in self._open:
            raise KeyError(f"no open conversation {conversation_id}")
        return self._open[conversation_id]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
