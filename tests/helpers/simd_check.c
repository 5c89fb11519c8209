/* Checks every entry of the SIMD table this process picks (csrc/cpu/simd.h: gemm, gemm_tn,
 * softmax_cols, exp_rows; float and double) against plain scalar loops in double, on random data
 * with -inf, NaN, huge scores, ragged tails and the edge cases simd.h documents. Built on its own
 * with csrc/cpu/simd.c and the softmax_*.c files, natively and cross-compiled for aarch64 (run
 * under qemu): tests/unit/test_simd_native.py.
 *
 *     simd_check                  prints the variant this process picks (simd_name())
 *     simd_check NAME [SEED]      checks it; NAME: the variant it must be (ATTNEXT_SIMD caps it)
 *
 * Prints the first few failures and a summary; exit status 0 when all pass.
 *
 * Legend: gemm C (M x N) = A (M x K) B (K x N), gemm_tn A stored (K x M); softmax_cols
 * St (n keys x cols queries); exp_rows S (rows x n). ld* are leading dimensions in elements.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_REPORTS 5
#define LOG2E SIMD_LOG2E

static uint64_t rng_state;
static int failures, reports;

static uint64_t next_u64(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* uniform in [-1, 1) */
static double uniform(void) { return (double)(next_u64() >> 11) / (double)(1ull << 52) - 1.0; }

static int below(int n) { return (int)(next_u64() % (uint64_t)n); }

static void fail(const char *what, const char *fmt, double got, double want, int i, int j)
{
    failures++;
    if (reports++ < MAX_REPORTS)
        printf("FAIL %s [%d, %d]: got %.9g, want %.9g%s\n", what, i, j, got, want, fmt);
}

/* |got - want| within rel * scale + abs; NaN only where NaN is wanted, +-inf likewise */
static int close_to(double got, double want, double rel, double scale, double abs)
{
    if (got == want)
        return 1;
    if (isnan(want) || isnan(got))
        return isnan(want) && isnan(got);
    if (isinf(want) || isinf(got))
        return got == want;
    return fabs(got - want) <= rel * scale + abs;
}

/* One check per (type, entry), for T = float and double: EPS is T's unit roundoff, T_MAX its
 * largest finite value, OPS its table; a variant may return 0 instead of 2^x under 2^EXP2_FLOOR
 * (float: the normal range; double: never), so results under TINY = 2^EXP2_FLOOR compare as 0. */
