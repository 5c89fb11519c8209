/* The float32 softmax passes (simd.h's softmax_cols and exp_rows) for AVX2 + FMA: softmax_simd.h's
 * body on 8-float vectors. AVX2 has no vscalefps, so exp2 builds 2^r in the exponent bits, and
 * flushes results under float's normal range to 0 as simd.c's exp2_f32 does (softmax_cols' p:
 * under 2^-126.5); a row's tail is a vmaskmovps. Picked at run time with the other AVX2 variants. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define SOFTMAX_TARGET __attribute__((target("avx2,fma")))
#define SOFTMAX_SUF avx2x

#define V __m256
#define VL 8
#define V_SET1 _mm256_set1_ps
#define V_ZERO _mm256_setzero_ps()
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_FMADD _mm256_fmadd_ps
#define V_FMSUB _mm256_fmsub_ps
#define V_MAX _mm256_max_ps
#define V_NEG_INF_TO_ZERO(v) _mm256_andnot_ps(_mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), v)
/* lanes 0 .. n-1 on */
#define TAIL_MASK(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define V_LOAD_N(p, n) _mm256_maskload_ps(p, TAIL_MASK(n))
#define V_STORE_N(p, v, n) _mm256_maskstore_ps(p, TAIL_MASK(n), v)
#define EXP2_ROWS 4
#define EXP2_NONPOS_N exp2_nonpos_rows

SOFTMAX_TARGET static inline void exp2_nonpos_rows(__m256 *x);

#include "softmax_simd.h"

/* r = round(x) by adding 1.5 * 2^23 (floats there are integers: the addition rounds to nearest),
 * with the exponent bias added too, so that the sum's low bits shifted into the exponent field are 2^r. x is
 * capped at 127 first (its exponent must fit; min returns its second operand's NaN), and x under
 * float's normal range (-126) gives 0, as simd.c's exp2_f32: the compare is false for NaN, which
 * stays NaN, and true for -inf, whose f is NaN. */
#define EXP2_ROUNDER (0x1.8p23f + SIMD_F32_EXP_BIAS)

SOFTMAX_TARGET static inline __m256 exp2_v(__m256 x)
{
    __m256 xc = _mm256_min_ps(_mm256_set1_ps(SIMD_EXP2_MAX_F32), x);
    __m256 t = _mm256_add_ps(xc, _mm256_set1_ps(EXP2_ROUNDER));
    __m256 r = _mm256_sub_ps(t, _mm256_set1_ps(EXP2_ROUNDER));
    __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
    __m256 p = _mm256_mul_ps(exp2_poly(_mm256_sub_ps(xc, r)), scale);
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(SIMD_EXP2_MIN_F32), _CMP_LT_OQ), p);
}

/* exp2_v for EXP2_ROWS vectors of x <= 0 (scores less their column's maximum), in place, step
 * by step across the vectors: the out-of-order window alone overlaps too few rows' chains of
 * dependent FMAs (Zen 2, one core, 64 x 64 tile: 0.58 ns a score one row at a time, 0.49 with 4
 * rows, 0.47 with 8, each row's sum in memory then). With the sums in two registers and the rows
 * walked by pointer, 8 rows spill and 4 do not (Zen 5: 0.26 and 0.22 ns a score). Two operations
 * fewer than exp2_v: no cap at 127, and x floored at -127 instead of compared with -126: r = -127
 * puts 0 in 2^r's exponent field, so the product is 0 (for -inf too), and x in (-126.5, -126)
 * gives 2^x as a subnormal rather than 0. NaN survives the floor (max's second operand). */
SOFTMAX_TARGET static inline void exp2_nonpos_rows(__m256 *x)
{
    __m256 t[EXP2_ROWS], f[EXP2_ROWS], p[EXP2_ROWS];
    for (int u = 0; u < EXP2_ROWS; u++) {
        x[u] = _mm256_max_ps(_mm256_set1_ps(SIMD_EXP2_MIN_F32 - 1), x[u]);
        t[u] = _mm256_add_ps(x[u], _mm256_set1_ps(EXP2_ROUNDER));
    }
    for (int u = 0; u < EXP2_ROWS; u++)
        f[u] = _mm256_sub_ps(x[u], _mm256_sub_ps(t[u], _mm256_set1_ps(EXP2_ROUNDER)));
    static const float c[] = {SIMD_EXP2_C5, SIMD_EXP2_C4, SIMD_EXP2_C3, SIMD_EXP2_C2, SIMD_EXP2_C1,
                              1.0f};
    for (int u = 0; u < EXP2_ROWS; u++)
        p[u] = _mm256_set1_ps(SIMD_EXP2_C6);
    for (int k = 0; k < (int)(sizeof c / sizeof c[0]); k++)
        for (int u = 0; u < EXP2_ROWS; u++)
            p[u] = _mm256_fmadd_ps(p[u], f[u], _mm256_set1_ps(c[k]));
    for (int u = 0; u < EXP2_ROWS; u++)
        x[u] = _mm256_mul_ps(p[u],
                             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t[u]), 23)));
}
#endif
