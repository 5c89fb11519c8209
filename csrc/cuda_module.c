/* attnext._C's CUDA functions: loading, NVRTC compiles, modules and launches, device memory,
 * streams, pinned host memory (allocated, or the caller's registered in place) and DLPack.
 * attnext/device.py builds device arrays on them.
 *
 * Conventions of every function here:
 * - Device pointers, streams and handles cross into Python as ints. A stream is a CUstream
 *   handle: 0 is the legacy default stream of the device's primary context, 1 and 2 the
 *   legacy and per-thread default streams (the values __cuda_array_interface__ and DLPack
 *   use); anything else a handle from stream_create, torch's `cuda_stream`, CuPy's `ptr`.
 * - `device` is an ordinal (default 0). Each call makes that device's primary context current on
 *   the calling thread; what runs from a destructor or finalizer (mem_free, PinnedBuffer,
 *   module capsules) restores the caller's context afterwards, since it runs inside whatever
 *   code dropped the last reference.
 * - The GIL is released around the calls that wait: synchronisation, copies to or from
 *   pageable memory, pinned allocation, registering host memory and NVRTC compiles.
 */
#include "cuda_driver.h"

#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MODULE_CAPSULE "attnext.cu_module"
#define FUNCTION_CAPSULE "attnext.cu_function"

static int as_ptr(PyObject *o, void *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(CUdeviceptr *)out = v;
    return 1;
}

static int as_stream(PyObject *o, void *out)
{
    CUdeviceptr v;
    if (!as_ptr(o, &v))
        return 0;
    *(CUstream *)out = (CUstream)(uintptr_t)v;
    return 1;
}

static int nonnegative(const char *fn, const char *name, Py_ssize_t v)
{
    if (v >= 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: %s must be >= 0, got %zd", fn, name, v);
    return -1;
}

/* Makes `device` current and returns the caller's context in *prev, for leave(). */
static int enter_keeping(int device, CUcontext *prev)
{
    if (cuda_driver_require())
        return -1;
    CU_CHECK(cuCtxGetCurrent, prev);
    return cuda_device_enter(device);
fail:
    return -1;
}

static void leave(CUcontext prev)
{
    CU.cuCtxSetCurrent(prev);
}

/* --- loading and device properties --- */

static PyObject *c_cuda_load(PyObject *module, PyObject *unused)
{
    if (cuda_driver_require())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *c_cuda_device_count(PyObject *module, PyObject *unused)
{
    int n;
    if (cuda_driver_require())
        return NULL;
    CU_CHECK(cuDeviceGetCount, &n);
    return PyLong_FromLong(n);
fail:
    return NULL;
}

static PyObject *c_cuda_info(PyObject *module, PyObject *args)
{
    int device = 0, version, major, minor, sms, smem, l2, pools, ro_register;
    CUdevice dev;
    size_t total;
    char name[256];
    if (!PyArg_ParseTuple(args, "|i:cuda_info", &device) || cuda_device_handle(device, &dev))
        return NULL;
    CU_CHECK(cuDriverGetVersion, &version);
    CU_CHECK(cuDeviceGetName, name, (int)sizeof name, dev);
    CU_CHECK(cuDeviceTotalMem_v2, &total, dev);
    CU_CHECK(cuDeviceGetAttribute, &major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
    CU_CHECK(cuDeviceGetAttribute, &minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
    CU_CHECK(cuDeviceGetAttribute, &sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    CU_CHECK(cuDeviceGetAttribute, &smem, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev);
    CU_CHECK(cuDeviceGetAttribute, &l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev);
    CU_CHECK(cuDeviceGetAttribute, &pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev);
    CU_CHECK(cuDeviceGetAttribute, &ro_register, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, dev);
    /* the driver encodes CUDA 12.8 as 12080 */
    return Py_BuildValue("{s:s,s:(ii),s:i,s:i,s:i,s:n,s:(ii),s:O,s:O}", "name", name,
                         "compute_capability", major, minor, "multiprocessor_count", sms,
                         "max_shared_memory_per_block_optin", smem, "l2_cache_size", l2,
                         "total_memory", (Py_ssize_t)total, "driver_version", version / 1000,
                         version % 1000 / 10, "memory_pools", pools ? Py_True : Py_False,
                         "read_only_host_register", ro_register ? Py_True : Py_False);
fail:
    return NULL;
}

/* --- NVRTC --- */

static int nvrtc_required(void)
{
    if (nvrtc_loaded_path())
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "attnext: NVRTC is not loaded (nvrtc_load first)");
    return -1;
}

static PyObject *c_nvrtc_load(PyObject *module, PyObject *candidates)
{
    PyObject *seq = PySequence_Fast(candidates, "nvrtc_load: candidates must be a list of paths");
    PyObject **encoded = NULL;
    const char **paths = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    char why[8192];
    if (!seq)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    encoded = PyMem_Calloc(n + 1, sizeof *encoded);
    paths = PyMem_Calloc(n + 1, sizeof *paths);
    if (!encoded || !paths) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &encoded[i]))
            goto done;
        paths[i] = PyBytes_AS_STRING(encoded[i]);
    }
    if (nvrtc_load(paths, (int)n, why, sizeof why)) {
        PyErr_SetString(PyExc_RuntimeError, why);
        goto done;
    }
    result = PyUnicode_DecodeFSDefault(nvrtc_loaded_path());
done:
    for (Py_ssize_t i = 0; encoded && i < n; i++)
        Py_XDECREF(encoded[i]);
    PyMem_Free(encoded);
    PyMem_Free(paths);
    Py_DECREF(seq);
    return result;
}

static PyObject *c_nvrtc_version(PyObject *module, PyObject *unused)
{
    int major, minor;
    if (nvrtc_required())
        return NULL;
    NVRTC_CHECK(nvrtcVersion, &major, &minor);
    return Py_BuildValue("(ii)", major, minor);
fail:
    return NULL;
}

/* attnext.CompileError(message, source=source, log=log), raised. The message quotes the log's
 * first error line, which is what the reader needs first. */
static void raise_compile_error(const char *filename, PyObject *source, const char *log)
{
    char first[320] = "see the log";
    const char *line = strstr(log, "error");
    while (line && line > log && line[-1] != '\n')
        line--;
    if (line)
        snprintf(first, sizeof first, "%.*s", (int)strcspn(line, "\n"), line);
    PyObject *types = PyImport_ImportModule("attnext.types");
    PyObject *cls = types ? PyObject_GetAttrString(types, "CompileError") : NULL;
    PyObject *log_obj = PyUnicode_DecodeUTF8(log, strlen(log), "replace");
    PyObject *first_obj = PyUnicode_DecodeUTF8(first, strlen(first), "replace");
    PyObject *msg = first_obj ? PyUnicode_FromFormat("NVRTC could not compile %s: %U", filename,
                                                     first_obj) : NULL;
    PyObject *args = msg ? PyTuple_Pack(1, msg) : NULL;
    PyObject *kwargs = args && log_obj ? Py_BuildValue("{s:O,s:O}", "source", source, "log", log_obj) : NULL;
    PyObject *exc = cls && kwargs ? PyObject_Call(cls, args, kwargs) : NULL;
    if (exc)
        PyErr_SetObject(cls, exc);
    Py_XDECREF(exc);
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    Py_XDECREF(msg);
    Py_XDECREF(first_obj);
    Py_XDECREF(log_obj);
    Py_XDECREF(cls);
    Py_XDECREF(types);
}

/* Borrowed UTF-8 pointers to the str items of seq (alive as long as seq is). */
static const char **utf8_items(PyObject *seq, const char *what)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const char **out = PyMem_Calloc(n + 1, sizeof *out);
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "nvrtc_compile: %s[%zd] must be a str, got %.100s",
                         what, i, Py_TYPE(item)->tp_name);
            PyMem_Free(out);
            return NULL;
        }
        if (!(out[i] = PyUnicode_AsUTF8(item))) {
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *c_nvrtc_compile(PyObject *module, PyObject *args)
{
    PyObject *source, *options, *headers, *opt_seq = NULL, *hdr_seq = NULL, *names = NULL;
    PyObject *texts = NULL, *cubin = NULL, *result = NULL;
    const char *filename, *src, **opts = NULL, **hdr_names = NULL, **hdr_texts = NULL;
    Py_ssize_t src_len, n_hdr = 0;
    nvrtcProgram prog = NULL;
    nvrtcResult rc;
    size_t log_size = 0, cubin_size = 0;
    char *log = NULL;
    if (!PyArg_ParseTuple(args, "UsOO:nvrtc_compile", &source, &filename, &options, &headers)
        || nvrtc_required())
        return NULL;
    if (!(src = PyUnicode_AsUTF8AndSize(source, &src_len)))
        return NULL;
    if ((Py_ssize_t)strlen(src) != src_len) {
        PyErr_SetString(PyExc_ValueError, "nvrtc_compile: the source contains a NUL character");
        return NULL;
    }
    if (!(opt_seq = PySequence_Fast(options, "nvrtc_compile: options must be a list of str"))
        || !(hdr_seq = PySequence_Fast(headers, "nvrtc_compile: headers must be a list of (name, text)"))
        || !(opts = utf8_items(opt_seq, "options")))
        goto fail;
    n_hdr = PySequence_Fast_GET_SIZE(hdr_seq);
    if (!(names = PyList_New(n_hdr)) || !(texts = PyList_New(n_hdr)))
        goto fail;
    for (Py_ssize_t i = 0; i < n_hdr; i++) {
        PyObject *name, *text, *item = PySequence_Fast_GET_ITEM(hdr_seq, i);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "UU", &name, &text)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "nvrtc_compile: header %zd must be a (name, text) tuple "
                         "of str, got a %.100s", i, Py_TYPE(item)->tp_name);
            goto fail;
        }
        PyList_SET_ITEM(names, i, Py_NewRef(name));
        PyList_SET_ITEM(texts, i, Py_NewRef(text));
    }
    if (!(hdr_names = utf8_items(names, "header names")) || !(hdr_texts = utf8_items(texts, "header texts")))
        goto fail;
    NVRTC_CHECK(nvrtcCreateProgram, &prog, src, filename, (int)n_hdr, hdr_texts, hdr_names);
    Py_BEGIN_ALLOW_THREADS
    rc = NVRTC.nvrtcCompileProgram(prog, (int)PySequence_Fast_GET_SIZE(opt_seq), opts);
    Py_END_ALLOW_THREADS
    NVRTC_CHECK(nvrtcGetProgramLogSize, prog, &log_size);
    if (!(log = PyMem_Malloc(log_size + 1))) {
        PyErr_NoMemory();
        goto fail;
    }
    log[0] = '\0';
    NVRTC_CHECK(nvrtcGetProgramLog, prog, log);
    log[log_size] = '\0';
    if (rc == NVRTC_ERROR_COMPILATION) {
        raise_compile_error(filename, source, log);
        goto fail;
    }
    if (rc != NVRTC_SUCCESS) {
        PyErr_Format(PyExc_RuntimeError, "nvrtcCompileProgram of %s failed: %s: %s", filename,
                     NVRTC.nvrtcGetErrorString(rc), log);
        goto fail;
    }
    if (NVRTC.nvrtcGetCUBINSize(prog, &cubin_size) != NVRTC_SUCCESS || cubin_size == 0) {
        PyErr_Format(PyExc_RuntimeError, "nvrtc_compile: no CUBIN for %s: compile for a real "
                     "architecture (--gpu-architecture=sm_XX, not compute_XX)", filename);
        goto fail;
    }
    if (!(cubin = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cubin_size)))
        goto fail;
    NVRTC_CHECK(nvrtcGetCUBIN, prog, PyBytes_AS_STRING(cubin));
    result = Py_BuildValue("(ON)", cubin, PyUnicode_DecodeUTF8(log, strlen(log), "replace"));
