/* Attention backward: FlashAttention-2's recomputation of P from the forward's lse, on mma.sync
 * tensor cores, deterministic by construction (every output element is written by one thread,
 * after a reduction in a fixed order).
 *
 *   q (B, Sq, Hq, D)  k (B, Sk, Hk, D)  v (B, Sk, Hk, Dv)  out, dout (B, Sq, Hq, Dv)
 *   lse, delta (B, Hq, Sq) float32        dq (B, Sq, Hq, D)  dk (B, Sk, Hk, D)  dv (B, Sk, Hk, Dv)
 *   dq_accum (B, Sq, Hq, D + D % 2) float32 (DQ_ATOMIC only: pairs of columns are added by one
 *   vector atomic; DQ_CHAINS copies, the heads' stride spanning them)
 *   dbias (B, Hb, Sq, Sk) in the bias's dtype, stride 0 along the dims the bias broadcasts
 *   varlen: B = 1 in memory, sequence b at rows cu_seqlens[b].. (seqlen.h)
 *
 * Kernels, in launch order (attnext/cuda_backend.py):
 *   attn_bwd_pre        delta = rowsum(dout * out) - dlse (0 for padding rows); zeroes dq_accum
 *   attn_bwd_dkdv       one CTA per (key tile, kv head, sequence): K, V stay in shared memory,
 *                       the query tiles of every query head of the GQA group stream past
 *                       (q_range: only tiles inside the causal / window band);
 *                       S^T = K Q^T, P^T = exp2(S^T log2e - lse log2e), dV += P^T dO,
 *                       dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
 *                       KV_SPLIT: D + Dv too wide for both accumulators at once, so
 *                       attn_bwd_dv and attn_bwd_dk run the two halves as separate passes.
 *                       DQ_ATOMIC: also dQ += dS K into dq_accum with float atomics (the
 *                       order varies from run to run; deterministic=False with the kernel lab's
 *                       ATTNEXT_BWD_DQ=atomic: slower than attn_bwd_dq on an H100)
 *   attn_bwd_dq         deterministic dQ: one CTA per (query tile, head, sequence) over the key
 *                       tiles kv_range allows; recomputes S, dP; dQ += dS K
 *   attn_bwd_dq_convert (DQ_ATOMIC) dq = dq_accum * scale
 *   attn_bwd_dbias      one CTA per tile of the bias's compact shape; loops in a fixed order over
 *                       every (batch, head, row tile, column tile) that lands on it
 * Varlen: the block row b = B (one past the last sequence) zeroes the packed rows after
 * cu_seqlens[B].
 *
 * Switches beyond attn_common.cuh's (bwd_defines in kernels.py):
 *   KV_BLOCK_M, KV_WARPS   dkdv: query rows per streamed tile; warps (16 key rows each)
 *   KV_SPLIT               1: dV and dK in two passes (wide head dims)
 *   DQ_ATOMIC              1: the dkdv kernel accumulates dQ into dq_accum (non-deterministic)
 *   DQ_ORDERED, DQ_TILE_M  attn_bwd_sm90.cu's ordered additions and their query tile (the convert's)
 *   DQ_CHAINS, DQ_KEY_BLOCK  their chains, each into its own copy of dq_accum, and the key block
 *                          that picks a chain (attn_bwd_tile.cuh)
 *   Q_BLOCK_M, Q_BLOCK_N, Q_WARPS   dq and dbias: query rows per CTA, key tile, warps
 *   KV_MINB, Q_MINB        CTAs per SM the register allocation must allow (__launch_bounds__)
 *
 * Gradients in natural units: dS = dL/ds for the final score s (after softcap, bias, alibi),
 * so dbias = dS, and dq, dk carry dS * score_grad * scale.
 */
#include "attn_bwd_tile.cuh"


#define KV_THREADS (KV_WARPS * 32)
#define KV_BLOCK_N (KV_WARPS * 16)       /* key rows per dkdv CTA: one m16 tile per warp */
#define PRE_THREADS 256

/* F32_PRESPLIT (select.bwd_f32_presplit): float32's shared tiles split into their TF32 parts once
 * (split_tile) where every warp split them at each use. PRE_STREAM: the tiles every warp reads
 * (dK/dV: each item's Q and dO; dQ: each key tile's K and V), hi in place and, with three passes,
 * lo in a plane beside them (LO_PLANES); PRE_FIXED (one pass, no planes): also the CTA's own
 * tiles (dK/dV: K and V; dQ: Q and dO), rounded in place once. With three passes those stay raw
 * and split at use: their owner warps are the readers (but the dQ product's K), and their planes
 * would not fit beside two CTAs an SM. The bits are those of splitting at each use. */
#if ELEM_F32 && F32_PRESPLIT
#define PRE_STREAM 1
#define PRE_FIXED (TF32_PASSES == 1)
#define LO_PLANES (TF32_PASSES == 3)
#else
#define PRE_STREAM 0
#define PRE_FIXED 0
#define LO_PLANES 0
#endif

/* ---------------------------------------------------------------- warp products */
/* acc[mt][nt] += A[mt*16 .., 0..KP) . B[nt*8 .., 0..KP)^T: A and B row-major in shared memory with
 * row stride KP + SMEM_PAD, sA at the warp's first A row, sB at B's first row. */
#if ELEM_F32
/* PA / PB: A / B split already (split_tile), a_lo / b_lo: the floats from each to its lo plane */
template <int MT, int NT, int KP, bool PA = false, bool PB = false>
DEV void mma_abt(float (&acc)[MT][NT][4], const elem_t *sA, const elem_t *sB, int lane, int a_lo = 0, int b_lo = 0)
{
    mma_abt_f32<MT, NT, KP, PA, PB>(acc, sA, sB, lane, a_lo, b_lo);
}

/* acc[mt][nt] += A . B[0..KS*16, nt*8 ..): A as C fragments (cfrag), B row-major [k][n] in
 * shared memory with row stride LD (PB, b_lo: as mma_abt's). */
template <int MT, int KS, int NT, int LD, bool PB = false>
DEV void mma_fb(float (&acc)[MT][NT][4], const cfrag<MT, KS> &a, const elem_t *sB, int lane, int b_lo = 0)
{
    mma_cb_f32<MT, 2 * KS, NT, LD, PB>(acc, a, sB, lane, b_lo);
}
#else
template <int MT, int NT, int KP, bool PA = false, bool PB = false>
DEV void mma_abt(float (&acc)[MT][NT][4], const elem_t *sA, const elem_t *sB, int lane, int = 0, int = 0)
{
    constexpr int LD = KP + SMEM_PAD;
    /* one shared address per operand: the unrolled steps add constants to it */
    const uint32_t a0 = smem_addr(sA) + 2 * ((lane & 15) * LD + (lane >> 4) * 8);
    const uint32_t b0 = smem_addr(sB) + 2 * (((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int kk = 0; kk < KP / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            ldmatrix_x4(a0 + 2 * (mt * 16 * LD + kk * 16), a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t x0, x1, x2, x3;
            ldmatrix_x4(b0 + 2 * (np * 16 * LD + kk * 16), x0, x1, x2, x3);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma16816(acc[mt][2 * np], a[mt], x0, x1);
                mma16816(acc[mt][2 * np + 1], a[mt], x2, x3);
            }
        }
    }
}

/* acc[mt][nt] += A . B[0..KS*16, nt*8 ..): A as packed A fragments (KS k16 steps, from C
 * fragments: pack_frag), B row-major [k][n] in shared memory with row stride LD. */
template <int MT, int KS, int NT, int LD, bool PB = false>
DEV void mma_fb(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][KS][4], const elem_t *sB, int lane, int = 0)
{
    const uint32_t b0 = smem_addr(sB) + 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8);
#pragma unroll
    for (int kk = 0; kk < KS; kk++)
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t x0, x1, x2, x3;
            ldmatrix_x4_trans(b0 + 2 * (kk * 16 * LD + np * 16), x0, x1, x2, x3);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma16816(acc[mt][2 * np], a[mt][kk], x0, x1);
                mma16816(acc[mt][2 * np + 1], a[mt][kk], x2, x3);
            }
        }
}
#endif

/* f stored as an element of attn_dtype dt at p[i] (dbias, in the bias's own dtype). */
DEV void store_from_f32(void *p, int64_t i, int dt, float f)
{
    uint16_t h;
    switch (dt) {
    case DT_F16:
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        ((uint16_t *)p)[i] = h;
        break;
    case DT_BF16:
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
        ((uint16_t *)p)[i] = h;
        break;
    case DT_F32: ((float *)p)[i] = f; break;
    default: ((double *)p)[i] = (double)f; break;
    }
}

/* ---------------------------------------------------------------- delta */
/* The 16-byte vector paths of the row kernels: rows of CHUNK-element (16-byte) chunks, L lanes of a
 * warp per row (a power of two no larger than the chunks, at most 32), so a warp covers 32 / L
 * rows at once and every lane loads at least one chunk. */
