/* The float16 operands of precision="tf32"'s backward on Hopper (attnext/cuda/scale16.py): q, k,
 * v, out and dout (float32) copied into C-contiguous float16 arrays, each scaled by a power of
 * two that takes its largest finite magnitude into [2^(top - 1), 2^top), so that float16's
 * 11-bit significand (TF32's) holds every element down to 2^-(13 + top) of it (float16's
 * smallest normal, 2^-14), and the backward's float16 roundings of P and dS stay in range
 * (scale16.py sizes the tops). out takes v's factor (out is an average of v's rows).
 *
 *   attn_scale16_max      grid (CTAs, 4): the bits of the largest finite |x| of q, k, v, dout into
 *                         maxima[0..3] (zeroed by the host), by red.max on the bits. NaN and inf
 *                         count as 0: a row that keeps no key may hold them (docs/semantics.md),
 *                         and must not set the scale of the rows that are read
 *   attn_scale16_convert  grid (CTAs, 5): the copies, x * 2^shift rounded to float16 (to nearest
 *                         even: one rounding, exact scaling); CTA (0, 0) writes grad_scales
 *                         (attn_params.h): the scores' factor 1 / (sq sk), dq's 1 / (sdo sv sk),
 *                         dk's 1 / (sdo sv sq), dv's 1 / sdo (double: their product of three
 *                         powers of two may leave float's range)
 *   attn_scale16_unscale  grid (CTAs, 1), the forward's last step: the float16 output of the
 *                         float16 forward over the copies of q, k and v (src[3], C-contiguous)
 *                         into the caller's float32 out (dst[3]: shape[3], strides[3]), times
 *                         1 / v's power of two (out is an average of v's rows)
 * shift = top - e where max = f 2^e, f in [1/2, 1); 0 for a max of 0 (NaN and inf pass through as
 * float16 takes them); within [-126, 126] (a power of two that float holds).
 *
 * No compile-time switches; parameter: the struct below, by value (scale16.PARAMS).
 */
#include "attn_params.h"

#define DEV static __device__ __forceinline__
#define NT 5                                /* q, k, v, out, dout */

struct scale16_params {
    uint64_t src[NT], dst[NT];              /* float32 sources, float16 C-contiguous copies (unscale:
                                             * slot 3 the other way) */
    int64_t shape[NT][4], strides[NT][4];   /* elements */
    int64_t n[NT];
    int32_t contig[NT];                     /* 1: the source (unscale: the destination) is
                                             * C-contiguous and 16-byte aligned */
    int32_t top[NT];
    uint64_t maxima;                        /* 4 uint32: max |x| of q, k, v, dout as bits */
    uint64_t scales;                        /* 4 double: attn_params.grad_scales */
};

DEV int64_t offset_of(const scale16_params &p, int t, int64_t i)
{
    int64_t off = 0;
#pragma unroll
    for (int d = 3; d >= 0; d--) {
        const int64_t n = p.shape[t][d];
        off += (i % n) * p.strides[t][d];
        i /= n;
    }
    return off;
}

DEV uint32_t abs_bits(float x)             /* |x|'s bits, 0 for NaN and inf */
{
    const uint32_t a = __float_as_uint(x) & 0x7fffffffu;
    return a < 0x7f800000u ? a : 0u;
}

extern "C" __global__ void __launch_bounds__(256) attn_scale16_max(const __grid_constant__ scale16_params p)
{
    const int m = blockIdx.y, t = m == 3 ? 4 : m;      /* maxima: q, k, v, dout */
    const float *src = (const float *)p.src[t];
    const int64_t n = p.n[t], stride = (int64_t)gridDim.x * blockDim.x;
    uint32_t best = 0;
    if (p.contig[t]) {
        const int64_t n4 = n / 4;
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += stride) {
            const float4 x = ((const float4 *)src)[i];
            best = max(best, max(max(abs_bits(x.x), abs_bits(x.y)), max(abs_bits(x.z), abs_bits(x.w))));
        }
        for (int64_t i = 4 * n4 + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride)
            best = max(best, abs_bits(src[i]));
    } else {
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride)
            best = max(best, abs_bits(src[offset_of(p, t, i)]));
    }
    asm("redux.sync.max.u32 %0, %0, 0xffffffff;" : "+r"(best));
    if ((threadIdx.x & 31) == 0 && best)
        asm volatile("red.global.max.u32 [%0], %1;" ::"l"((uint32_t *)p.maxima + m), "r"(best));
}

