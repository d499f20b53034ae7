"""The CPU emulator of `mx.fast.cuda_kernel` (tests/cuda_emu) on small kernels: launch geometry and
built-ins, warp collectives, barriers, tensor-core fragments, 16-bit rounding, sanitizer reports and
dynamic shared memory. Compiling is the slow part, so each kernel below is shared by several checks."""

import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import cuda_emu
from cuda_emu import CudaEmuError, cuda_kernel

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="the CUDA emulator needs g++")

PRELUDE = (Path(__file__).parents[1] / "mlx_mtp" / "kernels" / "prelude.cuh").read_text()
rng = np.random.default_rng(0)


def f32(a) -> np.ndarray:
    return np.array(a, dtype=np.float32)


# ---- (a) launch geometry and built-ins; (f) out-of-bounds writes -------------------------------------
ELEMENTWISE = cuda_kernel("elementwise", ["x"], ["y", "ids", "even"], header=PRELUDE, source="""
  // A 2-D grid over x's (rows, cols); the last blocks overhang the edges.
  const int col = blockIdx.x * blockDim.x + threadIdx.x, row = blockIdx.y * blockDim.y + threadIdx.y;
  if (row >= x_shape[0] || col >= x_shape[1]) return;
  const int i = row * x_shape[1] + col;
  y[i] = 2.f * x[i];
  ids[4 * i + 0] = threadIdx.x + 100 * threadIdx.y;
  ids[4 * i + 1] = blockIdx.x + 100 * blockIdx.y;
  ids[4 * i + 2] = blockDim.x + 100 * blockDim.y + 10000 * blockDim.z;
  ids[4 * i + 3] = gridDim.x + 100 * gridDim.y + 10000 * gridDim.z;
  if (col % 2 == 0) even[i] = x[i];
""")


def elementwise(x, threadgroup, init_value=None, y_size=None):
    rows, cols = x.shape
    return ELEMENTWISE(inputs=[x], output_shapes=[(y_size or rows * cols,), (rows, cols, 4), (rows, cols)],
                       output_dtypes=[mx.float32, mx.int32, mx.float32], grid=(cols, rows, 1),
                       threadgroup=threadgroup, init_value=init_value)


def expected_ids(rows, cols, block, grid):
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return np.stack([c % block[0] + 100 * (r % block[1]), c // block[0] + 100 * (r // block[1]),
                     np.full_like(r, block[0] + 100 * block[1] + 10000),
                     np.full_like(r, grid[0] + 100 * grid[1] + 10000)], axis=-1)


def test_elementwise_2d_grid_and_builtins():
    x = mx.array(rng.standard_normal((10, 21)).astype(np.float32))
    y, ids, even = elementwise(x, (8, 4, 1))
    np.testing.assert_array_equal(np.array(y), 2 * np.array(x).reshape(-1))
    np.testing.assert_array_equal(np.array(ids), expected_ids(10, 21, (8, 4), (3, 3)))
    even = np.array(even)
    np.testing.assert_array_equal(even[:, ::2], np.array(x)[:, ::2])
    assert np.isnan(even[:, 1::2]).all(), "unwritten outputs are poisoned"
    assert (np.array(elementwise(x, (8, 4, 1), init_value=-3)[2])[:, 1::2] == -3).all()


def test_block_is_clamped_to_the_grid():
    x = mx.array(rng.standard_normal((3, 5)).astype(np.float32))  # smaller than one threadgroup
    _, ids, _ = elementwise(x, (8, 4, 1))
    np.testing.assert_array_equal(np.array(ids), expected_ids(3, 5, (5, 3), (1, 1)))


def test_out_of_bounds_write_raises():
    x = mx.zeros((4, 8))
    with pytest.raises(CudaEmuError, match="heap-buffer-overflow"):
        elementwise(x, (8, 4, 1), y_size=4 * 8 - 1)


# ---- (b) warp collectives ----------------------------------------------------------------------------
WARP = cuda_kernel("warp", ["x", "rounds"], ["total", "bcast", "packed", "count"], header=PRELUDE, source="""
  const int t = threadIdx.x + threadIdx.y * blockDim.x;  // warps are runs of 32 linear indices
  const int g = blockIdx.y * blockDim.x * blockDim.y + t, lane = t % 32, warp = g / 32;
  const float v = x[g];
  float s = 0.f;
  for (int r = 0; r < rounds[0]; ++r) {
    s = v;
    for (int m = 16; m > 0; m >>= 1) s += ::mtp_shfl_xor(s, m);
  }
  total[g] = s;
  bcast[g] = ::mtp_shfl(v, 5 + 32 * 7);  // only the low 5 bits pick the lane
  const uint32_t keep = ::mtp_ballot(v > 0.f);
  if (v > 0.f) packed[32 * warp + ::mtp_popc(keep & ((1u << lane) - 1))] = v;
  if (lane == 0) count[warp] = ::mtp_popc(keep);
""")


