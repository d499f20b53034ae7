"""Oracle mode (issue 13 item 2): MTP vs plain decoding at controlled acceptance, paying a real
drafter's cost, for K = 1..6 and auto at B rows, in the chosen regime.

A row's drafts come from `RowsOracle`: like `mlx_mtp.decode.oracle.OracleDrafter` (lazy, no host read
inside a round; whether the draft at a position is right is a hash of (seed, position), so every
K meets the same luck) but with one truth per row: row r proposes the plain greedy continuation
of its own prompt. It runs the pair's real drafter too (`inner`), so each round pays the real
drafting cost; its tokens are not used. Rows are B different random-id prompts of the same length.

Method. Each row's prompt but its last token is prefilled once into a prefix cache; every run
inserts the prompts, which resume from there and feed only their last token, and the rows
join the batch in the same step (`JoinTogether`, a bench-only subclass that prefills every
pending row in one step), so every round has B rows. Timed: from the step that delivered the
rows' first tokens to the last event (the decode phase). One BatchGenerator per mode and B is
kept across the warm-up and the repeats, as the Engine keeps one, so `auto` starts each run with
the costs and acceptance it has measured. Repeat r uses oracle seed `--seed + r` for every K (so
results average over seeds); MTP/plain = plain decode time / mode decode time, the median of
within-repeat ratios; round cost in plain steps = (time per round) / (time per plain step).
"""

from __future__ import annotations

import json
import time

import mlx.core as mx
import numpy as np

from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.drafters import MTPProposer
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.loading import load_model
from mlx_mtp.decode.prefill import Prefill
from mlx_mtp.cache.prefix import PrefixCache
from mlx_mtp.decode.sample import uniform
from mlx_mtp.decode.speculative import K_MAX, MAX_ROLLBACK, Drafts

from .env import median
from .pairs import ROOT, build, load_pair
from .report import checked, fmt, section, table

_RIGHT, _WRONG = 5, 6  # the random streams mlx_mtp.decode.oracle uses


class RowsOracle:
    """Per-row truth: row r (the r-th inserted into the generator) proposes truth[r]'s next
    tokens, each right with probability p, decided by a hash of (seed + r, position)."""

    needs_history = False

    def __init__(self, truths: list, prompt_lens: list, vocab: int, p: float, inner=None):
        width = max(len(t) for t in truths) + K_MAX + 2
        self.truth = mx.array([list(t) + [0] * (width - len(t)) for t in truths], dtype=mx.int32)
        self.prompt_lens = mx.array(prompt_lens, dtype=mx.int32)
        self.vocab, self.p, self.inner = vocab, p, inner
        self.seed, self.gen, self.first_uid = 0, None, 0

    def start(self, gen: BatchGenerator, seed: int) -> None:
        """Before a run: the generator whose rows this serves, and the run's seed."""
        self.gen, self.seed, self.first_uid = gen, seed, gen._uids

    def propose(self, state, cache, k: int, plan) -> Drafts:
        rows = mx.array([r.uid - self.first_uid for r in self.gen.rows], dtype=mx.int32)  # host list: no sync
        positions = cache.offset[:, None] + 1 + mx.arange(k, dtype=mx.int32)[None]  # (B, k)
        index = mx.clip(positions - self.prompt_lens[rows][:, None], 0, self.truth.shape[1] - 1)
        right = mx.take_along_axis(self.truth[rows], index, axis=1)
        seeds = (rows + self.seed * 7919).astype(mx.uint32)
        lucky = uniform(seeds, positions, _RIGHT) < self.p
        offset = 1 + (uniform(seeds, positions, _WRONG) * (self.vocab - 1)).astype(mx.int32)
        tokens = mx.where(lucky, right, (right + offset) % self.vocab)
        if self.inner is not None:  # pay for the real drafter; its tokens are not used
            tokens = tokens + 0 * self.inner.propose(state, cache, k, plan).tokens
        return Drafts(tokens)