fail:
    if (prog)
        NVRTC.nvrtcDestroyProgram(&prog);
    PyMem_Free(log);
    PyMem_Free(opts);
    PyMem_Free(hdr_names);
    PyMem_Free(hdr_texts);
    Py_XDECREF(cubin);
    Py_XDECREF(names);
    Py_XDECREF(texts);
    Py_XDECREF(opt_seq);
    Py_XDECREF(hdr_seq);
    return result;
}

/* --- modules, functions, launches --- */

typedef struct {
    CUmodule module;
    CUcontext ctx;
    int device;
} module_handle;

typedef struct {
    CUfunction fn;
    int device;
} function_handle;

/* The handle inside a capsule made by module_load / module_function; NULL with TypeError for
 * anything else. */
static void *handle_of(PyObject *capsule, const char *name, const char *maker)
{
    if (PyCapsule_IsValid(capsule, name))
        return PyCapsule_GetPointer(capsule, name);
    PyErr_Format(PyExc_TypeError, "expected a capsule from %s(), got %.100s", maker,
                 Py_TYPE(capsule)->tp_name);
    return NULL;
}

/* Unloads only while the driver still answers: at interpreter exit it may be torn down. */
static void module_capsule_free(PyObject *capsule)
{
    module_handle *m = PyCapsule_GetPointer(capsule, MODULE_CAPSULE);
    CUcontext prev;
    if (!m)
        return;
    if (CU.cuCtxGetCurrent && CU.cuCtxGetCurrent(&prev) == CUDA_SUCCESS
        && CU.cuCtxSetCurrent(m->ctx) == CUDA_SUCCESS) {
        CU.cuModuleUnload(m->module);
        leave(prev);
    }
    PyMem_Free(m);
}

static void function_capsule_free(PyObject *capsule)
{
    PyMem_Free(PyCapsule_GetPointer(capsule, FUNCTION_CAPSULE));
    Py_XDECREF((PyObject *)PyCapsule_GetContext(capsule));   /* the module capsule */
}

static PyObject *c_module_load(PyObject *module, PyObject *args)
{
    Py_buffer image;
    int device = 0;
    module_handle *m = NULL;
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "y*|i:module_load", &image, &device))
        return NULL;
    if (cuda_device_enter(device))
        goto fail;
    if (!(m = PyMem_Calloc(1, sizeof *m))) {
        PyErr_NoMemory();
        goto fail;
    }
    m->device = device;
    CU_CHECK(cuCtxGetCurrent, &m->ctx);
    {   /* milliseconds a module: other threads (another module's load, a compile) go on */
        CUresult rc;
        Py_BEGIN_ALLOW_THREADS
        rc = CU.cuModuleLoadData(&m->module, image.buf);
        Py_END_ALLOW_THREADS
        CU_CHECK_RC("cuModuleLoadData", rc);
    }
    PyBuffer_Release(&image);
    capsule = PyCapsule_New(m, MODULE_CAPSULE, module_capsule_free);
    if (!capsule) {
        CU.cuModuleUnload(m->module);
        PyMem_Free(m);
    }
    return capsule;
fail:
    PyMem_Free(m);
    PyBuffer_Release(&image);
    return NULL;
}

