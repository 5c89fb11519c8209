"""The arrays a GPU call's score_mod / mask_mod capture, as the kernels read them, and the array
gradients its backward hands back. Captured arrays are read afresh at every call (docs/design.md):
the caller may change one in place between calls.

Host arrays -- NumPy arrays, and other libraries' arrays in host memory (a torch CPU tensor, a
JAX CPU array), read as NumPy's view of their memory (attnext.interop) -- are uploaded in the
kernels' storage types (codegen.storage_dtype: float32, one byte per bool, int32 for integers
whose values fit, else int64) through mod_cache, which keeps them on the device and finds them
again by their bits, knows an integer array's (min, max) for attnext.bounds, and keeps the block
masks made from them.

CUDA arrays (any library's: `__cuda_array_interface__` or `__dlpack__`; tracing found them,
trace.py) are taken afresh at every call by attnext.cuda.arrays.as_device_view on the call's stream,
which orders the call after the producer's stream where the protocol names one. Never read on
the host:

- In place -- the device address and element strides go into attn_mods_gpu, and nothing is
  copied -- when the dtype is a storage type of the values (float32, int32 or int64, bool) and the
  address is aligned to the element (the lookups are element loads), whatever the strides
  (transposed, reversed, broadcast), except for a float array whose gradient a backward
  accumulates: that one must be C-contiguous (the accumulator is indexed by element offset).
- Otherwise converted on the device, at every call, into a contiguous copy in the call's memory
  (kernels/attn_convert.cu, NumPy's astype rules: float16 / bfloat16 / float64 to float32,
  integers of at most 16 bits to int32, wider ones to int64; a misaligned one, or a strided
  gradient's, copied as it is). Chosen over a copy through the host because it needs no
  synchronisation: the call stays asynchronous, and the copy is one small kernel on the call's
  stream (a 16k-token int16 id array: 64 KiB written). A copy kept between calls could not tell
  whether its source changed without reading it.
- On another device than the call's (q, k and v's; cuda:0 for host q, k, v): ValueError naming
  it.
- Its values are unknown to the host: attnext.bounds takes an integer CUDA array's values as
  unknown, so a lookup indexed by them is checked on the device and the call waits for the
  error record (IndexError after the launches, as for any lookup that can fail); a mask_mod
  reading one gets its block mask made again at every call, never kept (mod_cache keys a kept
  mask by contents it has seen).

Gradients. The backward sums each float array's gradient into float64 on the device
(kernels/attn_dtensors.cu). A host array's comes back on the host in its dtype and library (a
NumPy array for a NumPy array, a torch CPU tensor for one: interop.to_library). A CUDA
array's stays on the device: attn_convert.cu rounds the sums to the array's dtype into new
memory (NumPy's astype rule, so the same bits as when the same values are captured as a NumPy
array), handed back as the array's own library's array through DLPack (torch.Tensor for a torch
tensor, cupy.ndarray for CuPy), else as an attnext.DeviceArray: as dq, dk, dv come back for CUDA
inputs. Nothing is downloaded, so a backward whose lookups cannot fail does not wait for its
kernels.

Every call that runs on the GPU reads them so, whether q, k and v are CUDA or host arrays. The
CPU backend and the reference refuse a CUDA array: checks.py raises TypeError naming it for a
call on them whose score_mod / mask_mod captures one. attnext never copies a CUDA input to the
host behind the caller's back (a CUDA bias, mask or dout beside host q, k, v on the CPU is
refused alike), and a host copy made by the caller (`table.cpu().numpy()`) is made once, not at
every call.
"""
from typing import NamedTuple

import numpy as np

from .. import _C, interop
from ..mods import codegen
from ..mods.trace import B, F, I
from . import arrays as device, mod_cache, nvrtc
from .devview import DevView

# the dtypes the kernels read a captured array of each value type in (codegen.storage_dtype): a
# CUDA array of one of them can be read in place
READABLE = {F: {codegen.STORAGE[F]}, I: {codegen.STORAGE[I], codegen.NARROW}, B: {codegen.STORAGE[B]}}
# attn_convert.cu's type codes, in its enum's order
TYPE_CODES = {np.dtype(t): code for code, t in enumerate(
    (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
     np.float16, device.BFLOAT16, np.float32, np.float64))}
DESTINATIONS = frozenset().union(*READABLE.values()) | {np.dtype(t) for t in (np.float16, device.BFLOAT16, np.float64)}
CONVERT_DIMS = 4           # attn_convert.cu's CONVERT_DIMS (codegen.MAX_DIMS)
CONVERT_THREADS = 256
CONVERT_PARAMS = np.dtype([("src", "u8"), ("dst", "u8"), ("shape", "i8", CONVERT_DIMS),
                           ("strides", "i8", CONVERT_DIMS), ("n", "i8"), ("src_type", "i4"),
                           ("dst_type", "i4")])


class Bound(NamedTuple):
    """One captured array as a call binds it. ref: (address, shape, element strides) for
    codegen.pack; shape, dtype, size: the captured array's; stored: the dtype the kernels read
    (codegen.storage_dtype); source: the captured object;
    serial: mod_cache's name for a host array's contents, None for a CUDA array (contents not
    seen); values: (min, max) of a host integer array, else None; in_place: a CUDA array read
    where it is; keep: what holds the memory the kernels read."""
    ref: tuple
    shape: tuple
    dtype: np.dtype
    size: int
    stored: np.dtype
    source: object
    serial: object
    values: object
    in_place: bool
    keep: object


