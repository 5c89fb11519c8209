"""attnext.testing, the public face of the three-way accuracy rule: what passes, what fails and
what the message says."""
import ml_dtypes
import numpy as np
import pytest

import attnext
import attnext.testing as at

BF16 = np.dtype(ml_dtypes.bfloat16)


def _case(dtype, rng):
    q, k, v = (rng.standard_normal((1, 70, 2, 32)).astype(dtype) for _ in range(3))
    return q, k, v, attnext.attention(q, k, v, causal=True), attnext.reference.attention(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_a_backend_result_passes_and_a_nudged_one_fails(dtype):
    rng = np.random.default_rng(3)
    *_, out, ref = _case(dtype, rng)
    at.assert_close(out, ref, dtype=dtype)
    bad = out.astype(np.float64)
    bad[0, 9, 1, 4] += 0.1 * np.abs(ref).max()
    with pytest.raises(AssertionError, match=r"out \(.*\): error .* at \(0, 9, 1, 4\)"):
        at.assert_close(bad, ref, dtype=dtype, name="out")


def test_nan_always_fails_and_the_inf_pattern_must_match():
    ref = np.array([1.0, -np.inf])
    with pytest.raises(AssertionError, match="NaN"):
        at.assert_close(np.array([np.nan, -np.inf], np.float32), ref)
    with pytest.raises(AssertionError, match="-inf pattern"):
        at.assert_close(np.array([1.0, 0.0], np.float32), ref)
    with pytest.raises(AssertionError, match="where the reference is finite"):
        at.assert_close(np.array([np.inf, -np.inf], np.float32), ref)
    at.assert_close(np.array([1.0, -np.inf], np.float32), ref)


def test_factor_and_baseline_widen_or_narrow_the_16_bit_allowance():
    ref = np.array([1.0, 2.0])
    got = np.array([1.0, 2.0 + 0.02])            # 2.6 half-ulps of bfloat16 at 2.0
    at.assert_close(got, ref, dtype=BF16)
    with pytest.raises(AssertionError):
        at.assert_close(got, ref, dtype=BF16, factor=2.0)
    with pytest.raises(AssertionError):
        at.assert_close(np.array([1.0, 2.1]), ref, dtype=BF16)
    at.assert_close(np.array([1.0, 2.1]), ref, dtype=BF16, baseline=np.array([1.0, 2.05]))
    with pytest.raises(ValueError, match="baseline"):
        at.assert_close(got, ref, dtype=BF16, baseline=np.zeros(3))


def test_shapes_and_dtypes_are_checked():
    with pytest.raises(AssertionError, match="shape"):
        at.assert_close(np.zeros(3, np.float32), np.zeros(4))
    with pytest.raises(TypeError, match="dtype"):
        at.assert_close(np.zeros(3, np.int32), np.zeros(3))


def test_grads_with_a_bias_and_a_captured_table():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 40, 2, 16)).astype(BF16) for _ in range(3))
    bias = rng.standard_normal((2, 1, 40)).astype(np.float32)
    table = rng.standard_normal((2, 40)).astype(np.float32)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx]

    opts = dict(causal=True, bias=bias, score_mod=mod)
    out, lse = attnext.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape).astype(BF16)
    g = attnext.attention_backward(dout, q, k, v, out, lse, **opts)
    rg = attnext.reference.attention_backward(dout, q, k, v, out, lse, **opts)
    at.assert_grads_close(g, rg, q=q, k=k, v=v, dout=dout, out=out, **opts)
    wrong = g._replace(dk=g.dk.astype(np.float32) * 1.1)
    with pytest.raises(AssertionError, match="dk"):
        at.assert_grads_close(wrong, rg, q=q, k=k, v=v, dout=dout, out=out, **opts)


def test_a_broadcast_dbias_that_cancels_is_held_to_the_size_of_its_terms():
    """A dbias summed over heads, rows and keys whose exact value is 0 (softmax scale 0: P is
    uniform, so each row's dS sums to 0; every dq and dk is 0 too): float32's round-off there is
    relative to the terms summed (accuracy.dbias_terms), not to the gradients, and an error well
    past that still fails."""
    from attnext.testing import accuracy

    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 96, 3, 8)).astype(np.float32) for _ in range(3))
    opts = dict(scale=0.0, bias=rng.standard_normal((2, 1, 1, 1)).astype(np.float32))
    out, lse = attnext.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    g = attnext.attention_backward(dout, q, k, v, out, lse, **opts)
    rg = attnext.reference.attention_backward(dout, q, k, v, out, lse, **opts)
    assert np.abs(rg.dbias).max() < 1e-12
    at.assert_grads_close(g, rg, q=q, k=k, v=v, dout=dout, out=out, **opts)
    terms = accuracy.dbias_terms(q, k, v, dout, attnext.reference.attention(q, k, v, **opts), None, opts)
    floor = max(np.abs(x).max() for x in rg[:3])
    rounded = (rg.dbias + 2 * np.finfo(np.float32).eps * terms).astype(np.float32)
    assert (np.abs(rounded) > accuracy.allowed_error(np.float32, 0.0, floor)).all()   # past the old rule
    at.assert_grads_close(g._replace(dbias=rounded), rg, q=q, k=k, v=v, dout=dout, out=out, **opts)
    wrong = (rg.dbias + 10 * accuracy.F32_RTOL * terms).astype(np.float32)
    with pytest.raises(AssertionError, match="dbias"):
        at.assert_grads_close(g._replace(dbias=wrong), rg, q=q, k=k, v=v, dout=dout, out=out, **opts)


