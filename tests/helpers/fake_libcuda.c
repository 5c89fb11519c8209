/* A fake libcuda: the driver API calls attnext dlopens, implemented on host memory (a "device
 * pointer" is a malloc'd host address; launches do nothing). tests/helpers/fake_cuda.py builds it;
 * the tests run the host side of every CUDA path on it without a GPU, and bench/labs/lab_host.py
 * times the GPU call's host path on it.
 *
 * FAKE_CUINIT=<code>: cuInit returns that error. -DNO_ALLOC_ASYNC: a driver without
 * cuMemAllocAsync. -DTENSOR_MAPS: a driver with cuTensorMapEncodeTiled (zeroed maps, counted in
 * `tensor_maps`; the last four's dims, strides, box and L2 promotion in `map_dims`, `map_strides`,
 * `map_box`, `map_l2`;
 * maps the driver would refuse are refused), so the TMA kernels (WS, TMA_KV, the backward's
 * BWD_TMA) are chosen. Counters the tests read through ctypes: `waits` (cuStreamWaitEvent),
 * `launches` (cuLaunchKernel), `dependent_launches` (cuLaunchKernelEx's), `allocs` and `frees`
 * (device memory), `host_allocs` and
 * `host_frees` (cuMemHostAlloc, cuMemFreeHost; `freed_ptrs` the last 1024 freed, and setting
 * `slow_free_us` makes each cuMemFreeHost sleep that long), `pool_threshold` (the memory pool's release
 * threshold), `pool_trims` (cuMemPoolTrimTo calls), `registered` (host ranges
 * registered now) and `registrations` (cuMemHostRegister calls that succeeded); setting
 * `register_error` makes every cuMemHostRegister fail with that code. With `record` set, each
 * launch of a kernel taking attn_params is copied into `last_launch` (built with -I csrc); the
 * launches of small_args' kernels are counted, not recorded.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attn_params.h"
typedef unsigned long long ptr_t;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_FOUND = 500, ALREADY_REGISTERED = 712,
       NOT_REGISTERED = 713 };
static void *current;
int cuInit(unsigned flags) { return getenv("FAKE_CUINIT") ? atoi(getenv("FAKE_CUINIT")) : OK; }
int cuDriverGetVersion(int *v)     /* FAKE_DRIVER_VERSION: 12080 for CUDA 12.8; else a CUDA 99 driver */
{
    *v = getenv("FAKE_DRIVER_VERSION") ? atoi(getenv("FAKE_DRIVER_VERSION")) : 99000;
    return OK;
}
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return OK; }
int cuDeviceGetCount(int *n) { *n = 1; return OK; }
int cuDeviceGetName(char *name, int len, int d) { strncpy(name, "Fake GPU", len); return OK; }
int cuDeviceGetAttribute(int *v, int attr, int d)
{
    *v = attr == 75 ? 9 : attr == 76 ? 0 : attr == 16 ? 132 : attr == 97 ? 232448
       : attr == 38 ? 52428800 : attr == 115 ? 1 : attr == 113 ? 1 : 0;
    return OK;
}
int cuDeviceTotalMem_v2(size_t *b, int d) { *b = (size_t)80 << 30; return OK; }
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)0x100; return OK; }
int cuCtxSetCurrent(void *c) { current = c; return OK; }
int cuCtxGetCurrent(void **c) { *c = current; return OK; }
int cuCtxSynchronize(void) { return OK; }
int cuModuleLoadData(void **m, const void *image) { *m = (void *)0x200; return OK; }
int cuModuleUnload(void *m) { return OK; }
/* The kernels whose argument is not an attn_params (the launch record must not read past it). */
static const char *const small_args[] = {"attn_dtensors", "attn_lengths", "attn_pages", "attn_convert",
                                         "attn_merge"};
#define FN_ATTN ((void *)0x300)
#define FN_SMALL ((void *)0x301)
int cuModuleGetFunction(void **f, void *m, const char *name)
{
    *f = FN_ATTN;
    for (size_t i = 0; i < sizeof small_args / sizeof *small_args; i++)
        if (!strcmp(name, small_args[i]))
            *f = FN_SMALL;
    return strcmp(name, "missing") ? OK : NOT_FOUND;
}
int cuFuncSetAttribute(void *f, int attr, int v) { return OK; }
int cuFuncGetAttribute(int *v, int attr, void *f) { *v = attr; return OK; }
int launches, allocs, frees, record;
struct {
    void *fn;
    unsigned grid[3], block[3], smem;
    void *stream;
    attn_params params;
} last_launch;
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void *stream, void **params, void **extra)
{
    launches++;
    if (record && params && f == FN_ATTN) {
        last_launch.fn = f;
        last_launch.grid[0] = gx, last_launch.grid[1] = gy, last_launch.grid[2] = gz;
        last_launch.block[0] = bx, last_launch.block[1] = by, last_launch.block[2] = bz;
        last_launch.smem = smem;
        last_launch.stream = stream;
        memcpy(&last_launch.params, params[0], sizeof last_launch.params);
    }
    return OK;
}
/* CUDA 12's launch with attributes: counted in `dependent_launches` when it asks for programmatic
 * stream serialisation (attribute 6 = 1: cuda.h's layout, 8 bytes of id then a 64-byte value),
 * then launched as cuLaunchKernel. */
