/* DLPack import and export (the ABI of dmlc/dlpack's dlpack.h, v1). (Conventions: host.h.) */
#include "host.h"

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

static PyMethodDef dlpack_methods[] = {
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

int cuda_dlpack_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, dlpack_methods);
}
