"""Attention sinks (sinks= on every public function, Grads.dsinks): the reference against
central differences of its own forward, every backend against the reference (check_backend:
the CPU, or the GPU on the suite's cuda rerun; run_gpu on CUDA tensors in place, the sinks a
CUDA float32 tensor), rows that keep no key (lse = the sink, out 0, only dlse reaching dsinks),
rows whose scores are too large for lse to hold log(sum) (the lost-row paths), and bad sinks."""
import numpy as np
import pytest

import attnext
from attnext import reference
from conftest import BF16, F16, F32, F64, TEST_DEVICE, check_backend, make_qkv, make_varlen_qkv, randn
from helpers.cases import CASES, problem
from helpers.numeric import central

H = 4


def _sinks(rng, dtype=F32):
    """Fresh sink logits around the scores' size; head 2 has none (-inf)."""
    s = (rng.standard_normal(H) * 1.5).astype(dtype)
    s[2] = -np.inf
    return s


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_reference_gradients_are_those_of_its_forward(rng, varlen):
    """sum(dout * out) + sum(dlse * lse) differentiated numerically through the reference's
    forward with sinks (float64, GQA, causal, a mask emptying some rows, a sequence without
    keys) equals its backward, dsinks included."""
    sinks = _sinks(rng, F64)
    if varlen:
        q, k, v = make_varlen_qkv(rng, 9, 8, H, 2, 3, dtype=F64)
        cu_q, cu_k = np.array([0, 3, 7, 9], np.int32), np.array([0, 5, 8, 8], np.int32)
        mask = rng.random((3, 1, 4, 5)) < 0.7
        opts = dict(causal=True, mask=mask, sinks=sinks)

        def fwd(**kw):
            return reference.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **{**opts, **kw})

        def bwd(*a, **kw):
            return reference.varlen_attention_backward(*a, cu_q, cu_k, **{**opts, **kw})
    else:
        q, k, v = make_qkv(rng, 2, 4, 5, H, 2, 3, dtype=F64)
        mask = rng.random((2, 1, 4, 5)) < 0.7
        mask[0, 0, 1] = False
        opts = dict(causal="top_left", mask=mask, sinks=sinks, seqlens_k=np.array([5, 0]))

        def fwd(**kw):
            return reference.attention(q, k, v, return_lse=True, **{**opts, **kw})

        def bwd(*a, **kw):
            return reference.attention_backward(*a, **{**opts, **kw})
    out, lse = fwd()
    dout = randn(rng, out.shape)
    dlse = np.where(np.isneginf(lse), 0.0, randn(rng, lse.shape))

    def loss(s=None):
        o, l = fwd() if s is None else fwd(sinks=s)
        return float(np.sum(dout * o) + np.sum(dlse * np.where(np.isneginf(l), 0.0, l)))
    g = bwd(dout, q, k, v, out, lse, dlse=dlse)
    for name, x, got in (("dq", q, g.dq), ("dk", k, g.dk), ("dv", v, g.dv)):
        np.testing.assert_allclose(got, central(loss, x), rtol=1e-5, atol=1e-7, err_msg=name)
    live = np.isfinite(sinks)
    want = central(lambda: loss(s), s := np.where(live, sinks, 0.0))
    np.testing.assert_allclose(g.dsinks[live], want[live], rtol=1e-5, atol=1e-7, err_msg="dsinks")
    assert g.dsinks[2] == 0 and np.abs(g.dsinks[live]).min() > 1e-4


def test_reference_rows_without_keys_hold_the_sink(rng):
    q, k, v = make_qkv(rng, 2, 6, 5, H, H, 8, dtype=F64)
    sinks = _sinks(rng, F64)
    out, lse = reference.attention(q, k, v, causal=True, seqlens_q=np.array([6, 3]),
                                   seqlens_k=np.array([5, 0]), sinks=sinks, return_lse=True)
    heads = np.broadcast_to(sinks[:, None], (H, 3))
    np.testing.assert_array_equal(lse[1, :, :3], heads)           # real rows, no key: the sink
    assert np.isneginf(lse[1, :, 3:]).all()                        # padding rows stay -inf
    np.testing.assert_array_equal(lse[0, :, 0], np.broadcast_to(sinks[:, None], (H, 1))[:, 0])  # row 0: no key (6 > 5)
    assert (out[1] == 0).all() and (out[0, 0] == 0).all()
    plain = reference.attention(q, k, v, causal=True, seqlens_q=np.array([6, 3]),
                                seqlens_k=np.array([5, 0]), return_lse=True)[1]
    live = np.isfinite(plain[0, :, 1:])                            # a sink only adds to the sum
    assert (lse[0, :, 1:][live] >= plain[0, :, 1:][live]).all()


