"""Engine mode (issue 10): the `Engine` under N concurrent requests.

For each pair, N client threads (N = 1, 2, 4, 8) submit one greedy request each at the same
moment (a barrier) and read their events; per configuration: aggregate tok/s (all tokens / wall
from the first submit to the last event), per-request tok/s (its tokens / its own submit-to-done
time, queueing included) and decode tok/s (after its first token), time to first token p50/p95
over every request of every repeat, MTP on vs off. Baselines in the same run: `max_batch=1`
(the FIFO engine) at N = `--fifo-clients`, and one request through `generate_tokens` on this
thread (what the Engine's worker adds at N = 1). Stop tokens are disabled so every request
generates exactly `--max-tokens`; every output is checked against the pair's plain greedy output
of its prompt. All configurations are interleaved within each repeat; ratios are medians of
within-repeat ratios.

The old single-request driver of commit 4491006 (run in a child process) was removed in issue 38;
its figures in apps/README.md came from that code, at commit d223093.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

import mlx_mtp
from mlx_mtp.engine.engine import Engine, Request
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.decode.stats import Stats

from .env import median
from .prompts import prompt_sets
from .report import checked, fmt, section, table
from .speed import pair_dirs, quantization_label

TARGETS = {"batch": 2.5, "mtp": 0.95, "gen": 0.95}


def percentile(xs, q):
    return float(np.percentile(xs, q)) if xs else None


@dataclasses.dataclass
class Config:
    driver: str  # "new" (Engine) or "gen" (generate_tokens on this thread)
    max_batch: int
    clients: int
    mtp: bool
    runs: list = dataclasses.field(default_factory=list)

    @property
    def key(self) -> str:
        mb = "gen" if self.driver == "gen" else f"mb{self.max_batch}"
        return f"{mb}-n{self.clients}-{'mtp' if self.mtp else 'plain'}"


def run_clients(engine: Engine, prompts: list, n: int, mtp: bool) -> dict:
    """N threads submit at once; returns per-request (submit, first, done, tokens, stats)."""
    barrier = threading.Barrier(len(prompts) + 1)
    out: list = [None] * len(prompts)
    errors: list = []

    def client(i):
        barrier.wait()
        start = time.perf_counter()
        try:
            handle = engine.submit(Request(prompt=prompts[i], max_tokens=n, mtp=mtp))
            first, last = None, None
            for event in handle:
                if event.kind == "token" and first is None:
                    first = time.perf_counter()
                elif event.kind == "error":
                    raise event.error
                last = event
            out[i] = dict(start=start, first=first, done=time.perf_counter(), tokens=list(last.tokens),
                          rounds=last.stats.rounds, accepted=last.stats.accepted,
                          plain_steps=last.stats.plain_steps)
        except BaseException as e:  # report, do not hang the barrier's owner
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return summarize_run(out)


def run_generate(loaded, prompt: list, n: int, mtp: bool) -> dict:
    """One request through generate_tokens on this thread: the Engine's work without its worker."""
    stats = Stats()
    start = time.perf_counter()
    tokens, first = [], None
    for token, _ in generate_tokens(loaded.target, prompt, drafter=loaded.drafter if mtp else None, max_tokens=n,
                                    stats=stats):
        tokens.append(token)
        if first is None:
            first = time.perf_counter()
    return summarize_run([dict(start=start, first=first, done=time.perf_counter(), tokens=tokens,
                               rounds=stats.rounds, accepted=stats.accepted, plain_steps=stats.plain_steps)])


def summarize_run(reqs: list) -> dict:
    wall = max(r["done"] for r in reqs) - min(r["start"] for r in reqs)
    total = sum(len(r["tokens"]) for r in reqs)
    return dict(
        wall=wall, aggregate_tps=total / wall,
        per_request_tps=[len(r["tokens"]) / (r["done"] - r["start"]) for r in reqs],
        decode_tps=[(len(r["tokens"]) - 1) / max(r["done"] - r["first"], 1e-9) for r in reqs],
        ttft=[r["first"] - r["start"] for r in reqs], tokens=[r["tokens"] for r in reqs],
        rounds=sum(r["rounds"] for r in reqs), accepted=sum(r["accepted"] for r in reqs),
        plain_steps=sum(r["plain_steps"] for r in reqs),
    )


