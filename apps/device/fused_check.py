"""The fused kernels of issue 42 on a real GPU (MLX's CUDA backend), at the released shapes: each against
its fp32 reference, every row bitwise its product alone, and its time (median of repeats) beside the
bytes of weight it streams (the fraction of a copy's bandwidth). `--smoke`: tiny shapes (any device the
kernels run on). One line per check; exit status 1 if any check fails.

    python -m apps.device.fused_check [--smoke] [--repeats 10]
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
import mlx.nn as nn

from mlx_mtp.kernels import attn_input, ffn, glue, routing
from mlx_mtp.models.quantized import QuantizedLinear

BF16 = mx.bfloat16
EPS = 1e-6
# (name, hidden, heads, kv heads, head_dim, kv) of the 31B's sliding and full layers; E4B-like at --smoke
ATTENTION = [("31b sliding", 5376, 32, 16, 256, 2), ("31b full (k = v)", 5376, 32, 4, 512, 1)]
MLP = [("31b mlp", 5376, 21504), ("26b-a4b dense mlp", 2816, 2112)]
EXPERTS = [("26b-a4b experts", 2816, 704, 128, 8)]
ROUTERS = [("26b-a4b router", 2816, 128, 8)]  # (name, hidden, experts, top-k): 8-bit as the product's conversions
MOE_GLUE = [(2816, 8)]  # (hidden, top-k): the residual glue with the experts' weighted sum
SMOKE = dict(attention=[("tiny", 256, 2, 1, 256, 2), ("tiny k=v", 256, 2, 1, 512, 1)], mlp=[("tiny mlp", 256, 512)],
             experts=[("tiny experts", 256, 64, 8, 2)], routers=[("tiny router", 256, 16, 2)], rows=(1, 3, 9),
             residual=[256], moe_glue=[(256, 2)])


def quantized(n: int, k: int, seed: int, bits: int = 4) -> QuantizedLinear:
    layer = QuantizedLinear(k, n, bias=False, group_size=64, bits=bits)
    w = mx.random.normal((n, k), key=mx.random.key(seed)) / k**0.5
    layer.weight, s, b = mx.quantize(w, group_size=64, bits=bits)
    layer.scales, layer.biases = s.astype(BF16), b.astype(BF16)
    mx.eval(layer.parameters())
    return layer


def experts_layer(e: int, n: int, k: int, seed: int):
    layer = quantized(e * n, k, seed)
    layer.weight = layer.weight.reshape(e, n, -1)
    layer.scales, layer.biases = layer.scales.reshape(e, n, -1), layer.biases.reshape(e, n, -1)
    return layer


def error(got, want) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want)))


def timed(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def normal(shape, seed, scale=1.0):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(BF16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m apps.device.fused_check")
    p.add_argument("--smoke", action="store_true", help="tiny shapes")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    shapes = SMOKE if args.smoke else dict(attention=ATTENTION, mlp=MLP, experts=EXPERTS, routers=ROUTERS,
                                           rows=(1, 4, 8, 32), residual=[5376, 2816], moe_glue=MOE_GLUE)
    a = mx.random.normal((64 << 20,))  # 256 MB: the copy bandwidth
    copy = 2 * a.nbytes / timed(lambda: a + 1, args.repeats)
    print(f"device {mx.default_device()}, copy {copy / 1e9:.0f} GB/s", flush=True)
    failed = []

    def report(name, rows, err, alone, seconds, weight_bytes, tol=2e-2):
        ok = err < tol and alone
        failed.extend([] if ok else [f"{name} rows={rows}"])
        print(f"{name:24s} rows {rows:2d}: error {err:.1e}, rows alone {'equal' if alone else 'DIFFER'}, "
              f"{seconds * 1e6:8.1f} us, {weight_bytes / seconds / copy:5.0%} of copy{'' if ok else '  FAIL'}",
              flush=True)

    for name, H, hq, hkv, D, kv in shapes["attention"]:
        qkv = quantized((hq + hkv * (2 if kv == 2 else 1)) * D, H, 1)
        norm_w, q_norm, k_norm = normal((H,), 2, 0.3) + 1, normal((D,), 3, 0.3) + 1, normal((D,), 4, 0.3) + 1
        inverse = (1 / 10000.0 ** (mx.arange(0, D, 2) / D)).astype(mx.float32)
        wbytes = qkv.weight.nbytes + qkv.scales.nbytes * 2
        for M in shapes["rows"]:
            x, pos = normal((M, H), 5, 4.0), (100 + mx.arange(M)).reshape(1, M).astype(mx.int32)
            run = lambda xs, ps: attn_input.attention_input(xs, norm_w, qkv, q_norm, k_norm, ps, inverse, hq, D,  # noqa
                                                           kv, EPS)
            got = run(x, pos)
            want = attn_input.reference(x, norm_w, qkv, q_norm, k_norm, pos, inverse, hq, D, kv, EPS)
            err = max(error(g, w) for g, w in zip(got, want))
            last = run(x[M - 1 :], pos[:, M - 1 :])
            alone = all(mx.array_equal(g[:, :, M - 1 :], o) for g, o in zip(got, last))
            report(name, M, err, alone, timed(lambda: run(x, pos), args.repeats), wbytes)
    for name, H, inter in shapes["mlp"]:
        gate_up = quantized(2 * inter, H, 6)
        norm_w = normal((H,), 7, 0.3) + 1
        wbytes = gate_up.weight.nbytes + gate_up.scales.nbytes * 2
        for M in shapes["rows"]:
            x = normal((M, H), 8, 3.0)
            got = ffn.dense(x, norm_w, gate_up, None, EPS)
            err = error(got, ffn.reference_dense(x, norm_w, gate_up, None, EPS))
            alone = mx.array_equal(got[M - 1 :], ffn.dense(x[M - 1 :], norm_w, gate_up, None, EPS))
            report(name, M, err, alone, timed(lambda: ffn.dense(x, norm_w, gate_up, None, EPS), args.repeats), wbytes)
    for name, H, inter, E, top_k in shapes["experts"]:
        gate_up = experts_layer(E, 2 * inter, H, 9)
        norm_w = normal((H,), 10, 0.3) + 1
        per_expert = (gate_up.weight.nbytes + gate_up.scales.nbytes * 2) / E
        for M in shapes["rows"]:
            x = normal((M, H), 11, 3.0)
            ids = mx.argsort(mx.random.uniform(shape=(M, E), key=mx.random.key(12)), axis=-1)[:, :top_k]
            ids = ids.reshape(-1).astype(mx.int32)
            got = ffn.experts(x, norm_w, ids, top_k, gate_up, None, EPS)
            err = error(got, ffn.reference_experts(x, norm_w, ids, top_k, gate_up, None, EPS))
            alone = mx.array_equal(got[-top_k:], ffn.experts(x[M - 1 :], norm_w, ids[-top_k:], top_k, gate_up, None,
                                                             EPS))
            used = len(set(ids.tolist())) * per_expert
            report(name, M, err, alone, timed(lambda: ffn.experts(x, norm_w, ids, top_k, gate_up, None, EPS),
                                              args.repeats), used)
    for name, H, E, top_k in shapes["routers"]:
        proj = quantized(E, H, 19, bits=8)
        scale, per_expert = normal((H,), 20, 0.3) + 1, normal((E,), 21, 0.3) + 1
        wbytes = proj.weight.nbytes + proj.scales.nbytes * 2
        for M in shapes["rows"]:
            x = normal((M, H), 22, 3.0)
            run = lambda xs: routing.router(xs, scale, proj, per_expert, top_k, EPS)  # noqa: E731
            (ids, weights), (want_ids, want_weights) = run(x), routing.reference(x, scale, proj, per_expert, top_k, EPS)
            err = error(weights, want_weights) if mx.array_equal(ids, want_ids) else 1.0  # other experts: a failure
            last = run(x[M - 1 :])
            alone = mx.array_equal(last[0], ids[M - 1 :]) and mx.array_equal(last[1], weights[M - 1 :])
            report(name, M, err, alone, timed(lambda: run(x), args.repeats), wbytes)
    for H, top_k in shapes["moe_glue"]:
        for M in shapes["rows"]:
            x, y, y2 = normal((M, H), 23, 2.0), normal((M, H), 24), normal((M, top_k, H), 25)
            route = mx.softmax(mx.random.normal((M, top_k), key=mx.random.key(26)), axis=-1)
            w, w1, w2 = normal((H,), 27, 0.3) + 1, normal((H,), 28, 0.3) + 1, normal((H,), 29, 0.3) + 1
            more = dict(scalar=mx.array([0.5], BF16), second=(w1, y2, w2), route=route)
            h = glue.residual(x, y, w, EPS, **more)
            one = glue.residual(x[M - 1 :], y[M - 1 :], w, EPS, more["scalar"], (w1, y2[M - 1 :], w2),
                                route=route[M - 1 :])
            report(f"residual {H} + {top_k} experts", M, error(h, glue.reference(x, y, w, EPS, **more)),
                   mx.array_equal(one, h[M - 1 :]), timed(lambda: glue.residual(x, y, w, EPS, **more), args.repeats),
                   0.0, tol=1e-2)
    for H in shapes["residual"]:
        for M in shapes["rows"]:
            x, y, y2 = normal((M, H), 13, 2.0), normal((M, H), 14), normal((M, H), 15)
            w, w1, w2 = normal((H,), 16, 0.3) + 1, normal((H,), 17, 0.3) + 1, normal((H,), 18, 0.3) + 1
            more = dict(scalar=mx.array([0.5], BF16), second=(w1, y2, w2), w_next=w)
            h, hn = glue.residual(x, y, w, EPS, **more)
            want_h, want_hn = glue.reference(x, y, w, EPS, **more)
            one = glue.residual(x[M - 1 :], y[M - 1 :], w, EPS, more["scalar"], (w1, y2[M - 1 :], w2), w)
            alone = mx.array_equal(one[0], h[M - 1 :]) and mx.array_equal(one[1], hn[M - 1 :])
            report(f"residual {H}", M, max(error(h, want_h), error(hn, want_hn)), alone,
                   timed(lambda: glue.residual(x, y, w, EPS, **more), args.repeats), 0.0, tol=1e-2)
    print("all fused checks passed" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
