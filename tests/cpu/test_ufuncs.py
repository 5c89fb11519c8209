"""NumPy's elementwise math in score_mod / mask_mod (issue 28, point 5: FlexAttention's `_trig`
score_mods call np.tan): every ufunc the tracer takes, on every backend against the reference.

Each ufunc is applied to the score and to a captured float array, both first mapped into its
domain by smooth functions (DOMAINS), on fresh random data: forward, backward and the array's
gradient (dtensors) on the CPU interpreter (float32, float64), the code generator's C checked
against trace.evaluate on the host and compiled by NVRTC, and on the GPU (`-m gpu`: torch CUDA
tensors in float16 / bfloat16, and NumPy inputs with device="cuda"). Also: integer operands as
NumPy types them, the bool-valued ufuncs on NaN / inf / -0.0, ufuncs inside mask_mods (over
cells the intervals settle and cells they cannot), and the error that names a ufunc still
unsupported.
"""
import math

import numpy as np
import pytest

import attnext
from attnext import _C
from attnext.cuda import nvrtc, select
from attnext.mods import codegen, grad as derivative, interp, trace
from attnext.testing.accuracy import EPS, LOW_FACTOR, compare_grads
from attnext.mods.grad import evaluate_grad
from attnext.mods.trace import evaluate, trace_mask_mod, trace_score_mod
from conftest import (BF16, F16, F32, F64, acc_dtype, assert_close, check_backend, check_dtensors,
                      dtype_id, make_qkv, randn)

from helpers import mods
from helpers.gpu import run_gpu, to_gpu, to_host
from helpers.host_c import bind as bind_arrays
from helpers.host_c import build, close, grid
from helpers.host_c import run as run_host

S, H = mods.S_MAX, mods.H_MAX

# smooth maps of the reals into each function's domain (all written with ops of their own)
DOMAINS = {
    "real": lambda x: x,
    "half": lambda x: 0.5 * x,                       # sinh, cosh, exp ...: outputs of a few units
    "wide": lambda x: 2.5 * x,                       # floor, rint ...: several integers
    "small": lambda x: 0.02 * x,                     # rad2deg: x * 57.3
    "unit": lambda x: 0.9 * np.tanh(x),              # arcsin, arccos, arctanh: (-0.9, 0.9)
    "angle": lambda x: np.tanh(x),                   # tan: inside (-pi/2, pi/2)
    "pos": lambda x: np.exp(0.5 * x),                # log, sqrt, reciprocal, cbrt: (0, inf)
    "above1": lambda x: 1.05 + np.exp(0.5 * x),      # arccosh: (1, inf)
}

# name -> (function, domain of each operand)
UNARY = {
    "tan": (np.tan, "angle"), "arcsin": (np.arcsin, "unit"), "arccos": (np.arccos, "unit"),
    "arctan": (np.arctan, "real"), "sinh": (np.sinh, "half"), "cosh": (np.cosh, "half"),
    "arcsinh": (np.arcsinh, "real"), "arccosh": (np.arccosh, "above1"),
    "arctanh": (np.arctanh, "unit"), "expm1": (np.expm1, "half"), "log1p": (np.log1p, "pos"),
    "log10": (np.log10, "pos"), "cbrt": (np.cbrt, "pos"), "floor": (np.floor, "wide"),
    "ceil": (np.ceil, "wide"), "rint": (np.rint, "wide"), "trunc": (np.trunc, "wide"),
    "square": (np.square, "real"), "reciprocal": (np.reciprocal, "pos"),
    "sign": (np.sign, "real"), "fabs": (np.fabs, "real"), "absolute": (np.absolute, "real"),
    "deg2rad": (np.deg2rad, "real"), "radians": (np.radians, "real"),
    "rad2deg": (np.rad2deg, "small"), "degrees": (np.degrees, "small"),
    "negative": (np.negative, "real"), "positive": (np.positive, "real"),
    "exp": (np.exp, "half"), "exp2": (np.exp2, "half"), "log": (np.log, "pos"),
    "log2": (np.log2, "pos"), "sqrt": (np.sqrt, "pos"), "tanh": (np.tanh, "real"),
    "sin": (np.sin, "real"), "cos": (np.cos, "real"),
    "round": (np.round, "wide"), "round_1": (lambda x: np.round(x, 1), "real"),
    "around_-1": (lambda x: np.around(x, decimals=-1), "small"),
}
BINARY = {
    "arctan2": (np.arctan2, "real", "real"), "hypot": (np.hypot, "real", "real"),
    "copysign": (np.copysign, "real", "real"), "fmin": (np.fmin, "real", "real"),
    "fmax": (np.fmax, "real", "real"), "logaddexp": (np.logaddexp, "real", "real"),
    "logaddexp2": (np.logaddexp2, "real", "real"), "power": (np.power, "pos", "half"),
    "float_power": (np.float_power, "pos", "half"), "minimum": (np.minimum, "real", "real"),
    "maximum": (np.maximum, "real", "real"),
    "clip": (lambda x, hi: np.clip(x, -0.5, hi), "real", "real"),
    "clip_none": (lambda x, lo: np.clip(x, lo, None), "real", "real"),
}
ALL = sorted(UNARY) + sorted(BINARY)
# what the GPU renders by a float function of the C library (tanf): the CUDA tests' subset of
# ALL, each once (the others are the same ops written with these, or old ones)
GPU = sorted(set(ALL) - {"absolute", "negative", "positive", "radians", "degrees", "minimum",
                         "maximum", "exp", "exp2", "log", "log2", "sqrt", "tanh", "sin", "cos"})


