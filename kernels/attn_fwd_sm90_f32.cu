/* Float32 attention forward for Hopper (sm_90a): both products on warpgroup TF32 tensor-core
 * instructions (wgmma m64nNk8), each operand split into TF32 parts x = hi + lo in shared memory
 * once per CTA, so that hi*hi + hi*lo + lo*hi carries float32's accuracy (TF32_PASSES 3; 1: hi*hi
 * alone, precision="tf32").
 *
 *   q (B, Sq, Hq, D)  k (B, Sk, Hk, D)  v (B, Sk, Hk, Dv)  ->  out (B, Sq, Hq, Dv), lse (B, Hq, Sq)
 *
 * Grid (query tiles, Hq, B [+1 under varlen]) as attn_fwd.cu. Block: NUM_WARPS 8 (one splitter
 * warpgroup, then the computing one) or 12 (two splitters, which lower their registers for the
 * computing warpgroup's: select.SM90_TILE_F32).
 *   The splitters (SPLITTERS threads) read Q's 64 rows, then each 64-key tile's K and V (last to
 *   first, inside the causal / window band) from global memory into registers as four 32-key
 *   pieces (K0 K1 V0 V1), and write their parts: Q and K as 128-byte swizzled K-major tiles
 *   (wgmma.cuh), V transposed (TF32 has no transposed B operand) in two panels of 32 keys: row d
 *   of a panel holds its keys, keys 2t, 2t + 1 of each 8 at k positions t, t + 4, the order in
 *   which S's C fragments hand P's values to the A operand of P V. Each piece is reloaded with
 *   the next tile's as soon as it is stored, so the loads of tile i + 1 run while the splitters
 *   wait for tile i's slots. Key rows past Lk are zeros. Two rings: K's parts in K_STAGES slots,
 *   V^T's in STAGES (full when the SPLITTERS threads have written and fenced a tile's K or V; K's
 *   slot empty once the computing warpgroup's S of it is done, V's once its P V is).
 *   The computing warpgroup (64 rows) runs each tile in turn: S = Q K^T, the softmax
 *   (attn_fwd_tile.cuh, the other kernels' code), O's rescale, P's parts, P V into a fresh
 *   accumulator added to O. Nothing is in flight across the loop's back edge (ptxas serialises
 *   every wgmma of a loop that a wgmma is in flight around), and the registers hold O, F and P's
 *   parts at once (64 + 64 + 64 at D128), with no second S. This beat w4's 32-key tiles with S of
 *   tile i under tile i - 1's end by 16% at D128 on an H200 (bench/NOTES.md, float32 forward w5):
 *   the 64-key S reads Q's parts once per 64 keys, not per 32.
 * Accuracy: the tensor cores add each product into the accumulator truncated, so errors of one
 * sign pile up in a large sum: S's small products are summed first, then the hi * hi steps meet
 * that sum once each (as many truncations as attn_fwd.cu's mma_abt_f32, whose small products
 * have an accumulator of their own: a register file short here), and each tile's P V goes into a
 * fresh accumulator (its small products first) added to O in float32.
 *
 * Applies to VEC_LOAD inputs with D and Dv in {64, 128} (select.fwd_f32_sm90 chooses); every option
 * of the score hook, masks, causal / window and varlen as attn_fwd.cu. Switches beyond
 * attn_common.cuh's: BLOCK_M (64), BLOCK_N (64), NUM_WARPS (8, 12), STAGES, K_STAGES (STAGES when
 * not given: select.fwd_defines).
 */
#include "attn_fwd_tile.cuh"
#include "wgmma.cuh"
#include "sm90_pipe.cuh"

#if !ELEM_F32 || !(HEAD_DIM == 64 || HEAD_DIM == 128) || !(HEAD_DIM_V == 64 || HEAD_DIM_V == 128) || !VEC_LOAD \
    || PACK_GQA || SPLIT_KV || BLOCK_M != 64 || BLOCK_N != 64
