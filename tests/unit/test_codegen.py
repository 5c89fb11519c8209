"""The CUDA code generator (attnext/codegen.py) without a GPU.

The generated device functions and kernels/attn_mods.cuh are plain C as well: here they are
built with the host C compiler (DEV = static inline) into a small program that evaluates them
over a grid of (score, b, h, q_idx, kv_idx, dout) (helpers/host_c.py) and compared with
trace.evaluate / grad.evaluate_grad, for the zoo of helpers/mods.py and NumPy's integer rules.
Also: lookups out of range set the error record and read nothing outside the array, the exact
gradient accumulator is the correctly rounded sum in any order, the attn_mods_gpu layout matches
codegen.pack's, and the op tables cover everything the tracer produces. The real kernels with
generated code are compiled by NVRTC in tests/host/test_kernels_compile.py.
"""
import math
import subprocess

import numpy as np
import pytest

from attnext.mods import codegen, grad as derivative, trace

from helpers import mods
from helpers.driver import run_fresh
from helpers.host_c import INCLUDES, bind, build, close, grid, run, with_facts
from helpers.paths import pythonpath


def int_rules(s, b, h, qi, ki):
    d = qi - ki
    ints = d // (ki % 4 - 1) + d % (qi % 3 - 1) * 3 + (-d) // 3 + (d % -4) + (d ** 3) % 5
    floats = np.floor_divide(s, 0.7) * 0.1 + np.remainder(s, -0.45)
    flags = (qi > 3) * 2 + ((qi & 1) ^ (ki | 2)) - (~d)
    return s + ints * 0.01 + floats + flags * 0.05 + np.where(d != 0, 1.0, 0.0)


def score_zoo():
    zoo = dict(mods.score_mods())
    zoo["int_rules"] = int_rules
    return zoo


@pytest.mark.parametrize("facts", [False, True], ids=["checked", "facts"])
@pytest.mark.parametrize("name", sorted(score_zoo()))
def test_score_mod_matches_evaluate(name, facts, cc, tmp_path, rng):
    """Every lookup checked, int64 integers; and as a call reads them (lookups bounds proves in
    range read directly, integer arrays as int32 where their values fit)."""
    t = trace.trace_score_mod(score_zoo()[name])
    _score_mod_against_evaluate(t, *_generated(t, facts), cc, tmp_path, rng)


def _generated(t, facts):
    """(Generated, the arrays it reads) of a traced score_mod: every lookup checked, or with_facts'."""
    if facts:
        return with_facts(t, None)
    gen = codegen.generate(t)
    return gen, bind(t, gen, "score_mod")


def _score_mod_against_evaluate(t, gen, bound, cc, tmp_path, rng):
    """The generated functions, built by the host C compiler, against trace.evaluate and
    grad.evaluate_grad on grid()'s points: the score, d score and each array's gradient."""
    exe = build(cc, tmp_path, gen)
    pts = grid(rng)
    fwd, dscore, _, err, grads = run(exe, tmp_path, gen, bound, pts, t.params)
    assert err[0] == 0
    with np.errstate(all="ignore"):
        want = trace.evaluate(t, *pts[:5])
        g = derivative.grad(t)
        want_ds, want_arrays = derivative.evaluate_grad(t, g, *pts, float_dtype=np.float64)
    close(fwd, want, "forward")
    close(dscore, want_ds, "d score")
    names = {i: name for i, (k, name, _) in enumerate(gen.arrays)}
    assert sorted(names[i] for i in gen.grad_arrays) == sorted(g.darrays)
    for i, got in grads.items():
        w = want_arrays[names[i]]
        close(got, w, f"d {names[i]}", atol=1e-4 * max(1.0, float(np.abs(w).max())))


def _function_body(source, name):
    return source.split(name + "(", 1)[1].split("\n}\n", 1)[0]


