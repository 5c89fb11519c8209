"""score_mod / mask_mod against the float64 reference on both backends: the CPU backend's
interpreter (csrc/interp/interp.c, attnext/mods/interp.py) on NumPy arrays, and the code
generator's kernels (attnext/mods/codegen.py) on torch CUDA tensors (`-m gpu`, float16 and
bfloat16).

On both (a `backend` parameter, "cuda" marked gpu): the zoo of helpers/mods.py forward and
backward with the array gradients (dtensors), the built-in options combined with them, varlen
(b is the sequence), lookups out of range (IndexError naming the array; nothing observable where
a mask removes the pair), and the program / kernel cache: two different functions get two, the
same function defined twice shares one, a sweep over a float constant compiles once.

The CPU alone: device="reference" (the zoo traced first, then the reference's answer; refusals:
contract/test_errors.py), block skipping at tile edges, lookups a mask_mod makes at every pair,
NumPy's integer rules, a float constant swept, the same bits for any thread count, the bounded
program cache. The GPU alone: odd and wgmma head dims, long sequences and the long forward tiles,
dQ added in order under narrowed key blocks, block-sparse masks (per head, per sequence, decode,
kept across calls), the device's dtensor sums, bit-identical reruns.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import attnext
from attnext import reference
from attnext.cuda import mod_cache, nvrtc
from conftest import (BF16, F16, F32, F64, assert_close, check_backend, check_dtensors, dtype_id,
                      make_qkv, make_varlen_qkv, randn)

from helpers import mods
from helpers.gpu import run_gpu, to_gpu, to_host

S, H = mods.S_MAX, mods.H_MAX
# (backend, dtype): the dtypes each backend has kernels for, the CPU's float32 / float64 and the
# GPU's float16 / bfloat16 (marked gpu); fewer where a check ran with fewer
BACKEND_DTYPES = [pytest.param(b, dt, id=f"{b}-{dtype_id(dt)}", marks=m) for b, dt, m in (
    ("cpu", F32, ()), ("cpu", F64, ()),
    ("cuda", F16, pytest.mark.gpu), ("cuda", BF16, pytest.mark.gpu))]
BACKEND_DTYPES_GPU_F16 = BACKEND_DTYPES[:3]                 # the GPU in float16 alone
BACKEND_ONE_DTYPE = [BACKEND_DTYPES[0], BACKEND_DTYPES[2]]  # float32 on the CPU, float16 on the GPU


class Backend:
    """One backend as the tests below call it: where q, k, v go (put: NumPy arrays for the CPU,
    torch CUDA tensors with the same bits for the GPU), how results come back (get), and check:
    forward and backward against the reference, the dtensors included (conftest.check_backend
    and check_dtensors on the CPU, helpers.gpu.run_gpu on the GPU), returning the host results.
    The GPU runs the head dims of its kernels' common case (64); the CPU's small ones keep the
    interpreter quick."""

    def __init__(self, name, request):
        self.name = name
        self.torch = request.getfixturevalue("torch") if name == "cuda" else None

    def dims(self, d, dv):
        """(D, Dv): the CPU's (d, dv), the GPU's 64."""
        return (d, dv) if self.name == "cpu" else (64, 64)

    def ints(self, values):
        """An index array (cu_seqlens, seqused): int32 on the GPU, NumPy's default on the CPU."""
        return np.array(values, np.int32 if self.name == "cuda" else None)

    def put(self, x):
        return x if self.name == "cpu" else to_gpu(self.torch, x)

    def get(self, t):
        return t if self.name == "cpu" else to_host(self.torch, t)

    def ones_like(self, x):
        return np.ones_like(x) if self.name == "cpu" else self.torch.ones_like(x)

    def call(self, fn, *args, **opts):
        """attnext.<fn> on this backend (its arrays from put)."""
        device = {"device": "cpu"} if self.name == "cpu" else {}
        return getattr(attnext, fn)(*args, **device, **opts)

    def check(self, q, k, v, rng, **opts):
        if self.name == "cuda":
            return run_gpu(self.torch, q, k, v, **opts)
        res = check_backend(q, k, v, rng, **opts)
        check_dtensors(res, opts.get("score_mod"), q.dtype)
        return res

    def compiles(self):
        """Programs compiled so far (the CPU's interpreter programs), or kernels that had to be
        produced (compiled now or read from the disk cache: a kernel this process had not built
        yet)."""
        if self.name == "cpu":
            return attnext.cache_info()["cpu"]["compiles"]
        info = nvrtc.cache_info()
        return info["compiles"] + info["disk_hits"]


