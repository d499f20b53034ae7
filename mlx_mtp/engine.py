"""An engine for apps: one worker thread owns every MLX call and serves many requests at once;
callers on any thread submit requests and read each request's events from its own queue.

    with Engine(mlx_mtp.load(model, drafter)) as engine:
        chat = engine.new_conversation(system="Be brief.")
        for event in engine.submit(Request("Hello!", conversation=chat)):
            if event.kind == "token":
                print(event.text, end="")

A reply to `messages` (or in a conversation) is parsed as it streams: a token event's `text`
is the answer's text, its `parts` also say what was reasoning and which tool calls were made.

The worker is an admission loop around one `BatchGenerator`: between rounds it admits queued
requests (up to `max_batch` rows, first in first out, while their KV cache fits the memory
limit), cancels what was cancelled, runs one step (a prompt chunk and a speculative round for
every row), delivers the events, and retires finished rows. Every request starts from the
deepest state of the engine's prefix cache that its prompt shares, and leaves its own there
(`PrefixCache`); a conversation is a client that pins the states of its latest turn, and runs
one request at a time.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
from typing import Callable, ClassVar, Iterator, Mapping, Optional, Sequence, Union

from . import chat_format, memory
from .batch import BatchGenerator, check_fits
from .cache import FULL, SLIDING
from .chat_format import Delta, OutputParser, Reply
from .conversation import Conversation, Turn
from .grammar import Grammar, vocabulary
from .prefix_cache import PrefixCache, token_bytes
from .prefix_disk import open_disk_tier
from .processors import MAX_LOGPROBS, NONE, Penalties
from .sample import SamplingParams
from .speculative import MAX_ROLLBACK, check_draft_tokens
from .stats import Stats
from .text import Detokenizer, encode, token_piece
from .threads import mark_mlx_thread

log = logging.getLogger(__name__)
BAN = -1e9  # the logit bias that bans a token


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

    `allow_tool_calls=False` keeps the `tools` declared but bans the token that opens a call.
    Earlier replies in `messages` render as the model generated them (`chat_format.render_generated`).
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

    def check(self) -> None:
        if self.conversation is not None:
            if not isinstance(self.prompt, str) or self.messages is not None:
                raise ValueError("a conversation request takes the user's message as a str `prompt`")
        elif (self.prompt is None) == (self.messages is None):
            raise ValueError("a one-shot request takes exactly one of `prompt` and `messages`")
        chat = (self.tools, self.enable_thinking, self.chat_template_kwargs, self.continue_final_message)
        if self.messages is None and any(chat):
            raise ValueError("`tools`, `enable_thinking`, `chat_template_kwargs` and `continue_final_message` "
                             "go with `messages`")
        if isinstance(self.max_tokens, bool) or int(self.max_tokens) != self.max_tokens or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.draft_tokens != "auto":
            check_draft_tokens(self.draft_tokens)
        if self.logprobs is not None and (type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        if not isinstance(self.penalties, Penalties) or not isinstance(self.grammar, (Grammar, type(None))):
            raise ValueError("`penalties` must be a Penalties and `grammar` a Grammar")


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
    output is all content; a chat reply's text that may still turn into a tag is held back."""

    text: str
    token: int
    from_draft: bool
    parts: tuple = ()
    logprob: Optional[TokenLogprob] = None  # when the request asked for log-probabilities
    kind: ClassVar[str] = "token"

    @property
    def reasoning(self) -> str:
        return "".join(p.text for p in self.parts if p.kind == "reasoning")

    @property
    def tool_calls(self) -> tuple:
        return tuple(p.call for p in self.parts if p.kind == "tool_call")


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    """The last event of a request that ran (or was cancelled): "stop", "length", "cancelled", or
    "dead_end" (its grammar allows no token next).
    `tokens` and the reply (`text`, `reasoning`, `tool_calls`) are everything streamed, which is
    also what a conversation kept."""

    finish_reason: str
    text: str
    tokens: tuple
    stats: Stats
    reasoning: str = ""
    tool_calls: tuple = ()
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