template <int COLS>
struct row_chunks {
    static constexpr int C = COLS / CHUNK;
    static constexpr int L = C >= 32 ? 32 : C >= 16 ? 16 : C >= 8 ? 8 : C >= 4 ? 4 : C >= 2 ? 2 : 1;
    static constexpr int R = 32 / L;                             /* rows per warp at once */
    static constexpr int PASSES = (PRE_ROWS + PRE_THREADS / 32 * R - 1) / (PRE_THREADS / 32 * R);
};

DEV bool aligned16(const void *x) { return ((uint64_t)x & 15) == 0; }

/* sum of a[i] * b[i] over the CHUNK elements of two 16-byte chunks */
DEV float dot_chunk(uint4 a, uint4 b)
{
    const uint32_t x[4] = {a.x, a.y, a.z, a.w}, y[4] = {b.x, b.y, b.z, b.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
#if ELEM_F32
        acc += __uint_as_float(x[i]) * __uint_as_float(y[i]);
#else
        acc += elem_to_f32((elem_t)(x[i] & 0xffffu)) * elem_to_f32((elem_t)(y[i] & 0xffffu));
        acc += elem_to_f32((elem_t)(x[i] >> 16)) * elem_to_f32((elem_t)(y[i] >> 16));
#endif
    }
    return acc;
}

/* What a lost row's P takes (lost_p): s the raw q.k where the score is plain, times c = scale
 * log2e; else the natural score (score_of), c = log2e. */
DEV float lost_unit(const score_ctx &sc, float dot, int r, int c, int &bad)
{
#if SCORE_IS_PLAIN
    return dot;
#else
    return score_of(sc, dot, r, c, bad);
#endif
}

/* q.k of query row r (in qs, floats) and key j of sequence sk, kv head hk: a scalar dot. */
DEV float scalar_dot(const attn_params &p, const seq_t &sk, int64_t hk, int64_t j, const float *qs)
{
    const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + (sk.start + j) * p.k.s[1] + hk * p.k.s[2];
    float dot = 0.f;
    for (int d = 0; d < HEAD_DIM; d++)
        dot = fmaf(qs[d], elem_to_f32(gk[d * p.k.s[3]]), dot);
    return dot;
}

/* n floats of a 16-bit row (stride s) into shared memory, a warp's lanes. */
DEV void row_to_smem(float *dst, const elem_t *src, int64_t s, int n)
{
    for (int d = threadIdx.x & 31; d < n; d += 32)
        dst[d] = elem_to_f32(src[d * s]);
    __syncwarp();
}

/* The maximum m and z = log2 of the sum of exp2((s - m) c) over the kept keys of query row r of
 * (sequence sc.b, head h), s and c as lost_p takes them: the forward's online softmax on scalar
 * dots, a key per lane, the lanes' (m, l) merged at the end; for a row whose lse is lost
 * (lse_is_lost; attn_params.h: row_mz). Scalar, and a row's keys on one warp: lost rows are
 * rare (fills near -1e10, a padding mask's rows that keep only filled keys). qs: the warp's
 * HEAD_DIM floats of shared memory. The dots are not the tensor cores' to the last bit: where
 * q.k itself is past ~1e5, P's error grows with it (docs/semantics.md: huge finite scores). */
DEV float2 lost_row_stats(const attn_params &p, const score_ctx &sc, const seq_t &sq, const seq_t &sk, int64_t h,
                          int r, float *qs)
{
    const int lane = threadIdx.x & 31;
    const int64_t hk = h / (p.Hq / p.Hk);
    const float c = SCORE_IS_PLAIN ? sc.scale * LOG2E : LOG2E;   /* negative scale: m maximises s c */
    row_to_smem(qs, (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + (sq.start + r) * p.q.s[1] + h * p.q.s[2],
                p.q.s[3], HEAD_DIM);
    int64_t lo = 0, hi = 0;
    kv_range(&p, r, r + 1, sq.len, sk.len, &lo, &hi);
    float m = 0.f, l = 0.f;               /* l = 0: no key yet */
    for (int64_t j = lo + lane; j < hi; j += 32) {
        int bad = 0;                      /* the main kernels report the mods' faults */
        if (!mask_keeps(sc, r, (int)j, bad))
            continue;
        const float x = lost_unit(sc, scalar_dot(p, sk, hk, j, qs), r, (int)j, bad);
        if (x == NEG_INF)
            continue;
        if (l == 0.f || (x - m) * c > 0.f) {
            l = (l == 0.f ? 0.f : l * exp2f((m - x) * c)) + 1.f;
            m = x;
        } else {
            l += exp2f((x - m) * c);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
        if (l2 == 0.f)
            continue;
        if (l == 0.f || (m2 - m) * c > 0.f) {
            l = (l == 0.f ? 0.f : l * exp2f((m - m2) * c)) + l2;
            m = m2;
        } else {
            l += l2 * exp2f((m2 - m) * c);
        }
    }
    __syncwarp();                         /* qs is the next row's */
    if (p.sinks && ((const float *)p.sinks)[h] != NEG_INF) {
        /* the sink's term joins the sum as in the forward, in x's units */
        const float xs = SCORE_IS_PLAIN ? ((const float *)p.sinks)[h] / sc.scale : ((const float *)p.sinks)[h];
        if (l == 0.f || (xs - m) * c > 0.f) {
            l = (l == 0.f ? 0.f : l * exp2f((m - xs) * c)) + 1.f;
            m = xs;
        } else {
            l += exp2f((xs - m) * c);
        }
    }
    /* no kept key (the forward's lse said otherwise: never): z = +inf, P = 0 */
    return l == 0.f ? make_float2(0.f, POS_INF) : make_float2(m, log2f(l));
}

/* Grid (row tiles of PRE_ROWS, Hq, B [+1 varlen in the ordered mode]). delta[r] = sum_d dout[r, d]
 * * out[r, d] for the rows of the sequence, 0 for its padding rows; dq_accum's rows zeroed when
 * given, except in the ordered mode (DQ_ORDERED), where the first addition into each query tile
 * stores (DQ_STORE_FIRST) or the host zeroes dq_accum (a mask_mod); dq_sem's words zeroed when
 * given. Where the ordered mode's last turns write dq (p.dq_write_last), also the dq rows they
 * do not write set to 0: those past dq_live_rows and the packed rows after the last sequence
 * (else attn_bwd_dq_convert writes every row). A row of the sequence whose lse is -inf (it keeps
 * no key) sets p.dead's words (attn_params.h) for attn_bwd_dead; so does a lost row
 * (lse_is_lost), after its (m, z) went to row_mz (a warp a row). */
#if ENTRY(attn_bwd_pre)
extern "C" __global__ void __launch_bounds__(PRE_THREADS) attn_bwd_pre(const __grid_constant__ attn_params p)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t h = blockIdx.y, b = blockIdx.z;
#if DQ_ORDERED
    if (b == p.B) {                       /* the grid has this block row only where p.dq_write_last */
        zero_rows((grad_t *)p.dq.ptr + h * p.dq.s[2], p.dq.s[1], p.dq.s[3], packed_end_q(&p), p.Sq, HEAD_DIM,
                  PRE_THREADS);
        return;
    }
#endif
    const seq_t sq = seq_q(&p, b);
    const elem_t *gdo = (const elem_t *)p.dout.ptr + sq.mem_b * p.dout.s[0] + sq.start * p.dout.s[1] + h * p.dout.s[2];
    const elem_t *go = (const elem_t *)p.out.ptr + sq.mem_b * p.out.s[0] + sq.start * p.out.s[1] + h * p.out.s[2];
    float *gd = (float *)p.delta.ptr + sq.mem_b * p.delta.s[0] + h * p.delta.s[1] + sq.start * p.delta.s[2];
    const int64_t r_base = (int64_t)blockIdx.x * PRE_ROWS;
    /* lse of a row, read beside its dout and out: -inf inside the length is a row that keeps no key */
    const float *gl = (const float *)p.lse.ptr + sq.mem_b * p.lse.s[0] + h * p.lse.s[1] + sq.start * p.lse.s[2];
    /* lse's gradient, where given: delta - dlse takes delta's place (dS = P (dP - delta + dlse));
     * a row that keeps no key ignores it */
    const float *gdl = p.dlse.ptr ? (const float *)p.dlse.ptr + sq.mem_b * p.dlse.s[0] + h * p.dlse.s[1]
                                        + sq.start * p.dlse.s[2]
                                  : nullptr;
    bool dead = false, lost = false;
    if (HEAD_DIM_V % CHUNK == 0 && p.dout.s[3] == 1 && p.out.s[3] == 1 && p.dout.s[1] % CHUNK == 0
        && p.out.s[1] % CHUNK == 0 && aligned16(gdo) && aligned16(go)) {
        /* 16-byte loads, all of a thread's rows in flight at once */
        using rc = row_chunks<HEAD_DIM_V % CHUNK ? CHUNK : HEAD_DIM_V>;
        float acc[rc::PASSES], lse[rc::PASSES];
#pragma unroll
        for (int k = 0; k < rc::PASSES; k++) {
            const int i = (k * (PRE_THREADS / 32) + warp) * rc::R + lane / rc::L;
            const int64_t r = r_base + i;
            acc[k] = 0.f;
            lse[k] = 0.f;
            if (lane % rc::L == 0 && i < PRE_ROWS && r < sq.len)
                lse[k] = bwd_lse(p, h, gl[r * p.lse.s[2]]);
            if (i < PRE_ROWS && r < sq.len)
#pragma unroll
                for (int c = lane % rc::L; c < rc::C; c += rc::L)
                    acc[k] += dot_chunk(*(const uint4 *)(gdo + r * p.dout.s[1] + c * CHUNK),
                                        *(const uint4 *)(go + r * p.out.s[1] + c * CHUNK));
        }
#pragma unroll
        for (int k = 0; k < rc::PASSES; k++) {
#pragma unroll
            for (int o = rc::L / 2; o > 0; o >>= 1)
                acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], o);
            const int i = (k * (PRE_THREADS / 32) + warp) * rc::R + lane / rc::L;
            const int64_t r = r_base + i;
            if (lane % rc::L == 0 && i < PRE_ROWS && r < sq.rows)
                gd[r * p.delta.s[2]] = acc[k] - (gdl && r < sq.len && lse[k] != NEG_INF ? gdl[r * p.dlse.s[2]] : 0.f);
            dead |= lse[k] == NEG_INF;
            lost |= lse_is_lost(lse[k]);
        }
    } else {
        for (int i = warp; i < PRE_ROWS; i += PRE_THREADS / 32) {
            const int64_t r = r_base + i;
            if (r >= sq.rows)
                break;
            float acc = 0.f;
            const float lse_r = r < sq.len ? bwd_lse(p, h, gl[r * p.lse.s[2]]) : 0.f;
            if (r < sq.len && lane == 0) {
                dead |= lse_r == NEG_INF;
                lost |= lse_is_lost(lse_r);
            }
            if (r < sq.len)
                for (int d = lane; d < HEAD_DIM_V; d += 32)
                    acc += elem_to_f32(gdo[r * p.dout.s[1] + d * p.dout.s[3]])
                           * elem_to_f32(go[r * p.out.s[1] + d * p.out.s[3]]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0)
                gd[r * p.delta.s[2]] = acc - (gdl && r < sq.len && lse_r != NEG_INF ? gdl[r * p.dlse.s[2]] : 0.f);
        }
    }
    /* the loop re-reads lse a row at a time: only in a block that saw a lost row (a barrier) */
    if (__syncthreads_or(lost) && p.row_mz) {
        __shared__ float qs[PRE_THREADS / 32][HEAD_DIM];
        const seq_t sk = seq_k(&p, b);
        const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
        for (int i = warp; i < PRE_ROWS && r_base + i < sq.len; i += PRE_THREADS / 32) {
            const int64_t r = r_base + i;
            if (!lse_is_lost(bwd_lse(p, h, gl[r * p.lse.s[2]])))
                continue;
            const float2 mz = lost_row_stats(p, sc, sq, sk, h, (int)r, qs[warp]);
            if (lane == 0)
                ((float2 *)p.row_mz)[sq.mem_b * p.delta.s[0] + h * p.delta.s[1] + (sq.start + r) * p.delta.s[2]] = mz;
            dead = true;
        }
    }
