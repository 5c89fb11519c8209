/* XLA FFI handlers (attnext.jax): what jax.ffi.ffi_call runs for attnext's targets, under jax.jit.
 *
 * XLA's FFI is a C ABI: the handler gets an XLA_FFI_CallFrame and returns NULL or an
 * XLA_FFI_Error. The structs below are the part of xla/ffi/api/c_api.h (API 0.1, the version the
 * handlers report) that they read, field for field in that header's order; nothing of jaxlib is
 * needed at build time. Every call is handed to the Python function attnext.jax registered with
 * ffi_set_dispatch (the GIL taken): dispatch(platform, stream, args, rets, attrs), args and rets
 * lists of (address, XLA dtype code, dims), attrs a dict of the scalar and string attributes.
 * The dispatcher runs attnext's public API on those buffers (the results written into rets); a
 * Python exception becomes an XLA error carrying its message, which JAX raises.
 *
 *   ffi_handler(platform) -> PyCapsule    the handler for "cpu" or "cuda" (jax.ffi.register_ffi_target)
 *   ffi_set_dispatch(fn)                  the Python dispatcher (None: calls fail with a message)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct ffi_ext {
    size_t struct_size;
    int type;                          /* 1: metadata */
    struct ffi_ext *next;
} ffi_ext;

typedef struct {
    size_t struct_size;
    ffi_ext *extension_start;
    int major_version, minor_version;
} ffi_api_version;

typedef struct ffi_error ffi_error;

typedef struct {
    size_t struct_size;
    ffi_ext *extension_start;
    const char *message;
    int errc;
} ffi_error_create_args;

typedef struct {
    size_t struct_size;
    ffi_ext *extension_start;
    void *ctx;
    void *stream;                      /* out */
} ffi_stream_get_args;

/* XLA_FFI_Api up to XLA_FFI_Stream_Get, the last function the handlers call */
typedef struct {
    size_t struct_size;
    ffi_ext *extension_start;
    ffi_api_version api_version;
    const void *internal_api;
    ffi_error *(*error_create)(ffi_error_create_args *);
    void (*error_get_message)(void *);
    void (*error_destroy)(void *);
    void *(*handler_register)(void *);
    ffi_error *(*stream_get)(ffi_stream_get_args *);
} ffi_api;

typedef struct {
    size_t struct_size;
    ffi_ext *extension_start;
    int dtype;
    void *data;
    int64_t rank;
    int64_t *dims;
} ffi_buffer;

typedef struct {
    size_t struct_size;
    ffi_ext *extension_start;
    int64_t size;
    int *types;                        /* 1: buffer */
    void **args;
} ffi_args;

typedef struct {
    const char *ptr;
    size_t len;
} ffi_bytes;

typedef struct {
    int dtype;
    void *value;
} ffi_scalar;

typedef struct {
    size_t struct_size;
    ffi_ext *extension_start;
    int64_t size;
    int *types;                        /* 3: scalar, 4: string */
    ffi_bytes **names;
    void **attrs;
} ffi_attrs;

typedef struct {
    size_t struct_size;
    ffi_ext *extension_start;
    const ffi_api *api;
    void *ctx;
    int stage;                         /* 3: execute */
    ffi_args args;
    ffi_args rets;                     /* XLA_FFI_Rets: the same layout */
    ffi_attrs attrs;
} ffi_call_frame;

typedef struct {
    size_t struct_size;
    ffi_api_version api_version;
    uint32_t traits;
} ffi_metadata;

typedef struct {
    ffi_ext extension_base;
    ffi_metadata *metadata;
} ffi_metadata_ext;

enum { EXT_METADATA = 1, STAGE_EXECUTE = 3, ARG_BUFFER = 1, ATTR_SCALAR = 3, ATTR_STRING = 4,
       ERR_INVALID_ARGUMENT = 3, ERR_INTERNAL = 13 };
