/* The CPU backend's hot loops: tile matrix products and the softmax passes, one table of
 * function pointers per accumulation type, filled at first use with the best variant this CPU
 * runs (AVX-512, AVX2+FMA, NEON on aarch64, or portable C). Nothing here is tuned to the build machine.
 *
 * Tiles are row-major with a leading dimension (ld, in elements). For gemm, M must be a multiple
 * of SIMD_M_ALIGN and N a multiple of SIMD_N_ALIGN; K is any. Callers pad their tiles (with zeros
 * where a padded element could reach a result they read).
 */
#ifndef ATTNEXT_SIMD_H
#define ATTNEXT_SIMD_H

#include <stdint.h>

#define SIMD_M_ALIGN 8
#define SIMD_N_ALIGN 32
#define SIMD_MAX_COLS 256

/* Every float exp2 variant computes 2^f, |f| <= 1/2, as 1 + sum of C_k f^k, k = 1 .. 6: the
 * polynomial of least relative error on [-1/2, 1/2] with 1 at f = 0 (the maximum's p stays
 * exactly 1), fitted in float64 and rounded to float. Its error, 1.6e-8, is under float's
 * rounding: by Horner's rule with FMA it is within 7.9e-8 of 2^f, as the degree-7 Taylor series
 * used before was (7.0e-8), one FMA a value fewer (Zen 2: softmax_cols 6% faster). */
#define SIMD_EXP2_C1 0.693147182f
#define SIMD_EXP2_C2 0.240226477f
#define SIMD_EXP2_C3 0.0555033237f
#define SIMD_EXP2_C4 0.00961843692f
#define SIMD_EXP2_C5 0.00133988622f
#define SIMD_EXP2_C6 0.000153533299f
#define SIMD_LOG2E 1.4426950408889634
/* float exp2's range: under 2^-126 (float's smallest normal) the variants without vscalefps
 * return 0; 2^127 is the largest power of two a float holds */
#define SIMD_EXP2_MIN_F32 (-126.0f)
#define SIMD_EXP2_MAX_F32 127.0f
#define SIMD_F32_EXP_BIAS 127   /* 2^r is the float whose exponent field holds r + this */

typedef struct {
    const char *name;
    /* C[M x N] (+)= A[M x K] * B[K x N]; accumulate = 0 overwrites C */
    void (*gemm)(int M, int N, int K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, int accumulate);
    /* C[M x N] (+)= A^T B with A stored (K x M) row-major: the backward's P^T dO and dS^T Q */
    void (*gemm_tn)(int M, int N, int K, const float *A, int64_t lda, const float *B, int64_t ldb,
                    float *C, int64_t ldc, int accumulate);
    /* C[M x N] = diag(row_scale) C + A^T B, A as gemm_tn's (row_scale: M values): the forward's
     * O = alpha O + P V, the rescale done where C's rows enter the registers (each row's product
     * C * row_scale rounded, then the sum, as a separate pass over O would) */
    void (*gemm_tn_scaled)(int M, int N, int K, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, const float *row_scale);
    /* B[cols x rows] = A^T, A[rows x cols] (rows and cols multiples of SIMD_M_ALIGN): the
     * forward's Q tile, transposed for St = K Q^T */
    void (*transpose)(int rows, int cols, const float *A, int64_t lda, float *B, int64_t ldb);
    /* Online-softmax step over transposed scores St[n keys x cols queries] (row stride ld), in
     * natural units: St <- t = St * scale, stored rounded (scale 1: St already holds the scores),
     * then per query c: m_new = max(m, max_j t); St <- exp2((t - m_new) log2 e); l <- l * alpha +
     * column sum; alpha[c] = exp2((m_old - m_new) log2 e). Subtracting the maximum before the
     * change of units keeps huge finite scores finite (-FLT_MAX * log2 e overflows) and gives
     * the maximum's p exactly 1 (t * log2e - m * log2e fused by FMA does not). A query still
     * without a finite score keeps m = -inf and gets P = 0, alpha = 0. cols <= SIMD_MAX_COLS. */
    void (*softmax_cols)(int n, int cols, int64_t ld, float *St, float scale, float *m, float *l,
                         float *alpha);
    /* The backward's P: S[i, j] <- exp2((t - m[i]) log2 e - z[i]) with t = S[i, j] * scale stored
     * rounded first, as softmax_cols rounds it; m = lse, z = 0 for most rows, the row's maximum
     * and log2 of its sum where lse lost them (cpu_impl.h's row_stats). Rows with m = -inf get 0. */
    void (*exp_rows)(int rows, int n, int64_t ld, float *S, float scale, const float *m,
                     const float *z);
} simd_ops_f32;

typedef struct {
    const char *name;
    void (*gemm)(int M, int N, int K, const double *A, int64_t lda, const double *B, int64_t ldb,
                 double *C, int64_t ldc, int accumulate);
    void (*gemm_tn)(int M, int N, int K, const double *A, int64_t lda, const double *B, int64_t ldb,
                    double *C, int64_t ldc, int accumulate);
    void (*gemm_tn_scaled)(int M, int N, int K, const double *A, int64_t lda, const double *B,
                           int64_t ldb, double *C, int64_t ldc, const double *row_scale);
    void (*transpose)(int rows, int cols, const double *A, int64_t lda, double *B, int64_t ldb);
    void (*softmax_cols)(int n, int cols, int64_t ld, double *St, double scale, double *m,
                         double *l, double *alpha);
    void (*exp_rows)(int rows, int n, int64_t ld, double *S, double scale, const double *m,
                     const double *z);
} simd_ops_f64;

const simd_ops_f32 *simd_f32(void);
const simd_ops_f64 *simd_f64(void);

/* "avx512", "avx2", "neon" or "portable": what simd_f32() chose (ATTNEXT_SIMD caps it). */
const char *simd_name(void);

#endif
