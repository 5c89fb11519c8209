"""CUDA arrays captured by score_mod / mask_mod (attnext/mod_arrays.py), without a GPU.

- Tracing takes a CUDA array's shape and dtype from its protocol, never its memory (a null
  pointer traces), and gives the NumPy twin's structure and key.
- On the fake driver (tests/fake_libcuda.c: device memory is host memory, kernels do nothing;
  attn_convert.cu, attn_dtensors.cu and the attention kernels' writes are played by NumPy
  stand-ins here): an array already in its storage type is bound in place (its address and
  element strides in attn_mods_gpu; no host copy either way); another dtype is converted on the
  device at every call; a mask_mod reading one makes its block mask every call and keeps none;
  lookups indexed by its values can fail (the call reads the error record, and raises
  IndexError from it); its gradient comes back as a device array of its dtype; another device
  is a ValueError, a host call a TypeError, both naming the array.
- attn_convert.cu compiles for every target architecture and agrees with mod_arrays on its type
  codes and parameter layout. The GPU tests (test_mod_arrays_cuda.py) run it against NumPy.
"""
import os
import re

import ml_dtypes
import numpy as np
import pytest

from attnext import _C
from attnext.cuda import mod_inputs as mod_arrays, nvrtc, select
from attnext.mods import fingerprint, trace
from helpers.driver import run_on_fake


class NullCudaArray:
    """__cuda_array_interface__ v2 with a null pointer: nothing could be read through it."""

    def __init__(self, shape, typestr):
        self.shape, self.typestr = shape, typestr

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.typestr, "data": (0, False), "version": 2}


def test_tracing_takes_shape_and_dtype_from_the_protocol():
    table = NullCudaArray((4, 33), "<f4")
    host = np.zeros((4, 33), np.float32)

    def on_device(s, b, h, qi, ki):
        assert table.shape == (4, 33)
        return s + table[h, qi - ki + 16] * (table.shape[1] - 1)

    def on_host(s, b, h, qi, ki):
        return s + host[h, qi - ki + 16] * (host.shape[1] - 1)

    t = trace.trace_score_mod(on_device)
    assert t.arrays == {"table": table}
    assert t.key == trace.trace_score_mod(on_host).key
    assert fingerprint.captured_arrays(on_device) == {"table": table}
    ids = NullCudaArray((7,), "<i4")
    tm = trace.trace_mask_mod(lambda b, h, qi, ki: ids[qi] == ids[ki])
    assert [n.args[1:] for n in trace.topo(tm.out) if n.op == "array"] == [("int32", (7,))]
    bf16 = NullCudaArray((3,), "<V2")          # bfloat16 (torch and ml_dtypes share the typestr)
    ts = trace.trace_score_mod(lambda s, b, h, qi, ki: s * bf16[qi])
    assert ts.out.dtype == trace.F and ts.arrays["bf16"] is bf16
    assert trace.array_kind(np.dtype(ml_dtypes.bfloat16)) == trace.F


def test_tracing_names_an_array_its_library_refuses_to_share():
    class RequiresGrad:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")

    param = RequiresGrad()
    with pytest.raises(TypeError, match=r"captured array 'param': .*\.detach\(\)"):
        trace.trace_score_mod(lambda s, b, h, qi, ki: s + param[qi])