static PyObject *c_module_function(PyObject *module, PyObject *args)
{
    PyObject *mod_capsule, *capsule;
    const char *name;
    int smem;
    function_handle *f = NULL;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "Osi:module_function", &mod_capsule, &name, &smem))
        return NULL;
    module_handle *m = handle_of(mod_capsule, MODULE_CAPSULE, "module_load");
    if (!m || nonnegative("module_function", "dynamic_smem", smem) || cuda_device_enter(m->device))
        return NULL;
    if (!(f = PyMem_Calloc(1, sizeof *f))) {
        PyErr_NoMemory();
        return NULL;
    }
    f->device = m->device;
    if ((rc = CU.cuModuleGetFunction(&f->fn, m->module, name)) != CUDA_SUCCESS) {
        cu_raise(rc, __FILE__, __LINE__, "cuModuleGetFunction(\"%s\")", name);
        goto fail;
    }
    if (smem > CU_DEFAULT_DYNAMIC_SMEM
        && (rc = CU.cuFuncSetAttribute(f->fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))) {
        cu_raise(rc, __FILE__, __LINE__, "cuFuncSetAttribute(%s, MAX_DYNAMIC_SHARED_SIZE_BYTES = %d)",
                 name, smem);
        goto fail;
    }
    if (!(capsule = PyCapsule_New(f, FUNCTION_CAPSULE, function_capsule_free)))
        goto fail;
    if (PyCapsule_SetContext(capsule, Py_NewRef(mod_capsule))) {
        Py_DECREF(mod_capsule);
        Py_DECREF(capsule);
        return NULL;
    }
    return capsule;
fail:
    PyMem_Free(f);
    return NULL;
}

CUfunction cuda_function_from_capsule(PyObject *capsule)
{
    function_handle *f = handle_of(capsule, FUNCTION_CAPSULE, "module_function");
    return f ? f->fn : NULL;
}

int cuda_function_device(PyObject *capsule)
{
    function_handle *f = handle_of(capsule, FUNCTION_CAPSULE, "module_function");
    return f ? f->device : -1;
}

static PyObject *c_function_attributes(PyObject *module, PyObject *capsule)
{
    static const struct { const char *name; int attr; } attrs[] = {
        {"num_regs", CU_FUNC_ATTRIBUTE_NUM_REGS},
        {"local_size_bytes", CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES},
        {"shared_size_bytes", CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES},
        {"max_threads_per_block", CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK},
        {"max_dynamic_shared_size_bytes", CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES},
        {"binary_version", CU_FUNC_ATTRIBUTE_BINARY_VERSION},
    };
    function_handle *f = handle_of(capsule, FUNCTION_CAPSULE, "module_function");
    PyObject *d;
    if (!f || cuda_device_enter(f->device) || !(d = PyDict_New()))
        return NULL;
    for (size_t i = 0; i < sizeof attrs / sizeof attrs[0]; i++) {
        int value;
        PyObject *v;
        CU_CHECK(cuFuncGetAttribute, &value, attrs[i].attr, f->fn);
        if (!(v = PyLong_FromLong(value)) || PyDict_SetItemString(d, attrs[i].name, v)) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *c_launch(PyObject *module, PyObject *args)
{
    PyObject *capsule;
    int g[3], b[3], smem;
    CUstream stream;
    Py_buffer params;
    if (!PyArg_ParseTuple(args, "O(iii)(iii)iO&y*:launch", &capsule, &g[0], &g[1], &g[2], &b[0],
                          &b[1], &b[2], &smem, as_stream, &stream, &params))
        return NULL;
    function_handle *f = handle_of(capsule, FUNCTION_CAPSULE, "module_function");
    unsigned grid[3], block[3];
    if (!f)
        goto fail;
    for (int i = 0; i < 3; i++) {
        if (g[i] < 1 || b[i] < 1) {
            PyErr_Format(PyExc_ValueError, "launch: grid (%d, %d, %d) and block (%d, %d, %d) must "
                         "be positive", g[0], g[1], g[2], b[0], b[1], b[2]);
            goto fail;
        }
        grid[i] = (unsigned)g[i];
        block[i] = (unsigned)b[i];
    }
    if (nonnegative("launch", "smem", smem) || cuda_device_enter(f->device))
        goto fail;
    CU_CHECK_RC("cuLaunchKernel", cuda_launch_struct(f->fn, grid, block, (unsigned)smem, stream,
                                                     params.len ? params.buf : NULL));
    PyBuffer_Release(&params);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&params);
    return NULL;
}

/* --- device memory and streams --- */

static int device_has_pools(int device, int *pools)
{
    CUdevice dev;
    if (cuda_device_handle(device, &dev))
        return -1;
    CU_CHECK(cuDeviceGetAttribute, pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev);
    return 0;
fail:
    return -1;
}

static PyObject *c_mem_alloc(PyObject *module, PyObject *args)
{
    Py_ssize_t nbytes;
    CUstream stream;
    int device = 0, pools;
    CUdeviceptr ptr = 0;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "nO&|i:mem_alloc", &nbytes, as_stream, &stream, &device)
        || nonnegative("mem_alloc", "nbytes", nbytes))
        return NULL;
    if (nbytes == 0)
        return PyLong_FromLong(0);
    if (device_has_pools(device, &pools) || cuda_device_enter(device))
        return NULL;
    /* stream-ordered where the device has memory pools (some virtualised GPUs do not) */
    rc = pools ? CU.cuMemAllocAsync(&ptr, (size_t)nbytes, stream) : CU.cuMemAlloc_v2(&ptr, (size_t)nbytes);
    if (rc != CUDA_SUCCESS) {
        cu_raise(rc, __FILE__, __LINE__, "%s of %zd bytes on device %d",
                 pools ? "cuMemAllocAsync" : "cuMemAlloc_v2", nbytes, device);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(ptr);
}

/* *pools: whether the device has memory pools; with them, *pool its current one (the device's
 * context entered). 0, or -1 with a Python exception set. */
static int current_pool(int device, int *pools, CUmemoryPool *pool)
{
    CUdevice dev;
    if (device_has_pools(device, pools))
        return -1;
    if (!*pools)
        return 0;
    if (cuda_device_handle(device, &dev) || cuda_device_enter(device))
        return -1;
    CU_CHECK(cuDeviceGetMemPool, pool, dev);
    return 0;
fail:
    return -1;
}

/* mem_pool_keep(nbytes, device=0): the device's current memory pool (what mem_alloc takes from)
 * keeps at least nbytes of freed memory reserved when a stream or the context synchronises,
 * rather than giving it all back to the driver (the default, 0): a NumPy call synchronises at its
 * end, and the next one would map its buffers again. Only ever raised (another library's larger
 * setting stays). False where the device has no pools. */
static PyObject *c_mem_pool_keep(PyObject *module, PyObject *args)
{
    Py_ssize_t nbytes;
    int device = 0, pools;
    CUmemoryPool pool;
    unsigned long long keep;
    if (!PyArg_ParseTuple(args, "n|i:mem_pool_keep", &nbytes, &device)
        || nonnegative("mem_pool_keep", "nbytes", nbytes) || current_pool(device, &pools, &pool))
        return NULL;
    if (!pools)
        Py_RETURN_FALSE;
    CU_CHECK(cuMemPoolGetAttribute, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep);
    if (keep < (unsigned long long)nbytes) {
        keep = (unsigned long long)nbytes;
        CU_CHECK(cuMemPoolSetAttribute, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep);
    }
    Py_RETURN_TRUE;
fail:
    return NULL;
}

/* mem_pool_trim(device=0): the device's current memory pool gives back every freed byte it keeps
 * (what mem_pool_keep lets it keep): a measure of free device memory then sees only memory in
 * use. False where the device has no pools. */
