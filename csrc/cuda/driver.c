/* Loading libcuda and libnvrtc with dlopen, primary contexts, launches and error mapping (see
 * cuda_driver.h). Everything here is process-wide, as the libraries and contexts are: one mutex
 * guards loading and context retention, so subinterpreters and threads share them safely.
 */
#include "driver.h"

#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct cu_api CU;
cu_encode_tiled_fn cu_encode_tiled;
cu_is_capturing_fn cu_is_capturing;
cu_launch_ex_fn cu_launch_ex;
struct nvrtc_api NVRTC;

#define MAX_DEVICES 64
#define REASON_LEN 1024

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

static int cu_state;                  /* 0: not tried, 1: usable, -1: failed for cu_reason */
static char cu_reason[REASON_LEN];
static int cu_device_count;
static CUcontext cu_contexts[MAX_DEVICES];   /* retained primary contexts, NULL until first use */

static void *nvrtc_handle;
static char nvrtc_path[4096];

/* Appends printf output to buf[len] (always NUL-terminated, silently truncated). */
static void append(char *buf, size_t len, const char *fmt, ...)
{
    size_t used = strnlen(buf, len);
    if (used + 1 >= len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + used, len - used, fmt, ap);
    va_end(ap);
}

static const char *cu_name(CUresult rc)
{
    const char *s = NULL;
    if (CU.cuGetErrorName == NULL || CU.cuGetErrorName(rc, &s) != CUDA_SUCCESS || s == NULL)
        return "unknown CUDA error";
    return s;
}

static const char *cu_text(CUresult rc)
{
    const char *s = NULL;
    if (CU.cuGetErrorString == NULL || CU.cuGetErrorString(rc, &s) != CUDA_SUCCESS || s == NULL)
        return "no description";
    return s;
}

/* The driver, or the reason it is unusable. Called with load_lock held. */
static int driver_load_locked(void)
{
    const char *env = getenv("ATTNEXT_LIBCUDA");
    const char *path = env && *env ? env : "libcuda.so.1";
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(cu_reason, sizeof cu_reason, "%s not found: %s (no NVIDIA driver here? "
                 "ATTNEXT_LIBCUDA may name the library's path)", path, dlerror());
        return -1;
    }
#define CU_RESOLVE(name, params)                                                               \
    if (!(CU.name = (CUresult(*) params)dlsym(h, #name))) {                                    \
        snprintf(cu_reason, sizeof cu_reason, "%s has no %s (a driver for CUDA 11.2 or newer " \
                 "is needed)", path, #name);                                                   \
        goto fail;                                                                             \
    }
    CU_API(CU_RESOLVE)
#undef CU_RESOLVE
    cu_encode_tiled = (cu_encode_tiled_fn)dlsym(h, "cuTensorMapEncodeTiled");   /* optional: CUDA 12 */
    cu_is_capturing = (cu_is_capturing_fn)dlsym(h, "cuStreamIsCapturing");      /* optional */
    cu_launch_ex = (cu_launch_ex_fn)dlsym(h, "cuLaunchKernelEx");                 /* optional: CUDA 12 */
    CUresult rc = CU.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        snprintf(cu_reason, sizeof cu_reason, "cuInit failed: %s (%s)", cu_name(rc), cu_text(rc));
        goto fail;
    }
    rc = CU.cuDeviceGetCount(&cu_device_count);
    if (rc != CUDA_SUCCESS || cu_device_count < 1) {
        snprintf(cu_reason, sizeof cu_reason, "cuDeviceGetCount found no device: %s",
                 rc ? cu_name(rc) : "0 devices");
        goto fail;
    }
    return 0;
fail:
    /* the library stays loaded (unloading a driver library is never safe), but unused */
    memset(&CU, 0, sizeof CU);
    cu_encode_tiled = NULL;
    cu_is_capturing = NULL;
    cu_launch_ex = NULL;
    return -1;
}

int cuda_driver_load(char *why, size_t n)
{
    pthread_mutex_lock(&load_lock);
    if (cu_state == 0)
        cu_state = driver_load_locked() == 0 ? 1 : -1;
    int state = cu_state;
    if (state < 0 && n > 0)
        snprintf(why, n, "%s", cu_reason);
    pthread_mutex_unlock(&load_lock);
    return state > 0 ? 0 : -1;
}

static int newest_first(const void *a, const void *b)
{
    return strverscmp(*(char *const *)b, *(char *const *)a);
}

/* The names in dir starting with `prefix`, newest version first (strdup'ed, at most max). */
static int list_libs(const char *dir, const char *prefix, char **names, int max)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    int count = 0;
    if (!d)
        return -1;
    while ((e = readdir(d)) && count < max)
        if (!strncmp(e->d_name, prefix, strlen(prefix)) && (names[count] = strdup(e->d_name)))
            count++;
    closedir(d);
    qsort(names, count, sizeof *names, newest_first);
    return count;
}

