"""The bad-input battery: every public function x every argument x every kind of wrong value.

tests/test_errors.py holds hand-picked cases with exact messages; this file generates its cases
from tables, so that each argument of each public function meets the same kinds of wrong value:
wrong types, dtypes (int, complex, object, big-endian, mixed), ranks and shapes, lengths and
offsets, option values, out=, backward inputs from another forward, callbacks, and sizes past the
machine's memory (stride-0 views, so the test allocates nothing big). Each case asserts the
documented exception (docs/design.md, Errors) and that the message names the argument. Then: zero-size
dimensions give empty results, inputs are never modified, and NaN / Inf in the data propagate.

Every refusal case is a test named test_bad_input* (from the BAD_* tables and a few by hand); the
other tests (zero sizes, inputs unmodified, NaN / Inf) check results, not refusals. The count of
refusal cases (`-k bad_input` would also match this module's name and count every test in it):
    python -m pytest tests/test_bad_input.py --collect-only -q | grep -c '::test_bad_input'
"""
import re
import warnings
import zlib

import numpy as np
import pytest

import attnext
from attnext import reference

from helpers.bad_inputs import (BAD_COMBINATIONS, BAD_INPUTS, BAD_MISMATCHES, BAD_OUTS, BF16,
                                CU_K, CU_Q, D, DV, F16, F32, F64, FUNCTIONS, GOOD, HK, HQ, K,
                                NONFINITE, Q, SEQLENS, SEQUSED_K, SEQUSED_Q, SK, SQ, V, VK, VQ, VV,
                                call, case_id, randn_seeded)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case_id(c) for c in BAD_INPUTS])
def test_bad_input(case):
    fn, arg, label, value, exc = case
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(exc) as info:
            call(fn, **{arg: value})
    message = str(info.value)
    assert re.search(rf"\b{re.escape(arg)}\b", message), f"{exc.__name__} does not name {arg}: {message}"


# --- callbacks on the reference: refused as on the CPU, with the same message ---

CALLBACK_CASES = [c for c in BAD_INPUTS if c[1] in ("score_mod", "mask_mod")]


@pytest.mark.parametrize("case", CALLBACK_CASES, ids=[case_id(c) for c in CALLBACK_CASES])
def test_bad_input_callback_on_the_reference(case):
    """device="reference" calls score_mod / mask_mod itself on NumPy arrays, where a bool
    score, a float mask or a None would pass unnoticed; it traces them first, so each callback
    the CPU backend refuses is refused there with the same exception and message."""
    fn, arg, label, value, exc = case
    with pytest.raises(exc) as on_cpu:
        call(fn, **{arg: value})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(exc) as on_reference:
            call(fn, device="reference", **{arg: value})
    assert type(on_reference.value) is type(on_cpu.value)
    assert str(on_reference.value) == str(on_cpu.value)


# --- mixed dtypes, disagreeing shapes, unknown keywords: several arguments at once ---

@pytest.mark.parametrize("fn, label, changes, exc, match", BAD_COMBINATIONS,
                         ids=[f"{c[0]}-{c[1]}" for c in BAD_COMBINATIONS])
def test_bad_input_combination(fn, label, changes, exc, match):
    with pytest.raises(exc, match=match):
        call(fn, **changes)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_bad_input_extra_positional(fn):
    with pytest.raises(TypeError, match="positional argument"):
        getattr(attnext, fn)(*GOOD[fn].values(), True)


def test_bad_input_info_takes_nothing():
    with pytest.raises(TypeError):
        attnext.info(1)
    with pytest.raises(TypeError):
        attnext.info(device="cpu")


@pytest.mark.parametrize("args, kw", [((1,), {}), (("cpu",), {}), ((), {"backend": "cpu"})],
                         ids=["int", "str", "keyword"])
def test_bad_input_cache_info_takes_nothing(args, kw):
    with pytest.raises(TypeError, match=r"cache_info\(\)"):
        attnext.cache_info(*args, **kw)


# --- out= ---

