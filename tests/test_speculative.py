"""Speculative decoding emits exactly what the target alone would (greedy), past the window."""

import pytest
from conftest import fused_too, reference, tiny_drafter, tiny_target

from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.decode.oracle import OracleDrafter as Oracle
from mlx_mtp.decode.sample import SamplingParams
from mlx_mtp.decode.stats import Stats

N_TOKENS = 60  # prompt 20 + 60 generated: far past the sliding window of 8


def plain(variant, n=N_TOKENS):
    return [t for t, _ in generate_tokens(tiny_target(variant), reference(variant)["prompt"].tolist(),
                                          max_tokens=n)]


def mtp(variant, drafter, k, n=N_TOKENS, stats=None, **kw):
    out = generate_tokens(tiny_target(variant), reference(variant)["prompt"].tolist(), drafter=drafter,
                          draft_tokens=k, max_tokens=n, stats=stats, **kw)
    return [t for t, _ in out]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, "auto"])
def test_greedy_mtp_equals_plain_with_random_drafter(variant, k):
    stats = Stats()
    assert mtp(variant, tiny_drafter(variant), k, stats=stats) == plain(variant)
    if k != "auto":
        assert stats.rounds > 0 and stats.accepted < stats.drafted  # rejections really happened


def OracleDrafter(target, prompt_len, truth, p_right, seed=0):
    return Oracle(truth, prompt_len, 128, p_right, seed=seed)


def test_seeded_auto_output_does_not_depend_on_timing(monkeypatch):
    """With "auto" the draft length follows measured timings; a seeded sampled request must
    not: runs under wildly different (faked) clocks give the same tokens."""
    import time

    import numpy as np

    s = SamplingParams(temperature=0.8)
    target, prompt = tiny_target("dense"), reference("dense")["prompt"].tolist()
    runs = []
    for clock_seed in range(4):
        rng, now = np.random.default_rng(clock_seed), [0.0]

        def clock():  # each reading advances by a random 1 ms .. 1 s
            now[0] += float(rng.uniform(0.001, 1.0))
            return now[0]

        monkeypatch.setattr(time, "perf_counter", clock)
        runs.append([t for t, _ in generate_tokens(target, prompt, drafter=tiny_drafter("dense"), sampling=s,
                                                   max_tokens=60, seed=3)])
    assert all(run == runs[0] for run in runs)


@pytest.mark.parametrize("p_right, fused", fused_too([0.5, 0.8, 0.95], [0.8]), indirect=["fused"])
def test_greedy_mtp_equals_plain_with_oracle_partial_acceptance(variant, p_right, fused):
    truth, stats = plain(variant), Stats()
    drafter = OracleDrafter(tiny_target(variant), 20, truth, p_right)
    assert mtp(variant, drafter, 4, stats=stats) == truth
    assert 0 < stats.accepted < stats.drafted
    # acceptance happened at several different positions within blocks
    assert sum(1 for a, d in zip(stats.accepted_at, stats.drafted_at) if 0 < a < d) >= 2


def test_oracle_acceptance_gives_fewer_target_forwards():
    truth, stats = plain("dense"), Stats()
    drafter = OracleDrafter(tiny_target("dense"), 20, truth, 1.0)
    assert mtp("dense", drafter, 4, stats=stats) == truth
    assert stats.acceptance_length == pytest.approx(5.0, abs=0.3)
    assert stats.target_forwards < len(truth) / 3


def test_eos_inside_accepted_run_stops_there():
    truth = plain("dense")
    stop = truth[13]  # lies inside an accepted block when drafting 4 at a time
    first = truth.index(stop)
    drafter = OracleDrafter(tiny_target("dense"), 20, truth, 1.0)
    out = mtp("dense", drafter, 4, stop_ids=[stop])
    assert out == truth[: first + 1]


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_max_tokens_counts_emitted_tokens(n):
    truth = plain("dense")
    drafter = OracleDrafter(tiny_target("dense"), 20, truth, 1.0)
    assert mtp("dense", drafter, 4, n=n) == truth[:n]


def test_sampling_is_reproducible_with_seed_and_mtp_can_be_off():
    kw = dict(drafter=tiny_drafter("moe"), draft_tokens=3, max_tokens=30, seed=7)
    s = SamplingParams(temperature=1.0, top_p=0.9)
    target, prompt = tiny_target("moe"), reference("moe")["prompt"].tolist()
    a = [t for t, _ in generate_tokens(target, prompt, sampling=s, **kw)]
    b = [t for t, _ in generate_tokens(target, prompt, sampling=s, **kw)]
    assert a == b and len(a) == 30
    stats = Stats()
    off = generate_tokens(target, prompt, sampling=s, **{**kw, "draft_tokens": 0}, stats=stats)
    assert len(list(off)) == 30 and stats.rounds == 0 and stats.plain_steps == 29
