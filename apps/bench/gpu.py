"""`python -m apps.bench gpu`: the figures that need a GPU, in one run (issue 27).

For 31B, 26B-A4B and E4B, built in memory with random weights at 4 bits (`inmemory.py`; the
assistant too): time to the first token after load, prefill tok/s at 1k and 8k tokens, plain
decode tok/s at B = 1, 4, 8 (and 16 for the MoE) as a fraction of the memory roofline (bytes a
decode step reads over the bandwidth a large copy measures), the MoE's expert union per layer,
MTP at controlled acceptance (an oracle right with probability p, the real assistant run every
round) against plain decoding for K = 1..6 and `auto` at B = 1, K = 3 and `auto` at B = 4, `auto`
at B = 8, each round's cost in plain steps, whether greedy MTP equals plain; then on the same
weights mlx-lm's plain decoding and mlx-vlm's Gemma 4 MTP (the real assistant, K = 3) beside ours.
Then the bundled demo pair, plain and `auto`, at B = 1 and 4 on its stdlib prompts.

`--smoke` runs the same code at the tiny fixture shapes, on any device, in seconds: the shapes and
stages are named for what they are (tiny-dense stands in for 31B, tiny-moe for 26B-A4B, tiny-e2b for
E4B), and on the CPU what only a GPU measures (the roofline fraction, the count of GPU kernels
compiled) is skipped in one line each. On a GPU the JSON also goes to
apps/results/gpu/<card>-<date>.json. Random weights: speed is real, text is not.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_mtp.runtime import jit
from mlx_mtp import kernels
from mlx_mtp.decode.drafters import MTPProposer
from mlx_mtp.runtime.memory import BACKENDS, Device, nbytes
from mlx_mtp.decode.speculative import K_MAX
from mlx_mtp.selftest.warm import Cycle, cycling
from mlx_mtp.models import moe

from . import inmemory, peers
from .env import median, time_fn
from .oracle import JoinTogether, RowsOracle, decode_run, expected_tokens, first_token
from .pairs import ROOT
from .realsize import expert_unions
from .realsize import sources as real_sources
from .report import section, table

GiB = 2**30
BITS = 4
STAND_IN = {"31b": "tiny-dense", "26b-a4b": "tiny-moe", "e4b": "tiny-e2b"}  # --smoke: the real three's stand-ins
TINY = {"tiny-dense": "dense", "tiny-moe": "moe", "tiny-e2b": "e2b"}  # a stand-in -> its fixture


@dataclass(frozen=True)
class Sizes:
    shapes: tuple
    prefill: tuple  # prompt lengths timed to the first token
    first_prompt: int  # the prompt of the first request after load
    context: int  # prompt tokens per row before decoding
    tokens: int  # new tokens per row at B = 1
    batch_tokens: int  # at B > 1
    copy_bytes: int  # the bandwidth probe's buffer
    demo_tokens: int
    demo_repeats: int
    estimate_scale: float = 1.0  # of the stages' estimates (H200 seconds)


REAL = Sizes(("31b", "26b-a4b", "e4b"), (1024, 8192), 128, 64, 64, 32, 4 * GiB, 96, 3)
SMOKE = Sizes(tuple(TINY), (32, 96), 8, 12, 8, 5, 16 << 20, 6, 1, estimate_scale=0.05)
BATCHES = (1, 4, 8)
MOE_BATCHES = (1, 4, 8, 16)
ORACLE_RUNS = [*((k, 1) for k in range(1, 7)), ("auto", 1), (3, 4), ("auto", 4), ("auto", 8)]  # (K, B)
PEER_K = 3


def sources(shape: str) -> tuple[dict, dict, str]:
    if shape in TINY:
        base = ROOT / "tests" / "fixtures" / "tiny" / TINY[shape]
        read = lambda kind: json.loads((base / kind / "config.json").read_text())  # noqa: E731
        return read("target"), read("drafter"), f"tiny {TINY[shape]} fixture shapes"
    return real_sources(shape)


# ---- measurements --------------------------------------------------------------------------------


def bandwidth(size: int, repeats: int = 5) -> dict:
    """Device memory bandwidth: a large float32 buffer read and written once (`a + 1`)."""
    a = mx.random.uniform(shape=(size // 4,))
    mx.eval(a)
    # two warm-ups: the kernel's first build, the output buffer's first allocation
    seconds = time_fn(lambda: mx.eval(a + 1.0), repeats, warmup=2)
    return dict(buffer_bytes=size, seconds=seconds, bytes_per_s=2 * size / seconds)


def plain_run(target, prompts: list, n: int) -> dict:
    """Greedy plain decoding of the prompts' rows together, after a short warm-up run at the same
    rows (the new shapes' compilation); the decode phase timed."""
    decode_run(JoinTogether(target), prompts, 3)
    run = decode_run(JoinTogether(target), prompts, n)
    step = median(run["step_seconds"])
    return dict(tokens=run["tokens"], step_s=step, tok_s=len(prompts) / step,
                mean_tok_s=run["decoded"] / run["seconds"])


def union_per_layer(target, prompts: list, n: int) -> list:
    """Distinct experts each MoE layer reads per decode step of these rows (a separate run: the
    router record keeps the forward uncompiled)."""
    moe.ROUTER_RECORD = []
    try:
        decode_run(JoinTogether(target), prompts, n)
        record = moe.ROUTER_RECORD
    finally:
        moe.ROUTER_RECORD = None
    unions = expert_unions(record, target.config.num_hidden_layers, len(prompts))
    return np.mean(unions, axis=0).round(2).tolist()


def step_bytes(target, rows: int, context: int, union: list | None = None) -> int:
    """Bytes one decode step of `rows` rows reads: every weight (the tied embedding as the head),
    but the per-layer-input table (a gather of `rows` rows) and, in an MoE layer, only the experts
    its rows route to; plus each row's K/V over `context` positions."""
    cfg = target.config
    total = 0
    for name, a in tree_flatten(target.parameters()):
        if "embed_tokens_per_layer" in name:
            continue
        share = 1.0
        if ".experts." in name and union:
            share = union[int(name.split(".layers.")[1].split(".")[0])] / cfg.num_experts
        total += int(a.nbytes * share)
    dtype_size = target.embed(mx.array([[1]])).dtype.size
    kv = sum(2 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i)
             * (min(context, cfg.sliding_window) if t == "sliding_attention" else context)
             for i, t in enumerate(cfg.layer_types))
    return total + rows * kv * dtype_size


