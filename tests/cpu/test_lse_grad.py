"""The lse gradient (attention_backward's and varlen_attention_backward's dlse=): the reference
against central differences of its own forward, every backend against the reference
(check_backend: the CPU, or the GPU on the suite's cuda rerun; run_gpu on CUDA tensors in
place), rows that keep no key, and a bad dlse."""
import numpy as np
import pytest

import attnext
from attnext import reference
from conftest import BF16, F32, F64, check_backend, make_qkv, make_varlen_qkv, randn
from helpers.cases import CASES, problem
from helpers.numeric import central

H = 2


def _dlse(rng, dead_nan=False):
    """A function of the forward's lse: fresh normal numbers in lse's dtype (NaN where the row
    keeps no key, with dead_nan: a backend must ignore them there)."""
    def make(lse):
        g = randn(rng, lse.shape, lse.dtype)
        return np.where(np.isneginf(lse), np.nan, g).astype(lse.dtype) if dead_nan else g
    return make


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("dout_zero", [False, True], ids=["dout", "dlse_only"])
def test_reference_dlse_is_the_gradient_of_lse(rng, varlen, dout_zero):
    """sum(dout * out) + sum(dlse * lse) differentiated numerically through the reference's
    forward (float64, GQA, causal, softcap, a bias) equals its backward with dlse."""
    opts = dict(causal=True, softcap=4.0)
    if varlen:
        q, k, v = make_varlen_qkv(rng, 7, 9, H, 1, 3, dtype=F64)
        cu_q, cu_k = np.array([0, 3, 7], np.int32), np.array([0, 5, 9], np.int32)
        bias = randn(rng, (2, H, 4, 5))

        def fwd(**kw):
            return reference.varlen_attention(q, k, v, cu_q, cu_k, bias=bias, return_lse=True, **opts, **kw)

        def bwd(*a, **kw):
            return reference.varlen_attention_backward(*a, cu_q, cu_k, bias=bias, **opts, **kw)
    else:
        q, k, v = make_qkv(rng, 2, 4, 5, H, 1, 3, dtype=F64)
        bias = randn(rng, (1, H, 4, 5))

        def fwd(**kw):
            return reference.attention(q, k, v, bias=bias, return_lse=True, **opts, **kw)

        def bwd(*a, **kw):
            return reference.attention_backward(*a, bias=bias, **opts, **kw)
    out, lse = fwd()
    dout = np.zeros(out.shape) if dout_zero else randn(rng, out.shape)
    dlse = np.where(np.isneginf(lse), 0.0, randn(rng, lse.shape))

    def loss():
        o, l = fwd()
        return float(np.sum(dout * o) + np.sum(np.where(np.isneginf(l), 0.0, dlse * l)))
    g = bwd(dout, q, k, v, out, lse, dlse=dlse)
    for name, x, got in (("dq", q, g.dq), ("dk", k, g.dk), ("dv", v, g.dv), ("dbias", bias, g.dbias)):
        want = central(loss, x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=name)
    if dout_zero:
        assert np.abs(g.dq).max() > 1e-3      # the gradient is lse's alone, and not zero


def _problem(rng, case, dtype):
    return problem(rng, case, dtype, H)


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_dlse_against_the_reference(rng, case, dtype):
    q, k, v, varlen, opts = _problem(rng, case, dtype)
    check_backend(q, k, v, rng, varlen=varlen, dlse=_dlse(rng), **opts)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: np.dtype(d).name)
def test_rows_that_keep_no_key_ignore_dlse(rng, dtype):
    """A mask that empties some rows; dlse is NaN there: no gradient may see it, dq is 0 there."""
    q, k, v = make_qkv(rng, 2, 13, 11, H, H, 16, dtype=dtype)
    mask = rng.random((2, H, 13, 11)) < 0.6
    mask[:, :, 3] = False
    mask[1, 0, 7:] = False
    res = check_backend(q, k, v, rng, mask=mask, dlse=_dlse(rng, dead_nan=True))
    for g in res.grads[:3]:
        assert np.isfinite(np.asarray(g, np.float64)).all()


def test_dlse_is_checked(rng):
    q, k, v = make_qkv(rng, 1, 8, 8, H, H, 16, dtype=F32)
    out, lse = attnext.attention(q, k, v, return_lse=True, device="cpu")
    dout = randn(rng, out.shape, F32)
    with pytest.raises(ValueError, match=r"dlse must have lse's shape \(1, 2, 8\), got \(1, 2, 7\)"):
        attnext.attention_backward(dout, q, k, v, out, lse, dlse=lse[:, :, :7], device="cpu")
    with pytest.raises(TypeError, match="dlse must have lse's dtype float32, got float16"):
        attnext.attention_backward(dout, q, k, v, out, lse, dlse=lse.astype(np.float16), device="cpu")
    with pytest.raises(TypeError, match="dlse"):
        attnext.attention_backward(dout, q, k, v, out, lse, dlse="zeros", device="cpu")
    before = lse.copy()
    attnext.attention_backward(dout, q, k, v, out, lse, dlse=lse, device="cpu")
    np.testing.assert_array_equal(lse, before)        # read, never written


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_dlse_on_cuda_tensors(case, rng, torch):
    from helpers.gpu import run_gpu
    q, k, v, varlen, opts = _problem(rng, case, BF16)
    run_gpu(torch, q, k, v, varlen=varlen, dlse=_dlse(rng), **opts)
