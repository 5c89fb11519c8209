/* Instantiates the CPU backend (cpu_impl.h) for float and double accumulation and routes a call
 * by dtype: float16, bfloat16 and float32 accumulate in float32, float64 in float64. */
#define _DEFAULT_SOURCE   /* madvise */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "block.h"
#include "convert.h"
#include "cpu.h"
#include "interp.h"
#include "seqlen.h"
#include "simd.h"

/* Tile sizes: a query tile of BQ rows against key tiles of BK columns (multiples of both SIMD
 * alignments). The backward splits keys into chunks until it has at least MIN_BWD_TASKS tasks;
 * the count depends on the shape only, so results never depend on the thread count. */
#define BQ 64
#define BK 64
#define MIN_BWD_TASKS 16
/* most memory the backward spends on per-task copies of score_mod's array gradients */
#define DTENSOR_BYTES ((double)(256 << 20))
#define ROUND_UP(x, a) (((x) + (a) - 1) / (a) * (a))

/* Packed K / V (and Q, dO) of at least this many bytes go in 2 MiB pages where Linux allows it
 * (transparent huge pages on madvise): one page fault where 512 small ones were. */
#define HUGE_PAGE_BYTES ((size_t)2 << 20)

/* Such blocks are also kept for the next call, up to BLOCK_CACHE_SLOTS blocks and
 * BLOCK_CACHE_BYTES in all: a fresh block costs a page fault and the kernel's zeroing of every
 * page (perf, S1024 D64 forward: clear_page 2.5-3% of the call, for 4 MiB of packed K / V). */
#define BLOCK_CACHE_SLOTS 8
#define BLOCK_CACHE_BYTES ((size_t)128 << 20)

static struct {
    pthread_mutex_t lock;
    void *ptr[BLOCK_CACHE_SLOTS];
    size_t bytes[BLOCK_CACHE_SLOTS];   /* 0: an empty slot */
} block_cache = {PTHREAD_MUTEX_INITIALIZER, {0}, {0}};

/* A cached block of exactly `bytes`, taken out of the cache, or NULL. Exactly: the caller gives
 * it back under the size it asked for (cpu_free_bytes), so a larger block would be kept under a
 * smaller size and the cache's bound no longer hold. */
static void *block_cache_take(size_t bytes)
{
    void *p = NULL;
    pthread_mutex_lock(&block_cache.lock);
    for (int i = 0; i < BLOCK_CACHE_SLOTS; i++)
        if (block_cache.bytes[i] == bytes) {
            p = block_cache.ptr[i];
            block_cache.bytes[i] = 0;
            break;
        }
    pthread_mutex_unlock(&block_cache.lock);
    return p;
}

/* Keeps a block of `bytes` for a later call; what does not fit (no slot, or past
 * BLOCK_CACHE_BYTES once the smaller blocks it may evict are gone) is freed. */
static void block_cache_give(void *p, size_t bytes)
{
    void *evict = NULL;
    pthread_mutex_lock(&block_cache.lock);
    size_t total = bytes;
    int slot = -1;
    for (int i = 0; i < BLOCK_CACHE_SLOTS; i++) {
        total += block_cache.bytes[i];
        if (slot < 0 || block_cache.bytes[i] < block_cache.bytes[slot])
            slot = i;   /* an empty slot, else the smallest block */
    }
    if (total - block_cache.bytes[slot] <= BLOCK_CACHE_BYTES && block_cache.bytes[slot] < bytes) {
        evict = block_cache.bytes[slot] ? block_cache.ptr[slot] : NULL;
        block_cache.ptr[slot] = p;
        block_cache.bytes[slot] = bytes;
        p = NULL;
    }
    pthread_mutex_unlock(&block_cache.lock);
    free(evict);
    free(p);
}

static size_t huge_block_bytes(size_t bytes)
{
    return (bytes + HUGE_PAGE_BYTES - 1) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
}

static void *cpu_alloc_bytes(size_t bytes)
{
    bytes = (bytes + 63) / 64 * 64;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_PAGE_BYTES) {
        bytes = huge_block_bytes(bytes);
        void *p = block_cache_take(bytes);
        if (p)
            return p;
        p = aligned_alloc(HUGE_PAGE_BYTES, bytes);
        if (p)
            madvise(p, bytes, MADV_HUGEPAGE);   /* advice only: nothing to do if refused */
        return p;
    }
#endif
    return aligned_alloc(64, bytes ? bytes : 64);
}

