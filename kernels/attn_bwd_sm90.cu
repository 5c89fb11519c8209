/* Attention backward for Hopper (sm_90a): attn_bwd.cu's dK/dV and dQ kernels with their products
 * on warpgroup tensor-core instructions (wgmma.mma_async) reading 128-byte swizzled shared
 * memory (wgmma.cuh); delta and dbias stay attn_bwd.cu's. Deterministic as attn_bwd.cu: every
 * output element is written once, by the CTA that owns its row.
 *
 *   attn_bwd_dkdv_sm90  one CTA per (key tile of KV_BLOCK_N = 64 per warpgroup, kv head,
 *                       sequence); warpgroup w owns keys [64w, 64w + 64). The query tiles
 *                       (KV_BLOCK_M = 64 rows) of every query head of the GQA group stream past,
 *                       double-buffered: S^T = K Q^T and dP^T = V dO^T from shared memory,
 *                       P^T and dS^T in registers (attn_bwd_tile.cuh, as attn_bwd.cu), dV +=
 *                       P^T dO and dK += dS^T Q with the register operand and dO, Q transposed.
 *                       DQ_ATOMIC (deterministic=False): also dQ += dS K, dS^T staged in
 *                       shared memory and read transposed, added into dq_accum (float32) by
 *                       vector atomics whose order varies from run to run; attn_bwd.cu's
 *                       attn_bwd_dq_convert scales it into dq (5 products instead of 7).
 *   attn_bwd_dq_sm90    one CTA per (query tile of Q_BLOCK_M = 64 per warpgroup, head,
 *                       sequence) over the key tiles (Q_BLOCK_N = 64) kv_range allows, K and V
 *                       double-buffered: S = Q K^T, dP = dO V^T, dS (ds_tile), dQ += dS K.
 *
 * Applies to VEC_LOAD inputs with D and Dv in {64, 128} (kernels.bwd_plan chooses); every option
 * of attn_bwd.cu otherwise. Switches: bwd_defines' (KV_BLOCK_M = 64, or 128 where the
 * warp-specialised kernel below takes D = 64; KV_WARPS = 4 per warpgroup, Q_BLOCK_M = 16 *
 * Q_WARPS, Q_BLOCK_N = 64).
 */
/* pt_pass's row pairs (attn_bwd_tile.cuh) at every D here: with PAIR_BITS the D = 64 warp-specialised
 * loop holds them without the spills they once cost (bench/NOTES.md, backward v19) */
#ifndef ROW_PAIRS
#define ROW_PAIRS 1
#endif
#include "attn_bwd_tile.cuh"
#include "wgmma.cuh"
#include "sm90_pipe.cuh"

#define KV_THREADS (KV_WARPS * 32)
#define KV_BLOCK_N (KV_WARPS * 16)
#define KV_WG (KV_WARPS / 4)            /* warpgroups of the dK/dV kernel */
#define NTK (HEAD_DIM / 8)              /* n8 column groups of dK, dQ per warp */
#define NTV (HEAD_DIM_V / 8)            /* of dV */

#if HEAD_DIM % 64 || HEAD_DIM_V % 64 || !VEC_LOAD || Q_BLOCK_N != 64 || Q_BLOCK_M != 16 * Q_WARPS || KV_SPLIT \
    || KV_BLOCK_M != (DQ_ATOMIC && HEAD_DIM == 64 ? 128 : 64)
#error "attn_bwd_sm90: D and Dv multiples of 64, 16-byte loads, 64-row streamed tiles (128 where D = 64 adds dQ)"
#endif

/* acc (+)= A B^T for 64 rows x N columns over k = KD (both operands K-major SW128 tiles: A's
 * warpgroup rows at a_base, B's N rows at b_base; a_rows / b_rows: the tiles' heights). */
template <int N, int KD>
DEV void mma_ss(float (&acc)[N / 8][4], uint32_t a_base, int a_rows, uint32_t b_base, int b_rows)
{
    const uint64_t da0 = uniform_desc(sw128_desc(a_base, 16, 1024)), db0 = uniform_desc(sw128_desc(b_base, 16, 1024));
#pragma unroll
    for (int kk = 0; kk < KD / 16; kk++) {
        const uint32_t off = (kk & 3) * 32;
        const uint64_t da = da0 + desc_step((kk >> 2) * (a_rows * 128) + off),
                       db = db0 + desc_step((kk >> 2) * (b_rows * 128) + off);
        if constexpr (N == 128)
            wgmma_m64n128_ss(acc, da, db, kk > 0);
        else
            wgmma_m64n64_ss(acc, da, db, kk > 0);
    }
}

/* acc += A B for 64 rows x N columns over k = 16 KS rows of B: A as register fragments (KS k16
 * steps), B an SW128 tile of 16 KS rows read transposed (MN-major). */
template <int N, int KS>
DEV void mma_rs(float (&acc)[N / 8][4], const uint32_t (&a)[1][KS][4], uint32_t b_base)
{
    const uint64_t db0 = uniform_desc(sw128_desc(b_base, 64 * 128, 1024));
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        const uint64_t db = db0 + desc_step(kk * 16 * 128);
        if constexpr (N == 128)
            wgmma_m64n128_rs_t(acc, a[0][kk], db);
        else
            wgmma_m64n64_rs_t(acc, a[0][kk], db);
    }
}

/* ---------------------------------------------------------------- dK, dV */
#define KQ_BYTES (KV_BLOCK_M * HEAD_DIM * 2)
#define KDO_BYTES (KV_BLOCK_M * HEAD_DIM_V * 2)

/* The items j = 0, 1, .. of a dK/dV CTA in turn: each one's query head and first query row
 * (head-major over the query tiles [m_first, m_first + nm)), by counting: no division in the
 * item loops. */
struct item_walk {
    int nm, m_first, jh = 0, jm = 0;
    int64_t h0;
    __device__ item_walk(int nm_, int m_first_, int64_t hk, int group)
        : nm(nm_), m_first(m_first_), h0(hk * group) {}
    /* this item's head and first row, then on to the next item */
    __device__ __forceinline__ void next(int64_t &h, int &m0)
    {
        h = h0 + jh;
        m0 = (m_first + jm) * KV_BLOCK_M;
        if (++jm == nm) {
            jm = 0;
            jh++;
        }
    }
};

