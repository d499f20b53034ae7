"""Logits processors, exact under speculative decoding.

One rule serves them all: a processor changes the target's logits at each verified position as
a function of the row's history plus the round's drafts before that position, so position j of a
round (which predicts the token after d_1..d_j) is processed exactly as plain decoding would
process it had it emitted d_1..d_j. Acceptance then runs against the processed distribution
(greedy: its argmax; sampling: rejection sampling), and the output is plain processed decoding's:
token for token, or in distribution. In order:

1. `logit_bias` is added;
2. penalties (vLLM's and OpenAI's definitions): `repetition` divides the positive logits and
   multiplies the negative ones of every token in the prompt or the output so far; `frequency`
   is subtracted once per earlier use of a token in the output, `presence` once if it was used;
3. a grammar's mask (see `grammar`) sets the logits of tokens it does not allow to -inf.

The drafter's distribution gets bias and penalties the same way, so its drafts follow them too.
A grammar's masks are computed on the host from the drafts (read back while the device runs the
verify forward); the tokens it forces are drafted, and accepted with certainty where they are the
only token allowed. Log-probabilities are those of the processed logits (before temperature and
the top-k / top-p / min-p filters) at each emitted position, drafted or not.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

MAX_LOGPROBS = 20  # alternatives a token's log-probability may come with


@dataclasses.dataclass(frozen=True)
class Penalties:
    """Repetition control and bias of one request (the defaults change nothing).

    Attributes:
        presence: subtracted from the logit of each token the output already holds.
        frequency: subtracted once per time the output already holds the token.
        repetition: > 0; the logits of tokens in the prompt or the output are divided by it
            where positive and multiplied by it where negative (1: off).
        logit_bias: (token id, bias) pairs added to those tokens' logits (a dict is accepted).
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple = ()

    def __post_init__(self):
        for name in ("presence", "frequency", "repetition"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} penalty must be a finite number")
        if not self.repetition > 0:
            raise ValueError(f"repetition penalty must be > 0, got {self.repetition}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs = []
        for token, value in bias:
            if isinstance(token, bool) or int(token) != token or token < 0 or not math.isfinite(value):
                raise ValueError(f"logit_bias needs token ids >= 0 and finite biases, got {token!r}: {value!r}")
            pairs.append((int(token), float(value)))
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))

    @property
    def counts(self) -> bool:
        """Whether the row's token history is read (a penalty is on)."""
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1

    @property
    def active(self) -> bool:
        return self.counts or bool(self.logit_bias)


NONE = Penalties()


@dataclasses.dataclass(frozen=True)
class RowProcessing:
    """What processes one row's logits: penalties and bias, a grammar state (`grammar.Matcher`),
    and how many alternatives its log-probabilities come with (None: no log-probabilities)."""

    penalties: Penalties = NONE
    grammar: Optional[object] = None
    logprobs: Optional[int] = None
    start: int = 0  # position of the row's first output token (its prompt's length)

    @property
    def active(self) -> bool:
        return self.penalties.active or self.grammar is not None or self.logprobs is not None


