"""The public functions and every argument check, in one place.

Each public call is checked here, normalised into a `_Problem` (q, k, v, out in (B, S, H, D)
order as strided NumPy views, bias and mask as views broadcast to (B, Hb, Sq, Sk) without copying,
lengths as int32) and handed to a backend: `attnext._C` for the CPU, or `attnext.reference`.

Causal alignment when Sq != Sk (here Sq = 2, Sk = 5; x = attended)::

    causal=True / "bottom_right"        causal="top_left"
        k: 0 1 2 3 4                       k: 0 1 2 3 4
    q0:    x x x x .                   q0:    x . . . .
    q1:    x x x x x                   q1:    x x . . .

A row that keeps no key (fully masked, or past its sequence's length) returns out = 0 and
lse = -inf, with zero gradients; never NaN.
"""
import functools
import inspect
import math
import os
import sys
import types

import ml_dtypes
import numpy as np

from . import _C, reference
from .cuda.devview import DevView, may_be_device_array
from .mods import codegen, fingerprint, interp, lower, trace
from .types import Grads

_DTYPE_CODES = {np.dtype(np.float16): 0, np.dtype(ml_dtypes.bfloat16): 1,
                np.dtype(np.float32): 2, np.dtype(np.float64): 3}
_DEVICES = ("cpu", "cuda", "reference")
_LAYOUTS = ("bshd", "bhsd")
_CAUSAL = {False: 0, None: 0, True: 1, "bottom_right": 1, "top_left": 2}
_PRECISIONS = (None, "tf32")
MAX_THREADS = 1024
MAX_HEAD_DIM = 256


def _fmt(x):
    return repr(x) if not isinstance(x, np.ndarray) else f"array(shape={x.shape}, dtype={x.dtype})"


_GPU_MODULES = []


def _gpu():
    """(cuda_backend, device), imported on the first GPU call: `import attnext` does not load
    the CUDA host side, and a `from . import` inside a function costs ~1 us on every call."""
    if not _GPU_MODULES:
        from .cuda import arrays, backend
        _GPU_MODULES[:] = (backend, arrays)
    return _GPU_MODULES


def _device_view(x):
    """A DevView of a CUDA array (__cuda_array_interface__ / __dlpack__), None for host data."""
    if not may_be_device_array(x):
        return None
    return _gpu()[1].as_device_view(x)


def _cuda_view(name, x):
    """_device_view, its TypeErrors (a dtype, byte order or refusal of the producer) naming the
    argument."""
    try:
        return _device_view(x)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None


def _array(name, x, host=False):
    """A host array (never copied unless misaligned), or a DevView of a CUDA array (host=True:
    copied to the host, for the small arrays the checks read). Non-arrays raise TypeError."""
    # numpy.ma not imported: x is no masked array (importing it cost a first call 15-80 ms)
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(x, ma.MaskedArray):
        raise TypeError(f"{name} is a masked array: attnext would read its data and ignore its mask; "
                        f"pass {name}.filled(...) or np.ma.getdata({name}), and mask= for masking")
    if isinstance(x, np.ndarray):
        a = x
    elif (dv := _cuda_view(name, x)) is not None:
        if not host:
            return dv
        a = _gpu()[0].to_host(dv)
    elif hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
        try:
            a = np.asarray(x)
        except Exception as e:   # e.g. a CUDA tensor refusing host conversion
            raise TypeError(f"{name} must be a NumPy array or array-like on the host, got "
                            f"{type(x).__name__}: {e}") from None
    else:
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if a.dtype.kind == "f" and not a.dtype.isnative:
        raise TypeError(f"{name} has non-native byte order ({a.dtype.str}); use "
                        f"{name}.astype({name}.dtype.newbyteorder('='))")
    if not a.flags.aligned:
        # copy only what the strides reach (a broadcast stays a broadcast), then view it again
        base = a[tuple(slice(0, 1) if s == 0 else slice(None) for s in a.strides)]
        a = np.broadcast_to(base.copy(), a.shape)
    return a


def _float_array(name, x):
    a = _array(name, x)
    if a.dtype not in _DTYPE_CODES:
        raise TypeError(f"{name} has dtype {a.dtype}; expected float16, bfloat16, float32 or float64")
    return a


def _int_array(name, x, length):
    a = _array(name, x, host=True)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.ndim != 1 or a.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {a.shape}")
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} must hold values in [0, 2**31), got {a.tolist()[:8]}")
    return np.ascontiguousarray(a, dtype=np.int32)


def _new_output(shape, dtype, pinned=False):
    """Every result buffer a backend fills (the tests poison these to catch unwritten elements).
    pinned: a NumPy call on the GPU, whose large results live in pooled pinned memory
    (staging.host_result), so their DMAs need no host copy."""
    if pinned:
        return _gpu()[0].host_result(shape, dtype)
    return np.empty(shape, dtype=dtype)


def _c_view(a):
    """What the C extension reads: bfloat16 as uint16 (NumPy cannot export it as a buffer)."""
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