/* One query tile against this warpgroup's 64 keys: rows kw0.. of the CTA's KV_BLOCK_N keys in sK,
 * sV, this warp's from n0w; Q at qb, dO at dob, the tile's lse rows lb (log2 units) and delta rows
 * db. S^T = K Q^T and dP^T = V dO^T from shared memory, P^T and dS^T (attn_bwd_tile.cuh), then
 * dV += P^T dO and, with DK, dK += dS^T Q issued with the register operand (committed, not
 * waited for). dS^T is left in pd as A fragments (rows keys, columns query rows). */
template <bool DK = true>
DEV void kv_item(float (&dk)[1][NTK][4], float (&dv)[1][NTV][4], uint32_t (&pd)[1][KV_NT / 2][4],
                 const attn_params &p, const score_ctx &sc, uint32_t sK, uint32_t sV, int kw0, uint32_t qb,
                 uint32_t dob, const float *lb, const float *db, int n0, int n0w, int m0, int Lq, int Lk,
                 const int (&qlo)[2], const int (&qhi)[2])
{
    float s[1][KV_NT][4], dp[1][KV_NT][4];
    wgmma_fence();
    mma_ss<KV_BLOCK_M, HEAD_DIM>(s[0], sK + kw0 * 128, KV_BLOCK_N, qb, KV_BLOCK_M);
    mma_ss<KV_BLOCK_M, HEAD_DIM_V>(dp[0], sV + kw0 * 128, KV_BLOCK_N, dob, KV_BLOCK_M);
    wgmma_commit();
    /* asked while the products run (a mask_mod's block mask is a global load away) */
    const bool need_mask = item_needs_mask(p, sc, n0, KV_BLOCK_N, m0, KV_BLOCK_M, Lq, Lk);
    wgmma_wait<0>();
    fence_acc(s[0]);
    fence_acc(dp[0]);

    uint32_t pp[1][KV_NT / 2][4];
    pt_tile<KV_NT, true>(s, pp, p, sc, lb, n0w, m0, qlo, qhi, need_mask, dp, db);   /* dS^T into dp */
    wgmma_fence();
    mma_rs<HEAD_DIM_V>(dv[0], pp, dob);          /* dV += P^T dO */
    wgmma_commit();
    pack_frag<1, KV_NT / 2>(pd, dp);
    if (DK) {
        wgmma_fence();
        mma_rs<HEAD_DIM>(dk[0], pd, qb);         /* dK += dS^T Q */
        wgmma_commit();
    }
}

/* The number of items of the CTA's key tile at n0: the query tiles that see it (kv_tile_rows:
 * [all_first, all_first + all_n)), less a mask_mod's empty tiles at either end ([m_first,
 * m_first + nm)), times the group's heads; n0w: this warp's first key. */
DEV int kv_items(const attn_params &p, int64_t b, int64_t hk, const seq_t &sq, const seq_t &sk, int n0, int n0w,
                 int &m_first, int &nm, int (&qlo)[2], int (&qhi)[2], int &all_first, int &all_n)
{
    const int group = (int)(p.Hq / p.Hk), Lq = (int)sq.len, Lk = (int)sk.len;
    kv_tile_rows(p, n0, KV_BLOCK_N, KV_BLOCK_M, n0w, Lq, Lk, m_first, nm, qlo, qhi);
    all_first = m_first;
    all_n = nm;
    int m_last = m_first + nm - 1;
    mod_narrow(make_score_ctx(p, b, hk * group, sq, sk), group, false, n0, min(n0 + KV_BLOCK_N, Lk), KV_BLOCK_M, Lq,
               m_first, m_last);
    nm = max(m_last - m_first + 1, 0);
    return group * nm;
}

/* A warp's 16 rows from g of the mma C fragments acc (N n8 groups) times mul, rows < rows written,
 * through the warp's 2 KB of shared memory at buf: 128 bytes of each row at a time (64 columns as
 * bf16 / f16 pairs, or F16_SCALED's float32 gradients 32 columns as float pairs; 16-byte chunks
 * swizzled by the row: no bank conflicts either way), then out in 16-byte stores.
 * g is 16-byte aligned and s_row a multiple of 8 (store_dkdv_staged checks). */
template <int N>
DEV void store_rows_staged(const float (&acc)[1][N][4], float mul, grad_t *g, int64_t s_row, int rows, uint32_t buf)
{
    constexpr int COLS = 128 / sizeof(grad_t), GROUPS = COLS / 8;   /* a pass's columns, n8 groups */
    const int lane = threadIdx.x & 31, gr = lane >> 2, t = lane & 3;
#pragma unroll
    for (int c = 0; c < N / GROUPS; c++) {
#pragma unroll
        for (int j = 0; j < GROUPS; j++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = gr + 8 * i;
                const float x = acc[0][GROUPS * c + j][2 * i] * mul, y = acc[0][GROUPS * c + j][2 * i + 1] * mul;
#if F16_SCALED
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};"
                             ::"r"(buf + r * 128 + (((2 * j + (t >> 1)) ^ (r & 7)) << 4) + (t & 1) * 8), "f"(x), "f"(y));
#else
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(buf + r * 128 + ((j ^ (r & 7)) << 4) + t * 4),
                             "r"(pack2(x, y)));
#endif
            }
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int piece = lane + 32 * k, r = piece >> 3, ch = piece & 7;
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(buf + r * 128 + ((ch ^ (r & 7)) << 4)));
            if (r < rows)
                *(uint4 *)(g + r * s_row + c * COLS + ch * (COLS / 8)) = v;
        }
        __syncwarp();
    }
}

/* store_dkdv's dk and dv of the warp's 16 keys from n0w in 16-byte stores (store_rows_staged, buf:
 * the warp's 2 KB of a free stage), or store_dkdv itself where either is not laid out for them.
 * Both dK/dV kernels call it after their last item, on the Q stage the next item would have used:
 * free, since every warp read it last for item items - 2, before the barrier of item items - 1,
 * and no load follows.
 * 16-bit scalar stores, eight rows to an instruction, took ~5 us a CTA at D = 64 and ~10 at
 * D = 128 (H100, globaltimer stamps): a sixth of a short row's CTA. */