def oracle_run(target, drafter, prompts: list, truths: list, k, p: float, n: int, plain: dict) -> dict:
    """MTP with a p-accurate oracle (each row's truth: its plain greedy output), the real assistant
    run every round; a warm-up run first, on the same generator (so `auto` starts from what it
    measured); against plain decoding of the same rows."""
    oracle = RowsOracle(truths, [len(x) for x in prompts], target.vocab_size, p, MTPProposer(drafter, target))
    if k == "auto":  # every draft length auto may pick, in every order, built first: no compile when timed
        for fixed in [*range(K_MAX + 1), Cycle()]:
            warm = JoinTogether(target, oracle, draft_tokens=fixed if isinstance(fixed, int) else "auto")
            if isinstance(fixed, Cycle):
                cycling(warm, fixed)
            oracle.start(warm, seed=1)
            decode_run(warm, prompts, min(n, 4 * (K_MAX + 1)))
    gen = JoinTogether(target, oracle, draft_tokens=k)
    oracle.start(gen, seed=1)
    decode_run(gen, prompts, min(n, 12))
    oracle.start(gen, seed=0)
    with jit.counting() as traced:
        run = decode_run(gen, prompts, n)
    same = all(got == want[:n] for got, want in zip(run["tokens"], truths))
    tok_s = run["decoded"] / run["seconds"]
    return dict(tok_s=tok_s, speedup=tok_s / plain["mean_tok_s"], rounds=run["steps"],
                round_in_plain_steps=median(run["step_seconds"]) / plain["step_s"],
                tokens_per_row_round=run["decoded"] / (len(prompts) * run["steps"]),
                expected_tokens=expected_tokens(p, k) if k != "auto" else None, equals_plain=same,
                traces_timed=traced.count)


