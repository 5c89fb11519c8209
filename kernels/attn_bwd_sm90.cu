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
 * of attn_bwd.cu otherwise. Switches: bwd_defines' (KV_BLOCK_M = 64, KV_WARPS = 4 per warpgroup,
 * Q_BLOCK_M = 16 * Q_WARPS, Q_BLOCK_N = 64).
 */
#include "attn_bwd_tile.cuh"
#include "wgmma.cuh"

#define KV_THREADS (KV_WARPS * 32)
#define KV_BLOCK_N (KV_WARPS * 16)
#define KV_WG (KV_WARPS / 4)            /* warpgroups of the dK/dV kernel */
#define NTK (HEAD_DIM / 8)              /* n8 column groups of dK, dQ per warp */
#define NTV (HEAD_DIM_V / 8)            /* of dV */

#if HEAD_DIM % 64 || HEAD_DIM_V % 64 || !VEC_LOAD || KV_BLOCK_M != 64 || Q_BLOCK_N != 64 \
    || Q_BLOCK_M != 16 * Q_WARPS || KV_SPLIT
#error "attn_bwd_sm90: D and Dv multiples of 64, 16-byte loads, 64-row streamed tiles"
#endif

/* acc (+)= A B^T for 64 rows x 64 columns over k = KD (both operands K-major SW128 tiles: A's
 * warpgroup rows at a_base, B's 64 rows at b_base; a_rows / b_rows: the tiles' heights). */
template <int KD>
DEV void mma_ss64(float (&acc)[8][4], uint32_t a_base, int a_rows, uint32_t b_base, int b_rows)
{
#pragma unroll
    for (int kk = 0; kk < KD / 16; kk++) {
        const uint32_t off = (kk & 3) * 32;
        wgmma_m64n64_ss(acc, sw128_desc(a_base + (kk >> 2) * (a_rows * 128) + off, 16, 1024),
                        sw128_desc(b_base + (kk >> 2) * (b_rows * 128) + off, 16, 1024), kk > 0);
    }
}

/* acc += A B for 64 rows x N columns over k = 64 rows of B: A as register fragments (4 k16
 * steps), B an SW128 tile of 64 rows read transposed (MN-major). */
template <int N>
DEV void mma_rs(float (&acc)[N / 8][4], const uint32_t (&a)[1][4][4], uint32_t b_base)
{
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const uint64_t db = sw128_desc(b_base + kk * 16 * 128, 64 * 128, 1024);
        if constexpr (N == 128)
            wgmma_m64n128_rs_t(acc, a[0][kk], db);
        else
            wgmma_m64n64_rs_t(acc, a[0][kk], db);
    }
}

/* ---------------------------------------------------------------- dK, dV */
#if DQ_ATOMIC
/* dQ += dS K for the CTA's KV_BLOCK_N keys x the query tile at m0, into dq_accum by vector float
 * atomics. pd: this warpgroup's dS^T as A fragments (rows keys, columns query rows), staged at
 * sds (an SW128 tile of KV_BLOCK_N rows = keys, 64 columns = query rows) so that read MN-major it
 * is dS (M = query rows); K read MN-major (N = D) from sk. The warpgroups split dQ's columns when
 * each gets at least 64 of them (every warpgroup then reads every key: half the atomics of one
 * partial per warpgroup), else each adds its own keys' partial over every column. All products
 * are issued at once behind dK's and waited for together; the next item's barrier at the loop's
 * top keeps sds until every warpgroup's products are done. */
#define DQ_SPLIT (HEAD_DIM / KV_WG >= 64)
#if DQ_ORDERED && !DQ_SPLIT && KV_WG > 1
#error "DQ_ORDERED: one dQ partial per CTA (one warpgroup, or the columns split)"
#endif
#if DQ_ORDERED
/* DQ_ORDERED (deterministic): the key blocks add into a query tile one at a time, in descending
 * key-block order, so every element of dq_accum sees the same additions in the same order on
 * every run. dq_sem (B, Hq, query tiles; zeroed by attn_bwd_pre) counts the blocks that have
 * added into a tile; block n's turn at tile m is (the last block that sees m) - n, since the
 * blocks that see a tile are consecutive (kv_tile_rows is kv_range's exact inverse). The grid
 * runs the key blocks in reverse (the last first), so a CTA only ever waits for CTAs launched
 * before it: those are running or done, whatever else shares the GPU. Causal and window blocks
 * reach their tiles in the same order (lockstep); without a mask block n first waits for the n
 * blocks above it. A wait that outlasts SEM_SPINS polls (a miscount: never expected) goes on
 * unordered rather than hang. */
