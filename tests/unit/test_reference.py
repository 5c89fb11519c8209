"""The NumPy reference against a plain dense implementation and against finite differences."""
import tracemalloc
import warnings
import zlib

import ml_dtypes
import numpy as np
import pytest

from attnext import reference as ref
from attnext.testing.accuracy import compare_dtensors
from conftest import check_backend

B, HQ, HK, D, DV = 2, 4, 2, 8, 6


# --- a dense implementation, written out plainly: full Lq x Lk matrices, one (b, h) at a time ---

def dense_head(q, k, v, b, h, *, scale=None, causal=False, window=None, softcap=None, slope=None,
               bias=None, mask=None, score_mod=None, mask_mod=None):
    """q (Lq, D), k (Lk, D), v (Lk, Dv) of one sequence b and head h; bias / mask (Lq, Lk)."""
    lq, lk = len(q), len(k)
    r, c = np.meshgrid(np.arange(lq), np.arange(lk), indexing="ij")
    bb, hh = np.full(r.shape, b), np.full(r.shape, h)
    s = (1 / np.sqrt(q.shape[1]) if scale is None else scale) * (q @ k.T)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if slope is not None:
        s = s - slope * np.abs(r + lk - lq - c)
    keep = np.ones((lq, lk), dtype=bool)
    if causal is True or causal == "bottom_right":
        keep &= c <= r + lk - lq
    if causal == "top_left":
        keep &= c <= r
    if window is not None:
        left, right = window
        if left != -1:
            keep &= c >= r + lk - lq - left
        if right != -1:
            keep &= c <= r + lk - lq + right
    if mask is not None:
        keep &= mask
    if mask_mod is not None:
        keep &= mask_mod(bb, hh, r, c)
    if score_mod is not None:
        s = score_mod(s, bb, hh, r, c)
    out, lse = np.zeros((lq, v.shape[1])), np.full(lq, -np.inf)
    for i in range(lq):
        row = s[i][keep[i]]
        if row.size and row.max() > -np.inf:
            w = np.exp(row - row.max())
            lse[i] = row.max() + np.log(w.sum())
            out[i] = w @ v[keep[i]] / w.sum()
    return out, lse


def head_block(x, b, h, hq, lq, lk, rows, cols):
    """bias / mask of sequence b, head h as a dense (lq, lk) array."""
    x = np.asarray(x)
    x = np.broadcast_to(x.reshape((1,) * (4 - x.ndim) + x.shape), (x.shape[0] if x.ndim == 4 else 1,
                        x.shape[-3] if x.ndim >= 3 else 1, rows, cols))
    return x[b if x.shape[0] > 1 else 0, h // (hq // x.shape[1]), :lq, :lk]


def dense(q, k, v, *, layout="bshd", seqlens_q=None, seqlens_k=None, bias=None, mask=None,
          alibi_slopes=None, **opts):
    """Dense attention over a padded batch: out in q's layout, lse (B, Hq, Sq)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if layout == "bhsd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    b_, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out, lse = np.zeros(q.shape[:3] + (v.shape[3],)), np.full((b_, hq, sq), -np.inf)
    for b in range(b_):
        lq = sq if seqlens_q is None else seqlens_q[b]
        lk = sk if seqlens_k is None else seqlens_k[b]
        for h in range(hq):
            hk_ = h // (hq // hk)
            extra = dict(opts)
            if bias is not None:
                extra["bias"] = head_block(bias, b, h, hq, lq, lk, sq, sk)
            if mask is not None:
                extra["mask"] = head_block(mask, b, h, hq, lq, lk, sq, sk)
            if alibi_slopes is not None:
                a = np.asarray(alibi_slopes)
                extra["slope"] = a[h] if a.ndim == 1 else a[b, h]
            o, l = dense_head(q[b, :lq, h], k[b, :lk, hk_], v[b, :lk, hk_], b, h, **extra)
            out[b, :lq, h], lse[b, h, :lq] = o, l
    return (out.transpose(0, 2, 1, 3) if layout == "bhsd" else out), lse


def dense_varlen(q, k, v, cu_q, cu_k, *, seqused_q=None, seqused_k=None, bias=None, mask=None,
                 alibi_slopes=None, **opts):
    """Dense attention over packed sequences: out (Tq, Hq, Dv), lse (Hq, Tq)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    maxq, maxk = max(np.diff(cu_q)), max(np.diff(cu_k))
    out, lse = np.zeros(q.shape[:2] + (v.shape[2],)), np.full((hq, len(q)), -np.inf)
    for b in range(len(cu_q) - 1):
        lq = cu_q[b + 1] - cu_q[b] if seqused_q is None else seqused_q[b]
        lk = cu_k[b + 1] - cu_k[b] if seqused_k is None else seqused_k[b]
        qs, ks = slice(cu_q[b], cu_q[b] + lq), slice(cu_k[b], cu_k[b] + lk)
        for h in range(hq):
            extra = dict(opts)
            if bias is not None:
                extra["bias"] = head_block(bias, b, h, hq, lq, lk, maxq, maxk)
            if mask is not None:
                extra["mask"] = head_block(mask, b, h, hq, lq, lk, maxq, maxk)
            if alibi_slopes is not None:
                a = np.asarray(alibi_slopes)
                extra["slope"] = a[h] if a.ndim == 1 else a[b, h]
            hk_ = h // (hq // hk)
            o, l = dense_head(q[qs, h], k[ks, hk_], v[ks, hk_], b, h, **extra)
            out[qs, h], lse[h, qs] = o, l
    return out, lse


def qkv(rng, sq, sk, layout="bshd", b=B, hq=HQ, hk=HK):
    shape = (lambda s, h, d: (b, s, h, d)) if layout == "bshd" else (lambda s, h, d: (b, h, s, d))
    return (rng.standard_normal(shape(sq, hq, D)), rng.standard_normal(shape(sk, hk, D)),
            rng.standard_normal(shape(sk, hk, DV)))


def assert_close_f64(actual, expected):
    assert not np.isnan(actual).any()
    np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.fixture
def strict():
    """Any warning (RuntimeWarning from a division by zero, a NaN...) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def sinusoid(s, b, h, qi, ki):
    return s * 2 + np.sin(s)


def tanh_mod(s, b, h, qi, ki):
    return s + np.tanh(s) * (h + 1)


def document_mask(doc):
    return lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi)


# --- forward ---

FORWARD_CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "bottom_right": dict(causal="bottom_right"),
    "top_left": dict(causal="top_left"),
    "window": dict(window=(5, 3)),
    "window_left": dict(window=(4, -1)),
    "window_causal": dict(causal=True, window=(6, 0)),
    "softcap_scale": dict(softcap=1.5, scale=0.7),
    "alibi": dict(alibi_slopes=[0.1, 0.2, 0.3, 0.4], causal=True),
    "alibi_batch": dict(alibi_slopes=np.linspace(0.1, 0.8, B * HQ).reshape(B, HQ)),
    "score_mod": dict(score_mod=sinusoid, causal="top_left"),
    "mask_mod": dict(mask_mod=lambda b, h, qi, ki: (qi + ki + h) % 3 != 0),
    "seqlens": dict(seqlens_q=[11, 0], seqlens_k=[29, 7], causal=True),
}


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("sq, sk", [(23, 37), (37, 23), (1, 1)])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_matches_dense(case, sq, sk, layout, strict):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, sq, sk, layout)
    opts = dict(FORWARD_CASES[case])
    if "seqlens_q" in opts:
        opts["seqlens_q"] = np.minimum(opts["seqlens_q"], sq)
        opts["seqlens_k"] = np.minimum(opts["seqlens_k"], sk)
    out, lse = ref.attention(q, k, v, layout=layout, return_lse=True, **opts)
    want_out, want_lse = dense(q, k, v, layout=layout, **opts)
    assert out.dtype == lse.dtype == np.float64
    assert_close_f64(out, want_out)
    assert_close_f64(lse, want_lse)


@pytest.mark.parametrize("bias_shape", [(B, HQ, 23, 37), (1, 1, 23, 37), (HK, 1, 37), (37,),
                                        (23, 1), (B, 1, 1, 1)])
def test_bias_and_mask_broadcast(bias_shape, strict):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 23, 37, "bhsd")
    bias = rng.standard_normal(bias_shape)
    mask = rng.random(bias_shape) < 0.7
    out, lse = ref.attention(q, k, v, layout="bhsd", bias=bias, mask=mask, return_lse=True)
    want_out, want_lse = dense(q, k, v, layout="bhsd", bias=bias, mask=mask)
    assert_close_f64(out, want_out)
    assert_close_f64(lse, want_lse)


def varlen_data(rng, hq=HQ, hk=HK):
    """Three sequences, the middle one empty, seqused below the segments, padding at the end."""
    cu_q, cu_k = np.array([0, 9, 9, 20]), np.array([0, 14, 14, 21])
    used_q, used_k = np.array([7, 0, 11]), np.array([12, 0, 5])
    q = rng.standard_normal((24, hq, D))
    k = rng.standard_normal((25, hk, D))
    v = rng.standard_normal((25, hk, DV))
    return q, k, v, cu_q, cu_k, used_q, used_k


@pytest.mark.parametrize("opts", [
    {}, dict(causal=True), dict(causal="top_left"), dict(window=(2, 1)),
    dict(softcap=2.0, alibi_slopes=np.linspace(0.1, 0.6, 3 * HQ).reshape(3, HQ)),
    dict(bias="full", mask="keys"), dict(score_mod=sinusoid, causal=True),
    dict(mask_mod=lambda b, h, qi, ki: (qi - ki + b) % 2 == 0),
], ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_matches_dense(opts, seqused, strict):
    rng = np.random.default_rng(3)
    q, k, v, cu_q, cu_k, used_q, used_k = varlen_data(rng)
    opts = dict(opts)
    if opts.get("bias") == "full":
        opts["bias"] = rng.standard_normal((3, HK, 11, 14))
        opts["mask"] = rng.random((3, 1, 1, 14)) < 0.8
    used = dict(seqused_q=used_q, seqused_k=used_k) if seqused else {}
    out, lse = ref.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **used, **opts)
    want_out, want_lse = dense_varlen(q, k, v, cu_q, cu_k, **used, **opts)
    assert out.shape == (24, HQ, DV) and lse.shape == (HQ, 24)
    assert_close_f64(out, want_out)
    assert_close_f64(lse, want_lse)
    real = np.zeros(24, dtype=bool)
    for b in range(3):
        n = used_q[b] if seqused else cu_q[b + 1] - cu_q[b]
        real[cu_q[b]:cu_q[b] + n] = True
    assert (out[~real] == 0).all() and (lse[:, ~real] == -np.inf).all()


def test_document_mask_mod(strict):
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 40, 40)
    doc = np.repeat([0, 1, 2, 3], [5, 17, 1, 17])
    mask_mod = document_mask(doc)
    out = ref.attention(q, k, v, mask_mod=mask_mod)
    assert_close_f64(out, dense(q, k, v, mask_mod=mask_mod)[0])
    r, c = np.meshgrid(np.arange(40), np.arange(40), indexing="ij")
    assert_close_f64(out, ref.attention(q, k, v, mask=(doc[r] == doc[c]) & (c <= r)))


def test_fully_masked_rows(strict):
    rng = np.random.default_rng(5)
    sq, sk = 9, 4
    q, k, v = qkv(rng, sq, sk)
    bias = np.zeros((1, 1, sq, sk))
    bias[..., 6, :] = -np.inf              # row 6: every kept score is -inf
    mask = np.ones((sq, sk), dtype=bool)
    mask[7] = False                        # row 7: nothing kept
    opts = dict(causal=True, bias=bias, mask=mask)   # rows 0-4: above the bottom-right diagonal
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    dead = [0, 1, 2, 3, 4, 6, 7]
    assert (out[:, dead] == 0).all() and (lse[:, :, dead] == -np.inf).all()
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, [5, 8]]).all()
    assert_close_f64(out, dense(q, k, v, **opts)[0])
    dout = rng.standard_normal(out.shape)
    g = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    assert all(np.isfinite(x).all() for x in g[:4])
    assert (g.dq[:, dead] == 0).all()
    assert (g.dbias[..., dead, :] == 0).all()
    # A score_mod sees only kept pairs, and its derivative does not leak NaN into the -inf row.
    g2 = ref.attention_backward(dout, q, k, v, out, lse, score_mod=tanh_mod, **opts)
    assert all(np.isfinite(x).all() for x in g2[:4])


def test_padding_rows_are_exactly_zero(strict):
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, 13, 17, "bhsd")
    opts = dict(seqlens_q=[13, 5], seqlens_k=[9, 17], layout="bhsd", causal=True)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    assert (out[1, :, 5:] == 0).all() and (lse[1, :, 5:] == -np.inf).all()
    g = ref.attention_backward(rng.standard_normal(out.shape), q, k, v, out, lse, **opts)
    assert (g.dq[1, :, 5:] == 0).all()
    assert (g.dk[0, :, 9:] == 0).all() and (g.dv[0, :, 9:] == 0).all()
    assert np.abs(g.dk[0, :, :9]).min() > 0


def test_varlen_padding_gradients_are_exactly_zero(strict):
    rng = np.random.default_rng(7)
    q, k, v, cu_q, cu_k, used_q, used_k = varlen_data(rng)
    opts = dict(seqused_q=used_q, seqused_k=used_k, causal=True)
    out, lse = ref.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    g = ref.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, **opts)
    q_pad = np.r_[7:9, 20:24]
    k_pad = np.r_[12:14, 19:25]
    assert (g.dq[q_pad] == 0).all()
    assert (g.dk[k_pad] == 0).all() and (g.dv[k_pad] == 0).all()
    assert g.dbias is None and g.dtensors == {}


# --- the row-block path ---

def test_many_rows_match_dense(strict):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 300, 211, b=1, hq=2, hk=1)
    opts = dict(causal=True, window=(150, 20), bias=rng.standard_normal((300, 211)))
    assert 300 > ref.ROW_BLOCK
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    want_out, want_lse = dense(q, k, v, **opts)
    assert_close_f64(out, want_out)
    assert_close_f64(lse, want_lse)


def test_block_size_does_not_change_the_answer(monkeypatch, strict):
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, 45, 30)
    opts = dict(causal="top_left", bias=rng.standard_normal((HK, 45, 1)),
                mask_mod=lambda b, h, qi, ki: ki != qi % 7, score_mod=sinusoid)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    g = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    monkeypatch.setattr(ref, "ROW_BLOCK", 7)
    out7, lse7 = ref.attention(q, k, v, return_lse=True, **opts)
    g7 = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    assert_close_f64(out7, out)
    assert_close_f64(lse7, lse)
    for a, b in zip(g7[:4], g[:4]):   # score_mod' is a difference quotient: ~1e-10 relative
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)


def test_memory_stays_linear():
    rng = np.random.default_rng(10)
    s = 4096
    q, k, v = (rng.standard_normal((1, s, 1, 8)) for _ in range(3))
    full_matrix = s * s * 8
    tracemalloc.start()
    try:
        ref.attention(q, k, v, causal=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < full_matrix / 4


# --- callbacks ---

def test_mods_are_called_per_row_block_on_the_right_pairs(monkeypatch):
    monkeypatch.setattr(ref, "ROW_BLOCK", 4)
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, 10, 6, b=1, hq=1, hk=1)
    mask_calls, score_calls = [], []

    def mask_mod(b, h, qi, ki):
        mask_calls.append((b, h, qi, ki))
        return ki % 2 == 0

    def score_mod(s, b, h, qi, ki):
        score_calls.append((s, b, h, qi, ki))
        return s

    ref.attention(q, k, v, seqlens_q=[9], causal=True, mask_mod=mask_mod, score_mod=score_mod)
    # rows 0-2 are above the diagonal (c <= r - 3): the first block keeps only (3, 0).
    assert len(mask_calls) == 3          # blocks 0-3, 4-7, 8
    assert sum(len(c[2]) for c in mask_calls) == 9 * 6
    assert len(score_calls) == 3
    for s, b, h, qi, ki in score_calls:
        assert s.dtype == np.float64 and s.ndim == 1
        assert all(x.dtype == np.int64 and x.shape == s.shape for x in (b, h, qi, ki))
        assert (ki % 2 == 0).all() and (ki <= qi - 3).all() and (qi < 9).all()
    assert list(score_calls[0][3]) == [3]
    # A block in which nothing is kept does not call score_mod at all.
    score_calls.clear()
    ref.attention(q, k, v, causal=True, seqlens_q=[9], mask=np.arange(10)[:, None] >= 4,
                  score_mod=score_mod)
    assert len(score_calls) == 2


# --- inputs ---

def test_inputs_unchanged_read_only_and_broadcast(strict):
    rng = np.random.default_rng(12)
    q, _, v = qkv(rng, 11, 13)
    k = np.broadcast_to(rng.standard_normal((1, 13, 1, D)), (B, 13, HK, D))
    bias = np.broadcast_to(rng.standard_normal((1, 1, 1, 13)), (B, HQ, 11, 13))
    mask = rng.random((11, 13)) < 0.8
    inputs = dict(q=q, k=k, v=v)
    opts = dict(bias=bias, mask=mask, alibi_slopes=np.full(HQ, 0.25), causal=True)
    for x in (q, v, mask, opts["alibi_slopes"]):
        x.flags.writeable = False
    copies = {n: x.copy() for n, x in {**inputs, **opts}.items() if isinstance(x, np.ndarray)}
    out, lse = ref.attention(**inputs, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    dout.flags.writeable = False
    dout_copy = dout.copy()
    out_copy, lse_copy = out.copy(), lse.copy()
    g = ref.attention_backward(dout, **inputs, out=out, lse=lse, **opts)
    for n, x in {**inputs, **opts}.items():
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, copies[n])
    np.testing.assert_array_equal(dout, dout_copy)
    np.testing.assert_array_equal(out, out_copy)
    np.testing.assert_array_equal(lse, lse_copy)
    assert g.dk.shape == k.shape and g.dk.strides != k.strides
    assert g.dbias.shape == bias.shape
    assert_close_f64(out, dense(q, np.ascontiguousarray(k), v, **opts)[0])


def test_backward_ignores_the_callers_out_and_lse():
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, 6, 9)
    out, lse = ref.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape)
    g = ref.attention_backward(dout, q, k, v, out, lse)
    bad = ref.attention_backward(dout, q, k, v, np.full_like(out, np.nan), np.zeros_like(lse))
    for a, b in zip(g[:3], bad[:3]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_low_precision_inputs_are_read_exactly(dtype):
    rng = np.random.default_rng(14)
    q, k, v = (x.astype(dtype) for x in qkv(rng, 10, 12))
    bias = rng.standard_normal((HQ, 10, 12)).astype(dtype)
    out, lse = ref.attention(q, k, v, bias=bias, return_lse=True, device="cpu", precision=None)
    assert out.dtype == lse.dtype == np.float64
    wide = [x.astype(np.float64) for x in (q, k, v)]
    assert_close_f64(out, ref.attention(*wide, bias=bias.astype(np.float64)))
    g = ref.attention_backward(out, q, k, v, out, lse, bias=bias, deterministic=True)
    assert all(x.dtype == np.float64 for x in g[:4])


# --- gradients against finite differences ---

def fd_check(loss, params, grads, rng, n_coords=5, eps=1e-6):
    """Central differences of loss(**params) at a few random coordinates of each param."""
    for name, x in params.items():
        flat = rng.choice(x.size, size=min(n_coords, x.size), replace=False)
        for idx in zip(*np.unravel_index(flat, x.shape)):
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (loss(**{**params, name: plus}) - loss(**{**params, name: minus})) / (2 * eps)
            assert grads[name][idx] == pytest.approx(fd, rel=1e-5, abs=1e-7), (name, idx)


GRAD_CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "top_left": dict(causal="top_left"),
    "window": dict(window=(3, 2)),
    "softcap": dict(softcap=0.8),
    "alibi": dict(alibi_slopes=[0.3, 0.1, 0.2, 0.5]),
    "bias_full": dict(bias=(1, 1, 9, 12)),
    "bias_kv_heads": dict(bias=(HK, 1, 12), causal=True),
    "score_mod": dict(score_mod=sinusoid, window=(4, -1)),
    "everything": dict(causal=True, softcap=2.0, alibi_slopes=[0.1] * HQ, bias=(B, HQ, 1, 12),
                       score_mod=sinusoid, mask_mod=lambda b, h, qi, ki: ki != 3),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_match_finite_differences(case, strict):
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, 9, 12)
    opts = dict(GRAD_CASES[case])
    params = dict(q=q, k=k, v=v)
    if "bias" in opts:
        params["bias"] = rng.standard_normal(opts.pop("bias"))
    dout = rng.standard_normal((B, 9, HQ, DV))

    def loss(**p):
        return np.sum(ref.attention(**p, **opts) * dout)

    out, lse = ref.attention(**params, return_lse=True, **opts)
    g = ref.attention_backward(dout, **params, out=out, lse=lse, **opts)
    grads = dict(q=g.dq, k=g.dk, v=g.dv, bias=g.dbias)
    fd_check(loss, params, grads, rng)


@pytest.mark.parametrize("opts", [
    dict(causal=True),
    dict(bias=(3, HQ, 11, 14), score_mod=sinusoid, alibi_slopes=[0.2, 0.1, 0.3, 0.4]),
], ids=["causal", "bias_score_mod_alibi"])
def test_varlen_gradients_match_finite_differences(opts, strict):
    rng = np.random.default_rng(16)
    q, k, v, cu_q, cu_k, used_q, used_k = varlen_data(rng)
    opts = dict(opts, seqused_q=used_q, seqused_k=used_k)
    params = dict(q=q, k=k, v=v)
    if "bias" in opts:
        params["bias"] = rng.standard_normal(opts.pop("bias"))
    dout = rng.standard_normal((24, HQ, DV))

    def loss(**p):
        return np.sum(ref.varlen_attention(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **p, **opts)
                      * dout)

    g = ref.varlen_attention_backward(dout, out=None, lse=None, cu_seqlens_q=cu_q,
                                      cu_seqlens_k=cu_k, **params, **opts)
    fd_check(loss, params, dict(q=g.dq, k=g.dk, v=g.dv, bias=g.dbias), rng, n_coords=8)


def test_gradients_across_row_blocks(strict):
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, 300, 40, b=1, hq=2, hk=1)
    dout = rng.standard_normal((1, 300, 2, DV))
    opts = dict(causal="top_left", softcap=3.0)

    def loss(**p):
        return np.sum(ref.attention(**p, **opts) * dout)

    g = ref.attention_backward(dout, q, k, v, None, None, **opts)
    params = dict(q=q, k=k, v=v)
    fd_check(loss, params, dict(q=g.dq, k=g.dk, v=g.dv), rng, n_coords=3)


# --- a score_mod that revives a -inf score ---
# A -inf bias removes a pair; a score_mod such as np.maximum(s, -10) brings it back with a finite
# score that no longer depends on q, k or the bias (score_mod(-inf +- h) = score_mod(-inf)): its
# P is not 0, but its score's derivatives are. The reference used to take them at s2 = 0 instead.

def _revive_table(rng):
    return -3.0 - rng.random(HQ)        # -3.x, below most scores: maximum() picks each side


REVIVING = {
    "maximum": lambda table: lambda s, b, h, qi, ki: np.maximum(s, -10.0),
    "clip": lambda table: lambda s, b, h, qi, ki: np.clip(s, -6.0, 1.5),
    "where": lambda table: lambda s, b, h, qi, ki: np.where(s < -1e30, -4.0 + 0.25 * qi, s * 0.5),
    "exp": lambda table: lambda s, b, h, qi, ki: np.exp(s) * 2.0,
    "table": lambda table: lambda s, b, h, qi, ki: np.maximum(s, table[h]),
}


def _reviving_bias(rng, sq, sk):
    """A (B, 1, sq, sk) bias with -inf at about a third of the pairs, every row keeping some
    finite ones."""
    bias = rng.standard_normal((B, 1, sq, sk))
    holes = rng.random(bias.shape) < 0.35
    holes[..., 0] = False
    bias[holes] = -np.inf
    return bias


@pytest.mark.parametrize("name", list(REVIVING))
def test_backward_where_a_score_mod_revives_minus_inf(name, strict):
    """The reference's backward against central differences of its own forward (loss
    sum(dout * out)) in q, k, v, the finite bias elements and a captured table, with a -inf bias
    that the score_mod revives; every -inf bias element gets dbias 0."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    sq, sk = 7, 10
    q, k, v = qkv(rng, sq, sk)
    bias = _reviving_bias(rng, sq, sk)
    table = _revive_table(rng)
    make = REVIVING[name]
    dout = rng.standard_normal((B, sq, HQ, DV))

    def loss(q, k, v, bias, table):
        return np.sum(ref.attention(q, k, v, bias=bias, score_mod=make(table)) * dout)

    g = ref.attention_backward(dout, q, k, v, None, None, bias=bias, score_mod=make(table))
    finite = np.isfinite(bias)
    assert (g.dbias[~finite] == 0).all()
    # the revived pairs count: masking them instead changes the answer
    masked = ref.attention(q, k, v, bias=np.where(finite, bias, 0.0), mask=finite,
                           score_mod=make(table))
    assert not np.allclose(masked, ref.attention(q, k, v, bias=bias, score_mod=make(table)))
    params = dict(q=q, k=k, v=v, bias=bias, table=table)
    grads = dict(q=g.dq, k=g.dk, v=g.dv, bias=g.dbias, table=g.dtensors.get("table"))
    eps = 1e-6
    for pname, x in params.items():
        if pname == "table" and name != "table":
            continue
        coords = np.flatnonzero(np.isfinite(x).ravel())
        for flat in rng.choice(coords, size=min(6, coords.size), replace=False):
            idx = np.unravel_index(flat, x.shape)
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (loss(**{**params, pname: plus}) - loss(**{**params, pname: minus})) / (2 * eps)
            assert grads[pname][idx] == pytest.approx(fd, rel=1e-5, abs=1e-7), (pname, idx)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(REVIVING))
def test_cpu_backend_where_a_score_mod_revives_minus_inf(name, dtype, rng):
    """The CPU backend's symbolic derivative against the reference's (above, held to finite
    differences) on the same reviving score_mods: out, lse, dq, dk, dv, dbias, dtensors."""
    sq, sk = 13, 21
    q, k, v = (x.astype(dtype) for x in qkv(rng, sq, sk))
    bias = _reviving_bias(rng, sq, sk).astype(dtype)
    score_mod = REVIVING[name](_revive_table(rng).astype(dtype))
    r = check_backend(q, k, v, rng, bias=bias, score_mod=score_mod)
    problems = compare_dtensors(r.grads, r.ref_grads, score_mod, dtype)
    assert not problems, problems


GAPS = {"left3e-6": 3e-6, "left1e-7": 1e-7, "left1e-9": 1e-9, "left3e-12": 3e-12, "right3e-6": -3e-6,
        "right1e-7": -1e-7, "right1e-9": -1e-9, "right3e-12": -3e-12}


@pytest.mark.parametrize("gap, lift", [(g, 0.0) for g in GAPS.values()] + [(g, 1e3) for g in GAPS.values() if g != 3e-12],
                         ids=[f"{n}-lift0" for n in GAPS] + [f"{n}-lift1e3" for n, g in GAPS.items() if g != 3e-12])
