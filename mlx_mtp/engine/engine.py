"""An engine for apps: one worker thread owns every MLX call and serves many requests at once;
callers on any thread submit requests and read each request's events from its own queue.

    with Engine(mlx_mtp.load(model, drafter)) as engine:
        chat = engine.conversations.new(system="Be brief.")
        for event in engine.submit(Request("Hello!", conversation=chat)):
            if event.kind == "token":
                print(event.text, end="")

A reply to `messages` (or in a conversation) is parsed as it streams: a token event's `text`
is the answer's text, its `parts` also say what was reasoning and which tool calls were made.
What a request means (its stop strings, one tool call or several) is applied below any API, so
an app embedding the engine gets the same replies as the server's clients.

The `Engine` is the surface an app embeds; the work is done by its parts: `prepare` (a request
rendered, checked and its grammar compiled, on the caller's thread), `worker` (the thread that
admits, steps and delivers), `conversations` (the registry of open conversations). The request
types live in `requests`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
from typing import Optional, Sequence, Union

from ..runtime import memory
from .conversations import Conversations
from .prepare import Preparer
from .requests import (DoneEvent, ErrorEvent, MemoryLimitError, QueueFull, Request, RequestEvent, RequestHandle,
                       TokenEvent, TokenLogprob)
from .worker import Settings, Worker

# The request types are `requests`'s; importable from here too, as they always were.
__all__ = ["DoneEvent", "Engine", "ErrorEvent", "MemoryLimitError", "QueueFull", "Request", "RequestEvent",
           "RequestHandle", "TokenEvent", "TokenLogprob"]

log = logging.getLogger(__name__)


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
            `mlx_mtp.runtime.memory`); the prefix cache gives way to rows.
        draft_tokens: the draft-length policy of the batch ("auto" or a fixed K).
        prompt_cache_bytes: the prefix cache's budget (default: `self.memory.prefix_cache`, a
            quarter of what the weights leave); 0 turns it off (conversations still keep their
            latest turn).
        prompt_cache_dir: a directory where the prefix cache also keeps its states, for later
            requests and later processes (`mlx_mtp.cache.disk`); None: memory only.
        prompt_cache_disk_bytes: the directory's budget (default 16 GiB), least recently used out first.
        learn_dir: keep each finished request's token ids and the drafter's counts on it here
            (`mlx_mtp.learn.capture`), for adapting the drafter (`mlx_mtp.learn`); None: nothing is kept.
            `Request(learn=False)` opts a request out.
        learn_bytes: the directory's budget (oldest requests out first; default: none).
        learn_every: with `drafter_dir` (the unquantized drafter in service), adapt the drafter
            after this many new requests, a piece at a time while the engine is idle, and put it in
            service if it is better (`learn.Learner`).

    Conversations (`engine.conversations`: `new`, `history`, `messages`, `reset`, `close`) live
    in the engine and share the model; the states of each one's latest turn stay in the prefix
    cache until it is closed. Cancelling a conversation request keeps the partial reply in the
    conversation, exactly as streamed (the DoneEvent's `tokens`); a failed request leaves the
    conversation as it was. While the engine runs, the model's buffers
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
        self.prompt_cache_dir = prompt_cache_dir
        settings = Settings(max_batch, max_queue, self.memory_limit, prompt_cache_bytes, prompt_cache_dir,
                            prompt_cache_disk_bytes, draft_tokens, prefill_chunk, prefill_tokens)
        self._prepare = Preparer(loaded)
        self.conversations = Conversations(loaded, lambda key, history: self._worker.forget(key, history))
        self.learner = None if learn_dir is None else _learner(learn_dir, learn_bytes, learn_every, drafter_dir,
                                                              loaded, self.swap_drafter, prefill_chunk)
        self._worker = Worker(loaded, settings, self._prepare, self.conversations, self.learner)

    @property
    def loaded(self):
        """The loaded model in service (its drafter changes with `swap_drafter`)."""
        return self._worker.loaded

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
            request, prepared = self._prepare.one_shot(request)
        return self._worker.submit(request, prepared)

    def count_tokens(self, request: Request) -> int:
        """The length of a one-shot request's prompt, as it would run."""
        request.check()
        if request.conversation is not None:
            raise ValueError("only a one-shot request's prompt can be counted")
        return self._prepare.count(request)

    def cached(self, tokens: Sequence[int], timeout: Optional[float] = None) -> int:
        """How many leading `tokens` the prefix cache can restore now (asked of the worker, after
        what is queued before; a conversation's `History.tokens`: what its next turn resumes from)."""
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._worker.command(None, lambda: answer.put(self._worker.prefix.lookup(tokens)))
        try:
            return answer.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the engine did not answer within {timeout} s") from None

    def metrics(self) -> dict:
        """Counters for monitoring: requests, tokens, speculative decoding (vLLM's names), memory."""
        return {**self._worker.counts(), **memory.usage()}  # MLX's allocator counters: any thread may read them

    def set_memory_limit(self, limit: int) -> None:
        """Change `memory_limit` (a pool growing a loaded pair's context): requests admitted from now
        on are counted against it; those running keep what they have."""
        self.memory_limit = limit
        self._worker.set_memory_limit(limit)

    def swap_drafter(self, drafter) -> concurrent.futures.Future:
        """Put `drafter` (an MTP drafter of this target, or its directory) in service for the requests that
        start from now; those running finish on the old one. The future is done once it is in service, or
        holds the error that kept it out (a bad directory, a drafter of another target)."""
        return self._worker.swap(drafter)

    def close(self, timeout: Optional[float] = None) -> None:
        """Cancel what is queued or running, stop the worker and wait for it (unless called on
        the worker itself, e.g. by a finalizer)."""
        self._worker.stop(timeout)

    @property
    def running(self) -> bool:
        return self._worker.alive

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _learner(*args):
    from ..learn.learner import Learner  # the training code loads only where it is used

    return Learner(*args)
