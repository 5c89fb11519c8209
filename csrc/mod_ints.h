/* NumPy's integer rules and the intervals over them (mask_mod over a whole block-mask cell): plain
 * C, shared by the GPU's generated code (kernels/attn_mods.cuh, NVRTC) and the CPU backend
 * (csrc/interp/interp.c). DEV: the including file's (static inline by default). */
#ifndef ATTNEXT_MOD_INTS_H
#define ATTNEXT_MOD_INTS_H

#ifndef __CUDACC_RTC__
#include <stdint.h>      /* NVRTC: attn_params.h's types, included first */
#endif

#ifndef DEV
#define DEV static inline
#endif

/* ---------------------------------------------------------------- NumPy's integer rules */
DEV int64_t mod_iadd(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
DEV int64_t mod_isub(int64_t a, int64_t b) { return (int64_t)((uint64_t)a - (uint64_t)b); }
DEV int64_t mod_imul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }
DEV int64_t mod_ineg(int64_t a) { return (int64_t)(0 - (uint64_t)a); }
DEV int64_t mod_iabs(int64_t a) { return a < 0 ? mod_ineg(a) : a; }

/* The same rules on int64 values that the GPU code generator proved within int32, operands and
 * result (codegen.py: _SMALL_INT_OPS): computed in int32, which then neither wraps nor differs */
DEV int64_t mod_sadd(int64_t a, int64_t b) { return (int32_t)a + (int32_t)b; }
DEV int64_t mod_ssub(int64_t a, int64_t b) { return (int32_t)a - (int32_t)b; }
DEV int64_t mod_smul(int64_t a, int64_t b) { return (int32_t)a * (int32_t)b; }
DEV int64_t mod_sneg(int64_t a) { return -(int32_t)a; }
DEV int64_t mod_sabs(int64_t a) { const int32_t x = (int32_t)a; return x < 0 ? -x : x; }
DEV int64_t mod_smin(int64_t a, int64_t b) { const int32_t x = (int32_t)a, y = (int32_t)b; return x <= y ? x : y; }
DEV int64_t mod_smax(int64_t a, int64_t b) { const int32_t x = (int32_t)a, y = (int32_t)b; return x >= y ? x : y; }

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

/* ---------------------------------------------------------------- narrower integer types
 * A value of type t (attnext/trace.py's INTS, the codes below) is held in an int64_t: its value,
 * or a uint64's bits. An op of type t computes in 64 bits and wraps the result into t (mod_wrap),
 * which gives NumPy's result wherever the 64-bit one is right modulo 2^bits (+ - * ** ~, and
 * // whose only overflow is MIN // -1); uint64 divides, compares and converts unsigned. */
enum { MOD_I64 = 0, MOD_I8, MOD_I16, MOD_I32, MOD_U8, MOD_U16, MOD_U32, MOD_U64 };

DEV int64_t mod_wrap(int64_t v, int t)
{
    const uint64_t u = (uint64_t)v;
    switch (t) {
    case MOD_I8: return (int64_t)((u & 0xffu) ^ 0x80u) - 0x80;
    case MOD_I16: return (int64_t)((u & 0xffffu) ^ 0x8000u) - 0x8000;
    case MOD_I32: return (int64_t)((u & 0xffffffffu) ^ 0x80000000u) - 0x80000000LL;
    case MOD_U8: return (int64_t)(u & 0xffu);
    case MOD_U16: return (int64_t)(u & 0xffffu);
    case MOD_U32: return (int64_t)(u & 0xffffffffu);
    default: return v;
    }
}

DEV int mod_unsigned(int t) { return t >= MOD_U8; }
DEV int64_t mod_tadd(int64_t a, int64_t b, int t) { return mod_wrap(mod_iadd(a, b), t); }
DEV int64_t mod_tsub(int64_t a, int64_t b, int t) { return mod_wrap(mod_isub(a, b), t); }
DEV int64_t mod_tmul(int64_t a, int64_t b, int t) { return mod_wrap(mod_imul(a, b), t); }
DEV int64_t mod_tpow(int64_t a, int64_t b, int t) { return mod_wrap(mod_ipow(a, b), t); }
DEV int64_t mod_tneg(int64_t a, int t) { return mod_wrap(mod_ineg(a), t); }
DEV int64_t mod_tnot(int64_t a, int t) { return mod_wrap(~a, t); }
DEV int64_t mod_tabs(int64_t a, int t) { return mod_unsigned(t) ? a : mod_wrap(mod_iabs(a), t); }
DEV int64_t mod_tfloordiv(int64_t a, int64_t b, int t)
{
    if (t == MOD_U64)
        return b ? (int64_t)((uint64_t)a / (uint64_t)b) : 0;
    return mod_wrap(mod_ifloordiv(a, b), t);
}
DEV int64_t mod_tmod(int64_t a, int64_t b, int t)
{
    if (t == MOD_U64)
        return b ? (int64_t)((uint64_t)a % (uint64_t)b) : 0;
    return mod_imod(a, b);
}
DEV int mod_tlt(int64_t a, int64_t b, int t) { return t == MOD_U64 ? (uint64_t)a < (uint64_t)b : a < b; }
DEV int mod_tle(int64_t a, int64_t b, int t) { return t == MOD_U64 ? (uint64_t)a <= (uint64_t)b : a <= b; }
DEV int64_t mod_tmin(int64_t a, int64_t b, int t) { return mod_tle(a, b, t) ? a : b; }
DEV int64_t mod_tmax(int64_t a, int64_t b, int t) { return mod_tle(b, a, t) ? a : b; }