#error "attn_fwd_sm90_f32: float32, D and Dv in {64, 128}, 16-byte loads, 64 x 64 tiles, no decode switches"
#endif
#ifndef STAGES
#define STAGES 1
#endif
#if NUM_WARPS != 8 && NUM_WARPS != 12
#error "attn_fwd_sm90_f32: one or two splitter warpgroups, then the computing one (NUM_WARPS 8 or 12)"
#endif
#define THREADS (NUM_WARPS * 32)           /* the splitter warpgroups, then the computing one */
#define SPLITTERS (THREADS - 128)          /* the splitters' threads */
#define SPLIT_WG (SPLITTERS / 128)
/* Two splitter warpgroups give registers to the computing one (setmaxnreg): a raise waits until
 * the lowered ones free enough of the CTA's launch allocation (168 a thread for 384 threads), so
 * the two sums must fit it, or the computing warpgroup waits forever. */
#define SPLIT_REGS 128
#define COMPUTE_REGS 248
#if SPLIT_WG == 2 && SPLITTERS * SPLIT_REGS + 128 * COMPUTE_REGS > THREADS * 168
#error "attn_fwd_sm90_f32: the warpgroups' registers exceed the launch allocation"
#endif
#define NT (BLOCK_N / 8)                  /* n8 column groups of S per warp; k8 steps of P V */
#define OT (HEAD_DIM_V / 8)               /* n8 column groups of O per warp */
#define PARTS (TF32_PASSES == 3 ? 2 : 1)  /* hi (and lo) tiles of each operand */
#define QP_BYTES (BLOCK_M * HEAD_DIM * 4) /* one part of Q */
#define KP_BYTES (BLOCK_N * HEAD_DIM * 4)
#define VP_BYTES (BLOCK_N * HEAD_DIM_V * 4)
#ifndef K_STAGES                          /* K's ring */
#define K_STAGES STAGES
#endif
#define K_SLOT (PARTS * KP_BYTES)
#define V_SLOT (PARTS * VP_BYTES)
#define KL (32 * HEAD_DIM / 4 / SPLITTERS)   /* a splitter thread's 16-byte loads of a 32-key piece of K */
#define VL (32 * HEAD_DIM_V / 4 / SPLITTERS) /* ... and of V */

/* F (+)= P V for one k8 step (8 keys), P's part from registers. */
DEV void pv_step(float (&f)[OT][4], const uint32_t (&a)[4], uint64_t dv, int accumulate)
{
#if HEAD_DIM_V == 128
    wgmma_m64n128k8_tf32_rs(f, a, dv, accumulate);
#else
    wgmma_m64n64k8_tf32_rs(f, a, dv, accumulate);
#endif
}

/* x's TF32 parts at hi and hi + lo_off (shared addresses): hi = x rounded, lo = (x - hi) rounded. */
DEV void store_parts4(uint32_t hi, uint32_t lo_off, float4 x)
{
    uint32_t h[4], l[4];
    split_tf32(x.x, h[0], l[0]);
    split_tf32(x.y, h[1], l[1]);
    split_tf32(x.z, h[2], l[2]);
    split_tf32(x.w, h[3], l[3]);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(hi), "r"(h[0]), "r"(h[1]), "r"(h[2]), "r"(h[3])
                 : "memory");
#if PARTS == 2
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(hi + lo_off), "r"(l[0]), "r"(l[1]), "r"(l[2]),
                 "r"(l[3]) : "memory");
#endif
}

DEV void store_parts1(uint32_t hi, uint32_t lo_off, float x)
{
    uint32_t h, l;
    split_tf32(x, h, l);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(hi), "r"(h) : "memory");
#if PARTS == 2
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(hi + lo_off), "r"(l) : "memory");
#endif
}

DEV float4 load4(const float *src, bool ok)
{
    return ok ? __ldg((const float4 *)src) : make_float4(0.f, 0.f, 0.f, 0.f);
}

/* A 32-key half of a tile's K or V as a splitter thread holds it between its loads and its stores.
 * K: 16-byte chunk c = tid % (D / 4) of rows tid / (D / 4) + j SPLITTERS / (D / 4). V: units of
 * 16 keys x 2 chunks (lane & 15 the key, lane >> 4 the chunk), unit u = warp + (SPLITTERS / 32) j:
 * keys 16 (u % 2).., chunks 2 (u / 2).. (32-byte runs of a row, a whole sector). Each store of V^T
 * then meets 32 banks: 4 key columns a 16-byte chunk, 8 chunks by the swizzle of 2 rows' parities. */
