/* The float32 softmax passes (simd.h's softmax_cols and exp_rows) for aarch64's NEON:
 * softmax_simd.h's body on 4-float vectors. exp2 builds 2^r in the exponent bits and flushes
 * results under float's normal range to 0, as simd.c's exp2_f32 does; NEON has no masked loads,
 * so a row's tail goes through a 4-float buffer. NEON is baseline on aarch64: no target
 * attribute, and the neon table is the default there (simd.c). */
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include <arm_neon.h>
#include <string.h>

#define SOFTMAX_TARGET
#define SOFTMAX_SUF neonx

#define V float32x4_t
#define VL 4
#define V_SET1 vdupq_n_f32
#define V_ZERO vdupq_n_f32(0.0f)
#define V_LOAD vld1q_f32
#define V_STORE vst1q_f32
#define V_ADD vaddq_f32
#define V_SUB vsubq_f32
#define V_MUL vmulq_f32
#define V_FMADD(a, b, c) vfmaq_f32(c, a, b)
#define V_FMSUB(a, b, c) vfmaq_f32(vnegq_f32(c), a, b)
#define V_MAX vmaxq_f32
#define V_NEG_INF_TO_ZERO(v) vbslq_f32(vceqq_f32(v, vdupq_n_f32(-INFINITY)), vdupq_n_f32(0.0f), v)

static inline float32x4_t load_n(const float *p, int n)
{
    float buf[VL] = {0};
    memcpy(buf, p, sizeof(float) * n);
    return vld1q_f32(buf);
}

static inline void store_n(float *p, float32x4_t v, int n)
{
    float buf[VL];
    vst1q_f32(buf, v);
    memcpy(p, buf, sizeof(float) * n);
}

#define V_LOAD_N load_n
#define V_STORE_N store_n

#include "softmax_simd.h"

/* x capped at 127 so that r + 127 fits the exponent field (vminq keeps a NaN); x under float's
 * normal range (-126) gives 0, as simd.c's exp2_f32: the compare is false for NaN, which stays
 * NaN, and true for -inf, whose f is NaN. */
static inline float32x4_t exp2_v(float32x4_t x)
{
    float32x4_t xc = vminq_f32(vdupq_n_f32(SIMD_EXP2_MAX_F32), x);
    float32x4_t r = vrndnq_f32(xc);
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(r), vdupq_n_s32(SIMD_F32_EXP_BIAS)), 23);
    float32x4_t p = vmulq_f32(exp2_poly(vsubq_f32(xc, r)), vreinterpretq_f32_s32(e));
    uint32x4_t under = vcltq_f32(x, vdupq_n_f32(SIMD_EXP2_MIN_F32));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(p), under));
}
#endif