def score_mod_of(name, table):
    """A score_mod applying ufunc `name` to the score and to table[h, q_idx - kv_idx + S] (a
    captured float array, so its gradient is a dtensor), each mapped into the domain."""
    if name in UNARY:
        f, dom = UNARY[name]
        dom = DOMAINS[dom]

        def score_mod(score, b, h, q_idx, kv_idx):
            return f(dom(score)) + 0.5 * f(dom(table[h, q_idx - kv_idx + S]))
        return score_mod
    f, d1, d2 = BINARY[name]
    d1, d2 = DOMAINS[d1], DOMAINS[d2]

    def score_mod(score, b, h, q_idx, kv_idx):
        t = table[h, q_idx - kv_idx + S]
        return f(d1(score), d2(t)) + 0.5 * f(d1(t), d2(score))
    return score_mod


def int_operands(score, b, h, q_idx, kv_idx):
    """The ufuncs on int64 operands: float results where NumPy gives floats (np.arctan(int64) is
    float64), integers where it keeps them (sign, fmin, square; floor in NumPy >= 2.3)."""
    d = q_idx - kv_idx
    floats = (np.arctan(d) + np.cbrt(d) + np.hypot(q_idx, kv_idx) * 0.1 + np.copysign(1, d)
              + np.logaddexp(q_idx, kv_idx) * 0.1 + np.deg2rad(d) + np.float_power(q_idx + 1, 0.5)
              + np.rint(d) * 0.01 + np.arctan2(d, 3))
    ints = np.sign(d) + np.fmin(q_idx, kv_idx) - np.fmax(q_idx, 3) + np.square(d) // 7 + np.floor(d)
    flags = np.where(np.signbit(d) | np.isnan(d) | np.isinf(d), 1.0, 0.0) + np.isfinite(d)
    return score + 0.1 * floats + 0.05 * ints + 0.2 * flags


SPECIALS = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0])


def special_table(rng):
    """A (H, 2S + 1) table of normal values with NaN, +-inf and signed zeros among them."""
    t = rng.standard_normal((H, 2 * S + 1))
    spots = rng.choice(t.size, 20, replace=False)
    t.flat[spots] = SPECIALS[np.arange(20) % SPECIALS.size]
    return t


def special_mod(table):
    """isnan, isinf, isfinite and signbit of values that have them; the result stays finite."""
    def score_mod(score, b, h, q_idx, kv_idx):
        t = table[h, q_idx - kv_idx + S]
        return (score + np.where(np.isnan(t), -1.0, 0.0) + np.where(np.isinf(t), 0.5, 0.0)
                + np.where(np.isfinite(t), t, 0.25) + np.where(np.signbit(t), 0.3, -0.3)
                + np.fmin(score, np.abs(t)) * 0.5 + np.fmax(-np.abs(t), score) * 0.25)
    return score_mod


