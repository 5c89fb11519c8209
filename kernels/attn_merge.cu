/* attnext.merge on the GPU (attnext/cuda/merge.py): attention over disjoint key sets combined from
 * each part's out and lse, lse = logsumexp_i lse_i, out = sum_i exp(lse_i - lse) out_i, in float32
 * (float64 for float64 parts). A part whose lse is -inf drops out (its out is not read); a row with
 * none left gives out 0 and lse -inf; a NaN lse makes the row NaN. attnext/merge.py's NumPy path
 * computes the same for host arrays.
 *
 * Rows are lse's index space (r0, r1, r2): (B, Hq, Sq), or (1, Hq, Tq) for varlen; every out
 * stride is given in that order, then the stride along Dv. One warp a row: its lanes take the
 * parts' lse (weights in shared memory, parts * 4 rows of them), then the row's Dv elements.
 *
 * Compile-time switch: MERGE_DT, the outs' attn_dtype (attn_params.h); parameter: merge_params,
 * by value, its parts a device table of merge_part. */
#include "attn_params.h"

#define DEV static __device__ __forceinline__
#define ROWS_PER_BLOCK 4
/* attn_dtype's values (an enum, which #if cannot read) */
#define MERGE_F16 0
#define MERGE_BF16 1
#define MERGE_F32 2
#define MERGE_F64 3

#if MERGE_DT == MERGE_F64
typedef double acc_t;
#define ACC_EXP exp
#define ACC_LOG log
#define ACC_INF __longlong_as_double(0x7ff0000000000000LL)
#define ACC_NAN __longlong_as_double(0x7ff8000000000000LL)
#else
typedef float acc_t;
#define ACC_EXP expf
#define ACC_LOG logf
#define ACC_INF __int_as_float(0x7f800000)
#define ACC_NAN __int_as_float(0x7fc00000)
#endif

struct merge_part {
    uint64_t out, lse;
    int64_t out_s[4], lse_s[3];
};

struct merge_params {
    uint64_t parts;              /* n_parts merge_part, in device memory */
    uint64_t out, lse;           /* the results, laid out as out_s / lse_s say */
    int64_t rows[3];
    int64_t out_s[4], lse_s[3];
    int64_t dv;
    int64_t n_parts;
};

DEV acc_t load_elem(const char *base, int64_t i)
{
#if MERGE_DT == MERGE_F16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(((const uint16_t *)base)[i]));
    return f;
#elif MERGE_DT == MERGE_BF16
    return __uint_as_float(((uint32_t)((const uint16_t *)base)[i]) << 16);
#elif MERGE_DT == MERGE_F32
    return ((const float *)base)[i];
#else
    return ((const double *)base)[i];
#endif
}

DEV void store_elem(char *base, int64_t i, acc_t x)
{
#if MERGE_DT == MERGE_F16
    uint16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    ((uint16_t *)base)[i] = r;
#elif MERGE_DT == MERGE_BF16
    uint16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    ((uint16_t *)base)[i] = r;
#elif MERGE_DT == MERGE_F32
    ((float *)base)[i] = x;
#else
    ((double *)base)[i] = x;
#endif
}

DEV acc_t warp_sum(acc_t x)
{
    for (int o = 16; o; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

extern "C" __global__ void __launch_bounds__(32 * ROWS_PER_BLOCK) attn_merge(const __grid_constant__ merge_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n = p.n_parts, row = (int64_t)blockIdx.x * ROWS_PER_BLOCK + warp;
    if (row >= p.rows[0] * p.rows[1] * p.rows[2])
        return;
    const int64_t r2 = row % p.rows[2], r1 = row / p.rows[2] % p.rows[1], r0 = row / p.rows[2] / p.rows[1];
    acc_t *w = (acc_t *)smem_raw + warp * n;         /* the parts' weights: -1 where one drops out */
    const merge_part *parts = (const merge_part *)p.parts;

    acc_t mx = -ACC_INF;
    bool nan = false;
    for (int64_t i = lane; i < n; i += 32) {
        const merge_part &q = parts[i];
        const acc_t l = ((const acc_t *)q.lse)[r0 * q.lse_s[0] + r1 * q.lse_s[1] + r2 * q.lse_s[2]];
        w[i] = l;
        nan |= l != l;
        mx = l > mx ? l : mx;
    }
    for (int o = 16; o; o >>= 1) {
        const acc_t other = __shfl_xor_sync(0xffffffffu, mx, o);
        mx = other > mx ? other : mx;
    }
    nan = __any_sync(0xffffffffu, nan);
    const acc_t base = mx == -ACC_INF ? (acc_t)0 : mx;
    acc_t sum = 0;
    for (int64_t i = lane; i < n; i += 32) {
        const acc_t l = w[i];
        const acc_t e = l == -ACC_INF ? (acc_t)-1 : ACC_EXP(l - base);
        w[i] = e;
        sum += e < 0 ? (acc_t)0 : e;
    }
    sum = warp_sum(sum);
    nan |= sum != sum;                                /* an lse of +inf: inf - inf */
    const acc_t lse = nan ? ACC_NAN : sum > 0 ? base + ACC_LOG(sum) : (acc_t)-ACC_INF;
    const acc_t inv = sum > 0 ? (acc_t)1 / sum : (acc_t)0;
    if (lane == 0)
        ((acc_t *)p.lse)[r0 * p.lse_s[0] + r1 * p.lse_s[1] + r2 * p.lse_s[2]] = lse;
    __syncwarp();
    char *orow = (char *)p.out;
    const int64_t o_at = r0 * p.out_s[0] + r1 * p.out_s[1] + r2 * p.out_s[2];
    for (int64_t d = lane; d < p.dv; d += 32) {
        acc_t acc = 0;
        for (int64_t i = 0; i < n; i++) {
            const acc_t e = w[i];
            if (e >= 0) {
                const merge_part &q = parts[i];
                acc += e * inv * load_elem((const char *)q.out, r0 * q.out_s[0] + r1 * q.out_s[1]
                                                                + r2 * q.out_s[2] + d * q.out_s[3]);
            }
        }
        store_elem(orow, o_at + d * p.out_s[3], nan ? ACC_NAN : acc);
    }
}
