"""One speculative round as named phases: draft -> verify -> accept -> advance.

Works on B rows at once (B = 1 for a single sequence) and reads nothing back to the host: the
accepted counts, next tokens, hidden states and cache lengths stay on the device, so the driver
builds and queues round n+1 before it reads round n's tokens. A round whose rows all draft
nothing is a plain decoding step; rows may count fewer drafts than the round makes (`limits`),
which is how rows with MTP off, or with a smaller draft length, share one verify forward.
The cache holds every token of a row but the last one emitted. Logits processors (grammars,
penalties, bias: `Plan.processors`) process the logits at every verified position, and the
drafts lead with the tokens a grammar forces.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence, Union, runtime_checkable

import mlx.core as mx
import numpy as np

from ..cache.kv import KVCache
from ..runtime.jit import Bounded, small
from ..models.base import TargetModel, TargetOutput
from .sample import (ACCEPT, RESAMPLE, SamplingParams, batch_probs, greedy_accept, indices, params_key,
                     rejection_accept, uniform)

K_MAX = 6  # the longest draft; one verify forward covers K_MAX + 1 tokens per row
# Rollback a cache must allow: a round's rejected drafts are undone on the device, and when a
# row leaves, the round queued after the one it finished in is undone as well.
MAX_ROLLBACK = 2 * (K_MAX + 1)


@dataclasses.dataclass
class BatchState:
    """What carries over between rounds, per row, on the device."""

    tokens: mx.array  # (B,) last emitted token, not yet in the cache (it sits at cache.offset)
    hidden: mx.array  # (B, H) target hidden state that predicted `tokens`
    seeds: mx.array  # (B,) uint32 random seed of each row
    history: Optional[mx.array] = None  # (B, T) the token at each position, -1 unknown (n-gram lookup)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The host's choices for one round, per row."""

    params: tuple  # SamplingParams of each row
    limits: tuple  # drafts that count for each row (0: a plain step for that row)
    processors: Optional[Any] = None  # the rows' logits processors (`processors.Processors`), if any

    @property
    def k(self) -> int:
        return max(self.limits, default=0)

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self.params)


@dataclasses.dataclass
class Drafts:
    tokens: mx.array  # (B, K) int32
    q: Optional[mx.array] = None  # (B, K, V) drafter distributions; None: greedy, or deterministic drafts
    limit: Optional[mx.array] = None  # (B,) drafts the proposer really made (None: all K)


@dataclasses.dataclass
class RoundOutput:
    """A round's result, still on the device when the next round is built."""

    tokens: mx.array  # (B, K+1) accepted drafts, then the target's token, then -1
    accepted: mx.array  # (B,) drafts accepted
    drafted: mx.array  # (B,) drafts that counted
    logprobs: Optional[tuple] = None  # of the emitted tokens, when a row asked (`Processors.logprobs`)


@runtime_checkable
class Proposer(Protocol):
    """Something that drafts: an MTP drafter, an n-gram lookup, an oracle for tests."""

    needs_history: bool  # reads `BatchState.history`

    def propose(self, state: BatchState, cache: KVCache, k: int, plan: Plan) -> Drafts: ...


def draft(proposer: Optional[Proposer], state: BatchState, cache: KVCache, plan: Plan) -> Drafts:
    B = state.tokens.shape[0]
    if plan.k == 0:
        return Drafts(mx.zeros((B, 0), dtype=mx.int32))
    steps = plan.k if plan.processors is None else plan.processors.drafter_steps()
    if proposer is None or steps == 0:  # nothing drafts but a grammar's forced tokens
        drafts = Drafts(mx.zeros((B, plan.k), dtype=mx.int32), None, mx.zeros((B,), dtype=mx.int32))
    else:
        drafts = pad(proposer.propose(state, cache, steps, plan), plan.k)
    return drafts if plan.processors is None else plan.processors.force(drafts)


def pad(drafts: Drafts, k: int) -> Drafts:
    """Drafts made up to k (forced tokens take the positions past what the proposer drafted)."""
    B, made = drafts.tokens.shape
    if made == k:
        return drafts
    tokens = mx.concatenate([drafts.tokens, mx.zeros((B, k - made), dtype=mx.int32)], axis=1)
    q = drafts.q if drafts.q is None else mx.pad(drafts.q, [(0, 0), (0, k - made), (0, 0)])
    limit = mx.full((B,), made, dtype=mx.int32) if drafts.limit is None else mx.minimum(drafts.limit, made)
    return Drafts(tokens, q, limit)