def mask_mods_of(table):
    """mask_mods through ufuncs: on a captured float array (its cells cannot be settled by
    intervals), on the indices as floats, and on integers written with the int ops (sign, fmin:
    intervals settle their cells)."""
    return {
        "tan_table": lambda b, h, q_idx, kv_idx: np.tan(np.clip(table[h, kv_idx], -1.2, 1.2)) < 0.5,
        "arctan2": lambda b, h, q_idx, kv_idx: np.arctan2(q_idx - kv_idx, 7) > -0.3,
        "floor_blocks": lambda b, h, q_idx, kv_idx: np.floor(q_idx / 24) >= np.floor(kv_idx / 24),
        "sign_causal": lambda b, h, q_idx, kv_idx: np.sign(q_idx - kv_idx) >= 0,
        "fmin_fmax": lambda b, h, q_idx, kv_idx: np.fmin(q_idx, kv_idx) + 40 > np.fmax(q_idx, kv_idx),
        "isfinite": lambda b, h, q_idx, kv_idx: np.isfinite(table[h, kv_idx]) | (q_idx == kv_idx),
    }


def mask_table(rng):
    """A (H, 150) table of normal values with NaN and +-inf among them (for isfinite)."""
    t = rng.standard_normal((H, 150))
    t.flat[rng.choice(t.size, 60, replace=False)] = SPECIALS[np.arange(60) % 3]
    return t


# --- the tracer: dtypes and the derivative, against NumPy itself ------------------------------

def _pairs(rng, n=400):
    idx = [rng.integers(0, top, n) for top in (2, H, S, S)]
    return rng.standard_normal(n) * 1.5, *idx


