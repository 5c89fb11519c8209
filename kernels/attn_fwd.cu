/* Attention forward: FlashAttention-2's tiled online softmax on mma.sync tensor cores.
 *
 *   q (B, Sq, Hq, D)  k (B, Sk, Hk, D)  v (B, Sk, Hk, Dv)  ->  out (B, Sq, Hq, Dv), lse (B, Hq, Sq)
 *   varlen: B = 1 in memory, sequence b at rows cu_seqlens[b].. (seqlen.h)
 *
 * Grid (query tiles, Hq, B [+1 under varlen: the block row b = B zeroes the packed rows after the
 * last sequence]). Block: NUM_WARPS warps; warp w owns query rows [w * WARP_M, (w + 1) * WARP_M)
 * of the tile, so the softmax's row statistics never leave a warp (a quad of 4 lanes per row).
 * Key tiles are visited last to first (the tiles that need the causal mask come first) and only
 * inside [kv_range): tiles outside the causal / window band are skipped, not masked. K of the
 * next tile loads while P V runs, V while Q K^T runs (cp.async, one buffer each).
 *
 * Decode (few query rows, long K/V) has two more switches:
 *   PACK_GQA  the G = Hq / Hk query heads that share a kv head are one block's rows: packed row
 *             pr is query row pr / G of head hk * G + pr % G (grid.y = Hk), so K and V are read
 *             once per kv head instead of G times. Not with bias, mask or alibi (per-head data).
 *   SPLIT_KV  grid.x = query tiles x p.num_splits; split s visits its share of the key tiles and
 *             writes a normalised partial result, its maximum and sum to o_accum / lse_accum;
 *             attn_fwd_combine merges the splits (whole GPU streaming K and V for Sq = 1).
 *   TMA_KV    (Hopper, below) a producer warp brings K and V by bulk tensor copies into a ring
 *             of STAGES stages; the kernel's second parameter holds the copies' tensor maps.
 *
 * Switches beyond attn_common.cuh's: BLOCK_M, BLOCK_N, NUM_WARPS (tile_config in select.py),
 * TMA_KV and STAGES (select.decode_tma_tile).
 */
#include "attn_fwd_tile.cuh"

#ifndef TMA_KV
#define TMA_KV 0
#endif

#define THREADS (NUM_WARPS * 32)          /* the warps that compute */
#define WARP_M (BLOCK_M / NUM_WARPS)      /* query rows per warp */
#define MT (WARP_M / 16)                  /* m16 tiles per warp */
#define NT (BLOCK_N / 8)                  /* n8 tiles of S per warp */
#define OT (DVP / 8)                      /* n8 tiles of O per warp */

#if TMA_KV
/* TMA_KV (Hopper decode): one more warp, the producer, brings key tiles into a ring of STAGES
 * stages of shared memory by bulk tensor copies (TMA: a box of 64 columns x BLOCK_N rows a copy,
 * or of a page's rows for PAGED, a page looked up a copy), while the NUM_WARPS warps compute:
 * many bytes in flight, and no copy instruction on the computing warps (the cp.async loop's
 * instructions were what bound the decode kernel at 8 warps an SM). A stage holds K then V,
 * each as D / 64 halves of BLOCK_N rows of 128 bytes, 128-byte swizzled (16-byte chunk j of row
 * r at chunk j ^ (r & 7)): ldmatrix then meets no bank conflict. Rows past Lk are zeroed by the
 * consumers once a stage lands (the copies read them from the tensor, or zeros past its end). */
#include "sm90_pipe.cuh"
#define THREADS_ALL (THREADS + 32)
#define KH (HEAD_DIM / 64 > 0 ? HEAD_DIM / 64 : 1)       /* 64-column halves of a K row */
#define VH (HEAD_DIM_V / 64 > 0 ? HEAD_DIM_V / 64 : 1)
#define KW (HEAD_DIM < 64 ? HEAD_DIM : 64)               /* columns of a half */
#define VW (HEAD_DIM_V < 64 ? HEAD_DIM_V : 64)
#define STAGE_ELEMS (BLOCK_N * (DP + DVP))             /* a stage: a K tile and a V tile */
static_assert(!ELEM_F32 && (HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128)
                  && DP == HEAD_DIM && DVP == HEAD_DIM_V,
              "TMA_KV takes 16-bit rows of 64 or 128 columns (select.decode_tma)");

