// The K loop of the fused projections (issue 42): qmm.cuh's tiling and order of sums, with two
// additions. NORM: the input RMSNorm in the prologue, for free: every lane already loads its x values
// for the products, so it multiplies them by the norm's weight (rounded to T once) and adds their
// squares; a row's 1 / rms scales its sums at the end (the same value in every block: the squares are
// added in an order fixed by K and the warp count, like the products). PARTS: weight row sets that
// share the x loads (a GLU's gate and up rows), each with its own accumulators.
// Needs qmm.cuh (MtpBlock, mtp_load_block, mtp_weights, mtp_reduce_tile).
#pragma once

MTP_DEVICE uint32_t mtp_word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// x pairs times the norm weight's pairs, each product rounded to T; their squares (of x) added to ss.
template <typename T, int PAIRS>
MTP_DEVICE void mtp_norm_pairs(uint32_t (&x)[PAIRS], const uint32_t (&w)[PAIRS], float& ss) {
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const float a = ::mtp_unpack<T>(x[p], 0), b = ::mtp_unpack<T>(x[p], 1);
    ss += a * a;
    ss += b * b;
    x[p] = ::mtp_pack2<T>(a * ::mtp_unpack<T>(w[p], 0), b * ::mtp_unpack<T>(w[p], 1));
  }
}

// One word j (0..3) of every part's blocks through mma against each tile's x (as mtp_word_mma).
// xs[mt]: the lane's x row for tile mt at the block's first k (nullptr: zeros); nw: the norm weight
// at the same k (nullptr without NORM or outside K).
template <typename T, int BITS, int MT, int PARTS, bool NORM>
MTP_DEVICE void mtp_fused_word(float (&acc)[PARTS][MT][4], float (&ss)[MT], const MtpBlock (&bg)[PARTS],
                               const MtpBlock (&bh)[PARTS], const T* const (&xs)[MT], const T* nw, int j) {
  constexpr int PAIRS = BITS == 4 ? 4 : 2;  // x pairs of one word's codes
  uint32_t xv[MT][PAIRS];
  uint32_t wv[PAIRS] = {};
  if (NORM && nw) {
    if constexpr (BITS == 4) {
      const uint4 v = ::mtp_load16(nw + 8 * j);
      wv[0] = v.x, wv[1] = v.y, wv[PAIRS - 2] = v.z, wv[PAIRS - 1] = v.w;
    } else {
      const uint2 v = ::mtp_load8(nw + 4 * j);
      wv[0] = v.x, wv[1] = v.y;
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if constexpr (BITS == 4) {
      const uint4 v = xs[mt] ? ::mtp_load16(xs[mt] + 8 * j) : make_uint4(0, 0, 0, 0);
      xv[mt][0] = v.x, xv[mt][1] = v.y, xv[mt][PAIRS - 2] = v.z, xv[mt][PAIRS - 1] = v.w;
    } else {
      const uint2 v = xs[mt] ? ::mtp_load8(xs[mt] + 4 * j) : make_uint2(0, 0);
      xv[mt][0] = v.x, xv[mt][1] = v.y;
    }
    if (NORM && nw && xs[mt]) mtp_norm_pairs<T, PAIRS>(xv[mt], wv, ss[mt]);
  }
#pragma unroll
  for (int part = 0; part < PARTS; ++part) {
    const uint32_t wg = mtp_word(bg[part].codes, j), wh = mtp_word(bh[part].codes, j);
    if constexpr (BITS == 4) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // pair i of a word = codes (i, i + 4): bits 4i and 4i + 16
        uint32_t a[4];
        a[0] = mtp_weights<T, 4>((wg >> (8 * h)) & 0x000F000Fu, bg[part].scale2, bg[part].bias2);
        a[1] = mtp_weights<T, 4>((wh >> (8 * h)) & 0x000F000Fu, bh[part].scale2, bh[part].bias2);
        a[2] = mtp_weights<T, 4>((wg >> (8 * h + 4)) & 0x000F000Fu, bg[part].scale2, bg[part].bias2);
        a[3] = mtp_weights<T, 4>((wh >> (8 * h + 4)) & 0x000F000Fu, bh[part].scale2, bh[part].bias2);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t lo = xv[mt][h], hi = xv[mt][h + 2];  // x (2h, 2h+1), (2h+4, 2h+5)
          const uint32_t b[2] = {::mtp_prmt(lo, hi, 0x5410u), ::mtp_prmt(lo, hi, 0x7632u)};
          ::mtp_mma<T>(acc[part][mt], a, b);
        }
      }
    } else {  // pair i of a word = codes (i, i + 2): bits 8i and 8i + 16
      uint32_t a[4];
      a[0] = mtp_weights<T, 8>(wg & 0x00FF00FFu, bg[part].scale2, bg[part].bias2);
      a[1] = mtp_weights<T, 8>(wh & 0x00FF00FFu, bh[part].scale2, bh[part].bias2);
      a[2] = mtp_weights<T, 8>((wg >> 8) & 0x00FF00FFu, bg[part].scale2, bg[part].bias2);
      a[3] = mtp_weights<T, 8>((wh >> 8) & 0x00FF00FFu, bh[part].scale2, bh[part].bias2);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint32_t b[2] = {::mtp_prmt(xv[mt][0], xv[mt][1], 0x5410u), ::mtp_prmt(xv[mt][0], xv[mt][1], 0x7632u)};
        ::mtp_mma<T>(acc[part][mt], a, b);
      }
    }
  }
}