def _resolve_device(device, q, k, v):
    """The backend for this call. CUDA arrays run on the GPU. device=None (or ATTNEXT_DEVICE)
    picks the GPU for host arrays when it is usable and has kernels for their dtype (float16,
    bfloat16), else the CPU."""
    if device is not None and device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES} or None, got {device!r}")
    on_gpu = [isinstance(x, DevView) for x in (q, k, v)]
    if any(on_gpu) and not all(on_gpu):
        where = ", ".join(f"{n} on {'cuda' if g else 'the host'}" for n, g in zip("qkv", on_gpu))
        raise TypeError(f"q, k and v must all live on the GPU or all on the host, got {where}")
    cuda_backend = _gpu()[0]
    if on_gpu[0]:
        if len({x.device for x in (q, k, v)}) > 1:
            raise ValueError(f"q, k and v live on different GPUs: cuda:{q.device}, cuda:{k.device}, "
                             f"cuda:{v.device}")
        if device not in (None, "cuda"):
            raise ValueError(f"device={device!r} cannot read q, k, v: they are CUDA arrays "
                             f"(on cuda:{q.device}); pass device='cuda' or None")
        device = "cuda"
    elif device is None:
        device = os.environ.get("ATTNEXT_DEVICE") or None
        if device is not None and device not in _DEVICES:
            raise ValueError(f"ATTNEXT_DEVICE: device must be one of {_DEVICES}, got {device!r}")
        if device is None:
            device = "cuda" if q.dtype in cuda_backend.DTYPES and cuda_backend.usable() else "cpu"
    if device == "cuda":
        why = cuda_backend.unavailable_reason()
        if why:
            raise RuntimeError(f"device='cuda': the CUDA backend is unavailable: {why}")
        if q.dtype not in cuda_backend.DTYPES:
            raise TypeError(f"device='cuda' runs float16 and bfloat16; q has dtype {q.dtype} "
                            "(float64 stays on the CPU)")
    return device


