"""The prefix cache: a request resumes from the deepest state an earlier one left that its prompt
shares, prefills only the rest, and gets exactly what a fresh prefill gives; memory stays
within the budget; pins hold; failures and cancels leave nothing wrong behind."""

import threading

import mlx.core as mx
import numpy as np
import pytest
from chat_helpers import DRAFTER, REWRITING_TEMPLATE, make_chat_model
from conftest import tiny_target

import mlx_mtp
from mlx_mtp.cache.kv import FULL, SLIDING
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.loading import Loaded
from mlx_mtp.models.base import one_by_one
from mlx_mtp.cache.prefix import PrefixCache, token_bytes
from mlx_mtp.decode.speculative import MAX_ROLLBACK

WAIT = 60
W = 8  # the tiny models' sliding window
TAIL = W + 1 + MAX_ROLLBACK  # the sliding positions a state keeps: what a row's ring holds
HOT = mlx_mtp.SamplingParams(temperature=2.0)
SYSTEM = "You are a coding agent. Tools: read(path), write(path, text), run(cmd). Be brief."


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_chat_model(tmp_path_factory.mktemp("prefix") / "model"), DRAFTER)


def ids(n, seed=0):
    return np.random.default_rng(seed).integers(6, 128, n).tolist()


def prefill(target, tokens, cache=None, cuts=()):
    """`tokens` fed after what `cache` holds, cut into forwards at the positions `cuts`."""
    cache = cache or target.make_cache(1, max_rollback=MAX_ROLLBACK)
    start = int(cache.offsets()[0])
    edges = [start, *(c for c in cuts if start < c < len(tokens)), len(tokens)]
    out = None
    for a, b in zip(edges, edges[1:]):
        out = target(mx.array([tokens[a:b]]), cache)
    return cache, out


def tree_bytes(pc):
    """Bytes of the arrays the tree really holds."""
    total, stack = 0, [pc.root]
    while stack:
        node = stack.pop()
        total += sum(a.nbytes for pair in [*node.full.values(), *node.sliding.values()] for a in pair)
        stack += node.children.values()
    return total


# ---- the tree ---------------------------------------------------------------------------------------


def test_a_state_is_restored_exactly_where_its_sliding_tail_was_kept():
    target = tiny_target("dense")
    pc = PrefixCache(target, budget=1 << 30)
    a = ids(60)
    cache, _ = prefill(target, a[:30])
    pc.store(a[:30], cache)  # keeps the sliding K/V of positions 30 - TAIL .. 29
    cache, _ = prefill(target, a[:60], cache)
    pc.store(a[:60], cache)
    b = a[:25] + ids(20, seed=1)  # parts ways at 25: W + 1 positions before it were kept
    assert pc.lookup(b) == 25 and pc.lookup(a[:30]) == 29 and pc.lookup(a) == 59
    assert pc.lookup(a[: 30 - TAIL + W + 2]) == 30 - TAIL + W + 1 and pc.lookup(a[: 30 - TAIL + W + 1]) == 0
    assert pc.lookup(ids(40, seed=2)) == 0
    resumed = target.make_cache(1, max_rollback=MAX_ROLLBACK)
    assert pc.resume(b, resumed) == 25 and (pc.stats.queries, pc.stats.hits) == (45, 25)
    fresh, whole = prefill(target, b, cuts=(25,))
    _, rest = prefill(target, b, resumed)
    assert np.abs(np.array(rest.logits[:, -1] - whole.logits[:, -1])).max() < 1e-5
    for kind, start in ((FULL, 0), (SLIDING, len(b) - W - 1)):
        got, want = resumed.read(start, len(b), kind), fresh.read(start, len(b), kind)
        assert all(np.array_equal(np.array(got[i][j]), np.array(want[i][j])) for i in got for j in (0, 1))


def test_branches_share_their_common_positions_and_the_accounting_is_exact():
    target = tiny_target("dense")
    pc = PrefixCache(target, budget=1 << 30)
    trunk = ids(40)
    cache, _ = prefill(target, trunk)
    pc.store(trunk, cache)
    for seed in range(4):  # four prompts sharing the 40-token trunk
        prompt = trunk + ids(20, seed=10 + seed)
        pc.store(prompt, prefill(target, prompt)[0])
        assert pc.nbytes == tree_bytes(pc)
    per = pc.token_bytes
    # full-attention K/V of the trunk once, of each branch once; sliding: the trunk's tail, then
    # each branch's (which reaches into the trunk's, held once)
    assert pc.nbytes == (40 + 4 * 20) * per[FULL] + (TAIL + 4 * 20) * per[SLIDING]
    assert pc.checkpoints == 5 and len(pc.root.children) == 1


