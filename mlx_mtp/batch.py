"""The one generation driver: continuous batching of speculative rounds.

Rows join and leave between rounds. A row is inserted with its prompt; its prompt is prefilled
in chunks, one chunk per `step()`, between the batch's rounds, so streaming rows stall for at
most one chunk; then it joins the batch. With a prefix cache, a prompt starts from the deepest
state an earlier row left that it shares, and rows leave states behind where later prompts may
part ways with theirs (`PrefixCache`). Each row owns its request: sampling parameters, seed,
stop tokens, token budget, MTP on/off and draft length; its output equals what it would get alone.

Rounds are pipelined: `step()` builds and queues round n+1 before it reads round n's tokens, so
the host's work of building a round and handing out tokens hides behind the device's work. A
row with a grammar is the exception: its next round's forced tokens and masks come from this
round's tokens, so while one runs, each round is read as soon as it is queued. Rows may ask for
logits processors (penalties, bias, a grammar) and log-probabilities (`processors`).
The shape follows mlx-lm's `BatchGenerator.insert(...)` / `remove(...)`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Hashable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .drafters import as_proposer
from .lockstep import ALONE, Lockstep
from .models.base import TargetModel
from .prefix_cache import PrefixCache
from .processors import MAX_LOGPROBS, NONE, Penalties, Processors, RowProcessing, row_logprobs
from .sample import RESAMPLE, SamplingParams, probs, sample, uniform
from .speculative import (K_MAX, MAX_ROLLBACK, Acceptance, BatchState, Member, Plan, RoundOutput, check_draft_tokens,
                          policy_for, run_round)
from .stats import Stats
from .threads import mark_mlx_thread

SEEDED_K = 3  # draft length of a seeded, sampled row under "auto" (see `insert`)


class ContextLengthError(ValueError):
    """A prompt (plus generation) that does not fit the model's context: `prompt_tokens`, the
    `context` length and, where the request's whole budget had to fit, its `max_tokens`."""

    def __init__(self, message: str, prompt_tokens: Optional[int] = None, context: Optional[int] = None,
                 max_tokens: Optional[int] = None):
        super().__init__(message)
        self.prompt_tokens, self.context, self.max_tokens = prompt_tokens, context, max_tokens


def check_fits(prompt_tokens: int, context: int, max_tokens: Optional[int] = None) -> None:
    """Raise ContextLengthError unless a prompt leaves room for a token (and for `max_tokens`)."""
    if prompt_tokens >= context:
        raise ContextLengthError(f"prompt of {prompt_tokens} tokens does not fit the model's context of {context} "
                                 "tokens", prompt_tokens, context)
    if max_tokens is not None and prompt_tokens + max_tokens > context:
        raise ContextLengthError(f"prompt of {prompt_tokens} tokens and max_tokens {max_tokens} exceed the model's "
                                 f"context of {context} tokens", prompt_tokens, context, max_tokens)


@dataclasses.dataclass
class RowEvent:
    """New tokens of one row from one `step()`; `finish_reason` is set on the row's last event."""

    uid: int
    tokens: list
    from_draft: list
    finish_reason: Optional[str] = None  # "stop", "length", "cancelled", or "dead_end" (the grammar allows nothing)
    stats: Optional[Stats] = None
    logprobs: Optional[list] = None  # per token (logprob, ((token, logprob), ...)) when the row asked


@dataclasses.dataclass(eq=False)
class _Row:
    uid: int
    prompt: list
    max_tokens: int
    params: SamplingParams
    seed: int
    seeded: bool
    stop_ids: frozenset
    draft: Union[int, str, None]  # None: MTP off for this row
    marks: frozenset  # prompt lengths at which the row leaves a state in the prefix cache
    owner: Optional[Hashable]  # pins the row's states (see `insert`)
    cache: Optional[KVCache] = None  # while the prompt is prefilled
    start: int = 0  # prompt tokens restored from the prefix cache
    fed: int = 0  # prompt tokens in the cache
    tokens: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    stats: Stats = dataclasses.field(default_factory=Stats)
    first: Optional[mx.array] = None
    began: float = 0.0
    pinned: list = dataclasses.field(default_factory=list)  # states the row left for its owner
    processing: RowProcessing = RowProcessing()
    first_logprobs: Optional[tuple] = None
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)  # of this row's drafts

    @property
    def length(self) -> int:
        """Tokens the row's cache holds: prompt and emitted tokens but the last one."""
        return self.fed + max(len(self.tokens) - 1, 0)


