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
