/* What the backward kernels (attn_bwd.cu on mma.sync, attn_bwd_sm90.cu on wgmma) share: the
 * row statistics of a query tile, P^T and dS^T of a dK/dV tile, dS of a dQ tile, fragment
 * packing, and the zero rows after a packed batch.
 *
 * Register layout: the mma C-fragment layout (attn_common.cuh's legend) per warp; wgmma's m64
 * accumulators are the same per warp (warp w of a warpgroup owns rows 16w..16w+15), so both
 * kernel families call these. Switches: Q_BLOCK_M, Q_BLOCK_N, Q_WARPS (dQ and dbias tiles: rows
 * per CTA, keys per tile, warps), KV_BLOCK_M (dK/dV: query rows per streamed tile).
 */
#ifndef ATTNEXT_ATTN_BWD_TILE_CUH
#define ATTNEXT_ATTN_BWD_TILE_CUH

#include "attn_common.cuh"

#define Q_THREADS (Q_WARPS * 32)
#define Q_WARP_M (Q_BLOCK_M / Q_WARPS)   /* query rows per warp (dq, dbias) */
#define Q_MT (Q_WARP_M / 16)
#define Q_NT (Q_BLOCK_N / 8)
#define KV_NT (KV_BLOCK_M / 8)           /* n8 tiles of S^T per warp */
#define PRE_ROWS 64                      /* rows per CTA of the small row kernels */

/* The C fragments of an m16 x (2 KS n8) product as the A fragments of the next product. */
template <int MT, int KS>
DEV void pack_frag(cfrag<MT, KS> &a, const float (&f)[MT][2 * KS][4])
{
#if ELEM_F32
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 2 * KS; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                a[mt][nt][e] = f[mt][nt][e];
#else
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            a[mt][kk][0] = pack2(f[mt][2 * kk][0], f[mt][2 * kk][1]);
            a[mt][kk][1] = pack2(f[mt][2 * kk][2], f[mt][2 * kk][3]);
            a[mt][kk][2] = pack2(f[mt][2 * kk + 1][0], f[mt][2 * kk + 1][1]);
            a[mt][kk][3] = pack2(f[mt][2 * kk + 1][2], f[mt][2 * kk + 1][3]);
        }
#endif
}

/* 8 floats times scale as 8 elements (16 bytes, the first lowest). */
DEV uint4 pack8(const float (&f)[8], float scale)
{
    return make_uint4(pack2(f[0] * scale, f[1] * scale), pack2(f[2] * scale, f[3] * scale),
                      pack2(f[4] * scale, f[5] * scale), pack2(f[6] * scale, f[7] * scale));
}

/* The ordered mode's first turn at a query tile stores its dQ partial, so nothing zeroes dq_accum,
 * and where p.dq_write_last (short keys) its last turn writes dq: attn_bwd_sm90.cu's
 * warp-specialised kernel without a mask_mod, whose blocks may pass their turns (then every turn
 * adds into a dq_accum the host zeroed, and attn_bwd_dq_convert writes dq). */
#define DQ_STORE_FIRST (DQ_ORDERED && !HAS_MASK_MOD)

/* DQ_CHAINS (the ordered mode with its first turns storing and dq converted apart, so without a
 * mask_mod and without p.dq_write_last: select.bwd_dq_chains): the key blocks of DQ_KEY_BLOCK
 * keys take their turns at a query tile in DQ_CHAINS chains, block n in chain n % DQ_CHAINS,
 * each chain into its own copy of dq_accum (p.dq_accum.s[2] / DQ_CHAINS elements after the
 * previous chain's: the host lays the copies out between the heads). A chain's turns wait only
 * for its own blocks, so the staircase of turns a query tile's key blocks climb at a kernel's
 * start is DQ_CHAINS times shorter; attn_bwd_dq_convert adds the copies in chain order, the
 * same bits every run. */
#ifndef DQ_CHAINS
#define DQ_CHAINS 1
#endif
#if DQ_CHAINS > 1 && (!DQ_STORE_FIRST || DQ_CHAINS > 32 || 32 % DQ_CHAINS)
#error "DQ_CHAINS: the ordered mode's stored first turns, a divisor of 32 chains"
#endif
#define DQ_ALL_CHAINS ((2u << (DQ_CHAINS - 1)) - 1)     /* a bit a chain (2u << 31 is 0: 32 chains) */

/* Where chain c's copy of dq_accum starts, in elements after chain 0's: the host lays dq_accum out
 * as (B, Hq, DQ_CHAINS, S, D) and hands the kernels a (B, S, Hq, D) view of chain 0's copies, so
 * its head stride spans DQ_CHAINS of them (backend.py: _new_backward_plan). */
DEV int64_t dq_chain_offset(const attn_params &p, int c)
{
    return c * (p.dq_accum.s[2] / DQ_CHAINS);
}

/* The rows of sequence b whose dq comes from dq_accum's sums: those below the returned row; dq is
 * 0 from it on. They are the sequence's rows (not its padding) except, in the ordered mode, where
 * the query tile of DQ_TILE_M rows (attn_bwd_sm90.cu's) holding row r sees no key: no key block
 * adds into it, and its dq_accum rows are never written. chains (DQ_CHAINS > 1): bit c set where
 * a key block of chain c adds into that tile (its other copies are never written). */
DEV int64_t dq_live_rows(const attn_params &p, const seq_t &sq, int64_t b, int64_t r, unsigned *chains = nullptr)
{
    if (chains)
        *chains = DQ_ALL_CHAINS;
#if DQ_ORDERED
    const int64_t m0 = r - r % DQ_TILE_M;
    if (m0 < sq.len) {
        int64_t lo, hi;
        kv_range(&p, m0, min(m0 + DQ_TILE_M, sq.len), sq.len, seq_k(&p, b).len, &lo, &hi);
        if (hi <= lo)
            return 0;
#if DQ_CHAINS > 1
        const int first = (int)(lo / DQ_KEY_BLOCK), last = (int)((hi - 1) / DQ_KEY_BLOCK);
        if (chains && last - first + 1 < DQ_CHAINS) {
            *chains = 0;
            for (int n = first; n <= last; n++)
                *chains |= 1u << (n % DQ_CHAINS);
        }
#endif
    }
#endif
    return sq.len;
}