def _num_threads():
    env = os.environ.get("ATTNEXT_NUM_THREADS")
    if not env:
        return 0
    try:
        n = int(env)
    except ValueError:
        raise ValueError(f"ATTNEXT_NUM_THREADS must be an integer in [1, {MAX_THREADS}], got {env!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"ATTNEXT_NUM_THREADS must be an integer in [1, {MAX_THREADS}], got {env!r}")
    return n


def _is_real(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _float_value(x):
    """float(x), with an int too large for a float (10**400) as infinity."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


# the arguments score_mod and mask_mod are called with
_MOD_ARGS = {"score_mod": "score, b, h, q_idx, kv_idx", "mask_mod": "b, h, q_idx, kv_idx"}


def _check_arity(name, f):
    """score_mod / mask_mod must accept their positional arguments; a callable whose signature
    Python cannot read (some builtins) is let through to the call."""
    args = _MOD_ARGS[name]
    n = args.count(",") + 1
    if isinstance(f, np.ufunc):
        if f.nin != n:
            raise TypeError(f"{name} must take {n} arguments ({args}); the ufunc {f.__name__} takes {f.nin}")
        return
    code = getattr(f, "__code__", None)
    if (type(f) is types.FunctionType and not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
            and not code.co_kwonlyargcount
            and code.co_argcount - len(f.__defaults__ or ()) <= n <= code.co_argcount):
        return        # a plain function that takes them (inspect.signature costs ~15 us a call)
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*range(n))
    except TypeError:
        raise TypeError(f"{name} must take {n} arguments ({args}), got "
                        f"{getattr(f, '__name__', type(f).__name__)}{sig}") from None


def _check_options(o, D, Hq, B):
    """Checks the scalar and small-array options; fills codes into o (a SimpleNamespace)."""
    if not isinstance(o.return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {_fmt(o.return_lse)}")
    if o.scale is None:
        o.scale_value = 1.0 / math.sqrt(D)
    else:
        if not _is_real(o.scale):
            raise TypeError(f"scale must be a real number, got {_fmt(o.scale)}")
        if not math.isfinite(_float_value(o.scale)):
            raise ValueError(f"scale must be finite, got {o.scale!r}")
        o.scale_value = float(o.scale)
    if o.softcap is None:
        o.softcap_value = 0.0
    else:
        if not _is_real(o.softcap):
            raise TypeError(f"softcap must be a positive real number, got {_fmt(o.softcap)}")
        if not (math.isfinite(_float_value(o.softcap)) and float(o.softcap) > 0):
            raise ValueError(f"softcap must be positive and finite, got {o.softcap!r}")
        o.softcap_value = float(o.softcap)
    causal = bool(o.causal) if isinstance(o.causal, np.bool_) else o.causal
    if not (causal is None or isinstance(causal, (bool, str))) or causal not in _CAUSAL:
        raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left', got {o.causal!r}")
    o.causal_code = _CAUSAL[causal]
    if o.window is None:
        o.window_left = o.window_right = -1
    else:
        w = o.window
        if (not isinstance(w, (tuple, list)) or len(w) != 2
                or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in w)):
            raise ValueError(f"window must be a pair of ints (left, right), -1 = unbounded, got {w!r}")
        if w[0] < -1 or w[1] < -1:
            raise ValueError(f"window sides must be >= -1 (-1 = unbounded), got {tuple(w)!r}")
        # no query is farther than Sq + Sk from a key: a wider side is unbounded, and clamping
        # keeps the kernels' int64 index arithmetic from wrapping
        far = o.Sq + o.Sk
        o.window_left, o.window_right = (min(int(x), far) for x in w)
    if o.precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {o.precision!r}")
    for name in ("score_mod", "mask_mod"):
        f = getattr(o, name)
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be callable or None, got {type(f).__name__}")
        if f is not None:
            _check_arity(name, f)
            if not o.on_gpu:
                _host_arrays_only(name, f, o.device)
    o.alibi = None
    if o.alibi_slopes is not None:
        a = _array("alibi_slopes", o.alibi_slopes, host=True)
        if a.dtype not in _DTYPE_CODES:
            raise TypeError(f"alibi_slopes must be a float array, got dtype {a.dtype}")
        if a.shape not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}), got {a.shape}")
        a = a.astype(np.float64 if a.dtype == np.float64 else np.float32)
        if not np.all(np.isfinite(a)):
            raise ValueError("alibi_slopes must be finite")
        o.alibi = np.broadcast_to(a, (B, Hq))


def _broadcast_4d(name, x, B, Hq, Hk, Sq, Sk, is_mask, varlen):
    """bias or mask as a (B, Hb, Sq, Sk) view (no copy) and Hb in {1, Hk, Hq}."""
    a = _array(name, x)
    if is_mask and a.dtype != np.bool_:
        raise TypeError(f"mask must be a bool array (True = attend), got dtype {a.dtype}")
    if not is_mask and a.dtype not in _DTYPE_CODES:
        raise TypeError(f"bias has dtype {a.dtype}; expected float16, bfloat16, float32 or float64")
    if a.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dims (B, H, Sq, Sk), got shape {a.shape}")
    a4 = a.reshape((1,) * (4 - a.ndim) + a.shape)
    heads = a4.shape[1]
    ok = (a4.shape[0] in (1, B) and heads in (1, Hk, Hq) and a4.shape[2] in (1, Sq)
          and a4.shape[3] in (1, Sk))
    if not ok:
        rows = "max_seqlen_q, max_seqlen_k" if varlen else "Sq, Sk"
        heads = " or ".join(str(h) for h in sorted({1, Hk, Hq}))
        raise ValueError(f"{name} of shape {a.shape} does not broadcast to (B, H, {rows}) = "
                         f"({B}, H, {Sq}, {Sk}) with H = {heads}")
    try:
        view = _broadcast_to(a4, (B, heads, Sq, Sk))
    except ValueError as e:     # more elements than an index can count
        rows = "max_seqlen_q, max_seqlen_k" if varlen else "Sq, Sk"
        raise ValueError(f"{name} of shape {a.shape} cannot be viewed as (B, H, {rows}) = "
                         f"({B}, {heads}, {Sq}, {Sk}): {e}") from None
    return a, view, heads


def _broadcast_to(a, shape):
    return a.broadcast_to(shape) if isinstance(a, DevView) else np.broadcast_to(a, shape)


def _normalise(q, k, v, opts, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, seqused_q=None, seqused_k=None, varlen=False):
    """Checks q, k, v and every option; returns a SimpleNamespace with the views the backends read."""
    o = types.SimpleNamespace(**opts)
    o.like = q                  # results of a GPU call come back as q's library's arrays
    q = _float_array("q", q)
    k = _float_array("k", k)
    v = _float_array("v", v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    o.device = _resolve_device(o.device, q, k, v)
    o.on_gpu = isinstance(q, DevView)
    o.cuda_device = q.device if o.on_gpu else 0
    o.cuda_stream = q.stream if o.on_gpu else 0
    for name in ("score_mod", "mask_mod"):        # a non-callable is a TypeError before anything else
        f = getattr(o, name)
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be callable or None, got {type(f).__name__}")
    o.q, o.k, o.v = q, k, v
    if varlen:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim != 3:
                raise ValueError(f"{name} must have 3 dims (T, H, D) for varlen, got shape {x.shape}")
        Tq, Hq, D = q.shape
        Tk, Hk, _ = k.shape
        Dv = v.shape[2]
        if k.shape[2] != D or v.shape[:2] != (Tk, Hk):
            raise ValueError(f"shapes disagree: q {q.shape}, k {k.shape}, v {v.shape} "
                             "(expected k (Tk, Hk, D), v (Tk, Hk, Dv))")
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k are required")
        cq_a = _array("cu_seqlens_q", cu_seqlens_q, host=True)
        ck_a = _array("cu_seqlens_k", cu_seqlens_k, host=True)
        for name, cu in (("cu_seqlens_q", cq_a), ("cu_seqlens_k", ck_a)):
            if cu.ndim != 1 or cu.shape[0] < 1:
                raise ValueError(f"{name} must have shape (B + 1,), got {cu.shape}")
        B = cq_a.shape[0] - 1
        if ck_a.shape != cq_a.shape:
            raise ValueError(f"cu_seqlens_k must have shape {cq_a.shape} like cu_seqlens_q (B + 1 = "
                             f"{B + 1} entries), got {ck_a.shape}")
        cq = _int_array("cu_seqlens_q", cq_a, B + 1)
        ck = _int_array("cu_seqlens_k", ck_a, B + 1)
        for name, cu, T in (("cu_seqlens_q", cq, Tq), ("cu_seqlens_k", ck, Tk)):
            if cu[0] != 0:
                raise ValueError(f"{name} must start at 0, got {cu[0]}")
            if np.any(np.diff(cu) < 0):
                raise ValueError(f"{name} must not decrease, got {cu.tolist()}")
            if cu[-1] > T:
                raise ValueError(f"{name}[-1] = {cu[-1]} is past the end of the packed tensor ({T} rows)")
        seg_q, seg_k = np.diff(cq), np.diff(ck)
        uq = uk = None
        if seqused_q is not None:
            uq = _int_array("seqused_q", seqused_q, B)
            if np.any(uq > seg_q):
                raise ValueError(f"seqused_q {uq.tolist()} exceeds the segment lengths {seg_q.tolist()}")
        if seqused_k is not None:
            uk = _int_array("seqused_k", seqused_k, B)
            if np.any(uk > seg_k):
                raise ValueError(f"seqused_k {uk.tolist()} exceeds the segment lengths {seg_k.tolist()}")
        lq = uq if uq is not None else seg_q
        lk = uk if uk is not None else seg_k
        longest_q = int(lq.max()) if B else 0
        longest_k = int(lk.max()) if B else 0
        for name, m, longest in (("max_seqlen_q", max_seqlen_q, longest_q),
                                 ("max_seqlen_k", max_seqlen_k, longest_k)):
            if m is not None:
                if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
                    raise TypeError(f"{name} must be an int, got {_fmt(m)}")
                if m < longest:
                    raise ValueError(f"{name} = {m} is smaller than the longest sequence ({longest})")
                if m > np.iinfo(np.int32).max:
                    raise ValueError(f"{name} = {m} is past the largest sequence length (2**31 - 1)")
        o.max_q = longest_q if max_seqlen_q is None else int(max_seqlen_q)
        o.max_k = longest_k if max_seqlen_k is None else int(max_seqlen_k)
        o.cu_q, o.cu_k, o.used_q, o.used_k = cq, ck, uq, uk
        o.q4, o.k4, o.v4 = q[None], k[None], v[None]
        o.B, o.Sq, o.Sk = B, o.max_q, o.max_k
        o.out_shape, o.lse_shape = (Tq, Hq, Dv), (Hq, Tq)
    else:
        if o.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {o.layout!r}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim != 4:
                raise ValueError(f"{name} must have 4 dims for layout {o.layout!r}, got shape {x.shape}")
        if o.layout == "bhsd":
            q4, k4, v4 = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        else:
            q4, k4, v4 = q, k, v
        B, Sq, Hq, D = q4.shape
        _, Sk, Hk, _ = k4.shape
        Dv = v4.shape[3]
        if k4.shape != (B, Sk, Hk, D) or v4.shape[:3] != (B, Sk, Hk):
            raise ValueError(f"shapes disagree for layout {o.layout!r}: q {q.shape}, k {k.shape}, "
                             f"v {v.shape}")
        o.cu_q = o.cu_k = None
        o.used_q = o.used_k = None
        if o.seqlens_q is not None:
            o.used_q = _int_array("seqlens_q", o.seqlens_q, B)
            if np.any(o.used_q > Sq):
                raise ValueError(f"seqlens_q {o.used_q.tolist()} exceeds Sq = {Sq}")
        if o.seqlens_k is not None:
            o.used_k = _int_array("seqlens_k", o.seqlens_k, B)
            if np.any(o.used_k > Sk):
                raise ValueError(f"seqlens_k {o.used_k.tolist()} exceeds Sk = {Sk}")
        o.q4, o.k4, o.v4 = q4, k4, v4
        o.B, o.Sq, o.Sk = B, Sq, Sk
        o.out_shape = (B, Sq, Hq, Dv) if o.layout == "bshd" else (B, Hq, Sq, Dv)
        o.lse_shape = (B, Hq, Sq)
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    for name, d in (("D", D), ("Dv", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name} = {d} is outside [1, {MAX_HEAD_DIM}]")
    o.Hq, o.Hk, o.D, o.Dv, o.varlen = Hq, Hk, D, Dv, varlen
    _check_options(o, D, Hq, o.B)
    o.bias4 = o.mask4 = None
    o.bias_heads = o.mask_heads = 1
    if o.bias is not None:
        o.bias, o.bias4, o.bias_heads = _broadcast_4d("bias", o.bias, o.B, Hq, Hk, o.Sq, o.Sk, False, varlen)
    if o.mask is not None:
        o.mask, o.mask4, o.mask_heads = _broadcast_4d("mask", o.mask, o.B, Hq, Hk, o.Sq, o.Sk, True, varlen)
    for name, x in (("bias", o.bias4), ("mask", o.mask4)):
        if isinstance(x, DevView) and (o.device != "cuda" or x.device != o.cuda_device):
            where = f"device={o.device!r}" if o.device != "cuda" else f"q on cuda:{o.cuda_device}"
            raise TypeError(f"{name} is a CUDA array on cuda:{x.device} but the call runs with {where}")
    o.acc_dtype = np.float64 if q.dtype == np.float64 else np.float32
    return o


def _host_arrays_only(name, f, device):
    """A call on host q, k, v runs score_mod / mask_mod on the host (the CPU backend's
    interpreter, or the reference), which reads NumPy arrays only: a captured CUDA array is a
    TypeError naming it, never copied to the host behind the caller's back (mod_arrays.py)."""
    for array, a in fingerprint.captured_arrays(f).items():
        if not isinstance(a, np.ndarray):
            where = "the reference" if device == "reference" else "the CPU backend's interpreter"
            raise TypeError(f"{name} captures {array!r}, a CUDA array ({type(a).__name__}), but q, k "
                            f"and v are host arrays, so {name} runs on {where}, which reads NumPy "
                            f"arrays only; pass q, k and v as CUDA arrays, or capture a NumPy copy of "
                            f"{array!r}")


def _check_device_out(name, x, shape, dtype, inputs):
    """out= for a GPU call: a CUDA array; returns its DevView."""
    dv = _device_view(x)
    if dv is None:
        raise TypeError(f"{name} must be a CUDA array like q (this call runs on the GPU), got "
                        f"{type(x).__name__}")
    _check_form(name, dv.shape, dv.dtype, shape, dtype)
    if dv.readonly:
        raise ValueError(f"{name} is read-only")
    if dv.size and any(s == 0 and n > 1 for s, n in zip(dv.strides, dv.shape)):
        raise ValueError(f"{name} has a zero stride (strides {dv.strides}): it would write one "
                         "element for several results")
    for other_name, other in inputs:
        if isinstance(other, DevView) and dv.overlaps(other):
            raise ValueError(f"{name} shares memory with {other_name}")
    return dv


@functools.lru_cache(maxsize=None)
def _memory_limit():
    """Bytes of RAM plus swap on this machine (Linux; None where the system does not say)."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    swap = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    swap = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return ram + swap


def _nbytes(shape, dtype):
    return math.prod(int(n) for n in shape) * np.dtype(dtype).itemsize


def _check_memory(o, backward, out_given=False):
    """MemoryError, before anything is allocated or computed, when the host buffers a call needs
    (its results, and the CPU backend's packed copies of its inputs) exceed the machine's RAM and
    swap: a broadcast (stride-0) input costs nothing to pass but its full size to compute on."""
    if o.on_gpu:
        return
    dt, acc, f64 = o.q.dtype, o.acc_dtype, np.float64
    if backward:
        parts = [("dq", o.q.shape, dt), ("dk", o.k.shape, dt), ("dv", o.v.shape, dt)]
    else:
        parts = [] if out_given else [("out", o.out_shape, dt)]
        parts.append(("lse", o.lse_shape, acc))
    if o.device == "reference":
        # float64 results, and one (sequence, head)'s keys and values in float64 at a time
        if backward:
            parts += [(f"float64 {n}", s, f64) for n, s, _ in parts]
        else:
            parts.append(("float64 out", o.out_shape, f64))
        parts.append(("float64 k and v of one head", (o.k4.shape[1], o.D + o.Dv), f64))
    elif o.device == "cpu":
        # the backend packs k and v (the backward also q, dout and a transposed k) in tiles
        parts += [("packed k", o.k.shape, acc), ("packed v", o.v.shape, acc)]
        if backward:
            parts += [("packed q", o.q.shape, acc), ("packed dout", o.out_shape, acc),
                      ("packed k transposed", o.k.shape, acc)]
    _check_fits(f"q {o.q.shape}, k {o.k.shape}, v {o.v.shape}", parts)


def _check_fits(who, parts):
    """MemoryError when the buffers `parts` ((name, shape, dtype), ...) that `who` needs exceed
    the machine's RAM and swap (attention's results, block_mask's tiles): raised before any of
    them is allocated, naming each."""
    limit = _memory_limit()
    if limit is None:
        return
    need = sum(_nbytes(s, d) for _, s, d in parts)
    if need > limit:
        what = ", ".join(f"{n} {tuple(s)} {np.dtype(d)}" for n, s, d in parts)
        raise MemoryError(f"attnext: {who} need at least {need / 2**30:.1f} GiB ({what}), more "
                          f"than this machine's memory ({limit / 2**30:.1f} GiB)")


def _check_form(name, got_shape, got_dtype, shape, dtype, of=""):
    """A result buffer (out=) or a backward input (dout, out, lse) of the wrong dtype is a
    TypeError, of the wrong shape a ValueError (DESIGN's errors), host and CUDA arrays alike.
    of: whose shape and dtype they must be ("the forward output's ")."""
    if got_dtype != dtype:
        raise TypeError(f"{name} must have {of}dtype {np.dtype(dtype)}, got {got_dtype}")
    if tuple(got_shape) != tuple(shape):
        raise ValueError(f"{name} must have {of}shape {tuple(shape)}, got {tuple(got_shape)}")


def _check_out(name, x, shape, dtype, inputs):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    _check_form(name, x.shape, x.dtype, shape, dtype)
    if not x.flags.writeable:
        raise ValueError(f"{name} is read-only")
    if x.size and any(s == 0 and n > 1 for s, n in zip(x.strides, x.shape)):
        raise ValueError(f"{name} has a zero stride (strides {x.strides}): it would write one "
                         "element for several results")
    for other_name, other in inputs:
        if other is not None and np.shares_memory(x, other):
            raise ValueError(f"{name} shares memory with {other_name}")


def _problem(o, out4, lse3):
    """The attribute bag _C.forward / _C.backward read (see csrc/module.c)."""
    return types.SimpleNamespace(
        dtype=_DTYPE_CODES[o.q.dtype], B=o.B,
        q=_c_view(o.q4), k=_c_view(o.k4), v=_c_view(o.v4), out=_c_view(out4), lse=lse3,
        cu_seqlens_q=o.cu_q, cu_seqlens_k=o.cu_k, seqused_q=o.used_q, seqused_k=o.used_k,
        bias=None if o.bias4 is None else _c_view(o.bias4),
        bias_dtype=_DTYPE_CODES[o.bias4.dtype] if o.bias4 is not None else 0,
        bias_heads=o.bias_heads,
        mask=o.mask4, mask_heads=o.mask_heads,
        alibi=o.alibi, alibi_dtype=_DTYPE_CODES[o.alibi.dtype] if o.alibi is not None else 0,
        scale=o.scale_value, softcap=o.softcap_value, causal=o.causal_code,
        window_left=o.window_left, window_right=o.window_right, num_threads=_num_threads(),
        mods=None)


def _cpu_mods(o, backward):
    """(the problem the C backend runs, interp.bind's mods) for a CPU call: mask_mod's band and
    documents moved into o first (attnext/lower.py), as the CUDA backend does; the problem is o,
    or o as varlen over the documents (the same memory: B = 1)."""
    ts = trace.trace_score_mod(o.score_mod) if o.score_mod is not None else None
    tm = lower.lower_mask(o, ts, trace.trace_mask_mod(o.mask_mod)) if o.mask_mod is not None else None
    return lower.kernel_problem(o), interp.bind(ts, tm, o.acc_dtype, backward=backward)


def _as_bshd(o, x):
    """A (B, S, H, D) view of an array in the caller's layout (varlen: a leading 1)."""
    if o.varlen:
        return x[None]
    return x.transpose(0, 2, 1, 3) if o.layout == "bhsd" else x


def _lse_3d(o, lse):
    return lse[None] if o.varlen else lse


def _runs_on_reference(o):
    return o.device == "reference"


def _trace_mods(o):
    """device="reference" calls score_mod / mask_mod itself on NumPy arrays (reference.py), yet
    refuses what the backends refuse: each is traced first, as the CPU backend's interp.bind
    does, so Python control flow on traced values, a wrong return type, a captured array no
    lookup can read, a builtin refusing the arguments or a constant index out of range raise
    the CPU's exception and message before the reference runs. Valid functions run as before."""
    if o.score_mod is not None:
        trace.trace_score_mod(o.score_mod)
    if o.mask_mod is not None:
        trace.trace_mask_mod(o.mask_mod)


def _has_mods(o):
    """score_mod / mask_mod with host arrays run on the CPU backend's interpreter, whatever the
    device; with CUDA arrays, the code generator's kernels (codegen.py)."""
    return o.score_mod is not None or o.mask_mod is not None


def _reference_kwargs(o):
    kw = dict(causal=o.causal, window=o.window, scale=o.scale, softcap=o.softcap,
              alibi_slopes=o.alibi_slopes, bias=o.bias, mask=o.mask, score_mod=o.score_mod,
              mask_mod=o.mask_mod)
    if o.varlen:
        kw.update(max_seqlen_q=o.max_q, max_seqlen_k=o.max_k, seqused_q=o.used_q, seqused_k=o.used_k)
    else:
        kw.update(seqlens_q=o.seqlens_q, seqlens_k=o.seqlens_k, layout=o.layout)
    return kw


def _captured_inputs(o):
    """(what, array) for every array score_mod / mask_mod captures: inputs too, which out= must
    not overlap (a head written early would change the table a later head reads). Host calls
    capture NumPy arrays only (_host_arrays_only); a CUDA array is given as its DevView, whose
    pointer range the GPU call's check compares."""
    found = []
    for kind in ("score_mod", "mask_mod"):
        f = getattr(o, kind)
        if f is None:
            continue
        for name, a in fingerprint.captured_arrays(f).items():
            found.append((f"the array {name!r} that {kind} captures",
                          a if isinstance(a, np.ndarray) else _device_view(a)))
    return found


def _forward(o):
    inputs = [("q", o.q), ("k", o.k), ("v", o.v), ("bias", o.bias), ("mask", o.mask),
              ("alibi_slopes", o.alibi_slopes), ("cu_seqlens_q", o.cu_q), ("cu_seqlens_k", o.cu_k),
              ("seqused_q", o.used_q), ("seqused_k", o.used_k)]
    if o.out is not None:
        inputs += _captured_inputs(o)
    if o.device == "cuda" and o.on_gpu:
        return _forward_on_gpu(o, inputs)
    _check_memory(o, backward=False, out_given=o.out is not None)
    gpu = o.device == "cuda" and not _has_mods(o)
    if o.out is not None:
        _check_out("out", o.out, o.out_shape, o.q.dtype, inputs)
        out = o.out
    else:
        out = _new_output(o.out_shape, o.q.dtype, pinned=gpu)
    lse = _new_output(o.lse_shape, o.acc_dtype, pinned=gpu)
    if _runs_on_reference(o):
        _trace_mods(o)
        if o.varlen:
            r_out, r_lse = reference.varlen_attention(o.q, o.k, o.v, o.cu_q, o.cu_k, return_lse=True,
                                                      **_reference_kwargs(o))
        else:
            r_out, r_lse = reference.attention(o.q, o.k, o.v, return_lse=True, **_reference_kwargs(o))
        out[...] = r_out.astype(out.dtype)
        lse[...] = r_lse
    elif o.device == "cuda" and not _has_mods(o):
        _gpu()[0].forward(o, out, lse)
    else:
        # the C backend writes through aligned element pointers; a misaligned out= gets a copy
        target = out if out.flags.aligned else _new_output(o.out_shape, o.q.dtype)
        ko, mods = _cpu_mods(o, backward=False)
        prob = _problem(ko, _as_bshd(o, target), _lse_3d(o, lse))
        prob.mods = mods
        _C.forward(prob)
        if target is not out:
            out[...] = target
    return (out, lse) if o.return_lse else out


def _forward_on_gpu(o, inputs):
    """CUDA arrays in, the caller's library's arrays out (or out= written in place)."""
    cuda_backend, device = _gpu()
    user_out = o.out
    if o.out is not None:
        o.out = _check_device_out("out", o.out, o.out_shape, o.q.dtype, inputs)
    out, lse = cuda_backend.forward(o, None, None)
    out = user_out if user_out is not None else device.to_caller(out, o.like)
    return (out, device.to_caller(lse, o.like)) if o.return_lse else out


def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
              bias=None, mask=None, score_mod=None, mask_mod=None, seqlens_q=None, seqlens_k=None,
              layout="bshd", return_lse=False, device=None, out=None, precision=None):
    """Scaled-dot-product attention; see the module docstring for the causal alignment.

    q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) for layout "bshd" ("bhsd": heads
    second). Returns out (the caller's layout, Dv wide, q's dtype) and with return_lse the
    natural-log lse (B, Hq, Sq), float32 (float64 for float64 inputs). Rows that keep no key give
    out = 0 and lse = -inf.
    """
    o = _normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=seqlens_q,
        seqlens_k=seqlens_k, layout=layout, return_lse=return_lse, device=device, out=out,
        precision=precision))
    return _forward(o)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                     seqused_q=None, seqused_k=None, causal=False, window=None, scale=None,
                     softcap=None, alibi_slopes=None, bias=None, mask=None, score_mod=None,
                     mask_mod=None, return_lse=False, device=None, out=None, precision=None):
    """Attention over a packed batch: q (Tq, Hq, D), k (Tk, Hk, D), v (Tk, Hk, Dv).

    Sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]; with seqused, only its first seqused[i]
    rows are real. Rows that are not real (and rows after cu_seqlens[-1]) give out = 0 and
    lse = -inf. lse is (Hq, Tq). bias and mask broadcast to (B, H, max_seqlen_q, max_seqlen_k),
    indexed by sequence and positions inside it.
    """
    o = _normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=None,
        seqlens_k=None, layout="thd", return_lse=return_lse, device=device, out=out,
        precision=precision), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
        seqused_k, varlen=True)
    return _forward(o)


