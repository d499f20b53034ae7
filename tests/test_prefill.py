"""Prefill (`mlx_mtp/decode/prefill.py`): queued prompts are prefilled several to a forward, side by side
(`Model.ragged`). Each row's K/V, logits and hidden state are bit for bit those of its own
forwards on the same chunk grid (float32 and 4-bit, the BLAS branch of a quantized product too,
and under a BLAS whose rounding follows the number of rows), so outputs, seeded samples and the
prefix cache's states are what each prompt gets alone."""

import copy
import json
import math
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import VARIANTS, reference, tiny_drafter, tiny_target

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.cache.kv import FULL, SLIDING
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.models.base import force_fused
from mlx_mtp.models.quantized import dequantizing_from
from mlx_mtp.cache.prefix import PrefixCache
from mlx_mtp.models.quantize import quantize
from mlx_mtp.decode.sample import SamplingParams
from mlx_mtp.decode.speculative import MAX_ROLLBACK

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 12  # over ROW_EXACT_TOKENS: a chunk's quantized products may share a dequantised weight
LENGTHS = (1, 2, 6, 9, 13, 30)  # one token, within a chunk, across chunks, past the sliding window of 8
HOT = SamplingParams(temperature=1.0, top_p=0.95)


def text(variant: str) -> list:
    ref = reference(variant)
    return (ref["prompt"].tolist() + ref["greedy"].tolist()) * 3


def prompts(variant: str, lengths=LENGTHS) -> list:
    t = text(variant)
    return [t[s : s + n] for s, n in zip(range(0, 6 * len(lengths), 6), lengths)]


@lru_cache(maxsize=None)
def model(variant: str, bits):
    if bits is None:
        return tiny_target(variant)
    q = copy.deepcopy(tiny_target(variant))
    quantize(q, {}, bits=bits, group_size=32)
    mx.eval(q.parameters())
    return q


def pieces(n: int) -> list:
    """A prompt of n tokens cut as the driver cuts it: on the grid, then its last token alone."""
    edges = [*range(0, n - 1, CHUNK), n - 1, n] if n > 1 else [0, 1]
    return list(zip(edges, edges[1:]))


def alone(target, prompt: list):
    cache, out = target.make_cache(1, max_rollback=MAX_ROLLBACK), None
    for a, b in pieces(len(prompt)):
        out = target(mx.array([prompt[a:b]]), cache, keep=1 if b == len(prompt) else 0)
    return out.logits[0, -1], out.hidden[0, -1], cache


def together(target, ps: list) -> list:
    """Every row's next piece in one ragged forward, until every prompt is in."""
    caches = [target.make_cache(1, max_rollback=MAX_ROLLBACK) for _ in ps]
    todo, outs = [pieces(len(p)) for p in ps], {}
    while any(todo):
        rows = [i for i in range(len(ps)) if todo[i]]
        edges = [todo[i].pop(0) for i in rows]
        wanted = [b == len(ps[i]) for i, (_, b) in zip(rows, edges)]
        chunks = [mx.array([ps[i][a:b]]) for i, (a, b) in zip(rows, edges)]
        out = target.ragged(chunks, [caches[i] for i in rows], wanted)
        for j, i in enumerate(i for i, w in zip(rows, wanted) if w):
            outs[i] = (out.logits[j, -1], out.hidden[j, -1])
    return [(*outs[i], caches[i]) for i in range(len(ps))]


def differences(target, ps: list) -> list:
    """The rows whose K/V, logits or hidden state side by side differ from alone (bitwise)."""
    def arrays(logits, hidden, cache):
        every = [logits, hidden, *cache.keys, *cache.values]
        return [np.array(a.astype(mx.float32)) for a in every if a is not None]

    out = []
    for p, side in zip(ps, together(target, ps)):
        mine, theirs = arrays(*alone(target, p)), arrays(*side)
        if len(mine) != len(theirs) or not all(np.array_equal(a, b) for a, b in zip(mine, theirs)):
            out.append(len(p))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bits,share", [(None, math.inf), (4, math.inf), (4, 3)],
                         ids=["fp32", "q4-kernel", "q4-blas-from-3-rows"])