template <int NK, int NV>
DEV void store_dkdv_staged(const attn_params &p, const seq_t &sk, int64_t hk, const float (&dk)[1][NK][4],
                           const float (&dv)[1][NV][4], int n0w, uint32_t buf)
{
    grad_t *gk = (grad_t *)p.dk.ptr + sk.mem_b * p.dk.s[0] + (sk.start + n0w) * p.dk.s[1] + hk * p.dk.s[2];
    grad_t *gv = (grad_t *)p.dv.ptr + sk.mem_b * p.dv.s[0] + (sk.start + n0w) * p.dv.s[1] + hk * p.dv.s[2];
    const bool vec = p.dk.s[3] == 1 && p.dv.s[3] == 1 && p.dk.s[1] % 8 == 0 && p.dv.s[1] % 8 == 0
                     && ((uint64_t)gk & 15) == 0 && ((uint64_t)gv & 15) == 0;
    if (!vec) {
        store_dkdv(p, sk, hk, dk, dv, n0w, true, true);
        return;
    }
    const int rows = (int)min((int64_t)16, sk.rows - n0w);
    store_rows_staged(dk, dk_mul(p), gk, p.dk.s[1], rows, buf);
    store_rows_staged(dv, dv_mul(p), gv, p.dv.s[1], rows, buf);
}

