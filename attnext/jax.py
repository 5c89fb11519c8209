"""attnext in JAX: attention and varlen_attention as jax.custom_vjp functions over XLA FFI calls,
under jax.jit and jax.grad, on the CPU and on the GPU.

    import attnext.jax as axj
    out = axj.attention(q, k, v, causal=True)                      # q (B, S, H, D) jax arrays
    loss = lambda q, k, v: axj.attention(q, k, v, causal=True).sum()
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

Each call is one jax.ffi.ffi_call of the target "attnext" (registered for the CPU and for CUDA at
import), whose handler is attnext._C's (csrc/xla/ffi.c: XLA's FFI is a C ABI, so no jaxlib is
needed to build attnext). The handler hands the call's buffers to _dispatch here, which runs
attnext's own API on them in place: XLA's CPU buffers as NumPy arrays over their memory, its
GPU buffers as CUDA arrays on XLA's stream (no copy in; the results are written into XLA's
buffers: out directly, lse and the gradients by one copy each).

Gradients reach q, k, v, bias and sinks (and the returned lse's through dlse); mask, alibi_slopes
and the lengths take none. score_mod / mask_mod are taken as on the NumPy API, reading NumPy
arrays they capture (a captured jax array would be a tracer under jit: refused); their captured
arrays get no gradient here. Options are static (part of the jit cache key). jax.vmap runs the
calls one after another ("sequential"). jax is imported by this module only.
"""
from __future__ import annotations

import ctypes
import functools
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import _C, api
from .merge import lse_shape

__all__ = ["attention", "varlen_attention"]

TARGET = "attnext"
# XLA_FFI_DataType codes (xla/ffi/api/c_api.h) of the buffers attnext reads and writes
_DTYPES = {1: np.dtype(np.bool_), 2: np.dtype(np.int8), 4: np.dtype(np.int32), 5: np.dtype(np.int64),
           6: np.dtype(np.uint8), 10: np.dtype(np.float16), 11: np.dtype(np.float32),
           12: np.dtype(np.float64), 16: np.dtype(ml_dtypes.bfloat16)}
_CALLBACKS: dict = {}     # id -> score_mod / mask_mod (strong references, as attnext.torch's)
DIFFERENTIABLE = ("bias", "sinks")
AUX = ("mask", "alibi_slopes", "seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "seqused_q",
       "seqused_k")


class _CudaBuffer:
    """An XLA GPU buffer as a CUDA array on XLA's stream (__cuda_array_interface__ v3)."""

    def __init__(self, ptr, shape, dtype, stream):
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": "<V2" if dtype == _DTYPES[16] else dtype.str,
            "data": (ptr, False), "version": 3, "strides": None, "stream": stream or 1}


def _buffer(platform, stream, ptr, code, dims):
    dtype = _DTYPES.get(code)
    if dtype is None:
        raise TypeError(f"attnext.jax: an operand of XLA dtype code {code}")
    shape = tuple(int(d) for d in dims)
    if platform == "cuda":
        return _CudaBuffer(ptr, shape, dtype, stream)
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer((ctypes.c_char * n).from_address(ptr), dtype).reshape(shape)


def _copy(platform, stream, dst, src):
    """src (attnext's result) into dst (an XLA buffer) on the call's stream."""
    if platform == "cpu":
        np.copyto(dst, np.asarray(src))
        return
    cai = dst.__cuda_array_interface__       # src: a DeviceArray on the call's stream
    nbytes = math.prod(cai["shape"]) * np.dtype(src.dtype).itemsize
    if nbytes:
        _C.memcpy_dtod(cai["data"][0], src.ptr, nbytes, stream or 0)


def _dispatch(platform, stream, args, rets, attrs):
    """The FFI handler's Python side (csrc/xla/ffi.c): one attnext call on XLA's buffers."""
    cfg = json.loads(attrs["config"])
    bufs = [_buffer(platform, stream, *a) for a in args]
    outs = [_buffer(platform, stream, *r) for r in rets]
    opts = dict(cfg["options"], device="cpu" if platform == "cpu" else "cuda")
    for kind in ("score_mod", "mask_mod"):
        key = cfg.get(kind)
        opts[kind] = None if not key else _CALLBACKS[key]
    if opts.get("window") is not None:
        opts["window"] = tuple(opts["window"])
    lengths = dict(cfg.get("lengths", {}))
    if attrs["op"] == "forward":
        q, k, v, *extra = bufs
        opts.update(zip(cfg["names"], extra))
        cu = [opts.pop(n, None) for n in ("cu_seqlens_q", "cu_seqlens_k")]
        if cfg["varlen"]:
            lengths.update({n: opts.pop(n) for n in ("seqused_q", "seqused_k") if n in opts})
            _, lse = api.varlen_attention(q, k, v, *cu, **lengths, **opts, return_lse=True, out=outs[0])
        else:
            _, lse = api.attention(q, k, v, **opts, return_lse=True, out=outs[0])
        _copy(platform, stream, outs[1], lse)
        return
    dout, q, k, v, out, lse, dlse, *extra = bufs
    opts.update(zip(cfg["names"], extra))
    opts.update(deterministic=cfg["deterministic"], dlse=dlse, dtensors=False)
    cu = [opts.pop(n, None) for n in ("cu_seqlens_q", "cu_seqlens_k")]
    if cfg["varlen"]:
        lengths.update({n: opts.pop(n) for n in ("seqused_q", "seqused_k") if n in opts})
        g = api.varlen_attention_backward(dout, q, k, v, out, lse, *cu, **lengths, **opts)
    else:
        g = api.attention_backward(dout, q, k, v, out, lse, **opts)
    results = [g.dq, g.dk, g.dv] + ([g.dbias] if "bias" in cfg["names"] else []) \
        + ([g.dsinks] if "sinks" in cfg["names"] else [])
    for dst, src in zip(outs, results):
        _copy(platform, stream, dst, src)


