"""Rows that keep no key (docs/design.md, semantics 7 and 8) whatever NaN or inf sits where they
cannot see it.

A row with no kept column (fully masked, before the causal diagonal, outside its window, dropped
by a mask_mod), a row whose kept scores are all -inf (a -inf bias), a padding row past seqused
and a packed row after cu_seqlens[-1] all give out = 0, lse = -inf and dq = 0 exactly, and add
nothing to dk, dv and dbias: they have no gradient path, so neither a NaN or inf in their dout
(or in their q) nor one in a key, value or bias element they do not keep may reach a gradient as
0 * NaN. The backward reads lse as given: a row is such a row when its lse is -inf.

Each case builds fresh random data, finds the rows that keep no key from the reference's lse on
the clean data, then plants NaN or inf in the dout and q of those rows, in the bias elements
they read, and in the keys and values of a (sequence, kv head) whose rows all keep nothing. The
backend (the reference, the CPU, and the GPU under `-m gpu`: DEVICES) must then give:
- out = 0, lse = -inf in exactly those rows, and the reference's out and lse elsewhere;
- dq = 0 in those rows, and the same dq, dk, dv, dbias, bit for bit, as when those rows' dout
  is 0 (the backward reads nothing of theirs);
- the reference's gradients for dout zeroed there, which are finite (conftest's tolerance).

test_nan_at_a_key_no_row_keeps puts the NaN or inf at a key that no row of its head keeps, in a
head that has rows of both kinds. A kept row then computes 0 * NaN at that masked pair inside a
computed tile (the CPU) or in its delta (the reference): its gradients may be NaN, as README
says. Rows that keep no key are still exactly 0, nothing of theirs reaches a gradient, and every
gradient the reference gives finite is finite and agrees.
"""
import types
import warnings

import numpy as np
import pytest

from attnext.testing.accuracy import compare_dtensors
from conftest import (BF16, F32, F64, assert_close, assert_lse_close, compare_grads, dead_rows,
                      entry_points, make_qkv, make_varlen_qkv, randn)

