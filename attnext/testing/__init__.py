"""Hold an attention implementation to `attnext.reference` in your own tests.

    import attnext, attnext.testing

    out = my_model_attention(q, k, v)                  # any implementation, any dtype
    ref = attnext.reference.attention(q, k, v, causal=True)   # float64: the exact answer
    attnext.testing.assert_close(out, ref, dtype=q.dtype)

This is the rule attnext's own test suite and its fuzzer apply to every backend (the three-way
accuracy check: a float64 reference, the same computation at the kernel's dtype, the kernel):

* The result is cast to float64 and compared with the float64 reference fed the *same* inputs
  (a float16 / bfloat16 input converts to float64 exactly, so the reference is the exact answer
  for the rounded inputs).
* With `scale` = the largest |reference| of the array, the error allowed is, for float64,
  1e-10 * scale + 1e-12; for float32, 2e-5 * scale + 1e-6; for float16 and bfloat16,
  `factor` (3) times the error the same computation makes at that dtype, plus the float32
  allowance (the backend's float32 accumulation). The same-dtype error is at least half an ulp
  at the array's largest magnitude, the error of merely storing the exact answer at that dtype;
  pass `baseline=` (the same computation run at that dtype, e.g. a plain NumPy or PyTorch
  attention in bfloat16) to use its measured error where that is larger.
* NaN always fails; -inf must sit exactly where the reference has -inf (the lse of a row that
  keeps no key); a finite reference needs a finite result.

`assert_grads_close` applies the rule to a backward's gradients, with the allowances a backward
needs (dS = P (dP - delta) cancels, so round-off is relative to the largest gradient of the
call; the backward reads the forward's rounded `out`; a 16-bit backward's tensor cores round P
and dS to 16 bits). `examples/test_my_attention.py` is a complete pytest file using both.

Arrays may be NumPy arrays, anything `np.asarray` reads (JAX, `attnext.DeviceArray`), PyTorch
tensors on any device (bfloat16 included) or CuPy arrays; they are copied to the host.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import reference
from ..types import Grads
from . import accuracy
from .accuracy import allowed_error

__all__ = ["assert_close", "assert_grads_close", "allowed_error", "to_numpy"]


def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy array of x: NumPy as is; a PyTorch tensor (any device; bfloat16 becomes
    `ml_dtypes.bfloat16`); a CuPy array (`.get()`); anything else through `np.asarray` (JAX,
    `attnext.DeviceArray`, lists)."""
    if isinstance(x, np.ndarray):
        return x
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            import torch
            return x.view(torch.int16).numpy().view(accuracy.BF16)
        return x.numpy()
    if module == "cupy":
        return x.get()
    return np.asarray(x)


def _problem(actual, expected, dtype, name, floor, cond, factor, baseline, extra):
    actual = to_numpy(actual)
    expected = np.asarray(to_numpy(expected), dtype=np.float64)
    dtype = np.dtype(actual.dtype if dtype is None else dtype)
    if dtype not in accuracy.EPS:
        raise TypeError(f"assert_close: dtype must be float16, bfloat16, float32 or float64, "
                        f"got {dtype}")
    if baseline is not None:
        err = _baseline_error(to_numpy(baseline), expected)
        if err is not None:
            extra = _plus(extra, factor * err)
    return accuracy.compare(name, actual, expected, dtype, floor, extra, cond, factor)


def _baseline_error(baseline, expected):
    """The largest finite |baseline - expected|, or None where there is none."""
    b = np.asarray(baseline, dtype=np.float64)
    if b.shape != expected.shape:
        raise ValueError(f"baseline: shape {b.shape} != the reference's {expected.shape}")
    ok = np.isfinite(b) & np.isfinite(expected)
    return float(np.abs(b[ok] - expected[ok]).max()) if ok.any() else None


def _plus(extra, amount):
    if extra is None:
        return lambda: amount
    return lambda: extra() + amount