@pytest.mark.parametrize("facts", [False, True], ids=["checked", "facts"])
def test_lookups_of_b_and_h_alone_are_read_once_a_head(facts, cc, tmp_path, rng):
    """A score_mod's float lookups whose indices are b, h and constants alone, proven in range,
    go to mod_head (the kernels: once a (b, h) tile, into score_ctx.hv), at most MAX_HEAD of
    them; the kernels' mod_score_h / mod_dscore_h / mod_dtensors_h read hv instead. A lookup
    by q_idx, an integer one, or one bounds did not prove stays at the score; and the values
    are the reference's either way (the host twin: mod_score = mod_head, then mod_score_h)."""
    H, S = mods.H_MAX, mods.S_MAX
    slopes = rng.standard_normal(H).astype(np.float32)
    table = rng.standard_normal((2, H)).astype(np.float32)
    rows = rng.standard_normal(S).astype(np.float32)
    scalar = np.array(0.5)
    heads = np.arange(H, dtype=np.int64) % 3

    def fn(s, b, h, qi, ki):
        return (s * slopes[h] - table[b, (h + 1) % H] * np.abs(qi - ki) + rows[qi] + scalar
                + table[1, heads[h]] + slopes[H - 1 - h])
    t = trace.trace_score_mod(fn)
    gen, bound = _generated(t, facts)
    head = _function_body(gen.source, "mod_head")
    kernel = _function_body(gen.source, "mod_score_h")
    held = head.count("mod_load_f(")
    if facts:
        # slopes[h], table[b, (h + 1) % H], the 0-d scalar and table[1, heads[h]] (through an
        # integer lookup of h: proven) fill MAX_HEAD; slopes[H - 1 - h], the fifth, stays
        assert held == codegen.MAX_HEAD == 4 and f"#define MOD_HEAD_SIZE {held}" in gen.source, head
        assert kernel.count("mod_load_f(") == 2 and kernel.count("hv[") == 4, kernel
        assert "q_idx" not in head and "mod_load_i" in head
        assert "hv[" in _function_body(gen.source, "mod_dscore_h")     # d/d score: slopes[h]
    else:                        # nothing proven: every lookup checked at the score
        assert held == 0 and "#define MOD_HEAD_SIZE 1" in gen.source and "hv[" not in kernel
    _score_mod_against_evaluate(t, gen, bound, cc, tmp_path, rng)


@pytest.mark.parametrize("facts", [False, True], ids=["checked", "facts"])
@pytest.mark.parametrize("name", sorted(mods.mask_mods()))
def test_mask_mod_matches_evaluate(name, facts, cc, tmp_path, rng):
    t = trace.trace_mask_mod(mods.mask_mods()[name])
    gen, bound = with_facts(None, t) if facts else (codegen.generate(None, t), None)
    exe = build(cc, tmp_path, gen)
    pts = grid(rng, scores=(0.0,))
    _, _, keep, err, _ = run(exe, tmp_path, gen, bound if facts else bind(t, gen, "mask_mod"), pts, t.params)
    assert err[0] == 0
    want = np.broadcast_to(trace.evaluate(t, None, *pts[1:5]), keep.shape)
    np.testing.assert_array_equal(keep.astype(bool), want)


def test_score_and_mask_mod_together_number_arrays_and_floats(cc, tmp_path, rng):
    table = rng.standard_normal((mods.H_MAX, 2 * mods.S_MAX + 1))
    allowed = rng.random((mods.S_MAX, mods.S_MAX)) < 0.5

    def score_mod(s, b, h, qi, ki):
        return s * 0.5 + table[h, qi - ki + mods.S_MAX] - 1.25

    def mask_mod(b, h, qi, ki):
        return allowed[qi, ki] | (qi * 1.5 > ki + 2.5)

    ts, tm = trace.trace_score_mod(score_mod), trace.trace_mask_mod(mask_mod)
    gen = codegen.generate(ts, tm)
    assert [a[:2] for a in gen.arrays] == [("score_mod", "table"), ("mask_mod", "allowed")]
    assert gen.n_score_floats == 2 and gen.grad_arrays == (0,)
    exe = build(cc, tmp_path, gen)
    pts = grid(rng)
    bound = bind(ts, gen, "score_mod") + bind(tm, gen, "mask_mod")
    fwd, _, keep, err, _ = run(exe, tmp_path, gen, bound, pts, ts.params + tm.params)
    assert err[0] == 0
    close(fwd, trace.evaluate(ts, *pts[:5]), "forward")
    np.testing.assert_array_equal(keep.astype(bool), trace.evaluate(tm, None, *pts[1:5]))