/* libnvrtc finds libnvrtc-builtins (which it dlopens at the first compile) through its own
 * RUNPATH; where that is not honoured (a sanitizer's dlopen, a copied library) the copy beside
 * it, loaded first, is found by its soname. */
static void preload_builtins(const char *path)
{
    char dir[4096], *names[8], lib[2 * sizeof dir];
    const char *slash = strrchr(path, '/');
    if (!slash)
        return;
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    int count = list_libs(dir, "libnvrtc-builtins.so", names, 8);
    for (int i = 0; i < count; i++) {
        snprintf(lib, sizeof lib, "%s/%s", dir, names[i]);
        if (i == 0)
            dlopen(lib, RTLD_NOW | RTLD_LOCAL);
        free(names[i]);
    }
}

/* Opens path and resolves every NVRTC symbol into NVRTC; on failure appends why to `why`. */
static int nvrtc_try(const char *path, char *why, size_t len)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        append(why, len, "\n  %s: %s", path, dlerror());
        return -1;
    }
    struct nvrtc_api api;
#define NVRTC_RESOLVE(ret, name, params)                                                       \
    if (!(api.name = (ret(*) params)dlsym(h, #name))) {                                        \
        append(why, len, "\n  %s: has no %s (NVRTC 11.2 or newer is needed)", path, #name);    \
        dlclose(h);                                                                            \
        return -1;                                                                             \
    }
    NVRTC_API(NVRTC_RESOLVE)
#undef NVRTC_RESOLVE
    preload_builtins(path);
    NVRTC = api;
    nvrtc_handle = h;
    snprintf(nvrtc_path, sizeof nvrtc_path, "%s", path);
    return 0;
}

/* Tries dir's libnvrtc.so* files (never libnvrtc-builtins), newest version first. */
static int nvrtc_try_dir(const char *dir, char *why, size_t len)
{
    char *names[64], path[4096];
    int rc = -1, count = list_libs(dir, "libnvrtc.so", names, 64);
    if (count < 0)
        append(why, len, "\n  %s: cannot list the directory", dir);
    else if (count == 0)
        append(why, len, "\n  %s: no libnvrtc.so* inside", dir);
    for (int i = 0; i < count; i++) {
        if (rc != 0) {
            snprintf(path, sizeof path, "%s/%s", dir, names[i]);
            rc = nvrtc_try(path, why, len);
        }
        free(names[i]);
    }
    return rc;
}

int nvrtc_load(const char *const *candidates, int n, char *why, size_t len)
{
    int rc = -1;
    pthread_mutex_lock(&load_lock);
    if (nvrtc_handle) {
        rc = 0;
        goto done;
    }
    if (len > 0)
        why[0] = '\0';
    append(why, len, "NVRTC could not be loaded (ATTNEXT_NVRTC may name libnvrtc.so or its "
           "directory; pip install nvidia-cuda-nvrtc provides one). Tried:");
    for (int i = 0; i < n && rc != 0; i++) {
        struct stat st;
        if (stat(candidates[i], &st) == 0 && S_ISDIR(st.st_mode))
            rc = nvrtc_try_dir(candidates[i], why, len);
        else
            rc = nvrtc_try(candidates[i], why, len);
    }
    if (n == 0)
        append(why, len, " nothing (no candidate given)");
done:
    pthread_mutex_unlock(&load_lock);
    return rc;
}

const char *nvrtc_loaded_path(void)
{
    pthread_mutex_lock(&load_lock);
    const char *p = nvrtc_handle ? nvrtc_path : NULL;
    pthread_mutex_unlock(&load_lock);
    return p;
}

int cuda_driver_require(void)
{
    char why[REASON_LEN];
    if (cuda_driver_load(why, sizeof why) == 0)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "attnext: CUDA is unusable: %s", why);
    return -1;
}

int cuda_device_handle(int device, CUdevice *handle)
{
    if (cuda_driver_require())
        return -1;
    if (device < 0 || device >= cu_device_count || device >= MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "attnext: CUDA device %d does not exist (%d device%s)",
                     device, cu_device_count, cu_device_count == 1 ? "" : "s");
        return -1;
    }
    CU_CHECK(cuDeviceGet, handle, device);
    return 0;
fail:
    return -1;
}

