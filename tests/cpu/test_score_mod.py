"""score_mod / mask_mod on the CPU backend's interpreter (csrc/interp/interp.c, attnext/mods/interp.py)
against the reference: the zoo of tests/mods.py forward and backward (dtensors included), the
built-in options combined with them, block skipping at tile edges, varlen, lookups out of range,
NumPy's integer rules, determinism, and the structural program cache. Also device="reference":
the zoo traced first (refusals: contract/test_errors.py), then the reference's answer."""
import os
import subprocess
import sys

import numpy as np
import pytest

import attnext
from attnext import reference
from conftest import (F32, F64, assert_close, check_backend, check_dtensors, dtype_id, make_qkv,
                      make_varlen_qkv, randn)

from helpers import mods

DTYPES = [F32, F64]
S, H = mods.S_MAX, mods.H_MAX


# --- the zoo ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", sorted(mods.score_mods()))
def test_score_mod_zoo(name, dtype, rng):
    score_mod = mods.score_mods()[name]
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 8, 6, dtype)
    res = check_backend(q, k, v, rng, score_mod=score_mod)
    check_dtensors(res, score_mod, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", sorted(mods.mask_mods()))
def test_mask_mod_zoo(name, dtype, rng):
    q, k, v = make_qkv(rng, 2, S, 11, H, 1, 8, 8, dtype)
    check_backend(q, k, v, rng, mask_mod=mods.mask_mods()[name])


COMBOS = {
    "causal_rel_bias": dict(score="rel_bias", causal=True),
    "window_alibi_doc": dict(score="alibi", mask_mod="document_causal", window=(6, 2)),
    "softcap_bias_trig": dict(score="trig", softcap=3.0, bias=True),
    "builtin_alibi_softcap_mod": dict(score="softcap_alibi_rel", alibi=True, mask_mod="prefix_lm"),
    "mask_and_mask_mod": dict(score="pair_product", bool_mask=True, mask_mod="sliding_window"),
    "bhsd_top_left": dict(score="clamp", causal="top_left", layout="bhsd"),
    "scale_head_dep": dict(score="head_offset", mask_mod="head_dependent", scale=0.7),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_combined_with_builtin_options(combo, dtype, rng):
    spec = dict(COMBOS[combo])
    score_mod = mods.score_mods()[spec.pop("score")]
    mask_mod = mods.mask_mods()[spec.pop("mask_mod")] if "mask_mod" in spec else None
    layout = spec.pop("layout", "bshd")
    q, k, v = make_qkv(rng, 2, 15, S, H, 2, 16, 8, dtype, layout)
    opts = dict(score_mod=score_mod, mask_mod=mask_mod, layout=layout)
    if spec.pop("bias", False):
        opts["bias"] = randn(rng, (2, 1, 15, S), dtype)
    if spec.pop("bool_mask", False):
        opts["mask"] = rng.random((15, S)) < 0.8
    if spec.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.1, 0.5, H)
    opts.update(spec)
    res = check_backend(q, k, v, rng, **opts)
    check_dtensors(res, score_mod, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_varlen_b_is_the_sequence(dtype, rng):
    """In varlen, b is the sequence's index and q_idx / kv_idx positions inside it; empty
    sequences, seqused padding and rows after the last sequence stay exactly zero."""
    cu_q, cu_k = np.array([0, 9, 9, 25, 30]), np.array([0, 14, 14, 30, 46])
    used_q, used_k = np.array([7, 0, 16, 5]), np.array([12, 0, 16, 11])
    q, k, v = make_varlen_qkv(rng, 33, 48, H, 2, 8, 8, dtype)
    table = rng.standard_normal((4, 2 * S + 1))
    doc = mods.DOC_ID

    def score_mod(s, b, h, qi, ki):
        return s + table[b, qi - ki + S] * (h + 1) * 0.5

    def mask_mod(b, h, qi, ki):
        return (ki <= qi + b) | (doc[qi] == doc[ki])

    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
    res = check_backend(q, k, v, rng, varlen=varlen, score_mod=score_mod, mask_mod=mask_mod)
    check_dtensors(res, score_mod, dtype)
    assert (res.out[30:] == 0).all() and (res.grads.dq[30:] == 0).all()
    assert (res.grads.dk[[12, 13, 41, 42]] == 0).all()


# --- device="reference": traced first, then the reference's own answer ---------------------------

ZOO = ([("score_mod", n) for n in sorted(mods.score_mods())]
       + [("mask_mod", n) for n in sorted(mods.mask_mods())])


def _same_as_reference(q, k, v, rng, varlen=None, **opts):
    """attention(..., device="reference") and its backward give the bits of attnext.reference's
    own functions (cast to q's dtype as the API casts them): tracing changed no answer."""
    names = ("attention", "attention_backward") if varlen is None else (
        "varlen_attention", "varlen_attention_backward")
    fwd, bwd = (getattr(attnext, n) for n in names)
    r_fwd, r_bwd = (getattr(reference, n) for n in names)
    args = dict(q=q, k=k, v=v, **(varlen or {}), **opts)
    out, lse = fwd(**args, return_lse=True, device="reference")
    r_out, r_lse = r_fwd(**args, return_lse=True)
    assert np.array_equal(out, r_out.astype(q.dtype))
    assert np.array_equal(lse, r_lse.astype(lse.dtype))
    dout = randn(rng, out.shape, q.dtype)
    g = bwd(dout=dout, out=out, lse=lse, **args, device="reference")
    rg = r_bwd(dout=dout, out=out, lse=lse, **args)
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(getattr(g, name), getattr(rg, name).astype(q.dtype)), name
    assert g.dbias is None and g.dtensors.keys() == rg.dtensors.keys()
    for name, d in rg.dtensors.items():
        assert np.array_equal(g.dtensors[name], d), name
    return out


@pytest.mark.parametrize("kind, name", ZOO, ids=[f"{k}-{n}" for k, n in ZOO])
def test_zoo_on_device_reference_is_the_reference(kind, name, rng):
    mod = (mods.score_mods() if kind == "score_mod" else mods.mask_mods())[name]
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 8, 6, F32)
    out = _same_as_reference(q, k, v, rng, **{kind: mod})
    assert np.isfinite(out).all()


def test_varlen_on_device_reference_is_the_reference(rng):
    cu_q, cu_k = np.array([0, 9, 9, 25]), np.array([0, 14, 14, 30])
    q, k, v = make_varlen_qkv(rng, 27, 31, H, 2, 8, 8, F64)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=np.array([7, 0, 16]))
    _same_as_reference(q, k, v, rng, varlen=varlen, score_mod=mods.score_mods()["rel_bias"],
                       mask_mod=mods.mask_mods()["document_causal"])