def test_lookup_out_of_range_sets_the_error_record_and_reads_inside(cc, tmp_path, rng):
    table = np.arange(5, dtype=np.float32) + 1

    def score_mod(s, b, h, qi, ki):
        return s + table[ki - 2]

    t = trace.trace_score_mod(score_mod)
    gen = codegen.generate(t)
    exe = build(cc, tmp_path, gen)
    pts = grid(rng, scores=(0.0,))
    fwd, _, _, err, _ = run(exe, tmp_path, gen, bind(t, gen, "score_mod"), pts)
    assert list(err) == [1, 0, 0, 5, 5]               # ki = 7 reads the first index past the end
    assert set(np.round(fwd - pts[0], 5)) <= set(table)   # clamped, never outside
    msg = str(codegen.index_error(codegen.call_arrays(t), err))
    assert msg == "score_mod: index 5 is out of bounds for axis 0 of array 'table' with size 5"


def test_facts_keep_the_check_where_bounds_cannot_prove_the_lookup(cc, tmp_path, rng):
    """A call's facts read the lookup they prove in range directly and still check the other:
    the error record names it, the value is the clamped element."""
    table = np.arange(5, dtype=np.float32) + 1
    ids = np.arange(mods.S_MAX, dtype=np.int64)[::-1] * (2 ** 32 // mods.S_MAX)   # past int32: stays int64

    def score_mod(s, b, h, qi, ki):
        return s + table[ki - 2] + ids[qi] * 1e-9

    t = trace.trace_score_mod(score_mod)
    gen, bound = with_facts(t, None)
    assert "mod_offset(" in gen.source and "mod_offset_in(" in gen.source
    assert [a.dtype for a in bound] == [np.float32, np.int64]
    exe = build(cc, tmp_path, gen)
    pts = grid(rng, scores=(0.0,))
    fwd, _, _, err, _ = run(exe, tmp_path, gen, bound, pts, t.params)
    assert list(err) == [1, 0, 0, 5, 5]
    inside = pts[4] < 7
    close(fwd[inside], trace.evaluate(t, *(x[inside] for x in pts[:5])), "forward")


def test_storage_narrows_integers_that_fit_int32():
    fits = np.array([-2 ** 31, 2 ** 31 - 1], np.int64)
    assert codegen.storage(fits, trace.I, narrow=True).dtype == np.int32
    assert codegen.storage(fits, trace.I).dtype == np.int64          # no Facts: int64
    assert codegen.storage(fits + 1, trace.I, narrow=True).dtype == np.int64
    assert codegen.storage(np.zeros(0, np.int64), trace.I, narrow=True).dtype == np.int64
    assert codegen.storage(np.array(True), trace.B, narrow=True).dtype == np.bool_
    for dt, want in ((np.int16, np.int32), (np.uint16, np.int32), (np.int32, np.int32),
                     (np.uint32, np.int64), (np.int64, np.int64)):
        assert codegen.storage_dtype(trace.I, dtype=np.dtype(dt)) == want, dt


def test_int64_expressions_within_int32_convert_and_compare_as_int():
    """The kernels' integer inputs lie in [0, 2^31): q_idx - kv_idx is computed, compared and
    converted as an int (32-bit arithmetic), |q_idx - kv_idx| (ALiBi) as the float's fabsf, and
    max(q_idx, kv_idx) in int32 too; while a product that can pass int32 (q_idx * 100000, 2 *
    kv_idx), what reads it, and a lookup's unknown value keep int64."""
    table = np.arange(5, dtype=np.int64)
    gen = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: s - 0.5 * np.abs(q - kv) + table[kv % 5]
                                                 + np.abs(q - 2 * kv) + np.maximum(q, kv)),
                           trace.trace_mask_mod(lambda b, h, q, kv: (q - kv < 100) & (q * 100000 > kv)))
    src = gen.source
    assert "fabsf((float)((int)(mod_ssub(q_idx, kv_idx))))" in src
    assert "((int)(mod_ssub(q_idx, kv_idx)) < (int)(((int64_t)100LL)))" in src
    assert "((float)((int)(mod_smax(q_idx, kv_idx))))" in src
    assert "(mod_imul(q_idx, ((int64_t)100000LL)) > kv_idx)" in src
    assert "((float)(mod_iabs(mod_isub(q_idx, mod_imul(((int64_t)2LL), kv_idx)))))" in src
    assert "const int64_t v0 = mod_load_i(" in src and "((float)(v0))" in src


