"""Legal NumPy in score_mod / mask_mod that the tracer used to refuse (issue [1/7] point 5), on
the CPU backend against the reference, forward and backward (and the gradients of the captured
float arrays), and with `-m gpu` on CUDA tensors (helpers.gpu.run_gpu):

- a partial index by int constants, then a lookup: `bias[0][b, h, q_idx]`, `tab[-1][h, kv_idx]`,
  `tab[1][0][kv_idx]` (NumPy's basic indexing: a view), IndexError at trace time for a constant
  out of range, as NumPy gives it;
- operations on plain constants, whose 0-d results are constants: `np.where(flag, 2.0, 1.0)`;
- a helper from another module that reads that module's own global array (captured under its
  name; the trace cache sees the array change);
- graphs 1,500 operations deep: no recursion without bound in the band lowering, the
  interpreter or the code generator, whose CUDA C stays statements NVRTC compiles.
"""
import os

import numpy as np
import pytest

import attnext
from attnext import _C
from attnext.cuda import nvrtc, select
from attnext.mods import codegen, fingerprint, trace
from attnext.testing.accuracy import compare_dtensors
from conftest import (BF16, F32, F64, assert_close, assert_lse_close, check_backend, compare_grads,
                      make_qkv, randn)

from helpers import legal_helpers
from helpers.legal_helpers import distance_bias, same_bucket

DTYPES = [F32, F64]
B, H, S = 2, 4, 19
DEPTH = 1500


def check(rng, dtype, sq=S, sk=S, hk=2, **opts):
    """The CPU backend against the reference (check_backend), the dtensors too."""
    q, k, v = make_qkv(rng, B, sq, sk, H, hk, 16, 8, dtype)
    res = check_backend(q, k, v, rng, **opts)
    if opts.get("score_mod") is not None:
        problems = compare_dtensors(res.grads, res.ref_grads, opts["score_mod"], dtype)
        assert not problems, "\n".join(problems)
    return res


# --- the cases, each a factory of (score_mod, mask_mod) over fresh arrays --------------------

def partial_bias(rng):
    """FlexAttention's form: a stack of biases, the first one looked up per (b, h, q_idx), and
    the last per (h, kv_idx) through a negative constant. The first scales the score: a term
    added to every score of a row has gradient 0, which 16-bit GPU products leave at their
    round-off, not 0."""
    bias = rng.standard_normal((3, B, H, S))
    tab = rng.standard_normal((2, H, S))
    return (lambda s, b, h, q_idx, kv_idx: s * (1 + 0.2 * bias[0][b, h, q_idx]) - 0.5 * tab[-1][h, kv_idx]), None


def partial_chain(rng):
    """Two constant steps, one per subscript, then one negative: tab[1][0][kv_idx], tab[-2][-1]."""
    tab = rng.standard_normal((2, 3, S))

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + 0.5 * tab[1][0][kv_idx] + tab[-2][-1][q_idx]
    return score_mod, None


def partial_then_full(rng):
    """A partial index, then the rest as ints and expressions in one subscript."""
    tab = rng.standard_normal((2, H, S, 2))
    return (lambda s, b, h, q_idx, kv_idx: s + tab[1][h, kv_idx, 0] * tab[0][h, q_idx, -1]), None


def partial_mask(rng):
    """An integer table's partial index in a mask_mod (with a score_mod reading another)."""
    doc = np.sort(rng.integers(0, 3, (2, S)), axis=1)
    bias = rng.standard_normal((1, S))
    return ((lambda s, b, h, q_idx, kv_idx: s + bias[0][kv_idx]),
            (lambda b, h, q_idx, kv_idx: (doc[1][q_idx] == doc[1][kv_idx]) | (kv_idx == 0)))


def constant_where(rng):
    """np.where and other ufuncs on plain Python values: 0-d NumPy results, constants."""
    flag, off = bool(rng.integers(2)), rng.standard_normal()
    scale = np.where(flag, 2.0, 1.0)
    shift = np.where(not flag, np.array(off), 0.0)

    def score_mod(s, b, h, q_idx, kv_idx):
        return (s * np.where(flag, 2.0, 1.0) * scale * (1 + 0.1 * shift)
                + np.maximum(0.5, np.float64(off))
                - np.array(3) * np.where(True, 1, 0) * (q_idx - kv_idx) * 0.01)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + np.where(flag, 3, 5)) & np.where(True, True, False)
    return score_mod, mask_mod


