// An MoE layer's router in one kernel (issue 42): its RMSNorm (with the router's `scale` as the weight, in
// the prologue) and the 1/sqrt(H) factor, the expert scores as a quantized product, each rounded to T (the
// product's output), the top TOP_K of the E scores, a softmax over them and the per-expert scale.
//
// The product is proj.cuh's (blocks of 16 experts, the warps splitting K): every row computed as if alone.
// Each block writes its 16 scores of every row to `part` and counts itself done in `done`; the block that
// completes the last one (which one changes nothing: every score was computed the same way) picks each
// row's experts, a warp per row: TOP_K rounds of a warp-wide maximum (ties: the lower expert first), so
// the experts come in order of score; the softmax's sums in that order.
// Needs qmm.cuh and proj.cuh.
#pragma once

// x (M, K); w: (E, K * BITS / 32). ids, weights: (M, TOP_K), the experts and their weights (fp32).
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH, int E, int TOP_K>
MTP_DEVICE void mtp_router(const T* x, const T* scale, const uint32_t* w, const T* scales, const T* biases,
                           const T* per_expert, int32_t* ids, float* weights, float* part, int32_t* done, int M,
                           int K, float eps) {
  constexpr int C = (E + 31) / 32;  // a row's scores per lane in the epilogue
  __shared__ float red[NW * 128];
  __shared__ float inv[MT * 8];
  __shared__ int last;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * 16;
  mtp_normed_part<T, BITS, GROUP, MT, NW, DEPTH>(red, inv, x, scale, w, scales, biases, part, M, E, K, n0, eps,
                                                 ::mtp_rsqrt((float)K), warp, lane);
  ::mtp_fence();
  __syncthreads();
  if (threadIdx.x == 0) last = ::mtp_atomic_add(done, 1) == E / 16 - 1;
  __syncthreads();
  if (!last) return;
  ::mtp_fence();
  for (int m = warp; m < M; m += NW) {  // a warp per row; lane holds experts lane + 32c
    float s[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int e = lane + 32 * c;
      s[c] = e < E ? ::mtp_load_coherent(part + (size_t)m * E + e) : -::mtp_inf();
    }
    uint32_t taken = 0;  // bit c: this lane's expert lane + 32c is chosen
    float top[TOP_K];
    int pick[TOP_K];
#pragma unroll
    for (int j = 0; j < TOP_K; ++j) {
      float best = -::mtp_inf();
      int at = E;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int e = lane + 32 * c;
        if (e < E && !(taken >> c & 1u) && (s[c] > best || at == E)) best = s[c], at = e;
      }
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {  // the maximum, the lower expert on ties, in every lane
        const float b = ::mtp_shfl_xor(best, o);
        const int a = (int)::mtp_shfl_xor((float)at, o);
        if (b > best || (b == best && a < at)) best = b, at = a;
      }
      if (at % 32 == lane) taken |= 1u << (at / 32);
      top[j] = best, pick[j] = at;
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < TOP_K; ++j) sum += ::mtp_exp(top[j] - top[0]);
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < TOP_K; ++j) {
        ids[(size_t)m * TOP_K + j] = pick[j];
        weights[(size_t)m * TOP_K + j] = ::mtp_exp(top[j] - top[0]) / sum * ::mtp_to_float(per_expert[pick[j]]);
      }
    }
  }
}
