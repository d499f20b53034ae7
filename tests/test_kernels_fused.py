"""The fused decode/verify kernels of issue 42 (mlx_mtp/kernels: attn_input, ffn, glue, routing):
compiled by NVRTC for Hopper and Ampere without spills, and run on the CPU by the emulator
(tests/cuda_emu), each against its fp32 reference, every row bitwise the same alone as beside other
rows (and unchanged when they change), at the shapes' edges: a K that ends inside a chunk, heads
finished by different blocks, more than one tile of rows, K = V layers and q-only layers, joined and
separate gate/up weights, an expert shared by tokens, routers of several blocks of experts with tied
scores, experts' outputs summed in the glue. Each compiled variant serves several checks."""

import platform

import mlx.core as mx
import mlx.nn as nn
import pytest

from apps.bench.kernels import switch_glu
from mlx_mtp.kernels import attn_input, ffn, glue, nvrtc, qmm, routing
from mlx_mtp.kernels.source import use_factory
from mlx_mtp.models.quantized import QuantizedLinear

import cuda_emu

BF16, F16 = mx.bfloat16, mx.float16
LINUX_X86 = platform.system() == "Linux" and platform.machine() == "x86_64"
EPS = 1e-6


def close(got, want, tol=2e-2):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want))) < tol


def linear(n, k, bits=4, group=64, dtype=BF16, seed=0):
    lin = nn.Linear(k, n, bias=False)
    lin.weight = mx.random.normal((n, k), key=mx.random.key(seed)) / k**0.5
    lin.set_dtype(dtype)
    q = nn.QuantizedLinear.from_linear(lin, group_size=group, bits=bits)
    q.__class__ = QuantizedLinear
    mx.eval(q.parameters())
    return q


def normal(shape, seed, dtype=BF16, scale=1.0):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


# ---- NVRTC ---------------------------------------------------------------------------------------------------


def attention_variant(dtype, bits, mt, d, hq, kv):
    ins = [dtype, dtype, mx.uint32, dtype, dtype, dtype, dtype, mx.int32, mx.float32, mx.float32]
    return attn_input._KERNEL, ins, [dtype] * 3 + [mx.float32, mx.int32], [
        ("T", dtype), ("BITS", bits), ("GROUP", 64), ("MT", mt), ("NW", 8), ("DEPTH", qmm.DEPTH), ("D", d),
        ("HQ", hq), ("KV", kv)]


def mlp_variant(dtype, bits, mt, norm, joined, experts=False):
    ins = [dtype, dtype, mx.uint32, dtype, dtype, mx.uint32, dtype, dtype, mx.float32]
    kernel, more = ffn._DENSE, []
    if experts:
        kernel, more = ffn._EXPERTS, [("TOP_K", 8)]
        ins = ins[:2] + [mx.int32] + ins[2:]
    return kernel, ins, [dtype], [("T", dtype), ("BITS", bits), ("GROUP", 64), ("MT", mt), ("NW", 8),
                                  ("DEPTH", qmm.DEPTH), *more, ("NORM", norm), ("JOINED", joined)]


def residual_variant(dtype, h, two, scalar, after, top_k=0):
    return glue._KERNEL, [dtype] * 4 + [mx.float32] + [dtype] * 4 + [mx.float32], [dtype, dtype], [
        ("T", dtype), ("S", dtype), ("H", h), ("TWO", two), ("TOP_K", top_k), ("SCALAR", scalar), ("NEXT", after)]


def router_variant(dtype, bits, mt, experts, top_k):
    ins = [dtype, dtype, mx.uint32, dtype, dtype, dtype, mx.float32]
    return routing._KERNEL, ins, [mx.int32, mx.float32, mx.float32, mx.int32], [
        ("T", dtype), ("BITS", bits), ("GROUP", 64), ("MT", mt), ("NW", 8), ("DEPTH", qmm.DEPTH), ("E", experts),
        ("TOP_K", top_k)]