def test_a_quotient_only_tanh_reads_divides_by_the_reciprocal():
    """s / cap inside np.tanh renders as mod_fdiv_tanh (the divisor's reciprocal alone); a
    quotient that anything else reads, or that is the score itself, keeps mod_fdiv (exact). Each
    function decides alone: the score's derivative may read tanh(u) where the score read u too."""
    def score_q(fn):
        src = codegen.generate(trace.trace_score_mod(fn)).source
        return src[src.index("DEV float mod_score_h("):src.index("DEV float mod_score_q(")]
    assert "fast_tanh(mod_fdiv_tanh(score, m->f[0]))" in score_q(lambda s, b, h, q, kv: 30.0 * np.tanh(s / 30.0))
    for fn in (lambda s, b, h, q, kv: s / 30.0,
               lambda s, b, h, q, kv: np.exp(s / 30.0),
               lambda s, b, h, q, kv: (lambda u: np.tanh(u) + u)(s / 30.0)):
        src = score_q(fn)
        assert "mod_fdiv(score, m->f[0])" in src and "mod_fdiv_tanh" not in src


def test_same_structure_other_names_binds_its_own_arrays(rng):
    """Two functions of one structure share their Generated (named after the first), but each
    call binds and reports its own arrays by position."""
    first, other = rng.standard_normal(7), rng.standard_normal(7)

    def a(s, b, h, qi, ki):
        return s + first[ki]

    def c(s, b, h, qi, ki):
        return s + other[ki]

    ta, tc = trace.trace_score_mod(a), trace.trace_score_mod(c)
    assert codegen.generated(ta) is codegen.generated(tc)
    assert codegen.call_arrays(ta) == [("score_mod", "first")]
    assert codegen.call_arrays(tc) == [("score_mod", "other")]
    assert "'other'" in str(codegen.index_error(codegen.call_arrays(tc), [1, 0, 0, 9, 7]))


def test_negative_indices_count_from_the_end(cc, tmp_path, rng):
    table = np.arange(mods.S_MAX, dtype=np.int64) * 3

    def mask_mod(b, h, qi, ki):
        return table[-1 - qi] > ki

    t = trace.trace_mask_mod(mask_mod)
    gen = codegen.generate(None, t)
    exe = build(cc, tmp_path, gen)
    pts = grid(rng, scores=(0.0,))
    _, _, keep, err, _ = run(exe, tmp_path, gen, bind(t, gen, "mask_mod"), pts)
    assert err[0] == 0
    np.testing.assert_array_equal(keep.astype(bool), table[-1 - pts[3]] > pts[4])


def test_empty_array_lookup_reports_and_adds_nothing(cc, tmp_path, rng):
    """A lookup into an empty array is out of range at every pair: reported, read from the one
    word pack points it at, and its (empty) gradient gets nothing, whatever the other arrays."""
    empty = np.zeros((mods.H_MAX, 0), np.float32)
    bias = rng.standard_normal(mods.S_MAX).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s + bias[qi] + empty[h, ki]

    t = trace.trace_score_mod(score_mod)
    gen = codegen.generate(t)
    bound = bind(t, gen, "score_mod")
    rec = np.frombuffer(codegen.pack(gen, t.params, [(1234, a.shape, (1,) * a.ndim) for a in bound],
                                     777, 0, {i: 0 for i in gen.grad_arrays}), codegen.MODS_DTYPE)[0]
    k = [name for _, name, _ in gen.arrays].index("empty")
    assert rec["a"][k]["ptr"] == 777 and rec["a"][k]["grad"] == -1
    assert rec["a"][1 - k]["ptr"] == 1234 and rec["a"][1 - k]["grad"] == 0
    exe = build(cc, tmp_path, gen)
    pts = grid(rng)
    _, _, _, err, grads = run(exe, tmp_path, gen, bound, pts, t.params)
    assert err[0] == 1 and err[1] == k and err[2] == 1 and err[4] == 0
    assert grads[k].shape == empty.shape
    assert grads[1 - k].shape == bias.shape