#if ENTRY(attn_bwd_dkdv_sm90) && !DQ_ATOMIC
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_MINB) attn_bwd_dkdv_sm90(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* K, V (the CTA's keys), Q[2], dO[2] (the streamed query tiles), then lse[2], delta[2] */
    const uint32_t sK = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sV = sK + KV_BLOCK_N * HEAD_DIM * 2, sQ = sV + KV_BLOCK_N * HEAD_DIM_V * 2;
    const uint32_t sdO = sQ + 2 * KQ_BYTES;
    float *sL = (float *)(smem_raw + (sdO + 2 * KDO_BYTES - smem_addr(smem_raw))), *sD = sL + 2 * KV_BLOCK_M;

    const int tid = threadIdx.x, warp = tid >> 5, wg = tid >> 7;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    if (b == p.B) {                       /* packed rows after the last sequence */
        zero_dkdv_tail(p, hk, KV_THREADS);
        return;
    }
    const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
    const int n0 = blockIdx.x * KV_BLOCK_N;
    if (n0 >= sk.rows)
        return;
    const int group = (int)(p.Hq / p.Hk), Lq = (int)sq.len, Lk = (int)sk.len;
    int m_first, nm, qlo[2], qhi[2], all_first, all_n;
    const int items = kv_items(p, b, hk, sq, sk, n0, n0 + warp * 16, m_first, nm, qlo, qhi, all_first, all_n);

    /* item j: Q and dO by cp.async into buffer j & 1; its lse (log2) and delta of row tid */
    item_walk ahead(nm, m_first, hk, group), walk(nm, m_first, hk, group);
    auto prefetch = [&](int j, float &l, float &d) {    /* j = 0, 1, .. in turn */
        int64_t h;
        int m0;
        ahead.next(h, m0);
        const int64_t row0 = sq.start + m0;
        load_sw128<KV_BLOCK_M, HEAD_DIM, KV_THREADS>(
            sQ + (j & 1) * KQ_BYTES, (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + row0 * p.q.s[1] + h * p.q.s[2],
            p.q.s[1], Lq - m0, tid);
        load_sw128<KV_BLOCK_M, HEAD_DIM_V, KV_THREADS>(
            sdO + (j & 1) * KDO_BYTES,
            (const elem_t *)p.dout.ptr + sq.mem_b * p.dout.s[0] + row0 * p.dout.s[1] + h * p.dout.s[2],
            p.dout.s[1], Lq - m0, tid);
        l = POS_INF;
        d = 0.f;
        if (tid < KV_BLOCK_M && m0 + tid < Lq) {
            const int64_t row = row0 + tid;
            l = lse_log2(bwd_lse(p, h, ((const float *)p.lse.ptr)[sq.mem_b * p.lse.s[0] + h * p.lse.s[1] + row * p.lse.s[2]]));
            d = ((const float *)p.delta.ptr)[sq.mem_b * p.delta.s[0] + h * p.delta.s[1] + row * p.delta.s[2]];
        }
    };

    float dk[1][NTK][4], dv[1][NTV][4];
    zero_acc(dk);
    zero_acc(dv);
    float nl = POS_INF, nd = 0.f;
    if (items > 0) {
        const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + (sk.start + n0) * p.k.s[1] + hk * p.k.s[2];
        const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + (sk.start + n0) * p.v.s[1] + hk * p.v.s[2];
        load_sw128<KV_BLOCK_N, HEAD_DIM, KV_THREADS>(sK, gk, p.k.s[1], Lk - n0, tid);
        load_sw128<KV_BLOCK_N, HEAD_DIM_V, KV_THREADS>(sV, gv, p.v.s[1], Lk - n0, tid);
        prefetch(0, nl, nd);
        cp_async_commit();
        if (tid < KV_BLOCK_M) {
            sL[tid] = nl;
            sD[tid] = nd;
        }
    }
    for (int j = 0; j < items; j++) {
        const int buf = j & 1;
        int64_t h;
        int m0;
        walk.next(h, m0);
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();                  /* item j in buffer buf; every warp is done with item j - 1 */
        nl = POS_INF;
        nd = 0.f;
        if (j + 1 < items)
            prefetch(j + 1, nl, nd);
        cp_async_commit();
        uint32_t pd[1][KV_NT / 2][4];
        kv_item(dk, dv, pd, p, make_score_ctx(p, b, h, sq, sk), sK, sV, wg * 64, sQ + buf * KQ_BYTES,
                sdO + buf * KDO_BYTES, sL + buf * KV_BLOCK_M, sD + buf * KV_BLOCK_M, n0, n0 + warp * 16, m0, Lq, Lk,
                qlo, qhi);
        wgmma_wait<0>();
        fence_acc(dv[0]);
        fence_acc(dk[0]);
        if (tid < KV_BLOCK_M) {           /* item j + 1's lse and delta: buffer buf ^ 1 is free */
            sL[(buf ^ 1) * KV_BLOCK_M + tid] = nl;
            sD[(buf ^ 1) * KV_BLOCK_M + tid] = nd;
        }
    }
    cp_async_wait_all();
    if constexpr (KQ_BYTES >= KV_WARPS * 2048)     /* the lab's wider tiles (ATTNEXT_TILE_BWD_SM90) may not fit */
        store_dkdv_staged(p, sk, hk, dk, dv, n0 + warp * 16, sQ + (items & 1) * KQ_BYTES + warp * 2048);
    else
        store_dkdv(p, sk, hk, dk, dv, n0 + warp * 16, true, true);
}
#endif

#if DQ_ATOMIC
/* attn_bwd_dkdv_ws_sm90: dK, dV and dQ from one kernel, warp-specialised as FlashAttention-3's
 * backward. A CTA owns KV_BLOCK_N = 128 keys; three warpgroups:
 *   0  producer, its registers lowered (setmaxnreg): warps 0-1 stream the query tiles' Q, dO, lse
 *      and delta into two stages (mbarriers q_full / q_empty): Q and dO by bulk tensor copies
 *      that thread 0 issues (BWD_TMA: the maps of q and dout, the kernel's second parameter),
 *      else by the 64 threads' cp.asyncs (q_tile_bulk says which); warps 2 and 3 write dQ, a
 *      warp a stage (warp 2 + x the items of stage x, every other one): its lane 0 adds the
 *      tile's dQ partial, staged in shared memory, into dq_accum with one bulk reduction
 *      (cp.reduce.async.bulk .add.f32), and the warp frees the stage (dq_full / dq_empty: each
 *      of its threads arrives). Two writers, so that one item's turn and addition run while
 *      the other's addition lands.
 *   1, 2  consumers, registers raised: warpgroup c owns keys [64c, 64c + 64) for dK and dV
 *      (kv_item), stages its dS^T in shared memory, and after a barrier of both computes dQ's
 *      columns [64c, 64c + 64) over all 128 keys (dS K, both operands read MN-major), then
 *      stores it into the dQ stage (dq_col's swizzle: conflict-free fragment stores).
 * DQ_ORDERED: the additions into a query tile take turns in descending key-block order (dq_sem,
 * as below), each writer warp's lane 0 waiting and signalling so the consumers never do: the
 * same bits on every run. Otherwise the bulk reductions land in whatever order
 * (deterministic=False). DQ_STORE_FIRST (ordered without a mask_mod, so every key block kv_range
 * names visits the tile): the first turn, the tile's last key block, stores its partial instead
 * of adding it, and nothing zeroes dq_accum; with p.dq_write_last (short keys) the last turn,
 * the tile's first key block, reads the sum back into its dQ stage and that stage's writer warp
 * writes dq from it, else attn_bwd_dq_convert does (both 0 for a tile no key block sees).
 * DQ_CHAINS (attn_bwd_tile.cuh; store-first, converted apart): the turns run in that many chains
 * (block n in chain n % DQ_CHAINS, each into its own copy of dq_accum), each chain's first turn
 * storing. With a mask_mod a block may pass its turn, so the host zeroes dq_accum, every turn
 * adds and attn_bwd_dq_convert writes dq.
 * dq_accum's rows of one head are contiguous (B, Hq, S, HEAD_DIM in memory; with DQ_CHAINS, B, Hq,
 * DQ_CHAINS, S, HEAD_DIM), so a tile's valid rows are one block. */
#if KV_WG != 2 || !(HEAD_DIM == 128 || (HEAD_DIM == 64 && HEAD_DIM_V == 64))
#error "attn_bwd_dkdv_ws_sm90: two consumer warpgroups, D = 128 (halves of dQ's columns) or D = Dv = 64 (its rows)"
#endif
#ifndef BWD_TMA
#define BWD_TMA 0
#endif
#define WS_THREADS (KV_THREADS + 128)
#define LOADERS 64                        /* producer threads that load Q, dO, lse, delta */
#define DQ_WRITERS 64                     /* the producer's other threads: the dQ writers (warps 2-3) */
#define SDS_BYTES (KV_BLOCK_N * KV_BLOCK_M * 2)
#define SDQ_BYTES (KV_BLOCK_M * HEAD_DIM * 4)
/* D = 128: 64 query rows per item, warpgroup c adds dQ's columns [64c, 64c + 64); D = 64: 128
 * rows (S^T of 64 keys x 128 rows per warpgroup, FlashAttention-3's hdim-64 tile), warpgroup c
 * adds rows [64c, 64c + 64) of dQ, every column. */
#define DQ_BY_ROWS (HEAD_DIM == 64)
/* Whether kv_item issues dK's product before dQ's (D = 64: 0.5-1% faster so, its registers
 * spill either way), or the consumer after it, so that dQ's stores run under dK's product
 * (D = 128: +2-3.5%; bench/NOTES.md, backward v13). */
#define DK_FIRST DQ_BY_ROWS
#if DQ_BY_ROWS
#define CONSUMER_REGS 232
#define PRODUCER_REGS 40
#else
#define CONSUMER_REGS 224
#define PRODUCER_REGS 56
#endif
static_assert(KV_BLOCK_M % LOADERS == 0, "loaders cover the lse / delta rows");
static_assert(LOADERS + DQ_WRITERS == 128, "the producer warpgroup: loaders, then the dQ writers");
static_assert(KQ_BYTES >= KV_WARPS * 2048, "a Q stage holds every consumer warp's store_rows_staged buffer");

#if DQ_ORDERED && DQ_TILE_M != KV_BLOCK_M
#error "attn_bwd_dkdv_ws_sm90: attn_bwd_dq_convert's DQ_TILE_M is this kernel's query tile"
#endif
#if DQ_CHAINS > 1 && DQ_KEY_BLOCK != KV_BLOCK_N
#error "attn_bwd_dkdv_ws_sm90: attn_bwd_dq_convert's DQ_KEY_BLOCK is this kernel's key block"
#endif

/* dq rows [m0, m0 + rows) of head h: the tile's dQ sum in the stage at st (float32 rows of
 * HEAD_DIM, columns in dq_col's order) times scale, by a writer warp's 32 lanes (lane). */
DEV void store_dq_tile(const attn_params &p, const seq_t &sq, int64_t h, int m0, int rows, uint32_t st, int lane)
{
    constexpr int C = HEAD_DIM / 8;
    const float scale = dq_mul(p);
    grad_t *gdq = (grad_t *)p.dq.ptr + sq.mem_b * p.dq.s[0] + (sq.start + m0) * p.dq.s[1] + h * p.dq.s[2];
    const bool vec = p.dq.s[3] == 1 && p.dq.s[1] % 8 == 0 && ((uint64_t)gdq & 15) == 0;
#pragma unroll 1                          /* unrolled, it cost the consumers spills (D = 128: 198 B) */
    for (int i = lane; i < rows * C; i += 32) {
        const int r = i / C, c = (i % C) * 8;
        const uint32_t src = st + (r * HEAD_DIM + dq_col(r, c)) * 4;
        float f[8];
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3]) : "r"(src));
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(f[4]), "=f"(f[5]), "=f"(f[6]), "=f"(f[7]) : "r"(src + 16));
        grad_t *row = gdq + (int64_t)r * p.dq.s[1];
