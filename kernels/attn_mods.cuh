/* What the generated score_mod / mask_mod code (attnext/codegen.py) calls: NumPy's integer and
 * float rules, bounds-checked lookups into the captured arrays, and the exact scatter-add of
 * the array gradients. The same text compiles as CUDA (NVRTC, included by attn_common.cuh) and
 * as host C (tests/test_codegen.py checks the generated code against trace.evaluate with it).
 *
 *   m->f[k]     the k-th float constant          m->a[i]   captured array i (attn_params.h)
 *   m->err      5 int64: flag, array, axis, index, size of the first lookup out of range
 *   m->dacc     ATTN_MOD_WORDS uint64 per gradient element (below)
 *
 * Lookups. An index is normalised as NumPy does (negative counts from the end); one out of range
 * sets the error flag (the host raises IndexError naming the array) and reads a clamped element
 * instead, so nothing outside the array is ever read.
 *
 * Gradients, deterministically. Every adjoint v is a float32 m * 2^e (m < 2^24 an integer,
 * e >= -149): it is added exactly as integer digits to a fixed-point number of MOD_LIMBS
 * signed 64-bit limbs of MOD_LIMB_BITS bits each (limb j weighs 2^(24 j - 149)), by integer
 * atomics. Integer addition is associative, so the sum's bits do not depend on the order the
 * threads add in; each limb absorbs 2^39 adjoints before it could overflow, and the host
 * propagates the carries and rounds once (codegen.limbs_to_float). A last word collects NaN and
 * infinities as flags. Cost: two atomics per adjoint and 104 bytes per gradient element.
 */
#ifndef ATTNEXT_ATTN_MODS_CUH
#define ATTNEXT_ATTN_MODS_CUH

#include "attn_params.h"

#ifndef DEV
#define DEV static inline
#endif

#define MOD_LIMB_BITS 24
#define MOD_LIMBS 12                  /* 288 bits cover float32's 2^-149 .. 2^128 */
#define MOD_LIMB_LSB (-149)
#define ATTN_MOD_WORDS (MOD_LIMBS + 1) /* + the flags word: 1 NaN, 2 +inf, 4 -inf */

/* ---------------------------------------------------------------- NumPy's integer rules */
DEV int64_t mod_iadd(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
DEV int64_t mod_isub(int64_t a, int64_t b) { return (int64_t)((uint64_t)a - (uint64_t)b); }
DEV int64_t mod_imul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }
DEV int64_t mod_ineg(int64_t a) { return (int64_t)(0 - (uint64_t)a); }
DEV int64_t mod_iabs(int64_t a) { return a < 0 ? mod_ineg(a) : a; }

/* floor division and remainder: by zero 0, rounding toward -inf, INT64_MIN // -1 wraps */
DEV int64_t mod_ifloordiv(int64_t a, int64_t b)
{
    if (b == 0)
        return 0;
    if (b == -1)
        return mod_ineg(a);
    int64_t q = a / b;
    if (a % b != 0 && ((a < 0) != (b < 0)))
        q--;
    return q;
}

DEV int64_t mod_imod(int64_t a, int64_t b)
{
    if (b == 0 || b == -1)
        return 0;
    int64_t r = a % b;
    if (r != 0 && ((r < 0) != (b < 0)))
        r += b;
    return r;
}

/* a ** e for the non-negative constant exponents the tracer allows, wrapping */
DEV int64_t mod_ipow(int64_t a, int64_t e)
{
    int64_t r = 1;
    if (e < 0)
        return 0;
    while (e) {
        if (e & 1)
            r = mod_imul(r, a);
        a = mod_imul(a, a);
        e >>= 1;
    }
    return r;
}

/* ---------------------------------------------------------------- NumPy's float rules */
/* floor_divide and remainder (npy_divmodf): the remainder takes the divisor's sign, the quotient
 * is snapped to the nearest integer; by zero a / b and fmod's NaN */
