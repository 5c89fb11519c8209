/* mask_mod's block mask: one byte per ATTN_BLOCK x ATTN_BLOCK cell of query rows x key columns of
 * a sequence (csrc/attn_params.h: attn_mods_gpu.blocks), saying whether mask_mod keeps some pair
 * of the cell inside the lengths (ATTN_BLOCK_KEPT) and whether it masks some (ATTN_BLOCK_MASKED).
 * The attention kernels read it (attn_common.cuh: mod_block_bits) to skip the key or query
 * tiles at either end of their range that mask_mod masks entirely, and to leave out the
 * per-element mask_mod test on tiles it keeps entirely.
 *
 * mask_mod is evaluated at every pair inside the lengths, as the reference does (a lookup out of
 * range anywhere there is reported), whatever causal and window say: they are the kernels' own
 * business. A CTA takes the cells of a row of cells its grid's width leaves it (at most
 * ATTN_BLOCK_CELLS, codegen.block_mask_grid): first one thread per cell asks
 * the generated mod_mask_cell (attn_mods.cuh: intervals over the cell's rows and columns) what
 * mask_mod may give there, which settles most cells of a document, causal or window mask at the
 * cost of a few lookups; a cell it cannot settle, or where a checked lookup may leave its array,
 * is then evaluated pair by pair by the whole CTA: thread t takes row t % 64 of the cell and
 * half its columns. Grid: (CTAs per row of cells, row cells, slices), a slice being
 * one (b, h) of blocks' layout (b and h are 0 when mask_mod reads neither and blk_sb / blk_sh
 * are 0); 128 threads. A lookup out of range is noted branch-free at each pair (mod_mask_q) and
 * reported once per thread, out of line (mod_mask_check), as the attention kernels' tiles do
 * (attn_common.cuh: mod_fault).
 *
 * Compile-time switches: those of attn_common.cuh with HAS_MASK_MOD, and ATTN_BLOCK_CELLS
 * (kernels.block_mask_defines).
 */
#include "attn_common.cuh"

#if ENTRY(attn_block_mask)
extern "C" __global__ void __launch_bounds__(128) attn_block_mask(const __grid_constant__ attn_params p)
{
#if HAS_MASK_MOD
    const attn_mods_gpu *m = &p.gmods;
    const int64_t heads = m->blk_sh ? p.Hq : 1;
    const int64_t b = blockIdx.z / heads, h = blockIdx.z % heads;
    const seq_t sq = seq_q(&p, b), sk = seq_k(&p, b);
    const int64_t r0 = (int64_t)blockIdx.y * ATTN_BLOCK, r1 = min(r0 + ATTN_BLOCK, sq.len) - 1;
    uint8_t *cells = (uint8_t *)m->blocks + b * m->blk_sb + h * m->blk_sh + blockIdx.y * m->blk_cols;
    __shared__ int todo[ATTN_BLOCK_CELLS], ntodo;
    if (threadIdx.x == 0)
        ntodo = 0;
    __syncthreads();
    const int per = (int)((m->blk_cols + gridDim.x - 1) / gridDim.x);   /* <= ATTN_BLOCK_CELLS */
    const int64_t x = (int64_t)blockIdx.x * per + threadIdx.x;
    if (threadIdx.x < per && x < m->blk_cols) {
        const int64_t c0 = x * ATTN_BLOCK, c1 = min(c0 + ATTN_BLOCK, sk.len) - 1;
        const int bits = r0 <= r1 && c0 <= c1 ? mod_mask_cell(b, h, r0, r1, c0, c1, m) : 0;
        if (bits == (ATTN_BLOCK_KEPT | ATTN_BLOCK_MASKED))
            todo[atomicAdd(&ntodo, 1)] = (int)x;
        else
            cells[x] = (uint8_t)bits;
    }
    __syncthreads();
    const int64_t r = r0 + threadIdx.x % ATTN_BLOCK;
    for (int i = 0; i < ntodo; i++) {
        const int64_t c0 = (int64_t)todo[i] * ATTN_BLOCK + (threadIdx.x / ATTN_BLOCK) * (ATTN_BLOCK / 2);
        int bits = 0;
        mod_fault fault = no_fault();
        if (r <= r1) {
            const int64_t c1 = min(c0 + ATTN_BLOCK / 2, sk.len);
            for (int64_t c = c0; c < c1; c++) {
                int bad = 0;
                bits |= mod_mask_q(b, h, r, c, m, &bad) ? ATTN_BLOCK_KEPT : ATTN_BLOCK_MASKED;
                note_fault(fault, bad, (int)r, (int)c, 0.f);
            }
        }
        if (fault.r >= 0)
            mod_mask_check(b, h, fault.r, fault.c, m);
        const int kept = __syncthreads_or(bits & ATTN_BLOCK_KEPT), masked = __syncthreads_or(bits & ATTN_BLOCK_MASKED);
        if (threadIdx.x == 0)
            cells[todo[i]] = (uint8_t)((kept ? ATTN_BLOCK_KEPT : 0) | (masked ? ATTN_BLOCK_MASKED : 0));
    }
#endif
}
#endif
