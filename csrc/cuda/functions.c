/* Modules and functions: cubins loaded, entry points found, kernels launched. (Conventions: host.h.) */
#include "host.h"

typedef struct {
    CUmodule module;
    CUcontext ctx;
    int device;
} module_handle;

typedef struct {
    CUfunction fn;
    int device;
    int dependent;       /* launched as a programmatic dependent (cuda_launch_dependent) */
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
    int smem, dependent = 0;
    function_handle *f = NULL;
    CUresult rc;
    if (!PyArg_ParseTuple(args, "Osi|p:module_function", &mod_capsule, &name, &smem, &dependent))
        return NULL;
    module_handle *m = handle_of(mod_capsule, MODULE_CAPSULE, "module_load");
    if (!m || nonnegative("module_function", "dynamic_smem", smem) || cuda_device_enter(m->device))
        return NULL;
    if (!(f = PyMem_Calloc(1, sizeof *f))) {
        PyErr_NoMemory();
        return NULL;
    }
    f->device = m->device;
    f->dependent = dependent;
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

int cuda_function_dependent(PyObject *capsule)
{
    function_handle *f = handle_of(capsule, FUNCTION_CAPSULE, "module_function");
    return f ? f->dependent : -1;
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
    if (PyDict_SetItemString(d, "dependent", f->dependent ? Py_True : Py_False))
        goto fail;
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

static PyMethodDef functions_methods[] = {
    {"module_load", c_module_load, METH_VARARGS,
     "module_load(cubin: bytes, device: int = 0, /) -> capsule: cuModuleLoadData in the "
     "device's primary context; unloaded when the capsule and every function from it are gone."},
    {"module_function", c_module_function, METH_VARARGS,
     "module_function(module, name: str, dynamic_smem: int, dependent: bool = False, /) -> "
     "capsule: the kernel `name` (extern \"C\"), keeping its module alive; above 48 KiB of "
     "dynamic shared memory its limit is raised to dynamic_smem. dependent: cuda_launch_attention "
     "launches it as a programmatic dependent of the kernel before it on the stream (CUDA 12's "
     "cuLaunchKernelEx, where the driver has it): it must begin with griddepcontrol.wait."},
    {"function_attributes", c_function_attributes, METH_O,
     "function_attributes(function, /) -> dict: num_regs, local_size_bytes (spills), "
     "shared_size_bytes (static), max_threads_per_block, max_dynamic_shared_size_bytes, "
     "binary_version, and dependent (module_function's flag)."},
    {"launch", c_launch, METH_VARARGS,
     "launch(function, grid: (x, y, z), block: (x, y, z), smem: int, stream: int, params: "
     "bytes, /) -> None: params are the bytes of the kernel's ONE by-value struct parameter "
     "(b\"\" for a kernel without parameters); their size is not checked."},
    {NULL, NULL, 0, NULL},
};

int cuda_functions_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, functions_methods);
}
