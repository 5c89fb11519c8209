"""Gradients only where asked: the backward's dtensors= (True: every float array the score_mod
reads, False: none, or a collection of their names).

- The CPU backend against the reference on fresh random data: the default returns every array's
  gradient, False none, a selection exactly the asked ones with the values the default gives
  them; dq, dk, dv do not change; attention and varlen; device="reference" computes only the
  asked ones (its finite differences cost a pass per element).
- The programs a selection makes: the CPU interpreter's derivative has no scatter into an array
  left out (and the call no accumulator for it); the generated CUDA header of a call that asks
  for none has no mod_dtensors and the kernel switches of a score_mod without array gradients
  (an ALiBi slopes array against its constant-slope twin), and its text, the kernel cache's key,
  tells the selections apart. NVRTC compiles it for sm_80 and sm_90a.
- The GPU host side on the fake driver: dtensors=False launches the constant twin's kernels (dQ
  no longer recomputed for the scatter), no accumulator and no gradient field; a selection binds
  the asked array's only.
- Bad input: TypeError naming dtensors and the value, ValueError naming the name and listing the
  valid ones, names without a score_mod.
- `-m gpu`: the kernels on torch CUDA tensors with NumPy- and torch-captured arrays.
"""
import os

import numpy as np
import pytest

import attnext
from attnext import reference
from attnext.cuda import select
from attnext.mods import codegen, grad as derivative, interp, trace
from attnext.testing.accuracy import compare_dtensors

from conftest import F32, F64, compare_grads, dtype_id, make_qkv, make_varlen_qkv, randn
from helpers import mods
from helpers.driver import run_on_fake as _run

S, H = mods.S_MAX, mods.H_MAX
SELECTIONS = [True, False, ["slopes"], {"table"}, ("table", "slopes")]


def _arrays(rng):
    """Fresh slopes (H,) and relative table (H, 2S + 1), float32."""
    return (rng.uniform(0.1, 1.0, H).astype(np.float32),
            rng.standard_normal((H, 2 * S + 1)).astype(np.float32))


def _asked(selection):
    return {"slopes", "table"} if selection is True else set(selection or ())


def alibi_of(slopes):
    """ALiBi through a captured slopes array."""
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * np.abs(q_idx - kv_idx)
    return alibi


def alibi_const(score, b, h, q_idx, kv_idx):
    """Its twin with one constant slope: no captured array, no array gradient."""
    return score - 0.5 * np.abs(q_idx - kv_idx)


# --- the CPU backend against the reference --------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_selection_on_the_cpu_against_the_reference(dtype, rng):
    slopes, table = _arrays(rng)
    score_mod = mods.softcap_alibi_rel(3.0, slopes, table)
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 8, 6, dtype)
    out, lse = attnext.attention(q, k, v, score_mod=score_mod, causal=True, return_lse=True, device="cpu")
    r_out = reference.attention(q, k, v, score_mod=score_mod, causal=True)
    dout = randn(rng, out.shape, dtype)
    every = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, causal=True, device="cpu")
    assert set(every.dtensors) == {"slopes", "table"} and all(np.any(x) for x in every.dtensors.values())
    for selection in SELECTIONS:
        g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, causal=True,
                                       device="cpu", dtensors=selection)
        rg = reference.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, causal=True,
                                          dtensors=selection)
        assert set(g.dtensors) == set(rg.dtensors) == _asked(selection), (selection, list(g.dtensors))
        opts = dict(score_mod=score_mod, causal=True)
        problems = compare_grads(g, rg, q, k, v, dout, out, r_out, None, opts)
        problems += compare_dtensors(g, rg, score_mod, dtype)
        assert not problems, (selection, problems)
        for name in ("dq", "dk", "dv"):          # the selection changes no other gradient
            assert np.array_equal(getattr(g, name), getattr(every, name)), (selection, name)
        for name, x in g.dtensors.items():       # nor an asked array's: the same sums in the same order
            assert x.dtype == np.float32 and np.array_equal(x, every.dtensors[name]), (selection, name)


