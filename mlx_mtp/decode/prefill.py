"""Prompt processing for the driver (`BatchGenerator`): queued prompts are prefilled in chunks,
the chunks of several prompts in one forward, until each prompt joins the batch with its first
token (as mlx-lm splits prompt processing from generation).

A prompt is cut on a fixed grid of `chunk` positions, at the positions where its row leaves a
state in the prefix cache, and before its last token, whatever else is queued: a state restored
later (from memory or disk), and a cancelled prefill's, is then what a fresh prefill computes. One
step runs one forward over the next piece of as many queued rows as fit a budget of prompt tokens
(the first row's piece always runs), side by side (`Model.ragged`: each row's K/V and output are
exactly those of a forward of its own), then, in a second forward, the last token of each row whose
chunk reached it, so streaming rows stall for about one chunk per step. A row whose prompt shares
a stretch with one being prefilled waits until that one has left its state there, so it prefills
only what is new (eight clients with one system prompt still prefill it once).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..cache.kv import KVCache
from ..models.base import TargetModel, TargetOutput
from ..cache.prefix import PrefixCache
from .processors import Processors, row_logprobs
from .row import Row, RowEvent
from .sample import RESAMPLE, probs, sample, uniform
from .speculative import MAX_ROLLBACK, BatchState
from .stats import Stats


class Prefill:
    """The prompts of a generator's queue: which rows' next pieces a forward takes, the forward,
    the states left in the prefix cache on the way, and each row's first token.

    Args:
        target: the target model.
        chunk: the grid prompts are cut on (positions).
        budget: prompt tokens one forward takes over all its rows (the first row's piece always
            runs, so a budget under a chunk prefills one row at a time).
        prefix: where prompts resume from and leave states (None: nowhere).
        share: where a decision on the logits is made (`Lockstep.share`).
        stats: the generator's statistics (prompt tokens counted as they are done).
    """

    def __init__(self, target: TargetModel, chunk: int, budget: int, prefix: Optional[PrefixCache],
                 share: Callable, stats: Stats):
        if chunk < 1 or budget < 1:
            raise ValueError(f"prefill_chunk and prefill_tokens must be >= 1, got {chunk} and {budget}")
        self.target, self.chunk, self.budget, self.prefix = target, chunk, budget, prefix
        self.share, self.stats = share, stats
        self.forwards = 0  # prefill forwards run
        self.pieces = 0  # rows' pieces they carried (pieces / forwards: rows per forward)

    def step(self, pending: deque, keeps_history: Callable[[Sequence[Row]], bool]) -> tuple[bool, list]:
        """One step over the queue `pending` (rows in arrival order). Returns whether a forward
        ran, and the rows whose prompt is done with the state each joins the batch with (taken
        off the queue). `keeps_history(rows)`: whether the batch keeps token histories once they join."""
        picked = self._pick(pending)
        if not picked:
            return False, []
        done = self._forward(picked)
        last = [(row, len(row.prompt)) for row, end in picked if end == len(row.prompt) - 1]
        if last:  # last tokens in a forward of their own: the rest's skips the KV-shared layers and head
            done += self._forward(last)
        for row, _, _ in done:
            pending.remove(row)
        return True, self._first_tokens(done, keeps_history([row for row, _, _ in done]))

    def keep(self, row: Row) -> None:
        """Leave what a cancelled row's prefill computed in the prefix cache, so a retry resumes
        there: its chunks end on the grid (or at marks), as the retry's will."""
        if self.prefix is not None and row.cache is not None and row.fed > row.start:
            if self.prefix.store(row.key[: row.fed], row.cache) is not None:
                row.stats.stored_tokens = row.fed - row.start
        row.cache = None

    # ---- which rows ---------------------------------------------------------------------------

    def _pick(self, pending: Sequence[Row]) -> list[tuple[Row, int]]:
        """(row, where its piece ends) for the rows the next forward takes: in queue order, those
        whose piece fits what the budget has left. A row's prefill begins (its cache made, resumed
        from the prefix cache) when it is first considered, which is only while budget is left."""
        picked, total = [], 0
        for row in pending:
            if total >= self.budget:
                break
            if row.cache is None:
                if self._waits(row, pending):
                    continue
                self._begin(row)
            end = self._end(row)
            if picked and total + end - row.fed > self.budget:
                continue
            picked.append((row, end))
            total += end - row.fed
        return picked

    def _waits(self, row: Row, pending: Sequence[Row]) -> bool:
        """Whether `row` should not begin yet: a row being prefilled will leave a state in the
        prefix cache within the stretch their prompts share, which `row` would then resume from."""
        if self.prefix is None:
            return False
        for other in pending:
            ahead = [m for m in other.marks if m > other.fed] if other.cache is not None else ()
            if ahead and _common(row.ids, other.ids, max(ahead)) >= min(ahead):
                return True
        return False

    def _begin(self, row: Row) -> None:
        row.began = time.perf_counter()
        row.cache = self.target.make_cache(1, max_rollback=MAX_ROLLBACK)
        if self.prefix is not None:
            row.start = row.fed = self.prefix.resume(row.key, row.cache)
            if row.images is not None and row.images.cut(0, row.fed) != row.fed:  # never resume inside an image
                row.cache = self.target.make_cache(1, max_rollback=MAX_ROLLBACK)
                row.start = row.fed = 0
        row.stats.cached_tokens = row.start  # known from here on

    def _end(self, row: Row) -> int:
        """Where the row's next piece ends: its prompt's last token alone once everything before it
        is in; before that on a grid of positions (so that a prompt resumed at a state an earlier
        prompt left on that grid is cut as it would be whole), at a state to leave, and before the
        last token."""
        last = len(row.prompt) - 1
        if row.fed >= last:
            return last + 1
        grid = (row.fed // self.chunk + 1) * self.chunk
        end = min(grid, last, *(m for m in row.marks if m > row.fed))
        return end if row.images is None else row.images.cut(row.fed, end)  # an image is one forward's

    # ---- the forward ----------------------------------------------------------------------------

    def _forward(self, pieces: list[tuple[Row, int]]) -> list[tuple[Row, Optional[mx.array], mx.array]]:
        """One forward over the rows' pieces; returns (row, logits, hidden) of the rows whose
        prompt it finished, each (1, 1, ...)."""
        wanted = [end == len(row.prompt) for row, end in pieces]
        chunks = [mx.array([row.prompt[row.fed : end]], dtype=mx.int32) for row, end in pieces]
        out = _ragged(self.target, pieces, chunks, wanted)
        self.forwards, self.pieces = self.forwards + 1, self.pieces + len(pieces)
        for row, end in pieces:
            self._reached(row, end)
        filling = [row.cache for (row, end), w in zip(pieces, wanted) if not w and end < len(row.prompt) - 1]
        if filling:  # rows that go on next step: their K/V computed meanwhile
            mx.async_eval([a for c in filling for a in c.keys + c.values if a is not None])
        done = [row for (row, _), w in zip(pieces, wanted) if w]
        return [(row, None if out.logits is None else out.logits[j : j + 1], out.hidden[j : j + 1])
                for j, row in enumerate(done)]

    def _reached(self, row: Row, fed: int) -> None:
        """The cache now holds `fed` prompt tokens: leave the state there if it is marked."""
        self.stats.prompt_tokens += fed - row.fed  # as it is done, so cancelled prefills count too
        row.fed = fed
        if self.prefix is not None and fed in row.marks:
            row.pinned.append(self.prefix.store(row.key[:fed], row.cache, pin=row.owner))
            if row.pinned[-1] is not None:
                row.stats.stored_tokens = fed - row.start

    def _first_tokens(self, done: list, history: bool) -> list[tuple[Row, BatchState]]:
        """Each finished row's first token, decided from its logits as it would be alone, and the
        state it joins the batch with (with its token history if the batch keeps them)."""
        if not done:
            return []
        seeds = [mx.array([row.seed], dtype=mx.uint32) for row, _, _ in done]
        processors = [Processors.build([row.processing], self.target.vocab_size, 0) for row, _, _ in done]
        prompts = [mx.array([row.prompt], dtype=mx.int32) for row, _, _ in done]
        logits = [None] * len(done)

        def decide():  # where the logits are (under pipeline parallelism, the last rank)
            firsts = []
            for i, (row, out, _) in enumerate(done):
                logits[i], token = _first_token(row, out, processors[i], prompts[i], seeds[i])
                firsts.append(token)
            return (mx.concatenate(firsts),)

        (first,) = self.share(decide, [(len(done),)])
        joined = []
        for i, (row, _, hidden) in enumerate(done):
            row.first = first[i : i + 1]
            if processors[i] is not None:
                row.first_logprobs = processors[i].logprobs(logits[i], row.first[:, None])
            tokens = mx.concatenate([prompts[i], row.first[:, None]], axis=1) if history else None
            joined.append((row, BatchState(row.first, hidden[:, -1], seeds[i], tokens)))
        mx.async_eval(first, *[a for row, _, _ in done for a in row.first_logprobs or () if a is not None])
        return joined


def _ragged(target: TargetModel, pieces: list, chunks: list, wanted: list):
    """`target.ragged` over the pieces, except that a piece holding image soft tokens runs in a forward
    of its own (its placed images, and on the 26B/31B its mask); the text pieces still run side by
    side. Outputs as `ragged` gives them: the wanted rows' last positions, in order."""
    placed = [row.images.rows(row.fed, end - row.fed) if row.images is not None else None for row, end in pieces]
    if all(p is None for p in placed):
        return target.ragged(chunks, [row.cache for row, _ in pieces], wanted)
    outs = {}  # piece -> (logits, hidden) of its last position, for the wanted pieces
    text = [i for i, p in enumerate(placed) if p is None]
    if text:
        out = target.ragged([chunks[i] for i in text], [pieces[i][0].cache for i in text], [wanted[i] for i in text])
        for j, i in enumerate(i for i in text if wanted[i]):
            outs[i] = out.logits[j : j + 1], out.hidden[j : j + 1]
    for i, images in enumerate(placed):
        if images is not None:
            out = target(chunks[i], pieces[i][0].cache, keep=1 if wanted[i] else 0, images=images)
            if wanted[i]:
                outs[i] = out.logits, out.hidden
    if not outs:
        return TargetOutput(None, None, {})
    order = sorted(outs)
    return TargetOutput(*(mx.concatenate([outs[i][k].reshape(1, 1, -1) for i in order]) for k in (0, 1)), {})


def _first_token(row: Row, logits: mx.array, processors: Optional[Processors], prompt: mx.array,
                 seed: mx.array) -> tuple[mx.array, mx.array]:
    """(processed logits, token) at the prompt's last position, decided as for the row alone."""
    if processors is not None:  # no drafts, the prompt as history
        logits = processors(logits, mx.zeros((1, 0), dtype=mx.int32), prompt, mx.array([len(row.prompt) - 1]))
    if row.params.greedy:
        return logits, mx.argmax(logits[:, 0], axis=-1).astype(mx.int32)
    return logits, sample(probs(logits[:, 0], row.params), uniform(seed, row.cache.offset, RESAMPLE))


def join(cache: Optional[KVCache], state: Optional[BatchState], joining: list) -> tuple[KVCache, BatchState]:
    """The batch's cache and state with the (row, state) pairs of `joining` appended, in order
    (each row's own cache is let go)."""
    for row, new in joining:
        if cache is None:
            cache, state = row.cache, new
        else:
            cache.extend(row.cache)
            history = None
            if new.history is not None:  # (a joining row has one whenever the batch has)
                mine = state.history
                if mine is None:
                    mine = mx.full((state.tokens.shape[0], 1), -1, dtype=mx.int32)
                width = max(mine.shape[1], new.history.shape[1])
                history = mx.concatenate([widen(mine, width), widen(new.history, width)])
            state = BatchState(mx.concatenate([state.tokens, new.tokens]),
                               mx.concatenate([state.hidden, new.hidden.astype(state.hidden.dtype)]),
                               mx.concatenate([state.seeds, new.seeds]), history)
        row.cache = None
    return cache, state


def first_events(rows: Sequence[Row], stats: Stats, limit: int) -> list[RowEvent]:
    """The first token of each row that joined (read back now) as its first event; its prompt's
    statistics are final."""
    events = []
    for row in rows:
        first = int(row.first.item())
        top = row.processing.logprobs
        lp = None
        if top is not None:
            lp = row_logprobs(tuple(None if a is None else a.tolist() for a in row.first_logprobs), 0, 1, top)
        row.stats.prompt_tokens, row.stats.cached_tokens = row.fed - row.start, row.start
        stats.cached_tokens += row.start
        row.stats.prompt_seconds = row.stats.first_token_seconds = time.perf_counter() - row.began
        stats.prompt_seconds += row.stats.prompt_seconds
        if row.finish_reason is None:
            events.append(_deliver_first(row, first, lp, stats, limit))
    return events


def _deliver_first(row: Row, token: int, logprobs: Optional[list], stats: Stats, limit: int) -> RowEvent:
    grammar = row.processing.grammar
    if grammar is not None and grammar.dead:  # it allows no first token
        row.finish_reason = "dead_end"
        return RowEvent(row.uid, [], [], "dead_end", row.stats)
    row.tokens.append(token)
    row.stats.emitted += 1
    stats.emitted += 1
    if token in row.stop_ids:
        row.finish_reason = "stop"
    elif row.max_tokens <= 1 or row.fed + 1 >= limit:
        row.finish_reason = "length"
    else:
        row.finish_reason = row.grammar_ends([token])
    return RowEvent(row.uid, [token], [False], row.finish_reason, row.stats, logprobs)


def widen(history: mx.array, width: int) -> mx.array:
    """Token history padded with -1 (unknown) to `width` positions."""
    extra = width - history.shape[1]
    if extra <= 0:
        return history
    return mx.concatenate([history, mx.full((history.shape[0], extra), -1, dtype=mx.int32)], axis=1)


def _common(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """How many leading tokens `a` and `b` share, counting up to `limit`."""
    n = min(len(a), len(b), limit)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