@pytest.fixture
def on(backend, request):
    return Backend(backend, request)


# --- the zoo ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("name", sorted(mods.score_mods()))
def test_score_mod_zoo(name, dtype, on, rng):
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, *on.dims(8, 6), dtype)
    on.check(q, k, v, rng, score_mod=mods.score_mods()[name])


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("name", sorted(mods.mask_mods()))
def test_mask_mod_zoo(name, dtype, on, rng):
    q, k, v = make_qkv(rng, 2, S, 11, H, 1, *on.dims(8, 8), dtype)
    on.check(q, k, v, rng, mask_mod=mods.mask_mods()[name])


COMBOS = mods.COMBOS


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES_GPU_F16)
@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_combined_with_builtin_options(combo, dtype, on, rng):
    spec = dict(COMBOS[combo])
    score_mod = mods.score_mods()[spec.pop("score")]
    mask_mod = mods.mask_mods()[spec.pop("mask_mod")] if "mask_mod" in spec else None
    layout = spec.pop("layout", "bshd")
    q, k, v = make_qkv(rng, 2, 15, S, H, 2, *on.dims(16, 8), dtype, layout)
    opts = dict(score_mod=score_mod, mask_mod=mask_mod, layout=layout)
    # the GPU reads a float32 bias and float32 slopes; the CPU a bias of q's dtype, float64 slopes
    gpu = on.name == "cuda"
    if spec.pop("bias", False):
        opts["bias"] = randn(rng, (2, 1, 15, S), np.float32 if gpu else dtype)
    if spec.pop("bool_mask", False):
        opts["mask"] = rng.random((15, S)) < 0.8
    if spec.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.1, 0.5, H).astype(np.float32 if gpu else np.float64)
    opts.update(spec)
    on.check(q, k, v, rng, **opts)


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES_GPU_F16)
def test_varlen_b_is_the_sequence(dtype, on, rng):
    """In varlen, b is the sequence's index and q_idx / kv_idx positions inside it; empty
    sequences, seqused padding and rows after the last sequence stay exactly zero."""
    cu_q, cu_k = on.ints([0, 9, 9, 25, 30]), on.ints([0, 14, 14, 30, 46])
    used_q, used_k = on.ints([7, 0, 16, 5]), on.ints([12, 0, 16, 11])
    q, k, v = make_varlen_qkv(rng, 33, 48, H, 2, *on.dims(8, 8), dtype)
    table = rng.standard_normal((4, 2 * S + 1))
    doc = mods.DOC_ID

    def score_mod(s, b, h, qi, ki):
        return s + table[b, qi - ki + S] * (h + 1) * 0.5

    def mask_mod(b, h, qi, ki):
        return (ki <= qi + b) | (doc[qi] == doc[ki])

    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
    res = on.check(q, k, v, rng, varlen=varlen, score_mod=score_mod, mask_mod=mask_mod)
    assert (res.out[30:] == 0).all() and (res.grads.dq[30:] == 0).all()
    assert (res.grads.dk[[12, 13, 41, 42]] == 0).all()