#if DQ_ORDERED
/* The ordered mode's turns (attn_bwd_sm90.cu's warp-specialised kernel, attn_bwd_sm90_x3.cu's
 * dK/dV kernel). The key blocks add into a query tile one at a time, in descending key-block
 * order, so every element of dq_accum sees the same additions in the same order on every run.
 * dq_sem (B, Hq, query tiles x SEM_WORDS; zeroed by attn_bwd_pre) holds a bit per key block and
 * tile: set once the block has added into the tile, or at the start for the tiles a mask_mod's
 * block mask took off its ends (mod_narrow: it adds nothing there). Block n adds into tile m once
 * every block of its chain (DQ_CHAINS) above it that sees m (up to kv_range's last) has set its
 * bit. The grid runs the key blocks in reverse (the last first), so a CTA only ever waits for
 * CTAs launched before it: those are running or done, whatever else shares the GPU. A wait that
 * outlasts SEM_SPINS polls (never expected) goes on unordered rather than hang where every turn
 * adds (a mask_mod); where the first turn stores (DQ_STORE_FIRST) a turn out of order would lose
 * sums, so the kernel traps: the call fails with the launch's error rather than return a wrong
 * dq. */
#define SEM_SPINS (1 << 22)
#define SEM_WORDS ((int)(gridDim.x + 31) >> 5)
/* sem_wait: a range of at most this many words is polled by lane 0 alone */
#define SEM_LANE_WORDS 2

/* Query tile m0's words (DQ_TILE_M rows), and the first and last key blocks (KEY_BLOCK keys, the
 * dK/dV kernel's grid's x) that see it. */
template <int KEY_BLOCK>
DEV int *sem_of(const attn_params &p, int64_t b, int64_t h, int m0, int Lq, int Lk, int &first, int &last)
{
    int64_t lo, hi;
    kv_range(&p, m0, min(m0 + DQ_TILE_M, Lq), Lq, Lk, &lo, &hi);
    first = (int)(lo / KEY_BLOCK);
    last = (int)((hi - 1) / KEY_BLOCK);
    return (int *)p.dq_sem.ptr + b * p.dq_sem.s[0] + h * p.dq_sem.s[1] + (m0 / DQ_TILE_M) * SEM_WORDS * p.dq_sem.s[2];
}

/* Until the bits of blocks n + DQ_CHAINS, n + 2 DQ_CHAINS, .. up to last (n's chain above it) are
 * all set. A whole warp calls it, lane i polling the range's i-th word, so a wait over many words
 * (a word holds 32 key blocks: up to 64 words at S 256k) costs one round trip to L2, not one a
 * word (one polling thread had made the writers' turn waits 8x longer there: bench/NOTES item
 * 10). __syncwarp orders the lanes' acquires before the warp's later operations (the vote does
 * not promise to), and the fence makes that gpu-wide for lane 0's bulk copies. A range of at
 * most SEM_LANE_WORDS words (short rows) lane 0 polls alone, as the thread that issues the
 * copies needs no fence after its own acquires (the warp and its fence had cost the float32
 * planes' backward 2-3% at S4k: bench/NOTES.md, backward v20b). The two polls stay apart: one
 * loop for both measured 1.5-1.7% slower (backward table, tried (s64)). */
DEV void sem_wait(const int *sem, int n, int last, int lane)
{
    /* the blocks of n's chain in a word: every DQ_CHAINS-th bit from n % DQ_CHAINS (two chains:
     * 0x55555555, or 0xaaaaaaaa for odd n) */
    const unsigned chain = (0xffffffffu / DQ_ALL_CHAINS) << (n % DQ_CHAINS);
    if ((last >> 5) - ((n + 1) >> 5) < SEM_LANE_WORDS) {
        /* a few words: lane 0, which issues the addition, acquires them itself (no fence) */
        if (lane == 0)
            for (int w = (n + 1) >> 5; w <= last >> 5; w++) {
                const int lo = max(n + 1, w * 32) - w * 32, hi = min(last, w * 32 + 31) - w * 32;
                const unsigned need = (hi == 31 ? ~0u : (2u << hi) - 1) & ~((1u << lo) - 1) & chain;
                int spins = 0;
                for (; spins < SEM_SPINS; spins++) {
                    unsigned v;
                    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem + w) : "memory");
                    if ((v & need) == need)
                        break;
                    if (spins >= 64)
                        __nanosleep(256);
                }
#if DQ_STORE_FIRST
                if (spins == SEM_SPINS)
                    __trap();
#endif
            }
        __syncwarp();
        return;
    }
    for (int w0 = (n + 1) >> 5; w0 <= last >> 5; w0 += 32) {
        const int w = w0 + lane;
        unsigned need = 0;
        if (w <= last >> 5) {
            const int lo = max(n + 1, w * 32) - w * 32, hi = min(last, w * 32 + 31) - w * 32;
            need = (hi == 31 ? ~0u : (2u << hi) - 1) & ~((1u << lo) - 1) & chain;
        }
        int spins = 0;
        for (; spins < SEM_SPINS; spins++) {
            unsigned v = 0;
            if (need)
                asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem + w) : "memory");
            if (__all_sync(0xffffffffu, (v & need) == need))
                break;
            if (spins >= 64)
                __nanosleep(256);
        }
#if DQ_STORE_FIRST
        if (spins == SEM_SPINS)
            __trap();
#endif
    }
    __syncwarp();
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

/* Block n's bit, released after its additions are complete (fenced), or at once where it adds
 * nothing (no fence: nothing to order). */
template <bool FENCED>
DEV void sem_set(int *sem, int n)
{
    if (FENCED)
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    asm volatile("red.relaxed.gpu.global.or.b32 [%0], %1;" ::"l"(sem + (n >> 5)), "r"(1u << (n & 31)) : "memory");
}
#endif