# ---- stages --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """Figures measured together. `shape`: a released shape (the tiny stand-in with --smoke); None:
    every shape built so far. `estimate_s`: the stage's seconds on an H200 with MLX's kernels compiled
    (apps/device's cache; the 31B's whole run took 120 s there), what `--budget` plans with: a stage
    that would not fit is skipped, saying so."""

    name: str
    shape: Optional[str]
    batches: tuple = ()  # plain decoding at these rows
    oracle: tuple = ()  # MTP (oracle) runs (K, B)
    parts: tuple = ()  # of "prefill", "peers"; or ("demo",)
    estimate_s: float = 60.0


MTP_B1 = tuple((k, 1) for k in range(1, 7)) + (("auto", 1),)
# In order of value (issue 36): the 31B at B = 1, the 26B-A4B at B = 1 and 8, then the rest; together
# they measure every figure of every shape.
STAGES = (
    Stage("31b", "31b", (1,), MTP_B1, estimate_s=80),
    Stage("26b-a4b", "26b-a4b", (1, 8), ((3, 1), ("auto", 1), ("auto", 8)), estimate_s=100),
    Stage("31b-batch", "31b", (4, 8), ((3, 4), ("auto", 4), ("auto", 8)), estimate_s=40),
    Stage("26b-a4b-batch", "26b-a4b", (4, 16), ((1, 1), (2, 1), (4, 1), (5, 1), (6, 1), (3, 4), ("auto", 4)),
          estimate_s=70),
    Stage("prefill", None, parts=("prefill",), estimate_s=60),
    Stage("peers", None, parts=("peers",), estimate_s=120),
    Stage("e4b", "e4b", BATCHES, tuple(ORACLE_RUNS), parts=("prefill", "peers"), estimate_s=150),
    Stage("demo", None, parts=("demo",), estimate_s=40),
)


class Suite:
    """One run: the shapes built on first use and kept, their prompts and plain runs (which the MTP
    runs are checked against), the results so far (saved after every stage on a GPU)."""

    def __init__(self, args, sizes: Sizes, res: dict, log, roofline: bool = True):
        self.args, self.sizes, self.res, self.log = args, sizes, res, log
        self.roofline = roofline  # a step's fraction of the memory roofline: a GPU's figure
        self.built: dict = {}
        self.plain: dict = {}  # (shape, B) -> plain run
        self.copy_rate = res["bandwidth"]["bytes_per_s"]

    def stage_name(self, stage: Stage) -> str:
        """The stage's name, the shape in it the one this run builds (--smoke: tiny-dense-batch)."""
        return stage.name.replace(stage.shape, self.name(stage.shape)) if stage.shape else stage.name

    def name(self, shape: str) -> str:
        """The shape a stage's released shape stands for in this run (--smoke: the tiny fixtures)."""
        return STAND_IN[shape] if self.args.smoke else shape

    def model(self, shape: str) -> dict:
        """The shape's pair, built on first use, with its first requests timed (compilation and all,
        then warm)."""
        if shape in self.built:
            return self.built[shape]
        target_config, drafter_config, provenance = sources(shape)
        started = time.perf_counter()
        target, config, weights = inmemory.build(target_config, BITS, seed=0)
        drafter, d_config, d_weights = inmemory.build(drafter_config, BITS, seed=1)
        drafter.check_target(target)
        out = self.res["shapes"].setdefault(shape, {})
        out.update(assistant_config=provenance, build_s=time.perf_counter() - started,
                   target_gib=nbytes(target) / GiB, assistant_gib=nbytes(drafter) / GiB,
                   moe=bool(target.config.enable_moe_block), layers=target.config.num_hidden_layers,
                   prefill={}, decode={}, mtp={})
        self.log(f"{shape}: built in {out['build_s']:.1f} s ({out['target_gib']:.2f} + {out['assistant_gib']:.2f} GiB)")
        rng = np.random.default_rng(self.args.seed)
        ids = lambda n: rng.integers(4, target.vocab_size, n).tolist()  # noqa: E731
        out["first_token_after_load_s"] = first_token(target, ids(self.sizes.first_prompt))
        out["first_token_warm_s"] = first_token(target, ids(self.sizes.first_prompt))
        self.log(f"  first token after load {out['first_token_after_load_s']:.2f} s, warm "
                 f"{out['first_token_warm_s']:.2f} s")
        prompts = [ids(self.sizes.context) for _ in range(max(MOE_BATCHES))]
        self.built[shape] = dict(target=target, drafter=drafter, weights=(config, weights),
                                 drafter_weights=(d_config, d_weights), prompts=prompts, ids=ids, out=out)
        return self.built[shape]

    def tokens(self, B: int) -> int:
        return self.sizes.tokens if B == 1 else self.sizes.batch_tokens

    def plain_run(self, shape: str, B: int) -> dict:
        key = (shape, B)
        if key not in self.plain:
            m = self.model(shape)
            run = self.plain[key] = plain_run(m["target"], m["prompts"][:B], self.tokens(B))
            union = union_per_layer(m["target"], m["prompts"][:B], 4) if m["out"]["moe"] else None
            read = step_bytes(m["target"], B, self.sizes.context + self.tokens(B) // 2, union)
            d = m["out"]["decode"][B] = dict(
                tok_s=run["tok_s"], step_s=run["step_s"], bytes_per_step=read,
                roofline=read / self.copy_rate / run["step_s"] if self.roofline else None, union_per_layer=union,
                union_mean=float(np.mean(union)) if union else None)
            of_roofline = f", {100 * d['roofline']:.0f}% of the roofline" if d["roofline"] is not None else ""
            self.log(f"  plain B={B}: {d['tok_s']:.1f} tok/s{of_roofline}"
                     + (f", expert union {d['union_mean']:.1f}" if union else ""))
        return self.plain[key]

    def oracle(self, shape: str, k, B: int) -> None:
        m, plain = self.model(shape), self.plain_run(shape, B)
        truths = plain["tokens"]
        r = oracle_run(m["target"], m["drafter"], m["prompts"][:B], truths, k, self.args.p, len(truths[0]), plain)
        m["out"]["mtp"][f"K={k},B={B}"] = r
        self.log(f"  MTP oracle p={self.args.p} K={k} B={B}: {r['speedup']:.2f}x plain, round = "
                 f"{r['round_in_plain_steps']:.2f} plain steps, equals plain: {r['equals_plain']}")

    def prefill(self, shape: str) -> None:
        m = self.model(shape)
        for n in prefill_lengths(self.args, self.sizes):
            seconds = first_token(m["target"], m["ids"](n))
            m["out"]["prefill"][n] = dict(seconds=seconds, tok_s=n / seconds)
            self.log(f"  {shape} prefill {n}: {n / seconds:.0f} tok/s")

    def peers(self, shape: str) -> None:
        m = self.model(shape)
        plain = {B: self.plain_run(shape, B) for B in peers.BATCHES}
        m["out"]["peers"] = peers.compare(m["target"], m["drafter"], m["weights"], m["drafter_weights"],
                                          m["prompts"], plain, PEER_K, self.tokens, self.log)

    def run(self, stage: Stage) -> None:
        started = time.perf_counter()
        kernels.dispatch.decisions.clear()
        shapes = [self.name(stage.shape)] if stage.shape else list(self.built)
        if stage.parts == ("demo",):
            self.res["demo"], shapes = bench_demo(self.sizes, self.log), []
        for shape in shapes:
            for B in stage.batches:
                self.plain_run(shape, B)
            for k, B in stage.oracle:
                self.oracle(shape, k, B)
            for part in stage.parts:
                if not (part == "peers" and self.args.no_peers):
                    getattr(self, part)(shape)
        ran = kernels.dispatch.summary()
        for shape in shapes if ran else ():
            self.res["shapes"][shape]["kernels_ran"] = ran
        name = self.stage_name(stage)
        self.res["stages"][name] = dict(seconds=time.perf_counter() - started, kernels=ran or None)
        self.log(f"stage {name}: {self.res['stages'][name]['seconds']:.0f} s"
                 + (f"; kernels: {ran}" if ran else ""))


def chosen_stages(args) -> list:
    """The stages `--stages` names (default: all), those of the `--shapes` chosen, in order of value."""
    names = [n for n in (getattr(args, "stages", None) or "").split(",") if n]
    unknown = set(names) - {s.name for s in STAGES}
    if unknown:
        raise SystemExit(f"unknown stage(s) {', '.join(sorted(unknown))}; choose from "
                         f"{', '.join(s.name for s in STAGES)}")
    shapes = [s for s in (args.shapes or "").split(",") if s]
    skipped = ({"peers"} if args.no_peers else set()) | ({"demo"} if args.no_demo else set())
    return [s for s in STAGES if (not names or s.name in names) and s.name not in skipped
            and (s.shape is None or not shapes or s.shape in shapes or STAND_IN[s.shape] in shapes)]


# ---- the demo pair ---------------------------------------------------------------------------------


def bench_demo(sizes: Sizes, log) -> dict:
    """The bundled pair as stored (bf16): plain and `auto` at B = 1 and 4 on held-out stdlib code,
    interleaved repeats; one generator per mode and B kept over them (as an Engine keeps one)."""
    from mlx_mtp.demo import load_demo

    from .prompts import code_snippets

    loaded = load_demo(dtype=False)
    prompts = [loaded.tokenizer.encode(t) for t in code_snippets(4)]
    out = {}
    for B in (1, 4):
        gens = {"plain": JoinTogether(loaded.target), "auto": JoinTogether(loaded.target, loaded.drafter)}
        runs = {mode: [] for mode in gens}
        for r in range(sizes.demo_repeats + 1):  # the first pass warms up
            for mode, gen in gens.items():
                run = decode_run(gen, prompts[:B], sizes.demo_tokens)
                if r:
                    runs[mode].append(run)
        tok_s = {m: median([x["decoded"] / x["seconds"] for x in v]) for m, v in runs.items()}
        same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["plain"], runs["auto"]))
        ratio = median([p["seconds"] / a["seconds"] for p, a in zip(runs["plain"], runs["auto"])])
        out[B] = dict(plain_tok_s=tok_s["plain"], auto_tok_s=tok_s["auto"], speedup=ratio, equals_plain=same)
        log(f"demo B={B}: plain {tok_s['plain']:.1f}, auto {tok_s['auto']:.1f} tok/s ({ratio:.2f}x)")
    return out