def _problem(rng, case, dtype):
    """CASES[case] (the "lengths" case's second sequence has no key: its rows hold the sink) with
    fresh sinks."""
    q, k, v, varlen, opts = problem(rng, case, dtype, H)
    opts["sinks"] = _sinks(rng)
    return q, k, v, varlen, opts


# dsinks is a sum over rows of exp(sink - lse) (rowsum(dout * out) - dlse): out's rounding to
# q's dtype (the backends read the out they returned) moves it by about eps(dtype) times the
# sum of the magnitudes
_EPS = {np.dtype(F64): 1e-12, np.dtype(F32): 2e-6, np.dtype(F16): 2e-3, np.dtype(BF16): 1e-2}


def check_dsinks(res, dlse=None):
    """The backend's dsinks (res: check_backend's or run_gpu's result) against the reference's."""
    q, k, v, varlen, opts = res.inputs
    g, rg = res.grads, res.ref_grads
    assert g.dsinks is not None and g.dsinks.shape == (H,)
    assert g.dsinks.dtype == (np.float64 if q.dtype == F64 else np.float32)
    assert g.dsinks[2] == 0                                   # a -inf sink has no gradient
    out = np.asarray(res.out, np.float64)
    lse = np.asarray(res.lse, np.float64)
    dout = np.asarray(res.dout, np.float64)
    prod = np.abs(dout * out).sum(-1)                         # rows x heads in q's layout
    if varlen:
        prod, lse = prod.T[None], lse[None]
    elif opts.get("layout") != "bhsd":
        prod = prod.transpose(0, 2, 1)
    sinks = np.asarray(opts["sinks"], np.float64)[None, :, None]
    with np.errstate(invalid="ignore", over="ignore"):
        p_sink = np.where(np.isneginf(lse), 0.0, np.exp(sinks - lse))
    mag = (p_sink * (prod + (0 if dlse is None else np.abs(dlse)))).sum(axis=(0, 2))
    limit = 8 * _EPS[np.dtype(q.dtype)] * mag + 1e-6
    err = np.abs(np.asarray(g.dsinks, np.float64) - rg.dsinks)
    assert (err <= limit).all(), f"dsinks {g.dsinks} != reference {rg.dsinks} (allowed {limit})"


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_sinks_against_the_reference(rng, case, dtype):
    q, k, v, varlen, opts = _problem(rng, case, dtype)
    res = check_backend(q, k, v, rng, varlen=varlen, **opts)
    check_dsinks(res)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: np.dtype(d).name)
def test_backend_sinks_with_dlse(rng, dtype):
    q, k, v, varlen, opts = _problem(rng, "lengths", dtype)
    seen = {}

    def dlse(lse):
        seen["dlse"] = randn(rng, lse.shape, lse.dtype)
        return seen["dlse"]
    res = check_backend(q, k, v, rng, varlen=varlen, dlse=dlse, **opts)
    check_dsinks(res, np.where(np.isneginf(res.lse), 0.0, seen["dlse"]))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: np.dtype(d).name)
def test_rows_that_keep_no_key(rng, dtype):
    """A mask empties some rows, whose q and dout hold NaN: their out is exactly 0 and their lse
    the sink, no gradient sees the NaN, their dq is 0, and dsinks takes their dlse (d lse /
    d sink = 1 there) and nothing of their dout."""
    q, k, v = make_qkv(rng, 1, 13, 11, H, H, 16, dtype=dtype)
    mask = rng.random((1, H, 13, 11)) < 0.6
    mask[:, :, 3] = False
    mask[:, 0, 7:] = False
    q[:, 3] = np.nan                            # row 3 keeps nothing in any head
    sinks = _sinks(rng)
    device = None if TEST_DEVICE == "cuda" else TEST_DEVICE
    out, lse = attnext.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True, device=device)
    assert (np.asarray(out, np.float64)[:, 3] == 0).all()
    np.testing.assert_array_equal(lse[0, :, 3], sinks)
    np.testing.assert_array_equal(lse[0, 0, 7:], np.full(6, sinks[0]))
    dout = randn(rng, out.shape, dtype)
    dout[:, 3] = np.nan                         # a row that keeps nothing: its dout is never read
    dlse = np.zeros_like(lse)
    dlse[0, 1, 3] = 0.5
    g = attnext.attention_backward(dout, q, k, v, out, lse, mask=mask, sinks=sinks, dlse=dlse,
                                   device=device)
    for name in ("dq", "dk", "dv"):
        x = np.asarray(getattr(g, name), np.float64)
        assert np.isfinite(x).all(), name
    assert (np.asarray(g.dq, np.float64)[:, 3] == 0).all()
    ref = reference.attention_backward(np.nan_to_num(dout), np.nan_to_num(q), k, v, out, lse,
                                       mask=mask, sinks=sinks, dlse=dlse)
    np.testing.assert_allclose(g.dsinks, ref.dsinks, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: np.dtype(d).name)
