"""attnext.mods.trace: tracing score_mod / mask_mod, evaluating the graph, its symbolic derivative and
its cache key. CPU only, fast.

Every mod of helpers/mods.py is checked against itself called on NumPy arrays (its NumPy twin),
in float64 (to 1e-12) and in float32 (to float32 round-off); every score_mod's derivative against
central differences in float64, for the score and every captured float array.
"""
import gc
from collections import namedtuple

import math

import numpy as np
import pytest

from helpers import mods
from attnext.mods import band, trace
from attnext.mods.grad import evaluate_grad, grad
from attnext.mods.trace import evaluate, trace_mask_mod, trace_score_mod

SCORE_MODS = mods.score_mods()
MASK_MODS = mods.mask_mods()


def _pairs(rng, n_batch=2, n_heads=mods.H_MAX, s=mods.S_MAX):
    """Flat int64 (b, h, q_idx, kv_idx) of every pair and a float64 score for each."""
    b, h, q, k = (x.ravel().astype(np.int64) for x in
                  np.meshgrid(np.arange(n_batch), np.arange(n_heads), np.arange(s), np.arange(s),
                              indexing="ij"))
    return rng.standard_normal(b.size) * 2, b, h, q, k


@pytest.fixture
def pairs():
    return _pairs(np.random.default_rng(0))


def _direct(fn, score, *idx):
    return np.broadcast_to(np.asarray(fn(score, *idx), dtype=np.float64), score.shape)


# --- evaluate() against the function itself ---------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_evaluate_matches_numpy(name, pairs):
    fn = SCORE_MODS[name]
    score, *idx = pairs
    tr = trace_score_mod(fn)
    want = _direct(fn, score, *idx)
    got64 = np.broadcast_to(evaluate(tr, score, *idx, float_dtype=np.float64), score.shape)
    np.testing.assert_allclose(got64, want, rtol=1e-12, atol=1e-12)
    got32 = evaluate(tr, score.astype(np.float32), *idx)
    assert got32.dtype == np.float32
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.broadcast_to(got32, score.shape), want, rtol=1e-5,
                               atol=1e-5 * scale)


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_evaluate_matches_numpy(name, pairs):
    fn = MASK_MODS[name]
    _, *idx = pairs
    tr = trace_mask_mod(fn)
    got = evaluate(tr, None, *idx)
    assert got.dtype == np.bool_
    want = np.broadcast_to(np.asarray(fn(*idx), dtype=bool), idx[0].shape)
    np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_evaluate_broadcasts_and_reads_arrays_afresh():
    table = np.arange(12.0).reshape(3, 4)
    tr = trace_score_mod(lambda s, b, h, q, k: s + table[h, q - k])   # q - k < 0: from the end
    q, k = np.arange(4)[:, None], np.arange(4)[None, :]
    got = evaluate(tr, np.zeros((4, 4)), 0, 2, q, k, float_dtype=np.float64)
    np.testing.assert_array_equal(got, table[2, q - k])
    table[2] += 100   # the trace holds the array itself, not a copy of its values
    np.testing.assert_array_equal(evaluate(tr, 0.0, 0, 2, q, k, float_dtype=np.float64),
                                  table[2, q - k])
    other = np.ones((3, 4))
    np.testing.assert_array_equal(evaluate(tr, 0.0, 0, 2, q, k, arrays={"table": other}), 1.0)


def test_params_replace_float_constants():
    tr = trace_score_mod(lambda s, b, h, q, k: 30.0 * np.tanh(s / 30.0))
    assert tr.params == (30.0, 30.0)
    s = np.linspace(-5, 5, 11)
    got = evaluate(tr, s, 0, 0, 0, 0, params=(2.0, 2.0), float_dtype=np.float64)
    np.testing.assert_allclose(got, 2.0 * np.tanh(s / 2.0), rtol=1e-15)


def test_hash_consing_shares_a_lookup_used_twice():
    table = np.ones((4, 8))
    tr = trace_score_mod(lambda s, b, h, q, k: table[h, q] * s + table[h, q])
    loads = [n for n in trace.topo(tr.out) if n.op == "load"]
    assert len(loads) == 1
    with pytest.raises(AttributeError):
        tr.out.op = "sub"


# --- the derivative against central differences ----------------------------------------------

def _fd_arrays(fn, tr, score, idx, dout, step=1e-6):
    """d sum(dout * f) / d array[i] for every element of every captured float array."""
    grads = {}
    for name, arr in tr.arrays.items():
        if not np.issubdtype(arr.dtype, np.floating):
            continue
        base = np.asarray(arr, dtype=np.float64)
        d = np.zeros(base.shape)
        for i in np.ndindex(base.shape):
            hi, lo = base.copy(), base.copy()
            hi[i] += step
            lo[i] -= step
            f = [evaluate(tr, score, *idx, arrays={name: x}, float_dtype=np.float64)
                 for x in (hi, lo)]
            d[i] = np.sum(dout * (f[0] - f[1])) / (2 * step)
        grads[name] = d
    return grads


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_grad_matches_central_differences(name):
    rng = np.random.default_rng(1)
    score, *idx = _pairs(rng, n_batch=2, n_heads=mods.H_MAX, s=6)
    fn = SCORE_MODS[name]
    tr = trace_score_mod(fn)
    g = grad(tr)
    dout = rng.standard_normal(score.shape)
    d_score, d_arrays = evaluate_grad(tr, g, score, *idx, dout, float_dtype=np.float64)

    step = 1e-6
    fd = (_direct(fn, score + step, *idx) - _direct(fn, score - step, *idx)) / (2 * step) * dout
    np.testing.assert_allclose(d_score, fd, rtol=1e-6, atol=1e-7)

    fd_arrays = _fd_arrays(fn, tr, score, idx, dout)
    float_arrays = {n for n, a in tr.arrays.items() if np.issubdtype(a.dtype, np.floating)}
    assert set(d_arrays) <= float_arrays
    for n in float_arrays:
        got = d_arrays.get(n, np.zeros(tr.arrays[n].shape))
        np.testing.assert_allclose(got, fd_arrays[n], rtol=1e-6, atol=1e-6, err_msg=n)


def test_grad_of_an_array_indexed_twice_at_one_element():
    t = np.array([[0.5, -1.5, 2.0]])
    tr = trace_score_mod(lambda s, b, h, q, k: t[0, q] * t[0, k] * s)
    d_score, d = evaluate_grad(tr, grad(tr), np.array([2.0]), 0, 0, np.array([1]), np.array([1]),
                               np.array([1.0]), float_dtype=np.float64)
    np.testing.assert_allclose(d["t"], [[0.0, 2 * 2.0 * -1.5, 0.0]])   # d(x^2 s)/dx = 2 x s
    np.testing.assert_allclose(d_score, [(-1.5) ** 2])


def test_grad_where_does_not_leak_nan_from_the_unchosen_branch():
    tr = trace_score_mod(lambda s, b, h, q, k: np.where(s > 0, np.log(s), s))
    s = np.array([-1.0, 0.0, 2.0])
    d_score, _ = evaluate_grad(tr, grad(tr), s, 0, 0, 0, 0, np.ones(3), float_dtype=np.float64)
    np.testing.assert_array_equal(d_score, [1.0, 1.0, 0.5])


