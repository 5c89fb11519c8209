/* The CUDA driver API and NVRTC, loaded at run time with dlopen and never linked: the extension
 * builds and imports where neither exists, and the GPU lights up where both load.
 *
 * No CUDA header is included (none need exist at build time): the few types, enum values and
 * function signatures used are declared here with their real numeric values and ABI. Each table
 * member is named after the exported symbol it is resolved from, `_v2` included where cuda.h
 * maps the plain name to a `_v2` symbol.
 *
 * Contexts: every device is used through its primary context (the one the CUDA runtime, PyTorch
 * and CuPy share), retained once and never released. cuda_device_enter() makes it current on
 * the calling thread; call it at the top of every entry point that talks to the driver. Code that
 * can run inside another call (destructors, finalizers) restores the context it found.
 *
 * Errors: with the GIL held, CU_CHECK / NVRTC_CHECK set a Python exception naming the call, the
 * error's name and description and file:line, then `goto fail`. Without the GIL, CU_TRY /
 * NVRTC_TRY record the same in a cu_error and `goto fail`; cu_error_raise() turns it into the
 * exception once the GIL is back. CUDA_ERROR_OUT_OF_MEMORY raises MemoryError, everything else
 * RuntimeError. Nothing here exits, aborts or asserts.
 */
#ifndef ATTNEXT_CUDA_DRIVER_H
#define ATTNEXT_CUDA_DRIVER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef unsigned long long CUdeviceptr;

typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;

enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2,
       CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712, CUDA_ERROR_NOT_SUPPORTED = 801 };

/* CUdevice_attribute */
enum {
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
    CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 113,
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115,
};

/* CUfunction_attribute */
enum {
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
    CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6,
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
};

/* CUpointer_attribute and the CUmemorytype values CU_POINTER_ATTRIBUTE_MEMORY_TYPE answers */
enum {
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
};
enum { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2 };

enum { CU_MEMHOSTALLOC_PORTABLE = 0x01 };   /* pinned memory usable from every context */
enum { CU_MEMHOSTREGISTER_READ_ONLY = 0x08 }; /* the device only reads it (read-only mappings) */
enum { CU_STREAM_NON_BLOCKING = 0x01 };     /* no implicit sync with the legacy default stream */
enum { CU_EVENT_DISABLE_TIMING = 0x02 };
enum { CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4 };  /* cuuint64_t: bytes a pool keeps at a sync */

/* Stream handles with a fixed meaning (also the values __cuda_array_interface__ and DLPack use) */
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

enum { NVRTC_SUCCESS = 0, NVRTC_ERROR_COMPILATION = 6 };

/* Dynamic shared memory a kernel may use without opting in through cuFuncSetAttribute */
#define CU_DEFAULT_DYNAMIC_SMEM (48 * 1024)

