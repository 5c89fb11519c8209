/* What the generated score_mod / mask_mod code (attnext/codegen.py) calls: NumPy's integer and
 * float rules, bounds-checked lookups into the captured arrays, and the exact scatter-add of
 * the array gradients. The same text compiles as CUDA (NVRTC, included by attn_common.cuh) and
 * as host C (tests/unit/test_codegen.py checks the generated code against trace.evaluate with it).
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
 *
 * Gradients through a tile (mod_tile). Where a lookup's index is affine in q_idx and kv_idx with
 * the rest fixed for a tile of the dQ kernels (codegen: tile terms; table[h, q_idx - kv_idx + S]),
 * a tile's adjoints fall on few elements (a diagonal table: BM + BN - 1 of them for BM x BN
 * pairs). The tile adds their digits into shared memory first, then each nonzero limb once into
 * the accumulator (mod_tile_flush): integer sums again, so the same words as adding each adjoint
 * directly. Shared memory has native 32-bit atomics only (a 64-bit add is a compare-and-swap
 * loop), so a tile's limbs are split in two 12-bit chunks, each summed in a 32-bit word: a tile
 * of at most 2^19 pairs cannot overflow one.
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

#include "mod_ints.h"

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

/* a / b. On the GPU by b's reciprocal r, which the compiler hoists out of the tile loops where b
 * is a captured constant (s / 30), and one FMA step on the exact residual e = a - q b; where e is
 * 0, inf or NaN, q is the quotient (an exact one with its sign of zero; b zero or inf, a inf or
 * NaN, overflow). Branch-free, by selects: b outside [2^-125, 2^125] (r subnormal or infinite)
 * scales a and b by 2^64 or 2^-64 (depends on b alone: hoisted too), and a tiny a (e would leave
 * the normal range) divides a 2^64 and scales the quotient back. The same bits as div.rn.f32 on
 * 260k pairs (random bits, every pair of special values, tiny numerators, subnormal divisors;
 * exact rational emulation, session 26) but for subnormal quotients of numerators under 2^-100:
 * one unit of 2^-149 off at most there (the scaling back rounds twice). div.rn.f32, its slow
 * path at every score, held a softcap score_mod dividing by its cap at 1.8x the built-in
 * softcap= (H200, D = 64); a form with a branch per score to it, 2.0x (its tile loop cut into
 * basic blocks); a form whose scaling made r depend on a (one rcp.rn a score), 2.3x. */
DEV float mod_fdiv(float a, float b)
{
#ifdef __CUDACC_RTC__
    const bool small = fabsf(b) < 0x1p-125f, large = fabsf(b) > 0x1p125f;
    const float f = small ? 0x1p64f : large ? 0x1p-64f : 1.f;
    const float bs = b * f;
    const float r = __frcp_rn(bs);
    const bool tiny = fabsf(a) < 0x1p-100f && f == 1.f;
    const float as = a * (tiny ? 0x1p64f : f);
    const float q = as * r;
    const float e = fmaf(-q, bs, as);
    const bool step = (fabsf(e) > 0.f) & (fabsf(e) < __int_as_float(0x7f800000));    /* &: no branch */
    const float x = fmaf(step ? e : -0.f, step ? r : 0.f, q);    /* q + -0 is q, -0 and NaN too */
    return tiny ? x * 0x1p-64f : x;
#else
    return a / b;
#endif
}

/* a / b where np.tanh alone reads the quotient (codegen.py: _LOOSE_DIV_READERS): by b's
 * reciprocal, one rounding more than mod_fdiv (within 1.5 units of the last place), which moves
 * tanh's result by less than 2^-22 of itself where the hardware's tanh is within 2^-10.99; b
 * outside [2^-125, 2^125] scales as mod_fdiv does. Two FMULs a score against mod_fdiv's ten
 * instructions: a softcap score_mod's forward at D = 64 went from 0.67 to 0.55 ms (H200). */
DEV float mod_fdiv_tanh(float a, float b)
{
#ifdef __CUDACC_RTC__
    const float f = fabsf(b) < 0x1p-125f ? 0x1p64f : fabsf(b) > 0x1p125f ? 0x1p-64f : 1.f;
    return (a * f) * __frcp_rn(b * f);
#else
    return a / b;
#endif
}

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