/* Past this |lse|, exp2(s c - lse log2e) is off by more than P's float32 rounding (its error
 * grows with ulp(lse): 1.2e-4 relative at 1024) and, far past it, lse holds the scores' fill
 * alone (-1e10, not -1e10 + log n): such a row is lost. The main kernels take it for a row that
 * keeps no key (P = 0: it adds nothing anywhere); attn_bwd_pre recomputes its maximum and sum
 * (attn_params.h: row_mz) and marks its (sequence, head) in the dead words, and its terms come
 * from the kernels that redo such heads: attn_bwd_dead (dK, dV by dkdv<DEAD>, dq and the
 * array gradients by lost_row_dq) and attn_bwd_dbias (ds_tile<LOST_OK>). The common tile pays
 * nothing: a second path beside it cost every backward 4-6% (bench/NOTES.md, session 22). */
#if ELEM_F32
#define LOST_LSE 64.f          /* float32's gradients: ulp(64) = 7.6e-6, inside float32's rule */
#else
#define LOST_LSE 1024.f
#endif

DEV bool lse_is_lost(float lse) { return fabsf(lse) > LOST_LSE && !isinf(lse); }

/* A row's lse as the backward reads it: with attention sinks, an lse equal to query head h's
 * sink is a row that keeps no key (the forward wrote the sink alone, or what the row keeps
 * weighs under float rounding), read as -inf so that such rows take the same path as rows
 * without a key: zero gradients, whatever NaN sits where they keep nothing. */
DEV float bwd_lse(const attn_params &p, int64_t h, float lse)
{
    return p.sinks && lse == ((const float *)p.sinks)[h] ? NEG_INF : lse;
}

/* lse of a row in log2 units, +inf for a row that keeps nothing (lse -inf) or is lost: exp2(s -
 * that) is then 0, and +inf marks such a row (ds_tile, dkdv<DEAD>). LOST_OK: a lost row gives
 * NaN instead, for the passes that take its P from row_mz (lost_p). An lse of +inf gives the
 * largest finite float: P = 0 there too, but the row is not taken for one that keeps nothing
 * (docs/semantics.md: NaN and Inf). */
template <bool LOST_OK = false>
DEV float lse_log2(float lse)
{
    return lse == NEG_INF ? POS_INF : lse == POS_INF ? __int_as_float(0x7f7fffff)
           : lse_is_lost(lse) ? (LOST_OK ? __int_as_float(0x7fc00000) : POS_INF) : lse * LOG2E;
}

/* The (m, z) of the lost rows of (sc.b, sc.h) (attn_bwd_pre), row r's at [r * p.delta.s[2]]. */
DEV const float2 *lost_rows(const attn_params &p, const score_ctx &sc)
{
    const seq_t sq = seq_q(&p, sc.b);
    return (const float2 *)p.row_mz + sq.mem_b * p.delta.s[0] + sc.h * p.delta.s[1] + sq.start * p.delta.s[2];
}

/* P at score x of row r: pv (from the row's lse2), unless lse2 marks a lost row (NaN: lse_log2
 * <true>), whose P is exp2((x - m) c - z) from its (m, z): x the raw q.k where the score is
 * plain (c = scale log2e), else the natural score (c = log2e); -inf where not kept. At most 1,
 * as P is: where q.k itself is huge (1e10) the tensor cores' dot can pass the recomputed
 * maximum by its rounding (hundreds), and exp2 of that would be inf. */
DEV float lost_p(const attn_params &p, const score_ctx &sc, const float2 *mz, int r, float x, float lse2, float pv)
{
    if (!isnan(lse2))
        return pv;
    const float2 s = mz[r * p.delta.s[2]];
    const float c = SCORE_IS_PLAIN ? sc.scale * LOG2E : LOG2E;
    return fast_exp2(fminf((x - s.x) * c - s.y, 0.f));
}

/* Rows [first, rows) x cols [0, cols) of one head of a gradient (dq, dk or dv: grad_t) set to 0, rows
 * spread over blockIdx.x (the packed rows after the last sequence). */
DEV void zero_rows(grad_t *base, int64_t s_row, int64_t s_col, int64_t first, int64_t rows, int cols,
                   int threads)
{
    for (int64_t r = first + (int64_t)blockIdx.x * PRE_ROWS; r < rows; r += (int64_t)gridDim.x * PRE_ROWS)
        for (int i = threadIdx.x; i < PRE_ROWS * cols; i += threads) {
            const int64_t row = r + i / cols;
            if (row < rows)
                base[row * s_row + (i % cols) * s_col] = 0;
        }
}

/* dq_accum's column for dQ column d of its sequence's row r: with D a multiple of 32, the 8-column
 * groups inside each 32 are swizzled by the row's low two bits, so that attn_bwd_sm90.cu's
 * fragment stores of a tile (eight rows at the same columns per warp) hit distinct banks. */
DEV int dq_col(int64_t r, int d) { return HEAD_DIM % 32 ? d : d ^ (((int)r & 3) << 3); }

/* A dQ CTA's start: query tile m0 of head h of sequence b (the grid's x counted from the last: the
 * longest causal rows first), bm rows, and the key tiles [n_first, n_last] of bn keys its rows see
 * (none: n_last < n_first). False where the CTA has no rows; the grid's extra sequence (b == p.B)
 * zeroes dq's packed rows after the last sequence and gives false. Every dQ kernel's (attn_bwd.cu,
 * attn_bwd_sm90.cu, attn_bwd_sm90_x3.cu). */
struct dq_cta {
    seq_t sq, sk;
    int64_t hk;
    int m0, Lq, Lk, n_first, n_last;
};

/* A dK/dV CTA of the grid's extra sequence (b == p.B): dk's and dv's packed rows after the last
 * sequence set to 0 for kv head hk. */
DEV void zero_dkdv_tail(const attn_params &p, int64_t hk, int threads)
{
    const int64_t first = packed_end_k(&p);
    zero_rows((grad_t *)p.dk.ptr + hk * p.dk.s[2], p.dk.s[1], p.dk.s[3], first, p.Sk, HEAD_DIM, threads);
    zero_rows((grad_t *)p.dv.ptr + hk * p.dv.s[2], p.dv.s[1], p.dv.s[3], first, p.Sk, HEAD_DIM_V, threads);
}

