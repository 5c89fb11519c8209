"""attnext.mods.bounds: the integer ranges of a traced graph hold every value the graph takes over a
call's inputs, and the lookups it calls in range never fail (random expressions, evaluated over
every input of a small grid by trace's NumPy evaluator)."""
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from attnext.mods import bounds, trace

# a random integer expression over b, h, q_idx, kv_idx: nested tuples (op, operands...)
_LEAF = st.one_of(st.sampled_from(["b", "h", "q", "k"]), st.integers(-40, 40))
_BINARY = ["add", "sub", "mul", "floordiv", "mod", "minimum", "maximum", "and", "or", "xor"]


def _expr():
    return st.recursive(
        _LEAF,
        lambda sub: st.one_of(
            st.tuples(st.sampled_from(_BINARY), sub, sub),
            st.tuples(st.sampled_from(["neg", "abs", "not", "square"]), sub),
            st.tuples(st.just("where"), sub, sub, sub, sub),
            st.tuples(st.just("lookup"), sub)),
        max_leaves=8)


def _build(e, env, table):
    if isinstance(e, str):
        return env[e]
    if isinstance(e, int):
        return e
    op, *a = e
    x = [_build(y, env, table) for y in a]
    if op == "where":
        return np.where(x[0] < x[1], x[2], x[3])
    if op == "lookup":
        return table[x[0]]
    if op == "square":
        return x[0] ** 2
    if op == "not":
        return ~x[0]
    with np.errstate(divide="ignore"):      # // and % by zero give 0 (trace.py's rule, NumPy's)
        return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "floordiv": np.floor_divide,
                "mod": np.remainder, "minimum": np.minimum, "maximum": np.maximum,
                "neg": np.negative, "abs": np.absolute, "and": np.bitwise_and,
                "or": np.bitwise_or, "xor": np.bitwise_xor}[op](*x)


def _grid(ext):
    return np.meshgrid(*(np.arange(n) for n in ext), indexing="ij")


@settings(max_examples=300, deadline=None)
@given(e=_expr(), size=st.integers(1, 60), tsize=st.integers(1, 30),
       ext=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 24), st.integers(1, 24)),
       seed=st.integers(0, 2 ** 32 - 1), host_values=st.booleans())
def test_ranges_hold_every_value_and_in_range_lookups_never_fail(e, size, tsize, ext, seed, host_values):
    rng = np.random.default_rng(seed)
    table = rng.integers(-35, 35, tsize)                 # an integer array the index may read
    arr = rng.standard_normal(size).astype(np.float32)   # the array the mask looks up

    def mask_mod(b, h, q, k):
        return arr[_build(e, {"b": b, "h": h, "q": q, "k": k}, table)] > 0

    try:
        t = trace.trace_mask_mod(mask_mod)
    except (TypeError, IndexError):
        return            # an integer power the tracer refuses, a constant index out of range
    extents = bounds.Extents(*ext)
    values = bounds.array_values(t, t.arrays) if host_values else None
    r = bounds.ranges([t.out], extents, values)
    b, h, q, k = _grid(ext)
    env = {"score": None, "b": b, "h": h, "q_idx": q, "kv_idx": k}
    # every node's values, each load evaluated with its indices clamped (the reference would stop
    # at the first bad one; the ranges must hold whatever the loads read)
    memo = {}
    for n in trace.topo(t.out):
        if n.op in env:
            memo[id(n)] = np.asarray(env[n.op])
        elif n.op == "array":
            continue
        elif n.op == "load":
            a = t.arrays[n.args[0].args[0]]
            i = memo[id(n.args[1])]
            memo[id(n)] = a[np.clip(np.where(i < 0, i + a.size, i), 0, a.size - 1)]
        else:
            memo[id(n)] = trace._run([n], env, t.params, t.arrays, np.float32)[id(n)] \
                if n.op in ("const", "fconst", "param") else _apply(n, memo)
        iv = r.get(id(n))
        if n.dtype == trace.I and iv is not None:
            v = memo[id(n)]
            assert iv[0] <= v.min() and v.max() <= iv[1], (trace.format_expr(n), iv, v.min(), v.max())
    flags = bounds.in_range(t, extents, values)
    event(f"lookups in range: {sum(flags)} of {len(flags)}")
    for n, ok in zip(bounds.loads(t), flags):
        if ok:
            i = memo[id(n.args[1])]
            size_n = n.args[0].args[2][0]
            assert ((i >= -size_n) & (i < size_n)).all(), trace.format_expr(n)


def _apply(n, memo):
    ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "floordiv": np.floor_divide,
           "mod": np.remainder, "pow": np.power, "minimum": np.minimum, "maximum": np.maximum,
           "neg": np.negative, "abs": np.absolute, "and": np.bitwise_and, "or": np.bitwise_or,
           "xor": np.bitwise_xor, "not": np.invert, "lt": np.less, "le": np.less_equal,
           "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
           "where": np.where}
    a = [memo[id(x)] for x in trace._children(n)]
    if n.op == "cast":
        return a[0].astype(np.int64 if n.dtype == trace.I else np.float32)
    with np.errstate(all="ignore"):
        if n.op in ("floordiv", "mod") and n.dtype == trace.I:
            d = np.where(a[1] == 0, 1, a[1])
            return np.where(a[1] == 0, 0, ops[n.op](a[0], d))
        return ops[n.op](*a)


S = 8192
TABLE = np.zeros((16, 2 * S), np.float32)
DOC = np.repeat(np.arange(7), 10)


