"""End to end: MTP sampling on the batched round, with the real tiny target and an independent
random drafter, has exactly the target's distribution for each row's own sampling parameters,
and the measured acceptance matches sum_x min(p, q)."""

import math

import mlx.core as mx
import numpy as np
from conftest import reference, tiny_drafter, tiny_target
from test_sample import STRICT, _chi2

from mlx_mtp.decode.drafters import MTPProposer
from mlx_mtp.decode.sample import SamplingParams, acceptance_rate, probs
from mlx_mtp.decode.speculative import BatchState, Plan, run_round

ROWS, K = 4000, 2
# Half the rows sample one way, half another: one verify forward serves both.
GROUPS = (SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=0.7, top_p=0.9))


def setup(n: int = ROWS):
    target, ref = tiny_target("dense"), reference("dense")
    prompt, bonus = ref["prompt"].tolist(), int(ref["greedy"][0])
    cache = target.make_cache(n, max_rollback=2 * K + 2)
    out = target(mx.array([prompt] * n), cache)
    seeds = mx.array(np.random.default_rng(0).integers(0, 2**32, n), dtype=mx.uint32)
    state = BatchState(mx.full((n,), bonus, dtype=mx.int32), out.hidden[:, -1], seeds)
    return target, prompt + [bonus], cache, state


def test_mtp_sampled_tokens_follow_each_rows_target_distribution():
    check_sampling_is_exact(tiny_drafter("dense"))


def check_sampling_is_exact(drafter_model, rows_total: int = ROWS):
    """Sampled MTP rounds with `drafter_model` (test_learn: an adapted one) against the exact laws."""
    target, context, cache, state = setup(rows_total)
    drafter = MTPProposer(drafter_model, target)
    params = tuple(GROUPS[i % 2] for i in range(rows_total))
    plan = Plan(params, (K,) * rows_total)
    emitted = [[] for _ in range(rows_total)]
    first_accepted = None
    while min(len(e) for e in emitted) < 2:
        state, out = run_round(target, drafter, cache, state, plan)
        tokens, accepted = out.tokens.tolist(), out.accepted.tolist()
        first_accepted = first_accepted or [n > 0 for n in accepted]
        for row, toks, n in zip(emitted, tokens, accepted):
            row.extend(toks[: n + 1])
    first, second = np.array([e[0] for e in emitted]), np.array([e[1] for e in emitted])

    nxt = target(mx.array([context + [x] for x in range(128)])).logits[:, -1]
    last = target(mx.array([context])).logits[0, -1]
    q1 = first_draft_logits(target, drafter_model, context)
    for g, sampling in enumerate(GROUPS):
        rows = np.arange(g, rows_total, 2)
        p1 = np.array(probs(last, sampling))  # exact laws: p1(x), p2(y) = sum_x p1(x) p(y | x)
        p2 = p1 @ np.array(probs(nxt, sampling))
        for tokens, law in ((first[rows], p1), (second[rows], p2)):
            stat, dof, pvalue = _chi2(np.bincount(tokens, minlength=128), law)
            assert pvalue > STRICT, (g, stat, dof)
        # acceptance of the first draft vs the theory: sum_x min(p1(x), q1(x))
        theory = acceptance_rate(mx.array(p1), probs(q1, sampling))
        measured = float(np.mean(np.array(first_accepted)[rows]))
        assert 0.05 < theory < 0.95  # rejections and acceptances both really happen
        assert abs(measured - theory) < 5 * math.sqrt(theory * (1 - theory) / len(rows))


def first_draft_logits(target, drafter, context):
    cache = target.make_cache(1)
    out = target(mx.array([context[:-1]]), cache)
    step = drafter.draft_step(target.embed(mx.array([[context[-1]]]))[:, 0], out.hidden[:, -1],
                              out.shared_kv, mx.array([len(context) - 1]))
    return step.full_logits(128)[0]
