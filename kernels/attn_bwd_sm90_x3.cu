/* Float32 attention backward for Hopper (sm_90a) on the bfloat16 tensor cores: each float32
 * operand x split into three bfloat16 planes x = x0 + x1 + x2 (x0 = bf16(x), x1 = bf16(x - x0),
 * x2 = bf16(x - x0 - x1): 24 bits, float32's), and each product taken as the six plane products
 * of order <= 2 (x0 y0, x0 y1, x1 y0, x0 y2, x2 y0, x1 y1; bench/labs/lab_split.py: 6.5e-9 against
 * NumPy float32's 5.7e-7), on the 16-bit kernels' wgmma and layouts, whose operands may be read
 * transposed (TF32's may not: attn_fwd_sm90_f32.cu). precision="tf32" (TF32_PASSES 1) takes two
 * planes (16 bits, past TF32's 11) and the three products of order <= 1. Hopper's float32
 * backward where it applies (select.bwd_f32_x3; ATTNEXT_BWD_F32_X3=0 leaves it); every tile split
 * by the CTA's threads as it is loaded, no loads in flight under the products (bench/NOTES.md,
 * float32 backward x1-x6).
 *
 *   attn_bwd_dkdv_x3  one CTA per (64 keys, kv head, sequence): K's and V's planes stay; the
 *                     query tiles (64 rows) of every query head of the GQA group come past in
 *                     turn, Q's and dO's planes split into shared memory: S^T = K Q^T and dP^T
 *                     = V dO^T, P^T and dS^T (attn_bwd_tile.cuh's pt_tile, in float32), their
 *                     planes as register A fragments, dV += P^T dO and dK += dS^T Q; one
 *                     warpgroup, or two (KV_WARPS 8: one for dV's products, one for dK's).
 *                     DQ_ATOMIC (two warpgroups, D = 128): also each item's dQ partial
 *                     dQ^T = K^T dS^T, added into dq_accum by a bulk reduction (DQ_ORDERED: in
 *                     the key blocks' turns, attn_bwd_tile.cuh), attn_bwd_dq_convert writing dq.
 *   attn_bwd_dq_x3    (without DQ_ATOMIC) one CTA per (64 query rows, head, sequence) over its
 *                     key tiles (64 keys): S = Q K^T, dP = dO V^T, dS (ds_tile), dQ += dS K;
 *                     one warpgroup (two, one for S and one for dP passing tiles through shared
 *                     memory, measured 8% slower at D = 128: bench/NOTES.md, float32 backward x3).
 * Deterministic: each dK, dV and recomputed dQ element is summed by the one CTA that owns its row,
 * in order; dQ's additions in the ordered turns; deterministic=False only adds them as they land.
 * delta (attn_bwd_pre) and rows that keep no key (attn_bwd_dead) are attn_bwd.cu's float32
 * kernels'. Applies to float32 VEC_LOAD inputs with D = Dv in {64, 128}, every option of the
 * score hook and masks, no generated mods (select.bwd_f32_x3).
 *
 * Switches: ELEM_F32 and ELEM_BF16 both 1 (float32 in memory, bfloat16 planes on the tensor
 * cores), KV_BLOCK_M = Q_BLOCK_M = Q_BLOCK_N = 64, Q_WARPS = 4, KV_WARPS 4 or 8
 * (select.bwd_x3_kv_warps).
 */
#include "attn_bwd_tile.cuh"
#include "sm90_pipe.cuh"
#include "wgmma.cuh"

#if !ELEM_F32 || !ELEM_BF16 || !(HEAD_DIM == 64 || HEAD_DIM == 128) || HEAD_DIM_V != HEAD_DIM || !VEC_LOAD \
    || KV_BLOCK_M != 64 || (KV_WARPS != 4 && KV_WARPS != 8) || Q_BLOCK_M != 64 || Q_BLOCK_N != 64 || Q_WARPS != 4 || HAS_SCORE_MOD \
    || HAS_MASK_MOD