static PyObject *c_mem_pool_trim(PyObject *module, PyObject *args)
{
    int device = 0, pools;
    CUmemoryPool pool;
    if (!PyArg_ParseTuple(args, "|i:mem_pool_trim", &device) || current_pool(device, &pools, &pool))
        return NULL;
    if (!pools)
        Py_RETURN_FALSE;
    CU_CHECK(cuMemPoolTrimTo, pool, 0);
    Py_RETURN_TRUE;
fail:
    return NULL;
}

static PyObject *c_mem_free(PyObject *module, PyObject *args)
{
    CUdeviceptr ptr;
    CUstream stream;
    CUcontext prev;
    int device = 0, pools;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "O&O&|i:mem_free", as_ptr, &ptr, as_stream, &stream, &device))
        return NULL;
    if (ptr == 0)
        Py_RETURN_NONE;
    if (device_has_pools(device, &pools) || enter_keeping(device, &prev))
        return NULL;
    rc = pools ? CU.cuMemFreeAsync(ptr, stream) : CU.cuMemFree_v2(ptr);
    leave(prev);
    CU_CHECK_RC(pools ? "cuMemFreeAsync" : "cuMemFree_v2", rc);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_memcpy_htod(PyObject *module, PyObject *args)
{
    CUdeviceptr dst;
    Py_buffer src;
    CUstream stream;
    int device = 0;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "O&y*O&|i:memcpy_htod", as_ptr, &dst, &src, as_stream, &stream, &device))
        return NULL;
    if (cuda_device_enter(device)) {
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = CU.cuMemcpyHtoDAsync_v2(dst, src.buf, (size_t)src.len, stream);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    CU_CHECK_RC("cuMemcpyHtoDAsync_v2", rc);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_memcpy_dtoh(PyObject *module, PyObject *args)
{
    Py_buffer dst;
    CUdeviceptr src;
    CUstream stream;
    int device = 0;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "w*O&O&|i:memcpy_dtoh", &dst, as_ptr, &src, as_stream, &stream, &device))
        return NULL;
    if (cuda_device_enter(device)) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = CU.cuMemcpyDtoHAsync_v2(dst.buf, src, (size_t)dst.len, stream);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    CU_CHECK_RC("cuMemcpyDtoHAsync_v2", rc);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_memcpy_dtod(PyObject *module, PyObject *args)
{
    CUdeviceptr dst, src;
    Py_ssize_t nbytes;
    CUstream stream;
    int device = 0;
    if (!PyArg_ParseTuple(args, "O&O&nO&|i:memcpy_dtod", as_ptr, &dst, as_ptr, &src, &nbytes,
                          as_stream, &stream, &device)
        || nonnegative("memcpy_dtod", "nbytes", nbytes) || cuda_device_enter(device))
        return NULL;
    CU_CHECK(cuMemcpyDtoDAsync_v2, dst, src, (size_t)nbytes, stream);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_memset_d8(PyObject *module, PyObject *args)
{
    CUdeviceptr ptr;
    int value, device = 0;
    Py_ssize_t nbytes;
    CUstream stream;
    if (!PyArg_ParseTuple(args, "O&inO&|i:memset_d8", as_ptr, &ptr, &value, &nbytes, as_stream,
                          &stream, &device)
        || nonnegative("memset_d8", "nbytes", nbytes) || cuda_device_enter(device))
        return NULL;
    if (value < 0 || value > 255) {
        PyErr_Format(PyExc_ValueError, "memset_d8: value must be a byte (0..255), got %d", value);
        return NULL;
    }
    CU_CHECK(cuMemsetD8Async, ptr, (unsigned char)value, (size_t)nbytes, stream);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_stream_synchronize(PyObject *module, PyObject *args)
{
    CUstream stream;
    int device = 0;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "O&|i:stream_synchronize", as_stream, &stream, &device)
        || cuda_device_enter(device))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = CU.cuStreamSynchronize(stream);
    Py_END_ALLOW_THREADS
    CU_CHECK_RC("cuStreamSynchronize", rc);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_device_synchronize(PyObject *module, PyObject *args)
{
    int device = 0;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "|i:device_synchronize", &device) || cuda_device_enter(device))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = CU.cuCtxSynchronize();
    Py_END_ALLOW_THREADS
    CU_CHECK_RC("cuCtxSynchronize", rc);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_stream_create(PyObject *module, PyObject *args)
{
    int device = 0, non_blocking = 1;
    CUstream stream;
    if (!PyArg_ParseTuple(args, "|ip:stream_create", &device, &non_blocking) || cuda_device_enter(device))
        return NULL;
    CU_CHECK(cuStreamCreate, &stream, non_blocking ? CU_STREAM_NON_BLOCKING : 0);
    return PyLong_FromVoidPtr(stream);
fail:
    return NULL;
}

static PyObject *c_stream_destroy(PyObject *module, PyObject *args)
{
    CUstream stream;
    int device = 0;
    if (!PyArg_ParseTuple(args, "O&|i:stream_destroy", as_stream, &stream, &device)
        || cuda_device_enter(device))
        return NULL;
    CU_CHECK(cuStreamDestroy_v2, stream);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_stream_wait(PyObject *module, PyObject *args)
{
    CUstream stream, on;
    CUevent event = NULL;
    int device = 0;
    if (!PyArg_ParseTuple(args, "O&O&|i:stream_wait", as_stream, &stream, as_stream, &on, &device)
        || cuda_device_enter(device))
        return NULL;
    CU_CHECK(cuEventCreate, &event, CU_EVENT_DISABLE_TIMING);
    CU_CHECK(cuEventRecord, event, on);
    CU_CHECK(cuStreamWaitEvent, stream, event, 0);
    /* the wait is enqueued: destroying the event now is allowed and frees it once it fires */
    CU_CHECK(cuEventDestroy_v2, event);
    Py_RETURN_NONE;
fail:
    if (event)
        CU.cuEventDestroy_v2(event);
    return NULL;
}

static PyObject *c_pointer_device(PyObject *module, PyObject *arg)
{
    CUdeviceptr ptr;
    CUcontext current;
    unsigned int type;
    int ordinal;
    CUresult rc;
    if (!as_ptr(arg, &ptr) || cuda_driver_require())
        return NULL;
    /* the query needs some context current; device 0's primary context serves every pointer */
    CU_CHECK(cuCtxGetCurrent, &current);
    if (!current && cuda_device_enter(0))
        return NULL;
    rc = CU.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr);
    if (rc == CUDA_ERROR_INVALID_VALUE || (rc == CUDA_SUCCESS && type == CU_MEMORYTYPE_HOST)) {
        PyErr_Format(PyExc_ValueError, "pointer_device: 0x%llx is %s", ptr,
                     rc ? "not memory CUDA knows of" : "host memory, not device memory");
        return NULL;
    }
    CU_CHECK_RC("cuPointerGetAttribute(MEMORY_TYPE)", rc);
    CU_CHECK(cuPointerGetAttribute, &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
    return PyLong_FromLong(ordinal);
fail:
    return NULL;
}

/* --- the caller's host memory, page-locked in place --- */

/* Pinning walks and locks every page (faulting in the ones never touched): slow for large
 * ranges, so the GIL is released meanwhile. */
static PyObject *c_host_register(PyObject *module, PyObject *args)
{
    CUdeviceptr ptr;
    Py_ssize_t nbytes;
    int device = 0, read_only = 0;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "O&n|ip:host_register", as_ptr, &ptr, &nbytes, &device, &read_only)
        || nonnegative("host_register", "nbytes", nbytes) || cuda_device_enter(device))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = CU.cuMemHostRegister_v2((void *)(uintptr_t)ptr, (size_t)nbytes,
                                 read_only ? CU_MEMHOSTREGISTER_READ_ONLY : 0);
    Py_END_ALLOW_THREADS
    if (rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
        Py_RETURN_FALSE;
    if (rc != CUDA_SUCCESS) {
        cu_raise(rc, __FILE__, __LINE__, "cuMemHostRegister_v2 of %zd bytes at 0x%llx%s", nbytes,
                 ptr, read_only ? " (read-only)" : "");
        return NULL;
    }
    Py_RETURN_TRUE;
}

