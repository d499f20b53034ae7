"""`python -m apps.bench kernels`: mlx_mtp's CUDA kernels against MLX's at the released shapes (issue 34).

For each distinct weight of 31B and 26B-A4B (4-bit affine, group 64; the MoE's router and dense MLP
at 8 bits) and each row count: our kernel's time and MLX's (median of repeats; each repeat one pass
over enough copies of the weight to leave the L2 cache, so that the weight streams from memory as in
a forward), the effective bandwidth (weight bytes / time), the largest difference from the fp32
reference relative to the reference's largest value, and whether every row is bitwise the product of
that row alone (row-invariance). Then the 26B-A4B's experts (tokens x top-8 of 128) and attention at
head_dim 256 and 512 (1-8 query positions against a sliding ring and a long full-attention buffer).

Correctness comes first, timings after, and every figure is printed as it is measured. `--smoke`
runs tiny shapes: on a GPU, or without one through the CPU emulator of a source checkout
(tests/cuda_emu, with g++): correctness and row-invariance only, each kernel timed once, the times
the emulator's. Without a GPU the full run says in one line that it needs one (exit status 2).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_mtp.kernels import qmm, sdpa
from mlx_mtp.kernels.source import use_factory
from mlx_mtp.models import gemma4

from .cli import NeedsGPU
from .env import median
from .realsize import sources
from .report import section, table

GROUP = 64
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
QUICK_ROWS = (1, 2, 4, 7, 8, 16, 28, 32, 56)
MLX_ROWS = (1, 4, 8, 16, 32)  # MLX's kernel at 8+ rows compiles for tens of seconds per tile shape: a few
STREAM_BYTES = 256 << 20  # weight copies per timed pass: several times an H200's 60 MB L2
MAX_COPIES = 16  # 1 in the emulator, where a launch is a process and only correctness counts
TINY_SHAPES = [("tiny q", 64, 128, 4), ("tiny down", 32, 192, 8)]


def weight_shapes(shape: str) -> list:
    """(label, N, K, bits) of every distinct quantized weight of a released target a step reads."""
    cfg = gemma4.Config.from_dict(sources(shape)[0])
    H, moe = cfg.hidden_size, cfg.enable_moe_block
    out = {}
    for i in range(cfg.num_hidden_layers):
        kind = "full" if cfg.layer_types[i] == "full_attention" else "sliding"
        hd, kv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        out.setdefault((cfg.num_attention_heads * hd, H, 4), f"q ({kind})")
        out.setdefault((kv * hd, H, 4), f"k/v ({kind})")
        out.setdefault((H, cfg.num_attention_heads * hd, 4), f"o ({kind})")
    mlp_bits = 8 if moe else 4
    out.setdefault((cfg.intermediate_size, H, mlp_bits), "mlp gate/up")
    out.setdefault((H, cfg.intermediate_size, mlp_bits), "mlp down")
    if moe:
        out.setdefault((cfg.num_experts, H, 8), "router")
    out.setdefault((cfg.vocab_size, H, 4), "tied head")
    return [(f"{shape} {label}", n, k, bits) for (n, k, bits), label in out.items()]


def random_weight(n: int, k: int, bits: int, key) -> tuple:
    """Uniform codes and per-group scales and biases giving weights of std ~ 1/sqrt(k), bf16."""
    k1, k2 = mx.random.split(key)
    w = mx.random.randint(0, 1 << 30, (n, k * bits // 32), key=k1).astype(mx.uint32) * 4 + \
        mx.random.randint(0, 4, (n, k * bits // 32), key=k2).astype(mx.uint32)
    step = 1 / (math.sqrt(k) * 2**bits / 3.5)
    scales = (mx.random.uniform(0.5, 1.5, (n, k // GROUP), key=k2) * step).astype(mx.bfloat16)
    biases = (-scales.astype(mx.float32) * (2**bits - 1) / 2).astype(mx.bfloat16)
    mx.eval(w, scales, biases)
    return w, scales, biases


def weight_copies(first: tuple, n: int, k: int, bits: int) -> list:
    """`first` and more random weights of its shape: up to 16, or as many as fill STREAM_BYTES."""
    nbytes = sum(a.nbytes for a in first)
    count = min(MAX_COPIES, max(1, STREAM_BYTES // nbytes))
    return [first] + [random_weight(n, k, bits, mx.random.key(c)) for c in range(1, count)]


def relative_error(got: mx.array, want: mx.array) -> float:
    want = want.astype(mx.float32)
    return float(mx.max(mx.abs(got.astype(mx.float32) - want)) / mx.maximum(mx.max(mx.abs(want)), 1e-30))


def rows_invariant(fn, x: mx.array, *more: mx.array) -> bool:
    """fn(x, *more)[i] == fn of row i alone, bitwise, for every row; and row 0 unchanged when the other
    rows of x change."""
    full = fn(x, *more)
    alone = mx.concatenate([fn(x[i : i + 1], *(m[i : i + 1] for m in more)) for i in range(x.shape[0])])
    other = mx.concatenate([x[:1], -x[1:]]) if x.shape[0] > 1 else x
    return bool(mx.array_equal(full, alone)) and bool(mx.array_equal(fn(other, *more)[:1], full[:1]))


def timed(fns: list, repeats: int) -> float:
    """Median seconds of one of `fns` (run all in one evaluation: each reads its own weight copy)."""
    mx.eval([f() for f in fns])  # warm-up: compilation, allocation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([f() for f in fns])
        times.append((time.perf_counter() - start) / len(fns))
    return median(times)


# ---- dense ------------------------------------------------------------------------------------------


def bench_dense(label: str, n: int, k: int, bits: int, rows: tuple, mlx_rows: tuple, repeats: int, log) -> list:
    key = mx.random.key(n * 7 + k)
    w, s, b = random_weight(n, k, bits, key)
    x = mx.random.normal((max(rows), k), key=key).astype(mx.bfloat16)
    ours = lambda xs, w=w, s=s, b=b: qmm.dense(xs, w, s, b, GROUP, bits)  # noqa: E731
    nbytes = w.nbytes + s.nbytes + b.nbytes
    copies = weight_copies((w, s, b), n, k, bits)
    out = []
    for m in rows:
        xm = x[:m]
        ref = qmm.reference_dense(xm, w, s, b, GROUP, bits)
        r = dict(label=label, n=n, k=k, bits=bits, rows=m, invariant=rows_invariant(ours, xm),
                 error=relative_error(ours(xm), ref),
                 ours_s=timed([lambda c=c: qmm.dense(xm, *c, GROUP, bits) for c in copies], repeats))
        if m in mlx_rows:
            theirs = lambda c: mx.quantized_matmul(xm, *c, True, GROUP, bits)  # noqa: E731
            r["mlx_error"] = relative_error(theirs(copies[0]), ref)
            r["mlx_s"] = timed([lambda c=c: theirs(c) for c in copies], repeats)
        r["ours_gb_s"] = nbytes / r["ours_s"] / 1e9
        out.append(r)
        log(_dense_line(r))
    return out


def _dense_line(r: dict) -> str:
    mlx = f", MLX {1e6 * r['mlx_s']:.1f} us ({r['mlx_s'] / r['ours_s']:.2f}x ours)" if "mlx_s" in r else ""
    return (f"  {r['label']} ({r['n']}x{r['k']}, {r['bits']}-bit) rows {r['rows']}: ours {1e6 * r['ours_s']:.1f} us "
            f"({r['ours_gb_s']:.0f} GB/s), error {r['error']:.1e}{mlx}, row-invariant {r['invariant']}")


def launch_cost(repeats: int) -> dict:
    """Seconds per launch of an empty custom kernel and of MLX's smallest op, 64 to an evaluation:
    the fixed cost every kernel of a forward pays on this backend."""
    from mlx_mtp.kernels.source import Kernel

    empty = Kernel("mtp_empty", None, ["a"], ["out"], "if (threadIdx.x == 0) out[0] = a[0];")
    a = mx.zeros((1,))
    ours = lambda: empty([a], [], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],  # noqa: E731
                         output_dtypes=[mx.float32])[0]
    return dict(custom_s=timed([ours] * 64, repeats), mlx_s=timed([lambda: mx.abs(a)] * 64, repeats))


def sweep(label: str, n: int, k: int, bits: int, rows: tuple, repeats: int, log) -> list:
    """Launch shapes for one weight: prefetch depth 1-3 at the chosen warps, and half and twice the
    warps at the chosen depth (the warps change the sums' order: a comparison, not a choice at run time)."""
    w, s, b = random_weight(n, k, bits, mx.random.key(11))
    nbytes = w.nbytes + s.nbytes + b.nbytes
    copies = weight_copies((w, s, b), n, k, bits)
    nw0 = qmm.warps(n, k, bits)
    shapes = [(d, nw0) for d in (1, 2, 3)]
    shapes += [(qmm.DEPTH, nw) for nw in (nw0 // 2, nw0 * 2) if 1 <= nw <= qmm.MAX_WARPS]
    out = []
    x = mx.random.normal((max(rows), k), key=mx.random.key(12)).astype(mx.bfloat16)
    for m in rows:
        for depth, nw in shapes:
            t = timed([lambda c=c: qmm.dense(x[:m], *c, GROUP, bits, depth=depth, nw=nw) for c in copies], repeats)
            out.append(dict(label=label, rows=m, depth=depth, nw=nw, s=t, gb_s=nbytes / t / 1e9))
            log(f"  {label} rows {m}: depth {depth}, {nw} warps: {1e6 * t:.1f} us ({nbytes / t / 1e9:.0f} GB/s)")
    return out


# ---- experts ----------------------------------------------------------------------------------------


def switch_glu(experts: int, hidden: int, inter: int, bits: int, group: int = GROUP,
               dtype: mx.Dtype = mx.bfloat16) -> SwitchGLU:
    """Gemma 4's experts (a SwitchGLU with its GeGLU), random and quantized."""
    glu = SwitchGLU(hidden, inter, experts, gemma4.GeGLU())
    nn.quantize(glu, group_size=group, bits=bits)
    glu.set_dtype(dtype)
    mx.eval(glu.parameters())
    return glu


def reference_glu(glu, x: mx.array, idx: mx.array) -> mx.array:
    k = idx.shape[-1]
    ids = idx.reshape(-1)
    h = qmm.reference_experts(x, ids, glu.gate_proj, k, glu=True, second=glu.up_proj)
    return qmm.reference_experts(h, ids, glu.down_proj, 1).reshape(*idx.shape, -1)


def bench_experts(experts: int, hidden: int, inter: int, top_k: int, tokens: tuple, repeats: int, log) -> list:
    from mlx_mtp import kernels

    glu = switch_glu(experts, hidden, inter, 4)
    key = mx.random.key(3)
    x = mx.random.normal((max(tokens), hidden), key=key).astype(mx.bfloat16)
    idx = mx.argsort(mx.random.uniform(shape=(max(tokens), experts), key=key), axis=-1)[:, :top_k].astype(mx.int32)
    ours = lambda xs, ids: kernels.glu_experts(glu, xs, ids)  # noqa: E731
    out = []
    for t in tokens:
        xt, it = x[:t], idx[:t]
        invariant = rows_invariant(ours, xt, it)
        error = relative_error(ours(xt, it), reference_glu(glu, xt, it))
        r = dict(tokens=t, top_k=top_k, invariant=invariant, error=error,
                 ours_s=timed([lambda: ours(xt, it)], repeats), mlx_s=_mlx_time(lambda: glu(xt, it), repeats, log))
        out.append(r)
        mlx = "-" if r["mlx_s"] is None else f"{1e6 * r['mlx_s']:.0f} us"
        log(f"  experts {experts}x({inter}x{hidden}) tokens {t} x top-{top_k}: ours {1e6 * r['ours_s']:.0f} us, "
            f"MLX {mlx}, error {r['error']:.1e}, row-invariant {invariant}")
    return out


def _mlx_time(fn, repeats: int, log) -> Optional[float]:
    """MLX's time for the same work, None (said in one line) where MLX cannot run it here: mlx-lm's
    experts on the CPU take float32 only ("[GatherMM::eval] Currently only supports float32")."""
    try:
        return timed([fn], repeats)
    except (RuntimeError, ValueError) as e:
        log(f"  MLX's own: skipped on {mx.default_device()}: {str(e).splitlines()[0]}")
        return None


# ---- attention --------------------------------------------------------------------------------------


def bench_attention(label: str, heads: int, kv_heads: int, head_dim: int, slots: int, visible: int,
                    queries: tuple, repeats: int, log) -> list:
    """L query positions (the last L of `visible` positions written in `slots` slots) per head."""
    key = mx.random.key(head_dim + slots)
    q_all = mx.random.normal((1, heads, max(queries), head_dim), key=key).astype(mx.bfloat16)
    kv = mx.random.normal((2, 1, kv_heads, slots, head_dim), key=key).astype(mx.bfloat16)
    out = []
    for L in queries:
        q = q_all[:, :, :L]
        pos = mx.arange(slots)[None, :]
        qpos = mx.arange(visible - L, visible)[:, None]
        mask = ((pos <= qpos) & (pos < visible))[None, None]
        ours = lambda qs, m: sdpa.attention(qs, kv[0], kv[1], m)  # noqa: E731
        alone = mx.concatenate([ours(q[:, :, i : i + 1], mask[:, :, i : i + 1]) for i in range(L)], axis=2)
        r = dict(label=label, queries=L, slots=slots, invariant=bool(mx.array_equal(ours(q, mask), alone)),
                 error=relative_error(ours(q, mask), sdpa.reference(q, kv[0], kv[1], mask)),
                 ours_s=timed([lambda: ours(q, mask)], repeats),
                 mlx_s=timed([lambda: mx.fast.scaled_dot_product_attention(q, kv[0], kv[1], scale=1.0, mask=mask)],
                             repeats))
        out.append(r)
        log(f"  attention {label} L={L}: ours {1e6 * r['ours_s']:.0f} us, MLX {1e6 * r['mlx_s']:.0f} us, "
            f"error {r['error']:.1e}, row-invariant {r['invariant']}")
    return out


# ---- the run -------------------------------------------------------------------------------------


def emulator():
    """The CPU emulator of mlx_mtp's CUDA kernels in a source checkout (tests/cuda_emu), or None where
    there is none or no C++ compiler for it."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not (tests / "cuda_emu" / "__init__.py").is_file():
        return None
    sys.path.insert(0, str(tests))
    try:
        import cuda_emu
    finally:
        sys.path.remove(str(tests))
    return cuda_emu if cuda_emu.available() else None


def run_kernels(args, log=print) -> dict:
    """On a GPU; with --smoke and no GPU, through the CPU emulator (NeedsGPU where neither runs)."""
    global MAX_COPIES
    if mx.cuda.is_available():
        return _run(args, log)
    if not args.smoke:
        raise NeedsGPU("kernels: needs an NVIDIA GPU (MLX's CUDA backend); `--smoke` runs tiny shapes through the "
                       "CPU emulator of a source checkout")
    emu = emulator()
    if emu is None:
        raise NeedsGPU("kernels --smoke: needs an NVIDIA GPU, or a source checkout's CPU emulator (tests/cuda_emu) "
                       "and g++")
    log("no GPU: tiny shapes through the CPU emulator (tests/cuda_emu): correctness and row-invariance; the times "
        "are the emulator's, not a GPU's")
    MAX_COPIES, args.repeats = 1, 1
    with use_factory(emu.cuda_kernel_fast):
        res = _run(args, log)
    res["device"] += ", CUDA kernels EMULATED"
    return res


def _run(args, log) -> dict:
    os.environ.setdefault("MLX_ENABLE_TF32", "0")  # fp32 references, not TF32 (read at MLX's first GPU matmul)
    started = time.perf_counter()
    rows = QUICK_ROWS if args.quick else ROWS
    res = dict(mode="kernels", device=str(mx.default_device()), smoke=args.smoke, dense=[], experts=[], attention=[])
    if args.smoke:
        shapes, experts, heads = TINY_SHAPES, (8, 64, 64, 2, (1, 3)), [("tiny", 4, 2, 64, 40, 37)]
        rows, mlx_rows = (1, 3, 9), ()
    else:
        shapes = [s for shape in args.shapes.split(",") for s in weight_shapes(shape)]
        experts, mlx_rows = (128, 2816, 704, 8, (1, 2, 4, 8, 16, 32)), MLX_ROWS
        heads = [("31b sliding (d256, ring 1039)", 32, 16, 256, 1039, 1000),
                 ("31b full (d512, 8k)", 32, 4, 512, 8192, 8000)]
    if not args.smoke:
        res["launch"] = launch_cost(args.repeats)
        log(f"launch: empty custom kernel {1e6 * res['launch']['custom_s']:.1f} us, MLX's abs of one value "
            f"{1e6 * res['launch']['mlx_s']:.1f} us (64 to an evaluation)")
        log("launch shapes:")
        res["sweep"] = [r for label, n, k, bits in (shapes[0], shapes[-1]) for r in
                        sweep(label, n, k, bits, (1, 8, 32), args.repeats, log)]
    log("dense quantized matmuls:")
    for label, n, k, bits in shapes:
        res["dense"] += bench_dense(label, n, k, bits, rows, mlx_rows, args.repeats, log)
    log("MoE experts:")
    res["experts"] = bench_experts(*experts[:4], experts[4], args.repeats, log)
    log("attention:")
    for h in heads:
        res["attention"] += bench_attention(*h, (1, 2, 4, 7, 8) if not args.smoke else (1, 3), args.repeats, log)
    res["seconds"] = time.perf_counter() - started
    res["mismatches"] = [f"{part} {r.get('label', '')} at {r.get('rows', r.get('tokens', r.get('queries')))}: "
                         "not row-invariant" for part in ("dense", "experts", "attention") for r in res[part]
                         if not r["invariant"]]
    return res


def kernels_md(res: dict) -> str:
    us = lambda s: f"{1e6 * s:.1f}" if s is not None else "-"  # noqa: E731
    emulated = "EMULATED" in res["device"]  # the emulator's times say nothing of a GPU's ratio
    ratio = lambda r: f"{r['mlx_s'] / r['ours_s']:.2f}x" if r.get("mlx_s") and not emulated else "-"  # noqa: E731
    dense = [[r["label"], f"{r['n']}x{r['k']}", r["bits"], r["rows"], us(r["ours_s"]), f"{r['ours_gb_s']:.0f}",
              us(r.get("mlx_s")), ratio(r), f"{r['error']:.1e}",
              "yes" if r["invariant"] else "**no**"] for r in res["dense"]]
    experts = [[r["tokens"], us(r["ours_s"]), us(r["mlx_s"]), ratio(r), f"{r['error']:.1e}",
                "yes" if r["invariant"] else "**no**"] for r in res["experts"]]
    attention = [[r["label"], r["queries"], us(r["ours_s"]), us(r["mlx_s"]), ratio(r),
                  f"{r['error']:.1e}", "yes" if r["invariant"] else "**no**"] for r in res["attention"]]
    return section(f"Kernels: mlx_mtp's against MLX's ({res['device']}{', SMOKE' if res['smoke'] else ''}), "
                   f"{res['seconds']:.0f} s",
                   table(["weight", "N x K", "bits", "rows", "ours us", "ours GB/s", "MLX us", "MLX / ours", "error",
                          "row-invariant"], dense),
                   table(["experts: tokens (top-8)", "ours us", "MLX us", "MLX / ours", "error", "row-invariant"],
                         experts),
                   table(["attention", "L", "ours us", "MLX us", "MLX / ours", "error", "row-invariant"], attention))