#error "attn_bwd_sm90_x3: float32 (bf16 planes), D = Dv in {64, 128}, 16-byte loads, 64 x 64 tiles, 4 or 8 dK/dV warps"
#endif
#if TF32_PASSES != 3 && TF32_PASSES != 1
#error "attn_bwd_sm90_x3: three planes (TF32_PASSES 3) or two (1)"
#endif
#if DQ_ATOMIC && (KV_WARPS != 8 || HEAD_DIM != 128)
#error "attn_bwd_sm90_x3: DQ_ATOMIC at D = 128 with two dK/dV warpgroups"
#endif
#if DQ_ORDERED && DQ_TILE_M != 64 || DQ_CHAINS > 1 && DQ_KEY_BLOCK != 64
#error "attn_bwd_sm90_x3: the ordered turns' query tiles and key blocks are this kernel's 64 rows"
#endif

#define X3_THREADS 128                    /* the dQ kernel's */
#define KV_THREADS (KV_WARPS * 32)        /* the dK/dV kernel's: one warpgroup or two */
/* The dK/dV kernel's passing region: P^T score_grad from the first warpgroup to the second (a
 * 64 x 64 float32 tile); DQ_ATOMIC also, in turn, dS^T's planes (64 x 64 bf16 each) and the
 * item's dQ partial (64 rows x 128 floats) */
#define XBUF_BYTES (KV_WARPS == 8 ? (DQ_ATOMIC ? 2 * 64 * 64 * 4 : 64 * 64 * 4) : 0)
#define DS_PLANE_BYTES (64 * 64 * 2)
#define PLANE_BYTES (64 * HEAD_DIM * 2)   /* one bf16 plane of a 64-row tile */
/* Each float32 value as three bfloat16 planes (24 bits: float32's accuracy, TF32_PASSES 3) or two
 * (16 bits, past TF32's 11: precision="tf32", TF32_PASSES 1), each product as the plane products
 * of order < PLANES: products [FIRST_PRODUCT, 6) of plane_a / plane_b's list, six or three */
#define PLANES (TF32_PASSES == 3 ? 3 : 2)
#define FIRST_PRODUCT (PLANES == 3 ? 0 : 3)
#define TILE_BYTES (PLANES * PLANE_BYTES) /* a tile's planes, one after another */
#define NTD (HEAD_DIM / 8)                /* n8 column groups of dK, dV, dQ per warp */

/* Product x of the six plane products of order <= 2, the small ones first (the last three: those
 * of order <= 1): A's plane, B's plane. */
DEV constexpr int plane_a(int x) { return x == 1 || x == 3 || x == 5 ? 0 : x == 2 ? 2 : 1; }
DEV constexpr int plane_b(int x) { return x == 2 || x == 4 || x == 5 ? 0 : x == 1 ? 2 : 1; }

/* x's three bfloat16 planes (round to nearest each: x0 + x1 + x2 holds x's 24 bits) as the
 * 16-bit halves of three pair words: lo and hi the pair's two values */
DEV void split3(float lo, float hi, uint32_t (&w)[3])
{
    w[0] = pack2(lo, hi);
    const float l1 = lo - bf16_to_f32((uint16_t)w[0]), h1 = hi - bf16_to_f32((uint16_t)(w[0] >> 16));
    w[1] = pack2(l1, h1);
    w[2] = pack2(l1 - bf16_to_f32((uint16_t)w[1]), h1 - bf16_to_f32((uint16_t)(w[1] >> 16)));
}

/* Two ROWS x COLS float32 tiles (row r of tile i at src[i] + r * stride[i], contiguous) split
 * into PLANES SW128 bf16 planes each, at base[i], + PLANE_BYTES, .. (wgmma.cuh's
 * layout: load_sw128's for 16-bit tiles); rows at or past valid are zero. Each thread converts
 * 8 floats of a row (two 16-byte loads) into one 16-byte chunk a plane. The loads of BATCH rows
 * of both tiles are issued before any of their stores (16 in flight a thread: the stores' asm
 * keeps later loads behind them, so a loop of load, split, store would wait out each load). */