static PyObject *c_host_unregister(PyObject *module, PyObject *args)
{
    CUdeviceptr ptr;
    int device = 0;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "O&|i:host_unregister", as_ptr, &ptr, &device)
        || cuda_device_enter(device))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = CU.cuMemHostUnregister((void *)(uintptr_t)ptr);
    Py_END_ALLOW_THREADS
    if (rc != CUDA_SUCCESS) {
        cu_raise(rc, __FILE__, __LINE__, "cuMemHostUnregister(0x%llx)", ptr);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *c_host_pinned(PyObject *module, PyObject *args)
{
    CUdeviceptr ptr;
    unsigned int type;
    int device = 0;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "O&|i:host_pinned", as_ptr, &ptr, &device) || cuda_device_enter(device))
        return NULL;
    rc = CU.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr);
    if (rc == CUDA_ERROR_INVALID_VALUE)     /* memory CUDA does not know of: pageable */
        Py_RETURN_FALSE;
    CU_CHECK_RC("cuPointerGetAttribute(MEMORY_TYPE)", rc);
    return PyBool_FromLong(type == CU_MEMORYTYPE_HOST);
fail:
    return NULL;
}

/* --- pinned host memory --- */

typedef struct {
    PyObject_HEAD
    void *ptr;
    Py_ssize_t nbytes;     /* what the buffer protocol shows */
    Py_ssize_t capacity;   /* what cuMemHostAlloc gave (a pooled block may be larger) */
    int device;
    int pooled;            /* on dealloc: back to the pool (while it has room), not freed */
    pid_t pid;             /* the process that allocated it: a forked child neither pools nor
                            * frees its parent's blocks */
    CUcontext ctx;
} pinned_buffer;

/* The pool of pinned blocks that pooled PinnedBuffers return to: the NumPy results of GPU
 * calls live in pinned memory, so their DMAs need no host copy, and the same sizes come back
 * call after call (cuMemHostAlloc of 64 MiB costs ~25 ms; a fresh pageable array's first touch
 * about as much). Bounded: POOL_SLOTS blocks and pool_limit bytes kept free; the GIL guards it
 * (every change runs with the GIL held). live_bytes counts pooled buffers in use, so the
 * caller can bound how much of its results it keeps pinned. */
#define POOL_SLOTS 16
struct pool_block {
    void *ptr;
    Py_ssize_t capacity;
    CUcontext ctx;
};
static struct pool_block pool[POOL_SLOTS];
static int pool_count;
static Py_ssize_t pool_free_bytes, pool_live_bytes, pool_limit = (Py_ssize_t)1 << 30;

static void free_block(void *ptr, CUcontext ctx)
{
    CUcontext prev;
    if (CU.cuCtxGetCurrent(&prev) == CUDA_SUCCESS && CU.cuCtxSetCurrent(ctx) == CUDA_SUCCESS) {
        Py_BEGIN_ALLOW_THREADS
        CU.cuMemFreeHost(ptr);
        Py_END_ALLOW_THREADS
        leave(prev);
    }
}

/* Takes the oldest free blocks out of the pool, while it holds more than `keep_bytes` free or
 * more than `keep_blocks` blocks, into out[] (POOL_SLOTS at most); returns how many. The caller
 * frees them (free_block releases the GIL: only after every change to the pool is made, so no
 * other thread sees a block that is being freed). */
static int pool_trim(Py_ssize_t keep_bytes, int keep_blocks, struct pool_block *out)
{
    int n = 0;
    while (pool_count > 0 && (pool_free_bytes > keep_bytes || pool_count > keep_blocks)) {
        out[n++] = pool[0];
        pool_free_bytes -= pool[0].capacity;
        memmove(pool, pool + 1, sizeof pool[0] * (size_t)--pool_count);
    }
    return n;
}

static void free_blocks(const struct pool_block *blocks, int n)
{
    for (int i = 0; i < n; i++)
        free_block(blocks[i].ptr, blocks[i].ctx);
}

/* The smallest free block of at least nbytes (and at most twice that, plus a MiB: a small
 * result does not hold a large block), taken out of the pool; -1 when none fits. */
static int pool_take(Py_ssize_t nbytes)
{
    int best = -1;
    for (int i = 0; i < pool_count; i++)
        if (pool[i].capacity >= nbytes && pool[i].capacity <= 2 * nbytes + (1 << 20)
            && (best < 0 || pool[i].capacity < pool[best].capacity))
            best = i;
    return best;
}

static PyObject *pinned_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nbytes", "device", "pooled", NULL};
    Py_ssize_t nbytes, capacity;
    int device = 0, pooled = 0, slot;
    void *ptr = NULL;
    CUcontext ctx;
    CUresult rc = CUDA_SUCCESS;
    pinned_buffer *self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|ip:host_alloc", kwlist, &nbytes, &device, &pooled)
        || nonnegative("host_alloc", "nbytes", nbytes) || cuda_device_enter(device))
        return NULL;
    CU_CHECK(cuCtxGetCurrent, &ctx);
    capacity = nbytes;
    if (pooled && nbytes > 0 && (slot = pool_take(nbytes)) >= 0) {
        ptr = pool[slot].ptr;
        capacity = pool[slot].capacity;
        ctx = pool[slot].ctx;
        pool_free_bytes -= capacity;
        pool[slot] = pool[--pool_count];
    } else if (nbytes > 0) {
        /* pinning pages takes a while for large sizes */
        Py_BEGIN_ALLOW_THREADS
        rc = CU.cuMemHostAlloc(&ptr, (size_t)nbytes, CU_MEMHOSTALLOC_PORTABLE);
        Py_END_ALLOW_THREADS
    }
    if (rc != CUDA_SUCCESS) {
        cu_raise(rc, __FILE__, __LINE__, "cuMemHostAlloc of %zd bytes", nbytes);
        return NULL;
    }
    if (!(self = (pinned_buffer *)type->tp_alloc(type, 0))) {
        if (ptr)
            free_block(ptr, ctx);
        return NULL;
    }
    self->ptr = ptr;
    self->nbytes = nbytes;
    self->capacity = capacity;
    self->device = device;
    self->pooled = pooled && ptr;
    self->pid = getpid();
    self->ctx = ctx;
    if (self->pooled)
        pool_live_bytes += capacity;
    return (PyObject *)self;
fail:
    return NULL;
}

/* cuMemFreeHost may wait for the device (it synchronises, as cudaFreeHost does): the GIL is
 * released meanwhile. Only while the driver still answers: at interpreter exit it may be torn
 * down. A pooled buffer's block goes back to the pool while it has room, the oldest block
 * freed to make it. */
static void pinned_dealloc(PyObject *op)
{
    pinned_buffer *self = (pinned_buffer *)op;
    PyTypeObject *type = Py_TYPE(op);
    struct pool_block out[POOL_SLOTS];
    int n = 0;
    if (self->pid != getpid()) {
        self->ptr = NULL;               /* a forked child: its parent's block, not ours */
    } else if (self->pooled) {
        pool_live_bytes -= self->capacity;
        if (self->capacity <= pool_limit) {
            n = pool_trim(pool_limit - self->capacity, POOL_SLOTS - 1, out);
            pool[pool_count].ptr = self->ptr;
            pool[pool_count].capacity = self->capacity;
            pool[pool_count++].ctx = self->ctx;
            pool_free_bytes += self->capacity;
            self->ptr = NULL;
        }
    }
    if (self->ptr)
        free_block(self->ptr, self->ctx);
    free_blocks(out, n);
    type->tp_free(op);
    Py_DECREF(type);
}