DEV bool dq_cta_begin(const attn_params &p, int64_t h, int64_t b, int bm, int bn, int threads, dq_cta &c)
{
    if (b == p.B) {
        zero_rows((grad_t *)p.dq.ptr + h * p.dq.s[2], p.dq.s[1], p.dq.s[3], packed_end_q(&p), p.Sq, HEAD_DIM, threads);
        return false;
    }
    c.sq = seq_q(&p, b);
    c.sk = seq_k(&p, b);
    c.m0 = (gridDim.x - 1 - blockIdx.x) * bm;
    if (c.m0 >= c.sq.rows)
        return false;
    c.hk = h / (p.Hq / p.Hk);
    c.Lq = (int)c.sq.len;
    c.Lk = (int)c.sk.len;
    int64_t lo = 0, hi = 0;
    if (c.m0 < c.Lq)
        kv_range(&p, c.m0, min(c.m0 + bm, c.Lq), c.Lq, c.Lk, &lo, &hi);
    c.n_first = (int)(lo / bn);
    c.n_last = hi > lo ? (int)((hi - 1) / bn) : -1;
    return true;
}

/* p[0] += a, p[1] += b by float atomics (one vector reduction on sm_90; p 8-byte aligned). */
DEV void red_add_f32x2(float *p, float a, float b)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + 1), "f"(b) : "memory");
#endif
}

/* Whether pt_pass's and ds_pass's plain pairs go without a branch each: the band's test (bitwise,
 * so the compiler keeps it a predicate) selects exp2's argument, exp2(-inf) = 0 (and ds_pass's
 * dS, so that a pair it drops stays exactly 0 whatever dP holds). With a branch around each exp2
 * the one pass at D = 64 ran a BSSY / BRA / BSYNC region a pair (ncu: 303M branch instructions
 * against cuDNN's 52M; bench/NOTES.md, backward v15). With a mask array the old form stays:
 * its read is behind the band's test. */
#define PAIR_SELECT (SCORE_IS_PLAIN && !MASK_ARRAY && !HAS_MASK_MOD && !ATTN_GMODS)
/* PAIR_BITS: PAIR_SELECT's band test as one bit of band_bits' word (attn_common.cuh: the thread's
 * query rows of S^T are an mma C fragment's columns, as the forward's keys are), at D <= 64, whose
 * pass has no copy for the tiles that need no test (each pair took its row's index, two compares
 * and the need_mask test before its exp2: ~5 instructions). At D = 128 that copy runs the
 * unmasked tiles, and the word's set-up added instructions there. ROW_PAIRS: pt_pass reads a row
 * pair's lse and delta by 8-byte loads; attn_bwd_sm90.cu takes them at D = 64 too. Both there at
 * D = 64 (H200, bf16, session 46): the backward 0.87-0.96x cuDNN -> 1.00-1.09x, PAIR_BITS alone
 * 0.95-1.07x (bench/NOTES.md, backward v19). */
#ifndef PAIR_BITS
#define PAIR_BITS (HEAD_DIM <= 64)
#endif
#ifndef ROW_PAIRS
#define ROW_PAIRS (HEAD_DIM > 64)
#endif

/* pt_tile's pass over the tile's elements; ALL: the tile keeps every pair (a generated
 * kernel's tile that needs no test: no per-element keep bits to read); DEAD: P^T is 0 in the
 * columns of rows that keep no key (lb +inf), whatever their scores, and lost rows (lb NaN) take
 * lost_p (attn_bwd.cu: dkdv<DEAD>). */
template <int NT, bool DS, bool ALL, bool DEAD>
DEV void pt_pass(float (&s)[1][NT][4], cfrag<1, NT / 2> &pp, const attn_params &p, const score_ctx &sc,
                 const float *lb, int n0w, int m0, const int (&qlo)[2], const int (&qhi)[2], bool need_mask,
                 float (&dp)[1][NT][4], const float *db, const tile_keep<1, NT> &keep, mod_fault &fault)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float scale_log2 = sc.scale * LOG2E;
    const float2 *mz = DEAD ? lost_rows(p, sc) : nullptr;
#if PAIR_SELECT && PAIR_BITS
    /* each key row's (half's) band over the thread's query rows, all of them where the tile needs
     * no test */
    const uint64_t band[2] = {need_mask ? band_bits<NT>(qlo[0], qhi[0], m0, t) : ~0ull,
                              need_mask ? band_bits<NT>(qlo[1], qhi[1], m0, t) : ~0ull};
#endif
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#if ROW_PAIRS
        /* the two query rows' lse and delta by 8-byte loads (the rows' buffers are 8-byte aligned):
         * half the shared loads of reading them one by one. At D = 64 attn_bwd.cu's items hold twice
         * the rows in the same registers: there the pairs held ahead cost spills (bench/NOTES.md,
         * backward v12) */
        const float2 lb2 = *(const float2 *)(lb + nt * 8 + 2 * t);
        const float2 db2 = DS ? *(const float2 *)(db + nt * 8 + 2 * t) : make_float2(0.f, 0.f);
#endif
#pragma unroll
        for (int half = 0; half < 2; half++) {
            float pr[2];
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const int e = half * 2 + x;
                const int c = n0w + g + half * 8;
                const int rl = nt * 8 + 2 * t + x, r = m0 + rl;
#if ROW_PAIRS
                const float lrow = x ? lb2.y : lb2.x, drow = x ? db2.y : db2.x;
#else
                const float lrow = lb[rl], drow = DS ? db[rl] : 0.f;
#endif
                const float raw = s[0][nt][e];
                float pv = 0.f, grad = 1.f;
                int bad = 0;
#if SCORE_ANYWHERE
                const bool k = ALL || keep.at(0, nt, e);
                const float sx = kept_score(sc, k, raw, r, c, bad);
                float pk = fast_exp2(sx * LOG2E - lrow);
                if (DEAD)
                    pk = lost_p(p, sc, mz, r, sx, lrow, pk);
                const float gk = score_grad(sc, raw, r, c);
                pv = k ? pk : 0.f;
                grad = k ? gk : 1.f;
#elif PAIR_SELECT
#if PAIR_BITS
                const bool k = ALL || (band[half] >> (2 * nt + x) & 1);
#else
                const bool k = ALL || (!need_mask | ((r >= qlo[half]) & (r < qhi[half])));
#endif
                pv = fast_exp2(k ? raw * scale_log2 - lrow : NEG_INF);
                if (DEAD && k)
                    pv = lost_p(p, sc, mz, r, raw, lrow, pv);
#else
#if ATTN_GMODS
                const bool k = ALL || keep.at(0, nt, e);
#else
                const bool k = ALL || !need_mask || (r >= qlo[half] && r < qhi[half] && mask_keeps(sc, r, c, bad));
#endif
                if (k) {
#if SCORE_IS_PLAIN
                    pv = fast_exp2(raw * scale_log2 - lrow);
                    if (DEAD)
                        pv = lost_p(p, sc, mz, r, raw, lrow, pv);
#else
                    const float sx = score_of(sc, raw, r, c, bad);
                    pv = fast_exp2(sx * LOG2E - lrow);
                    if (DEAD)
                        pv = lost_p(p, sc, mz, r, sx, lrow, pv);
#endif
                    grad = score_grad(sc, raw, r, c);
                }
#endif
                if (DEAD && lrow == POS_INF) {
                    pv = 0.f;
                    grad = 0.f;
                }
                note_fault(fault, bad, r, c, raw);
                pr[x] = pv;
                const float pg = pv * grad;
                if constexpr (DS)         /* dst_tile's rule, element by element */
                    dp[0][nt][e] = HAS_SCORE_MOD && pg == 0.f ? 0.f : pg * (dp[0][nt][e] - drow);
                else
                    s[0][nt][e] = pg;
            }
