"""Rows of huge but finite scores: additive masks filled with np.finfo(np.float32).min, -1e9,
-1e10 or -1e30 (the Hugging Face style), the soft-mask idiom np.where(cond, s, -1e10) inside a
score_mod, and q.k products of magnitude 1e10.

A row whose kept scores are all such a value keeps every one of them: the softmax of equal
scores is uniform and lse = fill + log(n), finite. Only a row that keeps no pair, or whose kept
scores are all -inf, gives out = 0 and lse = -inf (DESIGN step 7). Where a row's scores meet
exp, a backend must neither overflow (fill * log2 e is -inf below -FLT_MAX / log2 e) nor subtract
an unrounded product from a rounded maximum (an FMA's s * log2e - m: 2^(+-512) at 1e10), and its
backward must not take exp(s - lse) from an lse that rounded away log(n): the CPU recomputes such
rows (cpu_impl.h's row_stats), the GPU too (attn_bwd.cu's attn_bwd_pre, attn_params.h: row_mz),
whose main kernels leave their terms to the kernels that redo them (attn_bwd_dead: dK, dV, dq and
a score_mod's array gradients; attn_bwd_dbias: dbias).

The answer is judged at the precision the backend computes in (accuracy.py's three-way rule):
- float32 accumulation (float32, float16 and bfloat16 inputs): s + fill rounds to the same float32
  for every key once |fill| is large, so the expected answer is the reference's for the scores
  float32 gives (`at_precision`: the reference fed a bias under which it sees exactly those
  scores), held to the usual tolerance;
- float64: the reference itself, with the error the same computation at float64 makes
  (|at_precision - reference|, LOW_FACTOR of it) allowed on top, as for rounded dtypes.
"""
import numpy as np
import pytest

import attnext
from attnext import reference
from attnext.testing.accuracy import LOW_FACTOR, acc_dtype, allowed_error, coarser, compare
from conftest import BF16, F16, F32, F64, assert_close, make_qkv

