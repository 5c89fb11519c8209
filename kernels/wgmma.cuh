/* Hopper's warpgroup tensor-core instructions (sm_90a) as inline PTX: wgmma.mma_async with
 * operands in shared memory described by 64-bit matrix descriptors, its fences, and the 128-byte
 * swizzled shared-memory layout the descriptors below describe.
 *
 * Layout (SW128): a tile of ROWS rows x COLS 16-bit elements (COLS a multiple of 64) is stored as
 * COLS / 64 blocks of ROWS x 128 bytes; inside a block, row r's 16-byte chunk c sits at chunk
 * c ^ (r % 8). Every block starts 1024-byte aligned, so the hardware's swizzle (address bits 4-6
 * XOR bits 7-9) is exactly that permutation.
 *   As a K-major operand (rows = M or N, columns = K: Q and K of S = Q K^T): one k16 step is 32
 *   bytes inside a block's rows; 8-row groups are 1024 bytes apart (SBO).
 *   As an MN-major operand (rows = K, columns = N: V of O = P V, "transposed"): one k16 step is 16
 *   rows (2048 bytes); 64-column blocks are ROWS * 128 bytes apart (LBO), 8-row groups 1024 (SBO).
 *
 * Float32 (TF32 products, ELEM_F32) takes the same bytes: a 128-byte row holds 32 floats and one
 * k8 step is 32 bytes, as a k16 step of 16-bit elements; TF32 operands are K-major only.
 *
 * Accumulators: warp w of the warpgroup holds rows 16w..16w+15 of the m64 result in the mma.sync
 * C-fragment layout (attn_common.cuh's legend), d[j] being columns 8j..8j+7; the register A
 * operand is the m16n8k16 A fragment of the same 16 rows. So the tile code of attn_fwd_tile.cuh
 * serves both instruction families.
 *
 * The operand lists are spelled out per shape (inline asm takes no loops).
 */
#ifndef ATTNEXT_WGMMA_CUH
#define ATTNEXT_WGMMA_CUH

#include "attn_common.cuh"

#if ELEM_BF16
#define WGMMA_AB "bf16.bf16"
#else
#define WGMMA_AB "f16.f16"
#endif

/* Shared-memory matrix descriptor of an SW128 operand at shared address addr. */
DEV uint64_t sw128_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo_bytes >> 4) << 16)
           | ((uint64_t)(sbo_bytes >> 4) << 32) | (1ull << 62);
}

/* What a descriptor of addr + bytes adds to one of addr (bytes a multiple of 16): the start
 * address field in 16-byte units, which cannot carry while shared addresses stay below 2^18.
 * A product's steps then add constants to one base instead of rebuilding each descriptor. */
DEV constexpr uint64_t desc_step(uint32_t bytes) { return bytes >> 4; }

/* d with its varying low word taken from lane 0: the same value on every lane (a warpgroup's
 * descriptors are), and one ptxas knows to be uniform, so that the steps' additions run on the
 * uniform datapath instead of being rebuilt in each lane and moved over (R2UR) per wgmma. */
DEV uint64_t uniform_desc(uint64_t d)
{
    return (d & ~0xffffffffull) | __shfl_sync(0xffffffffu, (uint32_t)d, 0);
}