#if F16_SCALED                            /* float32 dq: the host leaves this to attn_bwd_dq_convert */
#pragma unroll
        for (int e = 0; e < 8; e++)
            row[(c + e) * p.dq.s[3]] = f[e] * scale;
        continue;
#endif
        const uint4 w = pack8(f, scale);
        if (vec) {
            *(uint4 *)(row + c) = w;
        } else {
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < 8; e++)
                row[(c + e) * p.dq.s[3]] = (elem_t)(ws[e >> 1] >> (16 * (e & 1)));
        }
    }
}

/* Whether the query tile at m0 comes by bulk tensor copies (BWD_TMA), else by the loaders'
 * cp.asyncs: a copy zero-fills only rows past the tensor's, so a tile whose rows past Lq lie
 * inside it (varlen: the next sequence's; seqused_q: padding) goes by cp.async, which zeroes
 * them (a NaN there would reach dK and dV as 0 * NaN). */
DEV bool q_tile_bulk(const attn_params &p, int m0, int Lq)
{
    return BWD_TMA && (m0 + KV_BLOCK_M <= Lq || !(p.cu_seqlens_q || p.seqused_q));
}

#if ENTRY(attn_bwd_dkdv_ws_sm90)
#if BWD_TMA
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    attn_bwd_dkdv_ws_sm90(const __grid_constant__ attn_params p, const __grid_constant__ attn_bwd_tmaps maps)
#else
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) attn_bwd_dkdv_ws_sm90(const __grid_constant__ attn_params p)
#endif
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* K, V (the CTA's keys), Q[2], dO[2] (the query tiles' stages), dS^T[2], dQ[2] (float32), then
     * lse[2], delta[2] and the mbarriers q_full[2], q_empty[2], dq_full[2], dq_empty[2], dq_back[2] */
    const uint32_t base = smem_addr(smem_raw), sK = base;
    if (base & 1023)                      /* never: declared 1024-aligned; the D = 64 layout has no byte to spare */
        __trap();
    const uint32_t sV = sK + KV_BLOCK_N * HEAD_DIM * 2, sQ = sV + KV_BLOCK_N * HEAD_DIM_V * 2;
    const uint32_t sdO = sQ + 2 * KQ_BYTES, sdS = sdO + 2 * KDO_BYTES, sdQ = sdS + 2 * SDS_BYTES;
    const uint32_t sLD = sdQ + 2 * SDQ_BYTES;
    float *sL = (float *)(smem_raw + (sLD - base)), *sD = sL + 2 * KV_BLOCK_M;
    const uint32_t q_full = sLD + 4 * 4 * KV_BLOCK_M, q_empty = q_full + 16, dq_full = q_full + 32,
                   dq_empty = q_full + 48, dq_back = q_full + 64;

    /* the roles split by a warp index ptxas knows uniform (sm90_pipe.cuh: D = 128's item loop 825 ->
     * 779 static instructions, +1-2.5% on the H200); D = 64 measured 1-1.5% slower so (its
     * consumers spill at 232 registers either way) and keeps threadIdx.x >> 5 */
    const int tid = threadIdx.x, warp = DQ_BY_ROWS ? tid >> 5 : uniform_warp_index(), wg = warp >> 2;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    if (b == p.B) {                       /* packed rows after the last sequence */
        zero_dkdv_tail(p, hk, WS_THREADS);
        return;
    }
    const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
#if DQ_ORDERED
    const int n_block = gridDim.x - 1 - blockIdx.x;     /* the last key block first */
#else
    const int n_block = blockIdx.x;