#if DQ_ORDERED
    if (p.dq_write_last) {
        grad_t *gdq = (grad_t *)p.dq.ptr + sq.mem_b * p.dq.s[0] + sq.start * p.dq.s[1] + h * p.dq.s[2];
        const int64_t from = max(r_base, dq_live_rows(p, sq, b, r_base)), to = min(r_base + PRE_ROWS, sq.rows);
        for (int64_t i = threadIdx.x; i < (to - from) * HEAD_DIM; i += PRE_THREADS)
            gdq[(from + i / HEAD_DIM) * p.dq.s[1] + (i % HEAD_DIM) * p.dq.s[3]] = 0;
    }
#else
    if (p.dq_accum.ptr && r_base < sq.rows) {
        float *gacc = (float *)p.dq_accum.ptr + sq.mem_b * p.dq_accum.s[0] + sq.start * p.dq_accum.s[1]
                      + h * p.dq_accum.s[2] + r_base * p.dq_accum.s[1];
        const int rows = (int)min((int64_t)PRE_ROWS, sq.rows - r_base);
        if (HEAD_DIM % 4 == 0 && p.dq_accum.s[3] == 1 && p.dq_accum.s[1] == HEAD_DIM && aligned16(gacc)) {
            for (int i = threadIdx.x; i < rows * HEAD_DIM / 4; i += PRE_THREADS)   /* the rows are one block */
                ((float4 *)gacc)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        } else {
            for (int i = threadIdx.x; i < rows * HEAD_DIM; i += PRE_THREADS)
                gacc[(i / HEAD_DIM) * p.dq_accum.s[1] + (i % HEAD_DIM) * p.dq_accum.s[3]] = 0.f;
        }
    }
#endif
    if (p.dq_sem.ptr) {                   /* this row tile's words (PRE_ROWS = its rows; gridDim.x tiles) */
        const int words = (int)(p.dq_sem.s[1] / gridDim.x);
        for (int w = threadIdx.x; w < words; w += PRE_THREADS)
            ((int *)p.dq_sem.ptr)[b * p.dq_sem.s[0] + h * p.dq_sem.s[1] + (blockIdx.x * words + w) * p.dq_sem.s[2]] = 0;
    }
    if (dead && p.dead) {                 /* every such thread writes the same 1s */
        p.dead[0] = 1;
        p.dead[1 + b * p.Hq + h] = 1;
    }
}
#endif

/* The sinks' gradient, after attn_bwd_pre: dsinks[h] = -sum over the real rows of every sequence
 * of exp(sinks[h] - lse) delta (d lse / d sink = exp(sink - lse) = P_sink, d out / d sink =
 * -P_sink out; delta is rowsum(dout * out) - dlse as attn_bwd_pre wrote it). A row whose lse is
 * the sink's keeps no key (bwd_lse): out 0, P_sink 1, it gives its dlse alone; rows of lse -inf
 * give nothing. Grid (Hq): a block a head, its additions in one fixed order (deterministic), in
 * float64. */
#if ENTRY(attn_bwd_sinks)
extern "C" __global__ void __launch_bounds__(PRE_THREADS) attn_bwd_sinks(const __grid_constant__ attn_params p)
{
    __shared__ double part[PRE_THREADS / 32];
    const int64_t h = blockIdx.x;
    const float sink = ((const float *)p.sinks)[h];
    double acc = 0.0;
    for (int64_t b = 0; b < p.B; b++) {
        const seq_t sq = seq_q(&p, b);
        const float *gl = (const float *)p.lse.ptr + sq.mem_b * p.lse.s[0] + h * p.lse.s[1] + sq.start * p.lse.s[2];
        const float *gd = (const float *)p.delta.ptr + sq.mem_b * p.delta.s[0] + h * p.delta.s[1]
                          + sq.start * p.delta.s[2];
        const float *gdl = p.dlse.ptr ? (const float *)p.dlse.ptr + sq.mem_b * p.dlse.s[0] + h * p.dlse.s[1]
                                            + sq.start * p.dlse.s[2]
                                      : nullptr;
        for (int64_t r = threadIdx.x; r < sq.len; r += PRE_THREADS) {
            const float lse = gl[r * p.lse.s[2]];
            if (lse == NEG_INF)
                continue;
            if (lse == sink)
                acc += gdl ? (double)gdl[r * p.dlse.s[2]] : 0.0;
            else
                acc -= exp((double)sink - (double)lse) * (double)gd[r * p.delta.s[2]];
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int w = 0; w < PRE_THREADS / 32; w++)
            sum += part[w];
        ((float *)p.dsinks)[h] = (float)sum;
    }
}
#endif

/* ---------------------------------------------------------------- dK, dV */
/* Query tile j of the CTA's work list (the query heads of the group, each over the same tiles)
 * into buffer `buf`: Q, dO by cp.async (the caller commits); lse (log2; lse_log2<DEAD>) and delta
 * of row threadIdx.x returned in *l, *d for the caller to store once the buffer is free. */
