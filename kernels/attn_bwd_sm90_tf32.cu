/* Float32 attention backward for Hopper (sm_90a) in single-pass TF32 (precision="tf32") on warpgroup
 * TF32 instructions (wgmma m64n64k8): each float32 operand rounded to TF32 once as its tile is
 * loaded, each product one TF32 product, where attn_bwd_sm90_x3.cu takes three bfloat16 products
 * of two planes (16 bits; this kernel's 11 are TF32's own). TF32 has no transposed operand, so the
 * products over a tile's rows (dV += P^T dO, dK += dS^T Q, dQ += dS K) read a transposed copy of
 * dO, Q and K, written beside the plain one as the tile is loaded (load_tf32). Runs only where the
 * kernel lab asks (ATTNEXT_BWD_TF32_WGMMA=1: select.bwd_tf32_wgmma) until measured (bench/NOTES.md,
 * float32 backward t1).
 *
 *   attn_bwd_dkdv_tf32  one CTA per (64 keys, kv head, sequence), one warpgroup: K and V stay; the
 *                       query tiles (64 rows) of every query head of the GQA group come past in
 *                       turn (Q, dO, Q^T, dO^T): S^T = K Q^T and dP^T = V dO^T, P^T and dS^T
 *                       (attn_bwd_tile.cuh's pt_tile), as register A fragments, dV += P^T dO
 *                       and dK += dS^T Q, each item's products into a fresh accumulator.
 *   attn_bwd_dq_tf32    one CTA per (64 query rows, head, sequence) over its key tiles (64 keys;
 *                       K, V, K^T): S = Q K^T, dP = dO V^T, dS (ds_tile), dQ += dS K.
 * The same tiles and order as attn_bwd_sm90_x3.cu's one-warpgroup pair (each dK, dV and dQ element
 * summed by the one CTA that owns its row, in order: deterministic). delta (attn_bwd_pre) and rows
 * that keep no key (attn_bwd_dead) are attn_bwd.cu's float32 kernels'. Applies to float32 VEC_LOAD
 * inputs with D = Dv = 64, every option of the score hook and masks, no generated mods.
 *
 * Switches: ELEM_F32, TF32_PASSES 1, KV_BLOCK_M = Q_BLOCK_M = Q_BLOCK_N = 64, KV_WARPS =
 * Q_WARPS = 4. Shared memory: six 16 KB tiles and the lse / delta rows (dK/dV: two CTAs an SM),
 * five tiles (dQ); select.bwd_tf32_smem_bytes adds the alignment's slack.
 */
#include "attn_bwd_tile.cuh"
#include "sm90_pipe.cuh"
#include "wgmma.cuh"

#if !ELEM_F32 || ELEM_BF16 || TF32_PASSES != 1 || HEAD_DIM != 64 || HEAD_DIM_V != 64 || !VEC_LOAD \
    || KV_BLOCK_M != 64 || KV_WARPS != 4 || Q_BLOCK_M != 64 || Q_BLOCK_N != 64 || Q_WARPS != 4 || HAS_SCORE_MOD \
    || HAS_MASK_MOD || DQ_ATOMIC
#error "attn_bwd_sm90_tf32: float32 in one TF32 pass, D = Dv = 64, 16-byte loads, 64 x 64 tiles, one warpgroup"
#endif

#define T_THREADS 128                     /* both kernels': load_tf32 takes a warp's 16 rows of 64 */
#define TILE_BYTES (64 * HEAD_DIM * 4)    /* a 64-row tile in TF32, plain or transposed */
#define NTD (HEAD_DIM / 8)                /* n8 column groups of dK, dV, dQ per warp */