#if ELEM_F32
            pp[0][nt][half * 2] = pr[0];
            pp[0][nt][half * 2 + 1] = pr[1];
#else
            pp[0][nt / 2][(nt & 1) * 2 + half] = pack2(pr[0], pr[1]);
#endif
        }
    }
}

/* P^T for a warp's 16 key rows x the query tile at m0, from S^T = K Q^T (raw dots in s; rows are
 * keys n0w + g (+ 8), columns query rows m0 + 8 nt + 2 t (+ 1)): P^T packed into pp (the A
 * fragments of dV += P^T dO), and s overwritten by P^T * score_grad (for dS^T). lb: the tile's
 * lse rows in log2 units; qlo, qhi: the query rows each of the thread's two key rows is seen
 * by; a tile that needs no mask skips the tests. DS: dP^T is in dp already, and dS^T (dst_tile's,
 * the same bits) goes into dp instead, element by element: s is dead as it is read (registers). */
template <int NT, bool DS = false, bool DEAD = false>
DEV void pt_tile(float (&s)[1][NT][4], cfrag<1, NT / 2> &pp, const attn_params &p, const score_ctx &sc,
                 const float *lb, int n0w, int m0, const int (&qlo)[2], const int (&qhi)[2], bool need_mask,
                 float (&dp)[1][NT][4], const float *db)
{
    mod_fault fault = no_fault();
    tile_keep<1, NT> keep;
#if ATTN_GMODS
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    /* the generated kernels: which pairs the tile keeps first (keep_pass: a mask_mod's lookups
     * in one batch), then the scores, branch-free where they may run anywhere (SCORE_ANYWHERE);
     * without a mask_mod, a tile that needs no test takes the pass without keep bits (softcap
     * score_mod backward 1.36x -> 1.44x Flex; with a mask_mod's code beside it the second pass
     * cost registers and time: bench/NOTES.md, backward v5) */
    keep_pass(sc, need_mask, s, keep, fault, [&](int, int nt, int e, int &r, int &c, bool &band) {
        c = n0w + g + (e / 2) * 8;
        r = m0 + nt * 8 + 2 * t + (e & 1);
        band = r >= qlo[e / 2] && r < qhi[e / 2];
    });
#endif
    /* a tile that needs no test takes a pass without them: with the generated kernels, and at
     * D > 64 for plain ones too (the per-pair tests cost 4-6% of the backward at D = 128; at
     * D = 64 the second copy spills: bench/NOTES.md, backward v12) */
#if !HAS_MASK_MOD && (ATTN_GMODS || HEAD_DIM > 64)
    if (!need_mask)
        pt_pass<NT, DS, true, DEAD>(s, pp, p, sc, lb, n0w, m0, qlo, qhi, need_mask, dp, db, keep, fault);
    else
#endif
        pt_pass<NT, DS, false, DEAD>(s, pp, p, sc, lb, n0w, m0, qlo, qhi, need_mask, dp, db, keep, fault);
    report_fault(sc, fault);
}

/* pt_tile leaving P^T * score_grad in s (attn_bwd.cu, which computes dP^T after dV's product). */
template <int NT, bool DEAD>
DEV void pt_tile(float (&s)[1][NT][4], cfrag<1, NT / 2> &pp, const attn_params &p, const score_ctx &sc,
                 const float *lb, int n0w, int m0, const int (&qlo)[2], const int (&qhi)[2], bool need_mask)
{
    pt_tile<NT, false, DEAD>(s, pp, p, sc, lb, n0w, m0, qlo, qhi, need_mask, s, nullptr);
}

/* For a dK/dV tile of bn keys at n0 (query tiles of bm rows): the query tiles [m_first, m_first +
 * nm) that see some key of it, and the query rows [qlo[i], qhi[i]) each of this thread's two key
 * rows (n0w + g, n0w + g + 8) is seen by: the exact inverse of kv_range, so the forward's kept set. */
