// A feed-forward block's input in one kernel (issue 42): the pre-feed-forward RMSNorm (NORM), gate and
// up in one pass over K (their rows share the x loads), and gelu_tanh(gate) * up, each product rounded
// to T first as separate matmuls' outputs are. For the dense MLP and for the MoE experts (each used
// expert's weights read once for all of its rows, as mtp_qmm_experts). Gate and up are one joined
// weight (JOINED: gate rows, then up rows) or two. Needs qmm.cuh and proj.cuh.
#pragma once

// The epilogue both kernels share: rows first .. first + MT * 8 - 1 (those below `limit`) of the
// block's 16 columns, gate and up sums reduced over the warps, scaled by the row's 1 / rms (NORM),
// each rounded to T, then gelu_tanh(gate) * up stored at y[out_row(j) * I + column].
template <typename T, int MT, int NW, bool NORM, typename OutRow>
MTP_DEVICE void mtp_glu_store(const float (&acc)[2][MT][4], const float* inv, float* red, int first, int limit,
                              T* y, int I, int warp, int lane, OutRow out_row) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float tile[2][4];
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int r = 0; r < 4; ++r) tile[p][r] = acc[p][mt][r];
    mtp_reduce_tile<NW, 2>(red, tile, warp, lane, [&](int row, int col, const float (&sums)[2]) {
      const int j = first + mt * 8 + col;
      if (j >= limit) return;
      const float s = NORM ? inv[mt * 8 + col] : 1.0f;
      const float gate = ::mtp_to_float(::mtp_from_float<T>(sums[0] * s));
      const float up = ::mtp_to_float(::mtp_from_float<T>(sums[1] * s));
      y[(size_t)out_row(j) * I + row] = ::mtp_from_float<T>(mtp_gelu_tanh(gate) * up);
    });
  }
}

// y (M, I) from x (M, K); w, w2: the gate's and the up projection's (w2 is w when JOINED). Rows go
// MT * 8 at a time (MT <= 4: two parts' sums of more tiles would not fit the registers).
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH, bool NORM, bool JOINED>
MTP_DEVICE void mtp_mlp_input(const T* x, const T* norm_w, const uint32_t* w, const T* scales, const T* biases,
                              const uint32_t* w2, const T* scales2, const T* biases2, T* y, int M, int I, int K,
                              float eps) {
  __shared__ float red[NW * 2 * 128];
  __shared__ float inv[MT * 8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * 16;
  for (int first = 0; first < M; first += MT * 8) {  // MT * 8 rows a pass (registers: two parts' sums)
    const T* x_row[MT];
    mtp_x_rows<T, MT>(x_row, x, first, M, K, lane);
    float acc[2][MT][4] = {};
    float ss[MT] = {};
    const MtpRows<T> rows[2] = {{w, scales, biases, n0}, {w2, scales2, biases2, (JOINED ? I : 0) + n0}};
    mtp_fused_warp<T, BITS, GROUP, MT, NW, DEPTH, 2, NORM>(acc, ss, rows, norm_w, x_row, K, warp, lane);
    if constexpr (NORM) mtp_row_scales<MT, NW>(inv, red, ss, K, eps, warp, lane);
    mtp_glu_store<T, MT, NW, NORM>(acc, inv, red, first, M, y + n0, I, warp, lane, [](int m) { return m; });
  }
}

// The experts' gate/up: y (P, I), pair p's token row p / TOP_K of x (P / TOP_K, K) through expert
// ids[p]; w, w2: (E, N, K * BITS / 32), N = 2I when JOINED (gate rows, then up rows), else I each.
// Block (b, s): columns 16b .. 16b + 15 of the s-th used expert, its pairs MT * 8 at a time.
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH, int TOP_K, bool NORM, bool JOINED>
MTP_DEVICE void mtp_experts_input(const T* x, const T* norm_w, const int32_t* ids, const uint32_t* w,
                                  const T* scales, const T* biases, const uint32_t* w2, const T* scales2,
                                  const T* biases2, T* y, int P, int N, int K, float eps) {
  __shared__ int shared_ids[MTP_QMM_MAX_PAIRS], pairs[MTP_QMM_MAX_PAIRS], info[2];
  __shared__ float red[NW * 2 * 128];
  __shared__ float inv[MT * 8];
  const int count = mtp_expert_rows(ids, P, blockIdx.y, shared_ids, pairs, info);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int I = JOINED ? N / 2 : N;
  const int n0 = blockIdx.x * 16;
  const size_t expert = info[0];
  const size_t words = (size_t)N * K * BITS / 32, groups = (size_t)N * (K / GROUP);
  for (int first = 0; first < count; first += MT * 8) {  // one pass unless an expert has > MT * 8 rows
    const T* x_row[MT];
    mtp_expert_x_rows<T, MT>(x_row, x, pairs, first, count, TOP_K, K, lane);
    float acc[2][MT][4] = {};
    float ss[MT] = {};
    const MtpRows<T> rows[2] = {
        {w + expert * words, scales + expert * groups, biases + expert * groups, n0},
        {w2 + expert * words, scales2 + expert * groups, biases2 + expert * groups, (JOINED ? I : 0) + n0}};
    mtp_fused_warp<T, BITS, GROUP, MT, NW, DEPTH, 2, NORM>(acc, ss, rows, norm_w, x_row, K, warp, lane);
    if constexpr (NORM) mtp_row_scales<MT, NW>(inv, red, ss, K, eps, warp, lane);
    mtp_glu_store<T, MT, NW, NORM>(acc, inv, red, first, count, y + n0, I, warp, lane,
                                   [&](int j) { return pairs[j]; });
  }
}
