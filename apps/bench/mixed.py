"""Mixed mode (issue 20 part 2): one batch mixing prose rows (drafts rarely accepted past the
first) and code rows (drafts mostly accepted), greedy, under each draft-length policy. Prose rows
run longer (`--prose-tokens`, default twice `--tokens`), so the batch ends with hard rows only, as
a batch does where easy requests finish first.

Modes, each on one BatchGenerator kept over the warm-up and the repeats (as the Engine keeps
one, so `auto` carries what it measured): plain decoding, fixed K, `auto-wide` (the issue-13
policy: one acceptance estimate per drafter, over all rows; a bench-only subclass that ignores
the rows) and `auto` (each row's own acceptance, the drafter's estimate as its prior). Every
prompt but its last token is prefilled once into a prefix cache; in each run the rows resume
from there and join in the same step (`JoinTogether`), and the decode phase is timed: aggregate
tok/s = all rows' tokens after their first / wall time. Modes interleave within each repeat;
ratios are medians of within-repeat ratios. Every output is checked against plain greedy.
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load
from mlx_mtp.decode.speculative import DraftPolicy
from mlx_mtp.decode.stats import Stats

from .env import median
from .oracle import JoinTogether, prefilled
from .prompts import prompt_sets
from .report import checked, fmt, section, table
from .speed import pair_dirs, quantization_label


class DrafterWide(DraftPolicy):
    """The issue-13 policy: the round's K from the drafter's estimate over all rows."""

    def choose(self, rows, members=()):
        return super().choose(rows)


def run_once(gen: JoinTogether, prompts: dict, budgets: dict) -> dict:
    """All rows at once; per-class statistics; the decode phase timed (after every first token)."""
    rows = {gen.insert(p, max_tokens=budgets[cls], stats=Stats()): (cls, p) for cls, ps in prompts.items() for p in ps}
    out = {u: [] for u in rows}
    stats = {}
    begun = None
    while gen.busy:
        for e in gen.step():
            out[e.uid] += e.tokens
            stats[e.uid] = e.stats
        if begun is None and all(out.values()):
            begun = time.perf_counter()
    seconds = time.perf_counter() - begun
    for u in rows:
        gen.remove(u)
    return dict(seconds=seconds, decoded=sum(len(t) - 1 for t in out.values()),
                outputs={u: (rows[u], out[u]) for u in rows}, stats={u: (rows[u][0], stats[u]) for u in rows})


def class_acceptance(stats: dict) -> dict:
    """Per prompt class: accepted / drafted over its rows (one run)."""
    out = {}
    for cls, s in stats.values():
        a, d = out.get(cls, (0, 0))
        out[cls] = (a + s.accepted, d + s.drafted)
    return {cls: a / d if d else None for cls, (a, d) in out.items()}


def run_mixed(args, log=print) -> dict:
    target_dir, drafter_dir = pair_dirs(args.pair)
    dtype = None if args.dtype == "stored" else getattr(mx, args.dtype)
    loaded = load(target_dir, drafter_dir, dtype=dtype)
    sets = prompt_sets(loaded, target_dir, max(args.prose, args.code))
    prompts = {"prose": sets["prose"][: args.prose], "code": sets["code"][: args.code]}
    budgets = {"prose": args.prose_tokens or 2 * args.tokens, "code": args.tokens}
    every = [(cls, p) for cls, ps in prompts.items() for p in ps]
    truth = {tuple(p): [t for t, _ in generate_tokens(loaded.target, p, max_tokens=budgets[cls])] for cls, p in every}
    states = prefilled(loaded.target, [p for _, p in every])
    modes = {"plain": (None, 0)}
    for k in (int(k) for k in args.k.split(",") if k):
        modes[f"K={k}"] = (loaded.drafter, k)
    modes["auto-wide"] = (loaded.drafter, "auto")
    modes["auto"] = (loaded.drafter, "auto")
    gens = {}
    for name, (drafter, k) in modes.items():
        gens[name] = JoinTogether(loaded.target, drafter, draft_tokens=k, prefix_cache=states)
        if k == "auto":  # a policy of its own, kept over the repeats
            gens[name].policy = DrafterWide("auto") if name == "auto-wide" else DraftPolicy("auto")
    runs = {name: [] for name in modes}
    mismatches = set()
    log(f"{len(modes)} modes x (1 warm-up + {args.repeats} repeats), {args.prose} prose rows of {budgets['prose']} "
        f"tokens + {args.code} code rows of {budgets['code']}")
    for r in range(args.repeats + 1):
        for name, gen in gens.items():
            run = run_once(gen, prompts, budgets)
            for (cls, p), tokens in run["outputs"].values():
                if tokens != truth[tuple(p)]:
                    mismatches.add(f"{name}: a {cls} row differs from plain greedy")
            if r:
                runs[name].append(run)
        log(f"  pass {r + 1}/{args.repeats + 1} done")
    rows = []
    for name, rs in runs.items():
        ratios = [p["seconds"] / m["seconds"] for m, p in zip(rs, runs["plain"])]
        acc = [class_acceptance(run["stats"]) for run in rs]
        rows.append(dict(mode=name, decode_tps=median([run["decoded"] / run["seconds"] for run in rs]),
                         vs_plain=median(ratios), ratios=[round(x, 3) for x in ratios],
                         prose_acceptance=_median_of(acc, "prose"), code_acceptance=_median_of(acc, "code"),
                         plain_share=_plain_share(gens[name].stats)))
    by = {row["mode"]: row for row in rows}
    best_other = max(by["auto-wide"]["vs_plain"], by.get("K=3", {}).get("vs_plain", 0.0))
    return dict(mode="mixed", pair=args.pair, quantization=quantization_label(target_dir, loaded.target),
                prose=args.prose, code=args.code, budgets=budgets, repeats=args.repeats, rows=rows,
                auto_vs_best_other=by["auto"]["vs_plain"] / best_other if best_other else None,
                mismatches=sorted(mismatches))


def _median_of(per_run: list, cls: str):
    values = [a[cls] for a in per_run if a.get(cls) is not None]
    return median(values) if values else None


def _plain_share(stats) -> float:
    return stats.plain_steps / stats.target_forwards if stats.target_forwards else 1.0


def mixed_md(res: dict) -> str:
    intro = (f"Measured. Greedy, {res['budgets']['prose']} tokens per prose row and {res['budgets']['code']} per code "
             "row (the batch ends with prose rows only), decode phase timed (every row's first token "
             f"excluded), medians of {res['repeats']} interleaved repeats after a warm-up; vs plain = median of "
             "within-repeat ratios of wall time. `auto-wide`: one acceptance estimate per drafter (the issue-13 "
             "policy); `auto`: each row's own, the drafter's as its prior. Acceptance: accepted / drafted drafts "
             "of the class's rows; plain share: rounds that drafted nothing (all runs).")
    check = checked(res["mismatches"], "Every row's output equals plain greedy decoding (every mode, repeat).")
    rows = [[r["mode"], fmt(r["decode_tps"]), fmt(r["vs_plain"]) + "x", fmt(r["prose_acceptance"]),
             fmt(r["code_acceptance"]), fmt(r["plain_share"])] for r in res["rows"]]
    parts = [intro, check, table(["mode", "aggregate decode tok/s", "vs plain", "prose acceptance",
                                  "code acceptance", "plain share"], rows)]
    if res["auto_vs_best_other"] is not None:
        verdict = "met" if res["auto_vs_best_other"] >= 1.0 else "MISSED"
        parts.append(f"Target (issue 20): `auto` >= the better of `auto-wide` and K=3: "
                     f"{res['auto_vs_best_other']:.2f}x ({verdict}).")
    return section(f"Mixed batch: {res['pair']} ({res['quantization']}), {res['prose']} prose + {res['code']} code "
                   f"rows, regime {res['regime']['name']}", *parts)