# --- lookups out of range -----------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", BACKEND_ONE_DTYPE)
def test_lookup_out_of_range_raises_index_error(dtype, on, rng):
    """IndexError naming the function, the index, the axis and the array, forward and backward;
    the CPU names the first lookup out of range in row order (index 5), the GPU the first a thread
    records (any of 5..11 here). The CPU's reference raises too; on the GPU a mask_mod's lookup
    out of range raises the same way (the CPU's: test_mask_mod_lookup_is_checked_...), and the
    library stays usable."""
    q, k, v = (on.put(x) for x in make_qkv(rng, 1, 10, 12, 2, 2, *on.dims(8, 8), dtype))
    table = rng.standard_normal(5)

    def score_mod(s, b, h, qi, ki):
        return s + table[ki]

    index = "5" if on.name == "cpu" else "([5-9]|1[01])"
    with pytest.raises(IndexError, match=rf"score_mod: index {index} is out of bounds for axis 0 of "
                                         r"array 'table' with size 5"):
        on.call("attention", q, k, v, score_mod=score_mod)
    out, lse = on.call("attention", q, k, v, return_lse=True)
    dout = np.ones_like(out) if on.name == "cpu" else on.torch.ones_like(out)
    with pytest.raises(IndexError, match="'table'"):
        on.call("attention_backward", dout, q, k, v, out, lse, score_mod=score_mod)
    if on.name == "cpu":
        with pytest.raises(IndexError):
            reference.attention(q, k, v, score_mod=score_mod)
        return
    flags = np.ones(10, dtype=bool)
    with pytest.raises(IndexError, match=r"mask_mod: index 1\d .* array 'flags' with size 10"):
        attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: flags[ki])
    attnext.attention(q, k, v)          # the library stays usable


@pytest.mark.parametrize("backend, dtype", BACKEND_ONE_DTYPE)
def test_lookup_out_of_range_only_where_masked_is_not_observable(dtype, on, rng):
    """score_mod runs only at kept pairs: indices out of range elsewhere are clamped."""
    q, k, v = make_qkv(rng, 1, 10, 12, 2, 2, *on.dims(8, 8), dtype)
    table = rng.standard_normal(5)
    on.check(q, k, v, rng, score_mod=lambda s, b, h, qi, ki: s + table[ki],
             mask_mod=lambda b, h, qi, ki: ki < 5)
    on.check(q, k, v, rng, score_mod=lambda s, b, h, qi, ki: s * table[qi - ki - 2],
             causal=True, window=(2, 0))


# --- the program / kernel cache -----------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", BACKEND_ONE_DTYPE)
def test_cache_two_different_lambdas_get_two_programs(dtype, on, rng):
    q, k, v = (on.put(x) for x in make_qkv(rng, 1, 8, 8, 1, 1, *on.dims(8, 8), dtype))
    on.call("attention", q, k, v)           # the plain call's kernels are not what is counted
    before = on.compiles()
    on.call("attention", q, k, v, score_mod=lambda s, b, h, qi, ki: s + qi * 7919)
    on.call("attention", q, k, v, score_mod=lambda s, b, h, qi, ki: s + ki * 7919)
    assert on.compiles() == before + 2


@pytest.mark.parametrize("backend, dtype", BACKEND_ONE_DTYPE)
def test_cache_the_same_function_defined_twice_shares_one(dtype, on, rng):
    q, k, v = (on.put(x) for x in make_qkv(rng, 1, 8, 8, 1, 1, *on.dims(8, 8), dtype))

    def first(s, b, h, qi, ki):
        return s - (qi - ki) % 7907

    def second(s, b, h, qi, ki):
        return s - (qi - ki) % 7907

    before, info = on.compiles(), attnext.cache_info()
    a = on.call("attention", q, k, v, score_mod=first)
    b = on.call("attention", q, k, v, score_mod=second)
    assert on.compiles() == before + 1
    np.testing.assert_array_equal(on.get(a), on.get(b))
    if on.name == "cpu":                    # the interpreter's hit counts
        after = attnext.cache_info()
        assert after["cpu"]["hits"] == info["cpu"]["hits"] + 1
        assert after["hits"] >= after["cpu"]["hits"] and after["compile_seconds"] >= 0


@pytest.mark.parametrize("backend, dtype", BACKEND_ONE_DTYPE)
def test_cache_a_float_sweep_compiles_once(dtype, on, rng):
    """A float constant is a parameter of the compiled code: nothing compiles after its first
    value (on the CPU one program, forward and backward), and each value gives its own answer
    (s * c - a constant: the softmax of s * c, attention with scale c / sqrt(D))."""
    d = on.dims(8, 8)[0]
    q, k, v = (on.put(x) for x in make_qkv(rng, 1, 8, 8, 1, 1, d, d, dtype))
    before, counts = on.compiles(), []
    for c in np.linspace(0.25, 7.0, 6):
        def sm(s, b, h, qi, ki):
            return s * c - 7901.5
        out, lse = on.call("attention", q, k, v, score_mod=sm, return_lse=True)
        on.call("attention_backward", on.ones_like(out), q, k, v, out, lse, score_mod=sm)
        want = on.call("attention", q, k, v, scale=float(c) / np.sqrt(d))
        counts.append(on.compiles())
        np.testing.assert_allclose(on.get(out).astype(np.float32), on.get(want).astype(np.float32),
                                   atol=2e-3, rtol=2e-3)
    assert len(set(counts)) == 1, counts
    if on.name == "cpu":
        assert counts[0] == before + 1


