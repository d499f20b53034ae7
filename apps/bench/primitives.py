"""Primitives mode (issue 42 item 1): graph nodes per layer and per step, on every path a model takes.

Per shape (the demo pair with its weights; the 31B, 26B-A4B and E4B at their released shapes with
weights that hold no memory: zero-stride arrays, 4-bit group 64 as the product's conversions, never
evaluated but for the CPU MoE's routing) and path (`mlx_mtp.selftest.primitives.PATHS`: the CPU's compiled
ops, MLX's GPU kernels as Metal runs them, mlx_mtp's CUDA kernels through the faked device): the
primitives of a plain decoding step at B rows and of a greedy K-draft round (the drafter's K steps,
the verify of K + 1 tokens, acceptance, the cache's updates), counted in the unevaluated graph.

A released shape is built with one and two periods of its layer pattern (and of its KV-shared tail):
per layer = the difference / the period's layers, and per step = the small model's count plus the
missing layers at the per-layer count (exact: every layer of a kind builds the same graph).
"""

from __future__ import annotations

import collections
import json

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_mtp.selftest import primitives
from mlx_mtp.loading import load
from mlx_mtp.models import gemma4, gemma4_assistant
from mlx_mtp.models.base import cpu_stream_count
from mlx_mtp.models.quantized import adopt

from .cost import ASSISTANTS, CONFIGS, TARGETS
from .report import fmt, section, table
from .speed import pair_dirs

SHAPES = ("demo", "31b", "26b-a4b", "e4b")


def hollow(model: nn.Module, bits: int = 4, group: int = 64) -> nn.Module:
    """`model` in bf16, quantized as the product's conversions are, its arrays zero-stride zeros of
    their shapes and dtypes (no memory: for building graphs, not for computing with)."""
    model.set_dtype(mx.bfloat16)
    if bits:
        predicate = getattr(model, "quant_predicate", lambda p, m: True)
        nn.quantize(model, group_size=group, bits=bits,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and predicate(p, m))
        adopt(model)
    flat = [(k, mx.broadcast_to(mx.zeros((), v.dtype), v.shape)) for k, v in tree_flatten(model.parameters())]
    mx.eval([v for _, v in flat])
    model.update(tree_unflatten(flat))
    return model.eval()


def text_config(shape: str) -> dict:
    config = json.loads((CONFIGS / TARGETS[shape] / "config.json").read_text())
    return dict(config.get("text_config", config))


def pattern(config: dict) -> tuple[list, int]:
    """(one period of the layer types, KV-shared layers) of a released config."""
    types = config["layer_types"]
    period = types.index("full_attention") + 1
    return types[:period], config.get("num_kv_shared_layers") or 0


def target_with(config: dict, own: int, shared: int) -> gemma4.Model:
    """The released target cut to `own` periods of its layer pattern with K/V, then `shared` periods
    that share them."""
    period, _ = pattern(config)
    cut = dict(config, layer_types=period * (own + shared), num_hidden_layers=len(period) * (own + shared),
               num_kv_shared_layers=len(period) * shared)
    return hollow(gemma4.Model(gemma4.Config.from_dict(cut)))


def drafter_for(shape: str) -> gemma4_assistant.Model:
    config = json.loads(ASSISTANTS[shape][0].read_text())
    config.pop("_partial", None)
    return hollow(gemma4_assistant.Model(gemma4_assistant.Config.from_dict(config)))


def count(target, drafter, rows: int, k: int) -> collections.Counter:
    return primitives.round_kinds(target, drafter, rows, k)


