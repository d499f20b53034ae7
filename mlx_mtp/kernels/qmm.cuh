// Quantized matmuls for decode and verify steps: y = x @ W.T for 1-64 rows of x, each weight read
// once for all of them, on the tensor cores, and every output row computed the same way whatever
// the other rows are ("row-invariant"), so that a verify's row equals the decode step it stands for.
//
// W is MLX's affine quantization: (N, K * BITS / 32) uint32, code i of a word in bits
// [BITS * i, BITS * (i + 1)); scales and biases (N, K / GROUP) in the activations' type T
// (bf16 or fp16); a weight is q * scale + bias.
//
// The tiling. A warp owns 16 rows of W (the wide side of mma.m16n8k16) and the rows of x are the
// narrow side, 8 to a tile (MT tiles: 1-64 rows). K is read in chunks: in each chunk every lane
// loads 16 contiguous bytes of its two weight rows (g and g + 8, g = lane / 4), the four lanes of
// a row (t = lane % 4) covering 64 contiguous bytes, one 16-byte "block" each (32 4-bit or 16 8-bit
// codes, inside one quantization group since GROUP >= 32). A block is dequantised into bf16/fp16
// pairs in registers (q * scale + bias, rounded once) and fed to mma with the matching x values:
// the products' k order inside a chunk is a fixed permutation of K (the A and B fragments use the
// same one), so each output element is a dot product over all of K in an order that depends on K
// and the block's warp count only. The warps of a block split K (warp w takes chunks w, w + NW,
// ..., DEPTH of them in flight) and their partial sums are added in warp order through shared
// memory. Nothing depends on how many rows there are or on their values, so rows are bitwise
// invariant; the launch shape (NW) is a function of the weight's shape alone (qmm.py).
#pragma once

// 16-byte blocks of a weight row a chunk covers (one per lane of a row's four).
#define MTP_QMM_BLOCKS 4
#define MTP_QMM_MAX_PAIRS 512

// The 16-bit float whose low mantissa bits take a small integer exactly: (magic | q) - magic = q.
template <typename T> struct MtpMagic;
template <> struct MtpMagic<__nv_bfloat16> {  // 128 + q for q < 2^7
  static constexpr uint32_t pair = 0x43004300u;
  static constexpr int mantissa = 7;
};
template <> struct MtpMagic<__half> {  // 1024 + q for q < 2^10
  static constexpr uint32_t pair = 0x64006400u;
  static constexpr int mantissa = 10;
};

// Two codes (given at bits 0 and 16 of `codes`, below 2^BITS) dequantised: a pair of weights.
template <typename T, int BITS>
MTP_DEVICE uint32_t mtp_weights(uint32_t codes, uint32_t scale2, uint32_t bias2) {
  if constexpr (BITS > MtpMagic<T>::mantissa) {
    // bf16 holds 0..255 exactly, but its 7-bit mantissa cannot take 8-bit codes: go through fp32.
    float lo = ::mtp_as_float(0x4B000000u | (codes & 0xFFu)) - 8388608.0f;
    float hi = ::mtp_as_float(0x4B000000u | ((codes >> 16) & 0xFFu)) - 8388608.0f;
    return ::mtp_fma2<T>(::mtp_pack2<T>(lo, hi), scale2, bias2);
  } else {
    uint32_t q = ::mtp_sub2<T>(codes | MtpMagic<T>::pair, MtpMagic<T>::pair);
    return ::mtp_fma2<T>(q, scale2, bias2);
  }
}

// One lane's share of a chunk of one weight row: its 16-byte block and the block's scale and bias,
// each twice (a pair, as mtp_fma2 takes them).
struct MtpBlock {
  uint4 codes;
  uint32_t scale2, bias2;
};

template <typename T, int BITS, int GROUP>
MTP_DEVICE MtpBlock mtp_load_block(const uint32_t* w, const T* scales, const T* biases, int row, int K, int block,
                                   bool valid) {
  MtpBlock b;
  if (!valid) {
    b.codes = make_uint4(0, 0, 0, 0);
    b.scale2 = b.bias2 = 0;  // weights 0: a missing block adds nothing
    return b;
  }
  constexpr int values = 128 / BITS;  // per block
  const size_t words = (size_t)K * BITS / 32;
  b.codes = ::mtp_load16(w + (size_t)row * words + (size_t)block * 4);
  const size_t group = (size_t)row * (K / GROUP) + (size_t)block * values / GROUP;
  uint32_t s = ::mtp_load2(scales + group), z = ::mtp_load2(biases + group);
  b.scale2 = s | (s << 16);
  b.bias2 = z | (z << 16);
  return b;
}

