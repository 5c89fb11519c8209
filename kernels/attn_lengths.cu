/* The check of device lengths (attnext/cuda/lengths.py): varlen_attention's cu_seqlens_* and
 * seqused_*, given as CUDA int32 arrays with max_seqlen_* beside them, are read by the attention
 * kernels where they lie, never by the host, so no call waits for the GPU. This kernel runs
 * first on the call's stream and checks what the host checks of host lengths: cu_seqlens starts
 * at 0, never decreases and ends inside the packed tensor, no segment is longer than max_seqlen,
 * and 0 <= seqused <= the segment. A call's first fault goes into the process's record in pinned
 * host memory, which the GPU writes at its host address (unified addressing), unless one waits
 * there already; the next call reads it and raises ValueError. The attention kernels clamp the
 * lengths meanwhile (seqlen.h), so wrong lengths read and write nothing outside the arrays.
 *
 * attn_pages checks a paged cache's block table the same way when it is a CUDA array the host
 * never reads: every page a sequence reads (those covering its length) in [0, num_pages); the
 * attention kernels clamp page indices meanwhile (key_row), and the next call raises IndexError.
 *
 * No compile-time switches; parameters: the structs below, by value. attn_lengths runs one CTA;
 * attn_pages a grid (table columns / 256, rows), one entry a thread.
 */
#define DEV static __device__ __forceinline__

typedef int int32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

/* The record: [0] the fault's code (0: none), written last, after [1] the array (0 cu_seqlens_q,
 * 1 cu_seqlens_k, 2 seqused_q, 3 seqused_k), [2] the index, [3] the value, [4] the bound it
 * broke and [5] the device. The CTA picks its first fault in shared memory and one thread writes
 * it with plain stores (atomics on host memory are not atomic over PCIe), unless a fault waits
 * there already. */
enum { LEN_START = 1, LEN_DECREASES = 2, LEN_PAST_END = 3, LEN_LONGER = 4, LEN_NEGATIVE = 5, LEN_USED_PAST = 6,
       PAGE_OUT_OF_RANGE = 7, SEQLENS_K_OUTSIDE = 8 };

struct lengths_params {
    const int32_t *cu[2];        /* cu_seqlens_q, cu_seqlens_k (B + 1) */
    const int32_t *used[2];      /* seqused_q, seqused_k (B), or null */
    int64_t *record;
    int64_t B, device;
    int64_t rows[2];             /* the packed tensors' rows, Tq and Tk */
    int64_t max_len[2];          /* max_seqlen_q, max_seqlen_k */
};

/* attn_pages: block_table (B, max_pages) int32, rows bt_stride apart; sequence b reads the pages
 * covering its length, used[b] (or Sk = max_pages * page_size without used) */
struct pages_params {
    const int32_t *table;
    const int32_t *used;
    int64_t *record;
    int64_t B, device, bt_stride, max_pages, page_size, num_pages;
    uint64_t call;               /* this launch's number (lengths.py), increasing */
};

/* The last attn_pages launch whose fault went into the record: one CTA reports per call. */
__device__ uint64_t pages_claim;

struct fault_slot {
    int taken;
    int64_t code, array, index, value, bound;
};

DEV void fault(fault_slot &f, int64_t code, int64_t array, int64_t index, int64_t value, int64_t bound)
{
    if (atomicCAS(&f.taken, 0, 1) != 0)
        return;
    f.code = code;
    f.array = array;
    f.index = index;
    f.value = value;
    f.bound = bound;
}

/* The CTA's fault, if any, into the record, unless one waits there already: the code last. */
DEV void report(const fault_slot &f, int64_t *record, int64_t device, int64_t column)
{
    volatile int64_t *r = record;
    if (!f.taken || r[0] != 0)
        return;
    r[1] = f.array;
    r[2] = f.index;
    r[3] = f.value;
    r[4] = f.bound;
    r[5] = device;
    r[6] = column;
    __threadfence_system();
    r[0] = f.code;
}

extern "C" __global__ void __launch_bounds__(256) attn_lengths(const __grid_constant__ lengths_params p)
{
    __shared__ fault_slot f;
    if (threadIdx.x == 0)
        f.taken = 0;
    __syncthreads();
    for (int64_t b = threadIdx.x; b <= p.B; b += blockDim.x)
#pragma unroll
        for (int side = 0; side < 2; side++) {
            const int32_t *cu = p.cu[side];
            const int64_t at = cu[b];
            if (b == 0 && at != 0)
                fault(f, LEN_START, side, 0, at, 0);
            if (b == p.B) {
                if (at > p.rows[side])
                    fault(f, LEN_PAST_END, side, b, at, p.rows[side]);
                continue;
            }
            const int64_t next = cu[b + 1], seg = next - at;
            if (seg < 0)
                fault(f, LEN_DECREASES, side, b + 1, next, at);
            else if (seg > p.max_len[side])
                fault(f, LEN_LONGER, side, b, seg, p.max_len[side]);
            const int32_t *used = p.used[side];
            if (used) {
                const int64_t u = used[b];
                if (u < 0)
                    fault(f, LEN_NEGATIVE, 2 + side, b, u, 0);
                else if (seg >= 0 && u > seg)
                    fault(f, LEN_USED_PAST, 2 + side, b, u, seg);
            }
        }
    __syncthreads();
    if (threadIdx.x == 0)
        report(f, p.record, p.device, 0);
}

/* The record's words as attn_lengths writes them; for a page fault [1] is 4 (block_table), [2] the
 * row b, [3] the page index found, [4] num_pages, [6] the column j; for a length outside the
 * table's rows (a CUDA seqlens_k, checks._seqlens_k_in_place) [1] is 5 (seqlens_k), [2] b, [3]
 * the length, [4] the rows. */
extern "C" __global__ void __launch_bounds__(256) attn_pages(const __grid_constant__ pages_params p)
{
    __shared__ fault_slot f;
    __shared__ int64_t column;
    if (threadIdx.x == 0)
        f.taken = 0;
    __syncthreads();
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t b = blockIdx.y; b < p.B && j < p.max_pages; b += gridDim.y) {
        /* both loads issued together: entry j of row b lies inside the table whether read or not */
        const int64_t rows = p.max_pages * p.page_size;
        const int64_t len = p.used ? (int64_t)p.used[b] : rows;
        const int64_t page = p.table[b * p.bt_stride + j];
        if (j == 0 && (len < 0 || len > rows)) {
            if (atomicCAS(&f.taken, 0, 1) == 0) {
                f.code = SEQLENS_K_OUTSIDE;
                f.array = 5;
                f.index = b;
                f.value = len;
                f.bound = rows;
                column = 0;
            }
        } else if (j < (len <= 0 ? 0 : (min(len, rows) + p.page_size - 1) / p.page_size) &&
                   (page < 0 || page >= p.num_pages)) {
            if (atomicCAS(&f.taken, 0, 1) == 0) {
                f.code = PAGE_OUT_OF_RANGE;
                f.array = 4;
                f.index = b;
                f.value = page;
                f.bound = p.num_pages;
                column = j;
            }
        }
    }
    __syncthreads();
    /* one CTA of the call reports (the first to claim the call), so faults in several CTAs never
     * mix their words in the record */
    if (threadIdx.x == 0 && f.taken && atomicMax(&pages_claim, p.call) < p.call)
        report(f, p.record, p.device, column);
}
