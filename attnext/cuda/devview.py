"""DevView: a strided view of GPU memory that api.py's checks can read like a NumPy array.

It carries what the checks look at (shape, dtype, ndim, strides) and what a kernel needs (the
device address of element [0, ..., 0] and element strides), and supports the few reshapes the
checks make: transpose, a leading new axis, leading ones, broadcast_to. It never reads or
writes device memory itself. `may_be_device_array` is the cheap test api.py (arguments) and
trace.py (captured arrays) make before asking attnext.cuda.arrays.as_device_view for a view.
"""
import math

import numpy as np


def _has(x, name):
    """hasattr without evaluating a property (torch builds its __cuda_array_interface__ dict on
    every read: this runs on every GPU call's hot path)."""
    return hasattr(type(x), name) or name in getattr(x, "__dict__", ())


def may_be_device_array(x):
    """Whether x may be another library's CUDA array: not a NumPy array nor a class (an array
    type such as torch.Tensor names both protocols too), and __cuda_array_interface__ or
    __dlpack__ on its type or instance. Only attnext.cuda.arrays.as_device_view tells (a CPU torch
    tensor has both names)."""
    return not isinstance(x, (np.ndarray, type)) and (_has(x, "__cuda_array_interface__") or _has(x, "__dlpack__"))


class Shaped:
    """ndim, size, itemsize and nbytes from a class's shape and dtype, as NumPy names them:
    DevView's and attnext.cuda.arrays.DeviceArray's."""
    __slots__ = ()

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def nbytes(self):
        return self.size * self.itemsize


class DevView(Shaped):
    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "stream", "keep", "readonly", "_span")

    def __init__(self, ptr, shape, strides, dtype, device, stream=0, keep=None, readonly=False):
        self.ptr = int(ptr)
        self.shape = tuple(map(int, shape))
        self.strides = tuple(map(int, strides))           # in elements
        self.dtype = np.dtype(dtype)
        self.device = int(device)
        self.stream = int(stream or 0)
        self.keep = keep                                   # what keeps the memory alive
        self.readonly = readonly
        self._span = None                                  # byte_span(), once asked

    @classmethod
    def _made(cls, ptr, shape, strides, dtype, device, stream, keep, readonly):
        """A view of values __init__ would leave as they are (ints, tuples of ints, a NumPy
        dtype): the hot path's constructor (every GPU call makes several views)."""
        view = cls.__new__(cls)
        view.ptr, view.shape, view.strides, view.dtype = ptr, shape, strides, dtype
        view.device, view.stream, view.keep, view.readonly, view._span = device, stream, keep, readonly, None
        return view

    @classmethod
    def contiguous(cls, ptr, shape, dtype, device, stream=0, keep=None):
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= max(int(n), 1)
        return cls(ptr, shape, tuple(reversed(strides)), dtype, device, stream, keep)

    def _like(self, ptr, shape, strides):
        return DevView._made(ptr, tuple(shape), tuple(strides), self.dtype, self.device, self.stream,
                             self.keep, self.readonly)

    def transpose(self, *axes):
        shape, strides = self.shape, self.strides
        return self._like(self.ptr, [shape[a] for a in axes], [strides[a] for a in axes])

    def __getitem__(self, key):
        if key is None:
            return self._like(self.ptr, (1,) + self.shape, (0,) + self.strides)
        raise TypeError("DevView supports only [None]")

    def reshape(self, shape):
        """Adds or drops leading dims of size 1 (all api.py asks of it)."""
        shape = tuple(map(int, shape))
        core = self.shape
        while core and core[0] == 1 and len(core) > len(shape):
            core = core[1:]
        lead = len(shape) - len(core)
        if lead < 0 or shape[lead:] != core or any(n != 1 for n in shape[:lead]):
            raise ValueError(f"DevView cannot reshape {self.shape} to {shape}")
        return self._like(self.ptr, shape, (0,) * lead + self.strides[len(self.shape) - len(core):])

    def broadcast_to(self, shape):
        shape = tuple(map(int, shape))
        if len(shape) != self.ndim:
            raise ValueError(f"DevView cannot broadcast {self.shape} to {shape}")
        strides = []
        for n, m, s in zip(self.shape, shape, self.strides):
            if n != m and n != 1:
                raise ValueError(f"DevView cannot broadcast {self.shape} to {shape}")
            strides.append(s if n == m else 0)
        return self._like(self.ptr, shape, strides)

    def byte_span(self):
        """[lo, hi) bytes of device memory the view can touch (empty for a zero-size view)."""
        if self._span is None:
            if 0 in self.shape:
                self._span = self.ptr, self.ptr
            else:
                item = self.dtype.itemsize
                lo = hi = self.ptr
                for n, s in zip(self.shape, self.strides):
                    off = (n - 1) * s * item
                    if off < 0:
                        lo += off
                    else:
                        hi += off
                self._span = lo, hi + item
        return self._span

    def overlaps(self, other):
        a0, a1 = self.byte_span()
        b0, b1 = other.byte_span()
        return self.device == other.device and a0 < b1 and b0 < a1

    def as_tuple(self):
        """What csrc/cuda/attention.c reads: (ptr, shape, strides in elements)."""
        return (self.ptr, self.shape, self.strides)

    def __repr__(self):
        return (f"DevView(shape={self.shape}, dtype={self.dtype}, strides={self.strides}, "
                f"device=cuda:{self.device})")