def _backward(o, dout, out, lse, deterministic):
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {_fmt(deterministic)}")
    dout = _float_array("dout", dout)
    out = _float_array("out", out)
    lse = _float_array("lse", lse)
    for name, x in (("dout", dout), ("out", out)):
        _check_form(name, x.shape, x.dtype, o.out_shape, o.q.dtype, of="the forward output's ")
    _check_form("lse", lse.shape, lse.dtype, o.lse_shape, o.acc_dtype)
    if o.device == "cuda" and o.on_gpu:
        return _backward_on_gpu(o, dout, out, lse, deterministic)
    on_host = o.device != "cuda" or _runs_on_reference(o) or _has_mods(o)
    if on_host and any(isinstance(x, DevView) for x in (dout, out, lse)):
        raise TypeError("dout, out and lse are CUDA arrays but q, k, v live on the host; pass all "
                        "of them on the GPU or all on the host")
    _check_memory(o, backward=True)
    if _runs_on_reference(o):
        _trace_mods(o)
        if o.varlen:
            g = reference.varlen_attention_backward(dout, o.q, o.k, o.v, out, lse, o.cu_q, o.cu_k,
                                                    **_reference_kwargs(o))
        else:
            g = reference.attention_backward(dout, o.q, o.k, o.v, out, lse, **_reference_kwargs(o))
        dbias = None if g.dbias is None else g.dbias.astype(o.bias.dtype)
        return Grads(g.dq.astype(o.q.dtype), g.dk.astype(o.q.dtype), g.dv.astype(o.q.dtype),
                     dbias, g.dtensors)
    gpu = o.device == "cuda" and not _has_mods(o)
    dq = _new_output(o.q.shape, o.q.dtype, pinned=gpu)
    dk = _new_output(o.k.shape, o.q.dtype, pinned=gpu)
    dv = _new_output(o.v.shape, o.q.dtype, pinned=gpu)
    if gpu:
        cuda_backend = _gpu()[0]
        dbias_acc = None
        if o.bias is not None:
            dbias_acc = np.zeros((1,) * (4 - o.bias.ndim) + o.bias.shape, dtype=o.acc_dtype)
        cuda_backend.backward(o, dout, out, lse, dq, dk, dv, dbias_acc, deterministic)
        dbias = None if dbias_acc is None else dbias_acc.reshape(o.bias.shape).astype(o.bias.dtype)
        return Grads(dq, dk, dv, dbias, {})
    ko, mods = _cpu_mods(o, backward=True)
    prob = _problem(ko, _as_bshd(o, out), _lse_3d(o, lse))
    prob.dout = _c_view(_as_bshd(o, dout))
    prob.dq, prob.dk, prob.dv = (_c_view(_as_bshd(o, x)) for x in (dq, dk, dv))
    prob.dbias = dbias_acc = None
    prob.mods = mods
    if o.bias is not None:
        # accumulate into the bias's own (compact) shape; broadcast dims get stride 0
        compact = o.bias.reshape((1,) * (4 - o.bias.ndim) + o.bias.shape)
        dbias_acc = np.zeros(compact.shape, dtype=o.acc_dtype)
        target = o.bias4.shape
        strides = tuple(0 if c == 1 and t != 1 else s
                        for c, t, s in zip(compact.shape, target, dbias_acc.strides))
        prob.dbias = np.lib.stride_tricks.as_strided(dbias_acc, target, strides)
    _C.backward(prob)
    dbias = None if dbias_acc is None else dbias_acc.reshape(o.bias.shape).astype(o.bias.dtype)
    return Grads(dq, dk, dv, dbias, interp.dtensors(prob.mods))