template <bool DEAD>
DEV void dkdv_prefetch(const attn_params &p, const seq_t &sq, int64_t hk, int group, int m_first, int nm,
                       int j, elem_t *sQ, elem_t *sdO, float *l, float *d)
{
    const int64_t h = hk * group + j / nm;
    const int m0 = (m_first + j % nm) * KV_BLOCK_M, Lq = (int)sq.len;
    const elem_t *gq = (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + (sq.start + m0) * p.q.s[1] + h * p.q.s[2];
    const elem_t *gdo = (const elem_t *)p.dout.ptr + sq.mem_b * p.dout.s[0] + (sq.start + m0) * p.dout.s[1]
                        + h * p.dout.s[2];
    load_tile<KV_BLOCK_M, DP, KV_THREADS>(sQ, gq, p.q.s[1], p.q.s[3], Lq - m0, HEAD_DIM, threadIdx.x);
    load_tile<KV_BLOCK_M, DVP, KV_THREADS>(sdO, gdo, p.dout.s[1], p.dout.s[3], Lq - m0, HEAD_DIM_V, threadIdx.x);
    *l = POS_INF;
    *d = 0.f;
    const int r = m0 + threadIdx.x;
    if (threadIdx.x < KV_BLOCK_M && r < Lq) {
        const int64_t row = sq.start + r;
        *l = lse_log2<DEAD>(bwd_lse(p, h, ((const float *)p.lse.ptr)[sq.mem_b * p.lse.s[0] + h * p.lse.s[1] + row * p.lse.s[2]]));
        *d = ((const float *)p.delta.ptr)[sq.mem_b * p.delta.s[0] + h * p.delta.s[1] + row * p.delta.s[2]];
    }
}

/* PART: 1 dV, 2 dK, 3 both, of key tile bx of kv head hk in sequence b (the grid's (key tiles, Hk,
 * B [+1 varlen]) for attn_bwd_dkdv); warp w owns key rows [16 w, 16 w + 16) of the tile, so dK
 * and dV never leave its registers. DEAD (attn_bwd_dead): the rows that keep no key (lse -inf)
 * take no part: their Q and dO rows are zeroed in shared memory and their P^T and dS^T columns
 * set to 0, so no NaN or inf of theirs, nor of a key or value they do not keep, reaches dK, dV
 * as 0 * NaN; without DEAD such a row adds P^T = 0 times whatever its dO holds (the common path,
 * which attn_bwd_dead redoes where such rows exist). */
template <int PART, bool DEAD>
DEV void dkdv(const attn_params &p, unsigned char *smem_raw, int bx, int64_t hk, int64_t b)
{
    constexpr bool DO_DV = PART & 1, DO_DK = PART & 2;
    constexpr int BM = KV_BLOCK_M, BN = KV_BLOCK_N;
    elem_t *sK = (elem_t *)smem_raw;                               /* BN x (DP + pad) */
    elem_t *sV = sK + BN * (DP + SMEM_PAD);                        /* BN x (DVP + pad), dK only */
    elem_t *sQ = sV + (DO_DK ? BN * (DVP + SMEM_PAD) : 0);         /* 2 x BM x (DP + pad) */
    elem_t *sdO = sQ + 2 * BM * (DP + SMEM_PAD);                   /* 2 x BM x (DVP + pad) */
    float *sL = (float *)(sdO + 2 * BM * (DVP + SMEM_PAD));        /* 2 x BM lse, log2 units */
    float *sD = sL + 2 * BM;                                       /* 2 x BM delta */
    elem_t *sdS = (elem_t *)(sD + 2 * BM);                         /* DQ_ATOMIC: BN x (BM + pad) */
    /* LO_PLANES: the lo planes of the item's Q and dO (else the tiles themselves: offset 0, unread) */
    elem_t *sQlo = LO_PLANES ? sdS + (DQ_ATOMIC ? BN * (BM + SMEM_PAD) : 0) : sQ;
    elem_t *sdOlo = LO_PLANES ? sQlo + BM * (DP + SMEM_PAD) : sdO;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    if (b == p.B) {                       /* packed rows after the last sequence */
        const int64_t first = packed_end_k(&p);
        if (DO_DK)
            zero_rows((grad_t *)p.dk.ptr + hk * p.dk.s[2], p.dk.s[1], p.dk.s[3], first, p.Sk, HEAD_DIM, KV_THREADS);
        if (DO_DV)
            zero_rows((grad_t *)p.dv.ptr + hk * p.dv.s[2], p.dv.s[1], p.dv.s[3], first, p.Sk, HEAD_DIM_V, KV_THREADS);
        return;
    }
    const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
    const int n0 = bx * BN;
    if (n0 >= sk.rows)
        return;
    const int group = (int)(p.Hq / p.Hk), Lq = (int)sq.len, Lk = (int)sk.len;

    int m_first, nm, qlo[2], qhi[2];
    kv_tile_rows(p, n0, BN, BM, n0 + warp * 16, Lq, Lk, m_first, nm, qlo, qhi);
    {                                     /* mask_mod's empty query tiles at either end */
        int m_last = m_first + nm - 1;
        mod_narrow(make_score_ctx(p, b, hk * group, sq, sk), group, false, n0, min(n0 + BN, Lk), BM, Lq,
                   m_first, m_last);
        nm = max(m_last - m_first + 1, 0);
    }

    const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + (sk.start + n0) * p.k.s[1] + hk * p.k.s[2];
    const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + (sk.start + n0) * p.v.s[1] + hk * p.v.s[2];
    const int items = group * nm;
    if (items > 0) {
        load_tile<BN, DP, KV_THREADS>(sK, gk, p.k.s[1], p.k.s[3], Lk - n0, HEAD_DIM, tid);
        if (DO_DK)
            load_tile<BN, DVP, KV_THREADS>(sV, gv, p.v.s[1], p.v.s[3], Lk - n0, HEAD_DIM_V, tid);
        float l, d;
        dkdv_prefetch<DEAD>(p, sq, hk, group, m_first, nm, 0, sQ, sdO, &l, &d);
        cp_async_commit();
        if (tid < BM) {
            sL[tid] = l;
            sD[tid] = d;
        }
    }

    float dk[1][DO_DK ? DP / 8 : 2][4], dv[1][DO_DV ? DVP / 8 : 2][4];
    zero_acc(dk);
    zero_acc(dv);
    for (int j = 0; j < items; j++) {
        const int buf = j & 1;
        const int64_t h = hk * group + j / nm;
        const int m0 = (m_first + j % nm) * BM;
        const elem_t *qb = sQ + buf * BM * (DP + SMEM_PAD), *dob = sdO + buf * BM * (DVP + SMEM_PAD);
        const float *lb = sL + buf * BM, *db = sD + buf * BM;
        cp_async_wait_all();
        __syncthreads();                  /* item j in buffer buf; every warp is done with buf ^ 1 */
        if (DEAD) {                       /* the Q and dO rows of rows that keep no key (and padding) to 0 */
            elem_t *q0 = (elem_t *)qb, *do0 = (elem_t *)dob;
            for (int i = tid; i < BM * DP; i += KV_THREADS)
                if (lb[i / DP] == POS_INF)
                    q0[(i / DP) * (DP + SMEM_PAD) + i % DP] = 0;
            for (int i = tid; i < BM * DVP; i += KV_THREADS)
                if (lb[i / DVP] == POS_INF)
                    do0[(i / DVP) * (DVP + SMEM_PAD) + i % DVP] = 0;
            __syncthreads();
        }
#if PRE_STREAM
        split_tile<BM, DP, KV_THREADS>((float *)qb, (float *)sQlo, tid);
        split_tile<BM, DVP, KV_THREADS>((float *)dob, (float *)sdOlo, tid);
        if (PRE_FIXED && j == 0) {        /* K and V came with item 0 */
            split_tile<BN, DP, KV_THREADS>((float *)sK, nullptr, tid);
            if (DO_DK)
                split_tile<BN, DVP, KV_THREADS>((float *)sV, nullptr, tid);
        }
        __syncthreads();
#endif
        const int q_lo = (int)(sQlo - qb), do_lo = (int)(sdOlo - dob);
        float nl = POS_INF, nd = 0.f;
        if (j + 1 < items)
            dkdv_prefetch<DEAD>(p, sq, hk, group, m_first, nm, j + 1, sQ + (buf ^ 1) * BM * (DP + SMEM_PAD),
                          sdO + (buf ^ 1) * BM * (DVP + SMEM_PAD), &nl, &nd);
        cp_async_commit();
        const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
        const float scale_log2 = sc.scale * LOG2E;

        /* S^T = K Q^T for this warp's key rows */
        float s[1][KV_NT][4];
        zero_acc(s);
        mma_abt<1, KV_NT, DP, PRE_FIXED, PRE_STREAM>(s, sK + warp * 16 * (DP + SMEM_PAD), qb, lane, 0, q_lo);

        const bool need_mask = tile_maybe_masked(sc, m0, min(m0 + BM, Lq), n0, min(n0 + BN, Lk))
                               || n0 + BN > Lk || m0 + BM > Lq
                               || !tile_inside_band(&p, m0, min(m0 + BM, Lq), n0, n0 + BN, Lq, Lk);
        cfrag<1, KV_NT / 2> pp;
        pt_tile<KV_NT, DEAD>(s, pp, p, sc, lb, n0 + warp * 16, m0, qlo, qhi, need_mask);

        if (DO_DV)                        /* dV += P^T dO */
            mma_fb<1, KV_NT / 2, DO_DV ? DVP / 8 : 2, DVP + SMEM_PAD, PRE_STREAM>(dv, pp, dob, lane, do_lo);

        if (DO_DK) {
            /* dP^T = V dO^T, dS^T = P^T (dP^T - delta) score_grad, dK += dS^T Q */
            float dp[1][KV_NT][4];
            zero_acc(dp);
            mma_abt<1, KV_NT, DVP, PRE_FIXED, PRE_STREAM>(dp, sV + warp * 16 * (DVP + SMEM_PAD), dob, lane, 0, do_lo);
            dst_tile(s, dp, db);
            if (DEAD)                     /* dS^T of a row that keeps no key: 0, not 0 * (NaN - delta) */
#pragma unroll
                for (int nt = 0; nt < KV_NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (lb[nt * 8 + 2 * t + (e & 1)] == POS_INF)
                            s[0][nt][e] = 0.f;
            pack_frag<1, KV_NT / 2>(pp, s);
            mma_fb<1, KV_NT / 2, DO_DK ? DP / 8 : 2, DP + SMEM_PAD, PRE_STREAM>(dk, pp, qb, lane, q_lo);
#if DQ_ATOMIC
            if (!DEAD) {                  /* (attn_bwd_dead leaves dq to the kernels before it) */
                /* dS^T to shared memory, then dQ (BM x DP) = dS K split over the warps:
                 * warp (wm, wd) owns query rows 16 wm .. and the 16-column groups wd, wd + WD, .. */
                constexpr int WM = BM / 16, WD = KV_WARPS / WM, NPW = (DP / 16 + WD - 1) / WD;
                constexpr int LDS = BM + SMEM_PAD;
                const int wm = warp % WM, wd = warp / WM;
                float acc[NPW][2][4];
                zero_acc(acc);
#if ELEM_F32
                /* the floats of dS^T (pp: S^T's C fragments), then k8 steps of keys by TF32 products:
                 * A = dS (query g, key k) from dS^T's rows, B = K (key k, column g) from K's, the
                 * product's k = t and t + 4 taken as keys 2t and 2t + 1 of the step (a sum over k in
                 * any order; rows 2t apart land in distinct banks, t apart did not) */
                float *row = sdS + (warp * 16 + g) * LDS + 2 * t;
#pragma unroll
                for (int nt = 0; nt < KV_NT; nt++) {
                    *(float2 *)(row + nt * 8) = make_float2(pp[0][nt][0], pp[0][nt][1]);
                    *(float2 *)(row + 8 * LDS + nt * 8) = make_float2(pp[0][nt][2], pp[0][nt][3]);
                }
                __syncthreads();
                float lo[NPW][2][4];          /* the small products' sums (mma_f32) */
                zero_acc(lo);
#pragma unroll
                for (int kk = 0; kk < BN / 8; kk++) {
                    const float *da = sdS + (kk * 8 + 2 * t) * LDS + wm * 16 + g;
                    tf32_frag<4> a;
                    a.set(0, da[0]);
                    a.set(1, da[8]);
                    a.set(2, da[LDS]);
                    a.set(3, da[LDS + 8]);
                    const float *kb = sK + (kk * 8 + 2 * t) * (DP + SMEM_PAD) + g;
#pragma unroll
                    for (int i = 0; i < NPW; i++) {
                        const int np = wd + i * WD;
                        if (np < DP / 16)
#pragma unroll
                            for (int hf = 0; hf < 2; hf++) {
                                tf32_frag<2> bk;
                                const float k0 = kb[np * 16 + hf * 8], k1 = kb[DP + SMEM_PAD + np * 16 + hf * 8];
                                if (PRE_FIXED) {  /* rounded in place (one pass: lo 0) */
                                    bk.parts(0, __float_as_uint(k0), 0u);
                                    bk.parts(1, __float_as_uint(k1), 0u);
                                } else {
                                    bk.set(0, k0);
                                    bk.set(1, k1);
                                }
                                mma_f32(acc[i][hf], lo[i][hf], a, bk);
                            }
                    }
                }
                if (TF32_PASSES == 3)     /* (one pass: lo is 0) */
#pragma unroll
                    for (int i = 0; i < NPW; i++)
#pragma unroll
                        for (int e = 0; e < 8; e++)
                            acc[i][e / 4][e % 4] += lo[i][e / 4][e % 4];
#else
                elem_t *row = sdS + (warp * 16 + g) * LDS + 2 * t;
#pragma unroll
                for (int kk = 0; kk < KV_NT / 2; kk++) {
                    *(uint32_t *)(row + kk * 16) = pp[0][kk][0];
                    *(uint32_t *)(row + 8 * LDS + kk * 16) = pp[0][kk][1];
                    *(uint32_t *)(row + kk * 16 + 8) = pp[0][kk][2];
                    *(uint32_t *)(row + 8 * LDS + kk * 16 + 8) = pp[0][kk][3];
                }
                __syncthreads();
#pragma unroll
                for (int kk = 0; kk < BN / 16; kk++) {
                    uint32_t a[4];
                    ldmatrix_x4_trans(smem_addr(sdS + (kk * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * LDS
                                                + wm * 16 + ((lane >> 3) & 1) * 8),
                                      a[0], a[1], a[2], a[3]);
#pragma unroll
                    for (int i = 0; i < NPW; i++) {
                        const int np = wd + i * WD;
                        if (np < DP / 16) {
                            uint32_t b0, b1, b2, b3;
                            ldmatrix_x4_trans(smem_addr(sK + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * (DP + SMEM_PAD)
                                                        + np * 16 + (lane >> 4) * 8),
                                              b0, b1, b2, b3);
                            mma16816(acc[i][0], a, b0, b1);
                            mma16816(acc[i][1], a, b2, b3);
                        }
                    }
                }
#endif
                float *gacc = (float *)p.dq_accum.ptr + sq.mem_b * p.dq_accum.s[0] + sq.start * p.dq_accum.s[1]
                              + h * p.dq_accum.s[2];
#pragma unroll
                for (int i = 0; i < NPW; i++)
#pragma unroll
                    for (int e = 0; e < 8; e += 2) {
                        const int r = m0 + wm * 16 + g + ((e % 4) / 2) * 8;
                        const int dcol = (wd + i * WD) * 16 + (e / 4) * 8 + 2 * t;
                        if (r < Lq && dcol < HEAD_DIM)
                            red_add_f32x2(gacc + (int64_t)r * p.dq_accum.s[1] + dq_col(r, dcol), acc[i][e / 4][e % 4],
                                          acc[i][e / 4][e % 4 + 1]);
                    }
            }
#endif
        }
        if (tid < BM) {                   /* the next item's lse and delta, now that buf ^ 1 is free */
            sL[(buf ^ 1) * BM + tid] = nl;
            sD[(buf ^ 1) * BM + tid] = nd;
        }
    }
    cp_async_wait_all();

    store_dkdv(p, sk, hk, dk, dv, n0 + warp * 16, DO_DK, DO_DV);
}

#if KV_SPLIT
#if ENTRY(attn_bwd_dv)
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_MINB) attn_bwd_dv(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    dkdv<1, false>(p, smem_raw, blockIdx.x, blockIdx.y, blockIdx.z);
}
#endif

#if ENTRY(attn_bwd_dk)
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_MINB) attn_bwd_dk(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    dkdv<2, false>(p, smem_raw, blockIdx.x, blockIdx.y, blockIdx.z);
}
#endif
#else
#if ENTRY(attn_bwd_dkdv)
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_MINB) attn_bwd_dkdv(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    dkdv<3, false>(p, smem_raw, blockIdx.x, blockIdx.y, blockIdx.z);
}
#endif
#endif