#endif
    const int n0 = n_block * KV_BLOCK_N;
    if (n0 >= sk.rows)
        return;
    const int group = (int)(p.Hq / p.Hk), Lq = (int)sq.len, Lk = (int)sk.len;
    const int cw = wg - 1, cwarp = warp - 4;             /* consumer warpgroup and warp (producer: < 0) */
    const int n0w = n0 + max(cwarp, 0) * 16;
    int m_first, nm, qlo[2], qhi[2], all_first, all_n;
    const int items = kv_items(p, b, hk, sq, sk, n0, n0w, m_first, nm, qlo, qhi, all_first, all_n);
    if (tid == 0) {
        for (int x = 0; x < 2; x++) {
            /* two arrivals a loader: its cp.asyncs' and its lse and delta's, or where thread 0
             * issued bulk copies, its arrival with their bytes and the others' second at once */
            mbar_init(q_full + 8 * x, 2 * LOADERS);
            mbar_init(q_empty + 8 * x, KV_THREADS);
            mbar_init(dq_full + 8 * x, KV_THREADS);
            mbar_init(dq_empty + 8 * x, 32);      /* the stage's writer warp */
            mbar_init(dq_back + 8 * x, 1);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {                        /* ---- producer */
        regs_lower<PRODUCER_REGS>();
        if (tid < LOADERS) {
            item_walk walk(nm, m_first, hk, group);
            for (int j = 0; j < items; j++) {
                const int x = j & 1;
                int64_t h;
                int m0;
                walk.next(h, m0);
                const int64_t row0 = sq.start + m0;
                /* the tile's lse and delta rows read first, their latency under the stage's wait and
                 * the copies (read after them, they held up a CTA's first item by ~2 us) */
                constexpr int LR = KV_BLOCK_M / LOADERS;
                float l[LR], d[LR];
#pragma unroll
                for (int i = 0; i < LR; i++) {
                    const int64_t row = row0 + tid + i * LOADERS;
                    const bool in = m0 + tid + i * LOADERS < Lq;
                    const float *lse = (const float *)p.lse.ptr, *delta = (const float *)p.delta.ptr;
                    l[i] = in ? lse[sq.mem_b * p.lse.s[0] + h * p.lse.s[1] + row * p.lse.s[2]] : 0.f;
                    d[i] = in ? delta[sq.mem_b * p.delta.s[0] + h * p.delta.s[1] + row * p.delta.s[2]] : 0.f;
                }
                if (j >= 2)
                    mbar_wait(q_empty + 8 * x, ((j >> 1) - 1) & 1);
                const bool bulk = q_tile_bulk(p, m0, Lq);
                if (bulk) {
#if BWD_TMA
                    if (tid == 0) {
                        mbar_arrive_expect_tx(q_full + 8 * x, KQ_BYTES + KDO_BYTES);
                        for (int hf = 0; hf < HEAD_DIM / 64; hf++)
                            tma_load_4d(sQ + x * KQ_BYTES + hf * KV_BLOCK_M * 128, &maps.q, hf * 64, (int)h, (int)row0,
                                        (int)sq.mem_b, q_full + 8 * x);
                        for (int hf = 0; hf < HEAD_DIM_V / 64; hf++)
                            tma_load_4d(sdO + x * KDO_BYTES + hf * KV_BLOCK_M * 128, &maps.dout, hf * 64, (int)h,
                                        (int)row0, (int)sq.mem_b, q_full + 8 * x);
                    }
#endif
                } else {
                    load_sw128<KV_BLOCK_M, HEAD_DIM, LOADERS, 1>(
                        sQ + x * KQ_BYTES, (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + row0 * p.q.s[1] + h * p.q.s[2],
                        p.q.s[1], Lq - m0, tid);
                    load_sw128<KV_BLOCK_M, HEAD_DIM_V, LOADERS, 1>(
                        sdO + x * KDO_BYTES,
                        (const elem_t *)p.dout.ptr + sq.mem_b * p.dout.s[0] + row0 * p.dout.s[1] + h * p.dout.s[2],
                        p.dout.s[1], Lq - m0, tid);
                    mbar_arrive_cp_async(q_full + 8 * x);
                }
#pragma unroll
                for (int i = 0; i < LR; i++) {
                    const bool in = m0 + tid + i * LOADERS < Lq;
                    sL[x * KV_BLOCK_M + tid + i * LOADERS] = in ? lse_log2(bwd_lse(p, h, l[i])) : POS_INF;
                    sD[x * KV_BLOCK_M + tid + i * LOADERS] = d[i];
                }
                mbar_arrive_n(q_full + 8 * x, bulk && tid != 0 ? 2 : 1);
            }
            cp_async_wait_all();
        } else {                          /* warps 2-3: the dQ writers (a warp a stage) and dq's last turns */
            const int wt = tid - 64, ws = wt >> 5, wl = wt & 31;   /* the warp's stage, its lane */
#if DQ_ORDERED && HAS_MASK_MOD
            for (int j = 0; j < group * all_n && wt == 0; j++) {     /* the tiles mod_narrow took off: their turns pass */
                const int m = all_first + j % all_n;
                if (m < m_first || m >= m_first + nm) {
                    int first, last;
                    sem_set<false>(sem_of<KV_BLOCK_N>(p, b, hk * group + j / all_n, m * KV_BLOCK_M, Lq, Lk, first, last), n_block);
                }
            }
#endif
            int backs = 0;                /* dq_back[ws]'s phases waited for */
            item_walk walk(nm, m_first, hk, group);
            for (int j = 0; j < items; j++) {
                const int x = j & 1;
                int64_t h;
                int m0;
                walk.next(h, m0);
                if (x != ws)              /* the other warp's item */
                    continue;
                const uint32_t stage = sdQ + x * SDQ_BYTES;
                float *dst = (float *)p.dq_accum.ptr + sq.mem_b * p.dq_accum.s[0] + (sq.start + m0) * p.dq_accum.s[1]
                             + h * p.dq_accum.s[2] + dq_chain_offset(p, n_block % DQ_CHAINS);
                const int rows = min(KV_BLOCK_M, Lq - m0), bytes = rows * HEAD_DIM * 4;
#if DQ_ORDERED
                int first, last;
                int *sem = sem_of<KV_BLOCK_N>(p, b, h, m0, Lq, Lk, first, last);
#endif
#if DQ_STORE_FIRST
                /* the tile's last turn writes dq where the host asks (short keys: beyond them this
                 * work holds up the last key block's consumers); alone (first == last) it converts
                 * its partial as it is (never with chains: select.bwd_dq_chains) */
                const bool final = DQ_CHAINS == 1 && p.dq_write_last && n_block == first,
                           alone = final && n_block == last;
#else
                const bool final = false, alone = false;
#endif
                /* each lane waits for every phase of its stage's dq_full and dq_back, then arrives
                 * on dq_empty itself, after its own reads of the stage (racecheck had seen lanes'
                 * reads unordered with the consumers' next stores when one lane arrived for all);
                 * the consumers refill the stage only once all 32 have, so a parity wait can
                 * neither skip a phase nor lag two */
                mbar_wait(dq_full + 8 * x, (j >> 1) & 1);
#if DQ_ORDERED
                if (!alone)
                    sem_wait(sem, n_block, last, wl);
#endif
                if (wl == 0 && !alone) {
#if DQ_ORDERED
                    fence_proxy_async_global();
#endif
#if DQ_STORE_FIRST
                    if (n_block + DQ_CHAINS > last)  /* its chain's first turn: into rows never zeroed */
                        bulk_store(dst, stage, bytes);
                    else
#endif
                        bulk_add_f32(dst, stage, bytes);
#if DQ_ORDERED
                    bulk_wait();
                    fence_proxy_async_global();
                    sem_set<true>(sem, n_block);
#else
                    bulk_wait_read();
#endif
                    if (final) {          /* the tile's sum back into the stage */
                        mbar_arrive_expect_tx(dq_back + 8 * x, bytes);
                        bulk_load(stage, dst, bytes, dq_back + 8 * x);
                    }
                }
                if (final) {
                    if (!alone)
                        mbar_wait(dq_back + 8 * x, backs++ & 1);
                    store_dq_tile(p, sq, h, m0, rows, stage, wl);
                }
                __syncwarp();
                mbar_arrive(dq_empty + 8 * x);
            }
            if (wl == 0)
                bulk_wait();
        }
        return;
    }

    /* ---- consumers */
    regs_raise<CONSUMER_REGS>();
    const int ctid = tid - 128, g = (tid & 31) >> 2, t = tid & 3, w4 = cwarp & 3;
    float dk[1][NTK][4], dv[1][NTV][4];
    zero_acc(dk);
    zero_acc(dv);
    if (items > 0) {
        const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + (sk.start + n0) * p.k.s[1] + hk * p.k.s[2];
        const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + (sk.start + n0) * p.v.s[1] + hk * p.v.s[2];
        load_sw128<KV_BLOCK_N, HEAD_DIM, KV_THREADS>(sK, gk, p.k.s[1], Lk - n0, ctid);
        load_sw128<KV_BLOCK_N, HEAD_DIM_V, KV_THREADS>(sV, gv, p.v.s[1], Lk - n0, ctid);
        cp_async_commit();
        cp_async_wait_all();
        fence_proxy_async();
    }
    named_sync(1, KV_THREADS);            /* K and V in */
    item_walk walk(nm, m_first, hk, group);
    for (int j = 0; j < items; j++) {
        const int x = j & 1;
        int64_t h;
        int m0;
        walk.next(h, m0);
        const uint32_t qb = sQ + x * KQ_BYTES, ds = sdS + x * SDS_BYTES, dqs = sdQ + x * SDQ_BYTES;
        const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
        mbar_wait(q_full + 8 * x, (j >> 1) & 1);
        if (!q_tile_bulk(p, m0, Lq))      /* the loaders' cp.async writes, before wgmma reads them */
            fence_proxy_async();
        uint32_t pd[1][KV_NT / 2][4];
        kv_item<DK_FIRST>(dk, dv, pd, p, sc, sK, sV, cw * 64, qb, sdO + x * KDO_BYTES, sL + x * KV_BLOCK_M,
                sD + x * KV_BLOCK_M, n0, n0w, m0, Lq, Lk, qlo, qhi);

        /* dS^T (keys x query rows) into stage x; both warpgroups' keys before dQ reads them */
#pragma unroll
        for (int kk = 0; kk < KV_NT / 2; kk++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = cw * 64 + w4 * 16 + g + (e & 1) * 8, col = kk * 16 + (e >> 1) * 8 + 2 * t;
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(ds + sw128_offset<KV_BLOCK_N>(key, col >> 3) + (col & 7) * 2),
                             "r"(pd[0][kk][e]));
            }
        fence_proxy_async();
        named_sync(1, KV_THREADS);

        /* dQ = dS K over the CTA's keys: rows [64 cw, + 64) (D = 64) or columns [64 cw, + 64) */
        float acc[8][4];
        const uint32_t a_panel = DQ_BY_ROWS ? cw * (KV_BLOCK_N * 128) : 0, b_panel = DQ_BY_ROWS ? 0 : cw * (KV_BLOCK_N * 128);
        const uint64_t da0 = uniform_desc(sw128_desc(ds + a_panel, KV_BLOCK_N * 128, 1024)),
                       db0 = uniform_desc(sw128_desc(sK + b_panel, KV_BLOCK_N * 128, 1024));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KV_BLOCK_N / 16; kk++)
            wgmma_m64n64_ss_tt(acc, da0 + desc_step(kk * 16 * 128), db0 + desc_step(kk * 16 * 128), kk > 0);
        wgmma_commit();
        if (!DK_FIRST) {                  /* dK += dS^T Q after dQ's product: dQ's stores below run under it */
            wgmma_fence();
            mma_rs<HEAD_DIM>(dk[0], pd, qb);
            wgmma_commit();
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
            fence_acc(dv[0]);
            fence_acc(dk[0]);
            mbar_arrive(q_empty + 8 * x); /* Q, dO, lse and delta of stage x read */
        }
        fence_acc(acc);

        if (j >= 2)
            mbar_wait(dq_empty + 8 * x, ((j >> 1) - 1) & 1);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            /* m0 is a multiple of 4: dq_col's row bits */
            const int r = (DQ_BY_ROWS ? cw * 64 : 0) + w4 * 16 + g + i * 8, c0 = DQ_BY_ROWS ? 0 : cw * 64;
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(dqs + r * (HEAD_DIM * 4)
                                                                       + dq_col(r, c0 + nt * 8 + 2 * t) * 4),
                             "f"(acc[nt][2 * i]), "f"(acc[nt][2 * i + 1]));
        }
        fence_proxy_async();
        mbar_arrive(dq_full + 8 * x);
        if (!DK_FIRST) {
            wgmma_wait<0>();
            fence_acc(dv[0]);
            fence_acc(dk[0]);
            mbar_arrive(q_empty + 8 * x);
        }
    }
    store_dkdv_staged(p, sk, hk, dk, dv, n0w, sQ + (items & 1) * KQ_BYTES + cwarp * 2048);
}
#endif
#endif

