// CPU emulation of the CUDA subset that mlx_mtp's kernels use: the helpers of
// mlx_mtp/kernels/prelude.cuh, the CUDA keywords and built-ins, and a launcher. tests/cuda_emu
// replaces the prelude with this file and compiles the kernel with g++ and the sanitizers.
// The runtime (fibers, scheduler, file I/O) sits under MTP_EMU_IMPLEMENTATION at the end: it is
// compiled once into an object that every kernel links, which halves each kernel's compile time.
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread: fibers run until they finish
// or wait in a barrier (__syncthreads, a warp collective), so execution is deterministic, barriers
// need no locks, and a barrier that can never complete is reported instead of hanging.
#pragma once
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define MTP_EMU_ASAN 1
#else
#define MTP_EMU_ASAN 0
#endif

// ---- CUDA keywords ---------------------------------------------------------------------------------
#define __global__
#define __device__
#define __forceinline__ inline
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
// Blocks run one after another, so a function-local static is exactly "one per block".
#define __shared__ static
#define MTP_DEVICE inline

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
struct __align__(8) uint2 { unsigned int x, y; };
struct __align__(16) uint4 { unsigned int x, y, z, w; };
inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return {x, y, z, w};
}

// Storage-only 16-bit floats: no arithmetic or implicit conversions, so a kernel that relies on
// cuda_fp16/cuda_bf16 operators (outside the prelude's subset) fails to compile here.
struct __nv_bfloat16 { uint16_t bits; };
struct __half { uint16_t bits; };

namespace cooperative_groups {}

// ---- errors ----------------------------------------------------------------------------------------
namespace mtp_emu {
inline uint3 g_thread_idx, g_block_idx;
inline dim3 g_block_dim, g_grid_dim;

// Reports a kernel error with the current block and thread, and ends the process.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
}  // namespace mtp_emu

inline const uint3& threadIdx = mtp_emu::g_thread_idx;
inline const uint3& blockIdx = mtp_emu::g_block_idx;
inline const dim3& blockDim = mtp_emu::g_block_dim;
inline const dim3& gridDim = mtp_emu::g_grid_dim;

// MLX's Shape / Strides parameters; reading past the input's ndim is a kernel bug, so it fails.
namespace mtp_emu {
template <typename T> struct NdArray {
  T v[10];
  int ndim;
  const char* name;
  const T& operator[](int64_t i) const {
    if (i < 0 || i >= ndim) fail("%s[%lld] read, but the input has %d dimensions", name, (long long)i, ndim);
    return v[i];
  }
};
}  // namespace mtp_emu
namespace mlx::core::cu {
using Shape = mtp_emu::NdArray<int32_t>;
using Strides = mtp_emu::NdArray<int64_t>;
}  // namespace mlx::core::cu