/* ---------------------------------------------------------------- rows that keep no key */
/* dq of lost query row r of (sequence sc.b, head h) into its dq row gdq (16-bit, stride
 * p.dq.s[3]), and the score_mod's array gradients of its pairs: dS = P (dP - delta) over its
 * kept keys, P from row_mz (lost_p's formula), a key per lane, then dq += dS score_grad k by the
 * lanes' columns. rows: the warp's HEAD_DIM + HEAD_DIM_V floats of shared memory (q's and dO's
 * rows). Scalar, as lost_row_stats. */
DEV void lost_row_dq(const attn_params &p, const score_ctx &sc, const seq_t &sq, const seq_t &sk, int64_t h, int r,
                     float *rows, grad_t *gdq)
{
    constexpr int COLS = (HEAD_DIM + 31) / 32;
    const int lane = threadIdx.x & 31;
    const int64_t hk = h / (p.Hq / p.Hk), row = sq.start + r;
    float *qs = rows, *dos = rows + HEAD_DIM;
    row_to_smem(qs, (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + row * p.q.s[1] + h * p.q.s[2], p.q.s[3], HEAD_DIM);
    row_to_smem(dos, (const elem_t *)p.dout.ptr + sq.mem_b * p.dout.s[0] + row * p.dout.s[1] + h * p.dout.s[2],
                p.dout.s[3], HEAD_DIM_V);
    const int64_t at = sq.mem_b * p.delta.s[0] + h * p.delta.s[1] + row * p.delta.s[2];
    const float2 mz = ((const float2 *)p.row_mz)[at];
    const float delta = ((const float *)p.delta.ptr)[at];
    const float c = SCORE_IS_PLAIN ? sc.scale * LOG2E : LOG2E;
    const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
    const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + sk.start * p.v.s[1] + hk * p.v.s[2];
    float acc[COLS];
#pragma unroll
    for (int i = 0; i < COLS; i++)
        acc[i] = 0.f;
    int64_t lo = 0, hi = 0;
    kv_range(&p, r, r + 1, sq.len, sk.len, &lo, &hi);
    for (int64_t j0 = lo; j0 < hi; j0 += 32) {
        const int64_t j = j0 + lane;
        float dsg = 0.f;
        int bad = 0;
        if (j < hi && mz.y != POS_INF && mask_keeps(sc, r, (int)j, bad)) {
            const float dot = scalar_dot(p, sk, hk, j, qs);
            const float x = lost_unit(sc, dot, r, (int)j, bad);
            float dp = 0.f;
            for (int d = 0; d < HEAD_DIM_V; d++)
                dp = fmaf(dos[d], elem_to_f32(gv[j * p.v.s[1] + d * p.v.s[3]]), dp);
            const float ds = exp2f(fminf((x - mz.x) * c - mz.y, 0.f)) * (dp - delta);
            score_dtensors(sc, dot, r, (int)j, ds, nullptr);
            dsg = ds * score_grad(sc, dot, r, (int)j);
        }
        for (int i = 0; i < 32 && j0 + i < hi; i++) {
            const float w = __shfl_sync(0xffffffffu, dsg, i);
            if (w == 0.f)
                continue;
            const elem_t *kr = gk + (j0 + i) * p.k.s[1];
#pragma unroll
            for (int x = 0; x < COLS; x++)
                if (lane + 32 * x < HEAD_DIM)
                    acc[x] = fmaf(w, elem_to_f32(kr[(lane + 32 * x) * p.k.s[3]]), acc[x]);
        }
    }
#pragma unroll
    for (int x = 0; x < COLS; x++)
        if (lane + 32 * x < HEAD_DIM)
            gdq[(lane + 32 * x) * p.dq.s[3]] = f32_to_grad(acc[x] * dq_mul(p));
    __syncwarp();                         /* rows is the next row's */
}

/* After the dK / dV / dQ kernels of any kind (attn_bwd.cu's or attn_bwd_sm90.cu's), a grid of a
 * few CTAs per SM. Where attn_bwd_pre found no row that keeps no key (p.dead[0] == 0: the common
 * case) every CTA returns at once. Else the CTAs share out, one after another, the key tiles of
 * every (sequence, kv head) whose query heads hold such a row and redo their dK and dV with
 * dkdv<DEAD> (the kernels before may have added 0 * NaN from such a row's dO or q, or from a key
 * or value it does not keep), then set the dq rows of those rows to 0 (dS K can be 0 * NaN
 * there too). dQ of the other rows is right as it stands: a row's dQ reads no other row. The dS
 * of dbias and of the score_mod's array gradients is 0 in those rows where it is made (ds_tile). */
#if ENTRY(attn_bwd_dead)
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_MINB) attn_bwd_dead(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (*(volatile const int32_t *)p.dead == 0)
        return;
    const int64_t group = p.Hq / p.Hk, tiles = (p.k_rows_max + KV_BLOCK_N - 1) / KV_BLOCK_N;
    for (int64_t v = blockIdx.x; v < tiles * p.Hk * p.B; v += gridDim.x) {
        const int64_t x = v % tiles, hk = (v / tiles) % p.Hk, b = v / (tiles * p.Hk);
        bool any = false;
        for (int64_t h = hk * group; h < (hk + 1) * group; h++)
            any |= p.dead[1 + b * p.Hq + h] != 0;
        if (!any)
            continue;
#if KV_SPLIT
        dkdv<1, true>(p, smem_raw, (int)x, hk, b);
        __syncthreads();
        dkdv<2, true>(p, smem_raw, (int)x, hk, b);
#else
        dkdv<3, true>(p, smem_raw, (int)x, hk, b);
#endif
        __syncthreads();                  /* every warp is done with the shared tiles */
    }
    for (int64_t v = blockIdx.x; v < p.Hq * p.B; v += gridDim.x) {
        if (!p.dead[1 + v])
            continue;
        const int64_t b = v / p.Hq, h = v % p.Hq;
        const seq_t sq = seq_q(&p, b);
        const float *gl = (const float *)p.lse.ptr + sq.mem_b * p.lse.s[0] + h * p.lse.s[1] + sq.start * p.lse.s[2];
        grad_t *gdq = (grad_t *)p.dq.ptr + sq.mem_b * p.dq.s[0] + sq.start * p.dq.s[1] + h * p.dq.s[2];
        for (int64_t i = threadIdx.x; i < sq.len * HEAD_DIM; i += KV_THREADS) {
            const int64_t r = i / HEAD_DIM;
            if (bwd_lse(p, h, gl[r * p.lse.s[2]]) == NEG_INF)
                gdq[r * p.dq.s[1] + (i % HEAD_DIM) * p.dq.s[3]] = 0;
        }
        /* the lost rows' dq and array gradients, a warp a row (the kernels before took them for
         * rows that keep no key); shared memory is free: every warp is past the dK / dV loop */
        const seq_t sk = seq_k(&p, b);
        const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
        float *rows = (float *)smem_raw + (threadIdx.x >> 5) * (HEAD_DIM + HEAD_DIM_V);
        for (int64_t r = threadIdx.x >> 5; r < sq.len; r += KV_WARPS)
            if (lse_is_lost(bwd_lse(p, h, gl[r * p.lse.s[2]])))
                lost_row_dq(p, sc, sq, sk, h, (int)r, rows, gdq + r * p.dq.s[1]);
    }
}
#endif