@pytest.mark.parametrize("name", ALL)
def test_evaluate_and_derivative_match_numpy(name, rng):
    """trace.evaluate is the ufunc in float64; its symbolic derivative (score and table) is
    NumPy's central difference away from the kinks and jumps random data never meets."""
    table = rng.standard_normal((H, 2 * S + 1))
    fn = score_mod_of(name, table)
    score, b, h, q, k = _pairs(rng)
    t = trace_score_mod(fn)
    np.testing.assert_allclose(evaluate(t, score, b, h, q, k, float_dtype=np.float64),
                               fn(score, b, h, q, k), rtol=1e-13, atol=1e-13)
    dout = rng.standard_normal(score.size)
    d_score, d_arrays = evaluate_grad(t, derivative.grad(t), score, b, h, q, k, dout,
                                      float_dtype=np.float64)
    eps = 1e-6
    fd = (fn(score + eps, b, h, q, k) - fn(score - eps, b, h, q, k)) / (2 * eps)
    np.testing.assert_allclose(d_score, dout * fd, rtol=1e-5, atol=1e-5)
    want = np.zeros_like(table)
    for e in range(table.size):
        hi, lo = table.copy(), table.copy()
        hi.flat[e] += eps
        lo.flat[e] -= eps
        want.flat[e] = np.sum(dout * (score_mod_of(name, hi)(score, b, h, q, k)
                                      - score_mod_of(name, lo)(score, b, h, q, k))) / (2 * eps)
    got = d_arrays.get("table", np.zeros_like(table))     # none where no path reaches the score
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_integer_operands_take_numpys_dtypes(rng):
    """np.tan(int64) computes in float; floor / ceil / trunc give an integer back where the
    installed NumPy does, sign / fmin / square stay integers; the whole matches NumPy."""
    seen = {}

    def probe(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        for name, v in (("tan", np.tan(d)), ("floor", np.floor(d)), ("trunc", np.trunc(d)),
                        ("rint", np.rint(d)), ("sign", np.sign(d)), ("fmin", np.fmin(q_idx, 3)),
                        ("square", np.square(d)), ("isnan", np.isnan(d)),
                        ("signbit", np.signbit(d)), ("hypot", np.hypot(d, 1))):
            seen[name] = v.node.dtype
        return score
    trace_score_mod(probe)
    d = np.arange(-3, 4)
    for name, dt in seen.items():
        got = getattr(np, name)(d) if name not in ("fmin", "hypot") else getattr(np, name)(d, 3)
        kind = {trace.F: "f", trace.I: "iu", trace.B: "b"}[dt]
        assert got.dtype.kind in kind, (name, dt, got.dtype)
    score, b, h, q, k = _pairs(rng)
    t = trace_score_mod(int_operands)
    np.testing.assert_allclose(evaluate(t, score, b, h, q, k, float_dtype=np.float64),
                               int_operands(score, b, h, q, k), rtol=1e-13)


def test_logaddexp_at_ties_and_infinities():
    """Equal operands (and equal infinities) give a + log(2) as NumPy's, and a derivative of 1/2
    to each operand, not 1 to one of them."""
    t = trace_score_mod(lambda s, b, h, q, k: np.logaddexp(s, 2 * s - 1.0))
    s = np.array([1.0, -np.inf, np.inf, 0.3, -40.0])
    z = np.zeros(5, np.int64)
    want = np.logaddexp(s, 2 * s - 1.0)
    np.testing.assert_array_equal(evaluate(t, s, z, z, z, z, float_dtype=np.float64), want)
    d, _ = evaluate_grad(t, derivative.grad(t), s[:1], z[:1], z[:1], z[:1], z[:1], np.ones(1),
                         float_dtype=np.float64)
    assert d[0] == pytest.approx(0.5 + 2 * 0.5)       # s == 2 s - 1 at s = 1


def test_clip_none_and_round_decimals_follow_numpy(rng):
    s = rng.standard_normal(50) * 30
    z = np.zeros(50, np.int64)
    for fn in (lambda s, b, h, q, k: np.clip(s, None, 0.5), lambda s, b, h, q, k: np.clip(s, -1.0, None),
               lambda s, b, h, q, k: np.round(s, 2), lambda s, b, h, q, k: np.around(s, -1),
               lambda s, b, h, q, k: np.round(q, 1) + s):
        np.testing.assert_array_equal(evaluate(trace_score_mod(fn), s, z, z, z, z, float_dtype=np.float64),
                                      fn(s, z, z, z, z))


@pytest.mark.parametrize("fn, match", [
    (lambda s, b, h, q, k: np.spacing(s), r"^score_mod: unsupported operation np.spacing on a "
                                          r"traced value \(supported: .*arctan2.*\btan\b"),
    (lambda s, b, h, q, k: np.nextafter(s, 1.0), r"unsupported operation np.nextafter"),
    (lambda s, b, h, q, k: np.ldexp(s, 2), r"unsupported operation np.ldexp"),
    (lambda s, b, h, q, k: np.arctan2.outer(s, s), r"np.arctan2.outer on a traced value"),
    (lambda s, b, h, q, k: np.tan(s, dtype=np.float32), r"np.tan with keyword arguments \['dtype'\]"),
    (lambda s, b, h, q, k: s + np.reciprocal(q), r"np.reciprocal of an integer value"),
    (lambda s, b, h, q, k: s + np.sign(q > k), r"np.sign on bool values"),
    (lambda s, b, h, q, k: math.tan(s), r"math.\* functions call it\): use the NumPy ufunc"),
    (lambda s, b, h, q, k: math.floor(s), r"math.floor\(\) of a traced value score .*use np.floor"),
    (lambda s, b, h, q, k: round(s), r"round\(\) of a traced value .*use np.round"),
    (lambda s, b, h, q, k: np.round(s, 0.5), r"np.round: decimals must be an int"),
    (lambda s, b, h, q, k: np.clip(s, None, None), r"np.clip on traced values needs"),
])
def test_unsupported_ufuncs_are_named(fn, match):
    with pytest.raises(TypeError, match=match):
        trace_score_mod(fn)


def test_unsupported_ufunc_is_refused_by_every_entry_point(rng):
    q, k, v = make_qkv(rng, 1, 5, 7, 2, 2, 8, 8, F32)
    for device in ("cpu", "reference"):
        with pytest.raises(TypeError, match=r"^score_mod: unsupported operation np.spacing"):
            attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: np.spacing(s), device=device)


# --- the CPU backend (its interpreter) against the reference -------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("name", ALL)
def test_score_mod_cpu(name, dtype, rng):
    fn = score_mod_of(name, rng.standard_normal((H, 2 * S + 1)))
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 8, 6, dtype)
    res = check_backend(q, k, v, rng, score_mod=fn)
    check_dtensors(res, fn, dtype)


@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_integer_operands_cpu(dtype, rng):
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 8, 6, dtype)
    check_backend(q, k, v, rng, score_mod=int_operands)