def test_gradient_accumulator_is_exact_in_any_order(cc, tmp_path, rng):
    """mod_scatter adds float32 values of every magnitude (denormals to 1e38, both signs,
    cancelling) exactly: the result is the correctly rounded sum, the same words in any order."""
    vals = np.concatenate([rng.standard_normal(200) * 10.0 ** rng.integers(-40, 38, 200),
                           [3e38, -3e38, 1e-45, -1e-45, 2.5, -2.5, 1.0, 1e-30]]).astype(np.float32)
    scale = np.zeros((), np.float32)

    def score_mod(s, b, h, qi, ki):
        return s * scale

    t = trace.trace_score_mod(score_mod)
    gen = codegen.generate(t)
    exe = build(cc, tmp_path, gen)
    n = vals.size
    zeros = np.zeros(n, np.int64)
    words = []
    for perm in (np.arange(n), rng.permutation(n), rng.permutation(n)):
        # d/d scale of s * scale is s: the adjoints are dout * s with dout = 1
        _, _, _, err, grads = run(exe, tmp_path, gen, bind(t, gen, "score_mod"),
                                  (vals[perm], zeros, zeros, zeros, zeros, np.ones(n, np.float32)))
        words.append(grads[0])
    assert words[0] == words[1] == words[2]
    assert float(words[0]) == math.fsum(float(v) for v in vals)


def test_limbs_to_float_specials():
    w = np.zeros((4, codegen.WORDS), np.uint64)
    w[0, -1], w[1, -1], w[2, -1], w[3, -1] = 1, 2, 4, 6
    got = codegen.limbs_to_float(w)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and np.isnan(got[3])


def test_struct_layout_matches_pack(cc, tmp_path):
    t = trace.trace_score_mod(mods.times_two)
    exe = build(cc, tmp_path, codegen.generate(t))
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    size, a_off, a_size, err_off, dacc_off, grad_off = map(int, out)
    d = codegen.MODS_DTYPE
    assert (size, a_off, err_off, dacc_off) == (d.itemsize, d.fields["a"][1], d.fields["err"][1],
                                                d.fields["dacc"][1])
    assert (a_size, grad_off) == (codegen.ARRAY_DTYPE.itemsize, codegen.ARRAY_DTYPE.fields["grad"][1])


def test_tables_cover_every_traced_op():
    produced = set(trace._ARITH) | set(trace._COMPARE) | set(trace._BITWISE) | set(
        trace._UNARY_FLOAT) | set(trace._BINARY_FLOAT) | {"neg", "abs", "not", "where", "cast",
                                                          "load", "dmul"}
    assert produced <= codegen.SUPPORTED_OPS, produced - codegen.SUPPORTED_OPS
    assert set(trace._EVAL) | {"load", "cast"} == codegen.SUPPORTED_OPS


def test_same_structure_same_source_floats_are_parameters():
    a = codegen.generate(trace.trace_score_mod(mods.softcap(2.0)))
    b = codegen.generate(trace.trace_score_mod(mods.softcap(30.0)))
    c = codegen.generate(trace.trace_score_mod(lambda s, b, h, qi, ki: s + qi * 7))
    d = codegen.generate(trace.trace_score_mod(lambda s, b, h, qi, ki: s + ki * 7))
    assert a.source == b.source and c.source != d.source
    assert "2.0" not in a.source and "30.0" not in a.source


def test_unsupported_shapes_name_the_limit():
    big = np.zeros((1, 1, 1, 1, 2))
    with pytest.raises(TypeError, match="at most 4"):
        codegen.generate(trace.trace_score_mod(lambda s, b, h, qi, ki: s + big[0, 0, 0, 0, qi]))
    arrays = [np.zeros(3) for _ in range(9)]
    a0, a1, a2, a3, a4, a5, a6, a7, a8 = arrays

    def many(s, b, h, qi, ki):
        return (s + a0[qi] + a1[qi] + a2[qi] + a3[qi] + a4[qi] + a5[qi] + a6[qi] + a7[qi]
                + a8[qi])
    with pytest.raises(TypeError, match="at most 8 captured arrays"):
        codegen.generate(trace.trace_score_mod(many))


