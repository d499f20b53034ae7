"""Logits processors under speculative decoding: grammars, each penalty and logit bias give
exactly plain processed decoding's output (greedy: token for token, past the sliding window,
batched with rows that process differently; sampling: in distribution), and log-probabilities
are plain decoding's. The reference is an independent plain decoding loop written here: one
target step per token, the processing in numpy, the grammar's mask from llguidance directly."""

import functools
import math

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np
import pytest
from chat_helpers import write_gemma4_tokenizer
from conftest import TINY, reference, tiny_drafter, tiny_target
from test_batch import prompts, run_batch
from test_sample import STRICT, _chi2

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.drafters import MTPProposer
from mlx_mtp.decode.generate import row_events
from mlx_mtp.decode.grammar import Grammar, Vocabulary
from mlx_mtp.loading import load_model
from mlx_mtp.decode.processors import NONE, Penalties, Processors, RowProcessing
from mlx_mtp.decode.sample import SamplingParams, probs
from mlx_mtp.decode.speculative import BatchState, Plan, run_round

STOP = (1, 106)  # <eos>, <turn|> of the character-level Gemma 4 tokenizer
N = 60  # tokens generated after a 20-token prompt: far past the sliding window of 8
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
CASES = {
    "json": (NONE, Grammar.json(SCHEMA)),
    "regex": (NONE, Grammar.regex(r"[a-z ]{10,40}\.")),
    "presence": (Penalties(presence=1.5), None),
    "frequency": (Penalties(frequency=0.8), None),
    "repetition": (Penalties(repetition=1.6), None),
    "bias": (Penalties(logit_bias={60: 2.5, 21: -30.0, 105: -4.0}), None),
    "all": (Penalties(0.4, 0.3, 1.3, {78: 1.0}), Grammar.regex(r"[a-m ]{20,40}!")),
}
PROCESSING = {**CASES, "none": (NONE, None)}


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("tokenizer")
    write_gemma4_tokenizer(path)
    return Vocabulary(transformers.AutoTokenizer.from_pretrained(str(path)), 128, STOP)


def processed(logits, prompt, output, penalties: Penalties, mask=None) -> np.ndarray:
    """Plain decoding's processing of one position's logits, in numpy: bias, penalties, mask."""
    x = np.array(logits, dtype=np.float32)
    for token, bias in penalties.logit_bias:
        x[token] += np.float32(bias)
    r = np.float32(penalties.repetition)
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(output):
        x[token] -= np.float32(penalties.frequency) * output.count(token) + np.float32(penalties.presence)
    if mask is not None:
        x[~mask] = -np.inf
    return x


def grammar_mask(matcher) -> np.ndarray:
    bits = llguidance.numpy.allocate_token_bitmask(1, 128)
    llguidance.numpy.fill_next_token_bitmask(matcher, bits)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:128].astype(bool)


@functools.lru_cache(maxsize=None)
def plain(case: str, prompt: tuple, vocab, n: int = N):
    """(tokens, log-probabilities) of plain processed greedy decoding: one step per token."""
    penalties, grammar = PROCESSING[case]
    target = tiny_target("dense")
    matcher = llguidance.LLMatcher(vocab.tokenizer, grammar.spec) if grammar else None
    cache = target.make_cache(1)
    logits = target(mx.array([list(prompt)]), cache).logits[0, -1]
    tokens, logprobs = [], []
    while len(tokens) < n:
        x = processed(logits, prompt, tokens, penalties, grammar_mask(matcher) if matcher else None)
        token = int(np.argmax(x))
        tokens.append(token)
        logprobs.append(float(x[token] - np.logaddexp.reduce(x[np.isfinite(x)].astype(np.float64))))
        if token in STOP:
            break
        if matcher:
            assert matcher.consume_token(token)
        logits = target(mx.array([[token]]), cache).logits[0, -1]
    return tokens, logprobs


def generated(prompt, vocab, case, drafter, **kw):
    penalties, grammar = PROCESSING[case]
    gen = BatchGenerator(tiny_target("dense"), drafter, draft_tokens=3)
    uid = gen.insert(prompt, **{"max_tokens": N, **kw}, stop_ids=STOP, penalties=penalties,
                     grammar=vocab.matcher(grammar) if grammar else None)
    events = list(row_events(gen, uid))
    return [t for e in events for t in e.tokens], [lp for e in events for lp in e.logprobs or ()], gen.stats


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_plain_processed_decoding(vocab, case):
    prompt = reference("dense")["prompt"].tolist()
    truth, _ = plain(case, tuple(prompt), vocab)
    assert truth != plain("none", tuple(prompt), vocab)[0]  # the processing matters
    mtp, _, stats = generated(prompt, vocab, case, tiny_drafter("dense"))
    assert mtp == truth
    assert stats.rounds > 0 and stats.accepted < stats.drafted  # real rejections
    assert generated(prompt, vocab, case, None)[0] == truth  # MTP off: grammar-forced drafts only
    assert len(prompt) + len(truth) > 4 * 8  # past the sliding window of 8
    if CASES[case][1] is not None:  # the grammar ended the reply
        assert truth[-1] in STOP