// ---- 16-bit float formats ----------------------------------------------------------------------------
namespace mtp_emu {
struct Format { int digits, emin, emax; };  // significand bits incl. the implicit one; normal exponents

// Rounds the exact value x + err to nearest-even in `f` and returns it as a float (which holds every
// value of both formats exactly). err is x's own rounding error (0 when x is exact): it only matters
// when x lies exactly on a midpoint of `f`, where it says which side the exact value is on.
inline float round_to(Format f, double x, double err) {
  if (x == 0 || !std::isfinite(x)) return (float)x;
  int e;
  frexp(fabs(x), &e);
  int quantum = std::max(e - 1, f.emin) - (f.digits - 1);  // exponent of one unit in the last place
  double scaled = ldexp(fabs(x), -quantum), n = floor(scaled), frac = scaled - n;
  double side = x < 0 ? -err : err;
  if (frac > 0.5 || (frac == 0.5 && (side > 0 || (side == 0 && fmod(n, 2.0) == 1.0)))) n += 1;
  double r = ldexp(n, quantum);
  if (r >= ldexp(1.0, f.emax + 1)) r = INFINITY;
  return (float)copysign(r, x);
}

inline uint32_t float_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
inline float bits_float(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }

template <typename T> struct F16;
template <> struct F16<__nv_bfloat16> {
  static constexpr Format format{8, -126, 127};
  static uint16_t encode(float v) { return (uint16_t)(float_bits(v) >> 16); }  // v exact in bf16
  static float decode(uint16_t b) { return bits_float((uint32_t)b << 16); }
};
template <> struct F16<__half> {
  static constexpr Format format{11, -14, 15};
  static uint16_t encode(float v) {  // v exact in fp16 (or +-inf)
    uint16_t sign = (uint16_t)((float_bits(v) >> 16) & 0x8000);
    float a = fabsf(v);
    if (std::isinf(a)) return sign | 0x7C00;
    if (a < 0x1p-14f) return sign | (uint16_t)(a * 0x1p24f);  // subnormal: a multiple of 2^-24
    int e;
    float m = frexpf(a, &e);  // a = m * 2^e, m in [0.5, 1)
    return sign | (uint16_t)((e + 14) << 10) | (uint16_t)((m * 2 - 1) * 1024);
  }
  static float decode(uint16_t b) {
    int exp = (b >> 10) & 0x1F, mant = b & 0x3FF;
    float a = exp == 0 ? ldexpf((float)mant, -24)
              : exp == 31 ? (mant ? NAN : INFINITY)
                          : ldexpf((float)(1024 + mant), exp - 25);
    return (b & 0x8000) ? -a : a;
  }
};

// x + err rounded once to T's bits; NaN becomes the canonical NaN 0x7FFF, as CUDA's conversions give.
template <typename T> inline uint16_t round_bits(double x, double err = 0) {
  if (std::isnan(x)) return 0x7FFF;
  return F16<T>::encode(round_to(F16<T>::format, x, err));
}
// x + y rounded once: two-sum recovers the double addition's exact error.
template <typename T> inline uint16_t sum_bits(double x, double y) {
  double s = x + y, bb = s - x, err = (x - (s - bb)) + (y - bb);
  return round_bits<T>(s, std::isfinite(s) ? err : 0);
}
template <typename T> inline float half_of(uint32_t packed, int i) {
  return F16<T>::decode((uint16_t)(packed >> (16 * i)));
}
template <typename T> inline T from_bits(uint16_t b) { T t; t.bits = b; return t; }
}  // namespace mtp_emu

// ---- scalars -----------------------------------------------------------------------------------------
MTP_DEVICE float mtp_to_float(__nv_bfloat16 x) { return mtp_emu::F16<__nv_bfloat16>::decode(x.bits); }
MTP_DEVICE float mtp_to_float(__half x) { return mtp_emu::F16<__half>::decode(x.bits); }
MTP_DEVICE float mtp_to_float(float x) { return x; }

template <typename T> MTP_DEVICE T mtp_from_float(float x);
template <> MTP_DEVICE __nv_bfloat16 mtp_from_float<__nv_bfloat16>(float x) {
  return mtp_emu::from_bits<__nv_bfloat16>(mtp_emu::round_bits<__nv_bfloat16>(x));
}
template <> MTP_DEVICE __half mtp_from_float<__half>(float x) {
  return mtp_emu::from_bits<__half>(mtp_emu::round_bits<__half>(x));
}
template <> MTP_DEVICE float mtp_from_float<float>(float x) { return x; }

MTP_DEVICE float mtp_as_float(uint32_t x) { return mtp_emu::bits_float(x); }
MTP_DEVICE uint32_t mtp_as_uint(float x) { return mtp_emu::float_bits(x); }
// __byte_perm: byte i of the result is byte (selector >> 4i) & 7 of the 8 bytes {b:a}.
MTP_DEVICE uint32_t mtp_prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint64_t v = (uint64_t)b << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
MTP_DEVICE float mtp_exp(float x) { return expf(x); }
MTP_DEVICE float mtp_inf() { return std::numeric_limits<float>::infinity(); }
MTP_DEVICE float mtp_rsqrt(float x) { return 1.0f / sqrtf(x); }
MTP_DEVICE void mtp_sincos(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }

// ---- packed pairs (low half first); each half is computed exactly and rounded once ---------------------
template <typename T> MTP_DEVICE uint32_t mtp_pack2(float lo, float hi) {
  static_assert(sizeof(mtp_emu::F16<T>) > 0, "mtp_pack2<T>: T is __nv_bfloat16 or __half");
  return mtp_emu::round_bits<T>(lo) | (uint32_t)mtp_emu::round_bits<T>(hi) << 16;
}
template <typename T> MTP_DEVICE float mtp_unpack(uint32_t pair, int i) { return mtp_emu::half_of<T>(pair, i); }
template <typename T> MTP_DEVICE uint32_t mtp_sub2(uint32_t a, uint32_t b) {
  using mtp_emu::half_of;
  uint32_t r = 0;
  for (int i = 0; i < 2; ++i)
    r |= (uint32_t)mtp_emu::sum_bits<T>(half_of<T>(a, i), -(double)half_of<T>(b, i)) << (16 * i);
  return r;
}
template <typename T> MTP_DEVICE uint32_t mtp_fma2(uint32_t a, uint32_t b, uint32_t c) {
  using mtp_emu::half_of;
  uint32_t r = 0;
  for (int i = 0; i < 2; ++i) {
    double product = (double)half_of<T>(a, i) * half_of<T>(b, i);  // exact: at most 22 significant bits
    r |= (uint32_t)mtp_emu::sum_bits<T>(product, half_of<T>(c, i)) << (16 * i);
  }
  return r;
}

