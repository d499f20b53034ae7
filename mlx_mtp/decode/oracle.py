"""A drafter that knows the answer: for tests and benchmarks of the speculative loop.

It proposes the target's known continuation, each draft right with probability `p_right` and
otherwise a wrong token: partial acceptance at controlled, varied positions. Whether the draft
for a position is right is a hash of (seed, position), so every draft length meets the same
luck and nothing is read back to the host inside a round. With `inner` (an MTP drafter) it
also runs the real drafter, so a benchmark pays the real drafting cost.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ..cache.kv import KVCache
from .drafters import MTPProposer
from .sample import uniform
from .speculative import K_MAX, BatchState, Drafts, Plan

_RIGHT, _WRONG = 5, 6  # random streams of their own


class OracleDrafter:
    needs_history = False

    def __init__(self, truth: Sequence[int], prompt_len: int, vocab_size: int, p_right: float,
                 inner: Optional[MTPProposer] = None, seed: int = 0):
        # Token at position prompt_len + i is truth[i]; positions past the end get token 0.
        self.truth = mx.array([*truth, *[0] * (K_MAX + 2)], dtype=mx.int32)
        self.prompt_len, self.vocab, self.p_right, self.inner = prompt_len, vocab_size, p_right, inner
        self.seed = mx.array([seed], dtype=mx.uint32)

    def propose(self, state: BatchState, cache: KVCache, k: int, plan: Plan) -> Drafts:
        positions = cache.offset[:, None] + 1 + mx.arange(k, dtype=mx.int32)[None]  # (B, k)
        index = mx.clip(positions - self.prompt_len, 0, self.truth.shape[0] - 1)
        right = self.truth[index]
        seeds = mx.broadcast_to(self.seed, positions.shape[:1])
        lucky = uniform(seeds, positions, _RIGHT) < self.p_right
        offset = 1 + (uniform(seeds, positions, _WRONG) * (self.vocab - 1)).astype(mx.int32)
        tokens = mx.where(lucky, right, (right + offset) % self.vocab)
        if self.inner is not None:  # pay for the real drafter; its tokens are not used
            tokens = tokens + 0 * self.inner.propose(state, cache, k, plan).tokens
        return Drafts(tokens)  # a deterministic proposal: q is one-hot on it
