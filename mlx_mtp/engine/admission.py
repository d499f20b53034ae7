"""Memory admission, beside the memory plan (`runtime/memory.py`) whose KV budget it enforces: how many
bytes a row's KV cache takes, and whether one more row fits beside the running ones within the
engine's memory limit, the prefix cache giving up what nobody pins to make room.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..cache.kv import FULL, SLIDING
from ..cache.prefix import PrefixCache, token_bytes
from .requests import MemoryLimitError
from ..decode.speculative import MAX_ROLLBACK


class Admission:
    """The KV bytes of rows of a target, against `limit`. Made on the thread that calls MLX (it
    builds a one-row cache to learn the sliding rings' size)."""

    def __init__(self, target, limit: int):
        per_token = token_bytes(target)
        self.limit = limit
        self.token_bytes = per_token[FULL]  # full-attention layers: every position
        self.ring_bytes = per_token[SLIDING] * target.make_cache(1, max_rollback=MAX_ROLLBACK).ring_size

    def need(self, tokens: int) -> int:
        """One row's KV bytes at `tokens` tokens (prompt and reply), with the rollback slack.

        Raises:
            MemoryLimitError: that alone exceeds the limit.
        """
        need = (tokens + MAX_ROLLBACK) * self.token_bytes + self.ring_bytes
        if need > self.limit:
            raise MemoryLimitError(f"the KV cache of this request ({need / 2**30:.2f} GiB) exceeds the "
                                   f"engine's memory limit ({self.limit / 2**30:.2f} GiB)")
        return need

    @staticmethod
    def batch_need(rows: Sequence[int], need: int) -> int:
        """The batch's KV bytes with one more row: full-attention buffers are as long as the
        longest row's, for every row."""
        every = [*rows, need]
        return len(every) * max(every)

    def room(self, rows: Sequence[int], need: int, prefix: PrefixCache, trim: Callable[[int], None]) -> bool:
        """Whether a row of `need` bytes fits beside running rows of `rows` bytes; `trim(n)`
        evicts prefix-cache states nobody pins down to n bytes. A row alone always fits."""
        total = self.batch_need(rows, need) if rows else need
        if total + prefix.nbytes > self.limit:
            trim(max(self.limit - total, 0))
        return not rows or total + prefix.nbytes <= self.limit