#define SEM_SPINS (1 << 22)
DEV void sem_wait(const int *sem, int turn)
{
    for (int spins = 0; spins < SEM_SPINS; spins++) {
        int v;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
        if (v >= turn)
            return;
        if (spins >= 64)
            __nanosleep(256);
    }
}

/* After a barrier that follows every thread's additions: the next block's turn. */
DEV void sem_signal(int *sem)
{
    asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(sem) : "memory");
}

/* The tile's counter and this block's turn at it. */
DEV int *sem_of(const attn_params &p, int64_t b, int64_t h, int m0, int Lq, int Lk, int n_block, int &turn)
{
    int64_t lo, hi;
    kv_range(&p, m0, min(m0 + KV_BLOCK_M, Lq), Lq, Lk, &lo, &hi);
    turn = (int)((hi - 1) / KV_BLOCK_N) - n_block;
    return (int *)p.dq_sem.ptr + b * p.dq_sem.s[0] + h * p.dq_sem.s[1] + (m0 / KV_BLOCK_M) * p.dq_sem.s[2];
}
#endif
#define DQ_COLS (DQ_SPLIT ? HEAD_DIM / KV_WG : HEAD_DIM)   /* dQ columns per warpgroup */
#define DQ_KEYS (DQ_SPLIT ? KV_BLOCK_N : 64)             /* keys each warpgroup's product reads */
DEV void dq_atomic(const attn_params &p, const seq_t &sq, int64_t h, int m0, int Lq,
                   const uint32_t (&pd)[1][KV_NT / 2][4], uint32_t sds, uint32_t sk, int *sem, int turn)
{
    const int warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    /* pd[kk]: keys (16 warp + g, + 8) x query columns 16 kk + 2 t (+ 8), pairs of adjacent columns */
#pragma unroll
    for (int kk = 0; kk < KV_NT / 2; kk++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int key = wg * 64 + warp * 16 + g + (x & 1) * 8, col = kk * 16 + (x >> 1) * 8 + 2 * t;
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(sds + sw128_offset<KV_BLOCK_N>(key, col >> 3) + (col & 7) * 2),
                         "r"(pd[0][kk][x]));
        }
    fence_proxy_async();
#if DQ_ORDERED
    if (threadIdx.x == 0)
        sem_wait(sem, turn);
#endif
    if (DQ_ORDERED || (DQ_SPLIT && KV_WG > 1))
        __syncthreads();                                     /* every warpgroup's keys; our turn */
    else
        asm volatile("bar.sync %0, 128;" ::"r"(1 + wg));                        /* this warpgroup's keys */
    const int col0 = DQ_SPLIT ? wg * DQ_COLS : 0, key0 = DQ_SPLIT ? 0 : wg * 64;
    float acc[DQ_COLS / 64][8][4];
    wgmma_fence();
#pragma unroll
    for (int chunk = 0; chunk < DQ_COLS / 64; chunk++)
#pragma unroll
        for (int kk = 0; kk < DQ_KEYS / 16; kk++)
            wgmma_m64n64_ss_tt(acc[chunk], sw128_desc(sds + (key0 + kk * 16) * 128, KV_BLOCK_N * 128, 1024),
                               sw128_desc(sk + (col0 / 64 + chunk) * (KV_BLOCK_N * 128) + (key0 + kk * 16) * 128,
                                          KV_BLOCK_N * 128, 1024),
                               kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int chunk = 0; chunk < DQ_COLS / 64; chunk++)
        fence_acc(acc[chunk]);
    float *acc_row = (float *)p.dq_accum.ptr + sq.mem_b * p.dq_accum.s[0] + sq.start * p.dq_accum.s[1]
                     + h * p.dq_accum.s[2] + col0;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = m0 + warp * 16 + g + i * 8;
        if (r < Lq)
#pragma unroll
            for (int chunk = 0; chunk < DQ_COLS / 64; chunk++)
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
                    red_add_f32x2(acc_row + (int64_t)r * p.dq_accum.s[1] + chunk * 64 + nt * 8 + 2 * t,
                                  acc[chunk][nt][2 * i], acc[chunk][nt][2 * i + 1]);
    }
}
#endif

#define KQ_BYTES (KV_BLOCK_M * HEAD_DIM * 2)
#define KDO_BYTES (KV_BLOCK_M * HEAD_DIM_V * 2)