DEV void kv_tile_rows(const attn_params &p, int n0, int bn, int bm, int n0w, int Lq, int Lk, int &m_first,
                      int &nm, int (&qlo)[2], int (&qhi)[2])
{
    const int g = (threadIdx.x & 31) >> 2;
    m_first = nm = 0;
    if (n0 < Lk) {
        int64_t lo, hi;
        q_range(&p, n0, min(n0 + bn, Lk), Lq, Lk, &lo, &hi);
        if (hi > lo) {
            m_first = (int)(lo / bm);
            nm = (int)((hi - 1) / bm) - m_first + 1;
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int c = n0w + g + i * 8;
        int64_t lo = 0, hi = 0;
        if (c < Lk)
            q_range(&p, c, c + 1, Lq, Lk, &lo, &hi);
        qlo[i] = (int)lo;
        qhi[i] = (int)hi;
    }
}

/* dk = dK * scale, dv = dV for a warp's 16 key rows from n0w (mma C layout); rows past the
 * sequence's length come out 0 (P was 0 there). */
template <int NK, int NV>
DEV void store_dkdv(const attn_params &p, const seq_t &sk, int64_t hk, const float (&dk)[1][NK][4],
                    const float (&dv)[1][NV][4], int n0w, bool do_dk, bool do_dv)
{
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int c = n0w + g + i * 8;
        if (c >= sk.rows)
            continue;
        if (do_dk) {
            const float scale = dk_mul(p);
            grad_t *row = (grad_t *)p.dk.ptr + sk.mem_b * p.dk.s[0] + (sk.start + c) * p.dk.s[1] + hk * p.dk.s[2];
#pragma unroll
            for (int nt = 0; nt < NK; nt++) {
                const int d = nt * 8 + 2 * t;
                if (d < HEAD_DIM)
                    row[d * p.dk.s[3]] = f32_to_grad(dk[0][nt][i * 2] * scale);
                if (d + 1 < HEAD_DIM)
                    row[(d + 1) * p.dk.s[3]] = f32_to_grad(dk[0][nt][i * 2 + 1] * scale);
            }
        }
        if (do_dv) {
            grad_t *row = (grad_t *)p.dv.ptr + sk.mem_b * p.dv.s[0] + (sk.start + c) * p.dv.s[1] + hk * p.dv.s[2];
#pragma unroll
            for (int nt = 0; nt < NV; nt++) {
                const int d = nt * 8 + 2 * t;
                if (d < HEAD_DIM_V)
                    row[d * p.dv.s[3]] = f32_to_grad(dv[0][nt][i * 2] * dv_mul(p));
                if (d + 1 < HEAD_DIM_V)
                    row[(d + 1) * p.dv.s[3]] = f32_to_grad(dv[0][nt][i * 2 + 1] * dv_mul(p));
            }
        }
    }
}

/* dS^T = P^T score_grad (dP^T - delta), in place of s, from dp (dP^T = V dO^T); db: the tile's
 * delta rows (the columns). With a score_mod, a pair whose P^T score_grad is 0 (one the row does
 * not keep) gives 0, not 0 * NaN from a value no row keeps, as the reference's chain through
 * score_mod does (its derivative is taken at kept pairs only: tests/contract/test_no_key_rows.py);
 * without one, 0 * NaN stays, as in the reference's and FlashAttention's dS
 * (tests/contract/test_errors.py: no NaN of the reference's goes missing). */
template <int NT>
DEV void dst_tile(float (&s)[1][NT][4], const float (&dp)[1][NT][4], const float *db)
{
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            s[0][nt][e] = HAS_SCORE_MOD && s[0][nt][e] == 0.f ? 0.f
                          : s[0][nt][e] * (dp[0][nt][e] - db[nt * 8 + 2 * t + (e & 1)]);
}

/* What a warp of the dq and dbias kernels knows about each of its 2 * Q_MT rows. */
struct row_info {
    int lo[2 * Q_MT], hi[2 * Q_MT];   /* kept key columns (kv_range); empty past the length */
    float lse2[2 * Q_MT], delta[2 * Q_MT];
};

/* LOST_OK: lost rows' lse2 NaN (lse_log2), for ds_tile<..., LOST_OK>. */
template <bool LOST_OK = false>
DEV void load_row_info(const attn_params &p, const seq_t &sq, const seq_t &sk, int64_t h, int m0, row_info &ri)
{
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    const int Lq = (int)sq.len, Lk = (int)sk.len;
#pragma unroll
    for (int i = 0; i < 2 * Q_MT; i++) {
        const int r = m0 + warp * Q_WARP_M + (i / 2) * 16 + g + (i % 2) * 8;
        int64_t lo = 0, hi = 0;
        ri.lse2[i] = POS_INF;
        ri.delta[i] = 0.f;
        if (r < Lq) {
            kv_range(&p, r, r + 1, Lq, Lk, &lo, &hi);
            const int64_t row = sq.start + r;
            ri.lse2[i] = lse_log2<LOST_OK>(bwd_lse(p, h, ((const float *)p.lse.ptr)[sq.mem_b * p.lse.s[0] + h * p.lse.s[1]
                                                                                    + row * p.lse.s[2]]));
            ri.delta[i] = ((const float *)p.delta.ptr)[sq.mem_b * p.delta.s[0] + h * p.delta.s[1] + row * p.delta.s[2]];
        }
        ri.lo[i] = (int)lo;
        ri.hi[i] = (int)hi;
    }
}

/* Whether the tile of keys [n0, n0 + bn) x query rows [m0, m0 + bm) needs per-element tests
 * (pt_tile's in a dK/dV item, ds_tile's in a dQ tile): a mask may cut it, or it runs past the
 * sequence's keys or rows, or out of the causal / window band. */
DEV bool item_needs_mask(const attn_params &p, const score_ctx &sc, int n0, int bn, int m0, int bm, int Lq, int Lk)
{
    return tile_maybe_masked(sc, m0, min(m0 + bm, Lq), n0, min(n0 + bn, Lk)) || n0 + bn > Lk || m0 + bm > Lq
           || !tile_inside_band(&p, m0, min(m0 + bm, Lq), n0, n0 + bn, Lq, Lk);
}

/* Whether the dQ / dbias tile of rows m0.. x the key tile at c0 needs ds_tile's per-element
 * tests (a kernel asks while the tile's products run). */
DEV bool ds_needs_mask(const attn_params &p, const score_ctx &sc, int m0, int c0, int Lq, int Lk)
{
    return item_needs_mask(p, sc, c0, Q_BLOCK_N, m0, Q_BLOCK_M, Lq, Lk);
}

/* A dK/dV item's lse (log2 units; rows past Lq +inf, so that P is 0 there) and delta rows for
 * query rows [m0, m0 + bm) of head h into sL and sD, by the CTA's first bm threads. */
DEV void load_lse_delta(const attn_params &p, const seq_t &sq, int64_t h, int m0, int bm, int Lq, float *sL, float *sD)
{
    const int tid = threadIdx.x;
    if (tid < bm) {
        float l = POS_INF, d = 0.f;
        if (m0 + tid < Lq) {
            const int64_t row = sq.start + m0 + tid;
            l = lse_log2(bwd_lse(p, h, ((const float *)p.lse.ptr)[sq.mem_b * p.lse.s[0] + h * p.lse.s[1]
                                                                 + row * p.lse.s[2]]));
            d = ((const float *)p.delta.ptr)[sq.mem_b * p.delta.s[0] + h * p.delta.s[1] + row * p.delta.s[2]];
        }
        sL[tid] = l;
        sD[tid] = d;
    }
}