def verify(target: TargetModel, cache: KVCache, state: BatchState, drafts: Drafts) -> TargetOutput:
    """One target forward over [last token, d_1..d_K] for every row."""
    inputs = state.tokens[:, None].astype(mx.int32)
    if drafts.tokens.shape[1]:  # (a plain step's forward takes the token alone: no concatenation node)
        inputs = mx.concatenate([inputs, drafts.tokens], axis=1)
    return target(inputs, cache)


def counted(drafts: Drafts, plan: Plan) -> mx.array:
    """(B,) drafts that count per row: the row's limit, or fewer if the proposer made fewer."""
    limit = mx.array(plan.limits, dtype=mx.int32)
    return limit if drafts.limit is None else mx.minimum(limit, drafts.limit)


def accept(drafts: Drafts, out: TargetOutput, plan: Plan, limit: mx.array, seeds: mx.array, base: mx.array):
    """(accepted drafts, next token) per row: greedy prefix match, or exact rejection sampling
    against the drafter's q. `base` (B,) is the position of each row's last token. A compiled
    function of the target's logits (B, K+1, V), so that what changes logits before the
    decision can come in between."""
    if plan.greedy:
        return _greedy(drafts.tokens, out.logits, limit if drafts.tokens.shape[1] else None)
    return _sampled(drafts.tokens, drafts.q, out.logits, limit, seeds, base, params_key(plan.params))


@small
def _greedy(drafts: mx.array, logits: mx.array, limit: Optional[mx.array]):
    return greedy_accept(drafts, mx.argmax(logits, axis=-1), limit)


@Bounded
def _sampled(drafts: mx.array, q: Optional[mx.array], logits: mx.array, limit: mx.array, seeds: mx.array,
             base: mx.array, key: tuple):
    p = batch_probs(logits, [SamplingParams(*row) for row in key])
    if q is None:  # a deterministic proposal: q is one-hot on it
        q = (mx.arange(p.shape[-1])[None, None] == drafts[..., None]).astype(mx.float32)
    k = drafts.shape[1]
    positions = base[:, None] + 1 + mx.arange(k + 1, dtype=mx.int32)[None]  # of d_1 .. d_K, bonus
    return rejection_accept(drafts, q, p, uniform(seeds, positions[:, :k], ACCEPT),
                            uniform(seeds, positions, RESAMPLE), limit)


def advance(cache: KVCache, out: TargetOutput, drafts: Drafts, n: mx.array, nxt: mx.array, limit: mx.array,
            base: mx.array, state: BatchState) -> tuple[BatchState, RoundOutput]:
    """Roll every row back to its accepted prefix and carry the next token on."""
    B, k = drafts.tokens.shape
    j = mx.arange(k + 1, dtype=mx.int32)[None]
    if k:
        emitted, hidden, kept = _emitted(drafts.tokens, n, nxt, out.hidden, base)
        cache.rollback_to(kept)  # keeps the row's last token and its n accepted drafts
    else:  # a plain step: nothing to roll back or pick
        emitted, hidden = nxt[:, None], out.hidden[:, 0]
    history = state.history
    if history is not None:  # positions past the new token get -1 (or are rewritten later)
        history = mx.put_along_axis(history, base[:, None] + 1 + j, emitted, axis=1)
    return BatchState(nxt, hidden, state.seeds, history), RoundOutput(emitted, n, limit)


@small  # one kernel for the bookkeeping, not a node per small op
def _emitted(drafts: mx.array, n: mx.array, nxt: mx.array, hidden: mx.array, base: mx.array) -> tuple:
    """(B, K+1) the accepted drafts, the next token, then -1; the hidden state that predicted it; and
    the (B,) int32 length the cache keeps (through the last accepted draft, from `base`)."""
    B, k = drafts.shape
    j, m = indices(k + 1), n[:, None]  # (one view of n, read twice)
    padded = mx.concatenate([drafts, mx.zeros((B, 1), dtype=mx.int32)], axis=1)
    emitted = mx.where(j < m, padded, mx.where(j == m, nxt[:, None], -1))
    return emitted, mx.take_along_axis(hidden, m[..., None], axis=1)[:, 0], (base + n + 1).astype(mx.int32)


def here(decide: Callable[[], tuple], shapes: Sequence[tuple]) -> tuple:
    """Where a decision is made and who gets it, in one process: here, for everyone. (Under
    pipeline parallelism the rank holding the logits decides and tells the others.)"""
    return decide()


