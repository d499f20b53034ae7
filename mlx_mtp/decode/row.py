"""A sequence in the driver (`Row`): its request, how far its prompt got, what it emitted; and
what one `BatchGenerator.step()` hands out of it (`RowEvent`). Shared by the driver and the
prompt processing that feeds it (`prefill.py`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Hashable, Optional, Union

import mlx.core as mx
import numpy as np

from ..cache.kv import KVCache
from .processors import RowProcessing
from .sample import SamplingParams
from .speculative import Acceptance
from .stats import Stats


@dataclasses.dataclass
class RowEvent:
    """New tokens of one row from one `step()`; `finish_reason` is set on the row's last event."""

    uid: int
    tokens: list
    from_draft: list
    finish_reason: Optional[str] = None  # "stop", "length", "cancelled", "dead_end" (grammar allows nothing)
    stats: Optional[Stats] = None
    logprobs: Optional[list] = None  # per token (logprob, ((token, logprob), ...)) when the row asked


@dataclasses.dataclass(eq=False)
class Row:
    uid: int
    prompt: list
    max_tokens: int
    params: SamplingParams
    seed: int
    seeded: bool
    stop_ids: frozenset
    draft: Union[int, str, None]  # None: MTP off for this row
    marks: frozenset  # prompt lengths at which the row leaves a state in the prefix cache
    owner: Optional[Hashable]  # pins the row's states (see `BatchGenerator.insert`)
    cache: Optional[KVCache] = None  # while the prompt is prefilled
    start: int = 0  # prompt tokens restored from the prefix cache
    fed: int = 0  # prompt tokens in the cache
    tokens: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    stats: Stats = dataclasses.field(default_factory=Stats)
    first: Optional[mx.array] = None
    began: float = 0.0
    pinned: list = dataclasses.field(default_factory=list)  # states the row left for its owner
    processing: RowProcessing = RowProcessing()
    first_logprobs: Optional[tuple] = None
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)  # of this row's drafts
    images: Optional[object] = None  # the prompt's images (`gemma4_vision.PromptImages`); None: text only

    @functools.cached_property
    def ids(self) -> np.ndarray:
        """The prompt as the prefix cache knows it, as an array (compared with other prompts while queued)."""
        return np.asarray(self.key, dtype=np.int64)

    @functools.cached_property
    def key(self) -> list:
        """The prompt as the prefix cache keys it: each image's placeholders replaced by ids drawn from
        its content (negative: never a token), so that only the same image matches."""
        return self.prompt if self.images is None else self.images.keyed(self.prompt)

    @property
    def length(self) -> int:
        """Tokens the row's cache holds: prompt and emitted tokens but the last one."""
        return self.fed + max(len(self.tokens) - 1, 0)

    def grammar_ends(self, tokens: list) -> Optional[str]:
        """"dead_end" when the row's grammar allows no token after `tokens` (which it takes in)."""
        grammar = self.processing.grammar
        if grammar is None:
            return None
        grammar.advance(tokens)
        return "dead_end" if grammar.dead else None