VARIANTS = [  # the released shapes' (31B: head_dim 256 / 512, 32 query heads; 26B-A4B's experts) and the edges
    attention_variant(BF16, 4, 1, 256, 32, 2), attention_variant(BF16, 4, 8, 512, 32, 1),
    attention_variant(F16, 8, 2, 256, 8, 0),
    mlp_variant(BF16, 4, 1, True, True), mlp_variant(BF16, 4, ffn.MAX_TILES, True, True),
    mlp_variant(F16, 8, 2, False, False), mlp_variant(BF16, 4, 1, True, True, experts=True),
    mlp_variant(BF16, 4, ffn.MAX_TILES, True, False, experts=True),
    residual_variant(BF16, 5376, False, False, False), residual_variant(BF16, 2816, True, True, True),
    residual_variant(BF16, 2816, True, True, False, top_k=8),  # the 26B-A4B's: its 8 experts summed
    router_variant(BF16, 8, 1, 128, 8), router_variant(BF16, 8, 8, 128, 8), router_variant(F16, 4, 2, 48, 2),
]


@pytest.mark.skipif(not LINUX_X86, reason="NVRTC's pip wheels are for Linux x86-64")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_fused_kernel_compiles_for_hopper_and_ampere_without_spilling(arch):
    assert nvrtc.available(), "the test extra installs nvidia-cuda-nvrtc and nvidia-cuda-runtime"
    for kernel, ins, outs, template in VARIANTS:
        _, log = nvrtc.compile_source(kernel.full_source(ins, outs, template), arch, name=kernel.name, verbose=True)
        assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, (kernel.name, template, log)


# ---- emulated ------------------------------------------------------------------------------------------------

emulated = pytest.mark.skipif(not cuda_emu.available(), reason="the emulator needs g++")


@pytest.fixture
def emulator():
    with use_factory(cuda_emu.cuda_kernel):
        yield


def rows_alone(fn, n):
    """fn(a, b) of rows a..b-1, for each row alone, joined along the row axis of each output."""
    return [fn(i, i + 1) for i in range(n)]


