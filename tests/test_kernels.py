"""mlx_mtp's CUDA kernels without a GPU: every source compiled by NVRTC for the GPUs MLX's CUDA build
runs on, the fp32 references they are held to checked against MLX's own kernels on the CPU, and the
dispatch (which product takes which kernel, and the switch back to MLX's) on a faked CUDA device.
tests/test_kernels_emulated.py runs the kernels themselves on the CPU."""

import platform

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from apps.bench.kernels import switch_glu
from mlx_mtp import kernels
from mlx_mtp.kernels import dispatch, nvrtc, qmm, sdpa
from mlx_mtp.models.base import force_fused
from mlx_mtp.models.quantized import QuantizedLinear

BF16, F16 = mx.bfloat16, mx.float16
LINUX_X86 = platform.system() == "Linux" and platform.machine() == "x86_64"


def dense_variant(dtype, bits, group, mt, nw, depth=qmm.DEPTH):
    return qmm._DENSE, [dtype, mx.uint32, dtype, dtype], [dtype], [("T", dtype), ("BITS", bits), ("GROUP", group),
                                                                   ("MT", mt), ("NW", nw), ("DEPTH", depth)]


def experts_variant(dtype, bits, mt, glu):
    return (qmm._EXPERTS, [dtype, mx.int32] + [mx.uint32, dtype, dtype] * 2, [dtype],
            [("T", dtype), ("BITS", bits), ("GROUP", 64), ("MT", mt), ("NW", 8), ("DEPTH", qmm.DEPTH),
             ("XDIV", 8 if glu else 1), ("GLU", glu)])


def attention_variant(dtype, d, mask, single):
    return (sdpa._SPLIT, [dtype] * 3 + [mx.bool_], [dtype, mx.float32, mx.float32],
            [("T", dtype), ("D", d), ("SPLIT", sdpa.split(d)), ("ROWS", 8), ("MASK", mask), ("SINGLE", single)])


VARIANTS = [
    dense_variant(BF16, 4, 64, 1, 8), dense_variant(BF16, 4, 32, 8, 8, 3), dense_variant(BF16, 8, 64, 2, 4, 1),
    dense_variant(F16, 4, 128, 4, 1), dense_variant(F16, 8, 32, 1, 2), dense_variant(BF16, 8, 64, 8, 8, 3),
    experts_variant(BF16, 4, 1, True), experts_variant(BF16, 4, 8, False), experts_variant(F16, 8, 2, True),
    attention_variant(BF16, 256, True, True), attention_variant(BF16, 512, True, False),
    attention_variant(F16, 64, False, False), attention_variant(F16, 128, True, True),
    (sdpa._COMBINE, [mx.float32] * 2, [BF16], [("T", BF16), ("D", 512)]),
]


@pytest.mark.skipif(not LINUX_X86, reason="NVRTC's pip wheels are for Linux x86-64")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_kernel_compiles_for_hopper_and_ampere_without_spilling(arch):
    assert nvrtc.available(), "the test extra installs nvidia-cuda-nvrtc and nvidia-cuda-runtime"
    for kernel, ins, outs, template in VARIANTS:
        _, log = nvrtc.compile_source(kernel.full_source(ins, outs, template), arch, name=kernel.name, verbose=True)
        assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, (kernel.name, template, log)


def test_a_typo_in_a_kernel_fails_to_compile():
    if not nvrtc.available():
        pytest.skip("no NVRTC")
    kernel, ins, outs, template = VARIANTS[0]
    source = kernel.full_source(ins, outs, template).replace("mtp_mma<T>(acc[mt], a, b)", "mtp_mma<T>(acc[mt], a)")
    with pytest.raises(nvrtc.CompileError, match="mtp_mma"):
        nvrtc.compile_source(source, "sm_90a")


# ---- the references, against MLX's own kernels on the CPU ------------------------------------------------


def quantized(n, k, bits, group, dtype, seed=0):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) / k**0.5
    return mx.quantize(w, group_size=group, bits=bits), dtype


