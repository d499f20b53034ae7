"""Proposers: what drafts the tokens a speculative round verifies.

`MTPProposer` runs a Gemma 4 MTP drafter (`gemma4_assistant`) on the target's own cache. Every
proposer works on the device only: no host read inside a round.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .cache import KVCache
from .models.base import Drafter, TargetModel
from .sample import DRAFT, batch_probs, sample, uniform
from .speculative import BatchState, Drafts, Plan, Proposer


class MTPProposer:
    """K drafter steps at the constant position p (the position of each row's last token)."""

    def __init__(self, drafter: Drafter, target: TargetModel):
        drafter.check_target(target)
        self.drafter, self.target = drafter, target

    def propose(self, state: BatchState, cache: KVCache, k: int, plan: Plan) -> Drafts:
        position = cache.offset
        shared = self.target.shared_kv(cache)
        tokens, hidden = state.tokens, state.hidden
        drafted, qs = [], []
        for i in range(k):
            out = self.drafter.draft_step(self.target.embed(tokens[:, None])[:, 0], hidden, shared, position)
            if plan.greedy:
                tokens = out.argmax().astype(mx.int32)
            else:
                q = batch_probs(out.full_logits(self.target.vocab_size), plan.params)
                tokens = sample(q, uniform(state.seeds, position + 1 + i, DRAFT))
                qs.append(q)
            drafted.append(tokens)
            hidden = out.hidden
        return Drafts(mx.stack(drafted, axis=1), mx.stack(qs, axis=1) if qs else None)


def as_proposer(drafter, target: TargetModel) -> Optional[Proposer]:
    """The proposer for `Loaded.drafter`: an MTP drafter model, or an object that already
    proposes (n-gram lookup, oracle); None for plain decoding."""
    if drafter is None:
        return None
    if isinstance(drafter, Proposer):
        return drafter
    return MTPProposer(drafter, target)