def test_json_grammar_forces_keys_and_output_parses(vocab):
    import json

    prompt = reference("dense")["prompt"].tolist()
    tokens, _, stats = generated(prompt, vocab, "json", tiny_drafter("dense"))
    text = vocab.tokenizer.decode_str(tokens[:-1])
    value = json.loads(text)
    assert list(value) == ["name", "tags", "n"] and len(value["name"]) <= 6 and 0 <= value["n"] <= 999
    assert text.startswith('{"name": "') and stats.forced >= 8  # keys and punctuation were drafted, not sampled


def test_logprobs_are_plain_decodings(vocab):
    prompt = reference("dense")["prompt"].tolist()
    truth, want = plain("all", tuple(prompt), vocab)
    for drafter in (tiny_drafter("dense"), None):
        tokens, logprobs, _ = generated(prompt, vocab, "all", drafter, logprobs=3)
        assert tokens == truth and len(logprobs) == len(truth)
        assert np.allclose([lp for lp, _ in logprobs], want, atol=1e-4)
        for token, (lp, top) in zip(tokens, logprobs):
            assert len(top) <= 3 and top[0] == (token, lp)  # greedy: the token is the most likely
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_batched_rows_with_different_processors_equal_plain(vocab):
    ps = prompts("dense", 5)
    cases = ["json", "repetition", "bias", "regex", "frequency"]
    jobs = {i: (p, dict(max_tokens=N, stop_ids=STOP, penalties=CASES[c][0], logprobs=2 if i == 2 else None,
                        grammar=vocab.matcher(CASES[c][1]) if CASES[c][1] else None, mtp=i != 3))
            for i, (p, c) in enumerate(zip(ps, cases))}
    jobs[5] = (ps[0], dict(max_tokens=30))  # no processing at all
    gen = BatchGenerator(tiny_target("dense"), tiny_drafter("dense"), draft_tokens=3, prefill_chunk=7)
    out, finish = run_batch(gen, jobs, join_later=(3, 4))
    for i, c in enumerate(cases):
        assert out[i] == plain(c, tuple(ps[i]), vocab)[0], f"row {i}: {c}"
    assert out[5] == plain("none", tuple(ps[0]), vocab, 30)[0]
    assert gen.stats.forced > 0 and gen.stats.accepted < gen.stats.drafted


def test_grammar_rounds_teach_a_draft_policy_of_their_own(vocab):
    """Rounds with a grammar row are read serially and led by forced tokens: their costs and the
    drafter's acceptance against masked targets are not an unconstrained round's, and back."""
    gen = BatchGenerator(tiny_target("dense"), load_model(TINY / "dense" / "drafter")[0])  # "auto", nothing measured yet
    assert gen.constrained_policy is not gen.policy
    prompt = reference("dense")["prompt"].tolist()
    list(row_events(gen, gen.insert(prompt, max_tokens=N, stop_ids=STOP, grammar=vocab.matcher(CASES["json"][1]))))
    assert gen.constrained_policy.times and not gen.policy.times
    list(row_events(gen, gen.insert(prompt, max_tokens=12)))
    assert gen.policy.times and BatchGenerator(tiny_target("dense"), gen.proposer.drafter).policy is gen.policy


def test_a_grammar_that_allows_nothing_ends_the_row(vocab):
    """The tokenizer cannot spell "é": the reply ends where the grammar needs it ("dead_end")."""
    prompt = reference("dense")["prompt"].tolist()
    for drafter in (None, tiny_drafter("dense")):
        gen = BatchGenerator(tiny_target("dense"), drafter, draft_tokens=3)
        rows = {gen.insert(prompt, max_tokens=20, stop_ids=STOP, grammar=vocab.matcher(Grammar.regex(g))): g
                for g in ("abcé", "é")}
        out = {}
        while gen.busy:
            for e in gen.step():
                tokens, _ = out.get(rows[e.uid], ([], None))
                out[rows[e.uid]] = (tokens + e.tokens, e.finish_reason)
        assert out == {"abcé": (vocab.tokenizer.tokenize_str("abc"), "dead_end"), "é": ([], "dead_end")}