/* host_pool(limit=-1): (free bytes kept, free blocks, live pooled bytes, limit); a limit >= 0
 * sets the bytes kept free from now on (0: none), freeing the oldest blocks past it. */
static PyObject *c_host_pool(PyObject *module, PyObject *args)
{
    Py_ssize_t limit = -1;
    if (!PyArg_ParseTuple(args, "|n:host_pool", &limit))
        return NULL;
    if (limit >= 0) {
        struct pool_block out[POOL_SLOTS];
        pool_limit = limit;
        free_blocks(out, pool_trim(pool_limit, POOL_SLOTS, out));
    }
    return Py_BuildValue("(ninn)", pool_free_bytes, pool_count, pool_live_bytes, pool_limit);
}

/* After fork: the parent's blocks are not this process's pinned memory; forget them (never
 * freed here) and count nothing live. */
static PyObject *c_host_pool_forget(PyObject *module, PyObject *unused)
{
    pool_count = 0;
    pool_free_bytes = pool_live_bytes = 0;
    Py_RETURN_NONE;
}

static int pinned_getbuffer(PyObject *op, Py_buffer *view, int flags)
{
    static char empty;   /* a zero-length buffer still needs a valid address */
    pinned_buffer *self = (pinned_buffer *)op;
    return PyBuffer_FillInfo(view, op, self->ptr ? self->ptr : &empty, self->nbytes, 0, flags);
}

static Py_ssize_t pinned_length(PyObject *op)
{
    return ((pinned_buffer *)op)->nbytes;
}

static PyObject *pinned_get_ptr(PyObject *op, void *unused)
{
    return PyLong_FromVoidPtr(((pinned_buffer *)op)->ptr);
}

static PyObject *pinned_get_nbytes(PyObject *op, void *unused)
{
    return PyLong_FromSsize_t(((pinned_buffer *)op)->nbytes);
}

static PyObject *pinned_get_pooled(PyObject *op, void *unused)
{
    return PyBool_FromLong(((pinned_buffer *)op)->pooled);
}

static PyObject *pinned_get_device(PyObject *op, void *unused)
{
    return PyLong_FromLong(((pinned_buffer *)op)->device);
}

static PyObject *pinned_repr(PyObject *op)
{
    pinned_buffer *self = (pinned_buffer *)op;
    return PyUnicode_FromFormat("PinnedBuffer(nbytes=%zd, device=%d, ptr=%p)", self->nbytes,
                                self->device, self->ptr);
}

static PyGetSetDef pinned_getset[] = {
    {"ptr", pinned_get_ptr, NULL, "The host address, as an int.", NULL},
    {"nbytes", pinned_get_nbytes, NULL, "Size in bytes.", NULL},
    {"device", pinned_get_device, NULL, "The device whose context pinned it.", NULL},
    {"pooled", pinned_get_pooled, NULL, "Whether its block goes back to the pool.", NULL},
    {NULL},
};

static PyType_Slot pinned_slots[] = {
    {Py_tp_doc, "PinnedBuffer(nbytes, device=0, pooled=False): page-locked host memory "
                "(cuMemHostAlloc, portable) exposing the writable buffer protocol; freed with "
                "cuMemFreeHost when the last reference and the last memoryview go, or with "
                "pooled=True taken from and given back to a bounded pool of blocks (host_pool). "
                "Copies from or to it are truly asynchronous: don't touch or drop it until the "
                "stream has passed them."},
    {Py_tp_new, pinned_new},
    {Py_tp_dealloc, pinned_dealloc},
    {Py_tp_repr, pinned_repr},
    {Py_tp_getset, pinned_getset},
    {Py_bf_getbuffer, pinned_getbuffer},
    {Py_mp_length, pinned_length},
    {0, NULL},
};

static PyType_Spec pinned_spec = {
    .name = "attnext._C.PinnedBuffer",
    .basicsize = sizeof(pinned_buffer),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = pinned_slots,
};

/* --- DLPack (the ABI of dmlc/dlpack's dlpack.h, v1) --- */

enum { kDLCPU = 1, kDLCUDA = 2 };
#define DLPACK_MAJOR 1
#define DLPACK_MINOR 0
#define DLPACK_FLAG_BITMASK_READ_ONLY 1ULL

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;            /* elements; NULL (unversioned only): C-contiguous */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

_Static_assert(sizeof(DLTensor) == 48, "DLTensor must match dlpack.h");
_Static_assert(sizeof(DLManagedTensor) == 64, "DLManagedTensor must match dlpack.h");
_Static_assert(sizeof(DLManagedTensorVersioned) == 80, "DLManagedTensorVersioned must match dlpack.h");

#define OWNER_CAPSULE "attnext.dlpack_owner"
#define OWNER_CAPSULE_VERSIONED "attnext.dlpack_owner_versioned"

static void owner_free(PyObject *owner)
{
    DLManagedTensor *mt = PyCapsule_GetPointer(owner, OWNER_CAPSULE);
    if (mt && mt->deleter)
        mt->deleter(mt);
}

static void owner_free_versioned(PyObject *owner)
{
    DLManagedTensorVersioned *mt = PyCapsule_GetPointer(owner, OWNER_CAPSULE_VERSIONED);
    if (mt && mt->deleter)
        mt->deleter(mt);
}

static PyObject *int64_tuple(const int64_t *v, int n)
{
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* Consumes a producer's capsule: renames it "used_..." so its destructor leaves the tensor alone,
 * and hands the tensor to an owner capsule whose destruction calls the producer's deleter. */
static PyObject *c_dlpack_import(PyObject *module, PyObject *capsule)
{
    PyObject *owner, *shape = NULL, *strides = NULL;
    DLTensor *t;
    int readonly = 0;
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
        if (!(owner = PyCapsule_New(mt, OWNER_CAPSULE, owner_free)))
            return NULL;
        t = &mt->dl_tensor;
        PyCapsule_SetName(capsule, "used_dltensor");
    } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *mt = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (!(owner = PyCapsule_New(mt, OWNER_CAPSULE_VERSIONED, owner_free_versioned)))
            return NULL;
        t = &mt->dl_tensor;
        readonly = (mt->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
        PyCapsule_SetName(capsule, "used_dltensor_versioned");
        /* a newer major version may lay the tensor out differently: only the deleter is safe */
        if (mt->version.major != DLPACK_MAJOR) {
            PyErr_Format(PyExc_BufferError, "dlpack_import: DLPack %u.%u tensor; only major "
                         "version %d is understood", mt->version.major, mt->version.minor, DLPACK_MAJOR);
            goto fail;
        }
    } else {
        const char *name = PyCapsule_CheckExact(capsule) ? PyCapsule_GetName(capsule) : NULL;
        PyErr_Format(PyExc_TypeError, "dlpack_import: expected an unused \"dltensor\" or "
                     "\"dltensor_versioned\" capsule, got %s%s%s", name ? "a capsule named \"" : "",
                     name ? name : Py_TYPE(capsule)->tp_name, name ? "\"" : "");
        return NULL;
    }
    if (t->ndim < 0 || (t->ndim > 0 && !t->shape)) {
        PyErr_Format(PyExc_BufferError, "dlpack_import: bad tensor (ndim %d)", (int)t->ndim);
        goto fail;
    }
    if (!(shape = int64_tuple(t->shape, t->ndim)))
        goto fail;
    if (t->strides) {
        strides = int64_tuple(t->strides, t->ndim);
    } else if ((strides = PyTuple_New(t->ndim))) {
        int64_t step = 1;
        for (int i = t->ndim - 1; i >= 0; i--) {
            PyObject *x = PyLong_FromLongLong(step);
            if (!x)
                goto fail;
            PyTuple_SET_ITEM(strides, i, x);
            step *= t->shape[i];
        }
    }
    if (!strides)
        goto fail;
    return Py_BuildValue("(NKNN(iii)(ii)O)", owner,
                         (unsigned long long)(uintptr_t)t->data + t->byte_offset, shape, strides,
                         t->dtype.code, t->dtype.bits, t->dtype.lanes, t->device.device_type,
                         t->device.device_id, readonly ? Py_True : Py_False);
fail:
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_DECREF(owner);
    return NULL;
}