DEV void load_k(float4 (&x)[KL], const float *gk, int64_t ks, int c0, int Lk, int tid)
{
    constexpr int CH = HEAD_DIM / 4, RS = SPLITTERS / CH;
#pragma unroll
    for (int j = 0; j < KL; j++) {
        const int r = tid / CH + j * RS;
        x[j] = load4(gk + (c0 + r) * ks + (tid % CH) * 4, c0 + r < Lk);
    }
}

DEV void load_v(float4 (&x)[VL], const float *gv, int64_t vs, int c0, int Lk, int tid)
{
    const int warp = tid >> 5, kl = tid & 15, cq = (tid >> 4) & 1;
#pragma unroll
    for (int j = 0; j < VL; j++) {
        const int u = warp + (SPLITTERS / 32) * j, key = (u % 2) * 16 + kl, c = (u / 2) * 2 + cq;
        x[j] = load4(gv + (c0 + key) * vs + c * 4, c0 + key < Lk);
    }
}

/* Half `half` of a K slot's 64 rows at sK (hi, then lo). */
DEV void store_k(const float4 (&x)[KL], uint32_t sK, int half, int tid)
{
    constexpr int CH = HEAD_DIM / 4, RS = SPLITTERS / CH;
#pragma unroll
    for (int j = 0; j < KL; j++)
        store_parts4(sK + sw128_offset<BLOCK_N>(32 * half + tid / CH + j * RS, tid % CH), KP_BYTES, x[j]);
}

/* Half `half` of a V^T slot at sV: its panel of 32 keys (hi, then lo). */
DEV void store_v(const float4 (&x)[VL], uint32_t sV, int half, int tid)
{
    const int warp = tid >> 5, kl = tid & 15, cq = (tid >> 4) & 1;
    sV += half * (HEAD_DIM_V * 128);
#pragma unroll
    for (int j = 0; j < VL; j++) {
        const int u = warp + (SPLITTERS / 32) * j, key = (u % 2) * 16 + kl;
        const int kp = (key & ~7) + ((key & 7) >> 1) + 4 * (key & 1);
        const int c = (u / 2) * 2 + cq;
        const float e[4] = {x[j].x, x[j].y, x[j].z, x[j].w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int d = 4 * c + i;                     /* V^T's row: 128 bytes of 32 keys, swizzled */
            store_parts1(sV + d * 128 + (((kp >> 2) ^ (d & 7)) << 4) + (kp & 3) * 4, VP_BYTES, e[i]);
        }
    }
}