def test_least_recently_used_states_go_first_and_pins_stay():
    target = tiny_target("dense")
    per = token_bytes(target)
    one = 30 * per[FULL] + TAIL * per[SLIDING]  # a 30-token prompt's state
    pc = PrefixCache(target, budget=2 * one)
    prompts = [[s] + ids(29, seed=s) for s in range(6, 11)]  # different first tokens: no sharing

    def store(p, pin=None):
        return pc.store(p, prefill(target, p)[0], pin=pin)

    def held():
        return [pc.lookup(p + [7]) == 30 for p in prompts]

    store(prompts[0])
    store(prompts[1])
    pc.resume(prompts[0] + [7], target.make_cache(1, max_rollback=MAX_ROLLBACK))  # 0 is used again
    store(prompts[2])  # over budget: 1 goes, the least recently used
    assert held() == [True, False, True, False, False] and pc.nbytes == 2 * one
    store(prompts[3], pin="agent")
    store(prompts[4], pin="agent")
    store(prompts[1], pin="other")  # three pinned states over a budget of two: only they stay
    assert held() == [False, True, False, True, True] and pc.nbytes == 3 * one == tree_bytes(pc)
    pc.release("agent")
    assert held() == [False, True, False, False, True] and pc.nbytes == 2 * one == tree_bytes(pc)
    assert PrefixCache(target, budget=0).store(prompts[0], prefill(target, prompts[0])[0]) is None


# ---- through the Engine -------------------------------------------------------------------------------


