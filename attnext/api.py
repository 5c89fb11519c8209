"""The public functions: each call is checked (checks.py: one Problem) and dispatched to a
backend: `attnext._C` for the CPU, the GPU host side (cuda/backend.py), or `attnext.reference`.

Causal alignment when Sq != Sk (here Sq = 2, Sk = 5; x = attended)::

    causal=True / "bottom_right"        causal="top_left"
        k: 0 1 2 3 4                       k: 0 1 2 3 4
    q0:    x x x x .                   q0:    x . . . .
    q1:    x x x x x                   q1:    x x . . .

A row that keeps no key (fully masked, or past its sequence's length) returns out = 0 and
lse = -inf, with zero gradients; never NaN.
"""
import ml_dtypes
import numpy as np

from . import _C, checks, reference
from ._layout import CpuCall, dtype_code
from .cuda.devview import DevView
from .mods import codegen, fingerprint, interp, lower, trace
from .types import Grads


def _new_output(shape, dtype, pinned=False):
    """Every result buffer a backend fills (the tests poison these to catch unwritten elements).
    pinned: a NumPy call on the GPU, whose large results live in pooled pinned memory
    (staging.host_result), so their DMAs need no host copy."""
    if pinned:
        return checks.gpu_modules()[0].host_result(shape, dtype)
    return np.empty(shape, dtype=dtype)


def _c_view(a):
    """What the C extension reads: bfloat16 as uint16 (NumPy cannot export it as a buffer)."""
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


def _problem(o, out4, lse3):
    """The CpuCall _C.forward / _C.backward read (csrc/module.c)."""
    return CpuCall(
        dtype=dtype_code(o.q.dtype), B=o.B,
        q=_c_view(o.q4), k=_c_view(o.k4), v=_c_view(o.v4), out=_c_view(out4), lse=lse3,
        cu_seqlens_q=o.cu_q, cu_seqlens_k=o.cu_k, seqused_q=o.used_q, seqused_k=o.used_k,
        bias=None if o.bias4 is None else _c_view(o.bias4),
        bias_dtype=dtype_code(o.bias4.dtype) if o.bias4 is not None else 0,
        bias_heads=o.bias_heads,
        mask=o.mask4, mask_heads=o.mask_heads,
        alibi=o.alibi, alibi_dtype=dtype_code(o.alibi.dtype) if o.alibi is not None else 0,
        scale=o.scale_value, softcap=o.softcap_value, causal=o.causal_code,
        window_left=o.window_left, window_right=o.window_right, num_threads=checks._num_threads(),
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
                          a if isinstance(a, np.ndarray) else checks.device_view(a)))
    return found


def _forward(o):
    inputs = [("q", o.q), ("k", o.k), ("v", o.v), ("bias", o.bias), ("mask", o.mask),
              ("alibi_slopes", o.alibi_slopes), ("cu_seqlens_q", o.cu_q), ("cu_seqlens_k", o.cu_k),
              ("seqused_q", o.used_q), ("seqused_k", o.used_k)]
    if o.out is not None:
        inputs += _captured_inputs(o)
    if o.device == "cuda" and o.on_gpu:
        return _forward_on_gpu(o, inputs)
    checks.check_memory(o, backward=False, out_given=o.out is not None)
    gpu = o.device == "cuda" and not _has_mods(o)
    if o.out is not None:
        checks.check_out("out", o.out, o.out_shape, o.q.dtype, inputs)
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
        checks.gpu_modules()[0].forward(o, out, lse)
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
    cuda_backend, device = checks.gpu_modules()
    user_out = o.out
    if o.out is not None:
        o.out = checks.check_device_out("out", o.out, o.out_shape, o.q.dtype, inputs)
    out, lse = cuda_backend.forward(o, None, None)
    out = user_out if user_out is not None else device.to_caller(out, o.like)
    return (out, device.to_caller(lse, o.like)) if o.return_lse else out


@checks.flex_keywords
def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
              bias=None, mask=None, score_mod=None, mask_mod=None, seqlens_q=None, seqlens_k=None,
              layout="bshd", return_lse=False, device=None, out=None, precision=None):
    """Scaled-dot-product attention; see the module docstring for the causal alignment.

    q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) for layout "bshd" ("bhsd": heads
    second). Returns out (the caller's layout, Dv wide, q's dtype) and with return_lse the
    natural-log lse (B, Hq, Sq), float32 (float64 for float64 inputs). Rows that keep no key give
    out = 0 and lse = -inf.
    """
    o = checks.normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=seqlens_q,
        seqlens_k=seqlens_k, layout=layout, return_lse=return_lse, device=device, out=out,
        precision=precision))
    return _forward(o)


@checks.flex_keywords
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
    o = checks.normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=None,
        seqlens_k=None, layout="thd", return_lse=return_lse, device=device, out=out,
        precision=precision), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
        seqused_k, varlen=True)
    return _forward(o)


def _backward(o, dout, out, lse, deterministic):
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {checks.fmt(deterministic)}")
    dout = checks.float_array("dout", dout)
    out = checks.float_array("out", out)
    lse = checks.float_array("lse", lse)
    for name, x in (("dout", dout), ("out", out)):
        checks.check_form(name, x.shape, x.dtype, o.out_shape, o.q.dtype, of="the forward output's ")
    checks.check_form("lse", lse.shape, lse.dtype, o.lse_shape, o.acc_dtype)
    if o.device == "cuda" and o.on_gpu:
        return _backward_on_gpu(o, dout, out, lse, deterministic)
    on_host = o.device != "cuda" or _runs_on_reference(o) or _has_mods(o)
    if on_host and any(isinstance(x, DevView) for x in (dout, out, lse)):
        raise TypeError("dout, out and lse are CUDA arrays but q, k, v live on the host; pass all "
                        "of them on the GPU or all on the host")
    checks.check_memory(o, backward=True)
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
        cuda_backend = checks.gpu_modules()[0]
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
    cuda_backend, device = checks.gpu_modules()
    dq, dk, dv, dbias = cuda_backend.backward(o, dout, out, lse, None, None, None, None, deterministic)
    dq, dk, dv = (device.to_caller(x, o.like) for x in (dq, dk, dv))
    dbias = None if dbias is None else device.to_caller(dbias, o.like)
    return Grads(dq, dk, dv, dbias, o.dtensors if o.dtensors is not None else {})


@checks.flex_keywords
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
    o = checks.normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=seqlens_q,
        seqlens_k=seqlens_k, layout=layout, return_lse=False, device=device, out=None,
        precision=precision))
    return _backward(o, dout, out, lse, deterministic)


@checks.flex_keywords
def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                              seqused_k=None, causal=False, window=None, scale=None, softcap=None,
                              alibi_slopes=None, bias=None, mask=None, score_mod=None,
                              mask_mod=None, device=None, precision=None, deterministic=True):
    """Gradients of varlen_attention; padding rows get exactly zero gradients."""
    o = checks.normalise(q, k, v, dict(
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
    from ._version import __version__
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
