"""The integer ranges a traced score_mod / mask_mod's expressions take over one call, to tell the
lookups that can never leave their array from those that must be checked.

A call fixes the ranges of the inputs: b in [0, B), h in [0, Hq), q_idx in [0, query rows) and
kv_idx in [0, key rows), where the rows are the longest sequence's (the kernels evaluate the
functions only at pairs inside the lengths). Interval arithmetic carries them through the
graph: exactly for + - * neg abs min max where, for // and % by a divisor whose sign is known,
for ~, for & with a non-negative operand and | ^ of non-negative ones; a cast of a bool is [0, 1]; an integer lookup
takes the [min, max] of the array's values when the caller gives them (NumPy arrays on the
host; a CUDA array's values are never read on the host, so a lookup indexed by them is checked),
and anything else is unknown. An interval that could leave int64 is unknown (the
kernels' integer arithmetic wraps there, as NumPy's does), and so is one of a narrower integer
type (int8 ... uint64) that leaves the type's range, or a uint64 lookup past int64: the value
wrapped there.

A lookup is in range when every index's interval lies within [-n, n) for its axis of size n:
it can never fail, so the generated code reads it without the check, the clamp or the error
record (codegen), and a call whose lookups are all in range has nothing to report and need not
wait for the kernels (cuda_backend). Which lookups are in range is part of the generated code's
key; the ranges themselves are not.
"""
from typing import NamedTuple

from . import trace

_I64_MIN, _I64_MAX = -2 ** 63, 2 ** 63 - 1


class Extents(NamedTuple):
    """The number of values of each integer input over one call (indices run from 0)."""
    b: int
    h: int
    q_idx: int
    kv_idx: int


def _fits(lo, hi):
    return (lo, hi) if _I64_MIN <= lo <= hi <= _I64_MAX else None


def _corners(f, a, b):
    vals = [f(x, y) for x in a for y in b]
    return _fits(min(vals), max(vals))