class Processors:
    """The logits processors of one round's rows, built by the driver for the round's `Plan`.

    Args:
        rows: each row's `RowProcessing`.
        vocab_size: the target's vocabulary.
        max_forced: the most forced tokens a row may draft (the longest draft).
    """

    def __init__(self, rows: Sequence[RowProcessing], vocab_size: int, max_forced: int):
        self.rows, self.vocab_size = list(rows), vocab_size
        B = len(self.rows)
        self.grammars = [(b, r.grammar) for b, r in enumerate(self.rows) if r.grammar is not None]
        self.forced = [[] for _ in range(B)]
        for b, grammar in self.grammars:
            self.forced[b] = grammar.forced(max_forced)
        self.nforced = [len(f) for f in self.forced]
        width = max(self.nforced, default=0)
        tokens, where = np.zeros((B, width), dtype=np.int32), np.zeros((B, width), dtype=bool)
        for b, forced in enumerate(self.forced):
            tokens[b, : len(forced)], where[b, : len(forced)] = forced, True
        self._forced = (mx.array(tokens), mx.array(where)) if width else None
        self.counting = any(r.penalties.counts for r in self.rows)
        self.top = max((r.logprobs for r in self.rows if r.logprobs is not None), default=None)
        self._cap: Optional[list] = None  # drafts each row may count, once its grammar's masks are known
        self._coefficients = None
        self._limits = (0,) * B
        self._first: Optional[mx.array] = None

    @classmethod
    def build(cls, rows: Sequence[RowProcessing], vocab_size: int, max_forced: int) -> Optional["Processors"]:
        """The round's processors, or None when no row has any."""
        return cls(rows, vocab_size, max_forced) if any(r.active for r in rows) else None

    @property
    def serial(self) -> bool:
        """A grammar row's next round is built from this round's tokens: the driver reads them
        before it queues another round."""
        return bool(self.grammars)

    # ---- the draft phase ---------------------------------------------------------------------

    def limits(self, limits: Sequence[int]) -> tuple:
        """Each row's draft count: the tokens its grammar forces where it forces any, else the
        policy's. The drafter sits out a round led by forced tokens: its drafts after them would
        cost and be accepted unlike any round the policy measures (forced drafts say nothing of
        the drafter), so every round the drafter runs in is one the policy can judge."""
        self._limits = tuple(f if f else k for k, f in zip(limits, self.nforced))
        return self._limits

    def drafter_steps(self) -> int:
        """Steps the proposer must draft: up to the longest count of a row that counts more
        drafts than its grammar forces (none when forced tokens are all there is to draft)."""
        return max((k for k, f in zip(self._limits, self.nforced) if k > f), default=0)

    def forced_at(self, i: int, tokens: mx.array) -> mx.array:
        """(B,) draft i with the forced tokens in place (they feed the drafter's next step)."""
        if self._forced is None or i >= self._forced[0].shape[1]:
            return tokens
        forced, where = self._forced
        return mx.where(where[:, i], forced[:, i], tokens)

    def force(self, drafts):
        """The round's drafts with each row's forced tokens first (q one-hot on them)."""
        if self._forced is None:
            return drafts
        k = drafts.tokens.shape[1]
        forced, where = (a[:, :k] for a in self._forced)
        pad = k - forced.shape[1]  # the round drafts at least as many as any row is forced
        forced, where = mx.pad(forced, [(0, 0), (0, pad)]), mx.pad(where, [(0, 0), (0, pad)])
        tokens = mx.where(where, forced, drafts.tokens)
        q = drafts.q
        if q is not None:
            one_hot = mx.arange(q.shape[-1])[None, None] == tokens[..., None]
            q = mx.where(where[..., None], one_hot.astype(q.dtype), q)
        limit = drafts.limit  # None: every draft is real, forced ones among them
        if limit is not None:
            limit = mx.maximum(limit, mx.array(self.nforced, dtype=limit.dtype))
        return dataclasses.replace(drafts, tokens=tokens, q=q, limit=limit)

    def draft_logits(self, logits: mx.array, drafted: Sequence[mx.array], history: Optional[mx.array],
                     base: mx.array) -> Optional[mx.array]:
        """(B, V) the drafter's logits for draft len(drafted) processed as the target's are at that
        position: bias and penalties from the history and the drafts before it. A grammar's mask
        there depends on those drafts, which only the device knows yet: the mask of the round's
        first position stands in for it (the drafts stay where the text is, inside a string, say;
        the verify applies the true masks). None when nothing changes them."""
        x = None
        if self.counting or any(r.penalties.logit_bias for r in self.rows):
            before = mx.stack(drafted, axis=1) if drafted else mx.zeros((logits.shape[0], 0), dtype=mx.int32)
            seen = mx.ones((1, before.shape[1]), dtype=mx.bool_)
            x = self._penalize(logits[:, None].astype(mx.float32), before, seen, history, base)[:, 0]
        if self.grammars:
            x = logits.astype(mx.float32) if x is None else x
            masked = mx.where(self._first_masks(), x, -mx.inf)
            x = mx.where(mx.isfinite(masked).any(axis=-1, keepdims=True), masked, x)  # the drafter allows none: as is
        return x

    def _first_masks(self) -> mx.array:
        """(B, V) each grammar's mask at the round's first position (all allowed without one)."""
        if self._first is None:
            bits = np.full((len(self.rows), self.grammars[0][1].vocab.words), -1, dtype=np.int32)
            for b, grammar in self.grammars:
                bits[b] = grammar.mask[0]
            word, shift = _bit_index(self.vocab_size)
            self._first = ((mx.take(mx.array(bits), word, axis=-1) >> shift) & 1).astype(mx.bool_)
        return self._first

    # ---- the verify phase --------------------------------------------------------------------

    def __call__(self, logits: mx.array, drafts: mx.array, history: Optional[mx.array], base: mx.array) -> mx.array:
        """(B, K+1, V) processed logits of a round's verified positions.

        Args:
            logits: (B, K+1, V) the target's logits at [last token, d_1 .. d_K].
            drafts: (B, K) the drafts.
            history: (B, T) each row's tokens by position, -1 where unknown (needed for penalties).
            base: (B,) position of each row's last token.
        """
        if self.grammars:
            mx.async_eval(logits)  # the device verifies while the host computes the masks
        k = drafts.shape[1]
        x = logits.astype(mx.float32)
        if self.counting or any(r.penalties.logit_bias for r in self.rows):
            seen = mx.arange(k)[None] < mx.arange(k + 1)[:, None]  # (K+1, K): position j sees d_1..d_j
            x = self._penalize(x, drafts, seen, history, base)
        if self.grammars:
            x = mx.where(self._allowed(drafts, k), x, -mx.inf)
        return x

    def counted(self, limit: mx.array) -> mx.array:
        """(B,) the drafts that count, fewer for a row whose grammar dead-ends inside the round."""
        if self._cap is None:
            return limit
        return mx.minimum(limit, mx.array(self._cap, dtype=limit.dtype))

    def _allowed(self, drafts: mx.array, k: int) -> mx.array:
        """(B, K+1, V) the grammars' masks (every token allowed for rows without one)."""
        bits = self.masks(drafts.tolist() if k else [[]] * drafts.shape[0], k)
        word, shift = _bit_index(self.vocab_size)
        return ((mx.take(mx.array(bits), word, axis=-1) >> shift) & 1).astype(mx.bool_)

    def masks(self, drafts: list, k: int) -> np.ndarray:
        """(B, K+1, words) int32 bitmasks of the round's positions, from the drafts read back."""
        words = self.grammars[0][1].vocab.words
        bits = np.full((len(drafts), k + 1, words), -1, dtype=np.int32)
        self._cap = [k] * len(drafts)
        for b, grammar in self.grammars:
            self._cap[b] = grammar.masks(drafts[b][: self._limits[b]], bits[b])
        return bits

    def _penalize(self, x: mx.array, drafts: mx.array, seen: mx.array, history: Optional[mx.array],
                  base: mx.array) -> mx.array:
        """Bias, then penalties, at L positions: position l sees the drafts where `seen[l]`."""
        B, L, V = x.shape
        presence, frequency, repetition, bias = self._arrays(V)
        if bias is not None:
            x = x + bias[:, None]
        if not self.counting:
            return x
        output, every = _counts(history, base, mx.array([r.start for r in self.rows], dtype=mx.int32), V)
        if drafts.shape[1]:  # the drafts each position sees count as output
            rows = mx.broadcast_to(mx.arange(B)[:, None, None], (B, L, drafts.shape[1]))
            at = mx.broadcast_to(mx.arange(L)[None, :, None], rows.shape)
            tokens = mx.broadcast_to(drafts[:, None, :], rows.shape)
            extra = mx.zeros((B, L, V)).at[rows, at, tokens].add(mx.broadcast_to(seen[None], rows.shape).astype(mx.float32))
            output, every = output[:, None] + extra, every[:, None] + extra
        else:
            output, every = output[:, None], every[:, None]
        r = repetition[:, None, None]
        x = mx.where(every > 0, mx.where(x > 0, x / r, x * r), x)
        return x - frequency[:, None, None] * output - presence[:, None, None] * (output > 0)

    def _arrays(self, V: int):
        if self._coefficients is None:
            p = [r.penalties for r in self.rows]
            bias = None
            pairs = [(b, t, v) for b, q in enumerate(p) for t, v in q.logit_bias]
            if pairs:
                rows, tokens, values = zip(*pairs)
                bias = mx.zeros((len(p), V)).at[mx.array(rows), mx.array(tokens)].add(mx.array(values))
            self._coefficients = (mx.array([q.presence for q in p]), mx.array([q.frequency for q in p]),
                                  mx.array([q.repetition for q in p]), bias)
        return self._coefficients

    # ---- what the round emitted ----------------------------------------------------------------

    def logprobs(self, logits: mx.array, tokens: mx.array) -> Optional[tuple]:
        """(log-probability of each emitted token (B, K+1), its top alternatives' ids and
        log-probabilities (B, K+1, n)) from the processed logits; None when no row asked."""
        if self.top is None:
            return None
        x = logits.astype(mx.float32)
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(x, mx.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
        if self.top == 0:
            return chosen, None, None
        ids = mx.argpartition(-x, self.top - 1, axis=-1)[..., : self.top]
        values = mx.take_along_axis(x, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)
        return chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def row_logprobs(out: tuple, b: int, count: int, top: Optional[int]) -> list:
    """Row b's first `count` entries of `Processors.logprobs` (read back with `tolist`) as
    (logprob, ((token, logprob), ...)) per token; alternatives the processors ruled out are left out."""
    chosen, ids, values = out
    entries = []
    for j in range(count):
        alternatives = ()
        if top:
            alternatives = tuple((t, v) for t, v in zip(ids[b][j][:top], values[b][j][:top]) if v != -math.inf)
        entries.append((chosen[b][j], alternatives))
    return entries


def _counts(history: mx.array, base: mx.array, start: mx.array, V: int) -> tuple[mx.array, mx.array]:
    """(B, V) how often each token occurs among the known positions <= base: from `start` on
    (the output), and anywhere (the prompt too)."""
    B, T = history.shape
    position = mx.arange(T, dtype=mx.int32)[None]
    known = (history >= 0) & (position <= base[:, None])
    rows = mx.broadcast_to(mx.arange(B)[:, None], (B, T))
    tokens = mx.maximum(history, 0)
    output = mx.zeros((B, V)).at[rows, tokens].add((known & (position >= start[:, None])).astype(mx.float32))
    every = mx.zeros((B, V)).at[rows, tokens].add(known.astype(mx.float32))
    return output, every


_BITS: dict[int, tuple[mx.array, mx.array]] = {}


def _bit_index(V: int) -> tuple[mx.array, mx.array]:
    """Where token v's bit is in a bitmask: (word, shift), (V,) each."""
    if V not in _BITS:
        v = mx.arange(V, dtype=mx.int32)
        _BITS[V] = (v // 32, v % 32)
    return _BITS[V]