def _backward_on_gpu(o, dout, out, lse, deterministic):
    """CUDA arrays in, gradients back as the caller's library's arrays."""
    cuda_backend, device = _gpu()
    dq, dk, dv, dbias = cuda_backend.backward(o, dout, out, lse, None, None, None, None, deterministic)
    dq, dk, dv = (device.to_caller(x, o.like) for x in (dq, dk, dv))
    dbias = None if dbias is None else device.to_caller(dbias, o.like)
    return Grads(dq, dk, dv, dbias, getattr(o, "dtensors", {}))


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, scale=None,
                       softcap=None, alibi_slopes=None, bias=None, mask=None, score_mod=None,
                       mask_mod=None, seqlens_q=None, seqlens_k=None, layout="bshd", device=None,
                       precision=None, deterministic=True):
    """Gradients of attention(q, k, v, ...) for the output gradient dout.

    out and lse are the forward's results (lse as returned with return_lse=True). Returns
    Grads(dq, dk, dv, dbias, dtensors): dq, dk, dv in the shapes of q, k, v; dbias in the shape
    of the bias given (summed over its broadcast dims), None without one. The CPU backend is
    deterministic whatever `deterministic` says.
    """
    o = _normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=seqlens_q,
        seqlens_k=seqlens_k, layout=layout, return_lse=False, device=device, out=None,
        precision=precision))
    return _backward(o, dout, out, lse, deterministic)


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                              seqused_k=None, causal=False, window=None, scale=None, softcap=None,
                              alibi_slopes=None, bias=None, mask=None, score_mod=None,
                              mask_mod=None, device=None, precision=None, deterministic=True):
    """Gradients of varlen_attention; padding rows get exactly zero gradients."""
    o = _normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=None,
        seqlens_k=None, layout="thd", return_lse=False, device=device, out=None,
        precision=precision), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
        seqused_k, varlen=True)
    return _backward(o, dout, out, lse, deterministic)