template <int ROWS, int COLS, int THREADS>
DEV void load_split_sw128(const uint32_t (&base)[2], const float *const (&src)[2], const int64_t (&stride)[2],
                          int valid, int tid)
{
    constexpr int CHUNKS = COLS / 8, STEP = THREADS / CHUNKS, BATCH = ROWS / STEP < 4 ? ROWS / STEP : 4;
    static_assert(THREADS % CHUNKS == 0 && ROWS % (STEP * BATCH) == 0, "tile and block do not fit");
    const int r0 = tid / CHUNKS, c = tid % CHUNKS;
#pragma unroll 1
    for (int j0 = 0; j0 < ROWS / STEP; j0 += BATCH) {
        float4 x[BATCH][2][2];
#pragma unroll
        for (int u = 0; u < BATCH; u++) {
            const int r = r0 + (j0 + u) * STEP;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                x[u][i][0] = x[u][i][1] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (r < valid) {
                    const float *row = src[i] + r * stride[i] + c * 8;
                    x[u][i][0] = __ldg((const float4 *)row);
                    x[u][i][1] = __ldg((const float4 *)(row + 4));
                }
            }
        }
#pragma unroll
        for (int u = 0; u < BATCH; u++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const float4 a = x[u][i][0], b = x[u][i][1];
                uint32_t w0[3], w1[3], w2[3], w3[3];
                split3(a.x, a.y, w0);
                split3(a.z, a.w, w1);
                split3(b.x, b.y, w2);
                split3(b.z, b.w, w3);
                const uint32_t at = base[i] + sw128_offset<ROWS>(r0 + (j0 + u) * STEP, c);
#pragma unroll
                for (int x3 = 0; x3 < PLANES; x3++)
                    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(at + x3 * PLANE_BYTES),
                                 "r"(w0[x3]), "r"(w1[x3]), "r"(w2[x3]), "r"(w3[x3]) : "memory");
            }
    }
}

/* acc (+)= A B^T over the plane products (A: 64 rows at a_base, B: N rows at b_base, both PLANES
 * planes of K-major SW128 tiles over k = HEAD_DIM, 64-row planes). */
template <int N>
DEV void mma_ss3(float (&acc)[N / 8][4], uint32_t a_base, uint32_t b_base)
{
#pragma unroll
    for (int x = FIRST_PRODUCT; x < 6; x++) {
        const uint64_t da0 = uniform_desc(sw128_desc(a_base + plane_a(x) * PLANE_BYTES, 16, 1024)),
                       db0 = uniform_desc(sw128_desc(b_base + plane_b(x) * PLANE_BYTES, 16, 1024));
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
            const uint32_t off = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
            wgmma_m64n64_ss(acc, da0 + desc_step(off), db0 + desc_step(off), x > FIRST_PRODUCT || kk > 0);
        }
    }
}

/* acc[0 .. N / 8) += A B over the plane products: A's planes as register fragments
 * (a[plane][k16 step]), B N columns of a 64-row tile's planes at b_base (a 64-column chunk
 * of them apart from the first: + 64 * 128 bytes each) read transposed (MN-major). The products
 * go into a fresh accumulator, the small ones first, added to acc in float32 once waited for:
 * the tensor cores add each product truncated (rounded toward zero), and errors of one sign
 * piling up in a sum over every key tile (or query tile) would reach 1e-5 at S4k (session 48);
 * here they reach one tile's sum, and the order of the big product's four steps only. */
template <int N, int NJ>
DEV void mma_rs3(float (&acc)[NJ][4], const uint32_t (&a)[3][4][4], uint32_t b_base)
{
    static_assert(N == 64 || N == 128, "n64 or n128 wgmma");
    float t[N / 8][4];
    wgmma_fence();
#pragma unroll
    for (int x = FIRST_PRODUCT; x < 6; x++) {
        const uint64_t db0 = uniform_desc(sw128_desc(b_base + plane_b(x) * PLANE_BYTES, 64 * 128, 1024));
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            if constexpr (N == 128)
                wgmma_m64n128_rs_t(t, a[plane_a(x)][kk], db0 + desc_step(kk * 16 * 128), x > FIRST_PRODUCT || kk > 0);
            else
                wgmma_m64n64_rs_t(t, a[plane_a(x)][kk], db0 + desc_step(kk * 16 * 128), x > FIRST_PRODUCT || kk > 0);
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(t);
#pragma unroll
    for (int j = 0; j < N / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[j][e] += t[j][e];
}

/* acc += A B (mma_rs3) over HEAD_DIM columns, 64 at a time (at D128 half the temporary registers
 * of one n128 product: the dK/dV kernel's are short) */
DEV void mma_rs3_by64(float (&acc)[NTD][4], const uint32_t (&a)[3][4][4], uint32_t b_base)
{
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 64; c++)
        mma_rs3<64>(*(float (*)[8][4])acc[c * 8], a, b_base + c * (64 * 128));
}

/* The C fragments f of a 64 x 64 product (float32) as the planes' A fragments of the next
 * product (pack_frag's order, a plane at a time) */
DEV void split_frag(uint32_t (&a)[3][4][4], const float (&f)[1][8][4])
{
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float *c = f[0][2 * kk + (e >> 1)];
            uint32_t w[3];
            split3(c[(e & 1) * 2], c[(e & 1) * 2 + 1], w);
#pragma unroll
            for (int x = 0; x < PLANES; x++)
                a[x][kk][e] = w[x];
        }
}