def test_varlen_selection_on_the_cpu_against_the_reference(rng):
    slopes, table = _arrays(rng)
    score_mod = mods.softcap_alibi_rel(3.0, slopes, table)
    cu = np.array([0, 7, 7, 23], np.int32)
    lengths = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S)
    q, k, v = make_varlen_qkv(rng, 23, 23, H, 2, 8, 8, F32)
    out, lse = attnext.varlen_attention(q, k, v, score_mod=score_mod, return_lse=True, device="cpu", **lengths)
    r_out = reference.varlen_attention(q, k, v, score_mod=score_mod, **lengths)
    dout = randn(rng, out.shape, F32)
    every = attnext.varlen_attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, device="cpu", **lengths)
    for selection in (["table"], False):
        g = attnext.varlen_attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, device="cpu",
                                              dtensors=selection, **lengths)
        rg = reference.varlen_attention_backward(dout, q, k, v, out, lse, score_mod=score_mod,
                                                 dtensors=selection, **lengths)
        assert set(g.dtensors) == set(rg.dtensors) == _asked(selection)
        problems = compare_grads(g, rg, q, k, v, dout, out, r_out, lengths, dict(score_mod=score_mod))
        problems += compare_dtensors(g, rg, score_mod, F32)
        assert not problems, problems
        assert all(np.array_equal(getattr(g, n), getattr(every, n)) for n in ("dq", "dk", "dv"))
        assert all(np.array_equal(x, every.dtensors[n]) for n, x in g.dtensors.items())


def test_an_asked_array_without_a_gradient_term_is_zero(rng):
    """An array that reaches the score only through a comparison is asked for like any other:
    its gradient is zeros, as the default gives it."""
    slopes, table = _arrays(rng)

    def gated(score, b, h, q_idx, kv_idx):
        return np.where(table[h, q_idx - kv_idx + S] > 0, score, score - slopes[h])
    q, k, v = make_qkv(rng, 1, 9, 9, H, 1, 8, 8, F32)
    out, lse = attnext.attention(q, k, v, score_mod=gated, return_lse=True, device="cpu")
    dout = randn(rng, out.shape, F32)
    g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=gated, device="cpu", dtensors=["table"])
    assert list(g.dtensors) == ["table"] and not np.any(g.dtensors["table"])
    assert g.dtensors["table"].shape == table.shape and g.dtensors["table"].dtype == np.float32


def test_device_reference_computes_only_the_asked_arrays(rng, monkeypatch):
    """The reference's finite differences run for the asked arrays only, through the API's
    device="reference" as through attnext.reference itself."""
    slopes, table = _arrays(rng)
    score_mod = mods.softcap_alibi_rel(3.0, slopes, table)
    q, k, v = make_qkv(rng, 1, 11, S, H, 2, 8, 8, F32)
    out, lse = attnext.attention(q, k, v, score_mod=score_mod, return_lse=True, device="cpu")
    dout = randn(rng, out.shape, F32)
    seen = []
    real = reference._add_dtensors

    def spy(score_mod, arrays, ds3, sc, dtensors):
        seen.append(sorted(arrays))
        return real(score_mod, arrays, ds3, sc, dtensors)
    monkeypatch.setattr(reference, "_add_dtensors", spy)
    for selection, want in ((["slopes"], [["slopes"]]), (False, []), (True, [["slopes", "table"]])):
        del seen[:]
        g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, device="reference",
                                       dtensors=selection)
        assert set(g.dtensors) == _asked(selection)
        assert seen and all(s == want[0] for s in seen) if want else not seen, (selection, seen)
        del seen[:]
        rg = reference.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, dtensors=selection)
        assert set(rg.dtensors) == _asked(selection) and (bool(seen) == bool(want))
        for name, x in g.dtensors.items():
            assert np.array_equal(x, rg.dtensors[name]), name


