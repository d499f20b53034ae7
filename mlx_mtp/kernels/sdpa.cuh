// Attention for decode and verify steps (1-8 query positions per sequence against the KV cache) and
// for prompt chunks, each query row reduced in an order that depends only on the key slots, never
// on how many query rows there are: a verify's row equals the decode step it stands for, and a
// prompt's rows are the same however it is cut into chunks.
//
// q (B, Hq, L, D), keys and values (B, Hkv, T, D), mask (B, 1, L, T) bool (true: visible), scale 1.
// A warp owns one query row (a head of the K/V head's group at one position) and walks the keys
// of its split (SPLIT slots, fixed) 32 at a time: each lane holds D / 32 dimensions, the 32 keys'
// partial dot products are summed by a butterfly that leaves key j's score on lane j, then an
// online softmax step (chunk max, rescale, p = exp(s - m)) and p @ V over the chunk in key order.
// Splits are combined in split order by `mtp_attention_combine` (a prompt chunk, with rows enough to
// fill the GPU, takes one split: SPLIT past any buffer). A chunk with no visible key is skipped, and
// a split with none contributes exactly zero, so slots past the last written one (buffers of other
// lengths) do not change a row's result either.
#pragma once

// DPL = D / 32 values of a row of `p` (T) from lane's offset, as floats.
template <typename T, int DPL>
MTP_DEVICE void mtp_load_row(float (&out)[DPL], const T* p) {
  static_assert(DPL % 2 == 0, "head_dim must be a multiple of 64");
  if constexpr (DPL % 8 == 0) {
#pragma unroll
    for (int i = 0; i < DPL; i += 8) {
      const uint4 v = ::mtp_load16(p + i);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        out[i + 2 * j] = ::mtp_to_float(*reinterpret_cast<const T*>(&words[j]));
        out[i + 2 * j + 1] = ::mtp_to_float(*(reinterpret_cast<const T*>(&words[j]) + 1));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < DPL; i += 2) {
      const uint32_t word = ::mtp_load4(p + i);
      out[i] = ::mtp_to_float(*reinterpret_cast<const T*>(&word));
      out[i + 1] = ::mtp_to_float(*(reinterpret_cast<const T*>(&word) + 1));
    }
  }
}

// v[0..31] of every lane -> on lane j, the sum over lanes of v[j]: a fixed butterfly (31 shuffles).
MTP_DEVICE float mtp_transpose_sum(float (&v)[32], int lane) {
#pragma unroll
  for (int step = 0; step < 5; ++step) {  // (bounds the compiler unrolls fully: v stays in registers)
    const int half = 16 >> step;
    const bool upper = lane & half;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i < half) {
        const float give = upper ? v[i] : v[i + half];
        const float keep = upper ? v[i + half] : v[i];
        v[i] = keep + ::mtp_shfl_xor(give, half);
      }
    }
  }
  return v[0];
}

MTP_DEVICE float mtp_warp_max(float x) {
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) x = fmaxf(x, ::mtp_shfl_xor(x, o));
  return x;
}

MTP_DEVICE float mtp_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) x += ::mtp_shfl_xor(x, o);
  return x;
}