def run_round(target: TargetModel, proposer: Optional[Proposer], cache: KVCache, state: BatchState,
              plan: Plan, share: Callable = here, queue: Optional[Callable] = None) -> tuple[BatchState, RoundOutput]:
    """draft -> verify -> accept -> advance, for every row of the cache; nothing is read back.

    `queue` (e.g. `mx.async_eval`) receives the drafts as soon as they are built, so the device
    starts drafting while the host builds the verify.
    """
    base = cache.offset
    drafts = draft(proposer, state, cache, plan)
    if queue is not None and plan.k:
        queue(drafts.tokens)
    out = verify(target, cache, state, drafts)
    processors = plan.processors

    def decide():
        nonlocal out
        limit = counted(drafts, plan)
        if processors is not None:
            out = out._replace(logits=processors(out.logits, drafts.tokens, state.history, base))
            limit = processors.counted(limit)
        return (drafts.tokens, *accept(drafts, out, plan, limit, state.seeds, base), limit)

    B, k = drafts.tokens.shape
    tokens, n, nxt, limit = share(decide, [(B, k), (B,), (B,), (B,)])
    state, result = advance(cache, out, dataclasses.replace(drafts, tokens=tokens), n, nxt, limit, base, state)
    if processors is not None:
        result.logprobs = processors.logprobs(out.logits, result.tokens)
    return state, result


class Acceptance:
    """Drafts accepted per draft position: a drafter's, over every row it drafted for, or one
    row's (one request's text: prose and code are drafted for very differently)."""

    FORGET = 200  # past this many rounds a position's old rounds fade: acceptance drifts with the text

    def __init__(self):
        self.hits, self.seen = np.zeros(K_MAX), np.zeros(K_MAX)

    def observe(self, k: int, n: int) -> None:
        """A round in which `k` drafts counted and the first `n` were accepted."""
        for i in range(min(n + 1, k)):  # position i was tried only if the ones before it were accepted
            if self.seen[i] >= self.FORGET:
                self.hits[i], self.seen[i] = self.hits[i] * 0.99, self.seen[i] * 0.99
            self.hits[i] += i < n
            self.seen[i] += 1

    def estimate(self, prior: np.ndarray, weight: float) -> np.ndarray:
        """P(draft i accepted | the ones before were), `prior` counting as `weight` rounds."""
        return (self.hits + weight * prior) / (self.seen + weight)


class Member(NamedTuple):
    """One row of a round, as the policy sees it."""

    acceptance: Acceptance  # the row's own
    fixed: Optional[int] = None  # drafts that count for it whatever the round makes (0: MTP off); None: all