def test_convert_kernel_agrees_with_mod_arrays():
    source = (nvrtc.KERNEL_DIR / "attn_convert.cu").read_text()
    enum = re.search(r"enum \{ (T_BOOL[^}]*) \}", source).group(1).replace(" ", "").split(",")
    assert [enum[c] for c in mod_arrays.TYPE_CODES.values()] == enum
    names = {np.dtype(t): n for t, n in ((np.bool_, "T_BOOL"), (np.int8, "T_I8"), (np.int16, "T_I16"),
                                         (np.int32, "T_I32"), (np.int64, "T_I64"), (np.uint8, "T_U8"),
                                         (np.uint16, "T_U16"), (np.uint32, "T_U32"), (np.uint64, "T_U64"),
                                         (np.float16, "T_F16"), (ml_dtypes.bfloat16, "T_BF16"),
                                         (np.float32, "T_F32"), (np.float64, "T_F64"))}
    assert {dt: enum[c] for dt, c in mod_arrays.TYPE_CODES.items()} == names
    # uint64 src, dst; int64 shape[4], strides[4], n; int32 src_type, dst_type
    assert mod_arrays.CONVERT_PARAMS.itemsize == 2 * 8 + 2 * 4 * 8 + 8 + 2 * 4
    assert f"#define CONVERT_DIMS {mod_arrays.CONVERT_DIMS}" in source


@pytest.mark.parametrize("arch", select.ARCHS)
def test_convert_kernel_compiles(arch):
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    nvrtc.nvrtc()
    cubin, _ = _C.nvrtc_compile(*nvrtc.compile_args("attn_convert", {}, arch))     # no cache
    assert cubin


