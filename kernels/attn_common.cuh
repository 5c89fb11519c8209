/* What the forward and backward kernels share: tensor-core and copy instructions as inline PTX
 * (no CUDA toolkit header is included: NVRTC needs no include path), element conversions,
 * tile loads into padded shared memory, and the per-score hook (softcap, bias, alibi, then the
 * score_mod slot) with the mask predicate.
 *
 * Compile-time switches (set by attnext/kernels.py):
 *   ELEM_BF16      1: q/k/v/out are bfloat16, 0: float16 (unless ELEM_F32)
 *   ELEM_F32       1: q/k/v/out are float32, multiplied on the tensor cores in TF32 (m16n8k8):
 *                  TF32_PASSES 3 splits each operand x = hi + lo into two TF32 values and adds
 *                  lo*hi + hi*lo + hi*hi (float32 accuracy), 1 takes hi*hi alone (precision="tf32")
 *   F16_SCALED     1 (float16 only): the backward of float32 inputs under precision="tf32" on
 *                  float16 products: q, k, v, out and dout are float16 copies scaled by powers of
 *                  two (attn_scale16.cu), whose factors p.grad_scales undoes: the scores' scale
 *                  times grad_scales[0], dq, dk, dv (float32: grad_t) times [1], [2], [3]
 *   HEAD_DIM, HEAD_DIM_V      D and Dv, any value 1..256
 *   VEC_LOAD       1: every q/k/v row is 16-byte aligned and its D elements contiguous, so tiles
 *                  load with 16-byte cp.async; 0: element loads (odd strides, odd D, misaligned)
 *   HAS_SOFTCAP, HAS_BIAS (+ BIAS_DT), HAS_ALIBI (+ ALIBI_DT)
 *   HAS_MASK       1: some pair inside the causal / window band and the lengths may still be
 *                  masked, so every tile takes the per-element test: a mask array (MASK_ARRAY,
 *                  which defaults to HAS_MASK) and / or a mask_mod
 *   HAS_SCORE_MOD, HAS_MASK_MOD, HAS_DTENSORS   the generated score_mod / mask_mod (attnext/
 *                  codegen.py: the in-memory header attn_mod_gen.cuh) fill the score_mod and
 *                  mask_mod slots below; HAS_DTENSORS: the dQ kernels' ds_tile also scatters the
 *                  score_mod's array gradients
 * Causal and window are run-time fields of attn_params: they decide which tiles are visited
 * (block.h) and which tiles need the per-element mask, never the inner loop's code.
 *
 * Fragment legend of mma.m16n8k16 (g = lane / 4, t = lane % 4):
 *   A 16x16 : a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
 *   B 16x8  : b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
 *   C 16x8  : c0 c1 (g, 2t..2t+1)   c2 c3 (g+8, 2t..2t+1)
 */
#ifndef ATTNEXT_ATTN_COMMON_CUH
#define ATTNEXT_ATTN_COMMON_CUH

#include "attn_params.h"
#include "seqlen.h"
#include "block.h"

#define DEV static __device__ __forceinline__
#define ROUND_UP(x, m) (((x) + (m) - 1) / (m) * (m))
#ifndef ELEM_F32
#define ELEM_F32 0
#endif
#ifndef TF32_PASSES
#define TF32_PASSES 3
#endif
#if ELEM_F32
#define ELEM_BYTES 4
#else
#define ELEM_BYTES 2
#endif
#define CHUNK (16 / ELEM_BYTES)            /* elements in 16 bytes: one cp.async, one ldmatrix row */
#define DP ROUND_UP(HEAD_DIM, 16)          /* D padded to the mma's k step */
#define DVP ROUND_UP(HEAD_DIM_V, 16)       /* Dv padded to two n8 tiles */
#define SMEM_PAD CHUNK                     /* 16 bytes per row keep ldmatrix conflict-free */
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

/* Programmatic dependent launch (Hopper; no-ops before it and without such a launch): a kernel
 * launched as a dependent (nvrtc.DEPENDENT_KERNELS) may start while the one before it on the
 * stream still runs; it calls grid_dependency_wait() before touching anything that kernel writes
 * or reads, which returns once that whole grid has finished and its writes are visible. The
 * kernel before calls allow_dependents() once its CTAs may share the SMs with the dependent's. */
DEV void allow_dependents()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

DEV void grid_dependency_wait()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#ifndef HAS_SCORE_MOD
#define HAS_SCORE_MOD 0
#endif
#ifndef HAS_MASK_MOD
#define HAS_MASK_MOD 0
#endif
#ifndef HAS_DTENSORS
#define HAS_DTENSORS 0
#endif
#ifndef MASK_ARRAY
#define MASK_ARRAY HAS_MASK
#endif
#ifndef ATTN_GMODS
#define ATTN_GMODS 0                 /* 1: a kernel with generated mods (kernels.py: mod_defines) */
#endif
/* Which entry points a compile emits: every one of the file, or with ATTN_ENTRY_ONLY only those
 * whose ATTN_ENTRY_<name> is 1 (kernels.py compiles a kernel with generated mods one entry point
 * at a time: only the code a call runs, and the entry points in parallel). */
