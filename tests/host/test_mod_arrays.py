"""CUDA arrays captured by score_mod / mask_mod (attnext/cuda/mod_inputs.py): without a GPU on the
fake driver, and with `-m gpu` on torch CUDA tensors and CuPy arrays.

Without a GPU:
- Tracing takes a CUDA array's shape and dtype from its protocol, never its memory (a null
  pointer traces), and gives the NumPy twin's structure and key.
- On the fake driver (tests/helpers/fake_libcuda.c: device memory is host memory, kernels do
  nothing; attn_convert.cu, attn_dtensors.cu and the attention kernels' writes are played by
  NumPy stand-ins here): an array already in its storage type is bound in place (its address and
  element strides in attn_mods_gpu; no host copy either way); another dtype is converted on the
  device at every call; a mask_mod reading one makes its block mask every call and keeps none;
  lookups indexed by its values can fail (the call reads the error record, and raises
  IndexError from it); its gradient comes back as a device array of its dtype; another device
  is a ValueError, a host call a TypeError, both naming the array.
- attn_convert.cu compiles for every target architecture and agrees with mod_inputs on its type
  codes and parameter layout.

The refusals naming the array run on both (an `arrays` parameter): stand-ins of CUDA arrays
without a GPU, torch CUDA tensors with one (`-m gpu`).

On the GPU (`-m gpu`): torch CUDA tensors and CuPy arrays read in place or converted on the
device. Every result is checked against the float64 reference, which runs the same function over
NumPy copies of the arrays (fingerprint.with_arrays), and against the same call with those NumPy
copies captured instead, bit for bit (the kernels read the same values; a CUDA array's gradient
is rounded on the device by NumPy's rule). kernels/attn_convert.cu is checked against NumPy's
astype, bit for bit, over every dtype pair mod_inputs uses and strided, reversed, broadcast, 0-d
and 4-d sources.
"""
import os
import re

import ml_dtypes
import numpy as np
import pytest

import attnext
from attnext import _C, reference
from attnext.cuda import (backend as cuda_backend, mod_cache, mod_inputs as mod_arrays, nvrtc, select,
                          staging)
from attnext.cuda.devview import DevView
from attnext.mods import fingerprint, trace
from attnext.testing.accuracy import coarser
from conftest import BF16, F16, assert_close, assert_lse_close, compare_grads, make_qkv, randn

from helpers.driver import run_on_fake
from helpers.fake_arrays import FAKE_ARRAYS

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


class RequiresGrad:
    """A CUDA array whose library refuses to share it, as torch refuses a tensor that requires
    grad."""

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")


def test_tracing_names_an_array_its_library_refuses_to_share():
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


BODY = FAKE_ARRAYS + r"""
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
    assert str(e) == ("score_mod: captured array 'far_arr' lives on cuda:1, but the call runs on cuda:0; "
                      "move it to cuda:0"), e
device._count[:], _C.pointer_device = count, pointer_device

# --- a host call cannot read it: TypeError naming it -------------------------------------------
hq = np.zeros((1, 8, 2, 16), np.float64)      # float64: device=None keeps it on the CPU
for where in ("cpu", "reference"):
    try:
        attnext.attention(hq, hq, hq, score_mod=relbias, device=where)
        raise SystemExit("no TypeError")
    except TypeError as e:
        assert "score_mod captures 'table', a CUDA array (CudaArray)" in str(e), e
try:
    attnext.attention_backward(hq, hq, hq, hq, hq, np.zeros((1, 2, 8), np.float64), mask_mod=doc_mask)
    raise SystemExit("no TypeError")
except TypeError as e:
    assert "mask_mod captures 'ids'" in str(e), e
print("ok")
"""


def test_captured_cuda_arrays_on_the_fake_driver(fake_driver):
    run_on_fake(fake_driver, BODY)


# --- refusals naming the array: stand-ins without a GPU, torch CUDA tensors with one ----------------