def test_a_ragged_forward_gives_each_row_exactly_its_own_forwards(variant, bits, share):
    with dequantizing_from(share):
        assert differences(model(variant, bits), prompts(variant)) == []


def test_a_ragged_forward_with_the_fused_kernels_is_exact_too():
    with force_fused(True):
        assert differences(model("e2b", 4), prompts("e2b")) == []


MKL_CHILD = """
import json, sys
sys.path[:0] = [{root!r}, {tests!r}]
from apps.bench import regime
regime.setup("mkl")
import mlx.core as mx, numpy as np
from mlx_mtp.models.quantized import dequantizing_from
import test_prefill as t
x, w = mx.random.normal((40, 64), key=mx.random.key(1)), mx.random.normal((96, 64), key=mx.random.key(2))
rounds_by_rows = not np.array_equal(np.array(x[:3] @ w.T), np.array((x @ w.T)[:3]))
out = {{"rounds_by_rows": bool(rounds_by_rows)}}
for variant, bits in (("dense", None), ("moe", None), ("e2b", None), ("dense", 4), ("moe", 4)):
    with dequantizing_from(3):
        out[f"{{variant}}-{{bits}}"] = t.differences(t.model(variant, bits), t.prompts(variant))
print(json.dumps(out))
"""


def test_rows_stay_exact_under_a_blas_that_rounds_by_the_number_of_rows():
    """MKL rounds a row of a product differently with the rows beside it: a ragged forward takes
    each sequence's rows apart wherever that matters, so it stays exact there too."""
    from apps.bench import regime

    try:
        regime.find_mkl()
    except Exception as e:
        pytest.skip(f"no MKL here ({e}); `pip install -e '.[bench]'` brings it")
    code = MKL_CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("rounds_by_rows")  # the hazard is real here: a row's product depends on the others
    assert out == {k: [] for k in out}


# ---- the driver ---------------------------------------------------------------------------------


def drain(gen, uids) -> dict:
    out = {u: [] for u in uids}
    while gen.busy:
        for event in gen.step():
            out[event.uid] += event.tokens
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompts_arriving_together_get_what_each_gets_alone(variant):
    """Six prompts at once, prefilled several to a forward, MTP on with an independently random
    drafter, generating past the sliding window: greedy rows give the plain greedy output and
    seeded rows the sample they give alone."""
    target, drafter = tiny_target(variant), tiny_drafter(variant)
    ps = prompts(variant, (3, 5, 8, 11, 20, 40))
    kws = [dict(max_tokens=30) for _ in ps]
    kws[1].update(sampling=HOT, seed=4)
    kws[4].update(sampling=HOT, seed=9)
    gen = BatchGenerator(target, drafter, draft_tokens=2, prefill_chunk=7, prefill_tokens=32)
    out = drain(gen, [gen.insert(p, **kw) for p, kw in zip(ps, kws)])
    assert gen.prefill.pieces > gen.prefill.forwards  # rows did share forwards
    assert gen.stats.accepted < gen.stats.drafted  # drafts really rejected
    for (uid, tokens), p, kw in zip(out.items(), ps, kws):
        if "seed" in kw:
            one = BatchGenerator(target, drafter, draft_tokens=2, prefill_chunk=7)
            assert tokens == drain(one, [one.insert(p, **kw)])[0], f"seeded row of {len(p)} tokens"
        else:
            plain = [t for t, _ in generate_tokens(target, p, max_tokens=30)]
            assert tokens == plain, f"row of {len(p)} tokens"


class Counting:
    """The target, recording the tokens of each row of each ragged forward."""

    def __init__(self, target):
        self._target, self.forwards = target, []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        return self._target(*args, **kwargs)

    def ragged(self, chunks, caches, wanted):
        self.forwards.append([c.shape[1] for c in chunks])
        return self._target.ragged(chunks, caches, wanted)


