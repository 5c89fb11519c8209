"""The symbolic derivative of a traced score_mod (grad) and its evaluation on NumPy arrays
(evaluate_grad): reverse mode over the forward graph's nodes plus a `dout` leaf; array gradients
are scatter-added with np.add.at (sequential, deterministic)."""
import collections.abc
import hashlib
import math
from typing import NamedTuple

import numpy as np

from .trace import B, F, Node, _LN2, _children, _normalised, _run, kind_of, structure_of, topo


class Grad(NamedTuple):
    """Reverse-mode derivative of a traced score_mod, as graphs over the forward nodes plus a
    "dout" leaf (the incoming gradient). dscore: d out / d score times dout. darrays: name ->
    tuple of (index nodes, adjoint node), one per distinct lookup of that float array; the
    array's gradient is the scatter-add of every adjoint at its (normalised) indices.
    structure / key: canonical text and SHA-256 of all these graphs together."""
    dscore: Node
    darrays: dict
    structure: str
    key: str


# op -> (f, k, out, *operands) -> the derivative of out w.r.t. each operand (None: 0), from
# f(op, *nodes) (a float node) and k(value) (a constant): the float functions above exp ... cos
_LOCAL = {
    "tan": lambda f, k, y, x: (f("add", k(1.0), f("mul", y, y)),),
    "atan": lambda f, k, y, x: (f("truediv", k(1.0), f("add", k(1.0), f("mul", x, x))),),
    "asin": lambda f, k, y, x: (f("truediv", k(1.0), f("sqrt", f("sub", k(1.0), f("mul", x, x)))),),
    "acos": lambda f, k, y, x: (f("truediv", k(-1.0), f("sqrt", f("sub", k(1.0), f("mul", x, x)))),),
    "sinh": lambda f, k, y, x: (f("cosh", x),),
    "cosh": lambda f, k, y, x: (f("sinh", x),),
    "asinh": lambda f, k, y, x: (f("truediv", k(1.0), f("hypot", x, k(1.0))),),   # no x * x overflow
    "acosh": lambda f, k, y, x: (f("truediv", k(1.0), f("mul", f("sqrt", f("sub", x, k(1.0))),
                                                       f("sqrt", f("add", x, k(1.0))))),),
    "atanh": lambda f, k, y, x: (f("truediv", k(1.0), f("sub", k(1.0), f("mul", x, x))),),
    "expm1": lambda f, k, y, x: (f("add", y, k(1.0)),),
    "log1p": lambda f, k, y, x: (f("truediv", k(1.0), f("add", x, k(1.0))),),
    "log10": lambda f, k, y, x: (f("truediv", k(1.0), f("mul", x, k(math.log(10.0)))),),
    "cbrt": lambda f, k, y, x: (f("truediv", k(1.0), f("mul", k(3.0), f("mul", y, y))),),
    "floor": lambda f, k, y, x: (None,), "ceil": lambda f, k, y, x: (None,),
    "rint": lambda f, k, y, x: (None,), "trunc": lambda f, k, y, x: (None,),
    # atan2(a, b) = atan(a / b): d/da = b / r^2, d/db = -a / r^2 with r = hypot(a, b)
    "atan2": lambda f, k, y, a, b: (f("truediv", f("truediv", b, f("hypot", a, b)), f("hypot", a, b)),
                                    f("neg", f("truediv", f("truediv", a, f("hypot", a, b)),
                                                  f("hypot", a, b)))),
    "hypot": lambda f, k, y, a, b: (f("truediv", a, y), f("truediv", b, y)),
    # copysign(a, b) = |a| sign(b): d/da = sign(a) sign(b) (at the kink a = 0, +-0's sign)
    "copysign": lambda f, k, y, a, b: (f("mul", f("copysign", k(1.0), a), f("copysign", k(1.0), b)),
                                       None),
}