/* ---------------------------------------------------------------- block-mask cells
 * mod_mask_cell's rules (codegen: an interval per integer node, a set of values per bool node)
 * live in mod_ints.h, shared with the CPU interpreter's block mask; here, its lookups. */
/* The values a lookup may read over the cell: its index box scanned (at most MOD_CELL_SCAN
 * elements; kind 0 int64, 1 int32, 2 bool, -1 a float array: no values). A box that may leave
 * the array sets *must where the lookup is checked (mod_offset): then the cell is evaluated pair
 * by pair, which reports it as the reference would. */
DEV mod_iv mod_cell_load(const attn_mods_gpu *m, int arr, int nidx, mod_iv i0, mod_iv i1, mod_iv i2, mod_iv i3,
                         int kind, int checked, int *must)
{
    const mod_iv idx[ATTN_MOD_DIMS] = {i0, i1, i2, i3};
    int64_t first[ATTN_MOD_DIMS] = {0, 0, 0, 0}, n[ATTN_MOD_DIMS] = {1, 1, 1, 1}, count;
    if (!mod_cell_box(idx, m->a[arr].shape, nidx, checked, first, n, &count, must) || kind < 0)
        return mod_iv_top();
    int64_t lo = 0, hi = 0;
    for (int64_t j0 = 0; j0 < n[0]; j0++)
        for (int64_t j1 = 0; j1 < n[1]; j1++)
            for (int64_t j2 = 0; j2 < n[2]; j2++)
                for (int64_t j3 = 0; j3 < n[3]; j3++) {
                    const int64_t off = (first[0] + j0) * m->a[arr].s[0] + (first[1] + j1) * m->a[arr].s[1]
                                      + (first[2] + j2) * m->a[arr].s[2] + (first[3] + j3) * m->a[arr].s[3];
                    const int64_t v = kind == 0 ? mod_load_i(m, arr, off)
                                    : kind == 1 ? mod_load_i32(m, arr, off) : mod_load_b(m, arr, off);
                    const int start = (j0 | j1 | j2 | j3) == 0;
                    lo = start || v < lo ? v : lo;
                    hi = start || v > hi ? v : hi;
                }
    return mod_iv_range(lo, hi);
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

/* An adjoint's bits, for the accumulator: a NaN or an infinity is its flags bit (the top of
 * this file; 0 for a finite one), a finite one's magnitude mant * 2^(pos + MOD_LIMB_LSB) with
 * mant < 2^24, its sign the top bit. */
DEV uint32_t mod_bits(float v)
{
    union { float f; uint32_t u; } bits;
    bits.f = v;
    return bits.u;
}

DEV uint32_t mod_flag(uint32_t u)
{
    return ((u >> 23) & 0xffu) != 0xffu ? 0u : (u & 0x7fffffu) ? 1u : (u >> 31) ? 4u : 2u;
}

DEV uint64_t mod_mant(uint32_t u, int *pos)
{
    const uint32_t ex = (u >> 23) & 0xffu;
    *pos = ex ? (int)ex - 1 : 0;                  /* bit of mant's lowest digit above 2^-149 */
    return ex ? (u & 0x7fffffu) | 0x800000u : (u & 0x7fffffu);
}

/* dacc[element off of array arr] += v, exactly (see the top of this file). */
DEV void mod_scatter(const attn_mods_gpu *m, int arr, int64_t off, float v)
{
    if (v == 0.f || m->a[arr].grad < 0)            /* grad -1: no gradient, or an empty array */
        return;
    uint64_t *w = m->dacc + (m->a[arr].grad + off) * ATTN_MOD_WORDS;
    const uint32_t u = mod_bits(v), flag = mod_flag(u), neg = u >> 31;
    if (flag) {
        mod_or_word(w + MOD_LIMBS, flag);
        return;
    }
    int pos;
    const uint64_t mant = mod_mant(u, &pos);
    const int limb = pos / MOD_LIMB_BITS, shift = pos % MOD_LIMB_BITS;
    const uint64_t wide = mant << shift;          /* < 2^47: two limbs' digits */
    const uint64_t lo = wide & ((1u << MOD_LIMB_BITS) - 1), hi = wide >> MOD_LIMB_BITS;
    mod_add_word(w + limb, neg ? 0 - lo : lo);
    if (hi)
        mod_add_word(w + limb + 1, neg ? 0 - hi : hi);
}

/* ---------------------------------------------------------------- gradients through a tile */
#define MOD_TILE_TERMS 4              /* lookups that may take a tile's path (codegen.MAX_TILE_TERMS) */
#define MOD_CHUNK_BITS 12             /* two chunks a limb */
#define MOD_CHUNKS (2 * MOD_LIMBS)
#ifndef MOD_TILE_ADMIT
#define MOD_TILE_ADMIT 0              /* bit k: tile term k has slots (kernels.tile_sums) */
#endif
#define MOD_TILE_ADMITS(k) ((MOD_TILE_ADMIT >> (k)) & 1)

/* One tile's shared sums. acc: MOD_CHUNKS rows of `slots` 32-bit words (chunk-major: the
 * adjoints of a warp's pairs, on neighbouring slots, hit distinct banks), zero between tiles.
 * Term k (a lookup, codegen's numbering) is on the tile's path when bit k of on is set: its
 * slots [at[k], at[k] + count[k]) hold consecutive elements of its array, whose accumulator words
 * start at dst[k] (no array number: an index into m->a that is not a constant would copy the
 * kernel parameter into local memory); element offset off is slot off + base[k], computed in 32
 * bits (the slot is small, so the wrapped sum is exact: one register, not three, in the
 * kernels' inner loop). */
typedef struct mod_tile {
    uint32_t *acc;
    int slots, used, on;
    int at[MOD_TILE_TERMS], count[MOD_TILE_TERMS], base[MOD_TILE_TERMS];
    uint64_t *dst[MOD_TILE_TERMS];
} mod_tile;

DEV void mod_tile_word(uint32_t *w, uint32_t x)
{
#ifdef __CUDACC_RTC__
    atomicAdd((unsigned *)w, (unsigned)x);
#else
    *w += x;
#endif
}

/* A tile's plan (the generated mod_tile_plan) starts with no term on its path ... */
DEV void mod_tile_start(mod_tile *t)
{
    t->used = 0;
    t->on = 0;
}

/* ... and ends here: whether every admitted term is (then the tile takes the path for all of
 * them, else for none: a choice per tile, not per term and pair, keeps a single branch out of the
 * kernels' inner loop; a branch per pair there cost the dQ kernels spills). */
DEV int mod_tile_done(mod_tile *t)
{
    if (t->on == MOD_TILE_ADMIT && t->on)
        return 1;
    t->used = 0;
    t->on = 0;
    return 0;
}

/* Term k for a tile of rows x cols pairs from (q0, kv0): a lookup of array arr whose index on
 * axis ax is i0[ax] + a[ax] (q_idx - q0) + c[ax] (kv_idx - kv0), i0 evaluated at (q0, kv0) and
 * wrapping as the lookup's own code does. It is on the tile's path when admitted, every index of
 * the tile is in range (an axis' all in [0, n), or all in [-n, 0): counted from the end) and its
 * elements' span fits the slots left: its offsets are then first + the slot's, exactly.
 * Otherwise the tile's adjoints go to the accumulator one by one (mod_scatter), where a lookup
 * out of range is clamped as before; score_mod's own lookups report it. */
DEV void mod_tile_term(const attn_mods_gpu *m, mod_tile *t, int k, int arr, int nidx, const int64_t *i0,
                       const int64_t *a, const int64_t *c, int rows, int cols)
{
    if (!MOD_TILE_ADMITS(k) || m->a[arr].grad < 0 || rows <= 0 || cols <= 0)
        return;
    int64_t off = 0, A = 0, C = 0;
    for (int ax = 0; ax < nidx; ax++) {
        const int64_t n = m->a[arr].shape[ax], s = m->a[arr].s[ax];
        if (i0[ax] < -n || i0[ax] >= n)           /* bounds what follows: no overflow */
            return;
        const int64_t lo = i0[ax] + (a[ax] < 0 ? a[ax] * (rows - 1) : 0) + (c[ax] < 0 ? c[ax] * (cols - 1) : 0);
        const int64_t hi = i0[ax] + (a[ax] > 0 ? a[ax] * (rows - 1) : 0) + (c[ax] > 0 ? c[ax] * (cols - 1) : 0);
        int64_t j;
        if (lo >= 0 && hi < n)
            j = i0[ax];
        else if (lo >= -n && hi < 0)
            j = i0[ax] + n;
        else
            return;
        off += j * s;
        A += a[ax] * s;
        C += c[ax] * s;
    }
    const int room = t->slots - t->used;
    if ((rows > 1 && mod_iabs(A) >= room) || (cols > 1 && mod_iabs(C) >= room))
        return;
    const int64_t span = mod_iabs(A) * (rows - 1) + mod_iabs(C) * (cols - 1) + 1;
    if (span > room)
        return;
    const int64_t first = off + (A < 0 ? A * (rows - 1) : 0) + (C < 0 ? C * (cols - 1) : 0);
    t->on |= 1 << k;
    t->at[k] = t->used;
    t->count[k] = (int)span;
    t->base[k] = (int)(uint32_t)((uint64_t)t->used - (uint64_t)first);
    t->dst[k] = m->dacc + (m->a[arr].grad + first) * ATTN_MOD_WORDS;
    t->used += (int)span;
}

/* The adjoint v of term k at element off of array arr: into the tile's shared sums where the
 * term is admitted and t (NULL: the tile takes no path, or no tile) given, else mod_scatter. */
DEV void mod_scatter_tile(const attn_mods_gpu *m, const mod_tile *t, int k, int arr, int64_t off, float v)
{
    if (!t || !MOD_TILE_ADMITS(k)) {
        mod_scatter(m, arr, off, v);
        return;
    }
    if (v == 0.f)
        return;
    const uint32_t u = mod_bits(v), flag = mod_flag(u), neg = u >> 31;
    if (flag) {                                    /* rare: straight to the flags word */
        mod_or_word(m->dacc + (m->a[arr].grad + off) * ATTN_MOD_WORDS + MOD_LIMBS, flag);
        return;
    }
    int pos;
    const uint64_t mant = mod_mant(u, &pos);
    const int chunk = pos / MOD_CHUNK_BITS, shift = pos % MOD_CHUNK_BITS;
    const uint64_t wide = mant << shift;          /* < 2^35: three chunks' digits */
    const uint32_t mask = (1u << MOD_CHUNK_BITS) - 1;
    const uint32_t d0 = (uint32_t)wide & mask, d1 = (uint32_t)(wide >> MOD_CHUNK_BITS) & mask,
                   d2 = (uint32_t)(wide >> (2 * MOD_CHUNK_BITS));
    uint32_t *w = t->acc + chunk * t->slots + (int)((uint32_t)off + (uint32_t)t->base[k]);
    if (d0)
        mod_tile_word(w, neg ? 0u - d0 : d0);
    if (d1)
        mod_tile_word(w + t->slots, neg ? 0u - d1 : d1);
    if (d2)
        mod_tile_word(w + 2 * t->slots, neg ? 0u - d2 : d2);
}

/* The tile's sums into the accumulator, each nonzero limb by one atomic, and its words zeroed:
 * thread tid of `threads` takes every threads-th (limb, slot). Call it once every thread's
 * mod_scatter_tile of the tile is done, and let no thread add again before all are through. A
 * word's sum is exact as a signed 32-bit number (the top of this file), so limb j's digits are
 * chunk 2j's plus chunk 2j + 1's times 2^12: the limb mod_scatter would have added into. */
DEV void mod_tile_flush(const mod_tile *t, int tid, int threads)
{
    for (int i = tid; i < t->used * MOD_LIMBS; i += threads) {
        const int slot = i % t->used, limb = i / t->used;
        uint32_t *w = t->acc + 2 * limb * t->slots + slot;
        const uint32_t lo = w[0], hi = w[t->slots];
        if (!(lo | hi))
            continue;
        w[0] = 0;
        w[t->slots] = 0;
        const int64_t v = (int64_t)(int32_t)lo + (int64_t)(int32_t)hi * (1 << MOD_CHUNK_BITS);
        for (int k = 0; k < MOD_TILE_TERMS; k++)
            if (v && MOD_TILE_ADMITS(k) && slot >= t->at[k] && slot < t->at[k] + t->count[k])
                mod_add_word(t->dst[k] + (int64_t)(slot - t->at[k]) * ATTN_MOD_WORDS + limb, (uint64_t)v);
    }
}

#endif
