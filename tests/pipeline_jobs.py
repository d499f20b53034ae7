"""Generation jobs run both in one process (the reference) and on rank 0 of a two-rank pipeline
group (`pipeline_ranks.py`); the outputs must be identical. Greedy MTP and plain decoding, one
row and a batch of rows (joining late, cancelled, drafting differently), seeded sampling, and
for the dense pair an Engine with a multi-turn conversation and one-shot requests that resume
from the prefix cache (every rank stores, resumes and evicts alike)."""

from pathlib import Path

import numpy as np

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.decode.sample import SamplingParams

TINY = Path(__file__).parent / "fixtures" / "tiny"
HOT = SamplingParams(temperature=1.0, top_p=0.95)
TOKENS = 30  # prompt 20 + 30: far past the sliding window of 8


def prompts(variant: str, n: int) -> list:
    ref = np.load(TINY / variant / "reference.npz")
    text = ref["prompt"].tolist() + ref["greedy"].tolist()
    starts = np.random.default_rng(0).integers(0, 30, n - 1)
    return [text[:20]] + [text[s : s + 9 + 3 * i] for i, s in enumerate(starts)]


def one_row(loaded, prompt, drafter=True, draft_tokens="auto", **kw) -> list:
    gen = BatchGenerator(loaded.target, loaded.drafter if drafter else None, draft_tokens=draft_tokens)
    gen.insert(prompt, max_tokens=TOKENS, **kw)
    out = []
    while gen.busy:
        out += [t for event in gen.step() for t in event.tokens]
    return out


def batch(loaded, ps: list) -> dict:
    """Rows with different budgets; two join after three steps, one drafts nothing, one drafts
    one token, one samples with a seed, and one is cancelled after five tokens. Prompts are
    prefilled several to a forward (ranks pass the rows' activations side by side)."""
    jobs = {i: dict(max_tokens=b) for i, b in enumerate([30, 24, 26, 30, 20, 24, 28])}
    jobs[2]["mtp"] = False
    jobs[5]["draft_tokens"] = 1
    jobs[6].update(sampling=HOT, seed=11)
    gen = BatchGenerator(loaded.target, loaded.drafter, draft_tokens=2, prefill_chunk=7, prefill_tokens=24)
    uids, out = {}, {i: [] for i in jobs}
    for step in range(1000):
        if step in (0, 3):
            for i in [i for i in jobs if (i in (3, 4)) == (step == 3)]:
                uids[gen.insert(ps[i], **jobs[i])] = i
        for event in gen.step():
            i = uids[event.uid]
            out[i] += event.tokens
            if i == 1 and len(out[i]) >= 5 and not event.finish_reason:
                gen.cancel(event.uid)
        if not gen.busy and step >= 3:
            break
    assert gen.prefill.pieces > gen.prefill.forwards  # rows did share prefill forwards
    return {str(i): tokens for i, tokens in out.items()}


def conversation(loaded) -> dict:
    """An Engine: a three-turn conversation next to one-shot requests (greedy and seeded)."""
    out = {}
    with Engine(loaded, max_batch=4, draft_tokens=3) as engine:
        chat = engine.conversations.new(system="be brief")
        one_shot = engine.submit(Request([5, 6, 7, 8, 9, 10], max_tokens=30))
        hot = engine.submit(Request("Tell me", max_tokens=30, sampling=HOT, seed=3))
        for turn, text in enumerate(["Hello there, how are you", "AND AGAIN, once more", "last one"]):
            reply = engine.submit(Request(text, conversation=chat, max_tokens=24)).result()
            out[f"turn{turn}"] = list(reply.tokens)
        out["one_shot"] = list(one_shot.result().tokens)
        out["hot"] = list(hot.result().tokens)
        again = engine.submit(Request("Tell me", max_tokens=30, sampling=HOT, seed=3)).result()
        out["again"], out["again_cached"] = list(again.tokens), again.stats.cached_tokens
    assert out["again"] == out["hot"] and out["again_cached"] > 0
    return out


def run_jobs(loaded, variant: str) -> dict:
    ps = prompts(variant, 7)
    out = {
        "plain": one_row(loaded, ps[0], drafter=False),
        "mtp3": one_row(loaded, ps[0], draft_tokens=3),
        "seeded": one_row(loaded, ps[0], sampling=HOT, seed=7),
        "batch": batch(loaded, ps),
    }
    if loaded.tokenizer is not None:  # the dense pair, with a chat tokenizer
        out["auto"] = one_row(loaded, ps[0])
        out["engine"] = conversation(loaded)
    return out