/* Two 64-row x HEAD_DIM float32 tiles (row r of tile i at src[i] + r * stride[i], contiguous)
 * rounded to TF32, each into a K-major SW128 tile at base[i] (32 floats a 128-byte row, HEAD_DIM /
 * 32 panels of 64 rows: wgmma.cuh's sw128_offset) and, where bit i of TRANS is set, transposed into
 * tbase[i]: the B operand of a product over the tile's rows (HEAD_DIM rows of 64 k values, two
 * panels of 32), rows 2t, 2t + 1 of each 8 at k positions t, t + 4 (the order in which a C
 * fragment's columns become an A fragment's k: frag_tf32). Rows at or past valid are zero. A
 * warp moves units of 16 rows x two 16-byte chunks (lane & 15 the row, lane >> 4 the chunk:
 * 32-byte runs of a row), so that each transposed store meets 32 banks (attn_fwd_sm90_f32.cu's
 * V^T) and each plain one 8 rows' 8 chunks; every load of both tiles is issued before any store. */
template <int TRANS>
DEV void load_tf32(const uint32_t (&base)[2], const uint32_t (&tbase)[2], const float *const (&src)[2],
                   const int64_t (&stride)[2], int valid, int tid)
{
    static_assert(T_THREADS == 128, "four warps, a warp's 16 rows");
    constexpr int PER = HEAD_DIM / 8;     /* a warp's units: its 16 rows x every chunk pair */
    const int warp = tid >> 5, lane = tid & 31, r = warp * 16 + (lane & 15), hi = lane >> 4;
    float4 x[2][PER];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < PER; j++)     /* chunk 2j + hi of row r */
            x[i][j] = r < valid ? __ldg((const float4 *)(src[i] + r * stride[i] + (2 * j + hi) * 4))
                                : make_float4(0.f, 0.f, 0.f, 0.f);
    /* The addresses, each a register and an immediate: chunk 2j + hi of row r sits in panel j / 4 at
     * chunk (2 (j % 4) + hi) ^ (r % 8) (sw128_offset); transposed, its element e is row d = 8j + 4 hi
     * + e, whose swizzle takes d % 8 = 4 hi + e, at r's k position kp */
    const int kp = (r & ~7) + ((r & 7) >> 1) + 4 * (r & 1);
    const int x7 = hi ^ (r & 7);
    int te[4];
#pragma unroll
    for (int e = 0; e < 4; e++)
        te[e] = (kp >> 5) * (HEAD_DIM * 128) + (kp & 3) * 4 + (4 * hi + e) * 128 + ((((kp & 31) >> 2) ^ (4 * hi + e)) << 4);
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const uint32_t w[4] = {to_tf32(x[i][j].x), to_tf32(x[i][j].y), to_tf32(x[i][j].z), to_tf32(x[i][j].w)};
            const uint32_t at = base[i] + (j >> 2) * (64 * 128) + r * 128 + (((2 * (j & 3)) ^ x7) << 4);
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                         "r"(w[3]) : "memory");
            if (TRANS >> i & 1) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(tbase[i] + te[e] + j * 8 * 128), "r"(w[e]) : "memory");
            }
        }
}

/* acc (+)= A B^T over k = HEAD_DIM in TF32 (A: 64 rows at a_base, B: 64 rows at b_base, both
 * load_tf32's plain tiles); the caller fences, commits and waits. */
DEV void mma_ss_tf32(float (&acc)[8][4], uint32_t a_base, uint32_t b_base)
{
    const uint64_t da0 = uniform_desc(sw128_desc(a_base, 16, 1024)), db0 = uniform_desc(sw128_desc(b_base, 16, 1024));
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 8; kk++) {
        const uint32_t off = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
        wgmma_m64n64k8_tf32_ss(acc, da0 + desc_step(off), db0 + desc_step(off), kk > 0);
    }
}

/* The C fragments f of a 64 x 64 product (float32) rounded to TF32 as the A fragments of a product
 * over its columns: step kk's k = t, t + 4 hold columns 8 kk + 2t, 2t + 1 (C elements 0, 2 and 1, 3;
 * load_tf32's transposed order). */
DEV void frag_tf32(uint32_t (&a)[8][4], const float (&f)[1][8][4])
{
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        a[kk][0] = to_tf32(f[0][kk][0]);
        a[kk][1] = to_tf32(f[0][kk][2]);
        a[kk][2] = to_tf32(f[0][kk][1]);
        a[kk][3] = to_tf32(f[0][kk][3]);
    }
}