int cuda_device_enter(int device)
{
    CUdevice dev;
    CUresult rc = CUDA_SUCCESS;
    if (cuda_device_handle(device, &dev))
        return -1;
    pthread_mutex_lock(&load_lock);
    CUcontext ctx = cu_contexts[device];
    if (!ctx && (rc = CU.cuDevicePrimaryCtxRetain(&ctx, dev)) == CUDA_SUCCESS)
        cu_contexts[device] = ctx;
    pthread_mutex_unlock(&load_lock);
    if (rc != CUDA_SUCCESS) {
        cu_raise(rc, __FILE__, __LINE__, "cuDevicePrimaryCtxRetain(device %d)", device);
        return -1;
    }
    CU_CHECK(cuCtxSetCurrent, ctx);
    return 0;
fail:
    return -1;
}

CUresult cuda_launch_struct(CUfunction fn, const unsigned grid[3], const unsigned block[3],
                            unsigned smem, CUstream stream, void *arg)
{
    void *params[1] = {arg};
    return CU.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                             stream, arg ? params : NULL, NULL);
}

CUresult cuda_launch_structs(CUfunction fn, const unsigned grid[3], const unsigned block[3],
                             unsigned smem, CUstream stream, void *arg, void *arg2)
{
    void *params[2] = {arg, arg2};
    return CU.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                             stream, params, NULL);
}

CUresult cuda_launch_dependent(CUfunction fn, const unsigned grid[3], const unsigned block[3],
                               unsigned smem, CUstream stream, void *arg)
{
    if (cu_launch_ex) {
        CUlaunchAttribute attr = {.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION};
        attr.value.programmatic_stream_serialization_allowed = 1;
        CUlaunchConfig config = {grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream,
                                 &attr, 1};
        void *params[1] = {arg};
        CUresult rc = cu_launch_ex(&config, fn, params, NULL);
        if (rc != CUDA_ERROR_NOT_SUPPORTED && rc != CUDA_ERROR_INVALID_VALUE)
            return rc;
        /* a driver that refuses the attribute: the ordinary launch (any other error is the call's) */
    }
    return cuda_launch_struct(fn, grid, block, smem, stream, arg);
}

void cu_raise(CUresult rc, const char *file, int line, const char *what, ...)
{
    char desc[256];
    va_list ap;
    va_start(ap, what);
    vsnprintf(desc, sizeof desc, what, ap);
    va_end(ap);
    PyErr_Format(rc == CUDA_ERROR_OUT_OF_MEMORY ? PyExc_MemoryError : PyExc_RuntimeError,
                 "%s failed: %s (%s) at %s:%d", desc, cu_name(rc), cu_text(rc), file, line);
}

void nvrtc_raise(nvrtcResult rc, const char *call, const char *file, int line)
{
    const char *s = NVRTC.nvrtcGetErrorString ? NVRTC.nvrtcGetErrorString(rc) : NULL;
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s at %s:%d", call,
                 s ? s : "unknown NVRTC error", file, line);
}

int cu_error_raise(const cu_error *e)
{
    if (e->is_nvrtc)
        nvrtc_raise(e->rc, e->call, e->file, e->line);
    else
        cu_raise(e->rc, e->file, e->line, "%s", e->call);
    return -1;
}
