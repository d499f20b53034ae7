"""An engine for apps: one worker thread owns every MLX call; callers on any thread submit
requests and read each request's events from its own queue.

    with Engine(mlx_mtp.load(model, drafter)) as engine:
        chat = engine.new_conversation(system="Be brief.")
        for event in engine.submit(Request("Hello!", conversation=chat)):
            if event.kind == "token":
                print(event.text, end="")

Requests run one at a time, first in first out. The worker takes one item at a time from its
inbox and serves a request token by token, so a batching scheduler can later replace `_serve`
without changing handles, events or conversations.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from typing import Callable, ClassVar, Iterator, Optional, Sequence, Union

from .conversation import Conversation
from .generate import stream_generate
from .sample import SamplingParams
from .stats import Stats
from .threads import mark_mlx_thread

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Request:
    """What to generate.

    With `conversation`, `prompt` is the user's next message and the reply joins that
    conversation (its KV cache is reused). Without one, the request is one-shot: `prompt` is
    raw text or token ids continued as they are, or `messages` are rendered with the chat
    template.
    """

    prompt: Union[str, Sequence[int], None] = None
    conversation: Optional[int] = None
    messages: Optional[Sequence[dict]] = None
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    draft_tokens: Union[int, str] = "auto"
    mtp: bool = True
    seed: Optional[int] = None

    def check(self) -> None:
        if self.conversation is not None:
            if not isinstance(self.prompt, str) or self.messages is not None:
                raise ValueError("a conversation request takes the user's message as a str `prompt`")
        elif (self.prompt is None) == (self.messages is None):
            raise ValueError("a one-shot request takes exactly one of `prompt` and `messages`")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    text: str
    token: int
    from_draft: bool
    kind: ClassVar[str] = "token"


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    """The last event of a request that ran (or was cancelled): "stop", "length" or "cancelled".
    `tokens` and `text` are everything streamed, which is also what a conversation kept."""

    finish_reason: str
    text: str
    tokens: tuple
    stats: Stats
    kind: ClassVar[str] = "done"


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    """The last event of a request that failed; the engine goes on with the next one."""

    error: BaseException
    kind: ClassVar[str] = "error"

    @property
    def message(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


Event = Union[TokenEvent, DoneEvent, ErrorEvent]


class RequestHandle:
    """A submitted request: iterate it (or `events(timeout)`) for its events; `cancel()` it."""

    def __init__(self, request_id: int, request: Request, conversation: Optional[Conversation]):
        self.id = request_id
        self.request = request
        self._conversation = conversation
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._state = "queued"  # -> "running" -> "finished"
        self._cancel = threading.Event()
        self._seen_last = False

    def cancel(self) -> None:
        """Stop the request at the next token boundary; its stream ends with a "cancelled"
        DoneEvent. A request that has not started yet never runs."""
        with self._lock:
            if self._state == "queued":
                self._state = "finished"
                self._events.put(DoneEvent("cancelled", "", (), Stats()))
        self._cancel.set()

    @property
    def finished(self) -> bool:
        return self._state == "finished"

    def events(self, timeout: Optional[float] = None) -> Iterator[Event]:
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

    def __iter__(self) -> Iterator[Event]:
        return self.events()

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

    def _finish(self, event: Event) -> None:
        with self._lock:
            if self._state != "finished":
                self._state = "finished"
                self._events.put(event)


_STOP = object()


# ---- server additions (issue 11), to be ported into the scheduler rewrite ----------------


class QueueFull(RuntimeError):
    """`submit` found `max_queue` requests already waiting; try again later."""


def _new_counters() -> dict:
    return dict(requests_total=0, prompt_tokens_total=0, generation_tokens_total=0, spec_drafts=0,
                spec_draft_tokens=0, spec_accepted_tokens=0, spec_accepted_per_pos=[])


def _count(counters: dict, stats: Stats) -> None:
    """Add one finished request's work to the engine's counters (vLLM's speculative names)."""
    counters["prompt_tokens_total"] += stats.prompt_tokens
    counters["generation_tokens_total"] += stats.emitted
    counters["spec_drafts"] += stats.rounds
    counters["spec_draft_tokens"] += stats.drafted
    counters["spec_accepted_tokens"] += stats.accepted
    per_pos = counters["spec_accepted_per_pos"]
    per_pos += [0] * (len(stats.accepted_at) - len(per_pos))
    for i, n in enumerate(stats.accepted_at):
        per_pos[i] += n

# ---- end of server additions ---------------------------------------------------------------


class Engine:
    """Serves requests for one loaded model on a worker thread.

    Conversations live in the engine and share the model; each has its own KV cache, made
    when its first request runs and freed by `close_conversation`.

    Cancelling a conversation request keeps the partial reply in the conversation, exactly
    as streamed (the DoneEvent's `tokens`), like a chat app that shows a stopped reply; a
    failed request leaves the conversation as it was.
    """

    def __init__(self, loaded, max_rollback: Optional[int] = None, max_batch: int = 8,
                 max_queue: Optional[int] = None):
        self.loaded = loaded
        self.max_rollback = max_rollback
        self.max_batch = max_batch  # server addition: the rewrite serves this many at once; this engine one
        self.max_queue = max_queue  # server addition: `submit` raises QueueFull past this many waiting
        self._counters = _new_counters()  # server addition
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._conversations: dict[int, Conversation] = {}
        self._live: set[RequestHandle] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mlx_mtp-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) --------------------------------------------------------

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request; its events arrive on the returned handle.

        Raises:
            ValueError: a malformed request. KeyError: an unknown conversation.
            RuntimeError: the engine is closed. QueueFull: `max_queue` requests are waiting.
        """
        request.check()
        with self._lock:
            self._check_open()
            conversation = None if request.conversation is None else self._conversation(request.conversation)
            # server addition:
            if self.max_queue is not None and self._count_state("queued") >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            handle = RequestHandle(next(self._ids), request, conversation)
            self._counters["requests_total"] += 1  # server addition
            self._live.add(handle)
            self._inbox.put(handle)
        return handle

    def new_conversation(self, system: Optional[str] = None) -> int:
        """Start a conversation (optionally with a system message); returns its id."""
        conversation = Conversation(self.loaded, system=system, max_rollback=self.max_rollback)
        with self._lock:
            self._check_open()
            conversation_id = next(self._ids)
            self._conversations[conversation_id] = conversation
        return conversation_id

    def reset_conversation(self, conversation_id: int) -> None:
        """Forget a conversation's turns once the requests queued before this call have run."""
        with self._lock:
            self._check_open()
            self._inbox.put(self._conversation(conversation_id).reset)

    def close_conversation(self, conversation_id: int) -> None:
        """Forget a conversation; requests already queued for it still run, then its cache is freed."""
        with self._lock:
            self._check_open()
            conversation = self._conversation(conversation_id)
            del self._conversations[conversation_id]
            self._inbox.put(conversation.reset)

    def messages(self, conversation_id: int) -> list[dict]:
        """A copy of a conversation's messages as of now."""
        with self._lock:
            return [dict(m) for m in list(self._conversation(conversation_id).messages)]

    def close(self, timeout: Optional[float] = None) -> None:
        """Cancel what is queued or running, stop the worker and wait for it."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for handle in live:
            handle.cancel()
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine's worker did not stop within {timeout} s")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # ---- server addition: counters for /metrics --------------------------------------------

    def metrics(self) -> dict:
        """Requests running and waiting now, and counters since the engine started."""
        with self._lock:
            out = dict(self._counters, spec_accepted_per_pos=list(self._counters["spec_accepted_per_pos"]))
            out.update(requests_running=self._count_state("running"),
                       requests_waiting=self._count_state("queued"))
        return out

    def _count_state(self, state: str) -> int:
        return sum(handle._state == state for handle in self._live)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def _conversation(self, conversation_id: int) -> Conversation:
        try:
            return self._conversations[conversation_id]
        except KeyError:
            raise KeyError(f"no open conversation {conversation_id}") from None

    # ---- worker side: the only thread that calls MLX ---------------------------------------

    def _run(self) -> None:
        mark_mlx_thread()
        try:
            while (item := self._inbox.get()) is not _STOP:
                if isinstance(item, RequestHandle):
                    self._serve(item)
                    with self._lock:
                        self._live.discard(item)
                else:
                    self._command(item)
        except BaseException as e:  # a bug in the loop itself: fail every waiting request
            with self._lock:
                self._closed = True
                live = list(self._live)
            for handle in live:
                handle._finish(ErrorEvent(RuntimeError(f"the engine's worker died: {e!r}")))
            raise
        finally:
            with self._lock:
                self._conversations.clear()  # free the caches on this thread

    def _serve(self, handle: RequestHandle) -> None:
        if not handle._start():
            return  # cancelled while queued
        text, tokens, stats, finish = [], [], Stats(), "length"
        try:
            events = self._open(handle.request, handle._conversation)
            try:
                for event in events:
                    handle._events.put(TokenEvent(event.text, event.token, event.from_draft))
                    text.append(event.text)
                    tokens.append(event.token)
                    stats = event.stats
                    if event.finish_reason:
                        finish = event.finish_reason
                    elif handle._cancel.is_set():
                        finish = "cancelled"
                        break
            finally:
                events.close()  # a conversation keeps the reply streamed so far
        except Exception as e:
            handle._finish(ErrorEvent(e))
            return
        finally:
            with self._lock:
                _count(self._counters, stats)  # server addition
        handle._finish(DoneEvent(finish, "".join(text), tuple(tokens), stats))

    def _open(self, request: Request, conversation: Optional[Conversation]):
        kwargs = dict(
            max_tokens=request.max_tokens, sampling=request.sampling, draft_tokens=request.draft_tokens,
            mtp=request.mtp, seed=request.seed,
        )
        if conversation is not None:
            return conversation.reply(request.prompt, **kwargs)
        prompt = request.prompt
        if request.messages is not None:
            if self.loaded.tokenizer is None:
                raise ValueError("`messages` need a tokenizer: the model directory has none")
            prompt = self.loaded.tokenizer.apply_chat_template(
                list(request.messages), add_generation_prompt=True
            )
        return stream_generate(self.loaded, prompt, **kwargs)

    @staticmethod
    def _command(command: Callable[[], None]) -> None:
        try:
            command()
        except Exception:
            log.exception("engine command %r failed", command)