/* dq = dQ * scale from the CTA's wgmma C fragments (its warp w: rows m0 + 16 w + g (+ 8)) of head
 * h; rows past the sequence's rows are not written, padding rows come out 0 (dQ is 0 there).
 * attn_bwd_sm90.cu's and attn_bwd_sm90_x3.cu's dQ kernels. */
template <int NT>
DEV void store_dq(const attn_params &p, const seq_t &sq, int64_t h, int m0, const float (&dq)[NT][4], float scale)
{
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    grad_t *gdq = (grad_t *)p.dq.ptr + sq.mem_b * p.dq.s[0] + sq.start * p.dq.s[1] + h * p.dq.s[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = m0 + warp * 16 + g + i * 8;
        if (r >= sq.rows)
            continue;
        grad_t *row = gdq + (int64_t)r * p.dq.s[1];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int d = nt * 8 + 2 * t;
            row[d * p.dq.s[3]] = f32_to_grad(dq[nt][2 * i] * scale);
            row[(d + 1) * p.dq.s[3]] = f32_to_grad(dq[nt][2 * i + 1] * scale);
        }
    }
}

/* The dQ kernels' scatter of the score_mod's array gradients through shared memory (attn_mods.cuh:
 * mod_tile): MOD_TILE_SLOTS slots of MOD_CHUNKS words for the tile terms of MOD_TILE_ADMIT
 * (kernels.tile_sums; 0: every adjoint straight to the accumulator) after the kernel's tiles
 * (kernels.py counts them in its shared memory). A kernel's loop over key tiles is a function
 * template of TO_SUMS, run with the sums where every key tile of the CTA can take them
 * (key_tiles_to_sums), else as without; MOD_TILE_ALWAYS (the call's bounds prove that every tile
 * can) compiles the first only. (Not a generic lambda: NVRTC 13.0 takes one for a host function
 * and refuses it.) A choice per tile inside the loop cost the kernels (at ~255
 * registers) spills in the inner loop, whether a branch per pair, a second inlined copy of the
 * pass or an out-of-line call; two copies of the whole loop did not. Per key tile of the sums'
 * loop: tile_sums_for before ds_tile, tile_sums_flush after it, with all the CTA's threads; the
 * barrier at the top of the next key tile keeps its additions behind the flush. */
#ifndef MOD_TILE_SLOTS
#define MOD_TILE_SLOTS 0
#endif
#ifndef MOD_TILE_ALWAYS
#define MOD_TILE_ALWAYS 0
#endif
#define TILE_SUMS (HAS_DTENSORS && MOD_TILE_SLOTS > 0)

#if TILE_SUMS
#if Q_BLOCK_M * Q_BLOCK_N > (1 << 19)
#error "mod_tile: a 32-bit word sums at most 2^19 chunks of 12 bits"
#endif
typedef mod_tile tile_sums;

/* The sums at acc zeroed (the kernel's next barrier publishes it). */
DEV void tile_sums_init(tile_sums &t, uint32_t *acc)
{
    t.acc = acc;
    t.slots = MOD_TILE_SLOTS;
    for (int i = threadIdx.x; i < MOD_CHUNKS * MOD_TILE_SLOTS; i += Q_THREADS)
        acc[i] = 0;
}

/* Whether the key tile at c0 of the CTA's rows from m0 takes the sums (planned into t). */
DEV bool tile_sums_plan(tile_sums &t, const score_ctx &sc, int m0, int c0, int Lq, int Lk)
{
    return mod_tile_plan(sc.b, sc.h, m0, c0, min(Q_BLOCK_M, Lq - m0), min(Q_BLOCK_N, Lk - c0), sc.mods, &t) != 0;
}
#else
struct tile_sums {};
DEV void tile_sums_init(tile_sums &, uint32_t *) {}
#endif

/* Whether every key tile n_first..n_last of the CTA's rows from m0 takes the sums (each planned
 * into t). A kernel runs its key-tile loop as
 *     if (key_tiles_to_sums(...)) loop<TILE_SUMS>(...); else loop<TILE_SUMS && MOD_TILE_ALWAYS>(...);
 * which compiles the direct copy only without the sums, the sums' copy only under MOD_TILE_ALWAYS
 * (true here), and both otherwise. */
DEV bool key_tiles_to_sums(tile_sums &t, const score_ctx &sc, int m0, int n_first, int n_last, int Lq, int Lk)
{
#if TILE_SUMS && MOD_TILE_ALWAYS
    return true;
#elif TILE_SUMS
    bool all = n_first <= n_last;
    for (int n = n_first; n <= n_last && all; n++)
        all = tile_sums_plan(t, sc, m0, n * Q_BLOCK_N, Lq, Lk);
    return all;
#else
    return false;
#endif
}

/* The sums for the key tile at c0 (planned), or NULL without them. */
template <bool TO_SUMS>
DEV const tile_sums *tile_sums_for(tile_sums &t, const score_ctx &sc, int m0, int c0, int Lq, int Lk)
{
#if TILE_SUMS
    if (TO_SUMS) {
        /* true: key_tiles_to_sums said so, or the bounds proved it (MOD_TILE_ALWAYS; never false, but
         * a wrong proof must fail the call, as DQ_STORE_FIRST's turns do, not scatter wrongly) */
        if (!tile_sums_plan(t, sc, m0, c0, Lq, Lk) && MOD_TILE_ALWAYS)
            __trap();
        return &t;
    }
#endif
    return nullptr;
}

/* The key tile's sums into the accumulator (attn_mods.cuh: mod_tile_flush), after a barrier. */
template <bool TO_SUMS>
DEV void tile_sums_flush(const tile_sums &t)
{
#if TILE_SUMS
    if (TO_SUMS) {
        __syncthreads();                 /* every warp's additions are in */
        mod_tile_flush(&t, threadIdx.x, Q_THREADS);
    }
#endif
}