@pytest.mark.parametrize("fn, label, value, exc", BAD_OUTS, ids=[f"{c[0]}-{c[1]}" for c in BAD_OUTS])
def test_bad_input_out(fn, label, value, exc):
    changes = {}
    if isinstance(value, tuple):
        name, shared, value = value
        changes[name] = shared
    with pytest.raises(exc, match=r"\bout\b"):
        call(fn, out=value, **changes)
    if label.startswith("aliases_") and "mod" in label:
        with pytest.raises(exc, match=rf"out shares memory with the array '\w+' that {name} captures"):
            call(fn, out=value, **changes)


# --- backward inputs that do not match the forward ---

@pytest.mark.parametrize("fn, arg, value, exc", BAD_MISMATCHES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(BAD_MISMATCHES)])
def test_bad_input_backward_mismatch(fn, arg, value, exc):
    with pytest.raises(exc, match=rf"\b{arg}\b"):
        call(fn, **{arg: value})


def test_backward_of_a_varlen_forward_with_other_lengths():
    """Lengths that differ from the forward's but fit the same packed tensors cannot be detected;
    they run (the gradient is then of another problem) and must not crash."""
    g = call("varlen_attention_backward", cu_seqlens_q=np.array([0, 1, 2, 3]))
    assert g.dq.shape == VQ.shape


# --- sizes past the machine's memory: MemoryError before any allocation or work ---

def _broadcast(shape, dtype=F32):
    """A full-looking array of any size that owns one element (stride 0 everywhere)."""
    return np.broadcast_to(np.ones((1,) * len(shape), dtype), shape)


HUGE = [
    # (function, arguments): out alone would be 1 TiB; the last overflows 2**63 bytes
    ("attention", dict(q=_broadcast((2 ** 16, 2 ** 16, 8, 8)), k=_broadcast((2 ** 16, 1, 8, 8)),
                       v=_broadcast((2 ** 16, 1, 8, 8)))),
    ("attention", dict(q=_broadcast((1, 2 ** 34, 1, 16)), k=_broadcast((1, 1, 1, 16)),
                       v=_broadcast((1, 1, 1, 16)), return_lse=True)),
    ("attention", dict(q=_broadcast((2 ** 24, 2 ** 24, 128, 1)), k=_broadcast((2 ** 24, 1, 1, 1)),
                       v=_broadcast((2 ** 24, 1, 1, 256)))),
    ("attention", dict(q=_broadcast((1, 2 ** 20, 1, 16)), k=_broadcast((1, 2 ** 36, 1, 16)),
                       v=_broadcast((1, 2 ** 36, 1, 16)))),
    ("varlen_attention", dict(q=_broadcast((2 ** 38, 2, 16)), k=_broadcast((4, 2, 16)),
                              v=_broadcast((4, 2, 16)), cu_seqlens_q=np.array([0, 2]),
                              cu_seqlens_k=np.array([0, 4]))),
    ("attention_backward", dict(dout=_broadcast((2 ** 16, 2 ** 16, 8, 8)), q=_broadcast((2 ** 16, 2 ** 16, 8, 8)),
                                k=_broadcast((2 ** 16, 1, 8, 8)), v=_broadcast((2 ** 16, 1, 8, 8)),
                                out=_broadcast((2 ** 16, 2 ** 16, 8, 8)), lse=_broadcast((2 ** 16, 8, 2 ** 16)))),
    ("varlen_attention_backward", dict(dout=_broadcast((2 ** 38, 2, 16)), q=_broadcast((2 ** 38, 2, 16)),
                                       k=_broadcast((4, 2, 16)), v=_broadcast((4, 2, 16)),
                                       out=_broadcast((2 ** 38, 2, 16)), lse=_broadcast((2, 2 ** 38)),
                                       cu_seqlens_q=np.array([0, 2]), cu_seqlens_k=np.array([0, 4]))),
]