int dependent_launches;
typedef struct { int id; char pad[4]; union { char bytes[64]; int allowed; } value; } fake_attr;
typedef struct {
    unsigned gx, gy, gz, bx, by, bz, smem;
    void *stream;
    fake_attr *attrs;
    unsigned n_attrs;
} fake_config;
int cuLaunchKernelEx(const fake_config *c, void *f, void **params, void **extra)
{
    for (unsigned i = 0; i < c->n_attrs; i++)
        if (c->attrs[i].id == 6 && c->attrs[i].value.allowed)
            __atomic_add_fetch(&dependent_launches, 1, __ATOMIC_RELAXED);
    return cuLaunchKernel(f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->smem, c->stream, params, extra);
}
/* "Device memory" is host memory with its size in a header, and freed blocks wait in a small
 * pool for an allocation of the same size, as the driver's stream-ordered pool does: the lab's
 * timings then count no mmap / munmap of large results. */
#define POOL 64
static struct { void *block; size_t n; } pool[POOL];
static int pooled;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static ptr_t fake_alloc(size_t n)
{
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < pooled; i++)
        if (pool[i].n == n) {
            void *b = pool[i].block;
            pool[i] = pool[--pooled];
            pthread_mutex_unlock(&pool_lock);
            return (ptr_t)((char *)b + 16);
        }
    pthread_mutex_unlock(&pool_lock);
    char *b = malloc(n + 16);
    if (!b)
        return 0;
    *(size_t *)b = n;
    return (ptr_t)(b + 16);
}
static void fake_free(ptr_t p)
{
    if (!p)
        return;
    char *b = (char *)p - 16;
    pthread_mutex_lock(&pool_lock);
    if (pooled < POOL) {
        pool[pooled].block = b;
        pool[pooled++].n = *(size_t *)b;
        b = NULL;
    }
    pthread_mutex_unlock(&pool_lock);
    free(b);
}
#ifdef TENSOR_MAPS
int tensor_maps = 0;
/* the last four maps (map tensor_maps - 1 at [(tensor_maps - 1) % 4]): dims, byte strides
 * (rank - 1 of them) and box, the first four of each, and the L2 promotion */
unsigned long long map_dims[4][4], map_strides[4][4];
unsigned map_box[4][4];
int map_l2[4];
/* what the driver refuses too: an address or a stride off 16 bytes, a 0 stride, a box of more
 * than 256 or more than its dimension */
int cuTensorMapEncodeTiled(void *map, int dtype, unsigned rank, void *address, const unsigned long long *dims,
                           const unsigned long long *strides, const unsigned *box, const unsigned *element_strides,
                           int interleave, int swizzle, int l2_promotion, int oob_fill)
{
    if (rank < 1 || rank > 5 || (uintptr_t)address % 16)
        return INVALID_VALUE;
    for (unsigned i = 0; i < rank; i++)
        if (!box[i] || box[i] > 256 || box[i] > dims[i] || (i + 1 < rank && (!strides[i] || strides[i] % 16)))
            return INVALID_VALUE;
    memset(map, 0, 128);
    const int at = tensor_maps % 4;
    for (unsigned i = 0; i < 4; i++) {
        map_dims[at][i] = i < rank ? dims[i] : 0;
        map_box[at][i] = i < rank ? box[i] : 0;
        map_strides[at][i] = i + 1 < rank ? strides[i] : 0;
    }
    map_l2[at] = l2_promotion;
    tensor_maps++;
    return OK;
}
#endif
#ifndef NO_ALLOC_ASYNC
int cuMemAllocAsync(ptr_t *p, size_t n, void *s)
{
    if (n > ((size_t)1 << 40))
        return OUT_OF_MEMORY;
    allocs++;
    *p = fake_alloc(n);
    return OK;
}
#endif
int cuMemFreeAsync(ptr_t p, void *s) { frees++; fake_free(p); return OK; }
long long pool_threshold = 0;
int cuDeviceGetMemPool(void **pool, int d) { *pool = (void *)0x900d; return OK; }
int cuMemPoolGetAttribute(void *pool, int attr, void *value)
{
    if (pool != (void *)0x900d || attr != 4)
        return INVALID_VALUE;
    *(unsigned long long *)value = (unsigned long long)pool_threshold;
    return OK;
}
int cuMemPoolSetAttribute(void *pool, int attr, void *value)
{
    if (pool != (void *)0x900d || attr != 4)
        return INVALID_VALUE;
    pool_threshold = (long long)*(unsigned long long *)value;
    return OK;
}
int pool_trims = 0;
int cuMemPoolTrimTo(void *pool, size_t keep) { pool_trims++; return pool == (void *)0x900d && keep == 0 ? OK : INVALID_VALUE; }
int cuMemAlloc_v2(ptr_t *p, size_t n) { allocs++; *p = fake_alloc(n); return OK; }
int cuMemFree_v2(ptr_t p) { frees++; fake_free(p); return OK; }
int cuMemcpyHtoDAsync_v2(ptr_t d, const void *s, size_t n, void *st) { memcpy((void *)d, s, n); return OK; }
int cuMemcpyDtoHAsync_v2(void *d, ptr_t s, size_t n, void *st) { memcpy(d, (void *)s, n); return OK; }
int cuMemcpyDtoDAsync_v2(ptr_t d, ptr_t s, size_t n, void *st) { memcpy((void *)d, (void *)s, n); return OK; }
int cuMemsetD8Async(ptr_t d, unsigned char v, size_t n, void *st) { memset((void *)d, v, n); return OK; }
int host_allocs, host_frees, slow_free_us;
void *freed_ptrs[1024];
int cuMemHostAlloc(void **p, size_t n, unsigned flags) { host_allocs++; *p = malloc(n); return OK; }
int cuMemFreeHost(void *p)
{
    if (slow_free_us)
        usleep(slow_free_us);
    freed_ptrs[host_frees++ % 1024] = p;
    free(p);
    return OK;
}
/* Registered host ranges, as the driver keeps them: a range overlapping one already registered
 * is refused, and only a registered range's start unregisters it. */
