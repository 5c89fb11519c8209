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
#ifndef ATTNEXT_CUDA_HOST_H
#define ATTNEXT_CUDA_HOST_H

#include "driver.h"

#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MODULE_CAPSULE "attnext.cu_module"
#define FUNCTION_CAPSULE "attnext.cu_function"

/* Argument converters (PyArg "O&"): a device pointer, a stream handle. */
int as_ptr(PyObject *o, void *out);
int as_stream(PyObject *o, void *out);
/* ValueError "fn: name must be >= 0, got v" and -1 when v < 0, else 0. */
int nonnegative(const char *fn, const char *name, Py_ssize_t v);
/* Makes `device` current and returns the caller's context in *prev, for leave(). */
int enter_keeping(int device, CUcontext *prev);
void leave(CUcontext prev);

/* Each file's functions (and types) added to the module (host.c's attnext_cuda_exec calls them). */
int cuda_device_exec(PyObject *module);
int cuda_nvrtc_exec(PyObject *module);
int cuda_functions_exec(PyObject *module);
int cuda_memory_exec(PyObject *module);
int cuda_pinned_exec(PyObject *module);
int cuda_dlpack_exec(PyObject *module);

#endif