def run_warp(x, threadgroup, rounds=1):
    n = x.size
    return WARP(inputs=[x, mx.array([rounds], dtype=mx.int32)],
                output_shapes=[(n,), (n,), (n,), (n // 32,)], output_dtypes=[mx.float32] * 3 + [mx.int32],
                grid=(threadgroup[0], n // threadgroup[0], 1), threadgroup=threadgroup)


def test_warp_shuffles_ballot_and_compaction():
    x = rng.integers(-50, 50, size=4 * 64).astype(np.float32)  # integers: sums are exact
    total, bcast, packed, count = (np.array(o) for o in run_warp(mx.array(x), (16, 4, 1)))
    warps = x.reshape(-1, 32)
    np.testing.assert_array_equal(total.reshape(-1, 32), np.repeat(warps.sum(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(bcast.reshape(-1, 32), np.repeat(warps[:, 5:6], 32, 1))
    np.testing.assert_array_equal(count, (warps > 0).sum(1))
    for w, row in enumerate(warps):
        kept = row[row > 0]
        np.testing.assert_array_equal(packed[32 * w: 32 * w + kept.size], kept)
        assert np.isnan(packed[32 * w + kept.size: 32 * (w + 1)]).all()


def test_collectives_are_fast():
    x = mx.array(rng.integers(-50, 50, size=8 * 256).astype(np.float32))
    run_warp(x[:512], (16, 16, 1))  # compiled (if needed) outside the timing
    start = time.perf_counter()
    total = run_warp(x, (16, 16, 1), rounds=60)[0]  # 8 blocks x 256 threads x 300 shuffles
    assert time.perf_counter() - start < 5
    np.testing.assert_array_equal(np.array(total).reshape(-1, 32)[:, 0], np.array(x).reshape(-1, 32).sum(1))


# ---- (c) __syncthreads and __shared__ -------------------------------------------------------------------
BLOCK_SUM = cuda_kernel("block_sum", ["x", "active"], ["sums"], header=PRELUDE, source="""
  __shared__ float partial[256];
  const int t = threadIdx.x;
  if (t >= active[0]) return;  // fewer than all threads at the barriers: a deadlock
  partial[t] = x[blockIdx.x * 256 + t];
  __syncthreads();
  for (int stride = 128; stride > 0; stride >>= 1) {
    if (t < stride) partial[t] += partial[t + stride];
    __syncthreads();
  }
  if (t == 0) sums[blockIdx.x] = partial[0];
""")


def block_sum(x, active=256):
    return BLOCK_SUM(inputs=[x, mx.array([active], dtype=mx.int32)], output_shapes=[(x.size // 256,)],
                     output_dtypes=[mx.float32], grid=(x.size, 1, 1), threadgroup=(256, 1, 1))[0]


def test_syncthreads_shared_reduction():
    x = rng.integers(-100, 100, size=5 * 256).astype(np.float32)
    np.testing.assert_array_equal(np.array(block_sum(mx.array(x))), x.reshape(5, 256).sum(1))


def test_barrier_missed_by_some_threads_is_a_deadlock():
    with pytest.raises(CudaEmuError, match="deadlock"):
        block_sum(mx.zeros((256,)), active=200)


# ---- (d) tensor-core fragments ----------------------------------------------------------------------------
MMA_HEADER = PRELUDE + """
// Gathers this lane's fragments of A (16 x 16) and B (16 x 8), both row-major in global memory, as
// documented for mtp_mma; runs d += A B twice and scatters d to D (16 x 8, row-major).
template <typename T>
MTP_DEVICE void mma_twice(const float* A, const float* B, float* D, int lane) {
  const int g = lane / 4, t = lane % 4;
  auto a2 = [&](int r, int c) { return ::mtp_pack2<T>(A[r * 16 + c], A[r * 16 + c + 1]); };
  auto b2 = [&](int k, int n) { return ::mtp_pack2<T>(B[k * 8 + n], B[(k + 1) * 8 + n]); };
  const uint32_t a[4] = {a2(g, 2 * t), a2(g + 8, 2 * t), a2(g, 2 * t + 8), a2(g + 8, 2 * t + 8)};
  const uint32_t b[2] = {b2(2 * t, g), b2(2 * t + 8, g)};
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  ::mtp_mma<T>(d, a, b);
  ::mtp_mma<T>(d, a, b);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}
"""
MMA = cuda_kernel("mma", ["a_bf", "b_bf", "a_h", "b_h"], ["d_bf", "d_h"], header=MMA_HEADER, source="""
  mma_twice<__nv_bfloat16>(a_bf, b_bf, d_bf, threadIdx.x);
  mma_twice<__half>(a_h, b_h, d_h, threadIdx.x);
""")


def test_mma_fragments_bf16_and_fp16():
    def representable(shape, dtype):  # so that packing loses nothing
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        return np.array(x.astype(dtype).astype(mx.float32))

    mats = [representable(s, t) for t in (mx.bfloat16, mx.float16) for s in ((16, 16), (16, 8))]
    d_bf, d_h = MMA(inputs=[mx.array(m) for m in mats], output_shapes=[(16, 8)] * 2,
                    output_dtypes=[mx.float32] * 2, grid=(32, 1, 1), threadgroup=(32, 1, 1))
    for d, (a, b) in ((d_bf, mats[:2]), (d_h, mats[2:])):
        np.testing.assert_allclose(np.array(d), a @ b * 2, rtol=1e-5, atol=1e-5)


# ---- (e) rounding of 16-bit conversions and packed arithmetic; byte permutes -------------------------
ROUNDING = cuda_kernel("rounding", ["f", "a_bf", "b_bf", "c_bf", "a_h", "b_h", "c_h", "sel"],
                       ["bf", "hf", "pack_bf", "fma_bf", "fma_h", "sub_bf", "sub_h", "prmt"], header=PRELUDE,
                       source="""
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= f_shape[0]) return;
  bf[i] = ::mtp_from_float<__nv_bfloat16>(f[i]);
  hf[i] = ::mtp_from_float<__half>(f[i]);
  pack_bf[i] = ::mtp_pack2<__nv_bfloat16>(f[i], -f[i]);
  fma_bf[i] = ::mtp_fma2<__nv_bfloat16>(a_bf[i], b_bf[i], c_bf[i]);
  fma_h[i] = ::mtp_fma2<__half>(a_h[i], b_h[i], c_h[i]);
  sub_bf[i] = ::mtp_sub2<__nv_bfloat16>(a_bf[i], c_bf[i]);
  sub_h[i] = ::mtp_sub2<__half>(a_h[i], c_h[i]);
  prmt[i] = ::mtp_prmt(a_bf[i], b_bf[i], sel[i]);
""")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of exact float64 values (normal bf16 range) to bf16 bits."""
    u = np.asarray(x, np.float64).view(np.uint64)
    drop = np.uint64(45)  # of float64's 52 mantissa bits, bf16 keeps 7
    u = (u + np.uint64((1 << 44) - 1) + ((u >> drop) & np.uint64(1))) >> drop << drop
    return (u.view(np.float64).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def f16_bits(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float16).view(np.uint16)  # numpy rounds once, to nearest even


def decode(bits: np.ndarray, fmt) -> np.ndarray:
    if fmt == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def tie_operands(n, digits):
    """a, b with a*b exactly halfway between two neighbours of the `digits`-bit format, and a tiny c:
    a*b + c rounds to the side of c's sign, but a*b + c rounded first to float32 is a tie instead."""
    p = np.arange(1 << (digits - 1), 1 << digits, dtype=np.int64)
    m = np.outer(p, p).reshape(-1)
    drop = np.floor(np.log2(m)).astype(np.int64) + 1 - digits
    ties = np.flatnonzero((m & ((1 << drop) - 1)) == (1 << (drop - 1)))
    pick = rng.choice(ties, n)
    a, b = p[pick // p.size] / 2.0 ** (digits - 1), p[pick % p.size] / 2.0 ** (digits - 1)
    tiny = 2.0 ** (-40 if digits == 8 else -24)
    return a * rng.choice([-1.0, 1.0], n), b, rng.choice([-1.0, 1.0], n) * tiny


def packed_operands(fmt, n):
    """n pairs of operands a, b, c (as float64 and packed in uint32s): the first half tie cases, the
    second general ones; a * b + c and a - c are exact in float64 for all of them."""
    digits, bits = (8, bf16_bits) if fmt == "bf16" else (11, f16_bits)
    ties = tie_operands(n, digits)
    general = [rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-e, e, n) for e in (4, 4, 6)]
    vals = [decode(bits(np.concatenate([t, g])), fmt) for t, g in zip(ties, general)]
    return vals, [bits(v).view(np.uint32) for v in vals]  # value 2i is the low half of element i


def test_rounding_conversions_and_single_rounded_fma():
    n = 512  # elements of every array; the packed ones hold 2n operands
    specials = f32([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.4028235e38, 3.3961776e38, np.inf, -np.inf,
                    np.nan, 0.0, -0.0, 2 ** -133 * 1.5, 2 ** -25, 3 * 2 ** -25, 65520.0, 65519.0, 1e-45])
    f = np.concatenate([specials, rng.standard_normal(n - specials.size).astype(np.float32) * 100])
    (a_bf, b_bf, c_bf), packed_bf = packed_operands("bf16", n)
    (a_h, b_h, c_h), packed_h = packed_operands("f16", n)
    sel = rng.integers(0, 8, size=(n, 4)) @ (16 ** np.arange(4))
    outs = ROUNDING(inputs=[mx.array(v) for v in (f, *packed_bf, *packed_h, sel.astype(np.uint32))],
                    output_shapes=[(n,)] * 8,
                    output_dtypes=[mx.bfloat16, mx.float16] + [mx.uint32] * 6,
                    grid=(n, 1, 1), threadgroup=(128, 1, 1))
    bf, hf, pack_bf, fma_bf, fma_h, sub_bf, sub_h, prmt = (
        np.array(o.view(mx.uint16) if o.dtype == mx.bfloat16 else o) for o in outs)
    u = f.view(np.uint32).astype(np.uint64)  # the classic float32 -> bf16 round-to-nearest-even
    ref_bf = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    np.testing.assert_array_equal(bf[~nan], ref_bf[~nan])
    with np.errstate(over="ignore"):  # overflowing to inf is the point
        ref_h = f.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(hf.view(np.uint16)[~nan], ref_h[~nan])
    assert np.isnan(decode(bf[nan], "bf16")).all() and np.isnan(hf[nan]).all()
    np.testing.assert_array_equal(pack_bf.view(np.uint16)[0::2][~nan], ref_bf[~nan])
    np.testing.assert_array_equal(pack_bf.view(np.uint16)[1::2][~nan], ref_bf[~nan] ^ 0x8000)

    for fmt, bits, (a, b, c), fma, sub in (("bf16", bf16_bits, (a_bf, b_bf, c_bf), fma_bf, sub_bf),
                                           ("f16", f16_bits, (a_h, b_h, c_h), fma_h, sub_h)):
        exact = a * b + c  # exact in float64 for these operands
        np.testing.assert_array_equal(fma.view(np.uint16), bits(exact), err_msg=f"{fmt} fma2")
        assert (bits(exact.astype(np.float32)) != bits(exact)).sum() >= n // 4, "the ties must tell"
        np.testing.assert_array_equal(sub.view(np.uint16), bits(a - c), err_msg=f"{fmt} sub2")

    pa, pb = packed_bf[0].astype(np.uint64), packed_bf[1].astype(np.uint64)
    both = pb << np.uint64(32) | pa
    ref = sum(((both >> np.uint64(8 * ((sel >> (4 * i)) & 7))) & np.uint64(0xFF)) << np.uint64(8 * i)
              for i in range(4))
    np.testing.assert_array_equal(prmt, ref.astype(np.uint32))


# ---- (g) dynamic shared memory -----------------------------------------------------------------------
DYNAMIC_SOURCE = """
  MTP_DYNAMIC_SHARED(float, buf);
  const int t = threadIdx.x, n = blockDim.x;
  buf[t] = x[blockIdx.x * n + t];
  __syncthreads();
  y[blockIdx.x * n + t] = buf[n - 1 - t];
  if (t == 0) garbage[blockIdx.x] = ::mtp_as_uint(buf[n]);  // one past what the threads wrote
"""


def run_dynamic(x, shared_floats):
    kernel = cuda_kernel("dynamic", ["x"], ["y", "garbage"], DYNAMIC_SOURCE, header=PRELUDE,
                         shared_memory=4 * shared_floats)
    return kernel(inputs=[x], output_shapes=[x.shape, (x.size // 64,)], output_dtypes=[mx.float32, mx.uint32],
                  grid=(x.size, 1, 1), threadgroup=(64, 1, 1))


def test_dynamic_shared_memory():
    x = rng.standard_normal(3 * 64).astype(np.float32)
    y, garbage = run_dynamic(mx.array(x), 65)
    np.testing.assert_array_equal(np.array(y), x.reshape(3, 64)[:, ::-1].reshape(-1))
    np.testing.assert_array_equal(np.array(garbage), [0xCDCDCDCD] * 3)
    with pytest.raises(CudaEmuError, match="heap-buffer-overflow"):
        run_dynamic(mx.array(x), 64)
