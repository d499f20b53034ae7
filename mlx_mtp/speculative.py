"""One speculative round as named phases: draft -> verify -> accept -> advance.

Works on B rows at once (B = 1 for a single sequence) and reads nothing back to the host: the
accepted counts, next tokens, hidden states and cache lengths stay on the device, so the driver
builds and queues round n+1 before it reads round n's tokens. A round whose rows all draft
nothing is a plain decoding step; rows may count fewer drafts than the round makes (`limits`),
which is how rows with MTP off, or with a smaller draft length, share one verify forward.
The cache holds every token of a row but the last one emitted.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .models.base import TargetModel, TargetOutput
from .sample import ACCEPT, RESAMPLE, batch_probs, greedy_accept, rejection_accept, uniform

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


@dataclasses.dataclass(frozen=True)
class Plan:
    """The host's choices for one round, per row."""

    params: tuple  # SamplingParams of each row
    limits: tuple  # drafts that count for each row (0: a plain step for that row)

    @property
    def k(self) -> int:
        return max(self.limits, default=0)

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self.params)


@dataclasses.dataclass
class Drafts:
    tokens: mx.array  # (B, K) int32
    q: Optional[mx.array] = None  # (B, K, V) drafter distributions (None when every row is greedy)
    limit: Optional[mx.array] = None  # (B,) drafts the proposer really made (None: all K)


@dataclasses.dataclass
class RoundOutput:
    """A round's result, still on the device when the next round is built."""

    tokens: mx.array  # (B, K+1) accepted drafts, then the target's token, then -1
    accepted: mx.array  # (B,) drafts accepted


@runtime_checkable
class Proposer(Protocol):
    """Something that drafts: an MTP drafter, an n-gram lookup, an oracle for tests."""

    def propose(self, state: BatchState, cache: KVCache, k: int, plan: Plan) -> Drafts: ...


def draft(proposer: Proposer, state: BatchState, cache: KVCache, plan: Plan) -> Drafts:
    if plan.k == 0:
        return Drafts(mx.zeros((state.tokens.shape[0], 0), dtype=mx.int32))
    return proposer.propose(state, cache, plan.k, plan)


def verify(target: TargetModel, cache: KVCache, state: BatchState, drafts: Drafts) -> TargetOutput:
    """One target forward over [last token, d_1..d_K] for every row."""
    inputs = mx.concatenate([state.tokens[:, None].astype(mx.int32), drafts.tokens], axis=1)
    return target(inputs, cache)


def accept(drafts: Drafts, out: TargetOutput, plan: Plan, seeds: mx.array, base: mx.array):
    """(accepted drafts, next token) per row: greedy prefix match, or exact rejection sampling
    against the drafter's q. `base` (B,) is the position of each row's last token."""
    limit = mx.array(plan.limits, dtype=mx.int32)
    if drafts.limit is not None:
        limit = mx.minimum(limit, drafts.limit)
    k = drafts.tokens.shape[1]
    if plan.greedy:
        return greedy_accept(drafts.tokens, mx.argmax(out.logits, axis=-1), limit if k else None)
    p = batch_probs(out.logits, plan.params)
    q = drafts.q if drafts.q is not None else mx.zeros((*drafts.tokens.shape, p.shape[-1]))
    positions = base[:, None] + 1 + mx.arange(k + 1, dtype=mx.int32)[None]  # of d_1 .. d_K, bonus
    return rejection_accept(drafts.tokens, q, p, uniform(seeds, positions[:, :k], ACCEPT),
                            uniform(seeds, positions, RESAMPLE), limit)


def advance(cache: KVCache, out: TargetOutput, drafts: Drafts, n: mx.array, nxt: mx.array,
            base: mx.array, seeds: mx.array) -> tuple[BatchState, RoundOutput]:
    """Roll every row back to its accepted prefix and carry the next token on."""
    B, k = drafts.tokens.shape
    if k:
        cache.rollback_to(base + n + 1)  # keeps the row's last token and its n accepted drafts
    j = mx.arange(k + 1)[None]
    padded = mx.concatenate([drafts.tokens, mx.zeros((B, 1), dtype=mx.int32)], axis=1)
    emitted = mx.where(j < n[:, None], padded, mx.where(j == n[:, None], nxt[:, None], -1))
    hidden = mx.take_along_axis(out.hidden, n[:, None, None], axis=1)[:, 0]
    return BatchState(nxt, hidden, seeds), RoundOutput(emitted, n)