@pytest.mark.parametrize("device", ["cpu", "reference"])
@pytest.mark.parametrize("fn, args", HUGE, ids=[f"{c[0]}-{i}" for i, c in enumerate(HUGE)])
def test_bad_input_past_memory(fn, args, device, monkeypatch):
    def no_work(*a, **kw):
        raise AssertionError("work started before the size was refused")

    for name in ("forward", "backward"):
        monkeypatch.setattr(attnext.api._C, name, no_work)
    monkeypatch.setattr(attnext.api, "_new_output", no_work)
    for name in ("attention", "varlen_attention", "attention_backward", "varlen_attention_backward"):
        monkeypatch.setattr(attnext.api.reference, name, no_work)
    with pytest.raises(MemoryError, match=r"GiB.*more than this machine's memory") as info:
        getattr(attnext, fn)(**args, device=device)
    assert re.search(r"\bq \(", str(info.value)), str(info.value)


# --- zero-size dimensions: empty results, never errors, forward and backward ---

ZERO_PADDED = [  # (B, Sq, Sk, Hq, Hk)
    (0, 5, 7, 4, 2), (2, 0, 7, 4, 2), (2, 5, 0, 4, 2), (0, 0, 0, 4, 2), (2, 0, 0, 4, 2),
    (2, 5, 7, 0, 2), (0, 5, 7, 0, 2), (1, 1, 0, 1, 1), (3, 0, 1, 2, 1),
]
ZERO_OPTIONS = {
    "plain": {}, "causal": dict(causal=True), "top_left": dict(causal="top_left"),
    "window": dict(window=(2, 0)), "softcap": dict(softcap=5.0),
    "bias_mask": dict(bias=np.ones(1, F32), mask=np.ones(1, bool)),
    "alibi": "alibi", "seqlens": "seqlens",
}


def _opts(name, b, hq, sq, sk):
    o = ZERO_OPTIONS[name]
    if o == "alibi":
        return dict(alibi_slopes=np.ones((b, hq), F32))
    if o == "seqlens":
        return dict(seqlens_q=np.full(b, sq), seqlens_k=np.zeros(b, np.int64))
    return o


@pytest.mark.parametrize("opt", list(ZERO_OPTIONS))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dims", ZERO_PADDED, ids=["B{}_Sq{}_Sk{}_Hq{}_Hk{}".format(*d) for d in ZERO_PADDED])
def test_zero_size_padded(dims, layout, opt):
    b, sq, sk, hq, hk = dims
    seed = zlib.crc32(repr((dims, layout, opt)).encode())

    def arr(s, h, n):
        return randn_seeded(seed, (b, s, h, n) if layout == "bshd" else (b, h, s, n), F32)

    q, k, v = arr(sq, hq, D), arr(sk, hk, D), arr(sk, hk, DV)
    opts = dict(layout=layout, device="cpu", **_opts(opt, b, hq, sq, sk))
    out, lse = attnext.attention(q, k, v, return_lse=True, **opts)
    want = (b, sq, hq, DV) if layout == "bshd" else (b, hq, sq, DV)
    assert out.shape == want and lse.shape == (b, hq, sq) and out.dtype == F32
    if sk == 0 or opt == "seqlens":
        assert (out == 0).all() and (lse == -np.inf).all()
    g = attnext.attention_backward(np.ones(want, F32), q, k, v, out, lse, **opts)
    assert (g.dq.shape, g.dk.shape, g.dv.shape) == (q.shape, k.shape, v.shape)
    assert all(np.isfinite(x).all() for x in g[:3])
    if "bias" in opts:
        assert g.dbias.shape == (1,) and np.isfinite(g.dbias).all()


ZERO_VARLEN = [  # (Tq, Tk, cu_q, cu_k, seqused_q, seqused_k)
    (0, 6, [0, 0], [0, 6], None, None), (5, 0, [0, 5], [0, 0], None, None),
    (0, 0, [0, 0, 0], [0, 0, 0], None, None), (0, 0, [0], [0], None, None),
    (4, 3, [0], [0], None, None), (6, 5, [0, 3, 6], [0, 2, 5], [0, 0], [2, 3]),
    (6, 5, [0, 3, 6], [0, 2, 5], [3, 1], [0, 0]),
]