def test_float32s_rounded_out_is_allowed_where_alike_keys_cancel():
    """Keys and values alike along the sequence: every row's P is uniform, dS = P (dP - delta)
    cancels exactly and the exact dq, dk are 0. A backward that forms delta = dout . out from
    float32's rounded out lands off by scale (dout . (v - out)) k however exact its arithmetic,
    and its own float32 products dP and delta add their rounding, the same for every key: both
    grow with |v| while the largest gradient (dv = P^T dout) does not. Past float32's term,
    within the rounded-out allowance (the fuzzer's seed 7272 found such a dq); an error 10x the
    exact backward's fails."""
    from attnext.testing import accuracy

    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 16, 2, 32)).astype(np.float32)
    k0 = rng.standard_normal((1, 1, 2, 32)).astype(np.float32)
    v0 = (300 * rng.standard_normal((1, 1, 2, 32))).astype(np.float32)
    k, v = np.broadcast_to(k0, (1, 200, 2, 32)), np.broadcast_to(v0, (1, 200, 2, 32))
    out, lse = attnext.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    rg = attnext.reference.attention_backward(dout, q, k, v, out, lse)
    assert max(np.abs(rg.dq).max(), np.abs(rg.dk).max()) < 1e-9
    # the exact backward fed the rounded out: dS_ij = (dout_i . (v0 - out_i)) / 200
    e = np.sum(dout.astype(np.float64) * (v0.astype(np.float64) - out), axis=-1, keepdims=True)
    fed = (e * k0 / np.sqrt(32)).astype(np.float32)
    floor = max(np.abs(x).max() for x in rg[:3])
    assert np.abs(fed).max() > 3 * accuracy.allowed_error(np.float32, 0.0, floor)   # past the rule
    g = attnext.attention_backward(dout, q, k, v, out, lse)
    at.assert_grads_close(g, rg, q=q, k=k, v=v, dout=dout, out=out)
    at.assert_grads_close(g._replace(dq=fed), rg, q=q, k=k, v=v, dout=dout, out=out)
    with pytest.raises(AssertionError, match="dq"):
        at.assert_grads_close(g._replace(dq=10 * fed), rg, q=q, k=k, v=v, dout=dout, out=out)


def test_tf32_precision_is_held_to_float16s_rule():
    """Gradients of float32 inputs with precision="tf32" in the options are held to float16's
    rule (TF32's 10-bit mantissa): an error of 2^-12 relative passes there and fails the float32
    rule; 2^-7 fails both."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in range(3))
    out, lse = attnext.attention(q, k, v, return_lse=True, causal=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    rg = attnext.reference.attention_backward(dout, q, k, v, out, lse, causal=True)
    floor = max(float(np.abs(x).max()) for x in rg[:3])
    for rel, tf32_ok in ((2.0 ** -12, True), (2.0 ** -7, False)):
        dk = (rg.dk + rel * floor * np.sign(rg.dk)).astype(np.float32)
        g = attnext.Grads(rg.dq.astype(np.float32), dk, rg.dv.astype(np.float32), None, {})
        with pytest.raises(AssertionError, match="dk"):
            at.assert_grads_close(g, rg, q=q, k=k, v=v, dout=dout, out=out, causal=True)
        if tf32_ok:
            at.assert_grads_close(g, rg, q=q, k=k, v=v, dout=dout, out=out, causal=True, precision="tf32")
        else:
            with pytest.raises(AssertionError, match="dk"):
                at.assert_grads_close(g, rg, q=q, k=k, v=v, dout=dout, out=out, causal=True,
                                      precision="tf32")


def test_to_numpy_reads_torch_tensors():
    torch = pytest.importorskip("torch")
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    got = at.to_numpy(x)
    assert got.dtype == BF16 and got.astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]


def _rounded(x, bits):
    """x rounded to `bits` explicit mantissa bits, ties away (cvt.rna: TF32 at 10)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    shift = 23 - bits
    return (((b + (1 << (shift - 1))) >> shift) << shift).astype(np.uint32).view(np.float32).astype(np.float64)


