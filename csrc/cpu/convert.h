/* Element conversions between the storage dtypes and the accumulation types, and strided row
 * loads/stores built on them. Scalar bit manipulation, portable C: conversions cost O(S * D)
 * per head, against the O(S^2 * D) products they feed. */
#ifndef ATTNEXT_CONVERT_H
#define ATTNEXT_CONVERT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attn_params.h"

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f)                                       /* inf, nan */
        return f32_from_bits(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {                                        /* zero, subnormal */
        float v = (float)man * 5.9604644775390625e-08f;    /* 2^-24 */
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

/* Round to nearest even; overflow to inf, NaN stays NaN. */
static inline uint16_t f32_to_f16(float f)
{
    uint32_t u = bits_from_f32(f), sign = (u >> 16) & 0x8000;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u)
        return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0));
    if (a >= 0x477ff000u)                                  /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00);
    if (a < 0x38800000u) {                                 /* below 2^-14: subnormal or 0 */
        float v = f32_from_bits(a) * 16777216.0f;          /* in units of 2^-24 */
        return (uint16_t)(sign | (uint32_t)nearbyintf(v));
    }
    uint32_t r = a + 0xfff + ((a >> 13) & 1);              /* round to nearest even */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u = bits_from_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);               /* quiet NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* dst[i] = (double)src[i * stride] for i < n */
static inline void load_row_f64(const void *src, int64_t stride, int64_t n, attn_dtype dt,
                                double *dst)
{
    int64_t i;
    switch (dt) {
    case DT_F16: for (i = 0; i < n; i++) dst[i] = f16_to_f32(((const uint16_t *)src)[i * stride]); break;
    case DT_BF16: for (i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i * stride]); break;
    case DT_F32: for (i = 0; i < n; i++) dst[i] = ((const float *)src)[i * stride]; break;
    case DT_F64: for (i = 0; i < n; i++) dst[i] = ((const double *)src)[i * stride]; break;
    }
}

static inline void load_row_f32(const void *src, int64_t stride, int64_t n, attn_dtype dt,
                                float *dst)
{
    int64_t i;
    switch (dt) {
    case DT_F16: for (i = 0; i < n; i++) dst[i] = f16_to_f32(((const uint16_t *)src)[i * stride]); break;
    case DT_BF16: for (i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i * stride]); break;
    case DT_F32:
        if (stride == 1)
            memcpy(dst, src, sizeof(float) * n);
        else
            for (i = 0; i < n; i++) dst[i] = ((const float *)src)[i * stride];
        break;
    case DT_F64: for (i = 0; i < n; i++) dst[i] = (float)((const double *)src)[i * stride]; break;
    }
}

/* dst[i * stride] = src[i] converted to dt, for i < n */
static inline void store_row_f32(void *dst, int64_t stride, int64_t n, attn_dtype dt,
                                 const float *src)
{
    int64_t i;
    switch (dt) {
    case DT_F16: for (i = 0; i < n; i++) ((uint16_t *)dst)[i * stride] = f32_to_f16(src[i]); break;
    case DT_BF16: for (i = 0; i < n; i++) ((uint16_t *)dst)[i * stride] = f32_to_bf16(src[i]); break;
    case DT_F32:
        if (stride == 1)
            memcpy(dst, src, sizeof(float) * n);
        else
            for (i = 0; i < n; i++) ((float *)dst)[i * stride] = src[i];
        break;
    case DT_F64: for (i = 0; i < n; i++) ((double *)dst)[i * stride] = src[i]; break;
    }
}

static inline void store_row_f64(void *dst, int64_t stride, int64_t n, attn_dtype dt,
                                 const double *src)
{
    int64_t i;
    switch (dt) {
    case DT_F16: for (i = 0; i < n; i++) ((uint16_t *)dst)[i * stride] = f32_to_f16((float)src[i]); break;
    case DT_BF16: for (i = 0; i < n; i++) ((uint16_t *)dst)[i * stride] = f32_to_bf16((float)src[i]); break;
    case DT_F32: for (i = 0; i < n; i++) ((float *)dst)[i * stride] = (float)src[i]; break;
    case DT_F64: for (i = 0; i < n; i++) ((double *)dst)[i * stride] = src[i]; break;
    }
}

#endif