@pytest.mark.parametrize("opt", ["plain", "causal", "window", "bias_mask", "alibi"])
@pytest.mark.parametrize("case", ZERO_VARLEN, ids=[f"Tq{c[0]}_Tk{c[1]}_nseq{len(c[2]) - 1}_{i}"
                                                   for i, c in enumerate(ZERO_VARLEN)])
def test_zero_size_varlen(case, opt):
    tq, tk, cu_q, cu_k, used_q, used_k = case
    nseq = len(cu_q) - 1
    q, k, v = randn_seeded(1, (tq, HQ, D)), randn_seeded(2, (tk, HK, D)), randn_seeded(3, (tk, HK, DV))
    lengths = dict(cu_seqlens_q=np.array(cu_q), cu_seqlens_k=np.array(cu_k))
    if used_q is not None:
        lengths.update(seqused_q=np.array(used_q), seqused_k=np.array(used_k))
    opts = _opts(opt, nseq, HQ, 0, 0)
    out, lse = attnext.varlen_attention(q, k, v, **lengths, return_lse=True, device="cpu", **opts)
    assert out.shape == (tq, HQ, DV) and lse.shape == (HQ, tq)
    assert (out == 0).all() and (lse == -np.inf).all()
    g = attnext.varlen_attention_backward(np.ones_like(out), q, k, v, out, lse, **lengths,
                                          device="cpu", **opts)
    assert (g.dq.shape, g.dk.shape, g.dv.shape) == (q.shape, k.shape, v.shape)
    assert all((x == 0).all() for x in g[:3])


# --- inputs are never modified; read-only inputs work ---

def _checksum(x):
    return zlib.crc32(np.ascontiguousarray(x).view(np.uint8).tobytes()), x.shape, x.dtype, x.strides


UNCHANGED_OPTIONS = {
    "plain": {}, "causal_window": dict(causal=True, window=(3, 1)),
    "bias_mask_alibi": "arrays", "softcap_scale": dict(softcap=3.0, scale=0.7),
    "score_mod": "mods",
}


def _option_arrays(opt, varlen):
    o = UNCHANGED_OPTIONS[opt]
    if o == "arrays":
        rows, cols = (5, 4) if varlen else (SQ, SK)   # varlen: the longest seqused
        return dict(bias=randn_seeded(9, (HQ, rows, cols)), mask=np.random.default_rng(10).random((rows, cols)) < 0.8,
                    alibi_slopes=np.abs(randn_seeded(11, (HQ,))))
    if o == "mods":
        table = randn_seeded(12, (HQ, 16))
        return dict(score_mod=lambda s, b, h, qi, ki: s + table[h, np.abs(qi - ki) % 16],
                    mask_mod=lambda b, h, qi, ki: (qi + ki) % 3 != 0)
    return dict(o)


@pytest.mark.parametrize("read_only", [False, True], ids=["writeable", "read_only"])
@pytest.mark.parametrize("opt", list(UNCHANGED_OPTIONS))
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=["f16", "bf16", "f32", "f64"])
def test_inputs_never_modified(dtype, varlen, opt, read_only):
    if varlen:
        arrays = dict(q=VQ.astype(dtype), k=VK.astype(dtype), v=VV.astype(dtype),
                      cu_seqlens_q=CU_Q.copy(), cu_seqlens_k=CU_K.copy(),
                      seqused_q=SEQUSED_Q.copy(), seqused_k=SEQUSED_K.copy())
        fwd, bwd = attnext.varlen_attention, attnext.varlen_attention_backward
    else:
        arrays = dict(q=Q.astype(dtype), k=K.astype(dtype), v=V.astype(dtype), seqlens_q=SEQLENS.copy())
        fwd, bwd = attnext.attention, attnext.attention_backward
    arrays.update(_option_arrays(opt, varlen))
    if read_only:
        for name, x in arrays.items():
            if isinstance(x, np.ndarray):
                x.flags.writeable = False
    before = {n: _checksum(x) for n, x in arrays.items() if isinstance(x, np.ndarray)}
    out, lse = fwd(**arrays, return_lse=True, device="cpu")
    dout = randn_seeded(13, out.shape, dtype)
    if read_only:
        for x in (out, lse, dout):
            x.flags.writeable = False
    seen = {"out": _checksum(out), "lse": _checksum(lse), "dout": _checksum(dout)}
    g = bwd(dout, out=out, lse=lse, **arrays, device="cpu")
    after = {n: _checksum(x) for n, x in arrays.items() if isinstance(x, np.ndarray)}
    assert after == before
    assert {"out": _checksum(out), "lse": _checksum(lse), "dout": _checksum(dout)} == seen
    assert g.dq.shape == arrays["q"].shape