def grad(traced):
    """The symbolic derivative of a score_mod (see Grad).

    Rules: np.where, minimum and maximum send the adjoint only to the chosen operand (ties of
    minimum / maximum go to the first operand, the one NumPy returns); abs' derivative is sign(x)
    with 0 at 0; a // b has derivative 0 and a % b has derivatives 1 and -(a // b); a ** b has
    b * a ** (b - 1) and, where b depends on the score or an array, a ** b * log(a). Integer
    and bool subgraphs (indices, comparisons) carry no gradient; floor, ceil, rint and trunc
    have derivative 0, the other float functions theirs (_LOCAL). Each adjoint times a local
    derivative is a "dmul": 0 where the adjoint is 0, so an unchosen branch never leaks NaN.
    """
    if traced.kind != "score_mod":
        raise TypeError("only a score_mod has a derivative; a mask_mod is piecewise constant")
    g = traced.graph
    order = topo(traced.out)
    diff = set()
    for n in order:
        if n.dtype != F:
            continue
        if n.op == "score" or n.op == "load" or any(id(a) in diff for a in _children(n)):
            diff.add(id(n))
    dout = g.node("dout", F)
    zero, one = g.fconst(0.0), g.fconst(1.0)
    node = g.node

    def dmul(adj, d):
        return node("dmul", F, adj, d)

    contrib = {id(traced.out): [dout]} if id(traced.out) in diff else {}
    dscore = zero
    darrays = {}

    def push(x, c):
        if id(x) in diff:
            contrib.setdefault(id(x), []).append(c)

    for n in reversed(order):
        cs = contrib.get(id(n))
        if not cs:
            continue
        adj = cs[0]
        for c in cs[1:]:
            adj = node("add", F, adj, c)
        op, a = n.op, n.args
        if op == "score":
            dscore = adj
        elif op == "load":
            darrays.setdefault(a[0].args[0], []).append((a[1:], adj))
        elif op == "add":
            push(a[0], adj), push(a[1], adj)
        elif op == "sub":
            push(a[0], adj), push(a[1], node("neg", F, adj))
        elif op == "mul":
            push(a[0], dmul(adj, a[1])), push(a[1], dmul(adj, a[0]))
        elif op == "truediv":
            push(a[0], dmul(adj, node("truediv", F, one, a[1])))
            push(a[1], dmul(adj, node("neg", F, node("truediv", F, n, a[1]))))
        elif op == "floordiv":
            pass
        elif op == "mod":
            push(a[0], adj)
            push(a[1], dmul(adj, node("neg", F, node("floordiv", F, a[0], a[1]))))
        elif op == "pow":
            push(a[0], dmul(adj, node("mul", F, a[1],
                                      node("pow", F, a[0], node("sub", F, a[1], one)))))
            if id(a[1]) in diff:
                push(a[1], dmul(adj, node("mul", F, n, node("log", F, a[0]))))
        elif op == "neg":
            push(a[0], node("neg", F, adj))
        elif op == "abs":
            push(a[0], node("where", F, node("gt", B, a[0], zero), adj,
                            node("where", F, node("lt", B, a[0], zero),
                                 node("neg", F, adj), zero)))
        elif op in ("minimum", "maximum", "where"):
            if op == "where":
                c, x, y = a
            else:
                c = node("le" if op == "minimum" else "ge", B, a[0], a[1])
                x, y = a
            push(x, node("where", F, c, adj, zero))
            push(y, node("where", F, c, zero, adj))
        elif op == "exp":
            push(a[0], dmul(adj, n))
        elif op == "exp2":
            push(a[0], dmul(adj, node("mul", F, n, g.fconst(_LN2))))
        elif op == "log":
            push(a[0], dmul(adj, node("truediv", F, one, a[0])))
        elif op == "log2":
            push(a[0], dmul(adj, node("truediv", F, one, node("mul", F, a[0], g.fconst(_LN2)))))
        elif op == "sqrt":
            push(a[0], dmul(adj, node("truediv", F, g.fconst(0.5), n)))
        elif op == "tanh":
            push(a[0], dmul(adj, node("sub", F, one, node("mul", F, n, n))))
        elif op == "sin":
            push(a[0], dmul(adj, node("cos", F, a[0])))
        elif op == "cos":
            push(a[0], dmul(adj, node("neg", F, node("sin", F, a[0]))))
        elif op in _LOCAL:
            for x, d in zip(a, _LOCAL[op](lambda o, *xs: node(o, F, *xs), g.fconst, n, *a)):
                if d is not None:
                    push(x, dmul(adj, d))
        else:
            raise TypeError(f"no derivative rule for op {op!r}")
    darrays = {k: tuple(v) for k, v in sorted(darrays.items())}
    roots = [dscore] + [x for k in darrays for idx, adj in darrays[k] for x in (*idx, adj)]
    text = structure_of("grad", roots, len(traced.params))
    return Grad(dscore, darrays, text, hashlib.sha256(text.encode()).hexdigest())