@pytest.mark.parametrize("bits,group,dtype", [(4, 64, BF16), (8, 32, F16), (4, 128, BF16)])
def test_the_dense_reference_is_mlx_quantized_matmul_to_rounding(bits, group, dtype):
    (w, s, b), _ = quantized(48, 256, bits, group, dtype)
    s, b = s.astype(dtype), b.astype(dtype)
    x = mx.random.normal((5, 256), key=mx.random.key(1)).astype(dtype)
    want = mx.quantized_matmul(x.astype(mx.float32), w, s.astype(mx.float32), b.astype(mx.float32), True, group, bits)
    got = qmm.reference_dense(x, w, s, b, group, bits).astype(mx.float32)
    assert mx.max(mx.abs(got - want)) / mx.max(mx.abs(want)) < 2e-2  # the weights rounded to bf16/fp16


def test_the_attention_reference_is_mlx_sdpa_to_rounding():
    key = mx.random.key(2)
    q = mx.random.normal((2, 4, 3, 64), key=key)
    k, v = mx.random.normal((2, 2, 2, 40, 64), key=mx.random.key(3))
    mask = mx.random.uniform(shape=(2, 1, 3, 40), key=key) < 0.7
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)
    assert mx.allclose(sdpa.reference(q, k, v, mask), want, atol=1e-5)


def test_the_experts_reference_is_the_switch_glu_to_rounding():
    glu = switch_glu(4, 64, 32, 4, group=32)
    x = mx.random.normal((3, 64), key=mx.random.key(4)).astype(BF16)
    idx = mx.array([[0, 2], [1, 2], [3, 0]])
    want = glu(x, idx).astype(mx.float32)
    h = qmm.reference_experts(x, idx.reshape(-1), glu.gate_proj, 2, glu=True, second=glu.up_proj)
    got = qmm.reference_experts(h, idx.reshape(-1), glu.down_proj, 1).reshape(3, 2, -1).astype(mx.float32)
    assert mx.max(mx.abs(got - want)) / mx.max(mx.abs(want)) < 3e-2


def test_launch_shapes_follow_the_weight_never_the_rows():
    """The warps that split K (and so the order partial sums are added in) depend on (N, K) alone."""
    assert qmm.warps(5376, 5376, 4) == 8 and qmm.warps(262144, 5376, 4) == 1
    assert all(1 <= qmm.warps(n, k, b) <= qmm.MAX_WARPS for n in (16, 704, 2112, 8192) for k in (64, 2816, 21504)
               for b in (4, 8))
    assert sdpa.split(256) == 256 and sdpa.split(512) == 128


# ---- dispatch on a faked CUDA device -------------------------------------------------------------------------


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(dispatch, "cuda", lambda: True)
    dispatch.decisions.clear()
    yield
    dispatch.decisions.clear()


def layer(n=32, k=64, bits=4, group=32, dtype=BF16):
    lin = nn.Linear(k, n, bias=False)
    lin.set_dtype(dtype)
    q = nn.QuantizedLinear.from_linear(lin, group_size=group, bits=bits)
    q.__class__ = QuantizedLinear
    return q


def test_decode_and_verify_products_take_ours_and_prompt_chunks_mlxs(cuda):
    q = layer()
    assert dispatch.quantized(1, BF16, q) == "" and dispatch.quantized(qmm.MAX_ROWS, BF16, q) == ""
    assert dispatch.quantized(qmm.MAX_ROWS + 1, BF16, q) == f"{qmm.MAX_ROWS + 1} rows"
    assert dispatch.quantized(0, BF16, q) == "0 rows"
    assert dispatch.quantized(4, mx.float32, q) == "float32 activations with bfloat16 scales"
    assert dispatch.quantized(4, BF16, layer(n=24)) == "24 output features (not a multiple of 16)"
    with kernels.using("mlx"):
        assert dispatch.quantized(1, BF16, q) == "MLX_MTP_KERNELS=mlx"
    assert dispatch.decisions[("quantized matmul", "mlx_mtp")] == 2
    summary = dispatch.summary()
    assert summary.startswith("quantized matmul: ") and "mlx_mtp x2" in summary
    assert f"MLX's ({qmm.MAX_ROWS + 1} rows) x1" in summary


