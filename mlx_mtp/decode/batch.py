"""The one generation driver: continuous batching of speculative rounds.

Rows join and leave between rounds. A row is inserted with its prompt; its prompt is prefilled
in chunks between the batch's rounds, the chunks of several queued prompts in one forward of at
most `prefill_tokens` tokens per `step()`, so streaming rows stall for about one chunk
(`prefill.py`); then it joins the batch. With a prefix cache, a prompt starts from the deepest
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
import logging
import time
from typing import Callable, Hashable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..cache.kv import KVCache
from .drafters import as_proposer
from .lockstep import ALONE, Lockstep
from ..models.base import TargetModel
from .prefill import Prefill, first_events, join, widen
from ..cache.prefix import PrefixCache
from .processors import MAX_LOGPROBS, NONE, Penalties, Processors, RowProcessing, row_logprobs
from .row import Row, RowEvent
from .sample import SamplingParams
from .speculative import (K_MAX, BatchState, Member, Plan, RoundOutput, check_draft_tokens, policy_for,
                          run_round)
from .stats import Stats
from ..runtime.threads import mark_mlx_thread

SEEDED_K = 3  # draft length of a seeded, sampled row under "auto" (see `insert`)
BAN = -1e9  # the logit bias that bans a token (processors apply it to the drafts and the verify alike)
log = logging.getLogger("mlx_mtp")


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


def _check_prompt(prompt, vocab_size: int) -> list:
    """A prompt as a list of token ids, checked: not empty, flat, within the vocabulary."""
    ids = list(prompt)
    if not ids:
        raise ValueError("empty prompt: nothing to condition on")
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError("a prompt is a flat list of integer token ids")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (0..{vocab_size - 1})")
    return [int(t) for t in ids]


def _processing(penalties: Penalties, grammar, logprobs: Optional[int], start: int, vocab_size: int,
                pipelined: bool) -> RowProcessing:
    """A row's logits processing, its arguments checked (none runs under pipeline parallelism)."""
    if logprobs is not None and (isinstance(logprobs, bool) or int(logprobs) != logprobs
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be an int in 0..{MAX_LOGPROBS}, got {logprobs!r}")
    if any(t >= vocab_size for t, _ in penalties.logit_bias):
        raise ValueError(f"logit_bias names a token outside the vocabulary (0..{vocab_size - 1})")
    processing = RowProcessing(penalties, grammar, logprobs, start)
    if processing.active and pipelined:
        raise ValueError("grammars, penalties, logit bias and logprobs are not supported under pipeline parallelism")
    return processing


def _suppressed(target: TargetModel, pipelined: bool) -> tuple:
    """(token, BAN) for each token the model never generates (its generation config's `suppress_tokens`,
    which the loader puts in its config: the 12B's image and audio end markers). Banned here, in every
    row's logit bias, so that every front end's rows (`generate`, the `Engine`, direct callers) honour them,
    drafts included. Under pipeline parallelism no logit processing runs: they are not applied."""
    tokens = sorted({int(t) for t in getattr(target.config, "suppress_tokens", ()) if 0 <= t < target.vocab_size})
    if tokens and pipelined:
        log.warning("suppress_tokens %s are not applied under pipeline parallelism", tokens)
        return ()
    return tuple((t, BAN) for t in tokens)


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


class DraftLengths:
    """Each round's draft length per row, and what each round read back teaches the draft policy
    that chose it: the drafts it accepted and, where the wall time since the previous read is the
    round's own, that time."""

    def __init__(self):
        self.last_read: Optional[float] = None  # when a round was last read; None: none runs since

    def limits(self, rows: Sequence[Row], policy, fixed: Optional[int], decide: Callable) -> tuple[int, ...]:
        """Each row's draft length: its own where it is fixed, else the round's K, which `policy`
        chooses (`decide(choose)`: one choice for every rank), at least the longest fixed one.
        `fixed`: the batch's fixed draft length (None: "auto")."""
        members = [Member(r.acceptance, self._fixed(r, fixed)) for r in rows]
        floor = max([m.fixed for m in members if m.fixed is not None], default=0)
        k = floor
        if any(m.fixed is None for m in members):
            k = max(floor, decide(lambda: policy.choose(len(rows), members)))
        return tuple(k if m.fixed is None else m.fixed for m in members)

    @staticmethod
    def _fixed(row: Row, fixed: Optional[int]) -> Optional[int]:
        """The drafts that count for `row` whatever the round makes; None: the round's K, which
        the policy chooses (and rows of a fixed length make longer, if they need)."""
        if row.draft is None:
            return 0
        if row.draft != "auto":
            return row.draft
        if fixed is not None:
            return fixed
        if row.seeded and not row.params.greedy:
            return SEEDED_K  # a measured-timing K would make the output depend on timing
        return None

    def learn(self, inflight: _Inflight, launched: Optional[_Inflight], policy, accepted: list, drafted: list,
              forced: list, stats: Stats) -> None:
        """Teach `policy` what `inflight`, just read, did (`launched`: the round queued after it);
        add the wall time since the last read to the batch's `stats`."""
        now = time.perf_counter()
        seconds = now - self.last_read if self._own_time(inflight, launched) else None
        if self.last_read is not None:
            stats.decode_seconds += now - self.last_read  # the batch's wall time in rounds
        self.last_read = now
        # Forced drafts are accepted whatever the drafter does: they say nothing of its acceptance.
        drafted_by = [0 if f else d for d, f in zip(drafted, forced)]
        members = [Member(r.acceptance) for r in inflight.rows]
        policy.observe(len(inflight.rows), inflight.plan.k, accepted, seconds, drafted_by, members)

    def idle(self) -> None:
        """Nothing runs until the next round: the wait until then is not a round's."""
        self.last_read = None

    def _own_time(self, inflight: _Inflight, launched: Optional[_Inflight]) -> bool:
        """Whether the time since the last read is this round's own: a pipelined round's when
        the round queued after it is alike, a serial round's (read as soon as queued) always;
        neither's when a prompt chunk ran in between."""
        if self.last_read is None or inflight.after_prefill or (inflight.plan.processors is not None
                                                                and any(inflight.plan.processors.nforced)):
            return False  # (forced drafts make a round that drafted without the drafter's cost)
        if inflight.serial:
            return True
        return (launched is not None and not launched.after_prefill and launched.plan.k == inflight.plan.k
                and len(launched.rows) == len(inflight.rows))


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
        prefill_chunk: the grid prompts are cut on: a prompt chunk ends at a multiple of it.
        prefix_cache: where prompts resume from, and rows leave their states (None: nowhere).
        prefill_tokens: prompt tokens a `step()` prefills over all queued rows, in one forward
            (default: prefill_chunk); 1 prefills one row at a time.
    """

    def __init__(self, target: TargetModel, drafter=None, draft_tokens: Union[int, str] = "auto",
                 prefill_chunk: int = 512, prefix_cache: Optional[PrefixCache] = None,
                 prefill_tokens: Optional[int] = None):
        self.target = target
        self.proposer = as_proposer(drafter, target)
        self.policy = policy_for(drafter, draft_tokens)
        self.constrained_policy = policy_for(drafter, draft_tokens, constrained=True)  # rounds with a grammar
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix_cache
        self.limit = target.config.max_position_embeddings
        self.stats = Stats()  # every row together
        self.pending: collections.deque[Row] = collections.deque()
        self.rows: list[Row] = []  # in the batch, in cache order
        self.cache: Optional[KVCache] = None
        self.state: Optional[BatchState] = None
        self._inflight: Optional[_Inflight] = None
        self._cancelled: list[Row] = []
        self._uids = 0
        self.lengths = DraftLengths()
        self.lockstep: Lockstep = getattr(target, "pipeline", None) or ALONE  # ranks of a pipeline group
        self.suppress = _suppressed(target, pipelined=self.lockstep is not ALONE)
        self.prefill_tokens = prefill_tokens or prefill_chunk
        self.prefill = Prefill(target, prefill_chunk, self.prefill_tokens, prefix_cache, self.lockstep.share,
                               self.stats)
        self.lockstep.made(self)

    @property
    def busy(self) -> bool:
        """True while any row still has work (or a cancel to report)."""
        return bool(self.pending or self.rows or self._cancelled)

    @property
    def active(self) -> int:
        return len(self.rows) + len(self.pending)

    # ---- rows in -------------------------------------------------------------------------

    def insert(self, prompt: Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
               seed: Optional[int] = None, stop_ids: Sequence[int] = (), mtp: bool = True,
               draft_tokens: Union[int, str] = "auto", boundaries: Sequence[int] = (),
               owner: Optional[Hashable] = None, stats: Optional[Stats] = None, penalties: Penalties = NONE,
               grammar=None, logprobs: Optional[int] = None, images=None) -> int:
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
            images: the prompt's images (`gemma4_vision.PromptImages`), their soft tokens placed at
                their placeholders; the prefix cache keys them by their content.

        Raises:
            ValueError: bad arguments or token ids; ContextLengthError: it does not fit.
        """
        ids = _check_prompt(prompt, self.target.vocab_size)
        if int(max_tokens) != max_tokens or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        draft = draft_tokens if draft_tokens == "auto" else check_draft_tokens(draft_tokens)
        check_fits(len(ids), self.limit)
        uid = self._uids
        value = _seed(seed) if seed is not None else self.lockstep.seed(self, uid)
        marks = frozenset(b for b in boundaries if 0 < b < len(ids)) | {len(ids) - 1, len(ids)}
        row = Row(uid, ids, int(max_tokens), sampling, value, seed is not None, frozenset(stop_ids),
                   draft if mtp and self.proposer is not None else None, marks - {0}, owner)
        row.stats = stats if stats is not None else row.stats
        row.images = images
        if self.suppress:
            penalties = dataclasses.replace(penalties, logit_bias=(*penalties.logit_bias, *self.suppress))
        row.processing = _processing(penalties, grammar, logprobs, len(ids), self.target.vocab_size,
                                     pipelined=self.lockstep is not ALONE)
        self.lockstep.inserting(self, row)
        self._uids += 1
        self.pending.append(row)
        return uid

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
            self.prefill.keep(row)

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

    def _find(self, uid: int) -> Optional[Row]:
        for row in [*self.pending, *self.rows]:
            if row.uid == uid:
                return row
        return None

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RowEvent]:
        """Retire finished rows, prefill (a chunk's worth of queued prompts), queue the next round,
        and return new rows' first tokens and the tokens of the round queued by the previous call."""
        mark_mlx_thread()
        self.lockstep.called(self, "step")
        events = [RowEvent(r.uid, [], [], r.finish_reason, r.stats) for r in self._cancelled]
        self._cancelled = []
        self._retire()
        prefilled, joined = self.prefill.step(self.pending, self._keeps_history)
        if joined:
            self.cache, self.state = join(self.cache, self.state, joined)
            self.rows += [row for row, _ in joined]
        first = first_events([row for row, _ in joined], self.stats, self.limit)
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
            self.lengths.idle()  # nothing runs until the next round
        self.lockstep.stepped(self)
        return events

    def _launch(self, after_prefill: bool) -> _Inflight:
        rows = self.rows
        policy = self._policy(any(r.processing.grammar is not None for r in rows))
        limits = self.lengths.limits(rows, policy, self.policy.fixed,
                                     lambda choose: self.lockstep.draft_tokens(self, choose))
        processors = Processors.build([r.processing for r in rows], self.target.vocab_size, K_MAX)
        if processors is not None:
            limits = processors.limits(limits)  # forced tokens are drafted, whatever the draft length
        plan = Plan(tuple(r.params for r in rows), limits, processors)
        if self.state.history is not None:  # room for this round's tokens
            needed = int(self.cache.bound.max()) + plan.k + 2
            if needed > self.state.history.shape[1]:
                self.state.history = widen(self.state.history, needed + 256)
        self.state, out = run_round(self.target, self.proposer, self.cache, self.state, plan, self.lockstep.share,
                                    queue=mx.async_eval)
        mx.async_eval(out.tokens, out.accepted, out.drafted, self.state.tokens, self.state.hidden, self.cache.offset,
                      *[a for a in out.logprobs or () if a is not None])
        return _Inflight(out, list(rows), plan, after_prefill)

    def _policy(self, constrained: bool):
        """The policy of rounds with a grammar row (read serially, led by forced tokens), or of the rest."""
        return self.constrained_policy if constrained else self.policy

    def _read(self, inflight: Optional[_Inflight], launched: Optional[_Inflight]) -> list[RowEvent]:
        if inflight is None or all(r.finish_reason for r in inflight.rows):
            return []  # nobody waits for it: don't wait for the device either
        out = inflight.out
        tokens, accepted, drafted = out.tokens.tolist(), out.accepted.tolist(), out.drafted.tolist()
        logprobs = out.logprobs and tuple(None if a is None else a.tolist() for a in out.logprobs)
        plan = inflight.plan
        forced = plan.processors.nforced if plan.processors is not None else [0] * len(inflight.rows)
        self.lengths.learn(inflight, launched, self._policy(inflight.serial), accepted, drafted, forced, self.stats)
        events = []
        for b, (row, toks, n, k) in enumerate(zip(inflight.rows, tokens, accepted, drafted)):
            if row.finish_reason is None:
                top = row.processing.logprobs
                lp = row_logprobs(logprobs, b, n + 1, top) if logprobs and top is not None else None
                events.append(_deliver(row, toks[: n + 1], n, k, self.limit, self.stats, lp, forced[b]))
        self._settle(inflight, launched)
        return events

    def _settle(self, inflight: _Inflight, launched: Optional[_Inflight]) -> None:
        """Tell the cache the lengths just read, so its host bounds do not drift (they decide
        how many slots attention reads, and what a rollback may still reach)."""
        ahead = launched.plan.k + 1 if launched is not None else 0  # what was queued since
        at = {id(row): i for i, row in enumerate(self.rows)}
        known = [(at[id(r)], r.length) for r in inflight.rows if r.finish_reason is None and id(r) in at]
        if known:
            rows, lengths = zip(*known)
            self.cache.settle(rows, lengths, ahead, reach=K_MAX + 1)

    def _keeps_history(self, joining: Sequence[Row]) -> bool:
        """Whether the batch keeps token histories once `joining` join it: for a proposer that
        looks tokens up, or for penalties."""
        return ((self.proposer is not None and self.proposer.needs_history)
                or any(row.processing.penalties.counts for row in joining)
                or (self.state is not None and self.state.history is not None))

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

    def _leave(self, row: Row, cache: KVCache) -> None:
        """Leave the state the row reached in the prefix cache (for its owner: in place of the
        ones its earlier rows left)."""
        cache.truncate([row.length])  # undo what was queued past the tokens handed out
        row.pinned.append(self.prefix.store((row.key + row.tokens)[: row.length], cache, pin=row.owner))
        if row.owner is not None:
            self.prefix.release(row.owner, keep=row.pinned)


def _deliver(row: Row, tokens: list, accepted: int, k: int, limit: int, stats: Stats,
             logprobs: Optional[list] = None, forced: int = 0) -> RowEvent:
    """Hand out a round's tokens of `row`, cut after a stop token, at the budget or the context
    (`limit`); the row's grammar takes them in, the row's and the batch's `stats` count them."""
    room = min(row.max_tokens - len(row.tokens), limit - row.fed - len(row.tokens))
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
    for counts in (row.stats, stats):
        counts.observe_round(k, accepted)
        counts.emitted += len(tokens)
        counts.from_draft += sum(from_draft)
        counts.forced += min(forced, accepted, len(tokens))
    row.stats.decode_seconds = time.perf_counter() - row.began - row.stats.first_token_seconds
    finish = row.finish_reason = finish or row.grammar_ends(tokens)
    return RowEvent(row.uid, tokens, from_draft, finish, row.stats, logprobs and logprobs[: len(tokens)])


def _seed(seed: int) -> int:
    if int(seed) != seed:
        raise ValueError(f"seed must be an int, got {seed!r}")
    return int(seed) % 2**32