def agent_session(engine, n_calls, sampling=None, seed=None, tag=0):
    """An agent's calls: each re-sends the conversation with the last reply and a tool result."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"fix bug {tag}"}]
    outputs, stats = [], []
    for call in range(n_calls):
        kw = dict(max_tokens=12, draft_tokens=3)
        if sampling is not None:
            kw.update(sampling=sampling, seed=seed)
        done = engine.submit(Request(messages=list(messages), **kw)).result(WAIT)
        outputs.append(list(done.tokens))
        stats.append(done.stats)
        messages += [{"role": "assistant", "content": done.text},
                     {"role": "user", "content": f"result {call}: " + "ok " * (3 + call % 4)}]
    return outputs, stats


def sessions(loaded, budget, n_sessions=3, n_calls=5, engine_options=None, **kw):
    """Concurrent agent sessions sharing a system prompt; (outputs, stats, metrics) per session."""
    out = {}
    with Engine(loaded, max_batch=4, prompt_cache_bytes=budget, **(engine_options or {})) as engine:
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, agent_session(engine, n_calls, tag=i, **kw)))
                   for i in range(n_sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10 * WAIT)
        metrics = engine.metrics()
    return out, metrics


@pytest.mark.parametrize("seeded", [False, True])
def test_hits_change_no_output_under_batching_and_mtp(loaded, seeded):
    """Three agents at once, greedy or seeded hot sampling, MTP with a random drafter, far past the
    sliding window: with the cache on, each call prefills about what is new to it, and every
    output equals the cache-off output."""
    kw = dict(sampling=HOT, seed=5) if seeded else {}
    on, metrics = sessions(loaded, 1 << 30, **kw)
    off, _ = sessions(loaded, 0, **kw)
    for i in on:
        assert on[i][0] == off[i][0], f"session {i}"
        prompt_lengths = [s.prompt_tokens + s.cached_tokens for s in on[i][1]]
        assert prompt_lengths[-1] > 6 * W
        for call, s in enumerate(on[i][1][1:], 1):
            new = prompt_lengths[call] - prompt_lengths[call - 1]
            assert s.cached_tokens > 0 and s.prompt_tokens <= new + 2, (i, call, s.prompt_tokens, new)
        assert all(s.cached_tokens == 0 for s in off[i][1])
    assert metrics["prefix_cache_hits"] > 0.6 * metrics["prefix_cache_queries"]
    assert metrics["spec_draft_tokens"] > metrics["spec_accepted_tokens"] > 0  # drafts really rejected


def test_a_shared_system_prompt_is_prefilled_once(loaded):
    with Engine(loaded, max_batch=4) as engine:
        first = engine.submit(Request(messages=[{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": "hi"}], max_tokens=4))
        first.result(WAIT)
        handles = [engine.submit(Request(messages=[{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": f"task {i}"}], max_tokens=4))
                   for i in range(4)]
        stats = [h.result(WAIT).stats for h in handles]
    system_turn = len(loaded.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}]))
    assert system_turn > 80 and all(s.cached_tokens >= system_turn - 1 and s.prompt_tokens < 20 for s in stats)


def test_a_template_that_rerenders_history_prefills_the_rerendered_reply_again(tmp_path):
    """This template lower-cases and trims every message, so each reply re-renders differently
    from how it was generated: the next call resumes before that reply, not at the start."""
    loaded = mlx_mtp.load(make_chat_model(tmp_path / "m", REWRITING_TEMPLATE), DRAFTER)
    on, _ = sessions(loaded, 1 << 30, n_sessions=1, n_calls=6)
    off, _ = sessions(loaded, 0, n_sessions=1, n_calls=6)
    assert on[0][0] == off[0][0]
    outputs, stats = on[0]
    for call in range(1, 6):
        before = stats[call - 1].prompt_tokens + stats[call - 1].cached_tokens
        assert stats[call].cached_tokens >= before  # the last prompt whole: only the reply is again
        assert stats[call].prompt_tokens <= len(outputs[call - 1]) + 50  # + a tool result, turn markers


def test_eviction_under_a_small_budget_keeps_outputs_exact_and_bytes_within_it(loaded):
    budget = 200_000  # about one session's states: the next session evicts the last one's
    with Engine(loaded, max_batch=2, prompt_cache_bytes=budget) as engine:
        seen = []
        for i in range(3):
            out, _ = agent_session(engine, 4, tag=i)
            seen.append(out)
            assert engine.metrics()["prefix_cache_bytes"] <= budget
        assert engine.metrics()["prefix_cache_hits"] > 0
    off, _ = sessions(loaded, 0, n_sessions=3, n_calls=4)
    assert seen == [off[i][0] for i in range(3)]


class Flaky:
    """The target, but a prefill forward over prompt tokens containing `poison` raises (a request
    failing half way through its prefill)."""

    def __init__(self, target, poison):
        self._target, self._poison = target, poison

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, tokens, cache=None, keep=None):
        if keep == 0 and self._poison in np.array(tokens).ravel().tolist():
            raise RuntimeError("injected failure")
        return self._target(tokens, cache, keep=keep)

    def ragged(self, chunks, caches, wanted):
        return one_by_one(self, chunks, caches, wanted)


def test_a_failed_or_cancelled_request_leaves_nothing_wrong_behind(loaded):
    poison = loaded.tokenizer.encode("~")[0]
    flaky = Loaded(Flaky(loaded.target, poison), loaded.tokenizer, loaded.drafter, loaded.eos_ids)
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "write a loop"}]
    with Engine(flaky, max_batch=2, prefill_chunk=16) as engine:
        cancelled = engine.submit(Request(messages=base, max_tokens=200))
        for event in cancelled:
            if event.kind == "token":
                cancelled.cancel()
        failed = engine.submit(Request(messages=base + [{"role": "assistant", "content": "x"},
                                                        {"role": "user", "content": "now ~"}], max_tokens=8))
        with pytest.raises(RuntimeError, match="injected"):
            failed.result(WAIT)
        again = engine.submit(Request(messages=base, max_tokens=30)).result(WAIT)
        later = engine.submit(Request(messages=base, max_tokens=30)).result(WAIT)
    with Engine(loaded, prompt_cache_bytes=0) as engine:
        fresh = engine.submit(Request(messages=base, max_tokens=30)).result(WAIT)
    assert again.tokens == later.tokens == fresh.tokens and later.stats.cached_tokens > 0


def run_row(gen, prompt, steps=None, **kw):
    """Insert `prompt` and step: `steps` times (then cancel it), or until it is done; its tokens
    and stats."""
    uid, tokens, stats, n = gen.insert(prompt, **kw), [], None, 0
    while gen.busy:
        if steps is not None and n == steps:
            gen.cancel(uid)
        for event in gen.step():
            tokens += event.tokens
            stats = event.stats
        n += 1
    return tokens, stats


def test_a_cancelled_prefill_leaves_its_chunks_and_a_retry_resumes_there_exactly(loaded):
    """A row cancelled after 3 of its prompt chunks leaves the state there (its chunks end on the
    grid); the retry prefills only the rest, on the same grid, and its output, past the sliding
    window with MTP on, is a fresh prefill's, greedy and seeded alike."""
    prompt = ids(200, seed=3)
    for kw in (dict(max_tokens=40), dict(max_tokens=40, sampling=HOT, seed=9)):
        gen = mlx_mtp.BatchGenerator(loaded.target, loaded.drafter, prefill_chunk=32,
                                     prefix_cache=PrefixCache(loaded.target, 1 << 30))
        assert run_row(gen, prompt, steps=3, **kw)[0] == []
        assert gen.stats.prompt_tokens == 96  # three chunks, counted though the row was cancelled
        tokens, stats = run_row(gen, prompt, **kw)
        assert (stats.cached_tokens, stats.prompt_tokens, stats.stored_tokens) == (96, 104, 104)
        assert gen.stats.prompt_tokens == 200  # one prefill over both attempts
        fresh = mlx_mtp.BatchGenerator(loaded.target, loaded.drafter, prefill_chunk=32)
        assert tokens == run_row(fresh, prompt, **kw)[0] and len(tokens) == 40


def test_with_the_cache_off_only_conversations_keep_their_turn(loaded):
    with Engine(loaded, prompt_cache_bytes=0) as engine:
        chat = engine.conversations.new(system=SYSTEM)
        turns = [engine.submit(Request(text, conversation=chat, max_tokens=8)).result(WAIT) for text in ("hi", "go on")]
        one_shot = [engine.submit(Request(messages=[{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": "hi"}], max_tokens=8)).result(WAIT)
                    for _ in range(2)]
        kept = engine.metrics()["prefix_cache_bytes"]
        engine.conversations.close(chat)
        engine.submit(Request("x", max_tokens=1)).result(WAIT)  # the close runs before it
        assert engine.metrics()["prefix_cache_bytes"] == 0 < kept
    assert turns[1].stats.cached_tokens > len(SYSTEM) and [s.stats.cached_tokens for s in one_shot] == [0, 0]