# ---- sampling: the exact processed distribution ------------------------------------------------------

ROWS, K = 1200, 2
PENALIZED = (Penalties(presence=0.7, frequency=0.5, repetition=1.8, logit_bias={70: 2.0}),
             SamplingParams(temperature=1.0))
SHAPED = (Grammar.regex("[a-c]z[d-f]"), SamplingParams(temperature=0.9))


def test_sampling_follows_the_processed_distribution(vocab):
    """Half the rows have penalties and bias (the first two tokens' laws), half a grammar whose
    second token is forced and third masked by the first (the third token's law)."""
    target, ref = tiny_target("dense"), reference("dense")
    context = ref["prompt"].tolist()[-7:] + [int(ref["greedy"][0])]  # short: 2000 rows prefill it
    cache = target.make_cache(ROWS, max_rollback=2 * K + 2)
    out = target(mx.array([context[:-1]] * ROWS), cache)  # the cache holds all but the last token
    seeds = mx.array(np.random.default_rng(1).integers(0, 2**32, ROWS), dtype=mx.uint32)
    history = mx.full((ROWS, len(context) + 4 * (K + 1)), -1, dtype=mx.int32)  # room for 3 tokens' rounds
    history[:, : len(context)] = mx.array([context] * ROWS, dtype=mx.int32)
    state = BatchState(mx.full((ROWS,), context[-1], dtype=mx.int32), out.hidden[:, -1], seeds, history)
    penalized = [b % 2 == 0 for b in range(ROWS)]
    rows = [RowProcessing(PENALIZED[0], None, None, len(context)) if p
            else RowProcessing(NONE, vocab.matcher(SHAPED[0]), None, len(context)) for p in penalized]
    params = tuple(PENALIZED[1] if p else SHAPED[1] for p in penalized)
    drafter, emitted = MTPProposer(tiny_drafter("dense"), target), [[] for _ in range(ROWS)]
    while min(len(e) for e in emitted) < 3:
        processors = Processors(rows, 128, K)
        plan = Plan(params, processors.limits((K,) * ROWS), processors)
        state, result = run_round(target, drafter, cache, state, plan)
        tokens, accepted = result.tokens.tolist(), result.accepted.tolist()
        for b, (toks, n) in enumerate(zip(tokens, accepted)):
            emitted[b] += toks[: n + 1]
            if rows[b].grammar is not None:
                rows[b].grammar.advance(toks[: n + 1])
    emitted = np.array([e[:3] for e in emitted])

    def law(prefixes, output_of, penalties, params, mask):
        """The processed law of the next token after each of `prefixes` (weighted)."""
        logits = np.array(target(mx.array([context + list(p) for p, _ in prefixes])).logits[:, -1])
        total = 0
        for (prefix, weight), x in zip(prefixes, logits):
            z = processed(x, context, output_of(prefix), penalties, mask(prefix))
            total = total + weight * np.array(probs(mx.array(z), params))
        return total

    p1 = law([((), 1.0)], list, *PENALIZED, lambda p: None)
    p2 = law([((x,), p1[x]) for x in range(128) if p1[x] > 0], list, *PENALIZED, lambda p: None)
    even = emitted[0::2]
    for tokens, expected in ((even[:, 0], p1), (even[:, 1], p2)):
        stat, dof, pvalue = _chi2(np.bincount(tokens, minlength=128), expected)
        assert pvalue > STRICT, (stat, dof)
    letters = {c: vocab.tokenizer.tokenize_str(c)[0] for c in "abcdefz"}
    allowed = lambda cs: np.isin(np.arange(128), [letters[c] for c in cs])
    q1 = law([((), 1.0)], list, NONE, SHAPED[1], lambda p: allowed("abc"))
    q3 = law([((x, letters["z"]), q1[x]) for x in range(128) if q1[x] > 0], list, NONE, SHAPED[1],
             lambda p: allowed("def"))
    odd = emitted[1::2]
    assert (odd[:, 1] == letters["z"]).all()
    for tokens, expected in ((odd[:, 0], q1), (odd[:, 2], q3)):
        stat, dof, pvalue = _chi2(np.bincount(tokens, minlength=128), expected)
        assert pvalue > STRICT, (stat, dof)
    assert math.isclose(sum(q3), 1.0, rel_tol=1e-5)