# --- NaN and Inf in the data propagate as IEEE arithmetic says; never a crash ---

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "minus_inf"])
@pytest.mark.parametrize("where, index", NONFINITE, ids=[w for w, _ in NONFINITE])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=["f16", "bf16", "f32", "f64"])
def test_nonfinite_data_propagate(dtype, where, index, value, causal):
    """out is NaN exactly where the reference's is (a NaN or +inf score poisons its row, a NaN key
    every row that sees it), lse is non-finite exactly where the reference's is, and no NaN of the
    reference's gradients goes missing (the backend may have more: 0 * NaN is NaN)."""
    arrays = dict(q=randn_seeded(21, (2, 9, 2, 8), dtype), k=randn_seeded(22, (2, 11, 2, 8), dtype),
                  v=randn_seeded(23, (2, 11, 2, 8), dtype), bias=randn_seeded(24, (2, 2, 9, 11), F32))
    arrays[where][index] = value
    opts = dict(causal=causal, bias=arrays.pop("bias"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = attnext.attention(**arrays, **opts, return_lse=True, device="cpu")
        r_out, r_lse = reference.attention(**arrays, **opts, return_lse=True)
        assert np.array_equal(np.isnan(out), np.isnan(r_out))
        assert np.array_equal(np.isfinite(lse), np.isfinite(r_lse))
        assert np.array_equal(lse == -np.inf, r_lse == -np.inf)
        finite = np.isfinite(r_out)
        tol = 1e-10 if dtype == F64 else 1e-5 if dtype == F32 else 5e-2
        np.testing.assert_allclose(out[finite].astype(F64), r_out[finite], rtol=tol, atol=tol)
        dout = randn_seeded(25, out.shape, dtype)
        g = attnext.attention_backward(dout, **arrays, out=out, lse=lse, **opts, device="cpu")
        rg = reference.attention_backward(dout, **arrays, out=r_out.astype(dtype), lse=r_lse, **opts)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), g[:4], rg[:4]):
        lost = np.isnan(b.astype(F64)) & ~np.isnan(a.astype(F64))
        assert not lost.any(), f"{name}: NaN of the reference's missing at {np.argwhere(lost)[:4].tolist()}"


# --- NaN and Inf in the backward's own inputs (dout, out, lse), and in packed q / k / v ---

def _flash_backward_head(dout, q, k, v, out, lse, keep, scale):
    """One (sequence, head) of what a backend's backward computes from the arrays it is given, in
    float64 with IEEE arithmetic (FlashAttention's backward): P = exp(s - lse);
    delta = rowsum(dout * out); dS = P * (dout v^T - delta). A row whose lse is -inf keeps no key
    and has no gradient path: its P, dS and dq are 0 and its q and dout are not read, so nothing
    of it reaches dk or dv (DESIGN, 7). Every pair of the sequence is computed, masked or not (a
    sequence shorter than the CPU's 64-row tiles is one tile): in a row that keeps a key, a
    masked pair gives 0 * NaN = NaN where a NaN reaches its dout v^T."""
    s = np.where(keep, scale * (q @ k.T), -np.inf)
    live = (lse != -np.inf)[:, None]
    p = np.where(live, np.exp(s - lse[:, None]), 0.0)
    do = np.where(live, dout, 0.0)
    ds = np.where(live, p * (do @ v.T - (do * out).sum(axis=1, keepdims=True)), 0.0)
    return (np.where(live, scale * (ds @ k), 0.0), scale * (ds.T @ np.where(live, q, 0.0)),
            p.T @ do)