// ---- fibers and barriers -----------------------------------------------------------------------------
namespace mtp_emu {
constexpr size_t kStackBytes = 256 << 10;
constexpr size_t kGuardBytes = 4096;  // PROT_NONE below each stack: an overflow faults

struct Fiber {
  ucontext_t ctx;
  char* stack;
  uint3 tid;
  bool done;
  const char* waiting;  // the barrier it waits in, for deadlock reports
};

// Counts arrivals; the last to arrive bumps `gen`, which releases the others.
struct Barrier { int expected = 0, arrived = 0; uint64_t gen = 0; const char* op = ""; };

// One lane's operands of a warp collective.
struct Slot { float f; uint32_t u; uint32_t a[4], b[2]; };

struct Runtime {
  std::vector<Fiber*> fibers;  // pointers: a ucontext_t must not move once made
  int current = 0;             // index == linear thread index in the block
  ucontext_t scheduler;
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
  uint64_t progress = 0;  // arrivals + finished threads; unchanged over a whole pass = deadlock
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<std::array<Slot, 64>> slots;  // per warp, two rounds of 32 (by barrier generation parity)
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  unsigned char* dynamic_shared = nullptr;
  size_t dynamic_shared_bytes = 0;
  std::vector<std::pair<const char*, size_t>> inputs;  // what mtp_load* may read
};
inline Runtime rt;

// Waits until `b.expected` threads have arrived. All of them must be in the same operation.
void arrive(Barrier& b, const char* op, const char* group);
// Sets up fibers and barriers for blocks of `block` threads, then runs the grid's blocks in order.
void run_grid(dim3 grid, dim3 block, void (*body)(void*), void* arg);

// A warp collective: deposit this lane's operands, wait for the whole warp, then compute this lane's
// result from everyone's. Two rounds of slots alternate, so a lane that races ahead into the next
// collective cannot overwrite operands that slower lanes are still reading.
template <typename F> inline auto warp_collective(const char* op, const Slot& mine, F result) {
  const int w = rt.current / 32, lane = rt.current % 32;
  Barrier& b = rt.warps[w];
  Slot* round = &rt.slots[w][32 * (b.gen & 1)];
  round[lane] = mine;
  arrive(b, op, "warp");
  return result(round, lane, b.expected);
}

inline int source_lane(const char* op, int lane, int warp_size) {
  if (lane >= warp_size) fail("%s reads lane %d, but this warp has only %d threads", op, lane, warp_size);
  return lane;
}

template <typename T> inline float a_elem(const Slot* s, int row, int col) {  // A, 16 x 16 row-major
  return half_of<T>(s[(row % 8) * 4 + (col % 8) / 2].a[row / 8 + 2 * (col / 8)], col % 2);
}
template <typename T> inline float b_elem(const Slot* s, int k, int col) {  // B, 16 x 8 column-major
  return half_of<T>(s[col * 4 + (k % 8) / 2].b[k / 8], k % 2);
}
}  // namespace mtp_emu

// ---- warps and blocks ---------------------------------------------------------------------------------
inline void __syncthreads() { mtp_emu::arrive(mtp_emu::rt.block, "__syncthreads", "block"); }

// Full-mask shuffles: like shfl.sync with c = 0x1f, only the lane operand's low 5 bits count.
MTP_DEVICE float mtp_shfl_xor(float v, int lane_mask) {
  return mtp_emu::warp_collective("mtp_shfl_xor", {v}, [&](const mtp_emu::Slot* s, int lane, int n) {
    return s[mtp_emu::source_lane("mtp_shfl_xor", lane ^ (lane_mask & 31), n)].f;
  });
}
MTP_DEVICE float mtp_shfl(float v, int src_lane) {
  return mtp_emu::warp_collective("mtp_shfl", {v}, [&](const mtp_emu::Slot* s, int, int n) {
    return s[mtp_emu::source_lane("mtp_shfl", src_lane & 31, n)].f;
  });
}
MTP_DEVICE uint32_t mtp_ballot(bool p) {
  return mtp_emu::warp_collective("mtp_ballot", {0, p}, [](const mtp_emu::Slot* s, int, int n) {
    uint32_t mask = 0;
    for (int i = 0; i < n; ++i) mask |= s[i].u << i;
    return mask;
  });
}
MTP_DEVICE int mtp_popc(uint32_t x) { return __builtin_popcount(x); }