@pytest.mark.parametrize("arrays", ["stand_in", pytest.param("torch", marks=pytest.mark.gpu)])
def test_refusals_name_the_array(arrays, rng, request):
    """A host call (the CPU backend, the reference) cannot read a captured CUDA array, and an
    array its library refuses to share (torch: a tensor that requires grad) is named with the
    fix: with stand-ins (NullCudaArray, RequiresGrad; a CPU call) and with torch CUDA tensors (a
    GPU call). With two GPUs, an array on the other one than q, k, v is a ValueError (the fake
    driver's run above checks it without)."""
    qh, kh, vh = make_qkv(rng, 1, 8, 8, 2, 2, 64, 64, F16)
    if arrays == "stand_in":
        table, param, kind = NullCudaArray((8,), "<f4"), RequiresGrad(), "NullCudaArray"
        (q, k, v), where = (qh, kh, vh), {"device": "cpu"}
    else:
        torch = request.getfixturevalue("torch")
        table, kind = torch.ones(8, device="cuda"), "Tensor"
        param = torch.nn.Parameter(torch.ones(8, device="cuda"))
        (q, k, v), where = (Torch().put(x) for x in (qh, kh, vh)), {}
    for device in ("cpu", "reference"):
        with pytest.raises(TypeError, match=rf"score_mod captures 'table', a CUDA array \({kind}\)"):
            attnext.attention(qh, kh, vh, score_mod=lambda s, b, h, qi, ki: s + table[ki], device=device)
    with pytest.raises(TypeError, match=r"captured array 'param': .*\.detach\(\)"):
        attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + param[ki], **where)
    if arrays == "stand_in" or torch.cuda.device_count() < 2:
        return
    far = torch.ones(8, device="cuda:1")
    with pytest.raises(ValueError, match=r"captured array 'far' lives on cuda:1, but q, k and v on cuda:0"):
        attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + far[ki])


# --- on the GPU (-m gpu) ------------------------------------------------------------------------

S, H = 80, 4        # two 64-row tiles; the reference's gradient of a table is one finite
                    # difference per element, so the tables stay small (H x 161)


class Torch:
    """torch CUDA tensors with a NumPy array's bits (bfloat16 included)."""
    name = "torch"

    def __init__(self):
        import torch
        self.torch = torch

    def put(self, x):
        torch = self.torch
        x = np.ascontiguousarray(x)
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(x).cuda()

    def get(self, t):
        torch = self.torch
        t = t.detach().cpu()
        return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()

    def is_own(self, a):
        return isinstance(a, self.torch.Tensor) and a.is_cuda

    def scale_(self, a, c):
        a.mul_(c)


class CuPy:
    """CuPy arrays (CuPy has no bfloat16: those cases skip)."""
    name = "cupy"

    def __init__(self):
        import cupy
        self.cupy = cupy

    def put(self, x):
        if np.dtype(x.dtype) == BF16:
            pytest.skip("CuPy has no bfloat16")
        return self.cupy.asarray(np.ascontiguousarray(x))

    def get(self, a):
        return self.cupy.asnumpy(a)

    def is_own(self, a):
        return isinstance(a, self.cupy.ndarray)

    def scale_(self, a, c):
        a *= c


@pytest.fixture(params=["torch", "cupy"])
def lib(request):
    if request.param == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device for torch")
        return Torch()
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device for CuPy")
    return CuPy()


def twin(fn, host):
    """fn over NumPy copies of its captured arrays (name -> NumPy array), or None."""
    return None if fn is None else fingerprint.with_arrays(fn, host)


