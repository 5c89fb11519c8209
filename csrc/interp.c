/* The score_mod / mask_mod interpreter (interp.h), instantiated for float and double
 * accumulation (interp_impl.h), plus what both share: the op names, NumPy's integer division
 * rules, index normalisation and error reporting. */
#include <math.h>
#include <string.h>

#include "interp.h"

#define INTERP_NAME(name) #name,
const char *const interp_op_names[OP_COUNT] = {INTERP_OPS(INTERP_NAME)};
#undef INTERP_NAME

/* int64 arithmetic that wraps, as NumPy's does (signed overflow is undefined in C) */
static inline int64_t wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
static inline int64_t wrap_sub(int64_t a, int64_t b) { return (int64_t)((uint64_t)a - (uint64_t)b); }
static inline int64_t wrap_mul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }
static inline int64_t wrap_neg(int64_t a) { return (int64_t)(0 - (uint64_t)a); }

/* NumPy's int64 floor_divide and remainder: by zero 0, rounding toward -inf, INT64_MIN // -1
 * wraps to INT64_MIN */
static inline int64_t int_floordiv(int64_t a, int64_t b)
{
    if (b == 0)
        return 0;
    if (b == -1)
        return wrap_neg(a);
    int64_t q = a / b;
    if (a % b != 0 && ((a < 0) != (b < 0)))
        q--;
    return q;
}

static inline int64_t int_mod(int64_t a, int64_t b)
{
    if (b == 0 || b == -1)
        return 0;
    int64_t r = a % b;
    if (r != 0 && ((r < 0) != (b < 0)))
        r += b;
    return r;
}

/* a ** e for a non-negative exponent (the tracer allows no other), wrapping */
static inline int64_t int_pow(int64_t a, int64_t e)
{
    int64_t r = 1;
    if (e < 0)
        return 0;
    while (e) {
        if (e & 1)
            r = wrap_mul(r, a);
        a = wrap_mul(a, a);
        e >>= 1;
    }
    return r;
}

static void record_error(const interp_mods *mods, int64_t fn, int64_t array, int64_t axis,
                         int64_t index, int64_t size)
{
#pragma omp critical(attnext_interp_error)
    {
        interp_error *e = mods->err;
        if (!e->failed) {
            e->fn = fn;
            e->array = array;
            e->axis = axis;
            e->index = index;
            e->size = size;
            e->failed = 1;
        }
    }
}

/* Flat offsets of a lookup into array `arr` for the m pairs of a chunk (index registers idx):
 * offs[k] = -1 where the array is empty at an inactive pair (the value read is then 0).
 * Returns -1 after recording an index out of range at an active pair. */
static int lookup_offsets(const interp_mods *mods, const interp_prog *pg, int64_t arr,
                          const int64_t *idx, int64_t nidx, int64_t *const *ir, int64_t m,
                          const unsigned char *act, int64_t *offs)
{
    const interp_array *a = &pg->arrays[arr];
    for (int64_t k = 0; k < m; k++)
        offs[k] = 0;
    for (int64_t ax = 0; ax < nidx; ax++) {
        const int64_t n = a->shape[ax], *x = ir[idx[ax]];
        for (int64_t k = 0; k < m; k++) {
            int64_t i = x[k] < 0 ? x[k] + n : x[k];
            if (i < 0 || i >= n) {
                if (!act || act[k]) {
                    record_error(mods, pg->fn, arr, ax, x[k], n);
                    return -1;
                }
                i = i < 0 ? 0 : n - 1;
            }
            offs[k] = (n == 0 || offs[k] < 0) ? -1 : offs[k] * n + i;
        }
    }
    return 0;
}

/* The operand kinds of each op: 'f' float register, 'i' int register, '-' unused; for loads
 * and scatters (a, b, c) are the array, the aux offset and the index count. */