#if ENTRY(attn_bwd_dkdv_sm90)
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_MINB) attn_bwd_dkdv_sm90(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* K, V (the CTA's keys), Q[2], dO[2] (the streamed query tiles), then lse[2], delta[2] */
    const uint32_t sK = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sV = sK + KV_BLOCK_N * HEAD_DIM * 2, sQ = sV + KV_BLOCK_N * HEAD_DIM_V * 2;
    const uint32_t sdO = sQ + 2 * KQ_BYTES;
    float *sL = (float *)(smem_raw + (sdO + 2 * KDO_BYTES - smem_addr(smem_raw))), *sD = sL + 2 * KV_BLOCK_M;
    const uint32_t sdS = sdO + 2 * KDO_BYTES + 1024;     /* DQ_ATOMIC: dS^T, KV_BLOCK_N keys x 64 */

    const int tid = threadIdx.x, warp = tid >> 5, wg = tid >> 7;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    if (b == p.B) {                       /* packed rows after the last sequence */
        const int64_t first = p.cu_seqlens_k[p.B];
        zero_rows((elem_t *)p.dk.ptr + hk * p.dk.s[2], p.dk.s[1], p.dk.s[3], first, p.Sk, HEAD_DIM, KV_THREADS);
        zero_rows((elem_t *)p.dv.ptr + hk * p.dv.s[2], p.dv.s[1], p.dv.s[3], first, p.Sk, HEAD_DIM_V, KV_THREADS);
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
    int m_first, nm, qlo[2], qhi[2];
    kv_tile_rows(p, n0, KV_BLOCK_N, KV_BLOCK_M, n0 + warp * 16, Lq, Lk, m_first, nm, qlo, qhi);
    {                                     /* mask_mod's empty query tiles at either end */
        int m_last = m_first + nm - 1;
        mod_narrow(make_score_ctx(p, b, hk * group, sq, sk), group, false, n0, min(n0 + KV_BLOCK_N, Lk), KV_BLOCK_M, Lq,
                   m_first, m_last);
        nm = max(m_last - m_first + 1, 0);
    }
    const int items = group * nm;         /* (query head, query tile) pairs, head-major */

    /* item j: Q and dO by cp.async into buffer j & 1; its lse (log2) and delta of row tid */
    auto prefetch = [&](int j, float &l, float &d) {
        const int64_t h = hk * group + j / nm;
        const int m0 = (m_first + j % nm) * KV_BLOCK_M;
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
            l = lse_log2(((const float *)p.lse.ptr)[sq.mem_b * p.lse.s[0] + h * p.lse.s[1] + row * p.lse.s[2]]);
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
#if DQ_ORDERED
    int *done = NULL;                     /* thread 0: the counter of the tile just added into */
#endif
    for (int j = 0; j < items; j++) {
        const int buf = j & 1;
        const int64_t h = hk * group + j / nm;
        const int m0 = (m_first + j % nm) * KV_BLOCK_M;
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();                  /* item j in buffer buf; every warp is done with item j - 1 */
#if DQ_ORDERED
        if (tid == 0 && done)
            sem_signal(done);             /* item j - 1's additions are all in */
#endif
        nl = POS_INF;
        nd = 0.f;
        if (j + 1 < items)
            prefetch(j + 1, nl, nd);
        cp_async_commit();
        const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
        const uint32_t qb = sQ + buf * KQ_BYTES, dob = sdO + buf * KDO_BYTES;

        /* S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys */
        float s[1][KV_NT][4], dp[1][KV_NT][4];
        wgmma_fence();
        mma_ss64<HEAD_DIM>(s[0], sK + wg * 64 * 128, KV_BLOCK_N, qb, KV_BLOCK_M);
        mma_ss64<HEAD_DIM_V>(dp[0], sV + wg * 64 * 128, KV_BLOCK_N, dob, KV_BLOCK_M);
        wgmma_commit();
        /* asked while the products run (a mask_mod's block mask is a global load away) */
        const bool need_mask = tile_maybe_masked(sc, m0, min(m0 + KV_BLOCK_M, Lq), n0, min(n0 + KV_BLOCK_N, Lk))
                               || n0 + KV_BLOCK_N > Lk || m0 + KV_BLOCK_M > Lq
                               || !tile_inside_band(&p, m0, min(m0 + KV_BLOCK_M, Lq), n0, n0 + KV_BLOCK_N, Lq, Lk);
        wgmma_wait<0>();
        fence_acc(s[0]);
        fence_acc(dp[0]);

        uint32_t pp[1][KV_NT / 2][4], pd[1][KV_NT / 2][4];
        pt_tile(s, pp, sc, sL + buf * KV_BLOCK_M, n0 + warp * 16, m0, qlo, qhi, need_mask);
        wgmma_fence();
        mma_rs<HEAD_DIM_V>(dv[0], pp, dob);          /* dV += P^T dO */
        wgmma_commit();
        dst_tile(s, dp, sD + buf * KV_BLOCK_M);
        pack_frag<1, KV_NT / 2>(pd, s);
        wgmma_fence();
        mma_rs<HEAD_DIM>(dk[0], pd, qb);             /* dK += dS^T Q */
        wgmma_commit();
#if DQ_ORDERED
        int turn;
        int *sem = sem_of(p, b, h, m0, Lq, Lk, n_block, turn);
        dq_atomic(p, sq, h, m0, Lq, pd, sdS, sK, sem, turn);
        done = sem;
#elif DQ_ATOMIC
        dq_atomic(p, sq, h, m0, Lq, pd, sdS, sK, NULL, 0);
#endif
        wgmma_wait<0>();
        fence_acc(dv[0]);
        fence_acc(dk[0]);
        if (tid < KV_BLOCK_M) {           /* item j + 1's lse and delta: buffer buf ^ 1 is free */
            sL[(buf ^ 1) * KV_BLOCK_M + tid] = nl;
            sD[(buf ^ 1) * KV_BLOCK_M + tid] = nd;
        }
    }
    cp_async_wait_all();
#if DQ_ORDERED
    __syncthreads();
    if (tid == 0 && done)
        sem_signal(done);
#endif
    store_dkdv(p, sk, hk, dk, dv, n0 + warp * 16, true, true);
}
#endif

/* ---------------------------------------------------------------- dQ */
#define QK_BYTES (Q_BLOCK_N * HEAD_DIM * 2)
#define QV_BYTES (Q_BLOCK_N * HEAD_DIM_V * 2)

#if ENTRY(attn_bwd_dq_sm90)
extern "C" __global__ void __launch_bounds__(Q_THREADS, Q_MINB) attn_bwd_dq_sm90(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* Q, dO (the CTA's rows), K[2], V[2] (the key tiles) */
    const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sdO = sQ + Q_BLOCK_M * HEAD_DIM * 2, sK = sdO + Q_BLOCK_M * HEAD_DIM_V * 2;
    const uint32_t sV = sK + 2 * QK_BYTES;

    const int tid = threadIdx.x, warp = tid >> 5, wg = tid >> 7, g = (tid & 31) >> 2, t = tid & 3;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    if (b == p.B) {
        zero_rows((elem_t *)p.dq.ptr + h * p.dq.s[2], p.dq.s[1], p.dq.s[3], p.cu_seqlens_q[p.B], p.Sq, HEAD_DIM,
                  Q_THREADS);
        return;
    }
    const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
    const int m0 = (gridDim.x - 1 - blockIdx.x) * Q_BLOCK_M;     /* the longest causal rows first */
    if (m0 >= sq.rows)
        return;
    const int64_t hk = h / (p.Hq / p.Hk);
    const int Lq = (int)sq.len, Lk = (int)sk.len;
    int64_t lo = 0, hi = 0;
    if (m0 < Lq)
        kv_range(&p, m0, min(m0 + Q_BLOCK_M, Lq), Lq, Lk, &lo, &hi);
    int n_first = (int)(lo / Q_BLOCK_N), n_last = hi > lo ? (int)((hi - 1) / Q_BLOCK_N) : -1;
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
        mma_ss64<HEAD_DIM>(s[0], sQ + wg * 64 * 128, Q_BLOCK_M, sK + buf * QK_BYTES, Q_BLOCK_N);
        mma_ss64<HEAD_DIM_V>(dp[0], sdO + wg * 64 * 128, Q_BLOCK_M, sV + buf * QV_BYTES, Q_BLOCK_N);
        wgmma_commit();
        const bool need = ds_needs_mask(p, sc, m0, n * Q_BLOCK_N, Lq, Lk);   /* while the products run */
        wgmma_wait<0>();
        fence_acc(s[0]);
        fence_acc(dp[0]);

        ds_tile<true>(s, dp, p, sc, ri, m0, n * Q_BLOCK_N, need, Lq, Lk);
        uint32_t a[1][Q_NT / 2][4];
        pack_frag<1, Q_NT / 2>(a, s);
        wgmma_fence();
        mma_rs<HEAD_DIM>(dq[0], a, sK + buf * QK_BYTES);   /* dQ += dS K */
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(dq[0]);
    }
    cp_async_wait_all();

    /* dq = dQ * scale; padding rows (and rows that keep nothing) come out 0 */
    const float scale = sc.scale;
    elem_t *gdq = (elem_t *)p.dq.ptr + sq.mem_b * p.dq.s[0] + sq.start * p.dq.s[1] + h * p.dq.s[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = m0 + warp * 16 + g + i * 8;
        if (r >= sq.rows)
            continue;
        elem_t *row = gdq + (int64_t)r * p.dq.s[1];
#pragma unroll
        for (int nt = 0; nt < NTK; nt++) {
            const int d = nt * 8 + 2 * t;
            row[d * p.dq.s[3]] = f32_to_elem(dq[0][nt][2 * i] * scale);
            row[(d + 1) * p.dq.s[3]] = f32_to_elem(dq[0][nt][2 * i + 1] * scale);
        }
    }
}
#endif