#if ENTRY(attn_fwd_sm90_f32)
extern "C" __global__ void __launch_bounds__(THREADS, 1) attn_fwd_sm90_f32(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* Q's parts, K_STAGES slots of K's (hi, lo), STAGES of V^T's, then the barriers: q_full, and
     * full and empty a slot; 1024-byte aligned (select.fwd_smem_bytes adds the slack) */
    const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sK = sQ + PARTS * QP_BYTES, sV = sK + K_STAGES * K_SLOT, bars = sV + STAGES * V_SLOT;
    const uint32_t q_full = bars, k_full = bars + 8, k_empty = k_full + 8 * K_STAGES;
    const uint32_t v_full = k_empty + 8 * K_STAGES, v_empty = v_full + 8 * STAGES;

    const int tid = threadIdx.x, warp = uniform_warp_index(), wg = warp >> 2;
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
    const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
    mod_narrow(sc, 1, true, m0, r_end, BLOCK_N, Lk, n_first, n_last);   /* mask_mod's empty end tiles */

    if (tid == 0) {
        mbar_init(q_full, SPLITTERS);
        for (int st = 0; st < K_STAGES; st++) {
            mbar_init(k_full + 8 * st, SPLITTERS);
            mbar_init(k_empty + 8 * st, 128);
        }
        for (int st = 0; st < STAGES; st++) {
            mbar_init(v_full + 8 * st, SPLITTERS);
            mbar_init(v_empty + 8 * st, 128);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg < SPLIT_WG) {                                 /* the splitters */
#if SPLIT_WG == 2
        regs_lower<SPLIT_REGS>();
#endif
        if (n_last < n_first)
            return;
        const float *gq = (const float *)p.q.ptr + sq.mem_b * p.q.s[0] + sq.start * p.q.s[1] + h * p.q.s[2];
        const float *gk = (const float *)p.k.ptr + sk.mem_b * p.k.s[0] + sk.start * p.k.s[1] + hk * p.k.s[2];
        const float *gv = (const float *)p.v.ptr + sk.mem_b * p.v.s[0] + sk.start * p.v.s[1] + hk * p.v.s[2];
        const int64_t ks = p.k.s[1], vs = p.v.s[1];
        float4 k0[KL], k1[KL], v0[VL], v1[VL];
        load_k(k0, gk, ks, n_last * BLOCK_N, Lk, tid);
        load_k(k1, gk, ks, n_last * BLOCK_N + 32, Lk, tid);
        load_v(v0, gv, vs, n_last * BLOCK_N, Lk, tid);
        load_v(v1, gv, vs, n_last * BLOCK_N + 32, Lk, tid);
        {   /* Q's 64 rows, rows past the real ones zero */
            constexpr int CH = HEAD_DIM / 4, RS = SPLITTERS / CH;
#pragma unroll 4
            for (int j = 0; j < BLOCK_M / RS; j++) {
                const int r = tid / CH + j * RS;
                store_parts4(sQ + sw128_offset<BLOCK_M>(r, tid % CH), QP_BYTES,
                             load4(gq + (m0 + r) * p.q.s[1] + (tid % CH) * 4, m0 + r < r_end));
            }
            fence_proxy_async();
            mbar_arrive(q_full);
        }
        for (int i = 0, n = n_last; n >= n_first; i++, n--) {
            const int kt = i % K_STAGES, vt = i % STAGES, c1 = (n - 1) * BLOCK_N;
            const bool more = n > n_first;
            if (i >= K_STAGES)
                mbar_wait(k_empty + 8 * kt, (i / K_STAGES - 1) & 1);
            store_k(k0, sK + kt * K_SLOT, 0, tid);
            if (more)
                load_k(k0, gk, ks, c1, Lk, tid);
            store_k(k1, sK + kt * K_SLOT, 1, tid);
            if (more)
                load_k(k1, gk, ks, c1 + 32, Lk, tid);
            fence_proxy_async();
            mbar_arrive(k_full + 8 * kt);
            if (i >= STAGES)
                mbar_wait(v_empty + 8 * vt, (i / STAGES - 1) & 1);
            store_v(v0, sV + vt * V_SLOT, 0, tid);
            if (more)
                load_v(v0, gv, vs, c1, Lk, tid);
            store_v(v1, sV + vt * V_SLOT, 1, tid);
            if (more)
                load_v(v1, gv, vs, c1 + 32, Lk, tid);
            fence_proxy_async();
            mbar_arrive(v_full + 8 * vt);
        }
        return;
    }

    /* the computing warpgroup: its warp w (of 4) owns rows 16w.. of the tile */
#if SPLIT_WG == 2
    regs_raise<COMPUTE_REGS>();
#endif
    const int row0 = m0 + (warp - SPLITTERS / 32) * 16;
    float o[1][OT][4];
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    zero_acc(o);
    if (n_last < n_first) {
        write_out(p, sq, sc.to_natural, o, m, l, row0, b, h, 1, 0, Lq);
        return;
    }
    /* S = Q K^T of K's slot st: the small products first, then hi * hi (the accumulator's
     * truncating adds then meet the small sum once, not at every step) */
    auto issue_s = [&](float (&s)[1][NT][4], int st) {
        const uint64_t dk0 = uniform_desc(sw128_desc(sK + st * K_SLOT, 16, 1024));
        /* Q's base made opaque at each issue: from a loop-invariant one, ptxas hoists S's 48 Q
         * descriptors out of the loop into vector registers (the uniform file cannot hold them),
         * 140 B spilled at D128 against 88, and 29% less TFLOP/s (bench/NOTES.md, float32 w4) */
        uint32_t q_at;
        asm volatile("mov.b32 %0, %1;" : "=r"(q_at) : "r"(sQ));
        const uint64_t dq0 = uniform_desc(sw128_desc(q_at, 16, 1024));
        /* k8 step kk of Q's part (q_part: 0 hi, QP_BYTES lo) times K's (k_part likewise) */
        auto step = [&](int kk, uint32_t q_part, uint32_t k_part, int accumulate) {
            const uint32_t qa = (kk >> 2) * (BLOCK_M * 128) + (kk & 3) * 32, ka = (kk >> 2) * (BLOCK_N * 128) + (kk & 3) * 32;
            wgmma_m64n64k8_tf32_ss(s[0], dq0 + desc_step(q_part + qa), dk0 + desc_step(k_part + ka), accumulate);
        };
        wgmma_fence();
#if PARTS == 2
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 8; kk++) {
            step(kk, 0, KP_BYTES, kk > 0);
            step(kk, QP_BYTES, 0, 1);
        }
#endif
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 8; kk++)
            step(kk, 0, 0, PARTS == 2 || kk > 0);
        wgmma_commit();
    };
    /* F = P V of V's slot st, P's parts in registers (ph, pl): the small products first */
    float f[OT][4];
    auto issue_pv = [&](const uint32_t (&ph)[NT][4], const uint32_t (&pl)[NT][4], int st) {
        const uint64_t dv0 = uniform_desc(sw128_desc(sV + st * V_SLOT, 16, 1024));
        wgmma_fence();
#if PARTS == 2
#pragma unroll
        for (int kk = 0; kk < NT; kk++) {
            const uint32_t vo = (kk >> 2) * (HEAD_DIM_V * 128) + (kk & 3) * 32;
            pv_step(f, ph[kk], dv0 + desc_step(VP_BYTES + vo), kk > 0);
            pv_step(f, pl[kk], dv0 + desc_step(vo), 1);
        }
#endif
#pragma unroll
        for (int kk = 0; kk < NT; kk++)
            pv_step(f, ph[kk], dv0 + desc_step((kk >> 2) * (HEAD_DIM_V * 128) + (kk & 3) * 32), PARTS == 2 || kk > 0);
        wgmma_commit();
    };
    /* tile n's scores in s become P; corrs: O's factors */
    auto softmax = [&](float (&s)[1][NT][4], int n, float (&corrs)[2]) {
        const bool need = tile_needs_mask(p, sc, m0, BLOCK_M, r_end, n * BLOCK_N, BLOCK_N, 1, Lq, Lk);
        score_tile(p, sc, s, row0, n * BLOCK_N, need, 1, Lq, Lk);
        softmax_update(s, m, l, corrs, sc.to_log2);
    };
    /* P's parts as the A operand: k = t, t + 4 of step kk hold keys 2t, 2t + 1 (C fragment
     * elements 0, 2 and 1, 3); written only once the P V that reads the last ones is done */
    auto p_parts = [&](const float (&s)[1][NT][4], uint32_t (&ph)[NT][4], uint32_t (&pl)[NT][4]) {
#pragma unroll
        for (int kk = 0; kk < NT; kk++) {
            const float a[4] = {s[0][kk][0], s[0][kk][2], s[0][kk][1], s[0][kk][3]};
#pragma unroll
            for (int e = 0; e < 4; e++)
                split_tf32(a[e], ph[kk][e], pl[kk][e]);
        }
    };
    /* O += F, this tile's P V */
    auto add_f = [&]() {
#pragma unroll
        for (int j = 0; j < OT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[0][j][e] += f[j][e];
    };

    const int tiles = n_last - n_first + 1;
    uint32_t ph[NT][4], pl[NT][4];
    float sa[1][NT][4], corrs[2];
    mbar_wait(q_full, 0);
    for (int i = 0; i < tiles; i++) {
        mbar_wait(k_full + 8 * (i % K_STAGES), (i / K_STAGES) & 1);
        issue_s(sa, i % K_STAGES);
        wgmma_wait<0>();
        fence_acc(sa[0]);
        mbar_arrive(k_empty + 8 * (i % K_STAGES));
        softmax(sa, n_last - i, corrs);
        rescale_o(o, corrs);
        p_parts(sa, ph, pl);
        mbar_wait(v_full + 8 * (i % STAGES), (i / STAGES) & 1);
        issue_pv(ph, pl, i % STAGES);
        wgmma_wait<0>();
        fence_acc(f);
        mbar_arrive(v_empty + 8 * (i % STAGES));
        add_f();
    }
    write_out(p, sq, sc.to_natural, o, m, l, row0, b, h, 1, 0, Lq);
}
#endif