#if DQ_ATOMIC
/* dS^T's fragments (float32: rows the warp's 16 keys, columns the item's 64 query rows) as PLANES
 * bf16 planes at base, DS_PLANE_BYTES apart, each an SW128 tile of 64 key rows x 64 columns
 * (wgmma.cuh's sw128_offset: a pair of columns a 4-byte store, the 8 rows of a store 8 chunks:
 * no bank conflict) */
DEV void store_ds_planes(uint32_t base, const float (&f)[1][KV_NT][4])
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, r0 = ((threadIdx.x >> 5) & 3) * 16 + g;
#pragma unroll
    for (int nt = 0; nt < KV_NT; nt++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = r0 + half * 8;
            uint32_t w[3];
            split3(f[0][nt][2 * half], f[0][nt][2 * half + 1], w);
            const uint32_t at = base + sw128_offset<64>(r, nt) + 4 * t;
#pragma unroll
            for (int x = 0; x < PLANES; x++)
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(at + x * DS_PLANE_BYTES), "r"(w[x]) : "memory");
        }
}

/* The item's dQ partial for the CTA's 64 keys, dQ^T = K^T dS^T over the plane products (both
 * operands MN-major, as attn_bwd_sm90.cu's dS K: K's planes as loaded, warpgroup wg's 64-column
 * chunk of them; dS^T's planes at region), into a fresh accumulator; staged in the region once
 * both warpgroups have read dS^T (64 rows of HEAD_DIM floats in dq_accum's column order, dq_col:
 * warpgroup wg's columns [64 wg, 64 wg + 64)), fenced for the bulk copy engine and the CTA
 * synchronised: warp 0 then hands it on (dq_issue). */