#define CU_API(X)                                                                              \
    X(cuInit, (unsigned int flags))                                                            \
    X(cuDriverGetVersion, (int *version))                                                      \
    X(cuDeviceGet, (CUdevice *device, int ordinal))                                            \
    X(cuDeviceGetCount, (int *count))                                                          \
    X(cuDeviceGetName, (char *name, int len, CUdevice device))                                 \
    X(cuDeviceGetAttribute, (int *value, int attribute, CUdevice device))                      \
    X(cuDeviceTotalMem_v2, (size_t *bytes, CUdevice device))                                   \
    X(cuDevicePrimaryCtxRetain, (CUcontext *ctx, CUdevice device))                             \
    X(cuCtxSetCurrent, (CUcontext ctx))                                                        \
    X(cuCtxGetCurrent, (CUcontext *ctx))                                                       \
    X(cuCtxSynchronize, (void))                                                                \
    X(cuModuleLoadData, (CUmodule *module, const void *image))                                 \
    X(cuModuleUnload, (CUmodule module))                                                       \
    X(cuModuleGetFunction, (CUfunction *fn, CUmodule module, const char *name))                \
    X(cuFuncSetAttribute, (CUfunction fn, int attribute, int value))                           \
    X(cuFuncGetAttribute, (int *value, int attribute, CUfunction fn))                          \
    X(cuLaunchKernel, (CUfunction fn, unsigned int grid_x, unsigned int grid_y,                \
                       unsigned int grid_z, unsigned int block_x, unsigned int block_y,        \
                       unsigned int block_z, unsigned int smem, CUstream stream,               \
                       void **params, void **extra))                                           \
    X(cuMemAllocAsync, (CUdeviceptr *ptr, size_t bytes, CUstream stream))                      \
    X(cuMemFreeAsync, (CUdeviceptr ptr, CUstream stream))                                      \
    X(cuDeviceGetMemPool, (CUmemoryPool *pool, CUdevice device))                              \
    X(cuMemPoolGetAttribute, (CUmemoryPool pool, int attribute, void *value))                 \
    X(cuMemPoolSetAttribute, (CUmemoryPool pool, int attribute, void *value))                 \
    X(cuMemPoolTrimTo, (CUmemoryPool pool, size_t min_bytes_to_keep))                         \
    X(cuMemAlloc_v2, (CUdeviceptr *ptr, size_t bytes))                                         \
    X(cuMemFree_v2, (CUdeviceptr ptr))                                                         \
    X(cuMemcpyHtoDAsync_v2, (CUdeviceptr dst, const void *src, size_t bytes, CUstream stream)) \
    X(cuMemcpyDtoHAsync_v2, (void *dst, CUdeviceptr src, size_t bytes, CUstream stream))       \
    X(cuMemcpyDtoDAsync_v2, (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream)) \
    X(cuMemsetD8Async, (CUdeviceptr dst, unsigned char value, size_t bytes, CUstream stream))  \
    X(cuMemHostAlloc, (void **ptr, size_t bytes, unsigned int flags))                          \
    X(cuMemFreeHost, (void *ptr))                                                              \
    X(cuMemHostRegister_v2, (void *ptr, size_t bytes, unsigned int flags))                     \
    X(cuMemHostUnregister, (void *ptr))                                                        \
    X(cuStreamCreate, (CUstream *stream, unsigned int flags))                                  \
    X(cuStreamDestroy_v2, (CUstream stream))                                                   \
    X(cuStreamSynchronize, (CUstream stream))                                                  \
    X(cuStreamWaitEvent, (CUstream stream, CUevent event, unsigned int flags))                 \
    X(cuEventCreate, (CUevent *event, unsigned int flags))                                     \
    X(cuEventRecord, (CUevent event, CUstream stream))                                         \
    X(cuEventSynchronize, (CUevent event))                                                     \
    X(cuEventDestroy_v2, (CUevent event))                                                      \
    X(cuPointerGetAttribute, (void *value, int attribute, CUdeviceptr ptr))                    \
    X(cuGetErrorName, (CUresult error, const char **name))                                     \
    X(cuGetErrorString, (CUresult error, const char **text))

#define NVRTC_API(X)                                                                           \
    X(nvrtcResult, nvrtcVersion, (int *major, int *minor))                                     \
    X(nvrtcResult, nvrtcCreateProgram, (nvrtcProgram *prog, const char *source,                \
                                        const char *name, int num_headers,                     \
                                        const char *const *headers,                            \
                                        const char *const *include_names))                     \
    X(nvrtcResult, nvrtcCompileProgram, (nvrtcProgram prog, int num_options,                   \
                                         const char *const *options))                          \
    X(nvrtcResult, nvrtcGetProgramLogSize, (nvrtcProgram prog, size_t *bytes))                 \
    X(nvrtcResult, nvrtcGetProgramLog, (nvrtcProgram prog, char *log))                         \
    X(nvrtcResult, nvrtcGetCUBINSize, (nvrtcProgram prog, size_t *bytes))                      \
    X(nvrtcResult, nvrtcGetCUBIN, (nvrtcProgram prog, char *cubin))                            \
    X(nvrtcResult, nvrtcDestroyProgram, (nvrtcProgram *prog))                                  \
    X(const char *, nvrtcGetErrorString, (nvrtcResult result))

#define CU_API_MEMBER(name, params) CUresult (*name) params;
#define NVRTC_API_MEMBER(ret, name, params) ret (*name) params;
struct cu_api { CU_API(CU_API_MEMBER) };
struct nvrtc_api { NVRTC_API(NVRTC_API_MEMBER) };
#undef CU_API_MEMBER
#undef NVRTC_API_MEMBER

