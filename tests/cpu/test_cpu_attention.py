"""The CPU backend against the float64 reference, forward and backward.

With ATTNEXT_TEST_DEVICE=cuda the same tests run on the GPU (DEVICE; gpu/test_cuda.py).
Every check goes through conftest.check_backend: out, lse, dq, dk, dv and dbias against the
reference on the same inputs, with the three-way tolerance described in conftest.py.
"""
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import attnext
from attnext import _C, reference
from conftest import (BF16, DTYPES, F16, F32, F64, TEST_DEVICE, assert_close, check_backend,
                      dtype_id, make_qkv, make_varlen_qkv, poisoned, randn, skip_unless_device_has)

DEVICE = TEST_DEVICE

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (3, 1)}
# awkward lengths, and lengths at the CPU backend's 64-row tile edges
LENGTHS = [(1, 1), (3, 3), (113, 203), (239, 1), (127, 129), (129, 127), (64, 64), (65, 193)]
CAUSAL = [False, True, "top_left"]


# --- the stacked grid ---

@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("sq, sk", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
@pytest.mark.parametrize("window", [None, (19, 7)], ids=["nowin", "win19_7"])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_grid(dtype, heads, causal, window, sq, sk, layout, rng):
    hq, hk = HEADS[heads]
    q, k, v = make_qkv(rng, 2, sq, sk, hq, hk, 40, 33, dtype, layout)
    check_backend(q, k, v, rng, causal=causal, window=window, layout=layout)


HEAD_DIMS = [(1, 1), (40, 40), (59, 59), (96, 96), (128, 128), (192, 128), (256, 256), (59, 17),
             (3, 256)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(113, 203), (129, 127)], ids=["113x203", "129x127"])