/* XLA_FFI_DataType codes of the scalar attributes */
enum { DT_PRED = 1, DT_S8 = 2, DT_S16 = 3, DT_S32 = 4, DT_S64 = 5, DT_U8 = 6, DT_U16 = 7, DT_U32 = 8,
       DT_U64 = 9, DT_F16 = 10, DT_F32 = 11, DT_F64 = 12 };

static PyObject *dispatch;             /* attnext.jax's, set once at its import (under the GIL) */

static ffi_error *fail(const ffi_call_frame *frame, int code, const char *message)
{
    ffi_error_create_args a = {sizeof a, NULL, message, code};
    return frame->api->error_create(&a);
}

static PyObject *buffers(const ffi_args *a)
{
    PyObject *list = PyList_New(a->size);
    for (int64_t i = 0; list && i < a->size; i++) {
        if (a->types[i] != ARG_BUFFER) {
            Py_DECREF(list);
            PyErr_SetString(PyExc_TypeError, "attnext FFI: an operand that is not a buffer");
            return NULL;
        }
        const ffi_buffer *b = a->args[i];
        PyObject *dims = PyTuple_New((Py_ssize_t)b->rank);
        for (int64_t d = 0; dims && d < b->rank; d++)
            PyTuple_SET_ITEM(dims, d, PyLong_FromLongLong(b->dims[d]));
        PyObject *item = dims ? Py_BuildValue("(KiN)", (unsigned long long)(uintptr_t)b->data, b->dtype, dims) : NULL;
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *scalar(const ffi_scalar *s)
{
    switch (s->dtype) {
    case DT_PRED: return PyBool_FromLong(*(const int8_t *)s->value);
    case DT_S8: return PyLong_FromLong(*(const int8_t *)s->value);
    case DT_S16: return PyLong_FromLong(*(const int16_t *)s->value);
    case DT_S32: return PyLong_FromLong(*(const int32_t *)s->value);
    case DT_S64: return PyLong_FromLongLong(*(const int64_t *)s->value);
    case DT_U8: return PyLong_FromUnsignedLong(*(const uint8_t *)s->value);
    case DT_U16: return PyLong_FromUnsignedLong(*(const uint16_t *)s->value);
    case DT_U32: return PyLong_FromUnsignedLong(*(const uint32_t *)s->value);
    case DT_U64: return PyLong_FromUnsignedLongLong(*(const uint64_t *)s->value);
    case DT_F32: return PyFloat_FromDouble(*(const float *)s->value);
    case DT_F64: return PyFloat_FromDouble(*(const double *)s->value);
    default:
        PyErr_Format(PyExc_TypeError, "attnext FFI: a scalar attribute of XLA dtype %d", s->dtype);
        return NULL;
    }
}

static PyObject *attributes(const ffi_attrs *a)
{
    PyObject *dict = PyDict_New();
    for (int64_t i = 0; dict && i < a->size; i++) {
        PyObject *value = NULL;
        if (a->types[i] == ATTR_SCALAR) {
            value = scalar(a->attrs[i]);
        } else if (a->types[i] == ATTR_STRING) {
            const ffi_bytes *s = a->attrs[i];
            value = PyUnicode_FromStringAndSize(s->ptr, (Py_ssize_t)s->len);
        } else {
            PyErr_Format(PyExc_TypeError, "attnext FFI: an attribute of kind %d (arrays and dicts are "
                         "not taken)", a->types[i]);
        }
        PyObject *name = value ? PyUnicode_FromStringAndSize(a->names[i]->ptr, (Py_ssize_t)a->names[i]->len) : NULL;
        int bad = !name || PyDict_SetItem(dict, name, value) < 0;
        Py_XDECREF(name);
        Py_XDECREF(value);
        if (bad) {
            Py_CLEAR(dict);
        }
    }
    return dict;
}

/* The Python exception in flight as an XLA error with its type and message. */
static ffi_error *python_error(const ffi_call_frame *frame)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *name = type ? ((PyTypeObject *)type)->tp_name : "Error";
    const char *msg = text ? PyUnicode_AsUTF8(text) : NULL;
    PyErr_Clear();
    PyObject *full = PyUnicode_FromFormat("%s: %s", name, msg ? msg : "(no message)");
    const char *s = full ? PyUnicode_AsUTF8(full) : NULL;
    ffi_error *err = fail(frame, ERR_INVALID_ARGUMENT, s ? s : "attnext FFI: an error without a message");
    PyErr_Clear();
    Py_XDECREF(full);
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return err;
}

static ffi_error *handle(ffi_call_frame *frame, const char *platform)
{
    /* XLA first asks for the handler's metadata: the API version it was written against */
    for (ffi_ext *e = frame->extension_start; e; e = e->next)
        if (e->type == EXT_METADATA) {
            ffi_metadata *m = ((ffi_metadata_ext *)e)->metadata;
            m->api_version.major_version = 0;
            m->api_version.minor_version = 1;
            m->traits = 0;
            return NULL;
        }
    if (frame->stage != STAGE_EXECUTE)
        return NULL;
    void *stream = NULL;
    if (platform[0] == 'c' && platform[1] == 'u') {
        ffi_stream_get_args a = {sizeof a, NULL, frame->ctx, NULL};
        ffi_error *err = frame->api->stream_get(&a);
        if (err)
            return err;
        stream = a.stream;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    ffi_error *err = NULL;
    if (!dispatch) {
        err = fail(frame, ERR_INTERNAL, "attnext FFI: no dispatcher (import attnext.jax first)");
    } else {
        PyObject *args = buffers(&frame->args), *rets = args ? buffers(&frame->rets) : NULL;
        PyObject *attrs = rets ? attributes(&frame->attrs) : NULL;
        PyObject *res = attrs ? PyObject_CallFunction(dispatch, "sKOOO", platform,
                                                      (unsigned long long)(uintptr_t)stream, args, rets, attrs)
                              : NULL;
        if (!res)
            err = python_error(frame);
        Py_XDECREF(res);
        Py_XDECREF(attrs);
        Py_XDECREF(rets);
        Py_XDECREF(args);
    }
    PyGILState_Release(gil);
    return err;
}

static ffi_error *handle_cpu(ffi_call_frame *frame) { return handle(frame, "cpu"); }
static ffi_error *handle_cuda(ffi_call_frame *frame) { return handle(frame, "cuda"); }

static PyObject *c_ffi_handler(PyObject *module, PyObject *arg)
{
    const char *platform = PyUnicode_AsUTF8(arg);
    if (!platform)
        return NULL;
    void *fn = !strcmp(platform, "cpu") ? (void *)handle_cpu : !strcmp(platform, "cuda") ? (void *)handle_cuda : NULL;
    if (!fn) {
        PyErr_Format(PyExc_ValueError, "ffi_handler: platform must be 'cpu' or 'cuda', got %R", arg);
        return NULL;
    }
    return PyCapsule_New(fn, NULL, NULL);
}

static PyObject *c_ffi_set_dispatch(PyObject *module, PyObject *fn)
{
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "ffi_set_dispatch: a callable or None");
        return NULL;
    }
    Py_XSETREF(dispatch, fn == Py_None ? NULL : Py_NewRef(fn));
    Py_RETURN_NONE;
}

static PyMethodDef ffi_methods[] = {
    {"ffi_handler", c_ffi_handler, METH_O,
     "ffi_handler(platform: 'cpu' | 'cuda') -> PyCapsule: the XLA FFI handler jax.ffi.register_ffi_target takes."},
    {"ffi_set_dispatch", c_ffi_set_dispatch, METH_O,
     "ffi_set_dispatch(fn): fn(platform, stream, args, rets, attrs) runs every FFI call (attnext.jax)."},
    {NULL, NULL, 0, NULL},
};

int attnext_xla_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, ffi_methods);
}
