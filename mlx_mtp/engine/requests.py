"""What callers of the `Engine` hand it and get back: a `Request`, its `RequestHandle`, the events
it streams (`TokenEvent`s, then one `DoneEvent` or `ErrorEvent`), and the errors `submit` raises.

Plain types with no worker in them: the server and apps import these without the engine. The
handle is the one object both threads touch: the worker puts events and finishes it, the caller
reads events and may cancel it.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import ClassVar, Iterator, Mapping, Optional, Sequence, Union

from ..decode.batch import ContextLengthError
from ..formats.chat import HISTORIES, Prompt
from ..decode.grammar import Grammar
from ..decode.processors import MAX_LOGPROBS, NONE, Penalties
from ..decode.sample import SamplingParams
from ..decode.speculative import check_draft_tokens
from ..decode.stats import Stats

__all__ = ["ContextLengthError", "DoneEvent", "ErrorEvent", "MemoryLimitError", "Prepared", "QueueFull",
           "Request", "RequestEvent", "RequestHandle", "TokenEvent", "TokenLogprob"]


class QueueFull(RuntimeError):
    """More requests are waiting than the engine's `max_queue`."""


class MemoryLimitError(ValueError):
    """A request whose KV cache alone would exceed the engine's memory limit."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What to generate.

    With `conversation`, `prompt` is the user's next message and the reply joins that
    conversation (its KV cache is reused). Without one, the request is one-shot: `prompt` is
    raw text or token ids continued as they are, or `messages` are rendered with the model's
    chat template, with `tools` (JSON schemas, see `chat_format`), `enable_thinking`,
    `chat_template_kwargs` (more template variables) and `continue_final_message` (the last,
    assistant, message is continued rather than answered). Tool calls are parsed only when
    `tools` are given.

    `stop`: strings that end the reply (finish_reason "stop", `DoneEvent.stop_sequence`): looked
    for in its content as it streams, across tokens and speculative rounds; no text from the stop
    string on is ever streamed, and generation stops there. `parallel_tool_calls=False` keeps the
    first tool call of a reply and drops any later one. `allow_tool_calls=False` keeps the `tools`
    declared but bans the token that opens a call.
    `history`: "generated" (the default) renders earlier replies in `messages` as the model
    generated them (`chat_format.render_generated`), each one's reasoning left out once a user or
    system message follows it (`keep_thinking=True` keeps it); "template" gives exactly the chat
    template's rendering (`apply_chat_template`'s tokens). Every string of the request is text:
    a control token spelled in it is never one (`parse_control_tokens=True` parses them, as
    `apply_chat_template` does); a raw `prompt` is read as written, control tokens and all.
    `penalties` (presence, frequency, repetition, logit bias) and `grammar` (what the reply must
    match: a JSON schema, a regex, a grammar, tool calls; after the reasoning, when thinking is on)
    process the logits, exactly under speculative decoding; `logprobs` (0..20 alternatives)
    reports each token's log-probability (see `processors`). `submit` refuses a prompt that leaves
    no room in the context (`ContextLengthError`), and with `fit_max_tokens` one whose `max_tokens`
    would pass it (else the reply stops there, with "length").
    """

    prompt: Union[str, Sequence[int], None] = None
    conversation: Optional[int] = None
    messages: Optional[Sequence[dict]] = None
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    draft_tokens: Union[int, str] = "auto"
    mtp: bool = True
    seed: Optional[int] = None
    tools: Optional[Sequence[dict]] = None
    enable_thinking: bool = False
    chat_template_kwargs: Optional[Mapping] = None
    continue_final_message: bool = False
    penalties: Penalties = NONE
    grammar: Optional[Grammar] = None
    logprobs: Optional[int] = None
    allow_tool_calls: bool = True
    fit_max_tokens: bool = False
    stop: Sequence[str] = ()
    parallel_tool_calls: bool = True
    history: str = "generated"
    keep_thinking: bool = False
    parse_control_tokens: bool = False
    learn: bool = True  # an Engine that keeps served requests (learn_dir) keeps this one's ids

    def check(self) -> None:
        if self.conversation is not None:
            if not isinstance(self.prompt, str) or self.messages is not None:
                raise ValueError("a conversation request takes the user's message as a str `prompt`")
            if self.keep_thinking:
                raise ValueError("a conversation keeps earlier thinking or not as it was opened "
                                 "(`conversations.new(keep_thinking=True)`)")
        elif (self.prompt is None) == (self.messages is None):
            raise ValueError("a one-shot request takes exactly one of `prompt` and `messages`")
        chat = (self.tools, self.enable_thinking, self.chat_template_kwargs, self.continue_final_message,
                self.history != "generated", self.parse_control_tokens)
        if self.messages is None and any(chat):
            raise ValueError("`tools`, `enable_thinking`, `chat_template_kwargs`, `continue_final_message`, "
                             "`history` and `parse_control_tokens` go with `messages`")
        if self.history not in HISTORIES:
            raise ValueError(f"history must be one of {', '.join(map(repr, HISTORIES))}, got {self.history!r}")
        if self.keep_thinking and self.history != "generated":
            raise ValueError('keep_thinking goes with history="generated" (the template decides what it keeps)')
        n = self.max_tokens
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"max_tokens must be a positive int, got {n!r}")
        if self.draft_tokens != "auto":
            check_draft_tokens(self.draft_tokens)
        k = self.logprobs
        if k is not None and (type(k) is not int or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in 0..{MAX_LOGPROBS}, got {k!r}")
        if not isinstance(self.penalties, Penalties) or not isinstance(self.grammar, (Grammar, type(None))):
            raise ValueError("`penalties` must be a Penalties and `grammar` a Grammar")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the processed distribution it was drawn from (see
    `processors`): its text and bytes, and the most likely tokens there (most likely first)."""

    token: int
    text: str
    bytes: bytes
    logprob: float
    top: tuple = ()


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token. `parts` is what it released, in order (`chat_format.Delta`s:
    content or reasoning text, whole tool calls); `text` is their content. A raw prompt's
    output is all content; a chat reply's text that may still turn into a tag (or a stop
    string) is held back. `finish_reason` is set on the reply's last token."""

    text: str
    token: int
    from_draft: bool
    parts: tuple = ()
    logprob: Optional[TokenLogprob] = None  # when the request asked for log-probabilities
    finish_reason: Optional[str] = None
    kind: ClassVar[str] = "token"

    @property
    def reasoning(self) -> str:
        return "".join(p.text for p in self.parts if p.kind == "reasoning")

    @property
    def tool_calls(self) -> tuple:
        return tuple(p.call for p in self.parts if p.kind == "tool_call")


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    """The last event of a request that ran (or was cancelled): "stop" (a stop token, or a stop
    string: `stop_sequence`), "length", "cancelled", or "dead_end" (its grammar allows no token
    next). `tokens` and the reply (`text`, `reasoning`, `tool_calls`) are everything streamed,
    which is also what a conversation kept."""

    finish_reason: str
    text: str
    tokens: tuple
    stats: Stats
    reasoning: str = ""
    tool_calls: tuple = ()
    stop_sequence: Optional[str] = None
    kind: ClassVar[str] = "done"


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    """The last event of a request that failed; the other requests go on."""

    error: BaseException
    kind: ClassVar[str] = "error"

    @property
    def message(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


RequestEvent = Union[TokenEvent, DoneEvent, ErrorEvent]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A request's prompt as it runs: its token ids, where its turns end (the prefix cache keeps
    states there), the rendered chat it came from (None for a raw prompt: its output is all
    content), and its grammar state (`grammar.Matcher`) if it has a grammar."""

    tokens: list
    boundaries: list
    chat: Optional[Prompt] = None
    grammar: object = None
    images: object = None  # the prompt's images (`gemma4_vision.PromptImages`), placed in `tokens`

    def keys(self) -> list:
        """The prompt's tokens as the prefix cache keys them (an image's placeholders by its content)."""
        return list(self.tokens) if self.images is None else self.images.keyed(self.tokens)


class RequestHandle:
    """A submitted request: iterate it (or `events(timeout)`) for its events; `cancel()` it."""

    def __init__(self, request_id: int, request: Request, prepared: Optional[Prepared] = None):
        self.id = request_id
        self.request = request
        self.conversation_id = request.conversation
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._state = "queued"  # -> "running" -> "finished"
        self._cancel = threading.Event()
        self._seen_last = False
        self._prepared = prepared  # a one-shot request's, made by `submit` (a conversation's: at its turn)
        self.prompt_tokens = len(prepared.tokens) if prepared else None  # a conversation's: once it starts
        self.cached_tokens: Optional[int] = None  # of those, from the prefix cache (known by its 1st token)
        self.stats = Stats()  # the row's, as it runs (`stats.cached_tokens` is known once its prefill begins)
        self.done: Optional[DoneEvent] = None  # the last event, once `tokens()` has read it

    def cancel(self) -> None:
        """Stop the request at the next round boundary; its stream ends with a "cancelled"
        DoneEvent. A request that has not started yet never runs."""
        with self._lock:
            if self._state == "queued":
                self._state = "finished"
                self._events.put(DoneEvent("cancelled", "", (), Stats()))
        self._cancel.set()

    @property
    def finished(self) -> bool:
        return self._state == "finished"

    def events(self, timeout: Optional[float] = None) -> Iterator[RequestEvent]:
        """Yield events up to and including the final DoneEvent or ErrorEvent.

        Raises:
            TimeoutError: no event came within `timeout` seconds.
        """
        while not self._seen_last:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no event within {timeout} s") from None
            self._seen_last = event.kind != "token"
            yield event

    def __iter__(self) -> Iterator[RequestEvent]:
        return self.events()

    def tokens(self) -> Iterator[TokenEvent]:
        """Yield the token events, then keep the DoneEvent in `done`; raise the request's error.
        Closed early (a `break`, an interrupt), it cancels the request."""
        try:
            for event in self.events():
                if event.kind == "error":
                    raise event.error
                if event.kind == "done":
                    self.done = event
                    return
                yield event
        finally:
            self.cancel()  # a no-op once it ended

    @property
    def prompt_keys(self) -> list:
        """A one-shot request's prompt as the prefix cache keys it ([] for a conversation's turn)."""
        return [] if self._prepared is None else self._prepared.keys()

    def result(self, timeout: Optional[float] = None) -> DoneEvent:
        """Wait for the end (`timeout` between events); raise the request's error if it failed."""
        last = None
        for last in self.events(timeout):
            pass
        if last is None:
            raise RuntimeError(f"request {self.id}: its events were already consumed")
        if last.kind == "error":
            raise last.error
        return last

    # ---- worker side ---------------------------------------------------------------

    def _start(self) -> bool:
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "running"
            return True

    def _finish(self, event: RequestEvent) -> None:
        with self._lock:
            if self._state != "finished":
                self._state = "finished"
                self._events.put(event)