class JoinTogether(BatchGenerator):
    """Bench only: every pending row is prefilled in the same step, so the batch starts with
    all of its rows (the driver itself prefills at most `prefill_tokens` prompt tokens a step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefill = _Drain(self.target, self.prefill_chunk, self.prefill_tokens, self.prefix,
                              self.lockstep.share, self.stats)


class _Drain(Prefill):
    """Prefill steps until the queue is empty, as one."""

    def step(self, pending, keeps_history):
        history = keeps_history(list(pending))  # decided for every row at once: they all join now
        ran, joined = False, []
        while pending:
            did, done = super().step(pending, lambda rows: history)
            ran, joined = ran or did, joined + done
        return ran, joined


def first_token(target, prompt: list) -> float:
    """Seconds from inserting a prompt into a fresh generator to its first token (one row)."""
    gen = JoinTogether(target)
    uid = gen.insert(prompt, max_tokens=1)
    start = time.perf_counter()
    while not any(e.tokens for e in gen.step() if e.uid == uid):
        pass
    seconds = time.perf_counter() - start
    gen.remove(uid)
    return seconds


def prefilled(target, prompts: list) -> PrefixCache:
    """A prefix cache holding the state after each prompt but its last token (pinned: with a
    budget of 0 it keeps nothing else, so the runs leave nothing behind)."""
    states = PrefixCache(target, budget=0)
    for p in prompts:
        cache = target.make_cache(1, max_rollback=MAX_ROLLBACK)
        target(mx.array([p[:-1]], dtype=mx.int32), cache, keep=0)
        mx.eval(cache.keys, cache.values, cache.offset)
        states.store(p[:-1], cache, pin="prompts")
    return states


def decode_run(gen: BatchGenerator, prompts: list, n: int) -> dict:
    """Rows resume from the prompts' states (`gen.prefix`); times the decode phase (after the
    first tokens)."""
    uids = [gen.insert(p, max_tokens=n) for p in prompts]
    out = {u: [] for u in uids}
    begun, reads = None, []
    while gen.busy:
        events = gen.step()
        for e in events:
            out[e.uid] += e.tokens
        if begun is None and all(out.values()):
            begun = time.perf_counter()  # every first token is in; round 1 is queued
            reads.append(begun)
        elif begun is not None and any(e.tokens for e in events):
            reads.append(time.perf_counter())  # a round was read
    rows = [out[u] for u in uids]
    for u in uids:
        gen.remove(u)
    return dict(tokens=rows, seconds=reads[-1] - begun, steps=len(reads) - 1, decoded=sum(len(r) - 1 for r in rows),
                step_seconds=np.diff(reads).tolist())


def oracle_pair(name: str, seed: int):
    """(target, drafter, a random drafter of the same shape, description), fp32."""
    if name.startswith("tiny-"):
        base = ROOT / "tests" / "fixtures" / "tiny" / name[5:]
        target, drafter = load_model(base / "target")[0], load_model(base / "drafter")[0]
        return target, drafter, drafter, f"{name} fixture pair (random drafter)"
    target, drafter, description = load_pair(name, seed)
    if name == "mid":
        return target, drafter, drafter, description + "; its drafter is random"
    config = json.loads((ROOT / "mlx_mtp" / "demo" / "drafter" / "config.json").read_text())
    return target, drafter, build(config, seed + 7), description + "; random drafter: the demo drafter's config"


def expected_tokens(p: float, k: int) -> float:
    """E[tokens per round] of an oracle with per-draft probability p and K drafts (bonus included)."""
    return sum(p ** i for i in range(k + 1))


def parse_ks(text: str) -> list:
    return [k if k == "auto" else int(k) for k in text.split(",") if k]


def bench_pair(name: str, args, log) -> dict:
    target, drafter, random_drafter, description = oracle_pair(name, args.seed)
    log(description)
    ps, ks = [float(p) for p in args.p.split(",")], parse_ks(args.k)
    batches = [int(b) for b in args.batch.split(",")]
    n, vocab = args.tokens, target.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(4, vocab, args.context).tolist() for _ in range(max(batches))]
    truths = [[t for t, _ in generate_tokens(target, p, max_tokens=n)] for p in prompts]
    states = prefilled(target, prompts)
    inner = MTPProposer(drafter, target)
    modes = {"plain": (None, 0)}  # name -> (proposer, K)
    oracles = {p: RowsOracle(truths, [len(x) for x in prompts], vocab, p, inner) for p in ps}
    for p in ps:
        for k in ks:
            modes[f"oracle-{p}-K{k}"] = (oracles[p], k)
    if not args.no_random:
        modes["random-auto"] = (random_drafter, "auto")
    gens = {(m, B): JoinTogether(target, proposer, draft_tokens=k, prefix_cache=states)
            for m, (proposer, k) in modes.items() for B in batches}
    results = {key: [] for key in gens}
    mismatches = []

    def once(key, seed):
        gen = gens[key]
        proposer = modes[key[0]][0]
        if isinstance(proposer, RowsOracle):
            proposer.start(gen, seed)
        B = key[1]
        run = decode_run(gen, prompts[:B], n)
        if run["tokens"] != truths[:B]:
            mismatches.append(f"{name} B={B} {key[0]}: output differs from plain greedy")
        run["stats"] = gen.stats
        return run

    log(f"{name}: {len(gens)} cases x (1 warm-up + {args.repeats} repeats), {n} tokens per row")
    started = time.perf_counter()
    for key in gens:
        once(key, args.seed + 1000)
    before = {key: _counts(gens[key].stats) for key in gens}
    for r in range(args.repeats):
        for key in gens:
            results[key].append(once(key, args.seed + r))
        log(f"  repeat {r + 1}/{args.repeats} done ({time.perf_counter() - started:.0f} s)")
    rows = []
    for (mode, B), runs in results.items():
        base = results[("plain", B)]
        speed = [b["seconds"] / m["seconds"] for m, b in zip(runs, base)]
        round_cost = [(m["seconds"] / m["steps"]) / (b["seconds"] / b["steps"]) for m, b in zip(runs, base)]
        proposer, k = modes[mode]
        c0, c1 = before[(mode, B)], _counts(gens[(mode, B)].stats)
        rounds, plain = c1[0] - c0[0], c1[1] - c0[1]
        accepted, drafted = c1[2] - c0[2], c1[3] - c0[3]
        decoded = sum(run["decoded"] for run in runs)
        p = proposer.p if isinstance(proposer, RowsOracle) else None
        rows.append(dict(
            pair=name, batch=B, mode=mode, k=k, p=p,
            decode_tps=median([run["decoded"] / run["seconds"] for run in runs]),
            speedup_vs_plain=median(speed), round_in_plain_steps=median(round_cost),
            speedups=[round(x, 3) for x in speed], round_costs=[round(x, 3) for x in round_cost],
            at_expected=expected_tokens(p, k) / median(round_cost) if p is not None and k != "auto" else None,
            ms_per_round=1e3 * median([run["seconds"] / run["steps"] for run in runs]),
            tokens_per_row_round=decoded / max(B * sum(run["steps"] for run in runs), 1),
            acceptance_length=1 + accepted / rounds if rounds else None,
            draft_acceptance=accepted / drafted if drafted else None,
            plain_step_share=plain / (plain + rounds) if plain + rounds else None,
            expected_tokens=expected_tokens(p, k) if p is not None and k != "auto" else None,
            policy=policy_state(gens[(mode, B)]) if k == "auto" else None,
        ))
    summary = {}
    for B in batches:
        for p in ps:
            fixed = [r for r in rows if r["batch"] == B and r["p"] == p and r["k"] != "auto"]
            best = max(fixed, key=lambda r: r["speedup_vs_plain"]) if fixed else None
            auto = next((r for r in rows if r["batch"] == B and r["p"] == p and r["k"] == "auto"), None)
            summary[f"p{p}@{B}"] = dict(best_k=best["k"] if best else None,
                                        best=best["speedup_vs_plain"] if best else None,
                                        auto=auto["speedup_vs_plain"] if auto else None,
                                        auto_vs_best=auto["speedup_vs_plain"] / best["speedup_vs_plain"]
                                        if auto and best else None)
        rnd = next((r for r in rows if r["batch"] == B and r["mode"] == "random-auto"), None)
        summary[f"random@{B}"] = rnd["speedup_vs_plain"] if rnd else None
    return dict(pair=name, description=description, prompt_tokens=args.context, batches=batches, ps=ps,
                ks=ks, rows=rows, summary=summary, mismatches=sorted(set(mismatches)))


def policy_state(gen: BatchGenerator) -> dict:
    """What `auto` believes at the end: per-position acceptance and round cost (ms) per (rows, K)."""
    policy = gen.policy
    return dict(accept=[round(float(a), 3) for a in policy.accept],
                cost_ms={f"{rows}x{k}": round(1e3 * c, 2) for (rows, k), c in sorted(policy.cost.items())})


def _counts(s) -> tuple:
    return s.rounds, s.plain_steps, s.accepted, s.drafted


def run_oracle(args, log=print) -> dict:
    if args.batch is None:
        args.batch = "1" if args.regime == "stock" else "1,4,8"
    if args.quick:
        args.batch, args.k, args.tokens, args.repeats = "1", "2,auto", 12, 1
    pairs = [bench_pair(p, args, log) for p in args.pair.split(",")]
    return dict(mode="oracle", tokens=args.tokens, repeats=args.repeats, pairs=pairs,
                mismatches=[m for p in pairs for m in p["mismatches"]])


def oracle_md(res: dict) -> str:
    intro = (f"Measured. {res['tokens']} new tokens per row, greedy; rows join together and the decode phase is "
             f"timed (prefill excluded); {res['repeats']} interleaved repeats after a warm-up, repeat r with oracle "
             "seed seed + r for every K (averaged over seeds); MTP/plain = plain decode time / mode decode time and "
             "round cost = time per round / time per plain step, medians of within-repeat ratios. oracle-p-K: the "
             "real drafter's cost, each draft right with probability p; E[tokens/round] = 1 + p + ... + p^K "
             "(measured: tokens per row per round). 'at expected acceptance' = E[tokens/round] / round cost (the "
             "measured round cost at the oracle's expected acceptance, free of the seeds' luck). random-auto: the "
             "random (untrained) drafter, draft length auto. Per-repeat ratios and `auto`'s final cost and acceptance "
             "estimates are in results.json.")
    return section(f"Oracle drafter (controlled acceptance), regime {res['regime']['name']}", intro,
                   *[pair_part(p) for p in res["pairs"]])


def pair_part(p: dict) -> tuple:
    """One pair's subsection: the output check, the summary per oracle p and B, every (B, mode) row."""
    check = checked(p["mismatches"], "Every output equals plain greedy decoding (every row, mode, repeat).")
    lines = []
    for q in p["ps"]:
        cells = []
        for b in p["batches"]:
            s = p["summary"][f"p{q}@{b}"]
            cells.append(f"best K={s['best_k']}: {fmt(s['best'])}x; auto {fmt(s['auto'])}x "
                         f"({fmt(s['auto_vs_best'])} of best)")
        lines.append([f"oracle p={q}: MTP/plain", *cells])
    lines.append(["random drafter, auto / plain", *[fmt(p["summary"][f"random@{b}"]) + "x" for b in p["batches"]]])
    rows = [[r["batch"], r["mode"], fmt(r["decode_tps"], ".1f"), fmt(r["speedup_vs_plain"]) + "x",
             fmt(r.get("at_expected")) + ("x" if r.get("at_expected") else ""),
             fmt(r["ms_per_round"], ".1f"), fmt(r["round_in_plain_steps"]) + "x",
             fmt(r["tokens_per_row_round"]), fmt(r["expected_tokens"]), fmt(r["acceptance_length"]),
             fmt(r["plain_step_share"])] for r in p["rows"]]
    return (f"{p['pair']}: {p['description']}", check,
            table(["target", *[f"B={b}" for b in p["batches"]]], lines),
            table(["B", "mode", "decode tok/s", "MTP/plain", "at expected acceptance", "ms/round",
                   "round / plain step", "tokens/row/round", "expected", "accept. length", "plain-step share"], rows))
