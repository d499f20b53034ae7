"""Controlled acceptance for the suites that measure MTP on random weights (`realsize`, `gpu`, `peers`):
a drafter whose drafts are right with a chosen probability while the real assistant's cost is paid,
and a generator whose rows join the batch together, so every timed round has B rows.

A row's drafts come from `RowsOracle`: like `mlx_mtp.decode.oracle.OracleDrafter` (lazy, no host read
inside a round; whether the draft at a position is right is a hash of (seed, position), so every
K meets the same luck) but with one truth per row: row r proposes the plain greedy continuation
of its own prompt. It runs the pair's real drafter too (`inner`), so each round pays the real
drafting cost; its tokens are not used.

The `oracle` mode that lived here (MTP vs plain on the mid pair for K sweeps per regime) was removed
in issue 45, its figures kept in apps/README.md; its code is at commit d1a4d89
(`git show d1a4d89:apps/bench/oracle.py`).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.prefill import Prefill
from mlx_mtp.decode.sample import uniform
from mlx_mtp.decode.speculative import K_MAX, Drafts

_RIGHT, _WRONG = 5, 6  # the random streams mlx_mtp.decode.oracle uses


class RowsOracle:
    """Per-row truth: row r (the r-th inserted into the generator) proposes truth[r]'s next
    tokens, each right with probability p, decided by a hash of (seed + r, position)."""

    needs_history = False

    def __init__(self, truths: list, prompt_lens: list, vocab: int, p: float, inner=None):
        width = max(len(t) for t in truths) + K_MAX + 2
        self.truth = mx.array([list(t) + [0] * (width - len(t)) for t in truths], dtype=mx.int32)
        self.prompt_lens = mx.array(prompt_lens, dtype=mx.int32)
        self.vocab, self.p, self.inner = vocab, p, inner
        self.seed, self.gen, self.first_uid = 0, None, 0

    def start(self, gen: BatchGenerator, seed: int) -> None:
        """Before a run: the generator whose rows this serves, and the run's seed."""
        self.gen, self.seed, self.first_uid = gen, seed, gen._uids

    def propose(self, state, cache, k: int, plan) -> Drafts:
        rows = mx.array([r.uid - self.first_uid for r in self.gen.rows], dtype=mx.int32)  # host list: no sync
        positions = cache.offset[:, None] + 1 + mx.arange(k, dtype=mx.int32)[None]  # (B, k)
        index = mx.clip(positions - self.prompt_lens[rows][:, None], 0, self.truth.shape[1] - 1)
        right = mx.take_along_axis(self.truth[rows], index, axis=1)
        seeds = (rows + self.seed * 7919).astype(mx.uint32)
        lucky = uniform(seeds, positions, _RIGHT) < self.p
        offset = 1 + (uniform(seeds, positions, _WRONG) * (self.vocab - 1)).astype(mx.int32)
        tokens = mx.where(lucky, right, (right + offset) % self.vocab)
        if self.inner is not None:  # pay for the real drafter; its tokens are not used
            tokens = tokens + 0 * self.inner.propose(state, cache, k, plan).tokens
        return Drafts(tokens)


class JoinTogether(BatchGenerator):
    """Bench only: every pending row is prefilled in the same step, so the batch starts with
    all of its rows (the driver itself prefills at most `prefill_tokens` prompt tokens a step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefill = _Drain(self.target, self.prefill_chunk, self.prefill_tokens, self.prefix,
                              self.lockstep.share, self.stats)


class _Drain(Prefill):
    """Prefill steps until the queue is empty, as one."""

    def step(self, pending, keeps_history):
        history = keeps_history(list(pending))  # decided for every row at once: they all join now
        ran, joined = False, []
        while pending:
            did, done = super().step(pending, lambda rows: history)
            ran, joined = ran or did, joined + done
        return ran, joined


def first_token(target, prompt: list) -> float:
    """Seconds from inserting a prompt into a fresh generator to its first token (one row)."""
    gen = JoinTogether(target)
    uid = gen.insert(prompt, max_tokens=1)
    start = time.perf_counter()
    while not any(e.tokens for e in gen.step() if e.uid == uid):
        pass
    seconds = time.perf_counter() - start
    gen.remove(uid)
    return seconds


def decode_run(gen: BatchGenerator, prompts: list, n: int) -> dict:
    """Rows resume from the prompts' states (`gen.prefix`); times the decode phase (after the
    first tokens)."""
    uids = [gen.insert(p, max_tokens=n) for p in prompts]
    out = {u: [] for u in uids}
    begun, reads = None, []
    while gen.busy:
        events = gen.step()
        for e in events:
            out[e.uid] += e.tokens
        if begun is None and all(out.values()):
            begun = time.perf_counter()  # every first token is in; round 1 is queued
            reads.append(begun)
        elif begun is not None and any(e.tokens for e in events):
            reads.append(time.perf_counter())  # a round was read
    rows = [out[u] for u in uids]
    for u in uids:
        gen.remove(u)
    return dict(tokens=rows, seconds=reads[-1] - begun, steps=len(reads) - 1, decoded=sum(len(r) - 1 for r in rows),
                step_seconds=np.diff(reads).tolist())


def expected_tokens(p: float, k: int) -> float:
    """E[tokens per round] of an oracle with per-draft probability p and K drafts (bonus included)."""
    return sum(p ** i for i in range(k + 1))