/* The producer warp: key tiles n_last down to n_first into stage i % STAGES (tile i of the
 * visit), once the consumers have released the stage's previous tile (empty); lane 0 announces
 * the tile's bytes to full with the one arrival, and lane j issues the copies of the tile's
 * j-th box of rows (a page for PAGED), looked up before the wait (the lookups run side by side,
 * their latency hidden there); the copies' completions finish the phase. */
DEV void produce_keys(const attn_params &p, const attn_tmaps &maps, const seq_t &sk, int64_t b, int64_t hk,
                      elem_t *sK, int n_first, int n_last, uint32_t full0, uint32_t empty0, int lane)
{
    const int box = (int)p.tma_rows;                  /* rows a copy: BLOCK_N, or a page's */
    for (int n = n_last, i = 0; n >= n_first; n--, i++) {
        const int st = i % STAGES, r = lane * box;
        int64_t mb = 0, at = 0;                         /* looked up before the wait: its latency hides there */
        if (r < BLOCK_N)
            key_row(&p, &sk, b, (int64_t)n * BLOCK_N + r, &mb, &at);
        if (i >= STAGES)
            mbar_wait(empty0 + 8 * st, (i / STAGES - 1) & 1);
        const uint32_t dk = smem_addr(sK + st * STAGE_ELEMS), dv = dk + 2 * BLOCK_N * DP;
        const uint32_t bar = full0 + 8 * st;
        if (lane == 0)
            mbar_arrive_expect_tx(bar, 2 * BLOCK_N * (DP + DVP));
        __syncwarp();
        if (r < BLOCK_N) {
            for (int hf = 0; hf < KH; hf++)
                tma_load_4d(dk + 2 * (hf * BLOCK_N * KW + r * KW), &maps.k, hf * 64, (int)hk, (int)at, (int)mb, bar);
            for (int hf = 0; hf < VH; hf++)
                tma_load_4d(dv + 2 * (hf * BLOCK_N * VW + r * VW), &maps.v, hf * 64, (int)hk, (int)at, (int)mb, bar);
        }
    }
}

/* The byte offset of 16-byte chunk j (of 8 columns) of row r in a swizzled half of w columns */
DEV uint32_t swz(int r, int j, int w) { return (uint32_t)(r * 2 * w + ((j ^ (r & 7)) << 4)); }
#else
#define THREADS_ALL THREADS
#endif

/* Merges the num_splits partial results of SPLIT_KV: split s left its rows' maximum m_s and sum
 * l_s in lse_accum (finish_rows; l_s after all splits' m_s), so lse = M + log sum_s exp(m_s - M)
 * l_s with M = max_s m_s, and out = sum_s w_s o_s, w_s = exp(m_s - M) l_s / that sum (with
 * sinks, exp(sink - M) joins that sum and M covers the sink). Not from
 * each split's lse: at 1e10 it rounds log(l_s) away, and splits of different sums would weigh
 * alike. Rows past the sequence's real length come out as 0 and -inf like every other row that
 * keeps no key.
 *
 * split_weights computes one row's weights with W lanes (lane j of W): w[s] for its splits s = j,
 * j + W, ..., and returns the row's lse. attn_fwd_combine (a block a row, grid (Sq, Hq, B)) and
 * the TMA_KV split kernel's own merge (combine_rows_warp, below) take their weights from it and
 * read the partials through L2 (ld.cg): for the own merge, other CTAs of the same launch wrote
 * them (L1 may hold none of theirs); attn_fwd_combine reads the grid's before, after its wait. */
