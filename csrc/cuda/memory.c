/* Device memory (stream-ordered pools), copies, streams and synchronisation. (Conventions: host.h.) */
#include "host.h"

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

static PyObject *c_stream_capturing(PyObject *module, PyObject *args)
{
    CUstream stream;
    int device = 0, status = 0;
    if (!PyArg_ParseTuple(args, "O&|i:stream_capturing", as_stream, &stream, &device) || cuda_device_enter(device))
        return NULL;
    if (!cu_is_capturing)
        Py_RETURN_FALSE;
    /* an error (the legacy stream while another captures globally) counts as capturing */
    return PyBool_FromLong(cu_is_capturing(stream, &status) != CUDA_SUCCESS || status != 0);
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

/* Events: a point in a stream's order that other streams wait for (staging.Fence), without a
 * stream of its own made and destroyed per fence. */
static PyObject *c_event_create(PyObject *module, PyObject *args)
{
    CUevent event = NULL;
    int device = 0;
    if (!PyArg_ParseTuple(args, "|i:event_create", &device) || cuda_device_enter(device))
        return NULL;
    CU_CHECK(cuEventCreate, &event, CU_EVENT_DISABLE_TIMING);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)event);
fail:
    return NULL;
}

static PyObject *c_event_record(PyObject *module, PyObject *args)
{
    CUdeviceptr event;
    CUstream stream;
    int device = 0;
    if (!PyArg_ParseTuple(args, "O&O&|i:event_record", as_ptr, &event, as_stream, &stream, &device)
        || cuda_device_enter(device))
        return NULL;
    CU_CHECK(cuEventRecord, (CUevent)(uintptr_t)event, stream);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_stream_wait_event(PyObject *module, PyObject *args)
{
    CUstream stream;
    CUdeviceptr event;
    int device = 0;
    if (!PyArg_ParseTuple(args, "O&O&|i:stream_wait_event", as_stream, &stream, as_ptr, &event, &device)
        || cuda_device_enter(device))
        return NULL;
    CU_CHECK(cuStreamWaitEvent, stream, (CUevent)(uintptr_t)event, 0);
    Py_RETURN_NONE;
fail:
    return NULL;
}

static PyObject *c_event_destroy(PyObject *module, PyObject *args)
{
    CUdeviceptr event;
    int device = 0;
    CUcontext prev = NULL;
    if (!PyArg_ParseTuple(args, "O&|i:event_destroy", as_ptr, &event, &device) || enter_keeping(device, &prev))
        return NULL;
    /* waits already enqueued on it still complete */
    CU_CHECK(cuEventDestroy_v2, (CUevent)(uintptr_t)event);
    leave(prev);
    Py_RETURN_NONE;
fail:
    leave(prev);
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

static PyMethodDef memory_methods[] = {
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
    {"stream_capturing", c_stream_capturing, METH_VARARGS,
     "stream_capturing(stream: int, device: int = 0, /) -> bool: whether the stream is capturing "
     "a CUDA graph (False where the driver cannot say)."},
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
    {"event_create", c_event_create, METH_VARARGS,
     "event_create(device: int = 0, /) -> int: an event without timing (cuEventCreate)."},
    {"event_record", c_event_record, METH_VARARGS,
     "event_record(event: int, stream: int, device: int = 0, /) -> None: the event marks the work "
     "enqueued on stream so far."},
    {"stream_wait_event", c_stream_wait_event, METH_VARARGS,
     "stream_wait_event(stream: int, event: int, device: int = 0, /) -> None: work enqueued on "
     "stream from now on waits for what the event marks (no host wait)."},
    {"event_destroy", c_event_destroy, METH_VARARGS,
     "event_destroy(event: int, device: int = 0, /) -> None: frees it once it has fired; waits "
     "enqueued on it still complete. Restores the caller's context (it runs from close())."},
    {"pointer_device", c_pointer_device, METH_O,
     "pointer_device(ptr: int, /) -> int: the device ordinal of device (or managed) memory; "
     "ValueError for host memory or an address CUDA does not know."},
    {NULL, NULL, 0, NULL},
};

int cuda_memory_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, memory_methods);
}
