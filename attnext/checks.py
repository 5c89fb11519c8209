"""Argument checking: every public call is checked here and normalised into one Problem.

A Problem holds q, k, v and out in (B, S, H, D) order as strided views (NumPy arrays, or DevViews
of CUDA arrays), bias and mask as views broadcast to (B, Hb, Sq, Sk) without copying, lengths as
int32, and the options as the codes the backends read. TypeError for wrong types and dtypes,
ValueError for shapes, lengths and options that disagree (naming the argument and the values),
MemoryError before anything is allocated when the host buffers a call needs exceed the machine.
"""
import functools
import inspect
import math
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import numpy as np

from . import _env, interop
from ._layout import NUMPY_DTYPES
from .cuda.devview import DevView, may_be_device_array
from .mods import fingerprint, grad, trace


@dataclass(slots=True)
class Problem:
    """One checked call, as the backends (api.py, cuda/backend.py, mods/lower.py) read it.

    The caller's keywords keep their names (causal, window, ..., out, precision); what the checks
    derive is below them. Sizes: B batch (varlen: sequences), Sq / Sk the query / key lengths
    (varlen: max_seqlen_q / max_seqlen_k), Hq / Hk heads, D / Dv head dims. q4, k4, v4: (B, S, H, D)
    views of q, k, v (varlen: a leading 1); bias4 / mask4: (B, Hb, Sq, Sk) broadcast views, Hb
    being bias_heads / mask_heads. Lowering (mods/lower.py) may narrow causal_code and the window
    or set documents; the CUDA backend sets the fields under "set by the backends"."""
    # the caller's keywords
    causal: Any = False
    window: Any = None
    scale: Any = None
    softcap: Any = None
    alibi_slopes: Any = None
    bias: Any = None
    mask: Any = None
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    seqlens_q: Any = None
    seqlens_k: Any = None
    layout: str = "bshd"            # "bshd", "bhsd", or "thd" for varlen
    return_lse: bool = False
    device: Optional[str] = None    # after the checks: "cpu", "cuda" or "reference"
    out: Any = None
    precision: Optional[str] = None
    sinks: Any = None
    block_table: Any = None         # after the checks: int32 (B, max_pages), C-contiguous
    # where the call runs
    like: Any = None                # q as given: a GPU call's results come back as its library's
    on_gpu: bool = False
    cuda_device: int = 0
    cuda_stream: int = 0
    # the arrays and sizes
    q: Any = None
    k: Any = None
    v: Any = None
    q4: Any = None
    k4: Any = None
    v4: Any = None
    B: int = 0
    Sq: int = 0
    Sk: int = 0
    Hq: int = 0
    Hk: int = 0
    D: int = 0
    Dv: int = 0
    varlen: bool = False
    max_q: int = 0
    max_k: int = 0
    cu_q: Any = None                # NumPy int32 arrays the host checked, or DevViews (device_lengths)
    cu_k: Any = None
    used_q: Any = None
    used_k: Any = None
    device_lengths: bool = False    # cu_q .. used_k are CUDA arrays the host never reads (cuda/lengths.py)
    out_shape: tuple = ()
    lse_shape: tuple = ()
    acc_dtype: Any = None
    # the options as codes
    scale_value: float = 0.0
    softcap_value: float = 0.0
    causal_code: int = 0            # 0 none, 1 bottom-right, 2 top-left
    window_left: int = -1
    window_right: int = -1
    alibi: Optional[np.ndarray] = None
    sink_values: Any = None         # sinks (Hq,): host ones in acc_dtype, CUDA ones float32 (a DevView)
    page_size: int = 0              # paged k / v (block_table): rows a page; Sk = max_pages * page_size
    bias4: Any = None
    mask4: Any = None
    bias_heads: int = 1
    mask_heads: int = 1
    documents: Optional[np.ndarray] = None   # mods/lower.py: cu_seqlens of a document mask_mod
    documents_read: Any = None      # (captured array's name, the values documents were read from)
    # set by the backends
    mods_lowered: bool = False      # the mask_mod went into the call's own features
    dtensors: Optional[dict] = None # the captured arrays' gradients of a GPU backward
    dtensors_asked: Optional[frozenset] = None   # the backward's dtensors= (None: every array)
    repeat_key: Any = None          # the key of a call that may replay (cuda/repeat.py)
    lengths_check: Any = None       # the device lengths' check launch (cuda/lengths.py: Check)
    recipe: Any = None              # a GPU forward's launches, for a replay (cuda/backend.py)
    whole_rows: Optional[int] = None   # a row slice of a longer sequence (cuda/backend.py)
    lse_rows: Any = None