def float_arrays(traced):
    """The names of the float arrays a traced score_mod reads, in its graph's order: the keys of
    a backward's dtensors (an array it reads only through indices or comparisons among them,
    with a zero gradient)."""
    names = []
    for n in topo(traced.out):
        if n.op == "array" and kind_of(n.dtype) == F and n.args[0] not in names:
            names.append(n.args[0])
    return names


def positions(traced, names):
    """The positions (the graph's order of its captured arrays, as codegen.array_order and
    interp number them) of the named arrays, as a sorted tuple; None for names None (every
    array). The key of a gradient selection: names differ between functions of one structure,
    positions do not."""
    if names is None:
        return None
    order = []
    for n in topo(traced.out):
        if n.op == "array" and n.args[0] not in order:
            order.append(n.args[0])
    return tuple(i for i, name in enumerate(order) if name in names)


def asked(dtensors, valid):
    """The captured arrays whose gradients a backward's `dtensors=` asks for: None for every one
    (True), a frozenset of names otherwise (False: the empty set). A collection of names is
    any iterable of str but a str itself (`dtensors="rel"` is refused: write ["rel"]); valid()
    gives the names that may be asked for (the score_mod's captured float arrays) or None
    without a score_mod, and is called only for a non-empty collection. TypeError for a wrong
    type, ValueError for a name that is not one of valid()'s, naming it and listing those."""
    if isinstance(dtensors, (bool, np.bool_)):
        return None if dtensors else frozenset()
    if isinstance(dtensors, (str, bytes)) or not isinstance(dtensors, collections.abc.Iterable):
        hint = f"; for one array write dtensors=[{dtensors!r}]" if isinstance(dtensors, str) else ""
        raise TypeError(f"dtensors must be True (every captured float array), False (none) or a "
                        f"collection of array names (a list, tuple or set of str), got "
                        f"{dtensors!r}{hint}")
    names = list(dtensors)
    wrong = [n for n in names if not isinstance(n, str)]
    if wrong:
        raise TypeError(f"dtensors must hold array names (str), got {wrong[0]!r} in {dtensors!r}")
    names = frozenset(names)
    if not names:
        return names
    ok = valid()
    if ok is None:
        raise ValueError(f"dtensors names {sorted(names)}, but no score_mod is given: without one "
                         "there is no array gradient to ask for (True or False are accepted)")
    unknown = sorted(names - set(ok))
    if unknown:
        have = ", ".join(repr(n) for n in sorted(ok)) or "none"
        raise ValueError(f"dtensors: {unknown[0]!r} is not a float array the score_mod captures "
                         f"(its captured float arrays: {have})")
    return names


def evaluate_grad(traced, g, score, b, h, q_idx, kv_idx, dout, params=None, arrays=None,
                  float_dtype=np.float32):
    """(d_score, {name: d_array}) for the incoming gradient dout, all broadcast together.

    d_score has the broadcast shape of the inputs; d_array the array's shape, in float_dtype,
    with every lookup's adjoint scatter-added (np.add.at) at its normalised indices."""
    arrays = {**traced.arrays, **(arrays or {})}
    values = {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, "dout": dout}
    roots = [g.dscore] + [x for k in g.darrays for idx, adj in g.darrays[k] for x in (*idx, adj)]
    # The forward's lookups are evaluated too, so that one out of range raises here as well.
    load_nodes = [n for n in topo(traced.out) if n.op == "load"]
    memo = _run(roots + load_nodes, values, traced.params if params is None else params,
                arrays, float_dtype)
    shape = np.broadcast_shapes(*(np.shape(v) for v in values.values()))
    d_score = np.broadcast_to(memo[id(g.dscore)], shape).astype(float_dtype)
    out = {}
    for name, terms in g.darrays.items():
        acc = np.zeros(np.shape(arrays[name]), dtype=float_dtype)
        for idx, adj in terms:
            vals = np.broadcast_to(memo[id(adj)], shape)
            if not idx:   # a 0-d array
                acc += vals.sum(dtype=float_dtype)
                continue
            fixed = _normalised(name, acc.shape, [memo[id(i)] for i in idx])
            parts = np.broadcast_arrays(*fixed, vals)
            np.add.at(acc, tuple(p.ravel() for p in parts[:-1]), parts[-1].ravel())
        out[name] = acc
    return d_score, out