@pytest.mark.parametrize("d, dv", HEAD_DIMS, ids=[f"d{a}_dv{b}" for a, b in HEAD_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_head_dims(dtype, d, dv, sq, sk, causal, rng):
    q, k, v = make_qkv(rng, 1, sq, sk, 2, 1, d, dv, dtype)
    check_backend(q, k, v, rng, causal=causal)


WINDOWS = [(0, 0), (-1, 0), (0, -1), (5, -1), (-1, 3), (1, 1), (300, 300), (40, 2)]


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("sq, sk", [(70, 150), (150, 70), (1, 90)],
                         ids=["70x150", "150x70", "1x90"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"win{a}_{b}" for a, b in WINDOWS])
def test_windows(window, sq, sk, causal, rng):
    q, k, v = make_qkv(rng, 1, sq, sk, 2, 2, 24, 16, F32)
    check_backend(q, k, v, rng, causal=causal, window=window)


SMALL_CASES = {
    "plain": {},
    "causal_window": dict(causal=True, window=(30, 4)),
    "top_left": dict(causal="top_left"),
    "everything": dict(causal=True, bias="bias", mask="mask", alibi="alibi", softcap=3.0),
    "varlen": dict(varlen=True, causal=True),
}


def _small_case(rng, dtype, case, sq, sk):
    """q, k, v and options for one test_small_grid case."""
    opts = dict(SMALL_CASES[case])
    b, hq, hk = 2, 4, 2
    if opts.pop("varlen", False):
        q, k, v = make_varlen_qkv(rng, 2 * sq + 3, 2 * sk + 1, hq, hk, 37, 29, dtype)
        varlen = dict(cu_seqlens_q=np.array([0, sq, 2 * sq]),
                      cu_seqlens_k=np.array([0, sk, 2 * sk]))
        return q, k, v, varlen, opts
    q, k, v = make_qkv(rng, b, sq, sk, hq, hk, 37, 29, dtype)
    if "bias" in opts:
        opts["bias"] = randn(rng, (hk, sq, sk), dtype)
        opts["mask"] = rng.random((b, 1, 1, sk)) < 0.8
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, hq)
        del opts["alibi"]
    return q, k, v, None, opts


@pytest.mark.parametrize("sq, sk", [(3, 3), (113, 203), (129, 65)],
                         ids=["3x3", "113x203", "129x65"])
@pytest.mark.parametrize("case", list(SMALL_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_small_grid(dtype, case, sq, sk, rng):
    """Every feature once per dtype: the set each SIMD variant runs (test_simd_variants)."""
    q, k, v, varlen, opts = _small_case(rng, dtype, case, sq, sk)
    check_backend(q, k, v, rng, varlen=varlen, **opts)


def test_simd_name():
    """In a subprocess started by test_simd_variants: the variant asked for is the one running."""
    want = os.environ.get("ATTNEXT_TEST_EXPECT_SIMD")
    if not want:
        pytest.skip("only meaningful under test_simd_variants")
    assert _C.simd() == want


# simd.c's variants, worst first, on this architecture
SIMD_LEVELS = ["portable", "neon"] if platform.machine() == "aarch64" else ["portable", "avx2", "avx512"]


def _best_simd():
    """The best variant this CPU runs, asked of a fresh process with no ATTNEXT_SIMD."""
    env = {k: v for k, v in os.environ.items() if k != "ATTNEXT_SIMD"}
    r = subprocess.run([sys.executable, "-c", "from attnext import _C; print(_C.simd())"],
                       env=env, capture_output=True, text=True, check=True)
    return r.stdout.strip()


@pytest.mark.parametrize("variant", SIMD_LEVELS)
def test_simd_variants(variant):
    """ATTNEXT_SIMD is read once per process, so each variant runs test_small_grid in its own
    interpreter."""
    best = _best_simd()
    if SIMD_LEVELS.index(variant) > SIMD_LEVELS.index(best):
        pytest.skip(f"this CPU runs at most {best}")
    env = dict(os.environ, ATTNEXT_SIMD=variant, ATTNEXT_TEST_EXPECT_SIMD=variant)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        __file__, "-k", "test_small_grid or test_simd_name"],
                       env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


# --- varlen and padding ---

VARLEN_CU_Q = np.array([0, 9, 9, 80, 81, 130])       # 5 sequences, the second empty
VARLEN_CU_K = np.array([0, 14, 14, 100, 100, 163])   # the fourth has no keys
VARLEN_USED_Q = np.array([7, 0, 70, 1, 45])
VARLEN_USED_K = np.array([12, 0, 80, 0, 60])
TQ, TK = 137, 170                                    # 7 trailing padding rows each


def _real_rows(cu, used, total):
    """Rows of a packed tensor that belong to a sequence (inside seqused when given)."""
    real = np.zeros(total, dtype=bool)
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b] if used is None else used[b]
        real[cu[b]:cu[b] + n] = True
    return real


def _check_varlen_padding(res, seqused):
    used_q = VARLEN_USED_Q if seqused else None
    used_k = VARLEN_USED_K if seqused else None
    pad_q = ~_real_rows(VARLEN_CU_Q, used_q, TQ)
    pad_k = ~_real_rows(VARLEN_CU_K, used_k, TK)
    assert pad_q[-7:].all() and pad_k[-7:].all()
    assert (res.out[pad_q] == 0).all() and (res.lse[:, pad_q] == -np.inf).all()
    if res.grads is not None:
        assert (res.grads.dq[pad_q] == 0).all()
        assert (res.grads.dk[pad_k] == 0).all() and (res.grads.dv[pad_k] == 0).all()


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("seqused", [False, True], ids=["segments", "seqused"])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_varlen(dtype, causal, seqused, heads, rng):
    hq, hk = HEADS[heads]
    q, k, v = make_varlen_qkv(rng, TQ, TK, hq, hk, 40, 24, dtype)
    varlen = dict(cu_seqlens_q=VARLEN_CU_Q, cu_seqlens_k=VARLEN_CU_K)
    if seqused:
        varlen.update(seqused_q=VARLEN_USED_Q, seqused_k=VARLEN_USED_K)
    res = check_backend(q, k, v, rng, varlen=varlen, causal=causal)
    assert res.out.shape == (TQ, hq, 24) and res.lse.shape == (hq, TQ)
    _check_varlen_padding(res, seqused)


@pytest.mark.parametrize("seqused", [False, True], ids=["segments", "seqused"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_varlen_everything(dtype, seqused, rng):
    """Bias, mask, alibi, softcap and window on packed sequences, with max_seqlen above the
    longest sequence (bias and mask are shaped by max_seqlen)."""
    hq, hk = 6, 2
    q, k, v = make_varlen_qkv(rng, TQ, TK, hq, hk, 32, 48, dtype)
    mq, mk = 75, 90
    varlen = dict(cu_seqlens_q=VARLEN_CU_Q, cu_seqlens_k=VARLEN_CU_K, max_seqlen_q=mq,
                  max_seqlen_k=mk)
    if seqused:
        varlen.update(seqused_q=VARLEN_USED_Q, seqused_k=VARLEN_USED_K)
    nseq = len(VARLEN_CU_Q) - 1
    opts = dict(causal=True, window=(25, -1), softcap=4.0,
                bias=randn(rng, (nseq, hk, mq, mk), F32),
                mask=rng.random((nseq, 1, 1, mk)) < 0.85,
                alibi_slopes=rng.uniform(0.0, 0.2, (nseq, hq)))
    res = check_backend(q, k, v, rng, varlen=varlen, **opts)
    _check_varlen_padding(res, seqused)


def test_varlen_all_padding(rng):
    """cu_seqlens of only empty sequences: every row is padding."""
    q, k, v = make_varlen_qkv(rng, 5, 4, 2, 1, 8)
    varlen = dict(cu_seqlens_q=np.array([0, 0, 0]), cu_seqlens_k=np.array([0, 0, 0]))
    res = check_backend(q, k, v, rng, varlen=varlen, out=poisoned((5, 2, 8), F32))
    assert (res.out == 0).all() and (res.lse == -np.inf).all()
    assert all((x == 0).all() for x in res.grads[:3])


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("dtype", [F16, F32, F64], ids=dtype_id)
def test_seqlens(dtype, causal, layout, rng):
    """Padded batches with actual lengths: rows past them are exactly zero, lse -inf."""
    sq, sk = 70, 90
    seqlens_q, seqlens_k = np.array([70, 0, 17, 33]), np.array([41, 90, 0, 90])
    q, k, v = make_qkv(rng, 4, sq, sk, 4, 2, 24, 20, dtype, layout)
    res = check_backend(q, k, v, rng, causal=causal, layout=layout, seqlens_q=seqlens_q,
                    seqlens_k=seqlens_k, bias=randn(rng, (4, 1, sq, sk), F32))
    out, dq, dk, dv = res.out, res.grads.dq, res.grads.dk, res.grads.dv
    if layout == "bhsd":
        out, dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (out, dq, dk, dv))
    for b in range(4):
        lq, lk = seqlens_q[b], seqlens_k[b]
        assert (out[b, lq:] == 0).all() and (res.lse[b, :, lq:] == -np.inf).all()
        assert (dq[b, lq:] == 0).all()
        assert (dk[b, lk:] == 0).all() and (dv[b, lk:] == 0).all()
        dbias = res.grads.dbias[b]
        assert (dbias[:, lq:] == 0).all() and (dbias[:, :, lk:] == 0).all()
    assert (out[2, :17] == 0).all() and (res.lse[2, :, :17] == -np.inf).all()   # no keys


# --- bias ---

B_, HQ_, HK_, SQ_, SK_ = 2, 6, 2, 45, 77
BIAS_SHAPES = {           # (declared shape, the compact array it is broadcast from)
    "Sk": ((SK_,), (SK_,)),
    "1_1_Sq_Sk": ((1, 1, SQ_, SK_), (1, 1, 1, SK_)),
    "B_1_1_Sk": ((B_, 1, 1, SK_), (1, 1, 1, SK_)),
    "Hk_Sq_Sk": ((HK_, SQ_, SK_), (HK_, SQ_, 1)),
    "Hq_1_1": ((HQ_, 1, 1), (1, 1, 1)),
    "full": ((B_, HQ_, SQ_, SK_), (1, HQ_, 1, SK_)),
    "B_Hk_Sq_1": ((B_, HK_, SQ_, 1), (B_, 1, SQ_, 1)),
}


@pytest.mark.parametrize("bias_dtype", [F16, BF16, F32, F64], ids=dtype_id)
@pytest.mark.parametrize("given", ["array", "broadcast_view", "reversed_view"])
@pytest.mark.parametrize("shape", list(BIAS_SHAPES))
@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_bias_shapes(dtype, shape, given, bias_dtype, rng):
    declared, compact = BIAS_SHAPES[shape]
    if given == "array":
        bias = randn(rng, declared, bias_dtype)
    elif given == "broadcast_view":
        bias = np.broadcast_to(randn(rng, compact, bias_dtype), declared)
    else:   # negative strides
        bias = np.flip(randn(rng, declared, bias_dtype))
    q, k, v = make_qkv(rng, B_, SQ_, SK_, HQ_, HK_, 32, 24, dtype)
    res = check_backend(q, k, v, rng, bias=bias, causal="top_left")
    assert res.grads.dbias.shape == declared and res.grads.dbias.dtype == bias_dtype


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_bias_is_indexed_batch_head_row_col(layout, rng):
    """The bias broadcasts to (B, H, Sq, Sk) whatever the layout of q, k, v."""
    q, k, v = make_qkv(rng, 2, 30, 40, 4, 2, 16, 16, F64, layout)
    bias = randn(rng, (2, 4, 30, 40), F64)
    check_backend(q, k, v, rng, bias=bias, layout=layout)


def test_scalar_bias_and_mask(rng):
    """0-d bias and mask broadcast to everything; dbias comes back 0-d."""
    q, k, v = make_qkv(rng, 2, 20, 30, 2, 1, 8, 8, F32)
    res = check_backend(q, k, v, rng, bias=np.array(0.5, F32), mask=np.array(True), causal=True)
    assert res.grads.dbias.shape == ()
    res = check_backend(q, k, v, rng, mask=np.array(False))
    assert (res.out == 0).all() and (res.lse == -np.inf).all()


def test_bias_with_neg_inf(rng):
    """A row whose kept scores are all -inf gives out = 0, lse = -inf, zero gradients."""
    q, k, v = make_qkv(rng, 2, 20, 30, 2, 1, 16, 16, F32)
    bias = randn(rng, (2, 1, 20, 30), F32)
    bias[0, 0, 3, :] = -np.inf                 # a whole row
    bias[1, 0, 5, 10:] = -np.inf               # the rest of a causal row
    bias[1, 0, 7, ::2] = -np.inf               # some entries
    bias[:, :, :, 29] = -np.inf                # a whole column
    res = check_backend(q, k, v, rng, bias=bias, causal="top_left")
    assert (res.lse[0, :, 3] == -np.inf).all() and (res.out[0, 3] == 0).all()
    assert (res.grads.dq[0, 3] == 0).all()
    assert np.isfinite(res.lse[1, :, 5]).all()


# --- masks ---

MASK_SHAPES = {
    "Sq_Sk": (SQ_, SK_),
    "B_1_1_Sk": (B_, 1, 1, SK_),
    "1_Hk_Sq_1": (1, HK_, SQ_, 1),
    "Hq_Sq_Sk": (HQ_, SQ_, SK_),
    "full": (B_, HQ_, SQ_, SK_),
}


@pytest.mark.parametrize("given", ["array", "broadcast_view", "reversed_view"])
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=dtype_id)
def test_mask_shapes(dtype, shape, given, rng):
    declared = MASK_SHAPES[shape]
    if given == "array":
        mask = rng.random(declared) < 0.7
    elif given == "broadcast_view":   # broadcast over the leading dim, read through stride 0
        mask = np.broadcast_to(rng.random((1,) + declared[1:]) < 0.7, declared)
    else:   # negative strides
        mask = np.flip(rng.random(declared) < 0.7)
    q, k, v = make_qkv(rng, B_, SQ_, SK_, HQ_, HK_, 32, 24, dtype)
    check_backend(q, k, v, rng, mask=mask, bias=randn(rng, (SK_,), F32))


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("dtype", [F16, F32], ids=dtype_id)
def test_fully_masked_rows(dtype, causal, rng):
    """Rows that keep nothing: out exactly 0, lse -inf, dq exactly 0, no NaN, no warning."""
    sq, sk = 90, 70
    q, k, v = make_qkv(rng, 2, sq, sk, 4, 2, 16, 16, dtype)
    mask = rng.random((2, 1, sq, sk)) < 0.6
    mask[0, 0, [0, 17, 64, 65, 89]] = False        # rows across tiles
    mask[1, 0, :, :] = mask[1, 0, :, :] & (np.arange(sq) % 3 != 0)[:, None]
    res = check_backend(q, k, v, rng, mask=mask, causal=causal, bias=randn(rng, (sq, sk), F32))
    for b, rows in ((0, [0, 17, 64, 65, 89]), (1, list(range(0, sq, 3)))):
        assert (res.lse[b, :, rows] == -np.inf).all()
        assert (res.out[b, rows] == 0).all() and (res.grads.dq[b, rows] == 0).all()


def test_mask_all_false(rng):
    q, k, v = make_qkv(rng, 2, 33, 65, 2, 2, 8, 8, F32)
    mask = np.broadcast_to(np.zeros((1, 1, 1, 1), bool), (2, 2, 33, 65))
    res = check_backend(q, k, v, rng, mask=mask, bias=randn(rng, (2, 1, 1, 65), F32))
    assert (res.out == 0).all() and (res.lse == -np.inf).all()
    assert all((x == 0).all() for x in res.grads[:4])


# --- alibi, softcap, scale ---

@pytest.mark.parametrize("slopes_dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("per_batch", [False, True], ids=["Hq", "B_Hq"])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=dtype_id)
def test_alibi(dtype, causal, per_batch, slopes_dtype, rng):
    q, k, v = make_qkv(rng, 2, 50, 83, 4, 2, 24, 24, dtype)
    slopes = rng.uniform(0.0, 0.5, (2, 4) if per_batch else (4,)).astype(slopes_dtype)
    check_backend(q, k, v, rng, alibi_slopes=slopes, causal=causal)


@pytest.mark.parametrize("softcap", [0.3, 2.0, 50.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_softcap(dtype, softcap, rng):
    q, k, v = make_qkv(rng, 2, 66, 131, 4, 1, 48, 40, dtype)
    check_backend(q, k, v, rng, softcap=softcap, scale=0.5, causal=True)


@pytest.mark.parametrize("scale", [0.0, -0.4, 0.05, 2.5, 7])
def test_scale(scale, rng):
    q, k, v = make_qkv(rng, 1, 70, 90, 2, 2, 20, 20, F64)
    check_backend(q, k, v, rng, scale=scale, causal="top_left")


def test_scale_that_rounds_to_zero_in_float32(rng):
    """A float64 scale > 0 that is 0 in float32: the causal tiles must not meet -inf * 0."""
    q, k, v = make_qkv(rng, 1, 150, 150, 2, 2, 32, 32, F32)
    check_backend(q, k, v, rng, scale=1e-50, causal=True)
    check_backend(q, k, v, rng, scale=1e-50, window=(40, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_large_scores(dtype, rng):
    """Scores in the hundreds and a bias of -1e4 here and there: the online softmax must not
    overflow, and rows whose weights underflow to one key must still match. (A bias of +1e4
    would make the problem ill-conditioned in float32: 1e4 + s keeps only ~1e-3 of s.)"""
    q, k, v = make_qkv(rng, 2, 70, 150, 2, 1, 32, 16, dtype)
    bias = randn(rng, (2, 1, 70, 150), F32)
    bias[:, :, ::7, ::3] = -1e4
    # |scores| reach ~200 (> log(FLT_MAX) = 88): their own float32 round-off, 200 * eps ~ 2.4e-5,
    # moves P by as much relative, so the relative allowance (2e-5) is scaled by cond
    check_backend(q, k, v, rng, scale=8.0, bias=bias, causal=True, cond=4.0)


COMBO_LENGTHS = [(1, 1), (37, 200), (200, 37), (128, 128)]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("sq, sk", COMBO_LENGTHS, ids=[f"{a}x{b}" for a, b in COMBO_LENGTHS])
@pytest.mark.parametrize("causal", [True, "top_left"], ids=["causal", "top_left"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_everything_together(dtype, causal, sq, sk, layout, rng):
    """causal + window + bias + mask + alibi + softcap + scale + seqlens at once, GQA."""
    b, hq, hk = 2, 6, 3
    q, k, v = make_qkv(rng, b, sq, sk, hq, hk, 36, 20, dtype, layout)
    opts = dict(causal=causal, window=(50, 10), softcap=6.0, scale=0.2, layout=layout,
                bias=np.broadcast_to(randn(rng, (1, hk, sq, 1), dtype), (b, hk, sq, sk)),
                mask=rng.random((1, 1, sq, sk)) < 0.9,
                alibi_slopes=rng.uniform(0, 0.1, (b, hq)),
                seqlens_q=np.array([sq, max(sq - 5, 0)]), seqlens_k=np.array([max(sk - 9, 1), sk]))
    check_backend(q, k, v, rng, **opts)


# --- strides, broadcasting, read-only inputs, out= ---

def _noncontiguous(rng, kind, dtype, b=2, sq=41, sk=67, hq=4, hk=2, d=24, dv=16):
    if kind == "steps":          # every other row, every other feature, reversed keys
        q = randn(rng, (b, 2 * sq, hq, d), dtype)[:, ::2]
        k = randn(rng, (b, sk, hk, 2 * d), dtype)[..., ::2]
        v = randn(rng, (b, sk, hk, dv), dtype)[:, ::-1]
    elif kind == "transposed":   # heads-major memory read as "bshd", Fortran-ordered k
        q = randn(rng, (b, hq, sq, d), dtype).transpose(0, 2, 1, 3)
        k = np.asfortranarray(randn(rng, (b, sk, hk, d), dtype))
        v = randn(rng, (dv, b, sk, hk), dtype).transpose(1, 2, 3, 0)
    elif kind == "broadcast_batch":   # k / v shared by the batch: stride 0
        q = randn(rng, (b, sq, hq, d), dtype)
        k = np.broadcast_to(randn(rng, (1, sk, hk, d), dtype), (b, sk, hk, d))
        v = np.broadcast_to(randn(rng, (1, sk, hk, dv), dtype), (b, sk, hk, dv))
    elif kind == "broadcast_heads":   # one kv head read as hk heads, q broadcast over rows
        q = np.broadcast_to(randn(rng, (b, 1, hq, d), dtype), (b, sq, hq, d))
        k = np.broadcast_to(randn(rng, (b, sk, 1, d), dtype), (b, sk, hk, d))
        v = np.broadcast_to(randn(rng, (b, sk, 1, dv), dtype), (b, sk, hk, dv))
    return q, k, v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["steps", "transposed", "broadcast_batch", "broadcast_heads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_noncontiguous(dtype, kind, causal, rng):
    q, k, v = _noncontiguous(rng, kind, dtype)
    assert not (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous)
    res = check_backend(q, k, v, rng, causal=causal)
    g = res.grads
    assert g.dk.shape == k.shape and g.dv.shape == v.shape and g.dq.shape == q.shape
    if kind.startswith("broadcast"):   # a gradient per broadcast copy, not their sum
        assert all(0 not in x.strides for x in g[:3])


def test_noncontiguous_varlen(rng):
    q = randn(rng, (TQ, 4, 2 * 24), F32)[..., ::2]
    k = randn(rng, (2, TK, 2, 24), F32)[1]
    v = randn(rng, (TK, 2, 16), F32)[::-1]
    varlen = dict(cu_seqlens_q=VARLEN_CU_Q, cu_seqlens_k=VARLEN_CU_K, seqused_q=VARLEN_USED_Q,
                  seqused_k=VARLEN_USED_K)
    res = check_backend(q, k, v, rng, varlen=varlen, causal=True)
    _check_varlen_padding(res, True)


def _misaligned(values):
    """A copy of `values` whose data starts one byte into its buffer (flags.aligned is False)."""
    raw = np.zeros(values.nbytes + 1, np.uint8)[1:]
    a = raw.view(values.dtype).reshape(values.shape)
    a[...] = values
    assert not a.flags.aligned
    return a


@pytest.mark.parametrize("dtype", [F16, F32, F64], ids=dtype_id)
def test_misaligned(dtype, rng):
    q, k, v = (_misaligned(x) for x in make_qkv(rng, 2, 37, 50, 4, 2, 24, 16, dtype))
    out = _misaligned(poisoned((2, 37, 4, 16), dtype))
    check_backend(q, k, v, rng, out=out, causal=True, bias=_misaligned(randn(rng, (37, 50), F32)))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_backward_reads_strided_dout_out_lse(layout, rng):
    """dout, out and lse as strided views give the same bits as contiguous copies."""
    q, k, v = make_qkv(rng, 2, 70, 90, 4, 2, 24, 16, F32, layout)
    opts = dict(causal=True, layout=layout, bias=randn(rng, (90,), F32), device=DEVICE)
    out, lse = attnext.attention(q, k, v, return_lse=True, **opts)
    dout = randn(rng, out.shape, F32)
    want = attnext.attention_backward(dout, q, k, v, out, lse, **opts)

    def strided(x):
        big = np.full(x.shape[:-1] + (2 * x.shape[-1],), np.nan, x.dtype)
        big[..., ::2] = x
        return big[..., ::2]

    flipped_dout = np.flip(np.flip(dout, 1).copy(), 1)     # negative strides
    got = attnext.attention_backward(flipped_dout, q, k, v, strided(out), strided(lse), **opts)
    for a, b in zip(got[:4], want[:4]):
        assert np.array_equal(a, b)


def _frozen(x):
    if isinstance(x, np.ndarray):
        x = x.view()
        x.flags.writeable = False
    return x


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=dtype_id)
def test_inputs_read_only_and_unchanged(dtype, varlen, rng):
    hq, hk = 4, 2
    if varlen:
        q, k, v = make_varlen_qkv(rng, TQ, TK, hq, hk, 24, 16, dtype)
        nseq = len(VARLEN_CU_Q) - 1
        lengths = dict(cu_seqlens_q=VARLEN_CU_Q.copy(), cu_seqlens_k=VARLEN_CU_K.copy(),
                       seqused_q=VARLEN_USED_Q.copy(), seqused_k=VARLEN_USED_K.copy())
        sq, sk, b = 70, 80, nseq     # the longest seqused_q, seqused_k
    else:
        b, sq, sk = 2, 37, 53
        q, k, v = make_qkv(rng, b, sq, sk, hq, hk, 24, 16, dtype)
        lengths = dict(seqlens_q=np.array([37, 20]), seqlens_k=np.array([50, 53]))
    opts = dict(bias=randn(rng, (b, hk, sq, sk), dtype), mask=rng.random((b, 1, sq, sk)) < 0.8,
                alibi_slopes=rng.uniform(0, 0.3, (b, hq)), causal=True, softcap=5.0)
    arrays = dict(q=q, k=k, v=v, **lengths, **opts)
    copies = {n: x.copy() for n, x in arrays.items() if isinstance(x, np.ndarray)}
    frozen = {n: _frozen(x) for n, x in arrays.items()}
    fq, fk, fv = frozen.pop("q"), frozen.pop("k"), frozen.pop("v")
    if varlen:
        cu = (frozen.pop("cu_seqlens_q"), frozen.pop("cu_seqlens_k"))
        out, lse = attnext.varlen_attention(fq, fk, fv, *cu, device=DEVICE, return_lse=True,
                                            **frozen)
        dout = _frozen(randn(rng, out.shape, dtype))
        saved = (out.copy(), lse.copy(), dout.copy())
        g = attnext.varlen_attention_backward(dout, fq, fk, fv, out, lse, *cu, device=DEVICE,
                                              **frozen)
    else:
        out, lse = attnext.attention(fq, fk, fv, device=DEVICE, return_lse=True, **frozen)
        dout = _frozen(randn(rng, out.shape, dtype))
        saved = (out.copy(), lse.copy(), dout.copy())
        g = attnext.attention_backward(dout, fq, fk, fv, out, lse, device=DEVICE, **frozen)
    for name, x in arrays.items():
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, copies[name], err_msg=name)
    for x, y in zip((out, lse, dout), saved):
        np.testing.assert_array_equal(x, y)
    assert g.dq.flags.writeable and g.dbias.shape == opts["bias"].shape


@pytest.mark.parametrize("frozen", ["out", "lse"])
def test_backward_reads_read_only_out_and_lse(frozen, rng):
    q, k, v = make_qkv(rng, 1, 8, 8, 1, 1, 4, 4, F32)
    out, lse = attnext.attention(q, k, v, device=DEVICE, return_lse=True)
    saved = out.copy(), lse.copy()
    out, lse = (_frozen(x) if name == frozen else x for name, x in (("out", out), ("lse", lse)))
    g = attnext.attention_backward(np.ones_like(out), q, k, v, out, lse, device=DEVICE)
    want = reference.attention_backward(np.ones_like(out), q, k, v, out, lse)
    assert_close("dq", g.dq, want.dq)
    np.testing.assert_array_equal(out, saved[0])
    np.testing.assert_array_equal(lse, saved[1])


# The CPU forward's two paths for q and out held in the accumulation type (float32, float64) with
# rows of stride 1: Q tiles transposed straight from q (D a multiple of 32, whole 64-row tiles),
# and out's rows written past the caches once out holds 4 MiB (cpu.c: STREAM_OUT_BYTES; the whole
# 64-byte lines of a row, the partial ones at its ends by ordinary stores). The shapes take them:
# 1100 rows (a last tile of 12), 8 query heads of 128 over 2 kv heads (4.3 MiB of float32);
# "q_strided" and "out_strided" send q or out down the ordinary path, "out_unaligned" (float
# aligned, 16-byte not) out's rows to memcpy whole, "out_offset" (16-byte aligned, 64-byte not)
# streams rows with partial lines at both ends.
@pytest.mark.parametrize("given", ["contiguous", "bhsd", "q_strided", "out_strided", "out_unaligned",
                                   "out_offset"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_large_forward_layouts(dtype, given, rng):
    if DEVICE != "cpu":
        pytest.skip("the CPU backend's paths")
    layout = "bhsd" if given == "bhsd" else "bshd"
    b, sq, sk, hq, hk, d = 1, 1100, 1200, 8, 2, 128
    q, k, v = make_qkv(rng, b, sq, sk, hq, hk, d, d, dtype, layout)
    if given == "q_strided":
        q = np.repeat(q, 2, axis=-1)[..., ::2]
    shape = (b, sq, hq, d) if layout == "bshd" else (b, hq, sq, d)
    size = int(np.prod(shape))
    if given == "out_strided":
        out = poisoned(shape[:-1] + (2 * d,), dtype)[..., ::2]
    elif given in ("out_unaligned", "out_offset"):
        at = np.dtype(dtype).itemsize if given == "out_unaligned" else 16     # the address mod 64
        raw = np.full(size + 64, np.nan, dtype)
        first = next(i for i in range(64) if raw[i:].ctypes.data % 64 == at)
        out = raw[first:first + size].reshape(shape)
    else:
        out = poisoned(shape, dtype)
    assert out.nbytes >= 4 << 20
    check_backend(q, k, v, rng, out=out, layout=layout, backward=False)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "varlen"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_out_poisoned(dtype, layout, rng):
    """out= filled with NaN first: every element must be written; the same object comes back."""
    if layout == "varlen":
        q, k, v = make_varlen_qkv(rng, TQ, TK, 4, 2, 24, 20, dtype)
        varlen = dict(cu_seqlens_q=VARLEN_CU_Q, cu_seqlens_k=VARLEN_CU_K, seqused_q=VARLEN_USED_Q,
                      seqused_k=VARLEN_USED_K)
        out = poisoned((TQ, 4, 20), dtype)
        check_backend(q, k, v, rng, varlen=varlen, out=out, causal=True)
    else:
        q, k, v = make_qkv(rng, 2, 65, 129, 4, 2, 24, 20, dtype, layout)
        out = poisoned((2, 65, 4, 20) if layout == "bshd" else (2, 4, 65, 20), dtype)
        check_backend(q, k, v, rng, out=out, layout=layout, causal=True,
                  seqlens_q=np.array([65, 30]), seqlens_k=np.array([129, 0]))


def test_out_strided(rng):
    """A strided out= view: its elements are written, the elements between them are not."""
    q, k, v = make_qkv(rng, 2, 33, 47, 2, 2, 16, 12, F32)
    big = poisoned((2, 33, 2, 24), F32)
    out = big[..., ::2]
    check_backend(q, k, v, rng, out=out, causal=True)
    assert np.isnan(big[..., 1::2]).all()


# --- Sq != Sk, long sequences ---

@pytest.mark.parametrize("window", [None, (100, 0), (-1, 3)], ids=["nowin", "win100_0", "win-1_3"])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("sq", [1, 2, 5, 16])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=dtype_id)
def test_decode(dtype, sq, causal, window, rng):
    """KV-cache decode: a few queries against a long cache, both causal alignments."""
    q, k, v = make_qkv(rng, 2, sq, 1000, 8, 2, 64, 64, dtype)
    check_backend(q, k, v, rng, causal=causal, window=window, seqlens_k=np.array([1000, 731]))


@pytest.mark.parametrize("sq, sk", [(4095, 4097)])
def test_long(sq, sk, rng):
    q, k, v = make_qkv(rng, 1, sq, sk, 1, 1, 16, 16, F32)
    check_backend(q, k, v, rng, causal=True, window=(3000, -1))


# --- determinism, threads, SIMD variants ---

def _bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


def _run_all(q, k, v, dout, **opts):
    out, lse = attnext.attention(q, k, v, device=DEVICE, return_lse=True, **opts)
    g = attnext.attention_backward(dout, q, k, v, out, lse, device=DEVICE, **opts)
    return [out, lse, g.dq, g.dk, g.dv, g.dbias]


@pytest.mark.parametrize("bias_shape", [(1, 1, 1, 300), (2, 4, 200, 300), (200, 1)],
                         ids=["bias_B_H_bcast", "bias_full", "bias_cols_bcast"])
def test_deterministic_backward(bias_shape, rng, monkeypatch):
    q, k, v = make_qkv(rng, 2, 200, 300, 4, 2, 40, 40, F32)
    opts = dict(bias=randn(rng, bias_shape, F32), causal="top_left",
                mask=rng.random((200, 300)) < 0.9)
    dout = randn(rng, (2, 200, 4, 40), F32)
    monkeypatch.delenv("ATTNEXT_NUM_THREADS", raising=False)
    first = _run_all(q, k, v, dout, **opts)
    again = _run_all(q, k, v, dout, **opts)
    out, lse = first[:2]
    g = attnext.attention_backward(dout, q, k, v, out, lse, device=DEVICE, deterministic=False,
                                   **opts)
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], first[2:], g[:4]):
        assert np.array_equal(_bits(a), _bits(b)), f"{name} with deterministic=False"
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", "1")
    one = _run_all(q, k, v, dout, **opts)
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", "2")
    two = _run_all(q, k, v, dout, **opts)
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", "3")
    three = _run_all(q, k, v, dout, **opts)
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    for other in (again, one, two, three):
        for name, a, b in zip(names, first, other):
            assert np.array_equal(_bits(a), _bits(b)), name


def test_deterministic_varlen(rng, monkeypatch):
    q, k, v = make_varlen_qkv(rng, TQ, TK, 4, 2, 24, 16, F32)
    varlen = dict(cu_seqlens_q=VARLEN_CU_Q, cu_seqlens_k=VARLEN_CU_K, seqused_q=VARLEN_USED_Q)
    dout = randn(rng, (TQ, 4, 16), F32)
    bias = randn(rng, (5, 1, 70, 86), F32)   # longest seqused_q, longest key segment

    def run():
        out, lse = attnext.varlen_attention(q, k, v, **varlen, bias=bias, device=DEVICE,
                                            return_lse=True)
        g = attnext.varlen_attention_backward(dout, q, k, v, out, lse, **varlen, bias=bias,
                                              device=DEVICE)
        return [out, lse, g.dq, g.dk, g.dv, g.dbias]

    monkeypatch.setenv("ATTNEXT_NUM_THREADS", "1")
    one = run()
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", "2")
    for a, b in zip(one, run()):
        assert np.array_equal(_bits(a), _bits(b))


def test_concurrent_threads(rng):
    """The GIL is released while attention runs; calls from several threads stay correct."""
    cases = [make_qkv(rng, 1, 150, 170, 2, 1, 32, 32, F32) for _ in range(4)]
    want = [attnext.attention(q, k, v, device=DEVICE, causal=True) for q, k, v in cases]
    got = [None] * len(cases)

    def work(i):
        for _ in range(3):
            got[i] = attnext.attention(*cases[i], device=DEVICE, causal=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


def test_gil_released_during_a_call(rng, monkeypatch):
    """Another Python thread keeps running while a long call is in C: its longest pause stays far
    below the call's length (with the GIL held it would span the whole call)."""
    skip_unless_device_has(F32)
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", "1")
    q, k, v = make_qkv(rng, 1, 4096, 4096, 4, 4, 64, 64, F32)
    started, done = threading.Event(), threading.Event()
    span = []

    def work():
        started.set()
        try:
            t0 = time.perf_counter()
            attnext.attention(q, k, v, device=DEVICE)
            span.append(time.perf_counter() - t0)
        finally:
            done.set()      # a call that raises must not leave the loop below spinning forever

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    last, longest_pause = time.perf_counter(), 0.0
    while not done.is_set():
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
    worker.join()
    assert span, "the call raised (the thread's traceback is above)"
    assert span[0] > 0.05, "the call is too short to tell"
    assert longest_pause < span[0] / 3, (longest_pause, span[0])


def test_device_selection(rng, monkeypatch):
    """device=None runs the CPU (no GPU in this build); ATTNEXT_DEVICE overrides it."""
    q, k, v = make_qkv(rng, 1, 20, 30, 2, 1, 8, 8, F32)
    monkeypatch.delenv("ATTNEXT_DEVICE", raising=False)
    cpu = attnext.attention(q, k, v, device=DEVICE)
    assert np.array_equal(attnext.attention(q, k, v), cpu)
    monkeypatch.setenv("ATTNEXT_DEVICE", "reference")
    ref_out = attnext.attention(q, k, v)
    assert np.array_equal(ref_out, reference.attention(q, k, v).astype(F32))
    assert_close("out", cpu, reference.attention(q, k, v))


def test_precision_tf32_on_cpu_keeps_float32_accuracy(rng):
    q, k, v = make_qkv(rng, 2, 64, 96, 2, 2, 32, 32, F32)
    check_backend(q, k, v, rng, precision="tf32", causal=True)


# --- score_mod / mask_mod (the CPU interpreter; the zoo: tests/cpu/test_score_mod.py) ---

def _tanh_mod(s, b, h, qi, ki):
    return s + 0.5 * np.tanh(s) * (h + 1)


def _rel_bias_mod(table):
    return lambda s, b, h, qi, ki: s + table[h, np.abs(qi - ki) % table.shape[1]]


@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("mods", ["score", "mask", "both"])
def test_score_and_mask_mods(dtype, mods, rng):
    q, k, v = make_qkv(rng, 2, 40, 57, 4, 2, 16, 16, dtype)
    opts = dict(causal=True)
    if mods in ("score", "both"):
        opts["score_mod"] = _rel_bias_mod(rng.standard_normal((4, 8)))
    if mods in ("mask", "both"):
        opts["mask_mod"] = lambda b, h, qi, ki: (qi + ki + h) % 5 != 0
    check_backend(q, k, v, rng, **opts)


def test_score_mod_varlen(rng):
    q, k, v = make_varlen_qkv(rng, TQ, TK, 4, 2, 16, 16, F32)
    varlen = dict(cu_seqlens_q=VARLEN_CU_Q, cu_seqlens_k=VARLEN_CU_K, seqused_q=VARLEN_USED_Q,
                  seqused_k=VARLEN_USED_K)
    res = check_backend(q, k, v, rng, varlen=varlen, score_mod=_tanh_mod,
                    mask_mod=lambda b, h, qi, ki: ki <= qi + b)
    _check_varlen_padding(res, True)


# --- memory ---

MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import attnext
    S, D = 32768, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, S, 1, D), dtype=np.float32) for _ in range(3))
    out = np.full((1, S, 1, D), np.nan, dtype=np.float32)
    mask = np.broadcast_to(np.ones((1, 1, 1, 1), bool), (1, 1, S, S))
    small = attnext.attention(q[:, :64], k[:, :64], v[:, :64], causal=True, device="cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out, lse = attnext.attention(q, k, v, causal=True, mask=mask, device="cpu", out=out,
                                 return_lse=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert np.isfinite(out).all()
    print((after - before) * 1024)
    dout = rng.standard_normal((1, S, 1, D), dtype=np.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = attnext.attention_backward(dout, q, k, v, out, lse, causal=True, mask=mask, device="cpu")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert np.isfinite(g.dq).all() and np.isfinite(g.dk).all()
    print((after - before) * 1024)
""")


def test_memory_is_linear():
    """A 32768 x 32768 causal problem with a broadcast (1, 1, S, S) mask. The forward raises
    peak RSS by under 64 MiB over its inputs and output; the backward (three gradients of 8 MiB
    each, plus its packed tiles and per-key-chunk partial dq, all linear in S) by under 512 MiB,
    an eighth of one Sq x Sk float32 matrix (4 GiB; the mask expanded would be 1 GiB)."""
    r = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    forward, backward = (int(x) for x in r.stdout.split()[-2:])
    assert forward < 64 * 2**20, f"the forward's peak RSS grew by {forward / 2**20:.1f} MiB"
    assert backward < 512 * 2**20, f"the backward's peak RSS grew by {backward / 2**20:.1f} MiB"


@pytest.mark.parametrize("seqused", [False, True], ids=["segments", "seqused"])
def test_varlen_many_sequences(seqused, rng):
    """Many short packed sequences, a third of them empty, with bias and GQA."""
    nseq = 150
    seg_q = rng.integers(0, 20, nseq) * (rng.random(nseq) > 0.33)
    seg_k = rng.integers(0, 20, nseq) * (rng.random(nseq) > 0.33)
    cu_q, cu_k = np.concatenate([[0], np.cumsum(seg_q)]), np.concatenate([[0], np.cumsum(seg_k)])
    q, k, v = make_varlen_qkv(rng, cu_q[-1] + 3, cu_k[-1], 4, 2, 16, 8, F32)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    len_k = seg_k
    if seqused:
        len_k = rng.integers(0, seg_k + 1)
        varlen.update(seqused_q=rng.integers(0, seg_q + 1), seqused_k=len_k)
    bias = randn(rng, (nseq, 1, 1, len_k.max()), F32)
    check_backend(q, k, v, rng, varlen=varlen, causal="top_left", bias=bias)


def test_info_reports_the_cpu_backend():
    info = attnext.info()
    assert info["version"] == attnext.__version__
    assert info["backends"]["cpu"].startswith("usable") and _C.simd() in info["backends"]["cpu"]
    assert info["backends"]["reference"] == "usable"


@pytest.mark.parametrize("window", [(2 ** 63 - 1, 2 ** 63 - 1), (2 ** 63 - 1, -1), (-1, 2 ** 64),
                                    (10 ** 30, 3)])
def test_huge_windows_are_unbounded_sides(window, rng):
    """A side wider than any distance is unbounded; int64 arithmetic must not wrap on the way."""
    q, k, v = make_qkv(rng, 1, 40, 70, 2, 1, 16, 16, F32)
    same = tuple(-1 if w > 10 ** 6 else w for w in window)
    check_backend(q, k, v, rng, window=window)
    got = attnext.attention(q, k, v, window=window, device=DEVICE)
    assert np.array_equal(got, attnext.attention(q, k, v, window=same, device=DEVICE))


def test_misaligned_broadcast_bias_stays_a_broadcast(rng, monkeypatch):
    """Realigning a misaligned broadcast bias copies its base, not the broadcast shape."""
    q, k, v = make_qkv(rng, 2, 30, 50, 2, 2, 16, 16, F32)
    raw = np.zeros(50 * 4 + 1, np.uint8)[1:].view(F32)
    raw[:] = rng.standard_normal(50)
    bias = np.broadcast_to(raw, (2, 2, 30, 50))
    assert not bias.flags.aligned
    seen = {}
    real = attnext.checks._broadcast_4d

    def spy(name, x, *args):
        res = real(name, x, *args)
        seen[name] = res[0]
        return res

    monkeypatch.setattr(attnext.checks, "_broadcast_4d", spy)
    check_backend(q, k, v, rng, bias=bias)
    assert seen["bias"].flags.aligned and seen["bias"].base.size == 50


# --- processes ---

FORK_SCRIPT = textwrap.dedent("""
    import os
    import numpy as np
    import attnext
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 300, 4, 64), dtype=np.float32) for _ in range(3))
    out, lse = attnext.attention(q, k, v, causal=True, device="cpu", return_lse=True)
    g = attnext.attention_backward(out, q, k, v, out, lse, causal=True, device="cpu")
    pid = os.fork()
    if pid == 0:   # the child: OpenMP's workers were not copied; the backend must not wait for them
        out2, lse2 = attnext.attention(q, k, v, causal=True, device="cpu", return_lse=True)
        g2 = attnext.attention_backward(out, q, k, v, out, lse, causal=True, device="cpu")
        same = np.array_equal(out, out2) and all(np.array_equal(a, b) for a, b in zip(g[:3], g2[:3]))
        os._exit(0 if same else 3)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_after_use():
    """A child forked after the parent ran the CPU backend gets the parent's bits, without hanging."""
    r = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, ATTNEXT_NUM_THREADS="2"))
    assert r.returncode == 0 and "child 0" in r.stdout, r.stdout + r.stderr