class DraftPolicy:
    """How many tokens to draft next round: the one policy for every batch size.

    Fixed, or "auto": the K in 0..k_max with the most expected tokens per second. A round with K
    drafts is expected to give sum over rows of (1 + sum_{j<K_b} prod_{i<=j} a_bi) tokens (a_bi:
    row b's acceptance of draft i given the ones before it: its own rounds, with the drafter's
    estimate over all rows as the prior, so a hard prompt among easy ones is expected to be hard;
    K_b: K, or the row's fixed draft length). The verify forward is (rows, K + 1) whatever each
    row counts, so its cost follows K alone while a row's expected tokens only grow with the drafts
    it counts: each row's estimate weighs in the choice of K, and every auto row then counts all K
    (a shorter K_b would only lose tokens). Its cost is measured per (rows, K), and for
    a K not measured at this batch size read off a line fitted through the drafted rounds that
    were (through the plain steps too while only one draft length is measured), or, with only
    plain steps measured there, scaled from the nearest batch size that has drafted rounds. The
    first rounds at a batch size measure K = 0 (pipelined plain decoding) and, unless such a
    neighbour exists, K = K_START; after that the best K runs, and every `probe_every` rounds a
    neighbour of it is measured again, so estimates follow the machine. While plain steps win, a
    probe of K_START checks whether drafts started being accepted and measures its cost again,
    ever more rarely (drafting that does not pay costs).
    """

    K_START = 1  # the cheapest drafted round; longer ones are estimated from it, then tried
    PROBE = 3  # rounds a probe lasts: a round's time is only known between two alike rounds
    MARGIN = 1.03  # drafting must promise this much more than plain steps: noise is not a gain
    WINDOW = 16  # round times kept per (rows, K); their median is the cost
    MAX_PAUSE = 512  # rounds between probes while plain steps keep winning
    REDECIDE = 8  # rounds a decision stands before the estimates are read again
    PRIOR = 4.0  # weight, in rounds, of a draft position's prior acceptance
    ROW_PRIOR = 8.0  # weight, in rounds, of the drafter's estimate in a row's

    def __init__(self, k: Union[int, str] = "auto", k_max: int = K_MAX, probe_every: int = 16):
        self.fixed = None if k == "auto" else check_draft_tokens(k)
        self.k_max = k_max if self.fixed is None else self.fixed
        self.wide = Acceptance()  # every row's rounds
        self.times: dict[tuple[int, int], collections.deque] = {}  # (rows, K) -> recent seconds
        self.probe_every = probe_every
        self.waited: dict[int, int] = {}  # rows -> rounds since the last probe
        self.pause: dict[int, int] = {}  # rows -> rounds between probes
        self.probing: list[int] = []  # the draft lengths of a probe still to run
        self.up = False  # probes alternate between the best K's neighbours
        self.decided: dict[int, tuple[int, int, tuple]] = {}  # rows -> (best K, rounds it has stood, members)
        self.lock = threading.Lock()  # one drafter's policy may serve generators on several threads

    @property
    def accept(self) -> np.ndarray:
        """P(draft i accepted | the ones before were). Each position's prior (PRIOR rounds' worth)
        lies halfway between a coin toss and the estimate of the position before it: a draft
        length never run yet looks better after well-accepted drafts than after poor ones, but
        not as good (acceptance usually falls with depth)."""
        out, before = np.empty(K_MAX), 0.5
        for i in range(K_MAX):
            prior = (0.5 + before) / 2
            out[i] = before = (self.wide.hits[i] + self.PRIOR * prior) / (self.wide.seen[i] + self.PRIOR)
        return out

    @property
    def cost(self) -> dict[tuple[int, int], float]:
        """(rows, K) -> measured seconds per round."""
        return {key: float(np.median(t)) for key, t in self.times.items()}

    def choose(self, rows: int, members: Sequence[Member] = ()) -> int:
        """The round's K for `rows` rows (`members`: each row's acceptance and fixed draft length;
        none given: rows drafting K, at the drafter's acceptance). Rows with a fixed length make
        the round at least that long, whatever this returns."""
        if self.fixed is not None:
            return self.fixed
        with self.lock:
            return self._choose(rows, tuple(members))

    def _choose(self, rows: int, members: tuple) -> int:
        start = min(self.K_START, self.k_max)
        # Measure plain steps and one draft length first; a new batch size whose drafted rounds
        # can be estimated from another batch size measures only its plain steps.
        if len(self.times.get((rows, 0), ())) < 3:
            return 0
        if len(self.times.get((rows, start), ())) < 3 and self._similar(rows) is None:
            return start
        if self.probing:
            return self.probing.pop()
        best = self._best(rows, members)
        self.waited[rows] = self.waited.get(rows, 0) + 1
        pause = self.pause.get(rows, self.probe_every)
        if self.waited[rows] < pause:
            return best
        self.waited[rows] = 0
        self.decided.pop(rows, None)  # decide afresh once the probe is measured
        if best == 0:  # a probe long enough to be timed: a cost measured once (a busy moment) is not kept for good
            self.pause[rows] = min(2 * pause, self.MAX_PAUSE)
            self.probing = [start] * (self.PROBE - 1)
            return start
        self.pause[rows], self.up = self.probe_every, not self.up
        neighbour = min(self.k_max, best + 1) if self.up else best - 1
        self.probing = [neighbour] * (self.PROBE - 1)
        return neighbour

    def _best(self, rows: int, members: tuple = ()) -> int:
        """The best K at `rows`, recomputed every REDECIDE rounds (the estimate costs host time
        that a small model's round cannot hide) or when the rows change."""
        best, age, known = self.decided.get(rows, (0, self.REDECIDE, ()))
        if age >= self.REDECIDE or known != members:
            cost, age = self.cost, 0
            best = self._best_drafted(rows, cost, members)
            if self.rate(rows, best, cost, members) < self.MARGIN * self.rate(rows, 0, cost, members):
                best = 0
        self.decided[rows] = (best, age + 1, members)
        return best

    def speeds(self, rows: int = 1) -> Optional[tuple[float, int, float]]:
        """(plain steps' tokens per second, the best draft length, its expected tokens per second) at
        `rows` rows, as measured so far; None until plain steps and a drafted round are timed there."""
        with self.lock:
            cost = self.cost
            if (rows, 0) not in cost or not any(r == rows and k > 0 for r, k in cost):
                return None
            best = self._best_drafted(rows, cost)
            return self.rate(rows, 0, cost), best, self.rate(rows, best, cost)

    def _best_drafted(self, rows: int, cost: dict, members: Sequence[Member] = ()) -> int:
        """The draft length in 1..k_max with the most expected tokens per second (0: k_max is 0)."""
        return max(range(1, self.k_max + 1), key=lambda k: self.rate(rows, k, cost, members), default=0)

    def rate(self, rows: int, k: int, cost: Optional[dict] = None, members: Sequence[Member] = ()) -> float:
        """Expected tokens per second of a round of K drafts (at least the rows' fixed lengths)."""
        wide = self.accept
        if not members:
            return rows * (1 + np.cumprod(wide[:k]).sum()) / self.round_cost(rows, k, cost)
        k = max([k] + [m.fixed for m in members if m.fixed is not None])
        tokens = 0.0
        for m in members:
            counted = k if m.fixed is None else m.fixed
            tokens += 1 + np.cumprod(m.acceptance.estimate(wide, self.ROW_PRIOR)[:counted]).sum()
        return tokens / self.round_cost(rows, k, cost)

    def round_cost(self, rows: int, k: int, cost: Optional[dict] = None) -> float:
        cost = self.cost if cost is None else cost
        if (rows, k) in cost:
            return cost[(rows, k)]
        known = [(kk, c) for (r, kk), c in cost.items() if r == rows]
        drafted = [(kk, c) for kk, c in known if kk > 0]
        if k > 0 and len(drafted) >= 2:  # the first draft has costs of its own: a line through drafted rounds
            known = drafted
        if len(known) >= 2:  # least-squares line through the measured draft lengths
            ks, cs = np.array(known, dtype=np.float64).T
            dk = ks - ks.mean()
            slope = max(float(dk @ (cs - cs.mean()) / (dk @ dk)), 0.0) if dk.any() else 0.0
            return max(float(cs.mean() + slope * (k - ks.mean())), 1e-9)
        near = self._similar(rows)
        if (rows, 0) in cost and near is not None:  # scaled from the nearest measured batch size
            return cost[(rows, 0)] * self.round_cost(near, k, cost) / cost[(near, 0)]
        if known:  # one point: assume each draft costs half a plain step
            k0, c0 = known[0]
            return c0 * (2 + k) / (2 + k0)
        return 1.0 + k / 2

    def _similar(self, rows: int) -> Optional[int]:
        """The batch size nearest `rows` with plain and drafted rounds measured, if any."""
        measured = lambda r, k: len(self.times.get((r, k), ())) >= 3
        sizes = {r for (r, k) in self.times if r != rows and k > 0 and measured(r, k) and measured(r, 0)}
        return min(sizes, key=lambda r: (abs(np.log(r / rows)), r), default=None)

    def observe(self, rows: int, k: int, accepted: Sequence[int], seconds: Optional[float],
                drafted: Optional[Sequence[int]] = None, members: Sequence[Member] = ()) -> None:
        """A round of `k` drafts over `rows` rows took `seconds` (None: not timed); row b counted
        `drafted[b]` drafts (default: k) and accepted `accepted[b]`. `members`: the rows' own
        acceptance, which is updated too."""
        drafted = [k] * len(accepted) if drafted is None else drafted
        with self.lock:
            if seconds is not None:
                self.times.setdefault((rows, k), collections.deque(maxlen=self.WINDOW)).append(seconds)
            for b, (n, d) in enumerate(zip(accepted, drafted)):
                self.wide.observe(d, n)
                if members:
                    members[b].acceptance.observe(d, n)