_DEVICES = ("cpu", "cuda", "reference")
_LAYOUTS = ("bshd", "bhsd")
_CAUSAL = {False: 0, None: 0, True: 1, "bottom_right": 1, "top_left": 2}
_PRECISIONS = (None, "tf32")
MAX_THREADS = 1024
MAX_HEAD_DIM = 256


def fmt(x):
    return repr(x) if not isinstance(x, np.ndarray) else f"array(shape={x.shape}, dtype={x.dtype})"


_GPU_MODULES = []


def gpu_modules():
    """(cuda_backend, device), imported on the first GPU call: `import attnext` does not load
    the CUDA host side, and a `from . import` inside a function costs ~1 us on every call."""
    if not _GPU_MODULES:
        from .cuda import arrays, backend
        _GPU_MODULES[:] = (backend, arrays)
    return _GPU_MODULES


def device_view(x):
    """A DevView of a CUDA array (__cuda_array_interface__ / __dlpack__), None for host data."""
    if not may_be_device_array(x):
        return None
    return gpu_modules()[1].as_device_view(x)


def _cuda_view(name, x):
    """device_view, its TypeErrors (a dtype, byte order or refusal of the producer) naming the
    argument."""
    try:
        return device_view(x)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None


def _array(name, x, host=False):
    """A host array (never copied unless misaligned: another library's, a torch CPU tensor or a
    JAX CPU array, as NumPy's view of its memory, attnext.interop), or a DevView of a CUDA array
    (host=True: copied to the host, for the small arrays the checks read). Non-arrays raise
    TypeError."""
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
        a = gpu_modules()[0].to_host(dv)
    elif (h := interop.host_view(name, x)) is not None:     # a torch CPU tensor, a JAX CPU array
        a = h
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


# keywords of torch's flex_attention / scaled_dot_product_attention: what attnext spells instead
_FOREIGN_KEYWORDS = {
    "attn_mask": "write mask= (a bool array, True = attend) or bias= (a float array added to the "
                 "scores)",
    "is_causal": "write causal=True (aligned bottom-right when Sq != Sk; SDPA's is_causal is "
                 "causal='top_left')",
    "enable_gqa": "leave it out: grouped-query attention is automatic when Hq is a multiple of Hk",
    "dropout_p": "leave it out: attnext has no dropout",
    "return_aux": "write return_lse=True (out, lse)",
    "kernel_options": "leave it out: attnext picks its tiles itself",
}


def _block_mask_message(x):
    own = (" (a torch BlockMask: mask_mod=block_mask.mask_mod, written with NumPy)"
           if hasattr(x, "mask_mod") else "")
    return (f"pass the mask function itself as mask_mod=fn, fn(b, h, q_idx, kv_idx) -> bool{own}. "
            f"attnext evaluates mask_mod tile by tile at every call and skips the tiles it masks "
            f"entirely, so there is no block mask to build first; attnext.block_mask(mask_mod, "
            f"Sq, Sk) only shows those tiles (a notebook's picture, not an argument)")


_F = TypeVar("_F", bound=Callable[..., Any])