def assert_close(actual: Any, expected: Any, *, dtype: Any = None, name: str = "result",
                 floor: float = 0.0, cond: float = 1.0, factor: float = accuracy.LOW_FACTOR,
                 baseline: Any = None, extra: Callable[[], Any] | None = None) -> None:
    """Raise AssertionError unless `actual` is within the three-way rule of `expected`.

    actual: the implementation's result (out, lse, a gradient), any shape.
    expected: the float64 answer for the same inputs, the same shape: `attnext.reference`'s.
    dtype: the dtype the computation ran at (q's dtype); default: actual's. An lse is float32
        whatever q's dtype and is held to the float32 rule: pass dtype=lse.dtype (the default).
    name: what the message calls the array.
    floor: the magnitude float32 round-off is relative to when larger than the array's own
        (for dq, dk, dv, dbias: the largest gradient of the call; `assert_grads_close` does it).
    cond: a factor on the relative terms, for problems whose own round-off is larger (scores of
        hundreds, say: eps * |score| exceeds the float32 allowance).
    factor: the multiple of the same-dtype error allowed for float16 / bfloat16 (default 3;
        float32 and float64 have fixed tolerances).
    baseline: the same computation run at `dtype` by a plain implementation (e.g. NumPy or
        PyTorch math-mode attention in bfloat16); its error against `expected`, times factor, is
        added to the allowance: "no worse than a few times a naive computation at that dtype".
    extra: a function returning a per-element allowance (broadcastable to actual) added where
        the limit alone is exceeded; called only then.

    NaN in actual always fails, as does -inf where the reference is finite (or the reverse) and
    a non-finite value where the reference is finite. The message names the worst element, its
    value, the reference's and the limit.
    """
    problem = _problem(actual, expected, dtype, name, floor, cond, factor, baseline, extra)
    if problem is not None:
        raise AssertionError(problem)


def assert_grads_close(grads: Grads | tuple, expected: Grads, *, q: Any, k: Any, v: Any, dout: Any,
                       out: Any, lengths: dict | None = None, cond: float = 1.0,
                       **options: Any) -> None:
    """Raise AssertionError unless a backward's dq, dk, dv (and dbias, dtensors) agree with
    `expected`, the reference's gradients, under the three-way rule.

    grads: (dq, dk, dv[, dbias[, dtensors]]) from the implementation, as `attnext.Grads` or a
        tuple, in the shapes of q, k, v (dbias in the bias's).
    expected: `attnext.reference.attention_backward(dout, q, k, v, out, lse, **options)` (or
        varlen_attention_backward's).
    q, k, v, dout: the inputs both were given (NumPy arrays or tensors, q's dtype).
    out: the forward output the implementation's backward read (it is stored at q's dtype; an
        exact backward fed that rounded out lands off the float64 gradients by a bounded amount,
        which is allowed).
    lengths: None for attention(); for varlen_attention, its length arguments (cu_seqlens_q,
        cu_seqlens_k, and max_seqlen_*, seqused_* where given).
    options: the keyword options of the call (causal, window, scale, bias, layout, score_mod,
        ...), as given to the reference (the backward's device, deterministic and dtensors may
        be among them: expected, computed with the same dtensors, holds the asked arrays).
    cond: as in assert_close.

    dq, dk and dbias are held relative to the largest of the reference's dq, dk, dv (the
    softmax's gradient cancels, so round-off scales with dP, not with the result), and a dbias
    also relative to the size of the terms it sums before they cancel (a broadcast bias's dbias
    can be exactly 0: `accuracy.dbias_terms`); the allowance grows by the effect of the rounded
    out (every dtype), and for float16 / bfloat16 by the rounding of P and dS to 16 bits before
    the products; with options' precision="tf32", float32 is held to
    float16's rule plus TF32's rounding of its operands (`accuracy.rounded_out_allowance`; for
    out, pass `extra=lambda: accuracy.tf32_out_allowance(q, k, v, lengths, options)` to
    assert_close, for lse `accuracy.tf32_lse_allowance(q, k, lengths, options)`). dtensors (a
    score_mod's captured float arrays) are checked when `options` has the score_mod and expected
    has any, relative to the largest dq, dk, dv, with the rounded out's effect and the round-off
    of their sums over pairs allowed (a central difference of the reference's lse per array
    element: computed only when needed).
    """
    q, k, v, dout, out = (to_numpy(x) for x in (q, k, v, dout, out))
    fields = list(grads) + [None] * (5 - len(grads))
    got = Grads(*(to_numpy(x) if x is not None and i < 4 else x for i, x in enumerate(fields)))
    if got.dtensors is None:
        got = got._replace(dtensors={})
    keep = {n: x for n, x in options.items()
            if n not in ("device", "precision", "deterministic", "dtensors", "return_lse", "out")}
    if lengths is None:
        ref_out = reference.attention(q, k, v, **keep)
    else:
        ref_out = reference.varlen_attention(q, k, v, **lengths, **keep)
    precision = options.get("precision")       # "tf32": float16's rule (accuracy.product_dtype)
    problems = accuracy.compare_grads(got, expected, q, k, v, dout, out, ref_out, lengths,
                                      dict(keep, precision=precision), cond)
    score_mod = keep.get("score_mod")
    if score_mod is not None and expected.dtensors:
        got = got._replace(dtensors={n: to_numpy(x) for n, x in got.dtensors.items()})
        extra = accuracy.dtensors_allowance(q, k, v, dout, out, ref_out, lengths, keep, cond)
        problems += accuracy.compare_dtensors(got, expected, score_mod, q.dtype, cond, extra,
                                              precision)
    if problems:
        raise AssertionError("\n".join(problems))