def constant_score(rng):
    """A score_mod whose whole value is one 0-d constant: uniform attention over kept keys."""
    return (lambda s, b, h, q_idx, kv_idx: np.where(False, 1.0, -2.5)), None


def helper_module(rng):
    """Helpers from another module (legal_helpers), each reading its module's global array."""
    return ((lambda s, b, h, q_idx, kv_idx: distance_bias(s, q_idx, kv_idx)),
            (lambda b, h, q_idx, kv_idx: same_bucket(q_idx, kv_idx) | (kv_idx == q_idx)))


def deep_affine(rng):
    """1,500 additions of 1 to kv_idx, then a band: the band lowering walks it without
    recursion (it used to raise RecursionError) and lowers it to causal."""
    def mask_mod(b, h, q_idx, kv_idx):
        x = kv_idx
        for _ in range(DEPTH):
            x = x + 1
        return x - DEPTH <= q_idx
    return None, mask_mod


def deep_general(rng):
    """Chains that no lowering takes: the general path, every op in sequence."""
    tab = rng.standard_normal((2 * S + 1,))

    def score_mod(s, b, h, q_idx, kv_idx):
        x, i = s, q_idx
        for n in range(DEPTH):
            x = (x + 1) - 1 if n % 2 else x * 1
            i = i + 1
        return x + tab[i - DEPTH - kv_idx + S]

    def mask_mod(b, h, q_idx, kv_idx):
        x = kv_idx
        for n in range(DEPTH):
            x = x + 1 if n % 2 else x - (-1)
        return ((x - DEPTH) * 7 + q_idx) % 5 != 1
    return score_mod, mask_mod


def deep_conjunction(rng):
    """1,500 bounds joined by &: the band's conjuncts are found without recursion."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        for n in range(DEPTH):
            keep = keep & (kv_idx != q_idx - 2 - n % 3)
        return keep
    return None, mask_mod


CASES = {f.__name__: f for f in (partial_bias, partial_chain, partial_then_full, partial_mask,
                                  constant_where, constant_score, helper_module, deep_affine,
                                  deep_general, deep_conjunction)}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(CASES))
def test_legal_mods_on_the_cpu(case, dtype, rng):
    score_mod, mask_mod = CASES[case](rng)
    check(rng, dtype, score_mod=score_mod, mask_mod=mask_mod)


def test_legal_mods_in_varlen(rng):
    """b is the sequence's index: bias[0][b, h, q_idx] reads each sequence's row."""
    score_mod, _ = partial_bias(rng)
    q, k, v = (x.reshape((-1,) + x.shape[2:]) for x in make_qkv(rng, 1, 2 * S, 2 * S, H, 2, 16, 8, F64))
    cu = np.array([0, S - 4, 2 * S - 8], np.int32)      # then padding rows
    check_backend(q, k, v, rng, varlen=dict(cu_seqlens_q=cu, cu_seqlens_k=cu), score_mod=score_mod)


# --- partial indices: what they read, and what is refused ------------------------------------

def test_partial_index_is_numpys_view(rng):
    """tab[c][...] reads what NumPy's view reads, for every constant in range, negative too;
    .shape / .ndim / .size / len() are the view's."""
    tab = rng.standard_normal((3, H, S))
    seen = {}
    for c in range(-3, 3):
        def score_mod(s, b, h, q_idx, kv_idx, c=c):
            view = tab[c]
            seen[c] = (view.shape, view.ndim, view.size, len(view))
            return s + view[h, kv_idx]
        t = trace.trace_score_mod(score_mod)
        h, kv = np.arange(H)[:, None], np.arange(S)[None, :]
        np.testing.assert_array_equal(trace.evaluate(t, np.zeros(()), 0, h, 0, kv, float_dtype=F64),
                                      tab[c][h, kv])
        assert seen[c] == ((H, S), 2, H * S, H)


@pytest.mark.parametrize("index", ["tab[3][h, kv_idx]", "tab[-4][h, kv_idx]", "tab[0][4][kv_idx]",
                                   "tab[0][-5, kv_idx]", "tab[1][h, 19]", "tab[0, 1][30]"])