# The GPU's dK / dV / dQ kernels compute such rows like any other (P = 0 times whatever their dO
# holds); attn_bwd_pre marks them and attn_bwd_dead (kernels/attn_bwd.cu) redoes the dK, dV they
# touched and zeroes their dq. The _d64 / _d128 cases take attn_bwd_sm90.cu's kernels on Hopper
# (the warp-specialised one at D = Dv = 64 and 128, the recomputing one at D 64 / Dv 128), the
# others attn_bwd.cu's. On cuda the mask_mod cases run the GPU's generated kernels, from NumPy
# arrays (staged) and, in test_mods_on_cuda_arrays, from torch CUDA tensors in place.
DEVICES = ["reference", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
VALUES = [np.nan, np.inf]
VALUE_IDS = ["nan", "inf"]
DTYPES = [F32, BF16]
GPU_DTYPES = (F32, BF16)


def _mask_case(rng, dtype, D=16, Dv=24):
    """bshd, B 2, Sq 70 x Sk 90 (two CPU tiles each way), GQA 4 / 2, softcap, a per-head boolean
    mask and bias. Rows that keep nothing: row 5 of batch 0 (every head), rows 64-66 of batch 0
    head 1 (the second query tile), and all of batch 1's heads 2 and 3 (kv head 1). Key 77 of
    batch 0 is kept by no row."""
    q, k, v = make_qkv(rng, 2, 70, 90, 4, 2, D, Dv, dtype)
    mask = rng.random((2, 4, 70, 90)) < 0.6
    mask[0, :, 5] = False
    mask[0, 1, 64:67] = False
    mask[1, 2:4] = False
    mask[0, :, :, 77] = False
    return dict(q=q, k=k, v=v, opts=dict(mask=mask, bias=randn(rng, (2, 4, 70, 90), F32),
                                         softcap=20.0),
                dead_kv=[(1, 3, 1), (1, 70, 1), (1, 10, 1), (1, 89, 1)],
                nobody_key=(0, 77))


def _causal_case(rng, dtype, D=32):
    """causal (bottom-right) with Sq 100 > Sk 40: rows 0-59 keep nothing. The bias (Sq, Sk) is
    shared by every head (dbias sums over them)."""
    q, k, v = make_qkv(rng, 1, 100, 40, 2, 1, D, D, dtype)
    return dict(q=q, k=k, v=v, opts=dict(causal=True, bias=randn(rng, (100, 40), F32)))


def _top_left_window_case(rng, dtype):
    """causal="top_left" with window (3, 10), Sq 130 > Sk 40 (the window is on the bottom-right
    diagonal c = r - 90): row r keeps r - 93 <= c <= min(r, r - 80), so rows 0-79 keep nothing.
    (causal="top_left" alone leaves no such row: row r keeps c = 0.)"""
    q, k, v = make_qkv(rng, 2, 130, 40, 3, 3, 24, 16, dtype)
    return dict(q=q, k=k, v=v, opts=dict(causal="top_left", window=(3, 10)))


def _window_case(rng, dtype, D=8, Dv=40):
    """"bhsd", window (2, 1) with Sq 90 > Sk 70: row r keeps r - 22 <= c <= r - 19, so rows 0-18
    keep nothing. A bias (1, Hq, Sq, Sk)."""
    q, k, v = make_qkv(rng, 2, 90, 70, 2, 1, D, Dv, dtype, layout="bhsd")
    return dict(q=q, k=k, v=v, opts=dict(window=(2, 1), layout="bhsd",
                                         bias=randn(rng, (1, 2, 90, 70), F32)))


def _varlen_case(rng, dtype):
    """Packed, causal: sequences of (Lq, Lk) = (45, 40) used of (50, 40), (0, 30), (70, 60)
    used of (80, 80), (20, 10); five rows after the last sequence. Rows that keep nothing: the
    first 5 rows of sequence 0 and 10 of sequence 3, the padding rows past seqused_q, the rows
    after cu_seqlens_q[-1]. Keys nobody reads: sequence 1's (no query row) and those past
    seqused_k."""
    q, k, v = make_varlen_qkv(rng, 155, 160, 4, 2, 16, 16, dtype)
    lengths = dict(cu_seqlens_q=np.array([0, 50, 50, 130, 150], np.int32),
                   cu_seqlens_k=np.array([0, 40, 70, 150, 160], np.int32),
                   seqused_q=np.array([45, 0, 70, 20], np.int32),
                   seqused_k=np.array([40, 30, 60, 10], np.int32))
    return dict(q=q, k=k, v=v, lengths=lengths, opts=dict(causal=True),
                dead_kv=[(40, 0), (69, 1), (55, 1), (140, 0), (149, 1)])


def _mask_mod_case(rng, dtype, D=16):
    """A mask_mod and a score_mod with a captured table, Sq = Sk = 100: rows with q_idx % 7 == 3
    keep nothing, nor do heads 2 and 3 (kv head 1); the score_mod gives -inf to every pair of
    the rows with q_idx % 11 == 5 (their kept scores are all -inf: no gradient reaches the
    table from them); key 77 is kept by no row."""
    q, k, v = make_qkv(rng, 1, 100, 100, 4, 2, D, D, dtype)
    table = rng.standard_normal((4, 16))

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx % 7 != 3) & (h < 2) & (kv_idx != 77) & (kv_idx <= q_idx + 20)

    def score_mod(score, b, h, q_idx, kv_idx):
        return np.where(q_idx % 11 == 5, -np.inf, score + table[h, kv_idx % 16])
    return dict(q=q, k=k, v=v, opts=dict(mask_mod=mask_mod, score_mod=score_mod),
                dead_kv=[(0, 0, 1), (0, 99, 1), (0, 50, 1)], nobody_key=(0, 77))


def _bias_minus_inf_case(rng, dtype):
    """Rows whose kept scores are all -inf: a bias of -inf at every pair the mask keeps in rows
    3, 40 and 66 of every head (the mask drops a third of the pairs)."""
    q, k, v = make_qkv(rng, 1, 70, 50, 2, 2, 16, 16, dtype)
    mask = rng.random((70, 50)) < 0.7
    bias = randn(rng, (2, 70, 50), F32)
    bias[:, [3, 40, 66]] = -np.inf
    return dict(q=q, k=k, v=v, opts=dict(mask=mask, bias=bias), no_q=True)