def pair_prompts(loaded, target_dir: Path, rows: int) -> tuple[str, list]:
    sets = prompt_sets(loaded, target_dir, rows)
    cls = "code" if "code" in sets else "fixture"
    return cls, sets[cls][:rows]


def bench_pair(pair: str, args, log) -> dict:
    target_dir, drafter_dir = pair_dirs(pair)
    dtype = None if args.dtype == "stored" else getattr(mx, args.dtype)
    loaded = mlx_mtp.load(target_dir, drafter_dir, dtype=dtype)._replace(eos_ids=frozenset())  # no stops
    clients = [int(c) for c in args.clients.split(",")]
    n, rows = args.max_tokens, max(clients + [args.fifo_clients])
    cls, prompts = pair_prompts(loaded, target_dir, rows)
    truth = [[t for t, _ in generate_tokens(loaded.target, p, max_tokens=n)] for p in prompts]
    engines = {1: Engine(loaded, max_batch=1), max(clients): Engine(loaded, max_batch=max(clients))}
    configs = []
    for mtp in (True, False):
        configs += [Config("new", max(clients), c, mtp) for c in clients]
        if args.fifo_clients:
            configs.append(Config("new", 1, args.fifo_clients, mtp))
        configs.append(Config("gen", 1, 1, mtp))

    def once(c: Config) -> dict:
        if c.driver == "gen":
            return run_generate(loaded, prompts[0], n, c.mtp)
        return run_clients(engines[c.max_batch], prompts[: c.clients], n, c.mtp)

    log(f"{pair}: {len(configs)} configurations x (1 warm-up + {args.repeats} repeats), {n} tokens per request")
    started = time.perf_counter()
    mismatches = []
    for c in configs:
        once(c)
    for r in range(args.repeats):
        for c in configs:
            run = once(c)
            c.runs.append(run)
            if run["tokens"] != truth[: c.clients]:
                mismatches.append(f"{pair} {c.key} repeat {r + 1}: output differs from plain greedy")
        log(f"  repeat {r + 1}/{args.repeats} done ({time.perf_counter() - started:.0f} s)")
    for e in engines.values():
        e.close()
    return dict(pair=pair, prompt_class=cls, prompt_tokens=[len(p) for p in prompts],
                quantization=quantization_label(target_dir, loaded.target),
                rows=[row(c) for c in configs], ratios=ratios(configs, clients, args.fifo_clients),
                mismatches=sorted(set(mismatches)))


def row(c: Config) -> dict:
    ttft = [t for run in c.runs for t in run["ttft"]]
    rounds, acc = sum(r["rounds"] for r in c.runs), sum(r["accepted"] for r in c.runs)
    plain = sum(r["plain_steps"] for r in c.runs)
    return dict(key=c.key, driver=c.driver, max_batch=c.max_batch, clients=c.clients, mtp=c.mtp,
                aggregate_tps=median([r["aggregate_tps"] for r in c.runs]),
                per_request_tps=median([median(r["per_request_tps"]) for r in c.runs]),
                decode_tps=median([median(r["decode_tps"]) for r in c.runs]),
                ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p95_ms=1e3 * percentile(ttft, 95),
                acceptance_length=1 + acc / rounds if rounds else None,
                plain_step_share=plain / (plain + rounds) if plain + rounds else None,
                wall_s=median([r["wall"] for r in c.runs]))


def ratios(configs: list, clients: list, fifo: int) -> dict:
    by = {c.key: c for c in configs}

    def ratio(a: str, b: str) -> Optional[float]:
        if a not in by or b not in by:
            return None
        return median([x["aggregate_tps"] / y["aggregate_tps"] for x, y in zip(by[a].runs, by[b].runs)])

    mb = max(clients)
    out = {}
    for mtp in ("mtp", "plain"):
        out[f"batch_vs_fifo_{mtp}"] = ratio(f"mb{mb}-n{fifo}-{mtp}", f"mb1-n{fifo}-{mtp}")
        out[f"n1_vs_gen_{mtp}"] = ratio(f"mb{mb}-n1-{mtp}", f"gen-n1-{mtp}")
    for c in clients:
        out[f"mtp_vs_plain_n{c}"] = ratio(f"mb{mb}-n{c}-mtp", f"mb{mb}-n{c}-plain")
    out["mtp_vs_plain_fifo"] = ratio(f"mb1-n{fifo}-mtp", f"mb1-n{fifo}-plain")
    return out