def test_a_prefill_forward_takes_at_most_its_budget_and_a_streaming_row_never_waits_long():
    target = Counting(tiny_target("dense"))
    gen = BatchGenerator(target, None, prefill_chunk=8, prefill_tokens=16)
    streaming, streamed = gen.insert(text("dense")[:5], max_tokens=60), 0
    while streamed < 2:  # its first token, then its first round: it is streaming
        streamed += sum(e.uid == streaming for e in gen.step())
    ps = prompts("dense", (30, 5, 5, 12, 3, 9))
    uids = [gen.insert(p, max_tokens=3) for p in ps]
    firsts, steps, out = {}, 0, {u: [] for u in uids}
    while len(firsts) < len(uids):
        steps += 1
        events = gen.step()
        assert any(e.uid == streaming and e.tokens for e in events)  # a round every step
        for e in events:
            if e.uid in out:
                firsts.setdefault(e.uid, steps)
                out[e.uid] += e.tokens
    chunks = [f for f in target.forwards if sum(f) > len(f)]  # not only last tokens
    assert all(sum(f) <= 16 for f in target.forwards) and max(len(f) for f in chunks) > 1
    assert len(set(firsts.values())) > 1  # rows join as their prompt is done, not all at the end
    for u, tokens in drain(gen, [streaming, *uids]).items():
        out.setdefault(u, []).extend(tokens)
    assert [len(out[u]) for u in uids] == [3] * len(uids)


def states(gen_kwargs: dict, ps: list, boundaries: list) -> PrefixCache:
    target, drafter = tiny_target("dense"), tiny_drafter("dense")
    prefix = PrefixCache(target, 1 << 30)
    gen = BatchGenerator(target, drafter, draft_tokens=2, prefill_chunk=7, prefix_cache=prefix, **gen_kwargs)
    drain(gen, [gen.insert(p, max_tokens=4, boundaries=b) for p, b in zip(ps, boundaries)])
    return prefix


def test_states_a_batched_prefill_leaves_are_bitwise_those_of_a_prefill_alone():
    """Every state rows leave while prefilled together (at turn ends, before and after a prompt's
    last token), restored, holds exactly the K/V a one-at-a-time prefill leaves there."""
    ps = prompts("dense", (13, 20, 26, 33))
    boundaries = [[6], [10], [9, 17], [20]]
    apart = states(dict(prefill_tokens=1), ps, boundaries)
    side = states(dict(prefill_tokens=64), ps, boundaries)
    target = tiny_target("dense")
    checked = 0
    for p, marks in zip(ps, boundaries):
        for m in [*marks, len(p) - 1, len(p)]:
            a, b = (target.make_cache(1, max_rollback=MAX_ROLLBACK) for _ in range(2))
            tokens = p[:m] + [0]  # one token past the state: resume restores the state at m
            assert apart.resume(tokens, a) == side.resume(tokens, b) == m
            low = int(a.oldest()[0])
            for kind, start in ((FULL, 0), (SLIDING, max(low, 0))):
                for layer, (k, v) in a.read(start, m, kind).items():
                    k2, v2 = b.read(start, m, kind)[layer]
                    assert np.array_equal(np.array(k), np.array(k2))
                    assert np.array_equal(np.array(v), np.array(v2))
            checked += 1
    assert checked == 13


def test_prompts_sharing_a_stretch_that_arrive_together_prefill_it_once():
    """Four prompts with one 40-token system turn arrive at once: the first prefills it, the others
    wait for its state there and prefill only their own 10 tokens, several to a forward."""
    target = tiny_target("dense")
    system = text("dense")[:40]
    ps = [system + text("dense")[50 + 10 * i : 60 + 10 * i] for i in range(4)]
    gen = BatchGenerator(target, None, prefill_chunk=16, prefix_cache=PrefixCache(target, 1 << 30))
    uids = [gen.insert(p, max_tokens=12, boundaries=[40]) for p in ps]
    out, stats = {u: [] for u in uids}, {}
    while gen.busy:
        for event in gen.step():
            out[event.uid] += event.tokens
            stats[event.uid] = event.stats
    assert [stats[u].cached_tokens for u in uids] == [0, 40, 40, 40]
    assert gen.stats.prompt_tokens == 40 + 4 * 10 and gen.prefill.pieces > gen.prefill.forwards
    for u, p in zip(uids, ps):
        assert out[u] == [t for t, _ in generate_tokens(target, p, max_tokens=12)]