def run(lib, q, k, v, host, *, score_mod=None, mask_mod=None, backward=True, **opts):
    """Forward and backward on lib's CUDA arrays with mods capturing CUDA arrays, checked against
    the reference over the NumPy copies `host` (name -> array) and against the same GPU call
    capturing those copies (bit for bit). Returns (host results of the GPU call, its dtensors)."""
    dtype = np.dtype(q.dtype)
    hs, hm = twin(score_mod, host), twin(mask_mod, host)
    tq, tk, tv = (lib.put(x) for x in (q, k, v))
    t_out, t_lse = attnext.attention(tq, tk, tv, score_mod=score_mod, mask_mod=mask_mod, return_lse=True,
                                     **opts)
    assert lib.is_own(t_out)
    out, lse = lib.get(t_out), lib.get(t_lse)
    r_out, r_lse = reference.attention(q, k, v, score_mod=hs, mask_mod=hm, return_lse=True, **opts)
    assert_close("out", out, r_out, dtype)
    assert_lse_close(lse, r_lse, dtype)
    n_out = attnext.attention(tq, tk, tv, score_mod=hs, mask_mod=hm, **opts)
    assert np.array_equal(lib.get(n_out).view(np.uint16), out.view(np.uint16)), "out: the twin's differs"
    if not backward:
        return out, None
    dout = randn(np.random.default_rng(7), out.shape, dtype)
    g = attnext.attention_backward(lib.put(dout), tq, tk, tv, t_out, t_lse, score_mod=score_mod,
                                   mask_mod=mask_mod, **opts)
    got = type(g)(*(None if x is None else lib.get(x) for x in g[:4]), g.dtensors)
    rg = reference.attention_backward(dout, q, k, v, out, lse, score_mod=hs, mask_mod=hm, **opts)
    problems = compare_grads(got, rg, q, k, v, dout, out, r_out, None, dict(opts, score_mod=hs, mask_mod=hm))
    assert not problems, "\n".join(problems)
    gn = attnext.attention_backward(lib.put(dout), tq, tk, tv, t_out, t_lse, score_mod=hs, mask_mod=hm,
                                    **opts)
    assert np.array_equal(lib.get(gn.dq).view(np.uint16), got.dq.view(np.uint16)), "dq: the twin's differs"
    dtensors = {}
    floor = max(float(np.abs(x).max(initial=0.0)) for x in rg[:3])
    for name, want in rg.dtensors.items():
        d = g.dtensors[name]
        assert lib.is_own(d), (name, type(d))
        h = lib.get(d)
        src = host[name]
        assert h.shape == src.shape and h.dtype == src.dtype, (name, h.shape, h.dtype)
        assert_close(f"dtensors[{name!r}]", h.astype(np.float64), want, coarser(dtype, src.dtype),
                     max(floor, float(np.abs(want).max(initial=0.0))))
        same = gn.dtensors[name]
        assert isinstance(same, np.ndarray) and np.array_equal(same.view(np.uint8), h.view(np.uint8)), name
        dtensors[name] = h
    return out, dtensors


# --- kernels/attn_convert.cu against NumPy -------------------------------------------------------

def _specials(dtype):
    f = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-310, 1e-45, 6e-8, 3e-8, 65504.0, 65520.0, 1e39,
         1 + 2 ** -11, 1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -8, 1 + 2 ** -8 + 2 ** -30, 3 * 2 ** -25]
    return np.array(f + [-x for x in f], np.float64).astype(dtype)


def _sources(rng, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(4096) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, 4096, dtype=dtype, endpoint=True)
    if dtype.itemsize == 2:                                       # every float16 / bfloat16 pattern
        return np.arange(2 ** 16, dtype=np.uint16).view(dtype)
    scale = np.exp2(rng.integers(-160, 140, 4096) if dtype == np.float64 else rng.integers(-30, 30, 4096))
    return np.concatenate([(rng.standard_normal(4096) * scale).astype(dtype), _specials(dtype)])


def _same(got, want):
    """Equal bits, or both NaN (a NaN's payload is the converting unit's)."""
    if got.dtype.kind == "f" or got.dtype == BF16:
        a, b = got.astype(np.float64), want.astype(np.float64)
        nan = np.isnan(a) & np.isnan(b)
        return np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
            got.view(f"u{got.itemsize}")[~nan], want.view(f"u{want.itemsize}")[~nan])
    return np.array_equal(got, want)


