"""The engine's worker: the one thread that calls MLX.

It is an admission loop around one batch generator (`BatchGenerator`): between rounds it takes
what came into its inbox, admits waiting requests (up to `max_batch` rows, first in first out,
while their KV cache fits the memory limit: `admission`), cancels what was cancelled, runs one
step (a prompt chunk and a speculative round for every row), delivers each row's events (an
`Output` per request) and retires finished rows, and rows whose reply reached a stop string.
Every request starts from the deepest state of the prefix cache that its prompt shares, and
leaves its own there (`PrefixCache`); a conversation's turn (`Conversations`) runs one at a time.
Callers on any thread put requests and commands in the inbox; only the worker touches the rest.
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
from typing import Any, Callable, Optional, Sequence

from ..runtime import memory
from .admission import Admission
from ..decode.batch import BatchGenerator
from .conversations import Conversations
from ..decode.drafters import HybridDrafter, MTPProposer, NgramDrafter
from .history import History, Turn
from ..loading import load_drafter
from .output import Output
from ..cache.prefix import PrefixCache
from ..cache.disk import open_disk_tier
from .prepare import Preparer
from .requests import ErrorEvent, Prepared, QueueFull, Request, RequestEvent, RequestHandle
from ..decode.stats import Stats
from ..runtime.threads import mark_mlx_thread, unmark_stop

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the worker serves with (the `Engine`'s arguments, checked)."""

    max_batch: int = 8
    max_queue: Optional[int] = None
    memory_limit: int = 0
    prompt_cache_bytes: int = 0
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk_bytes: Optional[int] = None
    draft_tokens: Any = "auto"
    prefill_chunk: int = 512
    prefill_tokens: Optional[int] = None

    def generator(self, loaded, prefix: PrefixCache) -> BatchGenerator:
        return BatchGenerator(loaded.target, loaded.drafter, prefix_cache=prefix, draft_tokens=self.draft_tokens,
                              prefill_chunk=self.prefill_chunk, prefill_tokens=self.prefill_tokens)


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

    def ready(self, target) -> bool:
        """Load and check the drafter at once (on the worker, which owns MLX), so an error is told
        without waiting for the running rows."""
        try:
            if isinstance(self.drafter, (str, os.PathLike)):
                self.drafter = load_drafter(self.drafter, target)
            self.drafter.check_target(target)
        except (OSError, ValueError) as e:
            self.done.set_exception(e)
            return False
        self.checked = True
        return True


@dataclasses.dataclass
class _Command:
    conversation_id: Optional[int]  # None: runs at the next admission, in no conversation's line
    run: Callable[[], None]

    def __call__(self) -> None:
        try:
            self.run()
        except Exception:
            log.exception("engine command %r failed", self.run)


_STOP = object()


