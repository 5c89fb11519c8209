"""The fake driver's stand-ins for CUDA arrays (tests/host/test_mod_arrays.py, the NumPy-call
tests that capture them: tests/host/test_numpy_mods_gpu.py, and device lengths:
tests/host/test_device_lengths.py): fake device memory, the convert, dtensors and lengths-check
kernels played by NumPy, the launches recorded. Code for run_on_fake's fresh interpreter, not
imported.

FAKE_ARRAYS: the stand-ins. NUMPY_CALLS: those, and for NumPy calls that run on the (fake) GPU
the attention launches' entry points recorded (NAMES) and the CPU backend's (CPU), with host
q, k, v (hq, hk, hv)."""

FAKE_ARRAYS = r"""
import ctypes
from attnext.cuda import lengths, mod_cache, mod_inputs as mod_arrays, staging
from attnext.mods import codegen, trace

S = 256         # a multiple of select.TILE_EDGE: the lookups over it are proved
rng = np.random.default_rng(0)
GMODS = []          # (entry point, attn_mods_gpu record) of every launch with mods
CONVERTS = []       # attn_convert's parameters, every launch
COPIES = []         # (direction, bytes) of every host <-> device copy
CHECKS = []         # attn_lengths' parameters, every launch
PAGE_CHECKS = []    # attn_pages' parameters, every launch
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


def lengths_fault(p):
    # attn_lengths.cu's checks, in its order: (code, array, index, value, bound) or None
    for b in range(int(p["B"]) + 1):
        for side in range(2):
            cu = at(p["cu"][side], (int(p["B"]) + 1,), (1,), np.int32).astype(np.int64)
            if b == 0 and cu[0] != 0:
                return 1, side, 0, cu[0], 0
            if b == p["B"]:
                if cu[b] > p["rows"][side]:
                    return 3, side, b, cu[b], p["rows"][side]
                continue
            seg = cu[b + 1] - cu[b]
            if seg < 0:
                return 2, side, b + 1, cu[b + 1], cu[b]
            if seg > p["max_len"][side]:
                return 4, side, b, seg, p["max_len"][side]
            if p["used"][side]:
                u = int(at(p["used"][side], (int(p["B"]),), (1,), np.int32)[b])
                if u < 0 or u > seg:
                    return (5, 2 + side, b, u, 0) if u < 0 else (6, 2 + side, b, u, seg)
    return None


def pages_fault(p):
    # attn_pages' check: (code, array, b, value, bound, j) of the first fault, or None
    B, max_pages, ps = int(p["B"]), int(p["max_pages"]), int(p["page_size"])
    table = at(p["table"], (B, max_pages), (int(p["bt_stride"]), 1), np.int32)
    lens = at(p["used"], (B,), (1,), np.int32) if p["used"] else np.full(B, max_pages * ps)
    for b in range(B):
        if not 0 <= lens[b] <= max_pages * ps:             # a CUDA seqlens_k outside the table's rows
            return lengths.SEQLENS_K_OUTSIDE, 5, b, int(lens[b]), max_pages * ps, 0
        for j in range(min(-(-int(lens[b]) // ps), max_pages)):
            if not 0 <= table[b, j] < p["num_pages"]:
                return lengths.PAGE_OUT_OF_RANGE, 4, b, int(table[b, j]), int(p["num_pages"]), j
    return None


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
    elif name == "attn_lengths":                        # the device lengths' check writes the record
        p = np.frombuffer(params, lengths.PARAMS)[0].copy()
        CHECKS.append(p)
        fault, rec = lengths_fault(p), at(p["record"], (lengths.WORDS,), (1,), np.int64)
        if fault and not rec[0]:
            rec[1:6] = [int(x) for x in fault[1:]] + [int(p["device"])]
            rec[0] = fault[0]
    elif name == "attn_pages":                          # a CUDA block table's check writes the record
        p = np.frombuffer(params, lengths.PAGES_PARAMS)[0].copy()
        PAGE_CHECKS.append(p)
        fault, rec = pages_fault(p), at(p["record"], (lengths.WORDS,), (1,), np.int64)
        if fault and not rec[0]:
            code, array, b, value, bound, j = fault
            rec[1:7] = [array, b, value, bound, int(p["device"]), j]
            rec[0] = code
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

"""

NUMPY_CALLS = FAKE_ARRAYS + r"""
NAMES = []          # (entry point, with mods) of every attention launch
CPU = []            # the CPU backend's entry points called
_with_gmods = _C.cuda_launch_attention


def named(fn, *args):
    NAMES.append((FN[id(fn)][1], len(args) > 8))
    _with_gmods(fn, *args)


_C.cuda_launch_attention = named
for entry in ("forward", "backward"):
    setattr(_C, entry, (lambda f, entry: lambda *a: (CPU.append(entry), f(*a))[1])(getattr(_C, entry), entry))


def launched(call):
    n = len(NAMES)
    result = call()
    return result, NAMES[n:]


def mods_kernels(names, prefix):
    return [n for n, with_mods in names if with_mods and n.startswith(prefix)]


hq, hk, hv = (rng.standard_normal((1, S, 2, 64)).astype(BF16) for _ in range(3))
"""
