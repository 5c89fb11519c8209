/* The score_mod's array gradients from their exact accumulators (attn_mods.cuh: signed limbs of
 * MOD_LIMB_BITS digits, then a flags word), one thread per gradient element: the carries
 * propagated, the sign taken out, the digits summed into float64 from the largest, then the
 * flags' NaN and infinities. The same steps, in the same order, as attnext/codegen.py's
 * limbs_to_float (the host's version, which the tests compare with): the same bits, and only
 * 8 bytes an element come back instead of ATTN_MOD_WORDS * 8.
 *
 * No compile-time switches; parameter: the struct below, by value.
 */
#define DEV static __device__ __forceinline__
#include "attn_mods.cuh"

struct dtensors_params {
    const uint64_t *dacc;     /* n x ATTN_MOD_WORDS words */
    double *out;              /* n values */
    int64_t n;
};

/* limbs[0 .. MOD_LIMBS - 2] become digits in [0, 2^MOD_LIMB_BITS), the excess carried up */
DEV void carry(int64_t (&limbs)[MOD_LIMBS])
{
#pragma unroll
    for (int j = 0; j < MOD_LIMBS - 1; j++) {
        const int64_t c = limbs[j] >> MOD_LIMB_BITS;          /* arithmetic: floor */
        limbs[j] &= (1ll << MOD_LIMB_BITS) - 1;
        limbs[j + 1] += c;
    }
}

extern "C" __global__ void __launch_bounds__(256) attn_dtensors(const __grid_constant__ dtensors_params p)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n)
        return;
    const uint64_t *w = p.dacc + i * ATTN_MOD_WORDS;
    int64_t limbs[MOD_LIMBS];
#pragma unroll
    for (int j = 0; j < MOD_LIMBS; j++)
        limbs[j] = (int64_t)w[j];
    const uint64_t flags = w[MOD_LIMBS];
    carry(limbs);
    const bool neg = limbs[MOD_LIMBS - 1] < 0;
    if (neg) {
#pragma unroll
        for (int j = 0; j < MOD_LIMBS; j++)
            limbs[j] = -limbs[j];
        carry(limbs);
    }
    double out = 0.0;
#pragma unroll
    for (int j = MOD_LIMBS - 1; j >= 0; j--)
        out = __dadd_rn(out, ldexp((double)limbs[j], MOD_LIMB_BITS * j + MOD_LIMB_LSB));
    if (neg)
        out = -out;
    const bool nan = (flags & 1) || ((flags & 2) && (flags & 4));
    if (flags & 2)
        out = __longlong_as_double(0x7ff0000000000000ll);
    if (flags & 4)
        out = __longlong_as_double((long long)0xfff0000000000000ull);
    if (nan)
        out = __longlong_as_double(0x7ff8000000000000ll);
    p.out[i] = out;
}