/* acc += A B over k = 64 in TF32 (A: frag_tf32's fragments; B: load_tf32's transposed tile at b_base)
 * into a fresh accumulator added to acc in float32 once waited for: the tensor cores add each
 * product truncated, and these errors of one sign then reach one tile's sum, not a whole row's
 * (attn_bwd_sm90_x3.cu's mma_rs3). */
DEV void mma_rs_tf32(float (&acc)[NTD][4], const uint32_t (&a)[8][4], uint32_t b_base)
{
    float t[NTD][4];
    const uint64_t db0 = uniform_desc(sw128_desc(b_base, 16, 1024));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
        wgmma_m64n64k8_tf32_rs(t, a[kk], db0 + desc_step((kk >> 2) * (HEAD_DIM * 128) + (kk & 3) * 32), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(t);
#pragma unroll
    for (int j = 0; j < NTD; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[j][e] += t[j][e];
}

#if ENTRY(attn_bwd_dkdv_tf32)
extern "C" __global__ void __launch_bounds__(T_THREADS, 1) attn_bwd_dkdv_tf32(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* K, V, Q, dO, Q^T, dO^T (TILE_BYTES each), then the tile's lse and delta rows */
    const uint32_t sK = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sV = sK + TILE_BYTES, sQ = sV + TILE_BYTES, sdO = sQ + TILE_BYTES, sQt = sdO + TILE_BYTES,
                   sdOt = sQt + TILE_BYTES;
    float *sL = (float *)(smem_raw + (sdOt + TILE_BYTES - smem_addr(smem_raw))), *sD = sL + KV_BLOCK_M;

    const int tid = threadIdx.x, warp = tid >> 5;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    if (b == p.B) {                       /* packed rows after the last sequence */
        zero_dkdv_tail(p, hk, T_THREADS);
        return;
    }
    const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
    const int n0 = (int)blockIdx.x * 64, n0w = n0 + warp * 16;
    if (n0 >= sk.rows)
        return;
    const int group = (int)(p.Hq / p.Hk), Lq = (int)sq.len, Lk = (int)sk.len;
    int m_first, nm, qlo[2], qhi[2];
    kv_tile_rows(p, n0, 64, KV_BLOCK_M, n0w, Lq, Lk, m_first, nm, qlo, qhi);
    const int items = group * nm;

    float dk[1][NTD][4], dv[1][NTD][4];
    zero_acc(dk);
    zero_acc(dv);
    if (items > 0)
        load_tf32<0>({sK, sV}, {0u, 0u},
                     {(const float *)p.k.ptr + sk.mem_b * p.k.s[0] + (sk.start + n0) * p.k.s[1] + hk * p.k.s[2],
                      (const float *)p.v.ptr + sk.mem_b * p.v.s[0] + (sk.start + n0) * p.v.s[1] + hk * p.v.s[2]},
                     {p.k.s[1], p.v.s[1]}, Lk - n0, tid);
    for (int j = 0; j < items; j++) {
        const int64_t h = hk * group + j / nm;
        const int m0 = (m_first + j % nm) * KV_BLOCK_M;
        const int64_t row0 = sq.start + m0;
        __syncthreads();                  /* every warp is done with item j - 1's tiles */
        load_tf32<3>({sQ, sdO}, {sQt, sdOt},
                     {(const float *)p.q.ptr + sq.mem_b * p.q.s[0] + row0 * p.q.s[1] + h * p.q.s[2],
                      (const float *)p.dout.ptr + sq.mem_b * p.dout.s[0] + row0 * p.dout.s[1] + h * p.dout.s[2]},
                     {p.q.s[1], p.dout.s[1]}, Lq - m0, tid);
        load_lse_delta(p, sq, h, m0, KV_BLOCK_M, Lq, sL, sD);
        fence_proxy_async();              /* the tiles' stores, before wgmma reads them */
        __syncthreads();

        const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
        const bool need_mask = item_needs_mask(p, sc, n0, 64, m0, KV_BLOCK_M, Lq, Lk);
        float s[1][KV_NT][4], dp[1][KV_NT][4];
        wgmma_fence();
        mma_ss_tf32(s[0], sK, sQ);        /* S^T = K Q^T */
        mma_ss_tf32(dp[0], sV, sdO);      /* dP^T = V dO^T */
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(s[0]);
        fence_acc(dp[0]);

        cfrag<1, KV_NT / 2> pf;           /* P^T in float32 (ELEM_F32's fragments) */
        pt_tile<KV_NT, true>(s, pf, p, sc, sL, n0w, m0, qlo, qhi, need_mask, dp, sD);   /* dS^T into dp */
        uint32_t a[8][4];
        frag_tf32(a, pf);
        mma_rs_tf32(dv[0], a, sdOt);      /* dV += P^T dO */
        frag_tf32(a, dp);
        mma_rs_tf32(dk[0], a, sQt);       /* dK += dS^T Q */
    }
    store_dkdv(p, sk, hk, dk, dv, n0w, true, true);
}
#endif

#if ENTRY(attn_bwd_dq_tf32)
extern "C" __global__ void __launch_bounds__(T_THREADS, 1) attn_bwd_dq_tf32(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* Q, dO (the CTA's rows), K, V, K^T (the key tile) */
    const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sdO = sQ + TILE_BYTES, sK = sdO + TILE_BYTES, sV = sK + TILE_BYTES, sKt = sV + TILE_BYTES;

    const int tid = threadIdx.x;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    dq_cta c;
    if (!dq_cta_begin(p, h, b, Q_BLOCK_M, Q_BLOCK_N, T_THREADS, c))
        return;
    const seq_t &sq = c.sq, &sk = c.sk;
    const int m0 = c.m0, Lq = c.Lq, Lk = c.Lk, n_first = c.n_first, n_last = c.n_last;
    const int64_t hk = c.hk;
    row_info ri;
    load_row_info(p, sq, sk, h, m0, ri);
    const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
    const float *gk = (const float *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
    const float *gv = (const float *)p.v.ptr + sk.mem_b * p.v.s[0] + sk.start * p.v.s[1] + hk * p.v.s[2];

    float dq[1][NTD][4];
    zero_acc(dq);
    if (n_last >= n_first) {
        const int64_t row0 = sq.start + m0;
        load_tf32<0>({sQ, sdO}, {0u, 0u},
                     {(const float *)p.q.ptr + sq.mem_b * p.q.s[0] + row0 * p.q.s[1] + h * p.q.s[2],
                      (const float *)p.dout.ptr + sq.mem_b * p.dout.s[0] + row0 * p.dout.s[1] + h * p.dout.s[2]},
                     {p.q.s[1], p.dout.s[1]}, Lq - m0, tid);
    }
    tile_sums sums;                       /* no array gradients here: an empty one */
    tile_sums_init(sums, nullptr);
    for (int n = n_first; n <= n_last; n++) {
        const int64_t c0 = n * Q_BLOCK_N;
        __syncthreads();                  /* every warp is done with tile n - 1 */
        load_tf32<1>({sK, sV}, {sKt, 0u}, {gk + c0 * p.k.s[1], gv + c0 * p.v.s[1]}, {p.k.s[1], p.v.s[1]},
                     Lk - (int)c0, tid);
        fence_proxy_async();
        __syncthreads();

        float s[1][Q_NT][4], dp[1][Q_NT][4];
        wgmma_fence();
        mma_ss_tf32(s[0], sQ, sK);        /* S = Q K^T */
        mma_ss_tf32(dp[0], sdO, sV);      /* dP = dO V^T */
        wgmma_commit();
        const bool need = ds_needs_mask(p, sc, m0, (int)c0, Lq, Lk);   /* while the products run */
        wgmma_wait<0>();
        fence_acc(s[0]);
        fence_acc(dp[0]);
        ds_tile<true, false>(s, dp, p, sc, ri, m0, (int)c0, need, Lq, Lk, tile_sums_for<false>(sums, sc, m0, (int)c0, Lq, Lk));
        uint32_t a[8][4];
        frag_tf32(a, s);
        mma_rs_tf32(dq[0], a, sKt);       /* dQ += dS K */
    }

    store_dq_f32(p, sq, h, m0, dq[0], sc.scale);   /* padding rows (and rows that keep nothing) come out 0 */
}
#endif
