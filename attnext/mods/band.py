"""A mask_mod's band: the conjuncts that bound kv_idx - q_idx by integer constants.

A mask_mod such as `(kv_idx <= q_idx) & (q_idx - kv_idx < 1024)` (a causal sliding window) or
`(doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)` (document-causal) is, in part, the band the
kernels already know how to walk: causal and window bound c - r, and the kernels visit only the
tiles inside that band and test pairs only in the tiles it cuts. split() finds that part so the
backends can hand it to their kernels as the window (attnext/lower.py: lower_band): the tiles
outside it are never visited, and a mask_mod that is nothing but a band leaves no mask code at
all. What stays a mask_mod is evaluated as before.

What counts. The output's top-level `&` (of bool operands; `np.logical_and` traces to the same op)
is split into conjuncts. A conjunct is a bound when it is a comparison < <= > >= of two integer
expressions that are affine in q_idx and kv_idx with integer constant coefficients (+, -, unary
-, multiplication by an integer constant, integer constants) whose difference is
+-(kv_idx - q_idx) + const: it bounds d = kv_idx - q_idx from above or below. Anything else (b,
h, lookups, floats, ==, |, ~, a coefficient other than +-1) stays in the rest, unchanged.
Integer arithmetic on the indices is exact in the kernels (int64), so the split is exact:
mask_mod(b, h, q, kv) == (lo <= kv - q <= hi) & rest(b, h, q, kv) for every input.
"""
from typing import NamedTuple, Optional

from ..lru import LRU
from . import trace

_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


class Band(NamedTuple):
    """lo <= kv_idx - q_idx <= hi (None: unbounded on that side); rest: the mask_mod's other
    conjuncts as a Traced (None: there are none)."""
    lo: Optional[int]
    hi: Optional[int]
    rest: Optional[trace.Traced]


def _conjuncts(node):
    """The operands of node's top-level bool `&`s, left to right (a stack, not recursion: a
    mask_mod may chain thousands of them)."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.op == "and" and n.dtype == trace.B:
            stack += (n.args[1], n.args[0])
        else:
            found.append(n)
    return found


_LIMIT = 1 << 31     # no term of a bound may reach this: int64 arithmetic on indices never wraps


def _affine(node):
    """(a_q, a_kv, c) with node == a_q * q_idx + a_kv * kv_idx + c, or None (also where a
    coefficient or constant reaches _LIMIT, at this node or below: the kernels' and NumPy's
    int64 arithmetic could wrap where these exact integers do not). Each node after its
    arguments (trace.topo), so a chain of any depth recurses nowhere."""
    memo = {}
    for n in trace.topo(node):
        x = _affine_exact(n, lambda a: memo[id(a)])
        memo[id(n)] = None if x is None or any(abs(t) >= _LIMIT for t in x) else x
    return memo[id(node)]


def _affine_exact(node, of):
    """node's (a_q, a_kv, c) from its arguments' (of(arg): their _affine), or None."""
    if node.dtype != trace.I:
        return None
    if node.op == "q_idx":
        return 1, 0, 0
    if node.op == "kv_idx":
        return 0, 1, 0
    if node.op == "const":
        return 0, 0, int(node.args[0])
    if node.op in ("add", "sub"):
        x, y = of(node.args[0]), of(node.args[1])
        if x is None or y is None:
            return None
        s = 1 if node.op == "add" else -1
        return x[0] + s * y[0], x[1] + s * y[1], x[2] + s * y[2]
    if node.op == "neg":
        x = of(node.args[0])
        return None if x is None else (-x[0], -x[1], -x[2])
    if node.op == "mul":
        x, y = of(node.args[0]), of(node.args[1])
        if x is None or y is None:
            return None
        if x[:2] == (0, 0):
            x, y = y, x
        if y[:2] != (0, 0):
            return None                   # a product of two index terms
        k = y[2]
        return x[0] * k, x[1] * k, x[2] * k
    return None


def _bound(node):
    """("lo" or "hi", value) when node bounds d = kv_idx - q_idx, else None."""
    if node.op not in _FLIP:
        return None
    x, y = _affine(node.args[0]), _affine(node.args[1])
    if x is None or y is None:
        return None
    a_q, a_kv, c = x[0] - y[0], x[1] - y[1], x[2] - y[2]     # a_q q + a_kv kv + c  op  0
    if (a_q, a_kv) == (1, -1):                               # -(d) + c op 0  ->  d flip(op) c
        op = _FLIP[node.op]
    elif (a_q, a_kv) == (-1, 1):                             # d + c op 0  ->  d op -c
        op, c = node.op, -c
    else:
        return None
    return {"lt": ("hi", c - 1), "le": ("hi", c), "gt": ("lo", c + 1), "ge": ("lo", c)}[op]


# (id(tm.out), lower, upper) -> (tm.out, the Band with its rest's arrays left out): trace's
# cache hands back one graph for an unchanged function
_splits = LRU(64)


def split(tm, lower=True, upper=True):
    """The Band of a traced mask_mod. lower / upper False: that side's bounds are left in the rest
    (a caller that cannot take them). Remembered for the graphs met last (each GPU call with a
    mask_mod asks, and a rest's canonical text costs ~15 us to make); the rest's arrays are
    always tm's own (a subset), never kept here."""
    key = (id(tm.out), lower, upper)
    hit = _splits.get(key)
    if hit is not None and hit[0] is tm.out:
        band = hit[1]
    else:
        band = _split(tm, lower, upper)
        bare = band if band.rest is None else band._replace(rest=band.rest._replace(arrays=tuple(band.rest.arrays)))
        _splits.put(key, (tm.out, bare))
        return band
    if band.rest is None:
        return band
    return band._replace(rest=band.rest._replace(arrays={name: tm.arrays[name] for name in band.rest.arrays}))


def _split(tm, lower, upper):
    lo = hi = None
    rest = []
    for n in _conjuncts(tm.out):
        b = _bound(n)
        if b is not None and b[0] == "lo" and lower:
            lo = b[1] if lo is None else max(lo, b[1])
        elif b is not None and b[0] == "hi" and upper:
            hi = b[1] if hi is None else min(hi, b[1])
        else:
            rest.append(n)
    if lo is None and hi is None:
        return Band(None, None, tm)
    if not rest:
        return Band(lo, hi, None)
    out = rest[0]
    for n in rest[1:]:
        out = tm.graph.node("and", trace.B, out, n)
    return Band(lo, hi, trace.with_output(tm, out))