BODY = r"""
import ctypes
from attnext.cuda import mod_cache, mod_inputs as mod_arrays, staging
from attnext.mods import codegen, trace

S = 256         # a multiple of select.TILE_EDGE: the lookups over it are proved
rng = np.random.default_rng(0)
GMODS = []          # (entry point, attn_mods_gpu record) of every launch with mods
CONVERTS = []       # attn_convert's parameters, every launch
COPIES = []         # (direction, bytes) of every host <-> device copy
READS = []          # what array 0 held for each launch with mods, when WATCH names its dtype
STATE = {"watch": None, "error": None, "grad": None}
_plain = _launch
_kernel = _C.launch
_htod, _dtoh = _C.memcpy_htod, _C.memcpy_dtoh
CODES = {code: dt for dt, code in mod_arrays.TYPE_CODES.items()}


def at(ptr, shape, strides, dtype):
    # a NumPy view of fake device memory (host memory): element [0, ...] at ptr, element strides
    dtype, shape, strides = np.dtype(dtype), tuple(int(n) for n in shape), tuple(int(s) for s in strides)
    lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0) if all(shape) else 0
    hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) if all(shape) else 0
    buf = (ctypes.c_char * ((hi - lo + 1) * dtype.itemsize)).from_address(int(ptr) + lo * dtype.itemsize)
    return np.ndarray(shape, dtype, buffer=buf, offset=-lo * dtype.itemsize,
                      strides=tuple(s * dtype.itemsize for s in strides))


def fake_memory(values):
    # values copied into fake device memory, as the NumPy array over it
    values = np.asarray(values)
    mem = device.empty((max(values.nbytes, 1),), np.uint8, 0, 0)
    KEEP.append(mem)
    a = at(mem.ptr, values.shape, device._contiguous_strides(values.shape), values.dtype)
    a[...] = values
    return a


class CudaArray:
    # the least a CUDA array is: __cuda_array_interface__ (v3) over fake device memory
    def __init__(self, host):
        self.host = host

    @property
    def __cuda_array_interface__(self):
        h = self.host
        return {"shape": h.shape, "typestr": h.dtype.str, "data": (h.ctypes.data, False),
                "strides": None if h.flags.c_contiguous else h.strides, "version": 3, "stream": None}


def launch(fn, *args):
    _plain(fn, *args)
    if len(args) <= 8:
        return
    rec = np.frombuffer(args[-1], codegen.MODS_DTYPE, count=1)[0].copy()
    GMODS.append((FN[id(fn)][1], rec))
    if STATE["watch"] is not None:
        a = rec["a"][0]
        nd = int(STATE["watch"][1])
        READS.append(at(a["ptr"], a["shape"][:nd], a["s"][:nd], STATE["watch"][0]).copy())
    if STATE["error"] is not None and rec["err"]:          # a lookup out of range, as the kernels note it
        at(rec["err"], (5,), (1,), np.int64)[...] = STATE["error"]
    if STATE["grad"] is not None and rec["dacc"]:           # the adjoints the kernels would scatter
        element, value = STATE["grad"]
        words = at(rec["dacc"], (element + 1, codegen.WORDS), (codegen.WORDS, 1), np.uint64)
        words[element, :] = 0
        words[element, 6] = int(value * 2 ** 5)         # limb 6 weighs 2^(6 * 24 - 149) = 2^-5


def kernel(fn, grid, block, smem, stream, params):
    fake_cuda.counter(lib, "record").value = 0          # these parameters are no attn_params
    _kernel(fn, grid, block, smem, stream, params)
    fake_cuda.counter(lib, "record").value = 1
    name = FN[id(fn)][1]
    if name == "attn_convert":                          # NumPy's rule, which attn_convert.cu follows
        p = np.frombuffer(params, mod_arrays.CONVERT_PARAMS)[0].copy()
        CONVERTS.append(p)
        src = at(p["src"], p["shape"], p["strides"], CODES[int(p["src_type"])])
        at(p["dst"], (int(p["n"]),), (1,), CODES[int(p["dst_type"])])[...] = src.reshape(-1)
    elif name == "attn_dtensors":                       # codegen.limbs_to_float, attn_dtensors.cu's rule
        dacc, out, n = (int(x) for x in np.frombuffer(params, np.uint64))
        words = at(dacc, (n, codegen.WORDS), (codegen.WORDS, 1), np.uint64)
        at(out, (n,), (1,), np.float64)[...] = codegen.limbs_to_float(words)


_C.cuda_launch_attention = launch
_C.launch = kernel
_C.memcpy_htod = lambda dst, src, *a: (COPIES.append(("htod", src.nbytes)), _htod(dst, src, *a))[1]
_C.memcpy_dtoh = lambda dst, src, *a: (COPIES.append(("dtoh", dst.nbytes)), _dtoh(dst, src, *a))[1]
q, k, v = qkv(1, S, S, 2, 2, 64)
out, lse = dev((1, S, 2, 64)), dev((1, 2, S), np.float32)

# --- float32, read in place: its address and element strides, no copy either way ---------------
base = fake_memory(rng.standard_normal((2 * S + 1, 2)).astype(np.float32))
table = CudaArray(base.T)                              # (2, 2S + 1), element strides (1, 2)


def relbias(s, b, h, qi, ki):
    return s + table[h, qi - ki + S]


del COPIES[:]
attnext.attention(q, k, v, score_mod=relbias)
name, rec = GMODS[-1]
a = rec["a"][0]
assert int(a["ptr"]) == base.ctypes.data, (hex(int(a["ptr"])), hex(base.ctypes.data))
assert tuple(a["shape"][:2]) == (2, 2 * S + 1) and tuple(a["s"][:2]) == (1, 2), a
assert COPIES == [] and CONVERTS == [], (COPIES, CONVERTS)   # the lookups cannot fail: no wait either

# --- a mask_mod reading an int64 array: in place, its block mask made at every call, none kept ---
doc = fake_memory(np.repeat(np.arange(4), S // 4).astype(np.int64))
ids = CudaArray(doc)


def doc_mask(b, h, qi, ki):
    return ids[qi] == ids[ki]


kept = mod_cache.info()["block_masks"]["entries"]
for call in range(3):
    n = len(GMODS)
    if call < 2:
        attnext.attention(q, k, v, mask_mod=doc_mask)
    else:
        attnext.attention_backward(out, q, k, v, out, lse, mask_mod=doc_mask)
    made = [g[0] for g in GMODS[n:]]
    assert made.count("attn_block_mask") == 1, made
    assert int(GMODS[-1][1]["a"][0]["ptr"]) == doc.ctypes.data
assert mod_cache.info()["block_masks"]["entries"] == kept
assert COPIES == [] and CONVERTS == [], (COPIES, CONVERTS)

# --- int32 ids: read in place as int32; int16 ids converted to int32 on the device at every call,
# so the call sees the values of now ---
doc32 = fake_memory(np.repeat(np.arange(4), S // 4).astype(np.int32))
ids32 = CudaArray(doc32)
del CONVERTS[:]
attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: ids32[qi] == ids32[ki])
assert CONVERTS == [] and int(GMODS[-1][1]["a"][0]["ptr"]) == doc32.ctypes.data
doc16 = fake_memory(np.repeat(np.arange(4), S // 4).astype(np.int16))
ids16 = CudaArray(doc16)
STATE["watch"] = (np.int32, 1)
for call in range(2):
    del CONVERTS[:], READS[:]
    attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: ids16[qi] == ids16[ki])
    (p,) = CONVERTS
    assert int(p["src"]) == doc16.ctypes.data and tuple(p["shape"]) == (1, 1, 1, S), p
    assert CODES[int(p["src_type"])] == np.int16 and CODES[int(p["dst_type"])] == np.int32, p
    a = GMODS[-1][1]["a"][0]
    assert int(a["ptr"]) == int(p["dst"]) and a["s"][0] == 1, (a, p)
    assert READS and all(np.array_equal(r, doc16) for r in READS), (READS, doc16)
    doc16[: S // 2] = 7                                 # changed in place: the next call converts it again
STATE["watch"] = None
# a reversed int64 array is read in place too (element [0] at its end, stride -1); a misaligned
# one is copied as it is, and the copy is converted from its own address and strides
rev = CudaArray(doc[::-1])
del CONVERTS[:]
attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: rev[qi] == rev[ki])
a = GMODS[-1][1]["a"][0]
assert CONVERTS == [] and int(a["ptr"]) == doc.ctypes.data + (S - 1) * 8 and a["s"][0] == -1, a
odd = fake_memory(np.zeros(8 * S + 8, np.uint8))
odd_view = odd[4:4 + 8 * S].view(np.int64)[::-1]            # 4 bytes past an 8-byte boundary
odd_view[...] = doc
skew = CudaArray(odd_view)
attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: skew[qi] == skew[ki])
(p,) = CONVERTS
assert int(p["src"]) == odd_view.ctypes.data and p["strides"][3] == -1 and p["src_type"] == p["dst_type"], p
assert int(GMODS[-1][1]["a"][0]["ptr"]) == int(p["dst"]) and GMODS[-1][1]["a"][0]["s"][0] == 1

# --- lookups indexed by a CUDA array's values can fail: the call reads the error record ---------
reads = []
_download = staging.Staging.download
staging.Staging.download = lambda self, view, dst: (reads.append(dst.shape), _download(self, view, dst))[1]
order = CudaArray(fake_memory(np.arange(S, dtype=np.int64)))
weights = CudaArray(fake_memory(np.ones(S, np.float32)))


def reorder(s, b, h, qi, ki):
    return s + weights[order[qi]]


attnext.attention(q, k, v, score_mod=reorder)
assert reads == [(5,)], reads
order_host = np.arange(S)                              # on the host its values are known: no wait
del reads[:]
attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + weights[order_host[qi]])
assert reads == [], reads
names = codegen.call_arrays(trace.trace_score_mod(reorder))
STATE["error"] = [1, names.index(("score_mod", "weights")), 0, S + 5, S]
try:
    attnext.attention(q, k, v, score_mod=reorder)
    raise SystemExit("no IndexError")
except IndexError as e:
    assert str(e) == (f"score_mod: index {S + 5} is out of bounds for axis 0 of array 'weights' "
                      f"with size {S}"), e
STATE["error"] = None

# --- gradients: on the device, in the array's dtype; the same values as a NumPy table's ---------
STATE["grad"] = (5, 1.5)
want = np.zeros((2, 2 * S + 1))
want.flat[5] = 1.5
tab = fake_memory(rng.standard_normal((2, 2 * S + 1)).astype(np.float32))
T = CudaArray(tab)
host_tab = np.array(tab)


def rb(s, b, h, qi, ki):
    return s + T[h, qi - ki + S]


def rb_host(s, b, h, qi, ki):
    return s + host_tab[h, qi - ki + S]


del COPIES[:], CONVERTS[:]
n = len(GMODS)
g = attnext.attention_backward(out, q, k, v, out, lse, score_mod=rb)
assert COPIES == [], COPIES                            # nothing downloaded: the backward need not wait
assert all(int(r["a"][0]["ptr"]) == tab.ctypes.data for _, r in GMODS[n:])
d = g.dtensors["T"]
assert isinstance(d, device.DeviceArray) and d.shape == tab.shape and d.dtype == np.float32, d
assert [CODES[int(p["src_type"])] for p in CONVERTS] == [np.float64], CONVERTS
assert np.array_equal(d.numpy(), want), d.numpy()
gh = attnext.attention_backward(out, q, k, v, out, lse, score_mod=rb_host)
assert isinstance(gh.dtensors["host_tab"], np.ndarray)
assert np.array_equal(gh.dtensors["host_tab"], d.numpy())
# bfloat16, and a transposed float32 table: read through float32 copies, gradients in their dtypes
bf = CudaArray(fake_memory(tab.astype(ml_dtypes.bfloat16)))
tt = CudaArray(fake_memory(np.ascontiguousarray(tab.T)).T)
for arr, dt in ((bf, ml_dtypes.bfloat16), (tt, np.float32)):
    del CONVERTS[:]
    attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + arr[h, qi - ki + S])
    assert len(CONVERTS) == (dt != np.float32), CONVERTS        # the transposed one is read in place
    del CONVERTS[:]
    g = attnext.attention_backward(out, q, k, v, out, lse,
                                   score_mod=lambda s, b, h, qi, ki: s + arr[h, qi - ki + S])
    d = g.dtensors["arr"]
    assert d.dtype == dt and d.shape == (2, 2 * S + 1), d
    assert [(CODES[int(p["src_type"])], CODES[int(p["dst_type"])]) for p in CONVERTS] == [
        (np.dtype(dt), np.float32), (np.float64, np.dtype(dt))], CONVERTS
    assert np.array_equal(d.numpy().astype(np.float64), want), d.numpy()
STATE["grad"] = None

# --- another device than q, k, v: ValueError naming the array ----------------------------------
far = fake_memory(np.ones(S, np.float32))
far_arr = CudaArray(far)
count, pointer_device = device._count[:], _C.pointer_device
device._count[:] = [2]
_C.pointer_device = lambda ptr: 1 if ptr == far.ctypes.data else 0
try:
    attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + far_arr[ki])
    raise SystemExit("no ValueError")
except ValueError as e:
    assert str(e) == ("score_mod: captured array 'far_arr' lives on cuda:1, but q, k and v on cuda:0; "
                      "move it to cuda:0"), e
device._count[:], _C.pointer_device = count, pointer_device

# --- a host call cannot read it: TypeError naming it -------------------------------------------
hq = np.zeros((1, 8, 2, 16), np.float32)
for where in ("cpu", "reference"):
    try:
        attnext.attention(hq, hq, hq, score_mod=relbias, device=where)
        raise SystemExit("no TypeError")
    except TypeError as e:
        assert "score_mod captures 'table', a CUDA array (CudaArray)" in str(e), e
try:
    attnext.attention_backward(hq, hq, hq, hq, hq, np.zeros((1, 2, 8), np.float32), mask_mod=doc_mask)
    raise SystemExit("no TypeError")
except TypeError as e:
    assert "mask_mod captures 'ids'" in str(e), e
print("ok")
"""


def test_captured_cuda_arrays_on_the_fake_driver(fake_driver):
    run_on_fake(fake_driver, BODY)
