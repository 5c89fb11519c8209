/* Attention forward for Hopper (sm_90a): attn_fwd.cu's tiles and online softmax, with both
 * products on warpgroup tensor-core instructions (wgmma.mma_async) that read Q, K and V straight
 * from 128-byte swizzled shared memory (wgmma.cuh).
 *
 *   q (B, Sq, Hq, D)  k (B, Sk, Hk, D)  v (B, Sk, Hk, Dv)  ->  out (B, Sq, Hq, Dv), lse (B, Hq, Sq)
 *
 * Grid (query tiles, Hq, B [+1 under varlen]) as attn_fwd.cu. Block: BLOCK_M / 64 warpgroups;
 * warpgroup w owns query rows [64w, 64w + 64) of the tile. Per key tile (last to first, only
 * inside the causal / window band): S = Q K^T by m64nBLOCK_Nk16 steps from shared memory, the
 * softmax on S in registers (attn_fwd_tile.cuh, the same code as attn_fwd.cu), O += P V with P
 * from registers and V read transposed from shared memory. K and V are double-buffered: tile
 * n - 1 loads by cp.async while tile n computes.
 *
 * Applies to VEC_LOAD inputs with D and Dv multiples of 64 (kernels.fwd_kernel chooses); every
 * option of the score hook, masks, causal / window and varlen as attn_fwd.cu. Switches beyond
 * attn_common.cuh's: BLOCK_M (64 or 128; WS: 128, or 192 at D = 64), BLOCK_N (64, 128, or 176:
 * the WS kernel's plain D = 128 calls over long keys, FlashAttention-3's width), MIN_BLOCKS (CTAs per SM the
 * registers must allow), WS (the warp-specialised kernel below) and its STAGES (V's ring; K's
 * too unless K_STAGES says).
 *
 * WS (FlashAttention-3's layout): a producer warpgroup and NUM_WG = BLOCK_M / 64 computing ones
 * (two, or three for 192-row tiles at D = 64). The producer gives up its registers (setmaxnreg)
 * and one thread (lane 0 of its first warp) brings each key tile's K and V by bulk tensor copies
 * (TMA; the kernel's second parameter holds the maps) into rings of STAGES stages, K and V apart
 * (mbarriers: full when the bytes landed, empty when every consumer is done). The others each own
 * 64 rows of the tile and take turns on the tensor cores in a ring (ping-pong: named barriers
 * 4 .. 3 + NUM_WG), so that one's softmax runs while another's products do;
 * within a warpgroup the next tile's S is issued before this tile's P V as above. No CTA-wide
 * barrier after the start. D = Dv. Key rows past Lk that lie inside the tensor (varlen: the next
 * sequence's; seqused_k: unused rows) are copied like any other: their scores are masked, and the
 * producer warp zeroes their V rows in shared memory before the tile's P V may read them (P's 0
 * times a NaN there would be NaN); rows past the tensor come as zeros from the copy. O leaves
 * through each warpgroup's Q block, whatever out's strides (a tile whose rows keep no key writes
 * its zeros by write_out).
 *
 * PERSIST (the WS kernel, dense batches, no mask_mod; select.fwd_persist: short rows without
 * score options by default): a grid of at most one CTA an SM, each taking query tiles in turn
 * (the next one from an atomic count, posted by the producer), Q by the producer's tensor copies
 * into two buffers, the K / V rings running on across tiles, so a tile's start and end run under
 * its neighbours' (bench/NOTES.md, forward v16); O leaves by bulk tensor copies from its Q block
 * where the launch made out's map (p.tma_out: out's rows 16-byte aligned).
 *
 * CLUSTER = 2 (the WS kernel a CTA a tile, D = 128, every CTA pair of one (head, sequence) over the
 * same key tiles: select.fwd_cluster's calls, with an even number of query tiles): the CTAs of
 * blockIdx.x 2i and 2i + 1 form a cluster, and each one's producer brings one 64-column panel of
 * every K and V tile into both CTAs at once (multicast), so that L2 serves each key tile once a
 * pair (FlashAttention-3's ClusterShape). A stage is empty once both CTAs' computing warps have
 * released it (each warp arrives on the stage's barrier in both), and a producer stays until the
 * last such arrivals into its CTA are made. Neither CTA may return early (zero_tail, a tile past
 * the rows): the other would wait at cluster_sync.
 */
#include "attn_fwd_tile.cuh"
#include "wgmma.cuh"

#ifndef WS
#define WS 0
#endif
#define NUM_WG (BLOCK_M / 64)             /* warpgroups that compute */
#define THREADS (NUM_WG * 128)
#define NT (BLOCK_N / 8)                  /* n8 column groups of S per warp */
#define OT (HEAD_DIM_V / 8)               /* n8 column groups of O per warp */
#define Q_BYTES (BLOCK_M * HEAD_DIM * 2)
#define K_BYTES (BLOCK_N * HEAD_DIM * 2)
#define V_BYTES (BLOCK_N * HEAD_DIM_V * 2)
/* Whether the pipeline's prologue (the last key tile's S and P) is peeled out of the loop: only
 * for the plain kernel's 64-row tile. Peeled, the softmax exists twice: the 128 x 128 tile then
 * compiles in 0.68 s instead of 0.53 (NVRTC 13.5 on the dev machine; ~2.2x that on the H100
 * hosts, which a first call waits for) at the same speed (bench/labs/lab_fwd.py, H100: D128 S2k-16k
 * 1.14-1.30x flash either way), while the 64 x 64 tile loses 2-5% unpeeled (D64 S512 1.05x ->
 * 1.02x). Generated mods never peel: their code is inlined at every score. */
#define PEEL (!ATTN_GMODS && BLOCK_M < 128)