DEV float mod_fdivmod(float a, float b, float *modulus)
{
    float mod = fmodf(a, b);
    if (b == 0.f) {
        *modulus = mod;
        return a / b;
    }
    float div = (a - mod) / b;
    if (mod != 0.f) {
        if ((b < 0.f) != (mod < 0.f)) {
            mod += b;
            div -= 1.f;
        }
    } else {
        mod = copysignf(0.f, b);
    }
    float fd;
    if (div != 0.f) {
        fd = floorf(div);
        if (div - fd > 0.5f)
            fd += 1.f;
    } else {
        fd = copysignf(0.f, a / b);
    }
    *modulus = mod;
    return fd;
}

DEV float mod_ffloordiv(float a, float b)
{
    float mod;
    return b != 0.f ? mod_fdivmod(a, b, &mod) : a / b;
}

DEV float mod_fmod(float a, float b)
{
    float mod;
    if (b == 0.f)
        return fmodf(a, b);
    mod_fdivmod(a, b, &mod);
    return mod;
}

#ifndef __CUDACC_RTC__
/* np.tanh: the GPU's is attn_common.cuh's (tanh.approx.f32), host C's the C library's */
DEV float fast_tanh(float x) { return tanhf(x); }
#endif

/* minimum / maximum: a NaN operand wins; a tie gives the first operand */
DEV float mod_fmin(float a, float b) { return (a != a || a <= b) ? a : b; }
DEV float mod_fmax(float a, float b) { return (a != a || a >= b) ? a : b; }

/* an adjoint of 0 contributes 0 even where the local derivative is inf or NaN */
DEV float mod_dmul(float g, float d) { return g == 0.f ? 0.f : g * d; }

/* ---------------------------------------------------------------- lookups */
/* Out-of-line code: what runs only after a lookup went out of range. Each generated function
 * has a _check twin of this kind (codegen.py): the function the kernels inline (_q) only clamps
 * and notes that an index was out of range (selects, no branch per index); a kernel's tile calls
 * the twins once for a pair that noted one (attn_common.cuh: mods_report), which repeat its
 * lookups and report the first bad one. A report inlined at every index of every score cost
 * NVRTC seconds and the kernels registers. */
#ifdef __CUDACC_RTC__
#define MOD_COLD static __device__ __noinline__
#else
#define MOD_COLD static
#endif

MOD_COLD void mod_fail(const attn_mods_gpu *m, int arr, int axis, int64_t i, int64_t n)
{
    int64_t *e = m->err;
#ifdef __CUDACC_RTC__
    if (atomicCAS((unsigned long long *)e, 0ull, 1ull) != 0ull)
        return;
#else
    if (e[0])
        return;
    e[0] = 1;
#endif
    e[1] = arr;
    e[2] = axis;
    e[3] = i;
    e[4] = n;
}

/* One axis' index, normalised and checked; clamped into [0, n - 1] when out of range (0 for an
 * empty axis), which is reported (bad NULL: the _check twins) or noted in *bad (the generated
 * functions). */
DEV int64_t mod_axis(const attn_mods_gpu *m, int arr, int axis, int64_t i, int *bad)
{
    const int64_t n = m->a[arr].shape[axis];
    int64_t j = i < 0 ? i + n : i;
    if (j < 0 || j >= n) {
        if (bad)
            *bad = 1;
        else
            mod_fail(m, arr, axis, i, n);
        j = j < 0 || n == 0 ? 0 : n - 1;
    }
    return j;
}

/* The element offset of array arr at the first nidx indices (clamped: never outside the array,
 * 0 for an empty one, whose pointer the host points at a readable element: a lookup into an
 * empty array is always out of range, so what it reads is never used). */
DEV int64_t mod_offset(const attn_mods_gpu *m, int arr, int nidx, int64_t i0, int64_t i1, int64_t i2,
                       int64_t i3, int *bad)
{
    const int64_t idx[ATTN_MOD_DIMS] = {i0, i1, i2, i3};
    int64_t off = 0;
    for (int ax = 0; ax < nidx; ax++)
        off += mod_axis(m, arr, ax, idx[ax], bad) * m->a[arr].s[ax];
    return off;
}

