"""MoE tuning: distinct experts touched per layer per verify forward (the expert union), time per
step, and whether SwitchGLU's sorted-indices path (mlx-lm sorts when indices.size >= 64) pays
off at small sizes."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

from mlx_mtp.batch import BatchGenerator
from mlx_mtp.loading import load
from mlx_mtp.models import moe

from .env import median, time_fn
from .report import fmt, section, table
from .speed import TINY


def uniform_union(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts if every token picked top_k of `experts` uniformly at random."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def measure_union(loaded, prompts, k, n, repeats):
    """Per step: (tokens per forward, mean union over MoE layers, max union, per-layer unions),
    and the median seconds per step from runs without the recorder."""
    drafter = loaded.drafter if k else None

    def run(record: bool):
        gen = BatchGenerator(loaded.target, drafter, draft_tokens=k)
        for p in prompts:
            gen.insert(p, max_tokens=n)
        while gen.pending:  # prompts, one chunk per step: not measured
            gen.step()
        steps, unions = [], []
        while gen.busy:
            moe.ROUTER_RECORD = [] if record else None
            rows = len(gen.rows)
            start = time.perf_counter()
            gen.step()
            steps.append(time.perf_counter() - start)
            if record:
                verify = [np.array(i) for i in moe.ROUTER_RECORD]
                if verify:
                    T = verify[0].size // verify[0].shape[-1]  # tokens (ids: tokens x top_k)
                    unions.append((T, rows, [len(np.unique(v)) for v in verify]))
        moe.ROUTER_RECORD = None
        return steps, unions

    _, unions = run(True)
    run(False)  # warm-up
    times = [median(run(False)[0]) for _ in range(repeats)]
    return unions, median(times)


def switch_glu(glu, x, indices, do_sort: bool):
    """SwitchGLU.__call__ with the sort decision forced (mlx-lm: indices.size >= 64)."""
    x = mx.expand_dims(x, (-2, -3))
    idx, inv = indices, None
    if do_sort:
        x, idx, inv = _gather_sort(x, indices)
    if "gate_up_proj" in glu:  # gate and up joined (models.moe.SwitchGLU): one product, then its halves
        gate, up = mx.split(glu.gate_up_proj(x, idx, sorted_indices=do_sort), 2, axis=-1)
    else:
        up = glu.up_proj(x, idx, sorted_indices=do_sort)
        gate = glu.gate_proj(x, idx, sorted_indices=do_sort)
    x = glu.down_proj(glu.activation(up, gate), idx, sorted_indices=do_sort)
    if do_sort:
        x = _scatter_unsort(x, inv, indices.shape)
    return x.squeeze(-2)


def time_sort_paths(glu, hidden, experts, top_k, sizes, repeats):
    rows = []
    for T in sizes:
        x = mx.random.normal((1, T, hidden))
        idx = mx.argpartition(-mx.random.normal((1, T, experts)), top_k - 1, axis=-1)[..., :top_k]
        mx.eval(x, idx)
        out = {}
        for sort in (False, True):
            out[sort] = time_fn(lambda s=sort: mx.eval(switch_glu(glu, x, idx, s)), repeats * 3)
        assert np.allclose(np.array(switch_glu(glu, x, idx, False)), np.array(switch_glu(glu, x, idx, True)),
                           atol=1e-3)
        rows.append(dict(tokens=T, indices=T * top_k, default_sorts=T * top_k >= 64,
                         unsorted_ms=1000 * out[False], sorted_ms=1000 * out[True],
                         sorted_speedup=out[False] / out[True]))
    return rows


def run_experts(args, log=print) -> dict:
    model_dir = Path(args.model) if args.model else TINY / "moe" / "target"
    drafter_dir = Path(args.drafter) if args.drafter else (TINY / "moe" / "drafter" if not args.model else None)
    loaded = load(model_dir, drafter_dir)
    cfg = loaded.target.config
    if not cfg.enable_moe_block:
        raise SystemExit(f"{model_dir} is not an MoE target")
    E, top = cfg.num_experts, cfg.top_k_experts
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batch.split(",")]
    ks = [0] + [int(k) for k in args.k.split(",")]
    rows = []
    for B in batches:
        prompts = [rng.integers(4, cfg.vocab_size, 24).tolist() for _ in range(B)]
        for k in ks:
            unions, step_s = measure_union(loaded, prompts, k, args.tokens, args.repeats)
            full = [u for u in unions if u[0] == B * (k + 1)]  # rounds with every row present
            per_layer = np.array([u[2] for u in full]) if full else np.zeros((0, 1))
            rows.append(dict(batch=B, k=k, tokens_per_forward=B * (k + 1), rounds=len(full),
                             union_mean=float(per_layer.mean()) if full else None,
                             union_max=int(per_layer.max()) if full else None,
                             union_per_layer=[round(float(v), 2) for v in per_layer.mean(axis=0)] if full else [],
                             uniform_union=uniform_union(E, top, B * (k + 1)),
                             step_ms=1000 * step_s))
            log(f"experts B={B} K={k}: union {rows[-1]['union_mean']}, {1000 * step_s:.1f} ms/step")
    sizes = [int(s) for s in args.sizes.split(",")]
    glu = loaded.target.model.layers[0].experts.switch_glu
    sort = {"tiny": dict(shape=str(model_dir), rows=time_sort_paths(glu, cfg.hidden_size, E, top, sizes, args.repeats))}
    if args.shape:
        from .cost import real_config

        rc = real_config(args.shape)
        if not rc.enable_moe_block:
            raise SystemExit(f"{args.shape} has no MoE block")
        experts = moe.Experts(rc)
        if args.bits:
            nn.quantize(experts, group_size=64, bits=args.bits)
        mx.eval(experts.parameters())
        sort["real"] = dict(shape=f"{args.shape} one MoE layer, random weights, "
                                  f"{f'{args.bits}-bit' if args.bits else 'fp32'}",
                            rows=time_sort_paths(experts.switch_glu, rc.hidden_size, rc.num_experts,
                                                 rc.top_k_experts, sizes, args.repeats))
        del experts
    return dict(mode="experts", model=str(model_dir), experts=E, top_k=top, layers=cfg.num_hidden_layers,
                tokens=args.tokens, repeats=args.repeats, rows=rows, sort=sort)


def experts_md(res: dict) -> str:
    intro = ("Measured during real batched MTP generation (BatchGenerator, greedy; K=0 is plain decoding): per "
             "verify forward, the number of distinct experts each layer's router selected over all B x (K+1) tokens, "
             "mean over layers and rounds. 'uniform' is what independent uniformly random routing would touch. Time "
             f"per step: median of {res['repeats']} runs with the recorder off.")
    rows = [[r["batch"], r["k"], r["tokens_per_forward"], fmt(r["union_mean"]), fmt(r["union_max"]),
             fmt(r["uniform_union"]), " ".join(f"{u:.1f}" for u in r["union_per_layer"]), fmt(r["step_ms"], ".1f"),
             r["rounds"]] for r in res["rows"]]
    unions = table(["B", "K", "tokens/forward", "union (mean)", "union (max)", "uniform routing", "per layer",
                    "ms/step", "rounds"], rows)
    return section(f"MoE expert union: {res['model']} ({res['experts']} experts, top-{res['top_k']}, "
                   f"{res['layers']} MoE layers), regime {res['regime']['name']}", intro, unions,
                   *[sort_part(block) for block in res["sort"].values()])


def sort_part(block: dict) -> tuple:
    rows = [[r["tokens"], r["indices"], "sorted" if r["default_sorts"] else "unsorted", fmt(r["unsorted_ms"], ".2f"),
             fmt(r["sorted_ms"], ".2f"), fmt(r["sorted_speedup"]) + "x"] for r in block["rows"]]
    return (f"SwitchGLU sorted-indices path: {block['shape']}",
            "Measured: one SwitchGLU forward (gather_mm / gather_qmm), random routing, forced unsorted vs "
            "forced sorted; mlx-lm's default sorts when tokens x top_k >= 64.",
            table(["tokens", "indices", "mlx-lm default", "unsorted ms", "sorted ms", "sorted speed-up"], rows))