#define COMBINE_THREADS 256
#define CVW (HEAD_DIM_V % 4 == 0 ? 4 : 1)              /* floats a load: float4 where rows allow */
#define CCOLS (HEAD_DIM_V / CVW)
#define COMBINE_GROUPS (CCOLS < COMBINE_THREADS ? COMBINE_THREADS / CCOLS : 1)   /* groups of splits */
#define MAX_SPLITS 128                                 /* backend.py's: one weight a split in w */
template <int W>
DEV float split_weights(const attn_params &p, bool on, int64_t row0, int64_t r, int64_t hr, int64_t b, int j,
                        float *w)
{
    constexpr int PER = MAX_SPLITS / W;                /* a lane's splits, at most */
    const int S = p.num_splits;
    const int64_t stride = p.B * p.Hq * p.Sq;
    const float *ms = p.lse_accum, *ls = p.lse_accum + S * stride;
    float m[PER], l[PER];                              /* every load issued at once: one round trip */
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int s = j + i * W;
        m[i] = on && s < S ? __ldcg(ms + s * stride + row0) : NEG_INF;
        l[i] = on && s < S ? __ldcg(ls + s * stride + row0) : 0.f;
    }
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < PER; i++)
        mx = fmaxf(mx, m[i]);
    for (int o = W / 2; o; o >>= 1)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    /* a real row's sink joins the sum as one more part of weight exp(sink) and no value */
    const float sink = on && p.sinks && r < seq_q(&p, b).len ? ((const float *)p.sinks)[hr] : NEG_INF;
    const float top = fmaxf(mx, sink), base = top == NEG_INF ? 0.f : top;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++)                      /* a split past S: exp2(-inf) 0 times 0 */
        sum += fast_exp2((m[i] - base) * LOG2E) * l[i];
    for (int o = W / 2; o; o >>= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (sink != NEG_INF)
        sum += expf(sink - base);
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (on && j + i * W < S)
            w[j + i * W] = sum != 0.f ? fast_exp2((m[i] - base) * LOG2E) * l[i] / sum : 0.f;
    return sum != 0.f ? base + logf(sum) : NEG_INF;    /* NaN stays NaN */
}

/* the merge for a one-warp CTA (the TMA_KV decode tile): rows [pr0, pr_end) of a packed tile
 * (packed row pr: query row pr / G of head h + pr % G), four at a time, eight lanes a row for its
 * weights (w: 4 x MAX_SPLITS floats in shared memory) and every lane on columns of all four
 * rows at once, so that many loads of the partials are in flight: one warp alone had merged a
 * row at a time at a few loads a lane. */
#if SPLIT_KV && TMA_KV
DEV void combine_rows_warp(const attn_params &p, int pr0, int pr_end, int G, int64_t h, int64_t b, int lane,
                           float *w)
{
    constexpr int CC = HEAD_DIM_V / CVW, ITEMS = (4 * CC + 31) / 32;   /* columns of CVW a row; a lane's (row, column) items */
    const int S = p.num_splits;
    const int64_t stride = p.B * p.Hq * p.Sq;
    for (int base = pr0; base < pr_end; base += 4) {
        {   /* weights: lanes 8i .. 8i + 7 for row base + i */
            const int pr = base + (lane >> 3), j = lane & 7;
            const bool on = pr < pr_end;
            const int64_t r = pr / G, hr = h + pr % G, row0 = (b * p.Hq + hr) * p.Sq + r;
            const float lse = split_weights<8>(p, on, row0, r, hr, b, j, w + (lane >> 3) * MAX_SPLITS);
            if (on && j == 0 && p.lse.ptr)
                ((float *)p.lse.ptr)[b * p.lse.s[0] + hr * p.lse.s[1] + r * p.lse.s[2]] = lse;
        }
        __syncwarp();
        /* values: item it = lane + 32 x of the four rows' CC columns each */
        float acc[ITEMS][CVW] = {};
        const float *src[ITEMS];
        int wrow[ITEMS];
#pragma unroll
        for (int x = 0; x < ITEMS; x++) {      /* items past the four rows' (4 CC) read row 0 of the pass */
            const int it = lane + 32 * x < 4 * CC ? lane + 32 * x : 0, i = it / CC, c = it % CC;
            const int pr = min(base + i, pr_end - 1);
            const int64_t row0 = (b * p.Hq + h + pr % G) * p.Sq + pr / G;
            src[x] = p.o_accum + row0 * HEAD_DIM_V + c * CVW;
            wrow[x] = i * MAX_SPLITS;
        }
#pragma unroll 4
        for (int s = 0; s < S; s++)
#pragma unroll
            for (int x = 0; x < ITEMS; x++) {
                const float *at = src[x] + s * stride * HEAD_DIM_V;
                const float ws = w[wrow[x] + s];
#if CVW == 4
                const float4 v4 = __ldcg((const float4 *)at);
                acc[x][0] += ws * v4.x;
                acc[x][1] += ws * v4.y;
                acc[x][2] += ws * v4.z;
                acc[x][3] += ws * v4.w;
#else
                acc[x][0] += ws * __ldcg(at);
#endif
            }
#pragma unroll
        for (int x = 0; x < ITEMS; x++) {
            const int it = lane + 32 * x, i = it / CC, c = it % CC, pr = base + i;
            if (it < 4 * CC && pr < pr_end) {
                const int64_t r = pr / G, hr = h + pr % G;
                elem_t *orow = (elem_t *)p.out.ptr + b * p.out.s[0] + r * p.out.s[1] + hr * p.out.s[2];
#pragma unroll
                for (int e = 0; e < CVW; e++)
                    orow[(c * CVW + e) * p.out.s[3]] = f32_to_elem(acc[x][e]);
            }
        }
        __syncwarp();                                    /* w free for the next four rows */
    }
}
#endif

