"""Step-cost mode: measured per-forward costs of a pair (the target's forward over T tokens per row,
one drafter step) at batch sizes B, and the MTP round cost they imply, in plain decoding steps:

    round(K, B) = (verify(T = K + 1) + K * draft_step) / plain_step(T = 1)

A round emits up to K + 1 tokens per row, so round(K) bounds the speed-up: at acceptance length
L a round pays off only if L > round(K). Medians of within-repeat ratios over interleaved repeats.

`python -m apps.bench.stepcost ARGS` is `python -m apps.bench stepcost ARGS`.
"""

import sys

if __name__ == "__main__":  # set up the regime before anything imports mlx
    from apps.bench.cli import main

    raise SystemExit(main(["stepcost", *sys.argv[1:]]))

import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from .env import median  # noqa: E402
from .pairs import load_pair  # noqa: E402
from .report import fmt, pivot, section, table  # noqa: E402


def timed(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def measure_batch(target, drafter, B: int, sizes: list[int], context: int, repeats: int, log) -> dict:
    cache = target.make_cache(B, max_rollback=max(sizes))
    prefill = target(mx.ones((B, context), dtype=mx.int32), cache)
    mx.eval(prefill.hidden)
    hidden = prefill.hidden[:, -1]
    token = mx.ones((B, 1), dtype=mx.int32)
    position = mx.full((B,), context, dtype=mx.int32)

    def forward(T):
        out = target(mx.ones((B, T), dtype=mx.int32), cache)
        mx.eval(out.logits)
        cache.trim(T)

    def draft_step():
        out = drafter.draft_step(target.embed(token)[:, 0], hidden, target.shared_kv(cache), position)
        mx.eval(out.logits, out.hidden)

    fns = {T: (lambda T=T: forward(T)) for T in sizes}
    fns["draft"] = draft_step
    # Warm-up; a sample repeats a call until it takes ~50 ms (tiny pairs are noisy per call).
    inner = {k: max(1, min(20, round(0.05 / max(timed(fn, 2), 1e-6)))) for k, fn in fns.items()}
    samples = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved: machine noise hits every size alike
        for k, fn in fns.items():
            samples[k].append(timed(fn, inner[k]))
    log(f"  B={B}: " + ", ".join(f"T={k} {1e3 * median(v):.1f} ms" if k != "draft" else
                                 f"draft {1e3 * median(v):.1f} ms" for k, v in samples.items()))
    return samples


def run_stepcost(args, log=print) -> dict:
    sizes = list(range(1, args.max_tokens + 1))
    batches = [int(b) for b in args.batch.split(",")]
    ks = [k for k in (int(k) for k in args.k.split(",")) if k + 1 <= args.max_tokens]
    dtype = None if args.dtype == "stored" else getattr(mx, args.dtype)
    target, drafter, description = load_pair(args.pair, args.seed, dtype)
    log(description)
    forward_ms, draft_ms, ratio_4_1, rounds = {}, {}, {}, {}
    for B in batches:
        s = measure_batch(target, drafter, B, sizes, args.context, args.repeats, log)
        forward_ms[B] = {T: 1e3 * median(s[T]) for T in sizes}
        draft_ms[B] = 1e3 * median(s["draft"])
        per_repeat = lambda f: median([f(r) for r in range(args.repeats)])  # noqa: E731
        if 4 in sizes:
            ratio_4_1[B] = per_repeat(lambda r: s[4][r] / s[1][r])
        for K in ks:
            rounds[f"{K}@{B}"] = per_repeat(lambda r: (s[K + 1][r] + K * s["draft"][r]) / s[1][r])
    return dict(mode="stepcost", pair=args.pair, description=description, context=args.context, dtype=args.dtype,
                repeats=args.repeats, sizes=sizes, batches=batches, ks=ks, forward_ms=forward_ms,
                draft_ms=draft_ms, ratio_4_1=ratio_4_1, round_in_plain_steps=rounds)


def stepcost_md(res: dict) -> str:
    intro = (f"Measured: {res['description']}. Target forward over T new tokens per row on a cache of "
             f"{res['context']} tokens (logits evaluated), one drafter step (logits and next hidden evaluated); "
             f"median of {res['repeats']} interleaved repeats; ratios are medians of within-repeat ratios.")
    header = ["B"] + [f"T={T} ms" for T in res["sizes"]] + ["draft step ms", "T=4 / T=1"]
    rows = [[B] + [fmt(res["forward_ms"][B][T], ".1f") for T in res["sizes"]]
            + [fmt(res["draft_ms"][B], ".1f"), fmt(res["ratio_4_1"].get(B)) + "x"] for B in res["batches"]]
    return section(f"Step cost: {res['pair']} pair, regime {res['regime']['name']}", intro, table(header, rows),
                   "MTP round cost in plain steps, (verify(K+1) + K x draft step) / plain step, same B "
                   f"(regime {res['regime']['name']}):",
                   pivot(res["round_in_plain_steps"], res["ks"], res["batches"], "round / plain step"))