def test_score_mod_derivative_near_a_kink(gap, lift):
    """A score within the central difference's step (6e-6) of a kink takes its derivative from
    the side that does not cross it: np.maximum(s, -1) + lift has slope 0 below -1 and 1 above,
    exactly, however close (the central difference gave the slope in between). Lifted by 1e3, the
    scores' differences carry 1e3 times the rounding (the bound with them), and shrinking steps
    (reference._shrinking) cannot read the score past a kink 1e-9 or closer: it is left to the
    side (a first cut let two steps agree within their rounding, or both straddle the kink:
    0.9987 at 1e-9, 0.5 at 3e-12). 3e-12 under the kink, lifted, is within the lifted score's
    rounding: the reference reads both sides as smooth there and takes their mean."""
    rng = np.random.default_rng(0)
    q = np.ones((1, 1, 1, 1))
    k = np.array([(1.0 + gap) / 1.5, rng.uniform(0.1, 0.5)]).reshape(1, 2, 1, 1)
    v = rng.standard_normal((1, 2, 1, 3))
    dout = rng.standard_normal((1, 1, 1, 3))
    s0 = -1.5 * float(k[0, 0, 0, 0])
    assert (s0 < -1.0) == (gap > 0) and 0 < abs(s0 + 1.0) < 4e-6
    opts = dict(scale=-1.5, score_mod=lambda s, b, h, qi, ki: np.maximum(s, -1.0) + lift)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    g = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    # dk of key 0 is dS * slope * scale * q: 0 below the kink, nonzero above it
    p = np.exp(np.array([max(s0, -1.0), -1.5 * k[0, 1, 0, 0]]) + lift - lse[0, 0, 0])
    dp = v[0, :, 0] @ dout[0, 0, 0]
    ds0 = p[0] * (dp[0] - p @ dp)
    want = 0.0 if gap > 0 else ds0 * -1.5
    assert abs(g.dk[0, 0, 0, 0] - want) < 1e-9 * (1.0 + lift) * max(1.0, abs(want))


