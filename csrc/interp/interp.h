/* The CPU backend's interpreter for score_mod / mask_mod programs (docs/design.md "score_mod and
 * mask_mod"): attnext/mods/interp.py lowers a traced graph to a flat program, and this evaluates it
 * over the pairs of a score tile, a vector of VL pairs at a time. No compiler at run time.
 *
 * Registers each hold one value per pair of the chunk. Float registers (the accumulation type T):
 * 0 the score, 1 the incoming gradient dout (derivative programs), then one register per float
 * constant (values in interp_prog.floats, given per call: the function's float constants are
 * parameters), then temporaries. Integer registers (int64; bools are 0 / 1): 0 q_idx,
 * 1 kv_idx, 2 b, 3 h, then one per int constant (interp_prog.iconst, part of the program),
 * then temporaries.
 *
 * An instruction is five int64: op, dst, a, b, c. Loads and scatters name an array (a), an
 * offset into aux where its index registers start (b) and their count (c); a scatter's dst is
 * the register of the value it adds. Integer arithmetic wraps and // and % follow NumPy's rules
 * (by zero: 0; floor for negatives); float // and % follow NumPy's float rules. An integer
 * register holds a value of one of NumPy's integer types (mod_ints.h: its value, a uint64's bits);
 * the integer ops whose signature ends in 't' (op_signature, interp.c) name that type in c: their
 * result's, or for comparisons and f_from_i their operands', MOD_I64 (0) for int64.
 *
 * Lookups: an index is normalised as NumPy does (negative counts from the end). At an active
 * pair an index out of range stops the evaluation with an interp_error (nothing is read); at
 * other pairs it is clamped, and an empty axis reads 0.
 */
#ifndef ATTNEXT_INTERP_H
#define ATTNEXT_INTERP_H

#include <stdint.h>

/* pairs per chunk: registers are VL values wide */
#define INTERP_VL 256

#define INTERP_F_SCORE 0
#define INTERP_F_DOUT 1
#define INTERP_F_FIRST_CONST 2
#define INTERP_I_Q 0
#define INTERP_I_KV 1
#define INTERP_I_B 2
#define INTERP_I_H 3
#define INTERP_I_FIRST_CONST 4

/* float -> float and float x float -> float by the C math library's function of the op's name
 * (expf / exp for the accumulation type): attnext/trace.py's _UNARY_FLOAT and _BINARY_FLOAT */
#define INTERP_LIBM1(X)                                                                         \
    X(exp) X(exp2) X(log) X(log2) X(sqrt) X(tanh) X(sin) X(cos) X(tan) X(asin) X(acos) X(atan) \
    X(sinh) X(cosh) X(asinh) X(acosh) X(atanh) X(expm1) X(log1p) X(log10) X(cbrt) X(floor)    \
    X(ceil) X(rint) X(trunc)
#define INTERP_LIBM2(X) X(atan2) X(hypot) X(copysign)

/* X(name): the ops, in opcode order. attnext/interp.py reads the names from _C.interp_ops(). */
#define INTERP_OPS(X)                                                                           \
    /* float x float -> float */                                                                \
    X(f_add) X(f_sub) X(f_mul) X(f_truediv) X(f_floordiv) X(f_mod) X(f_pow) X(f_minimum)        \
    X(f_maximum) X(f_dmul) INTERP_LIBM2(X)                                                      \
    /* float -> float */                                                                        \
    X(f_neg) X(f_abs) INTERP_LIBM1(X)                                                           \
    /* (bool, float, float) -> float; int -> float */                                          \
    X(f_where) X(f_from_i)                                                                      \
    /* float x float -> bool */                                                                 \
    X(f_lt) X(f_le) X(f_gt) X(f_ge) X(f_eq) X(f_ne)                                             \
    /* int x int -> int */                                                                      \
    X(i_add) X(i_sub) X(i_mul) X(i_floordiv) X(i_mod) X(i_pow) X(i_minimum) X(i_maximum)        \
    X(i_and) X(i_or) X(i_xor)                                                                   \
    /* int -> int (b_not: logical not of a bool; i_cast: into type c) */                        \
    X(i_neg) X(i_abs) X(i_not) X(b_not) X(i_cast)                                               \
    /* (bool, int, int) -> int */                                                               \
    X(i_where)                                                                                  \
    /* int x int -> bool */                                                                     \
    X(i_lt) X(i_le) X(i_gt) X(i_ge) X(i_eq) X(i_ne)                                             \
    /* lookups into a float array (-> float) or an int / bool array (-> int); scatter-add */    \
    X(load_f) X(load_i) X(scatter)                                                              \
    /* a register to / from stash slot a (float or int) for the pairs of the tile */           \
    X(stash_f) X(stash_i) X(unstash_f) X(unstash_i)