/* The element offset of a lookup that attnext/bounds.py proved in range over the call
 * (codegen.Facts): no check, no clamp; an index of an axis in the bits of neg may be negative
 * and counts from the end, the others are in [0, n). */
DEV int64_t mod_offset_in(const attn_mods_gpu *m, int arr, int nidx, int64_t i0, int64_t i1, int64_t i2,
                          int64_t i3, int neg)
{
    const int64_t idx[ATTN_MOD_DIMS] = {i0, i1, i2, i3};
    int64_t off = 0;
    for (int ax = 0; ax < nidx; ax++) {
        const int64_t j = (neg >> ax & 1) && idx[ax] < 0 ? idx[ax] + m->a[arr].shape[ax] : idx[ax];
        off += j * m->a[arr].s[ax];
    }
    return off;
}

/* Element loads, with no branch: on the GPU through the read-only path (ld.global.nc), since
 * the captured arrays do not change while a kernel runs; the compiler may then merge the loads
 * of one element (a row's doc[q_idx] at every column of the row). */
#ifdef __CUDACC_RTC__
#define MOD_LDG(T, p) ((T)__ldg(p))
#else
#define MOD_LDG(T, p) ((T)*(p))
#endif

DEV float mod_load_f(const attn_mods_gpu *m, int arr, int64_t off)
{
    return MOD_LDG(float, (const float *)m->a[arr].ptr + off);
}

DEV int64_t mod_load_i(const attn_mods_gpu *m, int arr, int64_t off)
{
    return MOD_LDG(int64_t, (const long long *)m->a[arr].ptr + off);
}

DEV int64_t mod_load_i32(const attn_mods_gpu *m, int arr, int64_t off)   /* codegen.NARROW */
{
    return MOD_LDG(int, (const int *)m->a[arr].ptr + off);
}

DEV int mod_load_b(const attn_mods_gpu *m, int arr, int64_t off)
{
    return MOD_LDG(int, (const unsigned char *)m->a[arr].ptr + off) != 0;
}

/* ---------------------------------------------------------------- gradients */
DEV void mod_add_word(uint64_t *w, uint64_t x)
{
#ifdef __CUDACC_RTC__
    atomicAdd((unsigned long long *)w, (unsigned long long)x);
#else
    *w += x;
#endif
}

DEV void mod_or_word(uint64_t *w, uint64_t x)
{
#ifdef __CUDACC_RTC__
    atomicOr((unsigned long long *)w, (unsigned long long)x);
#else
    *w |= x;
#endif
}

/* dacc[element off of array arr] += v, exactly (see the top of this file). */
DEV void mod_scatter(const attn_mods_gpu *m, int arr, int64_t off, float v)
{
    if (v == 0.f || m->a[arr].grad < 0)            /* grad -1: no gradient, or an empty array */
        return;
    uint64_t *w = m->dacc + (m->a[arr].grad + off) * ATTN_MOD_WORDS;
    union { float f; uint32_t u; } bits;
    bits.f = v;
    const uint32_t u = bits.u, ex = (u >> 23) & 0xffu, neg = u >> 31;
    if (ex == 0xffu) {
        mod_or_word(w + MOD_LIMBS, (u & 0x7fffffu) ? 1u : neg ? 4u : 2u);
        return;
    }
    const uint64_t mant = ex ? (u & 0x7fffffu) | 0x800000u : (u & 0x7fffffu);
    const int pos = ex ? (int)ex - 1 : 0;         /* bit of mant's lowest digit above 2^-149 */
    const int limb = pos / MOD_LIMB_BITS, shift = pos % MOD_LIMB_BITS;
    const uint64_t wide = mant << shift;          /* < 2^47: two limbs' digits */
    const uint64_t lo = wide & ((1u << MOD_LIMB_BITS) - 1), hi = wide >> MOD_LIMB_BITS;
    mod_add_word(w + limb, neg ? 0 - lo : lo);
    if (hi)
        mod_add_word(w + limb + 1, neg ? 0 - hi : hi);
}

#endif
