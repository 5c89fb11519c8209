/* Hopper's (sm_90a) tools for warp-specialised kernels as inline PTX: shared-memory mbarriers
 * (arrive, the phase-parity wait, the arrive cp.async completions trigger), register
 * reallocation between warpgroups (setmaxnreg) and the bulk asynchronous copies and reductions
 * of contiguous blocks between shared and global memory.
 *
 * mbarrier phases: a barrier initialised with count n completes a phase after n arrivals; a
 * waiter that wants the k-th completion (k = 0, 1, ...) waits for parity k & 1.
 */
#ifndef ATTNEXT_SM90_PIPE_CUH
#define ATTNEXT_SM90_PIPE_CUH

#include "attn_common.cuh"

/* The calling warp's index as ptxas knows to be warp-uniform (lane 0's, by a shuffle). Roles split
 * by it then count as uniform branches, and what a role computes from uniform values stays on
 * the uniform datapath; split by threadIdx.x >> 5, ptxas took such values for per-thread ones
 * (the persistent WS forward: the tile, the key loop's index and ring position, the stages'
 * descriptors in vector registers, each descriptor shuffled between the turn's barrier and the
 * products: 984 static instructions a key tile, 962 split by this; bench/NOTES.md, forward). */
DEV int uniform_warp_index() { return __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 5), 0); }

DEV void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

/* After every barrier is initialised, before a CTA-wide barrier: the inits visible to all. */
DEV void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

/* One arrival (release: this thread's earlier writes are seen by whoever waits for the phase). */
DEV void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

/* n arrivals at once (release, as mbar_arrive). */
DEV void mbar_arrive_n(uint32_t bar, int n)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n) : "memory");
}

/* One arrival, made when every cp.async this thread issued so far has landed. */
DEV void mbar_arrive_cp_async(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

/* One arrival that also makes the phase wait for `bytes` more of bulk-copy transfers (bulk_load). */
DEV void mbar_arrive_expect_tx(uint32_t bar, int bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

/* The phase also waits for `bytes` more of bulk-copy transfers, no arrival (bulk_load). */
DEV void mbar_expect_tx(uint32_t bar, int bytes)
{
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

/* Until the phase of parity `parity` has completed (acquire). */
DEV void mbar_wait(uint32_t bar, int parity)
{
    asm volatile("{\n.reg .pred done;\nwait_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

/* This CTA's rank in its cluster. */
DEV int cluster_rank()
{
    int r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/* Every thread of every CTA of the cluster meets here (whole warps): the mbarriers one CTA made
 * before it (mbar_init_fence: a release at cluster scope) are there for the others' arrivals and
 * copies after it. The arrival is relaxed (CUTLASS's cluster_arrive_relaxed): what else a thread
 * wrote before is not ordered for the other CTA (a release here is a MEMBAR.GPU a thread). */
DEV void cluster_sync()
{
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
                 "barrier.cluster.wait.aligned;" ::: "memory");
}

/* One arrival on the mbarrier at `bar` in the shared memory of the cluster's CTA of rank `rank`
 * (this one's included), release at CTA scope: for a consumer whose reads of a stage have
 * completed (wgmma_wait) telling the producers that the stage may be overwritten, as CUTLASS's
 * ClusterBarrier::arrive does. At cluster scope the release is a MEMBAR.GPU before each arrival
 * (ptxas: MEMBAR.ALL.GPU, ERRBAR, CGAERRBAR), which made the paired forward 20-35% slower (H200,
 * bench/NOTES.md, forward v28). */
DEV void mbar_arrive_at(uint32_t bar, int rank)
{
    asm volatile("{\n.reg .b32 at;\n"
                 "mapa.shared::cluster.u32 at, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [at];\n}" ::"r"(bar), "r"(rank) : "memory");
}

/* Named barrier id (not 0: __syncthreads') across n threads, whole warps. */
DEV void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }

/* The warpgroup's registers per thread raised or lowered to N (every thread of it calls). */
template <int N>
DEV void regs_raise() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
DEV void regs_lower() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

/* dst[i] += src[i] (float32) for bytes / 4 elements, a shared block into global memory by the
 * bulk-copy engine (both 16-byte aligned, bytes a multiple of 16); one bulk group per call. */
DEV void bulk_add_f32(float *dst, uint32_t src, int bytes)
{
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 "cp.async.bulk.commit_group;" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}

/* dst[i] = src[i] for bytes / 16 16-byte pieces, a shared block into global memory by the bulk-copy
 * engine (both 16-byte aligned, bytes a multiple of 16); one bulk group per call. */
DEV void bulk_store(void *dst, uint32_t src, int bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 "cp.async.bulk.commit_group;" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}

/* dst (shared) = src (global) for bytes / 16 16-byte pieces by the bulk-copy engine (both 16-byte
 * aligned, bytes a multiple of 16); the transfer counts towards bar's phase (mbar_arrive_expect_tx). */
DEV void bulk_load(uint32_t dst, const void *src, int bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

/* dst (shared) = the box of a tensor map (a 4-d CUtensorMap in parameter or global memory) at
 * coordinates (col, head, row, outer), its bytes counted on bar (mbar_arrive_expect_tx) */
DEV void tma_load_4d(uint32_t dst, const void *map, int col, int head, int row, int outer, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(dst), "l"(map), "r"(col), "r"(head), "r"(row), "r"(outer), "r"(bar) : "memory");
}

/* tma_load_4d into the same place (dst, and bar's bytes) of every CTA of the cluster whose bit
 * is set in `ctas` (bit r: rank r): one read of global memory for all of them. */
DEV void tma_load_4d_multicast(uint32_t dst, const void *map, int col, int head, int row, int outer, uint32_t bar,
                               uint16_t ctas)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
                 ::"r"(dst), "l"(map), "r"(col), "r"(head), "r"(row), "r"(outer), "r"(bar), "h"(ctas) : "memory");
}

/* The box of a tensor map (a 4-d CUtensorMap in parameter or global memory) at coordinates (col,
 * head, row, outer) = src (shared) by the bulk-copy engine, what lies past the tensor left
 * unwritten; one bulk group per call. */
DEV void tma_store_4d(const void *map, uint32_t src, int col, int head, int row, int outer)
{
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 "cp.async.bulk.commit_group;" ::"l"(map), "r"(src), "r"(col), "r"(head), "r"(row), "r"(outer)
                 : "memory");
}

/* Until this thread's bulk groups have read their shared memory (it may be rewritten). */
DEV void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

/* Until this thread's bulk groups are complete: their writes performed. */
DEV void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

/* Between the generic proxy's shared-memory writes and the async proxy's (bulk copies) there. */
DEV void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

/* Between the generic proxy's global accesses (flags) and the async proxy's (bulk copies). */
DEV void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

#endif