# --- the CPU alone: device="reference", traced first, then the reference's own answer -----------

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

@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
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


def test_cache_is_bounded():
    from attnext.mods import interp
    info = attnext.cache_info()["cpu"]
    assert info["entries"] <= info["capacity"] == interp.CACHE_CAPACITY


# --- the GPU alone ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("d", [59, 64, 128], ids=["d59", "d64", "d128"])
def test_odd_and_wgmma_head_dims(d, rng, torch):
    """Element loads (D = 59) and, on Hopper, the wgmma kernels (D = 64, 128); under GQA, so the
    dK/dV kernels' items change query head, and with it slopes[h], which score_ctx reads once an
    item (codegen.head_loads)."""
    q, k, v = make_qkv(rng, 2, S, S, H, 2, d, d, BF16)
    run_gpu(torch, q, k, v, score_mod=mods.score_mods()["softcap_alibi_rel"],
            mask_mod=mods.mask_mods()["document_causal"])


@pytest.mark.gpu
def test_longer_sequences_cross_tiles(rng, torch):
    """Several query and key tiles (full, partial and masked ones), GQA, a table over the
    relative position of every pair, with its gradient."""
    sq, sk = 300, 263
    table = rng.standard_normal((4, sq + sk + 1)).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s + table[h, qi - ki + sk] * 0.5

    doc = np.repeat(np.arange(6), [64, 64, 30, 40, 2, 100])
    doc_k = np.concatenate([doc[:sk], np.full(max(0, sk - doc.size), 9)])

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc_k[ki]) | (ki < 5)

    q, k, v = make_qkv(rng, 1, sq, sk, 4, 2, 64, 64, BF16)
    run_gpu(torch, q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    run_gpu(torch, q, k, v, score_mod=score_mod, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (128, 64), (64, 128)],
                         ids=["d64", "d128", "d128_dv64", "d64_dv128"])
def test_long_rows_take_the_long_forward_tiles(d, dv, rng, torch):
    """Past select.SM90_SHORT_ROWS query rows a score_mod takes the 128 x 64 forward tile on
    Hopper, except at D = 64, Dv = 128, where its staged output would not fit (128 x 128)."""
    q, k, v = make_qkv(rng, 1, 1100, 1100, 2, 1, d, dv, BF16)
    run_gpu(torch, q, k, v, score_mod=mods.score_mods()["softcap"], causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_narrowed_key_blocks_add_dq_in_order(d, rng, torch):
    """D = 128 (64-row query tiles) and D = 64 (128-row ones): on Hopper the dK/dV kernel adds dQ
    (select.bwd_dq_mode) while a mask_mod's block mask takes query tiles off each key block's ends; in the ordered mode those tiles' turns pass
    at once (a bit per key block), so a rerun gives the same bits, and deterministic=False the
    same values within rounding. Masks with and without keys every query sees."""
    doc = np.repeat(np.arange(5), [150, 10, 260, 200, 80])
    masks = {"doc": lambda b, h, qi, ki: doc[qi] == doc[ki],
             "doc_global": lambda b, h, qi, ki: (doc[qi] == doc[ki]) | (ki < 5)}
    q, k, v = make_qkv(rng, 2, 700, 700, 4, 2, d, d, BF16)
    for name, mask_mod in masks.items():
        run_gpu(torch, q, k, v, mask_mod=mask_mod)
        tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
        t_out, t_lse = attnext.attention(tq, tk, tv, mask_mod=mask_mod, return_lse=True)
        dout = to_gpu(torch, randn(rng, q.shape, BF16))
        runs = [attnext.attention_backward(dout, tq, tk, tv, t_out, t_lse, mask_mod=mask_mod,
                                           deterministic=det) for det in (True, True, False)]
        first, again, unordered = ([to_host(torch, x).astype(np.float32) for x in r[:3]] for r in runs)
        assert all(np.array_equal(a, b) for a, b in zip(first, again)), name
        for a, b in zip(first, unordered):
            np.testing.assert_allclose(b, a, rtol=0, atol=2e-2 * float(np.abs(a).max()), err_msg=name)


# --- block sparsity -----------------------------------------------------------------------------
# Lengths of several 64-pair cells and kernel tiles, so mask_mod's block mask has empty tiles at
# the ends of a tile's range (skipped), empty ones between kept ones, full tiles (no per-element
# test) and partial ones; every result against the reference.

# 700 positions, uneven documents; the ids repeat (0 1 2 0 1), so these masks stay mask_mods with
# block masks (a document mask over contiguous runs runs as varlen: unit/test_band.py)
DOCS = np.repeat(np.arange(5) % 3, [70, 200, 64, 1, 365])


def _doc_causal(b, h, qi, ki):
    return (DOCS[qi] == DOCS[ki]) & (ki <= qi)


def _global_and_window(b, h, qi, ki):
    return (ki < 8) | (np.abs(qi - ki) < 64)        # tiles between the first and the band: empty


@pytest.mark.gpu
@pytest.mark.parametrize("d", [59, 64, 128], ids=["d59", "d64", "d128"])
@pytest.mark.parametrize("mask", ["doc_causal", "global_and_window"])
def test_block_sparse_masks(mask, d, rng, torch):
    mask_mod = {"doc_causal": _doc_causal, "global_and_window": _global_and_window}[mask]
    q, k, v = make_qkv(rng, 1, 700, 700, 2, 1, d, d, BF16)
    run_gpu(torch, q, k, v, mask_mod=mask_mod)


@pytest.mark.gpu
def test_block_sparse_with_causal_window_and_score_mod(rng, torch):
    """mask_mod's tiles beside the built-in band (causal, window), with a score_mod reading a table."""
    table = rng.standard_normal(1400).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s + table[qi - ki + 700] * 0.25

    q, k, v = make_qkv(rng, 2, 600, 700, 2, 2, 128, 128, BF16)
    run_gpu(torch, q, k, v, mask_mod=_doc_causal, causal=True)
    run_gpu(torch, q, k, v, mask_mod=_global_and_window, window=(300, 0), score_mod=score_mod)


@pytest.mark.gpu
def test_block_sparse_per_head_under_gqa(rng, torch):
    """A mask_mod reading h: one block mask per query head; the dK/dV kernels take the union of
    the group's heads."""
    def mask_mod(b, h, qi, ki):
        return np.abs(qi - ki) <= 40 * (h + 1) + (h == 3) * 1000

    for d in (64, 128):
        q, k, v = make_qkv(rng, 1, 520, 520, 4, 2, d, d, F16)
        run_gpu(torch, q, k, v, mask_mod=mask_mod)


@pytest.mark.gpu
def test_block_sparse_varlen_per_sequence(rng, torch):
    """varlen: one block mask per sequence (b is the sequence; lengths differ), padding rows 0."""
    cu_q, cu_k = np.array([0, 300, 300, 710], np.int32), np.array([0, 260, 260, 760], np.int32)
    used_q = np.array([290, 0, 400], np.int32)

    def mask_mod(b, h, qi, ki):
        span = 100 + b * 40
        return (qi // span == ki // span) | (ki == 0)

    q, k, v = make_varlen_qkv(rng, 720, 770, 2, 2, 128, 128, BF16)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q)
    g = run_gpu(torch, q, k, v, varlen=varlen, mask_mod=mask_mod).grads
    assert (g.dq[290:300] == 0).all() and (g.dq[700:] == 0).all()


@pytest.mark.gpu
def test_block_sparse_decode_and_everything_or_nothing(rng, torch):
    """Few query rows against many keys (split-KV), interior empty key tiles; a mask_mod that
    keeps nothing (zeros, no NaN) and one that keeps everything (the plain result)."""
    q, k, v = make_qkv(rng, 2, 5, 900, 4, 2, 128, 128, BF16)
    run_gpu(torch, q, k, v, mask_mod=lambda b, h, qi, ki: ki % 256 < 100)
    q, k, v = make_qkv(rng, 1, 300, 330, 2, 2, 64, 64, BF16)
    g = run_gpu(torch, q, k, v, mask_mod=lambda b, h, qi, ki: ki < 0).grads
    assert not any(np.any(x) for x in g[:3])
    run_gpu(torch, q, k, v, mask_mod=lambda b, h, qi, ki: ki >= 0, causal=True)


@pytest.mark.gpu
def test_block_mask_kept_across_calls_follows_the_captured_array(rng, torch):
    """A call's block mask serves the next calls with the same mask_mod (mod_cache), and a
    captured array changed in place between calls gives the new mask; a call whose mask_mod
    looks up out of range raises every time (its mask is not kept)."""
    docs = DOCS.copy()

    def mask_mod(b, h, qi, ki):
        return (docs[qi] == docs[ki]) & (ki <= qi)

    q, k, v = make_qkv(rng, 1, 700, 700, 2, 1, 128, 128, BF16)
    hits = mod_cache.info()["block_masks"]["hits"]
    run_gpu(torch, q, k, v, mask_mod=mask_mod)
    run_gpu(torch, q, k, v, mask_mod=mask_mod)
    assert mod_cache.info()["block_masks"]["hits"] >= hits + 3    # backward, forward, backward
    docs[:] = np.repeat(np.arange(3) % 2, [300, 100, 300])
    run_gpu(torch, q, k, v, mask_mod=mask_mod)
    flags = np.ones(600, bool)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    for _ in range(2):
        with pytest.raises(IndexError, match="'flags'"):
            attnext.attention(tq, tk, tv, mask_mod=lambda b, h, qi, ki: flags[qi] & flags[ki])


@pytest.mark.gpu
def test_dtensor_sums_on_the_device_are_the_host_rule(rng, torch):
    """kernels/attn_dtensors.cu against codegen.limbs_to_float, bit for bit: limbs of both signs
    and any size (carries, negative totals, the last limb's rounding), and the flags."""
    from attnext.cuda import backend as cuda_backend, staging
    from attnext.mods import codegen
    n = 4096
    limbs = rng.integers(-2 ** 40, 2 ** 40, (n, codegen.LIMBS))
    limbs[: n // 4, 6:] = 0                                   # small sums
    limbs[n // 4: n // 2, -1] = rng.integers(-2 ** 62, 2 ** 62, n // 4)
    words = np.zeros((n, codegen.WORDS), np.uint64)
    words[:, :codegen.LIMBS] = limbs.view(np.uint64)
    words[-8:, -1] = [1, 2, 4, 6, 3, 5, 7, 0]
    with staging.Staging(0, 0) as stage:
        sums = np.zeros(n, np.float64)
        stage.download(cuda_backend._dtensor_sums(stage, stage.upload(words)), sums)
    want = codegen.limbs_to_float(words)
    assert np.array_equal(sums.view(np.uint64), want.view(np.uint64))


@pytest.mark.gpu
def test_backward_is_bit_identical_run_to_run(rng, torch):
    """The array gradients are integer sums on the device: the same bits whatever order the
    threads add in (a table read twice per pair, many pairs per element)."""
    sq = 150
    q, k, v = (to_gpu(torch, x) for x in make_qkv(rng, 2, sq, sq, 4, 4, 64, 64, BF16))
    table = rng.standard_normal((4, 2 * sq + 1)).astype(np.float32)

    def sm(s, b, h, qi, ki):
        return s * table[h, qi] + table[h, qi - ki + sq]

    out, lse = attnext.attention(q, k, v, score_mod=sm, return_lse=True)
    dout = torch.randn_like(out)
    runs = [attnext.attention_backward(dout, q, k, v, out, lse, score_mod=sm) for _ in range(3)]
    for g in runs[1:]:
        assert np.array_equal(g.dtensors["table"], runs[0].dtensors["table"])
        assert torch.equal(g.dq, runs[0].dq) and torch.equal(g.dk, runs[0].dk)