#if ENTRY(attn_fwd)
#if TMA_KV
extern "C" __global__ void __launch_bounds__(THREADS_ALL)
    attn_fwd(const __grid_constant__ attn_params p, const __grid_constant__ attn_tmaps maps)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* STAGES x (K, V) swizzled, 1024-aligned (the swizzle's period), then Q padded */
    elem_t *sK = (elem_t *)(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
    elem_t *sQ = sK + STAGES * STAGE_ELEMS;
#else
extern "C" __global__ void __launch_bounds__(THREADS_ALL) attn_fwd(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t *sQ = (elem_t *)smem_raw;                    /* BLOCK_M x (DP + pad) */
    elem_t *sK = sQ + BLOCK_M * (DP + SMEM_PAD);        /* BLOCK_N x (DP + pad) */
    elem_t *sV = sK + BLOCK_N * (DP + SMEM_PAD);        /* BLOCK_N x (DVP + pad) */
#endif

#if SPLIT_KV
    allow_dependents();                                /* attn_fwd_combine waits for the whole grid */
#endif
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t b = blockIdx.z;
#if PACK_GQA
    const int G = (int)(p.Hq / p.Hk);                  /* packed rows per query row */
    const int64_t hk = blockIdx.y, h = hk * G;         /* h: the group's first query head */
#else
    const int G = 1;
    const int64_t h = blockIdx.y, hk = h / (p.Hq / p.Hk);
#endif
    if (b == p.B) {
        zero_tail<BLOCK_M, THREADS_ALL>(p, h);
        return;
    }
#if SPLIT_KV
    const int split = blockIdx.x % p.num_splits, m_block = blockIdx.x / p.num_splits;
    const int m_blocks = gridDim.x / p.num_splits;
#else
    const int split = 0, m_block = blockIdx.x, m_blocks = gridDim.x;
#endif
    const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
    const int m0 = (m_blocks - 1 - m_block) * BLOCK_M; /* packed rows [m0, m0 + BLOCK_M) */
    if (m0 >= sq.rows * G)
        return;
    const int Lq = (int)sq.len, Lk = (int)sk.len;
    const int r_end = min(m0 + BLOCK_M, Lq * G);       /* packed rows with a real query */

    const score_ctx sc = make_score_ctx(p, b, h, sq, sk);

    /* key columns this tile visits (its query rows [m0 / G, (r_end - 1) / G]; mask_mod's empty
     * tiles at the ends dropped), this split's share */
    int64_t lo = 0, hi = 0;
    if (m0 < Lq * G)
        kv_range(&p, m0 / G, (r_end - 1) / G + 1, Lq, Lk, &lo, &hi);
    int n_first = (int)(lo / BLOCK_N), n_last = hi > lo ? (int)((hi - 1) / BLOCK_N) : -1;
    mod_narrow(sc, 1, true, m0 / G, (r_end - 1) / G + 1, BLOCK_N, Lk, n_first, n_last);
#if SPLIT_KV
    {
        const int per = (n_last - n_first + p.num_splits) / p.num_splits;
        n_first += split * per;
        n_last = min(n_last, n_first + per - 1);
    }
#endif
    const elem_t *gq = (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + sq.start * p.q.s[1] + h * p.q.s[2];
#if !PAGED && !TMA_KV
    const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
    const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + sk.start * p.v.s[1] + hk * p.v.s[2];
#endif
    /* key tile [c0, c0 + BLOCK_N) of k (K) or v into shared memory: evenly strided rows, or under
     * PAGED each row where the page table puts it. A paged tile's rows are looked up a tile
     * ahead (fetch_pages before Q K^T, store_pages after the softmax, the barrier before K's load
     * between) into sRow[tile & 1]: each row's element offset in k and in v, so a copy adds an
     * offset and none waits on the table (ncu, H200 decode: a lookup at every copy had cost 60%
     * more instructions in a kernel bound by their latency). The last threads look up, PAGE_ROWS
     * rows each: in a decode tile the last warps hold padding rows and would wait otherwise. */
#if PAGED && !TMA_KV
#define PAGE_ROWS ((BLOCK_N + THREADS - 1) / THREADS)
    __shared__ int64_t sRow[2][2][BLOCK_N];              /* [tile & 1][k, v][row] */
    int64_t next_row[PAGE_ROWS][2];
    const int pt = THREADS - 1 - tid;                    /* rows pt, pt + THREADS, .. */
    const auto fetch_pages = [&](int64_t c0) {
#pragma unroll
        for (int i = 0; i < PAGE_ROWS; i++) {
            const int r = pt + i * THREADS;
            next_row[i][0] = next_row[i][1] = 0;       /* rows past Lk: never loaded */
            if (r < BLOCK_N && c0 + r < Lk) {
                int64_t mb, at;
                key_row(&p, &sk, b, c0 + r, &mb, &at);
                next_row[i][0] = mb * p.k.s[0] + at * p.k.s[1];
                next_row[i][1] = mb * p.v.s[0] + at * p.v.s[1];
            }
        }
    };
    const auto store_pages = [&](int64_t c0) {
#pragma unroll
        for (int i = 0; i < PAGE_ROWS; i++) {
            const int r = pt + i * THREADS;
            if (r < BLOCK_N) {
                sRow[(c0 / BLOCK_N) & 1][0][r] = next_row[i][0];
                sRow[(c0 / BLOCK_N) & 1][1][r] = next_row[i][1];
            }
        }
    };
#endif
#if !TMA_KV
    auto load_keys = [&](elem_t *dst, bool K, int64_t c0) {
        const tensor4 &t = K ? p.k : p.v;
#if PAGED
        const int64_t *rows = sRow[(c0 / BLOCK_N) & 1][K ? 0 : 1];
        const elem_t *base = (const elem_t *)t.ptr + hk * t.s[2];
        const auto row = [&](int r) { return base + rows[r]; };
        if (K)
            load_rows<BLOCK_N, DP, THREADS>(dst, row, t.s[3], Lk - (int)c0, HEAD_DIM, tid);
        else
            load_rows<BLOCK_N, DVP, THREADS>(dst, row, t.s[3], Lk - (int)c0, HEAD_DIM_V, tid);
#else
        if (K)
            load_tile<BLOCK_N, DP, THREADS>(dst, gk + c0 * t.s[1], t.s[1], t.s[3], Lk - (int)c0, HEAD_DIM, tid);
        else
            load_tile<BLOCK_N, DVP, THREADS>(dst, gv + c0 * t.s[1], t.s[1], t.s[3], Lk - (int)c0, HEAD_DIM_V, tid);
#endif
    };
#endif

    /* each lane's ldmatrix row addresses (shared-state space, bytes); the per-tile offsets
     * below are compile-time constants that fold into the instructions' immediates */
#if !ELEM_F32
    const uint32_t q_lane = smem_addr(sQ) + 2 * ((warp * WARP_M + (lane & 15)) * (DP + SMEM_PAD) + (lane >> 4) * 8);
#if TMA_KV
    /* a lane's row in a 16-row group and its chunk bit; rows step by 8, so r & 7 is lane & 7 */
    const uint32_t k_base = smem_addr(sK), v_base = k_base + 2 * BLOCK_N * DP;
    const int k_row = (lane & 7) + ((lane >> 4) << 3), k_bit = (lane >> 3) & 1;
    const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_bit = lane >> 4;
#else
    const uint32_t k_lane = smem_addr(sK) + 2 * (((lane & 7) + ((lane >> 4) << 3)) * (DP + SMEM_PAD) + ((lane >> 3) & 1) * 8);
    const uint32_t v_lane = smem_addr(sV) + 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * (DVP + SMEM_PAD) + (lane >> 4) * 8);
#endif
#endif

    /* S = Q K^T for this warp's rows, K at kt (at: its offset from sK in elements) */
    const auto qk = [&](float (&s)[MT][NT][4], int at) {
        zero_acc(s);
#if ELEM_F32
        mma_abt_f32<MT, NT, DP>(s, sQ + warp * WARP_M * (DP + SMEM_PAD), sK + at, lane);
#else
#pragma unroll
        for (int kk = 0; kk < DP / 16; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                ldmatrix_x4(q_lane + 2 * (mt * 16 * (DP + SMEM_PAD) + kk * 16), a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t b0, b1, b2, b3;
#if TMA_KV
                ldmatrix_x4(k_base + 2 * at + 2 * ((kk / 4) * BLOCK_N * 64)
                                + swz(np * 16 + k_row, (kk % 4) * 2 + k_bit, 64), b0, b1, b2, b3);
#else
                ldmatrix_x4(k_lane + 2 * (at + np * 16 * (DP + SMEM_PAD) + kk * 16), b0, b1, b2, b3);
#endif
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma16816(s[mt][2 * np], a[mt], b0, b1);
                    mma16816(s[mt][2 * np + 1], a[mt], b2, b3);
                }
            }
        }
#endif
    };
    /* O += P V, V at its offset `at` from sV: the C fragments of S are the A fragments of P, two
     * n8 tiles per k16 step */
    const auto pv = [&](float (&o)[MT][OT][4], const float (&s)[MT][NT][4], int at) {
#if ELEM_F32
        mma_cb_f32<MT, NT, OT, DVP + SMEM_PAD>(o, s, sV + at, lane);
#else
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                p_fragment(s, mt, kk, a[mt]);
#pragma unroll
            for (int np = 0; np < OT / 2; np++) {
                uint32_t b0, b1, b2, b3;
#if TMA_KV
                ldmatrix_x4_trans(v_base + 2 * at + 2 * ((np / 4) * BLOCK_N * 64)
                                      + swz(kk * 16 + v_row, (np % 4) * 2 + v_bit, 64), b0, b1, b2, b3);
#else
                ldmatrix_x4_trans(v_lane + 2 * (at + kk * 16 * (DVP + SMEM_PAD) + np * 16), b0, b1, b2, b3);
#endif
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma16816(o[mt][2 * np], a[mt], b0, b1);
                    mma16816(o[mt][2 * np + 1], a[mt], b2, b3);
                }
            }
        }
#endif
    };

    float o[MT][OT][4];
    float m[2 * MT], l[2 * MT];
    zero_acc(o);