# --- bad input -------------------------------------------------------------------------------

@pytest.fixture
def small(rng):
    slopes, table = _arrays(rng)
    ids = np.arange(2 * S + 1)                    # an int array: no gradient, never a valid name
    mask_tab = rng.standard_normal(S).astype(np.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * np.abs(q_idx - kv_idx) + table[h, ids[q_idx - kv_idx + S]]

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_tab[kv_idx] > -3.0
    q, k, v = make_qkv(rng, 1, 6, 6, H, 1, 8, 8, F32)
    out, lse = attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True, device="cpu")
    return q, k, v, out, lse, score_mod, mask_mod


@pytest.mark.parametrize("device", ["cpu", "reference"])
@pytest.mark.parametrize("value, pattern", [
    ("slopes", r"dtensors must be True .* got 'slopes'; for one array write dtensors=\['slopes'\]"),
    (None, "dtensors must be True .* got None"),
    (2, "dtensors must be True .* got 2"),
    (0.5, "dtensors must be True .* got 0.5"),
    (b"slopes", "dtensors must be True .* got b'slopes'"),
    (["slopes", 3], r"dtensors must hold array names \(str\), got 3"),
])
def test_a_wrong_type_is_a_type_error_naming_dtensors(small, device, value, pattern):
    q, k, v, out, lse, score_mod, mask_mod = small
    with pytest.raises(TypeError, match=pattern):
        attnext.attention_backward(out, q, k, v, out, lse, score_mod=score_mod, mask_mod=mask_mod,
                                   device=device, dtensors=value)


@pytest.mark.parametrize("device", ["cpu", "reference"])
@pytest.mark.parametrize("name", ["nope", "ids", "mask_tab", "self.table"])
def test_a_name_that_is_no_captured_float_array_is_a_value_error(small, device, name):
    """An unknown name, an int array's and a mask_mod's array are refused, with the valid names."""
    q, k, v, out, lse, score_mod, mask_mod = small
    with pytest.raises(ValueError, match=rf"dtensors: '{name}' is not a float array the score_mod "
                                         r"captures \(its captured float arrays: 'slopes', 'table'\)"):
        attnext.attention_backward(out, q, k, v, out, lse, score_mod=score_mod, mask_mod=mask_mod,
                                   device=device, dtensors=["slopes", name])


def test_without_a_score_mod(small):
    """True, False and an empty collection give {}; names are a ValueError."""
    q, k, v, out, lse, _, mask_mod = small
    for device in ("cpu", "reference"):
        for value in (True, False, [], set(), np.True_):
            g = attnext.attention_backward(out, q, k, v, out, lse, mask_mod=mask_mod, device=device,
                                           dtensors=value)
            assert g.dtensors == {}
        with pytest.raises(ValueError, match=r"dtensors names \['slopes'\], but no score_mod is given"):
            attnext.attention_backward(out, q, k, v, out, lse, mask_mod=mask_mod, device=device,
                                       dtensors=["slopes"])
    cu = np.array([0, 6], np.int32)
    with pytest.raises(ValueError, match="no score_mod"):
        attnext.varlen_attention_backward(out[0], q[0], k[0], v[0], out[0], lse[0], cu, cu, dtensors={"x"})


def test_collections_of_names(small):
    """Any iterable of names: a list, tuple, set, a dict's keys, a generator; duplicates are one."""
    q, k, v, out, lse, score_mod, mask_mod = small
    for value in (["table"], ("table", "table"), {"table"}, frozenset({"table"}), {"table": 1},
                  (n for n in ["table"]), np.array(["table"])):
        g = attnext.attention_backward(out, q, k, v, out, lse, score_mod=score_mod, mask_mod=mask_mod,
                                       device="cpu", dtensors=value)
        assert list(g.dtensors) == ["table"], value


def test_the_forward_takes_no_dtensors(small):
    q, k, v, _, _, score_mod, _ = small
    with pytest.raises(TypeError, match="dtensors"):
        attnext.attention(q, k, v, score_mod=score_mod, dtensors=False)