/* What an exported capsule points into: the managed tensor, the owner it keeps alive, and the
 * shape and strides arrays the DLTensor points at (dims[0:ndim], dims[ndim:2*ndim]). */
typedef struct {
    union {
        DLManagedTensor plain;
        DLManagedTensorVersioned versioned;
    } mt;
    PyObject *owner;
    int64_t dims[];
} export_ctx;

/* Consumers call the deleter from any thread, with or without the GIL. Once the interpreter is
 * gone the owner can only be leaked. */
static void export_release(export_ctx *ctx)
{
    if (Py_IsInitialized()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_XDECREF(ctx->owner);
        PyGILState_Release(gil);
    }
    PyMem_RawFree(ctx);
}

static void export_deleter(DLManagedTensor *self)
{
    export_release(self->manager_ctx);
}

static void export_deleter_versioned(DLManagedTensorVersioned *self)
{
    export_release(self->manager_ctx);
}

/* A capsule nobody consumed still owns its tensor. */
static void export_capsule_free(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
        mt->deleter(mt);
    } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *mt = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        mt->deleter(mt);
    }
}

static int int64_items(PyObject *seq, int64_t *out, Py_ssize_t n, int is_shape)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v < 0 && is_shape) {
            PyErr_Format(PyExc_ValueError, "dlpack_export: shape[%zd] is %lld", i, v);
            return -1;
        }
        out[i] = v;
    }
    return 0;
}

static PyObject *c_dlpack_export(PyObject *module, PyObject *args)
{
    CUdeviceptr ptr;
    PyObject *shape, *strides, *owner, *shape_seq = NULL, *stride_seq = NULL, *capsule;
    int code, bits, lanes, device_id, device_type = kDLCUDA, versioned = 0;
    export_ctx *ctx = NULL;
    Py_ssize_t ndim;
    if (!PyArg_ParseTuple(args, "O&OO(iii)iO|ip:dlpack_export", as_ptr, &ptr, &shape, &strides,
                          &code, &bits, &lanes, &device_id, &owner, &device_type, &versioned))
        return NULL;
    if (code < 0 || code > 255 || bits < 1 || bits > 255 || lanes < 1 || lanes > 65535) {
        PyErr_Format(PyExc_ValueError, "dlpack_export: bad dtype (code %d, bits %d, lanes %d)",
                     code, bits, lanes);
        return NULL;
    }
    if (!(shape_seq = PySequence_Fast(shape, "dlpack_export: shape must be a tuple of ints")))
        return NULL;
    ndim = PySequence_Fast_GET_SIZE(shape_seq);
    if (strides != Py_None) {
        if (!(stride_seq = PySequence_Fast(strides, "dlpack_export: strides must be None or a tuple of ints")))
            goto fail;
        if (PySequence_Fast_GET_SIZE(stride_seq) != ndim) {
            PyErr_Format(PyExc_ValueError, "dlpack_export: %zd strides for %zd dims",
                         PySequence_Fast_GET_SIZE(stride_seq), ndim);
            goto fail;
        }
    }
    if (ndim > INT32_MAX / 2 || !(ctx = PyMem_RawCalloc(1, sizeof *ctx + 2 * ndim * sizeof(int64_t)))) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t *dims = ctx->dims, *steps = ctx->dims + ndim;
    if (int64_items(shape_seq, dims, ndim, 1) || (stride_seq && int64_items(stride_seq, steps, ndim, 0)))
        goto fail;
    if (!stride_seq) {
        /* DLPack 1.x wants strides even for contiguous tensors */
        int64_t step = 1;
        for (Py_ssize_t i = ndim - 1; i >= 0; i--) {
            steps[i] = step;
            step *= dims[i];
        }
    }
    DLTensor t = {(void *)(uintptr_t)ptr, {device_type, device_id}, (int32_t)ndim,
                  {(uint8_t)code, (uint8_t)bits, (uint16_t)lanes}, dims, steps, 0};
    if (versioned)
        ctx->mt.versioned = (DLManagedTensorVersioned){{DLPACK_MAJOR, DLPACK_MINOR}, ctx,
                                                       export_deleter_versioned, 0, t};
    else
        ctx->mt.plain = (DLManagedTensor){t, ctx, export_deleter};
    if (!(capsule = PyCapsule_New(&ctx->mt, versioned ? "dltensor_versioned" : "dltensor",
                                  export_capsule_free)))
        goto fail;
    ctx->owner = Py_NewRef(owner);
    Py_DECREF(shape_seq);
    Py_XDECREF(stride_seq);
    return capsule;
fail:
    PyMem_RawFree(ctx);
    Py_XDECREF(shape_seq);
    Py_XDECREF(stride_seq);
    return NULL;
}

/* --- the table --- */

