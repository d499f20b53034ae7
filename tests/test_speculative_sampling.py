"""End to end: MTP sampling with the real tiny target and an independent random drafter has
exactly the target's distribution, and the measured acceptance matches sum_x min(p, q)."""

import math

import mlx.core as mx
import numpy as np
from conftest import reference, tiny_drafter, tiny_target
from test_sample import STRICT, _chi2

from mlx_mtp.sample import SamplingParams, acceptance_rate, probs
from mlx_mtp.speculative import RoundState, run_round

ROWS, K = 4000, 2
SAMPLING = SamplingParams(temperature=1.0, top_k=40)


def setup():
    target, ref = tiny_target("dense"), reference("dense")
    prompt, bonus = ref["prompt"].tolist(), int(ref["greedy"][0])
    cache = target.make_cache(ROWS, max_rollback=K + 1)
    out = target(mx.array([prompt] * ROWS), cache)
    state = RoundState(mx.full((ROWS,), bonus, dtype=mx.int32), out.hidden[:, -1], out.shared_kv)
    return target, prompt + [bonus], cache, state


def test_mtp_sampled_tokens_follow_the_target_distribution():
    target, context, cache, state = setup()
    drafter, key = tiny_drafter("dense"), mx.random.key(3)
    emitted = [[] for _ in range(ROWS)]
    first_accepted = []
    while min(len(e) for e in emitted) < 2:
        key, sub = mx.random.split(key)
        result = run_round(target, drafter, cache, state, K, SAMPLING, [8] * ROWS, [frozenset()] * ROWS, sub)
        if not first_accepted:
            first_accepted = [n > 0 for n in result.accepted]
        for row, tokens in zip(emitted, result.emitted):
            row.extend(tokens)
        state = result.state
    first = np.array([e[0] for e in emitted])
    second = np.array([e[1] for e in emitted])

    # exact target laws: p1(x) and p2(y) = sum_x p1(x) p(y | x)
    p1 = np.array(probs(target(mx.array([context])).logits[0, -1], SAMPLING))
    nxt = target(mx.array([context + [x] for x in range(128)])).logits[:, -1]
    p2 = p1 @ np.array(probs(nxt, SAMPLING))
    for tokens, law in ((first, p1), (second, p2)):
        stat, dof, pvalue = _chi2(np.bincount(tokens, minlength=128), law)
        assert pvalue > STRICT, (stat, dof)

    # acceptance of the first draft vs the theory: sum_x min(p1(x), q1(x))
    q1 = first_draft_distribution(target, drafter, context)
    theory = acceptance_rate(mx.array(p1), q1)
    measured = float(np.mean(first_accepted))
    assert 0.05 < theory < 0.95  # rejections and acceptances both really happen
    assert abs(measured - theory) < 5 * math.sqrt(theory * (1 - theory) / ROWS)


def first_draft_distribution(target, drafter, context):
    cache = target.make_cache(1, max_rollback=K + 1)
    out = target(mx.array([context[:-1]]), cache)
    step = drafter.draft_step(target.embed(mx.array([[context[-1]]]))[:, 0], out.hidden[:, -1],
                              out.shared_kv, mx.array([len(context) - 1]))
    return probs(step.full_logits(128), SAMPLING)[0]
