"""One speculative round as named phases: draft -> verify -> accept -> emit -> rollback.

Works on B rows at once (B = 1 for a single conversation). Knows models only through the
`TargetModel` / `Drafter` protocols. A round with k = 0 drafts is a plain decoding step,
so plain and speculative decoding share one code path and one cache discipline:
the cache holds every emitted token except the last one of each row.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

import mlx.core as mx

from .cache import KVCache
from .models.base import Drafter, SharedKV, TargetModel, TargetOutput
from .sample import SamplingParams, greedy_accept_batch, probs, rejection_accept_batch, sample, split_key


@dataclasses.dataclass
class RoundState:
    """What carries over between rounds, per row."""

    tokens: mx.array  # (B,) last emitted token, not yet in the cache
    hidden: mx.array  # (B, H) target hidden state that predicted `tokens`
    shared_kv: dict[str, SharedKV]  # store-layer K/V of the last target forward


@dataclasses.dataclass
class Drafts:
    tokens: mx.array  # (B, K)
    q: Optional[mx.array] = None  # (B, K, V) drafter distributions (sampling only)


@dataclasses.dataclass
class RoundResult:
    emitted: list[list[int]]  # per row, in order; the last one is the target's own token
    accepted: list[int]  # drafts accepted per row (before any stop truncation)
    state: RoundState


def draft(
    drafter: Drafter, target: TargetModel, state: RoundState, cache: KVCache, k: int,
    sampling: SamplingParams, key: Optional[mx.array] = None,
) -> Drafts:
    """K drafter steps at the constant position p (= the cache's next position)."""
    position = mx.array(cache.offset.astype("int32"))
    tokens, hidden = state.tokens, state.hidden
    drafted, qs = [], []
    keys = mx.random.split(key, k) if key is not None and k else [None] * k
    for i in range(k):
        out = drafter.draft_step(target.embed(tokens[:, None])[:, 0], hidden, state.shared_kv, position)
        if sampling.greedy:
            tokens = out.argmax()
        else:
            q = probs(out.full_logits(target.vocab_size), sampling)
            tokens = sample(q, keys[i])
            qs.append(q)
        drafted.append(tokens)
        hidden = out.hidden
    B = state.tokens.shape[0]
    tokens = mx.stack(drafted, axis=1) if drafted else mx.zeros((B, 0), dtype=mx.int32)
    return Drafts(tokens.astype(mx.int32), mx.stack(qs, axis=1) if qs else None)


def verify(target: TargetModel, cache: KVCache, state: RoundState, drafts: Drafts) -> TargetOutput:
    """One target forward over [last token, d_1..d_K] for every row."""
    inputs = mx.concatenate([state.tokens[:, None].astype(mx.int32), drafts.tokens], axis=1)
    return target(inputs, cache)


def accept(
    drafts: Drafts, out: TargetOutput, sampling: SamplingParams, key: Optional[mx.array] = None
) -> tuple[list[int], list[int]]:
    """(accepted drafts per row, the target's next token per row): greedy prefix match,
    or exact rejection sampling against the drafter's q."""
    if sampling.greedy:
        return greedy_accept_batch(drafts.tokens, mx.argmax(out.logits, axis=-1))
    p = probs(out.logits, sampling)
    k = drafts.tokens.shape[1]
    q = drafts.q if drafts.q is not None else mx.zeros((*drafts.tokens.shape, p.shape[-1]))
    return rejection_accept_batch(drafts.tokens, q[:, :k], p, key)


def emit(
    drafts: Drafts, n: Sequence[int], nxt: Sequence[int], budget: Sequence[int],
    stop_ids: Sequence[frozenset],
) -> list[list[int]]:
    """Per row: accepted drafts then the target's token, cut after one of the row's stop
    tokens or at its remaining token budget."""
    rows = drafts.tokens.tolist()
    out = []
    for row, n_b, t, left, stops in zip(rows, n, nxt, budget, stop_ids):
        tokens = [*row[:n_b], t][: max(left, 1)]
        for i, tok in enumerate(tokens):
            if tok in stops:
                tokens = tokens[: i + 1]
                break
        out.append(tokens)
    return out


def rollback(cache: KVCache, k: int, emitted: Sequence[Sequence[int]]) -> None:
    """Drop every verified token that was not emitted-and-followed: a row that emitted m
    tokens keeps the first m of its k + 1 verify inputs."""
    cache.rollback([k + 1 - len(e) for e in emitted])


def next_state(out: TargetOutput, emitted: Sequence[Sequence[int]]) -> RoundState:
    last = mx.array([e[-1] for e in emitted], dtype=mx.int32)
    index = mx.array([len(e) - 1 for e in emitted], dtype=mx.int32)
    hidden = mx.take_along_axis(out.hidden, index[:, None, None], axis=1)[:, 0]
    return RoundState(last, hidden, out.shared_kv)


def run_round(
    target: TargetModel, drafter: Optional[Drafter], cache: KVCache, state: RoundState, k: int,
    sampling: SamplingParams, budget: Sequence[int], stop_ids: Sequence[frozenset],
    key: Optional[mx.array] = None,
) -> RoundResult:
    """draft -> verify -> accept -> emit -> rollback, for every row of the cache."""
    k_draft, k_accept = split_key(key)
    drafts = draft(drafter, target, state, cache, k, sampling, k_draft) if k else draft_none(state)
    out = verify(target, cache, state, drafts)
    n, nxt = accept(drafts, out, sampling, k_accept)
    emitted = emit(drafts, n, nxt, budget, stop_ids)
    rollback(cache, k, emitted)
    return RoundResult(emitted, n, next_state(out, emitted))


def draft_none(state: RoundState) -> Drafts:
    return Drafts(mx.zeros((state.tokens.shape[0], 0), dtype=mx.int32))


class DraftLength:
    """How many tokens to draft next round.

    A fixed K, or "auto": grow after a fully accepted round, shrink after an early
    rejection, and stop drafting while speculative rounds are measured to deliver fewer
    tokens per second than plain steps, probing again after an exponentially growing pause.
    """

    def __init__(self, k: Union[int, str] = "auto", k_max: int = 6, k_start: int = 3):
        self.auto = k == "auto"
        if not self.auto and (not isinstance(k, int) or k < 0):
            raise ValueError(f"draft length must be a non-negative int or 'auto', got {k!r}")
        self.k_max = k_max if self.auto else k
        self.k = min(k_start, k_max) if self.auto else k
        self.plain_tps: Optional[float] = None  # EMA of tokens/s of plain steps
        self.mtp_tps: Optional[float] = None  # EMA of tokens/s of speculative rounds
        self.mtp_rounds = 0
        self.off_for = 4 if self.auto else 0  # start with plain steps to measure them
        self.pause = 16

    def next(self) -> int:
        if self.off_for > 0:
            return 0
        return self.k

    def observe(self, k: int, accepted: int, tokens: int, seconds: float) -> None:
        if not self.auto:
            return
        tps = tokens / max(seconds, 1e-9)
        if k == 0:
            self.observe_plain(tokens, seconds)
            return
        self.mtp_tps = _ema(self.mtp_tps, tps)
        self.mtp_rounds += 1
        if accepted == k:
            self.k = min(self.k + 1, self.k_max)
        elif accepted < k // 2 or accepted == 0:
            self.k = max(self.k - 1, 1)
        if self.plain_tps is None or self.mtp_rounds < 3:
            return
        if self.mtp_tps < self.plain_tps:
            self.off_for, self.pause = self.pause, min(self.pause * 2, 1024)
            self.k = 1
        else:
            self.pause = 16

    def observe_plain(self, tokens: int, seconds: float) -> None:
        """A stretch of `tokens` plain steps (drafting off) took `seconds`."""
        if not self.auto or tokens == 0:
            return
        self.plain_tps = _ema(self.plain_tps, tokens / max(seconds, 1e-9))
        self.off_for = max(self.off_for - tokens, 0)
        if self.off_for == 0:
            self.mtp_tps, self.mtp_rounds = None, 0  # probe afresh


def _ema(old: Optional[float], new: float, alpha: float = 0.3) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed
