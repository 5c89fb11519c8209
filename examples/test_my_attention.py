"""Hold your model's attention to attnext.reference, the way attnext's own tests hold its backends.

Copy this file among your tests and make `my_attention` the call your model makes (attnext's, or
any other implementation taking the same arrays). pytest runs it:

    python -m pytest -q examples/test_my_attention.py

attnext.reference computes the same attention in float64 from the same (rounded) inputs, and
attnext.testing.assert_close allows the error the computation's dtype makes (a few times the
half-ulp of a float16 / bfloat16 result, about 1e-5 relative for float32) and never a NaN.
"""
import ml_dtypes
import numpy as np
import pytest

import attnext
import attnext.testing

BF16 = np.dtype(ml_dtypes.bfloat16)
HEADS, WINDOW = 2, 24

# A learned relative-position bias, one row per head: a captured array, so the backward also
# returns its gradient (grads.dtensors["REL_BIAS"]).
REL_BIAS = np.random.default_rng(1).standard_normal((HEADS, WINDOW)).astype(np.float32) * 0.5


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + REL_BIAS[h, q_idx - kv_idx]        # q_idx - kv_idx in [0, WINDOW) where kept


def sliding_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


OPTIONS = dict(score_mod=rel_bias, mask_mod=sliding_window)


def my_attention(q, k, v, **kw):
    """The call under test: your model's attention (here attnext's, with the mods above)."""
    return attnext.attention(q, k, v, **OPTIONS, **kw)


def my_attention_backward(dout, q, k, v, out, lse):
    return attnext.attention_backward(dout, q, k, v, out, lse, **OPTIONS)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (113, 113), (200, 77)])   # awkward lengths
def test_my_attention_matches_the_reference(dtype, sq, sk):
    rng = np.random.default_rng(sq * 1000 + sk)
    q = rng.standard_normal((2, sq, HEADS, 64)).astype(dtype)         # (B, Sq, H, D)
    k = rng.standard_normal((2, sk, HEADS, 64)).astype(dtype)
    v = rng.standard_normal((2, sk, HEADS, 64)).astype(dtype)

    out, lse = my_attention(q, k, v, return_lse=True)
    ref_out, ref_lse = attnext.reference.attention(q, k, v, return_lse=True, **OPTIONS)
    attnext.testing.assert_close(out, ref_out, dtype=dtype, name="out")
    attnext.testing.assert_close(lse, ref_lse, name="lse")            # float32 whatever q's dtype

    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = my_attention_backward(dout, q, k, v, out, lse)
    ref_grads = attnext.reference.attention_backward(dout, q, k, v, out, lse, **OPTIONS)
    attnext.testing.assert_grads_close(grads, ref_grads, q=q, k=k, v=v, dout=dout, out=out,
                                       **OPTIONS)


def test_a_wrong_answer_fails():
    """The rule is not slack: one element off by 5% of the output's scale fails."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 50, HEADS, 64)).astype(BF16) for _ in range(3))
    out = np.array(my_attention(q, k, v), dtype=np.float32)
    ref = attnext.reference.attention(q, k, v, **OPTIONS)
    out[0, 7, 1, 3] += 0.05 * np.abs(ref).max()
    with pytest.raises(AssertionError, match=r"out \(bfloat16\): error"):
        attnext.testing.assert_close(out, ref, dtype=BF16, name="out")