def run_engine(args, log=print) -> dict:
    if args.quick:
        args.clients, args.max_tokens, args.repeats = "1,8", 24, 1
    pairs = [bench_pair(p, args, log) for p in args.pair.split(",")]
    return dict(mode="engine", max_tokens=args.max_tokens, repeats=args.repeats, clients=args.clients,
                fifo_clients=args.fifo_clients, pairs=pairs,
                mismatches=[m for p in pairs for m in p["mismatches"]])


def verdict(value: Optional[float], target: float) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x ({'met' if value >= target else 'MISSED'}, target >= {target}x)"


def engine_md(res: dict) -> str:
    intro = (f"Measured. Greedy requests of {res['max_tokens']} tokens (stop tokens disabled), one per client "
             f"thread, submitted at once; {res['repeats']} interleaved repeats after a warm-up; aggregate = all "
             "tokens / wall from the first submit to the last event; per-request tok/s = its tokens / its "
             "submit-to-done time (queueing included); decode tok/s after its first token; TTFT percentiles over "
             "every request of every repeat. `mb1` = `Engine(max_batch=1)` (FIFO); `gen` = one request through "
             "`generate_tokens` on the calling thread. Ratios: medians of within-repeat ratios of aggregate tok/s.")
    return section(f"Engine under N concurrent requests, regime {res['regime']['name']}", intro,
                   *[pair_part(p, res["fifo_clients"]) for p in res["pairs"]])


def pair_part(p: dict, fifo: int) -> tuple:
    """One pair's subsection: the output check, every configuration, the ratios against issue 10's targets."""
    check = checked(p["mismatches"], "Every request's output equals its prompt's plain greedy output (every "
                                     "configuration, repeat).")
    rows = [[x["key"], x["clients"], "generate_tokens" if x["driver"] == "gen" else x["max_batch"],
             "on" if x["mtp"] else "off", fmt(x["aggregate_tps"], ".1f"), fmt(x["per_request_tps"], ".1f"),
             fmt(x["decode_tps"], ".1f"), fmt(x["ttft_p50_ms"], ".0f"), fmt(x["ttft_p95_ms"], ".0f"),
             fmt(x["acceptance_length"]), fmt(x["plain_step_share"])] for x in p["rows"]]
    configs = table(["config", "N", "max_batch", "MTP", "aggregate tok/s", "per-request tok/s", "decode tok/s",
                     "TTFT p50 ms", "TTFT p95 ms", "accept. length", "plain-step share"], rows)
    r = p["ratios"]
    targets = [[f"N={fifo} batched / max_batch=1 (MTP on)", verdict(r["batch_vs_fifo_mtp"], TARGETS["batch"])],
               [f"N={fifo} batched / max_batch=1 (MTP off)", verdict(r["batch_vs_fifo_plain"], TARGETS["batch"])]]
    targets += [[f"MTP on / off, N={k.split('_n')[1]}", verdict(v, TARGETS["mtp"])]
                for k, v in r.items() if k.startswith("mtp_vs_plain_n")]
    targets += [["MTP on / off, max_batch=1", verdict(r["mtp_vs_plain_fifo"], TARGETS["mtp"])],
                ["N=1 Engine / generate_tokens (MTP on)", verdict(r["n1_vs_gen_mtp"], TARGETS["gen"])],
                ["N=1 Engine / generate_tokens (MTP off)", verdict(r["n1_vs_gen_plain"], TARGETS["gen"])]]
    return (f"{p['pair']} ({p['quantization']}), {p['prompt_class']} prompts of "
            f"{min(p['prompt_tokens'])}-{max(p['prompt_tokens'])} tokens", check, configs,
            table(["ratio (aggregate tok/s)", "measured"], targets))
