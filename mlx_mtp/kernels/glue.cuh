// A residual block's glue in one kernel (issue 42), one block per row (so every row is its own):
//   y = rms(y1) * w1 (+ rms(y2) * w2 when TWO: an MoE layer's dense and expert outputs, each normed;
//       with TOP_K, y2 is the sum of the row's TOP_K expert outputs, each times its weight in `route`)
//   h = (x + rms(y) * w) (* scalar when SCALAR)
//   hn = rms(h) * w_next (when NEXT: the next product's input norm, for a consumer without a prologue)
// each step rounded to T as MLX's separate ops round it; reductions in fp32 in a fixed order.
#pragma once

#define MTP_RESIDUAL_THREADS 256

// The sum over the block of each thread's v, the same value in every thread (warps added in order).
MTP_DEVICE float mtp_block_sum(float v, float* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) v += ::mtp_shfl_xor(v, o);
  __syncthreads();  // `red` may still be read by the previous sum
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < MTP_RESIDUAL_THREADS / 32; ++w) s += red[w];
  return s;
}

// row[i] := round(rms(row) * weight[i]) (weight nullptr: none) over H values.
template <typename T, int H>
MTP_DEVICE void mtp_norm_row(float* row, const T* weight, float eps, float* red) {
  float s = 0.0f;
  for (int i = threadIdx.x; i < H; i += MTP_RESIDUAL_THREADS) s += row[i] * row[i];
  const float r = ::mtp_rsqrt(mtp_block_sum(s, red) / (float)H + eps);
  for (int i = threadIdx.x; i < H; i += MTP_RESIDUAL_THREADS)
    row[i] = ::mtp_to_float(::mtp_from_float<T>(weight ? row[i] * r * ::mtp_to_float(weight[i]) : row[i] * r));
}

// row[i] := the sum of the row's TOP_K expert outputs y (TOP_K rows of H from `y`), each times its weight
// in `route` (fp32; rounded to T, the product too, as MLX's ops round them), added in fp32 in their order.
template <typename T, int H, int TOP_K>
MTP_DEVICE void mtp_weighted_row(float* row, const T* y, const float* route) {
  for (int i = threadIdx.x; i < H; i += MTP_RESIDUAL_THREADS) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < TOP_K; ++j) {
      const float r = ::mtp_to_float(::mtp_from_float<T>(route[j]));
      s += ::mtp_to_float(::mtp_from_float<T>(r * ::mtp_to_float(y[(size_t)j * H + i])));
    }
    row[i] = ::mtp_to_float(::mtp_from_float<T>(s));
  }
}

template <typename T, typename S, int H, bool TWO, int TOP_K, bool SCALAR, bool NEXT>
MTP_DEVICE void mtp_residual(const T* x, const T* y1, const T* w1, const T* y2, const float* route, const T* w2,
                             const T* w, const S* scalar, const T* w_next, T* h, T* hn, float eps) {
  __shared__ float a[H], b[H];
  __shared__ float red[MTP_RESIDUAL_THREADS / 32];
  const size_t base = (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += MTP_RESIDUAL_THREADS) a[i] = ::mtp_to_float(y1[base + i]);
  if constexpr (TWO) {
    if constexpr (TOP_K > 0)
      mtp_weighted_row<T, H, TOP_K>(b, y2 + base * TOP_K, route + (size_t)blockIdx.x * TOP_K);
    else
      for (int i = threadIdx.x; i < H; i += MTP_RESIDUAL_THREADS) b[i] = ::mtp_to_float(y2[base + i]);
    mtp_norm_row<T, H>(a, w1, eps, red);
    mtp_norm_row<T, H>(b, w2, eps, red);
    for (int i = threadIdx.x; i < H; i += MTP_RESIDUAL_THREADS)
      a[i] = ::mtp_to_float(::mtp_from_float<T>(a[i] + b[i]));
  }
  mtp_norm_row<T, H>(a, w, eps, red);
  for (int i = threadIdx.x; i < H; i += MTP_RESIDUAL_THREADS) {
    float v = ::mtp_to_float(::mtp_from_float<T>(::mtp_to_float(x[base + i]) + a[i]));
    if constexpr (SCALAR) v = ::mtp_to_float(::mtp_from_float<T>(v * ::mtp_to_float(scalar[0])));
    h[base + i] = ::mtp_from_float<T>(v);
    a[i] = v;  // each thread rewrites only its own entries
  }
  if constexpr (NEXT) {
    mtp_norm_row<T, H>(a, w_next, eps, red);
    for (int i = threadIdx.x; i < H; i += MTP_RESIDUAL_THREADS) hn[base + i] = ::mtp_from_float<T>(a[i]);
  }
}
