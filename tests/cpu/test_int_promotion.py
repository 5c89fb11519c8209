"""Integer arithmetic in score_mod / mask_mod follows NumPy's promotion rules, as the reference's
call on NumPy arrays does (DESIGN "score_mod and mask_mod"; issue 28, point 2): captured arrays of
every integer dtype and bool, combined with each other, with Python ints (weak, NEP 50), NumPy
scalars (strong) and the int64 indices, under + - * // % comparisons min / max & | ^ - abs ~ and
np.where, in score_mods (forward and backward) and mask_mods, on the CPU against the reference.
Values span each dtype's whole range, so sums wrap, quotients meet negatives and zeros, and
uint64 values pass int64's. Also: the traced types are NumPy's, a lookup indexed by a wrapping
uint8 expression, block-mask cells whose intervals would wrap (csrc/mod_ints.h: mod_iv_fit), and
mask_mods that look like bands but compare through uint64 (attnext/band.py leaves them).
The same on the GPU under `-m gpu`: this file's test_gpu_*.
"""
import os

import numpy as np
import pytest

import attnext
from attnext import reference
from attnext.mods import band, codegen, trace
from conftest import F32, F64, assert_close, check_backend, make_qkv

# the reference computes the callbacks on NumPy arrays as they are: // and % by zero warn there
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

S = 24
INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
DTYPES = [np.bool_] + INTS


def name(dt):
    return np.dtype(dt).name


def values(rng, dtype, n=S):
    """n values of dtype: half small (around 0, negatives where signed), half over the whole
    range, with the extremes among them."""
    if dtype == np.bool_:
        return rng.random(n) < 0.5
    info = np.iinfo(dtype)
    v = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    small = rng.random(n) < 0.5
    v[small] = rng.integers(max(info.min, -6), 7, small.sum()).astype(dtype)
    v[rng.choice(n, 3, replace=False)] = [info.min, info.max, 0]
    return v


BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "minimum": np.minimum, "maximum": np.maximum,
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
    "where": lambda a, b: np.where(a < b, a, b),
}
UNARY = {"neg": lambda a, b: -a, "abs": lambda a, b: abs(a), "invert": lambda a, b: ~a}
OPS = {**BINARY, **UNARY}
# NumPy's bool arithmetic is logical (or refused); the tracer refuses it (TypeError)
BOOL_REFUSED = ("add", "sub", "mul", "floordiv", "mod", "minimum", "maximum", "neg", "abs")


PYTHON_INTS = (3, -2, 300, 2 ** 40)
SCALAR_DTYPES = (np.int8, np.uint8, np.int64, np.uint64)
# the second operands: a captured array read at kv_idx, a Python int, a NumPy scalar, kv_idx
PARTNERS = ([f"array-{name(d)}" for d in DTYPES] + [f"python-{v}" for v in PYTHON_INTS]
            + [f"numpy-{name(d)}" for d in SCALAR_DTYPES] + ["index"])


def partner(pid, rng):
    """The operand a PARTNERS id names, with fresh values (None: kv_idx)."""
    kind, _, arg = pid.partition("-")
    if kind == "array":
        return values(rng, np.dtype(arg).type)
    if kind == "python":
        return int(arg)
    if kind == "numpy":
        return np.dtype(arg).type(values(rng, np.dtype(arg).type)[0])
    return None


def reader(a_arr, other, body):
    """A function of *args (a score_mod's or a mask_mod's: q_idx, kv_idx last) giving
    body(args, x, y), x = a_arr[q_idx] and y the partner (other[kv_idx] for an array, kv_idx for
    None, else other itself). The lookups are written here, in the traced function: the tracer
    captures the arrays the function itself names, not those of the functions it calls."""
    if isinstance(other, np.ndarray):
        return lambda *args: body(args, a_arr[args[-2]], other[args[-1]])
    if other is None:
        return lambda *args: body(args, a_arr[args[-2]], args[-1])
    return lambda *args: body(args, a_arr[args[-2]], other)