#if HEAD_DIM % 64 || HEAD_DIM_V % 64 || !VEC_LOAD || PACK_GQA || SPLIT_KV
#error "attn_fwd_sm90: D and Dv multiples of 64, 16-byte loads, no decode switches"
#endif
#if WS && (!(BLOCK_M == 128 || (BLOCK_M == 192 && HEAD_DIM == 64)) || HEAD_DIM != HEAD_DIM_V || ELEM_F32)
#error "attn_fwd_sm90 WS: 128-row tiles (192 at D = 64), D = Dv, 16-bit elements"
#endif
#if defined(PERSIST) && PERSIST && (!WS || HAS_MASK_MOD)
#error "attn_fwd_sm90 PERSIST: the WS kernel, no mask_mod (its producer thread narrows no key range)"
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
#if CLUSTER != 1 && (CLUSTER != 2 || !WS || (defined(PERSIST) && PERSIST) || HEAD_DIM != 128 || HAS_MASK_MOD)
#error "attn_fwd_sm90 CLUSTER: pairs of CTAs a tile in the WS kernel at D = 128 (a K / V panel each), no mask_mod"
#endif

/* S (+)= Q K^T for one k16 step of this warpgroup's 64 rows. */
DEV void s_step(float (&s)[NT][4], uint64_t dq, uint64_t dk, int accumulate)
{
#if BLOCK_N == 128
    wgmma_m64n128_ss(s, dq, dk, accumulate);
#elif BLOCK_N == 176
    wgmma_m64n176_ss(s, dq, dk, accumulate);
#elif BLOCK_N == 64
    wgmma_m64n64_ss(s, dq, dk, accumulate);
#else
#error "attn_fwd_sm90: key tiles of 64, 128 or 176"
#endif
}

/* O += P V for one k16 step (16 keys). */
DEV void o_step(float (&o)[OT][4], const uint32_t (&a)[4], uint64_t dv)
{
#if HEAD_DIM_V == 128
    wgmma_m64n128_rs_t(o, a, dv);
#else
    wgmma_m64n64_rs_t(o, a, dv);
#endif
}

/* Whether out's rows are contiguous and 16-byte aligned: O may leave in 16-byte stores. */
DEV bool out_rows_16b(const attn_params &p)
{
    return p.out.s[3] == 1 && (((uint64_t)p.out.ptr | (uint64_t)(p.out.s[0] | p.out.s[1] | p.out.s[2]) * 2) & 15) == 0;
}

#if !WS
/* out = O (normalize_o's) through shared memory at sO (the Q and K buffers: free once every S
 * product is done): each warp's rows as 16-bit pairs into a padded tile (row stride OS:
 * conflict-free), then whole rows out with 16-byte stores. For outputs whose rows are contiguous
 * and 16-byte aligned; store_o (attn_fwd_tile.cuh) serves the others. */
#define OS (HEAD_DIM_V + 8)
static_assert(BLOCK_M * OS * 2 <= Q_BYTES + 2 * K_BYTES, "the staged O tile does not fit");

DEV void store_o_staged(const attn_params &p, const seq_t &sq, const float (&o)[OT][4], uint32_t sO, int m0,
                        int64_t h)
{
    const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
    __syncthreads();                                     /* every warp is past its last S product */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint32_t row = sO + 2 * (warp * 16 + g + i * 8) * OS;
#pragma unroll
        for (int nt = 0; nt < OT; nt++)
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(row + 2 * (nt * 8 + 2 * t)),
                         "r"(pack2(o[nt][2 * i], o[nt][2 * i + 1])));
    }
    __syncthreads();
    constexpr int CH = HEAD_DIM_V / 8;
    const int rows = min(BLOCK_M, (int)sq.rows - m0);
    elem_t *out = (elem_t *)p.out.ptr + sq.mem_b * p.out.s[0] + (sq.start + m0) * p.out.s[1] + h * p.out.s[2];
    for (int i = tid; i < rows * CH; i += THREADS) {
        const int r = i / CH, c = i % CH;
        uint32_t x0, x1, x2, x3;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3) : "r"(sO + 2 * (r * OS + c * 8)));
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(out + r * p.out.s[1] + c * 8),
                     "r"(x0), "r"(x1), "r"(x2), "r"(x3) : "memory");
    }
}
#endif