// Block (split, row group, b * Hkv + kv head), ROWS warps: warp w takes query row
// group * ROWS + w of the kv head's G * L rows (head kv * G + row / L, position row % L).
// SINGLE (one split): the output itself; else each split's (max, sum) and unnormalised p @ V.
template <typename T, int D, int SPLIT, int ROWS, bool MASK, bool SINGLE>
MTP_DEVICE void mtp_attention_split(const T* q, const T* keys, const T* values, const bool* mask, T* out,
                                    float* part_stats, float* part_acc, int Hq, int Hkv, int L, int Tk) {
  constexpr int DPL = D / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = blockIdx.x, bk = blockIdx.z, b = bk / Hkv, kv = bk % Hkv;
  const int G = Hq / Hkv, row = blockIdx.y * ROWS + warp;
  if (row >= G * L) return;  // whole warps: no collective is left waiting
  const int h = kv * G + row / L, l = row % L;
  const size_t qrow = ((size_t)(b * Hq + h) * L + l);
  float qv[DPL], acc[DPL] = {};
  mtp_load_row<T, DPL>(qv, q + qrow * D + lane * DPL);
  const T* kbase = keys + (size_t)bk * Tk * D + lane * DPL;
  const T* vbase = values + (size_t)bk * Tk * D + lane * DPL;
  const bool* mrow = MASK ? mask + ((size_t)b * L + l) * Tk : nullptr;
  float m = -::mtp_inf(), sum = 0.0f;
  const int stop = Tk < (split + 1) * SPLIT ? Tk : (split + 1) * SPLIT;
  for (int key0 = split * SPLIT; key0 < stop; key0 += 32) {
    const int key = key0 + lane;
    const bool visible = key < stop && (!MASK || mrow[key]);
    if (!::mtp_ballot(visible)) continue;  // nothing visible in this chunk: no change at all
    float dots[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) {  // branch-free, so that dots[] stays in registers
      const int key = key0 + j < stop ? key0 + j : stop - 1;
      float kr[DPL];
      mtp_load_row<T, DPL>(kr, kbase + (size_t)key * D);
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < DPL; ++i) dot = fmaf(qv[i], kr[i], dot);
      dots[j] = key0 + j < stop ? dot : 0.0f;
    }
    float s = mtp_transpose_sum(dots, lane);  // every lane takes part, visible or not
    if (!visible) s = -::mtp_inf();
    const float top = mtp_warp_max(s);
    const float m_new = fmaxf(m, top), scale = ::mtp_exp(m - m_new);
    const float p = visible ? ::mtp_exp(s - m_new) : 0.0f;
    sum = sum * scale + mtp_warp_sum(p);
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] *= scale;
    for (int j = 0; j < 32 && key0 + j < stop; ++j) {
      const float pj = ::mtp_shfl(p, j);
      if (pj == 0.0f) continue;  // invisible (a stale slot's values are never read)
      float vr[DPL];
      mtp_load_row<T, DPL>(vr, vbase + (size_t)(key0 + j) * D);
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] = fmaf(pj, vr[i], acc[i]);
    }
    m = m_new;
  }
  if constexpr (SINGLE) {
#pragma unroll
    for (int i = 0; i < DPL; ++i) out[qrow * D + lane * DPL + i] = ::mtp_from_float<T>(sum > 0.0f ? acc[i] / sum : 0.0f);
  } else {
    const size_t part = qrow * ((Tk + SPLIT - 1) / SPLIT) + split;
    if (lane == 0) {
      part_stats[2 * part] = m;
      part_stats[2 * part + 1] = sum;
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) part_acc[part * D + lane * DPL + i] = acc[i];
  }
}

// out (rows, D) from `splits` partial results per row, added in split order; thread (d, row).
template <typename T, int D>
MTP_DEVICE void mtp_attention_combine(const float* part_stats, const float* part_acc, T* out, int rows, int splits) {
  const int d = blockIdx.x * blockDim.x + threadIdx.x, row = blockIdx.y;
  if (d >= D || row >= rows) return;
  const float* stats = part_stats + (size_t)row * splits * 2;
  float top = -::mtp_inf();
  for (int s = 0; s < splits; ++s) top = fmaxf(top, stats[2 * s]);
  float acc = 0.0f, sum = 0.0f;
  if (top != -::mtp_inf()) {
    for (int s = 0; s < splits; ++s) {
      const float scale = ::mtp_exp(stats[2 * s] - top);  // an empty split: exp(-inf) = 0
      acc += part_acc[((size_t)row * splits + s) * D + d] * scale;
      sum += stats[2 * s + 1] * scale;
    }
  }
  out[(size_t)row * D + d] = ::mtp_from_float<T>(sum > 0.0f ? acc / sum : 0.0f);
}