def _flash_backward(dout, q, k, v, out, lse, causal, cu_seqlens_q=None, cu_seqlens_k=None):
    """(dq, dk, dv) of _flash_backward_head over every sequence and head, "bshd" or packed; rows
    after cu_seqlens_q[-1] get none."""
    dout, q, k, v, out, lse = (np.asarray(x, F64) for x in (dout, q, k, v, out, lse))
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    if cu_seqlens_q is None:
        segments = [(b, b, lse[b]) for b in range(q.shape[0])]
    else:
        segments = [(slice(q0, q1), slice(k0, k1), lse[:, q0:q1]) for q0, q1, k0, k1 in
                    zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:])]
    group = q.shape[-2] // k.shape[-2]
    for rows, keys, seg_lse in segments:
        lq, lk = q[rows].shape[0], k[keys].shape[0]
        keep = np.ones((lq, lk), bool)
        if causal:
            keep = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq
        dq, dk, dv = grads[0][rows], grads[1][keys], grads[2][keys]
        for h in range(q.shape[-2]):
            hk = h // group
            a, b, c = _flash_backward_head(dout[rows][:, h], q[rows][:, h], k[keys][:, hk], v[keys][:, hk],
                                           out[rows][:, h], seg_lse[h], keep, 1 / np.sqrt(q.shape[-1]))
            dq[:, h] = a
            dk[:, hk] += b
            dv[:, hk] += c
    return grads


# padded: q (2, 9, 4, 8), k and v (2, 11, 2, 8 / 6). Packed: q of 12 rows, the last one padding,
# sequences of (4, 3), (0, 6) and (7, 5) rows; under causal the first rows of the first and the
# last sequence keep no key. (arrays' varlen flag, where, index)
PACKED_CU_Q, PACKED_CU_K = np.array([0, 4, 4, 11]), np.array([0, 3, 9, 14])
NONFINITE_BACKWARD = [
    (False, "dout", (0, 2, 1, 3)), (False, "out", (1, 5, 3, 2)), (False, "lse", (0, 1, 2)),
    (True, "dout", (6, 3, 2)), (True, "out", (7, 2, 0)), (True, "lse", (1, 8)),
    (True, "dout", (11, 0, 0)),            # the padding row: not read
    (True, "q", (6, 1, 3)), (True, "k", (10, 0, 2)), (True, "v", (12, 1, 1)),
]


def _by_lse_row(x, varlen):
    """out or dq as (..., H, S, D), indexed like lse."""
    return x.transpose(1, 0, 2) if varlen else x.transpose(0, 2, 1, 3)


def _nonfinite_problem(dtype, varlen, causal):
    if varlen:
        arrays = dict(q=randn_seeded(31, (12, 4, 8), dtype), k=randn_seeded(32, (14, 2, 8), dtype),
                      v=randn_seeded(33, (14, 2, 6), dtype))
        lengths = dict(cu_seqlens_q=PACKED_CU_Q, cu_seqlens_k=PACKED_CU_K)
        names = ("varlen_attention", "varlen_attention_backward")
    else:
        arrays = dict(q=randn_seeded(31, (2, 9, 4, 8), dtype), k=randn_seeded(32, (2, 11, 2, 8), dtype),
                      v=randn_seeded(33, (2, 11, 2, 6), dtype))
        lengths = {}
        names = ("attention", "attention_backward")
    return arrays, dict(lengths, causal=causal), names


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_flash_backward_model_is_the_reference_on_finite_data(varlen, causal):
    """The model the next test holds the backward to computes the reference's gradients."""
    arrays, opts, (fwd, bwd) = _nonfinite_problem(F64, varlen, causal)
    out, lse = getattr(reference, fwd)(**arrays, **opts, return_lse=True)
    dout = randn_seeded(35, out.shape, F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model = _flash_backward(dout, **arrays, out=out, lse=lse, **opts)
    want = getattr(reference, bwd)(dout, **arrays, out=out, lse=lse, **opts)
    for name, a, b in zip(("dq", "dk", "dv"), model, want[:3]):
        assert np.abs(b).max() > 0.1, name
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "minus_inf"])
@pytest.mark.parametrize("varlen, where, index", NONFINITE_BACKWARD,
                         ids=[f"{'varlen' if c[0] else 'padded'}-{c[1]}-{'_'.join(map(str, c[2]))}"
                              for c in NONFINITE_BACKWARD])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=["f16", "bf16", "f32", "f64"])