#if ENTRY(attn_fwd_sm90) && !WS
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) attn_fwd_sm90(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* Q, then K[2], then V[2]; 1024-byte aligned (kernels.fwd_smem_bytes adds the slack) */
    const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sK = sQ + Q_BYTES, sV = sK + 2 * K_BYTES;

    const int tid = threadIdx.x, warp = tid >> 5, wg = tid >> 7;
    const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (p.Hq / p.Hk);
    if (b == p.B) {
        zero_tail<BLOCK_M, THREADS>(p, h);
        return;
    }
    seq_t sq, sk;
    int m0, r_end, n_first, n_last;
    if (!query_tile(p, b, blockIdx.x, gridDim.x, sq, sk, m0, r_end, n_first, n_last))
        return;
    const int Lq = (int)sq.len, Lk = (int)sk.len;
    const elem_t *gq = (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + sq.start * p.q.s[1] + h * p.q.s[2];
    const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
    const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + sk.start * p.v.s[1] + hk * p.v.s[2];
    const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
    mod_narrow(sc, 1, true, m0, r_end, BLOCK_N, Lk, n_first, n_last);   /* mask_mod's empty end tiles */
    const int64_t ks = p.k.s[1], vs = p.v.s[1];

    const int row0 = m0 + warp * 16;                    /* this warp's first row */
    float o[1][OT][4];
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    zero_acc(o);

    auto load_k = [&](int n) {
        const int64_t c0 = n * BLOCK_N;
        load_sw128<BLOCK_N, HEAD_DIM, THREADS>(sK + (n & 1) * K_BYTES, gk + c0 * ks, ks, Lk - c0, tid);
    };
    auto load_v = [&](int n) {
        const int64_t c0 = n * BLOCK_N;
        load_sw128<BLOCK_N, HEAD_DIM_V, THREADS>(sV + (n & 1) * V_BYTES, gv + c0 * vs, vs, Lk - c0, tid);
    };
    /* S = Q K[n]^T for this warpgroup's 64 rows, issued (the caller commits and waits) */
    const uint64_t dq0 = uniform_desc(sw128_desc(sQ + wg * 64 * 128, 16, 1024));
    auto issue_s = [&](float (&s)[NT][4], int n) {
        const uint64_t dk0 = uniform_desc(sw128_desc(sK + (n & 1) * K_BYTES, 16, 1024));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
            const uint32_t off = (kk & 3) * 32;
            s_step(s, dq0 + desc_step((kk >> 2) * (BLOCK_M * 128) + off),
                   dk0 + desc_step((kk >> 2) * (BLOCK_N * 128) + off), kk > 0);
        }
    };
    /* whether tile n needs the per-element tests: asked while its S product runs (a mask_mod's
     * block mask is a global load away) */
    auto needs_mask = [&](int n) {
        return tile_needs_mask(p, sc, m0, BLOCK_M, r_end, n * BLOCK_N, BLOCK_N, 1, Lq, Lk);
    };
    /* the scores of tile n in s become P (and the row statistics move); corrs: O's factors */
    auto softmax = [&](float (&s)[1][NT][4], int n, bool need, float (&corrs)[2]) {
        score_tile(p, sc, s, row0, n * BLOCK_N, need, 1, Lq, Lk);
        softmax_update(s, m, l, corrs, sc.to_log2);
    };

    if (n_last < n_first) {
        write_out(p, sq, sc.to_natural, o, m, l, row0, b, h, 1, 0, Lq);
        return;
    }

    /* Pipeline. Tile n's S and P come one step ahead of its P V: while the tensor cores run
     * P[n] V[n], the softmax of tile n - 1 (whose S was issued first) runs beside them. Loads run
     * one step further ahead: during the step of tile n, V[n - 1] and K[n - 2] arrive into the
     * buffers V[n + 1] and K[n] used (tile x's K and V live in buffer x & 1). The prologue, tile
     * n_last's S and P with no P V before them, is step n_last + 1: PEEL takes it out of the
     * loop; else it runs as the loop's first step, so that the softmax exists once (half the code
     * and NVRTC's time). */
    load_sw128<BLOCK_M, HEAD_DIM, THREADS>(sQ, gq + m0 * p.q.s[1], p.q.s[1], r_end - m0, tid);
    load_k(n_last);
    cp_async_commit();
#if PEEL
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    load_v(n_last);
    if (n_last > n_first)
        load_k(n_last - 1);
    cp_async_commit();
#endif

    uint32_t pa[BLOCK_N / 16][4];                       /* P of the tile whose P V is next */
#if PEEL
    {
        float s[1][NT][4], corrs[2];
        issue_s(s[0], n_last);
        wgmma_commit();
        const bool need = needs_mask(n_last);
        wgmma_wait<0>();
        fence_acc(s[0]);
        softmax(s, n_last, need, corrs);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; kk++)
            p_fragment(s, 0, kk, pa[kk]);
    }
#endif
    auto issue_pv = [&](int n) {
        const uint64_t dv0 = uniform_desc(sw128_desc(sV + (n & 1) * V_BYTES, BLOCK_N * 128, 1024));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; kk++)
            o_step(o[0], pa[kk], dv0 + desc_step(kk * 16 * 128));
        wgmma_commit();
    };
    auto next_loads = [&](int n) {                      /* tile n's step: V[n - 1], K[n - 2] */
        cp_async_wait_all();                             /* V[n], K[n - 1] */
        fence_proxy_async();
        __syncthreads();                                 /* ... from every thread; tile n + 1 done */
        if (n - 1 >= n_first)
            load_v(n - 1);
        if (n - 2 >= n_first)
            load_k(n - 2);
        cp_async_commit();
    };
    for (int n = !PEEL ? n_last + 1 : n_last; n > n_first; n--) {
        next_loads(n);
        float s[1][NT][4], corrs[2];
        issue_s(s[0], n - 1);
        wgmma_commit();
        const bool need = needs_mask(n - 1);
        if (!PEEL && n > n_last) {                     /* the prologue step */
            wgmma_wait<0>();
        } else {
            issue_pv(n);
            wgmma_wait<1>();                             /* S[n - 1]; P[n] V[n] may still run */
        }
        fence_acc(s[0]);
        softmax(s, n - 1, need, corrs);
        wgmma_wait<0>();
        fence_acc(o[0]);
        rescale_o(o, corrs);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; kk++)
            p_fragment(s, 0, kk, pa[kk]);
    }
    next_loads(n_first);
    issue_pv(n_first);
    wgmma_wait<0>();
    fence_acc(o[0]);
    float inv[2];
    finish_rows<1>(p, sq, sc.to_natural, m, l, row0, b, h, 1, 0, Lq, inv);
    normalize_o<1, OT>(o, inv);
    const bool rows_16b = out_rows_16b(p);
    if (rows_16b)
        store_o_staged(p, sq, o[0], sQ, m0, h);
    else
        store_o(p, sq, o, row0, b, h, 1, 0);
}
#endif

#if ENTRY(attn_fwd_sm90) && WS
#include "sm90_pipe.cuh"

#ifndef PERSIST
#define PERSIST 0
#endif
#define WS_THREADS (THREADS + 128)        /* the producer warpgroup, then the NUM_WG that compute */
#define QW_BYTES (64 * HEAD_DIM * 2)      /* one computing warpgroup's 64 rows of Q */
#define Q_BUFS (1 + PERSIST)              /* PERSIST: the next tile's Q lands under this one's */
#ifndef K_STAGES
#define K_STAGES STAGES                   /* K's ring (the lab's fifth tile value), V's: STAGES */
#endif
/* 24 + 2 x 240 = 3 x 168, what 384 threads start with; 32 + 3 x 160 = 4 x 128 (512 threads). The
 * persistent D = 128 kernel gives its producer 56 (+ 2 x 224): at 24 its tile switch (the next
 * tile taken, its place decoded and posted) spills, and the early take below bought 1% there
 * against 2.5% at 56 (H200, S2k; D = 64's, with a third stage, gained from neither). */
#define WIDE_PRODUCER (NUM_WG == 2 && PERSIST && HEAD_DIM == 128)
#define PRODUCER_REGS (WIDE_PRODUCER ? 56 : NUM_WG == 2 ? 24 : 32)
#define CONSUMER_REGS (WIDE_PRODUCER ? 224 : NUM_WG == 2 ? 240 : 160)
static_assert(64 * HEAD_DIM_V * 2 <= QW_BYTES, "the staged O tile does not fit its Q block");