def test_grad_ties_and_kinks():
    s = np.array([0.0, 1.0])
    for fn, want in [(lambda s, b, h, q, k: np.minimum(s, 1.0), [1.0, 1.0]),   # ties: 1st
                     (lambda s, b, h, q, k: np.maximum(1.0, s), [0.0, 0.0]),
                     (lambda s, b, h, q, k: abs(s), [0.0, 1.0]),
                     (lambda s, b, h, q, k: s // 0.5 + s % 0.75, [1.0, 1.0])]:
        tr = trace_score_mod(fn)
        d, _ = evaluate_grad(tr, grad(tr), s, 0, 0, 0, 0, np.ones(2), float_dtype=np.float64)
        np.testing.assert_array_equal(d, want)


def test_integer_subgraphs_and_constant_outputs_have_no_gradient():
    tr = trace_score_mod(lambda s, b, h, q, k: (q - k) * 0.5)
    g = grad(tr)
    assert g.dscore.op == "fconst" and g.darrays == {}
    tr = trace_score_mod(lambda s, b, h, q, k: 1.5)
    assert tr.params == (1.5,)
    np.testing.assert_array_equal(evaluate(tr, np.zeros(3), 0, 0, 0, 0), 1.5)
    with pytest.raises(TypeError, match="mask_mod"):
        grad(trace_mask_mod(mods.causal))


# --- errors ----------------------------------------------------------------------------------

def _if_score(s, b, h, q, k):
    if s > 0:
        return s
    return -s


@pytest.mark.parametrize("fn, match", [
    (_if_score, r"Python control flow.*bool\(\(score > "),
    (lambda s, b, h, q, k: s if q > k else 0.0, "Python control flow"),
    (lambda s, b, h, q, k: s + int(q_idx_of(q)), r"int\(\) of a traced value"),
    (lambda s, b, h, q, k: float(s) * 2, r"float\(\) of a traced value"),
    (lambda s, b, h, q, k: min(s, 1.0), "Python control flow"),
    (lambda s, b, h, q, k: (s > 0) and s, "Python control flow"),
    (lambda s, b, h, q, k: np.spacing(s), "unsupported operation np.spacing"),
    (lambda s, b, h, q, k: np.nextafter(s, 1.0), "unsupported operation np.nextafter"),
    (lambda s, b, h, q, k: np.add.reduce(s), r"np.add.reduce"),
    (lambda s, b, h, q, k: s & 1, "& on a float value"),
    (lambda s, b, h, q, k: q ** k, "integer power"),
    (lambda s, b, h, q, k: s + np.arange(3)[q], "not captured by name"),
    (lambda s, b, h, q, k: s + np.ones(3), "not captured by name"),
    (lambda s, b, h, q, k: None, "must return a float expression, got NoneType"),
    (lambda s, b, h, q, k: q >= k, "score_mod returned a bool"),
    (lambda s, b, h, q, k: (s, s), "must return a float expression, got tuple"),
])
def test_score_mod_errors(fn, match):
    with pytest.raises(TypeError, match=match):
        trace_score_mod(fn)


def q_idx_of(q):
    return q


LIST = [1.0, 2.0, 3.0]
TABLE = np.zeros((2, 3))


@pytest.mark.parametrize("fn, match", [
    (lambda b, h, q, k: q - k, "must return a bool expression, got a i64 expression"),
    (lambda b, h, q, k: 1, "must return a bool expression, got int"),
    (lambda b, h, q, k: LIST[q] > 0, "used as a Python index"),        # a captured list
    (lambda b, h, q, k: TABLE[h, 0.5] > 0, "indexed by 0.5"),
    (lambda b, h, q, k: TABLE[h, 1:] > 0, "indexed by slice"),
    (lambda b, h, q, k: TABLE[h, q > k] > 0, "indexed by a bool expression"),
    (lambda b, h, q, k: TABLE > 0, "without indexing"),
    (lambda b, h, q, k: TABLE[h] > 0, r"indexed by 1 of its 2 axes"),
    (lambda b, h, q, k: TABLE[h][q] > 0, r"indexed by 1 of its 2 axes"),
    (lambda b, h, q, k: TABLE.T[h, q] > 0, "'TABLE'"),
    (lambda b, h, q, k: bool(q > k), "Python control flow"),
])
def test_mask_mod_errors(fn, match):
    with pytest.raises(TypeError, match=match):
        trace_mask_mod(fn)


def test_constant_index_out_of_range_at_trace_time():
    with pytest.raises(IndexError, match="'TABLE'"):
        trace_mask_mod(lambda b, h, q, k: TABLE[h, 3] > 0)
    with pytest.raises(IndexError, match="too many indices for array 'TABLE'"):
        trace_mask_mod(lambda b, h, q, k: TABLE[h, q, k] > 0)


def test_lookup_out_of_range_raises_index_error_naming_the_array():
    table = np.zeros((4, 8))
    tr = trace_score_mod(lambda s, b, h, q, k: s + table[h, q - k + 4])
    q = np.arange(8)
    evaluate(tr, np.zeros(8), 0, 1, q, q)                     # q - k + 4 = 4: fine
    evaluate(tr, np.zeros(8), 0, 1, q, np.full(8, 7))         # down to -3: from the end
    with pytest.raises(IndexError, match=r"index 8 is out of bounds for axis 1 of array 'table' "
                                         r"with size 8"):
        evaluate(tr, np.zeros(8), 0, 1, q, np.full(8, 0))
    with pytest.raises(IndexError, match=r"index -9 .* array 'table'"):
        evaluate(tr, np.zeros(8), 0, 1, np.zeros(8, np.int64), np.full(8, 13))
    with pytest.raises(IndexError, match="array 'table'"):
        evaluate_grad(tr, grad(tr), np.zeros(8), 0, 1, q, np.zeros(8, np.int64), np.ones(8))


def test_two_arrays_under_one_name():
    def make():
        table = np.zeros(3)
        return lambda s, b, h, q, k: s + table[q] + TABLE2[q]

    global TABLE2
    TABLE2 = np.zeros(3)
    tr = trace_score_mod(make())
    assert set(tr.arrays) == {"table", "TABLE2"}


# --- cache keys ------------------------------------------------------------------------------

def test_keys():
    key = lambda fn: trace_score_mod(fn).key                               # noqa: E731
    assert key(lambda s, b, h, q, k: s * 2) != key(lambda s, b, h, q, k: s + 2)
    assert key(lambda s, b, h, q, k: s * 2) != key(lambda s, b, h, q, k: s * 3)   # int: structure
    assert key(mods.softcap(1.0)) == key(mods.softcap(50.0))              # float: a parameter
    assert key(lambda s, b, h, q, k: s * 2.0) == key(lambda s, b, h, q, k: s * 3.5)
    t1, t2 = np.ones((4, 33)), np.zeros((4, 33))
    assert key(mods.rel_bias(t1)) == key(mods.rel_bias(t2))              # values do not matter
    assert key(mods.rel_bias(t1)) == key(mods.rel_bias_global)            # nor names
    assert key(mods.rel_bias(t1)) != key(mods.rel_bias(np.ones((4, 34))))  # shapes do
    assert key(mods.rel_bias(t1)) != key(mods.rel_bias(t1.astype(np.float32)))   # dtypes too
    mkey = lambda fn: trace_mask_mod(fn).key                               # noqa: E731
    assert mkey(mods.sliding_window(3)) == mkey(mods.sliding_window(3))
    assert mkey(mods.sliding_window(3)) != mkey(mods.sliding_window(4))   # an int closure


def test_same_function_defined_twice_shares_a_key():
    def make():
        def mod(score, b, h, q_idx, kv_idx):
            return np.where(q_idx >= kv_idx, score * 0.5, -np.inf)
        return mod
    a, b = make(), make()
    assert a is not b
    assert trace_score_mod(a).key == trace_score_mod(b).key
    m1 = trace_mask_mod(mods.document_causal(mods.DOC_ID))
    m2 = trace_mask_mod(mods.document_causal(mods.DOC_ID.copy()))
    assert m1.key == m2.key != trace_mask_mod(mods.causal).key
    assert trace_mask_mod(mods.causal).key != trace_score_mod(mods.identity).key


def test_grad_keys_follow_the_forward():
    a = grad(trace_score_mod(mods.softcap(1.0)))
    b = grad(trace_score_mod(mods.softcap(20.0)))
    c = grad(trace_score_mod(mods.sigmoid))
    assert a.key == b.key != c.key


# --- capture and constants -------------------------------------------------------------------

def test_numpy_scalars_are_constants():
    tr = trace_score_mod(lambda s, b, h, q, k: np.float32(2) * s + np.int64(3) * q + np.float64(.5))
    assert tr.params == (2.0, 0.5)
    assert "const 3" in tr.structure
    got = evaluate(tr, np.array([1.0]), 0, 0, np.array([2]), 0, float_dtype=np.float64)
    np.testing.assert_array_equal(got, [2.0 + 6 + 0.5])


def test_arrays_captured_from_defaults_nested_functions_and_globals():
    tab = np.arange(5.0)

    def fn(s, b, h, q, k, t=tab):
        look = lambda i: t[i] + mods.REL_TABLE.shape[0] + REL_TABLE[h, i]   # noqa: E731
        return s + look(q)

    tr = trace_score_mod(fn)
    assert sorted(tr.arrays) == ["REL_TABLE", "t"]
    assert tr.arrays["t"] is tab
    q = np.array([1, -1])
    np.testing.assert_allclose(evaluate(tr, 0.0, 0, 2, q, 0, float_dtype=np.float64),
                               tab[q] + 4 + REL_TABLE[2, q])
    assert isinstance(globals()["REL_TABLE"], np.ndarray)   # the module's globals are untouched
    _, d = evaluate_grad(tr, grad(tr), np.zeros(2), 0, 2, q, 0, np.array([1.0, 2.0]),
                         float_dtype=np.float64)
    np.testing.assert_array_equal(d["t"], [0, 1, 0, 0, 2])
    assert d["REL_TABLE"][2, 1] == 1 and d["REL_TABLE"][2, -1] == 2 and d["REL_TABLE"].sum() == 3


REL_TABLE = mods.REL_TABLE


def test_int_and_bool_arrays_have_no_gradient():
    ids = np.arange(6) % 3
    flags = np.arange(6) < 2
    tr = trace_score_mod(lambda s, b, h, q, k: np.where(flags[q], s, ids[k] * s))
    _, d = evaluate_grad(tr, grad(tr), np.ones(6), 0, 0, np.arange(6), np.arange(6), np.ones(6))
    assert d == {}
    assert sorted(tr.arrays) == ["flags", "ids"]


# --- the trace cache ---------------------------------------------------------------------------

@pytest.fixture
def traces(monkeypatch, _empty_trace_caches):
    """Counts the traces actually run (cache misses), from an empty cache."""
    runs = []
    real = trace._trace
    monkeypatch.setattr(trace, "_trace", lambda fn, kind: runs.append(fn) or real(fn, kind))
    return runs


GLOBAL_SCALE = 2.0
GLOBAL_TABLE = np.arange(8, dtype=np.float32)


def _uses_globals(s, b, h, q, k):
    return s * GLOBAL_SCALE + GLOBAL_TABLE[q % 8]


def _helper(s):
    return s * GLOBAL_SCALE


def _calls_helper(s, b, h, q, k):
    return _helper(s) + 1.0


def test_trace_cache_reuses_an_unchanged_function(traces):
    table = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)

    def fn(s, b, h, q, k):
        return s + table[h, q - k + 8] * np.float32(0.5)
    first = trace_score_mod(fn)
    again = trace_score_mod(fn)
    assert again.out is first.out and again.arrays["table"] is table and len(traces) == 1
    table[0, 0] = 99.0                        # contents are read at each call, not traced
    assert trace_score_mod(fn).out is first.out and len(traces) == 1
    assert trace_mask_mod(lambda b, h, q, k: q >= k) is not None and len(traces) == 2


def test_trace_cache_keeps_no_array_alive(_empty_trace_caches):
    """A cached trace holds no array: a function and its table dropped free the table."""
    import weakref

    def make():
        table = np.zeros((4, 1 << 16), np.float32)

        def fn(s, b, h, q, k):
            return s + table[h, q]
        first = trace_score_mod(fn)
        assert trace_score_mod(fn).out is first.out and trace_score_mod(fn).arrays["table"] is table
        return weakref.ref(table)
    gone = make()
    gc.collect()
    assert gone() is None


def test_trace_cache_lets_a_captured_array_resize(traces):
    """NumPy refuses to resize an array with a weak reference: the cache holds none."""
    table = np.zeros((4, 16), np.float32)

    def fn(s, b, h, q, k):
        return s + table[h, q]
    trace_score_mod(fn)
    gc.collect()
    table.resize((4, 32), refcheck=False)
    assert "(4, 32)" in trace_score_mod(fn).structure and len(traces) == 2


def test_trace_cache_sees_what_tracing_read(traces, monkeypatch):
    """A closure value, a captured array replaced or reshaped in place, a global, a global
    read by a helper the function calls, a default: each traces again, with the new value."""
    c = 1.5
    table = np.zeros((4, 16), np.float32)

    def fn(s, b, h, q, k):
        return s * c + table[h, q % 16]
    assert trace_score_mod(fn).params == (1.5,)
    c = 2.5
    assert trace_score_mod(fn).params == (2.5,) and len(traces) == 2
    c = -0.0                                  # equal to 0.0, another trace
    t0 = trace_score_mod(fn)
    c = 0.0
    assert trace_score_mod(fn).out is not t0.out and len(traces) == 4
    table = np.zeros((4, 32), np.float32)     # another array
    assert trace_score_mod(fn).arrays["table"] is table and len(traces) == 5
    table.shape = (8, 16)                     # the same array, reshaped in place
    assert "8, 16" in trace_score_mod(fn).structure and len(traces) == 6
    trace_score_mod(_uses_globals)
    monkeypatch.setattr(__import__(__name__), "GLOBAL_SCALE", 3.0)
    assert trace_score_mod(_uses_globals).params[0] == 3.0 and len(traces) == 8
    # another array of the same shape and dtype: the same graph, with the array met now
    monkeypatch.setattr(__import__(__name__), "GLOBAL_TABLE", np.zeros(8, np.float32))
    assert trace_score_mod(_uses_globals).arrays["GLOBAL_TABLE"] is GLOBAL_TABLE and len(traces) == 8
    trace_score_mod(_calls_helper)
    monkeypatch.setattr(__import__(__name__), "GLOBAL_SCALE", 4.0)
    assert 4.0 in trace_score_mod(_calls_helper).params and len(traces) == 10

    def with_default(s, b, h, q, k, w=0.5):
        return s * w
    trace_score_mod(with_default)
    with_default.__defaults__ = (0.25,)
    assert trace_score_mod(with_default).params == (0.25,) and len(traces) == 12


def test_trace_cache_sees_a_replaced_numpy_function(traces, monkeypatch):
    """np.tanh replaced (a monkeypatch): traced again, through the new function; put back, the
    first trace again."""
    def fn(s, b, h, q, k):
        return 30.0 * np.tanh(s / 30.0)
    first = trace_score_mod(fn)
    monkeypatch.setattr(np, "tanh", lambda x: x * 2.0)
    again = trace_score_mod(fn)
    assert again.structure != first.structure and "tanh" not in again.structure and len(traces) == 2
    monkeypatch.undo()
    assert trace_score_mod(fn).out is first.out and len(traces) == 2


PATCH_K = 2.0


def _patched_tanh(x):
    return x * PATCH_K


def test_trace_cache_follows_a_replacement_module_function(traces, monkeypatch):
    """A replacement of np.tanh counts as a function: a global it reads changing traces again."""
    def fn(s, b, h, q, k):
        return np.tanh(s)
    monkeypatch.setattr(np, "tanh", _patched_tanh)
    assert trace_score_mod(fn).params == (2.0,)
    monkeypatch.setattr(__import__(__name__), "PATCH_K", 5.0)
    assert trace_score_mod(fn).params == (5.0,)


def test_trace_cache_sees_modules_reached_otherwise(traces, monkeypatch):
    """A module met as a default, a submodule's function, getattr by name, a replaced constant
    (by its repr: -0.0 is not 0.0): each traces again after the patch."""
    def by_default(s, b, h, q, k, _np=np):
        return _np.tanh(s)

    def submodule(s, b, h, q, k):
        return np.emath.sqrt(s) + s

    def by_name(s, b, h, q, k):
        return getattr(np, "tanh")(s)

    def constant(s, b, h, q, k):
        return s + math.pi
    monkeypatch.setattr(np.emath, "sqrt", lambda x: x * 4.0)     # the tracer has no np.emath.sqrt
    before = [trace_score_mod(f).structure for f in (by_default, submodule, by_name)]
    monkeypatch.setattr(np, "tanh", lambda x: x * 3.0)
    monkeypatch.setattr(np.emath, "sqrt", lambda x: x - 1.0)
    after = [trace_score_mod(f).structure for f in (by_default, submodule, by_name)]
    assert all(a != b for a, b in zip(after, before))
    monkeypatch.setattr(math, "pi", -0.0)
    assert trace_score_mod(constant).params == (-0.0,) and str(trace_score_mod(constant).params[0]) == "-0.0"
    monkeypatch.setattr(math, "pi", 0.0)
    assert str(trace_score_mod(constant).params[0]) == "0.0"


def test_trace_cache_leaves_what_it_cannot_know(traces):
    """A list, an object, a callable object, a user module: traced every time."""
    weights = [1.0, 2.0]

    class Box:
        scale = 2.0
    box = Box()
    import types as pytypes
    user_module = pytypes.ModuleType("user_helpers")
    user_module.scale = 3.0

    class Scaled:
        def __call__(self, s, b, h, q, k):
            return s * 2.0
    fns = [lambda s, b, h, q, k: s * weights[0], lambda s, b, h, q, k: s * box.scale,
           lambda s, b, h, q, k: s * user_module.scale, Scaled()]
    for fn in fns:
        trace_score_mod(fn)
        trace_score_mod(fn)
    assert len(traces) == 2 * len(fns)
    weights[0] = 5.0
    assert trace_score_mod(fns[0]).params == (5.0,)


# the trace cache's stale-trace cases found in review (each failed before the fix)
@pytest.fixture
def _empty_trace_caches():
    trace.trace_cache_clear()
    band._splits.clear()
    yield
    trace.trace_cache_clear()


CONF = np.array([0.125])       # read by a helper: captured under its name, as the score_mod's own


def _conf_scale():
    return CONF[0]                       # a lookup: its contents read at every evaluation


def _scaled(s, b, h, q, k):
    return s * _conf_scale()


def test_trace_cache_array_contents_read_by_a_helper_are_not_cached(_empty_trace_caches):
    CONF[0] = 0.125
    one = np.ones(1, np.float32)
    t = trace_score_mod(_scaled)
    assert list(t.arrays) == ["CONF"] and evaluate(t, one, 0, 0, 0, 0)[0] == 0.125
    CONF[0] = 0.5
    try:
        t = trace_score_mod(_scaled)
        assert t.arrays["CONF"] is CONF and evaluate(t, one, 0, 0, 0, 0)[0] == 0.5
    finally:
        CONF[0] = 0.125


def test_trace_cache_array_in_a_captured_tuple_is_not_cached(_empty_trace_caches):
    pair = (np.array(2.0),)

    def fn(s, b, h, q, k):
        return s * float(pair[0])
    assert trace_score_mod(fn).params == (2.0,)
    pair[0][...] = 3.0
    assert trace_score_mod(fn).params == (3.0,)


def test_trace_cache_function_attributes_are_seen(_empty_trace_caches):
    def fn(s, b, h, q, k):
        return s * fn.temperature
    fn.temperature = 1.0
    assert trace_score_mod(fn).params == (1.0,)
    fn.temperature = 4.0
    assert trace_score_mod(fn).params == (4.0,)


def test_trace_cache_bound_builtin_methods_are_not_cached(_empty_trace_caches):
    cfg = {"scale": 1.0}
    get = cfg.get
    arr = np.array([1.0, 2.0])
    amax = arr.max
    f1 = lambda s, b, h, q, k: s * get("scale")          # noqa: E731
    f2 = lambda s, b, h, q, k: s + amax()                # noqa: E731
    trace_score_mod(f1), trace_score_mod(f2)
    cfg["scale"], arr[1] = 7.0, 9.0
    assert trace_score_mod(f1).params == (7.0,)
    assert trace_score_mod(f2).params == (9.0,)


def test_trace_cache_numpy_random_is_not_frozen(_empty_trace_caches):
    fn = lambda s, b, h, q, k: s + np.random.rand()      # noqa: E731
    assert len({trace_score_mod(fn).params for _ in range(5)}) > 1


def _factory(scale):
    def f(x):
        return x * scale
    return f


def test_trace_cache_a_function_met_twice_is_not_identified_by_its_code(_empty_trace_caches):
    a, b = _factory(1.0), _factory(2.0)
    g = {"A": a, "B": b, "C": a}
    fn = eval("lambda s, b_, h, q, k: A(s) + B(s) + C(s)", g)
    assert trace_score_mod(fn).params == (1.0, 2.0, 1.0)
    g["C"] = b
    assert trace_score_mod(fn).params == (1.0, 2.0, 2.0)


DYN = 1.0


def _dynamic(s, b, h, q, k):
    return s * globals()["DYN"]


def test_trace_cache_dynamic_global_lookup_is_not_cached(_empty_trace_caches, monkeypatch):
    assert trace_score_mod(_dynamic).params == (1.0,)
    monkeypatch.setattr(__import__(__name__), "DYN", 3.0)
    assert trace_score_mod(_dynamic).params == (3.0,)


def test_trace_cache_subclasses_of_plain_values_are_not_cached(_empty_trace_caches):
    P1, P2 = namedtuple("P1", "scale bias"), namedtuple("P2", "bias scale")
    box = {"cfg": P1(1.0, 2.0)}
    fn = eval("lambda s, b, h, q, k: s * cfg.scale + cfg.bias", box)
    assert trace_score_mod(fn).params == (1.0, 2.0)
    box["cfg"] = P2(1.0, 2.0)
    assert trace_score_mod(fn).params == (2.0, 1.0)


def test_trace_cache_numpy_scalars_keyed_by_dtype(_empty_trace_caches):
    box = {"D": np.timedelta64(3, "D")}
    fn = eval("lambda s, b, h, q, k: s * float(D / np.timedelta64(1, 'h'))", dict(box, np=np))
    assert trace_score_mod(fn).params == (72.0,)
    fn.__globals__["D"] = np.timedelta64(3, "h")
    assert trace_score_mod(fn).params == (3.0,)


def test_trace_cache_band_memo_keeps_no_array_of_an_uncacheable_mask_mod(_empty_trace_caches):
    import weakref

    def make():
        big = np.zeros(1 << 16, np.int64)
        flags = [True]                   # a list: traced every call

        def mm(b, h, q, k):
            return (k <= q) & (big[q] == big[k]) & flags[0]
        band.split(trace_mask_mod(mm))
        return weakref.ref(big)
    gone = make()
    gc.collect()
    assert gone() is None


def test_trace_cache_cache_key_keeps_no_array_alive_through_a_bound_method(_empty_trace_caches):
    import weakref

    def make():
        big = np.zeros(1 << 16)
        m = big.max
        trace_score_mod(lambda s, b, h, q, k: s + m())
        return weakref.ref(big)
    gone = make()
    gc.collect()
    assert gone() is None
