"""An engine for apps: one worker thread owns every MLX call and serves many requests at once;
callers on any thread submit requests and read each request's events from its own queue.

    with Engine(mlx_mtp.load(model, drafter)) as engine:
        chat = engine.new_conversation(system="Be brief.")
        for event in engine.submit(Request("Hello!", conversation=chat)):
            if event.kind == "token":
                print(event.text, end="")

A reply to `messages` (or in a conversation) is parsed as it streams: a token event's `text`
is the answer's text, its `parts` also say what was reasoning and which tool calls were made.
What a request means (its stop strings, one tool call or several) is applied here, below any
API, so an app embedding the engine gets the same replies as the server's clients.

The worker is an admission loop around one `BatchGenerator`: between rounds it admits queued
requests (up to `max_batch` rows, first in first out, while their KV cache fits the memory
limit: `admission`), cancels what was cancelled, runs one step (a prompt chunk and a speculative
round for every row), delivers the events (`output`), and retires finished rows, and rows whose
reply reached a stop string. Every request starts from the deepest state of the engine's prefix
cache that its prompt shares, and leaves its own there (`PrefixCache`); a conversation
(`history.History`) is a client that pins the states of its latest turn, and runs one request
at a time. The request types live in `requests`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import threading
from typing import Any, Callable, Optional, Sequence, Union

from . import chat_format, memory
from .admission import Admission
from .batch import BatchGenerator, check_fits
from .chat_format import Prompt
from .grammar import Grammar, vocabulary
from .drafters import HybridDrafter, MTPProposer, NgramDrafter
from .history import History, Replies, Turn
from .loading import load_drafter
from .output import Output
from .prefix_cache import PrefixCache
from .prefix_disk import open_disk_tier
from .requests import (DoneEvent, ErrorEvent, MemoryLimitError, Prepared, QueueFull, Request, RequestEvent,
                       RequestHandle, TokenEvent, TokenLogprob)
from .stats import Stats
from .text import encode, token_piece
from .threads import mark_mlx_thread, unmark_stop

# The request types are `requests`'s; importable from here too, as they always were.
__all__ = ["DoneEvent", "Engine", "ErrorEvent", "MemoryLimitError", "QueueFull", "Request", "RequestEvent",
           "RequestHandle", "TokenEvent", "TokenLogprob"]

log = logging.getLogger(__name__)
BAN = -1e9  # the logit bias that bans a token
REPLIES_KEPT = 1024  # recent replies whose ids a history sent as messages can render with


@dataclasses.dataclass
class _Running:
    handle: RequestHandle
    output: Output
    history: Optional[History] = None
    turn: Optional[Turn] = None
    kv_bytes: int = 0
    prompt: Sequence[int] = ()


@dataclasses.dataclass
class _Swap:
    """A drafter (or its directory, loaded on the worker) to put in service once the rows running on the
    old one have finished."""

    drafter: Any
    done: concurrent.futures.Future
    conversation_id: Optional[int] = None
    checked: bool = False


@dataclasses.dataclass
class _Command:
    conversation_id: Optional[int]  # None: runs at the next admission, in no conversation's line
    run: Callable[[], None]


_STOP = object()


class Engine:
    """Serves requests for one loaded model on a worker thread, many at once.

    Args:
        loaded: a `load()`ed model (with a drafter for MTP).
        max_batch: rows generated together; more requests wait (first in, first out).
        max_queue: waiting requests beyond which `submit` raises `QueueFull` (None: no limit).
        prefill_chunk: the grid prompts are cut on (one chunk per forward for a prompt).
        prefill_tokens: prompt tokens of every queued prompt together that one round prefills, in
            one forward (default: one chunk; 1: one prompt at a time).
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
        learn_dir: keep each finished request's token ids and the drafter's counts on it here
            (`mlx_mtp.capture`), for adapting the drafter (`mlx_mtp.learn`); None: nothing is kept.
            `Request(learn=False)` opts a request out.
        learn_bytes: the directory's budget (oldest requests out first; default: none).
        learn_every: with `drafter_dir` (the unquantized drafter in service), adapt the drafter
            after this many new requests, a piece at a time while the engine is idle, and put it in
            service if it is better (`learn.Learner`).

    Conversations live in the engine and share the model; the states of each one's latest turn
    stay in the prefix cache until `close_conversation`. Cancelling a conversation request keeps
    the partial reply in the conversation, exactly as streamed (the DoneEvent's `tokens`); a
    failed request leaves the conversation as it was. While the engine runs, the model's buffers
    stay wired on a Mac; `engine.memory` is the memory plan (device, defaults) it started from.
    """

    def __init__(self, loaded, max_batch: int = 8, max_queue: Optional[int] = None, prefill_chunk: int = 512,
                 memory_limit: Optional[int] = None, draft_tokens: Union[int, str] = "auto",
                 prompt_cache_bytes: Optional[int] = None, prompt_cache_dir=None,
                 prompt_cache_disk_bytes: Optional[int] = None, prefill_tokens: Optional[int] = None,
                 learn_dir=None, learn_bytes: Optional[int] = None, learn_every: Optional[int] = None,
                 drafter_dir=None):
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
            os.makedirs(prompt_cache_dir, exist_ok=True)  # a bad path fails here, on the caller's thread
        self.prompt_cache_dir, self.prompt_cache_disk_bytes = prompt_cache_dir, prompt_cache_disk_bytes
        self._options = dict(draft_tokens=draft_tokens, prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens)
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._conversations: dict[int, History] = {}
        self._replies = Replies(loaded, REPLIES_KEPT)  # recent replies to histories sent as messages
        self._live: set[RequestHandle] = set()
        self._waiting: collections.deque = collections.deque()  # worker side
        self._running: dict[int, _Running] = {}  # row uid -> request (worker side)
        self._metrics = {"requests_total": 0, "requests_waiting": 0, "requests_running": 0}
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token -> its text and bytes (worker side)
        self._call_token = chat_format.token_id(loaded.tokenizer, chat_format.TOOL_CALL)  # banned where asked
        self._learner = None if learn_dir is None else _learner(learn_dir, learn_bytes, learn_every, drafter_dir,
                                                               loaded, self.swap_drafter, prefill_chunk)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mlx_mtp-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) --------------------------------------------------------

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request; its events arrive on the returned handle. A one-shot request's prompt
        is rendered and tokenized here, on the caller's thread (an agent's prompt can take a
        while), not on the worker, where it would hold up every running request; so is its
        grammar compiled. A conversation's turn is rendered when it starts (it follows the turns
        queued before it), and its grammar compiled then.

        Raises:
            ValueError: a malformed request (or messages the chat template refuses). KeyError: an
            unknown conversation. QueueFull: `max_queue` requests are already waiting.
            ContextLengthError: a one-shot prompt that leaves no room in the context.
            RuntimeError: the engine is closed.
        """
        request.check()
        prepared = None
        if request.conversation is None:
            prepared = self._prepare(request)
            request = self._ban_calls(request)
        with self._lock:
            self._check_open()
            if request.conversation is not None:
                self._conversation(request.conversation)
            if self.max_queue is not None and self._metrics["requests_waiting"] >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            handle = RequestHandle(next(self._ids), request, prepared)
            self._live.add(handle)
            self._metrics["requests_waiting"] += 1
            self._metrics["requests_total"] += 1
            self._inbox.put(handle)
        return handle

    def new_conversation(self, system: Optional[str] = None, enable_thinking: bool = False) -> int:
        """Start a conversation (optionally with a system message, or thinking); returns its id."""
        history = History(self.loaded, system=system, enable_thinking=enable_thinking)
        with self._lock:
            self._check_open()
            conversation_id = next(self._ids)
            self._conversations[conversation_id] = history
        return conversation_id

    def history(self, conversation_id: int) -> History:
        """A conversation's live state (`messages`, `tokens`): read or edit it only while none of
        its requests is queued or running (`messages` returns a copy at any time)."""
        with self._lock:
            return self._conversation(conversation_id)

    def reset_conversation(self, conversation_id: int) -> None:
        """Forget a conversation's turns once the requests queued before this call have run."""
        with self._lock:
            self._check_open()
            history = self._conversation(conversation_id)
            self._inbox.put(_Command(conversation_id, lambda: self._forget(history)))

    def close_conversation(self, conversation_id: int) -> None:
        """Forget a conversation; requests already queued for it still run, then its states are
        released (left to the prefix cache's budget)."""
        with self._lock:
            self._check_open()
            history = self._conversations.pop(self._check_id(conversation_id))
            self._inbox.put(_Command(conversation_id, lambda: self._forget(history)))

    def messages(self, conversation_id: int) -> list[dict]:
        """A copy of a conversation's messages as of now."""
        with self._lock:
            return [dict(m) for m in list(self._conversation(conversation_id).messages)]

    def count_tokens(self, request: Request) -> int:
        """The length of a one-shot request's prompt, as it would run."""
        request.check()
        if request.conversation is not None:
            raise ValueError("only a one-shot request's prompt can be counted")
        return len(self._render(request)[0])

    def cached(self, tokens: Sequence[int], timeout: Optional[float] = None) -> int:
        """How many leading `tokens` the prefix cache can restore now (asked of the worker, after
        what is queued before; a conversation's `History.tokens`: what its next turn resumes from)."""
        answer: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._check_open()
            self._inbox.put(_Command(None, lambda: answer.put(self._prefix.lookup(tokens))))
        try:
            return answer.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the engine did not answer within {timeout} s") from None

    def metrics(self) -> dict:
        """Counters for monitoring: requests, tokens, speculative decoding (vLLM's names), memory."""
        with self._lock:
            counters = dict(self._metrics)
        return {**counters, **memory.usage()}  # MLX's allocator counters: any thread may read them

    def close(self, timeout: Optional[float] = None) -> None:
        """Cancel what is queued or running, stop the worker and wait for it (unless called on
        the worker itself, e.g. by a finalizer)."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for handle in live:
            handle.cancel()
        self._inbox.put(_STOP)
        if threading.current_thread() is self._thread:
            return
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

    def _conversation(self, conversation_id: int) -> History:
        return self._conversations[self._check_id(conversation_id)]

    def _prepare(self, request: Request) -> Prepared:
        """A one-shot request's prompt, checked against the context, and its grammar state."""
        tokens, boundaries, chat = self._render(request)
        check_fits(len(tokens), self.loaded.target.config.max_position_embeddings,
                   request.max_tokens if request.fit_max_tokens else None)
        return Prepared(tokens, boundaries, chat, self._matcher(request.grammar, chat))

    def _render(self, request: Request) -> tuple[list[int], list[int], Optional[Prompt]]:
        """The request's prompt tokens, where its turns end (for the prefix cache), and the
        rendered chat (None for a raw prompt)."""
        if request.messages is None:
            prompt = encode(self.loaded, request.prompt)
            return prompt, chat_format.turn_ends(prompt, self.loaded.eos_ids), None
        if self.loaded.tokenizer is None:
            raise ValueError("`messages` need a tokenizer: the model directory has none")
        chat = chat_format.render(self.loaded.tokenizer, request.messages, request.tools,
                                  enable_thinking=request.enable_thinking,
                                  continue_final_message=request.continue_final_message,
                                  template_kwargs=request.chat_template_kwargs, as_generated=True,
                                  replies=self._replies)
        return chat.tokens, chat_format.turn_ends(chat.tokens, self.loaded.eos_ids), chat

    def _ban_calls(self, request: Request) -> Request:
        """`request` with the token that opens a tool call banned, where it declares tools it
        does not allow calls of (a logit bias: exact under speculative decoding)."""
        if not request.tools or request.allow_tool_calls or self._call_token is None:
            return request
        bias = (*request.penalties.logit_bias, (self._call_token, BAN))
        return dataclasses.replace(request, penalties=dataclasses.replace(request.penalties, logit_bias=bias))

    def _matcher(self, grammar: Optional[Grammar], chat: Optional[Prompt]):
        """The grammar's state for a reply to `chat`: after the reasoning where the reply may
        reason first (`Prompt.reasoning` decides). A large schema takes a while to compile."""
        if grammar is None:
            return None
        vocab = vocabulary(self.loaded)
        reasoning = chat.reasoning if chat is not None else None
        if reasoning is not None and vocab.reasoning:
            grammar = grammar.after_reasoning(reasoning)
        return vocab.matcher(grammar)

    # ---- worker side: the only thread that calls MLX ---------------------------------------

    def _run(self) -> None:
        mark_mlx_thread(stop=lambda: self.close(timeout=10))  # an engine nobody closed stops at exit
        try:
            # Wired for the engine's life, as mlx-lm's server does, not per request: they come any time.
            with memory.generating(self.loaded.target, self.loaded.drafter):
                self._serve()
        finally:
            unmark_stop()

    def _serve(self) -> None:
        disk = None if self.prompt_cache_dir is None else open_disk_tier(
            self.prompt_cache_dir, self.loaded.target, self.prompt_cache_disk_bytes,
            prefill_chunk=self._options["prefill_chunk"])  # how prompts are cut: part of what K/V depend on
        self._prefix = PrefixCache(self.loaded.target, self.prompt_cache_bytes, disk)
        self._gen = self._generator()
        self._admission = Admission(self.loaded.target, self.memory_limit)
        try:
            while self._take_inbox():
                self._admit()
                self._cancel_rows()
                if self._gen.busy:
                    self._step()
            for uid, run in list(self._running.items()):  # closing: end what still runs
                self._gen.remove(uid)
                self._end(uid, run, run.output.done("cancelled", Stats()))
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
            if self._learner is not None:
                self._learner.capture.close()

    def _generator(self) -> BatchGenerator:
        loaded = self.loaded
        return BatchGenerator(loaded.target, loaded.drafter, prefix_cache=self._prefix, **self._options)

    def swap_drafter(self, drafter) -> concurrent.futures.Future:
        """Put `drafter` (an MTP drafter of this target, or its directory) in service for the requests that
        start from now; those running finish on the old one. The future is done once it is in service, or
        holds the error that kept it out (a bad directory, a drafter of another target)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Swap(drafter, done))
        return done

    def _ready(self, swap: _Swap) -> bool:
        """Load and check the drafter at once (on this thread, which owns MLX), so an error is told
        without waiting for the running rows."""
        try:
            if isinstance(swap.drafter, (str, os.PathLike)):
                swap.drafter = load_drafter(swap.drafter, self.loaded.target)
            swap.drafter.check_target(self.loaded.target)
        except (OSError, ValueError) as e:
            swap.done.set_exception(e)
            return False
        swap.checked = True
        return True

    def _swap(self, swap: _Swap) -> None:
        drafter = swap.drafter
        if isinstance(self.loaded.drafter, HybridDrafter):  # the same kind of drafting, with the new model
            drafter = HybridDrafter(MTPProposer(drafter, self.loaded.target), NgramDrafter())
        self.loaded = self.loaded._replace(drafter=drafter)
        self._gen = self._generator()  # the prefix cache (target K/V) stays
        swap.done.set_result(True)

    def _forget(self, history: History) -> None:
        history.reset()
        self._gen.release(history.key)

    def _take_inbox(self) -> bool:
        """Move new requests and commands to the waiting line; block only when idle (and no
        adaptation of the drafter wants the idle time: it takes a step per loop instead)."""
        idle = not self._gen.busy and not self._waiting
        if idle and self._learner is not None and self._learner.wants_time():
            self._learner.step()
            idle = False
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
            if isinstance(item, _Swap):
                if not item.checked and not self._ready(item):
                    continue
                if self._running or blocked:  # the running rows finish on the old drafter
                    still.append(item)
                    blocked = True
                    continue
                self._swap(item)
            elif isinstance(item, _Command):
                self._command(item.run)
            elif not item.finished and not self._start(item):
                still.append(item)
                blocked = True  # first in, first out: nobody overtakes a request that must wait
                busy.add(key)
        self._waiting = still
        self._update_counts()

    def _start(self, handle: RequestHandle) -> bool:
        """Insert a request into the batch; False when it has to wait for room."""
        if len(self._running) >= self.max_batch:
            return False
        history = self._conversations.get(handle.conversation_id) if handle.conversation_id else None
        turn = None
        try:
            if history is None and handle.conversation_id is not None:
                raise KeyError(f"conversation {handle.conversation_id} was closed")
            if history is not None:
                turn = history.prepare(handle.request.prompt, handle.request.max_tokens)
            prepared, max_tokens = self._prepared(handle, turn)
            need = self._admission.need(len(prepared.tokens) + max_tokens)
            if not self._admission.room([r.kv_bytes for r in self._running.values()], need, self._prefix,
                                        self._gen.trim_prefix_cache):
                if turn is not None:
                    history.end(turn, [])
                return False
            uid = self._insert(handle, prepared, max_tokens, history, turn)
        except Exception as e:
            if turn is not None:
                history.end(turn, [])
            handle._finish(ErrorEvent(e))
            return True
        output = self._output(handle.request, prepared.chat)
        self._running[uid] = _Running(handle, output, history, turn, need, prepared.tokens)
        handle.prompt_tokens = len(prepared.tokens)
        if not handle._start():  # cancelled meanwhile: its row ends at the next step
            self._gen.cancel(uid)
        return True

    def _prepared(self, handle: RequestHandle, turn: Optional[Turn]) -> tuple[Prepared, int]:
        """The request's prompt and its token budget: a one-shot request's, prepared by `submit`;
        a conversation's turn, rendered now, with its grammar."""
        if turn is None:
            return handle._prepared, handle.request.max_tokens
        grammar = self._matcher(handle.request.grammar, turn.prompt)
        return Prepared(turn.prompt.tokens, turn.boundaries, turn.prompt, grammar), turn.max_tokens

    def _insert(self, handle: RequestHandle, prepared: Prepared, max_tokens: int, history: Optional[History],
                turn: Optional[Turn]) -> int:
        request = handle.request
        options = dict(sampling=request.sampling, seed=request.seed, mtp=request.mtp,
                       draft_tokens=request.draft_tokens, penalties=request.penalties,
                       grammar=prepared.grammar, logprobs=request.logprobs, stats=handle.stats)
        if history is not None:
            return history.insert(self._gen, turn, **options)
        return self._gen.insert(prepared.tokens, max_tokens=max_tokens, stop_ids=self.loaded.eos_ids,
                                boundaries=prepared.boundaries, **options)

    def _output(self, request: Request, chat: Optional[Prompt]) -> Output:
        """How the request's tokens become events: a chat reply is parsed (tool calls only where
        it declares tools, or in a conversation, whose model may call what it was told of)."""
        tools = bool(request.tools) or request.conversation is not None
        parser = None if chat is None else chat.parser(tools=tools)
        return Output(self.loaded, parser, request.stop, request.parallel_tool_calls, self._piece)

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
            if run is not None:
                self._deliver(run, event)
        self._update_counts()

    def _deliver(self, run: _Running, event) -> None:
        """One row's events of a step; its end at a finish, or at a stop string, where the row is
        taken out with the tokens streamed (the rest of its round is dropped)."""
        if run.handle.cached_tokens is None and event.stats is not None:
            run.handle.cached_tokens = event.stats.cached_tokens  # known before its first token goes out
        for token_event in run.output.events(event):
            run.handle._events.put(token_event)
        if run.output.stopped or event.finish_reason:
            self._gen.remove(event.uid, len(run.output.tokens) if run.output.stopped else None)
            stats = dataclasses.replace(event.stats) if event.stats is not None else Stats()
            self._end(event.uid, run, run.output.done(event.finish_reason, stats))

    def _piece(self, token: int) -> tuple[str, bytes]:
        if token not in self._pieces:
            tokenizer = self.loaded.tokenizer
            self._pieces[token] = token_piece(tokenizer, token) if tokenizer is not None else ("", b"")
        return self._pieces[token]

    def _end(self, uid: int, run: _Running, event: RequestEvent) -> None:
        del self._running[uid]
        if run.history is not None:
            with self._lock:
                run.history.end(run.turn, run.output.tokens)
        elif run.handle.request.messages is not None and run.output.tokens:
            self._replies.record(run.output.tokens)  # a history sent back with it renders it as generated
        if self._learner is not None and run.handle.request.learn and run.output.tokens:
            self._learner.finished(run.prompt, run.output.tokens, getattr(event, "stats", None))
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


def _learner(*args):
    from .learn import Learner  # the training code loads only where it is used

    return Learner(*args)