def flex_keywords(fn: _F) -> _F:
    """fn (a public function) with a TypeError that says what to write instead when it is
    called with a keyword of torch's flex_attention or scaled_dot_product_attention
    (block_mask=, attn_mask=, is_causal=, ...) in place of Python's "unexpected keyword"."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeError as e:
            if "block_mask" in kwargs:
                raise TypeError(f"{e}: {_block_mask_message(kwargs['block_mask'])}") from None
            for key in kwargs:
                if key in _FOREIGN_KEYWORDS:
                    raise TypeError(f"{e} (a keyword of torch's scaled_dot_product_attention / "
                                    f"flex_attention): {_FOREIGN_KEYWORDS[key]}") from None
            raise
    return call  # type: ignore[return-value]


def float_array(name, x):
    a = _array(name, x)
    if a.dtype not in NUMPY_DTYPES:
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


def _resolve_device(device, q, k, v):
    """The backend for this call. CUDA arrays run on the GPU. device=None (or ATTNEXT_DEVICE)
    picks the GPU for host arrays when it is usable and has kernels for their dtype (float16,
    bfloat16, float32), else the CPU."""
    if device is not None and device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES} or None, got {device!r}")
    on_gpu = [isinstance(x, DevView) for x in (q, k, v)]
    if any(on_gpu) and not all(on_gpu):
        where = ", ".join(f"{n} on {'cuda' if g else 'the host'}" for n, g in zip("qkv", on_gpu))
        raise TypeError(f"q, k and v must all live on the GPU or all on the host, got {where}")
    cuda_backend = gpu_modules()[0]
    if on_gpu[0]:
        if len({x.device for x in (q, k, v)}) > 1:
            raise ValueError(f"q, k and v live on different GPUs: cuda:{q.device}, cuda:{k.device}, "
                             f"cuda:{v.device}")
        if device not in (None, "cuda"):
            raise ValueError(f"device={device!r} cannot read q, k, v: they are CUDA arrays "
                             f"(on cuda:{q.device}); pass device='cuda' or None")
        device = "cuda"
    elif device is None:
        device = _env.get("ATTNEXT_DEVICE") or None
        if device is not None and device not in _DEVICES:
            raise ValueError(f"ATTNEXT_DEVICE: device must be one of {_DEVICES}, got {device!r}")
        if device is None:
            device = "cuda" if q.dtype in cuda_backend.DTYPES and cuda_backend.usable() else "cpu"
    if device == "cuda":
        why = cuda_backend.unavailable_reason()
        if why:
            raise RuntimeError(f"device='cuda': the CUDA backend is unavailable: {why}")
        if q.dtype not in cuda_backend.DTYPES:
            raise TypeError(f"device='cuda' runs float16, bfloat16 and float32; q has dtype {q.dtype} "
                            "(float64 stays on the CPU)")
    return device


def _num_threads():
    env = _env.get("ATTNEXT_NUM_THREADS")
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


def check_arity(name, f):
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
    """Checks the scalar and small-array options; fills their codes into o (a Problem)."""
    if not isinstance(o.return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {fmt(o.return_lse)}")
    if o.scale is None:
        o.scale_value = 1.0 / math.sqrt(D)
    else:
        if not _is_real(o.scale):
            raise TypeError(f"scale must be a real number, got {fmt(o.scale)}")
        if not math.isfinite(_float_value(o.scale)):
            raise ValueError(f"scale must be finite, got {o.scale!r}")
        o.scale_value = float(o.scale)
    if o.softcap is None:
        o.softcap_value = 0.0
    else:
        if not _is_real(o.softcap):
            raise TypeError(f"softcap must be a positive real number, got {fmt(o.softcap)}")
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
        # no query is farther than Sq + Sk from a key: a wider side is unbounded, and clamping
        # keeps the kernels' int64 index arithmetic from wrapping
        far = o.Sq + o.Sk
        o.window_left, o.window_right = (min(x, far) for x in window_pair(o.window))
    if o.precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {o.precision!r}")
    for name in ("score_mod", "mask_mod"):
        f = getattr(o, name)
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be callable or None, got {type(f).__name__}")
        if f is not None:
            check_arity(name, f)
            if o.device != "cuda":
                _host_arrays_only(name, f, o.device)
    o.alibi = None
    if o.alibi_slopes is not None:
        a = _array("alibi_slopes", o.alibi_slopes, host=True)
        if a.dtype not in NUMPY_DTYPES:
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
    if not is_mask and a.dtype not in NUMPY_DTYPES:
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


def _host_lengths(o, lengths, Tq, Tk, max_seqlen_q, max_seqlen_k):
    """varlen's lengths read on the host (copied there from a GPU: a synchronisation) and checked
    there: o.B, o.cu_q, o.cu_k, o.used_q, o.used_k (int32 NumPy arrays), o.max_q, o.max_k."""
    cq_a = _array("cu_seqlens_q", lengths["cu_seqlens_q"], host=True)
    ck_a = _array("cu_seqlens_k", lengths["cu_seqlens_k"], host=True)
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
    if lengths["seqused_q"] is not None:
        uq = _int_array("seqused_q", lengths["seqused_q"], B)
        if np.any(uq > seg_q):
            raise ValueError(f"seqused_q {uq.tolist()} exceeds the segment lengths {seg_q.tolist()}")
    if lengths["seqused_k"] is not None:
        uk = _int_array("seqused_k", lengths["seqused_k"], B)
        if np.any(uk > seg_k):
            raise ValueError(f"seqused_k {uk.tolist()} exceeds the segment lengths {seg_k.tolist()}")
    lq = uq if uq is not None else seg_q
    lk = uk if uk is not None else seg_k
    longest_q = int(lq.max()) if B else 0
    longest_k = int(lk.max()) if B else 0
    for name, m, longest in (("max_seqlen_q", max_seqlen_q, longest_q),
                             ("max_seqlen_k", max_seqlen_k, longest_k)):
        if m is not None and _max_seqlen(name, m) < longest:
            raise ValueError(f"{name} = {m} is smaller than the longest sequence ({longest})")
    o.max_q = longest_q if max_seqlen_q is None else int(max_seqlen_q)
    o.max_k = longest_k if max_seqlen_k is None else int(max_seqlen_k)
    o.cu_q, o.cu_k, o.used_q, o.used_k = cq, ck, uq, uk
    o.B = B


def _max_seqlen(name, m):
    """max_seqlen_q / _k as an int in [0, 2**31)."""
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {fmt(m)}")
    if m < 0:
        raise ValueError(f"{name} = {m} is negative")
    if m > np.iinfo(np.int32).max:
        raise ValueError(f"{name} = {m} is past the largest sequence length (2**31 - 1)")
    return int(m)


def _device_lengths(o, lengths, max_seqlen_q, max_seqlen_k):
    """Whether varlen's lengths stay on the GPU (cuda/lengths.py), as FlashAttention's do: q, k, v
    and cu_seqlens_q are CUDA arrays and max_seqlen_q and max_seqlen_k are given. Every lengths
    array given must then be a contiguous CUDA int32 array on q's device, of shape (B + 1,) for
    cu_seqlens_*, (B,) for seqused_*; their values are the GPU's to check (each segment at most
    max_seqlen_* rows, seqused inside its segment), reported by the next call. Sets o.B,
    o.cu_q .. o.used_k (their DevViews), o.max_q, o.max_k and o.device_lengths."""
    if not o.on_gpu or max_seqlen_q is None or max_seqlen_k is None:
        return False
    first = lengths["cu_seqlens_q"]
    views = {"cu_seqlens_q": _cuda_view("cu_seqlens_q", first) if may_be_device_array(first) else None}
    if views["cu_seqlens_q"] is None:
        return False
    how = ("cu_seqlens_q is a CUDA array and max_seqlen_* are given, so the lengths are read on "
           "the GPU without a synchronisation")
    for name, x in lengths.items():
        if name in views:
            dv = views[name]
        else:
            dv = None if x is None or not may_be_device_array(x) else _cuda_view(name, x)
        if x is not None and dv is None:
            raise TypeError(f"{name} is a host array but {how}: pass every lengths array as a CUDA "
                            f"array, or leave max_seqlen_* out to have them read and checked on the "
                            f"host")
        if dv is not None:
            if dv.dtype != np.int32:
                raise TypeError(f"{name} has dtype {dv.dtype}; {how}, and must be int32 (as "
                                f"FlashAttention's): pass it as int32, or leave max_seqlen_* out to "
                                f"have it read and checked on the host")
            if dv.ndim != 1 or (dv.shape[0] > 1 and dv.strides[0] != 1):
                raise ValueError(f"{name} must be a contiguous 1-d array, got shape {dv.shape} with "
                                 f"element strides {dv.strides}")
            if dv.device != o.cuda_device:
                raise ValueError(f"{name} is on cuda:{dv.device}, q on cuda:{o.cuda_device}")
        views[name] = dv
    cq, ck = views["cu_seqlens_q"], views["cu_seqlens_k"]
    if cq.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must have shape (B + 1,), got {cq.shape}")
    B = cq.shape[0] - 1
    if ck.shape != cq.shape:
        raise ValueError(f"cu_seqlens_k must have shape {cq.shape} like cu_seqlens_q (B + 1 = "
                         f"{B + 1} entries), got {ck.shape}")
    for name in ("seqused_q", "seqused_k"):
        if views[name] is not None and views[name].shape != (B,):
            raise ValueError(f"{name} must have shape ({B},), got {views[name].shape}")
    o.max_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    o.max_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    o.cu_q, o.cu_k, o.used_q, o.used_k = cq, ck, views["seqused_q"], views["seqused_k"]
    o.B, o.device_lengths = B, True
    return True


def window_pair(w):
    """window=(left, right) as two Python ints, each -1 (unbounded) or >= 0; else ValueError."""
    if (not isinstance(w, (tuple, list)) or len(w) != 2
            or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in w)):
        raise ValueError(f"window must be a pair of ints (left, right), -1 = unbounded, got {w!r}")
    if w[0] < -1 or w[1] < -1:
        raise ValueError(f"window sides must be >= -1 (-1 = unbounded), got {tuple(w)!r}")
    return int(w[0]), int(w[1])


def normalise(q, k, v, opts, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
              max_seqlen_k=None, seqused_q=None, seqused_k=None, varlen=False) -> "Problem":
    """Checks q, k, v and every option (opts: the public function's keywords); returns the
    Problem with the views the backends read."""
    o = Problem(**opts)
    o.like = q                  # results of a GPU call come back as q's library's arrays
    q = float_array("q", q)
    k = float_array("k", k)
    v = float_array("v", v)
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
    if varlen and o.block_table is not None:
        Tq, Hq, D, Hk, Dv = _paged_varlen(o, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q,
                                          seqused_k)
    elif varlen:
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
        lengths = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                       seqused_k=seqused_k)
        if not _device_lengths(o, lengths, max_seqlen_q, max_seqlen_k):
            _host_lengths(o, lengths, Tq, Tk, max_seqlen_q, max_seqlen_k)
        o.q4, o.k4, o.v4 = q[None], k[None], v[None]
        o.Sq, o.Sk = o.max_q, o.max_k
        o.out_shape, o.lse_shape = (Tq, Hq, Dv), (Hq, Tq)
    else:
        if o.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {o.layout!r}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim != 4:
                raise ValueError(f"{name} must have 4 dims for layout {o.layout!r}, got shape {x.shape}")
        if o.layout == "bhsd":
            if o.block_table is not None:
                raise ValueError("block_table (a paged cache) takes layout='bshd': q (B, Sq, Hq, D), "
                                 "k and v (num_pages, page_size, Hk, D)")
            q4, k4, v4 = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        else:
            q4, k4, v4 = q, k, v
        B, Sq, Hq, D = q4.shape
        _, Sk, Hk, _ = k4.shape
        Dv = v4.shape[3]
        if o.block_table is not None:
            Sk = _paged(o, k4, v4, B, D)
        elif k4.shape != (B, Sk, Hk, D) or v4.shape[:3] != (B, Sk, Hk):
            raise ValueError(f"shapes disagree for layout {o.layout!r}: q {q.shape}, k {k.shape}, "
                             f"v {v.shape}")
        o.cu_q = o.cu_k = None
        o.used_q = o.used_k = None
        if o.seqlens_q is not None:
            o.used_q = _int_array("seqlens_q", o.seqlens_q, B)
            if np.any(o.used_q > Sq):
                raise ValueError(f"seqlens_q {o.used_q.tolist()} exceeds Sq = {Sq}")
        if o.seqlens_k is not None:
            o.used_k = _seqlens_k_in_place(o, B)
        if o.seqlens_k is not None and o.used_k is None:
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
    o.sink_values = None if o.sinks is None else _sinks(o)
    if o.block_table is not None:
        _check_pages(o)
    return o


def _paged_varlen(o, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k):
    """varlen over a paged cache: q (Tq, Hq, D) packed by cu_seqlens_q; k, v pages; sequence b's
    keys are its block_table row, seqused_k[b] of them (else cu_seqlens_k's segment lengths,
    which then say only that). Fills what _host_lengths and the padded branch fill; returns
    (Tq, Hq, D, Hk, Dv)."""
    if q.ndim != 3 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"varlen over a paged cache takes q (Tq, Hq, D) and k, v (num_pages, page_size, "
                         f"Hk, D): got q {q.shape}, k {k.shape}, v {v.shape}")
    Tq, Hq, D = q.shape
    Hk, Dv = k.shape[2], v.shape[3]
    if cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q is required")
    if seqused_k is None and cu_seqlens_k is None:
        raise ValueError("varlen over a paged cache needs the keys' lengths: seqused_k, or cu_seqlens_k")
    # q's lengths as _host_lengths checks them (k's stand-in: q's own, then replaced)
    _host_lengths(o, dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_q, seqused_q=seqused_q,
                          seqused_k=None), Tq, Tq, max_seqlen_q, None)
    Sk = _paged(o, k, v, o.B, D)
    if seqused_k is not None:
        used = _int_array("seqused_k", seqused_k, o.B)
    else:
        ck = _int_array("cu_seqlens_k", cu_seqlens_k, o.B + 1)
        used = np.diff(ck).astype(np.int32)
        if ck[0] != 0 or np.any(used < 0):
            raise ValueError(f"cu_seqlens_k must start at 0 and not decrease, got {ck.tolist()}")
    if np.any(used > Sk):
        raise ValueError(f"the keys' lengths {used.tolist()} exceed the block_table's {Sk} rows")
    o.cu_k, o.used_k = None, used
    o.max_k = int(used.max()) if o.B else 0
    o.q4, o.k4, o.v4 = q[None], k, v
    o.Sq, o.Sk = o.max_q, Sk
    o.out_shape, o.lse_shape = (Tq, Hq, Dv), (Hq, Tq)
    return Tq, Hq, D, Hk, Dv


def _paged(o, k, v, B, D):
    """block_table= checked against k, v (num_pages, page_size, Hk, D / Dv): o.block_table
    becomes a host int64 copy (int32 once _check_pages has checked the pages a sequence reads,
    when the lengths are known), or on a GPU call a CUDA int32 table as its DevView (checked on
    the device); o.page_size set; returns the keys' padded length max_pages * page_size."""
    n_pages, page_size, Hk, _ = k.shape
    if k.shape[3] != D or v.shape[:3] != (n_pages, page_size, Hk):
        raise ValueError(f"with block_table, k and v are (num_pages, page_size, Hk, D / Dv): got k "
                         f"{k.shape}, v {v.shape} (D = {D})")
    if page_size < 1:
        raise ValueError(f"with block_table, k and v need pages of at least one row, got k {k.shape}")
    bt = _array("block_table", o.block_table, host=o.device != "cuda")
    if bt.dtype.kind not in "iu" or bt.ndim != 2 or bt.shape[0] != B:
        raise ValueError(f"block_table must be an int array (B, max_pages) = ({B}, max_pages), got "
                         f"{bt.dtype} {bt.shape}")
    o.page_size = int(page_size)
    if isinstance(bt, DevView):       # a GPU call's CUDA table: read in place, checked on the GPU
        if bt.device != o.cuda_device or bt.dtype != np.int32 or (bt.shape[1] > 1 and bt.strides[1] != 1):
            raise TypeError(f"block_table as a CUDA array must be int32 with contiguous rows on the call's "
                            f"device (cuda:{o.cuda_device}), got {bt.dtype} with strides {bt.strides} on "
                            f"cuda:{bt.device}; convert it, or pass a host array")
        o.block_table = bt
    else:
        o.block_table = np.ascontiguousarray(bt, np.int64)
    return bt.shape[1] * page_size


def _seqlens_k_in_place(o, B):
    """A paged decode's seqlens_k read where it lies (no synchronisation, as FlashAttention's
    cache_seqlens): a CUDA int32 array (B,) beside a CUDA block_table, on a call whose q, k, v
    are CUDA arrays, with no mask_mod (whose block mask the host builds from the lengths). Its
    values are checked on the GPU by attn_pages (0 <= seqlens_k[b] <= Sk; the next call raises
    ValueError) and clamped by the kernels meanwhile. None where the host reads it instead."""
    if isinstance(o.seqlens_k, np.ndarray) or not (isinstance(o.block_table, DevView) and o.on_gpu
                                                  and o.mask_mod is None):
        return None
    a = _array("seqlens_k", o.seqlens_k)
    if not isinstance(a, DevView):
        return None
    if a.device != o.cuda_device or a.dtype != np.int32 or a.shape != (B,) or (B > 1 and a.strides[0] != 1):
        raise TypeError(f"seqlens_k as a CUDA array beside a CUDA block_table must be contiguous int32 of "
                        f"shape ({B},) on the call's device (cuda:{o.cuda_device}), got {a.dtype} {a.shape} "
                        f"with strides {a.strides} on cuda:{a.device}; convert it, or pass a host array")
    return a


def _check_pages(o):
    """Every page a sequence reads (those covering its length) lies in [0, num_pages): IndexError
    naming the first that does not (entries past a sequence's pages are not read). A CUDA table
    is checked on the GPU instead (cuda/lengths.py: launch_pages)."""
    if isinstance(o.block_table, DevView):
        return
    n_pages = o.k4.shape[0]
    lengths = o.used_k if o.used_k is not None else np.full(o.B, o.Sk)
    for b, n in enumerate(lengths):
        need = -(-int(n) // o.page_size)
        row = o.block_table[b, :need]
        bad = np.flatnonzero((row < 0) | (row >= n_pages))
        if bad.size:
            j = int(bad[0])
            raise IndexError(f"block_table[{b}, {j}] = {int(row[j])} is out of range for {n_pages} pages "
                             f"(sequence {b} reads {need} pages of its {int(n)} keys)")
    o.block_table = o.block_table.astype(np.int32)


def _sinks(o):
    """sinks= checked: a host array (Hq,) of any float dtype, as acc_dtype (finite, or -inf for
    no sink), or on a GPU call a CUDA float32 array (Hq,) read in place (its values unchecked)."""
    a = _array("sinks", o.sinks)
    if isinstance(a, DevView):
        if o.device != "cuda" or a.device != o.cuda_device:
            where = f"device={o.device!r}" if o.device != "cuda" else f"q on cuda:{o.cuda_device}"
            raise TypeError(f"sinks is a CUDA array on cuda:{a.device} but the call runs with {where}")
        if a.dtype != np.float32 or a.shape != (o.Hq,) or (o.Hq > 1 and a.strides[0] != 1):
            raise TypeError(f"sinks as a CUDA array must be contiguous float32 of shape ({o.Hq},), "
                            f"got {a.dtype} {a.shape} with strides {a.strides}; convert it "
                            "(sinks.float()) or pass a host array")
        return a
    if a.dtype not in NUMPY_DTYPES:
        raise TypeError(f"sinks must be a float array, got dtype {a.dtype}")
    if a.shape != (o.Hq,):
        raise ValueError(f"sinks must have shape ({o.Hq},) (one logit per query head), got {a.shape}")
    a = np.ascontiguousarray(a, dtype=o.acc_dtype)
    if np.isnan(a).any() or (a == np.inf).any():
        raise ValueError(f"sinks must be finite (or -inf: no sink), got {a.tolist()[:8]}")
    return a


def _host_arrays_only(name, f, device):
    """A call on the CPU backend or the reference runs score_mod / mask_mod on the host (the
    interpreter, or the reference's call), which reads host arrays only (NumPy's, or NumPy's
    view of another library's: attnext.interop): a captured CUDA array is a TypeError naming
    it, never copied to the host behind the caller's back (mod_inputs.py). A call on the GPU
    reads it in place, whether q, k and v are CUDA or host arrays."""
    try:
        views = fingerprint.captured_views(f)
    except (TypeError, ValueError) as e:      # an array its library does not share
        raise type(e)(f"{name}: {e}") from None
    for array, a in views.items():
        if not isinstance(a, np.ndarray):
            where = "the reference" if device == "reference" else "the CPU backend's interpreter"
            kind = type(fingerprint.captured_arrays(f)[array]).__name__
            raise TypeError(f"{name} captures {array!r}, a CUDA array ({kind}), but the call runs on "
                            f"device={device!r}, so {name} runs on {where}, which reads host "
                            f"arrays only; run the call on the GPU (device='cuda', or q, k and v "
                            f"as CUDA arrays), or capture a host copy of {array!r}")


def check_device_out(name, x, shape, dtype, inputs):
    """out= for a GPU call: a CUDA array; returns its DevView."""
    dv = device_view(x)
    if dv is None:
        raise TypeError(f"{name} must be a CUDA array like q (this call runs on the GPU), got "
                        f"{type(x).__name__}")
    check_form(name, dv.shape, dv.dtype, shape, dtype)
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


def dtensors_asked(o, dtensors):
    """The backward's dtensors= as o.dtensors_asked reads it (grad.asked): None for every float
    array the score_mod reads, else a frozenset of their names (False: empty). The names are
    checked against the score_mod's traced float arrays (grad.float_arrays: the keys of the
    backward's dtensors), traced only when names are given."""
    return grad.asked(dtensors, lambda: None if o.score_mod is None
                      else grad.float_arrays(trace.trace_score_mod(o.score_mod)))


def check_memory(o, backward, out_given=False):
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
    check_fits(f"q {o.q.shape}, k {o.k.shape}, v {o.v.shape}", parts)


def check_fits(who, parts):
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


def check_form(name, got_shape, got_dtype, shape, dtype, of=""):
    """A result buffer (out=) or a backward input (dout, out, lse) of the wrong dtype is a
    TypeError, of the wrong shape a ValueError (DESIGN's errors), host and CUDA arrays alike.
    of: whose shape and dtype they must be ("the forward output's ")."""
    if got_dtype != dtype:
        raise TypeError(f"{name} must have {of}dtype {np.dtype(dtype)}, got {got_dtype}")
    if tuple(got_shape) != tuple(shape):
        raise ValueError(f"{name} must have {of}shape {tuple(shape)}, got {tuple(got_shape)}")


def check_out(name, x, shape, dtype, inputs):
    """out= for a call on host q, k, v: a writable host array (a NumPy array, or another
    library's whose NumPy view is writable: a torch CPU tensor); returns the NumPy view the
    backends write. inputs: (what, array) the view must not overlap (CUDA ones cannot)."""
    view = interop.host_view(name, x)
    if view is None:
        raise TypeError(f"{name} must be a NumPy array (or another library's array on the host), "
                        f"got {type(x).__name__}")
    check_form(name, view.shape, view.dtype, shape, dtype)
    if not view.flags.writeable:
        whose = "" if view is x else (f" (NumPy's view of this {interop.library(x)} {type(x).__name__} "
                                      f"is; JAX arrays are immutable): pass a writable array, or no {name}=")
        raise ValueError(f"{name} is read-only{whose}")
    if view.size and any(s == 0 and n > 1 for s, n in zip(view.strides, view.shape)):
        raise ValueError(f"{name} has a zero stride (strides {view.strides}): it would write one "
                         "element for several results")
    for other_name, other in inputs:
        if other is not None and not isinstance(other, DevView) and np.shares_memory(view, other):
            raise ValueError(f"{name} shares memory with {other_name}")
    return view