def test_device_reference_traces_once_then_calls_on_numpy_arrays(rng):
    """The first call of each callback is the trace (proxies); every later one, the reference's
    own, gets NumPy arrays of the pairs."""
    seen = []

    def score_mod(s, b, h, qi, ki):
        seen.append(("score_mod", type(s).__name__, type(qi).__name__))
        return s * 0.5 + qi

    def mask_mod(b, h, qi, ki):
        seen.append(("mask_mod", type(b).__name__, type(ki).__name__))
        return qi >= ki

    q, k, v = make_qkv(rng, 1, 5, 6, 2, 1, 8, 8, F32)
    attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, device="reference")
    assert seen[:2] == [("score_mod", "Proxy", "Proxy"), ("mask_mod", "Proxy", "Proxy")]
    assert {x[1:] for x in seen[2:]} == {("ndarray", "ndarray")}
    assert {x[0] for x in seen[2:]} == {"score_mod", "mask_mod"}


# --- block skipping -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["documents", "window", "nothing_kept", "everything_kept"])
def test_block_mask_tiles(case, rng):
    """Lengths across several 64-wide tiles with masks that leave empty, partial and full tiles
    (boundaries on and off the tile grid); a mask_mod that drops every pair gives out = 0,
    lse = -inf and zero gradients."""
    sq, sk = 200, 263
    doc = np.repeat(np.arange(6), [64, 64, 30, 40, 2, 63])
    doc_k = np.concatenate([doc, np.full(sk - doc.size, 9)])
    mask_mod = {
        "documents": lambda b, h, qi, ki: (doc[qi] == doc_k[ki]) & (ki <= qi + h),
        "window": lambda b, h, qi, ki: (qi - ki < 70) & (ki - qi < 3),
        "nothing_kept": lambda b, h, qi, ki: qi < -1,
        "everything_kept": lambda b, h, qi, ki: ki < 1000,
    }[case]
    q, k, v = make_qkv(rng, 1, sq, sk, 2, 1, 16, 16, F32)
    res = check_backend(q, k, v, rng, mask_mod=mask_mod, score_mod=mods.softcap(4.0))
    if case == "nothing_kept":
        assert (res.out == 0).all() and np.isneginf(res.lse).all()
        assert not res.grads.dq.any() and not res.grads.dk.any() and not res.grads.dv.any()