def numpy_result(op, a_arr, other):
    """What the reference computes: op on every (q_idx, kv_idx) pair; an exception is
    returned, not raised."""
    qi, ki = np.meshgrid(np.arange(S), np.arange(S), indexing="ij")
    try:
        with np.errstate(all="ignore"):
            return np.asarray(reader(a_arr, other, lambda args, x, y: OPS[op](x, y))(qi, ki))
    except (TypeError, OverflowError) as e:
        return e


def term(e, kind, scale=0.25):
    """A small float from an op's result e: its value mod 5 (integers: exact in any type), or
    its truth / sign (bools, floats: the float path's rounding stays out)."""
    if kind in "iu":
        return (e % 5) * scale
    return np.where(e if kind == "b" else e > 0, scale, -scale)


def keep(e, kind):
    """A mask from an op's result e."""
    return e % 3 != 1 if kind in "iu" else e if kind == "b" else e > 0


def cases(dtype, pid, rng):
    """(op, a_arr, other, NumPy's result or its exception) for every op that applies to a
    `dtype` array and this partner."""
    a_arr = values(rng, dtype)
    other = partner(pid, rng)
    for op in OPS:
        if op in UNARY and pid != "array-" + name(dtype):
            continue                  # once per dtype
        if dtype == np.bool_ and op in BOOL_REFUSED and (op in UNARY or pid == "array-bool"):
            continue
        yield op, a_arr, other, numpy_result(op, a_arr, other)


def traced_type(op, a_arr, other):
    """The tracer's type of op's result: its mask_mod's output (a bool) or the value a score_mod
    casts."""
    fn = reader(a_arr, other, lambda args, x, y: OPS[op](x, y))
    try:
        return trace.trace_mask_mod(fn).out.dtype
    except TypeError as e:
        if "must return a bool" not in str(e):
            raise
    out = trace.trace_score_mod(fn).out
    return out.args[0].dtype if out.op == "cast" else out.dtype


# --- the types --------------------------------------------------------------------------------