# --- the programs a selection makes ------------------------------------------------------------

def _instructions(program):
    """(op name, operands) of a packed interpreter program (interp._pack)."""
    names = {code: name for name, code in interp.OPS.items()}
    code = program.code
    n = int(code[0])
    return [(names[int(code[7 + 5 * i])], tuple(int(x) for x in code[8 + 5 * i:12 + 5 * i])) for i in range(n)]


def test_the_interpreter_scatters_only_the_asked_arrays(rng):
    slopes, table = _arrays(rng)
    t = trace.trace_score_mod(mods.softcap_alibi_rel(3.0, slopes, table))
    pos = {name: i for i, name in enumerate(codegen.array_order(t))}
    for names in (None, {"slopes"}, {"table"}, set()):
        low = interp.lower(t, derivative.positions(t, names))
        scattered = sorted({ops[1] for op, ops in _instructions(low.grad) if op == "scatter"})
        want = sorted(pos[n] for n in (pos if names is None else names))
        assert scattered == want and list(low.grad_arrays) == want, (names, scattered)
        m = interp.bind(t, None, np.float32, backward=True, dtensors=names)
        sizes = {"slopes": slopes.size, "table": table.size}
        assert m.dtensors.size == sum(sizes[n] for n in (sizes if names is None else names))
        assert [o >= 0 for o in m.grad_offsets] == [i in want for i in range(len(pos))]
    # the programs are cached by structure and selection: another selection, another lowering
    assert interp.programs(t, (0,)) is interp.programs(t, (0,))
    assert interp.programs(t, (0,)) is not interp.programs(t, ())


def test_no_asked_array_lowers_as_the_constant_twin(rng):
    """ALiBi through a slopes array with dtensors=False has the derivative program and the stash
    of its constant-slope twin (which has no array gradient at all)."""
    slopes, _ = _arrays(rng)
    ta, tc = trace.trace_score_mod(alibi_of(slopes)), trace.trace_score_mod(alibi_const)
    none, twin, every = interp.lower(ta, ()), interp.lower(tc), interp.lower(ta)
    assert np.array_equal(none.grad.code, twin.grad.code)
    assert (none.n_fstash, none.n_istash, none.grad_arrays) == (twin.n_fstash, twin.n_istash, ()) == (0, 0, ())
    assert "scatter" in [op for op, _ in _instructions(every.grad)]


def test_codegen_without_asked_arrays_is_the_constant_twins_shape(rng):
    """The generated header of ALiBi through a slopes array, asked for no gradient, defines the
    functions and kernel switches of its constant-slope twin: no mod_dtensors, no tile sums,
    HAS_DTENSORS 0, the same derivative, and every backward kernel's #defines the same."""
    slopes, _ = _arrays(rng)
    ta, tc = trace.trace_score_mod(alibi_of(slopes)), trace.trace_score_mod(alibi_const)
    none, twin, every = codegen.generate(ta, wanted=()), codegen.generate(tc), codegen.generate(ta)
    for gen in (none, twin):
        assert gen.defines == {"HAS_SCORE_MOD": 1, "HAS_MASK_MOD": 0, "HAS_DTENSORS": 0}
        assert gen.grad_arrays == () and gen.tile_terms == ()
        for absent in ("mod_dtensors", "mod_tile_plan", "mod_scatter"):
            assert absent not in gen.source, absent
    # the derivative's functions are the same text; only mod_score reads the array or the constant
    derivative_of = [g.source[g.source.index("MOD_COLD void mod_dscore_check"):] for g in (none, twin)]
    assert derivative_of[0] == derivative_of[1]
    assert every.defines["HAS_DTENSORS"] == 1 and every.grad_arrays == (0,) and "mod_scatter" in every.source
    features = dict(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None,
                    alibi_dtype=None, mask=False)
    for tile in (select.bwd_tile_config(128, 128), select.bwd_sm90_tile(128, "ordered")):
        for dq in ("recompute", "atomic", "ordered"):
            assert (select.bwd_defines(**features, tile=tile, dq=dq, mods=none)
                    == select.bwd_defines(**features, tile=tile, dq=dq, mods=twin))
    assert select.tile_sums(none, 64, 64) == select.tile_sums(twin, 64, 64) == (0, 0, False)