/* CUDA 12's bulk tensor copies (Hopper's TMA): a 128-byte, 64-byte-aligned map of a tensor
 * made by cuTensorMapEncodeTiled, which older drivers lack (cu_encode_tiled is then NULL and no
 * kernel that needs a map is chosen: cuda_tensor_maps()). Enum values as in cuda.h. */
typedef struct { _Alignas(64) unsigned long long opaque[16]; } CUtensorMap;
enum { CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9 };
enum { CU_TENSOR_MAP_INTERLEAVE_NONE = 0 };
enum { CU_TENSOR_MAP_SWIZZLE_128B = 3 };
enum { CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2, CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3 };
enum { CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0 };   /* elements outside the tensor read as zeros */
typedef CUresult (*cu_encode_tiled_fn)(CUtensorMap *map, int dtype, unsigned rank, void *address,
                                       const unsigned long long *dims, const unsigned long long *strides,
                                       const unsigned *box, const unsigned *element_strides, int interleave,
                                       int swizzle, int l2_promotion, int oob_fill);
extern cu_encode_tiled_fn cu_encode_tiled;

/* cuStreamIsCapturing (status 0: not capturing), resolved where the driver has it (NULL: taken
 * as never capturing): work kept across calls per stream (the split decode's counters) is not
 * used inside a capture, whose graph could replay it beside later calls. */
typedef CUresult (*cu_is_capturing_fn)(CUstream stream, int *status);
extern cu_is_capturing_fn cu_is_capturing;

/* cuLaunchKernelEx (CUDA 12), resolved where the driver has it (NULL: plain launches only), for
 * one attribute: programmatic stream serialisation (Hopper's programmatic dependent launch). A
 * kernel launched so may start while the kernel before it on the stream still runs, and must
 * wait (griddepcontrol.wait) before it touches memory that kernel writes or reads. Layouts and
 * values as in cuda.h. */
typedef struct {
    int id;
    char pad[4];
    union { char bytes[64]; unsigned long long align; int programmatic_stream_serialization_allowed; } value;
} CUlaunchAttribute;
typedef struct {
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, smem;
    CUstream stream;
    CUlaunchAttribute *attrs;
    unsigned num_attrs;
} CUlaunchConfig;
enum { CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6 };
typedef CUresult (*cu_launch_ex_fn)(const CUlaunchConfig *config, CUfunction fn, void **params, void **extra);
extern cu_launch_ex_fn cu_launch_ex;

/* Filled by cuda_driver_load() / nvrtc_load(); valid once they have returned 0. */
extern struct cu_api CU;
extern struct nvrtc_api NVRTC;

/* dlopen libcuda.so.1 (or $ATTNEXT_LIBCUDA), resolve CU, cuInit(0), count the devices. 0 when
 * usable; else -1 and the reason in why[n]. The outcome is remembered: later calls are cheap
 * and give the same answer. Thread-safe. */
int cuda_driver_load(char *why, size_t n);

/* With the GIL held: cuda_driver_load(), or -1 with RuntimeError("attnext: CUDA is unusable: ...") */
int cuda_driver_require(void);

/* dlopen the first of candidates[n] that loads and has every NVRTC symbol. A candidate is a file,
 * a directory (its libnvrtc.so* files are tried, newest version first) or a bare soname for the
 * dynamic loader's search. 0 when loaded (or already loaded: the candidates are then ignored);
 * else -1 and, in why[len], each candidate with why it failed. Independent of libcuda. */
int nvrtc_load(const char *const *candidates, int n, char *why, size_t len);
const char *nvrtc_loaded_path(void);   /* NULL until nvrtc_load succeeds */

/* With the GIL held: loads the driver if needed, retains the primary context of `device` (an
 * ordinal) once and makes it current on this thread. -1 with a Python exception set on failure
 * (RuntimeError without a driver, ValueError for a device that does not exist). */
int cuda_device_enter(int device);

/* With the GIL held: the driver's handle for ordinal `device` without creating a context. */
int cuda_device_handle(int device, CUdevice *handle);

/* Launches fn with ONE by-value argument: the struct `arg` points to (the kernels take a single
 * parameter struct). fn's context must be current. Returns the CUresult, GIL or no GIL. */
