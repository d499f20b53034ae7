/* Weight-streaming small-row cblas_sgemm for the benchmark's "streaming" regime (an EMULATION
 * of the bandwidth-bound regime of Apple GPUs, where a verify forward of K+1 tokens costs about
 * one decode step).
 *
 * MLX's CPU backend computes a Linear layer x @ W.T with one call
 *     cblas_sgemm(RowMajor, NoTrans, Trans, M, N, K, alpha, x, lda, W, ldb, beta, C, ldc)
 * where W is the (N, K) weight and M = batch x tokens. Stock MKL repacks W for a few rows, so a
 * 4-row call costs several 1-row calls. Here, for 1 <= M <= 8, each pair of weight rows is read
 * once and multiplied against all M rows of x (AVX-512, x stays in cache), so the cost is that of
 * streaming W once, as on a bandwidth-bound GPU. One row is served here too, so that a decode step
 * and a verify run on the same kernel. Every other call goes to MKL's cblas_sgemm, handed over by
 * streaming_sgemm_init. Built and loaded in-process by apps/bench/regime.py.
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, MIN_ROWS = 1, MAX_ROWS = 8 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn fallback;
static long streamed, forwarded;

/* Returns 0 when ready; -1 without AVX-512F (the caller refuses the regime), -2 without MKL. */
int streaming_sgemm_init(void *mkl_sgemm) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f"))
        return -1;
    if (!mkl_sgemm)
        return -2;
    fallback = (sgemm_fn)mkl_sgemm;
    return 0;
}

/* Calls served here / forwarded to MKL since the last reset. */
void streaming_sgemm_counts(long *out_streamed, long *out_forwarded, int reset) {
    *out_streamed = streamed;
    *out_forwarded = forwarded;
    if (reset)
        streamed = forwarded = 0;
}

#define KERNEL __attribute__((target("avx512f,fma"), always_inline)) static inline

/* out[m][r] = dot(A row m, W row r) for R (1 or 2) weight rows read once for all M rows. */
KERNEL void block(const int M, const int R, int K, const float *A, int lda, const float *W, int ldb,
                  float out[MAX_ROWS][2]) {
    __m512 acc[MAX_ROWS][2];
    for (int m = 0; m < M; m++)
        acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 w0 = _mm512_loadu_ps(W + k);
        __m512 w1 = R > 1 ? _mm512_loadu_ps(W + ldb + k) : w0;
        /* the next pair of rows: a row is often one 4 KB page, where hardware prefetch stops */
        _mm_prefetch((const char *)(W + 2L * ldb + k), _MM_HINT_T0);
        _mm_prefetch((const char *)(W + 3L * ldb + k), _MM_HINT_T0);
        for (int m = 0; m < M; m++) {
            __m512 x = _mm512_loadu_ps(A + (long)m * lda + k);
            acc[m][0] = _mm512_fmadd_ps(x, w0, acc[m][0]);
            if (R > 1)
                acc[m][1] = _mm512_fmadd_ps(x, w1, acc[m][1]);
        }
    }
    if (k < K) { /* K not a multiple of 16: masked loads read nothing past the row */
        __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);
        __m512 w0 = _mm512_maskz_loadu_ps(tail, W + k);
        __m512 w1 = R > 1 ? _mm512_maskz_loadu_ps(tail, W + ldb + k) : w0;
        for (int m = 0; m < M; m++) {
            __m512 x = _mm512_maskz_loadu_ps(tail, A + (long)m * lda + k);
            acc[m][0] = _mm512_fmadd_ps(x, w0, acc[m][0]);
            if (R > 1)
                acc[m][1] = _mm512_fmadd_ps(x, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++)
            out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

KERNEL void rows(const int M, int N, int K, float alpha, const float *A, int lda, const float *W, int ldb,
                 float beta, float *C, int ldc) {
    float out[MAX_ROWS][2];
    for (int n = 0; n < N; n += 2) {
        const int R = n + 1 < N ? 2 : 1;
        if (R == 2)
            block(M, 2, K, A, lda, W + (long)n * ldb, ldb, out);
        else
            block(M, 1, K, A, lda, W + (long)n * ldb, ldb, out);
        for (int m = 0; m < M; m++)
            for (int r = 0; r < R; r++) {
                float *c = C + (long)m * ldc + n + r;
                *c = alpha * out[m][r] + (beta == 0.0f ? 0.0f : beta * *c); /* beta 0: C may be garbage */
            }
    }
}

/* x rows copied to a 64-byte aligned buffer: MLX's arrays are 16-byte aligned, and split-line
 * loads of up to 8 rows per weight chunk cost more than streaming the weights. */
static float *aligned_rows(int M, int K, const float *A, int lda) {
    static __thread float *buf;
    static __thread size_t capacity;
    size_t need = (size_t)M * K;
    if (need > capacity) {
        free(buf);
        capacity = 0;
        buf = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
        if (!buf) {
            fputs("streaming_sgemm: out of memory\n", stderr);
            abort();
        }
        capacity = need;
    }
    for (int m = 0; m < M; m++)
        memcpy(buf + (size_t)m * K, A + (size_t)m * lda, K * sizeof(float));
    return buf;
}

__attribute__((target("avx512f,fma"))) static void stream(int M, int N, int K, float alpha, const float *A,
                                                           int lda, const float *W, int ldb, float beta,
                                                           float *C, int ldc) {
    const float *X = aligned_rows(M, K, A, lda);
    switch (M) { /* M as a compile-time constant: the accumulators stay in registers */
    case 1: rows(1, N, K, alpha, X, K, W, ldb, beta, C, ldc); break;
    case 2: rows(2, N, K, alpha, X, K, W, ldb, beta, C, ldc); break;
    case 3: rows(3, N, K, alpha, X, K, W, ldb, beta, C, ldc); break;
    case 4: rows(4, N, K, alpha, X, K, W, ldb, beta, C, ldc); break;
    case 5: rows(5, N, K, alpha, X, K, W, ldb, beta, C, ldc); break;
    case 6: rows(6, N, K, alpha, X, K, W, ldb, beta, C, ldc); break;
    case 7: rows(7, N, K, alpha, X, K, W, ldb, beta, C, ldc); break;
    default: rows(8, N, K, alpha, X, K, W, ldb, beta, C, ldc); break;
    }
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A,
                 int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (!fallback) {
        fputs("streaming_sgemm: cblas_sgemm called before streaming_sgemm_init\n", stderr);
        abort();
    }
    if (order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && M >= MIN_ROWS && M <= MAX_ROWS && K > 0) {
        __atomic_add_fetch(&streamed, 1, __ATOMIC_RELAXED);
        stream(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    __atomic_add_fetch(&forwarded, 1, __ATOMIC_RELAXED);
    fallback(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
