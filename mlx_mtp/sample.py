"""Sampling transforms and speculative-decoding acceptance rules.

All distributions are float32 over the last axis. `probs` is the single
transform applied identically to the target (p) and the drafter (q); the
rejection rule is exact only when drafts are sampled from that same q.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

# Smallest normal float32: the lower bound for Gumbel uniforms so that
# -log(-log(u)) stays finite (mx.random.gumbel can return -inf for u == 0).
_TINY = 1.1754944e-38


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


def _one_hot_argmax(logits: mx.array) -> mx.array:
    idx = mx.argmax(logits, axis=-1, keepdims=True)
    return (mx.arange(logits.shape[-1]) == idx).astype(mx.float32)


def probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Turn logits into the sampling distribution.

    Order: temperature, then top-k, top-p, min-p on the tempered
    distribution (HF convention; note mlx-lm's own sampler filters before
    temperature). Masked entries are exactly 0.

    Args:
        logits: Array of shape (..., V), any float dtype.
        params: The sampling configuration.

    Returns:
        float32 array (..., V) summing to 1 on the last axis; a one-hot on the
        argmax when `params.greedy`.
    """
    logits = logits.astype(mx.float32)
    if params.greedy:
        return _one_hot_argmax(logits)
    x = logits * (1.0 / params.temperature)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if 0 < params.top_k < x.shape[-1]:
        x = apply_top_k(x, int(params.top_k))
    if params.top_p < 1.0:
        x = apply_top_p(x, params.top_p)
    if params.min_p > 0.0:
        x = apply_min_p(x, params.min_p)
    return mx.softmax(x, axis=-1, precise=True)


def _gumbel_argmax(weights: mx.array, key: Optional[mx.array]) -> mx.array:
    # Own Gumbel-max rather than mx.random.categorical: its u can be exactly
    # 0, giving a -inf perturbation that can tie with masked (-inf) entries.
    u = mx.random.uniform(_TINY, 1.0, shape=weights.shape, key=key)
    return mx.argmax(mx.log(weights) - mx.log(-mx.log(u)), axis=-1)


def sample(p: mx.array, key: Optional[mx.array] = None) -> mx.array:
    """Draw one token per distribution; zero-probability entries never win.

    Args:
        p: Probabilities (..., V), e.g. from `probs`; need not be normalised.
        key: Optional `mx.random.key` for reproducibility.

    Returns:
        int32 token ids of shape (...).
    """
    return _gumbel_argmax(p.astype(mx.float32), key).astype(mx.int32)


def split_key(key: Optional[mx.array]) -> Tuple[Optional[mx.array], Optional[mx.array]]:
    """(next key, subkey) for reproducible sampling; (None, None) without a key (global RNG)."""
    if key is None:
        return None, None
    key, sub = mx.random.split(key)
    return key, sub


def _prefix_len(match: mx.array) -> mx.array:
    # Number of leading True values along the last axis.
    return mx.cumprod(match.astype(mx.int32), axis=-1).sum(axis=-1)


def _to_lists(n: mx.array, tokens: mx.array) -> Tuple[List[int], List[int]]:
    # One host sync for both outputs.
    n_list, tok_list = mx.stack([n.astype(mx.int32), tokens.astype(mx.int32)]).tolist()
    return n_list, tok_list


def greedy_accept_batch(
    draft_tokens: mx.array, target_argmax: mx.array
) -> Tuple[List[int], List[int]]:
    """Greedy verification of B rows of K drafts.

    Args:
        draft_tokens: (B, K) drafted ids.
        target_argmax: (B, K+1) target argmax at each verified position.

    Returns:
        (n_accepted, next_tokens): lists of length B; next is target_argmax[n].
    """
    draft_tokens, target_argmax = mx.array(draft_tokens), mx.array(target_argmax)
    k = draft_tokens.shape[-1]
    n = _prefix_len(draft_tokens == target_argmax[:, :k])
    nxt = mx.take_along_axis(target_argmax, n[:, None], axis=-1)[:, 0]
    return _to_lists(n, nxt)


def greedy_accept(draft_tokens: mx.array, target_argmax: mx.array) -> Tuple[int, int]:
    """Single-row `greedy_accept_batch`: (K,), (K+1,) -> (n_accepted, next)."""
    drafts, targets = mx.array(draft_tokens)[None], mx.array(target_argmax)[None]
    n, nxt = greedy_accept_batch(drafts, targets)
    return n[0], nxt[0]


def _gather_token_prob(dist: mx.array, tokens: mx.array) -> mx.array:
    return mx.take_along_axis(dist, tokens[..., None], axis=-1)[..., 0]


def rejection_accept_batch(
    draft_tokens: mx.array, q: mx.array, p: mx.array, key: Optional[mx.array] = None
) -> Tuple[List[int], List[int]]:
    """Speculative-sampling verification (Leviathan et al. / Chen et al.).

    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the
    first rejection the replacement comes from norm(max(p_i - q_i, 0)); if
    all K are accepted a bonus token comes from p_K. Exact provided the
    drafts were sampled from q. Everything is evaluated in one graph with a
    single host sync.

    Args:
        draft_tokens: (B, K) drafts, sampled from q.
        q: (B, K, V) drafter distributions the drafts were sampled from.
        p: (B, K+1, V) target distributions (same transform as q).
        key: Optional `mx.random.key`.

    Returns:
        (n_accepted, next_tokens): Python int lists of length B.
    """
    draft_tokens = mx.array(draft_tokens)
    q, p = q.astype(mx.float32), p.astype(mx.float32)
    b, k = draft_tokens.shape
    k_u, k_draw = split_key(key)

    p_d = _gather_token_prob(p[:, :k], draft_tokens)
    q_d = _gather_token_prob(q, draft_tokens)
    u = mx.random.uniform(shape=(b, k), key=k_u)
    # p_d >= q_d short-circuits so fp rounding of u * q_d can never reject a
    # sure accept; q_d == 0 (impossible for true q-samples) always rejects.
    accept = (q_d > 0) & ((p_d >= q_d) | (u * q_d < p_d))
    n = _prefix_len(accept)

    p_n = mx.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    if k > 0:
        q_n = mx.take_along_axis(q, mx.minimum(n, k - 1)[:, None, None], axis=1)[:, 0]
        # Bonus position (n == K) has no drafter term: residual is p_K itself.
        q_n = mx.where((n < k)[:, None], q_n, 0.0)
    else:
        q_n = mx.zeros_like(p_n)
    residual = mx.maximum(p_n - q_n, 0.0)
    # Residual is all zero only if p_n == q_n (then rejection is impossible
    # for real drafts); fall back to p_n rather than sampling from nothing.
    empty = residual.sum(axis=-1, keepdims=True) <= 0
    nxt = _gumbel_argmax(mx.where(empty, p_n, residual), k_draw)
    return _to_lists(n, nxt)


def rejection_accept(
    draft_tokens: mx.array, q: mx.array, p: mx.array, key: Optional[mx.array] = None
) -> Tuple[int, int]:
    """Single-row `rejection_accept_batch`: (K,), (K, V), (K+1, V) -> ints."""
    n, nxt = rejection_accept_batch(mx.array(draft_tokens)[None], q[None], p[None], key)
    return n[0], nxt[0]


def acceptance_rate(p: mx.array, q: mx.array) -> float:
    """Theoretical per-position acceptance sum_x min(p(x), q(x)) for (V,) inputs."""
    return mx.minimum(p.astype(mx.float32), q.astype(mx.float32)).sum().item()
