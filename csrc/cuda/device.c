/* Loading libcuda and the devices' properties. (Conventions: host.h.) */
#include "host.h"

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

static PyObject *c_cuda_driver_version(PyObject *module, PyObject *unused)
{
    int version;
    if (cuda_driver_require())
        return NULL;
    CU_CHECK(cuDriverGetVersion, &version);
    return Py_BuildValue("(ii)", version / 1000, version % 1000 / 10);
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

static PyMethodDef device_methods[] = {
    {"cuda_load", c_cuda_load, METH_NOARGS,
     "cuda_load() -> None: load libcuda (ATTNEXT_LIBCUDA overrides the soname) and cuInit; "
     "RuntimeError with the reason when CUDA is unusable. The outcome is remembered."},
    {"cuda_device_count", c_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int: number of CUDA devices (RuntimeError without a driver)."},
    {"cuda_driver_version", c_cuda_driver_version, METH_NOARGS,
     "cuda_driver_version() -> (major, minor): the newest CUDA the driver supports "
     "(RuntimeError without a driver)."},
    {"cuda_info", c_cuda_info, METH_VARARGS,
     "cuda_info(device=0, /) -> dict: name, compute_capability (major, minor), "
     "multiprocessor_count, max_shared_memory_per_block_optin, l2_cache_size, total_memory "
     "(bytes), driver_version (major, minor), memory_pools (bool), read_only_host_register "
     "(bool: host_register's read_only is supported). Creates no context."},
    {NULL, NULL, 0, NULL},
};

int cuda_device_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, device_methods);
}