PyMethodDef attnext_cuda_methods[] = {
    {"cuda_load", c_cuda_load, METH_NOARGS,
     "cuda_load() -> None: load libcuda (ATTNEXT_LIBCUDA overrides the soname) and cuInit; "
     "RuntimeError with the reason when CUDA is unusable. The outcome is remembered."},
    {"cuda_device_count", c_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int: number of CUDA devices (RuntimeError without a driver)."},
    {"cuda_info", c_cuda_info, METH_VARARGS,
     "cuda_info(device=0, /) -> dict: name, compute_capability (major, minor), "
     "multiprocessor_count, max_shared_memory_per_block_optin, l2_cache_size, total_memory "
     "(bytes), driver_version (major, minor), memory_pools (bool), read_only_host_register "
     "(bool: host_register's read_only is supported). Creates no context."},
    {"host_pool", c_host_pool, METH_VARARGS,
     "host_pool(limit=-1) -> (free bytes, free blocks, live bytes, limit): the pool of pinned "
     "blocks pooled PinnedBuffers use; limit >= 0 sets the bytes it keeps free."},
    {"host_pool_forget", c_host_pool_forget, METH_NOARGS,
     "Forgets the pool's blocks without freeing them (a forked child's)."},
    {"nvrtc_load", c_nvrtc_load, METH_O,
     "nvrtc_load(candidates: list[str], /) -> str: load the first candidate (a libnvrtc file, "
     "a directory holding libnvrtc.so*, or a soname) that works and return its path; once "
     "loaded, returns that path whatever the candidates. RuntimeError listing each candidate "
     "and why it failed."},
    {"nvrtc_version", c_nvrtc_version, METH_NOARGS,
     "nvrtc_version() -> (major, minor) of the loaded NVRTC."},
    {"nvrtc_compile", c_nvrtc_compile, METH_VARARGS,
     "nvrtc_compile(source: str, filename: str, options: list[str], headers: list[tuple[str, "
     "str]], /) -> (cubin: bytes, log: str). headers are (include name, text) pairs found by "
     "#include. The GIL is released while NVRTC compiles. A compile error raises "
     "attnext.CompileError(message, source=source, log=log); options must name a real "
     "architecture (--gpu-architecture=sm_90a), else RuntimeError; a failing NVRTC call raises "
     "RuntimeError naming it."},
    {"module_load", c_module_load, METH_VARARGS,
     "module_load(cubin: bytes, device: int = 0, /) -> capsule: cuModuleLoadData in the "
     "device's primary context; unloaded when the capsule and every function from it are gone."},
    {"module_function", c_module_function, METH_VARARGS,
     "module_function(module, name: str, dynamic_smem: int, /) -> capsule: the kernel `name` "
     "(extern \"C\"), keeping its module alive; above 48 KiB of dynamic shared memory its "
     "limit is raised to dynamic_smem."},
    {"function_attributes", c_function_attributes, METH_O,
     "function_attributes(function, /) -> dict: num_regs, local_size_bytes (spills), "
     "shared_size_bytes (static), max_threads_per_block, max_dynamic_shared_size_bytes, "
     "binary_version."},
    {"launch", c_launch, METH_VARARGS,
     "launch(function, grid: (x, y, z), block: (x, y, z), smem: int, stream: int, params: "
     "bytes, /) -> None: params are the bytes of the kernel's ONE by-value struct parameter "
     "(b\"\" for a kernel without parameters); their size is not checked."},
    {"mem_pool_keep", c_mem_pool_keep, METH_VARARGS,
     "mem_pool_keep(nbytes, device=0) -> bool: the device's current memory pool keeps at least "
     "nbytes of freed memory at a synchronisation (its RELEASE_THRESHOLD, only ever raised); False "
     "without memory pools."},
    {"mem_pool_trim", c_mem_pool_trim, METH_VARARGS,
     "mem_pool_trim(device=0) -> bool: the device's current memory pool gives back the freed "
     "memory it keeps (cuMemPoolTrimTo 0); False without memory pools."},
    {"mem_alloc", c_mem_alloc, METH_VARARGS,
     "mem_alloc(nbytes: int, stream: int, device: int = 0, /) -> int: device memory ordered on "
     "stream (cuMemAllocAsync; cuMemAlloc on devices without memory pools). 0 for 0 bytes. "
     "MemoryError when the device is out of memory."},
    {"mem_free", c_mem_free, METH_VARARGS,
     "mem_free(ptr: int, stream: int, device: int = 0, /) -> None: frees mem_alloc's memory "
     "ordered on stream: work already enqueued on stream may still use it. Restores the "
     "caller's current context (it runs from finalizers)."},
    {"memcpy_htod", c_memcpy_htod, METH_VARARGS,
     "memcpy_htod(dst: int, src: C-contiguous buffer, stream: int, device: int = 0, /) -> None: "
     "copies len(src) bytes on stream. From pageable memory src may be reused on return; from "
     "pinned memory (PinnedBuffer) the copy is asynchronous: keep src unchanged until the "
     "stream has passed it."},
    {"memcpy_dtoh", c_memcpy_dtoh, METH_VARARGS,
     "memcpy_dtoh(dst: writable C-contiguous buffer, src: int, stream: int, device: int = 0, /) "
     "-> None: copies len(dst) bytes on stream. Into pageable memory it returns once the copy "
     "is done; into pinned memory it is asynchronous: synchronize before reading dst."},
    {"memcpy_dtod", c_memcpy_dtod, METH_VARARGS,
     "memcpy_dtod(dst: int, src: int, nbytes: int, stream: int, device: int = 0, /) -> None"},
    {"memset_d8", c_memset_d8, METH_VARARGS,
     "memset_d8(ptr: int, value: int, nbytes: int, stream: int, device: int = 0, /) -> None"},
    {"stream_synchronize", c_stream_synchronize, METH_VARARGS,
     "stream_synchronize(stream: int, device: int = 0, /) -> None, GIL released while waiting."},
    {"device_synchronize", c_device_synchronize, METH_VARARGS,
     "device_synchronize(device: int = 0, /) -> None: waits for all work on the device, every "
     "stream's (GIL released)."},
    {"stream_create", c_stream_create, METH_VARARGS,
     "stream_create(device: int = 0, non_blocking: bool = True, /) -> int: a new stream; "
     "non-blocking streams do not synchronize with the legacy default stream."},
    {"stream_destroy", c_stream_destroy, METH_VARARGS,
     "stream_destroy(stream: int, device: int = 0, /) -> None"},
    {"stream_wait", c_stream_wait, METH_VARARGS,
     "stream_wait(stream: int, on: int, device: int = 0, /) -> None: work enqueued on stream "
     "from now on waits for the work enqueued on `on` so far (an event, without the host "
     "waiting)."},
    {"pointer_device", c_pointer_device, METH_O,
     "pointer_device(ptr: int, /) -> int: the device ordinal of device (or managed) memory; "
     "ValueError for host memory or an address CUDA does not know."},
    {"host_register", c_host_register, METH_VARARGS,
     "host_register(ptr: int, nbytes: int, device: int = 0, read_only: bool = False, /) -> bool: "
     "page-locks the host range in place (cuMemHostRegister) for DMA in the device's context; "
     "read_only: the device only reads it (CU_MEMHOSTREGISTER_READ_ONLY, needed for read-only "
     "mappings; cuda_info's read_only_host_register says whether the device takes it). False, "
     "doing nothing, when part of the range is registered already; RuntimeError naming the "
     "CUDA error otherwise. GIL released while the pages are locked."},
    {"host_unregister", c_host_unregister, METH_VARARGS,
     "host_unregister(ptr: int, device: int = 0, /) -> None: undoes the host_register that "
     "started at ptr (cuMemHostUnregister). No copy may still be using the range. GIL released."},
    {"host_pinned", c_host_pinned, METH_VARARGS,
     "host_pinned(ptr: int, device: int = 0, /) -> bool: whether ptr is page-locked host "
     "memory CUDA knows of (registered, or from cuMemHostAlloc / host_alloc)."},
    {"dlpack_import", c_dlpack_import, METH_O,
     "dlpack_import(capsule, /) -> (owner, ptr, shape, strides, (code, bits, lanes), "
     "(device_type, device_id), readonly): consumes a \"dltensor\" or \"dltensor_versioned\" "
     "capsule (renamed \"used_...\"). ptr includes byte_offset; strides are in elements "
     "(computed when the producer gave none); readonly is the versioned tensor's READ_ONLY "
     "flag (False for unversioned ones). The producer's deleter runs when `owner` is released."},
    {"dlpack_export", c_dlpack_export, METH_VARARGS,
     "dlpack_export(ptr: int, shape: tuple, strides: tuple | None, (code, bits, lanes), "
     "device_id: int, owner, device_type: int = 2 (kDLCUDA), versioned: bool = False, /) -> "
     "capsule \"dltensor\" (\"dltensor_versioned\", DLPack 1.0, when versioned). The tensor "
     "keeps `owner` alive until the consumer's deleter call, or the capsule's destruction "
     "if nobody consumed it. strides in elements; None: C-contiguous."},
    {NULL, NULL, 0, NULL},
};

int attnext_cuda_exec(PyObject *module)
{
    PyObject *type;
    if (PyModule_AddFunctions(module, attnext_cuda_methods))
        return -1;
    if (!(type = PyType_FromModuleAndSpec(module, &pinned_spec, NULL)))
        return -1;
    /* the type is the allocator: host_alloc(nbytes, device=0) is PinnedBuffer(nbytes, device) */
    int rc = PyModule_AddObjectRef(module, "PinnedBuffer", type) < 0
             || PyModule_AddObjectRef(module, "host_alloc", type) < 0 ? -1 : 0;
    Py_DECREF(type);
    return rc;
}
