// mlx_mtp's device helpers: every hardware-specific operation the kernels use goes through one of
// these, so that a kernel body is plain C++ over them. tests/cuda_emu/emulate.h implements the same
// functions on the CPU (one thread per CUDA thread), which is how the kernels' indexing is tested
// on machines without a GPU. Names carry the `mtp_` prefix and are called as `::mtp_...`: MLX puts
// kernel bodies inside its own namespace, whose names would otherwise hide ours.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
// (uint32_t and friends come with MLX's default header, which precedes this one)

#define MTP_DEVICE __device__ __forceinline__

// ---- scalars --------------------------------------------------------------------------------------
MTP_DEVICE float mtp_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
MTP_DEVICE float mtp_to_float(__half x) { return __half2float(x); }
MTP_DEVICE float mtp_to_float(float x) { return x; }

template <typename T> MTP_DEVICE T mtp_from_float(float x);
template <> MTP_DEVICE __nv_bfloat16 mtp_from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> MTP_DEVICE __half mtp_from_float<__half>(float x) { return __float2half_rn(x); }
template <> MTP_DEVICE float mtp_from_float<float>(float x) { return x; }

MTP_DEVICE float mtp_as_float(uint32_t x) { return __uint_as_float(x); }
MTP_DEVICE uint32_t mtp_as_uint(float x) { return __float_as_uint(x); }
MTP_DEVICE uint32_t mtp_prmt(uint32_t a, uint32_t b, uint32_t selector) { return __byte_perm(a, b, selector); }
MTP_DEVICE float mtp_exp(float x) { return expf(x); }
MTP_DEVICE float mtp_inf() { return __int_as_float(0x7f800000); }  // (NVRTC has no INFINITY)
MTP_DEVICE float mtp_rsqrt(float x) { return rsqrtf(x); }
MTP_DEVICE void mtp_sincos(float x, float* s, float* c) { sincosf(x, s, c); }

// ---- pairs of 16-bit floats packed in a uint32 (low half first) ----------------------------------------
// T picks the format: __nv_bfloat16 or __half. Each is one instruction on sm_80 and later.
template <typename T> MTP_DEVICE uint32_t mtp_pack2(float lo, float hi);
template <> MTP_DEVICE uint32_t mtp_pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> MTP_DEVICE uint32_t mtp_pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T> MTP_DEVICE float mtp_unpack(uint32_t pair, int i);  // half i of a pair, as a float
template <> MTP_DEVICE float mtp_unpack<__nv_bfloat16>(uint32_t pair, int i) {
  return __uint_as_float(i ? pair & 0xFFFF0000u : pair << 16);
}
template <> MTP_DEVICE float mtp_unpack<__half>(uint32_t pair, int i) {
  return __half2float(__ushort_as_half((unsigned short)(pair >> (16 * i))));
}

template <typename T> MTP_DEVICE uint32_t mtp_sub2(uint32_t a, uint32_t b);  // a - b, rounded once
template <> MTP_DEVICE uint32_t mtp_sub2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
template <> MTP_DEVICE uint32_t mtp_sub2<__half>(uint32_t a, uint32_t b) {
  __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

template <typename T> MTP_DEVICE uint32_t mtp_fma2(uint32_t a, uint32_t b, uint32_t c);  // a * b + c, rounded once
template <> MTP_DEVICE uint32_t mtp_fma2<__nv_bfloat16>(uint32_t a, uint32_t b, uint32_t c) {
  __nv_bfloat162 r = __hfma2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b),
                             *reinterpret_cast<__nv_bfloat162*>(&c));
  return *reinterpret_cast<uint32_t*>(&r);
}
template <> MTP_DEVICE uint32_t mtp_fma2<__half>(uint32_t a, uint32_t b, uint32_t c) {
  __half2 r = __hfma2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b),
                      *reinterpret_cast<__half2*>(&c));
  return *reinterpret_cast<uint32_t*>(&r);
}

// ---- warps ------------------------------------------------------------------------------------------
// Every lane of the warp calls these together (full mask).
MTP_DEVICE float mtp_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
MTP_DEVICE float mtp_shfl(float v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
MTP_DEVICE uint32_t mtp_ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
MTP_DEVICE int mtp_popc(uint32_t x) { return __popc(x); }

// d += A (16 x 16, row-major) * B (16 x 8, column-major), fp32 accumulators, tensor cores
// (mma.sync m16n8k16, sm_80 and later). Lane l holds, with g = l / 4 and t = l % 4:
//   a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   d[0..1] = D[g][2t..2t+1]                          d[2..3] = D[g+8][2t..2t+1]
// Each element of D depends on its own row of A and column of B only.
template <typename T> MTP_DEVICE void mtp_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <> MTP_DEVICE void mtp_mma<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> MTP_DEVICE void mtp_mma<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- memory -----------------------------------------------------------------------------------------
// 16 bytes through the read-only (non-coherent) path: inputs never change during a kernel.
MTP_DEVICE uint4 mtp_load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
MTP_DEVICE uint2 mtp_load8(const void* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
MTP_DEVICE uint32_t mtp_load4(const void* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }
MTP_DEVICE uint16_t mtp_load2(const void* p) { return __ldg(reinterpret_cast<const unsigned short*>(p)); }

// Global memory another block of this grid wrote (through L2, never a stale L1 line): read only after
// mtp_fence and an atomic told this block that the writer is done.
MTP_DEVICE float mtp_load_coherent(const float* p) { return __ldcg(p); }
// Orders this thread's global writes before its later ones as every block sees them (__threadfence).
MTP_DEVICE void mtp_fence() { __threadfence(); }
MTP_DEVICE int mtp_atomic_add(int* p, int v) { return atomicAdd(p, v); }

// Dynamic shared memory (the `shared_memory` bytes of the launch) as an array of `type`.
#define MTP_DYNAMIC_SHARED(type, name) \
  extern __shared__ __align__(16) unsigned char mtp_dynamic_shared[]; \
  type* name = reinterpret_cast<type*>(mtp_dynamic_shared)