/* LAZY_MAX (plain scores: no generated mods, score options or mask array; causal and windows
 * alike): a key tile's softmax first tries softmax_lazy (P against the rows' m, no maxima: an
 * FMNMX and an FADD a score fewer on a softmax bound by its instruction issue) once every row of
 * the warp has an m of moderate size (lazy_rows), and where a partial sum says some score lies
 * more than STALE_MAX_LOG2 above its m, gets the scores back (scores_from_p, or s_again where a p
 * overflowed) and runs softmax_update with m moved to the tile's maximum itself, so that a row
 * whose scores sit just above its m does not take this path tile after tile (bench/NOTES.md,
 * forward v31, v32). With score options the rare paths' registers spill in the key loop: those
 * keep softmax_update alone. */
#ifndef LAZY_MAX
#define LAZY_MAX (!ATTN_GMODS && SCORE_IS_PLAIN && !HAS_MASK)
#endif

#if LAZY_MAX
/* The raw q.k of a warp's S fragment again, in float32 by FMAs: LAZY_MAX's rarest path, a tile
 * with a score more than 128 log2 units above its row's m (inputs of magnitude ~100), whose P
 * overflowed and holds the score no more. Q from this warpgroup's block in shared memory (sw128:
 * 16-byte chunk c of a 64-column panel's row r at c ^ (r & 7)), K from global memory by sk's rows
 * (the WS kernel reads no page table; a key from Lk on reads key Lk - 1's row, which score_tile
 * then masks). r0: the warp's first row in the block; c0: the tile's first key. A key at a time,
 * its loop over D rolled: the rare path's code stays small. */
DEV void s_again(const attn_params &p, int64_t b, int hk, uint32_t sQw, int r0, int c0, int Lk, float (&s)[NT][4])
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, r = r0 + g;
    const seq_t sk = seq_k(&p, b);                   /* (again: nothing held for this path) */
    const elem_t *k0 = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
#pragma unroll
    for (int j = 0; j < 2 * NT; j++) {
        const int c = c0 + (j >> 1) * 8 + 2 * t + (j & 1);
        const elem_t *k = k0 + (int64_t)max(min(c, Lk - 1), 0) * p.k.s[1];
        float lo = 0.f, hi = 0.f;
#pragma unroll 1
        for (int d = 0; d < HEAD_DIM; d++) {
            const uint32_t at = sQw + (d >> 6) * (64 * 128) + ((((d & 63) >> 3) ^ (r & 7)) << 4) + (d & 7) * 2;
            unsigned short q0, q1;
            asm volatile("ld.shared.u16 %0, [%1];" : "=h"(q0) : "r"(at + r * 128));
            asm volatile("ld.shared.u16 %0, [%1];" : "=h"(q1) : "r"(at + (r + 8) * 128));
            const float kd = elem_to_f32(k[d * p.k.s[3]]);
            lo = fmaf(elem_to_f32(q0), kd, lo);
            hi = fmaf(elem_to_f32(q1), kd, hi);
        }
        s[j >> 1][j & 1] = lo;
        s[j >> 1][2 + (j & 1)] = hi;
    }
}
#endif

/* Ping-pong: a computing warpgroup waits for its turn (named barrier 4 + w), and hands the
 * tensor cores to the next (4 + (w + 1) % NUM_WG) once its products are issued; 256 threads
 * each. Barriers 1 + w: warpgroup w's own (its Q and O blocks). */
DEV void turn_wait(int w) { named_sync(4 + w, 256); }
DEV void turn_pass(int w) { asm volatile("bar.arrive %0, 256;" ::"r"(4 + (w + 1) % NUM_WG) : "memory"); }
DEV void wg_sync(int w) { named_sync(1 + w, 128); }

/* One query tile of the WS kernel: query_tile's answer for tile x of (h, b) (PERSIST: of a dense
 * batch); live false where it lies past the sequence's rows. */
struct ws_tile {
    int64_t b, h;
    seq_t sq, sk;
    int m0, r_end, n_first, n_last;
    bool live;
};

DEV ws_tile ws_tile_at(const attn_params &p, int x, int tiles_x, int64_t h, int64_t b)
{
    ws_tile t;
    t.b = b;
    t.h = h;
    t.live = query_tile<PERSIST>(p, b, x, tiles_x, t.sq, t.sk, t.m0, t.r_end, t.n_first, t.n_last);
    return t;
}

/* The WS grid's order of tiles: (sequence, head) pairs in sections of ws_section's size, and in a
 * section tile x of every pair before tile x + 1 (x = 0: the last rows). Under a causal mask a
 * tile's keys grow with its rows, so the tiles go longest first and the grid ends on short ones;
 * a section's pairs have K and V that fit 32 MiB of L2 together (the H100's L2 holds 50 MB, the
 * H200's 60 MB). Else a section is one pair: a head's tiles run together, its K and V in L2. */
DEV int ws_section(const attn_params &p, int tiles_x)
{
    if (p.causal == CAUSAL_NONE || p.cu_seqlens_k || (int64_t)tiles_x * p.Hq * p.B >= (1ll << 31))
        return 1;                                        /* (a tile's place in an int) */
    const float kv = (float)p.Sk * ((HEAD_DIM + HEAD_DIM_V) * sizeof(elem_t)) / (float)(p.Hq / p.Hk);
    return (int)fminf((float)(p.Hq * p.B), fmaxf(1.f, floorf(33554432.f / kv)));   /* a query head's share */
}

/* Tile t of that order (its place in launch order, or the persistent grid's turn) in sections of
 * sec pairs: its x, and its pair (h + Hq b) in *hb */
DEV int section_tile(const attn_params &p, int t, int tiles_x, int sec, int *hb)
{
    const int p0 = t / (sec * tiles_x) * sec, r = t - p0 * tiles_x, in = min(sec, (int)(p.Hq * p.B) - p0);
    *hb = p0 + r % in;
    return r / in;
}

/* Tile t's place in that order: its x, query head and sequence (int32 divisions: ws_section
 * takes sections of one pair where a tile's place would not fit an int) */