/* ---------------------------------------------------------------- block-mask cells
 * mask_mod over a whole cell of pairs at once: the GPU's generated mod_mask_cell (codegen;
 * kernels/attn_block_mask.cu asks it before evaluating a cell pair by pair) and the CPU
 * interpreter's interp_cell (interp.c; cpu_impl.h's block mask). An integer value is an interval (mod_iv;
 * top: unknown), a bool one the set of values it may take: bit 1 true, bit 2 false (the block
 * mask's ATTN_BLOCK_KEPT / ATTN_BLOCK_MASKED). Every rule over-approximates, so a cell whose
 * result is one bit is that for every pair in it. The integer rules wrap (mod_iadd ...); an
 * interval reaching past +-2^31 is made top, so no rule here can overflow: products of two
 * such bounds fit int64. */
#define MOD_IV_BIG ((int64_t)1 << 31)
#define MOD_CELL_SCAN 256             /* a lookup reads at most this many elements for its range */

typedef struct {
    int64_t lo, hi;
    int top;
} mod_iv;

DEV mod_iv mod_iv_range(int64_t lo, int64_t hi)
{
    mod_iv r;
    r.lo = lo;
    r.hi = hi;
    r.top = lo < -MOD_IV_BIG || hi > MOD_IV_BIG;
    return r;
}

DEV mod_iv mod_iv_top(void) { return mod_iv_range(0, MOD_IV_BIG + 1); }
DEV mod_iv mod_iv_point(int64_t v) { return mod_iv_range(v, v); }
DEV int64_t mod_min64(int64_t a, int64_t b) { return a < b ? a : b; }
DEV int64_t mod_max64(int64_t a, int64_t b) { return a > b ? a : b; }

DEV mod_iv mod_iv_add(mod_iv a, mod_iv b)
{
    return a.top || b.top ? mod_iv_top() : mod_iv_range(a.lo + b.lo, a.hi + b.hi);
}

DEV mod_iv mod_iv_sub(mod_iv a, mod_iv b)
{
    return a.top || b.top ? mod_iv_top() : mod_iv_range(a.lo - b.hi, a.hi - b.lo);
}

DEV mod_iv mod_iv_neg(mod_iv a) { return a.top ? a : mod_iv_range(-a.hi, -a.lo); }

DEV mod_iv mod_iv_mul(mod_iv a, mod_iv b)
{
    if (a.top || b.top)
        return mod_iv_top();
    const int64_t p0 = a.lo * b.lo, p1 = a.lo * b.hi, p2 = a.hi * b.lo, p3 = a.hi * b.hi;
    return mod_iv_range(mod_min64(mod_min64(p0, p1), mod_min64(p2, p3)),
                        mod_max64(mod_max64(p0, p1), mod_max64(p2, p3)));
}

DEV mod_iv mod_iv_abs(mod_iv a)
{
    if (a.top || a.lo >= 0)
        return a;
    return a.hi <= 0 ? mod_iv_neg(a) : mod_iv_range(0, mod_max64(-a.lo, a.hi));
}

DEV mod_iv mod_iv_min(mod_iv a, mod_iv b)
{
    return a.top || b.top ? mod_iv_top() : mod_iv_range(mod_min64(a.lo, b.lo), mod_min64(a.hi, b.hi));
}

DEV mod_iv mod_iv_max(mod_iv a, mod_iv b)
{
    return a.top || b.top ? mod_iv_top() : mod_iv_range(mod_max64(a.lo, b.lo), mod_max64(a.hi, b.hi));
}

/* a // d: monotone in each operand where d keeps one sign, so its corners bound it */
DEV mod_iv mod_iv_floordiv(mod_iv a, mod_iv d)
{
    if (a.top || d.top || (d.lo <= 0 && d.hi >= 0))
        return mod_iv_top();
    const int64_t p0 = mod_ifloordiv(a.lo, d.lo), p1 = mod_ifloordiv(a.lo, d.hi);
    const int64_t p2 = mod_ifloordiv(a.hi, d.lo), p3 = mod_ifloordiv(a.hi, d.hi);
    return mod_iv_range(mod_min64(mod_min64(p0, p1), mod_min64(p2, p3)),
                        mod_max64(mod_max64(p0, p1), mod_max64(p2, p3)));
}

