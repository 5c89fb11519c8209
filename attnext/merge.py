"""attnext.merge: attention over disjoint key sets combined into attention over their union,
from each part's out and lse (FlashAttention's combine, xformers' merge_attentions, FlashInfer's
merge_state; what ring and split-KV attention do with their partial results).

    lse = logsumexp_i lse_i,   out = sum_i exp(lse_i - lse) out_i

in float32 (float64 for float64 parts). A part whose lse is -inf (its row kept no key) drops out,
whatever its out holds; a row with no part left gives out 0 and lse -inf; a NaN lse makes the
row's out and lse NaN. Host arrays are merged with NumPy, CUDA arrays on their device
(kernels/attn_merge.cu, attnext/cuda/merge.py); results come back in the parts' library.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import checks, interop
from .cuda.devview import DevView

LAYOUTS = ("bshd", "bhsd")


def lse_shape(out_shape, layout):
    """The lse shape of an out shape: (B, Sq, Hq, Dv) "bshd" and (B, Hq, Sq, Dv) "bhsd" have
    (B, Hq, Sq); varlen's (Tq, Hq, Dv) has (Hq, Tq)."""
    if len(out_shape) == 3:
        return (out_shape[1], out_shape[0])
    B, a, b, _ = out_shape
    return (B, b, a) if layout == "bshd" else (B, a, b)


def _rows(lse, ndim, layout):
    """lse with out's leading axes, and a last axis of 1: it broadcasts against out."""
    if ndim == 3:
        return lse.T[..., None]
    return (lse.transpose(0, 2, 1) if layout == "bshd" else lse)[..., None]


def _parts(name, xs):
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
        raise TypeError(f"{name} must be a list or tuple of arrays, got {type(xs).__name__}")
    if not xs:
        raise ValueError(f"{name} is empty: merge needs at least one part")
    return [checks.float_array(f"{name}[{i}]", x) for i, x in enumerate(xs)]


def _check(outs, lses, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have one entry per part, got {len(outs)} and {len(lses)}")
    first = outs[0]
    if first.ndim not in (3, 4):
        raise ValueError(f"outs[0] must have shape (B, S, H, Dv), (B, H, S, Dv) or varlen's (T, H, Dv), "
                         f"got {first.shape}")
    acc = np.dtype(np.float64 if first.dtype == np.float64 else np.float32)
    want = lse_shape(first.shape, layout)
    on_gpu = isinstance(first, DevView)
    for i, (o, l) in enumerate(zip(outs, lses)):
        checks.check_form(f"outs[{i}]", o.shape, o.dtype, first.shape, first.dtype, of="outs[0]'s ")
        checks.check_form(f"lses[{i}]", l.shape, l.dtype, want, acc)
        for what, x in ((f"outs[{i}]", o), (f"lses[{i}]", l)):
            if isinstance(x, DevView) != on_gpu:
                raise TypeError(f"{what} is {'a host' if on_gpu else 'a CUDA'} array but outs[0] is "
                                f"{'a CUDA' if on_gpu else 'a host'} one: pass every part on one side")
            if on_gpu and x.device != first.device:
                raise ValueError(f"{what} is on CUDA device {x.device}, outs[0] on {first.device}")
    return acc, on_gpu


def merge(outs: Sequence, lses: Sequence, *, layout: str = "bshd"):
    """(out, lse) of attention over the union of disjoint key sets, from each set's (out, lse).

    outs: a list or tuple of the parts' outputs, one shape and dtype: (B, Sq, Hq, Dv) for layout
        "bshd" (default), (B, Hq, Sq, Dv) for "bhsd", or varlen's (Tq, Hq, Dv).
    lses: the parts' lse as return_lse=True gives it: (B, Hq, Sq) or (Hq, Tq), float32 (float64
        for float64 outs).
    Every array on the host (NumPy, torch CPU, JAX CPU), or every one a CUDA array on one device
    (torch, CuPy, JAX, anything with __cuda_array_interface__ or __dlpack__).

    Returns (out, lse): out in outs' shape and dtype, lse float32 (float64), in the parts'
    library: lse = logsumexp_i lse_i, out = sum_i exp(lse_i - lse) out_i, computed in float32
    (float64). A part with lse -inf drops out (its out is not read); a row with none left gives
    out 0 and lse -inf. The inputs are not modified.

    Example:
        >>> o1, l1 = attnext.attention(q, k[:, :512], v[:, :512], return_lse=True)
        >>> o2, l2 = attnext.attention(q, k[:, 512:], v[:, 512:], return_lse=True)
        >>> out, lse = attnext.merge([o1, o2], [l1, l2])   # attention(q, k, v), its lse
    """
    like = outs[0] if isinstance(outs, Sequence) and outs else None
    outs, lses = _parts("outs", outs), _parts("lses", lses)
    acc, on_gpu = _check(outs, lses, layout)
    if on_gpu:
        from .cuda import merge as cuda_merge
        arrays = checks.gpu_modules()[1]
        out, lse = cuda_merge.merge(outs, lses, layout, acc)
        return arrays.to_caller(out, like), arrays.to_caller(lse, like)
    out, lse = _merge_host(outs, lses, layout, acc)
    if not isinstance(like, np.ndarray):
        out, lse = interop.to_library(out, like), interop.to_library(lse, like)
    return out, lse


def _merge_host(outs, lses, layout, acc):
    ndim = outs[0].ndim
    with np.errstate(invalid="ignore", over="ignore"):
        ls = [np.asarray(l, acc) for l in lses]
        live = [l != -np.inf for l in ls]
        m = np.maximum.reduce(ls)                     # -inf where every part is; NaN wins
        base = np.where(np.isneginf(m), 0, m)
        weights = [np.where(a, np.exp(l - base), 0) for l, a in zip(ls, live)]
        total = np.add.reduce(weights)
        lse = np.where(total > 0, base + np.log(np.where(total > 0, total, 1)), -np.inf)
        lse = np.where(np.isnan(total), np.nan, lse).astype(acc)
        out = np.zeros(outs[0].shape, acc)
        for o, w, a in zip(outs, weights, live):
            share = _rows(np.where(total > 0, w / np.where(total > 0, total, 1), 0), ndim, layout)
            out += np.where(_rows(a, ndim, layout), share * np.asarray(o, acc), 0)
        out = np.where(_rows(np.isnan(lse), ndim, layout), np.nan, out)
    return out.astype(outs[0].dtype), lse