# --- the host side of a GPU call, on the fake driver ---------------------------------------------

def test_gpu_call_binds_reports_and_returns_on_the_fake_driver(fake_libcuda):
    """attention / attention_backward with CUDA arrays and a score_mod through api.py and
    cuda_backend to the launch, on the fake libcuda (helpers/fake_libcuda.c) (its device memory is host
    memory, its launches do nothing; NVRTC compiles the real kernels): what the launch gets
    (the float constant, the uploaded table, the error record and accumulator, copied into
    attn_params.gmods by _C.cuda_launch_attention), the IndexError made from the error record,
    dtensors made from the accumulator's words, and the plans: the generated code is part of a
    plan's key, the constants are not."""
    out = run_fresh(r"""
        import ctypes
        import os
        import numpy as np
        import attnext
        from attnext import _C, _env
        from attnext.cuda import arrays as device, backend as cuda_backend
        from attnext.mods import codegen
        from helpers import fake_cuda
        _C.cuda_load()
        lib = ctypes.CDLL(os.environ["ATTNEXT_LIBCUDA"])
        fake_cuda.counter(lib, "record").value = 1
        rng = np.random.default_rng(0)

        def dev(x):
            a = device.empty(x.shape, x.dtype, 0, 0)
            _C.memcpy_htod(a.ptr, np.ascontiguousarray(x), 0)
            return a

        q, k, v = (dev(rng.standard_normal((1, 10, 2, 59)).astype(np.float16)) for _ in range(3))
        table = rng.standard_normal(5)
        seen, accum, mode = [], [], {"what": "error", "scale": 0.375}
        real_launch = _C.cuda_launch_attention

        def fake_launch(*args):
            assert len(args) == 10 and args[9] is not None, len(args)
            real_launch(*args)
            gmods = args[9]
            params = fake_cuda.last_launch(lib).params
            assert bytes(params.gmods) == gmods
            accum.append(params.dq_accum.ptr)
            rec = np.frombuffer(gmods, codegen.MODS_DTYPE)[0]
            seen.append(rec)
            a = rec["a"][0]
            data = np.frombuffer(ctypes.string_at(int(a["ptr"]), 40), np.float32)
            assert tuple(a["shape"]) == (5, 1, 1, 1) and a["s"][0] == 1, a
            assert np.array_equal(data[:5], table.astype(np.float32)), data
            assert abs(rec["f"][0] - mode["scale"]) < 1e-7, rec["f"][:2]
            if mode["what"] == "error":
                err = np.array([1, 0, 0, 7, 5], np.int64)
                ctypes.memmove(int(rec["err"]), err.ctypes.data, err.nbytes)
            elif rec["dacc"]:
                assert a["grad"] == 0
                words = np.zeros((5, codegen.WORDS), np.uint64)
                words[2, 6] = 3 << 4               # 1.5 = 3 * 2^-1 = (3 << 148) * 2^-149
                ctypes.memmove(int(rec["dacc"]), words.ctypes.data, words.nbytes)

        _C.cuda_launch_attention = fake_launch
        real_sums = _C.launch

        def fake_sums(fn, grid, block, smem, stream, params):
            # kernels/attn_dtensors.cu, by the host rule the GPU tests hold it to
            real_sums(fn, grid, block, smem, stream, params)
            dacc, dst, n = np.frombuffer(params, np.uint64)
            words = np.frombuffer(ctypes.string_at(int(dacc), int(n) * codegen.WORDS * 8), np.uint64)
            sums = codegen.limbs_to_float(words.reshape(-1, codegen.WORDS))
            ctypes.memmove(int(dst), sums.ctypes.data, sums.nbytes)

        _C.launch = fake_sums

        def score_mod(s, b, h, qi, ki):
            return s * mode["scale"] + table[ki]

        try:
            attnext.attention(q, k, v, score_mod=score_mod)
            raise SystemExit("no IndexError")
        except IndexError as e:
            assert str(e) == ("score_mod: index 7 is out of bounds for axis 0 of array 'table' "
                              "with size 5"), e
        mode["what"] = "grad"
        plans = cuda_backend.plan_count()
        mode["scale"] = 0.5                        # another constant: the same plan
        attnext.attention(q, k, v, score_mod=score_mod)
        assert cuda_backend.plan_count() == plans, (plans, cuda_backend.plan_count())
        attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * mode["scale"] + table[qi])
        assert cuda_backend.plan_count() == plans + 1
        _C.cuda_launch_attention = real_launch     # without mods: 9 arguments, gmods zero
        attnext.attention(q, k, v)
        assert not any(fake_cuda.last_launch(lib).params.gmods)
        _C.cuda_launch_attention = fake_launch
        mode["scale"] = 0.375
        out = dev(np.zeros((1, 10, 2, 59), np.float16))
        lse = dev(np.zeros((1, 2, 10), np.float32))
        _env.setenv("ATTNEXT_BWD_DQ", "atomic")    # what mods overrule: dQ is recomputed (no
        del accum[:]                               # dq_accum), as its kernels scatter the dtensors
        for deterministic in (True, False):
            g = attnext.attention_backward(out, q, k, v, out, lse, score_mod=score_mod,
                                           deterministic=deterministic)
            assert set(g.dtensors) == {"table"} and g.dtensors["table"].dtype == np.float64
            assert np.array_equal(g.dtensors["table"], [0, 0, 1.5, 0, 0]), g.dtensors
        assert len(seen) >= 5 and all(r["dacc"] for r in seen[-2:])
        assert accum and not any(accum), accum
        print("ok")
    """, ATTNEXT_LIBCUDA=fake_libcuda["full"], ATTNEXT_CACHE_DIR="off", PYTHONPATH=pythonpath())
    assert out.strip() == "ok"