// mma.sync.m16n8k16.row.col, fragments as documented in prelude.cuh. Each D element: its 16 products
// (exact in float) summed in float in k order, then added to d.
template <typename T> MTP_DEVICE void mtp_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  mtp_emu::Slot mine{0, 0, {a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  mtp_emu::warp_collective("mtp_mma", mine, [&](const mtp_emu::Slot* s, int lane, int n) {
    if (n != 32) mtp_emu::fail("mtp_mma needs a full warp, this one has %d threads", n);
    const int g = lane / 4, t = lane % 4;
    for (int r = 0; r < 4; ++r) {
      const int row = g + 8 * (r / 2), col = 2 * t + r % 2;
      float sum = 0;
      for (int k = 0; k < 16; ++k) sum += mtp_emu::a_elem<T>(s, row, k) * mtp_emu::b_elem<T>(s, k, col);
      d[r] += sum;
    }
    return 0;
  });
}

// ---- memory -------------------------------------------------------------------------------------------
namespace mtp_emu {
// The read-only path (__ldg) needs an aligned address in global memory that no thread writes: an input.
template <typename V> inline V load(const void* p, const char* op) {
  if ((uintptr_t)p % sizeof(V)) fail("%s(%p): address not %zu-byte aligned", op, p, sizeof(V));
  const char* c = static_cast<const char*>(p);
  for (auto [base, size] : rt.inputs)
    if (c >= base && c + sizeof(V) <= base + size) return *reinterpret_cast<const V*>(p);
  fail("%s(%p): not inside an input array (the read-only path is for kernel inputs only)", op, p);
}
}  // namespace mtp_emu
MTP_DEVICE uint4 mtp_load16(const void* p) { return mtp_emu::load<uint4>(p, "mtp_load16"); }
MTP_DEVICE uint2 mtp_load8(const void* p) { return mtp_emu::load<uint2>(p, "mtp_load8"); }
MTP_DEVICE uint32_t mtp_load4(const void* p) { return mtp_emu::load<uint32_t>(p, "mtp_load4"); }
MTP_DEVICE uint16_t mtp_load2(const void* p) { return mtp_emu::load<uint16_t>(p, "mtp_load2"); }

// Blocks run one after another: another block's writes are all there, and an atomic is a plain update.
MTP_DEVICE float mtp_load_coherent(const float* p) { return *p; }
MTP_DEVICE void mtp_fence() {}
MTP_DEVICE int mtp_atomic_add(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}

#define MTP_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(::mtp_emu::rt.dynamic_shared)

// ---- launcher for the generated main() ------------------------------------------------------------------
namespace mtp_emu {
// <dir>/launch.txt holds integers: grid blocks (3), block threads (3), dynamic shared bytes, then per
// input "nbytes ndim shape... strides...", per output "nbytes". Buffers are <dir>/in<i>.bin, out<i>.bin.
struct Launch {
  const char* dir;
  FILE* meta;
  dim3 grid, block;
  std::vector<char*> in, out;
  std::vector<size_t> out_bytes;
  std::vector<std::array<int64_t, 20>> dims;  // shape then strides
  std::vector<int> ndims;

  Launch(int argc, char** argv);
  std::string path(const std::string& name) const { return std::string(dir) + "/" + name; }
  int64_t next();
  static char* alloc(size_t bytes);  // exactly `bytes` long: ASan flags the byte past the end
  static char* read(const std::string& file, size_t bytes);
  template <typename T> const T* input(int i) const { return reinterpret_cast<const T*>(in[i]); }
  template <typename T> T* output(int i) const { return reinterpret_cast<T*>(out[i]); }
  template <typename T> NdArray<T> nd(int i, int offset, const char* name) const {
    NdArray<T> a{{}, ndims[i], name};
    for (int j = 0; j < 10; ++j) a.v[j] = (T)dims[i][offset + j];
    return a;
  }
  NdArray<int32_t> shape(int i, const char* name) const { return nd<int32_t>(i, 0, name); }
  NdArray<int64_t> strides(int i, const char* name) const { return nd<int64_t>(i, 10, name); }
  int ndim(int i) const { return ndims[i]; }

  template <typename F> void run(F& kernel) {
    run_grid(grid, block, [](void* k) { (*static_cast<F*>(k))(); }, &kernel);
  }
  int finish() const;  // writes the outputs back
};
}  // namespace mtp_emu

// ---- the runtime, compiled once (see the top) ---------------------------------------------------------
#ifdef MTP_EMU_IMPLEMENTATION
#if MTP_EMU_ASAN
// Leaks are no kernel bug, and the runtime's buffers live until exit.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
#endif
namespace mtp_emu {
void fail(const char* fmt, ...) {
  fprintf(stderr, "cuda_emu: block (%u,%u,%u) thread (%u,%u,%u): ", g_block_idx.x, g_block_idx.y,
          g_block_idx.z, g_thread_idx.x, g_thread_idx.y, g_thread_idx.z);
  va_list args;
  va_start(args, fmt);
  vfprintf(stderr, fmt, args);
  va_end(args);
  fputc('\n', stderr);
  fflush(stderr);
  _Exit(3);
}

static void switch_context(ucontext_t* from, ucontext_t* to, const void* to_stack, size_t to_size) {
#if MTP_EMU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, to_stack, to_size);
  swapcontext(from, to);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  (void)to_stack, (void)to_size;
  swapcontext(from, to);
#endif
}

static void yield() {
  switch_context(&rt.fibers[rt.current]->ctx, &rt.scheduler, rt.scheduler_stack, rt.scheduler_stack_size);
}

// A fiber runs the kernel once per block; it is resumed again only for the next block.
static void fiber_main() {
#if MTP_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &rt.scheduler_stack, &rt.scheduler_stack_size);
#endif
  for (;;) {
    rt.body(rt.body_arg);
    rt.fibers[rt.current]->done = true;
    ++rt.progress;
    yield();
  }
}

static Fiber* make_fiber() {
  auto* mem = (char*)mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) fail("cannot map a fiber stack");
  mprotect(mem, kGuardBytes, PROT_NONE);
  auto* f = new Fiber{};
  f->stack = mem + kGuardBytes;
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = f->stack;
  f->ctx.uc_stack.ss_size = kStackBytes;
  f->ctx.uc_link = nullptr;
  makecontext(&f->ctx, fiber_main, 0);
  // ASan's swapcontext interceptor unpoisons the whole stack named here on every switch, which
  // would hide overflows of the kernel's local arrays; the fiber annotations already tell it enough.
  f->ctx.uc_stack.ss_sp = nullptr;
  f->ctx.uc_stack.ss_size = 0;
  return f;
}

static Fiber& current() { return *rt.fibers[rt.current]; }

void arrive(Barrier& b, const char* op, const char* group) {
  if (b.arrived == 0) b.op = op;
  else if (strcmp(b.op, op) != 0) fail("calls %s while other threads of its %s are in %s", op, group, b.op);
  ++rt.progress;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.gen;
    return;
  }
  uint64_t gen = b.gen;
  current().waiting = op;
  do yield(); while (b.gen == gen);
  current().waiting = nullptr;
}