@dataclasses.dataclass
class _Inflight:
    out: RoundOutput
    rows: list
    plan: Plan
    after_prefill: bool  # a prompt chunk ran just before it: its wall time is not the round's

    @property
    def serial(self) -> bool:
        """Read as soon as queued: a row's grammar needs its tokens to build the next round."""
        return self.plan.processors is not None and self.plan.processors.serial


class BatchGenerator:
    """Generate for any number of sequences at once.

    Usage:
        gen = BatchGenerator(target, drafter)
        uid = gen.insert(prompt_ids, max_tokens=100)
        while gen.busy:
            for event in gen.step(): ...   # RowEvent(uid, tokens, from_draft, finish_reason)

    Args:
        target: the target model.
        drafter: an MTP drafter, a proposer (e.g. `NgramDrafter`), or None for plain decoding.
        draft_tokens: the batch's draft-length policy: "auto" or a fixed K.
        prefill_chunk: prompt tokens processed per `step()`.
        prefix_cache: where prompts resume from, and rows leave their states (None: nowhere).
    """

    def __init__(self, target: TargetModel, drafter=None, draft_tokens: Union[int, str] = "auto",
                 prefill_chunk: int = 512, prefix_cache: Optional[PrefixCache] = None):
        self.target = target
        self.proposer = as_proposer(drafter, target)
        self.policy = policy_for(drafter, draft_tokens)
        self.constrained_policy = policy_for(drafter, draft_tokens, constrained=True)  # rounds with a grammar
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix_cache
        self.limit = target.config.max_position_embeddings
        self.stats = Stats()  # every row together
        self.pending: collections.deque[_Row] = collections.deque()
        self.rows: list[_Row] = []  # in the batch, in cache order
        self.cache: Optional[KVCache] = None
        self.state: Optional[BatchState] = None
        self._inflight: Optional[_Inflight] = None
        self._joined: list[_Row] = []  # first token not read yet
        self._cancelled: list[_Row] = []
        self._uids = 0
        self._last_read: Optional[float] = None
        self.lockstep: Lockstep = getattr(target, "pipeline", None) or ALONE  # ranks of a pipeline group
        self.lockstep.made(self)

    @property
    def busy(self) -> bool:
        """True while any row still has work (or a cancel to report)."""
        return bool(self.pending or self.rows or self._joined or self._cancelled)

    @property
    def active(self) -> int:
        return len(self.rows) + len(self.pending)

    # ---- rows in -------------------------------------------------------------------------

    def insert(self, prompt: Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
               seed: Optional[int] = None, stop_ids: Sequence[int] = (), mtp: bool = True,
               draft_tokens: Union[int, str] = "auto", boundaries: Sequence[int] = (),
               owner: Optional[Hashable] = None, stats: Optional[Stats] = None, penalties: Penalties = NONE,
               grammar=None, logprobs: Optional[int] = None) -> int:
        """Queue a sequence; returns its uid. Its first token comes from a later `step()`.

        Args:
            prompt: token ids.
            max_tokens: the row's token budget.
            sampling: the row's sampling parameters.
            seed: the row's random seed. A seeded row's output depends only on (seed, prompt,
                sampling, draft length): never on timing or on the other rows. Under "auto",
                a seeded row that samples drafts SEEDED_K tokens a round for that reason.
            stop_ids: tokens that end the row (emitted, then the row stops).
            mtp: False: the row drafts nothing (it still shares the batch's verify forward).
            draft_tokens: "auto" (the policy decides) or the row's fixed draft length.
            boundaries: prompt lengths where a later prompt may part ways with this one (the
                end of each turn of a rendered conversation): the prefix cache keeps the state
                there, as it does before the prompt's last token, after it, and after the reply.
            owner: pins the states this row leaves in the prefix cache for `owner` (a
                conversation keeping its latest turn); once the row is done, the ones earlier
                rows left for it are released.
            stats: the `Stats` to keep the row's statistics in (a new one by default).
            penalties: the row's penalties and logit bias.
            grammar: a `grammar.Matcher` its output must match (ends with "dead_end" if it
                ever allows no token).
            logprobs: report each token's log-probability, with this many alternatives (0..20).

        Raises:
            ValueError: bad arguments or token ids; ContextLengthError: it does not fit.
        """
        ids = self._check_prompt(prompt)
        if int(max_tokens) != max_tokens or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        draft = draft_tokens if draft_tokens == "auto" else check_draft_tokens(draft_tokens)
        check_fits(len(ids), self.limit)
        uid = self._uids
        value = _seed(seed) if seed is not None else self.lockstep.seed(self, uid)
        marks = frozenset(b for b in boundaries if 0 < b < len(ids)) | {len(ids) - 1, len(ids)}
        row = _Row(uid, ids, int(max_tokens), sampling, value, seed is not None, frozenset(stop_ids),
                   draft if mtp and self.proposer is not None else None, marks - {0}, owner)
        row.stats = stats if stats is not None else row.stats
        row.processing = self._processing(penalties, grammar, logprobs, len(ids))
        self.lockstep.inserting(self, row)
        self._uids += 1
        self.pending.append(row)
        return uid

    def _processing(self, penalties: Penalties, grammar, logprobs: Optional[int], start: int) -> RowProcessing:
        if logprobs is not None and (isinstance(logprobs, bool) or int(logprobs) != logprobs
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in 0..{MAX_LOGPROBS}, got {logprobs!r}")
        if any(t >= self.target.vocab_size for t, _ in penalties.logit_bias):
            raise ValueError(f"logit_bias names a token outside the vocabulary (0..{self.target.vocab_size - 1})")
        processing = RowProcessing(penalties, grammar, logprobs, start)
        if processing.active and self.lockstep is not ALONE:
            raise ValueError("grammars, penalties, logit bias and logprobs are not supported under pipeline parallelism")
        return processing

    def _check_prompt(self, prompt) -> list:
        ids = list(prompt)
        if not ids:
            raise ValueError("empty prompt: nothing to condition on")
        arr = np.asarray(ids)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError("a prompt is a flat list of integer token ids")
        bad = arr[(arr < 0) | (arr >= self.target.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (0..{self.target.vocab_size - 1})")
        return [int(t) for t in ids]

    # ---- rows out ------------------------------------------------------------------------

    def cancel(self, uid: int) -> None:
        """Stop a row; the next `step()` reports it with finish_reason "cancelled"."""
        self.lockstep.called(self, "cancel", uid)
        self._cancel(uid)

    def _cancel(self, uid: int) -> None:
        row = self._find(uid)
        if row is None or row.finish_reason is not None:
            return
        row.finish_reason = "cancelled"
        self._cancelled.append(row)
        if row in self.pending:
            self.pending.remove(row)
            self._keep_prefill(row)

    def _keep_prefill(self, row: _Row) -> None:
        """Leave what a cancelled row's prefill computed in the prefix cache, so a retry resumes
        there: its chunks end on the grid (or at marks), as the retry's will."""
        if self.prefix is not None and row.cache is not None and row.fed > row.start:
            if self.prefix.store(row.prompt[: row.fed], row.cache) is not None:
                row.stats.stored_tokens = row.fed - row.start
        row.cache = None

    def remove(self, uid: int, taken: Optional[int] = None) -> None:
        """Take a row out now (cancelling it if it still runs); with a prefix cache, the state
        it reached stays there.

        Args:
            taken: how many of its tokens the consumer took, when it stopped part way through
                a step's tokens; the state it leaves then ends with those.
        """
        self.lockstep.called(self, "remove", uid, taken)
        self._cancel(uid)
        row = self._find(uid)
        if row is None:
            return
        if taken is not None and taken < len(row.tokens):
            row.tokens = row.tokens[:taken]
        if row in self._joined:
            self._joined.remove(row)
        if row in self._cancelled:
            self._cancelled.remove(row)
        self._retire()

    def release(self, owner: Hashable) -> None:
        """Unpin the prefix-cache states left for `owner` (a conversation that ended)."""
        self.lockstep.called(self, "release", owner)
        if self.prefix is not None:
            self.prefix.release(owner)

    def trim_prefix_cache(self, nbytes: int) -> None:
        """Evict prefix-cache states nobody pins until it holds at most `nbytes` (room for rows)."""
        self.lockstep.called(self, "trim_prefix_cache", nbytes)
        if self.prefix is not None:
            self.prefix.evict(nbytes)

    def _find(self, uid: int) -> Optional[_Row]:
        for row in [*self.pending, *self.rows]:
            if row.uid == uid:
                return row
        return None

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RowEvent]:
        """Retire finished rows, prefill one chunk, queue the next round, and return new rows'
        first tokens and the tokens of the round queued by the previous call."""
        mark_mlx_thread()
        self.lockstep.called(self, "step")
        events = [RowEvent(r.uid, [], [], r.finish_reason, r.stats) for r in self._cancelled]
        self._cancelled = []
        self._retire()
        prefilled = self._prefill_chunk()
        first = self._read_first()
        events += first
        if first and self._inflight is None:  # nothing else runs: hand the first token out now
            self.lockstep.stepped(self)
            return events
        launched = self._launch(prefilled) if self.rows else None
        events += self._read(self._inflight, launched)
        self._inflight = launched
        if launched is not None and launched.serial:  # the next round is built from its tokens: read them now
            events += self._read(launched, None)
            self._inflight = None
        if launched is None or (self._inflight is None and all(r.finish_reason for r in self.rows)):
            self._last_read = None  # nothing runs until the next round: the wait is not a round's
        self.lockstep.stepped(self)
        return events

    def _launch(self, after_prefill: bool) -> _Inflight:
        rows = self.rows
        members = [Member(r.acceptance, self._fixed_k(r)) for r in rows]
        floor = max([m.fixed for m in members if m.fixed is not None], default=0)
        k = floor
        if any(m.fixed is None for m in members):
            policy = self._policy(any(r.processing.grammar is not None for r in rows))
            k = max(floor, self.lockstep.draft_tokens(self, lambda: policy.choose(len(rows), members)))
        limits = tuple(k if m.fixed is None else m.fixed for m in members)
        processors = Processors.build([r.processing for r in rows], self.target.vocab_size, K_MAX)
        if processors is not None:
            limits = processors.limits(limits)  # forced tokens are drafted, whatever the draft length
        plan = Plan(tuple(r.params for r in rows), limits, processors)
        if self.state.history is not None:  # room for this round's tokens
            needed = int(self.cache.bound.max()) + plan.k + 2
            if needed > self.state.history.shape[1]:
                self.state.history = _widen(self.state.history, needed + 256)
        self.state, out = run_round(self.target, self.proposer, self.cache, self.state, plan, self.lockstep.share,
                                    queue=mx.async_eval)
        mx.async_eval(out.tokens, out.accepted, out.drafted, self.state.tokens, self.state.hidden, self.cache.offset,
                      *[a for a in out.logprobs or () if a is not None])
        return _Inflight(out, list(rows), plan, after_prefill)

    def _policy(self, constrained: bool):
        """The policy of rounds with a grammar row (read serially, led by forced tokens), or of the rest."""
        return self.constrained_policy if constrained else self.policy

    def _fixed_k(self, row: _Row) -> Optional[int]:
        """The drafts that count for `row` whatever the round makes; None: the round's K, which
        the policy chooses (and rows of a fixed length make longer, if they need)."""
        if row.draft is None:
            return 0
        if row.draft != "auto":
            return row.draft
        if self.policy.fixed is not None:
            return self.policy.fixed
        if row.seeded and not row.params.greedy:
            return SEEDED_K  # a measured-timing K would make the output depend on timing
        return None

    def _read(self, inflight: Optional[_Inflight], launched: Optional[_Inflight]) -> list[RowEvent]:
        if inflight is None or all(r.finish_reason for r in inflight.rows):
            return []  # nobody waits for it: don't wait for the device either
        out = inflight.out
        tokens, accepted, drafted = out.tokens.tolist(), out.accepted.tolist(), out.drafted.tolist()
        logprobs = out.logprobs and tuple(None if a is None else a.tolist() for a in out.logprobs)
        now = time.perf_counter()
        seconds = now - self._last_read if self._timed(inflight, launched) else None
        if self._last_read is not None:
            self.stats.decode_seconds += now - self._last_read  # the batch's wall time in rounds
        self._last_read = now
        plan = inflight.plan
        forced = plan.processors.nforced if plan.processors is not None else [0] * len(inflight.rows)
        # Forced drafts are accepted whatever the drafter does: they say nothing of its acceptance.
        drafted_by = [0 if f else d for d, f in zip(drafted, forced)]
        members = [Member(r.acceptance) for r in inflight.rows]
        self._policy(inflight.serial).observe(len(inflight.rows), plan.k, accepted, seconds, drafted_by, members)
        events = []
        for b, (row, toks, n, k) in enumerate(zip(inflight.rows, tokens, accepted, drafted)):
            if row.finish_reason is None:
                top = row.processing.logprobs
                lp = row_logprobs(logprobs, b, n + 1, top) if logprobs and top is not None else None
                events.append(self._deliver(row, toks[: n + 1], n, k, lp, forced[b]))
        self._settle(inflight, launched)
        return events

    def _timed(self, inflight: _Inflight, launched: Optional[_Inflight]) -> bool:
        """Whether the time since the last read is this round's own: a pipelined round's when
        the round queued after it is alike, a serial round's (read as soon as queued) always;
        neither's when a prompt chunk ran in between."""
        if self._last_read is None or inflight.after_prefill or (inflight.plan.processors is not None
                                                                 and any(inflight.plan.processors.nforced)):
            return False  # (forced drafts make a round that drafted without the drafter's cost)
        if inflight.serial:
            return True
        return (launched is not None and not launched.after_prefill and launched.plan.k == inflight.plan.k
                and len(launched.rows) == len(inflight.rows))

    def _settle(self, inflight: _Inflight, launched: Optional[_Inflight]) -> None:
        """Tell the cache the lengths just read, so its host bounds do not drift (they decide
        how many slots attention reads, and what a rollback may still reach)."""
        ahead = launched.plan.k + 1 if launched is not None else 0  # what was queued since
        at = {id(row): i for i, row in enumerate(self.rows)}
        known = [(at[id(r)], r.length) for r in inflight.rows if r.finish_reason is None and id(r) in at]
        if known:
            rows, lengths = zip(*known)
            self.cache.settle(rows, lengths, ahead, reach=K_MAX + 1)

    def _deliver(self, row: _Row, tokens: list, accepted: int, k: int, logprobs: Optional[list] = None,
                 forced: int = 0) -> RowEvent:
        """Hand out a round's tokens, cut after a stop token, at the budget or the context; the
        row's grammar takes them in."""
        room = min(row.max_tokens - len(row.tokens), self.limit - row.fed - len(row.tokens))
        finish = None
        for i, tok in enumerate(tokens):
            if tok in row.stop_ids:
                tokens, finish = tokens[: i + 1], "stop"
                break
        if len(tokens) > room or (finish is None and len(tokens) == room):
            tokens, finish = tokens[:room], "length"
        row.tokens += tokens
        row.finish_reason = finish
        from_draft = [i < accepted for i in range(len(tokens))]
        for stats in (row.stats, self.stats):
            stats.observe_round(k, accepted)
            stats.emitted += len(tokens)
            stats.from_draft += sum(from_draft)
            stats.forced += min(forced, accepted, len(tokens))
        row.stats.decode_seconds = time.perf_counter() - row.began - row.stats.first_token_seconds
        finish = row.finish_reason = finish or self._grammar_ends(row, tokens)
        return RowEvent(row.uid, tokens, from_draft, finish, row.stats, logprobs and logprobs[: len(tokens)])

    @staticmethod
    def _grammar_ends(row: _Row, tokens: list) -> Optional[str]:
        """"dead_end" when the row's grammar allows no token after `tokens`."""
        grammar = row.processing.grammar
        if grammar is None:
            return None
        grammar.advance(tokens)
        return "dead_end" if grammar.dead else None

    # ---- prefill and joining -----------------------------------------------------------------

    def _prefill_chunk(self) -> bool:
        if not self.pending:
            return False
        row = self.pending[0]
        if row.cache is None:
            self._begin_prefill(row)
        last = len(row.prompt) - 1
        if row.fed < last:
            end = self._chunk_end(row)
            self.target(mx.array([row.prompt[row.fed : end]], dtype=mx.int32), row.cache, keep=0)
            self._reached(row, end)
            if end < last:
                mx.async_eval([a for a in row.cache.keys + row.cache.values if a is not None])
                return True
        # The prompt's last token as a step of its own: the forward over the rest skips what
        # only the last position needs (KV-shared layers, the head), and is faster so.
        out = self.target(mx.array([row.prompt[last:]], dtype=mx.int32), row.cache, keep=1)
        self._reached(row, last + 1)
        self.pending.popleft()
        seeds = mx.array([row.seed], dtype=mx.uint32)
        processors = Processors.build([row.processing], self.target.vocab_size, 0)
        prompt = mx.array([row.prompt], dtype=mx.int32)

        def decide():  # where the logits are (under pipeline parallelism, the last rank)
            nonlocal logits
            logits = out.logits[:, -1:]
            if processors is not None:  # at the prompt's last position: no drafts, the prompt as history
                logits = processors(logits, mx.zeros((1, 0), dtype=mx.int32), prompt, mx.array([last]))
            if row.params.greedy:
                return (mx.argmax(logits[:, 0], axis=-1).astype(mx.int32),)
            return (sample(probs(logits[:, 0], row.params), uniform(seeds, row.cache.offset, RESAMPLE)),)

        logits = None
        (first,) = self.lockstep.share(decide, [(1,)])
        if processors is not None:
            row.first_logprobs = processors.logprobs(logits, first[:, None])
        history = None
        if self._keeps_history(row):
            history = mx.concatenate([prompt, first[:, None]], axis=1)
        self._join(row, BatchState(first, out.hidden[:, -1], seeds, history))
        mx.async_eval(first, *[a for a in row.first_logprobs or () if a is not None])
        row.first = first
        self._joined.append(row)
        return True

    def _keeps_history(self, row: _Row) -> bool:
        """Whether the batch keeps token histories with `row` in it: for a proposer that looks
        tokens up, or for penalties."""
        return ((self.proposer is not None and self.proposer.needs_history) or row.processing.penalties.counts
                or (self.state is not None and self.state.history is not None))

    def _begin_prefill(self, row: _Row) -> None:
        row.began = time.perf_counter()
        row.cache = self.target.make_cache(1, max_rollback=MAX_ROLLBACK)
        if self.prefix is not None:
            row.start = row.fed = self.prefix.resume(row.prompt, row.cache)
        row.stats.cached_tokens = row.start  # known from here on

    def _chunk_end(self, row: _Row) -> int:
        """Where the next chunk ends: on a grid of positions, so that a prompt resumed at a state
        an earlier prompt left on that grid is cut as it would be whole, or at a state to leave,
        and before the prompt's last token."""
        grid = (row.fed // self.prefill_chunk + 1) * self.prefill_chunk
        return min(grid, len(row.prompt) - 1, *(m for m in row.marks if m > row.fed))

    def _reached(self, row: _Row, fed: int) -> None:
        """The cache now holds `fed` prompt tokens: leave the state there if it is marked."""
        self.stats.prompt_tokens += fed - row.fed  # as it is done, so cancelled prefills count too
        row.fed = fed
        if self.prefix is not None and fed in row.marks:
            row.pinned.append(self.prefix.store(row.prompt[:fed], row.cache, pin=row.owner))
            if row.pinned[-1] is not None:
                row.stats.stored_tokens = fed - row.start

    def _join(self, row: _Row, state: BatchState) -> None:
        if self.cache is None:
            self.cache, self.state, self.rows = row.cache, state, [row]
        else:
            self.cache.extend(row.cache)
            self.rows.append(row)
            s = self.state
            history = None
            if state.history is not None:  # (the joining row has one whenever the batch has)
                mine = s.history if s.history is not None else mx.full((len(self.rows) - 1, 1), -1, dtype=mx.int32)
                width = max(mine.shape[1], state.history.shape[1])
                history = mx.concatenate([_widen(mine, width), _widen(state.history, width)])
            self.state = BatchState(mx.concatenate([s.tokens, state.tokens]),
                                    mx.concatenate([s.hidden, state.hidden.astype(s.hidden.dtype)]),
                                    mx.concatenate([s.seeds, state.seeds]), history)
        row.cache = None

    def _read_first(self) -> list[RowEvent]:
        events = []
        for row in self._joined:
            first = int(row.first.item())
            top = row.processing.logprobs
            lp = row.first_logprobs
            lp = row_logprobs(tuple(None if a is None else a.tolist() for a in lp), 0, 1, top) if top is not None else None
            row.stats.prompt_tokens, row.stats.cached_tokens = row.fed - row.start, row.start
            self.stats.cached_tokens += row.start
            row.stats.prompt_seconds = row.stats.first_token_seconds = time.perf_counter() - row.began
            self.stats.prompt_seconds += row.stats.prompt_seconds
            if row.finish_reason is None:
                events.append(self._deliver_first(row, first, lp))
        self._joined = []
        return events

    def _deliver_first(self, row: _Row, token: int, logprobs: Optional[list]) -> RowEvent:
        grammar = row.processing.grammar
        if grammar is not None and grammar.dead:  # it allows no first token
            row.finish_reason = "dead_end"
            return RowEvent(row.uid, [], [], "dead_end", row.stats)
        row.tokens.append(token)
        row.stats.emitted += 1
        self.stats.emitted += 1
        if token in row.stop_ids:
            row.finish_reason = "stop"
        elif row.max_tokens <= 1 or row.fed + 1 >= self.limit:
            row.finish_reason = "length"
        else:
            row.finish_reason = self._grammar_ends(row, [token])
        return RowEvent(row.uid, [token], [False], row.finish_reason, row.stats, logprobs)

    # ---- leaving -----------------------------------------------------------------------------

    def _retire(self) -> None:
        """Take finished rows out of the batch (their results still in flight are ignored)."""
        if not any(r.finish_reason for r in self.rows):
            return
        keep = [i for i, r in enumerate(self.rows) if r.finish_reason is None]
        for i, row in enumerate(self.rows):
            if row.finish_reason is not None and self.prefix is not None:
                self._leave(row, self.cache.take(i))
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.state = None
            return
        self.cache.select(keep)
        index = mx.array(keep, dtype=mx.int32)
        s = self.state
        needed = (self.proposer is not None and self.proposer.needs_history) or any(
            r.processing.penalties.counts for r in self.rows)
        self.state = BatchState(s.tokens[index], s.hidden[index], s.seeds[index],
                                s.history[index] if s.history is not None and needed else None)

    def _leave(self, row: _Row, cache: KVCache) -> None:
        """Leave the state the row reached in the prefix cache (for its owner: in place of the
        ones its earlier rows left)."""
        cache.truncate([row.length])  # undo what was queued past the tokens handed out
        row.pinned.append(self.prefix.store((row.prompt + row.tokens)[: row.length], cache, pin=row.owner))
        if row.owner is not None:
            self.prefix.release(row.owner, keep=row.pinned)


def _widen(history: mx.array, width: int) -> mx.array:
    """Token history padded with -1 (unknown) to `width` positions."""
    extra = width - history.shape[1]
    if extra <= 0:
        return history
    return mx.concatenate([history, mx.full((history.shape[0], extra), -1, dtype=mx.int32)], axis=1)


def _seed(seed: int) -> int:
    if int(seed) != seed:
        raise ValueError(f"seed must be an int, got {seed!r}")
    return int(seed) % 2**32