// One word of a block (j = 0..3) through mma against each tile's x values: 4-bit words hold 8
// codes (two k16 steps), 8-bit words 4 (one step). x_rows[mt] points at the lane's x row for tile
// mt at the block's first k (nullptr: no row, zeros). Every tile's x is loaded before any product.
template <typename T, int BITS, int MT>
MTP_DEVICE void mtp_word_mma(float (&acc)[MT][4], uint32_t wg, uint32_t wh, const MtpBlock& bg, const MtpBlock& bh,
                             const T* const (&x_rows)[MT], int j) {
  if constexpr (BITS == 4) {
    uint4 xv[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) xv[mt] = x_rows[mt] ? ::mtp_load16(x_rows[mt] + 8 * j) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // pair i of a word = codes (i, i + 4): bits 4i and 4i + 16
      uint32_t a[4];
      a[0] = mtp_weights<T, 4>((wg >> (8 * h)) & 0x000F000Fu, bg.scale2, bg.bias2);
      a[1] = mtp_weights<T, 4>((wh >> (8 * h)) & 0x000F000Fu, bh.scale2, bh.bias2);
      a[2] = mtp_weights<T, 4>((wg >> (8 * h + 4)) & 0x000F000Fu, bg.scale2, bg.bias2);
      a[3] = mtp_weights<T, 4>((wh >> (8 * h + 4)) & 0x000F000Fu, bh.scale2, bh.bias2);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint32_t lo = h ? xv[mt].y : xv[mt].x, hi = h ? xv[mt].w : xv[mt].z;  // x (2h, 2h+1), (2h+4, 2h+5)
        const uint32_t b[2] = {::mtp_prmt(lo, hi, 0x5410u), ::mtp_prmt(lo, hi, 0x7632u)};
        ::mtp_mma<T>(acc[mt], a, b);
      }
    }
  } else {
    uint2 xv[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) xv[mt] = x_rows[mt] ? ::mtp_load8(x_rows[mt] + 4 * j) : make_uint2(0, 0);
    // pair i of a word = codes (i, i + 2): bits 8i and 8i + 16
    uint32_t a[4];
    a[0] = mtp_weights<T, 8>(wg & 0x00FF00FFu, bg.scale2, bg.bias2);
    a[1] = mtp_weights<T, 8>(wh & 0x00FF00FFu, bh.scale2, bh.bias2);
    a[2] = mtp_weights<T, 8>((wg >> 8) & 0x00FF00FFu, bg.scale2, bg.bias2);
    a[3] = mtp_weights<T, 8>((wh >> 8) & 0x00FF00FFu, bh.scale2, bh.bias2);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint32_t b[2] = {::mtp_prmt(xv[mt].x, xv[mt].y, 0x5410u), ::mtp_prmt(xv[mt].x, xv[mt].y, 0x7632u)};
      ::mtp_mma<T>(acc[mt], a, b);
    }
  }
}

// One chunk of a warp's K loop: its four words through mma.
template <typename T, int BITS, int MT>
MTP_DEVICE void mtp_chunk_mma(float (&acc)[MT][4], const MtpBlock& bg, const MtpBlock& bh,
                              const T* const (&x_row)[MT], int block, bool valid) {
  constexpr int values = 128 / BITS;
  const T* xs[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) xs[mt] = (x_row[mt] && valid) ? x_row[mt] + (size_t)block * values : nullptr;
  const uint32_t wg[4] = {bg.codes.x, bg.codes.y, bg.codes.z, bg.codes.w};
  const uint32_t wh[4] = {bh.codes.x, bh.codes.y, bh.codes.z, bh.codes.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) mtp_word_mma<T, BITS, MT>(acc, wg[j], wh[j], bg, bh, xs, j);
}

