/* The one parameter struct shared by every backend (flash-attention's Flash_fwd_params).
 *
 * Legend of dimension letters, used by every file in csrc/:
 *   B   batch (number of sequences in varlen)     Hq  query heads     Hk  key/value heads
 *   Sq  query rows per batch item (varlen: rows of the packed tensor, Tq)
 *   Sk  key rows per batch item   (varlen: Tk)    D   q/k head dim    Dv  v head dim
 *   Hb  heads of the bias / mask: 1, Hk or Hq (query head h reads head h / (Hq / Hb))
 *
 * Every tensor is described by a base pointer and int64 element strides, so non-contiguous and
 * broadcast (stride 0) inputs are read in place. A feature that is off is a NULL pointer.
 * Varlen is not a separate entry point: with cu_seqlens set, the tensors have B = 1 in memory and
 * sequence b starts at row cu_seqlens[b] of that one batch item (see seqlen.h).
 */
#ifndef ATTNEXT_ATTN_PARAMS_H
#define ATTNEXT_ATTN_PARAMS_H

/* The same text compiles as C (the CPU backend, the host side) and, handed to NVRTC as an
 * in-memory header, as CUDA: no standard header exists there, so the fixed-width types are
 * spelled out. ATTN_FN marks the small helpers both sides call. */
#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned long size_t;
#define ATTN_FN static __device__ __forceinline__
#else
#include <stddef.h>
#include <stdint.h>
#define ATTN_FN static inline
#endif

typedef enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2, DT_F64 = 3 } attn_dtype;

ATTN_FN size_t dtype_size(attn_dtype dt) { return dt == DT_F64 ? 8 : dt == DT_F32 ? 4 : 2; }

/* What lse and dbias are stored in, and what a backend accumulates in, for inputs of `dt`. */
ATTN_FN attn_dtype acc_dtype(attn_dtype dt) { return dt == DT_F64 ? DT_F64 : DT_F32; }

typedef enum { CAUSAL_NONE = 0, CAUSAL_BOTTOM_RIGHT = 1, CAUSAL_TOP_LEFT = 2 } attn_causal;

/* A strided 4-D view: element [i0, i1, i2, i3] lives at ptr + i0*s[0] + ... + i3*s[3]
 * (strides in elements, any sign, 0 for a broadcast dimension). */
typedef struct {
    void *ptr;
    int64_t s[4];
} tensor4;

/* The GPU's generated score_mod / mask_mod (attnext/codegen.py) read their run-time inputs
 * here: the float constants (parameters, so a sweep over one compiles once) and the captured
 * arrays. Arrays are numbered score_mod's first, then mask_mod's; elements are float32, int64
 * or one byte (bool) by the array's kind, shape and element strides padded at the back. */
#define ATTN_MOD_FLOATS 64
#define ATTN_MOD_ARRAYS 8
#define ATTN_MOD_DIMS 4
typedef struct {
    const void *ptr;
    int64_t shape[ATTN_MOD_DIMS], s[ATTN_MOD_DIMS];
    int64_t grad;                /* first element of its gradient in dacc; -1: none */
} attn_mod_array;

typedef struct {
    float f[ATTN_MOD_FLOATS];
    attn_mod_array a[ATTN_MOD_ARRAYS];
    /* err (5 int64, zeroed): the first lookup out of range sets err[0] = 1 and writes its array,
     * axis, index and size to err[1..4] (attn_mods.cuh) */
    int64_t *err;
    /* the score_mod's array gradients (backward): ATTN_MOD_WORDS words per element, the exact
     * fixed-point sum of every adjoint (attn_mods.cuh: mod_scatter) */
    uint64_t *dacc;
    /* mask_mod's block mask (kernels/attn_block_mask.cu), NULL without one: a byte per
     * ATTN_BLOCK x ATTN_BLOCK cell of a sequence, [b * blk_sb + h * blk_sh + i * blk_cols + j]
     * (blk_sb / blk_sh 0 when mask_mod reads neither b nor h and the lengths are the same for
     * every b, or does not read h). Bit 0: mask_mod keeps some pair of the cell inside the
     * lengths; bit 1: it masks some such pair (ATTN_BLOCK_KEPT / ATTN_BLOCK_MASKED). */
    const uint8_t *blocks;
    int64_t blk_sb, blk_sh, blk_rows, blk_cols;
} attn_mods_gpu;

#define ATTN_BLOCK 64
#define ATTN_BLOCK_KEPT 1
#define ATTN_BLOCK_MASKED 2