class RequestHandle:
    """A submitted request: iterate it (or `events(timeout)`) for its events; `cancel()` it."""

    def __init__(self, request_id: int, request: Request, conversation_id: Optional[int]):
        self.id = request_id
        self.request = request
        self.conversation_id = conversation_id
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._state = "queued"  # -> "running" -> "finished"
        self._cancel = threading.Event()
        self._seen_last = False
        self._prepared: Optional[tuple] = None  # a one-shot request's prompt, turn ends, output parser, reasoning
        self._grammar = None  # the request's grammar state (`grammar.Matcher`)
        self.prompt_tokens: Optional[int] = None  # the prompt's length (a conversation's: once it started)
        self.cached_tokens: Optional[int] = None  # of which restored from the prefix cache, by its first token
        self.stats = Stats()  # the row's, as it runs (`stats.cached_tokens` is known once its prefill begins)

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


@dataclasses.dataclass
class _Running:
    handle: RequestHandle
    detok: Detokenizer
    parser: Optional[OutputParser]  # None: raw text, all content
    conversation: Optional[Conversation] = None
    turn: Optional[Turn] = None
    reply: Reply = dataclasses.field(default_factory=Reply)
    tokens: list = dataclasses.field(default_factory=list)
    kv_bytes: int = 0

    def token_event(self, text: str, token: int, from_draft: bool, finish: Optional[str],
                    logprob: Optional[TokenLogprob] = None) -> TokenEvent:
        if self.parser is None:
            parts = [Delta("content", text)] if text else []
        else:  # a call the budget cuts short is dropped
            parts = self.parser.feed(text) + (self.parser.finish(cut=finish == "length") if finish else [])
        self.reply.add(parts)
        self.tokens.append(token)
        return TokenEvent("".join(p.text for p in parts if p.kind == "content"), token, from_draft, tuple(parts),
                          logprob)

    def done(self, finish_reason: str, stats: Stats) -> DoneEvent:
        r = self.reply
        return DoneEvent(finish_reason, r.content, tuple(self.tokens), stats, r.reasoning, tuple(r.tool_calls))


@dataclasses.dataclass
class _Command:
    conversation_id: int
    run: Callable[[], None]


_STOP = object()


