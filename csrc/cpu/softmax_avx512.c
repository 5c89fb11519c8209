/* The float32 softmax passes (simd.h's softmax_cols and exp_rows) written for AVX-512: exp2 is a
 * polynomial and one vscalefps (p * 2^r without integer bit games), and a row's tail is a lane
 * mask instead of a scalar loop. Picked at run time with the other AVX-512 variants; never called
 * on a CPU without AVX-512. */
#include "simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512dq,fma")))

/* Below this, 2^x is 0 in float32 (the smallest subnormal is 2^-149). */
#define EXP2_FLOOR (-150.0f)

/* 2^x for x <= 0 and for -inf (-> 0); NaN stays NaN. x = r + f with r = round(x), |f| <= 1/2;
 * 2^f = e^(f ln 2) by its Taylor series to degree 7 (relative error < 1e-8). */
TARGET static inline __m512 exp2_ps(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(EXP2_FLOOR), x);   /* NaN in x wins (second operand) */
    __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, r), _mm512_set1_ps(SIMD_LN2_F32));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, r);
}

static inline __mmask16 tail_mask(int left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1); }

/* simd.h's softmax_cols, 16 queries at a time (cols is a multiple of SIMD_N_ALIGN). */
TARGET void softmax_cols_f32_avx512x(int n, int cols, int64_t ld, float *St, float scale, float *m,
                                     float *l, float *alpha)
{
    const __m512 vscale = _mm512_set1_ps(scale), log2e = _mm512_set1_ps((float)SIMD_LOG2E);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < cols; c += 16) {
        __m512 mx = _mm512_loadu_ps(m + c);
        for (int j = 0; j < n; j++) {
            float *s = St + (int64_t)j * ld + c;
            __m512 t = _mm512_loadu_ps(s);
            if (scale != 1) {
                t = _mm512_mul_ps(t, vscale);
                _mm512_storeu_ps(s, t);
            }
            mx = _mm512_max_ps(mx, t);
        }
        /* a query with no finite score yet keeps m = -inf; 0 stands in for it so that its p and
         * alpha come out 0 rather than NaN */
        __m512 safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), mx,
                                           _mm512_setzero_ps());
        __m512 a = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(m + c), safe), log2e));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            float *s = St + (int64_t)j * ld + c;
            __m512 p = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s), safe), log2e));
            _mm512_storeu_ps(s, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_storeu_ps(alpha + c, a);
        _mm512_storeu_ps(l + c, _mm512_fmadd_ps(_mm512_loadu_ps(l + c), a, sum));
        _mm512_storeu_ps(m + c, mx);
    }
}

TARGET void exp_rows_f32_avx512x(int rows, int n, int64_t ld, float *S, float scale, const float *m,
                                 const float *z)
{
    const __m512 vscale = _mm512_set1_ps(scale), log2e = _mm512_set1_ps((float)SIMD_LOG2E);
    for (int i = 0; i < rows; i++) {
        float *s = S + (int64_t)i * ld;
        if (m[i] == -INFINITY) {
            memset(s, 0, sizeof(float) * n);
            continue;
        }
        const __m512 off = _mm512_set1_ps(m[i]), zi = _mm512_set1_ps(z[i]);
        /* t = s * scale stored rounded, as softmax_cols rounds it: a loop of its own, so that
         * the compiler cannot fuse the product into the subtraction (-ffp-contract=fast) */
        if (scale != 1)
            for (int j = 0; j < n; j += 16) {
                __mmask16 k = tail_mask(n - j);
                _mm512_mask_storeu_ps(s + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), vscale));
            }
        for (int j = 0; j < n; j += 16) {
            __mmask16 k = tail_mask(n - j);
            __m512 t = _mm512_maskz_loadu_ps(k, s + j);
            __m512 p = exp2_ps(_mm512_fmsub_ps(_mm512_sub_ps(t, off), log2e, zi));
            _mm512_mask_storeu_ps(s + j, k, p);
        }
    }
}
#endif