#define MAX_REGISTERED 256
static struct { char *lo, *hi; } ranges[MAX_REGISTERED];
int registered, registrations, register_error;
static pthread_mutex_t range_lock = PTHREAD_MUTEX_INITIALIZER;
int cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    char *lo = p, *hi = lo + n;
    int rc = OK;
    if (register_error)
        return register_error;
    if (n == 0)
        return INVALID_VALUE;
    pthread_mutex_lock(&range_lock);
    for (int i = 0; i < registered && rc == OK; i++)
        if (lo < ranges[i].hi && ranges[i].lo < hi)
            rc = ALREADY_REGISTERED;
    if (rc == OK && registered == MAX_REGISTERED)
        rc = OUT_OF_MEMORY;
    if (rc == OK) {
        ranges[registered].lo = lo, ranges[registered++].hi = hi;
        registrations++;
    }
    pthread_mutex_unlock(&range_lock);
    return rc;
}
int cuMemHostUnregister(void *p)
{
    int rc = NOT_REGISTERED;
    pthread_mutex_lock(&range_lock);
    for (int i = 0; i < registered && rc != OK; i++)
        if (ranges[i].lo == (char *)p) {
            ranges[i] = ranges[--registered];
            rc = OK;
        }
    pthread_mutex_unlock(&range_lock);
    return rc;
}
static int is_registered(ptr_t p)
{
    int found = 0;
    pthread_mutex_lock(&range_lock);
    for (int i = 0; i < registered && !found; i++)
        found = ranges[i].lo <= (char *)p && (char *)p < ranges[i].hi;
    pthread_mutex_unlock(&range_lock);
    return found;
}
int cuStreamCreate(void **s, unsigned flags) { *s = (void *)0x5000; return OK; }
int cuStreamDestroy_v2(void *s) { return OK; }
int cuStreamSynchronize(void *s) { return OK; }
int waits;   /* cuStreamWaitEvent calls, read by the test through ctypes */
int cuStreamWaitEvent(void *s, void *e, unsigned flags) { waits++; return OK; }
int cuEventCreate(void **e, unsigned flags) { *e = (void *)0x6000; return OK; }
int cuEventRecord(void *e, void *s) { return OK; }
int cuEventSynchronize(void *e) { return OK; }
int cuEventDestroy_v2(void *e) { return OK; }
int cuPointerGetAttribute(void *v, int attr, ptr_t p)
{
    if (attr == 2)      /* MEMORY_TYPE: registered host ranges are host memory, the rest device */
        *(unsigned *)v = is_registered(p) ? 1 : 2;
    else
        *(int *)v = 0;
    return OK;
}
static const char *name_of(int e)
{
    return e == OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY" : e == 100 ? "CUDA_ERROR_NO_DEVICE"
         : e == NOT_FOUND ? "CUDA_ERROR_NOT_FOUND" : e == INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE"
         : e == ALREADY_REGISTERED ? "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
         : e == NOT_REGISTERED ? "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED" : 0;
}
int cuGetErrorName(int e, const char **s) { *s = name_of(e); return *s ? OK : 1; }
int cuGetErrorString(int e, const char **s)
{
    *s = e == OUT_OF_MEMORY ? "out of memory" : e == 100 ? "no CUDA-capable device is detected"
       : e == NOT_FOUND ? "named symbol not found" : e == INVALID_VALUE ? "invalid argument"
       : e == ALREADY_REGISTERED ? "part or all of the requested memory range is already mapped"
       : e == NOT_REGISTERED ? "pointer does not correspond to a registered memory region" : 0;
    return *s ? OK : 1;
}