# ---- the suite -------------------------------------------------------------------------------------


def card() -> str:
    """The device's name: the GPU's, or the CPU's."""
    return mx.device_info().get("device_name", str(mx.default_device()))


def prefill_lengths(args, sizes: Sizes) -> tuple:
    chosen = getattr(args, "prefill", None)
    return sizes.prefill if chosen is None else tuple(int(n) for n in chosen.split(",") if n)


def run_gpu(args, log=print) -> dict:
    with kernels.using(getattr(args, "kernels", None)):
        return _run_gpu(args, log)


def _run_gpu(args, log) -> dict:
    sizes = SMOKE if args.smoke else REAL
    device = Device.current()
    started = time.perf_counter()
    cache = jit.KernelCache.open(getattr(args, "kernel_cache", None))
    if device.gpu:
        watch = jit.watch_compiles(lambda n: log(f"compiling GPU kernels (kept on disk for later runs): {n} so far"))
    else:
        watch = lambda: None  # noqa: E731
        log(f"on the {device.backend.upper()}: skipped, the roofline fraction (no GPU memory to compare a step "
            "with) and the count of GPU kernels compiled")
    res = dict(mode="gpu", smoke=args.smoke, card=card(), backend=BACKENDS[device.backend],
               mlx=mx.__version__, p=args.p, bits=BITS, sizes=sizes.__dict__, shapes={}, stages={},
               kernels=kernels.mode(), bandwidth=bandwidth(sizes.copy_bytes), budget_s=args.budget)
    log(f"{res['card']}, MLX {res['backend']} backend: "
        f"copy bandwidth {res['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")
    suite = Suite(args, sizes, res, log, roofline=device.gpu)
    for stage in chosen_stages(args):
        left = args.budget - (time.perf_counter() - started) if args.budget else None
        need = stage.estimate_s * sizes.estimate_scale
        if left is not None and need > left:
            res["stages"][suite.stage_name(stage)] = dict(skipped=f"needs ~{need:.0f} s, {max(left, 0):.0f} s left")
            log(f"stage {suite.stage_name(stage)}: skipped (needs ~{need:.0f} s of the budget, "
                f"{max(left, 0):.0f} s left)")
            continue
        suite.run(stage)
        res["kernel_cache"] = cache.report()
        if saving(args, device):
            save(res, args)  # what is measured so far survives a run cut short
    watch()
    res["seconds"] = time.perf_counter() - started
    res["kernel_cache"] = cache.report()
    log(f"kernels: {res['kernel_cache']}")
    res["mismatches"] = [f"{shape} MTP {key} differs from plain" for shape, r in res["shapes"].items()
                         for key, m in r.get("mtp", {}).items() if not m["equals_plain"]]
    res["mismatches"] += [f"demo auto B={B} differs from plain" for B, r in res.get("demo", {}).items()
                          if not r["equals_plain"]]
    if saving(args, device):
        res["saved"] = str(save(res, args))
    return res


