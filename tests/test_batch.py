"""Batched speculative decoding: every row gets exactly its B=1 greedy output."""

import numpy as np
import pytest
from conftest import reference, tiny_drafter, tiny_target

from mlx_mtp.batch import BatchGenerator, CostModel
from mlx_mtp.generate import generate_tokens


def prompts(variant, n):
    """Rows of different lengths (9..27 tokens), from the reference prompt and its continuation."""
    ref = reference(variant)
    text = ref["prompt"].tolist() + ref["greedy"].tolist()
    rng = np.random.default_rng(0)
    return [text[s : s + 9 + 3 * i] for i, s in enumerate(rng.integers(0, 30, n))]


def alone(variant, prompt, n, stop=()):
    return [t for t, _ in generate_tokens(tiny_target(variant), prompt, max_tokens=n, stop_ids=stop)]


def run_batch(gen, jobs, join_later=()):
    """jobs: {index: (prompt, max_tokens, stop)}; rows in join_later join after 3 rounds."""
    out, uids = {}, {}
    for i, (prompt, n, stop) in jobs.items():
        if i not in join_later:
            uids[gen.add(prompt, n, stop)] = i
    rounds = 0
    while gen.active or len(uids) < len(jobs):
        rounds += 1
        if rounds == 4:
            for i in join_later:
                prompt, n, stop = jobs[i]
                uids[gen.add(prompt, n, stop)] = i
        for uid, tokens, _ in gen.step():
            out.setdefault(uids[uid], []).extend(tokens)
    return out


@pytest.mark.parametrize("k", [2, 5, "auto"])
def test_rows_equal_their_single_sequence_output(variant, k):
    ps = prompts(variant, 5)
    budgets = [40, 12, 33, 40, 25]  # rows finish at different rounds
    jobs = {i: (p, b, ()) for i, (p, b) in enumerate(zip(ps, budgets))}
    gen = BatchGenerator(tiny_target(variant), tiny_drafter(variant), draft_tokens=k)
    out = run_batch(gen, jobs, join_later=(3, 4))
    for i, (p, b, _) in jobs.items():
        assert out[i] == alone(variant, p, b), f"row {i}"
    assert gen.stats.rounds > 0 and gen.stats.accepted < gen.stats.drafted  # real rejections


def test_row_stopping_early_on_its_own_stop_token():
    ps = prompts("dense", 3)
    stop_for_row0 = alone("dense", ps[0], 30)[6]
    jobs = {0: (ps[0], 30, (stop_for_row0,)), 1: (ps[1], 30, ()), 2: (ps[2], 30, ())}
    out = run_batch(BatchGenerator(tiny_target("dense"), tiny_drafter("dense"), draft_tokens=3), jobs)
    assert out[0] == alone("dense", ps[0], 30, (stop_for_row0,)) and len(out[0]) <= 7
    assert out[1] == alone("dense", ps[1], 30) and out[2] == alone("dense", ps[2], 30)


def test_cost_model_prefers_drafting_only_when_it_pays():
    model = CostModel("auto", k_max=4)
    for _ in range(20):  # useless drafts, each draft as costly as a plain step
        model.observe(8, 0, [0] * 8, 1.0)
        model.observe(8, 2, [0] * 8, 3.0)
    assert model.choose(8) == 0
    good = CostModel("auto", k_max=4)
    for _ in range(20):  # near-perfect drafts, cheap drafting
        good.observe(8, 0, [0] * 8, 1.0)
        good.observe(8, 4, [4] * 8, 1.4)
    assert good.choose(8) >= 3