[[noreturn]] static void report_deadlock(int n) {
  fprintf(stderr, "cuda_emu: deadlock in block (%u,%u,%u); threads by linear index:\n", g_block_idx.x,
          g_block_idx.y, g_block_idx.z);
  for (int i = 0, j; i < n; i = j) {  // runs of threads in the same state
    const char* state = rt.fibers[i]->done ? "finished" : rt.fibers[i]->waiting;
    for (j = i + 1; j < n && (rt.fibers[j]->done ? "finished" : rt.fibers[j]->waiting) == state; ++j) {}
    fprintf(stderr, "  %d-%d (warps %d-%d): %s%s\n", i, j - 1, i / 32, (j - 1) / 32,
            rt.fibers[i]->done ? "" : "waiting in ", state);
  }
  fputs("cuda_emu: a warp collective needs every lane of its warp, __syncthreads every thread of the block\n",
        stderr);
  fflush(stderr);
  _Exit(3);
}

// Runs one block: passes over the unfinished threads until all are done.
static void run_block(uint3 block) {
  g_block_idx = block;
  const dim3 d = g_block_dim;
  const int n = (int)(d.x * d.y * d.z);
  memset(rt.dynamic_shared, 0xCD, rt.dynamic_shared_bytes);  // unwritten shared memory reads as garbage
  for (int i = 0; i < n; ++i) {
    Fiber& f = *rt.fibers[i];
    f.tid = {i % d.x, (i / d.x) % d.y, i / (d.x * d.y)};
    f.done = false;
  }
  for (;;) {
    uint64_t before = rt.progress;
    int live = 0;
    for (int i = 0; i < n; ++i) {
      Fiber& f = *rt.fibers[i];
      if (f.done) continue;
      rt.current = i;
      g_thread_idx = f.tid;
      switch_context(&rt.scheduler, &f.ctx, f.stack, kStackBytes);
      live += !f.done;
    }
    if (live == 0) return;
    if (rt.progress == before) report_deadlock(n);
  }
}