CASES = {"mask": _mask_case, "causal_sq_gt_sk": _causal_case,
         "top_left_window": _top_left_window_case, "window_bhsd": _window_case,
         "varlen_seqused": _varlen_case, "mask_mod": _mask_mod_case,
         "bias_minus_inf": _bias_minus_inf_case,
         # the head dims of the Hopper kernels (see DEVICES; the forward: attn_fwd_sm90.cu)
         "mask_d64": lambda rng, dtype: _mask_case(rng, dtype, D=64, Dv=64),
         "causal_d128": lambda rng, dtype: _causal_case(rng, dtype, D=128),
         "window_d64_dv128": lambda rng, dtype: _window_case(rng, dtype, D=64, Dv=128),
         "mask_mod_d128": lambda rng, dtype: _mask_mod_case(rng, dtype, D=128)}


def _problem(name, rng, dtype):
    """The case's clean arrays and where the rows that keep no key are: dead, a mask over out's
    leading dims, and dead_lse, over lse's (from the reference on the clean data)."""
    c = types.SimpleNamespace(lengths=None, dead_kv=[], nobody_key=None, no_q=False)
    c.__dict__.update(CASES[name](rng, dtype))
    c.varlen = c.lengths is not None
    c.layout = c.opts.get("layout", "bshd")
    _, rfwd = entry_points(c.lengths)[::2]
    _, lse = rfwd(c.q, c.k, c.v, **dict(c.lengths or {}), return_lse=True, **c.opts)
    c.dead_lse = np.isneginf(lse)
    c.dead = dead_rows(lse, c.varlen, c.layout)
    assert c.dead.any() and not c.dead.all(), "the case must have rows of both kinds"
    return c