/* ds_tile's pass over the tile's elements (keep: its kept pairs, with a mask_mod); LOST: some row
 * of the tile is lost (lse2 NaN: lost_p). */
template <bool WITH_GRAD, bool LOST>
DEV void ds_pass(float (&s)[Q_MT][Q_NT][4], const float (&dp)[Q_MT][Q_NT][4], const attn_params &p,
                 const score_ctx &sc, const row_info &ri, int m0, int c0, bool need_mask,
                 const tile_keep<Q_MT, Q_NT> &keep, mod_fault &fault, const mod_tile *tile)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float scale_log2 = sc.scale * LOG2E;
    const float2 *mz = LOST ? lost_rows(p, sc) : nullptr;
#pragma unroll
    for (int mt = 0; mt < Q_MT; mt++)
#pragma unroll
        for (int nt = 0; nt < Q_NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = mt * 2 + e / 2;
                const int r = m0 + warp * Q_WARP_M + mt * 16 + g + (e / 2) * 8;
                const int c = c0 + nt * 8 + 2 * t + (e & 1);
                const float raw = s[mt][nt][e];
                int bad = 0;
                float ds = 0.f;
#if SCORE_ANYWHERE
                const bool k = keep.at(mt, nt, e), live = k && ri.lse2[i] != POS_INF;
                const float sx = kept_score(sc, k, raw, r, c, bad);
                float pv = fast_exp2(sx * LOG2E - ri.lse2[i]);
                if (LOST)
                    pv = lost_p(p, sc, mz, r, sx, ri.lse2[i], pv);
                ds = live ? pv * (dp[mt][nt][e] - ri.delta[i]) : 0.f;
                if (WITH_GRAD) {
                    score_dtensors(sc, raw, r, c, ds, tile);
                    const float gk = score_grad(sc, raw, r, c);
                    ds = live ? ds * gk : 0.f;
                } else if (HAS_SCORE_MOD) {
                    const float gk = score_mod_grad(sc, raw, r, c);
                    ds = live ? ds * gk : 0.f;
                }
#elif PAIR_SELECT
                const bool live = (!need_mask | ((c >= ri.lo[i]) & (c < ri.hi[i]))) & (ri.lse2[i] != POS_INF);
                float pv = fast_exp2(live ? raw * scale_log2 - ri.lse2[i] : NEG_INF);
                if (LOST && live)
                    pv = lost_p(p, sc, mz, r, raw, ri.lse2[i], pv);
                ds = live ? pv * (dp[mt][nt][e] - ri.delta[i]) : 0.f;
#else
#if ATTN_GMODS
                const bool k = keep.at(mt, nt, e);
#else
                const bool k = !need_mask || (c >= ri.lo[i] && c < ri.hi[i] && mask_keeps(sc, r, c, bad));
#endif
                if (k && ri.lse2[i] != POS_INF) {
#if SCORE_IS_PLAIN
                    float pv = fast_exp2(raw * scale_log2 - ri.lse2[i]);
                    if (LOST)
                        pv = lost_p(p, sc, mz, r, raw, ri.lse2[i], pv);
#else
                    const float sx = score_of(sc, raw, r, c, bad);
                    float pv = fast_exp2(sx * LOG2E - ri.lse2[i]);
                    if (LOST)
                        pv = lost_p(p, sc, mz, r, sx, ri.lse2[i], pv);
#endif
                    ds = pv * (dp[mt][nt][e] - ri.delta[i]);
                    if (WITH_GRAD) {
                        score_dtensors(sc, raw, r, c, ds, tile);
                        ds *= score_grad(sc, raw, r, c);
                    } else if (HAS_SCORE_MOD) {
                        ds *= score_mod_grad(sc, raw, r, c);
                    }
                }
#endif
                note_fault(fault, bad, r, c, raw);
                s[mt][nt][e] = ds;
            }
}

/* dS for this warp's rows x the key tile at c0, in place of s (S = Q K^T, raw dots) from dp
 * (dO V^T): the gradient of the score before score_mod (dbias) or WITH_GRAD times score_grad
 * (dq; its kernels also scatter the score_mod's array gradients, each pair once: through sums
 * where TO_SUMS, else straight to the accumulator). Pairs outside the kept set, and the rows
 * that keep no key (lse2 +inf), give exactly 0: not 0 * NaN from such a row's dO or from a value
 * it does not keep. LOST_OK (attn_bwd_dbias; ri from load_row_info<true>): lost rows take
 * lost_p, through a second pass that only a warp holding such a row runs; elsewhere they are
 * rows that keep no key (lse_log2). */
template <bool WITH_GRAD, bool TO_SUMS = false, bool LOST_OK = false>
DEV void ds_tile(float (&s)[Q_MT][Q_NT][4], const float (&dp)[Q_MT][Q_NT][4], const attn_params &p,
                 const score_ctx &sc, const row_info &ri, int m0, int c0, bool need_mask, int Lq, int Lk,
                 const tile_sums *sums = nullptr)
{
    const mod_tile *tile = nullptr;
#if TILE_SUMS
    tile = TO_SUMS ? sums : nullptr;
#endif
    mod_fault fault = no_fault();
    tile_keep<Q_MT, Q_NT> keep;             /* as pt_tile's (with a mask_mod) */
#if ATTN_GMODS
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    keep_pass(sc, need_mask, s, keep, fault, [&](int mt, int nt, int e, int &r, int &c, bool &band) {
        r = m0 + warp * Q_WARP_M + mt * 16 + g + (e / 2) * 8;
        c = c0 + nt * 8 + 2 * t + (e & 1);
        band = c >= ri.lo[mt * 2 + e / 2] && c < ri.hi[mt * 2 + e / 2];
    });
#endif
    bool lost = false;
    if (LOST_OK)
#pragma unroll
        for (int i = 0; i < 2 * Q_MT; i++)
            lost |= isnan(ri.lse2[i]);
    if (LOST_OK && __any_sync(0xffffffffu, lost))
        ds_pass<WITH_GRAD, LOST_OK>(s, dp, p, sc, ri, m0, c0, need_mask, keep, fault, tile);
    else
        ds_pass<WITH_GRAD, false>(s, dp, p, sc, ri, m0, c0, need_mask, keep, fault, tile);
    report_fault(sc, fault);
}

#endif
