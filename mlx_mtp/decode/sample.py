"""Sampling transforms, counter-based random numbers, and the speculative acceptance rules.

All distributions are float32 over the last axis. `probs` is the single transform applied
identically to the target (p) and the drafter (q); the rejection rule is exact only when
drafts are sampled from that same q.

Random numbers are a pure function of (row seed, token position, purpose): `uniform` hashes
them on the device. A row's output therefore depends on its own seed and positions only,
never on which rows share its batch or on how often other code drew random numbers, and no
random state has to travel between rounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

# Purposes of a random number at one position (streams of the counter-based generator).
DRAFT, ACCEPT, RESAMPLE = 0, 1, 2


@dataclass(frozen=True)
class SamplingParams:
    """Sampling configuration; 0 / 1.0 values disable a filter.

    Attributes:
        temperature: Softmax temperature; 0 means greedy (argmax).
        top_k: Keep the k most likely tokens; 0 disables.
        top_p: Nucleus mass in (0, 1]; 1.0 disables.
        min_p: Keep tokens with prob >= min_p * max prob; 0 disables.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative int, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature == 0)."""
        return self.temperature == 0.0


def probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Turn logits into the sampling distribution.

    Order: temperature, then top-k, top-p, min-p on the tempered distribution (HF
    convention; mlx-lm's own sampler filters before temperature). Masked entries are 0.

    Args:
        logits: (..., V), any float dtype.
        params: the sampling configuration.

    Returns:
        float32 (..., V) summing to 1 on the last axis; a one-hot on the argmax when greedy.
    """
    logits = logits.astype(mx.float32)
    if params.greedy:
        idx = mx.argmax(logits, axis=-1, keepdims=True)
        return (mx.arange(logits.shape[-1]) == idx).astype(mx.float32)
    x = logits * (1.0 / params.temperature)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if 0 < params.top_k < x.shape[-1]:
        x = apply_top_k(x, int(params.top_k))
    if params.top_p < 1.0:
        x = apply_top_p(x, params.top_p)
    if params.min_p > 0.0:
        x = apply_min_p(x, params.min_p)
    return mx.softmax(x, axis=-1, precise=True)


def params_key(params: Sequence[SamplingParams]) -> tuple:
    """Each row's sampling parameters as a compile constant (rebuilt with `SamplingParams(*row)`)."""
    return tuple(dataclasses.astuple(p) for p in params)