def test_the_switch_reads_the_environment(monkeypatch, cuda):
    monkeypatch.setenv(dispatch.SWITCH, "mlx")
    assert kernels.mode() == "mlx" and dispatch.quantized(1, BF16, layer()) == "MLX_MTP_KERNELS=mlx"
    monkeypatch.setenv(dispatch.SWITCH, "metal")
    with pytest.raises(ValueError, match="MLX_MTP_KERNELS must be one of auto, mlx"):
        kernels.mode()


def test_experts_and_attention_dispatch(cuda):
    glu = switch_glu(4, 64, 32, 4, group=32)
    assert dispatch.experts(8, 8, BF16, glu) == "" and dispatch.experts(65, 8, BF16, glu) == "65 tokens"
    plain = SwitchGLU(64, 32, 4)
    nn.quantize(plain, group_size=32, bits=4)
    assert dispatch.experts(1, 2, BF16, plain).startswith("activation")
    q = mx.zeros((1, 8, 7, 256), BF16)
    kv = mx.zeros((1, 2, 300, 256), BF16)
    mask = mx.ones((1, 1, 7, 300), mx.bool_)
    assert dispatch.attention(q, kv, kv, mask, 1.0) == "" and dispatch.attention(q, kv, kv, None, 1.0) == ""
    assert dispatch.attention(mx.zeros((1, 8, 512, 256), BF16), kv, kv, None, 1.0) == ""  # a prompt chunk
    small = mx.zeros((1, 2, 300, 128), BF16)
    assert dispatch.attention(mx.zeros((1, 8, 9, 128), BF16), small, small, None, 1.0) == \
        "9 query positions over 300 slots at head_dim 128"  # cuDNN takes these
    assert dispatch.attention(q, kv, kv, mask[:, :, :, :10], 1.0).startswith("a bool mask")


def test_off_cuda_nothing_changes_and_nothing_is_counted():
    q = layer()
    x = mx.random.normal((3, 64)).astype(BF16)
    with force_fused(True):
        assert mx.array_equal(q(x), mx.quantized_matmul(x, q.weight, q.scales, q.biases, True, 32, 4))
    assert not dispatch.decisions


def test_a_quantized_layer_on_cuda_calls_our_kernel_for_a_step_and_mlxs_for_a_prompt(cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(qmm, "dense", lambda x, w, s, b, g, bits: calls.append(x.shape) or
                        qmm.reference_dense(x, w, s, b, g, bits))
    q = layer()
    with force_fused(True):
        step = q(mx.random.normal((2, 3, 64)).astype(BF16))
        q(mx.random.normal((1, qmm.MAX_ROWS + 1, 64)).astype(BF16))
    assert calls == [(6, 64)] and step.shape == (2, 3, 32)


def test_a_prompt_chunks_experts_go_by_expert_on_cuda(cuda):
    """More tokens than a decode step's: one product per used expert over its rows (MLX's gather_qmm
    re-reads an expert per pair, and past 8,192 tokens x top-8 launches past CUDA's grid limit)."""
    from mlx_mtp.models.quantized import switch_glu as forward

    glu = switch_glu(16, 64, 32, 4, group=32)
    tokens = qmm.MAX_ROWS + 6
    x = mx.random.normal((tokens, 64), key=mx.random.key(5)).astype(BF16)
    idx = mx.argsort(mx.random.uniform(shape=(tokens, 16), key=mx.random.key(6)), axis=-1)[:, :2].astype(mx.int32)
    with force_fused(True):
        got = forward(glu, x, idx)
    want = glu(x, idx)
    assert got.shape == want.shape == (tokens, 2, 64)
    assert mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))) / mx.max(mx.abs(want)) < 2e-2
    assert dispatch.decisions[("MoE experts by expert (prompt)", dispatch.OURS)] == 1