/* Byte offset of row r, 16-byte chunk c (of the whole row, c < COLS / 8) in an SW128 tile. */
template <int ROWS>
DEV uint32_t sw128_offset(int r, int c)
{
    return (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

/* ROWS x COLS elements into an SW128 tile at shared address base by cp.async (16 bytes each,
 * consecutive threads along a row): row r from src + r * row_stride, contiguous. Rows at or past
 * `valid` are zero. A thread's chunks sit STEP rows apart; when that is a multiple of 8 its
 * swizzle is the same on every row: one address per tile, constant offsets. Commit and wait are
 * the caller's. UNROLL: the loop's unrolling (a producer warp short of registers takes 1). */
template <int ROWS, int COLS, int NTHREADS, int UNROLL = ROWS * COLS / 8 / NTHREADS>
DEV void load_sw128(uint32_t base, const elem_t *src, int64_t row_stride, int valid, int tid)
{
    constexpr int CHUNKS = COLS / 8, STEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % STEP == 0 && (STEP % 8 == 0 || 8 % STEP == 0),
                  "tile and block do not fit");
    const int r0 = tid / CHUNKS, c = tid % CHUNKS;
    const elem_t *row = src + r0 * row_stride + c * 8;
    const uint32_t dst = base + sw128_offset<ROWS>(r0, c);
#pragma unroll UNROLL
    for (int j = 0; j < ROWS / STEP; j++) {
        const bool ok = r0 + j * STEP < valid;
        const uint32_t at = STEP % 8 == 0 ? dst + j * STEP * 128 : base + sw128_offset<ROWS>(r0 + j * STEP, c);
        cp_async16(at, ok ? row + j * STEP * row_stride : src, ok ? 16 : 0);
    }
}

/* The accumulator operands of a wgmma of N n8 groups (d[N][4]: C fragments, read and written). */
#define WGMMA_D4(d) "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]),   \
    "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define WGMMA_D8_HI(d) "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), \
    "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]),      \
    "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define WGMMA_D8(d) WGMMA_D4(d), WGMMA_D8_HI(d)
#define WGMMA_D16_HI(d) "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]),  \
    "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), \
    "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]),              \
    "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]),              \
    "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define WGMMA_D16(d) WGMMA_D8(d), WGMMA_D16_HI(d)
#define WGMMA_D22(d) WGMMA_D16(d), \
    "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), \
    "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), \
    "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), \
    "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3])

DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
DEV void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

/* Shared memory written through the generic proxy (cp.async, st.shared) made visible to the
 * async proxy that wgmma reads it with. */
DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

/* Keeps the compiler from moving reads or writes of accumulator registers across a wgmma's
 * issue or wait (the asm statements do not name them). */
template <int NJ>
DEV void fence_acc(float (&d)[NJ][4])
{
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            asm volatile("" : "+f"(d[j][e])::"memory");
}

/* d (+)= A B for m64n64k16: A and B from shared memory (descriptors). */
DEV void wgmma_m64n64_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." WGMMA_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WGMMA_D8(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* d (+)= A B for m64n128k16: A and B from shared memory (descriptors). */
DEV void wgmma_m64n128_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." WGMMA_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WGMMA_D16(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* d (+)= A B for m64n176k16: A and B from shared memory (descriptors). */
DEV void wgmma_m64n176_ss(float (&d)[22][4], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n176k16.f32." WGMMA_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
                 : WGMMA_D22(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* d (+)= A B for m64n64k16: A from registers (the m16n8k16 A fragment of this warp's 16 rows),
 * B from shared memory, MN-major (transposed: N contiguous). */
DEV void wgmma_m64n64_rs_t(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b, int accumulate = 1)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." WGMMA_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : WGMMA_D8(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

/* d (+)= A B for m64n128k16: A from registers (the m16n8k16 A fragment of this warp's 16 rows),
 * B from shared memory, MN-major (transposed: N contiguous). */
DEV void wgmma_m64n128_rs_t(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b, int accumulate = 1)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." WGMMA_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : WGMMA_D16(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

/* d (+)= A B for m64n64k16 with both operands in shared memory MN-major (transposed: A's M
 * and B's N contiguous). */
DEV void wgmma_m64n64_ss_tt(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." WGMMA_AB " "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
                 : WGMMA_D8(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

#if ELEM_F32
/* d (+)= A B for m64n64k8 in TF32: A and B from shared memory, both K-major (TF32 has no
 * transposed operand). */
DEV void wgmma_m64n64k8_tf32_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
                 : WGMMA_D8(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* d (+)= A B for m64n64k8 in TF32: A from registers (a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
 * a3 (g + 8, t + 4) of this warp's 16 rows, mma.m16n8k8's A fragment), B from shared memory,
 * K-major. */
DEV void wgmma_m64n64k8_tf32_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : WGMMA_D8(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

/* d (+)= A B for m64n128k8 in TF32: A from registers (a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
 * a3 (g + 8, t + 4) of this warp's 16 rows, mma.m16n8k8's A fragment), B from shared memory,
 * K-major. */
DEV void wgmma_m64n128k8_tf32_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : WGMMA_D16(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
#endif

#endif