# --- lookups out of range -----------------------------------------------------------------------

def test_lookup_out_of_range_raises_index_error(rng):
    q, k, v = make_qkv(rng, 1, 10, 12, 2, 2, 8, 8, F32)
    table = rng.standard_normal(5)

    def score_mod(s, b, h, qi, ki):
        return s + table[ki]

    for call in (lambda: attnext.attention(q, k, v, score_mod=score_mod, device="cpu"),
                 lambda: reference.attention(q, k, v, score_mod=score_mod)):
        with pytest.raises(IndexError):
            call()
    with pytest.raises(IndexError, match=r"score_mod: index 5 is out of bounds for axis 0 of "
                                         r"array 'table' with size 5"):
        attnext.attention(q, k, v, score_mod=score_mod, device="cpu")
    out, lse = attnext.attention(q, k, v, return_lse=True, device="cpu")
    with pytest.raises(IndexError, match="'table'"):
        attnext.attention_backward(np.ones_like(out), q, k, v, out, lse, score_mod=score_mod,
                                   device="cpu")


def test_lookup_out_of_range_only_where_masked_is_not_observable(rng):
    """score_mod runs only at kept pairs: indices out of range elsewhere are clamped."""
    q, k, v = make_qkv(rng, 1, 10, 12, 2, 2, 8, 8, F32)
    table = rng.standard_normal(5)
    opts = dict(score_mod=lambda s, b, h, qi, ki: s + table[ki],
                mask_mod=lambda b, h, qi, ki: ki < 5)
    check_backend(q, k, v, rng, **opts)
    check_backend(q, k, v, rng, score_mod=lambda s, b, h, qi, ki: s * table[qi - ki - 2],
                  causal=True, window=(2, 0))


def test_mask_mod_lookup_is_checked_at_every_pair_inside_the_lengths(rng):
    """mask_mod is evaluated inside the lengths whatever the other masks say (the reference
    calls it there), but not past seqlens."""
    q, k, v = make_qkv(rng, 2, 10, 12, 2, 2, 8, 8, F32)
    flags = np.ones(10, dtype=bool)

    def mask_mod(b, h, qi, ki):
        return flags[ki]

    with pytest.raises(IndexError, match=r"mask_mod: index 10 .* array 'flags' with size 10"):
        attnext.attention(q, k, v, mask_mod=mask_mod, causal="top_left", device="cpu")
    with pytest.raises(IndexError):
        reference.attention(q, k, v, mask_mod=mask_mod, causal="top_left")
    check_backend(q, k, v, rng, mask_mod=mask_mod, seqlens_k=np.array([10, 7]))


# --- semantics of the interpreter ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_numpy_integer_and_float_rules(dtype, rng):
    """// and % of int64 by zero give 0 and round toward -inf for negatives; float // and %
    follow NumPy; an int power wraps like NumPy's; bools mix with ints."""
    q, k, v = make_qkv(rng, 1, 14, 15, 2, 1, 8, 8, dtype)

    def score_mod(s, b, h, qi, ki):
        d = qi - ki
        ints = d // (ki % 4 - 1) + d % (qi % 3 - 1) * 3 + (-d) // 3 + (d % -4) + (d ** 3) % 5
        floats = np.floor_divide(s, 0.7) * 0.1 + np.remainder(s, -0.45)
        flags = (qi > 3) * 2 + ((qi & 1) ^ (ki | 2)) - (~d)
        return s + ints * 0.01 + floats + flags * 0.05 + np.where(d != 0, 1.0, 0.0)

    with np.errstate(divide="ignore"):
        check_backend(q, k, v, rng, score_mod=score_mod)