#define DEFINE_CHECKS(T, SUF, OPS, EPS, T_MAX, EXP2_FLOOR, TINY)                                               \
    static T *alloc_##SUF(int64_t n)                                                                \
    {                                                                                               \
        T *p = (T *)malloc(sizeof(T) * (size_t)(n ? n : 1));                                        \
        if (!p) {                                                                                   \
            fprintf(stderr, "out of memory\n");                                                     \
            exit(2);                                                                                \
        }                                                                                           \
        return p;                                                                                   \
    }                                                                                               \
                                                                                                    \
    /* C (+)= A B or A^T B (tn 1), or C = diag(rs) C + A^T B (tn 2: gemm_tn_scaled, rs holding 0,   \
     * 1 and others); C's padding (columns past N, rows past M) must stay as it was, a NaN in C     \
     * must not leak into an overwrite, and K = 0 leaves 0, C or rs C. */                           \
    static void check_gemm_##SUF(int tn, int M, int N, int K, int accumulate)                       \
    {                                                                                               \
        const char *what = tn == 2 ? #SUF " gemm_tn_scaled" : tn ? #SUF " gemm_tn" : #SUF " gemm"; \
        accumulate |= tn == 2;                                                                      \
        const int64_t rows_a = tn ? K : M, cols_a = tn ? M : K;                                     \
        const int64_t lda = cols_a + below(5), ldb = N + below(9), ldc = N + 1 + below(9);         \
        const int64_t MC = M + 2;                                                                   \
        T *A = alloc_##SUF(rows_a * lda), *B = alloc_##SUF((int64_t)K * ldb);                       \
        T *C = alloc_##SUF(MC * ldc), *C0 = alloc_##SUF(MC * ldc), *rs = alloc_##SUF(M);            \
        for (int i = 0; i < M; i++) rs[i] = below(3) == 0 ? 1 : below(2) == 0 ? 0 : (T)uniform();   \
        for (int64_t x = 0; x < rows_a * lda; x++) A[x] = (T)uniform();                             \
        for (int64_t x = 0; x < (int64_t)K * ldb; x++) B[x] = (T)uniform();                         \
        for (int64_t x = 0; x < MC * ldc; x++)                                                      \
            C0[x] = C[x] = accumulate || x >= (int64_t)M * ldc || x % ldc >= N ? (T)uniform() : (T)NAN; \
        if (tn == 2)                                                                                \
            OPS->gemm_tn_scaled(M, N, K, A, lda, B, ldb, C, ldc, rs);                               \
        else if (tn)                                                                                \
            OPS->gemm_tn(M, N, K, A, lda, B, ldb, C, ldc, accumulate);                              \
        else                                                                                        \
            OPS->gemm(M, N, K, A, lda, B, ldb, C, ldc, accumulate);                                 \
        for (int i = 0; i < MC; i++)                                                                \
            for (int j = 0; j < ldc; j++) {                                                         \
                double want = C0[i * ldc + j], mag = 0;                                             \
                if (i < M && j < N) {                                                               \
                    want = tn == 2 ? (T)(want * rs[i]) : accumulate ? want : 0;                     \
                    mag = fabs(want);                                                               \
                    for (int k = 0; k < K; k++) {                                                   \
                        double a = tn ? A[k * lda + i] : A[i * lda + k];                            \
                        want += a * B[k * ldb + j];                                                 \
                        mag += fabs(a * B[k * ldb + j]);                                            \
                    }                                                                               \
                }                                                                                   \
                double got = C[i * ldc + j];                                                        \
                int ok = i < M && j < N ? close_to(got, want, 4 * EPS * (K + 2), mag, 0)            \
                                        : memcmp(&C[i * ldc + j], &C0[i * ldc + j], sizeof(T)) == 0; \
                if (!ok)                                                                            \
                    fail(what, i < M && j < N ? "" : " (outside C: must be untouched)", got, want, i, j); \
            }                                                                                       \
        free(A); free(B); free(C); free(C0); free(rs);                                              \
    }                                                                                               \
                                                                                                    \
    /* B = A^T exactly, nothing of B outside the transpose touched */                               \
    static void check_transpose_##SUF(int rows, int cols)                                           \
    {                                                                                               \
        const char *what = #SUF " transpose";                                                      \
        const int64_t lda = cols + below(9), ldb = rows + 1 + below(9), nb = (int64_t)(cols + 1) * ldb; \
        T *A = alloc_##SUF((int64_t)rows * lda), *B = alloc_##SUF(nb), *B0 = alloc_##SUF(nb);        \
        for (int64_t x = 0; x < (int64_t)rows * lda; x++) A[x] = (T)uniform();                      \
        for (int64_t x = 0; x < nb; x++) B0[x] = B[x] = (T)uniform();                               \
        OPS->transpose(rows, cols, A, lda, B, ldb);                                                 \
        for (int c = 0; c <= cols; c++)                                                             \
            for (int r = 0; r < ldb; r++) {                                                         \
                const T want = c < cols && r < rows ? A[(int64_t)r * lda + c] : B0[c * ldb + r];    \
                if (memcmp(&B[c * ldb + r], &want, sizeof(T)))                                      \
                    fail(what, "", B[c * ldb + r], want, r, c);                                     \
            }                                                                                       \
        free(A); free(B); free(B0);                                                                 \
    }                                                                                               \
                                                                                                    \
    /* exp2 itself: S = 0, m = 0 and z = -x give P = 2^x with no rounding before the exponent       \
     * (scale 1). x spans the edges: 0 (exactly 1), underflow, -inf, NaN, the top of the range,     \
     * and past it (an lse under the row's scores, never a forward's): 2^127 at least, or +inf. */ \
    static void check_exp2_##SUF(int flush_to_zero)                                                 \
    {                                                                                               \
        const char *what = #SUF " exp2 (exp_rows)";                                                 \
        static const double edges[] = {0, -0.5, 0.5, -1, 1, -0.25, -3.75, -20.5, -100, -125.5,     \
                                       -125.9, -126, -126.25, -126.5, -127, -140, -149, -150,       \
                                       -151, -1000, -1e30, 126.9, 127, 127.6, 128.5, 200, 1e30};    \
        const int n_edge = (int)(sizeof edges / sizeof edges[0]), rows = n_edge + 200 + 2;          \
        const int n = 1 + below(40);                                                                \
        T *S = alloc_##SUF((int64_t)rows * n), *m = alloc_##SUF(rows), *z = alloc_##SUF(rows);      \
        double *x = (double *)malloc(sizeof(double) * rows);                                        \
        for (int i = 0; i < rows; i++) {                                                            \
            x[i] = i < n_edge ? edges[i] : i < rows - 2 ? 30 * uniform() - 20                        \
                 : i == rows - 2 ? -INFINITY : NAN;                                                 \
            m[i] = 0;                                                                               \
            z[i] = (T)-x[i];                                                                        \
            x[i] = -(double)z[i];     /* x as T holds it */                                         \
            for (int j = 0; j < n; j++) S[i * n + j] = 0;                                           \
        }                                                                                           \
        OPS->exp_rows(rows, n, n, S, 1, m, z);                                                      \
        for (int i = 0; i < rows; i++)                                                              \
            for (int j = 0; j < n; j++) {                                                           \
                double got = S[i * n + j], want = exp2(x[i]);                                       \
                int ok;                                                                             \
                if (x[i] > 127)                                                                     \
                    ok = got >= 0x1p127;                                                            \
                else if (x[i] < EXP2_FLOOR)      /* 0 or, without a flush, 2^x rounded */           \
                    ok = got == 0 || (!flush_to_zero && close_to(got, want, 8 * EPS, want, TINY));  \
                else                                                                                \
                    ok = close_to(got, want, 8 * EPS, want, 0);                                     \
                if (x[i] == 0 && got != 1)                                                          \
                    ok = 0;                                                                         \
                if (!ok)                                                                            \
                    fail(what, " (x = -z of this row)", got, want, i, j);                           \
            }                                                                                       \
        free(S); free(m); free(z); free(x);                                                         \
    }                                                                                               \
                                                                                                    \
    /* Scores of awkward kinds: -inf (masked), NaN, huge finite, ordinary. */                       \
    static T score_##SUF(int kind)                                                                  \
    {                                                                                               \
        switch (kind) {                                                                             \
        case 0: return (T)-INFINITY;                                                                \
        case 1: return (T)NAN;                                                                      \
        case 2: return (T)(-T_MAX * (0.5 + 0.5 * fabs(uniform())));                                \
        default: return (T)(8 * uniform());                                                         \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* S (rows x n, row stride ld > n: the columns past n must stay as they were); per row          \
     * m = lse (some -inf: the row becomes 0 whatever S holds) and z (0 mostly). */                 \
    static void check_exp_rows_##SUF(int rows, int n, T scale)                                      \
    {                                                                                               \
        const char *what = #SUF " exp_rows";                                                        \
        const int64_t ld = n + below(17);                                                           \
        T *S = alloc_##SUF(rows * ld), *S0 = alloc_##SUF(rows * ld);                                \
        T *m = alloc_##SUF(rows), *z = alloc_##SUF(rows);                                           \
        for (int i = 0; i < rows; i++) {                                                            \
            int dead = below(6) == 0;                                                               \
            m[i] = dead ? (T)-INFINITY : (T)(4 + 4 * uniform());                                    \
            z[i] = below(3) == 0 ? (T)(2 * fabs(uniform())) : 0;                                    \
            for (int64_t j = 0; j < ld; j++)                                                        \
                S0[i * ld + j] = S[i * ld + j] = below(10) == 0 ? score_##SUF(below(2) + (dead ? 1 : 0)) \
                                                                : (T)(8 * uniform() / scale);        \
        }                                                                                           \
        OPS->exp_rows(rows, n, ld, S, scale, m, z);                                                 \
        for (int i = 0; i < rows; i++)                                                              \
            for (int64_t j = 0; j < ld; j++) {                                                      \
                double got = S[i * ld + j];                                                         \
                if (j >= n) {                                                                       \
                    if (memcmp(&S[i * ld + j], &S0[i * ld + j], sizeof(T)))                         \
                        fail(what, " (past n: must be untouched)", got, S0[i * ld + j], i, (int)j); \
                    continue;                                                                       \
                }                                                                                   \
                T t = S0[i * ld + j] * scale;     /* rounded to T, as simd.h says */                \
                double xd = ((double)t - m[i]) * LOG2E - z[i];                                      \
                double want = m[i] == -INFINITY ? 0 : exp2(xd);                                     \
                if (!close_to(got, want, 8 * EPS * (1 + fabs(xd)), want, TINY))                     \
                    fail(what, "", got, want, i, (int)j);                                           \
            }                                                                                       \
        free(S); free(S0); free(m); free(z);                                                        \
    }                                                                                               \
                                                                                                    \
    /* One online-softmax step over St (n x cols, stride ld): columns of every kind, m carried in   \
     * (some -inf, some above every score), l carried in. */                                        \
    static void check_softmax_cols_##SUF(int n, int cols, T scale)                                  \
    {                                                                                               \
        const char *what = #SUF " softmax_cols";                                                    \
        const int64_t ld = cols + SIMD_N_ALIGN * below(2) + below(5);                               \
        T *St = alloc_##SUF(n * ld + 1), *S0 = alloc_##SUF(n * ld + 1);                             \
        T *m = alloc_##SUF(cols), *l = alloc_##SUF(cols), *alpha = alloc_##SUF(cols);                \
        T *m0 = alloc_##SUF(cols), *l0 = alloc_##SUF(cols);                                         \
        for (int c = 0; c < cols; c++) {                                                            \
            /* kind: 0 masked column, 1 a NaN in it, 2 huge finite scores, 3 ordinary (mostly) */   \
            int kind = c < 3 ? c : 3 + below(8);                                                    \
            int kind3 = kind > 3 ? 3 : kind;                                                        \
            int carried = below(4);                                                                 \
            m0[c] = m[c] = carried == 0 ? (T)-INFINITY : carried == 1 ? (T)(100 * scale + 200)      \
                                                                   : (T)(8 * uniform());            \
            l0[c] = l[c] = m[c] == -INFINITY ? 0 : (T)(1 + 10 * fabs(uniform()));                    \
            if (kind3 == 2) {                                                                       \
                m0[c] = m[c] = (T)-INFINITY;                                                        \
                l0[c] = l[c] = 0;                                                                   \
            }                                                                                       \
            for (int j = 0; j < n; j++) {                                                           \
                T s = kind3 == 0 ? (T)-INFINITY                                                     \
                    : kind3 == 1 && j == n / 2 ? (T)NAN                                             \
                    : kind3 == 2 ? score_##SUF(2)                                                   \
                    : below(8) == 0 ? (T)-INFINITY : (T)(8 * uniform() / scale);                    \
                St[j * ld + c] = s;                                                                 \
            }                                                                                       \
        }                                                                                           \
        for (int j = 0; j < n; j++)                                                                 \
            for (int64_t c = cols; c < ld; c++)                                                     \
                St[j * ld + c] = (T)uniform();                                                      \
        memcpy(S0, St, sizeof(T) * (size_t)(n * ld));                                               \
        OPS->softmax_cols(n, cols, ld, St, scale, m, l, alpha);                                     \
        for (int c = 0; c < cols; c++) {                                                            \
            T mx = m0[c];                                                                           \
            int has_nan = 0;                                                                        \
            for (int j = 0; j < n; j++) {                                                           \
                T t = S0[j * ld + c] * scale;                                                       \
                has_nan |= isnan(t);                                                                \
                if (t > mx) mx = t;                                                                 \
            }                                                                                       \
            double safe = mx == -INFINITY ? 0 : mx, sum = 0;                                        \
            /* a NaN column: its sum is NaN; its maximum and other p are the variant's business */ \
            for (int j = 0; j < n && has_nan; j++)                                                  \
                if (isnan(S0[j * ld + c]) && !isnan(St[j * ld + c]))                                \
                    fail(what, " (p of a NaN score)", St[j * ld + c], NAN, j, c);                   \
            for (int j = 0; j < n && !has_nan; j++) {                                               \
                T t = S0[j * ld + c] * scale;                                                       \
                double want = exp2(((double)t - safe) * LOG2E), got = St[j * ld + c];               \
                sum += want;                                                                        \
                /* the maximum's p is exactly 1; a NaN score's p is NaN */                          \
                double x = ((double)t - safe) * LOG2E;                                              \
                int ok = t == mx && mx != -INFINITY ? got == 1 : close_to(got, want, 8 * EPS * (1 + fabs(x)), want, TINY); \
                if (!ok)                                                                            \
                    fail(what, " (p)", got, want, j, c);                                            \
            }                                                                                       \
            double a = exp2(((double)m0[c] - safe) * LOG2E);                                        \
            double lw = (double)l0[c] * a + sum;                                                    \
            if (!has_nan && memcmp(&m[c], &mx, sizeof(T)))                                          \
                fail(what, " (m)", m[c], mx, -1, c);                                                \
            if (!has_nan && (mx == m0[c] ? alpha[c] != (mx == -INFINITY ? 0 : 1)                    \
                                         : !close_to(alpha[c], a, 8 * EPS * (1 + fabs(log2(a))), a, TINY))) \
                fail(what, " (alpha)", alpha[c], a, -1, c);                                         \
            if (has_nan ? !isnan(l[c]) : !close_to(l[c], lw, 8 * EPS * (n + 2), lw, 0))             \
                fail(what, " (l)", l[c], lw, -1, c);                                                \
        }                                                                                           \
        for (int j = 0; j < n; j++)                                                                 \
            for (int64_t c = cols; c < ld; c++)                                                     \
                if (memcmp(&St[j * ld + c], &S0[j * ld + c], sizeof(T)))                            \
                    fail(what, " (past cols: must be untouched)", St[j * ld + c], S0[j * ld + c], j, (int)c); \
        free(St); free(S0); free(m); free(l); free(alpha); free(m0); free(l0);                      \
    }                                                                                               \
                                                                                                    \
    static void check_all_##SUF(int flush_to_zero)                                                  \
    {                                                                                               \
        /* M: AVX2's 6-row blocks end in 4 + 4 (8, 56), 5 + 5 (16, 64), or no rest (48) */        \
        static const int Ms[] = {SIMD_M_ALIGN, 2 * SIMD_M_ALIGN, 48, 56, 64};                       \
        static const int Ns[] = {SIMD_N_ALIGN, 64, 96};                                             \
        static const int Ks[] = {0, 1, 3, 17, 64, 129};                                             \
        for (int tn = 0; tn < 3; tn++)                                                              \
            for (int a = 0; a < 5; a++)                                                             \
                for (int b = 0; b < 3; b++)                                                         \
                    for (int k = 0; k < 6; k++)                                                     \
                        check_gemm_##SUF(tn, Ms[a], Ns[b], Ks[k], below(2));                        \
        for (int a = 0; a < 5; a++)                                                                 \
            for (int b = 0; b < 3; b++)                                                             \
                check_transpose_##SUF(Ms[a], Ns[b]);                                                \
        check_exp2_##SUF(flush_to_zero);                                                            \
        static const int ns[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64};                        \
        for (int k = 0; k < 12; k++) {                                                              \
            check_exp_rows_##SUF(1 + below(70), ns[k], 1);                                          \
            check_exp_rows_##SUF(1 + below(70), ns[k], (T)0.125);                                   \
        }                                                                                           \
        static const int cs[] = {SIMD_N_ALIGN, 64, SIMD_MAX_COLS};                                  \
        static const int nk[] = {0, 1, 5, 64};                                                      \
        for (int a = 0; a < 3; a++)                                                                 \
            for (int k = 0; k < 4; k++) {                                                           \
                check_softmax_cols_##SUF(nk[k], cs[a], 1);                                          \
                check_softmax_cols_##SUF(nk[k], cs[a], (T)0.125);                                   \
            }                                                                                       \
    }

DEFINE_CHECKS(float, f32, simd_f32(), FLT_EPSILON / 2, FLT_MAX, SIMD_EXP2_MIN_F32, 0x1p-126)
DEFINE_CHECKS(double, f64, simd_f64(), DBL_EPSILON / 2, DBL_MAX, -HUGE_VAL, 0.0)

int main(int argc, char **argv)
{
    if (argc < 2) {
        printf("%s\n", simd_name());
        return 0;
    }
    rng_state = argc > 2 ? strtoull(argv[2], NULL, 0) : 0x9e3779b97f4a7c15ull;
    if (!rng_state)
        rng_state = 1;
    if (strcmp(simd_name(), argv[1]) || strcmp(simd_f64()->name, argv[1])) {
        printf("FAIL the variant: simd_name() is %s (double: %s), want %s\n", simd_name(),
               simd_f64()->name, argv[1]);
        return 1;
    }
    /* every variant but AVX-512's (vscalefps rounds to subnormals) returns 0 under 2^-126 */
    const int flush = strcmp(argv[1], "avx512") != 0;
    check_all_f32(flush);
    check_all_f64(flush);
    printf("%s: %d failures (seed %s)\n", argv[1], failures, argc > 2 ? argv[2] : "default");
    return failures ? 1 : 0;
}