/* ---------------------------------------------------------------- dQ */
#define QK_BYTES (Q_BLOCK_N * HEAD_DIM * 2)
#define QV_BYTES (Q_BLOCK_N * HEAD_DIM_V * 2)

#if ENTRY(attn_bwd_dq_sm90) && !DQ_ATOMIC
/* attn_bwd_dq_sm90's loop over its key tiles n_first..n_last (K[n_first], V[n_first] on their
 * way; load_kv(n) loads tile n), through the array gradients' tile sums or not
 * (attn_bwd_tile.cuh: key_tiles_to_sums). */
template <bool TO_SUMS, typename LoadKv>
DEV void dq_key_tiles_sm90(const attn_params &p, const score_ctx &sc, const row_info &ri, uint32_t sQ, uint32_t sdO,
                           uint32_t sK, uint32_t sV, const LoadKv &load_kv, int wg, int m0, int n_first, int n_last,
                           int Lq, int Lk, float (&dq)[1][NTK][4], tile_sums &sums)
{
    for (int n = n_first; n <= n_last; n++) {
        const int buf = (n - n_first) & 1;
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();                  /* K[n], V[n] in; every warp is done with tile n - 1 */
        if (n < n_last)
            load_kv(n + 1);
        cp_async_commit();

        float s[1][Q_NT][4], dp[1][Q_NT][4];
        wgmma_fence();
        mma_ss<Q_BLOCK_N, HEAD_DIM>(s[0], sQ + wg * 64 * 128, Q_BLOCK_M, sK + buf * QK_BYTES, Q_BLOCK_N);
        mma_ss<Q_BLOCK_N, HEAD_DIM_V>(dp[0], sdO + wg * 64 * 128, Q_BLOCK_M, sV + buf * QV_BYTES, Q_BLOCK_N);
        wgmma_commit();
        const bool need = ds_needs_mask(p, sc, m0, n * Q_BLOCK_N, Lq, Lk);   /* while the products run */
        wgmma_wait<0>();
        fence_acc(s[0]);
        fence_acc(dp[0]);

        ds_tile<true, TO_SUMS>(s, dp, p, sc, ri, m0, n * Q_BLOCK_N, need, Lq, Lk,
                               tile_sums_for<TO_SUMS>(sums, sc, m0, n * Q_BLOCK_N, Lq, Lk));
        uint32_t a[1][Q_NT / 2][4];
        pack_frag<1, Q_NT / 2>(a, s);
        wgmma_fence();
        mma_rs<HEAD_DIM>(dq[0], a, sK + buf * QK_BYTES);   /* dQ += dS K */
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(dq[0]);
        tile_sums_flush<TO_SUMS>(sums);   /* after the wait: the product reads a's registers */
    }
}