def test_nonfinite_backward_inputs_propagate(dtype, varlen, where, index, value, causal):
    """The rule for non-finite values: IEEE arithmetic on what each backend computes.

    The backward reads out and lse as given (FlashAttention's algorithm: P = exp(s - lse),
    delta = rowsum(dout * out), dS = P * (dout v^T - delta)); the reference recomputes both from
    q, k, v and reads neither. So the gradients are held to those formulas evaluated in float64
    on the very arrays the backend was given (_flash_backward): non-finite exactly where they
    are non-finite, finite values within the dtype's tolerance elsewhere. NaN and +-inf are not
    told apart: which one comes out depends on how a sum is ordered (for an infinite dout, the
    reference's delta = sum P * dP adds +inf and -inf into NaN where dout . out gives +-inf, so
    its dk is NaN where the backend's is +-inf). Against the reference: for a non-finite dout
    (out and lse the forward's) the gradients are non-finite exactly where its are; for
    non-finite q, k, v none of its non-finite gradients goes missing. The forward of non-finite
    packed q, k, v: lse non-finite (and -inf) exactly where the reference's is, out NaN exactly
    where its is, and out = 0 in a row that keeps no key (DESIGN, 7), on both, whatever NaN
    sits in v. Padding rows after cu_seqlens[-1] get zero gradients whatever their dout.
    """
    arrays, opts, (fwd, bwd) = _nonfinite_problem(dtype, varlen, causal)
    if where in arrays:
        arrays[where][index] = value
    tol = {F64: 1e-10, F32: 1e-5, F16: 5e-3, BF16: 1e-2}[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = getattr(attnext, fwd)(**arrays, **opts, return_lse=True, device="cpu")
        r_out, r_lse = getattr(reference, fwd)(**arrays, **opts, return_lse=True)
        assert np.array_equal(np.isfinite(lse), np.isfinite(r_lse))
        keeps_none = lse == -np.inf
        assert np.array_equal(keeps_none, r_lse == -np.inf)
        rows, r_rows = (_by_lse_row(x, varlen) for x in (out.astype(F64), r_out))
        assert (rows[keeps_none] == 0).all() and (r_rows[keeps_none] == 0).all()
        rows, r_rows = rows[~keeps_none], r_rows[~keeps_none]
        assert np.array_equal(np.isnan(rows), np.isnan(r_rows))
        finite = np.isfinite(r_rows)
        np.testing.assert_allclose(rows[finite], r_rows[finite], rtol=tol, atol=tol)
        given = dict(dout=randn_seeded(35, out.shape, dtype), out=out.copy(), lse=lse.copy())
        if where in given:
            given[where][index] = value
        g = getattr(attnext, bwd)(**given, **arrays, **opts, device="cpu")
        rg = getattr(reference, bwd)(**given, **arrays, **opts)
        model = _flash_backward(**given, **arrays, **opts)
    for name, got, want, ref in zip(("dq", "dk", "dv"), g[:3], model, rg[:3]):
        got = got.astype(F64)
        differ = np.isfinite(got) != np.isfinite(want)
        assert not differ.any(), (f"{name}: finite in one and not the other of the backend and the "
                                  f"model at {np.argwhere(differ)[:4].tolist()}")
        both = np.isfinite(want)
        np.testing.assert_allclose(got[both], want[both], rtol=tol, atol=tol, err_msg=name)
        if where == "dout":
            assert np.array_equal(np.isfinite(got), np.isfinite(ref)), name
        elif where in arrays:
            lost = ~np.isfinite(ref) & np.isfinite(got)
            assert not lost.any(), (f"{name}: finite where the reference's is not, at "
                                    f"{np.argwhere(lost)[:4].tolist()}")
    if varlen:
        assert (g.dq[PACKED_CU_Q[-1]:] == 0).all()
