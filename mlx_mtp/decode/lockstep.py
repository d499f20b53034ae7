"""The hooks that keep the processes of a pipeline-parallel group in step, as the one driver
(`BatchGenerator`) calls them, and `ALONE`: a process running by itself, where they do nothing.

Every rank of a group runs the same generator calls in the same order (SPMD). Rank 0 makes the
host-side choices (which rows join, leave or are cancelled, the draft length) and tells the
other ranks (`mlx_mtp.distributed.pipeline.Leader`); they repeat its calls (`Follower`). On the device, the
rank that holds the logits makes each round's decision and shares it (`share`).
"""

from __future__ import annotations

import secrets
from typing import Callable, Sequence

from .speculative import here


class Lockstep:
    """The hooks, as a process running by itself has them: they do nothing (`mlx_mtp.distributed.pipeline`'s
    `Leader` and `Follower` override what a group needs)."""

    def made(self, gen) -> None:
        """`gen` was just made (the other ranks make theirs)."""

    def inserting(self, gen, row) -> None:
        """`row` is about to join `gen`'s queue (the other ranks insert the same row)."""

    def called(self, gen, call: str, *args) -> None:
        """`gen.<call>(*args)` begins: "step", "cancel", "remove", "release" or "trim_prefix_cache"."""

    def stepped(self, gen) -> None:
        """`gen.step()` finished."""

    def draft_tokens(self, gen, choose: Callable[[], int]) -> int:
        """The round's draft length: `choose()` on rank 0, the same number everywhere."""
        return choose()

    def share(self, decide: Callable[[], tuple], shapes: Sequence[tuple]) -> tuple:
        """`decide()` (int32 arrays of these shapes) where the logits are, for every rank."""
        return here(decide, shapes)

    def seed(self, gen, uid: int) -> int:
        """A random seed for row `uid` inserted without one (the same one on every rank)."""
        return secrets.randbits(32)


ALONE = Lockstep()