@pytest.mark.parametrize("fn, extents, expect", [
    # the relative-bias table of the bench: every offset q - k + S of an S x S call is inside
    (lambda s, b, h, q, k: s + TABLE[h, q - k + S], (2, 16, S, S), (True,)),
    (lambda s, b, h, q, k: s + TABLE[h, q - k + S], (2, 16, S + 1, S), (False,)),
    (lambda s, b, h, q, k: s + TABLE[h, q - k + S], (2, 17, S, S), (False,)),
    # negative indices count from the end: q - k alone stays within [-2S, 2S)
    (lambda s, b, h, q, k: s + TABLE[h, q - k], (1, 16, S, S), (True,)),
    (lambda s, b, h, q, k: s + TABLE[h % 16, (q * 3) % 100], (1, 40, 10 ** 6, 7), (True,)),
    (lambda s, b, h, q, k: s + TABLE[h // 2, np.minimum(q, 5)], (1, 32, 10 ** 9, 1), (True,)),
    (lambda s, b, h, q, k: s * np.where(q >= k, TABLE[0, q], TABLE[1, k]), (1, 1, 100, 2 * S), (True, True)),
    (lambda s, b, h, q, k: s * np.where(q >= k, TABLE[0, q], TABLE[1, k]), (1, 1, 100, 2 * S + 1), (True, False)),
])
def test_in_range_of_common_lookups(fn, extents, expect):
    t = trace.trace_score_mod(fn)
    assert bounds.in_range(t, bounds.Extents(*extents)) == expect


def test_document_mask_and_lookups_of_lookups():
    t = trace.trace_mask_mod(lambda b, h, q, k: DOC[q] == DOC[k])
    assert bounds.in_range(t, bounds.Extents(1, 1, 70, 70)) == (True, True)
    assert bounds.in_range(t, bounds.Extents(1, 1, 71, 70)) == (False, True)
    # TABLE[h, DOC[q]]: in range only when the caller gives DOC's values (0..6)
    t = trace.trace_mask_mod(lambda b, h, q, k: TABLE[h, DOC[q]] > 0)
    ext = bounds.Extents(1, 16, 70, 70)
    assert bounds.in_range(t, ext) == (True, False)
    assert bounds.in_range(t, ext, bounds.array_values(t, t.arrays)) == (True, True)
    assert bounds.array_values(t, t.arrays) == {"DOC": (0, 6)}


def test_wrapping_arithmetic_is_unknown():
    big = 2 ** 62
    t = trace.trace_score_mod(lambda s, b, h, q, k: s + TABLE[0, (q * big * 4) % 7])
    # q * big * 4 can wrap in int64: the product's range is unknown, but % 7 bounds it again
    r = bounds.ranges([t.out], bounds.Extents(1, 1, 10, 1))
    assert any(v is None for v in r.values())
    assert bounds.in_range(t, bounds.Extents(1, 1, 10, 1)) == (True,)
    t = trace.trace_score_mod(lambda s, b, h, q, k: s + TABLE[0, q * big * 4])
    assert bounds.in_range(t, bounds.Extents(1, 1, 10, 1)) == (False,)


def test_empty_extents_and_arrays():
    t = trace.trace_score_mod(lambda s, b, h, q, k: s + TABLE[h, q])
    assert bounds.in_range(t, bounds.Extents(0, 0, 0, 0)) == (False,)
    empty = np.zeros((0,), np.float32)
    t = trace.trace_score_mod(lambda s, b, h, q, k: s + empty[q])
    assert bounds.in_range(t, bounds.Extents(1, 1, 4, 4)) == (False,)


def test_lookup_modes_name_the_axes_that_may_count_from_the_end():
    """A proven lookup's mode is the bits of its axes whose index may be negative (codegen
    normalises only those); CHECKED when it may leave the array."""
    ext = bounds.Extents(1, 16, S, S)
    cases = [(lambda s, b, h, q, k: s + TABLE[h, q - k + S], (0,)),
             (lambda s, b, h, q, k: s + TABLE[h, q - k], (2,)),
             (lambda s, b, h, q, k: s + TABLE[h - 16, q - k], (3,)),
             (lambda s, b, h, q, k: s + TABLE[h - 16, q] + TABLE[h, q - k - 2 * S], (1, bounds.CHECKED))]
    for fn, want in cases:
        t = trace.trace_score_mod(fn)
        assert bounds.lookup_modes(t, ext) == want
        assert bounds.in_range(t, ext) == tuple(m != bounds.CHECKED for m in want)


def test_cuda_facts_prove_lookups_over_lengths_rounded_to_the_tile_edge():
    """A branch-free tile evaluates the mods up to select.TILE_EDGE past a sequence's end (the
    results discarded there), so the CUDA backend proves lookups over the lengths rounded up to
    it: a document id array of exactly Sq entries is read directly only when Sq is a multiple of
    the edge, else checked (clamped), never past its end."""
    from types import SimpleNamespace

    from attnext.cuda import backend as cuda_backend, nvrtc, select
    edge = select.TILE_EDGE
    for sq, want in ((2 * edge, 0), (2 * edge - 60, bounds.CHECKED), (2 * edge + 1, bounds.CHECKED)):
        doc = np.zeros(sq, np.int64)
        t = trace.trace_mask_mod(lambda b, h, q, k: doc[q] == doc[k])
        o = SimpleNamespace(B=1, Hq=2, varlen=False, Sq=sq, Sk=sq, device_lengths=False)
        assert cuda_backend._facts(o, None, t, [], []).mask == (want, want), sq