CUresult cuda_launch_struct(CUfunction fn, const unsigned grid[3], const unsigned block[3],
                            unsigned smem, CUstream stream, void *arg);
/* The same with a second by-value argument (a kernel's tensor maps, attn_fwd.cu TMA_KV). */
CUresult cuda_launch_structs(CUfunction fn, const unsigned grid[3], const unsigned block[3],
                             unsigned smem, CUstream stream, void *arg, void *arg2);
/* cuda_launch_struct as a programmatic dependent launch (cu_launch_ex above) where the driver
 * takes one, else the ordinary launch: for kernels that begin with griddepcontrol.wait. */
CUresult cuda_launch_dependent(CUfunction fn, const unsigned grid[3], const unsigned block[3],
                               unsigned smem, CUstream stream, void *arg);

/* The function, device ordinal and dependent flag (module_function's `dependent`) behind a
 * module_function() capsule; NULL / -1 with TypeError set when `capsule` is something else. */
CUfunction cuda_function_from_capsule(PyObject *capsule);
int cuda_function_device(PyObject *capsule);
int cuda_function_dependent(PyObject *capsule);

/* --- errors --- */

/* Sets MemoryError (CUDA_ERROR_OUT_OF_MEMORY) or RuntimeError: "<what> failed: <NAME> (<text>) at
 * <file>:<line>", <what> being printf-formatted, usually the call's name. */
void cu_raise(CUresult rc, const char *file, int line, const char *what, ...)
    __attribute__((format(printf, 4, 5)));
/* RuntimeError "<call> failed: <nvrtcGetErrorString> at <file>:<line>". */
void nvrtc_raise(nvrtcResult rc, const char *call, const char *file, int line);

#define CU_CHECK_RC(what, expr)                                                                \
    do {                                                                                       \
        CUresult cu_rc_ = (expr);                                                              \
        if (cu_rc_ != CUDA_SUCCESS) {                                                          \
            cu_raise(cu_rc_, __FILE__, __LINE__, "%s", what);                                  \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)
/* CU_CHECK(cuMemAllocAsync, &ptr, bytes, stream) calls CU.cuMemAllocAsync(&ptr, bytes, stream) */
#define CU_CHECK(fn, ...) CU_CHECK_RC(#fn, CU.fn(__VA_ARGS__))
#define NVRTC_CHECK(fn, ...)                                                                   \
    do {                                                                                       \
        nvrtcResult nvrtc_rc_ = NVRTC.fn(__VA_ARGS__);                                         \
        if (nvrtc_rc_ != NVRTC_SUCCESS) {                                                      \
            nvrtc_raise(nvrtc_rc_, #fn, __FILE__, __LINE__);                                   \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

/* A failure recorded without the GIL; call == NULL: none. */
typedef struct {
    const char *call;
    int rc;
    int is_nvrtc;
    const char *file;
    int line;
} cu_error;

/* With the GIL back: raises e (as CU_CHECK / NVRTC_CHECK would have) and returns -1. */
int cu_error_raise(const cu_error *e);

#define CU_TRY_RC(err, what, expr)                                                             \
    do {                                                                                       \
        CUresult cu_rc_ = (expr);                                                              \
        if (cu_rc_ != CUDA_SUCCESS) {                                                          \
            *(err) = (cu_error){what, cu_rc_, 0, __FILE__, __LINE__};                          \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)
#define CU_TRY(err, fn, ...) CU_TRY_RC(err, #fn, CU.fn(__VA_ARGS__))
#define NVRTC_TRY(err, fn, ...)                                                                \
    do {                                                                                       \
        nvrtcResult nvrtc_rc_ = NVRTC.fn(__VA_ARGS__);                                         \
        if (nvrtc_rc_ != NVRTC_SUCCESS) {                                                      \
            *(err) = (cu_error){#fn, nvrtc_rc_, 1, __FILE__, __LINE__};                        \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

/* --- the Python side --- */

/* The CUDA functions of attnext._C (csrc/cuda/: device, nvrtc, functions, memory, pinned,
 * dlpack); attnext_cuda_exec (host.c) adds them and the PinnedBuffer type to the module
 * (module.c's Py_mod_exec slot). */
int attnext_cuda_exec(PyObject *module);

#endif