struct ws_place {
    int x, h, b;
};

DEV ws_place ws_place_of(const attn_params &p, int t, int tiles_x, int sec)
{
    int hb;
    const int x = section_tile(p, t, tiles_x, sec, &hb), hq = (int)p.Hq;
    return {x, hb % hq, hb / hq};
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) __cluster_dims__(CLUSTER, 1, 1)
    attn_fwd_sm90(const __grid_constant__ attn_params p, const __grid_constant__ attn_tmaps maps)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* Q (Q_BUFS x NUM_WG blocks of 64 rows), then K[K_STAGES], V[STAGES], then the barriers:
     * full_k, empty_k (K_STAGES each), full_v, empty_v (STAGES each), and tail_v; PERSIST:
     * q_full, q_empty, next_full, next_empty, two each, then, 16-byte aligned, the two slots of
     * the next tile (int32 t and its ws_place) */
    const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sK = sQ + Q_BUFS * Q_BYTES, sV = sK + K_STAGES * K_BYTES, bars = sV + STAGES * V_BYTES;
    const uint32_t full_k = bars, empty_k = bars + 8 * K_STAGES, full_v = bars + 16 * K_STAGES,
                   empty_v = full_v + 8 * STAGES, tail_v = empty_v + 8 * STAGES;
    const int tid = threadIdx.x, warp = uniform_warp_index(), lane = tid & 31, wg = warp >> 2;   /* roles: uniform */
#if PERSIST
    /* PERSIST (the host's choice for dense batches: no cu_seqlens or seqused): gridDim.x CTAs
     * take the call's tiles in ws_place_of's order, blockIdx.x first; the next one by
     * p.counters[0] (an atomic count of the tiles taken past the grid's first; its last taker
     * sets it back to 0) where the host lent it, else every gridDim.x-th. The producer takes it
     * a tile ahead and posts it in a slot with its place, so that the computing warps divide
     * nothing at a tile switch; every Q comes by its bulk tensor copies (maps.q). */
    const uint32_t q_full = tail_v + 8, q_empty = q_full + 16, next_full = q_empty + 16, next_empty = next_full + 16,
                   next_slot = (next_empty + 16 + 15) & ~15u;
    const int tiles_x = (int)((p.Sq + BLOCK_M - 1) / BLOCK_M), total = tiles_x * (int)p.Hq * (int)p.B,
              sec = ws_section(p, tiles_x);
#else
    if (blockIdx.z == p.B) {                             /* packed rows after the last sequence */
        zero_tail<BLOCK_M, WS_THREADS>(p, blockIdx.y);
        return;
    }
    /* the one tile, by every thread (mod_narrow takes whole warps) */
    ws_place pl = {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z};
    if (const int sec = ws_section(p, gridDim.x); sec > 1)
        pl = ws_place_of(p, (int)(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)), gridDim.x, sec);
    ws_tile tile = ws_tile_at(p, pl.x, gridDim.x, pl.h, pl.b);
    if (!tile.live)
        return;
    const score_ctx tile_sc = make_score_ctx(p, tile.b, tile.h, tile.sq, tile.sk);
    mod_narrow(tile_sc, 1, true, tile.m0, tile.r_end, BLOCK_N, tile.sk.len, tile.n_first, tile.n_last);
#endif

    if (tid == 0) {
        for (int st = 0; st < K_STAGES; st++) {
            mbar_init(full_k + 8 * st, 1);
            mbar_init(empty_k + 8 * st, 4 * NUM_WG * CLUSTER);   /* lane 0 of each computing warp */
        }
        for (int st = 0; st < STAGES; st++) {
            mbar_init(full_v + 8 * st, 1);
            mbar_init(empty_v + 8 * st, 4 * NUM_WG * CLUSTER);
        }
        mbar_init(tail_v, 1);
#if PERSIST
        for (int x = 0; x < 2; x++) {
            mbar_init(q_full + 8 * x, 1);
            mbar_init(q_empty + 8 * x, 4 * NUM_WG);
            mbar_init(next_full + 8 * x, 1);
            mbar_init(next_empty + 8 * x, 4 * NUM_WG);
        }
#endif
        mbar_init_fence();
    }
#if CLUSTER > 1
    cluster_sync();                                      /* both CTAs' barriers made before any copy */
#else
    __syncthreads();