def saving(args, device) -> bool:
    """Whether the run's JSON goes to --results-dir (a GPU's run, not a smoke run)."""
    return device.gpu and not args.smoke


def save(res: dict, args) -> Path:
    """apps/results/gpu/<card>-<date>.json, with the command, the MLX version and the card inside."""
    slug = re.sub(r"[^a-z0-9]+", "-", res["card"].lower()).strip("-")
    path = Path(args.results_dir) / f"{slug}-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(res, command=getattr(args, "command_line", None)), indent=1, default=str))
    return path


# ---- the report ------------------------------------------------------------------------------------


def _cache(c: Optional[dict]) -> str:
    if not c:
        return "-"
    return f"{c['found']} kernels found in {c['folder']}, {c['compiled']} compiled by this run"


def _x(value) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def figures(r: dict) -> dict:
    """One shape's figures as text, in table order."""
    out = {"weights, target + assistant (GiB)": f"{r['target_gib']:.2f} + {r['assistant_gib']:.2f}",
           "built in memory (s)": f"{r['build_s']:.1f}",
           "first token after load; warm (s)": f"{r['first_token_after_load_s']:.2f}; {r['first_token_warm_s']:.2f}"}
    for n, p in r["prefill"].items():
        out[f"prefill {n} tokens (tok/s)"] = f"{p['tok_s']:.0f}"
    for B, d in r["decode"].items():
        if d["roofline"] is None:  # not measured on the CPU
            out[f"decode B={B} (tok/s)"] = f"{d['tok_s']:.1f}"
        else:
            out[f"decode B={B} (tok/s, roofline)"] = f"{d['tok_s']:.1f} ({100 * d['roofline']:.0f}%)"
    for B, d in r["decode"].items():
        if d["union_mean"] is not None:
            out[f"expert union per layer, B={B}"] = f"{d['union_mean']:.1f}"
    for key, m in r["mtp"].items():
        if key.endswith(",B=1") and key != "K=auto,B=1":
            out[f"round {key} (plain steps)"] = f"{m['round_in_plain_steps']:.2f}"
    for key, m in r["mtp"].items():
        out[f"MTP oracle {key} / plain"] = _x(m["speedup"]) + ("" if m["equals_plain"] else " **differs**")
    if "peers" in r:
        out.update(peers.figures(r["peers"], PEER_K))
    return out