typedef struct {
    /* problem size */
    int64_t B, Sq, Sk, Hq, Hk, D, Dv;
    attn_dtype dtype;            /* q, k, v, out, dout, dq, dk, dv */

    /* q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv), out (B, Sq, Hq, Dv) */
    tensor4 q, k, v, out;
    /* lse (B, Hq, Sq), float32 (float64 for DT_F64): s[0], s[1], s[2] used */
    tensor4 lse;
    /* backward: the gradient of lse, laid out as lse is (ptr NULL without one); it joins dS as
     * delta does, with the opposite sign: dS = P (dP - delta + dlse) */
    tensor4 dlse;
    /* attention sinks (Hq) or NULL, float32 (float64 for DT_F64): exp(sinks[h]) joins every real
     * row's sum, lse = log(sum exp(s) + exp(sinks[h])), and a real row that keeps no key gets
     * lse = sinks[h]. GPU backward: dsinks (Hq, float32) = -sum over rows of exp(sinks[h] - lse)
     * delta (attn_bwd_sinks), or NULL */
    const void *sinks;
    void *dsinks;
    /* a paged k / v cache (CPU): k (num_pages, page_size, Hk, D), v likewise, and block_table (B,
     * max_pages) int32 with rows bt_stride apart: key row c of sequence b is row c % page_size of
     * page block_table[b * bt_stride + c / page_size] (seq_k gives only its length then). NULL:
     * k and v hold the rows where seq_k says (key_row in seqlen.h reads both) */
    const int32_t *block_table;
    int64_t bt_stride, page_size, num_pages;   /* num_pages: k's pages; key_row clamps into them */
    /* Hopper decode (attn_fwd.cu TMA_KV): the keys a bulk tensor copy brings (a box's rows; a
     * page's at most); cuda_launch_attention then makes the maps of k and v (attn_tmaps) and
     * passes them as the kernel's second parameter. 0: no maps */
    int64_t tma_rows;
    /* Hopper backward (attn_bwd_sm90.cu's dK/dV kernel, BWD_TMA): the query rows of a bulk tensor
     * copy of q and dout (a query tile's); cuda_launch_attention then makes their maps
     * (attn_bwd_tmaps), the kernel's second parameter. 0: no maps */
    int64_t tma_rows_q;
    /* the persistent WS forward: 1 where the launch made out's map (attn_tmaps.out: out's rows
     * 16-byte aligned), so each tile's O leaves by bulk tensor copies from shared memory; 0: by
     * the computing threads' stores */
    int64_t tma_out;

    /* varlen: cu_seqlens_* (B + 1), seqused_* (B); non-varlen seqlens_* use seqused_* alone */
    const int32_t *cu_seqlens_q, *cu_seqlens_k;
    const int32_t *seqused_q, *seqused_k;
    /* varlen: the most rows a sequence's segment may have, what the GPU's grid covers (the
     * longest segment of host-checked lengths, max_seqlen_* of device lengths); seqlen.h clamps
     * every segment to it and to the tensor, so lengths nobody checked never reach past either */
    int64_t max_rows_q, max_rows_k;

    /* bias (B, Hb, Sq, Sk) in its own dtype bias_dtype; mask (B, Hb, Sq, Sk) bool (1 byte) */
    tensor4 bias;
    attn_dtype bias_dtype;
    int64_t bias_heads;
    tensor4 mask;
    int64_t mask_heads;
    /* alibi slopes (B, Hq), float32 or float64 (alibi_dtype): s[0], s[1] used */
    tensor4 alibi;
    attn_dtype alibi_dtype;

    double scale;                /* multiplies q.k */
    double softcap;              /* 0 = off */
    attn_causal causal;
    int64_t window_left, window_right;   /* -1 = unbounded on that side */

    /* backward: dout like out, dq like q, dk like k, dv like v (all written, never accumulated
     * into). dbias (B, Hb, Sq, Sk) float32 (float64 for DT_F64) is accumulated into: broadcast
     * dimensions have stride 0, so the sum over them lands in one element. */
    tensor4 dout, dq, dk, dv, dbias;
    /* GPU backward scratch (the CPU backend keeps its own): delta (B, Hq, Sq) float32 =
     * rowsum(dout * out) per row, laid out like lse; dq_accum (B, Sq, Hq, D) float32 (the ordered
     * mode's chains: DQ_CHAINS copies between the heads, attn_bwd_tile.cuh's dq_chain_offset);
     * dq_sem (B, Hq, query tiles) int32: the ordered dq additions' counters (s[0..2]) */
    tensor4 delta, dq_accum, dq_sem;
    /* GPU split-KV forward scratch: num_splits partial results per row, contiguous,
     * o_accum [split][B][Hq][Sq][Dv] and lse_accum [2][split][B][Hq][Sq] float32: each partial's
     * maximum score (natural log units), then its sum of exp(s - maximum) */
    float *o_accum, *lse_accum;
    /* int32 counters the host lent the launch (process.borrow_counters), zero before it and left
     * zero after it; NULL: none lent. The split kernel's own combine (attn_fwd.cu): one a query
     * tile (CTAs / num_splits), else attn_fwd_combine merges the partials. attn_fwd_sm90's
     * persistent WS grid: [0] counts the tiles taken past the grid's first, else every CTA takes
     * every gridDim.x-th */
    int *counters;
    int num_splits;
    /* GPU backward, the ordered dq mode: 1 where the last turn at each query tile writes dq
     * (attn_bwd_sm90.cu), 0 where attn_bwd_dq_convert does */
    int dq_write_last;
    /* GPU backward, rows that keep no key (lse -inf inside a sequence's length): dead (1 + B * Hq
     * int32, zeroed by the host) gets dead[0] = 1 and dead[1 + b * Hq + h] = 1 from attn_bwd_pre
     * for each (sequence, head) holding such a row, and attn_bwd_dead redoes what they touched;
     * k_rows_max: the longest key sequence's rows (attn_bwd_dead's key blocks) */
    int32_t *dead;
    int64_t k_rows_max;
    /* GPU backward, rows whose |lse| is past LOST_LSE (attn_bwd_tile.cuh): lse has rounded
     * log(sum) away there (a fill of -1e10 gives lse -1e10, not -1e10 + log n), so attn_bwd_pre
     * recomputes each such row's maximum m and z = log2 of its sum of exp2((s - m) c) into
     * row_mz (a float2 per row, laid out like delta; written and read at lost rows only) and
     * marks its (sequence, head) in dead; the kernels that redo such heads take P = exp2((s - m)
     * c - z) there (lost_p) */
    float *row_mz;
    /* GPU backward of float32 under precision="tf32" on float16 products (F16_SCALED): the
     * factors attn_scale16.cu writes: the scores' scale's, dq's, dk's and dv's, powers of two */
    const double *grad_scales;

    int num_threads;             /* <= 0: the OpenMP default */

    /* CPU backend: the call's score_mod / mask_mod programs (interp.h); NULL without them */
    const struct interp_mods *mods;
    /* GPU backend: the generated score_mod / mask_mod's constants, arrays and outputs. Last, and
     * in the kernels' view of the struct only when they have mods (ATTN_GMODS, kernels.py:
     * mod_defines): the driver copies a kernel's declared parameter size, so a plain kernel's
     * launch moves the ~840 bytes before it, not these ~900 too. */
#if !defined(__CUDACC_RTC__) || ATTN_GMODS
    attn_mods_gpu gmods;
#endif
} attn_params;

