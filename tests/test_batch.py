"""The one driver: every row of a batch gets exactly its single-sequence output, whatever joins,
leaves, finishes early, is cancelled or drafts differently; seeded rows are reproducible."""

import numpy as np
import pytest
from conftest import TINY, reference, tiny_drafter, tiny_target

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load_model
from mlx_mtp.cache.prefix import PrefixCache
from mlx_mtp.decode.sample import SamplingParams
from mlx_mtp.decode.oracle import OracleDrafter
from mlx_mtp.decode.speculative import K_MAX, Acceptance, DraftPolicy, Member
from mlx_mtp.decode.stats import Stats

HOT = SamplingParams(temperature=1.0, top_p=0.95)


def prompts(variant, n):
    """Rows of different lengths (9..30 tokens), from the reference prompt and its continuation."""
    ref = reference(variant)
    text = ref["prompt"].tolist() + ref["greedy"].tolist()
    rng = np.random.default_rng(0)
    return [text[s : s + 9 + 3 * i] for i, s in enumerate(rng.integers(0, 30, n))]


def alone(variant, prompt, n, stop=(), **kw):
    return [t for t, _ in generate_tokens(tiny_target(variant), prompt, max_tokens=n, stop_ids=stop, **kw)]


def drain(gen):
    out = []
    while gen.busy:
        out += [t for event in gen.step() for t in event.tokens]
    return out


def run_batch(gen, jobs, join_later=(), cancel_after=None):
    """jobs: {index: (prompt, insert kwargs)}; rows in join_later join after 3 steps; the row
    `cancel_after` = (index, tokens) is cancelled once it has that many tokens."""
    out, uids, finish = {}, {}, {}
    for i, (prompt, kw) in jobs.items():
        if i not in join_later:
            uids[gen.insert(prompt, **kw)] = i
    steps = 0
    while gen.busy or len(uids) < len(jobs):
        steps += 1
        if steps == 4:
            for i in join_later:
                uids[gen.insert(jobs[i][0], **jobs[i][1])] = i
        for event in gen.step():
            i = uids[event.uid]
            out.setdefault(i, []).extend(event.tokens)
            if event.finish_reason:
                finish[i] = event.finish_reason
            if cancel_after and i == cancel_after[0] and len(out[i]) >= cancel_after[1] and i not in finish:
                gen.cancel(event.uid)
    return out, finish


@pytest.mark.parametrize("k", [2, 5, "auto"])
def test_rows_equal_their_single_sequence_output(variant, k):
    ps = prompts(variant, 6)
    budgets = [40, 12, 33, 40, 25, 30]  # rows finish at different rounds
    jobs = {i: (p, dict(max_tokens=b)) for i, (p, b) in enumerate(zip(ps, budgets))}
    jobs[2][1]["mtp"] = False  # drafts nothing, shares the verify forward
    jobs[5][1]["draft_tokens"] = 1  # its own draft length
    gen = BatchGenerator(tiny_target(variant), tiny_drafter(variant), draft_tokens=k, prefill_chunk=7)
    out, finish = run_batch(gen, jobs, join_later=(3, 4))
    for i, (p, kw) in jobs.items():
        assert out[i] == alone(variant, p, kw["max_tokens"]), f"row {i}"
        assert finish[i] == "length"
    assert gen.stats.rounds > 0 and gen.stats.accepted < gen.stats.drafted  # real rejections
    assert max(len(p) + 40 for p in ps) > 2 * 8  # well past the window of 8


def test_stop_tokens_cancels_and_late_joiners():
    ps = prompts("dense", 4)
    stop_for_row0 = alone("dense", ps[0], 30)[6]
    jobs = {0: (ps[0], dict(max_tokens=30, stop_ids=(stop_for_row0,))), 1: (ps[1], dict(max_tokens=30)),
            2: (ps[2], dict(max_tokens=30)), 3: (ps[3], dict(max_tokens=20))}
    gen = BatchGenerator(tiny_target("dense"), tiny_drafter("dense"), draft_tokens=3)
    out, finish = run_batch(gen, jobs, join_later=(3,), cancel_after=(1, 5))
    assert out[0] == alone("dense", ps[0], 30, (stop_for_row0,)) and finish[0] == "stop" and len(out[0]) <= 7
    assert finish[1] == "cancelled" and out[1] == alone("dense", ps[1], 30)[: len(out[1])]
    assert out[2] == alone("dense", ps[2], 30) and out[3] == alone("dense", ps[3], 20)
    assert not gen.busy and gen.cache is None  # everybody left