QUIET_PROGRAM = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stddef.h>
#define DEV static inline
#include "attn_params.h"
#include "attn_mods.cuh"
#include "attn_mod_gen.cuh"

int main(void)
{
    static attn_mods_gpu m;
    static float table[5] = {1, 2, 3, 4, 5};
    static int64_t err[5];
    int bad = 0;
    m.a[0].ptr = table;
    m.a[0].shape[0] = 5;
    m.a[0].s[0] = 1;
    m.err = err;
    float v = mod_score_q(0.f, 0, 0, 0, 7, &m, &bad);      /* table[5]: clamped to table[4] */
    printf("%g %d %lld\n", v, bad, (long long)err[0]);
    mod_score_check(0.f, 0, 0, 0, 7, &m);
    printf("%lld %lld %lld %lld %lld\n", (long long)err[0], (long long)err[1], (long long)err[2],
           (long long)err[3], (long long)err[4]);
    bad = 0;
    v = mod_score_q(0.f, 0, 0, 0, 3, &m, &bad);
    printf("%g %d\n", v, bad);
    return 0;
}
"""


def test_kernel_lookups_note_and_the_check_twin_reports(cc, tmp_path):
    """What the kernels inline (mod_score_q) clamps an index out of range and sets *bad without
    touching the error record; its out-of-line twin (mod_score_check) repeats the lookups and
    reports (attn_common.cuh: a tile calls it once for a pair that noted one)."""
    table = np.arange(5, dtype=np.float32) + 1

    def score_mod(s, b, h, qi, ki):
        return s + table[ki - 2]

    gen = codegen.generate(trace.trace_score_mod(score_mod))
    d = tmp_path / "quiet"
    d.mkdir()
    (d / codegen.HEADER).write_text(gen.source)
    (d / "main.c").write_text(QUIET_PROGRAM)
    exe = d / "main"
    subprocess.run([cc, "-std=c11", "-O1", "-Wall", "-Werror", "-Wno-unused-variable",
                    "-Wno-unused-function", "-Wno-unused-but-set-variable",
                    *(f"-D{k}={v}" for k, v in gen.defines.items()),
                    *(f"-I{p}" for p in INCLUDES + [str(d)]), str(d / "main.c"), "-o", str(exe), "-lm"],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    assert out[0] == "5 1 0"              # clamped read, noted, not reported
    assert out[1] == "1 0 0 5 5"          # the twin reports array 0, axis 0, index 5, size 5
    assert out[2] == "2 0"                # in range: table[1], nothing noted