def shape_rows(shapes: dict) -> list:
    """(figure, its value per shape): one table for every shape. The MoE, which has every figure,
    sets the order."""
    columns = [figures(r) for r in shapes.values()]
    labels = dict.fromkeys(label for c in sorted(columns, key=len, reverse=True) for label in c)
    return [[label, *(c.get(label, "-") for c in columns)] for label in labels]


def gpu_md(res: dict) -> str:
    kind = "SMOKE RUN (tiny shapes)" if res["smoke"] else "random weights at the released shapes"
    bw = res["bandwidth"]
    parts = [f"{res['bits']}-bit affine (group 64) targets and assistants built in memory; greedy; oracle "
             f"p = {res['p']}. Copy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s "
             f"({bw['buffer_bytes'] / GiB:.2f} GiB read and written); "
             f"roofline = bytes a decode step reads / that bandwidth / the measured step. Whole run "
             f"{res['seconds']:.0f} s." + (f" JSON: `{res['saved']}`." if res.get("saved") else ""),
             table(["figure", *res["shapes"]], shape_rows(res["shapes"])),
             "Stages, in order of value" + (f" (budget {res['budget_s']:.0f} s)" if res.get("budget_s") else "")
             + f"; MLX's kernel cache: {_cache(res.get('kernel_cache'))}:",
             table(["stage", "seconds", "kernels"], [[name, f"{st['seconds']:.0f}" if "seconds" in st else
                                                      f"skipped: {st['skipped']}", st.get("kernels") or "-"]
                                                     for name, st in res.get("stages", {}).items()])]
    ran = [f"- {shape}: {r['kernels_ran']}" for shape, r in res["shapes"].items() if r.get("kernels_ran")]
    if ran:
        parts += [f"Kernels (`--kernels {res.get('kernels', 'auto')}`), per family, with the products that took "
                  "them:", "\n".join(ran)]
    errors = [f"- {shape}: {r['peers'][key]}" for shape, r in res["shapes"].items()
              for key in ("mlx_lm_error", "mlx_vlm_error", "mlx_lm_skipped", "mlx_vlm_skipped")
              if r.get("peers", {}).get(key)]
    if errors:
        parts += ["Peers that could not run:", "\n".join(errors)]
    if res.get("demo"):
        parts += ["Demo pair (bf16 as stored), held-out stdlib code:",
                  table(["B", "plain tok/s", "auto tok/s", "auto / plain", "equals plain"],
                        [[B, f"{r['plain_tok_s']:.1f}", f"{r['auto_tok_s']:.1f}", _x(r["speedup"]),
                          "yes" if r["equals_plain"] else "**no**"] for B, r in res["demo"].items()])]
    return section(f"GPU suite: {res['card']}, MLX {res['backend']} backend, mlx {res['mlx']} ({kind})", *parts)