def here(decide: Callable[[], tuple], shapes: Sequence[tuple]) -> tuple:
    """Where a decision is made and who gets it, in one process: here, for everyone. (Under
    pipeline parallelism the rank holding the logits decides and tells the others.)"""
    return decide()


def run_round(target: TargetModel, proposer: Optional[Proposer], cache: KVCache, state: BatchState,
              plan: Plan, share: Callable = here) -> tuple[BatchState, RoundOutput]:
    """draft -> verify -> accept -> advance, for every row of the cache; nothing is evaluated."""
    base = cache.offset
    drafts = draft(proposer, state, cache, plan)
    out = verify(target, cache, state, drafts)

    def decide():
        return (drafts.tokens, *accept(drafts, out, plan, state.seeds, base))

    B, k = drafts.tokens.shape
    tokens, n, nxt = share(decide, [(B, k), (B,), (B,)])
    return advance(cache, out, dataclasses.replace(drafts, tokens=tokens), n, nxt, base, state.seeds)


class DraftPolicy:
    """How many tokens to draft next round: the one policy for every batch size.

    Fixed, or "auto": the K in 0..k_max with the most expected tokens per second, where a round
    with K drafts is expected to give rows * (1 + sum_j prod_{i<=j} a_i) tokens (a_i: measured
    acceptance of draft i given the ones before it) and its cost is measured per (rows, K),
    K = 0 included, then interpolated for K not yet measured. Neighbours of the best K are
    re-measured now and then so estimates follow the machine.
    """

    def __init__(self, k: Union[int, str] = "auto", k_max: int = K_MAX, probe_every: int = 16):
        self.fixed = None if k == "auto" else check_draft_tokens(k)
        self.k_max = k_max if self.fixed is None else self.fixed
        self.accept = np.full(K_MAX, 0.6)  # P(draft i accepted | the ones before were)
        self.seen = np.zeros(K_MAX)
        self.cost: dict[tuple[int, int], float] = {}  # (rows, K) -> seconds per round
        self.rounds = 0
        self.probe_every = probe_every

    def choose(self, rows: int) -> int:
        if self.fixed is not None:
            return self.fixed
        self.rounds += 1
        best = max(range(self.k_max + 1), key=lambda k: self.rate(rows, k))
        if self.rounds % self.probe_every == 0:  # keep the neighbours' estimates fresh
            up = (self.rounds // self.probe_every) % 2
            best = min(self.k_max, best + 1) if up else max(0, best - 1)
        return best

    def rate(self, rows: int, k: int) -> float:
        tokens = rows * (1 + np.cumprod(self.accept[:k]).sum())
        return tokens / self.round_cost(rows, k)

    def round_cost(self, rows: int, k: int) -> float:
        if (rows, k) in self.cost:
            return self.cost[(rows, k)]
        known = sorted((kk, c) for (r, kk), c in self.cost.items() if r == rows)
        if len(known) >= 2:
            (k0, c0), (k1, c1) = known[0], known[-1]
            slope = max((c1 - c0) / max(k1 - k0, 1), 0.0)
            return max(c0 + slope * (k - k0), 1e-9)
        if known:  # one point: assume each draft adds a fifth of a plain step
            k0, c0 = known[0]
            return c0 * (5 + k) / (5 + k0)
        return 1.0 + k / 5  # nothing measured yet: optimistic, so drafting gets tried

    def observe(self, rows: int, k: int, accepted: Sequence[int], seconds: Optional[float]) -> None:
        """A round of `k` drafts over `rows` rows took `seconds` (None: not timed) and
        accepted `accepted[b]` drafts of the rows that drafted."""
        if seconds is not None:
            key = (rows, k)
            self.cost[key] = seconds if key not in self.cost else 0.8 * self.cost[key] + 0.2 * seconds
        for n in accepted:  # conditional acceptance per position, from each row's prefix
            for i in range(min(n + 1, k)):
                self.seen[i] += 1
                weight = max(1.0 / self.seen[i], 0.02)
                self.accept[i] += weight * ((i < n) - self.accept[i])


def check_draft_tokens(k) -> int:
    """A draft length given by a user: an int in 0..K_MAX."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= K_MAX:
        raise ValueError(f"draft_tokens must be 'auto' or an int in 0..{K_MAX}, got {k!r}")
    return int(k)
