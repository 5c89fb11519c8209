"""Device arrays: the GPU memory attnext allocates (`DeviceArray`, `empty`), the views it reads
of other libraries' CUDA arrays (`as_device_view`), and results handed back in the caller's
library (`to_caller`). Pure Python over attnext._C's CUDA primitives.

Streams. A stream is an int, a CUstream handle: 0 (or 1) the legacy default stream, 2 the
per-thread default stream, else a handle (torch's `cuda_stream`, CuPy's `ptr`).

- Inputs are read on the stream their protocol names: a `__cuda_array_interface__` v3 "stream"
  (None there means the producer needs no synchronisation; v2 names none), else the legacy
  default stream, which is also what `as_device_view` asks a DLPack producer to make the data
  ready on. Given an explicit `stream`, the view is made ready on that stream instead (an event
  wait for the interface, the `stream=` argument for DLPack).
- Results are written on the call's stream and live in its order. `DeviceArray.stream` is that
  stream; its `__cuda_array_interface__` names it, and its `__dlpack__(stream=s)` makes s wait for
  it, as the DLPack protocol asks (torch.from_dlpack and cupy.from_dlpack pass their current
  stream).
- Memory from `empty` is stream-ordered: allocated on its stream (cuMemAllocAsync) and freed on
  it (cuMemFreeAsync) once the last reference goes, so work still queued on that stream is safe.
  Streams it was handed to through `__dlpack__` are waited for before the free (what PyTorch's
  record_stream does). A consumer of `__cuda_array_interface__` on another stream has no way to
  say so: keep the array alive until that work is done. Memory still held at interpreter exit
  is left to the driver, which frees everything with the process.
- Scratch, the memory a call needs only while its kernels run, is process.py's (borrow_scratch).
"""
import functools
import math
import sys
import weakref

import ml_dtypes
import numpy as np

from .. import _C, interop
from .devview import DevView, Shaped

KDL_CUDA = 2
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# DLPack type codes: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6 (bits, lanes 1)
_FROM_DLPACK = {(2, 16): np.float16, (2, 32): np.float32, (2, 64): np.float64, (4, 16): BFLOAT16,
                (0, 8): np.int8, (0, 16): np.int16, (0, 32): np.int32, (0, 64): np.int64,
                (1, 8): np.uint8, (1, 16): np.uint16, (1, 32): np.uint32, (1, 64): np.uint64,
                (6, 8): np.bool_}
_TO_DLPACK = {np.dtype(t): (code, bits, 1) for (code, bits), t in _FROM_DLPACK.items()}


def _legacy(stream):
    """One name for the legacy default stream: 0 and 1 are the same stream."""
    return 0 if stream in (None, 0, 1) else stream


@functools.lru_cache(maxsize=1024)
def _contiguous_strides(shape):
    """C-order strides (elements) of a shape (a tuple of ints): cached, every GPU call asks."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def is_contiguous(shape, strides):
    """Whether element strides lay out shape in C order (strides of size-1 dims do not matter)."""
    want = _contiguous_strides(tuple(shape))
    return tuple(strides) == want or all(n == 1 or s == c for n, s, c in zip(shape, strides, want))


class _Allocation:
    """Owns mem_alloc's memory; frees it on its stream after the streams it was handed to."""

    __slots__ = ("ptr", "streams", "__weakref__")

    def __init__(self, ptr, stream, device):
        self.ptr = ptr
        self.streams = set()      # consumer streams from __dlpack__, waited for before the free
        if ptr:
            weakref.finalize(self, _free, ptr, stream, device, self.streams).atexit = False


def _free(ptr, stream, device, streams):
    try:
        for s in streams:
            _C.stream_wait(stream, s, device)
        _C.mem_free(ptr, stream, device)
    except RuntimeError:
        # a finalizer cannot raise; a faulted context is reported by the next call that checks
        pass


