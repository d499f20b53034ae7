"""Replies after images: MTP greedy == plain (and == transformers), MTP sampling has the target's
law, the prefix cache keys an image by its content (in memory and on disk), and an image row runs
in a batch beside text-only rows as it does alone."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_drafter
from test_sample import STRICT, _chi2
from test_vision_prompt import loaded, prompt

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.drafters import MTPProposer
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.models.gemma4_vision import ImageRows, PromptImages
from mlx_mtp.cache.prefix import PrefixCache
from mlx_mtp.cache.disk import DiskTier, model_fingerprint
from mlx_mtp.decode.sample import SamplingParams, probs
from mlx_mtp.decode.stats import Stats
from mlx_mtp.decode.speculative import BatchState, Plan, run_round

DRAFTER = {"bidir": "dense", "causal": "e2b"}  # independently random drafters of the same shapes


def greedy(variant, ids, images, drafter=None, n=24, **kw):
    model = loaded(variant)[0]
    return [t for t, _ in generate_tokens(model, ids.tolist(), drafter=drafter, max_tokens=n, images=images, **kw)]


@pytest.mark.parametrize("variant", ["bidir", "causal"])
def test_greedy_mtp_equals_plain_after_images_past_the_window(variant):
    ids, images = prompt(variant, 3)
    plain = greedy(variant, ids, images, n=32)
    for k in (2, "auto"):
        assert greedy(variant, ids, images, tiny_drafter(DRAFTER[variant]), n=32, draft_tokens=k) == plain


def test_greedy_equals_transformers_generate():
    ids, images = prompt("bidir", 2)
    ref = loaded("bidir")[2]
    assert greedy("bidir", ids, images, tiny_drafter("dense"), n=len(ref["greedy_2"])) == ref["greedy_2"].tolist()


def tiled(images: PromptImages, rows: int, length: int) -> ImageRows:
    """The prompt's images in each of `rows` identical rows of one forward."""
    one = images.rows(0, length)
    flat = mx.concatenate([one.rows + r * length for r in range(rows)])
    return ImageRows(flat, mx.concatenate([one.features] * rows), tuple(mx.repeat(b, rows, axis=0) for b in one.blocks))


def test_mtp_sampling_after_images_follows_the_target_law():
    """As test_speculative_sampling, after a 2-image prompt: the first two sampled tokens of 400 rows
    against the exact laws p1 and p1 @ p(. | x)."""
    n, K, sampling = 400, 2, SamplingParams(temperature=1.0, top_k=40)
    target = loaded("bidir")[0]
    ids, images = prompt("bidir", 2)
    L = len(ids)
    cache = target.make_cache(n, max_rollback=2 * K + 2)
    out = target(mx.array([ids.tolist()] * n), cache, images=tiled(images, n, L))
    last = out.logits[0, -1]
    bonus = int(mx.argmax(last))
    seeds = mx.array(np.random.default_rng(0).integers(0, 2**32, n), dtype=mx.uint32)
    state = BatchState(mx.full((n,), bonus, dtype=mx.int32), out.hidden[:, -1], seeds)
    first, second, accepted = first_two(target, MTPProposer(tiny_drafter("dense"), target), cache, state, sampling, K)
    context = ids.tolist() + [bonus]
    nxt = target(mx.array([context + [x] for x in range(128)]), images=tiled(images, 128, L + 2)).logits[:, -1]
    p_next = np.array(probs(target(mx.array([context]), images=images.rows(0, L + 1)).logits[0, -1], sampling))
    p2 = p_next @ np.array(probs(nxt, sampling))
    for tokens, law in ((first, p_next), (second, p2)):
        assert _chi2(np.bincount(tokens, minlength=128), law)[2] > STRICT
    assert 0.05 < accepted < 0.95  # drafts were both accepted and rejected


