"""Batched speculative decoding: 1-8 sequences verified in one target forward per round.

Rows have their own prompts, lengths, drafts, acceptance and budgets; they join (after a
prefill of their own) and leave between rounds. Every row's tokens equal what it would
get alone: positions, masks and rollback are per row in the shared cache.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .generate import check_context, prefill
from .models.base import Drafter, TargetModel
from .sample import SamplingParams, probs, sample, split_key
from .speculative import RoundState, run_round
from .stats import Stats


@dataclasses.dataclass
class Row:
    uid: int
    budget: int  # tokens still allowed
    stop_ids: frozenset
    tokens: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None


class CostModel:
    """Draft length from measured round cost and per-position acceptance.

    Expected tokens per round with k drafts is rows * (1 + sum_j prod_{i<=j} a_i); the round
    cost at this batch size is measured (EMA per k, linear fit for unseen k). The k with the
    highest expected tokens per second wins; neighbours are re-probed now and then.
    """

    def __init__(self, k: Union[int, str] = "auto", k_max: int = 6, probe_every: int = 16):
        self.fixed = None if k == "auto" else int(k)
        self.k_max = k_max if self.fixed is None else self.fixed
        self.accept = np.full(self.k_max, 0.5)  # P(draft i accepted | drafts < i accepted)
        self.seen = np.zeros(self.k_max)
        self.cost: dict[tuple[int, int], float] = {}  # (rows, k) -> seconds per round
        self.rounds = 0
        self.probe_every = probe_every

    def choose(self, rows: int) -> int:
        if self.fixed is not None:
            return self.fixed
        self.rounds += 1
        best = max(range(self.k_max + 1), key=lambda k: self.rate(rows, k))
        if self.rounds % self.probe_every == 0:  # keep estimates of the neighbours fresh
            best = min(self.k_max, best + 1) if self.rounds % (2 * self.probe_every) else max(0, best - 1)
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
            return max(c0 + slope * (k - k0), 1e-6)
        if known:  # one point: assume each draft adds a third of a plain step
            k0, c0 = known[0]
            return c0 * (3 + k) / (3 + k0)
        return 1.0 + k / 3  # nothing measured yet: optimistic, so drafting gets tried

    def observe(self, rows: int, k: int, accepted: Sequence[int], seconds: float) -> None:
        key = (rows, k)
        self.cost[key] = seconds if key not in self.cost else 0.7 * self.cost[key] + 0.3 * seconds
        for n in accepted:  # conditional acceptance per position, from each row's prefix
            for i in range(min(n + 1, k)):
                hit = 1.0 if i < n else 0.0
                self.seen[i] += 1
                weight = max(1.0 / self.seen[i], 0.05)
                self.accept[i] = (1 - weight) * self.accept[i] + weight * hit


class BatchGenerator:
    """Generate for several sequences at once; rows join and leave between rounds.

    Usage:
        gen = BatchGenerator(target, drafter)
        uid = gen.add(prompt_ids, max_tokens=100)
        while gen.active: for uid, tokens, finish in gen.step(): ...
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: Optional[Drafter] = None,
        sampling: SamplingParams = SamplingParams(),
        draft_tokens: Union[int, str] = "auto",
        k_max: int = 6,
        seed: Optional[int] = None,
    ):
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.policy = CostModel(draft_tokens if drafter is not None else 0, k_max)
        if drafter is not None:
            drafter.check_target(target)
        self.rows: list[Row] = []
        self.cache: Optional[KVCache] = None
        self.state: Optional[RoundState] = None
        self.key = mx.random.key(seed) if seed is not None else None
        self.stats = Stats()
        self._next_uid = 0
        self._pending: list[tuple[Row, int]] = []

    @property
    def active(self) -> int:
        return len(self.rows)

    def add(self, prompt: Sequence[int], max_tokens: int = 256, stop_ids: Sequence[int] = ()) -> int:
        """Prefill a new sequence and put it in the batch; returns its id. Its first token is
        reported by the next `step()`."""
        cache = self.target.make_cache(1, max_rollback=self.policy.k_max + 1)
        check_context(self.target, cache, len(prompt))
        started = time.perf_counter()
        logits, state = prefill(self.target, cache, prompt)
        first = sample(probs(logits, self.sampling), self._split()).astype(mx.int32)
        mx.eval(first)
        self.stats.prompt_tokens += len(prompt)
        self.stats.prompt_seconds += time.perf_counter() - started
        row = Row(self._next_uid, max_tokens, frozenset(stop_ids))
        self._next_uid += 1
        self._join(row, cache, RoundState(first, state.hidden, state.shared_kv))
        self._pending.append((row, int(first.item())))
        return row.uid

    def step(self) -> list[tuple[int, list[int], Optional[str]]]:
        """One round for every row: [(uid, new tokens, finish reason or None)]. Rows added
        since the last step first report their prefill token."""
        events = [self._emit(row, [tok]) for row, tok in self._pending]
        self._pending = []
        self._drop_finished()
        if self.rows:
            events += self._round()
            self._drop_finished()
        return events

    def _round(self):
        rows = len(self.rows)
        k = self.policy.choose(rows) if self.drafter is not None else 0
        k = min(k, self._room() - 1) if self._room() > 1 else 0
        budget = [r.budget for r in self.rows]
        started = time.perf_counter()
        result = run_round(self.target, self.drafter, self.cache, self.state, k, self.sampling,
                           budget, [r.stop_ids for r in self.rows], self._split())
        self.state = result.state
        mx.eval(self.state.hidden)
        seconds = time.perf_counter() - started
        self.policy.observe(rows, k, result.accepted, seconds)
        self.stats.decode_seconds += seconds
        events = []
        for row, emitted, n in zip(self.rows, result.emitted, result.accepted):
            self.stats.observe_round(k, n)
            self.stats.from_draft += min(n, len(emitted)) if k else 0
            events.append(self._emit(row, emitted))
        return events

    def _emit(self, row: Row, tokens: list[int]):
        row.tokens += tokens
        row.budget -= len(tokens)
        self.stats.emitted += len(tokens)
        if tokens and tokens[-1] in row.stop_ids:
            row.finish_reason = "stop"
        elif row.budget <= 0:
            row.finish_reason = "length"
        return row.uid, tokens, row.finish_reason

    def _join(self, row: Row, cache: KVCache, state: RoundState) -> None:
        if self.cache is None:
            self.cache, self.rows = cache, [row]
            self.state = RoundState(state.tokens, state.hidden, self.target.shared_kv(cache))
            return
        self.cache.extend(cache)
        self.rows.append(row)
        self.state = RoundState(
            mx.concatenate([self.state.tokens, state.tokens]),
            mx.concatenate([self.state.hidden, state.hidden.astype(self.state.hidden.dtype)]),
            self.target.shared_kv(self.cache),
        )

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if r.finish_reason is None]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.state = None, None
            return
        self.cache.select(keep)
        index = mx.array(keep, dtype=mx.int32)
        self.state = RoundState(self.state.tokens[index], self.state.hidden[index],
                                self.target.shared_kv(self.cache))

    def _room(self) -> int:
        limit = self.target.config.max_position_embeddings
        return limit - int(self.cache.offset.max()) - 1

    def _split(self):
        self.key, sub = split_key(self.key)
        return sub
