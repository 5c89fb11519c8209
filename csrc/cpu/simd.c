/* SIMD variants of the CPU backend's hot loops (see simd.h), generated from one macro body per
 * (type, instruction set): GCC/Clang vector extensions for the register-blocked matrix product,
 * `omp simd` loops for the softmax passes, except float32's on AVX-512, AVX2 and NEON, written
 * with intrinsics (softmax_simd.h). The best variant is picked once, at run time, from what the
 * CPU reports; the build never targets the build machine. */
#include "simd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* a variant may replace a generic function with a hand-written one (softmax_simd.h's) */
#define UNUSED __attribute__((unused))

/* 2^x for x <= 0, float: split x = i + f with |f| <= 1/2, 2^f by simd.h's polynomial, 2^i
 * through the exponent bits. Results under float's normal range flush to 0, so exp2(-inf) = 0
 * exactly as masked scores need. */
static inline __attribute__((always_inline)) float exp2_f32(float x)
{
    float xc = x < SIMD_EXP2_MIN_F32 ? SIMD_EXP2_MIN_F32 : (x > SIMD_EXP2_MAX_F32 ? SIMD_EXP2_MAX_F32 : x);
    float r = rintf(xc);
    float f = xc - r;
    float p = 1.0f + f * (SIMD_EXP2_C1 + f * (SIMD_EXP2_C2 + f * (SIMD_EXP2_C3 + f * (SIMD_EXP2_C4
              + f * (SIMD_EXP2_C5 + f * SIMD_EXP2_C6)))));
    int32_t bits = ((int32_t)r + SIMD_F32_EXP_BIAS) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < SIMD_EXP2_MIN_F32 ? 0.0f : p * scale;
}

static inline __attribute__((always_inline)) double exp2_f64(double x) { return exp2(x); }

/* What precedes the K loop of GEMM_ROWS: a variant's unrolling hint, set around its
 * DEFINE_VARIANT (macros expand where the variant is defined); none by default. */
#define GEMM_K_HINT

/* The register-blocked product: an MRX x NV block of vectors of C stays in registers while K
 * streams, for every block of rows i .. i + MRX. A_BLOCK is where the block's A starts and A_AT
 * reads its element (row a, step k), so one body serves A (gemm) and A stored transposed
 * (gemm_tn); C's rows start as 0, as C, or as C times row_scale (NULL unless the caller's
 * `accumulate` is 2: gemm_tn_scaled). */
