/* The helpers every file of csrc/cuda/ shares, and attnext_cuda_exec, which adds each file's
 * functions to attnext._C (the conventions: host.h). */
#include "host.h"

int as_ptr(PyObject *o, void *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(CUdeviceptr *)out = v;
    return 1;
}

int as_stream(PyObject *o, void *out)
{
    CUdeviceptr v;
    if (!as_ptr(o, &v))
        return 0;
    *(CUstream *)out = (CUstream)(uintptr_t)v;
    return 1;
}

int nonnegative(const char *fn, const char *name, Py_ssize_t v)
{
    if (v >= 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: %s must be >= 0, got %zd", fn, name, v);
    return -1;
}

/* Makes `device` current and returns the caller's context in *prev, for leave(). */
int enter_keeping(int device, CUcontext *prev)
{
    if (cuda_driver_require())
        return -1;
    CU_CHECK(cuCtxGetCurrent, prev);
    return cuda_device_enter(device);
fail:
    return -1;
}

void leave(CUcontext prev)
{
    CU.cuCtxSetCurrent(prev);
}

int attnext_cuda_exec(PyObject *module)
{
    return cuda_device_exec(module) || cuda_nvrtc_exec(module) || cuda_functions_exec(module)
           || cuda_memory_exec(module) || cuda_pinned_exec(module) || cuda_dlpack_exec(module) ? -1 : 0;
}