def first_two(target, drafter, cache, state, sampling, K: int) -> tuple:
    """MTP rounds of draft length K over the state's rows until each has emitted two tokens: (first
    tokens, second tokens, the share of row-rounds that accepted a draft)."""
    n = len(state.seeds)
    emitted, accepted, rounds = [[] for _ in range(n)], 0, 0
    while min(len(e) for e in emitted) < 2:
        state, rnd = run_round(target, drafter, cache, state, Plan((sampling,) * n, (K,) * n))
        accepted, rounds = accepted + sum(a > 0 for a in rnd.accepted.tolist()), rounds + n
        for row, toks, a in zip(emitted, rnd.tokens.tolist(), rnd.accepted.tolist()):
            row.extend(toks[: a + 1])
    return np.array([e[0] for e in emitted]), np.array([e[1] for e in emitted]), accepted / rounds


def run(gen, ids, images, n=8, stats=None, boundaries=()):
    uid = gen.insert(ids.tolist(), max_tokens=n, images=images, stats=stats, boundaries=boundaries)
    out = []
    while gen.active:
        for ev in gen.step():
            if ev.uid == uid:
                out += ev.tokens
    return out, gen


def other_image(images: PromptImages, which: int) -> PromptImages:
    feats = list(images.features)
    feats[which] = feats[which][::-1]  # the same count of soft tokens, other content
    return PromptImages(images.starts, tuple(feats))


@pytest.mark.parametrize("disk", [False, True])
def test_prefix_cache_keys_images_by_content(tmp_path, disk):
    target = loaded("bidir")[0]
    ids, images = prompt("bidir", 2)
    fresh = {}
    for name, imgs in (("same", images), ("other", other_image(images, 1))):
        fresh[name] = run(BatchGenerator(target, prefill_chunk=5), ids, imgs)[0]
    assert fresh["same"] != fresh["other"]
    tier = DiskTier(tmp_path, model_fingerprint(target), 1 << 30, target.make_cache(1).window) if disk else None
    pc = PrefixCache(target, 1 << 30, disk=tier)
    turn = [images.spans[0][1] + 2]  # a state left between the two images (a turn's end)
    run(BatchGenerator(target, prefill_chunk=5, prefix_cache=pc), ids, images, boundaries=turn)
    if disk:  # a new process: nothing in memory, the states on disk
        pc = PrefixCache(target, 1 << 30, disk=DiskTier(tmp_path, model_fingerprint(target), 1 << 30,
                                                         target.make_cache(1).window))
    cached = {}
    for name, imgs in (("other", other_image(images, 1)), ("same", images)):
        stats = Stats()
        gen = BatchGenerator(target, prefill_chunk=5, prefix_cache=pc)
        assert run(gen, ids, imgs, stats=stats, boundaries=turn)[0] == fresh[name]
        cached[name] = stats.cached_tokens
    assert cached["same"] >= len(ids) - 1  # the whole prompt but (at most) its last token
    assert turn[0] <= cached["other"] <= images.spans[1][0]  # up to the other image, never into it


def test_image_row_beside_text_rows_equals_alone():
    target = loaded("bidir")[0]
    ids, images = prompt("bidir", 3)
    alone = run(BatchGenerator(target, tiny_drafter("dense")), ids, images, n=12)[0]
    gen = BatchGenerator(target, tiny_drafter("dense"), prefill_chunk=7, prefill_tokens=64)  # rows share forwards
    text = [gen.insert(list(range(3, 3 + m)), max_tokens=12) for m in (9, 20)]
    uid = gen.insert(ids.tolist(), max_tokens=12, images=images)
    out = {u: [] for u in (*text, uid)}
    while gen.active:
        for ev in gen.step():
            out[ev.uid] += ev.tokens
    assert out[uid] == alone
    assert gen.prefill.pieces > gen.prefill.forwards  # the image's pieces ran in steps beside text rows
    for u, m in zip(text, (9, 20)):
        assert out[u] == [t for t, _ in generate_tokens(target, list(range(3, 3 + m)), max_tokens=12)]