extern "C" __global__ void __launch_bounds__(Q_THREADS, Q_MINB) attn_bwd_dq_sm90(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* Q, dO (the CTA's rows), K[2], V[2] (the key tiles), then the tile sums (MOD_TILE_SLOTS x MOD_CHUNKS words) */
    const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sdO = sQ + Q_BLOCK_M * HEAD_DIM * 2, sK = sdO + Q_BLOCK_M * HEAD_DIM_V * 2;
    const uint32_t sV = sK + 2 * QK_BYTES;
    uint32_t *sSums = (uint32_t *)(smem_raw + (sV + 2 * QV_BYTES - smem_addr(smem_raw)));

    const int tid = threadIdx.x, wg = tid >> 7;
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
    const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
    mod_narrow(sc, 1, true, m0, min(m0 + Q_BLOCK_M, Lq), Q_BLOCK_N, Lk, n_first, n_last);   /* mask_mod's empty end tiles */
    const elem_t *gk = (const elem_t *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
    const elem_t *gv = (const elem_t *)p.v.ptr + sk.mem_b * p.v.s[0] + sk.start * p.v.s[1] + hk * p.v.s[2];
    auto load_kv = [&](int n) {           /* key tile n into buffer (n - n_first) & 1 */
        const int64_t c0 = n * Q_BLOCK_N;
        const int buf = (n - n_first) & 1;
        load_sw128<Q_BLOCK_N, HEAD_DIM, Q_THREADS>(sK + buf * QK_BYTES, gk + c0 * p.k.s[1], p.k.s[1], Lk - (int)c0, tid);
        load_sw128<Q_BLOCK_N, HEAD_DIM_V, Q_THREADS>(sV + buf * QV_BYTES, gv + c0 * p.v.s[1], p.v.s[1], Lk - (int)c0, tid);
    };

    float dq[1][NTK][4];
    zero_acc(dq);
    if (n_last >= n_first) {
        const int64_t row0 = sq.start + m0;
        load_sw128<Q_BLOCK_M, HEAD_DIM, Q_THREADS>(
            sQ, (const elem_t *)p.q.ptr + sq.mem_b * p.q.s[0] + row0 * p.q.s[1] + h * p.q.s[2], p.q.s[1], Lq - m0, tid);
        load_sw128<Q_BLOCK_M, HEAD_DIM_V, Q_THREADS>(
            sdO, (const elem_t *)p.dout.ptr + sq.mem_b * p.dout.s[0] + row0 * p.dout.s[1] + h * p.dout.s[2],
            p.dout.s[1], Lq - m0, tid);
        load_kv(n_first);
        cp_async_commit();
    }
    tile_sums sums;
    tile_sums_init(sums, sSums);
    if (key_tiles_to_sums(sums, sc, m0, n_first, n_last, Lq, Lk))
        dq_key_tiles_sm90<TILE_SUMS>(p, sc, ri, sQ, sdO, sK, sV, load_kv, wg, m0, n_first, n_last, Lq, Lk, dq, sums);
    else
        dq_key_tiles_sm90<TILE_SUMS && MOD_TILE_ALWAYS>(p, sc, ri, sQ, sdO, sK, sV, load_kv, wg, m0, n_first, n_last,
                                                        Lq, Lk, dq, sums);
    cp_async_wait_all();

    store_dq(p, sq, h, m0, dq[0], dq_mul(p));   /* padding rows (and rows that keep nothing) come out 0 */
}
#endif
