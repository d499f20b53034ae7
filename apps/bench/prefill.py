"""Prefill mode (issue 31 item 3): requests arriving together, their prompts prefilled one at a time
against several to a forward.

N requests (`--arrivals`, default 8) are inserted into one `BatchGenerator` at the same moment, with
prompts of `--prompt-tokens` new tokens each (lengths spread evenly over the range; distinct held-out
stdlib source, so no two share a prefix, and no prefix cache), greedy, `--max-tokens` tokens each
(stop tokens off), MTP on with the pair's drafter (the Engine's defaults otherwise). What the Engine
does with N requests that arrive together, without its threads. Configurations differ only in
`prefill_tokens`, the prompt tokens one step prefills over all queued rows: 1 (one row at a time:
the driver before issue 31), the prefill chunk (512, the default) and more. Per run: time to first
token of each request (from the insert), the last first token, and the total (to the last token).
Configurations interleave within each repeat after a warm-up; TTFT percentiles pool every request
of every repeat; ratios are medians of within-repeat ratios. Every output is checked against the
plain greedy output of its prompt.
"""

from __future__ import annotations

import time

import numpy as np

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load

from .env import median
from .prompts import code_snippets
from .report import checked, fmt, section, table
from .speed import pair_dirs, quantization_label


def prompts_of(tokenizer, n: int, lo: int, hi: int) -> list:
    """n distinct code prompts of lengths spread evenly over lo..hi tokens."""
    lengths = np.linspace(lo, hi, n).round().astype(int).tolist()
    texts = code_snippets(n, chars=8 * hi)
    ids = [tokenizer.encode(t) for t in texts]
    if len(ids) < n or min(len(x) for x in ids) < hi:
        raise SystemExit(f"not enough held-out source for {n} prompts of {hi} tokens")
    return [x[:length] for x, length in zip(ids, lengths)]


def run_once(gen: BatchGenerator, prompts: list, n: int) -> dict:
    start = time.perf_counter()
    uids = [gen.insert(p, max_tokens=n) for p in prompts]
    first, out = {}, {u: [] for u in uids}
    forwards, pieces = gen.prefill.forwards, gen.prefill.pieces
    while gen.busy:
        for e in gen.step():
            out[e.uid] += e.tokens
            if e.tokens and e.uid not in first:
                first[e.uid] = time.perf_counter() - start
    total = time.perf_counter() - start
    return dict(ttft=[first[u] for u in uids], last_first=max(first.values()), total=total,
                tokens=[out[u] for u in uids], forwards=gen.prefill.forwards - forwards,
                pieces=gen.prefill.pieces - pieces)


def label(budget: int) -> str:
    return "one at a time" if budget == 1 else f"batched, {budget} tokens a step"


def run_prefill(args, log=print) -> dict:
    target_dir, drafter_dir = pair_dirs(args.pair)
    loaded = load(target_dir, drafter_dir)._replace(eos_ids=frozenset())
    if loaded.tokenizer is None:
        raise SystemExit("prefill mode needs a pair with a tokenizer (demo)")
    budgets = [int(b) for b in args.budgets.split(",")]
    scenarios = []
    for spec in args.prompt_tokens.split(","):
        lo, hi = (int(x) for x in spec.split("-"))
        ps = prompts_of(loaded.tokenizer, args.arrivals, lo, hi)
        truth = [[t for t, _ in generate_tokens(loaded.target, p, max_tokens=args.max_tokens)] for p in ps]
        scenarios.append(dict(range=spec, prompts=ps, truth=truth, runs={b: [] for b in budgets}))
    gens = {b: BatchGenerator(loaded.target, loaded.drafter, prefill_chunk=args.chunk, prefill_tokens=b)
            for b in budgets}
    mismatches = set()
    log(f"{len(scenarios)} scenarios x {len(budgets)} configurations x (1 warm-up + {args.repeats} repeats), "
        f"{args.arrivals} requests of {args.max_tokens} tokens each")
    for r in range(args.repeats + 1):
        for s in scenarios:
            for b, gen in gens.items():
                run = run_once(gen, s["prompts"], args.max_tokens)
                if run.pop("tokens") != s["truth"]:
                    mismatches.add(f"{s['range']}, {label(b)}: output differs from plain greedy")
                if r:
                    s["runs"][b].append(run)
        log(f"  pass {r + 1}/{args.repeats + 1} done")
    return dict(mode="prefill", pair=args.pair, quantization=quantization_label(target_dir, loaded.target),
                arrivals=args.arrivals, max_tokens=args.max_tokens, chunk=args.chunk, repeats=args.repeats,
                budgets=budgets, scenarios=[summarize(s, budgets) for s in scenarios],
                mismatches=sorted(mismatches))


def summarize(s: dict, budgets: list) -> dict:
    base = s["runs"][budgets[0]]
    rows = []
    for b in budgets:
        runs = s["runs"][b]
        ttft = [t for run in runs for t in run["ttft"]]

        def ratio(key, pick=lambda run, key: run[key]):
            return median([pick(x, key) / pick(y, key) for x, y in zip(runs, base)])

        def p50(run, key):
            return float(np.percentile(run[key], 50))

        rows.append(dict(budget=b, label=label(b), ttft_p50_ms=1e3 * float(np.percentile(ttft, 50)),
                         ttft_p95_ms=1e3 * float(np.percentile(ttft, 95)),
                         last_first_ms=1e3 * median([run["last_first"] for run in runs]),
                         total_s=median([run["total"] for run in runs]),
                         forwards=median([run["forwards"] for run in runs]),
                         rows_per_forward=median([run["pieces"] / run["forwards"] for run in runs]),
                         p50_ratio=ratio("ttft", p50), total_ratio=ratio("total"),
                         totals=[round(run["total"], 3) for run in runs]))
    return dict(range=s["range"], lengths=[len(p) for p in s["prompts"]], rows=rows)


def prefill_md(res: dict) -> str:
    intro = (f"Measured. {res['arrivals']} greedy requests inserted into one `BatchGenerator` at once, "
             f"{res['max_tokens']} tokens each, MTP on (auto), prompts cut on a grid of {res['chunk']} tokens; "
             "configurations differ in `prefill_tokens` (prompt tokens one step prefills over all queued rows, "
             "in one forward). TTFT from the insert, percentiles over every request of "
             f"{res['repeats']} interleaved repeats after a warm-up; last first token and total (to the last "
             "token): medians; ratios: medians of within-repeat ratios to the first configuration.")
    check = checked(res["mismatches"], "Every output equals its prompt's plain greedy output (every configuration, "
                                       "repeat).")
    return section(f"Requests arriving together: {res['pair']} ({res['quantization']}), {res['arrivals']} "
                   f"requests, regime {res['regime']['name']}", intro, check,
                   *[(f"Prompts of {s['range']} new tokens ({', '.join(map(str, s['lengths']))})", scenario_table(s))
                     for s in res["scenarios"]])


def scenario_table(s: dict) -> str:
    rows = [[r["label"], fmt(r["ttft_p50_ms"], ".0f"), fmt(r["ttft_p95_ms"], ".0f"), fmt(r["last_first_ms"], ".0f"),
             fmt(r["total_s"]), fmt(r["forwards"], ".0f"), fmt(r["rows_per_forward"]), fmt(r["p50_ratio"]) + "x",
             fmt(r["total_ratio"]) + "x"] for r in s["rows"]]
    return table(["prefill", "TTFT p50 ms", "TTFT p95 ms", "last first token ms", "total s", "prefill forwards",
                  "rows per forward", "TTFT p50 ratio", "total ratio"], rows)