class DeviceArray(Shaped):
    """An array in GPU memory: attnext's results when the caller's library cannot take a
    DLPack capsule. Exposes `__cuda_array_interface__` (v3) and `__dlpack__`, so CuPy, PyTorch,
    JAX and Numba read it in place; `numpy()` (or `np.asarray`) copies it to the host.

    ptr: device address of element [0, ..., 0]; strides in elements (None: C-contiguous);
    dtype: a NumPy dtype (bfloat16 is ml_dtypes.bfloat16); device: the CUDA ordinal; stream: the
    stream its contents were written on; owner: what keeps the memory alive.
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "stream", "owner", "__weakref__")

    def __init__(self, ptr, shape, dtype, device=0, strides=None, stream=0, owner=None):
        self.ptr = int(ptr)
        self.shape = tuple(map(int, shape))
        self.strides = _contiguous_strides(self.shape) if strides is None else tuple(map(int, strides))
        if len(self.strides) != len(self.shape):
            raise ValueError(f"DeviceArray: {len(self.strides)} strides for shape {self.shape}")
        self.dtype = np.dtype(dtype)
        self.device = int(device)
        self.stream = int(stream)
        self.owner = owner

    def is_contiguous(self):
        """C-contiguous (strides of size-1 dims do not matter)."""
        return is_contiguous(self.shape, self.strides)

    @property
    def __cuda_array_interface__(self):
        # bfloat16 has no typestr of its own: '<V2' is the one PyTorch and ml_dtypes share
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None if self.is_contiguous() else tuple(s * self.itemsize for s in self.strides),
            "version": 3,
            "stream": 1 if _legacy(self.stream) == 0 else self.stream,
        }

    def __dlpack_device__(self):
        return (KDL_CUDA, self.device)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule viewing this array (DLPack 1.0 when max_version allows it).

        stream: the consumer's stream, made to wait for this array's stream; None means the
        legacy default stream (as the protocol says), -1 no synchronisation."""
        if copy:
            raise BufferError("DeviceArray.__dlpack__: copy=True is not supported; the capsule "
                              "views the array in place")
        if dl_device is not None and tuple(dl_device) != (KDL_CUDA, self.device):
            raise BufferError(f"DeviceArray.__dlpack__: the array lives on {(KDL_CUDA, self.device)} "
                              f"(kDLCUDA, ordinal), not {tuple(dl_device)}")
        if self.dtype not in _TO_DLPACK:
            raise BufferError(f"DeviceArray.__dlpack__: dtype {self.dtype} has no DLPack code")
        if stream != -1:
            self._order_before(1 if stream is None else stream)
        versioned = max_version is not None and max_version[0] >= 1
        return _C.dlpack_export(self.ptr, self.shape, self.strides, _TO_DLPACK[self.dtype],
                                self.device, self, KDL_CUDA, versioned)

    def _order_before(self, stream):
        """Work enqueued on `stream` from now on sees this array's contents."""
        if _legacy(stream) == _legacy(self.stream):
            return
        _C.stream_wait(stream, self.stream, self.device)
        if isinstance(self.owner, _Allocation):
            self.owner.streams.add(stream)

    def numpy(self):
        """A host copy (NumPy array, C-contiguous), taken in the order of the array's stream."""
        out = np.empty(self.shape, self.dtype)
        if out.size == 0:
            return out
        view = DevView(self.ptr, self.shape, self.strides, self.dtype, self.device)
        lo, hi = view.byte_span()
        raw = np.empty(hi - lo, np.uint8)
        # into pageable memory the copy has finished when memcpy_dtoh returns
        _C.memcpy_dtoh(raw, lo, self.stream, self.device)
        out[...] = np.ndarray(self.shape, self.dtype, buffer=raw, offset=self.ptr - lo,
                              strides=tuple(s * self.itemsize for s in self.strides))
        return out

    def __array__(self, dtype=None, copy=None):
        if copy is False:
            raise ValueError("a DeviceArray lives in GPU memory: NumPy can only copy it")
        out = self.numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self):
        layout = "" if self.is_contiguous() else f", strides={self.strides}"
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}{layout}, device=cuda:{self.device})"


def empty(shape, dtype, device=0, stream=0):
    """An uninitialised C-contiguous DeviceArray, allocated and (when unreferenced) freed in the
    order of `stream`. MemoryError when the device is out of memory."""
    shape = tuple(map(int, shape))
    dtype = np.dtype(dtype)
    ptr = _C.mem_alloc(math.prod(shape) * dtype.itemsize, stream, device)
    return DeviceArray(ptr, shape, dtype, device, None, stream, _Allocation(ptr, stream, device))


PER_THREAD_STREAM = 2            # CU_STREAM_PER_THREAD: each thread's own default stream


def _cuda_array_interface(x):
    try:
        return x.__cuda_array_interface__
    except AttributeError:     # e.g. a CPU torch tensor: the property exists but refuses
        return None
    except RuntimeError as e:  # torch refuses a tensor that requires grad (and DLPack does too)
        raise TypeError(f"{type(x).__name__} refused to share its memory ({e}); pass a tensor that "
                        "does not require grad (.detach())") from None


_count = []


def _device_count():
    if not _count:
        _count.append(_C.cuda_device_count())
    return _count[0]


_TYPESTRS = {}     # __cuda_array_interface__ typestr -> NumPy dtype


def _dtype_of(typestr):
    dtype = _TYPESTRS.get(typestr)
    if dtype is None:
        dtype = BFLOAT16 if typestr[1:] == "V2" else np.dtype(typestr)
        _TYPESTRS[typestr] = dtype
    return dtype