def _register():
    _C.ffi_set_dispatch(_dispatch)
    jax.ffi.register_ffi_target(TARGET, _C.ffi_handler("cpu"), platform="cpu")
    try:     # a jaxlib without its CUDA plugin has no such platform: CPU only
        jax.ffi.register_ffi_target(TARGET, _C.ffi_handler("cuda"), platform="CUDA")
    except Exception:
        pass


_register()


def _key(fn):
    if fn is None:
        return 0
    _CALLBACKS[id(fn)] = fn
    return id(fn)


def _call(static, results, *operands, op):
    return jax.ffi.ffi_call(TARGET, results, vmap_method="sequential")(*operands, op=op, config=static)


def _forward(static, q, k, v, diff, aux):
    cfg = json.loads(static)
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    layout = "thd" if cfg["varlen"] else cfg["options"]["layout"]
    results = (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),
               jax.ShapeDtypeStruct(lse_shape(q.shape, layout), acc))
    return _call(static, results, q, k, v, *diff, *aux, op="forward")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, diff, aux):
    out, lse = _forward(static, q, k, v, diff, aux)
    return out, lse


def _attention_fwd(static, q, k, v, diff, aux):
    out, lse = _forward(static, q, k, v, diff, aux)
    return (out, lse), (q, k, v, diff, aux, out, lse)


def _attention_bwd(static, res, cts):
    q, k, v, diff, aux, out, lse = res
    dout, dlse = cts
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, *diff)]
    grads = _call(static, results, dout.astype(q.dtype), q, k, v, out, lse, dlse.astype(lse.dtype), *diff, *aux,
                  op="backward")
    return (grads[0], grads[1], grads[2], tuple(grads[3:]), tuple(None for _ in aux))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _run(q, k, v, arrays, options, varlen, lengths, deterministic, return_lse, score_mod, mask_mod):
    present = {n: x for n, x in arrays.items() if x is not None}
    diff = [jnp.asarray(present[n], jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
            if n == "sinks" else jnp.asarray(present[n]) for n in DIFFERENTIABLE if n in present]
    aux = [jnp.asarray(present[n]) for n in AUX if n in present]
    names = [n for n in DIFFERENTIABLE if n in present] + [n for n in AUX if n in present]
    static = json.dumps({"options": options, "names": names, "varlen": varlen, "lengths": lengths,
                         "deterministic": bool(deterministic), "score_mod": _key(score_mod),
                         "mask_mod": _key(mask_mod)}, sort_keys=True)
    out, lse = _attention(static, q, k, v, tuple(diff), tuple(aux))
    return (out, lse) if return_lse else out


def _options(causal, window, scale, softcap, precision, layout="thd"):
    return {"causal": causal, "window": None if window is None else [int(w) for w in window],
            "scale": None if scale is None else float(scale),
            "softcap": None if softcap is None else float(softcap), "precision": precision,
            **({} if layout == "thd" else {"layout": layout})}


def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None, alibi_slopes=None, bias=None,
              mask=None, sinks=None, score_mod=None, mask_mod=None, seqlens_q=None, seqlens_k=None,
              layout="bshd", precision=None, deterministic=True, return_lse=False):
    """attnext.attention on jax arrays, differentiable (jax.grad: q, k, v, bias, sinks, and lse's
    gradient with return_lse) and jit-able; out, or (out, lse). Options as attnext.attention's
    (static); deterministic as attention_backward's."""
    arrays = dict(bias=bias, sinks=sinks, mask=mask, alibi_slopes=alibi_slopes, seqlens_q=seqlens_q,
                  seqlens_k=seqlens_k)
    return _run(q, k, v, arrays, _options(causal, window, scale, softcap, precision, layout), False, {},
                deterministic, return_lse, score_mod, mask_mod)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                     seqused_q=None, seqused_k=None, causal=False, window=None, scale=None, softcap=None,
                     alibi_slopes=None, bias=None, mask=None, sinks=None, score_mod=None, mask_mod=None,
                     precision=None, deterministic=True, return_lse=False):
    """attnext.varlen_attention on jax arrays (as attention()). max_seqlen_q / max_seqlen_k: ints,
    read from concrete cu_seqlens when not given (under jit they must be given: the lengths are
    not known while tracing)."""
    lengths = {}
    for name, m, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q), ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
        if m is None:
            try:
                m = int(np.max(np.diff(np.asarray(cu)))) if np.size(cu) > 1 else 0
            except jax.errors.TracerArrayConversionError:
                raise ValueError(f"attnext.jax.varlen_attention under jax.jit needs {name} (an int): "
                                 f"cu_seqlens are not known while tracing") from None
        lengths[name] = int(m)
    arrays = dict(bias=bias, sinks=sinks, mask=mask, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k)
    return _run(q, k, v, arrays, _options(causal, window, scale, softcap, precision), True, lengths,
                deterministic, return_lse, score_mod, mask_mod)