def test_partial_index_out_of_range_is_an_index_error(index):
    """As NumPy raises it at that call (here at trace time, a constant being known): the
    callback, the array and the constant named."""
    tab = np.zeros((3, H, S))
    fn = eval(f"lambda s, b, h, q_idx, kv_idx: s + {index}", {"tab": tab})
    with pytest.raises(IndexError, match=r"score_mod: index -?\d+ is out of bounds .* array 'tab'"):
        trace.trace_score_mod(fn)
    q = np.ones((1, 4, H, 8))
    with pytest.raises(IndexError):
        attnext.attention(q, q, q, score_mod=fn, device="cpu")
    with pytest.raises(IndexError):
        attnext.reference.attention(q, q, q, score_mod=fn)


def test_partial_index_by_a_traced_value_is_still_refused():
    """tab[h][kv_idx] means something else on index arrays (the reference's calls): refused."""
    tab = np.zeros((H, S))
    with pytest.raises(TypeError, match=r"index every axis at once"):
        trace.trace_score_mod(lambda s, b, h, q_idx, kv_idx: s + tab[h][kv_idx])
    tab3 = np.zeros((2, H, S))
    with pytest.raises(TypeError, match=r"array 'tab3'\[0\] of shape \(4, 19\) indexed by 1 of its 2 axes"):
        trace.trace_score_mod(lambda s, b, h, q_idx, kv_idx: s + tab3[0][h][kv_idx])
    with pytest.raises(TypeError, match=r"array 'tab3'\[1\] of shape \(4, 19\) used in an expression"):
        trace.trace_score_mod(lambda s, b, h, q_idx, kv_idx: s + tab3[1])


# --- helpers in other modules and the trace cache ----------------------------------------------

def test_helper_module_arrays_are_captured_by_their_names():
    ts = trace.trace_score_mod(lambda s, b, h, q_idx, kv_idx: distance_bias(s, q_idx, kv_idx))
    tm = trace.trace_mask_mod(lambda b, h, q_idx, kv_idx: same_bucket(q_idx, kv_idx))
    assert ts.arrays == {"DIST_BIAS": legal_helpers.DIST_BIAS}
    assert tm.arrays == {"BUCKET": legal_helpers.BUCKET}
    assert fingerprint.captured_arrays(lambda s, b, h, q_idx, kv_idx: distance_bias(s, q_idx, kv_idx)) == {
        "DIST_BIAS": legal_helpers.DIST_BIAS}


def test_helper_module_array_changes_reach_the_next_call(rng, monkeypatch):
    """The trace cache keys on the helper's global array (name, shape, dtype) and reads its
    contents at every call: a new array of another shape retraces, new contents are read."""
    def score_mod(s, b, h, q_idx, kv_idx):
        return distance_bias(s, q_idx, kv_idx)
    q, k, v = make_qkv(rng, 1, S, S, H, 2, 16, 8, F64)

    def agrees():
        got = attnext.attention(q, k, v, score_mod=score_mod, device="cpu")
        np.testing.assert_allclose(got, attnext.reference.attention(q, k, v, score_mod=score_mod),
                                   rtol=1e-10, atol=1e-12)
        return got
    first = agrees()
    monkeypatch.setattr(legal_helpers, "DIST_BIAS", legal_helpers.DIST_BIAS * 3.0)
    assert not np.allclose(agrees(), first)
    monkeypatch.setattr(legal_helpers, "SPAN", 4)
    monkeypatch.setattr(legal_helpers, "DIST_BIAS", rng.standard_normal(9))
    assert trace.trace_score_mod(score_mod).arrays["DIST_BIAS"].shape == (9,)
    agrees()
    legal_helpers.DIST_BIAS[4] += 1.0          # contents, same array: read at the call
    agrees()


def test_out_may_not_overlap_a_helpers_array(rng):
    """The arrays a helper captures are inputs too (api._captured_inputs)."""
    q, k, v = make_qkv(rng, 1, S, S, H, 2, 16, 8, F64)
    out = np.zeros((1, S, H, 8))
    fn = lambda s, b, h, q_idx, kv_idx: helper_of(s, q_idx)      # noqa: E731
    global _OUT_TABLE
    _OUT_TABLE = out.reshape(-1)[:S]
    with pytest.raises(ValueError, match=r"out shares memory with the array '_OUT_TABLE' that score_mod"):
        attnext.attention(q, k, v, score_mod=fn, out=out, device="cpu")