/* Frees a block of cpu_alloc_bytes(bytes) (NULL: nothing), keeping a large one for later. */
static void cpu_free_bytes(void *p, size_t bytes)
{
    bytes = (bytes + 63) / 64 * 64;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (p && bytes >= HUGE_PAGE_BYTES) {
        block_cache_give(p, huge_block_bytes(bytes));
        return;
    }
#endif
    free(p);
}

/* What a mask_mod does to a tile: drops every pair, keeps some, keeps every pair. */
enum { TILE_EMPTY = 0, TILE_PARTIAL = 1, TILE_FULL = 2 };

/* A forward's output rows go around the caches (non-temporal stores) when the output is at least
 * this large (a fair share of a last-level cache, which a caller reading it next would not
 * find it in anyway): nothing reads them again during the call, and an ordinary store first
 * reads its line from memory. Zen 2, B1 S1024 H8 D128 (4 MiB) with the output evicted between
 * calls (as the bench's torch call does): the output pass 0.45 -> 0.28 ms a thread (with the Q
 * tile transposed in place, cpu_impl.h: the S1024 D128 rows 3% faster, t/ax 1.16-1.20 ->
 * 1.20-1.23). */
#define STREAM_OUT_BYTES ((size_t)4 << 20)

/* dst[0 .. bytes) = src[0 .. bytes): the whole 64-byte lines of dst by non-temporal stores where
 * the CPU has them (x86-64: SSE2) and dst is 16-byte aligned, the partial lines at either end
 * (which other rows share) and everything elsewhere by memcpy; stream_fence() then orders them
 * before the stores that follow (once per batch of rows: a fence per row cost more than it
 * saved). */
static inline void stream_copy(void *dst, const void *src, size_t bytes)
{
#ifdef __SSE2__
    char *d = (char *)dst;
    const char *s = (const char *)src;
    const size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (((uintptr_t)d & 15) == 0 && bytes >= head + 64) {
        const size_t body = (bytes - head) & ~(size_t)63;
        memcpy(d, s, head);
        for (size_t x = head; x < head + body; x += 16)
            _mm_stream_si128((__m128i *)(d + x), _mm_loadu_si128((const __m128i *)(s + x)));
        memcpy(d + head + body, s + head + body, bytes - head - body);
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

static inline void stream_fence(void)
{
#ifdef __SSE2__
    _mm_sfence();
#endif
}

/* libgomp's worker pool does not survive fork(): a child entering a parallel region of several
 * threads waits forever for workers that were never copied into it. A forked child therefore
 * runs the backend on its one thread (same results: they never depend on the thread count). */
static volatile int in_forked_child;

/* The block cache's lock is held across fork(), so that the child's copy is consistent. */
static void before_fork(void) { pthread_mutex_lock(&block_cache.lock); }

static void after_fork_parent(void) { pthread_mutex_unlock(&block_cache.lock); }

static void mark_forked_child(void)
{
    in_forked_child = 1;
    pthread_mutex_unlock(&block_cache.lock);
}

static void register_fork_handler(void) { pthread_atfork(before_fork, after_fork_parent, mark_forked_child); }

void cpu_init(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
}

/* Threads for one call: 1 in a forked child, else the caller's count or OpenMP's default. */
static int cpu_threads(int requested)
{
#ifdef _OPENMP
    if (in_forked_child)
        return 1;
    return requested > 0 ? requested : omp_get_max_threads();
#else
    (void)requested;
    return 1;
#endif
}

#define T float
#define SUF f32
#define OPS simd_f32()
#define LOAD_ROW load_row_f32
#define STORE_ROW store_row_f32
#define TANH tanhf
#define LOG logf
#define LOG2 log2f
#define EXP expf
#include "cpu_impl.h"
#undef T
#undef SUF
#undef OPS
#undef LOAD_ROW
#undef STORE_ROW
#undef TANH
#undef LOG
#undef LOG2
#undef EXP

#define T double
#define SUF f64
#define OPS simd_f64()
#define LOAD_ROW load_row_f64
#define STORE_ROW store_row_f64
#define TANH tanh
#define LOG log
#define LOG2 log2
#define EXP exp
#include "cpu_impl.h"

int cpu_forward(const attn_params *p)
{
    return p->dtype == DT_F64 ? cpu_forward_f64(p) : cpu_forward_f32(p);
}

int cpu_backward(const attn_params *p)
{
    return p->dtype == DT_F64 ? cpu_backward_f64(p) : cpu_backward_f32(p);
}