def released(shape: str, path: str, batches: list, k: int, log) -> list:
    """Rows of per-layer and per-step counts of a released shape on `path`."""
    config = text_config(shape)
    period, shared_layers = pattern(config)
    p, n = len(period), config["num_hidden_layers"]
    has_shared = shared_layers > 0
    base_shared = 1 if has_shared else 0
    drafter = drafter_for(shape)
    models = {(1, base_shared): target_with(config, 1, base_shared), (2, base_shared): target_with(config, 2, base_shared)}
    if has_shared:
        models[(1, 2)] = target_with(config, 1, 2)
    rows = []
    with primitives.path(path):
        for B in batches:
            for kk in sorted({0, k}):
                counts = {key: count(m, drafter, B, kk) for key, m in models.items()}
                small = sum(counts[(1, base_shared)].values())
                own_layer = (sum(counts[(2, base_shared)].values()) - small) / p
                shared_layer = (sum(counts[(1, 2)].values()) - small) / p if has_shared else None
                step = small + (n - shared_layers - p) * own_layer
                if has_shared:
                    step += (shared_layers - p) * shared_layer
                per_layer = counts[(2, base_shared)] - counts[(1, base_shared)]
                rows.append(dict(shape=shape, path=path, batch=B, k=kk, per_layer=own_layer, per_shared_layer=shared_layer,
                                 per_step=step, layer_kinds={name: v / p for name, v in per_layer.most_common()}))
                log(f"  {shape} {path} B={B} K={kk}: {own_layer:.1f} per layer, {step:.0f} per step")
    return rows


def demo(path: str, batches: list, k: int, log) -> list:
    target_dir, drafter_dir = pair_dirs("demo")
    loaded = load(target_dir, drafter_dir)
    rows = []
    with primitives.path(path):
        for B in batches:
            for kk in sorted({0, k}):
                kinds = count(loaded.target, loaded.drafter, B, kk)
                total = sum(kinds.values())
                matmuls, views, rest = primitives.split(kinds)
                rows.append(dict(shape="demo", path=path, batch=B, k=kk, per_step=total, per_layer=None,
                                 per_shared_layer=None, split=[matmuls, views, rest], kinds=dict(kinds.most_common())))
                log(f"  demo {path} B={B} K={kk}: {total} per step")
    return rows


def run_primitives(args, log=print) -> dict:
    shapes = args.shapes.split(",")
    paths = args.paths.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    unknown = [s for s in shapes if s not in SHAPES] + [p for p in paths if p not in primitives.PATHS]
    if unknown:
        raise SystemExit(f"unknown shape or path: {', '.join(unknown)} (shapes {', '.join(SHAPES)}; "
                         f"paths {', '.join(primitives.PATHS)})")
    rows = []
    for shape in shapes:
        for path in paths:
            rows += demo(path, batches, args.k, log) if shape == "demo" else released(shape, path, batches, args.k, log)
    plain = {(r["shape"], r["path"], r["batch"]): r["per_step"] for r in rows if r["k"] == 0}
    for r in rows:
        r["in_plain_steps"] = r["per_step"] / plain[(r["shape"], r["path"], r["batch"])]
    return dict(mode="primitives", k=args.k, rows=rows, streams=cpu_stream_count(), mismatches=[])


def primitives_md(res: dict) -> str:
    intro = ("Counted, not timed: the primitives in the unevaluated graph of a greedy round (K = 0: a plain "
             "decoding step), per path (cpu: MLX's CPU backend; metal: MLX's GPU kernels, each `mx.fast` op one "
             "node; cuda: mlx_mtp's kernels where they apply on an NVIDIA GPU, each launch one node). Released "
             "shapes: 4-bit g64 weights without memory, per layer from one and two periods of the layer pattern, "
             f"per step extrapolated to every layer; CPU counts with {res['streams']} CPU stream(s) for quantized "
             "products (apps/bench/primitives.py).")
    cells = [[r["shape"], r["path"], r["batch"], r["k"], fmt(r["per_layer"], ".1f"), fmt(r["per_shared_layer"], ".1f"),
              fmt(r["per_step"], ".0f"), fmt(r["in_plain_steps"])] for r in res["rows"]]
    return section("Primitives per layer and per step", intro,
                   table(["shape", "path", "B", "K", "per layer (with K/V)", "per KV-shared layer", "per step",
                          "in plain steps"], cells))