def _emulated_attention(q, k, v, dout, bits, causal):
    """A tensor-core attention whose products take operands rounded to `bits` (bshd, MHA): out
    and the gradients as a GPU kernel forms them (delta = dout . out from the stored out)."""
    qh, kh, vh, dh = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    r = lambda x: _rounded(x, bits)  # noqa: E731
    scale = 1 / np.sqrt(q.shape[-1])
    s = r(qh) @ r(kh).swapaxes(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = np.where(np.arange(sk)[None, :] > np.arange(sq)[:, None] + sk - sq, -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0].astype(np.float32)
    p /= p.sum(-1, keepdims=True)
    out = (r(p) @ r(vh)).astype(np.float32).astype(np.float64)
    ds = p * (r(dh) @ r(vh).swapaxes(-1, -2) - (dh * out).sum(-1, keepdims=True))
    back = lambda x: x.transpose(0, 2, 1, 3).astype(np.float32)  # noqa: E731
    grads = attnext.Grads(back(r(ds) @ r(kh) * scale), back(r(ds).swapaxes(-1, -2) @ r(qh) * scale),
                          back(r(p).swapaxes(-1, -2) @ r(dh)), None, {})
    return back(out), grads, lse


@pytest.mark.parametrize("sq, sk, d, causal", [(1, 1, 40, False), (239, 1, 40, False), (113, 203, 1, True),
                                              (64, 64, 64, True), (200, 300, 40, False)])
def test_the_tf32_rule_passes_tf32_and_fails_a_coarser_product(sq, sk, d, causal):
    """precision="tf32" is held to float16's rule plus the effect of rounding float32 operands
    (accuracy.tf32_out_allowance, tf32_lse_allowance, rounded_out_allowance(precision="tf32")): an
    attention whose products round to TF32 passes, one that rounds them to 6 mantissa bits (16x
    coarser) does not."""
    from attnext.testing import accuracy
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, n, 3, d)).astype(np.float32) for n in (sq, sk, sk))
    dout = rng.standard_normal((2, sq, 3, d)).astype(np.float32)
    opts = dict(causal=causal, precision="tf32")
    ref_out, ref_lse = attnext.reference.attention(q, k, v, causal=causal, return_lse=True)

    def problems(bits):
        out, g, lse = _emulated_attention(q, k, v, dout, bits, causal)
        rg = attnext.reference.attention_backward(dout, q, k, v, out, ref_lse, causal=causal)
        found = [accuracy.compare("out", out, ref_out, accuracy.F16,
                                  extra=lambda: accuracy.tf32_out_allowance(q, k, v, None, opts)),
                 accuracy.compare("lse", lse, ref_lse, accuracy.F16,
                                  extra=lambda: accuracy.tf32_lse_allowance(q, k, None, opts))]
        return [p for p in found if p] + accuracy.compare_grads(g, rg, q, k, v, dout, out, ref_out,
                                                                 None, opts)
    assert not problems(10)
    assert problems(6)


def test_the_tf32_lse_rule_where_the_products_cancel():
    """accuracy.tf32_lse_allowance where float16's rule alone is too tight for TF32: q . k small
    beside |q| |k| (q's two halves alike, k's second half its first negated, plus noise), so
    that rounding the operands to TF32 moves the scores far more than lse's limit, and lifts lse
    (its second-order term). An attention whose products round to TF32 passes with the allowance
    (and not without it); one that rounds them to 6 mantissa bits does not."""
    from attnext.testing import accuracy
    rng = np.random.default_rng()
    d, a = 64, 30.0
    q, k = (rng.standard_normal((2, n, 2, d // 2)) * a for n in (150, 170))
    q = np.concatenate([q, q], -1).astype(np.float32)
    k = (np.concatenate([k, -k], -1) + rng.standard_normal((2, 170, 2, d)) * 0.01).astype(np.float32)
    _, ref_lse = attnext.reference.attention(q, k, k, return_lse=True)
    opts = dict(precision="tf32")

    def lse_problem(bits, extra):
        lse = _emulated_attention(q, k, k, np.zeros_like(q), bits, False)[2]
        return accuracy.compare("lse", lse, ref_lse, accuracy.F16,
                                extra=(lambda: accuracy.tf32_lse_allowance(q, k, None, opts)) if extra else None)
    assert lse_problem(10, extra=False)
    assert not lse_problem(10, extra=True)
    assert lse_problem(6, extra=True)