/* ---------------------------------------------------------------- dQ (and the dS of dbias) */
#if ENTRY(attn_bwd_dq)
/* attn_bwd_dq's loop over its key tiles n_first..n_last (K[n_first], V[n_first] on their way),
 * through the array gradients' tile sums or not (attn_bwd_tile.cuh: key_tiles_to_sums). */
template <bool TO_SUMS>
DEV void dq_key_tiles(const attn_params &p, const score_ctx &sc, const row_info &ri, elem_t *sQ, elem_t *sdO,
                      elem_t *sK, elem_t *sV, elem_t *sKlo, elem_t *sVlo, const elem_t *gk, const elem_t *gv, int m0,
                      int n_first, int n_last, int Lq, int Lk, float (&dq)[Q_MT][DP / 8][4], tile_sums &sums)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int n = n_first; n <= n_last; n++) {
        const int c0 = n * Q_BLOCK_N;
        elem_t *kb = sK + ((n - n_first) & 1) * Q_BLOCK_N * (DP + SMEM_PAD);
        elem_t *kn = sK + ((n - n_first + 1) & 1) * Q_BLOCK_N * (DP + SMEM_PAD);
        cp_async_wait_all();
        __syncthreads();                  /* K[n], V[n] in; every warp is done with K[n - 1] */
        if (n < n_last)
            load_tile<Q_BLOCK_N, DP, Q_THREADS>(kn, gk + (int64_t)(c0 + Q_BLOCK_N) * p.k.s[1], p.k.s[1], p.k.s[3],
                                                Lk - (c0 + Q_BLOCK_N), HEAD_DIM, tid);
        cp_async_commit();
#if PRE_STREAM
        /* K[n] and V[n] split once (their lo planes: every warp is done with tile n - 1's) */
        split_tile<Q_BLOCK_N, DP, Q_THREADS>((float *)kb, (float *)sKlo, tid);
        split_tile<Q_BLOCK_N, DVP, Q_THREADS>((float *)sV, (float *)sVlo, tid);
        if (PRE_FIXED && n == n_first) {  /* Q and dO came with K[n_first] */
            split_tile<Q_BLOCK_M, DP, Q_THREADS>((float *)sQ, nullptr, tid);
            split_tile<Q_BLOCK_M, DVP, Q_THREADS>((float *)sdO, nullptr, tid);
        }
        __syncthreads();
#endif
        const int k_lo = (int)(sKlo - kb), v_lo = (int)(sVlo - sV);

        float s[Q_MT][Q_NT][4], dp[Q_MT][Q_NT][4];
        zero_acc(s);
        zero_acc(dp);
        mma_abt<Q_MT, Q_NT, DP, PRE_FIXED, PRE_STREAM>(s, sQ + warp * Q_WARP_M * (DP + SMEM_PAD), kb, lane, 0, k_lo);
        mma_abt<Q_MT, Q_NT, DVP, PRE_FIXED, PRE_STREAM>(dp, sdO + warp * Q_WARP_M * (DVP + SMEM_PAD), sV, lane, 0,
                                                        v_lo);
        __syncthreads();                  /* every warp is done with V[n] */
        if (n < n_last)
            load_tile<Q_BLOCK_N, DVP, Q_THREADS>(sV, gv + (int64_t)(c0 + Q_BLOCK_N) * p.v.s[1], p.v.s[1], p.v.s[3],
                                                 Lk - (c0 + Q_BLOCK_N), HEAD_DIM_V, tid);
        cp_async_commit();

        ds_tile<true, TO_SUMS>(s, dp, p, sc, ri, m0, c0, ds_needs_mask(p, sc, m0, c0, Lq, Lk), Lq, Lk,
                               tile_sums_for<TO_SUMS>(sums, sc, m0, c0, Lq, Lk));
        cfrag<Q_MT, Q_NT / 2> a;
        pack_frag<Q_MT, Q_NT / 2>(a, s);
        mma_fb<Q_MT, Q_NT / 2, DP / 8, DP + SMEM_PAD, PRE_STREAM>(dq, a, kb, lane, k_lo);
        tile_sums_flush<TO_SUMS>(sums);
    }
}

/* Grid (query tiles, Hq, B [+1 varlen]). Warp w owns query rows [w Q_WARP_M, (w + 1) Q_WARP_M).
 * K double-buffered (K[n+1] loads during tile n), V loads while dS K runs. */