/* 2^shift for array t's maximum bits (module comment). */
DEV int shift_of(uint32_t bits, int top)
{
    if (bits == 0 || bits >= 0x7f800000u)
        return 0;
    int e;                                   /* max = f 2^e, f in [1/2, 1) */
    if (bits >= 0x00800000u)
        e = (int)(bits >> 23) - 126;
    else                                     /* subnormal: the top bit p of the significand, 2^(p - 149) */
        e = (31 - __clz(bits)) - 148;
    return max(-126, min(126, top - e));
}

DEV float pow2f(int e) { return __uint_as_float((uint32_t)(e + 127) << 23); }   /* e in [-126, 127] */
DEV double pow2(int e) { return __longlong_as_double((long long)(e + 1023) << 52); }   /* e in [-1022, 1023] */

DEV uint16_t to_f16(float f)
{
    uint16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

extern "C" __global__ void __launch_bounds__(256) attn_scale16_convert(const __grid_constant__ scale16_params p)
{
    const int t = blockIdx.y;
    const uint32_t *maxima = (const uint32_t *)p.maxima;
    if (t == 0 && blockIdx.x == 0 && threadIdx.x == 0) {
        int sh[4];
        for (int m = 0; m < 4; m++)
            sh[m] = shift_of(maxima[m], p.top[m == 3 ? 4 : m]);
        double *g = (double *)p.scales;
        g[0] = pow2(-sh[0] - sh[1]);
        g[1] = pow2(-sh[3] - sh[2] - sh[1]);
        g[2] = pow2(-sh[3] - sh[2] - sh[0]);
        g[3] = pow2(-sh[3]);
    }
    const float s = pow2f(shift_of(maxima[t < 3 ? t : t - 1], p.top[t]));   /* out: v's maximum */
    const float *src = (const float *)p.src[t];
    uint16_t *dst = (uint16_t *)p.dst[t];
    const int64_t n = p.n[t], stride = (int64_t)gridDim.x * blockDim.x;
    if (p.contig[t]) {
        const int64_t n4 = n / 4;
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += stride) {
            const float4 x = ((const float4 *)src)[i];
            const uint2 w = make_uint2(to_f16(x.x * s) | (uint32_t)to_f16(x.y * s) << 16,
                                       to_f16(x.z * s) | (uint32_t)to_f16(x.w * s) << 16);
            ((uint2 *)dst)[i] = w;
        }
        for (int64_t i = 4 * n4 + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride)
            dst[i] = to_f16(src[i] * s);
    } else {
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride)
            dst[i] = to_f16(src[offset_of(p, t, i)] * s);
    }
}

DEV float from_f16(uint16_t h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

extern "C" __global__ void __launch_bounds__(256) attn_scale16_unscale(const __grid_constant__ scale16_params p)
{
    const float s = pow2f(-shift_of(((const uint32_t *)p.maxima)[2], p.top[2]));
    const uint16_t *src = (const uint16_t *)p.src[3];
    float *dst = (float *)p.dst[3];
    const int64_t n = p.n[3], stride = (int64_t)gridDim.x * blockDim.x;
    if (p.contig[3]) {
        const int64_t n4 = n / 4;
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += stride) {
            const uint2 w = ((const uint2 *)src)[i];
            ((float4 *)dst)[i] = make_float4(from_f16((uint16_t)w.x) * s, from_f16((uint16_t)(w.x >> 16)) * s,
                                             from_f16((uint16_t)w.y) * s, from_f16((uint16_t)(w.y >> 16)) * s);
        }
        for (int64_t i = 4 * n4 + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride)
            dst[i] = from_f16(src[i]) * s;
    } else {
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride)
            dst[offset_of(p, 3, i)] = from_f16(src[i]) * s;
    }
}