def test_a_row_leaves_its_exact_state_in_the_prefix_cache():
    """The state a row leaves holds the prompt and every token handed out but the last, even
    when the row was cancelled with a round already queued past it."""
    target, drafter = tiny_target("dense"), tiny_drafter("dense")
    p = prompts("dense", 1)[0]
    truth = alone("dense", p, 40)
    for stop_after in (1, 5, 30):
        gen = BatchGenerator(target, drafter, draft_tokens=4, prefix_cache=PrefixCache(target, budget=1 << 30))
        uid, seen = gen.insert(p, max_tokens=40), []
        while len(seen) < stop_after:
            seen += [t for e in gen.step() for t in e.tokens]
        gen.remove(uid, stop_after)
        seen = seen[:stop_after]
        assert seen == truth[:stop_after]
        assert gen.prefix.lookup(p + seen) == len(p) + len(seen) - 1
        # continuing from that state gives the same continuation as a fresh run
        uid = gen.insert(p + seen, max_tokens=5)
        assert drain(gen) == alone("dense", p + seen, 5)
        assert gen.stats.cached_tokens == len(p) + len(seen) - 1


def test_seeded_rows_are_identical_alone_and_batched():
    target, drafter = tiny_target("moe"), tiny_drafter("moe")
    ps = prompts("moe", 8)
    kw = dict(max_tokens=30, sampling=HOT, seed=7)
    solo = alone("moe", ps[0], 30, drafter=drafter, sampling=HOT, seed=7)
    jobs = {0: (ps[0], kw)}
    jobs.update({i: (ps[i], dict(max_tokens=20 + i, sampling=SamplingParams(0.8 + i / 10), seed=i)) for i in range(1, 8)})
    out, _ = run_batch(BatchGenerator(target, drafter), jobs, join_later=(5, 6))
    assert out[0] == solo
    assert alone("moe", ps[0], 30, drafter=drafter, sampling=HOT, seed=8) != solo  # the seed matters


def test_each_row_is_expected_to_draft_as_it_has_so_far():
    """Issue 20: a row's own acceptance (the drafter's estimate over all rows as its prior) sets
    the draft length, so a hard prompt is not drafted for as if it were easy, nor the reverse."""
    policy = DraftPolicy("auto", k_max=4)
    easy, hard = Member(Acceptance()), Member(Acceptance())
    for _ in range(30):  # alternating requests, one easy text and one hard; a round costs 1 + K/4 plain steps
        for who, accepted in ((easy, lambda k: k), (hard, lambda k: 0)):
            for k in range(5):
                policy.observe(1, k, [accepted(k)], 1 + k / 4, members=[who])
    assert policy._best(1, (easy,)) >= 3
    assert policy._best(1, (hard,)) == 0
    assert policy._best(1) >= 3  # the drafter-wide estimate alone: the hard row drafted for as if easy


def test_a_mixed_batch_drafts_for_its_rows_as_they_have_done():
    """One K a round (the verify is rows x (K + 1) whatever a row counts): an easy row among hard
    ones is worth drafting for, and every row counts all K; hard rows alone are not."""
    policy = DraftPolicy("auto", k_max=4)
    easy, hard = Member(Acceptance()), Member(Acceptance())
    for _ in range(30):  # a round costs 1 + K/4 plain steps; the easy row accepts all, the hard none
        for k in range(5):
            policy.observe(2, k, [k, 0], 1 + k / 4, members=[easy, hard])
    assert policy._best(2, (easy, easy)) == 4
    assert policy._best(2, (easy, hard)) == 4  # 2 + K tokens for 1 + K/4: the hard row rides along
    assert policy._best(2, (hard, hard)) == 0
    assert policy.rate(2, 4, members=(easy, hard)) > policy.rate(2, 4, members=(easy, Member(hard.acceptance, 0)))


def test_rows_of_one_batch_keep_their_own_acceptance():
    """Row 0 is drafted its own continuation, row 1 a wrong one: each row's estimate follows its
    own drafts (the output stays exact)."""
    target = tiny_target("dense")
    p0, p1 = prompts("dense", 2)[0], prompts("dense", 3)[2][:9]
    truth = alone("dense", p0, 30)
    oracle = OracleDrafter(truth, len(p0), target.vocab_size, p_right=1.0)
    gen = BatchGenerator(target, oracle, draft_tokens=3)
    uids = [gen.insert(p, max_tokens=30) for p in (p0, p1)]
    rows, out = {}, {u: [] for u in uids}
    while gen.busy:
        rows.update({r.uid: r for r in gen.rows})
        for event in gen.step():
            out[event.uid] += event.tokens
    assert out[uids[0]] == truth and out[uids[1]] == alone("dense", p1, 30)
    prior = np.full(K_MAX, 0.5)
    own = [rows[u].acceptance.estimate(prior, 1.0) for u in uids]
    assert own[0][0] > 0.8 and own[1][0] < 0.2


