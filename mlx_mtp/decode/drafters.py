"""Proposers: what drafts the tokens a speculative round verifies.

`MTPProposer` runs a Gemma 4 MTP drafter (`gemma4_assistant`) on the target's own cache. Every
proposer works on the device only: no host read inside a round.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..cache.kv import KVCache
from ..runtime.jit import Bounded
from ..models.base import Drafter, DraftOutput, TargetModel
from .sample import DRAFT, SamplingParams, batch_probs, params_key, sample, uniform
from .speculative import BatchState, Drafts, Plan, Proposer


class MTPProposer:
    """K drafter steps at the constant position p (the position of each row's last token)."""

    needs_history = False

    def __init__(self, drafter: Drafter, target: TargetModel):
        drafter.check_target(target)
        self.drafter, self.target = drafter, target

    def propose(self, state: BatchState, cache: KVCache, k: int, plan: Plan) -> Drafts:
        position = cache.offset
        shared = self.target.shared_kv(cache)
        step = self.drafter.step(shared, position[:, None])  # masks and RoPE: once per block
        tokens, hidden = state.tokens, state.hidden
        drafted, qs = [], []
        processors = plan.processors  # bias and penalties apply to drafts as to the target; forced tokens lead
        key = None if plan.greedy else params_key(plan.params)
        for i in range(k):
            out = self.drafter.draft_step(self.target.embed(tokens), hidden, shared, position, step)
            logits = None  # processed: None where nothing changes them (no processors, or logprobs alone)
            if processors is not None:
                logits = processors.draft_logits(out.full_logits(self.target.vocab_size), drafted, state.history,
                                                 position)
            if plan.greedy and logits is None:  # the drafter's own argmax (no grammar: nothing is forced),
                drafted.append(out.argmax(keepdims=True))  # in (B, 1) columns: no view to stack; one to embed
                tokens, hidden = drafted[-1].reshape(-1), out.hidden
                continue
            if plan.greedy:
                tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
            else:
                if logits is None:
                    tokens, q = _draw(out.logits, out.token_ids, state.seeds, position, i, self.target.vocab_size, key)
                else:  # processed: sampled from q as `_draw` does
                    q = batch_probs(logits, plan.params)
                    tokens = sample(q, uniform(state.seeds, position + 1 + i, DRAFT))
                qs.append(q)
            if processors is not None:
                tokens = processors.forced_at(i, tokens)
            drafted.append(tokens)
            hidden = out.hidden
        if drafted[0].ndim == 2:  # the greedy columns
            return Drafts(mx.concatenate(drafted, axis=1).astype(mx.int32))
        tokens = mx.stack(drafted, axis=1)
        return Drafts(tokens, mx.stack(qs, axis=1) if qs else None)


@Bounded
def _draw(logits: mx.array, token_ids: Optional[mx.array], seeds: mx.array, position: mx.array, i: int,
          vocab_size: int, key: tuple) -> tuple[mx.array, mx.array]:
    """Draft i of a block at `position`, sampled from q (the same transform as the target's p)."""
    q = batch_probs(DraftOutput(logits, None, token_ids).full_logits(vocab_size), [SamplingParams(*r) for r in key])
    return sample(q, uniform(seeds, position + 1 + i, DRAFT)), q


class NgramDrafter:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the last
    n tokens (the longest n in n_min..n_max that occurs) in the row's context, prompt and
    output alike. It needs no model, so any Gemma 4 target (a fine-tune without an MTP drafter)
    drafts; the search runs on the device over the row's token history.
    """

    needs_history = True

    def __init__(self, n_max: int = 4, n_min: int = 2):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min

    def propose(self, state: BatchState, cache: KVCache, k: int, plan: Plan) -> Drafts:
        tokens, count = lookup(state.history, cache.offset + 1, k, self.n_min, self.n_max)
        return Drafts(tokens, None, count)  # a deterministic proposal: q is one-hot on it


class HybridDrafter:
    """The n-gram proposal where it is long (at least `min_ngram` tokens, or all K), the MTP
    drafter's otherwise, chosen per row on the device."""

    needs_history = True

    def __init__(self, mtp: MTPProposer, ngram: NgramDrafter, min_ngram: int = 3):
        self.mtp, self.ngram, self.min_ngram = mtp, ngram, min_ngram

    def propose(self, state: BatchState, cache: KVCache, k: int, plan: Plan) -> Drafts:
        a, b = self.ngram.propose(state, cache, k, plan), self.mtp.propose(state, cache, k, plan)
        use = a.limit >= min(k, self.min_ngram)
        tokens = mx.where(use[:, None], a.tokens, b.tokens)
        q = None
        if b.q is not None:
            q = mx.where(use[:, None, None], one_hot(a.tokens, b.q.shape[-1]), b.q)
        return Drafts(tokens, q, mx.where(use, a.limit, k))


def lookup(history: mx.array, length: mx.array, k: int, n_min: int, n_max: int) -> tuple[mx.array, mx.array]:
    """(B, k) proposed tokens and (B,) how many are real, for rows whose first `length` tokens
    are known: the continuation of the latest earlier occurrence of their last n tokens."""
    B, T = history.shape
    start, count = mx.zeros((B,), dtype=mx.int32), mx.zeros((B,), dtype=mx.int32)
    for n in range(n_min, n_max + 1):  # a longer match, where there is one, overrides
        last = mx.take_along_axis(history, mx.maximum(length[:, None] - n + mx.arange(n)[None], 0), axis=1)
        match = mx.ones((B, T - n + 1), dtype=mx.bool_)
        for d in range(n):
            match = match & (history[:, d : T - n + 1 + d] == last[:, d : d + 1])
        i = mx.arange(T - n + 1, dtype=mx.int32)[None]
        match = match & (i + n < length[:, None]) & (length[:, None] >= n)  # strictly earlier
        found = mx.max(mx.where(match, i, -1), axis=1)
        has = found >= 0
        start = mx.where(has, found + n, start)
        count = mx.where(has, mx.minimum(k, length - (found + n)), count)
    index = mx.minimum(start[:, None] + mx.arange(k, dtype=mx.int32)[None], T - 1)
    tokens = mx.where(mx.arange(k)[None] < count[:, None], mx.take_along_axis(history, index, axis=1), 0)
    return tokens.astype(mx.int32), count


def one_hot(tokens: mx.array, vocab_size: int) -> mx.array:
    return (mx.arange(vocab_size)[None, None] == tokens[..., None]).astype(mx.float32)


def as_proposer(drafter, target: TargetModel) -> Optional[Proposer]:
    """The proposer for `Loaded.drafter`: an MTP drafter model, or an object that already
    proposes (n-gram lookup, oracle); None for plain decoding."""
    if drafter is None:
        return None
    if isinstance(drafter, Proposer):
        return drafter
    return MTPProposer(drafter, target)