#endif

    if (wg == 0) {                                       /* the producer */
        regs_lower<PRODUCER_REGS>();
        if (warp != 0 || (PERSIST && lane != 0))
            return;
        /* Key tile i of a query tile's visit (n = n_last - i) goes to ring position kv + i (the
         * CTA's key tiles so far, plus i): stage (kv + i) % K_STAGES (K) or % STAGES (V), once
         * every computing warpgroup has released that stage's previous tile. K runs a tile ahead
         * of V (K[i + 1], then V[i]): a step needs the S of its tile before the P V of the last.
         * Lane 0 issues; without PERSIST the warp's lanes zero tail_rows of V[0] (its copy
         * completes tail_v, and the warp completes full_v's phase by a plain arrival once the rows
         * are 0). */
        int kv = 0;
        const int group = (int)(p.Hq / p.Hk);            /* query heads a K / V head */
#if PERSIST
        int qn = 0;                                      /* Q blocks brought */
        ws_place pl = ws_place_of(p, blockIdx.x, tiles_x, sec);
        for (int j = 0, t = blockIdx.x; t < total; j++) {
            const ws_tile tl = ws_tile_at(p, pl.x, tiles_x, pl.h, pl.b);
#else
        for (int j = 0; j < 1; j++) {                    /* the one tile: the loop's body shared */
            const ws_tile tl = tile;
#endif
            const seq_t sk = tl.sk;
            const int n_last = tl.n_last, tiles = tl.live ? max(0, n_last - tl.n_first + 1) : 0;
            const int64_t b = tl.b, hk = (int)tl.h / group;
            /* rows of the visit's first tile past Lk that the copy brings from inside the tensor */
            const int Lk = (int)sk.len;
            const int tail_rows = !PERSIST && (p.cu_seqlens_k || p.seqused_k) && tiles > 0
                                  ? max(0, (n_last + 1) * BLOCK_N - max(Lk, n_last * BLOCK_N)) : 0;
            /* key tile i into its stage, its bytes counted on full's barrier of that stage, or on
             * tail_v (tail: V[0]'s rows past Lk are zeroed before full_v completes) */
            auto load = [&](int i, int stages, uint32_t empty, uint32_t dst, const void *map, int bytes, int cols,
                            uint32_t full, bool tail = false) {
                const int g = kv + i, st = g % stages;
                int64_t mb, at;
                key_row(&p, &sk, b, (int64_t)(n_last - i) * BLOCK_N, &mb, &at);
                if (g >= stages)
                    mbar_wait(empty + 8 * st, (g / stages - 1) & 1);
                const uint32_t landed = tail ? tail_v : full + 8 * st;
                mbar_arrive_expect_tx(landed, bytes);
#if CLUSTER > 1
                const int hf = cluster_rank();           /* this CTA's panel, into both */
                tma_load_4d_multicast(dst + st * bytes + hf * BLOCK_N * 128, map, hf * 64, (int)hk, (int)at, (int)mb,
                                      landed, (1 << CLUSTER) - 1);
#else
                for (int hf = 0; hf < cols / 64; hf++)
                    tma_load_4d(dst + st * bytes + hf * BLOCK_N * 128, map, hf * 64, (int)hk, (int)at, (int)mb, landed);
#endif
            };
            if (tiles > 0 && lane == 0) {
#if PERSIST
                const int qb = qn & 1;
                if (qn >= 2)
                    mbar_wait(q_empty + 8 * qb, ((qn >> 1) - 1) & 1);
                mbar_arrive_expect_tx(q_full + 8 * qb, Q_BYTES);
                for (int r = 0; r < NUM_WG; r++)
                    for (int hf = 0; hf < HEAD_DIM / 64; hf++)
                        tma_load_4d(sQ + qb * Q_BYTES + r * QW_BYTES + hf * 64 * 128, &maps.q, hf * 64, (int)tl.h,
                                    tl.m0 + 64 * r, (int)b, q_full + 8 * qb);
                qn++;
#endif
                load(0, K_STAGES, empty_k, sK, &maps.k, K_BYTES, HEAD_DIM, full_k);
                if (tiles > 1)
                    load(1, K_STAGES, empty_k, sK, &maps.k, K_BYTES, HEAD_DIM, full_k);
                load(0, STAGES, empty_v, sV, &maps.v, V_BYTES, HEAD_DIM_V, full_v, tail_rows > 0);
            }
            if (tail_rows) {              /* 128-byte rows of each 64-column panel: a block apiece */
                __syncwarp();
                mbar_wait(tail_v, 0);
                for (int hf = 0; hf < HEAD_DIM_V / 64; hf++)
                    for (int x = lane; x < tail_rows * 8; x += 32)
                        asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};"
                                     ::"r"(sV + hf * BLOCK_N * 128 + (BLOCK_N - tail_rows) * 128 + x * 16), "r"(0)
                                     : "memory");
                fence_proxy_async();
                __syncwarp();
                if (lane == 0)
                    mbar_arrive(full_v);
            }
            if (lane != 0)
                return;
            /* PERSIST: the next tile is taken (p.counters' atomic) before the last V's wait for
             * its stage, so that the atomic's round trip runs under that wait, not between this
             * tile's last load and the next one's Q (the last V issued to the next tile posted:
             * 0.83 us in session 68's stamps, D64 S2k causal); taken any earlier, a CTA would hold
             * a tile it cannot start while others run out */
#if PERSIST
            int taken = -1;                              /* none yet */
#endif
            for (int i = 1; i < tiles; i++) {
                if (i + 1 < tiles)
                    load(i + 1, K_STAGES, empty_k, sK, &maps.k, K_BYTES, HEAD_DIM, full_k);
#if PERSIST
                else if (p.counters)
                    taken = atomicAdd(p.counters, 1);
#endif
                load(i, STAGES, empty_v, sV, &maps.v, V_BYTES, HEAD_DIM_V, full_v);
            }
            kv += tiles;
#if PERSIST
            /* (a tile of at most one key tile, or a grid without counters, takes it here), posted
             * in slot (j + 1) & 1 once the computing warps have read that slot's last */
            if (taken < 0)
                taken = p.counters ? atomicAdd(p.counters, 1) : 0;
            const int next = p.counters ? (int)gridDim.x + taken : t + (int)gridDim.x, s = (j + 1) & 1;
            if (next < total)
                pl = ws_place_of(p, next, tiles_x, sec);
            if (j >= 2)
                mbar_wait(next_empty + 8 * s, ((j >> 1) - 1) & 1);
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
                         ::"r"(next_slot + 16 * s), "r"(next), "r"(pl.x), "r"(pl.h), "r"(pl.b) : "memory");
            mbar_arrive(next_full + 8 * s);
            if (p.counters && taken == total - 1)         /* every CTA has taken its last */
                atomicExch(p.counters, 0);
            t = next;
#endif
        }
#if CLUSTER > 1
        /* the CTA's shared memory stays until both CTAs' last releases of every stage have come */
        for (int g = kv; g < kv + K_STAGES; g++)
            if (g >= K_STAGES)
                mbar_wait(empty_k + 8 * (g % K_STAGES), (g / K_STAGES - 1) & 1);
        for (int g = kv; g < kv + STAGES; g++)
            if (g >= STAGES)
                mbar_wait(empty_v + 8 * (g % STAGES), (g / STAGES - 1) & 1);
#endif
        return;
    }

    regs_raise<CONSUMER_REGS>();
    const int w = wg - 1, cw = warp - 4, ctid = tid & 127;   /* computing warpgroup, its warp */
    auto release = [&](uint32_t bar) {
        __syncwarp();
        if (lane == 0)
            mbar_arrive(bar);
    };
    auto release_kv = [&](uint32_t bar) {              /* a K / V stage: in every CTA its copies fill */
#if CLUSTER > 1
        __syncwarp();
        if (lane == 0)
            for (int r = 0; r < CLUSTER; r++)
                mbar_arrive_at(bar, r);
#else
        release(bar);
#endif
    };
    if (w == NUM_WG - 1)
        turn_pass(w);                                    /* warpgroup 0 goes first */
    int kv = 0;                                          /* key tiles through the rings so far */