def test_the_selection_keys_the_generated_code(rng):
    """Each selection's header is its own text (the plans' and the cubin cache's key), cached
    under the selection's positions, which functions of one structure share whatever their
    names."""
    slopes, table = _arrays(rng)
    t = trace.trace_score_mod(mods.softcap_alibi_rel(3.0, slopes, table))
    pos = {name: i for i, name in enumerate(codegen.array_order(t))}
    gens = {sel: codegen.generated(t, None, None, sel)
            for sel in (None, (), (pos["slopes"],), (pos["table"],))}
    assert len({g.source for g in gens.values()}) == len(gens)
    assert [g.grad_arrays for g in gens.values()] == [(0, 1), (), (pos["slopes"],), (pos["table"],)]
    assert gens[()].defines["HAS_DTENSORS"] == 0 and gens[(pos["slopes"],)].defines["HAS_DTENSORS"] == 1
    assert codegen.generated(t, None, None, ()) is gens[()]
    assert codegen.generated(t, None, None, (0, 1)).source == gens[None].source   # all named: all
    other_slopes, other_table = slopes.copy(), table.copy()      # another function, one structure

    def renamed(score, b, h, q_idx, kv_idx):
        s = 3.0 * np.tanh(score / 3.0)
        return s - other_slopes[h] * np.abs(q_idx - kv_idx) + other_table[h, q_idx - kv_idx + S]
    t2 = trace.trace_score_mod(renamed)
    assert t2.key == t.key
    assert derivative.positions(t2, {"other_table"}) == derivative.positions(t, {"table"}) == (pos["table"],)
    assert codegen.generated(t2, None, None, (pos["table"],)) is gens[(pos["table"],)]