#define INTERP_ENUM(name) OP_##name,
typedef enum { INTERP_OPS(INTERP_ENUM) OP_COUNT } interp_op;
#undef INTERP_ENUM

extern const char *const interp_op_names[OP_COUNT];

typedef enum { ARR_FLOAT = 0, ARR_INT = 1, ARR_BOOL = 2, ARR_UINT64 = 3 } interp_array_kind;

/* A captured array, C-contiguous: float arrays in the accumulation type, int arrays int64 (a
 * uint64 array's as its bits: ARR_UINT64), bool arrays one byte. For a float array with a gradient, grad_offset is where its gradient starts in
 * the accumulator (double, interp_mods.n_grad elements), else -1. */
typedef struct {
    interp_array_kind kind;
    int64_t ndim, size, grad_offset;
    const int64_t *shape;
    const void *data;
} interp_array;

typedef struct {
    int64_t n_instr, n_fregs, n_iregs;
    int64_t out;                 /* the result register */
    int out_is_int;              /* 1 for a mask program (an int register), else 0 (float) */
    int fn;                      /* whose arrays: 0 the score_mod's, 1 the mask_mod's */
    const int64_t *instr;        /* n_instr x 5 */
    const int64_t *aux;          /* index registers of loads and scatters */
    int64_t n_aux;
    const int64_t *iconst;       /* values of the int constant registers */
    int64_t n_iconst;
    const double *floats;        /* values of the float constant registers (this call's) */
    int64_t n_floats;
    const interp_array *arrays;  /* the function's captured arrays */
    int64_t n_arrays;
} interp_prog;

/* What stopped an evaluation: an index out of range at an active pair. */
typedef struct {
    int failed;
    int64_t fn, array, axis, index, size;
} interp_error;

/* A call's score_mod and mask_mod. A program with n_instr < 0 is absent. The backward runs
 * score_bwd (score with stash instructions: the values its derivative reads, kept per pair of
 * the tile in n_fstash float and n_istash int slots) and then grad, which unstashes them instead
 * of computing them again. */
typedef struct interp_mods {
    interp_prog score, mask, score_bwd, grad;
    int64_t n_fstash, n_istash;
    int64_t n_grad;              /* gradient elements of the score_mod's float arrays */
    double *dtensors;            /* backward: those gradients (n_grad), written */
    int mask_uses_h;             /* 0: one block mask serves every head */
    interp_error *err;           /* set by the first failing evaluation */
} interp_mods;

/* The pairs of one evaluation: pair k is (q_idx, kv_idx) = (r0 + k / ld, c0 + k % ld) of
 * sequence b, query head h. active (NULL: all) marks the pairs whose lookups must be in range. */
typedef struct {
    int64_t b, h, r0, c0, ld, n;
    const unsigned char *active;
} interp_tile;

static inline int interp_has(const interp_prog *pg) { return pg->n_instr >= 0; }

/* NULL when pg only names registers, arrays and aux entries that exist, with loads of the
 * right kind, else what is wrong (module.c checks every program before a call). */
const char *interp_check(const interp_mods *mods, const interp_prog *pg);

/* What mask program pg may give over the pairs q_idx in [r0, r1], kv_idx in [c0, c1] of
 * sequence b, head h, all inside the lengths, by intervals (mod_ints.h): 1 every pair kept, 2
 * every pair masked, 3 either, or a lookup may leave its array there (evaluating the pairs then
 * reports it). scratch: interp_scratch_bytes' worth (any element size). */
int interp_cell(const interp_prog *pg, int64_t b, int64_t h, int64_t r0, int64_t r1, int64_t c0,
                int64_t c1, void *scratch);

/* Scratch for one thread's evaluations of any program of mods, in bytes. */
int64_t interp_scratch_bytes(const interp_mods *mods, int64_t elem_size);

/* Stash bytes for a tile of n pairs. */
int64_t interp_stash_bytes(const interp_mods *mods, int64_t elem_size, int64_t n);

/* Evaluate pg over the tile. score: the scores (float programs; NULL for masks); dout: the
 * incoming gradient (derivative programs); out_f receives a float result, out_b a mask (may
 * alias score / dout); dacc: the gradient accumulator scatters add into (NULL without one);
 * stash: the slots of score_bwd / grad (interp_stash_bytes for t->n pairs; float slots first).
 * Returns 0, or -1 after recording an index out of range in mods->err. */
int interp_eval_f32(const interp_mods *mods, const interp_prog *pg, const interp_tile *t,
                    const float *score, const float *dout, float *out_f, unsigned char *out_b,
                    double *dacc, void *stash, void *scratch);
int interp_eval_f64(const interp_mods *mods, const interp_prog *pg, const interp_tile *t,
                    const double *score, const double *dout, double *out_f, unsigned char *out_b,
                    double *dacc, void *stash, void *scratch);

#endif