def batch_probs(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """`probs` with each row's own parameters: logits (B, ..., V), params one per row."""
    groups: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault(p, []).append(row)
    if len(groups) == 1:
        return probs(logits, params[0])
    parts, order = [], []
    for p, rows in groups.items():
        parts.append(probs(logits[mx.array(rows)], p))
        order += rows
    inverse = mx.argsort(mx.array(order))
    return mx.concatenate(parts)[inverse]


# ---- counter-based random numbers ----------------------------------------------------------


def _mix(x: mx.array) -> mx.array:
    """A 32-bit integer finalizer (good avalanche: every input bit flips ~half the output bits)."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x7FEB352D, dtype=mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(0x846CA68B, dtype=mx.uint32)
    return x ^ (x >> 16)


def uniform(seeds: mx.array, positions: mx.array, stream: int) -> mx.array:
    """Uniform numbers in (0, 1), one per (row seed, position), for one purpose `stream`.

    Args:
        seeds: (B,) uint32 per-row seeds.
        positions: (B, ...) int token positions.
        stream: DRAFT, ACCEPT or RESAMPLE.
    """
    seeds = seeds.astype(mx.uint32).reshape(seeds.shape + (1,) * (positions.ndim - 1))
    counter = positions.astype(mx.uint32) * mx.array(4, dtype=mx.uint32) + mx.array(stream, dtype=mx.uint32)
    bits = _mix(_mix(counter ^ _mix(seeds)) + seeds)
    # 24 random bits, centred in their cell: never exactly 0 or 1.
    return ((bits >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))


def sample(p: mx.array, u: mx.array) -> mx.array:
    """Inverse-CDF draw: one token per distribution, zero-probability entries never win.

    Args:
        p: (..., V) probabilities (need not be normalised).
        u: (...) uniforms in (0, 1).

    Returns:
        int32 token ids (...).
    """
    cdf = mx.cumsum(p.astype(mx.float32), axis=-1)
    x = u[..., None] * cdf[..., -1:]
    # The first entry whose cumulative mass exceeds x; an entry with p = 0 has the same
    # cumulative mass as the one before it, so it is never the first.
    return mx.minimum((cdf < x).sum(axis=-1), p.shape[-1] - 1).astype(mx.int32)


# ---- acceptance ----------------------------------------------------------------------------


def _prefix_len(match: mx.array) -> mx.array:
    """Number of leading True values along the last axis."""
    return mx.cumprod(match.astype(mx.int32), axis=-1).sum(axis=-1)


def _limit(accept: mx.array, limit: Optional[mx.array]) -> mx.array:
    """Drafts at index >= limit[b] do not count for row b (a row drafting fewer than K)."""
    if limit is None:
        return accept
    return accept & (indices(accept.shape[-1]) < limit[:, None])


_INDICES: dict = {}


def indices(n: int) -> mx.array:
    """(1, n) int32 0..n-1, evaluated: a constant in a compiled function (`mx.arange` there is a
    graph node, and its row view another), usable from any thread."""
    if n not in _INDICES:
        _INDICES[n] = mx.array(np.arange(n, dtype=np.int32)[None])
    return _INDICES[n]


def greedy_accept(drafts: mx.array, target_argmax: mx.array, limit: Optional[mx.array] = None):
    """Greedy verification of B rows of K drafts, on the device.

    Args:
        drafts: (B, K) drafted ids.
        target_argmax: (B, K+1) the target's argmax at each verified position.
        limit: optional (B,) number of drafts that count per row.

    Returns:
        (n, next): (B,) accepted drafts and the target's token at n.
    """
    k = drafts.shape[-1]
    if k == 0:  # a plain step (no draft accepted: a constant, not a graph node)
        return mx.array(np.zeros(drafts.shape[:1], dtype=np.int32)), target_argmax[:, 0].astype(mx.int32)
    n = _prefix_len(_limit(drafts == target_argmax[:, :k], limit))
    return n, mx.take_along_axis(target_argmax, n[:, None], axis=-1)[:, 0].astype(mx.int32)


def _token_prob(dist: mx.array, tokens: mx.array) -> mx.array:
    return mx.take_along_axis(dist, tokens[..., None], axis=-1)[..., 0]


def rejection_accept(drafts: mx.array, q: mx.array, p: mx.array, u_accept: mx.array, u_draw: mx.array,
                     limit: Optional[mx.array] = None):
    """Speculative-sampling verification (Leviathan et al. / Chen et al.), on the device.

    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    the replacement comes from norm(max(p_i - q_i, 0)); if every counted draft is accepted, a
    bonus token comes from p at that position. Exact provided the drafts were sampled from q.
    One-hot p and q (greedy rows) reduce this to greedy verification.

    Args:
        drafts: (B, K) drafts, sampled from q.
        q: (B, K, V) the distributions the drafts were sampled from.
        p: (B, K+1, V) target distributions (the same transform as q).
        u_accept: (B, K) uniforms for the accept tests.
        u_draw: (B, K+1) uniforms for the replacement / bonus draw at each position.
        limit: optional (B,) number of drafts that count per row.

    Returns:
        (n, next): (B,) accepted drafts and the next token.
    """
    q, p = q.astype(mx.float32), p.astype(mx.float32)
    k = drafts.shape[1]
    p_d, q_d = _token_prob(p[:, :k], drafts), _token_prob(q, drafts)
    # p_d >= q_d short-circuits so fp rounding of u * q_d can never reject a sure accept;
    # q_d == 0 (impossible for true q-samples) always rejects.
    accept = (q_d > 0) & ((p_d >= q_d) | (u_accept * q_d < p_d))
    n = _prefix_len(_limit(accept, limit))
    p_n = mx.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    if k:
        q_n = mx.take_along_axis(q, mx.minimum(n, k - 1)[:, None, None], axis=1)[:, 0]
        counted = n < (k if limit is None else mx.minimum(limit, k))
        q_n = mx.where(counted[:, None], q_n, 0.0)  # a bonus position has no drafter term
    else:
        q_n = mx.zeros_like(p_n)
    residual = mx.maximum(p_n - q_n, 0.0)
    # All zero only if p_n == q_n, where rejection is impossible for real drafts: use p_n.
    empty = residual.sum(axis=-1, keepdims=True) <= 0
    u = mx.take_along_axis(u_draw, n[:, None], axis=1)[:, 0]
    return n, sample(mx.where(empty, p_n, residual), u)


def acceptance_rate(p: mx.array, q: mx.array) -> float:
    """Theoretical per-position acceptance sum_x min(p(x), q(x)) for (V,) inputs."""
    return mx.minimum(p.astype(mx.float32), q.astype(mx.float32)).sum().item()