def bind(kind, name, source, vt, stage, arch, grad=False):
    """The Bound of captured array `name` of `kind` ("score_mod" / "mask_mod"), value type vt
    (trace.F / I / B), for a call on stage's device and stream; grad: a backward accumulates
    its gradient. See the module docstring."""
    host = interop.host_view(name, source)
    if host is not None:
        e = mod_cache.array_copy(host, lambda h: codegen.storage(h, vt, narrow=True), stage.device, stage.stream)
        a = e.dev
        return Bound(_ref(a), host.shape, host.dtype, host.size, a.dtype, source, e.serial, e.values, False, a)
    view = _view(kind, name, source, stage)
    if not _in_place(view, vt, grad):
        copy = stage.scratch(view.shape, codegen.storage_dtype(vt, dtype=view.dtype))
        convert(view, copy, stage, arch)
        return Bound(_ref(copy), view.shape, view.dtype, view.size, copy.dtype, source, None, None, False, copy)
    return Bound(_ref(view), view.shape, view.dtype, view.size, view.dtype, source, None, None, True, view)


def _ref(a):
    return (a.ptr if a.size else 0, a.shape, a.strides)     # codegen.pack points an empty one elsewhere


def _view(kind, name, source, stage):
    """A DevView of a captured CUDA array, ready on the call's stream, on the call's device."""
    try:
        view = device.as_device_view(source, stage.stream)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{kind}: captured array {name!r}: {e}") from None
    if view is None:
        raise TypeError(f"{kind}: captured array {name!r} ({type(source).__name__}) no longer "
                        "exposes CUDA memory")
    if view.device != stage.device:
        raise ValueError(f"{kind}: captured array {name!r} lives on cuda:{view.device}, but the call "
                         f"runs on cuda:{stage.device}; move it to cuda:{stage.device}")
    return view


def _in_place(view, vt, grad):
    return (view.dtype in READABLE[vt] and view.ptr % view.itemsize == 0
            and not (grad and not device.is_contiguous(view.shape, view.strides)))


def convert(src, dst, stage, arch):
    """Launches kernels/attn_convert.cu on the call's stream: dst (a C-contiguous DevView of
    src's size) receives src's elements in C order, in dst's dtype (NumPy's astype rules)."""
    if src.size != dst.size:
        raise ValueError(f"convert: {src.size} elements into {dst.size}")
    if src.size == 0:
        return
    nd = len(src.shape)
    if nd > CONVERT_DIMS:
        raise TypeError(f"convert: {nd} dims; at most {CONVERT_DIMS}")
    floats = {t.kind == "f" or t == device.BFLOAT16 for t in (src.dtype, dst.dtype)}
    if len(floats) != 1 or src.dtype not in TYPE_CODES or dst.dtype not in DESTINATIONS:
        raise TypeError(f"convert: no rule from {src.dtype} to {dst.dtype}")
    p = np.zeros((), CONVERT_PARAMS)
    p["src"], p["dst"], p["n"] = src.ptr, dst.ptr, src.size
    p["shape"] = (1,) * (CONVERT_DIMS - nd) + tuple(src.shape)
    p["strides"] = (0,) * (CONVERT_DIMS - nd) + tuple(src.strides)
    p["src_type"], p["dst_type"] = TYPE_CODES[src.dtype], TYPE_CODES[dst.dtype]
    fn = nvrtc.function("attn_convert", "attn_convert", {}, stage.device, arch, 0)
    _C.launch(fn, (-(-src.size // CONVERT_THREADS), 1, 1), (CONVERT_THREADS, 1, 1), 0, stage.stream,
              p.tobytes())


def gradients(arrays, sums, offsets, stage, arch):
    """{name: gradient} for arrays [(number, name, Bound)], the float arrays a backward's
    score_mod reads: sums (a DevView of float64, or None: no gradient term at all) holds array
    number i's from element offsets[i] (absent: zeros). NumPy arrays' come back as NumPy
    arrays, CUDA arrays' on the device as the array's library's arrays (module docstring); both
    in the array's dtype and shape."""
    out, host = {}, None
    for i, name, a in arrays:
        off = offsets.get(i) if sums is not None else None
        if a.serial is not None:            # a host array: its gradient on the host, in its library
            if off is None:
                g = np.zeros(a.shape)
            else:
                if host is None:
                    host = np.zeros(sums.shape[0], np.float64)
                    stage.download(sums, host)
                g = host[off:off + a.size].reshape(a.shape)
            out[name] = interop.to_library(g.astype(a.dtype), a.source)
            continue
        g = device.empty(a.shape, a.dtype, stage.device, stage.stream)
        if off is None:
            if g.nbytes:
                _C.memset_d8(g.ptr, 0, g.nbytes, stage.stream, stage.device)
        else:
            part = DevView.contiguous(sums.ptr + off * sums.itemsize, (a.size,), sums.dtype, stage.device)
            convert(part, DevView.contiguous(g.ptr, (a.size,), a.dtype, stage.device), stage, arch)
        out[name] = device.to_caller(g, a.source)
    return out
