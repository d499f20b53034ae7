// An attention layer's input in one kernel (issue 42): the input RMSNorm, q/k/v as one product over
// their joined quantized weight (rows: HQ query heads, then the K/V heads' k, then their v unless
// KV < 2), the per-head norms (q and k with their weights, v without) and RoPE on q and k, written
// head-major, (B, heads, L, D), as attention reads them.
//
// The product is proj.cuh's (blocks of 16 weight rows, the warps splitting K): every row computed as
// if alone. A head's norm needs all D of its columns, which D / 16 blocks compute: each block writes
// its columns (rounded to T, as the projection's output) to `part` and counts itself done in
// `done[head]`; the block that completes a head (the last to count) normalises and rotates it. Which
// block is last changes nothing: every value it reads was computed the same way.
// Needs qmm.cuh and proj.cuh.
#pragma once

// Rows x (M, K) with M = B * L (positions (B, L)); w: (N, K * BITS / 32), N = (HQ + KV_SETS * HKV) * D.
// KV: 0 (q only: a layer reading another's K/V), 1 (k only: v is k before its norm), 2 (k and v).
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH, int D, int HQ, int KV>
MTP_DEVICE void mtp_attention_input(const T* x, const T* norm_w, const uint32_t* w, const T* scales, const T* biases,
                                    const T* q_norm, const T* k_norm, const int32_t* positions, const float* inverse,
                                    T* q, T* k, T* v, float* part, int32_t* done, int M, int N, int K, int L,
                                    float eps) {
  constexpr int C = D / 32;  // a head's values per lane in the epilogue
  __shared__ float red[NW * 128];
  __shared__ float inv[MT * 8];
  __shared__ int last;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * 16;
  mtp_normed_part<T, BITS, GROUP, MT, NW, DEPTH>(red, inv, x, norm_w, w, scales, biases, part, M, N, K, n0, eps, 1.0f,
                                                 warp, lane);
  // The block that completes its head goes on; the others are done.
  const int head = n0 / D;
  ::mtp_fence();
  __syncthreads();
  if (threadIdx.x == 0) last = ::mtp_atomic_add(done + head, 1) == D / 16 - 1;
  __syncthreads();
  if (!last) return;
  ::mtp_fence();
  const int hkv = (N / D - HQ) / (KV == 2 ? 2 : 1);
  const bool is_q = head < HQ, is_v = head >= HQ + hkv;
  const int h = is_q ? head : is_v ? head - HQ - hkv : head - HQ;
  const int heads = is_q ? HQ : hkv;
  for (int m = warp; m < M; m += NW) {  // a warp per row; lane holds columns lane + 32c
    const size_t out = (((size_t)(m / L) * heads + h) * L + m % L) * D;
    float val[C];
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      val[c] = ::mtp_load_coherent(part + (size_t)m * N + (size_t)head * D + lane + 32 * c);
      s += val[c] * val[c];
    }
#pragma unroll
    for (int o = 1; o < 32; o *= 2) s += ::mtp_shfl_xor(s, o);
    const float r = ::mtp_rsqrt(s / (float)D + eps);
    if (is_v || KV == 1 && !is_q) {  // v: the norm without a weight (for KV == 1, of k's values)
#pragma unroll
      for (int c = 0; c < C; ++c) v[out + lane + 32 * c] = ::mtp_from_float<T>(val[c] * r);
    }
    if (is_v) continue;
    const T* nw = is_q ? q_norm : k_norm;
    T* dst = is_q ? q : k;
    float y[C];
#pragma unroll
    for (int c = 0; c < C; ++c)
      y[c] = ::mtp_to_float(::mtp_from_float<T>(val[c] * r * ::mtp_to_float(nw[lane + 32 * c])));
    const float pos = (float)positions[m];
#pragma unroll
    for (int c = 0; c < C / 2; ++c) {  // RoPE's pairs (i, i + D/2), both in this lane
      const int i = lane + 32 * c;
      float sn, cs;
      ::mtp_sincos(pos * inverse[i], &sn, &cs);
      const float a = y[c], b = y[c + C / 2];
      dst[out + i] = ::mtp_from_float<T>(a * cs - b * sn);
      dst[out + i + D / 2] = ::mtp_from_float<T>(b * cs + a * sn);
    }
  }
}