FILLS = [float(np.finfo(np.float32).min), -1e9, -1e10, -1e30]
FILL_IDS = ["f32min", "1e9", "1e10", "1e30"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CPU_DTYPES = [F32, F64]
GPU_DTYPES = [BF16, F16, F32]


def _dtypes(device):
    return CPU_DTYPES if device == "cpu" else GPU_DTYPES


def exact_scores(q, k, scale):
    """scale * q . k in float64, (B, Hq, Sq, Sk), as the reference computes it (bshd, GQA)."""
    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    k64 = np.repeat(k64, q.shape[2] // k.shape[2], axis=2)
    return scale * np.einsum("bihd,bjhd->bhij", q64, k64)


def at_precision(q, k, bias, scale):
    """The (B, Hq, Sq, Sk) bias under which the float64 reference computes the scores that
    q's accumulation dtype gives for s + bias: s rounded to it, then the sum rounded to it. At
    a fill of 1e9 or more every score of the row becomes the fill; the bias reproduces that up
    to float64's rounding of s + (fill - s), exactly for the fills past 1e16."""
    acc = acc_dtype(q.dtype)
    s = exact_scores(q, k, scale)
    s_acc = s.astype(acc) + (0 if bias is None else np.asarray(bias).astype(acc))
    return s_acc.astype(np.float64) - s


def expected(q, k, v, dout, bias, scale, opts):
    """(out, lse, grads) to hold a backend to, and an `extra` allowance per name (None or a
    function, accuracy.compare's): see the module docstring."""
    eff = at_precision(q, k, bias, scale)
    r_out, r_lse = reference.attention(q, k, v, bias=eff, scale=scale, return_lse=True, **opts)
    r_g = reference.attention_backward(dout, q, k, v, r_out, r_lse, bias=eff, scale=scale, **opts)
    dbias = None
    if bias is not None:
        axes = tuple(range(eff.ndim - np.ndim(bias)))
        dbias = r_g.dbias.sum(axis=axes).reshape(np.shape(bias))
    at = dict(out=r_out, lse=r_lse, dq=r_g.dq, dk=r_g.dk, dv=r_g.dv, dbias=dbias, dtensors=r_g.dtensors)
    if acc_dtype(q.dtype) != F64:
        return at, {}
    d_out, d_lse = reference.attention(q, k, v, bias=bias, scale=scale, return_lse=True, **opts)
    d_g = reference.attention_backward(dout, q, k, v, d_out, d_lse, bias=bias, scale=scale, **opts)
    ref = dict(out=d_out, lse=d_lse, dq=d_g.dq, dk=d_g.dk, dv=d_g.dv, dbias=d_g.dbias)
    extra = {n: (lambda a=at[n], r=ref[n]: LOW_FACTOR * np.abs(a - r))
             for n in ref if ref[n] is not None}
    return ref, extra


def check_lse(lse, want, dtype, extra=None):
    """lse by magnitude class: a -1e10 row's tolerance (relative to 1e10) must not swallow the
    ordinary rows' (accuracy.compare scales its tolerance by the array's largest value)."""
    huge = np.abs(np.where(np.isfinite(want), want, 0)) > 1e3
    for part in (huge, ~huge):
        if part.any():
            ex = None if extra is None else (lambda e=extra, m=part: e()[m])
            assert_close("lse", lse[part], want[part], acc_dtype(dtype), extra=ex)


def run_and_check(device, q, k, v, rng, bias=None, scale=None, terms=0.0, backward=True, deterministic=True,
                  **opts):
    """Forward (out, lse) and, with backward, the backward (dq, dk, dv, dbias) on `device`
    against `expected`. terms: the size of the terms the gradients sum, where it exceeds theirs
    (test_huge_products)."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = attnext.attention(q, k, v, bias=bias, scale=scale, return_lse=True, device=device,
                                 **opts)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    want, extra = expected(q, k, v, dout, bias, scale, opts)
    assert np.isfinite(lse).all(), f"lse not finite at {np.argwhere(~np.isfinite(lse))[:4]}"
    assert_close("out", out, want["out"], extra=extra.get("out"))
    check_lse(lse, want["lse"], q.dtype, extra.get("lse"))
    if not backward:
        return out, lse
    g = attnext.attention_backward(dout, q, k, v, out, lse, bias=bias, scale=scale, device=device,
                                   deterministic=deterministic, **opts)
    floor = max([float(np.abs(want[n]).max()) for n in ("dq", "dk", "dv")] + [terms])
    for name in ("dq", "dk", "dv", "dbias"):
        got = getattr(g, name)
        if want[name] is None:
            assert got is None
            continue
        dtype = q.dtype if name != "dbias" else coarser(q.dtype, bias.dtype)
        problem = compare(name, got, want[name], dtype, floor, extra.get(name))
        assert problem is None, problem
    for name, w in (want.get("dtensors") or {}).items():    # a score_mod's captured arrays
        problem = compare(f"dtensors[{name!r}]", g.dtensors[name], w, coarser(q.dtype, F32),
                          float(np.abs(w).max()))
        assert problem is None, problem
    return out, lse


def filled_bias(rng, sq, sk, fill, dtype):
    """(Sq, Sk) bias, N(0, 1) with `fill` in: every key of row 1, the first half of row 2's keys,
    all but key 3 of row 3, and every key of the last row (the second query tile's)."""
    bias = rng.standard_normal((sq, sk)).astype(dtype)
    bias[1] = fill
    bias[2, :sk // 2] = fill
    bias[3] = fill
    bias[3, 3] = 0.5
    bias[-1] = fill
    return bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill", FILLS, ids=FILL_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_filled_bias_rows(device, fill, causal, rng):
    """A shared (Sq, Sk) bias with fill rows, over two query and three key tiles (the CPU's 64),
    GQA 4 / 2: every filled row is uniform over what it keeps, its lse finite."""
    for dtype in _dtypes(device):
        q, k, v = make_qkv(rng, 2, 70, 150, 4, 2, 16, 24, dtype)
        bias_dtype = F64 if dtype == F64 else F32
        run_and_check(device, q, k, v, rng, bias=filled_bias(rng, 70, 150, fill, bias_dtype),
                      causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill", FILLS, ids=FILL_IDS)
def test_filled_bias_per_head(device, fill, rng):
    """A (B, Hq, Sq, Sk) bias whose fill rows differ by head: head 1 of batch 0 filled entirely,
    the rest as filled_bias on batch 1 only."""
    for dtype in _dtypes(device):
        q, k, v = make_qkv(rng, 2, 33, 90, 2, 2, 32, 32, dtype)
        bias_dtype = F64 if dtype == F64 else F32
        bias = rng.standard_normal((2, 2, 33, 90)).astype(bias_dtype)
        bias[0, 1] = fill
        bias[1, 0] = filled_bias(rng, 33, 90, fill, bias_dtype)
        run_and_check(device, q, k, v, rng, bias=bias)


@pytest.mark.parametrize("device", DEVICES)
def test_huge_products(device, rng):
    """q . k of magnitude 1e10 and no mask: a one-hot softmax, lse the row's maximum."""
    for dtype in _dtypes(device):
        q, k, v = make_qkv(rng, 1, 40, 100, 2, 2, 16, 16, F64)
        big = 1e5 if dtype != F16 else 2e2     # float16 stops at 65504
        q, k = (x * big for x in (q, k))
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        # dS = P (dP - delta) cancels to 0 in a one-hot row, from terms of scale |dP| |k| (|q|):
        # float round-off in dq, dk is relative to those (accuracy.py, "Cancellation"), and
        # |k| = 1e5 here. |dP| <= max |dout| (about 4 for N(0, 1)) * sum |v|.
        top = max(np.abs(x.astype(F64)).max() for x in (q, k))
        terms = 4 * np.abs(v.astype(F64)).sum(axis=-1).max() * top / np.sqrt(q.shape[-1])
        _, lse = run_and_check(device, q, k, v, rng, terms=terms)
        assert np.abs(lse).max() > (1e9 if dtype != F16 else 1e4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill", [-1e10, -1e30], ids=["1e10", "1e30"])
def test_soft_mask_score_mod(device, fill, rng):
    """np.where(cond, s, fill) inside a score_mod: row 0 keeps its whole row at the fill, the
    others soft-causal (the fill past the diagonal)."""
    def soft_causal(s, b, h, q_idx, kv_idx):
        return np.where((kv_idx <= q_idx) & (q_idx != 0), s, fill)

    for dtype in _dtypes(device):
        q, k, v = make_qkv(rng, 1, 70, 70, 2, 1, 16, 16, dtype)
        run_and_check(device, q, k, v, rng, score_mod=soft_causal)


@pytest.mark.parametrize("device", DEVICES)
def test_large_lse_backward(device, rng):
    """Rows of a bias of -300 and -5000: their lse holds log(n) only roughly in float32 (ulp
    3e-5 and 5e-4), so the backward must not take P from it (cpu_impl.h's row_stats)."""
    for dtype in _dtypes(device):
        q, k, v = make_qkv(rng, 1, 20, 130, 2, 2, 16, 16, dtype)
        bias = rng.standard_normal((20, 130)).astype(F32 if dtype != F64 else F64)
        bias[0] -= 300
        bias[1] -= 5000
        run_and_check(device, q, k, v, rng, bias=bias)


def test_at_precision_rounds_the_fill(rng):
    """The expected answer's construction: at a -1e10 fill, float32 scores of a row are all the
    fill (uniform), float64 ones keep their differences."""
    q, k, v = make_qkv(rng, 1, 4, 8, 1, 1, 8, 8, F32)
    bias = np.zeros((4, 8), np.float32)
    bias[1] = -1e10
    s = exact_scores(q, k, 1.0)
    seen32 = s + at_precision(q, k, bias, 1.0)
    assert np.ptp(seen32[0, 0, 1]) < 1e-5 and np.ptp(s[0, 0, 1]) > 0.1
    seen64 = s + at_precision(q.astype(F64), k.astype(F64), bias.astype(F64), 1.0)
    assert np.allclose(seen64[0, 0, 1] + 1e10, s[0, 0, 1], atol=1e-5)
    assert allowed_error(F32, 1.0) < 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sk, kept", [(4096, 300), (4000, 4000)], ids=["300of4096", "short_split"])
def test_decode_fill_rows(device, sk, kept, rng):
    """One query over thousands of keys (the GPU splits the keys: attn_fwd_combine), the first
    `kept` keys at -1e10, the rest -inf: each split must count its own keys, not weigh alike."""
    for dtype in _dtypes(device):
        q, k, v = make_qkv(rng, 1, 1, sk, 1, 1, 64, 64, dtype)
        bias = np.full((1, sk), -np.inf, F64 if dtype == F64 else F32)
        bias[:, :kept] = -1e10
        run_and_check(device, q, k, v, rng, bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_gpu_backward_of_lost_rows(D, deterministic, rng):
    """The head dims of the Hopper backward (attn_bwd_sm90.cu) and both dq modes: the dK/dV kernel
    that also adds dQ (nondet) takes P^T of lost rows too; filled rows among ordinary ones, over
    two query tiles of 64 and three key tiles, causal."""
    q, k, v = make_qkv(rng, 2, 130, 300, 4, 2, D, D, BF16)
    bias = filled_bias(rng, 130, 300, -1e10, F32)
    bias[70:75] = float(np.finfo(np.float32).min)
    run_and_check("cuda", q, k, v, rng, bias=bias, causal=True, deterministic=deterministic)


@pytest.mark.gpu
def test_gpu_lost_rows_with_mask_mod(rng):
    """A generated kernel's lost rows (attn_bwd_pre recomputes them with the score_mod and the
    mask_mod): a soft mask's fill inside the score_mod, a document mask_mod beside it."""
    doc = np.repeat(np.arange(3), [40, 50, 40])

    def soft(s, b, h, q_idx, kv_idx):
        return np.where(q_idx % 7 != 0, s, -1e10)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    for D in (16, 64):
        q, k, v = make_qkv(rng, 1, 130, 130, 2, 1, D, D, BF16)
        run_and_check("cuda", q, k, v, rng, score_mod=soft, mask_mod=same_doc)


@pytest.mark.gpu
def test_gpu_lost_rows_array_gradient(rng):
    """A lost row's terms in a captured array's gradient (attn_bwd_dead's lost_row_dq scatters
    them; the dQ kernel leaves them out): a per-(head, key) table, every fifth row shifted by
    -3000 (lse past LOST_LSE; float32 keeps the scores' differences there to 2.4e-4)."""
    table = rng.standard_normal((2, 130)).astype(np.float32)

    def mod(s, b, h, q_idx, kv_idx):
        return np.where(q_idx % 5 != 0, s + table[h, kv_idx], s + table[h, kv_idx] - 3000.0)

    for D in (16, 64):
        q, k, v = make_qkv(rng, 1, 130, 130, 2, 1, D, D, BF16)
        run_and_check("cuda", q, k, v, rng, score_mod=mod, causal=True)