// Sanitizer reports name source lines only; say which CUDA thread it was.
static void name_the_thread() {
  fprintf(stderr, "cuda_emu: the error above happened in block (%u,%u,%u) thread (%u,%u,%u)\n", g_block_idx.x,
          g_block_idx.y, g_block_idx.z, g_thread_idx.x, g_thread_idx.y, g_thread_idx.z);
}

void run_grid(dim3 grid, dim3 block, void (*body)(void*), void* arg) {
#if MTP_EMU_ASAN
  __sanitizer_set_death_callback(name_the_thread);
#endif
  g_grid_dim = grid;
  g_block_dim = block;
  const int n = (int)(block.x * block.y * block.z), nwarps = (n + 31) / 32;
  while ((int)rt.fibers.size() < n) rt.fibers.push_back(make_fiber());
  rt.block = Barrier{n};
  rt.warps.assign(nwarps, Barrier{});
  for (int w = 0; w < nwarps; ++w) rt.warps[w].expected = std::min(32, n - 32 * w);
  rt.slots.assign(nwarps, {});
  rt.body = body;
  rt.body_arg = arg;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) run_block({x, y, z});
}

Launch::Launch(int argc, char** argv) : dir(argc > 1 ? argv[1] : ".") {
  meta = fopen(path("launch.txt").c_str(), "r");
  if (!meta) fail("cannot open %s/launch.txt", dir);
  grid = {(unsigned)next(), (unsigned)next(), (unsigned)next()};
  block = {(unsigned)next(), (unsigned)next(), (unsigned)next()};
  rt.dynamic_shared_bytes = next();
  rt.dynamic_shared = (unsigned char*)alloc(rt.dynamic_shared_bytes);
  const int n_in = (int)next(), n_out = (int)next();
  for (int i = 0; i < n_in; ++i) {
    size_t bytes = next();
    in.push_back(read(path("in" + std::to_string(i) + ".bin"), bytes));
    rt.inputs.push_back({in.back(), bytes});
    ndims.push_back((int)next());
    dims.emplace_back();
    for (int j = 0, nd = ndims.back(); j < 2 * nd; ++j) dims.back()[(j / nd) * 10 + j % nd] = next();
  }
  for (int i = 0; i < n_out; ++i) {
    out_bytes.push_back(next());
    out.push_back(read(path("out" + std::to_string(i) + ".bin"), out_bytes.back()));
  }
  fclose(meta);
}
int64_t Launch::next() {
  long long v;
  if (fscanf(meta, "%lld", &v) != 1) fail("launch.txt is truncated");
  return v;
}
char* Launch::alloc(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 256, bytes)) fail("out of memory (%zu bytes)", bytes);
  return (char*)p;
}
char* Launch::read(const std::string& file, size_t bytes) {
  char* p = alloc(bytes);
  FILE* f = fopen(file.c_str(), "rb");
  if (!f || fread(p, 1, bytes, f) != bytes) fail("cannot read %zu bytes from %s", bytes, file.c_str());
  fclose(f);
  return p;
}
int Launch::finish() const {
  for (size_t i = 0; i < out.size(); ++i) {
    FILE* f = fopen(path("out" + std::to_string(i) + ".bin").c_str(), "wb");
    if (!f || fwrite(out[i], 1, out_bytes[i], f) != out_bytes[i]) fail("cannot write output %zu", i);
    fclose(f);
  }
  return 0;
}
}  // namespace mtp_emu
#endif  // MTP_EMU_IMPLEMENTATION

// MLX's default header defines this; it comes last so that it cannot break the code above.
#define inf std::numeric_limits<float>::infinity()
