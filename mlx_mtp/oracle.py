"""A drafter that knows the answer: for tests and benchmarks of the speculative loop.

It runs a real drafter (so a benchmark pays the real drafting cost), then replaces its
proposal by the target's known continuation with probability `p_right`, otherwise by a
wrong token: partial acceptance at controlled, varied positions.
"""

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .models.base import DraftOutput


class OracleDrafter:
    def __init__(self, truth: Sequence[int], prompt_len: int, vocab_size: int, p_right: float,
                 inner=None, seed: int = 0):
        self.truth, self.prompt_len, self.vocab = list(truth), prompt_len, vocab_size
        self.p_right, self.inner = p_right, inner
        self.rng = np.random.default_rng(seed)
        self._block: tuple[Optional[int], int] = (None, 0)

    def check_target(self, target) -> None:
        if self.inner is not None:
            self.inner.check_target(target)

    def draft_step(self, token_embed, hidden, shared_kv, position) -> DraftOutput:
        if self.inner is not None:
            out = self.inner.draft_step(token_embed, hidden, shared_kv, position)
            mx.eval(out.logits, out.hidden)
            hidden = out.hidden
        p = int(position[0].item())
        step = self._block[1] + 1 if self._block[0] == p else 0
        self._block = (p, step)
        index = p - self.prompt_len + 1 + step  # index of the proposed token in `truth`
        right = self.truth[index] if index < len(self.truth) else 0
        token = right
        if self.rng.random() >= self.p_right:
            token = (right + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
        logits = mx.where(mx.arange(self.vocab) == token, 10.0, -10.0)[None]
        return DraftOutput(logits, hidden)