#if PERSIST
    int qn = 0;                                          /* Q blocks used */
    int pend = -1;                                       /* a Q block whose O the bulk copies still read */
    ws_place pl = ws_place_of(p, blockIdx.x, tiles_x, sec);
    for (int j = 0, t = blockIdx.x;; j++) {
        if (j > 0) {
            const int s = j & 1;
            mbar_wait(next_full + 8 * s, ((j - 1) >> 1) & 1);
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(t), "=r"(pl.x), "=r"(pl.h), "=r"(pl.b) : "r"(next_slot + 16 * s) : "memory");
            t = __shfl_sync(0xffffffffu, t, 0);          /* warp-uniform to ptxas: the tile's values
                                                          * stay on the uniform datapath, its branches
                                                          * uniform (else +19% instructions a key tile) */
            pl.x = __shfl_sync(0xffffffffu, pl.x, 0);
            pl.h = __shfl_sync(0xffffffffu, pl.h, 0);
            pl.b = __shfl_sync(0xffffffffu, pl.b, 0);
            release(next_empty + 8 * s);
        }
        if (t >= total)
            break;
        const ws_tile tl = ws_tile_at(p, pl.x, tiles_x, pl.h, pl.b);
        if (!tl.live)
            continue;
        const score_ctx sc = make_score_ctx(p, tl.b, tl.h, tl.sq, tl.sk);