def test_auto_rows_count_every_draft_of_a_round_a_fixed_row_lengthens():
    """A seeded sampled row drafts SEEDED_K tokens a round whatever the policy says; a greedy
    auto row in the same batch counts those drafts too (they cost nothing more), and stays exact."""
    target, drafter = tiny_target("dense"), tiny_drafter("dense")
    ps = prompts("dense", 2)
    gen = BatchGenerator(target, drafter)
    gen.policy = DraftPolicy("auto")  # a fresh policy measures plain steps first: it says K = 0
    greedy = Stats()
    out, _ = run_batch(gen, {0: (ps[0], dict(max_tokens=20, stats=greedy)),
                             1: (ps[1], dict(max_tokens=20, sampling=HOT, seed=5))})
    assert out[0] == alone("dense", ps[0], 20)
    # batch.SEEDED_K drafts in the rounds the rows shared (the drafter is random: the seeded row
    # accepts few, so they share most of its 20 tokens); counting its own K, 0, it would draft none
    assert len(greedy.drafted_at) == 3 and greedy.drafted_at[2] >= 10


def test_token_ids_and_budgets_are_checked():
    gen = BatchGenerator(tiny_target("dense"), tiny_drafter("dense"))
    for bad, match in (([], "empty"), ([1, 999], "outside the vocabulary"), ([1, -2], "outside"),
                       ([[1, 2]], "flat list")):
        with pytest.raises(ValueError, match=match):
            gen.insert(bad)
    for kw in (dict(max_tokens=0), dict(max_tokens=-3), dict(draft_tokens=100), dict(draft_tokens=-1)):
        with pytest.raises(ValueError):
            gen.insert([1, 2, 3], **kw)


def test_draft_policy_prefers_drafting_only_when_it_pays():
    model = DraftPolicy("auto", k_max=4)
    for _ in range(20):  # useless drafts, each draft as costly as a plain step
        model.observe(8, 0, [0] * 8, 1.0)
        model.observe(8, DraftPolicy.K_START, [0] * 8, 1.0 + DraftPolicy.K_START)
    assert model.choose(8) == 0
    good = DraftPolicy("auto", k_max=4)
    for _ in range(20):  # near-perfect drafts, cheap drafting
        good.observe(8, 0, [0] * 8, 1.0)
        good.observe(8, 1, [1] * 8, 1.1)
        good.observe(8, 2, [2] * 8, 1.2)
        good.observe(8, 4, [4] * 8, 1.4)
    assert good.choose(8) >= 3
    fresh = DraftPolicy("auto")  # nothing measured at this batch size: plain steps, then K_START
    chosen = []
    for _ in range(6):
        chosen.append(fresh.choose(3))
        fresh.observe(3, chosen[-1], [1] * 3, 1.0)
    assert chosen == [0, 0, 0] + [DraftPolicy.K_START] * 3


def test_the_auto_policy_persists_with_the_drafter():
    """What one generation measured serves the next: a second generator of the same drafter
    does not explore again (an MLX module is a dict, so it cannot key a WeakKeyDictionary)."""
    target, drafter = tiny_target("dense"), load_model(TINY / "dense" / "drafter")[0]
    first = BatchGenerator(target, drafter)
    assert BatchGenerator(target, drafter).policy is first.policy
    assert BatchGenerator(target, load_model(TINY / "dense" / "drafter")[0]).policy is not first.policy
    assert BatchGenerator(target, drafter, draft_tokens=2).policy is not first.policy
    for _ in range(8):
        first.policy.observe(1, 0, [0], 1.0)
        first.policy.observe(1, DraftPolicy.K_START, [0], 3.0)
    assert BatchGenerator(target, drafter).policy.choose(1) == 0


def test_an_untried_draft_position_is_expected_to_do_like_the_last_tried_one():
    """Drafts accepted at K=2 make K=3 look worth a try, where a coin-toss prior for the untried
    positions keeps the policy at K=2; rejected drafts make every untried position look poor."""
    good, bad = DraftPolicy("auto"), DraftPolicy("auto")
    for _ in range(20):
        good.observe(1, 2, [2], None)
        bad.observe(1, 2, [0], None)
    assert good.accept[2] > 0.7 and bad.accept[1] < 0.3
    for _ in range(3):  # rounds cost 1 + K/4 plain steps
        for k in (0, 2):
            good.observe(1, k, [2], 1 + k / 4)
    assert good._best(1) > 2