def _from_interface(x, cai, stream):
    if cai.get("mask") is not None:
        raise ValueError(f"{type(x).__name__}: masked CUDA arrays (__cuda_array_interface__ "
                         "'mask') are not supported")
    typestr = cai["typestr"]
    dtype = _dtype_of(typestr)
    if dtype.byteorder == ">":
        raise TypeError(f"{type(x).__name__}: big-endian data ({typestr!r}) is not supported")
    shape = tuple(map(int, cai["shape"]))
    ptr, readonly = cai["data"]
    byte_strides = cai.get("strides")
    if byte_strides is None:
        strides = _contiguous_strides(shape)
    else:
        item = dtype.itemsize
        if any(s % item for s in byte_strides):
            raise ValueError(f"{type(x).__name__}: strides {tuple(byte_strides)} (bytes) are not "
                             f"multiples of the itemsize {item}")
        strides = tuple([int(s) // item for s in byte_strides])
    ptr = int(ptr)
    # the interface does not say which device: the driver knows (nothing is read when empty;
    # with one GPU there is nothing to ask)
    device = _C.pointer_device(ptr) if ptr and _device_count() > 1 else 0
    produced_on = cai.get("stream") if cai.get("version", 0) >= 3 else None
    if stream is None:
        stream = produced_on
    elif produced_on is not None and _legacy(produced_on) != _legacy(stream):
        _C.stream_wait(stream, produced_on, device)
    return DevView._made(ptr, shape, strides, dtype, device, int(_legacy(stream) or 0), x, bool(readonly))


def _from_dlpack(x, stream):
    # DLPack names the legacy default stream 1 (0 is disallowed for CUDA)
    consumer = 1 if _legacy(stream) == 0 else stream
    try:
        capsule = x.__dlpack__(stream=consumer, max_version=(1, 0))
    except TypeError:          # a producer older than DLPack 1.0
        capsule = x.__dlpack__(stream=consumer)
    owner, ptr, shape, strides, (code, bits, lanes), (_, device), readonly = _C.dlpack_import(capsule)
    if lanes != 1 or (code, bits) not in _FROM_DLPACK:
        raise TypeError(f"{type(x).__name__}: DLPack dtype (code {code}, bits {bits}, lanes {lanes}) "
                        "is not supported")
    return DevView(ptr, shape, strides, _FROM_DLPACK[code, bits], device, _legacy(stream), owner,
                   readonly)


class _Torch:
    """What _torch_view needs of torch, looked up once torch has been imported by the caller
    (attnext never imports it): the Tensor type, torch dtype -> NumPy dtype, torch.strided, and
    torch's test for a __torch_function__ override."""
    tensor = dtypes = strided = overridden = None


def plain_cuda_tensor(x):
    """Whether x is a plain CUDA torch.Tensor whose own accessors tell what its interface would
    (_torch_view; cuda/repeat.py's keys): not a subclass, a CPU, sparse or other non-strided
    tensor, a tensor that requires grad, or one under a __torch_function__ mode. False until the
    caller has imported torch."""
    if _Torch.tensor is None:
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "Tensor"):
            return False
        _Torch.dtypes = {getattr(torch, name): np.dtype(name) for name in (
            "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")}
        _Torch.dtypes[torch.bfloat16] = BFLOAT16
        _Torch.strided, _Torch.overridden = torch.strided, torch._C._has_torch_function_unary
        _Torch.tensor = torch.Tensor
    return (type(x) is _Torch.tensor and x.is_cuda and x.layout is _Torch.strided and not x.requires_grad
            and not _Torch.overridden(x))


def _torch_view(x, stream):
    """The DevView a plain CUDA torch.Tensor's `__cuda_array_interface__` (v2: no stream) gives,
    read through the tensor's own accessors: torch builds that dict in Python on every read, the
    largest item of a short GPU call's host time (bench/NOTES.md, decode B1). None where the
    interface must decide, with its own refusals: anything but a plain_cuda_tensor, a dtype
    outside the table."""
    if not plain_cuda_tensor(x):
        return None
    dtype = _Torch.dtypes.get(x.dtype)
    if dtype is None:
        return None
    shape = tuple(x.shape)
    strides = _contiguous_strides(shape) if x.is_contiguous() else x.stride()
    ptr = x.data_ptr() if x.numel() else 0
    return DevView._made(ptr, shape, strides, dtype, x.get_device(), int(_legacy(stream)), x, False)


def as_device_view(x, stream=None):
    """A DevView of x when x is a CUDA array (`__cuda_array_interface__` v2/v3, or `__dlpack__`
    on a kDLCUDA device), else None: the caller treats x as host data.

    The view keeps x's memory alive, has strides in elements, a NumPy dtype (bfloat16 is
    ml_dtypes.bfloat16: typestr '<V2', DLPack kDLBfloat), the device ordinal and a stream (see
    the module docstring). `stream`: the stream the caller will read x on; None takes the
    interface's own stream, else the legacy default stream.
    """
    view = _torch_view(x, stream)
    if view is not None:
        return view
    cai = _cuda_array_interface(x)
    if cai is not None:
        return _from_interface(x, cai, stream)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        if x.__dlpack_device__()[0] == KDL_CUDA:
            return _from_dlpack(x, stream)
    return None


def to_caller(devarr, like):
    """devarr in the library `like` came from: its `from_dlpack` (torch, CuPy, JAX:
    attnext.interop.from_dlpack) when it has one, a NumPy copy for NumPy, else devarr itself."""
    if interop.library(like) == "numpy":
        return devarr.numpy()
    from_dlpack = interop.from_dlpack(like)
    return devarr if from_dlpack is None else from_dlpack(devarr)


# The module's last statement: sys.modules holds this module from its first line on, while another
# thread's import may still be running it; repeat.key reads it only once LOADED is set.
LOADED = True
