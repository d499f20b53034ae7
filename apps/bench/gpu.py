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

`--smoke` runs the same code at the tiny fixture shapes, on any device, in seconds. On a GPU the
JSON also goes to apps/results/gpu/<card>-<date>.json. Random weights: speed is real, text is not.
"""

from __future__ import annotations

import datetime
import gc
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_mtp import kernels
from mlx_mtp.drafters import MTPProposer
from mlx_mtp.memory import BACKENDS, Device, nbytes
from mlx_mtp.models import gemma4

from . import inmemory, peers
from .env import median, time_fn
from .oracle import JoinTogether, RowsOracle, decode_run, expected_tokens, first_token
from .pairs import ROOT
from .realsize import expert_unions
from .realsize import sources as real_sources
from .report import table

GiB = 2**30
BITS = 4
TINY = {"tiny-dense": "dense", "tiny-moe": "moe", "tiny-e2b": "e2b"}  # --smoke: stand-ins for the real three


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


REAL = Sizes(("31b", "26b-a4b", "e4b"), (1024, 8192), 128, 64, 64, 32, 4 * GiB, 96, 3)
SMOKE = Sizes(tuple(TINY), (32, 96), 8, 12, 8, 5, 16 << 20, 6, 1)
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
    gemma4.ROUTER_RECORD = []
    try:
        decode_run(JoinTogether(target), prompts, n)
        record = gemma4.ROUTER_RECORD
    finally:
        gemma4.ROUTER_RECORD = None
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
    gen = JoinTogether(target, oracle, draft_tokens=k)
    oracle.start(gen, seed=1)
    decode_run(gen, prompts, min(n, 12))
    oracle.start(gen, seed=0)
    run = decode_run(gen, prompts, n)
    same = all(got == want[:n] for got, want in zip(run["tokens"], truths))
    tok_s = run["decoded"] / run["seconds"]
    return dict(tok_s=tok_s, speedup=tok_s / plain["mean_tok_s"], rounds=run["steps"],
                round_in_plain_steps=median(run["step_seconds"]) / plain["step_s"],
                tokens_per_row_round=run["decoded"] / (len(prompts) * run["steps"]),
                expected_tokens=expected_tokens(p, k) if k != "auto" else None, equals_plain=same)


# ---- one shape -------------------------------------------------------------------------------------


def bench_shape(shape: str, sizes: Sizes, args, copy_rate: float, log) -> dict:
    target_config, drafter_config, provenance = sources(shape)
    started = time.perf_counter()
    target, config, weights = inmemory.build(target_config, BITS, seed=0)
    drafter, d_config, d_weights = inmemory.build(drafter_config, BITS, seed=1)
    drafter.check_target(target)
    out = dict(assistant_config=provenance, build_s=time.perf_counter() - started,
               target_gib=nbytes(target) / GiB, assistant_gib=nbytes(drafter) / GiB,
               moe=bool(target.config.enable_moe_block), layers=target.config.num_hidden_layers)
    log(f"{shape}: built in {out['build_s']:.1f} s "
        f"({out['target_gib']:.2f} + {out['assistant_gib']:.2f} GiB)")
    rng = np.random.default_rng(args.seed)
    ids = lambda n: rng.integers(4, target.vocab_size, n).tolist()  # noqa: E731
    out["first_token_after_load_s"] = first_token(target, ids(sizes.first_prompt))
    out["prefill"] = {}
    for n in prefill_lengths(args, sizes):
        seconds = first_token(target, ids(n))
        out["prefill"][n] = dict(seconds=seconds, tok_s=n / seconds)
        log(f"  prefill {n}: {n / seconds:.0f} tok/s")
    batches = MOE_BATCHES if out["moe"] else BATCHES
    prompts = [ids(sizes.context) for _ in range(max(batches))]
    tokens = lambda B: sizes.tokens if B == 1 else sizes.batch_tokens  # noqa: E731
    plain = {B: plain_run(target, prompts[:B], tokens(B)) for B in batches}
    out["decode"] = {}
    for B, run in plain.items():
        union = union_per_layer(target, prompts[:B], 4) if out["moe"] else None
        read = step_bytes(target, B, sizes.context + tokens(B) // 2, union)
        out["decode"][B] = dict(tok_s=run["tok_s"], step_s=run["step_s"], bytes_per_step=read,
                                roofline=read / copy_rate / run["step_s"], union_per_layer=union,
                                union_mean=float(np.mean(union)) if union else None)
        d = out["decode"][B]
        log(f"  plain B={B}: {d['tok_s']:.1f} tok/s, {100 * d['roofline']:.0f}% of the roofline"
            + (f", expert union {d['union_mean']:.1f}" if union else ""))
    out["mtp"] = {}
    for k, B in ORACLE_RUNS:
        truths = plain[B]["tokens"]
        r = oracle_run(target, drafter, prompts[:B], truths, k, args.p, len(truths[0]), plain[B])
        out["mtp"][f"K={k},B={B}"] = r
        log(f"  MTP oracle p={args.p} K={k} B={B}: {r['speedup']:.2f}x plain, round = "
            f"{r['round_in_plain_steps']:.2f} plain steps, equals plain: {r['equals_plain']}")
    if not args.no_peers:
        out["peers"] = peers.compare(target, drafter, (config, weights), (d_config, d_weights), prompts,
                                     {B: plain[B] for B in (1, 4)}, PEER_K, tokens, log)
    out["seconds"] = time.perf_counter() - started  # the shape's share of the suite's time
    log(f"{shape}: {out['seconds']:.0f} s in all")
    return out


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
    shapes = tuple(s for s in args.shapes.split(",") if s) if args.shapes else sizes.shapes
    device = Device.current()
    started = time.perf_counter()
    res = dict(mode="gpu", smoke=args.smoke, card=card(), backend=BACKENDS[device.backend],
               mlx=mx.__version__, p=args.p, bits=BITS, sizes=sizes.__dict__, shapes={}, kernels=kernels.mode(),
               bandwidth=bandwidth(sizes.copy_bytes))
    log(f"{res['card']}, MLX {res['backend']} backend: "
        f"copy bandwidth {res['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")
    for shape in shapes:
        kernels.dispatch.decisions.clear()
        res["shapes"][shape] = bench_shape(shape, sizes, args, res["bandwidth"]["bytes_per_s"], log)
        res["shapes"][shape]["kernels_ran"] = kernels.dispatch.summary()
        log(f"  kernels: {res['shapes'][shape]['kernels_ran'] or 'MLX only'}")
        if device.gpu and not args.smoke:
            save(res, args)  # what is measured so far survives a run cut short
        gc.collect()
        mx.clear_cache()
    if not args.no_demo:
        res["demo"] = bench_demo(sizes, log)
    res["seconds"] = time.perf_counter() - started
    res["mismatches"] = [f"{shape} MTP {key} differs from plain" for shape, r in res["shapes"].items()
                         for key, m in r["mtp"].items() if not m["equals_plain"]]
    res["mismatches"] += [f"demo auto B={B} differs from plain" for B, r in res.get("demo", {}).items()
                          if not r["equals_plain"]]
    if device.gpu and not args.smoke:
        res["saved"] = str(save(res, args))
    return res


def save(res: dict, args) -> Path:
    """apps/results/gpu/<card>-<date>.json, with the command, the MLX version and the card inside."""
    slug = re.sub(r"[^a-z0-9]+", "-", res["card"].lower()).strip("-")
    path = Path(args.results_dir) / f"{slug}-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(res, command=getattr(args, "command_line", None)), indent=1, default=str))
    return path


# ---- the report ------------------------------------------------------------------------------------


def _x(value) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def figures(r: dict) -> dict:
    """One shape's figures as text, in table order."""
    out = {"weights, target + assistant (GiB)": f"{r['target_gib']:.2f} + {r['assistant_gib']:.2f}",
           "built in memory (s); the whole shape (s)": f"{r['build_s']:.1f}; {r['seconds']:.0f}",
           "first token after load (s)": f"{r['first_token_after_load_s']:.2f}"}
    for n, p in r["prefill"].items():
        out[f"prefill {n} tokens (tok/s)"] = f"{p['tok_s']:.0f}"
    for B, d in r["decode"].items():
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
    out = [f"## GPU suite: {res['card']}, MLX {res['backend']} backend, mlx {res['mlx']} ({kind})", "",
           f"{res['bits']}-bit affine (group 64) targets and assistants built in memory; greedy; oracle "
           f"p = {res['p']}. Copy bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s "
           f"({bw['buffer_bytes'] / GiB:.2f} GiB read and written); "
           f"roofline = bytes a decode step reads / that bandwidth / the measured step. Whole run "
           f"{res['seconds']:.0f} s." + (f" JSON: `{res['saved']}`." if res.get("saved") else ""), "",
           table(["figure", *res["shapes"]], shape_rows(res["shapes"])), ""]
    ran = [f"- {shape}: {r['kernels_ran']}" for shape, r in res["shapes"].items() if r.get("kernels_ran")]
    if ran:
        out += [f"Kernels (`--kernels {res.get('kernels', 'auto')}`), per family, with the products that took "
                "them:", "",
                *ran, ""]
    errors = [f"- {shape}: {r['peers'][key]}" for shape, r in res["shapes"].items()
              for key in ("mlx_lm_error", "mlx_vlm_error") if r.get("peers", {}).get(key)]
    if errors:
        out += ["Peers that could not run:", "", *errors, ""]
    if res.get("demo"):
        out += ["Demo pair (bf16 as stored), held-out stdlib code:", "",
                table(["B", "plain tok/s", "auto tok/s", "auto / plain", "equals plain"],
                      [[B, f"{r['plain_tok_s']:.1f}", f"{r['auto_tok_s']:.1f}", _x(r["speedup"]),
                        "yes" if r["equals_plain"] else "**no**"] for B, r in res["demo"].items()]), ""]
    return "\n".join(out)