def test_unmeasured_draft_lengths_follow_the_drafted_rounds():
    """The first draft costs more than the next ones (the drafter's first step, a wider verify):
    a longer K is extrapolated from the drafted rounds, not from a line through the plain step."""
    policy = DraftPolicy("auto")
    for k, seconds in ((0, 1.0), (1, 1.33), (2, 1.5), (3, 1.7)):
        for _ in range(3):
            policy.observe(1, k, [0], seconds)
    assert policy.round_cost(1, 5) == pytest.approx(1.51 + 0.185 * 3, rel=1e-6)
    sparse = DraftPolicy("auto")  # one draft length measured: the line goes through the plain step
    for k, seconds in ((0, 1.0), (2, 1.6)):
        sparse.observe(1, k, [0], seconds)
    assert sparse.round_cost(1, 4) == pytest.approx(2.2)


def test_a_new_batch_size_borrows_drafted_costs_from_a_measured_one():
    """Drafting that did not pay at 4 rows is not re-explored at 6: its rounds are estimated
    from 4 rows' costs scaled by the plain-step ratio, and only plain steps are measured."""
    policy = DraftPolicy("auto", k_max=4)
    for _ in range(8):  # at 4 rows: plain 1.0 s, K=2 3.0 s, nothing accepted
        policy.observe(4, 0, [0] * 4, 1.0)
        policy.observe(4, 2, [0] * 4, 3.0)
    chosen = []
    for _ in range(10):
        chosen.append(policy.choose(6))
        policy.observe(6, chosen[-1], [0] * 6, 1.5 * (1 + chosen[-1]))
    assert chosen == [0] * 10
    assert policy.round_cost(6, 2) == pytest.approx(1.5 * 3.0)
    paying = DraftPolicy("auto", k_max=4)  # the same, but drafts accepted: 6 rows draft at once
    for _ in range(8):
        paying.observe(4, 0, [0] * 4, 1.0)
        paying.observe(4, 2, [2] * 4, 1.2)
    for _ in range(3):
        paying.observe(6, paying.choose(6), [2] * 6, 1.5)
    assert paying.choose(6) > 0


def test_a_long_prompt_is_prefilled_between_rounds():
    """While a 300-token prompt is prefilled in chunks of 16, a streaming row gets tokens at
    every step: it stalls for at most one chunk per round."""
    target, drafter = tiny_target("dense"), tiny_drafter("dense")
    gen = BatchGenerator(target, drafter, draft_tokens=2, prefill_chunk=16)
    short = prompts("dense", 1)[0]
    first, streamed = gen.insert(short, max_tokens=200), 0
    while streamed < 2:  # its first token, then its first round: it is streaming
        streamed += sum(e.uid == first for e in gen.step())
    long_prompt = (reference("dense")["prompt"].tolist() * 15)[:300]
    second = gen.insert(long_prompt, max_tokens=5)
    steps_while_prefilling, out = 0, {first: [], second: []}
    while gen.busy:
        prefilling = bool(gen.pending)
        events = gen.step()
        for e in events:
            out[e.uid] += e.tokens
        if prefilling:
            steps_while_prefilling += 1
            assert any(e.uid == first and e.tokens for e in events)
    assert steps_while_prefilling >= 300 // 16
    assert out[second] == alone("dense", long_prompt, 5)


def test_draft_policy_probes_ever_more_rarely_while_drafting_does_not_pay():
    policy = DraftPolicy("auto")
    chosen = []
    for _ in range(400):
        k = policy.choose(1)
        chosen.append(k)
        policy.observe(1, k, [0], 1.0 + k)  # nothing accepted, each draft costs a plain step
    drafted = [i for i, k in enumerate(chosen) if k]
    # exploration, then probes of PROBE rounds (timed) at 16, 32, 64, 128, 256 rounds' pause
    assert len(drafted) <= 3 + 5 * DraftPolicy.PROBE
    assert all(k == 0 for k in chosen[-100:])


def test_a_drafted_round_measured_slow_once_is_measured_again_while_plain_steps_win():
    """A K_START cost measured in a busy moment (or while kernels compiled) would keep plain
    steps on for good: the probes while plain steps win time their rounds, and drafting comes
    back once it pays."""
    policy = DraftPolicy("auto")
    chosen, k = [], policy.choose(1)
    for i in range(300):
        queued = policy.choose(1)  # pipelined: the next round is queued before this one is read
        seconds = 1.0 if k == 0 else (6.0 if i < 10 else 1.2)  # drafted rounds: slow at first
        policy.observe(1, k, [k], seconds if queued == k else None)  # timed only between alike rounds
        chosen.append(k)
        k = queued
    assert DraftPolicy.K_START in chosen[:10] and 0 in chosen[10:20]
    assert all(k > 0 for k in chosen[-50:])