// The K loop of one warp over rows n0 .. n0 + 15 of W: chunks warp, warp + NW, ... in that order,
// DEPTH of them loaded ahead of the products (a ring of registers: more bytes in flight per warp,
// the same sums in the same order whatever DEPTH is). x_row[mt]: this lane's x row for tile mt
// (nullptr: none).
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH>
MTP_DEVICE void mtp_qmm_warp(float (&acc)[MT][4], const uint32_t* w, const T* scales, const T* biases,
                             const T* const (&x_row)[MT], int n0, int K, int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int blocks = K * BITS / 128;  // 16-byte blocks per weight row
  const int chunks = (blocks + MTP_QMM_BLOCKS - 1) / MTP_QMM_BLOCKS;
  MtpBlock ring_g[DEPTH], ring_h[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    const int c = warp + d * NW, block = c * MTP_QMM_BLOCKS + t;
    ring_g[d] = mtp_load_block<T, BITS, GROUP>(w, scales, biases, n0 + g, K, block, c < chunks && block < blocks);
    ring_h[d] = mtp_load_block<T, BITS, GROUP>(w, scales, biases, n0 + g + 8, K, block, c < chunks && block < blocks);
  }
  for (int first = warp; first < chunks; first += NW * DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int c = first + d * NW;
      if (c >= chunks) break;
      const MtpBlock bg = ring_g[d], bh = ring_h[d];
      const int block = c * MTP_QMM_BLOCKS + t, ahead = (c + NW * DEPTH) * MTP_QMM_BLOCKS + t;
      const bool more = c + NW * DEPTH < chunks && ahead < blocks;
      ring_g[d] = mtp_load_block<T, BITS, GROUP>(w, scales, biases, n0 + g, K, ahead, more);
      ring_h[d] = mtp_load_block<T, BITS, GROUP>(w, scales, biases, n0 + g + 8, K, ahead, more);
      mtp_chunk_mma<T, BITS, MT>(acc, bg, bh, x_row, block, block < blocks);
    }
  }
}

// Tile mt's accumulators of every warp (PARTS of them per lane: a GLU's gate and up), added in
// warp order through `red` (NW * PARTS * 128 floats); f(row, col, sums) for each of the tile's
// 16 x 8 outputs, from one thread each (row: of the warp's 16 weight rows; col: of the tile's 8).
template <int NW, int PARTS, typename F>
MTP_DEVICE void mtp_reduce_tile(float* red, const float (&acc)[PARTS][4], int warp, int lane, F f) {
#pragma unroll
  for (int part = 0; part < PARTS; ++part)
#pragma unroll
    for (int r = 0; r < 4; ++r) red[((warp * PARTS + part) * 4 + r) * 32 + lane] = acc[part][r];
  __syncthreads();
  for (int i = threadIdx.x; i < 128; i += NW * 32) {
    float sums[PARTS] = {};
    for (int v = 0; v < NW; ++v)
#pragma unroll
      for (int part = 0; part < PARTS; ++part) sums[part] += red[(v * PARTS + part) * 128 + i];
    const int r = i / 32, l = i % 32;  // accumulator r of lane l: see mtp_mma's layout
    f(l / 4 + (r >= 2 ? 8 : 0), 2 * (l % 4) + (r & 1), sums);
  }
  __syncthreads();  // `red` is written again by the next tile
}

// The x rows a lane loads in an MMA tile loop: rows first + mt * 8 + lane / 4 (nullptr past M).
template <typename T, int MT>
MTP_DEVICE void mtp_x_rows(const T* (&x_row)[MT], const T* x, int first, int M, int K, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int m = first + mt * 8 + lane / 4;
    x_row[mt] = m < M ? x + (size_t)m * K : nullptr;
  }
}

// The x rows a lane loads for an expert's pairs: pair j = first + mt * 8 + lane / 4 reads x row pairs[j] / div
// (a token's row, or its (token, k) row when div is 1; nullptr past count).
template <typename T, int MT>
MTP_DEVICE void mtp_expert_x_rows(const T* (&x_row)[MT], const T* x, const int* pairs, int first, int count, int div,
                                  int K, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int j = first + mt * 8 + lane / 4;
    x_row[mt] = j < count ? x + (size_t)(pairs[j] / div) * K : nullptr;
  }
}

// y (M, N) = x (M, K) @ W.T: block b owns rows 16b .. 16b + 15 of W.
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH>
MTP_DEVICE void mtp_qmm_dense(const T* x, const uint32_t* w, const T* scales, const T* biases, T* y, int M, int N,
                              int K) {
  __shared__ float red[NW * 128];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * 16;
  const T* x_row[MT];
  mtp_x_rows<T, MT>(x_row, x, 0, M, K, lane);
  float acc[MT][4] = {};
  mtp_qmm_warp<T, BITS, GROUP, MT, NW, DEPTH>(acc, w, scales, biases, x_row, n0, K, warp, lane);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float tile[1][4] = {{acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]}};
    mtp_reduce_tile<NW, 1>(red, tile, warp, lane, [&](int row, int col, const float (&sums)[1]) {
      const int m = mt * 8 + col;
      if (m < M) y[(size_t)m * N + n0 + row] = ::mtp_from_float<T>(sums[0]);
    });
  }
}

