"""Property tests: random problems, the CPU backend's forward and backward against the reference.

Hypothesis draws the shapes and options (and a seed for the data), so a failure shrinks to a
small problem and replays from the example database.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import F32, F64, check_backend, randn

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def options(draw, hq):
    """The options shared by padded and packed problems (not bias / mask / lengths)."""
    opts = dict(causal=draw(st.sampled_from([False, True, "top_left"])))
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(-1, 40)), draw(st.integers(-1, 40)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.floats(0.25, 30.0))
    if draw(st.booleans()):
        opts["scale"] = draw(st.floats(-1.0, 1.0))
    return opts


@st.composite
def broadcast_shape(draw, full):
    """A shape that broadcasts to `full` = (B, H, Sq, Sk): each dim kept or 1, the heads dim
    one of the allowed head counts, leading dims sometimes dropped."""
    b, heads, sq, sk = full
    shape = [draw(st.sampled_from([1, b])), draw(st.sampled_from(heads)),
             draw(st.sampled_from([1, sq])), draw(st.sampled_from([1, sk]))]
    while len(shape) > 1 and shape[0] == 1 and draw(st.booleans()):
        shape.pop(0)
    return tuple(shape)


def _bias_and_mask(draw, rng, dtype, nb, hq, hk, sq, sk):
    opts = {}
    full = (nb, sorted({1, hk, hq}), sq, sk)
    if draw(st.booleans()):
        opts["bias"] = randn(rng, draw(broadcast_shape(full)), dtype)
    if draw(st.booleans()):
        opts["mask"] = rng.random(draw(broadcast_shape(full))) < draw(st.floats(0.3, 1.0))
    if draw(st.booleans()):
        slopes = (hq,) if draw(st.booleans()) else (nb, hq)
        opts["alibi_slopes"] = rng.uniform(0.0, 0.3, slopes)
    return opts


@SETTINGS
@given(data=st.data())
def test_padded_matches_reference(data):
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F64]), label="dtype")
    b, sq, sk = draw(st.integers(1, 3)), draw(st.integers(1, 80)), draw(st.integers(1, 80))
    hk, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    hq = hk * group
    d, dv = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    layout = draw(st.sampled_from(["bshd", "bhsd"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    shape = (lambda s, h, n: (b, s, h, n)) if layout == "bshd" else (lambda s, h, n: (b, h, s, n))
    q, k, v = (randn(rng, shape(sq, hq, d), dtype), randn(rng, shape(sk, hk, d), dtype),
               randn(rng, shape(sk, hk, dv), dtype))
    opts = dict(draw(options(hq)), layout=layout)
    opts.update(_bias_and_mask(draw, rng, dtype, b, hq, hk, sq, sk))
    if draw(st.booleans()):
        opts["seqlens_q"] = np.array(draw(st.lists(st.integers(0, sq), min_size=b, max_size=b)))
        opts["seqlens_k"] = np.array(draw(st.lists(st.integers(0, sk), min_size=b, max_size=b)))
    check_backend(q, k, v, rng, **opts)


@SETTINGS
@given(data=st.data())
def test_varlen_matches_reference(data):
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F64]), label="dtype")
    nseq = draw(st.integers(1, 4))
    seg_q = draw(st.lists(st.integers(0, 80), min_size=nseq, max_size=nseq), label="seg_q")
    seg_k = draw(st.lists(st.integers(0, 80), min_size=nseq, max_size=nseq), label="seg_k")
    hk, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    hq = hk * group
    d, dv = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    cu_q, cu_k = np.cumsum([0] + seg_q), np.cumsum([0] + seg_k)
    tq, tk = cu_q[-1] + draw(st.integers(0, 5)), cu_k[-1] + draw(st.integers(0, 5))
    q, k, v = (randn(rng, (tq, hq, d), dtype), randn(rng, (tk, hk, d), dtype),
               randn(rng, (tk, hk, dv), dtype))
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    lq, lk = seg_q, seg_k
    if draw(st.booleans()):
        lq = [draw(st.integers(0, n)) for n in seg_q]
        lk = [draw(st.integers(0, n)) for n in seg_k]
        varlen.update(seqused_q=np.array(lq), seqused_k=np.array(lk))
    mq, mk = max(lq) + draw(st.integers(0, 3)), max(lk) + draw(st.integers(0, 3))
    varlen.update(max_seqlen_q=mq, max_seqlen_k=mk)
    opts = draw(options(hq))
    opts.update(_bias_and_mask(draw, rng, dtype, nseq, hq, hk, mq, mk))
    res = check_backend(q, k, v, rng, varlen=varlen, **opts)
    real_q = np.zeros(tq, bool)
    for b in range(nseq):
        real_q[cu_q[b]:cu_q[b] + lq[b]] = True
    assert (res.out[~real_q] == 0).all() and (res.grads.dq[~real_q] == 0).all()