@pytest.mark.parametrize("arch, kernel, name, dq", [
    ("sm_80", "attn_bwd", "attn_bwd_dq", "recompute"),
    ("sm_80", "attn_bwd", "attn_bwd_dkdv", "atomic"),
    ("sm_90a", "attn_bwd_sm90", "attn_bwd_dkdv_ws_sm90", "ordered"),
])
def test_the_header_without_asked_arrays_compiles(arch, kernel, name, dq, rng):
    """NVRTC compiles the backward's entry points over a header without mod_dtensors."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    from attnext import _C
    from attnext.cuda import nvrtc
    slopes, _ = _arrays(rng)
    gen = codegen.generate(trace.trace_score_mod(alibi_of(slopes)), wanted=())
    features = dict(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None,
                    alibi_dtype=None, mask=False)
    tile = select.bwd_sm90_tile(128, dq) if arch == "sm_90a" else select.bwd_tile_config(128, 128)
    defines = select.entry_defines(select.bwd_defines(**features, tile=tile, dq=dq, mods=gen), name)
    nvrtc.nvrtc()
    cubin, _ = _C.nvrtc_compile(*nvrtc.compile_args(kernel, defines, arch, gen.source))
    assert name.encode() in cubin


# --- the GPU host side on the fake driver ----------------------------------------------------

def test_gpu_host_side_on_the_fake_driver(fake_driver):  # noqa: F811
    """dtensors=False launches the constant twin's kernels (their names, #defines, shared memory
    and grids) on sm_90a and sm_80, with no accumulator and every gradient field -1, and comes
    back {}; the default launches the scatter (HAS_DTENSORS; on sm_90a a dQ kernel the twin does
    not run) and the sums; a selection binds only the asked array's gradient field; a transposed
    CUDA table left out is read in place, not copied contiguous."""
    _run(fake_driver, r"""
        from attnext.mods import codegen, trace
        MODS = []
        _plain = _C.cuda_launch_attention

        def launch_mods(fn, *args):
            _plain(fn, *args[:8])
            if len(args) > 8:
                rec = np.frombuffer(args[-1], codegen.MODS_DTYPE, count=1)[0].copy()
                MODS.append((FN[id(fn)][1], rec))

        _C.cuda_launch_attention = launch_mods
        _kernel = _C.launch
        SUMS = []

        def kernel(fn, *args):            # attn_dtensors and attn_convert: no attn_params
            fake_cuda.counter(lib, "record").value = 0
            _kernel(fn, *args)
            fake_cuda.counter(lib, "record").value = 1
            SUMS.append(FN[id(fn)][1])

        _C.launch = kernel

        H, S = 4, 200
        q, k, v = qkv(1, S, S, H, H, 128)
        out, lse, dout = dev((1, S, H, 128)), dev((1, H, S), np.float32), dev((1, S, H, 128))
        slopes = np.linspace(0.1, 0.8, H).astype(np.float32)
        table = np.linspace(-1, 1, H * (2 * S + 1)).astype(np.float32).reshape(H, 2 * S + 1)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * np.abs(q_idx - kv_idx)

        def alibi_const(score, b, h, q_idx, kv_idx):
            return score - 0.5 * np.abs(q_idx - kv_idx)

        def both(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * np.abs(q_idx - kv_idx) + table[h, q_idx - kv_idx + S]

        def backward(fn, **kw):
            del MODS[:], SUMS[:]
            n = len(LAUNCHES)
            g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=fn, causal=True, **kw)
            return g, [l[:4] for l in LAUNCHES[n:]], list(MODS), list(SUMS)

        for arch in ("sm_90a", "sm_80"):
            cuda_backend.device_arch = lambda device, arch=arch: arch
            cuda_backend.clear_plans()
            g_twin, twin, _, sums_twin = backward(alibi_const)
            g_none, none, recs, sums_none = backward(alibi, dtensors=False)
            assert g_twin.dtensors == g_none.dtensors == {} and sums_twin == sums_none == []
            assert none == twin, (arch, none, twin)
            assert all(not r["dacc"] and (r["a"]["grad"] == -1).all() for _, r in recs), recs
            g_all, every, recs, sums = backward(alibi)
            assert set(g_all.dtensors) == {"slopes"} and sums == ["attn_dtensors"], (g_all.dtensors, sums)
            assert every != twin and any(dict(l[0][2]).get("HAS_DTENSORS") for l in every), every
            names = [l[0][1] for l in every]
            assert any(n.startswith("attn_bwd_dq") for n in names), names
            if arch == "sm_90a":        # the scatter's dQ kernel, where the twin adds dQ in order
                assert names != [l[0][1] for l in twin], names
            assert all(r["dacc"] and r["a"][0]["grad"] == 0 for _, r in recs)
            # a selection: only the asked array has a gradient field and an accumulator
            g_sel, _, recs, _ = backward(both, dtensors=["table"])
            order = codegen.array_order(trace.trace_score_mod(both))
            grads = recs[-1][1]["a"]["grad"][:2]
            assert list(g_sel.dtensors) == ["table"] and grads[order.index("slopes")] == -1, grads
            assert grads[order.index("table")] == 0 and recs[-1][1]["dacc"], grads
        # a transposed CUDA table: the accumulator needs it contiguous, so the default backward
        # copies it; left out, it is read in place as the forward reads it
        base = dev((2 * S + 1, H), np.float32)
        ttab = device.DeviceArray(base.ptr, (H, 2 * S + 1), np.float32, 0, (1, H), 0, base)

        def rel(score, b, h, q_idx, kv_idx):
            return score + ttab[h, q_idx - kv_idx + S]

        _, _, recs, sums = backward(rel)
        assert "attn_convert" in sums and recs[-1][1]["a"][0]["ptr"] != base.ptr, sums
        g, _, recs, sums = backward(rel, dtensors=False)
        assert g.dtensors == {} and sums == [] and recs[-1][1]["a"][0]["ptr"] == base.ptr, sums
        assert tuple(recs[-1][1]["a"][0]["s"][:2]) == (1, H)
        print("ok")
    """)


# --- on the GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("capture", ["numpy", "torch"])
def test_gpu_selection_on_torch_tensors(torch, capture):
    """bfloat16 torch CUDA tensors, a score_mod reading a slopes array and a relative table
    captured as NumPy arrays or torch CUDA tensors: every selection's dq, dk, dv and asked
    dtensors against the reference; an asked array's gradient has the default's bits (the sums
    are exact), dq, dk, dv agree with the default's within the rule (dtensors=False may add dQ
    by another mode); dtensors=False runs the constant twin's kernels."""
    from conftest import BF16, assert_close
    from attnext.cuda import backend as cuda_backend, nvrtc
    from attnext.mods import fingerprint
    from attnext.testing.accuracy import coarser
    rng = np.random.default_rng(11)
    B, SQ, HQ, D = 2, 130, 4, 64
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    table = (0.3 * rng.standard_normal((HQ, 2 * SQ + 1))).astype(np.float32)
    host = {"slopes": slopes, "table": table}
    captured = host if capture == "numpy" else {n: torch.from_numpy(a).cuda() for n, a in host.items()}

    def make(slopes, table):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * np.abs(q_idx - kv_idx) + table[h, q_idx - kv_idx + SQ]
        return score_mod
    score_mod = make(captured["slopes"], captured["table"])
    on_host = fingerprint.with_arrays(score_mod, host)
    q, k, v = make_qkv(rng, B, SQ, SQ, HQ, 2, D, D, BF16)
    dout = randn(rng, q.shape, BF16)

    def put(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()

    def get(t):
        if isinstance(t, np.ndarray):
            return t
        t = t.detach().cpu()
        return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()
    tq, tk, tv, tdo = (put(x) for x in (q, k, v, dout))
    t_out, t_lse = attnext.attention(tq, tk, tv, score_mod=score_mod, causal=True, return_lse=True)
    out, lse = get(t_out), get(t_lse)
    r_out = reference.attention(q, k, v, score_mod=on_host, causal=True)
    every = attnext.attention_backward(tdo, tq, tk, tv, t_out, t_lse, score_mod=score_mod, causal=True)
    every_h = type(every)(*(get(x) for x in every[:3]), None, {n: get(x) for n, x in every.dtensors.items()})
    for selection in SELECTIONS:
        g = attnext.attention_backward(tdo, tq, tk, tv, t_out, t_lse, score_mod=score_mod, causal=True,
                                       dtensors=selection)
        assert set(g.dtensors) == _asked(selection), (selection, list(g.dtensors))
        got = type(g)(*(get(x) for x in g[:3]), None, {n: get(x) for n, x in g.dtensors.items()})
        rg = reference.attention_backward(dout, q, k, v, out, lse, score_mod=on_host, causal=True,
                                          dtensors=selection)
        problems = compare_grads(got, rg, q, k, v, dout, out, r_out, None, dict(score_mod=on_host, causal=True))
        assert not problems, (selection, problems)
        floor = max(float(np.abs(x).max(initial=0.0)) for x in rg[:3])
        for name, x in got.dtensors.items():
            if capture == "torch":
                assert isinstance(g.dtensors[name], torch.Tensor) and g.dtensors[name].is_cuda
            assert x.dtype == np.float32 and x.shape == host[name].shape
            assert_close(f"dtensors[{name!r}]", x.astype(np.float64), rg.dtensors[name],
                         coarser(BF16, np.float32), max(floor, float(np.abs(rg.dtensors[name]).max())))
            assert np.array_equal(x.view(np.uint32), every_h.dtensors[name].view(np.uint32)), (selection, name)
        for name in ("dq", "dk", "dv"):
            assert_close(name, getattr(got, name), getattr(every_h, name), BF16, cond=2.0)
    # dtensors=False launches what the constant-slope twin launches
    seen = []
    real = nvrtc.function

    def spy(kernel, name, defines, device, arch, smem, generated=None):
        seen.append((kernel, name, tuple(sorted(defines.items())), smem))
        return real(kernel, name, defines, device, arch, smem, generated)
    alibi, const = alibi_of(captured["slopes"]), alibi_const
    kernels = {}
    try:
        cuda_backend.nvrtc.function = spy
        for what, fn, kw in (("twin", const, {}), ("none", alibi, dict(dtensors=False))):
            cuda_backend.clear_plans()
            del seen[:]
            g = attnext.attention_backward(tdo, tq, tk, tv, t_out, t_lse, score_mod=fn, causal=True, **kw)
            torch.cuda.synchronize()
            assert g.dtensors == {}
            kernels[what] = list(seen)
    finally:
        cuda_backend.nvrtc.function = real
    assert kernels["none"] == kernels["twin"] and kernels["none"], kernels


@pytest.mark.gpu
def test_gpu_varlen_selection_with_numpy_lengths(torch):
    """varlen_attention_backward on torch CUDA tensors: a selection returns exactly its names,
    with the default's bits."""
    from conftest import BF16
    rng = np.random.default_rng(12)
    slopes, table = (rng.uniform(0.05, 0.5, 4).astype(np.float32),
                     (0.3 * rng.standard_normal((4, 2 * 70 + 1))).astype(np.float32))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * np.abs(q_idx - kv_idx) + table[h, q_idx - kv_idx + 70]
    cu = np.array([0, 70, 90, 160], np.int32)
    q, k, v = make_varlen_qkv(rng, 160, 160, 4, 2, 64, 64, BF16)

    def put(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()
    tq, tk, tv = (put(x) for x in (q, k, v))
    out, lse = attnext.varlen_attention(tq, tk, tv, cu, cu, score_mod=score_mod, return_lse=True)
    every = attnext.varlen_attention_backward(out, tq, tk, tv, out, lse, cu, cu, score_mod=score_mod)
    g = attnext.varlen_attention_backward(out, tq, tk, tv, out, lse, cu, cu, score_mod=score_mod,
                                          dtensors={"slopes"})
    assert list(g.dtensors) == ["slopes"]
    assert np.array_equal(g.dtensors["slopes"].view(np.uint32), every.dtensors["slopes"].view(np.uint32))
    g = attnext.varlen_attention_backward(out, tq, tk, tv, out, lse, cu, cu, score_mod=score_mod, dtensors=False)
    assert g.dtensors == {}


def test_assert_grads_close_takes_the_backwards_dtensors(rng):
    """attnext.testing.assert_grads_close with the options of a backward that asked for some
    arrays: the reference's expected asked for the same ones."""
    import attnext.testing
    slopes, table = _arrays(rng)
    score_mod = mods.softcap_alibi_rel(3.0, slopes, table)
    q, k, v = make_qkv(rng, 1, 9, S, H, 2, 8, 8, F32)
    opts = dict(score_mod=score_mod, causal=True, dtensors=["table"])
    out, lse = attnext.attention(q, k, v, score_mod=score_mod, causal=True, return_lse=True)
    dout = randn(rng, out.shape, F32)
    g = attnext.attention_backward(dout, q, k, v, out, lse, **opts)
    expected = reference.attention_backward(dout, q, k, v, out, lse, **opts)
    attnext.testing.assert_grads_close(g, expected, q=q, k=k, v=v, dout=dout, out=out, **opts)
    bad = g._replace(dtensors={"table": 2 * g.dtensors["table"]})
    with pytest.raises(AssertionError, match="dtensors"):
        attnext.testing.assert_grads_close(bad, expected, q=q, k=k, v=v, dout=dout, out=out, **opts)