@pytest.mark.parametrize("pid", PARTNERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_traced_types_are_numpys(dtype, pid, rng):
    """The tracer gives each expression NumPy's type, and refuses (with NumPy's exception type)
    what NumPy refuses: a Python int out of the array's range, & of int64 with uint64."""
    for op, a_arr, other, want in cases(dtype, pid, rng):
        if isinstance(want, Exception):
            with pytest.raises(type(want)):
                traced_type(op, a_arr, other)
            continue
        assert traced_type(op, a_arr, other) == trace.value_dtype(want.dtype), (op, want.dtype)


def test_a_traced_graph_evaluates_as_numpy(rng):
    """trace.evaluate (the backends' definition of the graph) gives NumPy's values and dtype."""
    u8, i16, u64 = values(rng, np.uint8), values(rng, np.int16), values(rng, np.uint64)

    def mask_mod(b, h, qi, ki):
        return ((u8[qi] - u8[ki]) * i16[qi] // (u8[ki] + np.int8(-3))) % 7 < (u64[qi] > qi)

    qi, ki = np.meshgrid(np.arange(S), np.arange(S), indexing="ij")
    with np.errstate(all="ignore"):
        want = mask_mod(0, 0, qi, ki)
        got = trace.evaluate(trace.trace_mask_mod(mask_mod), None, 0, 0, qi, ki)
    assert np.array_equal(got, want)


# --- the CPU against the reference -----------------------------------------------------------

@pytest.mark.parametrize("pid", PARTNERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_cpu_against_the_reference(dtype, pid, rng):
    """Each op as a score_mod and as a mask_mod (forward), then all of them summed in one
    score_mod (forward and backward), on the CPU against the reference."""
    q, k, v = make_qkv(rng, 1, S, S, 2, 1, 8, 8, F64)
    ok = [(op, a_arr, other, r.dtype.kind) for op, a_arr, other, r in cases(dtype, pid, rng)
          if not isinstance(r, Exception)]
    for op, a_arr, other, kind in ok:
        f = OPS[op]
        score_mod = reader(a_arr, other, lambda args, x, y: args[0] + term(f(x, y), kind))
        mask_mod = reader(a_arr, other, lambda args, x, y: keep(f(x, y), kind))
        try:
            check_backend(q, k, v, rng, score_mod=score_mod, backward=False)
            check_backend(q, k, v, rng, mask_mod=mask_mod, backward=False)
        except AssertionError as e:
            raise AssertionError(f"{op}: {e}") from None
    if ok:
        check_backend(q.astype(F32), k.astype(F32), v.astype(F32), rng, score_mod=combined(ok)[0])


def combined(ok):
    """One score_mod adding every op's term and one mask_mod xor-ing every op's mask (for the
    accumulation type float32), over the operands the ops of ok ((op, a_arr, other, kind),
    cases' operands) share."""
    _, a_arr, other, _ = ok[0]
    # a float // or % of integers past 2^24 (int64 with uint64) depends on the float type's
    # rounding: float64 in the reference, float32 here; those run in float64 alone (above)
    terms = [(OPS[op], kind, 0.1 * (i % 3 + 1)) for i, (op, _, _, kind) in enumerate(ok)
             if not (kind == "f" and op in ("floordiv", "mod"))]

    def keeps(args, x, y):
        m = args[-1] == 0                # a traced bool to start from; key 0 stays kept
        for f, kind, _ in terms:
            m = m ^ keep(f(x, y), kind)
        return m | (args[-1] == 0)
    return (reader(a_arr, other, lambda args, x, y: args[0] + sum(term(f(x, y), kind, c) for f, kind, c in terms)),
            reader(a_arr, other, keeps))


def test_a_wrapping_uint8_index_into_a_float_table(rng):
    """tab[u8[q_idx] - u8[kv_idx]] reads the uint8 difference (0..255, never negative): in
    int64 it would count from the end. Its gradient lands on those elements."""
    u8 = values(rng, np.uint8)
    tab = rng.standard_normal(256)
    i8 = values(rng, np.int8)

    def score_mod(s, b, h, qi, ki):
        return s + tab[u8[qi] - u8[ki]] + tab[i8[qi] * i8[ki]]      # int8 product: -128..127

    q, k, v = make_qkv(rng, 2, S, S, 2, 2, 8, 8, F64)
    res = check_backend(q, k, v, rng, score_mod=score_mod)
    assert np.allclose(res.grads.dtensors["tab"], res.ref_grads.dtensors["tab"], atol=1e-9)


# Over a block-mask cell these tables' values run as ramps, whose narrow sums wrap inside some
# cells: an interval of the unwrapped sums would settle cells that hold both kept and masked
# pairs; a uint64 constant past int64 is no interval of its value either (mod_ints.h: mod_iv_fit)
N_RAMP = 320
RAMP_U8 = (np.arange(N_RAMP) % 256).astype(np.uint8)
RAMP_I8 = np.arange(N_RAMP).astype(np.int8)                  # wraps at 128
RAMP_U64 = np.arange(N_RAMP).astype(np.uint64)
RAMP_MASKS = {
    "uint8_sum": lambda b, h, qi, ki: ((RAMP_U8[qi] + np.uint8(100)) < 150) | (ki == qi),
    "int8_sum": lambda b, h, qi, ki: ((RAMP_I8[ki] + np.int8(20)) < 0) | (ki == qi),
    "uint64_constant": lambda b, h, qi, ki: np.where(RAMP_U8[qi] > 250, RAMP_U64[ki], 2 ** 64 - 2) % 3 != 1,
}


@pytest.mark.parametrize("which", sorted(RAMP_MASKS))
def test_block_mask_cells_do_not_trust_a_wrapped_interval(which, rng):
    q, k, v = make_qkv(rng, 1, N_RAMP, N_RAMP, 1, 1, 8, 8, F32)
    check_backend(q, k, v, rng, mask_mod=RAMP_MASKS[which])


BAND_LIKE = {
    "uint64_offset": lambda b, h, qi, ki: ki + np.uint64(0) <= qi,          # float64 in NumPy
    "uint64_bound": lambda b, h, qi, ki: (qi - ki < np.uint64(5)) & (ki <= qi),
    "int8_window": lambda b, h, qi, ki: (qi - ki) * np.int8(1) < 4,          # int64: a band
}


@pytest.mark.parametrize("which", sorted(BAND_LIKE))
def test_mask_mods_through_uint64_are_no_bands(which, rng):
    """A bound on kv_idx - q_idx written through a uint64 scalar is a float or a mixed
    comparison in NumPy, which band.py does not take for a band; with int64 it still does."""
    mask_mod = BAND_LIKE[which]
    split = band.split(trace.trace_mask_mod(mask_mod))
    if which == "int8_window":
        assert split.lo == -3 and split.rest is None
    else:
        assert split.rest is not None
    q, k, v = make_qkv(rng, 1, 40, 40, 1, 1, 8, 8, F32)
    check_backend(q, k, v, rng, mask_mod=mask_mod)


def test_out_of_range_python_int_raises_as_numpy_does(rng):
    u8 = values(rng, np.uint8)
    q, k, v = make_qkv(rng, 1, S, S, 1, 1, 8, 8, F32)

    def score_mod(s, b, h, qi, ki):
        return s + (u8[qi] + 300)

    with pytest.raises(OverflowError):
        reference.attention(q, k, v, score_mod=score_mod)
    with pytest.raises(OverflowError, match="300"):
        attnext.attention(q, k, v, score_mod=score_mod, device="cpu")


# --- the GPU's generated code, built as host C ------------------------------------------------

HOST_PAIRS = [("array-own", "array-own"), ("array-uint64", "python-3"), ("index", "numpy-int8")]


@pytest.mark.parametrize("facts", [False, True], ids=["checked", "facts"])
@pytest.mark.parametrize("pids", HOST_PAIRS, ids=["-".join(p) for p in HOST_PAIRS])
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_generated_code_computes_in_numpys_types(dtype, pids, facts, cc, tmp_path, rng):
    """codegen's score_mod, mask_mod and block-mask cells (mod_ints.h's typed rules) as host C:
    the score and the mask as trace.evaluate (NumPy on the traced types) gives them, and each
    cell's intervals cover its pairs (a wrapped sum is no interval)."""
    from helpers.host_c import bind, build, close, grid, random_cells, run, run_cells, with_facts
    own = "array-" + name(dtype)
    ts, tm = (trace.trace_score_mod(combined(ok)[0]) if i == 0 else trace.trace_mask_mod(combined(ok)[1])
              for i, ok in enumerate(
                  [(op, a, o, r.dtype.kind) for op, a, o, r in cases(dtype, own if p == "array-own" else p, rng)
                   if not isinstance(r, Exception)] for p in pids))
    if facts:
        gen, bound = with_facts(ts, tm)
    else:
        gen = codegen.generate(ts, tm)
        bound = bind(ts, gen, "score_mod") + bind(tm, gen, "mask_mod")
    exe = build(cc, tmp_path, gen)
    pts = grid(rng)
    fwd, _, keeps, err, _ = run(exe, tmp_path, gen, bound, pts, ts.params + tm.params)
    assert err[0] == 0
    with np.errstate(all="ignore"):
        close(fwd, trace.evaluate(ts, *pts[:5]), "score_mod")
        want = np.broadcast_to(trace.evaluate(tm, None, *pts[1:5]), keeps.shape)
    np.testing.assert_array_equal(keeps.astype(bool), want)
    from helpers.host_c import CELL_HARNESS
    cells = random_cells(rng, 300)
    mask_gen = codegen.generate(None, tm)
    exe = build(cc, tmp_path, mask_gen, CELL_HARNESS, folder="cells")
    got, pairs, _ = run_cells(exe, tmp_path, mask_gen, bind(tm, mask_gen, "mask_mod"), cells, tm.params)
    assert ((got & pairs) == pairs).all(), [(c, g, p) for c, g, p in zip(cells, got, pairs) if g & p != p][:5]


@pytest.mark.parametrize("which", sorted(RAMP_MASKS))
def test_generated_cells_do_not_trust_a_wrapped_interval(which, cc, tmp_path):
    """The ramps' 64 x 64 cells by codegen's mod_mask_cell as host C: each covers its pairs, and
    the cells no wrap or edge crosses are settled."""
    from helpers.host_c import BOTH, CELL_HARNESS, bind, build, run_cells
    t = trace.trace_mask_mod(RAMP_MASKS[which])
    gen = codegen.generate(None, t)
    exe = build(cc, tmp_path, gen, CELL_HARNESS)
    cells = [(0, 0, r, min(r + 63, N_RAMP - 1), c, min(c + 63, N_RAMP - 1))
             for r in range(0, N_RAMP, 64) for c in range(0, N_RAMP, 64)]
    got, pairs, _ = run_cells(exe, tmp_path, gen, bind(t, gen, "mask_mod"), cells)
    assert ((got & pairs) == pairs).all(), [(c, g, p) for c, g, p in zip(cells, got, pairs) if g & p != p][:5]
    assert (got != BOTH).any() or which == "uint64_constant"


# --- the GPU -----------------------------------------------------------------------------------
# All ops of a case in one score_mod and one mask_mod, so the compiles stay few.

GPU_PARTNERS = ("array-int16", "array-uint64", "python-3", "numpy-int8", "index")


@pytest.mark.gpu
@pytest.mark.parametrize("pid", GPU_PARTNERS + ("array-own",))
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_gpu_against_the_reference(dtype, pid, rng, torch):
    from helpers.gpu import run_gpu
    pid = "array-" + name(dtype) if pid == "array-own" else pid
    ok = [(op, a_arr, other, r.dtype.kind) for op, a_arr, other, r in cases(dtype, pid, rng)
          if not isinstance(r, Exception)]
    score_mod, mask_mod = combined(ok)
    q, k, v = make_qkv(rng, 1, S, S, 2, 1, 16, 16, np.float16)
    run_gpu(torch, q, k, v, score_mod=score_mod)
    run_gpu(torch, q, k, v, mask_mod=mask_mod)


@pytest.mark.gpu
@pytest.mark.parametrize("which", sorted(RAMP_MASKS))
def test_gpu_block_mask_cells_and_uint8_index(which, rng, torch):
    from helpers.gpu import run_gpu
    tab = rng.standard_normal(256)

    def score_mod(s, b, h, qi, ki):
        return s + tab[RAMP_U8[qi] - RAMP_U8[ki]]

    q, k, v = make_qkv(rng, 1, N_RAMP, N_RAMP, 2, 2, 64, 64, np.float16)
    run_gpu(torch, q, k, v, mask_mod=RAMP_MASKS[which], score_mod=score_mod)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "int64"])
def test_gpu_captured_torch_integer_tensors(dtype, rng, torch):
    """A captured CUDA integer tensor computes in its own dtype too (read through its
    interface; narrow ones widened on the device)."""
    host = values(rng, np.dtype(dtype).type)
    dev = torch.from_numpy(host).cuda()
    q, k, v = make_qkv(rng, 1, S, S, 2, 2, 16, 16, np.float16)
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))

    def sm_dev(s, b, h, qi, ki):
        return s + ((dev[qi] - dev[ki]) * np.int8(3) % 5) * 0.25

    def sm_host(s, b, h, qi, ki):
        return s + ((host[qi] - host[ki]) * np.int8(3) % 5) * 0.25

    out = attnext.attention(tq, tk, tv, score_mod=sm_dev).cpu().numpy()
    assert_close("out", out, reference.attention(q, k, v, score_mod=sm_host), np.float16)


@pytest.mark.parametrize("dtype, pid", [(np.int8, "array-own"), (np.uint64, "array-own"),
                                        (np.uint64, "index")], ids=["int8", "uint64", "uint64-index"])
def test_generated_code_compiles_with_nvrtc(dtype, pid, rng):
    """NVRTC takes the typed rules (mod_ints.h) as the generated code uses them: the block-mask
    kernel, which includes the whole generated header (score_mod, mask_mod, cells)."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    from attnext import _C
    from attnext.cuda import nvrtc, select
    pid = "array-" + name(dtype) if pid == "array-own" else pid
    ok = [(op, a, o, r.dtype.kind) for op, a, o, r in cases(dtype, pid, rng) if not isinstance(r, Exception)]
    score_mod, mask_mod = combined(ok)
    gen = codegen.generate(trace.trace_score_mod(score_mod), trace.trace_mask_mod(mask_mod))
    assert "mod_t" in gen.source
    [spec] = select.block_mask_specs(gen)
    k, d, g = nvrtc.module_of(*spec)
    nvrtc.nvrtc()
    cubin, _ = _C.nvrtc_compile(*nvrtc.compile_args(k, d, "sm_80", g))
    assert b"attn_block_mask" in cubin