static const char *op_signature(interp_op op)
{
    switch (op) {
    case OP_f_neg: case OP_f_abs: case OP_f_exp: case OP_f_exp2: case OP_f_log: case OP_f_log2:
    case OP_f_sqrt: case OP_f_tanh: case OP_f_sin: case OP_f_cos:
        return "ff--";
    case OP_f_where: return "fiff";
    case OP_f_from_i: return "fi--";
    case OP_f_lt: case OP_f_le: case OP_f_gt: case OP_f_ge: case OP_f_eq: case OP_f_ne:
        return "iff-";
    case OP_i_neg: case OP_i_abs: case OP_i_not: case OP_b_not:
        return "ii--";
    case OP_i_where: return "iiii";
    case OP_load_f: case OP_scatter: return "f...";
    case OP_load_i: return "i...";
    case OP_stash_f: case OP_unstash_f: return "f:--";
    case OP_stash_i: case OP_unstash_i: return "i;--";
    default:
        return op < OP_i_add ? "fff-" : "iii-";
    }
}

const char *interp_check(const interp_mods *mods, const interp_prog *pg)
{
    if (!interp_has(pg))
        return NULL;
    if (pg->n_fregs < INTERP_F_FIRST_CONST + pg->n_floats
        || pg->n_iregs < INTERP_I_FIRST_CONST + pg->n_iconst)
        return "too few registers for the constants";
    for (int64_t n = 0; n < pg->n_instr; n++) {
        const int64_t *in = pg->instr + 5 * n;
        if (in[0] < 0 || in[0] >= OP_COUNT)
            return "unknown op";
        const char *sig = op_signature((interp_op)in[0]);
        for (int j = 0; j < 4; j++) {
            int64_t r = in[1 + j], lim = sig[j] == 'f' ? pg->n_fregs : sig[j] == 'i' ? pg->n_iregs : 1;
            if ((sig[j] == 'f' || sig[j] == 'i') && (r < 0 || r >= lim))
                return "register out of range";
        }
        if (sig[1] == ':' || sig[1] == ';') {
            if (in[2] < 0 || in[2] >= (sig[1] == ':' ? mods->n_fstash : mods->n_istash))
                return "stash slot out of range";
            continue;
        }
        if (sig[1] != '.')
            continue;
        int64_t arr = in[2], off = in[3], nidx = in[4];
        if (arr < 0 || arr >= pg->n_arrays || off < 0 || nidx < 0 || off + nidx > pg->n_aux)
            return "bad lookup operands";
        const interp_array *a = &pg->arrays[arr];
        if (nidx != a->ndim)
            return "lookup index count differs from the array's dims";
        if ((in[0] == OP_load_i) != (a->kind != ARR_FLOAT))
            return "lookup of the wrong array kind";
        if (in[0] == OP_scatter && (a->grad_offset < 0 || a->grad_offset + a->size > mods->n_grad))
            return "scatter into an array without a gradient";
        for (int64_t j = 0; j < nidx; j++)
            if (pg->aux[off + j] < 0 || pg->aux[off + j] >= pg->n_iregs)
                return "index register out of range";
    }
    if (pg->out < 0 || pg->out >= (pg->out_is_int ? pg->n_iregs : pg->n_fregs))
        return "result register out of range";
    return NULL;
}

static int64_t prog_scratch(const interp_prog *pg, int64_t elem_size)
{
    if (!interp_has(pg))
        return 0;
    /* registers, their pointers, and the offsets of one lookup */
    return pg->n_fregs * (INTERP_VL * elem_size + (int64_t)sizeof(void *))
           + pg->n_iregs * (INTERP_VL * 8 + (int64_t)sizeof(void *)) + INTERP_VL * 8 + 64;
}

int64_t interp_scratch_bytes(const interp_mods *mods, int64_t elem_size)
{
    const interp_prog *progs[4] = {&mods->score, &mods->mask, &mods->score_bwd, &mods->grad};
    int64_t m = 0;
    for (int i = 0; i < 4; i++) {
        int64_t b = prog_scratch(progs[i], elem_size);
        m = b > m ? b : m;
    }
    return m;
}

int64_t interp_stash_bytes(const interp_mods *mods, int64_t elem_size, int64_t n)
{
    return n * (mods->n_fstash * elem_size + mods->n_istash * 8);
}

#define T float
#define SUF f32
#define M(fn) fn##f
#include "interp_impl.h"
#undef T
#undef SUF
#undef M

#define T double
#define SUF f64
#define M(fn) fn
#include "interp_impl.h"
#undef T
#undef SUF
#undef M
