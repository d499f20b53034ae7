"""Real-shape cost mode: the released Gemma 4 shapes with random weights.

Measured: the step cost of a few layers of each kind (sliding/full, K/V-producing or
K/V-shared, MoE) against T tokens per forward, the 262144-row LM head against T, and the
MTP drafter's step against B, at the released shapes. Derived: a full-depth forward as
sum(count of kind x per-layer cost) + head. PROJECTED: the MTP speed-up
    speedup(K, B) = E[tokens per round | K] * cost(T=B) / (cost(T=B(K+1)) + K * drafter(B))
with E[tokens | K] = 1 + sum_{i<=K} a_i from per-position acceptance a_i (measured on a demo
pair, or a published figure; the source is stated). Sampling/acceptance overheads and the
per-layer-embedding table lookup (a gather) are not included.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_mtp.cache.kv import FULL, SLIDING, KVCache, Step
from mlx_mtp.models import gemma4, gemma4_assistant
from mlx_mtp.models.base import SharedKV

from .env import peak_mb, reset_peak, time_fn
from .report import fmt, pivot, section, table

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "real_configs"
TINY = ROOT / "tests" / "fixtures" / "tiny"

TARGETS = {"e2b": "google--gemma-4-E2B-it", "e4b": "google--gemma-4-E4B-it",
           "26b-a4b": "google--gemma-4-26B-A4B-it", "31b": "google--gemma-4-31B-it"}
ASSISTANTS = {  # (path, provenance)
    "e2b": (CONFIGS / "google--gemma-4-E2B-it-assistant" / "config.json", "official config"),
    "e4b": (CONFIGS / "google--gemma-4-E4B-it-assistant" / "config.partial.json",
            "PARTIAL config (fields from transformers' converter)"),
    "26b-a4b": (CONFIGS / "google--gemma-4-26B-A4B-it-assistant" / "config.DERIVED-UNVERIFIED.json",
                "DERIVED-UNVERIFIED config (31B assistant with 26B-A4B widths)"),
    "31b": (CONFIGS / "google--gemma-4-31B-it-assistant" / "config.json", "official config"),
}
# eugr/spark-vllm-docker #343: 26B-A4B nvfp4 on vLLM, per-position acceptance at K=4
# (/work/shared/research/peers.md §4.3); positions 5-6 continue the last ratio (0.70).
PUBLISHED = [0.844, 0.599, 0.385, 0.271]
PUBLISHED_SOURCE = ("published: vLLM, 26B-A4B nvfp4 + MTP assistant, K=4 (eugr/spark-vllm-docker #343); "
                    "positions > 4 extrapolated geometrically")


def real_config(shape: str) -> gemma4.Config:
    if shape == "tiny":
        return gemma4.Config.from_dict(json.loads((TINY / "moe" / "target" / "config.json").read_text()))
    if shape not in TARGETS:
        raise SystemExit(f"unknown shape {shape!r}: {', '.join(TARGETS)} or tiny")
    return gemma4.Config.from_dict(json.loads((CONFIGS / TARGETS[shape] / "config.json").read_text()))


def assistant_config(shape: str) -> tuple[Optional[gemma4_assistant.Config], str]:
    if shape == "tiny":
        path, source = TINY / "moe" / "drafter" / "config.json", "tiny fixture drafter"
    else:
        path, source = ASSISTANTS[shape]
    if not path.exists():
        return None, f"no assistant config at {path}"
    raw = json.loads(path.read_text())
    raw.pop("_partial", None)
    return gemma4_assistant.Config.from_dict(raw), source


def quantize(module: nn.Module, bits: int) -> None:
    if bits:
        def predicate(path, m):
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % 64:
                return False  # (toy shapes) not divisible by the group size: left unquantized
            return {"group_size": 64, "bits": 8} if path.endswith("router.proj") else True

        nn.quantize(module, group_size=64, bits=bits, class_predicate=predicate)
    mx.eval(module.parameters())


def nbytes(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def layer_kinds(cfg: gemma4.Config) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {}
    for i, t in enumerate(cfg.layer_types):
        name = "sliding" if t == SLIDING else "full"
        if i >= cfg.first_shared_layer:
            name += " kv-shared"
        if cfg.use_double_wide_mlp and i >= cfg.first_shared_layer:
            name += " 2x-MLP"
        if cfg.enable_moe_block:
            name += " MoE"
        kinds.setdefault(name, []).append(i)
    return kinds


def time_layers(cfg, index, copies, sizes, context, repeats, bits, log):
    """Seconds per layer of kind `index`, for each T in sizes: `copies` instances chained."""
    layers = []
    for _ in range(copies):
        layer = gemma4.DecoderLayer(cfg, index)
        quantize(layer, bits)
        layers.append(layer)
    attn = layers[0].self_attn
    window = cfg.sliding_window if attn.layer_type == SLIDING else None
    ctx = min(context, window) if window else context
    P = cfg.hidden_size_per_layer_input
    out = {}
    own = attn.heads[1] > 0  # computes K/V (else reads the producer's, new tokens included)
    for T in sizes:
        kv_shape = (1, attn.n_kv, ctx + (0 if own else T), attn.head_dim)
        ck, cv = mx.random.normal(kv_shape), mx.random.normal(kv_shape)
        mask = mx.array(np.tril(np.ones((T, ctx + T), dtype=bool), k=ctx))[None, None]
        x0 = mx.random.normal((1, T, cfg.hidden_size)) * 0.1
        pli = mx.random.normal((1, T, P)) if P else None
        mx.eval(ck, cv, mask, x0, *(a for a in [pli] if a is not None))
        cache = None
        if own:  # a real cache holding `ctx` positions, rolled back after every timed forward
            cache = KVCache([attn.layer_type] * (index + 1), cfg.sliding_window, 1, max_rollback=max(sizes))
            cache.begin(ctx).store(index, ck, cv)
        shared = Step(mx.arange(ctx, ctx + T)[None], ctx, {attn.layer_type: mask}, {}, {})

        def chain():
            x = x0
            step = cache.begin(T) if own else shared
            for layer in layers:
                x, _ = layer(x, step, None if own else (ck, cv), pli)
            mx.eval(x)
            if own:
                cache.trim(T)

        out[T] = time_fn(chain, repeats) / copies
        log(f"  layer {index} ({attn.layer_type}) T={T}: {1000 * out[T]:.1f} ms/layer")
    size = nbytes(layers[0])
    return out, size


def time_head(cfg, sizes, repeats, bits, log):
    """The tied 262144-row LM head (+ softcap) against T; weights built in row chunks."""
    V, H = cfg.vocab_size, cfg.hidden_size
    chunk = 16384
    parts = []
    for start in range(0, V, chunk):
        w = mx.random.normal((min(chunk, V - start), H)) * 0.02
        parts.append(mx.quantize(w, 64, bits) if bits else (w,))
        mx.eval(*parts[-1])
    if bits:
        wq = mx.concatenate([p[0] for p in parts])
        scales, biases = mx.concatenate([p[1] for p in parts]), mx.concatenate([p[2] for p in parts])
        mx.eval(wq, scales, biases)
        head = lambda x: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=bits)
        size = wq.nbytes + scales.nbytes + biases.nbytes
    else:
        w = mx.concatenate([p[0] for p in parts])
        mx.eval(w)
        head = lambda x: x @ w.T
        size = w.nbytes
    del parts
    cap = cfg.final_logit_softcapping or 30.0
    out = {}
    for T in sizes:
        x = mx.random.normal((1, T, H))
        mx.eval(x)
        out[T] = time_fn(lambda: mx.eval(mx.argmax(mx.tanh(head(x) / cap) * cap, axis=-1)), repeats)
        log(f"  head T={T}: {1000 * out[T]:.1f} ms")
    return out, size


def time_ple_projection(cfg, sizes, repeats, bits):
    """E2B/E4B: the per-layer-input projection H -> layers * P (the table lookup is a gather)."""
    if not cfg.hidden_size_per_layer_input:
        return {T: 0.0 for T in sizes}
    proj = nn.Linear(cfg.hidden_size, cfg.num_hidden_layers * cfg.hidden_size_per_layer_input, bias=False)
    quantize(proj, bits)
    out = {}
    for T in sizes:
        x = mx.random.normal((1, T, cfg.hidden_size))
        mx.eval(x)
        out[T] = time_fn(lambda: mx.eval(proj(x)), repeats)
    return out


def time_drafter(shape, tcfg, batches, context, repeats, bits, log):
    acfg, source = assistant_config(shape)
    if acfg is None:
        return None, source, 0
    model = gemma4_assistant.Model(acfg)
    if acfg.use_ordered_embeddings:
        model.masked_embedding.token_ordering = mx.random.permutation(acfg.text.vocab_size).astype(mx.int32)
    quantize(model, bits)
    out = {}
    for B in batches:
        shared = {}
        for kind in (SLIDING, FULL):
            src = tcfg.store_layer(kind)
            ctx = min(context, tcfg.sliding_window) if kind == SLIDING else context
            shape_kv = (B, tcfg.layer_kv_heads(src), ctx, tcfg.layer_head_dim(src))
            shared[kind] = SharedKV(mx.random.normal(shape_kv), mx.random.normal(shape_kv),
                                    mx.broadcast_to(mx.arange(ctx, dtype=mx.int32)[None], (B, ctx)))
        emb = mx.random.normal((B, tcfg.hidden_size))
        hid = mx.random.normal((B, tcfg.hidden_size))
        pos = mx.full((B,), context, dtype=mx.int32)
        mx.eval(emb, hid, pos, *[a for kv in shared.values() for a in kv])

        def step():
            o = model.draft_step(emb, hid, shared, pos)
            mx.eval(o.argmax(), o.hidden)

        out[B] = time_fn(step, repeats)
        log(f"  drafter B={B}: {1000 * out[B]:.1f} ms/step")
    size = nbytes(model)
    return out, source, size


def interp(costs: dict, T: int) -> tuple[float, bool]:
    """Linear interpolation in T between measured sizes; linear extrapolation past the
    largest (flagged)."""
    xs = sorted(costs)
    if T in costs:
        return costs[T], False
    if T < xs[0]:
        return costs[xs[0]], True
    for a, b in zip(xs, xs[1:]):
        if a < T < b:
            return costs[a] + (costs[b] - costs[a]) * (T - a) / (b - a), False
    if len(xs) == 1:
        return costs[xs[0]] * T / xs[0], True
    a, b = xs[-2], xs[-1]
    return costs[b] + (costs[b] - costs[a]) * (T - b) / (b - a), True


def acceptance_source(arg: Optional[str], kmax: int) -> tuple[list[float], str]:
    if arg and Path(arg).exists():
        data = json.loads(Path(arg).read_text())
        for res in data["results"]:
            if res["mode"] != "speed":
                continue
            best = [r for r in res["rows"] if r["batch"] == 1 and r["mode"].startswith("ours-mtp-")
                    and r["k"] != "auto" and r["acceptance_at"]]
            if best:
                kk = max(r["k"] for r in best)
                rates = np.mean([r["acceptance_at"] for r in best if r["k"] == kk], axis=0).tolist()
                return extend(rates, kmax), (f"measured: {res['pair']} pair, K={kk}, B=1, mean over prompt "
                                             f"classes ({arg})")
        raise SystemExit(f"{arg} has no measured per-position acceptance")
    if arg:
        rates = [float(a) for a in arg.split(",")]
        return extend(rates, kmax), "given on the command line"
    return extend(PUBLISHED, kmax), PUBLISHED_SOURCE


def extend(rates: list[float], kmax: int) -> list[float]:
    rates = list(rates)
    ratio = rates[-1] / rates[-2] if len(rates) > 1 and rates[-2] > 0 else 0.7
    while len(rates) < kmax:
        rates.append(rates[-1] * min(ratio, 1.0))
    return rates


def run_shape(shape, args, log) -> dict:
    cfg = real_config(shape)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    batches = [int(b) for b in args.batch.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    kinds = layer_kinds(cfg)
    log(f"{shape}: {cfg.num_hidden_layers} layers, kinds {{{', '.join(f'{k}: {len(v)}' for k, v in kinds.items())}}}")
    reset_peak()
    started = time.perf_counter()
    layer_cost, layer_bytes = {}, {}
    for name, idx in kinds.items():
        layer_cost[name], layer_bytes[name] = time_layers(cfg, idx[0], args.layers, sizes, args.context,
                                                          args.repeats, args.bits, log)
    if args.skip_head:
        head, head_bytes = {T: 0.0 for T in sizes}, 0
    else:
        head, head_bytes = time_head(cfg, sizes, args.repeats, args.bits, log)
    ple = time_ple_projection(cfg, sizes, args.repeats, args.bits)
    drafter, drafter_source, drafter_bytes = time_drafter(shape, cfg, batches, args.context, args.repeats,
                                                          args.bits, log)
    forward = {T: sum(len(kinds[n]) * layer_cost[n][T] for n in kinds) + head[T] + ple[T] for T in sizes}
    rates, rate_source = acceptance_source(args.acceptance, max(ks))
    proj = {"ks": ks, "batches": batches, "speedup": {}, "tps": {}, "plain_tps": {}, "extrapolated": []}
    for B in batches:
        plain, _ = interp(forward, B)
        proj["plain_tps"][B] = B / plain
        for K in ks:
            cost_t, extra = interp(forward, B * (K + 1))
            if drafter is None:
                continue
            round_cost = cost_t + K * drafter[B]
            tokens = 1 + sum(rates[:K])
            proj["speedup"][f"{K}@{B}"] = tokens * plain / round_cost
            proj["tps"][f"{K}@{B}"] = B * tokens / round_cost
            if extra:
                proj["extrapolated"].append(f"{K}@{B}")
    label = f"{args.bits}-bit affine g64 (router 8-bit)" if args.bits else "unquantized fp32"
    return dict(
        shape=shape, config=TARGETS.get(shape, "tiny fixture"), vocab=cfg.vocab_size, bits=args.bits, bits_label=label,
        layers_total=cfg.num_hidden_layers, kinds={k: len(v) for k, v in kinds.items()},
        copies_timed=args.layers, context=args.context, sizes=sizes,
        layer_ms={n: {T: 1000 * c for T, c in v.items()} for n, v in layer_cost.items()},
        head_ms={T: 1000 * c for T, c in head.items()}, ple_projection_ms={T: 1000 * c for T, c in ple.items()},
        forward_ms={T: 1000 * c for T, c in forward.items()},
        drafter_ms={B: 1000 * c for B, c in drafter.items()} if drafter else None, drafter_config=drafter_source,
        projected_weight_gb=(sum(len(kinds[n]) * layer_bytes[n] for n in kinds) + head_bytes) / 1e9,
        drafter_weight_gb=drafter_bytes / 1e9, peak_mb=peak_mb(), seconds=time.perf_counter() - started,
        acceptance=rates, acceptance_source=rate_source, projection=proj,
    )


def run_cost(args, log=print) -> dict:
    shapes = [run_shape(s, args, log) for s in args.shape.split(",")]
    return dict(mode="cost", repeats=args.repeats, shapes=shapes)


def cost_md(res: dict) -> str:
    return "\n".join(shape_md(s, res) for s in res["shapes"])


def shape_md(s: dict, res: dict) -> str:
    sizes = s["sizes"]
    intro = (f"Measured: {s['copies_timed']} chained instance(s) of each layer kind, one row of T query tokens over "
             f"a context of {s['context']} cached tokens (sliding layers: up to the window), median of "
             f"{res['repeats']}; the tied {s['vocab']}-row head separately. Derived (not measured as a whole): a full "
             f"{s['layers_total']}-layer forward = sum over kinds of (count x per-layer cost) + head"
             + (" + per-layer-input projection" if any(s["ple_projection_ms"].values()) else "")
             + f". Layer counts: {', '.join(f'{k} x{n}' for k, n in s['kinds'].items())}. Projected weight memory "
             f"{s['projected_weight_gb']:.2f} GB (drafter {s['drafter_weight_gb']:.2f} GB); peak memory of this run "
             f"{s['peak_mb']:.0f} MB; {s['seconds']:.0f} s.")
    header = (["T (tokens/forward)"] + [f"{k} ms/layer" for k in s["layer_ms"]]
              + ["head ms", "full forward ms (derived)", "ms per token"])
    rows = [[T] + [fmt(s["layer_ms"][k][T], ".1f") for k in s["layer_ms"]] + [
        fmt(s["head_ms"][T], ".1f"), fmt(s["forward_ms"][T], ".0f"), fmt(s["forward_ms"][T] / T, ".0f")]
        for T in sizes]
    if s["drafter_ms"]:
        drafter = f"Drafter step ({s['drafter_config']}), measured: " + ", ".join(
            f"B={b}: {fmt(v, '.1f')} ms" for b, v in s["drafter_ms"].items())
    else:
        drafter = f"Drafter: {s['drafter_config']}: no projection"
    return section(f"Real-shape cost: {s['shape']} ({s['config']}), {s['bits_label']}, random weights, "
                   f"regime {res['regime']['name']}", intro, table(header, rows), drafter, *projection(s))


def projection(s: dict) -> list:
    p = s["projection"]
    if not p["speedup"]:
        return []
    return [f"**PROJECTION** (not a measurement): MTP speed-up over plain decoding at the same B, "
            f"= E[tokens|K] x cost(T=B) / (cost(T=B(K+1)) + K x drafter(B)); per-position acceptance "
            f"{' '.join(f'{a:.3f}' for a in s['acceptance'][:max(p['ks'])])} ({s['acceptance_source']})."
            + (f" Entries {', '.join(p['extrapolated'])} extrapolate the forward cost linearly past "
               f"T={max(s['sizes'])}." if p["extrapolated"] else ""),
            pivot(p["speedup"], p["ks"], p["batches"], "projected speed-up"),
            "Projected plain decode on this machine (full depth): " + ", ".join(
                f"B={b}: {v:.2f} tok/s" for b, v in p["plain_tps"].items())]
