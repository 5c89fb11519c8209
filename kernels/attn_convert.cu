/* Element conversions for the captured arrays of score_mod / mask_mod (attnext/mod_arrays.py):
 * a CUDA array whose dtype is not the kernels' storage type is converted here, on the call's
 * stream, into a C-contiguous copy (float32, int64, int32 from integers of at most 16 bits, or one
 * byte per bool), and the float64 sums
 * of a backward's array gradients become the captured array's own dtype. One thread per element.
 *
 *   src      element [0, ..., 0] of the source; shape / strides (elements) of its CONVERT_DIMS
 *            dims, C order, leading unused dims of size 1 (negative and zero strides are fine)
 *   dst      n elements, C order
 *
 * The rules are NumPy's astype, bit for bit: floats widen exactly to double, then round to
 * nearest even once into the destination -- except bfloat16, rounded from double to float32
 * first, then to bfloat16 (what ml_dtypes does: a NumPy bfloat16 array built from float64 gets
 * the same bits); integers widen to int64 (uint64 keeps its bits, as astype(np.int64) does); a
 * bool destination is 1 for any non-zero source. Only float -> float and integer / bool ->
 * integer / bool pairs occur (mod_arrays checks).
 *
 * No compile-time switches; parameter: the struct below, by value.
 */
#include "attn_params.h"

#define DEV static __device__ __forceinline__
#define CONVERT_DIMS 4

/* type codes: mod_arrays.TYPE_CODES */
enum { T_BOOL, T_I8, T_I16, T_I32, T_I64, T_U8, T_U16, T_U32, T_U64, T_F16, T_BF16, T_F32, T_F64 };

struct convert_params {
    uint64_t src, dst;
    int64_t shape[CONVERT_DIMS];
    int64_t strides[CONVERT_DIMS];
    int64_t n;
    int32_t src_type, dst_type;
};

DEV int type_size(int t)
{
    switch (t) {
    case T_I16: case T_U16: case T_F16: case T_BF16: return 2;
    case T_I32: case T_U32: case T_F32: return 4;
    case T_I64: case T_U64: case T_F64: return 8;
    default: return 1;
    }
}

DEV double load_float(const void *p, int t)
{
    switch (t) {
    case T_F16: {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*(const uint16_t *)p));
        return f;
    }
    case T_BF16: return __uint_as_float(((uint32_t)*(const uint16_t *)p) << 16);
    case T_F32: return *(const float *)p;
    default: return *(const double *)p;
    }
}

DEV int64_t load_int(const void *p, int t)
{
    switch (t) {
    case T_I8: return *(const int8_t *)p;
    case T_I16: return *(const short *)p;
    case T_I32: return *(const int32_t *)p;
    case T_I64: case T_U64: return *(const int64_t *)p;
    case T_U16: return *(const uint16_t *)p;
    case T_U32: return *(const uint32_t *)p;
    default: return *(const uint8_t *)p;          /* T_BOOL, T_U8 */
    }
}

DEV void store(void *p, int t, const void *src, int src_type)
{
    switch (t) {
    case T_F64: *(double *)p = load_float(src, src_type); return;
    case T_F32: *(float *)p = (float)load_float(src, src_type); return;   /* round to nearest even */
    case T_F16: {
        uint16_t r;
        asm("cvt.rn.f16.f64 %0, %1;" : "=h"(r) : "d"(load_float(src, src_type)));
        *(uint16_t *)p = r;
        return;
    }
    case T_BF16: {
        uint16_t r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"((float)load_float(src, src_type)));
        *(uint16_t *)p = r;
        return;
    }
    case T_I64: *(int64_t *)p = load_int(src, src_type); return;
    case T_I32: *(int32_t *)p = (int32_t)load_int(src, src_type); return;   /* from 8 / 16 bits */
    default: *(uint8_t *)p = load_int(src, src_type) != 0; return;   /* T_BOOL */
    }
}

extern "C" __global__ void __launch_bounds__(256) attn_convert(const __grid_constant__ convert_params p)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n)
        return;
    int64_t rest = i, off = 0;
#pragma unroll
    for (int d = CONVERT_DIMS - 1; d >= 0; d--) {
        off += rest % p.shape[d] * p.strides[d];
        rest /= p.shape[d];
    }
    const char *src = (const char *)p.src + off * type_size(p.src_type);
    store((char *)p.dst + i * type_size(p.dst_type), p.dst_type, src, p.src_type);
}