/* a % d takes d's sign; exact where d is one value and a stays in one period */
DEV mod_iv mod_iv_mod(mod_iv a, mod_iv d)
{
    if (a.top || d.top || (d.lo <= 0 && d.hi >= 0))
        return mod_iv_top();
    if (d.lo == d.hi && mod_ifloordiv(a.lo, d.lo) == mod_ifloordiv(a.hi, d.lo))
        return mod_iv_range(mod_imod(a.lo, d.lo), mod_imod(a.hi, d.lo));
    return d.lo > 0 ? mod_iv_range(0, d.hi - 1) : mod_iv_range(d.lo + 1, 0);
}

DEV mod_iv mod_iv_where(int c, mod_iv a, mod_iv b)
{
    if (c == 1)
        return a;
    if (c == 2)
        return b;
    return a.top || b.top ? mod_iv_top() : mod_iv_range(mod_min64(a.lo, b.lo), mod_max64(a.hi, b.hi));
}

/* v as a value of type t: unchanged where every value in it fits t (nothing wrapped), else top
 * (a uint64 held as negative bits is past int64: top too) */
DEV mod_iv mod_iv_fit(mod_iv v, int t)
{
    int64_t lo = 0, hi = MOD_IV_BIG;      /* an interval never reaches past MOD_IV_BIG */
    switch (t) {
    case MOD_I8: lo = -128; hi = 127; break;
    case MOD_I16: lo = -32768; hi = 32767; break;
    case MOD_I32: lo = -MOD_IV_BIG; hi = MOD_IV_BIG - 1; break;
    case MOD_U8: hi = 255; break;
    case MOD_U16: hi = 65535; break;
    case MOD_U32: case MOD_U64: break;
    default: return v;
    }
    return v.top || (v.lo >= lo && v.hi <= hi) ? v : mod_iv_top();
}

DEV mod_iv mod_iv_of_set(int c) { return mod_iv_range(c & 2 ? 0 : 1, c & 1 ? 1 : 0); }

/* comparisons and logic: sets of bool values (1 may be true, 2 may be false) */
DEV int mod_set(int may_true, int may_false) { return (may_true ? 1 : 0) | (may_false ? 2 : 0); }
DEV int mod_iv_lt(mod_iv a, mod_iv b) { return a.top || b.top ? 3 : mod_set(a.lo < b.hi, a.hi >= b.lo); }
DEV int mod_iv_le(mod_iv a, mod_iv b) { return a.top || b.top ? 3 : mod_set(a.lo <= b.hi, a.hi > b.lo); }
DEV int mod_iv_eq(mod_iv a, mod_iv b)
{
    return a.top || b.top ? 3 : mod_set(a.lo <= b.hi && b.lo <= a.hi, !(a.lo == a.hi && b.lo == b.hi && a.lo == b.lo));
}
DEV int mod_set_not(int a) { return ((a & 1) << 1) | ((a & 2) >> 1); }
DEV int mod_set_and(int a, int b) { return mod_set((a & 1) && (b & 1), (a & 2) || (b & 2)); }
DEV int mod_set_or(int a, int b) { return mod_set((a & 1) || (b & 1), (a & 2) && (b & 2)); }
DEV int mod_set_xor(int a, int b)
{
    return mod_set(((a & 1) && (b & 2)) || ((a & 2) && (b & 1)), ((a & 1) && (b & 1)) || ((a & 2) && (b & 2)));
}
DEV int mod_set_where(int c, int a, int b) { return c == 1 ? a : c == 2 ? b : a | b; }
DEV int mod_cell_set(mod_iv v) { return v.top ? 3 : mod_set(v.hi >= 1, v.lo <= 0); }   /* a bool lookup's */

/* A lookup's index box over a cell (idx: one interval an axis of an array of these dims): per
 * axis its first element (a negative index counts from the end) and count. 1 when the box is
 * known and holds at most MOD_CELL_SCAN elements (*count), else 0 (the lookup's value is then
 * unknown). Where an index may leave its axis, *must is set if the lookup is checked: the cell
 * is evaluated pair by pair, which reports it. The GPU's mod_cell_load (attn_mods.cuh) and the
 * CPU's cell_load (interp.c) scan the box. */
DEV int mod_cell_box(const mod_iv *idx, const int64_t *shape, int nidx, int checked, int64_t *first, int64_t *n,
                     int64_t *count, int *must)
{
    int known = 1;
    *count = 1;
    for (int ax = 0; ax < nidx; ax++) {
        const int64_t size = shape[ax];
        const mod_iv i = idx[ax];
        if (i.top || i.lo < -size || i.hi >= size) {
            *must |= checked;
            known = 0;
        } else if (i.lo < 0 && i.hi >= 0) {       /* both ends of the axis: two runs */
            known = 0;
        } else if (known) {
            first[ax] = i.lo < 0 ? i.lo + size : i.lo;
            n[ax] = i.hi - i.lo + 1;
            known = n[ax] <= MOD_CELL_SCAN && (*count *= n[ax]) <= MOD_CELL_SCAN;
        }
    }
    return known;
}

#endif