// Where one part's weight rows are: w, scales and biases of the (N, K) matrix they belong to, and the
// first of the warp's 16 rows.
template <typename T> struct MtpRows {
  const uint32_t* w;
  const T* scales;
  const T* biases;
  int row0;
};

// The K loop of one warp (as mtp_qmm_warp: chunks warp, warp + NW, ..., DEPTH of them in flight) over
// PARTS row sets sharing the x loads. ss[mt]: this lane's sum of the squares of its x values of tile mt
// (NORM), each x value counted by exactly one lane of the block.
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH, int PARTS, bool NORM>
MTP_DEVICE void mtp_fused_warp(float (&acc)[PARTS][MT][4], float (&ss)[MT], const MtpRows<T> (&rows)[PARTS],
                               const T* norm_w, const T* const (&x_row)[MT], int K, int warp, int lane) {
  constexpr int values = 128 / BITS;  // per block
  const int g = lane / 4, t = lane % 4;
  const int blocks = K * BITS / 128;
  const int chunks = (blocks + MTP_QMM_BLOCKS - 1) / MTP_QMM_BLOCKS;
  MtpBlock ring_g[DEPTH][PARTS], ring_h[DEPTH][PARTS];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    const int c = warp + d * NW, block = c * MTP_QMM_BLOCKS + t;
    const bool valid = c < chunks && block < blocks;
#pragma unroll
    for (int p = 0; p < PARTS; ++p) {
      const MtpRows<T>& r = rows[p];
      ring_g[d][p] = mtp_load_block<T, BITS, GROUP>(r.w, r.scales, r.biases, r.row0 + g, K, block, valid);
      ring_h[d][p] = mtp_load_block<T, BITS, GROUP>(r.w, r.scales, r.biases, r.row0 + g + 8, K, block, valid);
    }
  }
  for (int first = warp; first < chunks; first += NW * DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int c = first + d * NW;
      if (c >= chunks) break;
      MtpBlock bg[PARTS], bh[PARTS];
      const int block = c * MTP_QMM_BLOCKS + t, ahead = (c + NW * DEPTH) * MTP_QMM_BLOCKS + t;
      const bool more = c + NW * DEPTH < chunks && ahead < blocks;
#pragma unroll
      for (int p = 0; p < PARTS; ++p) {
        const MtpRows<T>& r = rows[p];
        bg[p] = ring_g[d][p], bh[p] = ring_h[d][p];
        ring_g[d][p] = mtp_load_block<T, BITS, GROUP>(r.w, r.scales, r.biases, r.row0 + g, K, ahead, more);
        ring_h[d][p] = mtp_load_block<T, BITS, GROUP>(r.w, r.scales, r.biases, r.row0 + g + 8, K, ahead, more);
      }
      const bool valid = block < blocks;
      const T* xs[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xs[mt] = (x_row[mt] && valid) ? x_row[mt] + (size_t)block * values : nullptr;
      const T* nw = (NORM && valid) ? norm_w + (size_t)block * values : nullptr;
#pragma unroll
      for (int j = 0; j < 4; ++j) mtp_fused_word<T, BITS, MT, PARTS, NORM>(acc, ss, bg, bh, xs, nw, j);
    }
  }
}

// 1 / rms of each x row of the block's tiles (row mt * 8 + i at inv[mt * 8 + i]) from the lanes' ss:
// the four lanes of a row added, then the warps in warp order. `red`: NW * MT * 8 floats.
template <int MT, int NW>
MTP_DEVICE void mtp_row_scales(float* inv, float* red, const float (&ss)[MT], int K, float eps, int warp, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float v = ss[mt];
    v += ::mtp_shfl_xor(v, 1);
    v += ::mtp_shfl_xor(v, 2);
    if (lane % 4 == 0) red[(warp * MT + mt) * 8 + lane / 4] = v;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < MT * 8; i += NW * 32) {
    float s = 0.0f;
    for (int v = 0; v < NW; ++v) s += red[v * MT * 8 + i];
    inv[i] = ::mtp_rsqrt(s / (float)K + eps);
  }
  __syncthreads();
}

// A single-part fused product's first half, shared by the attention input and the router: rows x (M, K)
// normed by norm_w in the prologue, times the block's 16 weight rows from n0, each sum scaled by its row's
// 1 / rms and `factor`, rounded to T and written as float to part (M, N) for the epilogue's block.
// `red`: NW * 128 floats; `inv`: MT * 8.
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH>
MTP_DEVICE void mtp_normed_part(float* red, float* inv, const T* x, const T* norm_w, const uint32_t* w,
                                const T* scales, const T* biases, float* part, int M, int N, int K, int n0,
                                float eps, float factor, int warp, int lane) {
  const T* x_row[MT];
  mtp_x_rows<T, MT>(x_row, x, 0, M, K, lane);
  float acc[1][MT][4] = {};
  float ss[MT] = {};
  const MtpRows<T> rows[1] = {{w, scales, biases, n0}};
  mtp_fused_warp<T, BITS, GROUP, MT, NW, DEPTH, 1, true>(acc, ss, rows, norm_w, x_row, K, warp, lane);
  mtp_row_scales<MT, NW>(inv, red, ss, K, eps, warp, lane);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float tile[1][4] = {{acc[0][mt][0], acc[0][mt][1], acc[0][mt][2], acc[0][mt][3]}};
    mtp_reduce_tile<NW, 1>(red, tile, warp, lane, [&](int row, int col, const float (&sums)[1]) {
      const int m = mt * 8 + col;
      if (m < M) part[(size_t)m * N + n0 + row] = ::mtp_to_float(::mtp_from_float<T>(sums[0] * inv[m] * factor));
    });
  }
}