_OUT_TABLE = None


def helper_of(s, i):
    return s + _OUT_TABLE[i]


# --- deep graphs: the generated CUDA C ---------------------------------------------------------

def test_deep_graphs_generate_statements_not_one_expression(rng):
    score_mod, mask_mod = deep_general(rng)
    gen = codegen.generate(trace.trace_score_mod(score_mod), trace.trace_mask_mod(mask_mod))
    longest = max(len(line) for line in gen.source.splitlines())
    assert longest < 4000, longest
    nesting = max(line.count("(") - line.count(")") for line in gen.source.splitlines())
    assert nesting < 4 * codegen.MAX_INLINE_DEPTH


PROBE = r"""
#include "attn_common.cuh"
extern "C" __global__ void probe(const __grid_constant__ attn_params p, float *out)
{
    const attn_mods_gpu *m = &p.gmods;
    const int64_t i = threadIdx.x;
    float r = 0.f;
#if HAS_SCORE_MOD
    r += mod_score((float)i, 0, 0, i, i + 1, m) + mod_dscore((float)i, 0, 0, i, i + 1, 1.f, m);
#if HAS_DTENSORS
    mod_dtensors((float)i, 0, 0, i, i + 1, 1.f, 0, m);
#endif
#endif
#if HAS_MASK_MOD
    r += (float)mod_mask(0, 0, i, i + 1, m) + (float)mod_mask_cell(0, 0, i, i + 63, 0, 63, m);
#endif
    out[i] = r;
}
"""


def test_deep_graphs_compile_with_nvrtc(rng):
    """Every generated function of a 1,500-deep score_mod (with a lookup and its gradient) and
    mask_mod, called from a small kernel, compiles for sm_80 (the attention kernels inline the
    same functions; compiling those takes minutes on a small machine: the GPU tests do)."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    score_mod, mask_mod = deep_general(rng)
    gen = codegen.generate(trace.trace_score_mod(score_mod), trace.trace_mask_mod(mask_mod))
    defines = select.fwd_defines(dtype="bfloat16", D=64, Dv=64, vec=True, softcap=False,
                                  bias_dtype=None, alibi_dtype=None, mask=False,
                                  tile=select.tile_config(64, 64), mods=gen)
    assert defines["HAS_SCORE_MOD"] == defines["HAS_MASK_MOD"] == defines["HAS_DTENSORS"] == 1
    nvrtc.nvrtc()
    cubin, _ = _C.nvrtc_compile(PROBE, "probe.cu", nvrtc.options(defines, "sm_80"),
                                nvrtc._headers(gen.source))
    assert b"probe" in cubin


# --- on the GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_legal_mods_on_cuda_tensors(case, rng, torch):
    """The generated kernels on torch CUDA tensors (bfloat16), forward, backward and dtensors,
    against the reference."""
    from helpers.gpu import run_gpu
    score_mod, mask_mod = CASES[case](rng)
    q, k, v = make_qkv(rng, B, S, S, H, 2, 64, 64, BF16)
    run_gpu(torch, q, k, v, score_mod=score_mod, mask_mod=mask_mod)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["partial_bias", "constant_where", "helper_module", "deep_affine"])
def test_legal_mods_with_numpy_inputs_on_cuda(case, rng, gpu):
    """NumPy bfloat16 inputs with device="cuda" (the mods run where api.py sends them), forward
    and backward against the reference."""
    score_mod, mask_mod = CASES[case](rng)
    q, k, v = make_qkv(rng, B, S, S, H, 2, 64, 64, BF16)
    opts = dict(score_mod=score_mod, mask_mod=mask_mod)
    out, lse = attnext.attention(q, k, v, device="cuda", return_lse=True, **opts)
    r_out, r_lse = attnext.reference.attention(q, k, v, return_lse=True, **opts)
    assert_close("out", out, r_out, BF16)
    assert_lse_close(lse, r_lse, BF16)
    dout = randn(rng, out.shape, BF16)
    g = attnext.attention_backward(dout, q, k, v, out, lse, device="cuda", **opts)
    rg = attnext.reference.attention_backward(dout, q, k, v, out, lse, **opts)
    problems = compare_grads(g, rg, q, k, v, dout, out, r_out, None, opts)
    assert not problems, "\n".join(problems)