PAIRS = ([(t, np.int64) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                   np.uint64)]
         + [(np.bool_, np.bool_)]
         + [(t, np.float32) for t in (np.float16, BF16, np.float32, np.float64)]
         + [(np.float64, t) for t in (np.float16, BF16, np.float32, np.float64)])


@pytest.mark.gpu
@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{np.dtype(a).name}-{np.dtype(b).name}" for a, b in PAIRS])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_convert_kernel_is_numpy_astype(src, dst, rng, gpu):
    with np.errstate(all="ignore"):
        _check_convert(_sources(rng, src), dst)


def _check_convert(x, dst):
    n = x.size - x.size % 16
    arch = cuda_backend.device_arch(0)
    with staging.Staging(0, 0) as stage:
        base = stage.upload(x)
        item = x.itemsize
        strided = np.lib.stride_tricks.as_strided
        views = {                                   # DevViews of the uploaded x and the NumPy twin
            "flat": (base, x),
            "reversed": (DevView(base.ptr + (x.size - 1) * item, (x.size,), (-1,), x.dtype, 0), x[::-1]),
            "transposed": (DevView(base.ptr, (16, n // 16), (1, 16), x.dtype, 0), x[:n].reshape(n // 16, 16).T),
            "4d": (DevView(base.ptr, (2, 2, 4, n // 16), (n // 2, n // 4, 1, 4), x.dtype, 0),
                   strided(x, (2, 2, 4, n // 16), tuple(s * item for s in (n // 2, n // 4, 1, 4)))),
            "broadcast": (DevView(base.ptr + 8 * item, (3, 5), (0, 1), x.dtype, 0),
                          np.broadcast_to(x[8:13], (3, 5))),
            "0d": (DevView(base.ptr + 3 * item, (), (), x.dtype, 0), x[3]),
        }
        for name, (view, want) in views.items():
            want = np.asarray(want).astype(dst)
            out = stage.scratch(view.shape, dst)
            mod_arrays.convert(view, out, stage, arch)
            got = np.empty(want.shape, want.dtype)
            stage.download(out, got)
            assert _same(got, want), (name, got[~(got == want)][:8] if got.shape else got,
                                      want[~(got == want)][:8] if want.shape else want)


# --- the relative bias table ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("table_dtype", [np.float32, BF16, np.float16, np.float64],
                         ids=["f32", "bf16", "f16", "f64"])
def test_relative_bias_table(table_dtype, lib, rng):
    """In place for float32; converted on the device for the others; its gradient on the device in
    its own dtype."""
    host = {"table": randn(rng, (H, 2 * S + 1), table_dtype)}
    table = lib.put(host["table"])

    def relbias(s, b, h, qi, ki):
        return s + table[h, qi - ki + S]

    q, k, v = make_qkv(rng, 1, S, S, H, 2, 64, 64, F16 if lib.name == "cupy" else BF16)
    run(lib, q, k, v, host, score_mod=relbias)
    run(lib, q, k, v, host, score_mod=relbias, causal=True, backward=False)


@pytest.mark.gpu
def test_relative_bias_table_views(rng, lib):
    """A transposed table (read in place by the forward, copied for the backward's gradient) and a
    broadcast one (stride 0: each element its own gradient, as NumPy's broadcast_to twin gives)."""
    if lib.name != "torch":
        pytest.skip("torch's transpose / expand")
    base = randn(rng, (2 * S + 1, H), np.float32)
    t = lib.put(base).T
    row = randn(rng, (1, 2 * S + 1), np.float32)
    e = lib.put(row).expand(H, 2 * S + 1)

    def transposed(s, b, h, qi, ki):
        return s + t[h, qi - ki + S]

    def broadcast(s, b, h, qi, ki):
        return s + e[h, qi - ki + S] * 0.5

    q, k, v = make_qkv(rng, 1, S, S, H, H, 64, 64, BF16)
    run(lib, q, k, v, {"t": base.T.copy()}, score_mod=transposed)
    run(lib, q, k, v, {"e": np.broadcast_to(row, (H, 2 * S + 1)).copy()}, score_mod=broadcast)


# --- the document mask ---------------------------------------------------------------------------

# 230 positions, uneven documents; the ids repeat (0 1 2 0 1), so the NumPy twins keep the mask_mod
# too (a document mask over contiguous NumPy runs runs as varlen: other bits than the CUDA call's)
DOCS = np.repeat(np.arange(5) % 3, [40, 70, 1, 64, 55])


@pytest.mark.gpu
@pytest.mark.parametrize("id_dtype", [np.int64, np.int32], ids=["i64", "i32"])
def test_document_mask(id_dtype, lib, rng):
    """int64 ids in place, int32 converted on the device; the block mask made at every call and
    never kept (its contents are not seen on the host)."""
    host = {"doc": DOCS.astype(id_dtype)}
    doc = lib.put(host["doc"])

    def document(b, h, qi, ki):
        return doc[qi] == doc[ki]

    def document_causal(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    q, k, v = make_qkv(rng, 1, DOCS.size, DOCS.size, 2, 1, 128, 128, F16)
    run(lib, q, k, v, host, mask_mod=document)
    run(lib, q, k, v, host, mask_mod=document_causal)
    tq, tk, tv = (lib.put(x) for x in (q, k, v))
    before = mod_cache.info()["block_masks"]
    for _ in range(2):
        attnext.attention(tq, tk, tv, mask_mod=document)
    after = mod_cache.info()["block_masks"]
    assert (after["entries"], after["hits"]) == (before["entries"], before["hits"]), (before, after)


@pytest.mark.gpu
def test_document_mask_varlen_with_table(lib, rng):
    """varlen (b the sequence), a mask_mod reading an int32 id array and a score_mod reading a
    float32 table indexed by b."""
    cu_q, cu_k = np.array([0, 90, 90, 230], np.int32), np.array([0, 100, 100, 230], np.int32)
    host = {"doc": DOCS.astype(np.int32), "table": randn(rng, (3, 2 * 230 + 1), np.float32)}
    doc, table = lib.put(host["doc"]), lib.put(host["table"])
    q = randn(rng, (230, 2, 64), F16)
    k, v = randn(rng, (230, 1, 64), F16), randn(rng, (230, 1, 64), F16)

    def score_mod(s, b, h, qi, ki):
        return s + table[b, qi - ki + 230]

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) | (ki < 3)

    hs, hm = twin(score_mod, host), twin(mask_mod, host)
    lengths = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out = attnext.varlen_attention(*(lib.put(x) for x in (q, k, v)), score_mod=score_mod, mask_mod=mask_mod,
                                   **{n: lib.put(x) for n, x in lengths.items()})
    want = reference.varlen_attention(q, k, v, score_mod=hs, mask_mod=hm, **lengths)
    assert_close("out", lib.get(out), want, F16)


# --- lookups out of range ------------------------------------------------------------------------

@pytest.mark.gpu
def test_lookup_indexed_by_device_values_raises_index_error(lib, rng):
    """attnext.bounds cannot know a CUDA array's values: a lookup indexed by them is checked on
    the device, and one out of range raises IndexError after the launches, forward and backward;
    a good call after it works."""
    q, k, v = (lib.put(x) for x in make_qkv(rng, 1, 40, 48, 2, 2, 64, 64, F16))
    ids_host = np.arange(48, dtype=np.int32)
    ids_host[29] = 70
    ids = lib.put(ids_host)
    table = lib.put(randn(rng, 64, np.float32))
    flags = lib.put(np.ones(64, bool))

    def score_mod(s, b, h, qi, ki):
        return s + table[ids[ki]]

    with pytest.raises(IndexError, match=r"score_mod: index 70 is out of bounds for axis 0 of array 'table' "
                                         r"with size 64"):
        attnext.attention(q, k, v, score_mod=score_mod)
    out, lse = attnext.attention(q, k, v, return_lse=True)
    with pytest.raises(IndexError, match="'table'"):
        attnext.attention_backward(out, q, k, v, out, lse, score_mod=score_mod)
    for _ in range(2):                   # a mask that failed is never kept
        with pytest.raises(IndexError, match=r"mask_mod: index 70 .* array 'flags' with size 64"):
            attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: flags[ids[ki]])
    short = lib.put(np.ones(40, np.float32))
    with pytest.raises(IndexError, match=r"index 4\d is out of bounds for axis 0 of array 'short' with "
                                         r"size 40"):
        attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * short[ki])
    ids_host[29] = 29
    good = lib.put(ids_host)
    attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[good[ki]])


# --- read afresh at every call -------------------------------------------------------------------

@pytest.mark.gpu
def test_in_place_changes_are_seen_by_the_next_call(lib, rng):
    """A table scaled in place and document ids rewritten in place (int64 read in place, int32
    converted again) between calls: each call gives the reference's answer for the values of
    its time (the block mask is made again)."""
    q, k, v = make_qkv(rng, 1, DOCS.size, DOCS.size, 2, 2, 64, 64, F16)
    tq, tk, tv = (lib.put(x) for x in (q, k, v))
    host_table = randn(rng, (2, 2 * DOCS.size + 1), np.float32)
    table = lib.put(host_table)

    def relbias(s, b, h, qi, ki):
        return s + table[h, qi - ki + DOCS.size]

    for c in (1.0, 3.0, 0.25):
        lib.scale_(table, c)
        host_table = host_table * np.float32(c)
        got = lib.get(attnext.attention(tq, tk, tv, score_mod=relbias))
        want = reference.attention(q, k, v, score_mod=twin(relbias, {"table": host_table}))
        assert_close("out", got, want, F16)
    for dt in (np.int64, np.int32):
        host_doc = DOCS.astype(dt)
        doc = lib.put(host_doc)

        def mask_mod(b, h, qi, ki):
            return doc[qi] == doc[ki]

        for flip in range(3):
            if flip:
                host_doc = np.roll(host_doc, 37 * flip)
                doc[...] = lib.put(host_doc)                  # written in place, same memory
            got = lib.get(attnext.attention(tq, tk, tv, mask_mod=mask_mod))
            want = reference.attention(q, k, v, mask_mod=twin(mask_mod, {"doc": host_doc}))
            assert_close("out", got, want, F16)


# --- no host copy, refusals ----------------------------------------------------------------------

@pytest.mark.gpu
def test_in_place_arrays_cost_no_host_copy(rng, monkeypatch):
    """A float32 table and int64 ids read in place: no upload, and no download either (their
    lookups cannot fail over the lengths rounded up to select.TILE_EDGE, so the call does not
    wait), forward and backward."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    lib = Torch()
    q, k, v = (lib.put(x) for x in make_qkv(rng, 1, S, S, 2, 2, 64, 64, BF16))
    edge = -(-S // select.TILE_EDGE) * select.TILE_EDGE
    table = lib.put(randn(rng, (2, 2 * edge + 1), np.float32))
    doc = lib.put(np.repeat(np.arange(edge // 50 + 1), 50)[:edge].astype(np.int64))

    def score_mod(s, b, h, qi, ki):
        return s + table[h, qi - ki + edge]

    def mask_mod(b, h, qi, ki):
        return doc[qi] == doc[ki]

    out, lse = attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    attnext.attention_backward(out, q, k, v, out, lse, score_mod=score_mod, mask_mod=mask_mod)
    copies = []
    for name in ("memcpy_htod", "memcpy_dtoh"):
        real = getattr(_C, name)
        monkeypatch.setattr(_C, name, lambda *a, real=real, name=name: (copies.append(name), real(*a))[1])
    out, lse = attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    g = attnext.attention_backward(out, q, k, v, out, lse, score_mod=score_mod, mask_mod=mask_mod)
    assert copies == [], copies
    assert g.dtensors["table"].is_cuda and g.dtensors["table"].dtype == torch.float32