def test_lost_rows_with_sinks(rng, dtype):
    """Scores near 3000 (a bias), where lse cannot hold log(sum) at float32 and the backends
    recompute each row's maximum and sum: the sink (near the scores too) joins that sum."""
    q, k, v = make_qkv(rng, 1, 21, 17, H, H, 16, dtype=dtype)
    bias = (3000 + randn(rng, (1, H, 21, 17))).astype(F32)
    sinks = (3000 + _sinks(rng, F64)).astype(F32)
    sinks[2] = -np.inf
    res = check_backend(q, k, v, rng, bias=bias, sinks=sinks, causal=True, cond=4000)
    check_dsinks(res)


def test_bad_sinks_name_the_argument(rng):
    q, k, v = make_qkv(rng, 1, 8, 8, H, H, 16, dtype=F32)
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\) \(one logit per query head\), got \(3,\)"):
        attnext.attention(q, k, v, sinks=np.zeros(3, F32), device="cpu")
    with pytest.raises(TypeError, match="sinks must be a float array, got dtype int64"):
        attnext.attention(q, k, v, sinks=np.zeros(H, np.int64), device="cpu")
    with pytest.raises(ValueError, match="sinks must be finite"):
        attnext.attention(q, k, v, sinks=np.array([0, np.nan, 0, 0], F32), device="cpu")
    with pytest.raises(ValueError, match="sinks must be finite"):
        attnext.attention(q, k, v, sinks=np.array([0, np.inf, 0, 0], F32), device="reference")
    with pytest.raises(TypeError, match="sinks must be a NumPy array"):
        attnext.attention(q, k, v, sinks="zeros", device="cpu")
    out, lse = attnext.attention(q, k, v, return_lse=True, device="cpu")
    g = attnext.attention_backward(out, q, k, v, out, lse, device="cpu")
    assert g.dsinks is None                                  # no sinks, no gradient


def test_sinks_are_read_not_written_and_any_float_dtype_is_taken(rng):
    q, k, v = make_qkv(rng, 2, 9, 12, H, 2, 16, dtype=F32)
    sinks = _sinks(rng).astype(F16)
    before = sinks.copy()
    out, lse = attnext.attention(q, k, v, sinks=sinks, return_lse=True, device="cpu")
    np.testing.assert_array_equal(sinks, before)
    as32 = attnext.attention(q, k, v, sinks=sinks.astype(F32), device="cpu")
    np.testing.assert_array_equal(out, as32)
    g = attnext.attention_backward(randn(rng, out.shape, F32), q, k, v, out, lse, sinks=sinks,
                                   device="cpu")
    assert g.dsinks.dtype == np.float32
    np.testing.assert_array_equal(sinks, before)
    dq, dk, dv, dbias, dtensors = g                          # five fields unpack as before
    assert dbias is None and dtensors == {}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_sinks_on_cuda_tensors(case, rng, torch):
    from helpers.gpu import run_gpu
    q, k, v, varlen, opts = _problem(rng, case, BF16)
    res = run_gpu(torch, q, k, v, varlen=varlen, **opts)
    check_dsinks(res)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 300, 300, 128), (2, 1, 5000, 64), (1, 4, 9000, 128)],
                         ids=["sm90_tiles", "decode_split", "decode_long"])
def test_sinks_on_the_gpu_paths(shape, rng, torch):
    """The Hopper forward (finish_rows), the split-KV decode (attn_fwd_combine) and their
    backward, with the sinks a CUDA float32 tensor."""
    from helpers.gpu import run_gpu
    b, sq, sk, d = shape
    q, k, v = make_qkv(rng, b, sq, sk, H, 2, d, dtype=BF16)
    res = run_gpu(torch, q, k, v, causal=True, seqlens_k=np.array([sk, sk - 17][:b]), sinks=_sinks(rng))
    check_dsinks(res)