/* The second kernel parameter of TMA_KV and the WS forward: the tensor maps of k and v
 * (cuTensorMapEncodeTiled's 128-byte, 64-byte-aligned CUtensorMap), 4-d (D, Hk, rows, batch or
 * pages), boxes of 64 columns (128 bytes, swizzled 128B) x 1 head x tma_rows rows x 1; and where
 * tma_rows_q is set too (the persistent WS forward), q's, 4-d (D, Hq, Sq, B), boxes of
 * tma_rows_q rows, else q is not made; and where tma_out is set, out's likewise (Dv, Hq, Sq, B). */
#ifdef __cplusplus
#define ATTN_ALIGN64 alignas(64)
#else
#define ATTN_ALIGN64 _Alignas(64)
#endif
typedef struct {
    ATTN_ALIGN64 uint64_t opaque[16];
} attn_tmap;
typedef struct {
    attn_tmap k, v, q, out;
} attn_tmaps;
/* The backward dK/dV kernel's second parameter (tma_rows_q): the maps of q and dout, 4-d (D, Hq,
 * rows, batch), boxes of 64 columns x 1 head x tma_rows_q rows x 1. */
typedef struct {
    attn_tmap q, dout;
} attn_bwd_tmaps;
#if !defined(__CUDACC_RTC__) && !defined(__cplusplus)
_Static_assert(sizeof(attn_tmaps) == 4 * sizeof(attn_tmap) && sizeof(attn_bwd_tmaps) == 2 * sizeof(attn_tmap),
               "cuda_launch_attention passes four maps or two");
#endif

#endif