# The caches of compiled score_mod / mask_mod programs, by backend: name -> function returning
# a dict with at least hits, misses, compiles and compile_seconds ("cuda": the generated
# sources; NVRTC's cubins are nvrtc.cache_info()).
_PROGRAM_CACHES = {"cpu": interp.cache_info, "cuda": codegen.cache_info}


def cache_info():
    """Counters of the score_mod / mask_mod program caches: hits, misses, compiles and
    compile_seconds summed over the backends, and each backend's own counters under its name
    ("cpu": the interpreter's lowered programs, "cuda": the generated CUDA sources, both keyed by
    the graph's structure)."""
    per = {name: fn() for name, fn in _PROGRAM_CACHES.items()}
    total = {k: sum(p[k] for p in per.values())
             for k in ("hits", "misses", "compiles", "compile_seconds")}
    return {**total, **per}


def info():
    """What this build can run, and why not where it cannot."""
    from . import __version__
    from .cuda import backend as cuda_backend, nvrtc
    why = cuda_backend.unavailable_reason()
    device_name = None
    if not why:
        d = cuda_backend.device_info(0)
        device_name = f"{d['name']} (sm_{d['compute_capability'][0]}{d['compute_capability'][1]})"
    try:
        nvrtc_version = ".".join(map(str, nvrtc.nvrtc()))
    except RuntimeError:
        nvrtc_version = None
    cache = nvrtc.cache_info()
    return {
        "version": __version__,
        "backends": {
            "reference": "usable",
            "cpu": f"usable ({_C.simd()} SIMD, "
                   f"{'OpenMP, %d threads' % _C.openmp_threads() if _C.openmp_threads() else 'no OpenMP: serial'})",
            "cuda": "usable (float16, bfloat16)" if not why else f"unavailable: {why}",
        },
        "score_mod": "NumPy inputs: the CPU backend's interpreter (forward, backward, mask_mod block "
                     "skipping), whatever the device; CUDA arrays: generated CUDA code compiled "
                     "into the kernels (forward, backward; no block skipping yet)",
        "device_name": device_name,
        "nvrtc_version": nvrtc_version,
        "cache_dir": cache["cache_dir"] if cache else None,
    }