def check_special_dtensors(g, rg, table, dtype):
    """The gradient of special_table: 0 at its NaN and +-inf elements (the score does not move
    with them), the reference's elsewhere. Where the reference has no answer, it is left out:
    its difference quotient is NaN at a non-finite element (x + h and x - h are not numbers
    apart) and straddles signbit's jump at +-0."""
    got, want = g.dtensors["table"], rg.dtensors["table"]
    assert np.isfinite(got).all() and (got[~np.isfinite(table)] == 0).all()
    ordinary = np.isfinite(table) & (table != 0)
    floor = max(float(np.abs(x).max()) for x in rg[:3])
    extra = None
    if dtype in (F16, BF16):    # the GPU's out rounded to q's dtype moves every dS (run_gpu's rule)
        largest = float(np.abs(want[ordinary]).max())
        extra = lambda: LOW_FACTOR * 0.5 * EPS[np.dtype(dtype)] * largest    # noqa: E731
    assert_close("dtensors['table']", got[ordinary], want[ordinary], acc_dtype(dtype), floor, extra)


@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_nan_inf_and_signed_zeros_cpu(dtype, rng):
    table = special_table(rng)
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 8, 6, dtype)
    res = check_backend(q, k, v, rng, score_mod=special_mod(table))
    check_special_dtensors(res.grads, res.ref_grads, table, dtype)


@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("name", sorted(mask_mods_of(None)))
def test_mask_mod_cpu(name, dtype, rng):
    """Over 150 x 150 pairs: cells that the intervals settle (sign, fmin on integers) and cells
    evaluated pair by pair (a float ufunc is unknown over a cell)."""
    fn = mask_mods_of(mask_table(rng))[name]
    q, k, v = make_qkv(rng, 1, 150, 150, H, 2, 8, 8, dtype)
    check_backend(q, k, v, rng, mask_mod=fn)


def test_every_float_function_has_an_instruction_and_a_rendering():
    """trace's tables are the one list: the interpreter has an instruction of each name
    (csrc/interp/interp.h INTERP_LIBM1 / 2), the code generator a C call, every one a derivative."""
    ops = set(trace._UNARY_FLOAT) | set(trace._BINARY_FLOAT)
    assert ops <= set(interp.OPS), ops - set(interp.OPS)
    assert ops <= set(codegen._FLOAT_OPS), ops - set(codegen._FLOAT_OPS)
    old = {"exp", "exp2", "log", "log2", "sqrt", "tanh", "sin", "cos"}    # grad()'s own branches
    assert ops - old == set(derivative._LOCAL), (ops - old) ^ set(derivative._LOCAL)


# --- the CUDA code generator, without a GPU -----------------------------------------------------

@pytest.mark.parametrize("name", GPU + ["int_operands"])
def test_generated_code_matches_evaluate(name, cc, tmp_path, rng):
    """The generated C (the host compiler, attn_mods.cuh as plain C) against trace.evaluate in
    float32 and its derivative, table gradient included, in float64."""
    fn = int_operands if name == "int_operands" else score_mod_of(name, rng.standard_normal((H, 2 * S + 1)))
    t = trace_score_mod(fn)
    gen = codegen.generate(t)
    exe = build(cc, tmp_path, gen)
    pts = grid(rng)
    fwd, dscore, _, err, grads = run_host(exe, tmp_path, gen, bind_arrays(t, gen, "score_mod"), pts,
                                          t.params)
    assert err[0] == 0
    with np.errstate(all="ignore"):
        want = evaluate(t, *pts[:5])
        g = derivative.grad(t)
        want_ds, want_arrays = evaluate_grad(t, g, *pts, float_dtype=np.float64)
    close(fwd, want, "forward", rtol=1e-4, atol=1e-4)
    close(dscore, want_ds, "d score", rtol=1e-4, atol=1e-4)
    for i, got in grads.items():
        w = want_arrays[gen.arrays[i][1]]
        close(got, w, "d table", atol=1e-4 * max(1.0, float(np.abs(w).max())))


def test_nvrtc_compiles_every_op(rng):
    """NVRTC has every float function the generator calls without a header: a mask_mod reading
    all of them (and the derivatives' own) compiled into the block-mask kernel, for sm_80 and
    sm_90a."""
    import os
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    table = rng.standard_normal((H, 2 * S + 1)).astype(np.float32)

    def mask_mod(b, h, q_idx, kv_idx):
        t = table[h, q_idx - kv_idx + S]
        total = (sum(f(t) for f, _ in UNARY.values())
                 + sum(f(t, q_idx - kv_idx) for f, _, _ in BINARY.values()))
        return (total > 0) | np.isnan(t)
    gen = codegen.generate(None, trace_mask_mod(mask_mod))
    for op in set(trace._UNARY_FLOAT) | set(trace._BINARY_FLOAT):
        assert codegen._FLOAT_OPS[op].split("(")[0] in gen.source, op
    [spec] = select.block_mask_specs(gen)
    k, d, g = nvrtc.module_of(*spec)
    nvrtc.nvrtc()
    for arch in ("sm_80", "sm_90a"):
        cubin, _ = _C.nvrtc_compile(*nvrtc.compile_args(k, d, arch, g))
        assert b"attn_block_mask" in cubin, arch