#else
    for (int j = 0; j < 1; j++) {                        /* the one tile: the loop's body shared */
        const ws_tile &tl = tile;
        const score_ctx &sc = tile_sc;
#endif
        const int64_t b = tl.b, h = tl.h;
        const seq_t sq = tl.sq;
        const int Lq = (int)sq.len, Lk = (int)tl.sk.len, m0 = tl.m0, r_end = tl.r_end;
        const int n_first = tl.n_first, n_last = tl.n_last;
        const int row0 = m0 + cw * 16;                   /* this warp's first row */
        float o[1][OT][4];
        float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
        zero_acc(o);
        if (n_last < n_first) {
            write_out(p, sq, sc.to_natural, o, m, l, row0, b, h, 1, 0, Lq);
            continue;
        }
        const int tiles = n_last - n_first + 1;
#if !PERSIST
        if (m0 + 64 * w >= (int)sq.rows) {
            /* no row of this warpgroup's is the call's (the last tile of 192-row tiles over 2048 or
             * 4096 rows: a third of it): it computes nothing, and only takes its turns and
             * releases each stage once filled, so that the others' turns and the rings run on */
            for (int i = 0; i <= tiles; i++) {
                const int g = kv + i, st = g % K_STAGES, pst = (g + STAGES - 1) % STAGES;
                if (i < tiles) {
                    mbar_wait(full_k + 8 * st, (g / K_STAGES) & 1);
                    turn_wait(w);
                    turn_pass(w);
                    release_kv(empty_k + 8 * st);
                }
                if (i > 0) {
                    mbar_wait(full_v + 8 * pst, ((g - 1) / STAGES) & 1);
                    release_kv(empty_v + 8 * pst);
                }
            }
            kv += tiles;
            continue;
        }
#endif
#if PERSIST
        const uint32_t sQw = sQ + (qn & 1) * Q_BYTES + w * QW_BYTES;   /* this warpgroup's Q, later its O */
        mbar_wait(q_full + 8 * (qn & 1), (qn >> 1) & 1);
#else
        const uint32_t sQw = sQ + w * QW_BYTES;
        const elem_t *gq = (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + sq.start * p.q.s[1] + h * p.q.s[2];
        load_sw128<64, HEAD_DIM, 128>(sQw, gq + (int64_t)(m0 + 64 * w) * p.q.s[1], p.q.s[1], r_end - m0 - 64 * w,
                                      ctid);
        cp_async_commit();
        cp_async_wait_all();
        fence_proxy_async();
        wg_sync(w);                                      /* this warpgroup's Q in shared memory */
#endif

        const uint64_t dq0 = uniform_desc(sw128_desc(sQw, 16, 1024));
        auto issue_s = [&](float (&s)[NT][4], int st) {
            const uint64_t dk0 = uniform_desc(sw128_desc(sK + st * K_BYTES, 16, 1024));
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
                const uint32_t off = (kk & 3) * 32;
                s_step(s, dq0 + desc_step((kk >> 2) * (64 * 128) + off),
                       dk0 + desc_step((kk >> 2) * (BLOCK_N * 128) + off), kk > 0);
            }
            wgmma_commit();
        };
        uint32_t pa[BLOCK_N / 16][4];                    /* P of the tile whose P V is next */
        auto issue_pv = [&](int st) {
            const uint64_t dv0 = uniform_desc(sw128_desc(sV + st * V_BYTES, BLOCK_N * 128, 1024));
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; kk++)
                o_step(o[0], pa[kk], dv0 + desc_step(kk * 16 * 128));
            wgmma_commit();
        };

        /* Step i: S of tile i (n = n_last - i, ring position kv + i) and P V of tile i - 1
         * issued in this warpgroup's turn, then tile i's softmax beside P V; step 0 has no P V,
         * a last step only P V. Every turn is passed on; warpgroup 0 takes the last at the end. */
        for (int i = 0; i < tiles; i++) {
            const int n = n_last - i, g = kv + i, st = g % K_STAGES, pst = (g + STAGES - 1) % STAGES;
            float s[1][NT][4], corrs[2];
            mbar_wait(full_k + 8 * st, (g / K_STAGES) & 1);
            turn_wait(w);
            issue_s(s[0], st);
            const bool need = tile_needs_mask(p, sc, m0, BLOCK_M, r_end, n * BLOCK_N, BLOCK_N, 1, Lq, Lk);
            if (i == 0) {
                turn_pass(w);
#if PERSIST
                if (pend >= 0) {                         /* the last tile's block, once its O is read */
                    if (ctid == 0)
                        bulk_wait_read();
                    release(q_empty + 8 * pend);
                    pend = -1;
                }
#endif
                wgmma_wait<0>();
            } else {
                mbar_wait(full_v + 8 * pst, ((g - 1) / STAGES) & 1);
                issue_pv(pst);
                turn_pass(w);
                wgmma_wait<1>();                         /* S; P V may still run */
            }
            release_kv(empty_k + 8 * st);
            fence_acc(s[0]);
            score_tile(p, sc, s, row0, n * BLOCK_N, need, 1, Lq, Lk);
            bool kept = false;                           /* LAZY_MAX: softmax_lazy kept the tile */
#if LAZY_MAX
            float stale = STALE_MAX_LOG2;
            if (lazy_rows<1>(m, sc.to_log2)) {
                float sums[2];
                kept = softmax_lazy(s, m, l, sums, sc.to_log2);
                if (!kept) {
                    if (__any_sync(0xffffffffu, sums[0] == POS_INF || sums[1] == POS_INF)) {
                        wgmma_wait<0>();                 /* P V read pa: its registers free */
                        s_again(p, b, (int)h / ((int)p.Hq / (int)p.Hk), sQw, (cw & 3) * 16, n * BLOCK_N, Lk, s[0]);
                        score_tile(p, sc, s, row0, n * BLOCK_N, need, 1, Lq, Lk);
                    } else {
                        scores_from_p(s, m, sc.to_log2);
                    }
                    stale = 0.f;
                }
            }
            if (!kept)
                softmax_update(s, m, l, corrs, sc.to_log2, stale);
#else
            softmax_update(s, m, l, corrs, sc.to_log2);
#endif
            if (i > 0) {
                wgmma_wait<0>();
                release_kv(empty_v + 8 * pst);
                fence_acc(o[0]);
                if (!kept)
                    rescale_o(o, corrs);
            }
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; kk++)
                p_fragment(s, 0, kk, pa[kk]);
        }
        {
            const int g = kv + tiles - 1, pst = g % STAGES;
            mbar_wait(full_v + 8 * pst, (g / STAGES) & 1);
            issue_pv(pst);
            wgmma_wait<0>();
            release_kv(empty_v + 8 * pst);
            fence_acc(o[0]);
        }
        kv += tiles;
        float inv[2];
        finish_rows<1>(p, sq, sc.to_natural, m, l, row0, b, h, 1, 0, Lq, inv);
        /* O through this warpgroup's Q block (its S products are done), laid out as Q's copies
         * bring it: 64-column panels of 64 rows of 128 bytes, 16-byte chunk c of a panel's row r
         * at c ^ (r & 7) (a warp's 8 rows of a store meet 8 chunks: no bank conflict). PERSIST
         * with out's map (p.tma_out): the block leaves by bulk tensor copies (rows past Sq
         * clipped), and goes back to the producer once they have read it, at the next tile's
         * first turn (pend). Else out by rows: 16-byte stores where its rows allow
         * (out_rows_16b), else an element at a time (store_o's registers in the tile loop would
         * cost every key tile: ptxas then keeps the loop's predicates in general registers). */
        auto o_chunk = [&](int r, int c) {
            return sQw + (c >> 3) * (64 * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
        };
        normalize_o<1, OT>(o, inv);
        wg_sync(w);                                      /* every warp's S products read Q */
        {   /* the warp's 16 rows, 16 columns a stmatrix: lane l gives row l % 16 of chunk nt + l / 16 */
            const int r = (cw & 3) * 16 + (lane & 15), hi = lane >> 4;
#pragma unroll
            for (int nt = 0; nt < OT; nt += 2)
                stmatrix_x4(o_chunk(r, nt + hi), pack2(o[0][nt][0], o[0][nt][1]), pack2(o[0][nt][2], o[0][nt][3]),
                            pack2(o[0][nt + 1][0], o[0][nt + 1][1]), pack2(o[0][nt + 1][2], o[0][nt + 1][3]));
        }
#if PERSIST
        if (p.tma_out) {
            fence_proxy_async_shared();                  /* the block's writes before the copies read it */
            wg_sync(w);
            if (ctid == 0)
                for (int hf = 0; hf < HEAD_DIM_V / 64; hf++)
                    tma_store_4d(&maps.out, sQw + hf * (64 * 128), hf * 64, (int)h, m0 + 64 * w, (int)b);
            pend = qn & 1;
            qn++;
            continue;
        }
#endif
        wg_sync(w);
        {
            constexpr int CH = HEAD_DIM_V / 8;
            const int rows = min(64, (int)sq.rows - m0 - 64 * w);
            elem_t *out = (elem_t *)p.out.ptr + sq.mem_b * p.out.s[0] + (sq.start + m0 + 64 * w) * p.out.s[1]
                          + h * p.out.s[2];
            if (out_rows_16b(p)) {
                for (int x = ctid; x < rows * CH; x += 128) {
                    const int r = x / CH, c = x % CH;
                    uint32_t x0, x1, x2, x3;
                    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3) : "r"(o_chunk(r, c)));
                    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(out + r * p.out.s[1] + c * 8),
                                 "r"(x0), "r"(x1), "r"(x2), "r"(x3) : "memory");
                }
            } else {
                for (int x = ctid; x < rows * HEAD_DIM_V; x += 128) {
                    const int r = x / HEAD_DIM_V, c = x % HEAD_DIM_V;
                    unsigned short e;
                    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(e) : "r"(o_chunk(r, c >> 3) + 2 * (c & 7)));
                    *(unsigned short *)(out + r * p.out.s[1] + c * p.out.s[3]) = e;
                }
            }
        }
#if PERSIST
        fence_proxy_async_shared();                      /* the block's reads before the next Q's copy */
        release(q_empty + 8 * (qn & 1));
        qn++;
#endif
    }
#if PERSIST
    if (pend >= 0 && ctid == 0)
        bulk_wait();                                     /* the last copies done before the CTA ends */
#endif
    if (w == 0)
        turn_wait(0);                                    /* the last warpgroup's last pass */
}
#endif