class Worker:
    """Owns the batch and every MLX call on a thread of its own: inbox, admission, steps, delivery,
    cancellation, counts. `generator(loaded, prefix_cache)` makes its batch generator (default:
    `settings.generator`); `learner` (`learn.Learner`) gets finished requests and idle time."""

    def __init__(self, loaded, settings: Settings, preparer: Preparer, conversations: Conversations,
                 learner=None, generator: Optional[Callable] = None):
        self.loaded, self.settings, self.learner = loaded, settings, learner
        self._preparer, self._conversations = preparer, conversations
        self._make = generator or settings.generator
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # the caller side: closed, live, counts
        self._closed = False
        self._live: set[RequestHandle] = set()
        self._counts = {"requests_total": 0, "requests_waiting": 0, "requests_running": 0}
        self._handle_ids = itertools.count(1)
        self._waiting: collections.deque = collections.deque()  # worker side from here on
        self._running: dict[int, _Running] = {}  # row uid -> request
        self._thread = threading.Thread(target=self._run, name="mlx_mtp-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread) --------------------------------------------------------

    def submit(self, request: Request, prepared: Optional[Prepared]) -> RequestHandle:
        """Queue a request (a one-shot one `prepared`); raises QueueFull or RuntimeError (closed)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if request.conversation is not None:
                self._conversations.check(request.conversation)
            queued = self._counts["requests_waiting"]
            if self.settings.max_queue is not None and queued >= self.settings.max_queue:
                raise QueueFull(f"{self.settings.max_queue} requests are already waiting")
            handle = RequestHandle(next(self._handle_ids), request, prepared)
            self._live.add(handle)
            self._counts["requests_waiting"] += 1
            self._counts["requests_total"] += 1
            self._inbox.put(handle)
        return handle

    def command(self, conversation_id: Optional[int], run: Callable[[], None]) -> None:
        """Run `run` on the worker: in the conversation's line, or at the next admission (None)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._inbox.put(_Command(conversation_id, run))

    def set_memory_limit(self, limit: int) -> None:
        """The KV cache and prefix cache's limit, from the next admission on."""
        self.command(None, lambda: setattr(self._admission, "limit", limit))

    def forget(self, conversation_id: int, history: History) -> None:
        """Reset a conversation and release the states it pins, in its line."""
        self._inbox.put(_Command(conversation_id, lambda: (history.reset(), self.gen.release(history.key))))

    def swap(self, drafter) -> concurrent.futures.Future:
        """Put `drafter` (or its directory) in service once the running rows have finished."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Swap(drafter, done))
        return done

    def counts(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def stop(self, timeout: Optional[float] = None) -> None:
        """Cancel what is queued or running, stop and wait (unless called on the worker itself)."""
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
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- worker side: the only thread that calls MLX ---------------------------------------

    def _run(self) -> None:
        mark_mlx_thread(stop=lambda: self.stop(timeout=10))  # a worker nobody stopped stops at exit
        try:
            # Wired for the engine's life, as mlx-lm's server does, not per request: they come any time.
            with memory.generating(self.loaded.target, self.loaded.drafter):
                self._serve()
        finally:
            unmark_stop()

    def _serve(self) -> None:
        s = self.settings
        disk = None if s.prompt_cache_dir is None else open_disk_tier(
            s.prompt_cache_dir, self.loaded.target, s.prompt_cache_disk_bytes,
            prefill_chunk=s.prefill_chunk)  # how prompts are cut: part of what K/V depend on
        self.prefix = PrefixCache(self.loaded.target, s.prompt_cache_bytes, disk)
        self.gen = self._make(self.loaded, self.prefix)
        self._admission = Admission(self.loaded.target, s.memory_limit)
        try:
            while self._take_inbox():
                self._admit()
                self._cancel_rows()
                if self.gen.busy:
                    self._step()
            for uid, run in list(self._running.items()):  # closing: end what still runs
                self.gen.remove(uid)
                self._end(uid, run, run.output.done("cancelled", Stats()))
        except BaseException as e:  # a bug in the loop itself: fail every waiting request
            with self._lock:
                self._closed = True
                live = list(self._live)
            for handle in live:
                handle._finish(ErrorEvent(RuntimeError(f"the engine's worker died: {e!r}")))
            raise
        finally:
            self._conversations.shut()
            self.prefix.clear()  # free the cached states on this thread
            if self.learner is not None:
                self.learner.capture.close()

    def _take_inbox(self) -> bool:
        """Move new requests and commands to the waiting line; block only when idle (and no
        adaptation of the drafter wants the idle time: it takes a step per loop instead)."""
        idle = not self.gen.busy and not self._waiting
        if idle and self.learner is not None and self.learner.wants_time():
            self.learner.step()
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
                if not item.checked and not item.ready(self.loaded.target):
                    continue
                if self._running or blocked:  # the running rows finish on the old drafter
                    still.append(item)
                    blocked = True
                    continue
                self._swap(item)
            elif isinstance(item, _Command):
                item()
            elif not item.finished and not self._start(item):
                still.append(item)
                blocked = True  # first in, first out: nobody overtakes a request that must wait
                busy.add(key)
        self._waiting = still
        self._update_counts()

    def _start(self, handle: RequestHandle) -> bool:
        """Insert a request into the batch; False when it has to wait for room."""
        if len(self._running) >= self.settings.max_batch:
            return False
        history = turn = None
        try:
            if handle.conversation_id is not None:
                history, turn = self._conversations.start(handle.conversation_id, handle.request)
            prepared = handle._prepared if turn is None else self._preparer.turn(handle.request, turn)
            max_tokens = handle.request.max_tokens if turn is None else turn.max_tokens
            need = self._admission.need(len(prepared.tokens) + max_tokens)
            if not self._admission.room([r.kv_bytes for r in self._running.values()], need, self.prefix,
                                        self.gen.trim_prefix_cache):
                if turn is not None:
                    self._conversations.end(history, turn, [])
                return False
            uid = self._insert(handle, prepared, max_tokens, history, turn)
        except Exception as e:
            if turn is not None:
                self._conversations.end(history, turn, [])
            handle._finish(ErrorEvent(e))
            return True
        output = self._preparer.output(handle.request, prepared.chat)
        self._running[uid] = _Running(handle, output, history, turn, need, prepared.tokens)
        handle.prompt_tokens = len(prepared.tokens)
        if not handle._start():  # cancelled meanwhile: its row ends at the next step
            self.gen.cancel(uid)
        return True

    def _insert(self, handle: RequestHandle, prepared: Prepared, max_tokens: int, history: Optional[History],
                turn: Optional[Turn]) -> int:
        request = handle.request
        options = dict(sampling=request.sampling, seed=request.seed, mtp=request.mtp,
                       draft_tokens=request.draft_tokens, penalties=request.penalties,
                       grammar=prepared.grammar, logprobs=request.logprobs, stats=handle.stats)
        if history is not None:
            return history.insert(self.gen, turn, **options)
        return self.gen.insert(prepared.tokens, max_tokens=max_tokens, stop_ids=self.loaded.eos_ids,
                               boundaries=prepared.boundaries, images=prepared.images, **options)

    def _cancel_rows(self) -> None:
        for uid, run in self._running.items():
            if run.handle._cancel.is_set():
                self.gen.cancel(uid)

    def _step(self) -> None:
        try:
            events = self.gen.step()
        except Exception as e:  # the batch's state is unknown now: fail its rows, start afresh
            log.exception("a generation step failed")
            for uid, run in list(self._running.items()):
                self._end(uid, run, ErrorEvent(e))
            self.prefix.clear()  # it may hold half a state of the failed step
            stats, self.gen = self.gen.stats, self._make(self.loaded, self.prefix)
            self.gen.stats = stats  # counters never go back
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
            self.gen.remove(event.uid, len(run.output.tokens) if run.output.stopped else None)
            stats = dataclasses.replace(event.stats) if event.stats is not None else Stats()
            self._end(event.uid, run, run.output.done(event.finish_reason, stats))

    def _end(self, uid: int, run: _Running, event: RequestEvent) -> None:
        del self._running[uid]
        if run.history is not None:
            self._conversations.end(run.history, run.turn, run.output.tokens)
        elif run.handle.request.messages is not None and run.output.tokens:
            self._preparer.replies.record(run.output.tokens, run.output.reply.message())  # sent back: as generated
        if self.learner is not None and run.handle.request.learn and run.output.tokens:
            self.learner.finished(run.prompt, run.output.tokens, getattr(event, "stats", None))
        run.handle._finish(event)
        with self._lock:
            self._live.discard(run.handle)

    def _swap(self, swap: _Swap) -> None:
        drafter = swap.drafter
        if isinstance(self.loaded.drafter, HybridDrafter):  # the same kind of drafting, with the new model
            drafter = HybridDrafter(MTPProposer(drafter, self.loaded.target), NgramDrafter())
        self.loaded = self.loaded._replace(drafter=drafter)
        self.gen = self._make(self.loaded, self.prefix)  # the prefix cache (target K/V) stays
        swap.done.set_result(True)

    def _update_counts(self) -> None:
        s = self.gen.stats
        waiting = sum(isinstance(i, RequestHandle) and not i.finished for i in self._waiting)
        with self._lock:
            self._counts.update(
                requests_running=len(self._running),
                requests_waiting=waiting + self._inbox.qsize(),
                prompt_tokens_total=s.prompt_tokens,
                generation_tokens_total=s.emitted,
                spec_drafts=s.rounds,
                spec_draft_tokens=s.drafted,
                spec_accepted_tokens=s.accepted,
                spec_accepted_per_pos=list(s.accepted_at),
                **self.prefix.metrics(),
            )