# --- the GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", GPU)
def test_score_mod_cuda(name, dtype, rng, torch):
    """The generated kernels on torch CUDA tensors: forward, backward and the table's gradient."""
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 64, 64, dtype)
    run_gpu(torch, q, k, v, score_mod=score_mod_of(name, rng.standard_normal((H, 2 * S + 1))))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_integer_operands_and_specials_cuda(dtype, rng, torch):
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 64, 64, dtype)
    run_gpu(torch, q, k, v, score_mod=int_operands)
    table = special_table(rng)
    fn = special_mod(table)
    run_gpu(torch, q, k, v, score_mod=fn, backward=False)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    out, lse = attnext.attention(tq, tk, tv, score_mod=fn, return_lse=True)
    dout = randn(rng, q.shape, dtype)
    g = attnext.attention_backward(to_gpu(torch, dout), tq, tk, tv, out, lse, score_mod=fn)
    host = type(g)(*(to_host(torch, x) for x in g[:4]), g.dtensors)
    out, lse = to_host(torch, out), to_host(torch, lse)
    rg = attnext.reference.attention_backward(dout, q, k, v, out, lse, score_mod=fn)
    r_out = attnext.reference.attention(q, k, v, score_mod=fn)
    problems = compare_grads(host, rg, q, k, v, dout, out, r_out, None, dict(score_mod=fn))
    assert not problems, "\n".join(problems)
    check_special_dtensors(host, rg, table, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("c", [30.0, -7.5, 0.05, 3e30, 1e38], ids=["30", "neg", "small", "huge", "scaled"])
def test_division_cuda(c, dtype, rng, torch):
    """The generated code's division (attn_mods.cuh: mod_fdiv, by a reciprocal and one FMA step)
    against the reference, forward and backward: by a captured constant (scores from 1e-30 to
    about 100), by a table's elements of either sign, and into a constant by an index; and a
    quotient only np.tanh reads (mod_fdiv_tanh, by the reciprocal alone; 1e38, 1e-38 and the
    subnormal 3e-39 take its scaling)."""
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 64, 64, dtype)
    table = (rng.uniform(0.5, 4.0, (H, S)) * rng.choice([-1.0, 1.0], (H, S))).astype(np.float32)
    run_gpu(torch, q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s / c)
    run_gpu(torch, q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s / table[h, kv_idx] + 1.0 / (1 + kv_idx))
    run_gpu(torch, q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: c * np.tanh(s / c) + np.tanh(s / table[h, kv_idx])
            + np.tanh(s / 1e-38) + np.tanh(s / 3e-39))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(mask_mods_of(None)))
def test_mask_mod_cuda(name, rng, torch):
    """The generated mask and its cells (mod_mask_cell) over 150 x 150 pairs."""
    q, k, v = make_qkv(rng, 1, 150, 150, H, 2, 64, 64, BF16)
    run_gpu(torch, q, k, v, mask_mod=mask_mods_of(mask_table(rng))[name])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tan", "arctan2", "logaddexp", "floor", "fmin"])
def test_numpy_inputs_on_cuda(name, rng, gpu):
    """NumPy inputs with device="cuda" (attnext runs their mods where README says), against the
    reference, forward and backward."""
    fn = score_mod_of(name, rng.standard_normal((H, 2 * S + 1)))
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 64, 64, BF16)
    out, lse = attnext.attention(q, k, v, score_mod=fn, device="cuda", return_lse=True)
    r_out, r_lse = attnext.reference.attention(q, k, v, score_mod=fn, return_lse=True)
    assert_close("out", out, r_out, BF16)
    assert_close("lse", lse, r_lse, lse.dtype)
    dout = randn(rng, out.shape, BF16)
    g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=fn, device="cuda")
    rg = attnext.reference.attention_backward(dout, q, k, v, out, lse, score_mod=fn)
    problems = compare_grads(g, rg, q, k, v, dout, out, r_out, None, dict(score_mod=fn))
    assert not problems, "\n".join(problems)