// ---- MoE experts ----------------------------------------------------------------------------------
// P (token, expert) pairs, ids[p] the expert of pair p. Block (tile, s) takes the s-th distinct
// expert in order of first appearance and every pair routed to it, so each used expert's weights
// are read once for all of its rows. Fills `rows` with those pairs (in pair order) and returns how
// many; 0 when fewer than s + 1 experts are used (the block has nothing to do). `info`: 2 shared ints.
MTP_DEVICE int mtp_expert_rows(const int32_t* ids, int P, int s, int* shared_ids, int* rows, int* info) {
  const int tid = threadIdx.x;
  for (int p = tid; p < P; p += blockDim.x) shared_ids[p] = ids[p];
  if (tid == 0) info[0] = -1;
  __syncthreads();
  if (tid < 32) {  // warp 0: ranks from ballots, in pair order
    int seen = 0;
    for (int base = 0; base < P; base += 32) {
      const int p = base + tid;
      bool first = p < P;
      for (int q = 0; first && q < p; ++q) first = shared_ids[q] != shared_ids[p];
      const uint32_t ballot = ::mtp_ballot(first);
      if (first && seen + ::mtp_popc(ballot & ((1u << tid) - 1u)) == s) info[0] = shared_ids[p];
      seen += ::mtp_popc(ballot);
    }
  }
  __syncthreads();
  const int e = info[0];
  if (e < 0) return 0;
  if (tid < 32) {
    int count = 0;
    for (int base = 0; base < P; base += 32) {
      const int p = base + tid;
      const bool mine = p < P && shared_ids[p] == e;
      const uint32_t ballot = ::mtp_ballot(mine);
      if (mine) rows[count + ::mtp_popc(ballot & ((1u << tid) - 1u))] = p;
      count += ::mtp_popc(ballot);
    }
    if (tid == 0) info[1] = count;
  }
  __syncthreads();
  return info[1];
}

MTP_DEVICE float mtp_gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// y (P, N): pair p's row of x (x row p / XDIV: top-k when x holds tokens, 1 when it holds a row per
// pair) times its expert's W (E, N, K * BITS / 32). GLU: W is the gate and W2 the up projection
// (both read in one pass over K's chunks per block), and y = gelu_tanh(gate) * up, each product
// rounded to T first as a separate matmul's output would be. Block (b, s): rows 16b .. 16b + 15 of
// the s-th used expert (`mtp_expert_rows`), its pairs MT * 8 at a time.
template <typename T, int BITS, int GROUP, int MT, int NW, int DEPTH, int XDIV, bool GLU>
MTP_DEVICE void mtp_qmm_experts(const T* x, const int32_t* ids, const uint32_t* w, const T* scales, const T* biases,
                                const uint32_t* w2, const T* scales2, const T* biases2, T* y, int P, int N, int K) {
  constexpr int PARTS = GLU ? 2 : 1;
  __shared__ int shared_ids[MTP_QMM_MAX_PAIRS], rows[MTP_QMM_MAX_PAIRS], info[2];
  __shared__ float red[NW * PARTS * 128];
  const int count = mtp_expert_rows(ids, P, blockIdx.y, shared_ids, rows, info);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * 16;
  const size_t expert = info[0];
  const size_t words = (size_t)N * K * BITS / 32, groups = (size_t)N * (K / GROUP);
  for (int first = 0; first < count; first += MT * 8) {  // one pass unless an expert has > MT * 8 rows
    const T* x_row[MT];
    mtp_expert_x_rows<T, MT>(x_row, x, rows, first, count, XDIV, K, lane);
    float acc[PARTS][MT][4] = {};
    mtp_qmm_warp<T, BITS, GROUP, MT, NW, DEPTH>(acc[0], w + expert * words, scales + expert * groups,
                                         biases + expert * groups, x_row, n0, K, warp, lane);
    if constexpr (GLU)
      mtp_qmm_warp<T, BITS, GROUP, MT, NW, DEPTH>(acc[1], w2 + expert * words, scales2 + expert * groups,
                                           biases2 + expert * groups, x_row, n0, K, warp, lane);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float tile[PARTS][4];
#pragma unroll
      for (int part = 0; part < PARTS; ++part)
#pragma unroll
        for (int r = 0; r < 4; ++r) tile[part][r] = acc[part][mt][r];
      mtp_reduce_tile<NW, PARTS>(red, tile, warp, lane, [&](int row, int col, const float (&sums)[PARTS]) {
        const int j = first + mt * 8 + col;
        if (j >= count) return;
        float out = sums[0];
        if constexpr (GLU) {  // each product rounded to T first, as separate matmuls' outputs are
          const float gate = ::mtp_to_float(::mtp_from_float<T>(sums[0]));
          out = mtp_gelu_tanh(gate) * ::mtp_to_float(::mtp_from_float<T>(sums[PARTS - 1]));
        }
        y[(size_t)rows[j] * N + n0 + row] = ::mtp_from_float<T>(out);
      });
    }
  }
}
