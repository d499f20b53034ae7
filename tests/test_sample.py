"""Tests for mlx_mtp.decode.sample: transforms, acceptance rules and exactness.

The exactness tests simulate speculative decoding on a toy "language" over
V=6 tokens: target and drafter are first-order Markov chains, p(x_t | x_t-1)
and q(x_t | x_t-1), both the `probs` transform (temperature 0.8, top-k 4) of
different random logit tables. So q really depends on the previous draft and
p is evaluated on the drafted prefix, as in real decoding, and a misaligned
p/q index or a wrong residual changes the law of the emitted sequence.
Whole batches of independent generations run as one batched call.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.decode.sample import (
    ACCEPT,
    DRAFT,
    RESAMPLE,
    SamplingParams,
    acceptance_rate,
    batch_probs,
    greedy_accept,
    probs,
    rejection_accept,
    sample,
    uniform,
)

V, K, B = 6, 3, 100000
CONTEXT = 0  # token preceding the first speculative step
N_TOKENS = K + 1  # emitted prefix whose joint law is tested; includes a bonus
PARAMS = SamplingParams(temperature=0.8, top_k=4)
P_LOGITS = mx.array(np.random.default_rng(1).normal(0, 2, (V, V)), mx.float32)
# The drafter roughly tracks the target (~70% acceptance) so that long accepted
# runs and bonus tokens are common, yet top-k masks different tokens.
Q_NOISE = np.random.default_rng(7).normal(0, 1, (V, V))
Q_LOGITS = P_LOGITS + mx.array(Q_NOISE, mx.float32)
P_TAB = probs(P_LOGITS, PARAMS)  # row = previous token
Q_TAB = probs(Q_LOGITS, PARAMS)
STRICT = 1e-4  # p-value a correct sampler must exceed (fixed seeds)


# ---------------------------------------------------------------- statistics


def _chi2_sf(stat, dof):
    """Chi-square upper tail via the Wilson-Hilferty normal approximation."""
    if not math.isfinite(stat):
        return 0.0
    s = 2.0 / (9.0 * dof)
    z = ((stat / dof) ** (1.0 / 3.0) - (1.0 - s)) / math.sqrt(s)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _chi2(counts, expected_p):
    """Pearson chi-square of counts against probabilities.

    Cells with expected count < 5 are pooled; any count in a zero-probability
    cell makes the statistic infinite.
    """
    counts = np.asarray(counts, np.float64).ravel()
    expected_p = np.asarray(expected_p, np.float64).ravel()
    expected = expected_p / expected_p.sum() * counts.sum()
    zero = expected_p == 0
    if counts[zero].sum() > 0:
        return math.inf, 1, 0.0
    small = ~zero & (expected < 5)
    big = ~zero & ~small
    obs = np.append(counts[big], counts[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat, dof, _chi2_sf(stat, dof)


def test_chi2_helper_calibrated():
    # Even dof has a closed form: sf(x; 2m) = exp(-x/2) sum_{i<m} (x/2)^i / i!.
    def exact_sf(x, dof):
        h = x / 2.0
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(dof // 2))

    for dof, x in [(4, 23.5), (10, 35.6), (50, 96.2), (200, 283.3)]:
        assert exact_sf(x, dof) == pytest.approx(1e-4, rel=0.1)
        assert _chi2_sf(x, dof) == pytest.approx(exact_sf(x, dof), rel=0.35)
    assert _chi2_sf(5.0, 5) > 0.3


# ---------------------------------------------------------------- transforms


def _hand_logits():
    return mx.log(mx.array([0.15, 0.5, 0.05, 0.3]))


def test_params_validation():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy
    for bad in (
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(min_p=-0.1),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_temperature_matches_softmax():
    logits = mx.array(np.random.default_rng(0).normal(size=(3, 10)), mx.float32)
    got = probs(logits, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(got, mx.softmax(logits / 0.5, axis=-1), atol=1e-6)


def test_top_k_keeps_exactly_k():
    logits = mx.array(np.random.default_rng(0).normal(size=(5, 20)), mx.float32)
    got = np.array(probs(logits, SamplingParams(temperature=1.3, top_k=4)))
    top4 = np.argsort(-np.array(logits), axis=-1)[:, :4]
    for row, keep in zip(got, top4):
        assert set(np.flatnonzero(row)) == set(keep)
    lg = np.array(logits) / 1.3
    ref = np.zeros_like(lg)
    np.put_along_axis(ref, top4, np.take_along_axis(np.exp(lg), top4, -1), -1)
    np.testing.assert_allclose(got, ref / ref.sum(-1, keepdims=True), atol=1e-6)
    assert np.array_equal(
        np.array(probs(logits, SamplingParams(1.0, top_k=20))),
        np.array(probs(logits, SamplingParams(1.0))),
    )


@pytest.mark.parametrize(
    "params, expected",
    [
        # nucleus of [.15, .5, .05, .3]: {.5, .3} reaches .75
        (SamplingParams(1.0, top_p=0.75), [0, 0.625, 0, 0.375]),
        (SamplingParams(1.0, top_p=0.85), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]),
        # top token is always kept
        (SamplingParams(1.0, top_p=0.1), [0, 1, 0, 0]),
        # min-p: keep p >= 0.2 * 0.5
        (SamplingParams(1.0, min_p=0.2), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]),
        (SamplingParams(1.0, min_p=0.5), [0, 0.625, 0, 0.375]),
        # temperature 2 first: sqrt-flattened probs, so .75 needs three tokens
        (
            SamplingParams(2.0, top_p=0.75),
            np.sqrt([0.15, 0.5, 0, 0.3]) / np.sqrt([0.15, 0.5, 0.3]).sum(),
        ),
    ],
)
def test_nucleus_and_min_p_hand_examples(params, expected):
    got = probs(_hand_logits(), params)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert np.array_equal(np.array(got) == 0, np.array(expected) == 0)


def test_greedy_is_one_hot_float32():
    logits = mx.array(np.random.default_rng(0).normal(size=(2, 3, 7)), mx.bfloat16)
    got = probs(logits, SamplingParams())
    assert got.dtype == mx.float32 and got.shape == (2, 3, 7)
    want = np.eye(7)[np.argmax(np.array(logits.astype(mx.float32)), -1)]
    assert np.array_equal(np.array(got), want)
    assert probs(logits, SamplingParams(0.9, top_p=0.9)).dtype == mx.float32


def test_batch_probs_applies_each_rows_parameters():
    logits = mx.array(np.random.default_rng(3).normal(size=(4, 2, 9)), mx.float32)
    params = [SamplingParams(), SamplingParams(0.7, top_k=3), SamplingParams(), SamplingParams(1.5, top_p=0.8)]
    got = np.array(batch_probs(logits, params))
    for row, p in enumerate(params):
        np.testing.assert_allclose(got[row], np.array(probs(logits[row], p)), atol=1e-6)


# ---------------------------------------------------------------- random numbers and sample


def _uniforms(n, seed=0):
    return mx.random.uniform(shape=(n,), key=mx.random.key(seed))


def test_sample_never_draws_zero_mass():
    p = mx.broadcast_to(mx.array([0.2, 0.0, 0.5, 0.0, 0.3, 0.0]), (20000, 6))
    draws = np.array(sample(p, _uniforms(20000, 3)))
    counts = np.bincount(draws, minlength=6)
    stat, dof, pval = _chi2(counts, [0.2, 0, 0.5, 0, 0.3, 0])
    assert counts[[1, 3, 5]].sum() == 0 and pval > STRICT, (stat, dof, pval)
    one_hot = mx.broadcast_to(mx.array([0.0, 0.0, 1.0, 0.0]), (20000, 4))
    assert np.all(np.array(sample(one_hot, _uniforms(20000, 4))) == 2)
    edges = mx.array([1e-9, 0.5, 1 - 1e-7])  # extreme uniforms stay on tokens with mass
    assert set(np.array(sample(mx.broadcast_to(mx.array([0.0, 0.3, 0.7, 0.0]), (3, 4)), edges)).tolist()) <= {1, 2}


def test_uniform_is_a_function_of_seed_position_and_stream():
    seeds = mx.array([7, 7, 8], dtype=mx.uint32)
    pos = mx.broadcast_to(mx.arange(50_000, dtype=mx.int32)[None], (3, 50_000))
    u = np.array(uniform(seeds, pos, ACCEPT))
    assert np.array_equal(u, np.array(uniform(seeds, pos, ACCEPT)))  # no hidden state
    assert np.array_equal(u[0], u[1]) and not np.array_equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1
    stat, dof, pval = _chi2(np.histogram(u[0], bins=50, range=(0, 1))[0], np.full(50, 1 / 50))
    assert pval > STRICT, (stat, dof, pval)
    other = np.array(uniform(seeds, pos, DRAFT))[0]
    for a, b in ((u[0][:-1], u[0][1:]), (u[0], other), (u[0], u[2])):  # positions, streams, seeds
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.02
    assert uniform(seeds, pos[:, :5], RESAMPLE).shape == (3, 5)


# ---------------------------------------------------------------- greedy accept


def _lists(n, nxt):
    return np.array(n).tolist(), np.array(nxt).tolist()


@pytest.mark.parametrize("k", range(1, 7))
def test_greedy_accept_every_rejection_position(k):
    rng = np.random.default_rng(k)
    drafts, targets, want_n = [], [], []
    for reject_at in range(k + 1):  # reject_at == k means all accepted
        target = rng.integers(0, 100, k + 1)
        draft = target[:k].copy()
        if reject_at < k:
            draft[reject_at] = target[reject_at] + 1
        drafts.append(draft), targets.append(target), want_n.append(reject_at)
    n, nxt = _lists(*greedy_accept(mx.array(np.stack(drafts)), mx.array(np.stack(targets))))
    assert n == want_n
    assert nxt == [int(t[i]) for t, i in zip(targets, want_n)]
    limit = mx.array([min(i, 1) for i in range(k + 1)])  # rows counting 0 or 1 drafts
    n, nxt = _lists(*greedy_accept(mx.array(np.stack(drafts)), mx.array(np.stack(targets)), limit))
    assert n == [min(w, lim) for w, lim in zip(want_n, np.array(limit).tolist())]
    assert nxt == [int(t[i]) for t, i in zip(targets, n)]


# ---------------------------------------------------------------- rejection accept


def _deterministic_rows():
    """Row j rejects at position j (p_j has no mass on the draft); row K keeps all."""
    eye = np.eye(5, dtype=np.float32)
    drafts = np.zeros((K + 1, K), np.int32)
    q = np.broadcast_to(eye[0], (K + 1, K, 5)).copy()
    p = np.full((K + 1, K + 1, 5), 0.2, np.float32)
    for j in range(K + 1):
        p[j, :j] = eye[0]
        p[j, j] = eye[j + 1]  # correction (j < K) or bonus (j == K)
    return mx.array(drafts), mx.array(q), mx.array(p)


def _accept(drafts, q, p, seed=0, limit=None):
    b, k = drafts.shape
    keys = mx.random.split(mx.random.key(seed))
    u = mx.random.uniform(shape=(b, k), key=keys[0])
    u_draw = mx.random.uniform(shape=(b, k + 1), key=keys[1])
    return _lists(*rejection_accept(drafts, q, p, u, u_draw, limit))


def test_forced_outcomes_and_per_row_limits():
    drafts, q, p = _deterministic_rows()
    assert _accept(drafts, q, p) == (list(range(K + 1)), list(range(1, K + 2)))
    # Row j counting only `limit` drafts: accepted min(j, limit); at the limit the bonus
    # comes from p there (no drafter term), below it the correction.
    limit = mx.array([1] * (K + 1))
    n, nxt = _accept(drafts, q, p, limit=limit)
    assert n == [0] + [1] * K
    # row 0: correction eye[1]; row 1: bonus p[1, 1] = eye[2]; rows j >= 2: bonus p[j, 1] = eye[0]
    assert nxt == [1, 2] + [0] * (K - 1)


def _random_problem(b, k, v, seed):
    keys = mx.random.split(mx.random.key(seed), 3)
    params = SamplingParams(1.0, top_k=v // 2)
    q = probs(mx.random.normal((b, k, v), key=keys[0]), params)
    p = probs(mx.random.normal((b, k + 1, v), key=keys[1]), params)
    return sample(q, mx.random.uniform(shape=(b, k), key=keys[2])), q, p


def test_same_uniforms_same_decisions():
    drafts, q, p = _random_problem(64, 4, 8, seed=5)
    first = _accept(drafts, q, p, seed=11)
    assert _accept(drafts, q, p, seed=11) == first
    assert any(_accept(drafts, q, p, seed=s) != first for s in (12, 13))
    assert all(0 <= x <= 4 for x in first[0])


def test_zero_q_draft_rejected_and_empty_residual_falls_back_to_p():
    # Draft 2 has q = p = 0 (cannot come from q): must reject, and the residual
    # max(p - q, 0) is all zero, so the replacement is drawn from p itself.
    rows = 4000
    pq = mx.broadcast_to(mx.array([[0.5, 0.5, 0.0, 0.0]]), (rows, 1, 4))
    bonus = mx.broadcast_to(mx.array([[0.0, 0, 0, 1]]), (rows, 1, 4))
    p = mx.concatenate([pq, bonus], axis=1)
    drafts = mx.full((rows, 1), 2, mx.int32)
    n, nxt = _accept(drafts, pq, p, seed=9)
    assert set(n) == {0} and set(nxt) <= {0, 1}
    assert abs(np.mean(nxt) - 0.5) < 5 * math.sqrt(0.25 / rows)


def test_no_drafts_draws_from_p0():
    p = mx.broadcast_to(mx.array([[0.0, 0.0, 1.0]]), (3, 1, 3))
    n, nxt = _accept(mx.zeros((3, 0), mx.int32), mx.zeros((3, 0, 3)), p)
    assert n == [0, 0, 0] and nxt == [2, 2, 2]


def test_acceptance_rate_formula():
    p, q = mx.array([0.5, 0.5, 0.0]), mx.array([0.25, 0.25, 0.5])
    assert acceptance_rate(p, q) == 0.5
    assert acceptance_rate(P_TAB[0], P_TAB[0]) == pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------- exactness


def _propose_sampled(prev, key):
    """Our drafter: d_i ~ q(. | d_{i-1}), q reported as-is."""
    drafts, qs = [], []
    for sub in mx.random.split(key, K):
        qi = Q_TAB[prev]
        prev = sample(qi, mx.random.uniform(shape=prev.shape, key=sub))
        drafts.append(prev), qs.append(qi)
    return mx.stack(drafts, 1), mx.stack(qs, 1)


def _propose_transformers(prev, key):
    """transformers' rule: greedy drafts, but q = softmax of raw drafter logits.

    The acceptance test min(1, p/q) and the residual norm((p - q)+) are the
    same arithmetic as ours, so only the proposal is broken: the drafts are
    not samples of the q used in the ratio.
    """
    del key
    drafts, qs = [], []
    for _ in range(K):
        logits = Q_LOGITS[prev]
        qs.append(mx.softmax(logits, axis=-1))
        prev = mx.argmax(logits, axis=-1).astype(mx.int32)
        drafts.append(prev)
    return mx.stack(drafts, 1), mx.stack(qs, 1)


def _simulate(propose, seed):
    """Run B independent generations until each has N_TOKENS tokens.

    Returns:
        (tokens (B, N_TOKENS), n_accepted of the first step (B,)).
    """
    key = mx.random.key(seed)
    prev = mx.full((B,), CONTEXT, mx.int32)
    out = np.full((B, N_TOKENS), -1)
    count = np.zeros(B, np.int64)
    rows = np.arange(B)
    first_n = None
    while count.min() < N_TOKENS:
        key, k_prop, k_acc, k_draw = mx.random.split(key, 4)
        drafts, q = propose(prev, k_prop)
        p = P_TAB[mx.concatenate([prev[:, None], drafts], axis=1)]
        u, u_draw = mx.random.uniform(shape=(B, K), key=k_acc), mx.random.uniform(shape=(B, K + 1), key=k_draw)
        n, nxt = rejection_accept(drafts, q, p, u, u_draw)
        n, nxt = np.array(n), np.array(nxt)
        emitted = np.concatenate([np.array(drafts), nxt[:, None]], axis=1)
        emitted[rows, n] = nxt
        for j in range(K + 1):
            pos = count + j
            m = (j <= n) & (pos < N_TOKENS)
            out[rows[m], pos[m]] = emitted[m, j]
        count += n + 1
        prev = mx.array(nxt.astype(np.int32))
        first_n = n if first_n is None else first_n
    return out, first_n


def _target_law():
    """Exact law of the first N_TOKENS tokens under the target chain."""
    p = np.array(P_TAB, np.float64)
    p /= p.sum(-1, keepdims=True)
    first = p[CONTEXT]
    return first, np.einsum("a,ab,bc,cd->abcd", first, p, p, p)


def _fit(tokens):
    """Chi-square of the first-token marginal and of the N_TOKENS joint."""
    first, joint = _target_law()
    c1 = np.bincount(tokens[:, 0], minlength=V)
    c3 = np.bincount(tokens @ V ** np.arange(N_TOKENS)[::-1], minlength=V**N_TOKENS)
    return _chi2(c1, first), _chi2(c3, joint)


@pytest.fixture(scope="module")
def ours():
    return _simulate(_propose_sampled, seed=123)


def test_setup_really_rejects():
    # Guard against a vacuous test: drafter and target disagree, including
    # tokens one has masked and the other has not.
    a = acceptance_rate(P_TAB[CONTEXT], Q_TAB[CONTEXT])
    assert 0.3 < a < 0.9
    p0, q0 = np.array(P_TAB[CONTEXT]), np.array(Q_TAB[CONTEXT])
    assert np.any((p0 == 0) & (q0 > 0)) and np.any((q0 == 0) & (p0 > 0))


def test_speculative_sampling_is_exact(ours):
    tokens, _ = ours
    (s1, d1, pv1), (s3, d3, pv3) = _fit(tokens)
    assert pv1 > STRICT, f"first token chi2={s1:.1f} dof={d1} p={pv1:.2g}"
    assert pv3 > STRICT, f"{N_TOKENS}-token joint chi2={s3:.1f} dof={d3} p={pv3:.2g}"


def test_transformers_rule_is_not_exact():
    tokens, _ = _simulate(_propose_transformers, seed=123)
    (s1, d1, pv1), (s3, d3, pv3) = _fit(tokens)
    assert pv1 < 1e-12 and pv3 < 1e-12, (s1, d1, s3, d3)


def test_acceptance_frequency_matches_theory(ours):
    _, first_n = ours
    a = acceptance_rate(P_TAB[CONTEXT], Q_TAB[CONTEXT])
    measured = np.mean(first_n >= 1)
    assert abs(measured - a) < 5 * math.sqrt(a * (1 - a) / B), (measured, a)
    # Whole law of n: P(n >= j) = sum f_j, f_1 = min(p, q)[ctx], f_j+1 = f_j M.
    m = np.minimum(np.array(P_TAB, np.float64), np.array(Q_TAB, np.float64))
    f, tail = m[CONTEXT], [1.0]
    for _ in range(K):
        tail.append(f.sum())
        f = f @ m
    law = -np.diff(np.append(tail, 0.0))
    stat, dof, pval = _chi2(np.bincount(first_n, minlength=K + 1), law)
    assert pval > STRICT, (stat, dof, pval)
