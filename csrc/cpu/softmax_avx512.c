/* The float32 softmax passes (simd.h's softmax_cols and exp_rows) for AVX-512: softmax_simd.h's
 * body on 16-float vectors. exp2 ends in one vscalefps (p * 2^r without integer bit games), and a
 * row's tail is a lane mask. Picked at run time with the other AVX-512 variants; never called on
 * a CPU without AVX-512. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define SOFTMAX_TARGET __attribute__((target("avx512f,avx512dq,fma")))
#define SOFTMAX_SUF avx512x

#define V __m512
#define VL 16
#define V_SET1 _mm512_set1_ps
#define V_ZERO _mm512_setzero_ps()
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_FMADD _mm512_fmadd_ps
#define V_FMSUB _mm512_fmsub_ps
#define V_MAX _mm512_max_ps
#define V_NEG_INF_TO_ZERO(v) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), v, _mm512_setzero_ps())
#define TAIL_MASK(n) ((__mmask16)((1u << (n)) - 1))
#define V_LOAD_N(p, n) _mm512_maskz_loadu_ps(TAIL_MASK(n), p)
#define V_STORE_N(p, v, n) _mm512_mask_storeu_ps(p, TAIL_MASK(n), v)

#include "softmax_simd.h"

/* vscalefps gives 0 below 2^-149 (the smallest subnormal) by itself; the floor keeps -inf out of
 * the polynomial, and NaN in x survives it (x is max's second operand). */
SOFTMAX_TARGET static inline __m512 exp2_v(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);
    __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp2_poly(_mm512_sub_ps(x, r)), r);
}
#endif