#if ATTN_ENTRY_ONLY
#define ENTRY(name) ATTN_ENTRY_##name
#else
#define ENTRY(name) 1
#endif
DEV float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

DEV float fast_log2(float x)
{
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

DEV float fast_rcp(float x)
{
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* tanh by the hardware's approximation (relative error 2^-10.99, below the rounding of the
 * 16-bit inputs and of P; FlashAttention-3's softcap takes it too): softcap and score_mod's
 * np.tanh (the generated code calls it; attn_mods.cuh gives host C tanhf under this name) */
DEV float fast_tanh(float x)
{
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#if HAS_SCORE_MOD || HAS_MASK_MOD
#include "attn_mods.cuh"
#include "attn_mod_gen.cuh"
#endif

#if ELEM_F32
typedef float elem_t;
#else
typedef uint16_t elem_t;                   /* the raw 16 bits of a bfloat16 or float16 */
#endif
#ifndef F16_SCALED
#define F16_SCALED 0
#endif
#if F16_SCALED && (ELEM_F32 || ELEM_BF16)
#error "F16_SCALED: float16 operands"
#endif
#if F16_SCALED
typedef float grad_t;                      /* dq, dk, dv: the caller's float32 arrays */
#else
typedef elem_t grad_t;
#endif

/* ---------------------------------------------------------------- conversions */
DEV float bf16_to_f32(uint16_t x) { return __uint_as_float(((uint32_t)x) << 16); }

DEV float f16_to_f32(uint16_t x)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

DEV float elem_to_f32(elem_t x)
{
#if ELEM_F32
    return x;
#elif ELEM_BF16
    return bf16_to_f32(x);
#else
    return f16_to_f32(x);
#endif
}

DEV elem_t f32_to_elem(float f)
{
#if ELEM_F32
    return f;
#else
    uint16_t r;
#if ELEM_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
#endif
}

DEV grad_t f32_to_grad(float f)
{
#if F16_SCALED
    return f;
#else
    return f32_to_elem(f);
#endif
}

/* What the backward's stores multiply dQ, dK and dV by: the scale for dq and dk, 1 for dv, under
 * F16_SCALED each times its factor in grad_scales (attn_scale16.cu: 1 / the powers of two that
 * scaled the operands). */
DEV float dq_mul(const attn_params &p) { return F16_SCALED ? (float)(p.scale * p.grad_scales[1]) : (float)p.scale; }
DEV float dk_mul(const attn_params &p) { return F16_SCALED ? (float)(p.scale * p.grad_scales[2]) : (float)p.scale; }
DEV float dv_mul(const attn_params &p) { return F16_SCALED ? (float)p.grad_scales[3] : 1.f; }

/* Two floats to one register of two 16-bit elements, lo in the low half. */
DEV uint32_t pack2(float lo, float hi)
{
    uint32_t r;
#if ELEM_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

/* A float of any attn_dtype at p[i]. */
DEV float load_as_f32(const void *p, int64_t i, int dt)
{
    switch (dt) {
    case DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    case DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case DT_F32: return ((const float *)p)[i];
    default: return (float)((const double *)p)[i];
    }
}

/* ---------------------------------------------------------------- shared memory and copies */
DEV uint32_t smem_addr(const void *p)
{
    uint32_t a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

/* 16 bytes global -> shared; src_bytes < 16 zero-fills the rest (0: all zeros, src unread). */
DEV void cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

DEV void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
DEV void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

DEV void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

DEV void ldmatrix_x4_trans(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

/* ldmatrix_x4's inverse (sm_90): register j of every lane (16-bit pairs, an mma fragment's
 * layout: lane l holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1) into 8 x 8 matrix j, whose
 * row i lies at the address lane 8 j + i gives. */
DEV void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3)
{
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

#if ELEM_F32
/* x rounded to TF32 (to nearest, ties away: cvt.rna.tf32.f32's result), in a float's bits, by
 * integer operations: half of the 13 dropped bits added to the magnitude, then cut off (inf and
 * NaN stay so). The same bits as cvt.rna.tf32.f32, which held the float32 forward at 0.78x of
 * this (H200, D = 64 and 128: 44-45 against 56-58 TFLOP/s). */
DEV uint32_t to_tf32(float x)
{
    return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}

/* c += a * b, one m16n8k8 TF32 product, float32 accumulate (A: a0 (g, t) a1 (g+8, t) a2 (g, t+4)
 * a3 (g+8, t+4); B: b0 (k t, n g) b1 (k t+4, n g); C as m16n8k16's). */
DEV void mma1688(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* x as TF32 parts: hi = x rounded; under TF32_PASSES 3 also lo = (x - hi) rounded (hi + lo carries
 * ~22 bits of x's 24). */
DEV void split_tf32(float x, uint32_t &hi, uint32_t &lo)
{
    hi = to_tf32(x);
#if TF32_PASSES == 3
    lo = to_tf32(x - __uint_as_float(hi));
#else
    lo = 0;
#endif
}

/* An operand fragment of N float32 values as TF32 parts (split_tf32). */
template <int N>
struct tf32_frag {
    uint32_t hi[N], lo[N];
    __device__ __forceinline__ void set(int i, float x) { split_tf32(x, hi[i], lo[i]); }
    /* parts split before (split_tile): lo is 0 under TF32_PASSES 1 */
    __device__ __forceinline__ void parts(int i, uint32_t h, uint32_t l)
    {
        hi[i] = h;
        lo[i] = TF32_PASSES == 3 ? l : 0u;
    }
};

/* A float32 tile in shared memory (ROWS x COLS, row stride COLS + SMEM_PAD) split into its TF32
 * parts once, for every warp that reads it: each x becomes hi in place and, under TF32_PASSES 3,
 * lo at the same index of the plane `lo` (split_tf32's bits, so the products' sums are the bits
 * of splitting at each use). The products then take the tile as split (mma_abt_f32's and
 * mma_cb_f32's PA / PB, with the plane's offset) and split nothing: a tile read by every warp
 * of a CTA was split by each of them, at each use (F32_PRESPLIT, attn_bwd.cu). THREADS threads
 * from tid; the caller syncs before and after. */
template <int ROWS, int COLS, int THREADS>
DEV void split_tile(float *tile, float *lo, int tid)
{
    static_assert(COLS % 4 == 0, "whole 16-byte chunks");
    constexpr int LD = COLS + SMEM_PAD, C4 = COLS / 4;
#pragma unroll 1          /* the backward's kernels run at 255 registers */
    for (int i = tid; i < ROWS * C4; i += THREADS) {
        const int at = (i / C4) * LD + (i % C4) * 4;
        const float4 x = *(const float4 *)(tile + at);
        uint4 h, l;
        split_tf32(x.x, h.x, l.x);
        split_tf32(x.y, h.y, l.y);
        split_tf32(x.z, h.z, l.z);
        split_tf32(x.w, h.w, l.w);
        *(uint4 *)(tile + at) = h;
        if (TF32_PASSES == 3)
            *(uint4 *)(lo + at) = l;
    }
}

/* a * b in float32 by TF32 products. The tensor cores add each product into the accumulator
 * truncated (rounded toward zero), so errors of one sign pile up with every mma into a large
 * sum: the small products lo*hi + hi*lo go into their own accumulator (c_lo, ~2^-11 of c's
 * magnitude: its truncation is negligible), hi*hi alone into c; the caller adds c_lo into c
 * when the sum is done. TF32_PASSES 1: hi*hi alone, and c_lo stays 0: the callers leave its add
 * out (x + 0 is x but for the sign of a zero, which the compiler must keep: ~150 FADD of the
 * one-pass dK/dV item's ~1230 instructions at D = 128). */
DEV void mma_f32(float *c, float *c_lo, const tf32_frag<4> &a, const tf32_frag<2> &b)
{
#if TF32_PASSES == 3
    mma1688(c_lo, a.lo, b.hi[0], b.hi[1]);
    mma1688(c_lo, a.hi, b.lo[0], b.lo[1]);
#endif
    mma1688(c, a.hi, b.hi[0], b.hi[1]);
}

/* The A operand of a product taken from an earlier product's C fragments (P, dS): under ELEM_F32
 * the floats themselves (kn8 tiles of keys, split at the product: mma_cb_f32), else packed pairs
 * of 16-bit elements (KS k16 steps: p_fragment, pack_frag). */
template <int MT, int KS>
using cfrag = float[MT][2 * KS][4];

template <int MT, int NT>
DEV void zero_acc(float (&acc)[MT][NT][4]);

/* acc[mt][nt] += A[mt*16 .., 0..KP) . B[nt*8 .., 0..KP)^T in float32 by TF32 products: A and B
 * row-major in shared memory (row stride KP + SMEM_PAD), sA at the warp's first A row, sB at B's
 * first row. A k8 step of floats is 32 bytes, as a k16 step of 16-bit elements: ldmatrix's 8 x
 * 16-byte rows give each lane the TF32 fragment's element (m16n8k8's legend). PA / PB: A / B
 * split already (split_tile), its lo plane a_lo / b_lo floats past it (TF32_PASSES 3). */
template <int MT, int NT, int KP, bool PA = false, bool PB = false>
DEV void mma_abt_f32(float (&acc)[MT][NT][4], const float *sA, const float *sB, int lane, int a_lo = 0,
                     int b_lo = 0)
{
    constexpr int LD = KP + SMEM_PAD;
    constexpr bool LO_A = PA && TF32_PASSES == 3, LO_B = PB && TF32_PASSES == 3;
    const uint32_t a0 = smem_addr(sA) + 4 * ((lane & 15) * LD + (lane >> 4) * 4);
    const uint32_t b0 = smem_addr(sB) + 4 * (((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 4);
    float lo[MT][NT][4];
    zero_acc(lo);
#pragma unroll
    for (int kk = 0; kk < KP / 8; kk++) {
        tf32_frag<4> a[MT];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            uint32_t r[4], l[4] = {0u, 0u, 0u, 0u};
            ldmatrix_x4(a0 + 4 * (mt * 16 * LD + kk * 8), r[0], r[1], r[2], r[3]);
            if (LO_A)
                ldmatrix_x4(a0 + 4 * (a_lo + mt * 16 * LD + kk * 8), l[0], l[1], l[2], l[3]);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (PA)
                    a[mt].parts(i, r[i], l[i]);
                else
                    a[mt].set(i, __uint_as_float(r[i]));
            }
        }
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4], bl[4] = {0u, 0u, 0u, 0u};
            ldmatrix_x4(b0 + 4 * (np * 16 * LD + kk * 8), b[0], b[1], b[2], b[3]);
            if (LO_B)
                ldmatrix_x4(b0 + 4 * (b_lo + np * 16 * LD + kk * 8), bl[0], bl[1], bl[2], bl[3]);
            tf32_frag<2> b01, b23;
            if (PB) {
                b01.parts(0, b[0], bl[0]);
                b01.parts(1, b[1], bl[1]);
                b23.parts(0, b[2], bl[2]);
                b23.parts(1, b[3], bl[3]);
            } else {
                b01.set(0, __uint_as_float(b[0]));
                b01.set(1, __uint_as_float(b[1]));
                b23.set(0, __uint_as_float(b[2]));
                b23.set(1, __uint_as_float(b[3]));
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_f32(acc[mt][2 * np], lo[mt][2 * np], a[mt], b01);
                mma_f32(acc[mt][2 * np + 1], lo[mt][2 * np + 1], a[mt], b23);
            }
        }
    }
    if (TF32_PASSES == 3)                 /* one pass: lo is 0 (an add the compiler must keep: -0 + 0) */
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    acc[mt][nt][e] += lo[mt][nt][e];
}

/* acc[mt][nt] += A . B[0..8 KN, nt*8 ..) in float32 by TF32 products: A the C fragments f of an
 * earlier product (KN n8 tiles: a lane holds columns 8 kn + 2t, + 1 of rows g, g + 8, which the
 * k8 product takes as its k = t and t + 4, a sum over k in any order), B row-major [k][n] in
 * shared memory with row stride LD, so its fragment is rows 2t and 2t + 1 of each 8, column g of
 * the n8 tile: two scalar loads (rows 16 bytes apart mod 128: conflict-free). Per n8 tile of acc
 * the sum over k goes into fresh accumulators, added to acc rounded: the mma's truncating adds
 * reach only this call's sum. PB: B split already (split_tile), its lo plane b_lo floats past it. */
template <int MT, int KN, int NT, int LD, bool PB = false>
DEV void mma_cb_f32(float (&acc)[MT][NT][4], const float (&f)[MT][KN][4], const float *sB, int lane, int b_lo = 0)
{
    tf32_frag<4> a[MT][KN];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int kk = 0; kk < KN; kk++) {
            a[mt][kk].set(0, f[mt][kk][0]);
            a[mt][kk].set(1, f[mt][kk][2]);
            a[mt][kk].set(2, f[mt][kk][1]);
            a[mt][kk].set(3, f[mt][kk][3]);
        }
    const float *bl = sB + 2 * (lane & 3) * LD + (lane >> 2);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        float c[MT][4], c_lo[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                c[mt][e] = c_lo[mt][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KN; kk++) {
            tf32_frag<2> b;
            const int at = kk * 8 * LD + nt * 8;
            if (PB) {
                const bool lo = TF32_PASSES == 3;
                b.parts(0, __float_as_uint(bl[at]), lo ? __float_as_uint(bl[b_lo + at]) : 0u);
                b.parts(1, __float_as_uint(bl[at + LD]), lo ? __float_as_uint(bl[b_lo + at + LD]) : 0u);
            } else {
                b.set(0, bl[at]);
                b.set(1, bl[at + LD]);
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                mma_f32(c[mt], c_lo[mt], a[mt][kk], b);
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[mt][nt][e] += TF32_PASSES == 3 ? c[mt][e] + c_lo[mt][e] : c[mt][e];
    }
}
#else
template <int MT, int KS>
using cfrag = uint32_t[MT][KS][4];

/* c += a * b, one m16n8k16 tensor-core product, float32 accumulate. */
DEV void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
{
#if ELEM_BF16
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

/* The columns of [lo, hi) among a thread's 2 NT of a tile from column c0 (the forward: the keys a
 * row keeps, row_band's; the backward's S^T: the query rows a key row is seen by), as bits: bit
 * 2 nt + j for column c0 + 8 nt + 2 t + j (an mma C fragment's). The columns rise with the bit,
 * so the kept ones are bits [below(lo), below(hi)), below(x) counting the thread's columns under
 * x: one bit test a pair, where two compares had been. */
template <int NT>
DEV uint64_t band_bits(int lo, int hi, int c0, int t)
{
    static_assert(NT <= 32, "a bit a column of the thread's");
    auto below = [&](int x) {
        const int y = x - c0 - 2 * t;              /* column 8 nt + j of the thread's is under x: 8 nt + j < y */
        return y <= 0 ? 0 : min(2 * (y >> 3) + min(y & 7, 2), 2 * NT);
    };
    auto bits_under = [](int b) { return b >= 64 ? ~0ull : (1ull << b) - 1; };
    return bits_under(below(hi)) & ~bits_under(below(lo));
}

/* Zeroes a warp's mma accumulators (MT m16 tiles x NT n8 tiles). */
template <int MT, int NT>
DEV void zero_acc(float (&acc)[MT][NT][4])
{
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[mt][nt][e] = 0.f;
}

/* Rows [0, ROWS) x cols [0, COLS_P) of a tile into shared memory (row stride COLS_P + SMEM_PAD);
 * row r is read from row_ptr(r) with column stride col_stride. Rows at or past `valid` and cols
 * at or past `cols` are zero: a padded key row must hold 0, not garbage, since its probability 0
 * times a NaN would still be NaN. VEC_LOAD issues cp.async (commit and wait are the caller's);
 * otherwise plain loads and stores, complete on return. */
template <int ROWS, int COLS_P, int THREADS, typename RowPtr>
DEV void load_rows(elem_t *smem, RowPtr row_ptr, int64_t col_stride, int valid, int cols, int tid)
{
#if VEC_LOAD
    constexpr int CHUNKS = COLS_P / CHUNK;
    const uint32_t base = smem_addr(smem);
#pragma unroll
    for (int j = 0; j < (ROWS * CHUNKS + THREADS - 1) / THREADS; j++) {
        const int i = tid + j * THREADS;
        const int r = i / CHUNKS, c = (i % CHUNKS) * CHUNK;
        if ((ROWS * CHUNKS) % THREADS == 0 || r < ROWS) {
            const bool ok = r < valid && c < cols;
            const elem_t *src = row_ptr(ok ? r : 0) + (ok ? c : 0);   /* one row_ptr a copy */
            cp_async16(base + ELEM_BYTES * (r * (COLS_P + SMEM_PAD) + c), src, ok ? 16 : 0);
        }
    }
#else
    for (int i = tid; i < ROWS * COLS_P; i += THREADS) {
        int r = i / COLS_P, c = i % COLS_P;
        elem_t x = 0;
        if (r < valid && c < cols)
            x = row_ptr(r)[c * col_stride];
        smem[r * (COLS_P + SMEM_PAD) + c] = x;
    }
#endif
}

/* load_rows for rows evenly spaced by row_stride from src. */
template <int ROWS, int COLS_P, int THREADS>
DEV void load_tile(elem_t *smem, const elem_t *src, int64_t row_stride, int64_t col_stride,
                   int valid, int cols, int tid)
{
    load_rows<ROWS, COLS_P, THREADS>(smem, [=](int r) { return src + r * row_stride; }, col_stride,
                                     valid, cols, tid);
}

/* ---------------------------------------------------------------- the score hook */
/* What one (batch, query head) block needs to finish a raw q.k into a score. */
/* True when the options change a score beyond the scale (else a score's units are q.k: score_ctx's
 * raw). */
#define SCORE_IS_PLAIN (!HAS_SOFTCAP && !HAS_BIAS && !HAS_ALIBI && !HAS_SCORE_MOD)

struct score_ctx {
    float scale;             /* multiplies q.k */
    /* The units the forward's softmax and the backward's P take scores in (score_units): q.k
     * itself where the score is plain and scale > 0 (its order is the scores'), else the
     * natural-log score. to_log2 turns a difference of them into log2 units, to_natural a value
     * into the natural score: exp2((s - m) * to_log2), m a running maximum at most
     * STALE_MAX_LOG2 behind (softmax_update), never overflows, and stays exact at huge scores,
     * where s * log2e - m * log2e fused by an FMA would be off by 2^(+-512) at 1e10. */
    bool raw;
    float to_log2, to_natural;
    float softcap, inv_softcap;
    const void *bias;        /* at [b, hb] already; indexed by r * bias_sr + c * bias_sc */
    int64_t bias_sr, bias_sc;
    const uint8_t *mask;     /* likewise */
    int64_t mask_sr, mask_sc;
    float slope;             /* alibi slope of (b, h) */
    int diag;                /* Lk - Lq: row r's diagonal is column r + diag */
    int64_t b, h;            /* what score_mod / mask_mod see: the sequence and query head */
    const attn_mods_gpu *mods;   /* their constants and arrays (in the kernel parameter) */
#if HAS_SCORE_MOD
    /* score_mod's lookups of (b, h) alone (codegen.head_loads: ALiBi's slopes[h]), read here
     * once rather than at every score, where a tile's products would keep the load waiting */
    float hv[MOD_HEAD_SIZE];
#endif
};

DEV score_ctx make_score_ctx(const attn_params &p, int64_t b, int64_t h, const seq_t &sq, const seq_t &sk)
{
    score_ctx s;
    s.scale = F16_SCALED ? (float)(p.scale * p.grad_scales[0]) : (float)p.scale;
    s.softcap = (float)p.softcap;
    s.inv_softcap = p.softcap > 0 ? (float)(1.0 / p.softcap) : 0.f;
    s.bias = 0;
    s.mask = 0;
    s.bias_sr = s.bias_sc = s.mask_sr = s.mask_sc = 0;
    s.diag = (int)(sk.len - sq.len);
    s.slope = 0.f;
    s.b = b;
    s.h = h;
#if ATTN_GMODS
    s.mods = &p.gmods;
#else
    s.mods = 0;
#endif
#if HAS_SCORE_MOD
    mod_head(b, h, s.mods, s.hv);
#endif
#if HAS_BIAS
    {
        int64_t hb = h / (p.Hq / p.bias_heads);
        s.bias = (const char *)p.bias.ptr + (b * p.bias.s[0] + hb * p.bias.s[1]) * dtype_size((attn_dtype)BIAS_DT);
        s.bias_sr = p.bias.s[2];
        s.bias_sc = p.bias.s[3];
    }
#endif
#if MASK_ARRAY
    {
        int64_t hm = h / (p.Hq / p.mask_heads);
        s.mask = (const uint8_t *)p.mask.ptr + b * p.mask.s[0] + hm * p.mask.s[1];
        s.mask_sr = p.mask.s[2];
        s.mask_sc = p.mask.s[3];
    }
#endif
#if HAS_ALIBI
    s.slope = load_as_f32(p.alibi.ptr, b * p.alibi.s[0] + h * p.alibi.s[1], ALIBI_DT);
#endif
    s.raw = SCORE_IS_PLAIN && s.scale > 0.f;
    s.to_log2 = s.raw ? s.scale * LOG2E : LOG2E;
    s.to_natural = s.raw ? s.scale : 1.f;
    return s;
}

/* Steps 1-4 of DESIGN's semantics for the pair (r, c), natural-log units: what score_mod gets. */
DEV float score_base(const score_ctx &s, float dot, int r, int c)
{
    float x = dot * s.scale;
#if HAS_SOFTCAP
    x = s.softcap * fast_tanh(x * s.inv_softcap);
#endif
#if HAS_BIAS
    x += load_as_f32(s.bias, r * s.bias_sr + c * s.bias_sc, BIAS_DT);
#endif
#if HAS_ALIBI
    x -= s.slope * fabsf((float)(r + s.diag - c));
#endif
    return x;
}

/* Steps 1-5: the score_mod slot (the identity without one). A lookup of the generated code
 * out of range sets bad (and reads a clamped element); the tile reports it (mod_fault). */
DEV float score_of(const score_ctx &s, float dot, int r, int c, int &bad)
{
#if HAS_SCORE_MOD
    return mod_score_h(score_base(s, dot, r, c), s.b, s.h, r, c, s.mods, s.hv, &bad);
#else
    return score_base(s, dot, r, c);
#endif
}

/* Whether score_of may run at a pair that no mask keeps, for a branch-free tile: the generated
 * kernels' lookups clamp; a bias array ends with the lengths, so with one the scores run where
 * kept only. */
#define SCORE_ANYWHERE (ATTN_GMODS && !HAS_BIAS)

/* score_of where keep, -inf elsewhere; bad as score_of's, where keep only. */
DEV float kept_score(const score_ctx &s, bool keep, float dot, int r, int c, int &bad)
{
#if SCORE_ANYWHERE
    int b = 0;
    const float x = score_of(s, dot, r, c, b);
    bad |= keep ? b : 0;
    return keep ? x : NEG_INF;
#else
    return keep ? score_of(s, dot, r, c, bad) : NEG_INF;
#endif
}

/* score_of in the softmax's units (score_ctx's raw): q.k itself where the score is plain and
 * the scale positive. */
DEV float unit_score(const score_ctx &s, float dot, int r, int c, int &bad)
{
#if SCORE_IS_PLAIN
    return s.raw ? dot : dot * s.scale;
#else
    return score_of(s, dot, r, c, bad);
#endif
}

/* kept_score in the softmax's units. */
DEV float kept_unit_score(const score_ctx &s, bool keep, float dot, int r, int c, int &bad)
{
#if SCORE_IS_PLAIN
    return keep ? unit_score(s, dot, r, c, bad) : NEG_INF;
#else
    return kept_score(s, keep, dot, r, c, bad);
#endif
}

/* d score_mod / d its score argument at (r, c) (1 without one): what dbias carries. Its lookups
 * are score_of's at the same pair, which reports them. */
DEV float score_mod_grad(const score_ctx &s, float dot, int r, int c)
{
#if HAS_SCORE_MOD
    int bad = 0;
    return mod_dscore_h(score_base(s, dot, r, c), s.b, s.h, r, c, 1.f, s.mods, s.hv, &bad);
#else
    return 1.f;
#endif
}

/* d score / d (scale * dot) at (r, c), for the backward: softcap's slope times score_mod's. */
DEV float score_grad(const score_ctx &s, float dot, int r, int c)
{
#if HAS_SOFTCAP
    float t = fast_tanh(dot * s.scale * s.inv_softcap);
    return (1.f - t * t) * score_mod_grad(s, dot, r, c);
#else
    return score_mod_grad(s, dot, r, c);
#endif
}

struct mod_tile;                   /* attn_mods.cuh: a tile's shared sums of the array gradients */

/* The score_mod's array gradients at (r, c) for dS (the gradient of the final score) scattered
 * into the accumulator, exactly and in any order (attn_mods.cuh), through the tile's shared sums
 * where tile (NULL: none) takes a lookup; lookups as score_mod_grad's. */
DEV void score_dtensors(const score_ctx &s, float dot, int r, int c, float ds, const mod_tile *tile)
{
#if HAS_DTENSORS
    int bad = 0;
    if (ds != 0.f)
        mod_dtensors_h(score_base(s, dot, r, c), s.b, s.h, r, c, ds, tile, s.mods, s.hv, &bad);
#endif
}

/* The mask array's and the mask_mod's verdict (causal, window and lengths are checked through
 * the row bounds, first: mask_mod runs only inside the lengths); bad as for score_of. */
DEV bool mask_keeps(const score_ctx &s, int r, int c, int &bad)
{
    bool keep = true;
#if MASK_ARRAY
    keep = s.mask[r * s.mask_sr + c * s.mask_sc] != 0;
#endif
#if HAS_MASK_MOD
    keep = mod_mask_q(s.b, s.h, r, c, s.mods, &bad) && keep;
#endif
    return keep;
}

/* Whether a tile that needs the per-element test keeps the pair (r, c), band: the pair lies
 * inside its row's lengths and causal / window band. mask_mod runs at every pair, band or not,
 * with no branch around it: its lookups clamp, so it can, and a tile's loads then issue together
 * instead of one latency after another behind a branch per pair; its faults count inside the
 * band only (bad), as if it had run there alone. The mask array is read inside the band only
 * (it has nothing past the lengths). */
DEV bool pair_keeps(const score_ctx &s, int r, int c, bool band, int &bad)
{
#if HAS_MASK_MOD
    int b = 0;
    const bool mod = mod_mask_q(s.b, s.h, r, c, s.mods, &b) != 0;
    bad |= band ? b : 0;
#else
    const bool mod = true;
#endif
#if MASK_ARRAY
    return band && mod && s.mask[r * s.mask_sr + c * s.mask_sc] != 0;
#else
    return band && mod;
#endif
}

/* mask_mod's block mask over rows [r0, r1) x columns [c0, c1) inside the lengths, for query
 * head h of s's sequence: the OR of its cells' ATTN_BLOCK_KEPT / ATTN_BLOCK_MASKED bits
 * (attn_block_mask.cu); both bits without one. */
DEV int mod_block_bits(const score_ctx &s, int64_t h, int64_t r0, int64_t r1, int64_t c0, int64_t c1)
{
#if HAS_MASK_MOD
    const attn_mods_gpu *m = s.mods;
    if (!m->blocks)
        return ATTN_BLOCK_KEPT | ATTN_BLOCK_MASKED;
    if (r1 <= r0 || c1 <= c0)
        return 0;
    const uint8_t *cells = m->blocks + s.b * m->blk_sb + h * m->blk_sh;
    const int64_t i1 = min((r1 - 1) / ATTN_BLOCK, m->blk_rows - 1), j1 = min((c1 - 1) / ATTN_BLOCK, m->blk_cols - 1);
    int bits = 0;
    for (int64_t i = r0 / ATTN_BLOCK; i <= i1; i++)
        for (int64_t j = c0 / ATTN_BLOCK; j <= j1; j++)
            bits |= cells[i * m->blk_cols + j];
    return bits;
#else
    return ATTN_BLOCK_KEPT | ATTN_BLOCK_MASKED;
#endif
}

/* Whether the mask array or mask_mod may mask some pair of rows [r0, r1) x columns [c0, c1)
 * (inside the lengths) of s's sequence and head: the tile then takes the per-element test; else
 * only the lengths and the causal / window band may mask it. */
DEV bool tile_maybe_masked(const score_ctx &s, int64_t r0, int64_t r1, int64_t c0, int64_t c1)
{
#if MASK_ARRAY
    return true;
#elif HAS_MASK_MOD
    return (mod_block_bits(s, s.h, r0, r1, c0, c1) & ATTN_BLOCK_MASKED) != 0;
#else
    return false;
#endif
}

/* Drops from both ends of the tile range [first, last] the tiles that mask_mod masks entirely
 * for every query head h of [s.h, s.h + heads): keys: key tiles of bn columns seen by rows
 * [a0, a1); else query tiles of bn rows seeing columns [a0, a1) (the dK/dV kernels). len: the
 * tiles' sequence length. Empty tiles between kept ones stay: computed, fully masked. Every
 * warp scans 32 tiles a step, one per lane (a document far from the sequence's start skips
 * hundreds of tiles: one by one, their loads' latencies would add up); call it with all 32
 * lanes of every warp. */
DEV void mod_narrow(const score_ctx &s, int heads, bool keys, int64_t a0, int64_t a1, int bn, int64_t len,
                    int &first, int &last)
{
#if HAS_MASK_MOD
    if (!s.mods->blocks)
        return;
    if (!s.mods->blk_sh)
        heads = 1;
    auto kept = [&](int n) {
        const int64_t t0 = (int64_t)n * bn, t1 = min(t0 + bn, len);
        int bits = 0;
        for (int64_t h = s.h; h < s.h + heads; h++)
            bits |= keys ? mod_block_bits(s, h, a0, a1, t0, t1) : mod_block_bits(s, h, t0, t1, a0, a1);
        return (bits & ATTN_BLOCK_KEPT) != 0;
    };
    const int lane = threadIdx.x & 31;
    int f = last + 1;
    for (int base = first; base <= last; base += 32) {
        const unsigned hit = __ballot_sync(0xffffffffu, base + lane <= last && kept(base + lane));
        if (hit) {
            f = base + __ffs(hit) - 1;
            break;
        }
    }
    int l = f - 1;
    for (int base = last; base >= f; base -= 32) {
        const unsigned hit = __ballot_sync(0xffffffffu, base - lane >= f && kept(base - lane));
        if (hit) {
            l = base - (__ffs(hit) - 1);
            break;
        }
    }
    first = f;
    last = l;
#endif
}

/* A lookup out of range that a tile's scores noted: the last pair that noted one (r < 0: none;
 * dot: its raw dot product). The tile reports it once, out of line (report_fault): checking
 * and reporting inline at every index of every score cost NVRTC seconds and registers. */
struct mod_fault {
    int r, c;
    float dot;
};

DEV mod_fault no_fault()
{
    mod_fault f;
    f.r = -1;
    f.c = 0;
    f.dot = 0.f;
    return f;
}

DEV void note_fault(mod_fault &f, int bad, int r, int c, float dot)
{
    if (bad) {
        f.r = r;
        f.c = c;
        f.dot = dot;
    }
}

#if ATTN_GMODS
/* The pair's lookups again, each reporting an index out of range (the generated _check twins):
 * mask_mod's, then score_mod's where the mask keeps the pair, as the tile evaluated them. The
 * backward's derivative code reads the score_mod's lookups, nothing else. */
static __device__ __noinline__ void mods_report(score_ctx s, mod_fault f)
{
#if HAS_MASK_MOD
    mod_mask_check(s.b, s.h, f.r, f.c, s.mods);
#endif
#if HAS_SCORE_MOD
    int bad = 0;
    if (mask_keeps(s, f.r, f.c, bad))
        mod_score_check(score_base(s, f.dot, f.r, f.c), s.b, s.h, f.r, f.c, s.mods);
#endif
}
#endif

DEV void report_fault(const score_ctx &s, const mod_fault &f)
{
#if ATTN_GMODS
    if (f.r >= 0)
        mods_report(s, f);
#endif
}

/* Which pairs of a warp's MT x NT fragment of scores (mma C layout) a tile keeps, a bit each
 * (a bool each would hold a register each: the 128 x 128 forward spilled). */
template <int MT, int NT>
struct tile_keep {
    uint32_t w[(MT * NT * 4 + 31) / 32];
    __device__ __forceinline__ bool at(int mt, int nt, int e) const
    {
        const int i = (mt * NT + nt) * 4 + e;
        return (w[i >> 5] >> (i & 31)) & 1u;
    }
};

/* keep for a tile: every pair when it needs no per-element test (need false), else
 * pair_keeps at each; pair(mt, nt, e, r, c, band) names element [mt][nt][e]'s query row, key
 * column and whether it lies inside the band. The generated kernels take this pass before the
 * scores: mask_mod's code then exists once, outside the score_mod's, and a masked tile's
 * lookups run as one batch. Faults are noted with the pair's raw dot (s). */
template <int MT, int NT, typename Pair>
DEV void keep_pass(const score_ctx &sc, bool need, const float (&s)[MT][NT][4], tile_keep<MT, NT> &keep,
                   mod_fault &fault, Pair pair)
{
#pragma unroll
    for (int j = 0; j < (MT * NT * 4 + 31) / 32; j++)
        keep.w[j] = need ? 0u : ~0u;
    if (!need)
        return;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r, c, bad = 0;
                bool band;
                pair(mt, nt, e, r, c, band);
                const int i = (mt * NT + nt) * 4 + e;
                keep.w[i >> 5] |= (uint32_t)pair_keeps(sc, r, c, band, bad) << (i & 31);
                note_fault(fault, bad, r, c, s[mt][nt][e]);
            }
}

#endif