#define GEMM_ROWS(T, VT, VL, MRX, NV, A_BLOCK, A_AT)                                                \
    for (int j = 0; j < N; j += VL * NV) {                                                          \
        VT##_u acc[MRX][NV];                                                                        \
        for (int a = 0; a < MRX; a++)                                                               \
            for (int v = 0; v < NV; v++) {                                                          \
                acc[a][v] = accumulate ? *(const VT##_u *)(C + (i + a) * ldc + j + v * VL)          \
                                       : (VT##_u){0};                                               \
                if (accumulate == 2)                                                                \
                    acc[a][v] *= row_scale[i + a];                                                  \
            }                                                                                       \
        const T *Ai = A_BLOCK;                                                                      \
        const T *Bj = B + j;                                                                        \
        GEMM_K_HINT                                                                                 \
        for (int k = 0; k < K; k++) {                                                               \
            VT##_u b[NV];                                                                           \
            for (int v = 0; v < NV; v++)                                                            \
                b[v] = *(const VT##_u *)(Bj + k * ldb + v * VL);                                    \
            for (int a = 0; a < MRX; a++) {                                                         \
                T s = A_AT;                                                                         \
                for (int v = 0; v < NV; v++)                                                        \
                    acc[a][v] += s * b[v];                                                          \
            }                                                                                       \
        }                                                                                           \
        for (int a = 0; a < MRX; a++)                                                               \
            for (int v = 0; v < NV; v++)                                                            \
                *(VT##_u *)(C + (i + a) * ldc + j + v * VL) = acc[a][v];                            \
    }

/* C (M x N) (+)= A B in blocks of MR rows. An MR that does not divide SIMD_M_ALIGN (AVX2's 6)
 * leaves a rest of M (a multiple of 2), taken with the last block of MR rows as 5 + 5 rows (a
 * rest of 4: the tiles' 64 rows) or 4 + 4 (a rest of 2), whose 10 and 8 accumulators keep the
 * FMA pipes busier than a block of 4 or 2 rows alone (Zen 2, 64-row tiles: a 4-row block took
 * 8% of the product's time for 6% of its rows). */
#define GEMM_FN(NAME, TARGET, T, VT, VL, MR, NV, A_BLOCK, A_AT)                                     \
    TARGET static inline __attribute__((always_inline)) void                                        \
    NAME##_body(int M, int N, int K, const T *A, int64_t lda, const T *B, int64_t ldb, T *C,        \
                int64_t ldc, int accumulate, const T *row_scale)                                    \
    {                                                                                               \
        int i = 0;                                                                                  \
        const int rest = M % MR, last = rest && M >= MR + rest ? MR + rest : rest;                    \
        for (; i + last < M; i += MR)                                                               \
            GEMM_ROWS(T, VT, VL, MR, NV, A_BLOCK, A_AT)                                             \
        if (SIMD_M_ALIGN % MR) {                                                                    \
            if (M - i == 10)                                                                        \
                for (; i < M; i += 5)                                                               \
                    GEMM_ROWS(T, VT, VL, 5, NV, A_BLOCK, A_AT)                                      \
            for (; i + 4 <= M; i += 4)                                                              \
                GEMM_ROWS(T, VT, VL, 4, NV, A_BLOCK, A_AT)                                          \
            for (; i < M; i += 2)                                                                   \
                GEMM_ROWS(T, VT, VL, 2, NV, A_BLOCK, A_AT)                                          \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    TARGET static void NAME(int M, int N, int K, const T *A, int64_t lda, const T *B, int64_t ldb, \
                            T *C, int64_t ldc, int accumulate)                                      \
    {                                                                                               \
        NAME##_body(M, N, K, A, lda, B, ldb, C, ldc, accumulate != 0, NULL);                        \
    }

/* One variant. VT is a vector of VL elements of T; the product keeps an MR x NV block of vectors
 * of C in registers and streams K. */
#define DEFINE_VARIANT(SUF, TARGET, T, VT, VL, MR, NV, EXP2)                                        \
    typedef T VT##_u __attribute__((vector_size(VL * sizeof(T)), aligned(sizeof(T))));             \
                                                                                                    \
    GEMM_FN(gemm_##SUF, TARGET, T, VT, VL, MR, NV, A + (int64_t)i * lda, Ai[(int64_t)a * lda + k]) \
    GEMM_FN(gemm_tn_##SUF, TARGET, T, VT, VL, MR, NV, A + i, Ai[(int64_t)k * lda + a])         \
                                                                                                    \
    TARGET static void gemm_tn_scaled_##SUF(int M, int N, int K, const T *A, int64_t lda,          \
                                            const T *B, int64_t ldb, T *C, int64_t ldc,            \
                                            const T *row_scale)                                    \
    {                                                                                               \
        gemm_tn_##SUF##_body(M, N, K, A, lda, B, ldb, C, ldc, 2, row_scale);                        \
    }                                                                                               \
                                                                                                    \
    /* simd.h's transpose, by blocks of SIMD_M_ALIGN x SIMD_M_ALIGN (both sides in cache) */     \
    TARGET UNUSED static void transpose_##SUF(int rows, int cols, const T *A, int64_t lda, T *B,  \
                                              int64_t ldb)                                          \
    {                                                                                               \
        for (int r0 = 0; r0 < rows; r0 += SIMD_M_ALIGN)                                             \
            for (int c0 = 0; c0 < cols; c0 += SIMD_M_ALIGN)                                         \
                for (int c = c0; c < c0 + SIMD_M_ALIGN; c++)                                        \
                    for (int r = r0; r < r0 + SIMD_M_ALIGN; r++)                                    \
                        B[(int64_t)c * ldb + r] = A[(int64_t)r * lda + c];                          \
    }                                                                                               \
                                                                                                    \
    /* Online-softmax step over transposed scores (see simd.h): every pass is a vertical        \
     * vector operation across the `cols` queries, with no horizontal reduction. */             \
    TARGET UNUSED static void softmax_cols_##SUF(int n, int cols, int64_t ld, T *St, T scale, T *m, \
                                                 T *l, T *alpha)                                    \
    {                                                                                               \
        const T log2e = (T)SIMD_LOG2E;                                                              \
        T mx[SIMD_MAX_COLS], sum[SIMD_MAX_COLS];                                                    \
        for (int c = 0; c < cols; c++) {                                                            \
            mx[c] = m[c];                                                                           \
            sum[c] = 0;                                                                             \
        }                                                                                           \
        for (int j = 0; j < n; j++) {                                                               \
            T *s = St + (int64_t)j * ld;                                                            \
            if (scale != 1) {                                                                       \
                _Pragma("omp simd")                                                                 \
                for (int c = 0; c < cols; c++) {                                                    \
                    T t = s[c] * scale;                                                             \
                    s[c] = t;                                                                       \
                    mx[c] = t > mx[c] ? t : mx[c];                                                  \
                }                                                                                   \
            } else {                                                                                \
                _Pragma("omp simd")                                                                 \
                for (int c = 0; c < cols; c++)                                                      \
                    mx[c] = s[c] > mx[c] ? s[c] : mx[c];                                            \
            }                                                                                       \
        }                                                                                           \
        /* a query with no finite score yet keeps m = -inf; 0 stands in so that its p and alpha \
         * come out 0 (exp2(-inf)) rather than NaN */                                               \
        _Pragma("omp simd")                                                                         \
        for (int c = 0; c < cols; c++) {                                                            \
            T safe = mx[c] == -INFINITY ? 0 : mx[c];                                                \
            alpha[c] = EXP2((m[c] - safe) * log2e);                                                 \
            m[c] = mx[c];                                                                           \
            mx[c] = safe;                                                                           \
        }                                                                                           \
        for (int j = 0; j < n; j++) {                                                               \
            T *s = St + (int64_t)j * ld;                                                            \
            _Pragma("omp simd")                                                                     \
            for (int c = 0; c < cols; c++) {                                                        \
                T p = EXP2((s[c] - mx[c]) * log2e);                                                 \
                s[c] = p;                                                                           \
                sum[c] += p;                                                                        \
            }                                                                                       \
        }                                                                                           \
        for (int c = 0; c < cols; c++)                                                              \
            l[c] = l[c] * alpha[c] + sum[c];                                                        \
    }                                                                                               \
                                                                                                    \
    TARGET UNUSED static void exp_rows_##SUF(int rows, int n, int64_t ld, T *S, T scale, const T *m, \
                                             const T *z)                                            \
    {                                                                                               \
        const T log2e = (T)SIMD_LOG2E;                                                              \
        for (int i = 0; i < rows; i++) {                                                            \
            T *s = S + (int64_t)i * ld;                                                             \
            const T off = m[i], zi = z[i];                                                          \
            if (off == -INFINITY) {                                                                 \
                memset(s, 0, sizeof(T) * n);                                                        \
                continue;                                                                           \
            }                                                                                       \
            if (scale != 1) {   /* its own loop: t rounded, never fused into the subtraction */     \
                _Pragma("omp simd")                                                                 \
                for (int j = 0; j < n; j++)                                                         \
                    s[j] *= scale;                                                                  \
            }                                                                                       \
            _Pragma("omp simd")                                                                     \
            for (int j = 0; j < n; j++)                                                             \
                s[j] = EXP2((s[j] - off) * log2e - zi);                                             \
        }                                                                                           \
    }


#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
DEFINE_VARIANT(f32_avx512, TARGET_AVX512, float, vf32_512, 16, 8, 2, exp2_f32)
DEFINE_VARIANT(f64_avx512, TARGET_AVX512, double, vf64_512, 8, 8, 2, exp2_f64)
/* AVX2's 16 ymm registers: a 6 x 2 block (12 accumulators) covers the FMA pipes' latency where
 * 4 x 2 did not (Zen 2: 5 cycles on 2 pipes; 4 x 2 ran 74-79 GF/s a core, 6 x 2 94-97) */
/* ... and its K loop unrolled twice: the loop's counter, pointer steps and branch once for 24
 * FMAs, not 12 (Zen 2, fresh processes alternating, min of 10 calls: forward B1 S1024 H8 D128
 * 28.6 -> 28.3 ms, D64 15.3 -> 15.0, B2 S4096 D128 835 -> 818; backward D128 71.7 -> 70.4) */
#undef GEMM_K_HINT
#define GEMM_K_HINT _Pragma("GCC unroll 2")
DEFINE_VARIANT(f32_avx2, TARGET_AVX2, float, vf32_256, 8, 6, 2, exp2_f32)
#undef GEMM_K_HINT
#define GEMM_K_HINT
DEFINE_VARIANT(f64_avx2, TARGET_AVX2, double, vf64_256, 4, 4, 2, exp2_f64)
#define HAVE_X86_VARIANTS 1
#endif
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
/* NEON is baseline on aarch64: 16-byte vectors are NEON registers, 32 of them, so an 8 x 2 block
 * (16 accumulators) where the portable variant keeps 4 x 2 */
DEFINE_VARIANT(f32_neon, , float, vf32_neon, 4, 8, 2, exp2_f32)
DEFINE_VARIANT(f64_neon, , double, vf64_neon, 2, 8, 2, exp2_f64)
#define HAVE_NEON_VARIANTS 1
#endif
DEFINE_VARIANT(f32_portable, , float, vf32_128, 4, 4, 2, exp2_f32)
DEFINE_VARIANT(f64_portable, , double, vf64_128, 2, 4, 2, exp2_f64)

#define OPS(T, SUF, NAME) {NAME, gemm_##SUF, gemm_tn_##SUF, gemm_tn_scaled_##SUF, transpose_##SUF,    \
                           softmax_cols_##SUF, exp_rows_##SUF}

static const simd_ops_f32 ops_f32_portable = OPS(float, f32_portable, "portable");
static const simd_ops_f64 ops_f64_portable = OPS(double, f64_portable, "portable");
/* softmax_avx512.c, softmax_avx2.c, softmax_neon.c: the float32 softmax passes written with
 * intrinsics (softmax_simd.h) */
#define DECLARE_SOFTMAX_F32(SUF)                                                                   \
    void softmax_cols_f32_##SUF(int n, int cols, int64_t ld, float *St, float scale, float *m,    \
                                float *l, float *alpha);                                          \
    void exp_rows_f32_##SUF(int rows, int n, int64_t ld, float *S, float scale, const float *m,   \
                            const float *z);
#ifdef HAVE_NEON_VARIANTS
DECLARE_SOFTMAX_F32(neonx)
static const simd_ops_f32 ops_f32_neon = {"neon", gemm_f32_neon, gemm_tn_f32_neon,
                                          gemm_tn_scaled_f32_neon, transpose_f32_neon,
                                          softmax_cols_f32_neonx,
                                          exp_rows_f32_neonx};
static const simd_ops_f64 ops_f64_neon = OPS(double, f64_neon, "neon");
#endif
#ifdef HAVE_X86_VARIANTS
#include <immintrin.h>

/* simd.h's transpose by 8 x 8 blocks of ymm shuffles (AVX-512 takes it too): the generic loop's
 * element-by-element copy cost the forward ~0.9% at D128 (perf, S1024) */
TARGET_AVX2 static void transpose_f32_avx2x(int rows, int cols, const float *A, int64_t lda, float *B,
                                            int64_t ldb)
{
    for (int r0 = 0; r0 < rows; r0 += 8)
        for (int c0 = 0; c0 < cols; c0 += 8) {
            __m256 x[8], y[8];
            for (int r = 0; r < 8; r++)
                x[r] = _mm256_loadu_ps(A + (int64_t)(r0 + r) * lda + c0);
            for (int r = 0; r < 8; r += 2) {   /* pairs of rows interleaved */
                y[r] = _mm256_unpacklo_ps(x[r], x[r + 1]);
                y[r + 1] = _mm256_unpackhi_ps(x[r], x[r + 1]);
            }
            for (int r = 0; r < 8; r += 4)     /* then pairs of pairs */
                for (int u = 0; u < 2; u++) {
                    x[r + u] = _mm256_shuffle_ps(y[r + u], y[r + u + 2], _MM_SHUFFLE(1, 0, 1, 0));
                    x[r + u + 2] = _mm256_shuffle_ps(y[r + u], y[r + u + 2], _MM_SHUFFLE(3, 2, 3, 2));
                }
            /* x[0..3]: columns 0 2 1 3 (lanes: 0-3 | 4-7 of the row block) from rows 0-3, x[4..7]
             * the same from rows 4-7; the 128-bit halves then make the columns */
            static const int col_of[4] = {0, 2, 1, 3};
            for (int u = 0; u < 4; u++) {
                const int c = col_of[u];
                _mm256_storeu_ps(B + (int64_t)(c0 + c) * ldb + r0, _mm256_permute2f128_ps(x[u], x[u + 4], 0x20));
                _mm256_storeu_ps(B + (int64_t)(c0 + c + 4) * ldb + r0, _mm256_permute2f128_ps(x[u], x[u + 4], 0x31));
            }
        }
}

DECLARE_SOFTMAX_F32(avx512x)
DECLARE_SOFTMAX_F32(avx2x)
static const simd_ops_f32 ops_f32_avx512 = {"avx512", gemm_f32_avx512, gemm_tn_f32_avx512,
                                            gemm_tn_scaled_f32_avx512, transpose_f32_avx2x,
                                            softmax_cols_f32_avx512x,
                                            exp_rows_f32_avx512x};
static const simd_ops_f64 ops_f64_avx512 = OPS(double, f64_avx512, "avx512");
static const simd_ops_f32 ops_f32_avx2 = {"avx2", gemm_f32_avx2, gemm_tn_f32_avx2,
                                          gemm_tn_scaled_f32_avx2, transpose_f32_avx2x,
                                          softmax_cols_f32_avx2x,
                                          exp_rows_f32_avx2x};
static const simd_ops_f64 ops_f64_avx2 = OPS(double, f64_avx2, "avx2");
#endif

/* 0 portable, 1 avx2 (x86) or neon (aarch64), 2 avx512; ATTNEXT_SIMD=portable|avx2|neon|avx512
 * caps it (tests run every variant this CPU has). Racing first calls compute the same value, so
 * no lock is needed. */
static int chosen_level(void)
{
    static volatile int level = -1;
    if (level >= 0)
        return level;
    int best = 0;
#ifdef HAVE_X86_VARIANTS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        best = 1;
    if (best == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512dq"))
        best = 2;
#endif
#ifdef HAVE_NEON_VARIANTS
    best = 1;
#endif
    const char *env = getenv("ATTNEXT_SIMD");
    if (env) {
        int cap = !strcmp(env, "portable") ? 0 : !strcmp(env, "avx2") || !strcmp(env, "neon") ? 1 : 2;
        if (cap < best)
            best = cap;
    }
    level = best;
    return best;
}

const simd_ops_f32 *simd_f32(void)
{
#ifdef HAVE_X86_VARIANTS
    switch (chosen_level()) {
    case 2: return &ops_f32_avx512;
    case 1: return &ops_f32_avx2;
    }
#endif
#ifdef HAVE_NEON_VARIANTS
    if (chosen_level() == 1)
        return &ops_f32_neon;
#endif
    return &ops_f32_portable;
}

const simd_ops_f64 *simd_f64(void)
{
#ifdef HAVE_X86_VARIANTS
    switch (chosen_level()) {
    case 2: return &ops_f64_avx512;
    case 1: return &ops_f64_avx2;
    }
#endif
#ifdef HAVE_NEON_VARIANTS
    if (chosen_level() == 1)
        return &ops_f64_neon;
#endif
    return &ops_f64_portable;
}

const char *simd_name(void) { return simd_f32()->name; }