_POLICIES: dict[tuple, DraftPolicy] = {}  # (id(drafter), constrained) -> its policy, dropped with the drafter


def policy_for(drafter, k: Union[int, str], constrained: bool = False) -> DraftPolicy:
    """The draft-length policy of a drafter: "auto" policies persist with the drafter object, so
    what one generation measured (round costs, acceptance) serves the next. Rounds with a grammar
    (`constrained`) have a policy of their own: they are read as soon as queued, forced tokens
    lead their drafts and the drafter's are judged against masked targets, so neither their cost
    nor their acceptance is an unconstrained round's. (Keyed by id: an MLX module is a dict, so
    it cannot be a dictionary key itself.)"""
    if drafter is None or k != "auto":
        return DraftPolicy(k if drafter is not None else 0)
    key = (id(drafter), constrained)
    if key not in _POLICIES:
        try:
            weakref.finalize(drafter, _POLICIES.pop, key, None)
        except TypeError:  # not weakly referenceable: a policy of its own
            return DraftPolicy("auto")
        _POLICIES[key] = DraftPolicy("auto")
    return _POLICIES[key]


def check_draft_tokens(k) -> int:
    """A draft length given by a user: an int in 0..K_MAX."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= K_MAX:
        raise ValueError(f"draft_tokens must be 'auto' or an int in 0..{K_MAX}, got {k!r}")
    return int(k)
