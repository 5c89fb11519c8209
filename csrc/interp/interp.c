/* The score_mod / mask_mod interpreter (interp.h), instantiated for float and double
 * accumulation (interp_impl.h), plus what both share: the op names, index normalisation and
 * error reporting, and a mask program over a whole block-mask tile by intervals (interp_cell).
 * NumPy's int64 rules and the intervals over them: mod_ints.h, the GPU's too. */
#include <math.h>
#include <string.h>

#include "interp.h"
#include "mod_ints.h"

#define INTERP_NAME(name) #name,
const char *const interp_op_names[OP_COUNT] = {INTERP_OPS(INTERP_NAME)};
#undef INTERP_NAME

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

/* The operand kinds of each op: 'f' float register, 'i' int register, 't' an integer type
 * (mod_ints.h's MOD_I64 ... MOD_U64), '-' unused; for loads and scatters (a, b, c) are the
 * array, the aux offset and the index count. */
static const char *op_signature(interp_op op)
{
#define CASE(name) case OP_##name:
    switch (op) {
    case OP_f_neg: case OP_f_abs: INTERP_LIBM1(CASE)
        return "ff--";
    INTERP_LIBM2(CASE)
        return "fff-";
#undef CASE
    case OP_f_where: return "fiff";
    case OP_f_from_i: return "fi-t";
    case OP_f_lt: case OP_f_le: case OP_f_gt: case OP_f_ge: case OP_f_eq: case OP_f_ne:
        return "iff-";
    case OP_i_neg: case OP_i_abs: case OP_i_not: case OP_i_cast:
        return "ii-t";
    case OP_b_not: return "ii--";
    case OP_i_where: return "iiii";
    case OP_load_f: case OP_scatter: return "f...";
    case OP_load_i: return "i...";
    case OP_stash_f: case OP_unstash_f: return "f:--";
    case OP_stash_i: case OP_unstash_i: return "i;--";
    default:
        return op < OP_i_add ? "fff-" : "iiit";
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
            if (sig[j] == 't' && (r < MOD_I64 || r > MOD_U64))
                return "unknown integer type";
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

/* ------------------------------------------------------------------ a tile by intervals */
/* A value that is nonzero (true) or zero (false): the set of those it may be (mod_ints.h) */
static int truth(mod_iv v)
{
    return v.top ? 3 : mod_set(!(v.lo == 0 && v.hi == 0), v.lo <= 0 && v.hi >= 0);
}

/* The values a lookup may read over the tile (load_i; load_f only checks its box): the index
 * box scanned, at most MOD_CELL_SCAN elements, else unknown; *must where the box may leave the
 * array (every pair of the tile is active: the pairs then report it). */
static mod_iv cell_load(const interp_array *arr, const int64_t *idx, int64_t nidx, const mod_iv *ir,
                        int values, int *must)
{
    mod_iv box[16];
    int64_t first[16], n[16], count;
    if (nidx > 16) {                      /* unknown; every pair is evaluated and checked */
        *must = 1;
        return mod_iv_top();
    }
    for (int64_t ax = 0; ax < nidx; ax++)
        box[ax] = ir[idx[ax]];
    if (!mod_cell_box(box, arr->shape, (int)nidx, 1, first, n, &count, must) || !values)
        return mod_iv_top();
    int64_t j[16] = {0}, lo = 0, hi = 0;
    for (int64_t e = 0; e < count; e++) {
        int64_t off = 0;
        for (int64_t ax = 0; ax < nidx; ax++)
            off = off * arr->shape[ax] + first[ax] + j[ax];
        const int64_t v = arr->kind == ARR_BOOL ? ((const unsigned char *)arr->data)[off] != 0
                                                : ((const int64_t *)arr->data)[off];
        lo = e == 0 || v < lo ? v : lo;
        hi = e == 0 || v > hi ? v : hi;
        for (int64_t ax = nidx - 1; ax >= 0 && ++j[ax] == n[ax]; ax--)
            j[ax] = 0;
    }
    return mod_iv_range(lo, hi);
}

int interp_cell(const interp_prog *pg, int64_t b, int64_t h, int64_t r0, int64_t r1, int64_t c0,
                int64_t c1, void *scratch)
{
    mod_iv *ir = (mod_iv *)scratch;
    int must = 0;
    for (int64_t r = 0; r < pg->n_iregs; r++)
        ir[r] = mod_iv_top();
    ir[INTERP_I_Q] = mod_iv_range(r0, r1);
    ir[INTERP_I_KV] = mod_iv_range(c0, c1);
    ir[INTERP_I_B] = mod_iv_point(b);
    ir[INTERP_I_H] = mod_iv_point(h);
    for (int64_t j = 0; j < pg->n_iconst; j++)
        ir[INTERP_I_FIRST_CONST + j] = mod_iv_point(pg->iconst[j]);
    for (int64_t n = 0; n < pg->n_instr; n++) {
        const int64_t *in = pg->instr + 5 * n;
        const int64_t op = in[0], d = in[1], a = in[2], bb = in[3], c = in[4];
        /* a uint64 op reads its operands as uint64s: a constant past int64 (negative bits) is
         * no interval of its value */
        const int u64 = c == MOD_U64 && op_signature((interp_op)op)[3] == 't';
        const mod_iv xv = u64 ? mod_iv_fit(ir[a], MOD_U64) : ir[a];
        const mod_iv yv = u64 ? mod_iv_fit(ir[bb], MOD_U64) : ir[bb];
        const mod_iv *x = &xv, *y = &yv;
        mod_iv z = mod_iv_top();
        switch ((interp_op)op) {
        case OP_f_lt: case OP_f_le: case OP_f_gt: case OP_f_ge: case OP_f_eq: case OP_f_ne:
            z = mod_iv_range(0, 1);
            break;
        /* the exact result where it fits the op's type c (nothing wrapped), else unknown */
        case OP_i_add: z = mod_iv_fit(mod_iv_add(*x, *y), (int)c); break;
        case OP_i_sub: z = mod_iv_fit(mod_iv_sub(*x, *y), (int)c); break;
        case OP_i_mul: z = mod_iv_fit(mod_iv_mul(*x, *y), (int)c); break;
        case OP_i_floordiv: z = mod_iv_fit(mod_iv_floordiv(*x, *y), (int)c); break;
        case OP_i_mod: z = mod_iv_fit(mod_iv_mod(*x, *y), (int)c); break;
        case OP_i_minimum: z = mod_iv_fit(mod_iv_min(*x, *y), (int)c); break;
        case OP_i_maximum: z = mod_iv_fit(mod_iv_max(*x, *y), (int)c); break;
        case OP_i_neg: z = mod_iv_fit(mod_iv_neg(*x), (int)c); break;
        case OP_i_abs: z = mod_iv_fit(mod_iv_abs(*x), (int)c); break;
        case OP_i_cast: z = mod_iv_fit(*x, (int)c); break;
        case OP_i_and: case OP_i_or: case OP_i_xor:   /* of bools (0 / 1); of other ints unknown */
            if (!x->top && !y->top && x->lo >= 0 && x->hi <= 1 && y->lo >= 0 && y->hi <= 1) {
                const int s = op == OP_i_and ? mod_set_and(truth(*x), truth(*y))
                            : op == OP_i_or ? mod_set_or(truth(*x), truth(*y)) : mod_set_xor(truth(*x), truth(*y));
                z = mod_iv_of_set(s);
            }
            break;
        case OP_b_not: z = mod_iv_of_set(mod_set_not(truth(*x))); break;
        case OP_i_where: z = mod_iv_where(truth(*x), ir[bb], ir[c]); break;
        case OP_i_lt: z = mod_iv_of_set(mod_iv_lt(*x, *y)); break;
        case OP_i_le: z = mod_iv_of_set(mod_iv_le(*x, *y)); break;
        case OP_i_gt: z = mod_iv_of_set(mod_iv_lt(*y, *x)); break;
        case OP_i_ge: z = mod_iv_of_set(mod_iv_le(*y, *x)); break;
        case OP_i_eq: z = mod_iv_of_set(mod_iv_eq(*x, *y)); break;
        case OP_i_ne: z = mod_iv_of_set(mod_set_not(mod_iv_eq(*x, *y))); break;
        case OP_load_i: case OP_load_f:
            /* a uint64 array's values (bits in int64) have no interval here */
            z = cell_load(&pg->arrays[a], pg->aux + bb, c, ir,
                          op == OP_load_i && pg->arrays[a].kind != ARR_UINT64, &must);
            if (op == OP_load_f)
                continue;
            break;
        case OP_scatter: case OP_stash_f: case OP_stash_i: case OP_unstash_f: case OP_unstash_i:
            return 3;                     /* not in a mask program */
        case OP_i_pow: case OP_i_not:
            break;
        default:                          /* float results: not followed */
            continue;
        }
        ir[d] = z;
    }
    return must ? 3 : truth(ir[pg->out]);
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
