/* Host memory for DMA: the caller's registered in place, and PinnedBuffer (pinned blocks, pooled). (Conventions: host.h.) */
#include "host.h"

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

static PyMethodDef pinned_methods[] = {
    {"host_pool", c_host_pool, METH_VARARGS,
     "host_pool(limit=-1) -> (free bytes, free blocks, live bytes, limit): the pool of pinned "
     "blocks pooled PinnedBuffers use; limit >= 0 sets the bytes it keeps free."},
    {"host_pool_forget", c_host_pool_forget, METH_NOARGS,
     "Forgets the pool's blocks without freeing them (a forked child's)."},
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
    {NULL, NULL, 0, NULL},
};

int cuda_pinned_exec(PyObject *module)
{
    PyObject *type;
    if (PyModule_AddFunctions(module, pinned_methods))
        return -1;
    if (!(type = PyType_FromModuleAndSpec(module, &pinned_spec, NULL)))
        return -1;
    /* the type is the allocator: host_alloc(nbytes, device=0) is PinnedBuffer(nbytes, device) */
    int rc = PyModule_AddObjectRef(module, "PinnedBuffer", type) < 0
             || PyModule_AddObjectRef(module, "host_alloc", type) < 0 ? -1 : 0;
    Py_DECREF(type);
    return rc;
}
