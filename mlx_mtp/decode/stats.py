"""Generation statistics, following vLLM's convention: acceptance length counts the bonus."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Stats:
    prompt_tokens: int = 0  # prompt tokens prefilled
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead
    stored_tokens: int = 0  # of the prompt tokens prefilled, those left in the prefix cache for later requests
    prompt_seconds: float = 0.0
    first_token_seconds: float = 0.0  # from the call to the first emitted token
    decode_seconds: float = 0.0
    emitted: int = 0  # tokens given to the caller
    from_draft: int = 0  # of which were drafted and accepted
    forced: int = 0  # of which a grammar forced (drafted without the drafter)
    rounds: int = 0  # verify forwards that carried at least one draft
    plain_steps: int = 0  # target forwards with no draft
    drafted: int = 0
    accepted: int = 0
    drafted_at: list = dataclasses.field(default_factory=list)  # per draft position
    accepted_at: list = dataclasses.field(default_factory=list)

    def observe_round(self, k: int, n: int) -> None:
        """A target forward that verified `k` drafts and accepted `n` of them."""
        if k == 0:
            self.plain_steps += 1
            return
        self.rounds += 1
        self.drafted += k
        self.accepted += n
        grow = k - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n

    @property
    def target_forwards(self) -> int:
        return self.rounds + self.plain_steps

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per MTP verify forward, bonus token included (1.0 = no gain)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position: P(draft i accepted | drafted)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def decode_tps(self) -> float:
        # The first token comes from the prefill; decode speed counts the rest.
        return (self.emitted - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def draft_share(self) -> float:
        return self.from_draft / self.emitted if self.emitted else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("acceptance_length", "acceptance_rates", "decode_tps", "prompt_tps", "draft_share",
                     "target_forwards"):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        line = (
            f"{self.decode_tps:.1f} tok/s, first token {self.first_token_seconds * 1000:.0f} ms, "
            f"{self.emitted} tokens"
        )
        if self.rounds:
            rates = " ".join(f"{r:.2f}" for r in self.acceptance_rates)
            line += (
                f", acceptance length {self.acceptance_length:.2f}, {100 * self.draft_share:.0f}% "
                f"from drafts (per position {rates})"
            )
        return line