def test_score_mod_derivative_far_from_zero():
    """Scores of a few hundred through a smooth, oscillating score_mod (sin, as the fuzzer's
    "trig"): the big step (relative to |s|, ~0.2 there) truncates by ~5e-6, so the derivative
    comes from the small step, which agrees with half of itself; dq and dk match the closed form
    to float64's rounding (the one-sided differences a kink would take were off by up to 1e-7)."""
    rng = np.random.default_rng(1)
    q, k = (30 * rng.standard_normal((1, n, 1, 4)) for n in (96, 80))
    v, dout = rng.standard_normal((1, 80, 1, 3)), rng.standard_normal((1, 96, 1, 3))
    opts = dict(score_mod=lambda s, b, h, qi, ki: np.sin(s) + np.cos(0.5 * s) * 0.25)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    g = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    s = (q[0, :, 0] @ k[0, :, 0].T) / 2.0
    assert np.abs(s).max() > 200
    t = np.sin(s) + np.cos(0.5 * s) * 0.25
    p = np.exp(t - t.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dp = dout[0, :, 0] @ v[0, :, 0].T
    ds = p * (dp - (p * dp).sum(1, keepdims=True)) * (np.cos(s) - 0.125 * np.sin(0.5 * s))
    for got, want in ((g.dq[0, :, 0], ds @ k[0, :, 0] / 2.0), (g.dk[0, :, 0], ds.T @ q[0, :, 0] / 2.0)):
        assert np.abs(got - want).max() < 1e-9 * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()


def test_score_mod_derivative_where_it_is_steep():
    """Scores of 1e-6 to 1e-2 (either sign) through np.cbrt, whose slope there is 70 to 23000
    and changes by its own size within the central difference's step (6e-6): the steps shrink
    until they settle (reference._shrinking), and dq, dk and the gradient of a captured table
    read through np.cbrt at 1e-6 to 1e-3 match the closed form to 1e-9 (the fixed steps were off
    by up to 1%, and straddled 0 below 6e-6)."""
    rng = np.random.default_rng(2)

    def tiny(shape, lo, hi):
        return rng.choice([-1.0, 1.0], shape) * 10.0 ** rng.uniform(lo, hi, shape)
    q, k = tiny((1, 40, 1, 1), -3, -1), tiny((1, 30, 1, 1), -3, -1)
    table = np.abs(tiny(30, -6, -3))
    v, dout = rng.standard_normal((1, 30, 1, 3)), rng.standard_normal((1, 40, 1, 3))
    opts = dict(score_mod=lambda s, b, h, qi, ki: np.cbrt(s) + np.cbrt(table[ki]))
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    g = ref.attention_backward(dout, q, k, v, out, lse, **opts)
    s = q[0, :, 0] @ k[0, :, 0].T
    assert np.abs(s).min() < 1e-5 and np.abs(s).max() > 1e-3
    t = np.cbrt(s) + np.cbrt(table)
    p = np.exp(t - t.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dp = dout[0, :, 0] @ v[0, :, 0].T
    dt = p * (dp - (p * dp).sum(1, keepdims=True))
    ds = dt / (3 * np.cbrt(s) ** 2)
    for got, want in ((g.dq[0, :, 0], ds @ k[0, :, 0]), (g.dk[0, :, 0], ds.T @ q[0, :, 0]),
                      (g.dtensors["table"], dt.sum(0) / (3 * np.cbrt(table) ** 2))):
        assert np.abs(got - want).max() < 1e-9 * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()