extern "C" __global__ void __launch_bounds__(Q_THREADS, Q_MINB) attn_bwd_dq(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t *sQ = (elem_t *)smem_raw;                            /* Q_BLOCK_M x (DP + pad) */
    elem_t *sdO = sQ + Q_BLOCK_M * (DP + SMEM_PAD);             /* Q_BLOCK_M x (DVP + pad) */
    elem_t *sK = sdO + Q_BLOCK_M * (DVP + SMEM_PAD);            /* 2 x Q_BLOCK_N x (DP + pad) */
    elem_t *sV = sK + 2 * Q_BLOCK_N * (DP + SMEM_PAD);          /* Q_BLOCK_N x (DVP + pad) */
    /* LO_PLANES: the lo planes of the key tile's K and V (else the tiles: offset 0, unread) */
    elem_t *sKlo = LO_PLANES ? sV + Q_BLOCK_N * (DVP + SMEM_PAD) : sK;
    elem_t *sVlo = LO_PLANES ? sKlo + Q_BLOCK_N * (DP + SMEM_PAD) : sV;
    uint32_t *sSums = (uint32_t *)(sV + Q_BLOCK_N * (DVP + SMEM_PAD)
                                   + (LO_PLANES ? Q_BLOCK_N * (DP + DVP + 2 * SMEM_PAD) : 0));   /* MOD_TILE_SLOTS x MOD_CHUNKS */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    dq_cta c;
    if (!dq_cta_begin(p, h, b, Q_BLOCK_M, Q_BLOCK_N, Q_THREADS, c))
        return;
    const seq_t &sq = c.sq, &sk = c.sk;
    const int m0 = c.m0, Lq = c.Lq, Lk = c.Lk;
    int n_first = c.n_first, n_last = c.n_last;     /* mod_narrow may narrow them */
    const int64_t hk = c.hk;
    row_info ri;
    load_row_info(p, sq, sk, h, m0, ri);

    const elem_t *gq = (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + (sq.start + m0) * p.q.s[1] + h * p.q.s[2];
    const elem_t *gdo = (const elem_t *)p.dout.ptr + sq.mem_b * p.dout.s[0] + (sq.start + m0) * p.dout.s[1]
                        + h * p.dout.s[2];
    const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
    const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + sk.start * p.v.s[1] + hk * p.v.s[2];
    const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
    mod_narrow(sc, 1, true, m0, min(m0 + Q_BLOCK_M, Lq), Q_BLOCK_N, Lk, n_first, n_last);   /* mask_mod's empty end tiles */

    if (n_last >= n_first) {
        const int c0 = n_first * Q_BLOCK_N;
        load_tile<Q_BLOCK_M, DP, Q_THREADS>(sQ, gq, p.q.s[1], p.q.s[3], Lq - m0, HEAD_DIM, tid);
        load_tile<Q_BLOCK_M, DVP, Q_THREADS>(sdO, gdo, p.dout.s[1], p.dout.s[3], Lq - m0, HEAD_DIM_V, tid);
        load_tile<Q_BLOCK_N, DP, Q_THREADS>(sK, gk + (int64_t)c0 * p.k.s[1], p.k.s[1], p.k.s[3], Lk - c0, HEAD_DIM, tid);
        load_tile<Q_BLOCK_N, DVP, Q_THREADS>(sV, gv + (int64_t)c0 * p.v.s[1], p.v.s[1], p.v.s[3], Lk - c0, HEAD_DIM_V, tid);
        cp_async_commit();
    }
    float dq[Q_MT][DP / 8][4];
    zero_acc(dq);
    tile_sums sums;
    tile_sums_init(sums, sSums);
    if (key_tiles_to_sums(sums, sc, m0, n_first, n_last, Lq, Lk))
        dq_key_tiles<TILE_SUMS>(p, sc, ri, sQ, sdO, sK, sV, sKlo, sVlo, gk, gv, m0, n_first, n_last, Lq, Lk, dq, sums);
    else
        dq_key_tiles<TILE_SUMS && MOD_TILE_ALWAYS>(p, sc, ri, sQ, sdO, sK, sV, sKlo, sVlo, gk, gv, m0, n_first, n_last,
                                                   Lq, Lk, dq, sums);
    cp_async_wait_all();

    /* dq = dQ * scale; padding rows (and rows that keep nothing) come out 0 */
    const float scale = dq_mul(p);
    grad_t *gdq = (grad_t *)p.dq.ptr + sq.mem_b * p.dq.s[0] + sq.start * p.dq.s[1] + h * p.dq.s[2];
#pragma unroll
    for (int i = 0; i < 2 * Q_MT; i++) {
        const int mt = i / 2, e0 = (i % 2) * 2;
        const int r = m0 + warp * Q_WARP_M + mt * 16 + g + (i % 2) * 8;
        if (r >= sq.rows)
            continue;
        grad_t *row = gdq + (int64_t)r * p.dq.s[1];
#pragma unroll
        for (int nt = 0; nt < DP / 8; nt++) {
            const int d = nt * 8 + 2 * t;
            if (d < HEAD_DIM)
                row[d * p.dq.s[3]] = f32_to_grad(dq[mt][nt][e0] * scale);
            if (d + 1 < HEAD_DIM)
                row[(d + 1) * p.dq.s[3]] = f32_to_grad(dq[mt][nt][e0 + 1] * scale);
        }
    }
}
#endif

/* Grid (row tiles of PRE_ROWS, Hq, B [+1 varlen]): dq = dq_accum * scale, 0 where dq_live_rows
 * says (padding rows, and in the ordered mode a query tile that sees no key); with DQ_CHAINS,
 * dq_accum's copies that the tile's key blocks wrote, added in chain order. */
#if DQ_ORDERED && (DQ_TILE_M < PRE_ROWS || DQ_TILE_M % PRE_ROWS)
#error "attn_bwd_dq_convert: a CTA's rows inside one of the dK/dV kernel's query tiles"
#endif
#if ENTRY(attn_bwd_dq_convert)
extern "C" __global__ void __launch_bounds__(PRE_THREADS) attn_bwd_dq_convert(const __grid_constant__ attn_params p)
{
    const int64_t h = blockIdx.y, b = blockIdx.z;
    if (b == p.B) {
        zero_rows((grad_t *)p.dq.ptr + h * p.dq.s[2], p.dq.s[1], p.dq.s[3], packed_end_q(&p), p.Sq, HEAD_DIM,
                  PRE_THREADS);
        return;
    }
    const seq_t sq = seq_q(&p, b);
    const float scale = dq_mul(p);
    unsigned chains;
    const int64_t r_base = (int64_t)blockIdx.x * PRE_ROWS, live = dq_live_rows(p, sq, b, r_base, &chains);
    grad_t *gdq = (grad_t *)p.dq.ptr + sq.mem_b * p.dq.s[0] + sq.start * p.dq.s[1] + h * p.dq.s[2];
    const float *gacc = (const float *)p.dq_accum.ptr + sq.mem_b * p.dq_accum.s[0] + sq.start * p.dq_accum.s[1]
                        + h * p.dq_accum.s[2];
    if (!ELEM_F32 && !F16_SCALED && HEAD_DIM % 8 == 0 && p.dq.s[3] == 1 && p.dq.s[1] % 8 == 0 && aligned16(gdq) && p.dq_accum.s[3] == 1
        && p.dq_accum.s[1] % 4 == 0 && aligned16(gacc)) {
        /* 8 columns a thread: two 16-byte loads (dq_col keeps 8-column groups whole), one store */
        constexpr int C = HEAD_DIM / 8, STEPS = (PRE_ROWS * C + PRE_THREADS - 1) / PRE_THREADS;
#pragma unroll
        for (int k = 0; k < STEPS; k++) {
            const int i = threadIdx.x + k * PRE_THREADS, c = (i % C) * 8;
            const int64_t r = r_base + i / C;
            if (i >= PRE_ROWS * C || r >= sq.rows)
                continue;
            uint4 w = make_uint4(0u, 0u, 0u, 0u);
            if (r < live) {
                const float *src = gacc + r * p.dq_accum.s[1] + dq_col(r, c);
                float f[8] = {-0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f};   /* -0 + x is x */
#pragma unroll
                for (int ch = 0; ch < DQ_CHAINS; ch++)
                    if (chains >> ch & 1) {
                        const float4 *copy = (const float4 *)(src + dq_chain_offset(p, ch));
                        const float4 x = copy[0], y = copy[1];
                        f[0] += x.x, f[1] += x.y, f[2] += x.z, f[3] += x.w;
                        f[4] += y.x, f[5] += y.y, f[6] += y.z, f[7] += y.w;
                    }
                w = pack8(f, scale);
            }
            *(uint4 *)(gdq + r * p.dq.s[1] + c) = w;
        }
        return;
    }
    for (int i = threadIdx.x; i < PRE_ROWS * HEAD_DIM; i += PRE_THREADS) {
        const int64_t r = r_base + i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        if (r >= sq.rows)
            continue;
        float f = -0.f;
        if (r < live)
#pragma unroll
            for (int ch = 0; ch < DQ_CHAINS; ch++)
                if (chains >> ch & 1)
                    f += gacc[dq_chain_offset(p, ch) + r * p.dq_accum.s[1] + dq_col(r, d) * p.dq_accum.s[3]];
        gdq[r * p.dq.s[1] + d * p.dq.s[3]] = r < live ? f32_to_grad(f * scale) : (grad_t)0;
    }
}
#endif

/* ---------------------------------------------------------------- dbias */
/* Grid (row tiles, column tiles, Bc * Hb) of dbias's compact shape (a broadcast dim: one tile,
 * Bc = 1 when the batch is broadcast). Each CTA owns its elements: it visits, in a fixed order,
 * every batch item, query head of its bias head, row tile and column tile landing on them, sums
 * dS in registers, reduces over the broadcast rows / columns in a fixed order and writes once.
 * Elements past every sequence's length are left as the caller's zeros. */
#if ENTRY(attn_bwd_dbias)
extern "C" __global__ void __launch_bounds__(Q_THREADS, Q_MINB) attn_bwd_dbias(const __grid_constant__ attn_params p)
{
#if HAS_BIAS
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t *sQ = (elem_t *)smem_raw;                            /* Q_BLOCK_M x (DP + pad) */
    elem_t *sdO = sQ + Q_BLOCK_M * (DP + SMEM_PAD);             /* Q_BLOCK_M x (DVP + pad) */
    elem_t *sK = sdO + Q_BLOCK_M * (DVP + SMEM_PAD);            /* Q_BLOCK_N x (DP + pad) */
    elem_t *sV = sK + Q_BLOCK_N * (DP + SMEM_PAD);              /* Q_BLOCK_N x (DVP + pad) */
    float *sRed = (float *)(sV + Q_BLOCK_N * (DVP + SMEM_PAD)); /* Q_WARPS x Q_BLOCK_N */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mc = blockIdx.x, nc = blockIdx.y;
    const int64_t hb = blockIdx.z % p.bias_heads, bz = blockIdx.z / p.bias_heads;
    const bool bcast_b = p.dbias.s[0] == 0, bcast_r = p.dbias.s[2] == 0, bcast_c = p.dbias.s[3] == 0;
    const int64_t heads_per = p.Hq / p.bias_heads;

    float acc[Q_MT][Q_NT][4];
    zero_acc(acc);
    int rlim = 0, clim = 0;
    for (int64_t b = bcast_b ? 0 : bz; b < (bcast_b ? p.B : bz + 1); b++) {
        const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
        const int Lq = (int)sq.len, Lk = (int)sk.len;
        rlim = max(rlim, Lq);
        clim = max(clim, Lk);
        const int mt_lo = bcast_r ? 0 : mc;
        const int mt_hi = bcast_r ? (Lq + Q_BLOCK_M - 1) / Q_BLOCK_M : (mc * Q_BLOCK_M < Lq ? mc + 1 : mc);
        for (int64_t hh = 0; hh < heads_per; hh++) {
            const int64_t h = hb * heads_per + hh, hk = h / (p.Hq / p.Hk);
            const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
            for (int mi = mt_lo; mi < mt_hi; mi++) {
                const int m0 = mi * Q_BLOCK_M;
                int64_t lo, hi;
                kv_range(&p, m0, min(m0 + Q_BLOCK_M, Lq), Lq, Lk, &lo, &hi);
                if (hi <= lo)
                    continue;
                int n_lo = (int)(lo / Q_BLOCK_N), n_hi = (int)((hi - 1) / Q_BLOCK_N);
                if (!bcast_c) {
                    if (nc < n_lo || nc > n_hi)
                        continue;
                    n_lo = n_hi = nc;
                }
                row_info ri;
                load_row_info<true>(p, sq, sk, h, m0, ri);
                const elem_t *gq = (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + (sq.start + m0) * p.q.s[1] + h * p.q.s[2];
                const elem_t *gdo = (const elem_t *)p.dout.ptr + sq.mem_b * p.dout.s[0]
                                    + (sq.start + m0) * p.dout.s[1] + h * p.dout.s[2];
                const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
                const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + sk.start * p.v.s[1] + hk * p.v.s[2];
                for (int n = n_lo; n <= n_hi; n++) {
                    const int c0 = n * Q_BLOCK_N;
                    __syncthreads();      /* every warp is done with the previous tiles */
                    if (n == n_lo) {
                        load_tile<Q_BLOCK_M, DP, Q_THREADS>(sQ, gq, p.q.s[1], p.q.s[3], Lq - m0, HEAD_DIM, tid);
                        load_tile<Q_BLOCK_M, DVP, Q_THREADS>(sdO, gdo, p.dout.s[1], p.dout.s[3], Lq - m0, HEAD_DIM_V, tid);
                    }
                    load_tile<Q_BLOCK_N, DP, Q_THREADS>(sK, gk + (int64_t)c0 * p.k.s[1], p.k.s[1], p.k.s[3], Lk - c0,
                                                        HEAD_DIM, tid);
                    load_tile<Q_BLOCK_N, DVP, Q_THREADS>(sV, gv + (int64_t)c0 * p.v.s[1], p.v.s[1], p.v.s[3], Lk - c0,
                                                         HEAD_DIM_V, tid);
                    cp_async_commit();
                    cp_async_wait_all();
                    __syncthreads();
                    float s[Q_MT][Q_NT][4], dp[Q_MT][Q_NT][4];
                    zero_acc(s);
                    zero_acc(dp);
                    mma_abt<Q_MT, Q_NT, DP>(s, sQ + warp * Q_WARP_M * (DP + SMEM_PAD), sK, lane);
                    mma_abt<Q_MT, Q_NT, DVP>(dp, sdO + warp * Q_WARP_M * (DVP + SMEM_PAD), sV, lane);
                    ds_tile<false, false, true>(s, dp, p, sc, ri, m0, c0, ds_needs_mask(p, sc, m0, c0, Lq, Lk), Lq,
                                                Lk);
#pragma unroll
                    for (int mt = 0; mt < Q_MT; mt++)
#pragma unroll
                        for (int nt = 0; nt < Q_NT; nt++)
#pragma unroll
                            for (int e = 0; e < 4; e++)
                                acc[mt][nt][e] += s[mt][nt][e];
                }
            }
        }
    }

    char *out = (char *)p.dbias.ptr + (bz * p.dbias.s[0] + hb * p.dbias.s[1]) * dtype_size((attn_dtype)BIAS_DT);
    const int r_base = mc * Q_BLOCK_M + warp * Q_WARP_M + g, c_base = nc * Q_BLOCK_N + 2 * t;
    if (!bcast_r && !bcast_c) {
#pragma unroll
        for (int mt = 0; mt < Q_MT; mt++)
#pragma unroll
            for (int nt = 0; nt < Q_NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = r_base + mt * 16 + (e / 2) * 8, c = c_base + nt * 8 + (e & 1);
                    if (r < rlim && c < clim)
                        store_from_f32(out, (int64_t)r * p.dbias.s[2] + (int64_t)c * p.dbias.s[3], BIAS_DT,
                                       acc[mt][nt][e]);
                }
    } else if (!bcast_r) {                /* sum over the columns: a quad holds a row */
#pragma unroll
        for (int i = 0; i < 2 * Q_MT; i++) {
            float x = 0.f;
#pragma unroll
            for (int nt = 0; nt < Q_NT; nt++)
                x += acc[i / 2][nt][(i % 2) * 2] + acc[i / 2][nt][(i % 2) * 2 + 1];
            x += __shfl_xor_sync(0xffffffffu, x, 1);
            x += __shfl_xor_sync(0xffffffffu, x, 2);
            const int r = r_base + (i / 2) * 16 + (i % 2) * 8;
            if (t == 0 && r < rlim)
                store_from_f32(out, (int64_t)r * p.dbias.s[2], BIAS_DT, x);
        }
    } else {                              /* sum over the rows (and the columns when both) */
        float col[Q_NT][2];
#pragma unroll
        for (int nt = 0; nt < Q_NT; nt++)
#pragma unroll
            for (int x = 0; x < 2; x++) {
                float v = 0.f;
#pragma unroll
                for (int mt = 0; mt < Q_MT; mt++)
                    v += acc[mt][nt][x] + acc[mt][nt][2 + x];
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                col[nt][x] = v;
            }
        if (g == 0)
#pragma unroll
            for (int nt = 0; nt < Q_NT; nt++) {
                sRed[warp * Q_BLOCK_N + nt * 8 + 2 * t] = col[nt][0];
                sRed[warp * Q_BLOCK_N + nt * 8 + 2 * t + 1] = col[nt][1];
            }
        __syncthreads();
        if (!bcast_c) {
            if (tid < Q_BLOCK_N) {
                float v = 0.f;
                for (int w = 0; w < Q_WARPS; w++)
                    v += sRed[w * Q_BLOCK_N + tid];
                const int c = nc * Q_BLOCK_N + tid;
                if (c < clim)
                    store_from_f32(out, (int64_t)c * p.dbias.s[3], BIAS_DT, v);
            }
        } else if (tid == 0) {
            float v = 0.f;
            for (int w = 0; w < Q_WARPS; w++)
                for (int c = 0; c < Q_BLOCK_N; c++)
                    v += sRed[w * Q_BLOCK_N + c];
            store_from_f32(out, 0, BIAS_DT, v);
        }
    }
#endif
}
#endif