def _floordiv(a, d):
    """a // d (floor), for intervals a and d where d keeps one sign (never 0)."""
    return _corners(lambda x, y: x // y, a, d)


def _mod(a, d):
    """NumPy's remainder: the divisor's sign; a itself when it already lies in [0, d). a may be
    unknown (None)."""
    lo, hi = d
    if lo > 0:
        if a is not None and a[0] >= 0 and a[1] < lo:
            return a
        return (0, hi - 1)
    if hi < 0:
        if a is not None and a[1] <= 0 and a[0] > hi:
            return a
        return (lo + 1, 0)
    return None


def _bitwise(op, a, b):
    """| ^ of non-negative intervals: bounded by the bits of the larger operand."""
    if a[0] < 0 or b[0] < 0:
        return None
    top = (1 << max(a[1], b[1]).bit_length()) - 1
    return (0, top)


def _pow(a, e):
    """a ** e for a constant e >= 0 (the tracer's rule)."""
    if e[0] != e[1] or e[0] < 0:
        return None
    k = e[0]
    vals = [a[0] ** k, a[1] ** k]
    if a[0] < 0 < a[1]:
        vals.append(0)
    return _fits(min(vals), max(vals))


def ranges(roots, extents, values=None):
    """{id(node): (lo, hi) or None} for the integer and bool nodes reachable from roots (bool
    nodes are [0, 1]). values: {array name: (min, max)} of integer arrays' contents, optional."""
    values = values or {}
    out = {}
    inputs = extents._asdict()
    for n in trace.topo(*roots):
        if n.dtype == trace.B:
            out[id(n)] = (0, 1)
            continue
        if not trace.is_int(n.dtype):
            continue
        a = [out.get(id(x)) for x in trace._children(n)]
        op = n.op
        r = None
        if op in inputs:
            r = (0, inputs[op] - 1) if inputs[op] > 0 else None
        elif op == "const":
            r = (int(n.args[0]), int(n.args[0]))
        elif op == "load":
            arr = n.args[0]
            r = values.get(arr.args[0]) if trace.is_int(arr.dtype) else None
        elif op == "cast":
            r = (0, 1) if n.args[0].dtype == trace.B else a[0]
        elif op == "where":
            if a[1] is not None and a[2] is not None:
                r = (min(a[1][0], a[2][0]), max(a[1][1], a[2][1]))
        elif op == "mod":
            r = _mod(a[0], a[1]) if a[1] is not None else None
        elif op == "and" and any(x is not None and x[0] >= 0 for x in a):
            r = (0, min(x[1] for x in a if x is not None and x[0] >= 0))
        elif any(x is None for x in a):
            r = None
        elif op == "add":
            r = _fits(a[0][0] + a[1][0], a[0][1] + a[1][1])
        elif op == "sub":
            r = _fits(a[0][0] - a[1][1], a[0][1] - a[1][0])
        elif op == "mul":
            r = _corners(lambda x, y: x * y, a[0], a[1])
        elif op == "neg":
            r = _fits(-a[0][1], -a[0][0])
        elif op == "abs":
            lo, hi = a[0]
            r = _fits(0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        elif op == "minimum":
            r = (min(a[0][0], a[1][0]), min(a[0][1], a[1][1]))
        elif op == "maximum":
            r = (max(a[0][0], a[1][0]), max(a[0][1], a[1][1]))
        elif op == "floordiv":
            r = _floordiv(a[0], a[1]) if a[1][0] > 0 or a[1][1] < 0 else None
        elif op == "pow":
            r = _pow(a[0], a[1])
        elif op == "not":
            r = (-a[0][1] - 1, -a[0][0] - 1)
        elif op in ("and", "or", "xor"):
            r = _bitwise(op, a[0], a[1])
        if r is not None and n.dtype != trace.I:     # a narrower type: exact where nothing wrapped
            lo, hi = trace.int_range(n.dtype)
            r = r if lo <= r[0] and r[1] <= hi else None
        out[id(n)] = r
    return out


def loads(traced):
    """The lookups of a traced function, in its graph's topological order (codegen's order)."""
    return [n for n in trace.topo(traced.out) if n.op == "load"]


CHECKED = -1     # a lookup's mode (lookup_modes): normalised, clamped and reported


def lookup_modes(traced, extents, values=None):
    """How each lookup of traced (loads' order) may be read over a call with these extents:
    CHECKED when it may leave its array; else the bits of the axes whose index may be negative
    (counted from the end), 0 when every index is in [0, n): the plain offset. values: {array
    name: (min, max)} of integer arrays."""
    r = ranges([traced.out], extents, values)
    modes = []
    for n in loads(traced):
        shape = n.args[0].args[2]
        mode = 0
        for ax, (idx, size) in enumerate(zip(n.args[1:], shape)):
            iv = r.get(id(idx))
            if size <= 0 or iv is None or not (-size <= iv[0] and iv[1] < size):
                mode = CHECKED
                break
            mode |= (1 << ax) if iv[0] < 0 else 0
        modes.append(mode)
    return tuple(modes)


def in_range(traced, extents, values=None):
    """A tuple of bools, one per lookup of traced (loads' order): whether it can never leave its
    array over a call with these extents. values: {array name: (min, max)} of integer arrays."""
    return tuple(m != CHECKED for m in lookup_modes(traced, extents, values))


def value_range(a):
    """(min, max) of an integer NumPy array's values, or None (empty, not integer, or past
    int64)."""
    if a.size == 0 or a.dtype.kind not in "iu":
        return None
    return _fits(int(a.min()), int(a.max()))


def fits_int32(values):
    """Whether a (min, max) range, or None (unknown), lies within int32."""
    return values is not None and -2 ** 31 <= values[0] and values[1] < 2 ** 31


def array_values(traced, arrays):
    """{name: (min, max)} of the integer captured arrays among arrays (name -> np.ndarray on the
    host); arrays that are empty, not integer or not on the host are left out."""
    import numpy as np
    out = {}
    for n in trace.topo(traced.out):
        a = arrays.get(n.args[0]) if n.op == "array" and trace.is_int(n.dtype) else None
        iv = value_range(a) if isinstance(a, np.ndarray) else None
        if iv is not None:
            out[n.args[0]] = iv
    return out