#pragma unroll
    for (int i = 0; i < 2 * MT; i++) {
        m[i] = NEG_INF;
        l[i] = 0.f;
    }
    /* a warp whose rows all lie past the real ones (r_end: a packed decode block's padding) only
     * loads; write_out gives its rows 0 and -inf, as for any row that keeps no key */
    const bool warp_rows = m0 + warp * WARP_M < r_end;
    const auto load_q = [&]() {
        load_rows<BLOCK_M, DP, THREADS>(
            sQ, [&](int r) { return gq + (int64_t)((m0 + r) / G) * p.q.s[1] + (int64_t)((m0 + r) % G) * p.q.s[2]; },
            p.q.s[3], r_end - m0, HEAD_DIM, tid);
    };

#if TMA_KV
    /* the ring: stage i % STAGES holds key tile i (K, then V); full[st] completes when its bytes
     * have landed (one arrival: the producer's arrive.expect_tx, before its copies), empty[st]
     * when every consumer warp has read it */
    __shared__ __align__(8) uint64_t bars[2 * STAGES];
    const uint32_t full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES;
    if (tid == 0) {
        for (int st = 0; st < STAGES; st++) {
            mbar_init(full0 + 8 * st, 1);
            mbar_init(empty0 + 8 * st, NUM_WARPS);
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (warp == NUM_WARPS) {                             /* the producer */
        produce_keys(p, maps, sk, b, hk, sK, n_first, n_last, full0, empty0, lane);
        return;
    }
    if (n_last >= n_first) {
        load_q();
        cp_async_commit();
        cp_async_wait_all();
        named_sync(1, THREADS);                          /* Q in shared memory */
    }
    for (int n = n_last, i = 0; n >= n_first; n--, i++) {
        const int st = i % STAGES;
        mbar_wait(full0 + 8 * st, (i / STAGES) & 1);
        const int tail = Lk - n * BLOCK_N;               /* < BLOCK_N: rows past Lk to zero */
        if (tail < BLOCK_N) {
            uint4 *kv = (uint4 *)(sK + st * STAGE_ELEMS);   /* rows of 128 bytes: 8 uint4 */
            for (int x = tid; x < (KH + VH) * BLOCK_N * 8; x += THREADS)
                if ((x / 8) % BLOCK_N >= tail)
                    kv[x] = make_uint4(0, 0, 0, 0);
            named_sync(1, THREADS);
        }
        if (warp_rows) {
            float s[MT][NT][4];
            qk(s, st * STAGE_ELEMS);
            const int c0 = n * BLOCK_N;
            const bool need_mask = tile_needs_mask(p, sc, m0, BLOCK_M, r_end, c0, BLOCK_N, G, Lq, Lk);
            softmax_step(p, sc, s, o, m, l, m0 + warp * WARP_M, c0, need_mask, G, Lq, Lk);
            pv(o, s, st * STAGE_ELEMS);
        }
        if (tail < BLOCK_N)
            fence_proxy_async_shared();                  /* the zeros before the stage's next copies */
        __syncwarp();
        if (lane == 0)
            mbar_arrive(empty0 + 8 * st);
    }
#else
    if (n_last >= n_first) {
        load_q();
#if PAGED
        fetch_pages((int64_t)n_last * BLOCK_N);
        store_pages((int64_t)n_last * BLOCK_N);
        __syncthreads();
#endif
        load_keys(sK, true, (int64_t)n_last * BLOCK_N);
        cp_async_commit();
    }
    for (int n = n_last; n >= n_first; n--) {
        const int c0 = n * BLOCK_N;
        cp_async_wait_all();
        __syncthreads();                                 /* K[n] (and Q) in shared memory */
        load_keys(sV, false, c0);
        cp_async_commit();
#if PAGED
        if (n > n_first)
            fetch_pages(c0 - BLOCK_N);
#endif
        float s[MT][NT][4];
        if (warp_rows) {
            qk(s, 0);
            const bool need_mask = tile_needs_mask(p, sc, m0, BLOCK_M, r_end, c0, BLOCK_N, G, Lq, Lk);
            softmax_step(p, sc, s, o, m, l, m0 + warp * WARP_M, c0, need_mask, G, Lq, Lk);
        }
#if PAGED
        if (n > n_first)
            store_pages(c0 - BLOCK_N);
#endif
        cp_async_wait_all();
        __syncthreads();                                 /* V[n] in; every warp is done with K[n] */
        if (n > n_first)
            load_keys(sK, true, (int64_t)(c0 - BLOCK_N));
        cp_async_commit();
        if (warp_rows)
            pv(o, s, 0);
    }
    cp_async_wait_all();
#endif

    write_out(p, sq, sc.to_natural, o, m, l, m0 + warp * WARP_M, b, h, G, split, Lq);
#if SPLIT_KV && TMA_KV
    /* the split kernel's own merge, where the host lent counters (p.counters: an int32 a query
     * tile, zero before the launch; backend.py takes this for a few packed rows a tile): each
     * CTA counts itself in once its partials are written; the last of the tile's num_splits
     * merges the tile's rows (combine_rows_warp, the one computing warp) in the shared memory the
     * ring is done with, and sets the count back to 0 for the next launch. Else attn_fwd_combine
     * runs next. */
    if (p.counters) {
        __shared__ int last;
        __threadfence();                                 /* this CTA's partials, before its count */
        named_sync(1, THREADS);                          /* the computing warps: the producer is gone */
        const int64_t tq = ((int64_t)blockIdx.z * gridDim.y + blockIdx.y) * m_blocks + m_block;
        if (tid == 0) {
            last = atomicAdd(p.counters + tq, 1) == p.num_splits - 1;
            __threadfence();                             /* every count before the partials are read */
        }
        named_sync(1, THREADS);
        if (!last || warp != 0)                          /* warp 0 merges (the shipped tile's only one) */
            return;
        __threadfence();
        combine_rows_warp(p, m0, min(m0 + BLOCK_M, (int)sq.rows * G), G, h, b, lane, (float *)smem_raw);
        if (tid == 0)
            p.counters[tq] = 0;
    }
#endif
}
#endif

#if ENTRY(attn_fwd_combine)
/* a block a row: warp 0 takes the weights while COMBINE_GROUPS groups of threads load their first
 * COMBINE_AHEAD partials (every load of a row in flight at once for up to COMBINE_GROUPS x
 * COMBINE_AHEAD splits), each group then sums every COMBINE_GROUPS-th split over the CVW columns
 * of its thread (one column group a thread: CCOLS <= COMBINE_THREADS / COMBINE_GROUPS), and the
 * groups' sums meet */
#define COMBINE_AHEAD 4
#if CVW == 4
typedef float4 cvec;
DEV void cvec_fma(float (&acc)[4], float wt, const float4 &x)
{
    acc[0] += wt * x.x;
    acc[1] += wt * x.y;
    acc[2] += wt * x.z;
    acc[3] += wt * x.w;
}
#else
typedef float cvec;
DEV void cvec_fma(float (&acc)[1], float wt, float x) { acc[0] += wt * x; }
#endif
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) attn_fwd_combine(const __grid_constant__ attn_params p)
{
    __shared__ float w[MAX_SPLITS];
    __shared__ __align__(16) float part[COMBINE_GROUPS * HEAD_DIM_V];
    __shared__ float lse_sh;
    grid_dependency_wait();                            /* the split kernel's partials (a dependent launch) */
    const int64_t r = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, S = p.num_splits;
    const int64_t row0 = (b * p.Hq + h) * p.Sq + r, stride = p.B * p.Hq * p.Sq;
    const int per = COMBINE_THREADS / COMBINE_GROUPS, grp = tid / per, c = tid % per;
    const bool mine = grp < COMBINE_GROUPS && c < CCOLS;
    const cvec *src = (const cvec *)(p.o_accum + row0 * HEAD_DIM_V) + c;
    const int64_t step = stride * CCOLS;               /* cvecs from one split's partial to the next */
    cvec ahead[COMBINE_AHEAD];
#pragma unroll
    for (int i = 0; i < COMBINE_AHEAD; i++) {
        const int s = grp + i * COMBINE_GROUPS;
        ahead[i] = mine && s < S ? __ldcg(src + s * step) : cvec{};
    }
    if (tid < 32) {
        const float lse = split_weights<32>(p, true, row0, r, h, b, tid, w);
        if (tid == 0)
            lse_sh = lse;
    }
    __syncthreads();
    if (mine) {
        float acc[CVW] = {};
#pragma unroll
        for (int i = 0; i < COMBINE_AHEAD; i++) {
            const int s = grp + i * COMBINE_GROUPS;
            if (s < S)
                cvec_fma(acc, w[s], ahead[i]);
        }
#pragma unroll 4
        for (int s = grp + COMBINE_AHEAD * COMBINE_GROUPS; s < S; s += COMBINE_GROUPS)
            cvec_fma(acc, w[s], __ldcg(src + s * step));
#pragma unroll
        for (int j = 0; j < CVW; j++)
            part[grp * HEAD_DIM_V + c * CVW + j] = acc[j];
    }
    __syncthreads();
    elem_t *orow = (elem_t *)p.out.ptr + b * p.out.s[0] + r * p.out.s[1] + h * p.out.s[2];
    for (int d = tid; d < HEAD_DIM_V; d += COMBINE_THREADS) {
        float acc = 0.f;
#pragma unroll
        for (int g = 0; g < COMBINE_GROUPS; g++)
            acc += part[g * HEAD_DIM_V + d];
        orow[d * p.out.s[3]] = f32_to_elem(acc);
    }
    if (tid == 0 && p.lse.ptr)
        ((float *)p.lse.ptr)[b * p.lse.s[0] + h * p.lse.s[1] + r * p.lse.s[2]] = lse_sh;
}
#endif