def _plant_bias(bias, dead_lse, value):
    """bias[b, h, r, c] = value, in place, for each row r that keeps no key in every (batch,
    query head) reading that bias row (a broadcast bias is shared by several), except where the
    bias is -inf (a kept pair of a row whose kept scores are all -inf: NaN there would make the
    row NaN)."""
    b4 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    nb, nh, sq = dead_lse.shape
    assert b4.shape[2] == sq
    dead = dead_lse.reshape(nb, b4.shape[1], nh // b4.shape[1], sq).all(axis=2)
    if b4.shape[0] == 1:
        dead = dead.all(axis=0, keepdims=True)
    rows = b4[dead]
    b4[dead] = np.where(rows == -np.inf, rows, value)


def _planted(c, value, rng):
    """The case's arrays with NaN / inf planted: (q, k, v, opts, dout, dout0), dout0 being dout
    with 0 in the rows that keep no key."""
    q, k, v = (x.copy() for x in (c.q, c.k, c.v))
    opts = dict(c.opts)
    if not c.no_q:
        q[c.dead] = value
    for key in c.dead_kv:   # a few elements of each such key's k and v rows
        k[key][::5] = value
        v[key][1::7] = value
    if opts.get("bias") is not None and not c.varlen:
        opts["bias"] = opts["bias"].copy()
        _plant_bias(opts["bias"], c.dead_lse, value)
    shape = q.shape[:-1] + v.shape[-1:]
    dout0 = randn(rng, shape, q.dtype)
    dout0[c.dead] = 0
    dout = dout0.copy()
    dout[c.dead] = value
    dout[c.dead & (rng.random(c.dead.shape) < 0.5)] = -value   # both signs
    return q, k, v, opts, dout, dout0


def _skip_unless(device, dtype, request):
    if device == "cuda":
        request.getfixturevalue("gpu")
        if np.dtype(dtype) not in GPU_DTYPES:
            pytest.skip(f"cuda: no kernels for {np.dtype(dtype)}")


def _named(grads):
    """{name: gradient}: dq, dk, dv, dbias (None without a bias), then the dtensors."""
    return dict(zip(("dq", "dk", "dv", "dbias"), grads[:4]), **grads.dtensors)


def _zero_outside(x, keep):
    """x with 0 where keep is False (NaN-free for the accuracy check), in x's dtype."""
    return None if x is None else np.where(keep, x, np.zeros((), x.dtype))


def _check(c, device, every_finite, move=None):
    """Runs case c (c.planted: _planted's arrays) on device and checks what the module docstring
    lists; every_finite: the reference's results (dout zeroed in the rows that keep no key) must
    be finite everywhere. move: (put, get), the call's arrays put on a GPU library's arrays and
    its results got back (a score_mod / mask_mod with NumPy arrays runs on the CPU whatever the
    device: this puts it on the GPU's generated kernels). Returns the backend's gradients."""
    fwd, bwd, rfwd, rbwd = entry_points(c.lengths)
    lengths = dict(c.lengths or {})
    dtype = np.dtype(c.q.dtype)
    q, k, v, opts, dout, dout0 = c.planted
    put, get = move or (lambda x: x, lambda x: x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        d_q, d_k, d_v = put(q), put(k), put(v)
        d_out, d_lse = fwd(d_q, d_k, d_v, **lengths, return_lse=True, device=device, **opts)
        out, lse = get(d_out), get(d_lse)
        r_out, r_lse = rfwd(q, k, v, **lengths, return_lse=True, **opts)
        g, g0 = (bwd(put(x), d_q, d_k, d_v, d_out, d_lse, **lengths, device=device, **opts) for x in (dout, dout0))
        g, g0 = (x._replace(**{n: get(getattr(x, n)) for n in ("dq", "dk", "dv", "dbias")}) for x in (g, g0))
        rg = rbwd(dout0, q, k, v, out, lse, **lengths, **opts)

    assert np.array_equal(np.isneginf(lse), c.dead_lse), "lse: -inf not exactly in the rows that keep no key"
    assert np.array_equal(np.isneginf(r_lse), c.dead_lse), "reference lse: -inf rows moved"
    assert (out[c.dead] == 0).all(), "out: a row that keeps no key is not exactly 0"
    assert (r_out[c.dead] == 0).all(), "reference out: a row that keeps no key is not exactly 0"
    assert (g.dq[c.dead] == 0).all(), "dq: a row that keeps no key is not exactly 0"
    assert (rg.dq[c.dead] == 0).all(), "reference dq: a row that keeps no key is not exactly 0"
    for (name, a), b in zip(_named(g).items(), _named(g0).values()):
        if a is not None:
            np.testing.assert_array_equal(a.astype(F64), b.astype(F64),
                                          err_msg=f"{name}: changed by the dout of rows that keep no key")
    if every_finite:
        assert np.isfinite(r_out).all(), "reference out: not finite"
        for name, x in _named(rg).items():
            assert x is None or np.isfinite(x).all(), f"reference {name}: not finite"

    # where the reference is finite: the backend is finite and agrees
    held = np.isfinite(r_out)
    assert np.isfinite(out[held].astype(F64)).all(), "out: not finite where the reference is"
    assert_close("out", _zero_outside(out, held), _zero_outside(r_out, held), dtype)
    assert_lse_close(lse, r_lse, dtype)
    holds = [None if x is None else np.isfinite(x) for x in rg[:4]]
    for name, x, h in zip(("dq", "dk", "dv", "dbias"), g[:4], holds):
        if h is not None:
            bad = np.argwhere(h & ~np.isfinite(x.astype(F64)))
            assert not len(bad), (f"{name}: not finite where the reference is, at {len(bad)} "
                                  f"indices, first {bad[:6].tolist()}")
    part, r_part = ([_zero_outside(x, h) for x, h in zip(grads[:4], holds)] for grads in (g, rg))
    # the rounded-out allowance (bfloat16) reads q, k, v: the planted elements are read by no
    # kept pair, so 0 there gives the same allowance, without NaN
    clean = [np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in (q, k, v)]
    problems = compare_grads(g._replace(dq=part[0], dk=part[1], dv=part[2], dbias=part[3]),
                             rg._replace(dq=r_part[0], dk=r_part[1], dv=r_part[2], dbias=r_part[3]),
                             *clean, dout0, _zero_outside(out, held), _zero_outside(r_out, held),
                             c.lengths, opts)
    if rg.dtensors and dtype == F32:   # bfloat16 needs fuzz.py's rounded-out allowance here
        held_t = {n: np.isfinite(x) for n, x in rg.dtensors.items()}
        for n, h in held_t.items():
            assert np.isfinite(g.dtensors[n][h]).all(), f"dtensors[{n!r}]: not finite where the reference is"
        problems += compare_dtensors(
            g._replace(dtensors={n: _zero_outside(x, held_t[n]) for n, x in g.dtensors.items()}),
            rg._replace(dtensors={n: _zero_outside(x, held_t[n]) for n, x in rg.dtensors.items()}),
            opts["score_mod"], dtype)
    assert not problems, "\n".join(problems)
    return g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_rows_that_keep_no_key(dtype, case, value, device, rng, request):
    _skip_unless(device, dtype, request)
    c = _problem(case, rng, dtype)
    c.planted = _planted(c, value, rng)
    g = _check(c, device, every_finite=True)
    for key in c.dead_kv:   # keys that only rows keeping nothing (or no row) could read
        assert (g.dk[key] == 0).all() and (g.dv[key] == 0).all(), f"dk, dv of key {key} not 0"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("case", ["mask", "mask_mod"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_nan_at_a_key_no_row_keeps(dtype, case, where, value, device, rng, request):
    _skip_unless(device, dtype, request)
    c = _problem(case, rng, dtype)
    q, k, v, opts, dout, dout0 = _planted(c, value, rng)
    b, col = c.nobody_key
    (k if where == "k" else v)[b, col, :, :3] = value   # every kv head of that batch item
    c.planted = q, k, v, opts, dout, dout0
    _check(c, device, every_finite=False)


@pytest.mark.parametrize("device", ["reference", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_forward_rows_that_keep_no_key(dtype, case, value, device, rng, request):
    """The forward alone, which the GPU holds too: out exactly 0 and lse -inf in the rows that
    keep no key, whatever NaN or inf sits in their q or in the keys and values they do not keep
    (an unkept NaN value used to reach such a row's out as 0 * NaN), the reference's out and lse
    elsewhere."""
    _skip_unless(device, dtype, request)
    c = _problem(case, rng, dtype)
    q, k, v, opts, _, _ = _planted(c, value, rng)
    fwd, _, rfwd, _ = entry_points(c.lengths)
    lengths = dict(c.lengths or {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = fwd(q, k, v, **lengths, return_lse=True, device=device, **opts)
        r_out, r_lse = rfwd(q, k, v, **lengths, return_lse=True, **opts)
    assert np.array_equal(np.isneginf(lse), c.dead_lse), "lse: -inf not exactly in the rows that keep no key"
    assert (out[c.dead] == 0).all(), "out: a row that keeps no key is not exactly 0"
    assert np.isfinite(r_out).all(), "reference out: not finite"
    assert_close("out", out, r_out, np.dtype(dtype))
    assert_lse_close(lse, r_lse, np.dtype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("case", ["mask_mod", "mask_mod_d128"])
def test_mods_on_cuda_arrays(case, value, gpu, rng, torch):
    """The mask_mod / score_mod cases on torch CUDA tensors, so the generated kernels run them
    (the recomputing dK / dV and dQ kernels, the dQ kernel's dtensors scatter, attn_bwd_dead with
    the mods): the same checks as test_rows_that_keep_no_key."""
    from helpers.gpu import to_gpu, to_host
    c = _problem(case, rng, BF16)
    c.planted = _planted(c, value, rng)
    g = _check(c, "cuda", every_finite=True,
               move=(lambda x: to_gpu(torch, x), lambda t: None if t is None else to_host(torch, t)))
    for key in c.dead_kv:
        assert (g.dk[key] == 0).all() and (g.dv[key] == 0).all(), f"dk, dv of key {key} not 0"