class Engine:
    """Serves requests for one loaded model on a worker thread, many at once.

    Args:
        loaded: a `load()`ed model (with a drafter for MTP).
        max_batch: rows generated together; more requests wait (first in, first out).
        max_queue: waiting requests beyond which `submit` raises `QueueFull` (None: no limit).
        prefill_chunk: prompt tokens processed per round.
        memory_limit: bytes the batch's KV cache and the prefix cache may take together (default:
            `self.memory.kv_limit`, half of what the weights leave of the device's memory; see
            `mlx_mtp.memory`); the prefix cache gives way to rows.
        draft_tokens: the draft-length policy of the batch ("auto" or a fixed K).
        prompt_cache_bytes: the prefix cache's budget (default: `self.memory.prefix_cache`, a
            quarter of what the weights leave); 0 turns it off (conversations still keep their
            latest turn).
        prompt_cache_dir: a directory where the prefix cache also keeps its states, for later
            requests and later processes (`mlx_mtp.prefix_disk`); None: memory only.
        prompt_cache_disk_bytes: the directory's budget (default 16 GiB), least recently used out first.

    Conversations live in the engine and share the model; the states of each one's latest turn
    stay in the prefix cache until `close_conversation`. Cancelling a conversation request keeps
    the partial reply in the conversation, exactly as streamed (the DoneEvent's `tokens`); a
    failed request leaves the conversation as it was. While the engine runs, the model's buffers
    stay wired on a Mac; `engine.memory` is the memory plan (device, defaults) it started from.
    """

    def __init__(self, loaded, max_batch: int = 8, max_queue: Optional[int] = None, prefill_chunk: int = 512,
                 memory_limit: Optional[int] = None, draft_tokens: Union[int, str] = "auto",
                 prompt_cache_bytes: Optional[int] = None, prompt_cache_dir=None,
                 prompt_cache_disk_bytes: Optional[int] = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.loaded = loaded
        self.max_batch, self.max_queue = max_batch, max_queue
        self.memory = memory.plan(loaded.target, loaded.drafter)
        self.memory_limit = memory_limit if memory_limit is not None else self.memory.kv_limit
        if prompt_cache_bytes is None:
            prompt_cache_bytes = min(self.memory.prefix_cache, self.memory_limit)
        if prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0, got {prompt_cache_bytes}")
        self.prompt_cache_bytes = prompt_cache_bytes
        log.info("%s", self.memory.describe(prompt_cache_bytes))
        if prompt_cache_disk_bytes is not None and prompt_cache_disk_bytes <= 0:
            raise ValueError(f"prompt_cache_disk_bytes must be > 0, got {prompt_cache_disk_bytes}")
        if prompt_cache_dir is not None:
            os.makedirs(prompt_cache_dir, exist_ok=True)  # an unusable path fails here, on the caller's thread
        self.prompt_cache_dir, self.prompt_cache_disk_bytes = prompt_cache_dir, prompt_cache_disk_bytes
        self._options = dict(draft_tokens=draft_tokens, prefill_chunk=prefill_chunk)
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._conversations: dict[int, Conversation] = {}
        self._live: set[RequestHandle] = set()
        self._waiting: collections.deque = collections.deque()  # worker side
        self._running: dict[int, _Running] = {}  # row uid -> request (worker side)
        self._metrics = {"requests_total": 0, "requests_waiting": 0, "requests_running": 0}
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token -> its text and bytes (worker side)
        self._call_token = chat_format.token_id(loaded.tokenizer, chat_format.TOOL_CALL)  # banned where asked
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mlx_mtp-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) --------------------------------------------------------

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request; its events arrive on the returned handle. A one-shot request's prompt
        is rendered and tokenized here, on the caller's thread (an agent's prompt can take a
        while), not on the worker, where it would hold up every running request.

        Raises:
            ValueError: a malformed request (or messages the chat template refuses). KeyError: an
            unknown conversation. QueueFull: `max_queue` requests are already waiting.
            RuntimeError: the engine is closed.
        """
        request.check()
        prepared = self._prompt(request) if request.conversation is None else None
        if prepared is not None:
            check_fits(len(prepared[0]), self.loaded.target.config.max_position_embeddings,
                       request.max_tokens if request.fit_max_tokens else None)
            request = self._ban_calls(request)
        grammar = self._matcher(request, prepared[3] if prepared else None)
        with self._lock:
            self._check_open()
            if request.conversation is not None:
                self._conversation(request.conversation)
            if self.max_queue is not None and self._metrics["requests_waiting"] >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            handle = RequestHandle(next(self._ids), request, request.conversation)
            handle._prepared, handle._grammar = prepared, grammar
            handle.prompt_tokens = len(prepared[0]) if prepared else None
            self._live.add(handle)
            self._metrics["requests_waiting"] += 1
            self._metrics["requests_total"] += 1
            self._inbox.put(handle)
        return handle

    def new_conversation(self, system: Optional[str] = None, enable_thinking: bool = False) -> int:
        """Start a conversation (optionally with a system message, or thinking); returns its id."""
        conversation = Conversation(self.loaded, system=system, enable_thinking=enable_thinking)
        with self._lock:
            self._check_open()
            conversation_id = next(self._ids)
            self._conversations[conversation_id] = conversation
        return conversation_id

    def reset_conversation(self, conversation_id: int) -> None:
        """Forget a conversation's turns once the requests queued before this call have run."""
        with self._lock:
            self._check_open()
            conversation = self._conversation(conversation_id)
            self._inbox.put(_Command(conversation_id, lambda: self._forget(conversation)))

    def close_conversation(self, conversation_id: int) -> None:
        """Forget a conversation; requests already queued for it still run, then its states are
        released (left to the prefix cache's budget)."""
        with self._lock:
            self._check_open()
            conversation = self._conversations.pop(self._check_id(conversation_id))
            self._inbox.put(_Command(conversation_id, lambda: self._forget(conversation)))

    def messages(self, conversation_id: int) -> list[dict]:
        """A copy of a conversation's messages as of now."""
        with self._lock:
            return [dict(m) for m in list(self._conversation(conversation_id).messages)]

    def count_tokens(self, request: Request) -> int:
        """The length of a one-shot request's prompt, as it would run."""
        request.check()
        if request.conversation is not None:
            raise ValueError("only a one-shot request's prompt can be counted")
        return len(self._prompt(request)[0])

    def metrics(self) -> dict:
        """Counters for monitoring: requests, tokens, speculative decoding (vLLM's names), memory."""
        with self._lock:
            counters = dict(self._metrics)
        return {**counters, **memory.usage()}  # MLX's allocator counters: any thread may read them

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

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def _check_id(self, conversation_id: int) -> int:
        if conversation_id not in self._conversations:
            raise KeyError(f"no open conversation {conversation_id}")
        return conversation_id

    def _conversation(self, conversation_id: int) -> Conversation:
        return self._conversations[self._check_id(conversation_id)]

    # ---- worker side: the only thread that calls MLX ---------------------------------------

    def _run(self) -> None:
        mark_mlx_thread()
        # Wired for the engine's life, as mlx-lm's server does, not per request: they come any time.
        with memory.generating(self.loaded.target, self.loaded.drafter):
            self._serve()

    def _serve(self) -> None:
        disk = None if self.prompt_cache_dir is None else open_disk_tier(
            self.prompt_cache_dir, self.loaded.target, self.prompt_cache_disk_bytes,
            prefill_chunk=self._options["prefill_chunk"])  # how prompts are cut: part of what K/V depend on
        self._prefix = PrefixCache(self.loaded.target, self.prompt_cache_bytes, disk)
        self._gen = self._generator()
        self._token_bytes, self._ring_bytes = _kv_bytes(self.loaded.target)
        try:
            while self._take_inbox():
                self._admit()
                self._cancel_rows()
                if self._gen.busy:
                    self._step()
            for uid, run in list(self._running.items()):  # closing: end what still runs
                self._gen.remove(uid)
                self._end(uid, run, run.done("cancelled", Stats()))
        except BaseException as e:  # a bug in the loop itself: fail every waiting request
            with self._lock:
                self._closed = True
                live = list(self._live)
            for handle in live:
                handle._finish(ErrorEvent(RuntimeError(f"the engine's worker died: {e!r}")))
            raise
        finally:
            with self._lock:
                self._conversations.clear()
            self._prefix.clear()  # free the cached states on this thread

    def _generator(self) -> BatchGenerator:
        return BatchGenerator(self.loaded.target, self.loaded.drafter, prefix_cache=self._prefix, **self._options)

    def _forget(self, conversation: Conversation) -> None:
        conversation.reset()
        self._gen.release(conversation.key)

    def _take_inbox(self) -> bool:
        """Move new requests and commands to the waiting line; block only when idle."""
        idle = not self._gen.busy and not self._waiting
        while True:
            try:
                item = self._inbox.get(block=idle)
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            self._waiting.append(item)
            idle = False

    def _admit(self) -> None:
        """Start waiting requests in order, while rows and memory allow; a conversation runs
        one request (or command) at a time, in the order they came."""
        busy = {r.handle.conversation_id for r in self._running.values()} - {None}
        still: collections.deque = collections.deque()
        blocked = False
        for item in self._waiting:
            key = item.conversation_id
            if (key is not None and key in busy) or (blocked and isinstance(item, RequestHandle)):
                still.append(item)
                busy.add(key)
                continue
            if isinstance(item, _Command):
                self._command(item.run)
            elif not item.finished and not self._start(item):
                still.append(item)
                blocked = True  # first in, first out: nobody overtakes a request that must wait
                busy.add(key)
        self._waiting = still
        self._update_counts()

    def _start(self, handle: RequestHandle) -> bool:
        """Insert a request into the batch; False when it has to wait for room."""
        request = handle.request
        if len(self._running) >= self.max_batch:
            return False
        conversation = self._conversations.get(handle.conversation_id) if handle.conversation_id else None
        turn, parser = None, OutputParser(tools=False)
        try:
            if conversation is None and request.conversation is not None:
                raise KeyError(f"conversation {request.conversation} was closed")
            if conversation is not None:
                turn = conversation.prepare(request.prompt, request.max_tokens)
                prompt, boundaries, max_tokens = turn.prompt, turn.boundaries, turn.max_tokens
            else:
                prompt, boundaries, parser, _ = handle._prepared
                max_tokens = request.max_tokens
            need = self._need(len(prompt) + max_tokens)
            if need > self.memory_limit:
                raise MemoryLimitError(f"the KV cache of this request ({need / 2**30:.2f} GiB) exceeds the "
                                       f"engine's memory limit ({self.memory_limit / 2**30:.2f} GiB)")
            if not self._room(need):
                if turn is not None:
                    conversation.end(turn, [])
                return False
            options = dict(sampling=request.sampling, seed=request.seed, mtp=request.mtp,
                           draft_tokens=request.draft_tokens, penalties=request.penalties, grammar=handle._grammar,
                           logprobs=request.logprobs)
            if turn is not None:
                uid = conversation.insert(self._gen, turn, **options)
            else:
                uid = self._gen.insert(prompt, max_tokens=max_tokens, stop_ids=self.loaded.eos_ids,
                                       boundaries=boundaries, stats=handle.stats, **options)
        except Exception as e:
            if turn is not None:
                conversation.end(turn, [])
            handle._finish(ErrorEvent(e))
            return True
        self._running[uid] = _Running(handle, Detokenizer(self.loaded), parser, conversation, turn, kv_bytes=need)
        handle.prompt_tokens = len(turn.prompt) if turn is not None else len(prompt)
        if not handle._start():  # cancelled meanwhile: its row ends at the next step
            self._gen.cancel(uid)
        return True

    def _room(self, need: int) -> bool:
        """Whether a row needing `need` bytes fits beside the running ones: the prefix cache
        gives up what nobody pins to make room."""
        rows = self._batch_need(need) if self._running else need
        if rows + self._prefix.nbytes > self.memory_limit:
            self._gen.trim_prefix_cache(max(self.memory_limit - rows, 0))
        return not self._running or rows + self._prefix.nbytes <= self.memory_limit

    def _prompt(self, request: Request) -> tuple[list[int], list[int], Optional[OutputParser], Optional[bool]]:
        """The request's prompt tokens, where its turns end (for the prefix cache), the parser
        of its output (None for a raw prompt), and where reasoning may come first: True when the
        prompt left a reasoning channel open, False when thinking is on, None when neither."""
        if request.messages is None:
            prompt = encode(self.loaded, request.prompt)
            return prompt, chat_format.turn_ends(prompt, self.loaded.eos_ids), None, None
        if self.loaded.tokenizer is None:
            raise ValueError("`messages` need a tokenizer: the model directory has none")
        rendered = chat_format.render(self.loaded.tokenizer, request.messages, request.tools,
                                      enable_thinking=request.enable_thinking,
                                      continue_final_message=request.continue_final_message,
                                      template_kwargs=request.chat_template_kwargs, as_generated=True)
        boundaries = chat_format.turn_ends(rendered.tokens, self.loaded.eos_ids)
        reasoning = True if rendered.open is not None else (False if request.enable_thinking else None)
        return rendered.tokens, boundaries, rendered.parser(tools=bool(request.tools)), reasoning

    def _ban_calls(self, request: Request) -> Request:
        """`request` with the token that opens a tool call banned, where it declares tools it
        does not allow calls of (a logit bias: exact under speculative decoding)."""
        if not request.tools or request.allow_tool_calls or self._call_token is None:
            return request
        bias = (*request.penalties.logit_bias, (self._call_token, BAN))
        return dataclasses.replace(request, penalties=dataclasses.replace(request.penalties, logit_bias=bias))

    def _matcher(self, request: Request, reasoning: Optional[bool]):
        """The request's grammar state, its grammar after the reasoning where the reply may
        reason first (see `_prompt`); made on the caller's thread: a large schema takes a while."""
        if request.grammar is None:
            return None
        if request.conversation is not None:
            with self._lock:
                reasoning = False if self._conversation(request.conversation).enable_thinking else None
        vocab = vocabulary(self.loaded)
        grammar = request.grammar
        if reasoning is not None and vocab.reasoning:
            grammar = grammar.after_reasoning(reasoning)
        return vocab.matcher(grammar)

    def _need(self, tokens: int) -> int:
        return (tokens + MAX_ROLLBACK) * self._token_bytes + self._ring_bytes

    def _batch_need(self, need: int) -> int:
        """The batch's KV bytes with one more row: full-attention buffers are as long as the
        longest row's, for every row."""
        rows = [r.kv_bytes for r in self._running.values()] + [need]
        return len(rows) * max(rows)

    def _cancel_rows(self) -> None:
        for uid, run in self._running.items():
            if run.handle._cancel.is_set():
                self._gen.cancel(uid)

    def _step(self) -> None:
        try:
            events = self._gen.step()
        except Exception as e:  # the batch's state is unknown now: fail its rows, start afresh
            log.exception("a generation step failed")
            for uid, run in list(self._running.items()):
                self._end(uid, run, ErrorEvent(e))
            self._prefix.clear()  # it may hold half a state of the failed step
            stats, self._gen = self._gen.stats, self._generator()
            self._gen.stats = stats  # counters never go back
            return
        for event in events:
            run = self._running.get(event.uid)
            if run is None:
                continue
            if run.handle.cached_tokens is None and event.stats is not None:
                run.handle.cached_tokens = event.stats.cached_tokens  # known before its first token goes out
            for e in run.detok.events(event):
                logprob = self._logprob(e.token, e.logprob)
                run.handle._events.put(run.token_event(e.text, e.token, e.from_draft, e.finish_reason, logprob))
            if event.finish_reason:
                done = run.done(event.finish_reason, dataclasses.replace(event.stats))
                self._gen.remove(event.uid)
                self._end(event.uid, run, done)
        self._update_counts()

    def _logprob(self, token: int, entry: Optional[tuple]) -> Optional[TokenLogprob]:
        if entry is None:
            return None
        logprob, top = entry
        return TokenLogprob(token, *self._piece(token), logprob,
                            tuple(TokenLogprob(t, *self._piece(t), value) for t, value in top))

    def _piece(self, token: int) -> tuple[str, bytes]:
        if token not in self._pieces:
            tokenizer = self.loaded.tokenizer
            self._pieces[token] = token_piece(tokenizer, token) if tokenizer is not None else ("", b"")
        return self._pieces[token]

    def _end(self, uid: int, run: _Running, event: RequestEvent) -> None:
        del self._running[uid]
        if run.conversation is not None:
            with self._lock:
                run.conversation.end(run.turn, run.tokens)
        run.handle._finish(event)
        with self._lock:
            self._live.discard(run.handle)

    def _update_counts(self) -> None:
        s = self._gen.stats
        waiting = sum(isinstance(i, RequestHandle) and not i.finished for i in self._waiting)
        with self._lock:
            self._metrics.update(
                requests_running=len(self._running),
                requests_waiting=waiting + self._inbox.qsize(),
                prompt_tokens_total=s.prompt_tokens,
                generation_tokens_total=s.emitted,
                spec_drafts=s.rounds,
                spec_draft_tokens=s.drafted,
                spec_accepted_tokens=s.accepted,
                spec_accepted_per_pos=list(s.accepted_at),
                **self._prefix.metrics(),
            )

    @staticmethod
    def _command(command: Callable[[], None]) -> None:
        try:
            command()
        except Exception:
            log.exception("engine command %r failed", command)


def _kv_bytes(target) -> tuple[int, int]:
    """(bytes per token of the full-attention layers, bytes of the sliding rings) for one row."""
    per_token = token_bytes(target)
    return per_token[FULL], per_token[SLIDING] * target.make_cache(1, max_rollback=MAX_ROLLBACK).ring_size