DEV void stage_dq_partial(uint32_t sK, uint32_t region, float *region_ptr, int wg)
{
    float t[8][4];
    wgmma_fence();
#pragma unroll
    for (int x = FIRST_PRODUCT; x < 6; x++) {
        const uint64_t da0 = uniform_desc(sw128_desc(sK + plane_a(x) * PLANE_BYTES + wg * (64 * 128), 64 * 128, 1024)),
                       db0 = uniform_desc(sw128_desc(region + plane_b(x) * DS_PLANE_BYTES, 64 * 128, 1024));
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_m64n64_ss_tt(t, da0 + desc_step(kk * 16 * 128), db0 + desc_step(kk * 16 * 128),
                               x > FIRST_PRODUCT || kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(t);
    __syncthreads();                      /* both warpgroups' reads of dS^T done: the partial takes its place */
    const int ctid = threadIdx.x & 127, lane = ctid & 31, g = lane >> 2, tq = lane & 3;
    const int d0 = wg * 64 + (ctid >> 5) * 16 + g;   /* the fragment's rows: dQ's columns d0, d0 + 8 */
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = nt * 8 + 2 * tq + (e & 1);   /* m0 is a multiple of 64: dq_col's row bits */
            region_ptr[r * HEAD_DIM + dq_col(r, d0 + (e >> 1) * 8)] = t[nt][e];
        }
    fence_proxy_async();                  /* the stores, before the bulk engine reads them */
    __syncthreads();
}

/* Warp 0 (lane 0 issues): the staged partial (region) into dq_accum's rows [m0, m0 + 64) of head
 * h by one bulk copy (a head's rows are one block: backend.py). DQ_ORDERED: at the key block's
 * turn (sem_wait: attn_bwd_tile.cuh), its chain's first turn storing (DQ_STORE_FIRST), the others
 * adding, the same order every run; otherwise added whenever it lands. */
DEV void dq_issue(const attn_params &p, const seq_t &sq, int64_t b, int64_t h, int m0, int Lq, int Lk, int n_block,
                  uint32_t region, int lane)
{
    float *dst = (float *)p.dq_accum.ptr + sq.mem_b * p.dq_accum.s[0] + (sq.start + m0) * p.dq_accum.s[1]
                 + h * p.dq_accum.s[2] + dq_chain_offset(p, n_block % DQ_CHAINS);
    const int bytes = min(64, Lq - m0) * HEAD_DIM * 4;
#if DQ_ORDERED
    int first, last;
    sem_wait(sem_of<64>(p, b, h, m0, Lq, Lk, first, last), n_block, last, lane);
#endif
    if (lane != 0)
        return;
#if DQ_ORDERED
    fence_proxy_async_global();
#if DQ_STORE_FIRST
    if (n_block + DQ_CHAINS > last) { /* its chain's first turn: into rows never zeroed */
        bulk_store(dst, region, bytes);
        return;
    }
#endif
#endif
    bulk_add_f32(dst, region, bytes);
}

/* Thread 0, before the region is written again: dq_issue's copy read out of it; DQ_ORDERED, its
 * writes complete and the block's bit for the tile set (the next turn's). Deferred to the next
 * item's first write of the region, so that the copy lands under that item's loads and products. */
DEV void dq_settle(const attn_params &p, int64_t b, int64_t h, int m0, int Lq, int Lk, int n_block)
{
#if DQ_ORDERED
    bulk_wait();
    fence_proxy_async_global();
    int first, last;
    sem_set<true>(sem_of<64>(p, b, h, m0, Lq, Lk, first, last), n_block);
#else
    bulk_wait_read();
#endif
}
#endif

#if ENTRY(attn_bwd_dkdv_x3)
/* KV_WARPS 4: one warpgroup takes every product of an item. 8: two warpgroups over the same 64
 * keys, each with one accumulator: the first S^T = K Q^T, P^T and dV += P^T dO, the second
 * dP^T = V dO^T and dK += dS^T Q, P^T * score_grad passing from the first to the second through
 * shared memory (each thread's fragment, the other warpgroup's thread of the same rank reading
 * it: the fragments match) */
extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) attn_bwd_dkdv_x3(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* K's, V's, Q's and dO's planes (TILE_BYTES each), the passed P^T (XBUF_BYTES), then the
     * tile's lse and delta rows */
    const uint32_t sK = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sV = sK + TILE_BYTES, sQ = sV + TILE_BYTES, sdO = sQ + TILE_BYTES, sX = sdO + TILE_BYTES;
    float *xbuf = (float *)(smem_raw + (sX - smem_addr(smem_raw))), *sL = xbuf + XBUF_BYTES / 4, *sD = sL + KV_BLOCK_M;

    const int tid = threadIdx.x, warp = tid >> 5;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    if (b == p.B) {                       /* packed rows after the last sequence */
        zero_dkdv_tail(p, hk, KV_THREADS);
        return;
    }
    const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
    /* DQ_ORDERED: the key blocks in reverse, the last first (its turns come first: attn_bwd_tile.cuh) */
    const int n_block = DQ_ORDERED ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int n0 = n_block * 64, n0w = n0 + (warp & 3) * 16;
    if (n0 >= sk.rows)
        return;
    const int group = (int)(p.Hq / p.Hk), Lq = (int)sq.len, Lk = (int)sk.len;
    int m_first, nm, qlo[2], qhi[2];
    kv_tile_rows(p, n0, 64, KV_BLOCK_M, n0w, Lq, Lk, m_first, nm, qlo, qhi);
    const int items = group * nm;

#if KV_WARPS == 8
    const int wg = warp >> 2;             /* 0: dV's, 1: dK's */
    float acc[1][NTD][4];
    zero_acc(acc);
#else
    float dk[1][NTD][4], dv[1][NTD][4];
    zero_acc(dk);
    zero_acc(dv);
#endif
    if (items > 0) {
        load_split_sw128<64, HEAD_DIM, KV_THREADS>(
            {sK, sV},
            {(const float *)p.k.ptr + sk.mem_b * p.k.s[0] + (sk.start + n0) * p.k.s[1] + hk * p.k.s[2],
             (const float *)p.v.ptr + sk.mem_b * p.v.s[0] + (sk.start + n0) * p.v.s[1] + hk * p.v.s[2]},
            {p.k.s[1], p.v.s[1]}, Lk - n0, tid);
    }
    for (int j = 0; j < items; j++) {
        const int64_t h = hk * group + j / nm;
        const int m0 = (m_first + j % nm) * KV_BLOCK_M;
        const int64_t row0 = sq.start + m0;
        __syncthreads();                  /* every warp is done with item j - 1's tiles */
        load_split_sw128<KV_BLOCK_M, HEAD_DIM, KV_THREADS>(
            {sQ, sdO},
            {(const float *)p.q.ptr + sq.mem_b * p.q.s[0] + row0 * p.q.s[1] + h * p.q.s[2],
             (const float *)p.dout.ptr + sq.mem_b * p.dout.s[0] + row0 * p.dout.s[1] + h * p.dout.s[2]},
            {p.q.s[1], p.dout.s[1]}, Lq - m0, tid);
        load_lse_delta(p, sq, h, m0, KV_BLOCK_M, Lq, sL, sD);
        fence_proxy_async();              /* the planes' stores, before wgmma reads them */
        __syncthreads();

        const score_ctx sc = make_score_ctx(p, b, h, sq, sk);
        const bool need_mask = item_needs_mask(p, sc, n0, 64, m0, KV_BLOCK_M, Lq, Lk);
        uint32_t a[3][4][4];
#if KV_WARPS == 8
        float s[1][KV_NT][4];             /* S^T, or dP^T */
        wgmma_fence();
        mma_ss3<KV_BLOCK_M>(s[0], wg ? sV : sK, wg ? sdO : sQ);
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(s[0]);
        /* P^T score_grad passes at a barrier of the whole CTA: a named barrier's arrive (the
         * first) and sync (the second) measured the same but racecheck reported the next item's
         * lse / delta stores against the second's reads, and a sync in each branch is two
         * barrier instructions to synccheck */
        float *x = xbuf + (tid & 127);
        cfrag<1, KV_NT / 2> pf;           /* the first's P^T in float32 (ELEM_F32's fragments) */
        if (wg == 0) {
            pt_tile<KV_NT, false>(s, pf, p, sc, sL, n0w, m0, qlo, qhi, need_mask);   /* s: P^T score_grad */
#if DQ_ATOMIC
            if (j > 0) {                  /* item j - 1's dQ copy out of the region first */
                if (tid == 0)
                    dq_settle(p, b, hk * group + (j - 1) / nm, (m_first + (j - 1) % nm) * KV_BLOCK_M, Lq, Lk, n_block);
                named_sync(2, 128);
            }
#endif
#pragma unroll
            for (int nt = 0; nt < KV_NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    x[(nt * 4 + e) * 128] = s[0][nt][e];
        }
        __syncthreads();
        if (wg == 0) {
            split_frag(a, pf);
            mma_rs3_by64(acc[0], a, sdO);   /* dV += P^T dO */
        } else {
            const int t = tid & 3;
#pragma unroll
            for (int nt = 0; nt < KV_NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)   /* dS^T: pt_pass's rule with DS */
                    s[0][nt][e] = x[(nt * 4 + e) * 128] * (s[0][nt][e] - sD[nt * 8 + 2 * t + (e & 1)]);
#if DQ_ATOMIC
            named_sync(1, 128);           /* every P^T read: dS^T's planes take its place */
            store_ds_planes(sX, s);
#endif
            split_frag(a, s);
            mma_rs3_by64(acc[0], a, sQ);    /* dK += dS^T Q */
        }
#if DQ_ATOMIC
        fence_proxy_async();              /* dS^T's planes, before wgmma reads them */
        __syncthreads();
        stage_dq_partial(sK, sX, xbuf, wg);
        if (tid < 32)
            dq_issue(p, sq, b, h, m0, Lq, Lk, n_block, sX, tid);
#endif
#else
        float s[1][KV_NT][4], dp[1][KV_NT][4];
        wgmma_fence();
        mma_ss3<KV_BLOCK_M>(s[0], sK, sQ);
        mma_ss3<KV_BLOCK_M>(dp[0], sV, sdO);
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(s[0]);
        fence_acc(dp[0]);

        cfrag<1, KV_NT / 2> pf;           /* P^T in float32 (ELEM_F32's fragments) */
        pt_tile<KV_NT, true>(s, pf, p, sc, sL, n0w, m0, qlo, qhi, need_mask, dp, sD);   /* dS^T into dp */
        split_frag(a, pf);
        mma_rs3_by64(dv[0], a, sdO);  /* dV += P^T dO */
        split_frag(a, dp);
        mma_rs3_by64(dk[0], a, sQ);   /* dK += dS^T Q */
#endif
    }
#if DQ_ATOMIC
    if (tid == 0 && items > 0) {          /* the last item's copy, complete before the CTA leaves */
        dq_settle(p, b, hk * group + (items - 1) / nm, (m_first + (items - 1) % nm) * KV_BLOCK_M, Lq, Lk, n_block);
        bulk_wait();
    }
#endif
#if KV_WARPS == 8
    store_dkdv(p, sk, hk, acc, acc, n0w, wg == 1, wg == 0);
#else
    store_dkdv(p, sk, hk, dk, dv, n0w, true, true);
#endif
}
#endif

#if ENTRY(attn_bwd_dq_x3)
extern "C" __global__ void __launch_bounds__(X3_THREADS, 1) attn_bwd_dq_x3(const __grid_constant__ attn_params p)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    /* Q's, dO's planes (the CTA's rows), K's, V's (the key tile) */
    const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
    const uint32_t sdO = sQ + TILE_BYTES, sK = sdO + TILE_BYTES, sV = sK + TILE_BYTES;

    const int tid = threadIdx.x;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    dq_cta c;
    if (!dq_cta_begin(p, h, b, Q_BLOCK_M, Q_BLOCK_N, X3_THREADS, c))
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
        load_split_sw128<Q_BLOCK_M, HEAD_DIM, X3_THREADS>(
            {sQ, sdO},
            {(const float *)p.q.ptr + sq.mem_b * p.q.s[0] + row0 * p.q.s[1] + h * p.q.s[2],
             (const float *)p.dout.ptr + sq.mem_b * p.dout.s[0] + row0 * p.dout.s[1] + h * p.dout.s[2]},
            {p.q.s[1], p.dout.s[1]}, Lq - m0, tid);
    }
    tile_sums sums;                       /* no array gradients here: an empty one */
    tile_sums_init(sums, nullptr);
    for (int n = n_first; n <= n_last; n++) {
        const int64_t c0 = n * Q_BLOCK_N;
        __syncthreads();                  /* every warp is done with tile n - 1 */
        load_split_sw128<Q_BLOCK_N, HEAD_DIM, X3_THREADS>({sK, sV}, {gk + c0 * p.k.s[1], gv + c0 * p.v.s[1]},
                                                          {p.k.s[1], p.v.s[1]}, Lk - (int)c0, tid);
        fence_proxy_async();
        __syncthreads();

        float s[1][Q_NT][4], dp[1][Q_NT][4];
        wgmma_fence();
        mma_ss3<Q_BLOCK_N>(s[0], sQ, sK);
        mma_ss3<Q_BLOCK_N>(dp[0], sdO, sV);
        wgmma_commit();
        const bool need = ds_needs_mask(p, sc, m0, (int)c0, Lq, Lk);   /* while the products run */
        wgmma_wait<0>();
        fence_acc(s[0]);
        fence_acc(dp[0]);
        ds_tile<true, false>(s, dp, p, sc, ri, m0, (int)c0, need, Lq, Lk, tile_sums_for<false>(sums, sc, m0, (int)c0, Lq, Lk));
        uint32_t a[3][4][4];
        split_frag(a, s);
        mma_rs3<HEAD_DIM>(dq[0], a, sK);  /* dQ += dS K */
    }

    store_dq(p, sq, h, m0, dq[0], dq_mul(p));   /* padding rows (and rows that keep nothing) come out 0 */
}
#endif