def test_a_sweep_over_a_float_constant_is_right_for_every_value(rng):
    q, k, v = make_qkv(rng, 1, 40, 50, 2, 2, 16, 16, F32)
    for cap in (0.5, 2.0, 30.0):
        want = attnext.attention(q, k, v, softcap=cap, device="cpu")
        got = attnext.attention(q, k, v, score_mod=mods.softcap(cap), device="cpu")
        assert_close("out", got, reference.attention(q, k, v, softcap=cap))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


DETERMINISM_SCRIPT = """
import sys, numpy as np, attnext
rng = np.random.default_rng(3)
q, k, v = (rng.standard_normal((2, 150, 4, 16)).astype(np.float32) for _ in range(3))
table = rng.standard_normal((4, 2 * 150 + 1)).astype(np.float32)
sm = lambda s, b, h, qi, ki: s * table[h, qi] + table[h, qi - ki + 150]
mm = lambda b, h, qi, ki: (qi - ki) % 7 != 3
out, lse = attnext.attention(q, k, v, score_mod=sm, mask_mod=mm, return_lse=True)
g = attnext.attention_backward(np.ones_like(out), q, k, v, out, lse, score_mod=sm, mask_mod=mm)
sys.stdout.write(g.dtensors["table"].tobytes().hex() + g.dq.tobytes().hex()[:4000])
"""


def test_backward_is_deterministic_across_thread_counts():
    """The same bits for the array gradients (a table read twice per pair) with 1 and 2
    threads: per-task sums added in task order."""
    outs = []
    for threads in ("1", "2", "2"):
        env = dict(os.environ, ATTNEXT_NUM_THREADS=threads, ATTNEXT_DEVICE="cpu")
        outs.append(subprocess.run([sys.executable, "-c", DETERMINISM_SCRIPT], env=env,
                                   capture_output=True, text=True, check=True).stdout)
    assert outs[0] == outs[1] == outs[2]


# --- the program cache --------------------------------------------------------------------------

def _compiles():
    return attnext.cache_info()["cpu"]["compiles"]


def test_cache_two_different_lambdas_get_two_programs(rng):
    q, k, v = make_qkv(rng, 1, 8, 8, 1, 1, 8, 8, F32)
    before = _compiles()
    attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + qi * 7919, device="cpu")
    attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + ki * 7919, device="cpu")
    assert _compiles() == before + 2


def test_cache_the_same_function_defined_twice_shares_one(rng):
    q, k, v = make_qkv(rng, 1, 8, 8, 1, 1, 8, 8, F32)

    def first(s, b, h, qi, ki):
        return s - (qi - ki) % 7907

    def second(s, b, h, qi, ki):
        return s - (qi - ki) % 7907

    before, info = _compiles(), attnext.cache_info()
    a = attnext.attention(q, k, v, score_mod=first, device="cpu")
    b = attnext.attention(q, k, v, score_mod=second, device="cpu")
    after = attnext.cache_info()
    assert _compiles() == before + 1
    assert after["cpu"]["hits"] == info["cpu"]["hits"] + 1
    assert after["hits"] >= after["cpu"]["hits"] and after["compile_seconds"] >= 0
    np.testing.assert_array_equal(a, b)


def test_cache_a_float_sweep_compiles_once(rng):
    q, k, v = make_qkv(rng, 1, 8, 8, 1, 1, 8, 8, F32)
    before = _compiles()
    for c in np.linspace(0.25, 7.0, 6):
        out, lse = attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * c - 7901.5,
                                     return_lse=True, device="cpu")
        attnext.attention_backward(np.ones_like(out), q, k, v, out, lse, device="cpu",
                                   score_mod=lambda s, b, h, qi, ki: s * c - 7901.5)
    assert _compiles() == before + 1


def test_cache_is_bounded():
    from attnext.mods import interp
    info = attnext.cache_info()["cpu"]
    assert info["entries"] <= info["capacity"] == interp.CACHE_CAPACITY