@emulated
@pytest.mark.parametrize("dtype,bits,head_dim,n_heads,n_kv,kv,batch,length", [
    (BF16, 4, 64, 2, 1, 2, 3, 3),   # q, k, v; 9 rows: two tiles; heads of 4 blocks each
    (F16, 8, 128, 2, 1, 1, 1, 2),   # v = k before its norm (K = V full layers); 8-bit codes
    (BF16, 4, 64, 3, 0, 0, 2, 1),   # q only (a layer reading another's K/V)
])
def test_attention_input_matches_its_reference_and_every_row_is_its_own(emulator, dtype, bits, head_dim, n_heads,
                                                                        n_kv, kv, batch, length):
    H = 160  # K ends inside the second chunk of 4-bit codes
    n = (n_heads + n_kv * (2 if kv == 2 else 1)) * head_dim
    qkv = linear(n, H, bits, 32, dtype, seed=1)
    norm_w, q_norm, k_norm = (normal((d,), s, dtype, 0.3) + 1 for d, s in ((H, 2), (head_dim, 3), (head_dim, 4)))
    periods = 10000.0 ** (mx.arange(0, head_dim, 2) / head_dim)
    inverse = mx.where(mx.arange(head_dim // 2) < head_dim // 8, 1 / periods, 0).astype(mx.float32)  # partial RoPE
    positions = (mx.array([[7], [300], [41]])[:batch] + mx.arange(length)).astype(mx.int32)
    x = normal((batch * length, H), 5, dtype, 4.0)
    args = (norm_w, qkv, q_norm, k_norm if kv else None)
    rest = (inverse, n_heads, head_dim, kv, EPS)
    got = attn_input.attention_input(x, *args, positions, *rest)
    want = attn_input.reference(x, *args, positions, *rest)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape == (batch, g.shape[1], length, head_dim) and g.dtype == dtype
        assert close(g, w)
    L = length
    alone = rows_alone(lambda a, b: attn_input.attention_input(
        x[a:b], *args, positions.reshape(-1, 1)[a:b], *rest), batch * L)
    for i, row in enumerate(alone):
        for g, r in zip(got, row):
            if g is not None:
                assert mx.array_equal(g[i // L, :, i % L], r[0, :, 0]), i
    other = mx.concatenate([x[:1], x[1:] * 3 + 1])
    assert all(g is None or mx.array_equal(o[0, :, 0], g[0, :, 0]) for g, o in
               zip(got, attn_input.attention_input(other, *args, positions, *rest)))


@emulated
@pytest.mark.parametrize("dtype,bits,joined,norm,rows", [
    (BF16, 4, True, True, (2, 9)),   # the joined weight (gate rows, then up rows), two tiles
    (F16, 8, False, False, (3,)),   # two layers, no norm
])
def test_mlp_input_matches_its_reference_and_every_row_is_its_own(emulator, dtype, bits, joined, norm, rows):
    K, inter = 192, 48
    gate, up = (linear(2 * inter, K, bits, 64, dtype, seed=6), None) if joined else \
        (linear(inter, K, bits, 64, dtype, seed=6), linear(inter, K, bits, 64, dtype, seed=7))
    norm_w = normal((K,), 8, dtype, 0.3) + 1 if norm else None
    x = normal((max(rows), K), 9, dtype, 3.0)
    for m in rows:
        got = ffn.dense(x[:m], norm_w, gate, up, EPS)
        assert got.shape == (m, inter) and close(got, ffn.reference_dense(x[:m], norm_w, gate, up, EPS))
        alone = mx.concatenate(rows_alone(lambda a, b: ffn.dense(x[a:b], norm_w, gate, up, EPS), m))
        assert mx.array_equal(got, alone)


@emulated
def test_experts_input_reads_each_expert_once_and_a_token_is_its_own_whoever_shares_its_experts(emulator):
    glu = switch_glu(6, 64, 32, 4, group=32)
    norm_w = normal((64,), 10, BF16, 0.3) + 1
    x = normal((5, 64), 11, BF16, 3.0)
    idx = mx.array([[0, 3], [3, 1], [0, 5], [2, 3], [4, 0]], dtype=mx.int32)  # experts 0 and 3: three rows each
    ids = idx.reshape(-1)
    run = lambda xs, i: ffn.experts(xs, norm_w, i.reshape(-1), 2, glu.gate_proj, glu.up_proj, EPS)  # noqa
    got = run(x, idx)
    want = ffn.reference_experts(x, norm_w, ids, 2, glu.gate_proj, glu.up_proj, EPS)
    assert got.shape == (10, 32) and close(got, want)
    assert mx.array_equal(got, mx.concatenate(rows_alone(lambda a, b: run(x[a:b], idx[a:b]), 5)))


@emulated
def test_residual_glue_matches_its_reference_row_by_row(emulator):
    M, H = 3, 320
    x, y, y2 = (normal((M, H), s, BF16, 2.0) for s in (12, 13, 14))
    w, w1, w2, w_next = (normal((H,), s, BF16, 0.3) + 1 for s in (15, 16, 17, 18))
    scalar = mx.array([0.5], dtype=BF16)
    plain = glue.residual(x, y, w, EPS)
    assert close(plain, glue.reference(x, y, w, EPS), 1e-2)
    moe = dict(scalar=scalar, second=(w1, y2, w2), w_next=w_next)
    h, hn = glue.residual(x, y, w, EPS, **moe)
    want_h, want_hn = glue.reference(x, y, w, EPS, **moe)
    assert close(h, want_h, 1e-2) and close(hn, want_hn, 1e-2)
    h1, hn1 = glue.residual(x[1:2], y[1:2], w, EPS, scalar=scalar, second=(w1, y2[1:2], w2), w_next=w_next)
    assert mx.array_equal(h1, h[1:2]) and mx.array_equal(hn1, hn[1:2])


@emulated
def test_router_matches_its_reference_breaks_ties_by_expert_and_every_row_is_its_own(emulator):
    """48 experts (three blocks of 16: the last block done picks), 4 of them per row, 9 rows (two tiles);
    experts 5 and 30 have the same weights, and every row leans towards them: a tie, 5 first."""
    H, E, k = 192, 48, 4
    lean = normal((H,), 40, F32)
    w = mx.random.normal((E, H), key=mx.random.key(41)) / H**0.5
    w = mx.concatenate([w[:5], lean[None] / 4, w[6:30], lean[None] / 4, w[31:]])
    lin = nn.Linear(H, E, bias=False)
    lin.weight = w.astype(BF16)
    proj = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=8)
    proj.__class__ = QuantizedLinear
    scale, per_expert = normal((H,), 42, BF16, 0.2) + 1, normal((E,), 43, BF16, 0.2) + 1
    x = (normal((9, H), 44, F32, 2.0) + 2 * lean).astype(BF16)
    ids, weights = routing.router(x, scale, proj, per_expert, k, EPS)
    want_ids, want_weights = routing.reference(x, scale, proj, per_expert, k, EPS)
    assert ids.shape == weights.shape == (9, k) and ids.dtype == mx.int32 and weights.dtype == F32
    assert mx.array_equal(ids, want_ids) and close(weights, want_weights, 1e-2)
    assert all(row[:2] == [5, 30] for row in ids.tolist())  # tied: the lower expert first
    assert len(set(ids[:, 2:].reshape(-1).tolist())) > 3  # the rest differ from row to row
    for i in range(9):
        alone = routing.router(x[i : i + 1], scale, proj, per_expert, k, EPS)
        assert all(mx.array_equal(a[0], b[i]) for a, b in zip(alone, (ids, weights))), i
    other = routing.router(mx.concatenate([x[:1], x[1:] * 3 + 1]), scale, proj, per_expert, k, EPS)
    assert mx.array_equal(other[0][0], ids[0]) and mx.array_equal(other[1][0], weights[0])


@emulated
def test_the_glue_sums_the_experts_outputs_with_their_weights_row_by_row(emulator):
    M, k, H = 3, 4, 256
    x, y = (normal((M, H), s, BF16, 2.0) for s in (45, 46))
    y2 = normal((M, k, H), 47, BF16, 2.0)
    route = mx.softmax(normal((M, k), 48, F32), axis=-1)
    w, w1, w2 = (normal((H,), s, BF16, 0.3) + 1 for s in (49, 50, 51))
    scalar = mx.array([0.5], dtype=BF16)
    h = glue.residual(x, y, w, EPS, scalar, (w1, y2, w2), route=route)
    assert h.shape == (M, H) and close(h, glue.reference(x, y, w, EPS, scalar, (w1, y2, w2), route=route), 1e-2)
    for i in range(M):
        one = glue.residual(x[i : i + 1], y[i : i + 1], w, EPS, scalar, (w1, y2[i : i + 1], w2), route=route[i : i + 1])
        assert mx.array_equal(one, h[i : i + 1]), i
    unweighted = glue.residual(x, y, w, EPS, scalar, (w1, y2[:, 0], w2))  # the weights do count
    assert not mx.array_equal(unweighted, h)


# ---- the references are the model's math (its modules on MLX's ops, all in float32, so that only a ----------
# ---- difference of math, not of rounding, shows) -------------------------------------------------------------
F32 = mx.float32


def attention_layer(k_eq_v: bool, layer: int):
    from mlx_mtp.models import gemma4

    cfg = gemma4.Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                        global_head_dim=128, attention_k_eq_v=k_eq_v, num_global_key_value_heads=1,
                        num_hidden_layers=6, intermediate_size=64, hidden_size_per_layer_input=0)
    attn = gemma4.Attention(cfg, layer)
    for name in ("q_norm", "k_norm"):
        getattr(attn, name).weight = normal((attn.head_dim,), 20 + layer, scale=0.3).astype(mx.float32) + 1
    nn.quantize(attn, group_size=64, bits=4)
    attn.set_dtype(F32)
    mx.eval(attn.parameters())
    return cfg, attn


def rows(layer, a, b):
    """Output rows a..b-1 of a quantized layer (a joined gate/up's gate or up) as a layer of their own."""
    out = QuantizedLinear(layer.weight.shape[1] * 32 // layer.bits, 16, bias=False,
                          group_size=layer.group_size, bits=layer.bits)
    for name in ("weight", "scales", "biases"):
        out[name] = layer[name][a:b]
    return out


@pytest.mark.parametrize("k_eq_v,layer", [(False, 0), (True, 5)])  # sliding (default RoPE), full (partial RoPE)
def test_the_attention_input_reference_is_the_models_projection_norms_and_rope(k_eq_v, layer):
    from mlx_mtp.cache.kv import Step
    from mlx_mtp.models.base import force_fused, rms_norm

    cfg, attn = attention_layer(k_eq_v, layer)
    B, L = 2, 3
    x = normal((B * L, cfg.hidden_size), 21, F32, 3.0)
    norm_w = normal((cfg.hidden_size,), 22, F32, 0.3) + 1
    positions = (mx.array([[5], [70]]) + mx.arange(L)).astype(mx.int32)
    step = Step(positions=positions, offset=positions[:, 0], masks={}, writes={}, scratch={})
    with force_fused(True):
        q, k, v = attn._rotate(*attn._project(rms_norm(x, norm_w, cfg.rms_norm_eps), B, L, True), step)
    kv = 1 if attn.k_eq_v else 2
    want = attn_input.reference(x, norm_w, attn.qkv_proj, attn.q_norm.weight, attn.k_norm.weight, positions,
                                attn.rope.pairs, attn.n_heads, attn.head_dim, kv, cfg.rms_norm_eps)
    for got, ref in zip((q, k, v), want):
        assert got.shape == ref.shape and close(got, ref, 1e-4)


def test_the_mlp_and_residual_references_are_the_models_math():
    from mlx_mtp.models import gemma4
    from mlx_mtp.models.base import force_fused, rms_norm

    mlp = gemma4.MLP(96, 64)
    nn.quantize(mlp, group_size=32, bits=4)
    mlp.set_dtype(F32)
    x, y, y2 = (normal((3, 96), s, F32, 2.0) for s in (23, 24, 25))
    w, w1, w2, w_next = (normal((96,), s, F32, 0.3) + 1 for s in (26, 27, 28, 29))
    scalar = mx.array([0.7])
    with force_fused(True):
        glu = gemma4.gelu_tanh_glu(*mx.split(mlp.gate_up_proj(rms_norm(x, w, 1e-6)), 2, axis=-1))
        f = rms_norm(y, w1, 1e-6) + rms_norm(y2, w2, 1e-6)
        h = (x + rms_norm(f, w, 1e-6)) * scalar
        hn = rms_norm(h, w_next, 1e-6)
    gate, up = (rows(mlp.gate_up_proj, a, a + 64) for a in (0, 64))
    assert close(glu, ffn.reference_dense(x, w, mlp.gate_up_proj, None, 1e-6), 1e-4)
    assert close(glu, ffn.reference_dense(x, w, gate, up, 1e-6), 1e-4)
    want_h, want_hn = glue.reference(x, y, w, 1e-6, scalar, (w1, y2, w2), w_next)
    assert close(h, want_h, 1e-5) and close(hn, want_hn, 1e-5)


def test_the_router_and_weighted_sum_references_are_the_models_math():
    """The router's reference against `moe.Router` in float32 (MLX's argpartition gives the experts in no
    set order: compared by expert), and the glue's weighted sum against `moe.weighted`."""
    from mlx_mtp.models import moe
    from mlx_mtp.models.base import force_fused, rms_norm

    cfg = type("Config", (), dict(hidden_size=128, num_experts=32, top_k_experts=4, rms_norm_eps=1e-6))
    layer = moe.Router(cfg)
    layer.scale, layer.per_expert_scale = normal((128,), 52, F32, 0.3) + 1, normal((32,), 53, F32, 0.3) + 1
    nn.quantize(layer, group_size=64, bits=8)
    x = normal((5, 128), 54, F32, 2.0)
    for fused in (False, True):
        with force_fused(fused):
            idx, weights = layer(x)
        want_ids, want_weights = routing.reference(x, layer.scale, layer.proj, layer.per_expert_scale, 4, 1e-6)
        order = mx.argsort(idx, axis=-1)
        assert mx.array_equal(mx.take_along_axis(idx, order, axis=-1).astype(mx.int32), mx.sort(want_ids, axis=-1))
        want = mx.take_along_axis(want_weights, mx.argsort(want_ids, axis=-1), axis=-1)
        assert close(mx.take_along_axis(weights, order, axis=-1), want, 1e-5)
    y, y2, w, w1, w2 = normal((5, 128), 55, F32), normal((5, 4, 128), 56, F32), *(normal((128,), s, F32) for s in (57, 58, 59))
    with force_fused(True):
        h = x + rms_norm(rms_norm(y, w1, 1e-6) + rms_norm(moe.weighted(y2, weights), w2, 1e-6), w, 1e-6)
    assert close(h, glue.reference(x, y, w, 1e-6, None, (w1, y2, w2), route=weights), 1e-5)


# ---- dispatch on a faked CUDA device ---------------------------------------------------------------------------


def test_the_fused_entry_points_take_steps_leave_prompts_and_the_switch_to_mlx(monkeypatch):
    from mlx_mtp import kernels
    from mlx_mtp.kernels import dispatch

    monkeypatch.setattr(dispatch, "cuda", lambda: True)
    monkeypatch.setattr(attn_input, "attention_input", lambda *a: ("ours",))
    monkeypatch.setattr(ffn, "dense", lambda *a: mx.zeros((a[0].shape[0], 8)))
    monkeypatch.setattr(glue, "residual", lambda *a: "ours")
    dispatch.decisions.clear()
    qkv, gate_up = linear(3 * 64, 128), linear(32, 128)
    norm_w, head_w = mx.ones((128,), BF16), mx.ones((64,), BF16)
    inverse = mx.zeros((32,), mx.float32)
    step, prompt = normal((4, 128), 30), normal((qmm.MAX_ROWS + 1, 128), 31)
    args = (norm_w, qkv, head_w, head_w, mx.zeros((1, 4), mx.int32), inverse, 1, 64, 2, EPS)
    assert kernels.attention_input(step, *args) == ("ours",)
    assert kernels.attention_input(prompt, *args) is None
    assert kernels.mlp_input(step, norm_w, gate_up).shape == (4, 8)
    assert kernels.residual(step, step, norm_w, EPS) == "ours"
    assert kernels.residual(step, step, norm_w, EPS, scalar=mx.ones((1,))) is None  # float32: MLX's would promote
    experts = (norm_w, mx.zeros((4, 2, 128), BF16), norm_w)
    assert kernels.residual(step, step, norm_w, EPS, second=experts, route=mx.ones((4, 2))) == "ours"
    assert kernels.residual(step, step, norm_w, EPS, second=experts, route=mx.ones((4, 2), BF16)) is None
    proj, expert_scale = linear(16, 128, bits=8), mx.ones((16,), BF16)
    monkeypatch.setattr(routing, "router", lambda *a: "ours")
    assert kernels.router(step, norm_w, proj, expert_scale, 2, EPS) == "ours"
    assert kernels.router(prompt, norm_w, proj, expert_scale, 2, EPS) is None
    assert kernels.router(step, norm_w, proj, expert_scale, 17, EPS) is None  # more than its experts
    with kernels.using("mlx"):
        assert kernels.attention_input(step, *args) is None and kernels.mlp_input(step, norm_w, gate_up) is None
        assert kernels.residual(step, step, norm_w, EPS) is None
        assert kernels.router(step, norm_w, proj, expert_scale, 2, EPS) is None
    assert dispatch.decisions[("router", "MLX's (top 17 of 16 experts)")] == 1
    assert dispatch.decisions[("attention input", dispatch.OURS)] == 1
    assert dispatch.decisions[("attention input", f"MLX's ({qmm.MAX_ROWS + 1} rows)")] == 1
    assert dispatch.decisions[("MLP input", "MLX's (MLX_MTP_KERNELS=mlx)")] == 1
    assert "residual: " in dispatch.summary()
    dispatch.decisions.clear()
