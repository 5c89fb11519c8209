/* The float32 softmax passes (simd.h's softmax_cols and exp_rows) written once for every
 * instruction set that has hand-written ones: softmax_avx512.c, softmax_avx2.c and softmax_neon.c
 * each define the vector operations below and include this file, which defines
 * softmax_cols_f32_<SOFTMAX_SUF> and exp_rows_f32_<SOFTMAX_SUF> (simd.c puts them in its tables).
 *
 * What an includer defines, for a vector V of VL floats:
 *   SOFTMAX_TARGET, SOFTMAX_SUF        the functions' target attribute and name suffix
 *   V_SET1(x) V_ZERO V_LOAD(p) V_STORE(p, v)
 *   V_ADD V_SUB V_MUL (a, b); V_FMADD(a, b, c) = a b + c; V_FMSUB(a, b, c) = a b - c
 *   V_MAX(a, b)            the larger (which of a NaN and a number: as the instruction set does)
 *   V_NEG_INF_TO_ZERO(v)   v with its -inf lanes 0
 *   V_LOAD_N(p, n), V_STORE_N(p, v, n)   the first n < VL lanes, touching no memory past them
 *   EXP2_ROWS, EXP2_NONPOS_N(x)   (optional) x[u] <- 2^x[u] for the EXP2_ROWS vectors of x, each
 *                       lane <= 0, -inf or NaN (softmax_cols' exponents of a group of rows), where
 *                       several polynomials at once keep the FMA units busy; 2 and exp2_v if not
 * and, after including it, exp2_v (below).
 */
#include <math.h>
#include <string.h>

#include "simd.h"

#define SOFTMAX_CAT_(a, b) a##_##b
#define SOFTMAX_CAT(a, b) SOFTMAX_CAT_(a, b)
#define SOFTMAX_FN(name) SOFTMAX_CAT(name, SOFTMAX_SUF)

/* 2^f for |f| <= 1/2: simd.h's polynomial, by Horner's rule (fewest operations: the passes are
 * bound by their throughput, and Estrin's shorter chain measured slower). */
SOFTMAX_TARGET static inline V exp2_poly(V f)
{
    V p = V_SET1(SIMD_EXP2_C6);
    p = V_FMADD(p, f, V_SET1(SIMD_EXP2_C5));
    p = V_FMADD(p, f, V_SET1(SIMD_EXP2_C4));
    p = V_FMADD(p, f, V_SET1(SIMD_EXP2_C3));
    p = V_FMADD(p, f, V_SET1(SIMD_EXP2_C2));
    p = V_FMADD(p, f, V_SET1(SIMD_EXP2_C1));
    return V_FMADD(p, f, V_SET1(1.0f));
}

/* 2^x for x <= 0 and for -inf (-> 0); NaN stays NaN: x = r + f with r = round(x), 2^f by
 * exp2_poly, 2^r as the instruction set does it best. Defined by the includer, after this file. */
SOFTMAX_TARGET static inline V exp2_v(V x);

#ifndef EXP2_NONPOS_N
#define EXP2_ROWS 2
#define EXP2_NONPOS_N(x) ((x)[0] = exp2_v((x)[0]), (x)[1] = exp2_v((x)[1]))
#endif

/* a row of St times scale, stored rounded (scale 1: the row as it is) */
SOFTMAX_TARGET static inline V scaled_row(float *s, float scale, V vscale)
{
    V t = V_LOAD(s);
    if (scale != 1) {
        t = V_MUL(t, vscale);
        V_STORE(s, t);
    }
    return t;
}

/* simd.h's softmax_cols, VL queries at a time (cols is a multiple of SIMD_N_ALIGN, of VL). Rows
 * are walked by pointer, and the maximum and the sum each run in two chains (even and odd rows),
 * so that neither a max's nor an add's latency sets the pace. */
SOFTMAX_TARGET void SOFTMAX_FN(softmax_cols_f32)(int n, int cols, int64_t ld, float *St, float scale,
                                                  float *m, float *l, float *alpha)
{
    const V vscale = V_SET1(scale), log2e = V_SET1((float)SIMD_LOG2E);
    for (int c = 0; c < cols; c += VL) {
        const V m_old = V_LOAD(m + c);
        V mx0 = m_old, mx1 = m_old;
        float *s = St + c;
        int j = 0;
        for (; j + 2 <= n; j += 2, s += 2 * ld) {
            mx0 = V_MAX(mx0, scaled_row(s, scale, vscale));
            mx1 = V_MAX(mx1, scaled_row(s + ld, scale, vscale));
        }
        if (j < n)
            mx0 = V_MAX(mx0, scaled_row(s, scale, vscale));
        const V m_new = V_MAX(mx0, mx1);
        /* a query with no finite score yet keeps m = -inf; 0 stands in for it so that its p and
         * alpha come out 0 rather than NaN */
        const V safe = V_NEG_INF_TO_ZERO(m_new);
        const V a = exp2_v(V_MUL(V_SUB(m_old, safe), log2e));
        V sum0 = V_ZERO, sum1 = V_ZERO;
        s = St + c;
        j = 0;
        for (; j + EXP2_ROWS <= n; j += EXP2_ROWS, s += EXP2_ROWS * ld) {
            V p[EXP2_ROWS];
            for (int u = 0; u < EXP2_ROWS; u++)
                p[u] = V_MUL(V_SUB(V_LOAD(s + u * ld), safe), log2e);
            EXP2_NONPOS_N(p);
            for (int u = 0; u < EXP2_ROWS; u++) {
                V_STORE(s + u * ld, p[u]);
                if (u & 1)
                    sum1 = V_ADD(sum1, p[u]);
                else
                    sum0 = V_ADD(sum0, p[u]);
            }
        }
        for (; j < n; j++, s += ld) {   /* the rows after the last group of EXP2_ROWS */
            V p = exp2_v(V_MUL(V_SUB(V_LOAD(s), safe), log2e));
            V_STORE(s, p);
            sum1 = V_ADD(sum1, p);
        }
        V_STORE(alpha + c, a);
        V_STORE(l + c, V_FMADD(V_LOAD(l + c), a, V_ADD(sum0, sum1)));
        V_STORE(m + c, m_new);
    }
}

SOFTMAX_TARGET void SOFTMAX_FN(exp_rows_f32)(int rows, int n, int64_t ld, float *S, float scale,
                                              const float *m, const float *z)
{
    const V vscale = V_SET1(scale), log2e = V_SET1((float)SIMD_LOG2E);
    const int full = n / VL * VL, tail = n - full;
    for (int i = 0; i < rows; i++) {
        float *s = S + (int64_t)i * ld;
        if (m[i] == -INFINITY) {
            memset(s, 0, sizeof(float) * n);
            continue;
        }
        const V off = V_SET1(m[i]), zi = V_SET1(z[i]);
        /* t = s * scale stored rounded, as softmax_cols rounds it: a loop of its own, so that
         * the compiler cannot fuse the product into the subtraction (-ffp-contract=fast) */
        if (scale != 1) {
            for (int j = 0; j < full; j += VL)
                V_STORE(s + j, V_MUL(V_LOAD(s + j), vscale));
            if (tail)
                V_STORE_N(s + full, V_MUL(V_LOAD_N(s + full, tail), vscale), tail);
        }
        for (int j = 0; j < full; j += VL)
            V_STORE(s + j, exp2_v(V_FMSUB(V_SUB(V_LOAD(s + j), off), log2e, zi)));
        if (tail)
            V_STORE_N(s + full, exp2_v(V_FMSUB(V_SUB(V_LOAD_N(s + full, tail), off), log2e, zi)), tail);
    }
}
