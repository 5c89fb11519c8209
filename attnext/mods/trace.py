"""Tracing score_mod / mask_mod into an expression graph, its evaluation and its derivative.

A score_mod(score, b, h, q_idx, kv_idx) or mask_mod(b, h, q_idx, kv_idx) is called once with
proxy values: `score` is a float ("f32": the accumulation dtype), the indices are int64 ("i64").
Every operation on a proxy records a Node; the returned proxy is the graph's output.

Supported, on traced values (anything else raises TypeError naming the operation):

    Python operators     + - * / // % ** (unary -, +), abs(), < <= > >= == !=, & | ^ ~
    NumPy ufuncs         np.add subtract multiply divide (true_divide) floor_divide remainder
                         (mod) power square negative positive absolute (abs) minimum maximum
                         less less_equal greater greater_equal equal not_equal
                         logical_and logical_or logical_xor logical_not
                         bitwise_and bitwise_or bitwise_xor invert (bitwise_not)
                         exp exp2 log log2 sqrt tanh sin cos tan arcsin arccos arctan sinh
                         cosh arcsinh arccosh arctanh expm1 log1p log10 cbrt floor ceil rint
                         trunc arctan2 hypot copysign (C-library ops of their own); fmin fmax
                         sign reciprocal fabs deg2rad radians rad2deg degrees float_power
                         logaddexp logaddexp2 isnan isinf isfinite signbit (written with the
                         ops above: _COMPOSITES)
    NumPy functions      np.where(cond, a, b), np.clip(x, lo, hi) (lo or hi may be None),
                         np.round / np.around(x, decimals)
    constants            Python / NumPy ints and bools (part of the graph's structure), Python /
                         NumPy floats (kernel parameters: their values are not part of the
                         structure, so a sweep over one compiles once); 0-d NumPy arrays, what
                         NumPy gives for an operation on constants (np.where(flag, 2.0, 1.0)),
                         as their scalars
    lookups              table[i, j] into a captured array (bool, integer, float16/32/64 or
                         bfloat16): a NumPy array, or a CUDA array (below), indexed by
                         integer expressions or ints, every axis in one subscript
                         (table[i][j] raises: on NumPy index arrays it means something else),
                         after any leading int constants (table[0][b, h, q_idx], tab[-1][1][i]:
                         NumPy's view; a constant out of range is an IndexError at trace time);
                         negative indices count from the end. A 0-d
                         captured array is a scalar lookup. .shape / .ndim / .size / .dtype /
                         len() of a captured array are plain Python values.

A sigmoid is written `1 / (1 + np.exp(-x))`; there is no sigmoid op. Unsupported ufuncs (for
example np.spacing, np.nextafter, np.ldexp) raise TypeError naming the ufunc.

Types follow NumPy's promotion, as the reference's call on NumPy arrays does: the indices are
int64 ("i64"), the score a float ("f32": float64 in the reference, the accumulation type in the
backends), a lookup has its array's dtype (bool, int8 ... uint64: INTS; every float dtype is
f32), a NumPy scalar its own, and a Python scalar takes the other operand's (NEP 50; an
OverflowError where a Python int does not fit it, as NumPy raises). The result type of an
arithmetic or bitwise op is what NumPy gives for these operand types (_promoted asks it), so
u8[i] - u8[j] wraps in uint8 and int64 with uint64 is a float; the operands are cast to it
(explicit "cast" nodes; constants are made in it). The exponent of an integer power must be a
non-negative int constant; / and the transcendental ufuncs give f32 (floor, ceil and trunc
give an integer back as it is where the installed NumPy does: _INT_IDENTITY). Comparisons give bool
and are exact between integers of any types, as NumPy 2's (_compare). & | ^ ~ take bool or
integers, never f32. Arithmetic with only bool operands raises (NumPy's bool + bool is a
logical or). Integer // and % by zero give 0, as NumPy does (without its warning). Every float
is computed in f32, whatever NumPy's float type (np.exp of a uint8 is float16 in NumPy).

Python control flow on a traced value (`if`, `while`, `and`/`or`/`not`, chained comparisons,
min()/max(), bool(), int(), float(), math.*) raises TypeError: use np.where and & | ~.
A TypeError or IndexError raised while the function is traced names it first ("score_mod: ...").

How captured arrays are found and named. Before the call, the function is rebuilt with
types.FunctionType from the same code object, with every NumPy or CUDA array it can reach by
name replaced by a named array proxy: closure cells (named by the free variable), globals named
in its code or in the code of functions / lambdas defined inside it (named by the global name;
the globals dict is copied, the module's own is untouched), and default arguments (named by the
parameter); the plain functions it names (helpers, from any module but NumPy's, math's, ...)
are rebuilt alike, so a helper's own closure, module globals and defaults are captured under
their names too. A bound method or a callable object (an instance whose class defines
__call__) is traced alike, called on a view of its self in which the arrays among the
attributes its code names (or the code of a method of its class it names: self.helper()) are
captured as "self.table" (its first parameter's name, a dot, the attribute). The name is the
key of the array's gradient in `dtensors`. Limits: arrays reached any other way (an attribute
of another object, an item of a list or dict, a helper reached as a module's attribute
`mod.helper`, a functools.partial argument) are not captured: indexing one with a traced value
raises TypeError (NumPy asks for __index__), as does indexing a Python list or tuple. Two
different arrays under one name raise TypeError. Other callables (builtins, ufuncs, partials)
are called as they are, without array capture.

FlexAttention habits. torch functions and tensor methods on a traced value (torch.where,
score.exp()), and a torch tensor indexed with one that is not captured (an item of a list, say),
raise TypeError (AttributeError for a method) saying what to write instead: torch calls
Proxy.__torch_function__ for any object that has one, so attnext never imports torch.

Other libraries' arrays. An array in host memory of another library (a torch CPU tensor, a JAX
CPU array: `__dlpack_device__` says kDLCPU) is captured as the NumPy array it shares memory with
(attnext.interop.host_view; a torch bfloat16 tensor, which NumPy cannot read, and a tensor that
requires grad are refused, naming it). Any library's array exposing `__cuda_array_interface__`
or `__dlpack__` on a CUDA device (CuPy, PyTorch, JAX, Numba) is captured like a NumPy array:
attnext.cuda.arrays' as_device_view gives its shape, dtype and device from the protocol, without
reading its memory (a torch tensor that requires grad is refused there: capture
`table.detach()`). The graph and its key see only dtype and shape, so a CUDA and a NumPy array
of one dtype and shape share the generated code. `Traced.arrays` holds the object itself: the
CUDA backend binds it afresh at every call (mod_inputs.py); evaluate() and the CPU backend read
host arrays only, through their NumPy views (checks.py refuses a call on the CPU or the
reference whose function captures a CUDA array). Such a function is traced at every call
(fingerprint.py caches NumPy arrays only).

The graph is hash-consed within one trace (structurally equal nodes are one object), so a
subexpression used twice, e.g. the same lookup, is one node. `Traced.key` is a SHA-256 of the
canonical structure: ops, dtypes, integer constants, the number and positions of the float
parameters, and each array's dtype and shape (not its name, values or id()). The same function
defined twice gives the same key; a different function a different one.

evaluate() runs a graph on NumPy arrays with broadcasting; grad() builds the reverse-mode
derivative as another graph over the same nodes plus a `dout` leaf; evaluate_grad() runs it and
scatter-adds the array gradients (np.add.at: sequential, deterministic).
"""
import hashlib
import math
import sys
from typing import NamedTuple

import ml_dtypes
import numpy as np

from ..lru import LRU
from .fingerprint import _rebound, fingerprint

INPUTS = ("score", "b", "h", "q_idx", "kv_idx")
F, I, B = "f32", "i64", "bool"
# Integer value types: I (the indices') and those a captured array or a NumPy scalar brings; a
# value is computed in its own type, wrapping there, as the reference's NumPy arrays are.
INTS = ("i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")
_NUMPY_OF = {F: np.dtype(np.float64), B: np.dtype(np.bool_),
             **{t: np.dtype(("int" if t[0] == "i" else "uint") + t[1:]) for t in INTS}}

_LN2 = float(np.log(2.0))
_BF16 = np.dtype(ml_dtypes.bfloat16)
_I64_MIN, _I64_MAX, _U64_MAX = -2 ** 63, 2 ** 63 - 1, 2 ** 64 - 1


class Node:
    """One immutable graph node: op, dtype ("f32", an integer type of INTS or "bool") and args.

    Leaves: an input ("score", "b", "h", "q_idx", "kv_idx"; "dout" in gradient graphs), "const"
    (an int of its dtype's range, or a bool, part of the structure), "fconst" (a float fixed by the derivative rules, part
    of the structure), "param" (args = (k,): the k-th float constant of the traced function, its
    value outside the structure) and "array" (args = (name, dtype name, shape)). "load" has args
    (array node, index nodes...). Every other op has Node args.
    """
    __slots__ = ("op", "dtype", "args")

    def __init__(self, op, dtype, args):
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "args", tuple(args))

    def __setattr__(self, name, value):
        raise AttributeError("Node is immutable")

    def __repr__(self):
        return f"Node({format_expr(self)} : {self.dtype})"


_LEAVES = ("score", "b", "h", "q_idx", "kv_idx", "dout", "const", "fconst", "param", "array")


def _children(node):
    if node.op in _LEAVES:
        return ()
    return node.args


_topos = LRU(256)     # id(root) -> (root, its topo)


def topo(*roots):
    """Nodes reachable from roots, each after its arguments (iterative post-order DFS), as a
    tuple. A single root's is remembered (a cached trace's graph is walked by bounds, codegen
    and band at every call: ~10 us a walk); a Node never changes, so its order never does."""
    if len(roots) == 1:
        hit = _topos.get(id(roots[0]))
        if hit is not None and hit[0] is roots[0]:
            return hit[1]
        order = _topo(roots)
        _topos.put(id(roots[0]), (roots[0], order))
        return order
    return _topo(roots)


def _topo(roots):
    order, seen = [], set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            n, done = stack.pop()
            if done:
                order.append(n)
                continue
            if id(n) in seen:
                continue
            seen.add(id(n))
            stack.append((n, True))
            for a in reversed(_children(n)):
                if id(a) not in seen:
                    stack.append((a, False))
    return tuple(order)


_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
          "pow": "**", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
          "and": "&", "or": "|", "xor": "^"}


def format_expr(node, params=None):
    """A readable, fully parenthesised rendering of a node (for messages and reprs)."""
    memo = {}
    for n in topo(node):
        a = [memo.get(id(x)) for x in _children(n)]
        if n.op in ("score", "b", "h", "q_idx", "kv_idx", "dout"):
            s = n.op
        elif n.op == "const":
            s = repr(n.args[0])
        elif n.op == "fconst":
            s = repr(n.args[0])
        elif n.op == "param":
            s = f"p{n.args[0]}" if params is None else f"{params[n.args[0]]!r}"
        elif n.op == "array":
            s = n.args[0]
        elif n.op == "load":
            s = f"{a[0]}[{', '.join(a[1:])}]"
        elif n.op in _INFIX:
            s = f"({a[0]} {_INFIX[n.op]} {a[1]})"
        elif n.op == "neg":
            s = f"(-{a[0]})"
        elif n.op == "not":
            s = f"(~{a[0]})"
        elif n.op == "cast":
            s = f"{n.dtype}({a[0]})"
        else:
            s = f"{n.op}({', '.join(a)})"
        memo[id(n)] = s
    return memo[id(node)]


class _Graph:
    """Hash-consing node factory of one trace; also holds the float parameters and arrays."""

    def __init__(self):
        self._interned = {}
        self.params = []
        self.arrays = {}      # name -> the captured object (np.ndarray or a CUDA array)

    def node(self, op, dtype, *args):
        key = (op, dtype, tuple(("n", id(a)) if isinstance(a, Node) else
                                (type(a).__name__, repr(a)) for a in args))
        n = self._interned.get(key)
        if n is None:
            n = self._interned[key] = Node(op, dtype, args)
        return n

    def param(self, value):
        self.params.append(float(value))
        return Node("param", F, (len(self.params) - 1,))   # never merged: one per occurrence

    def const(self, value, dtype=I):
        """A bool constant, or an int one of integer type dtype (TypeError where it does not fit)."""
        if isinstance(value, (bool, np.bool_)):
            return self.node("const", B, bool(value))
        value = int(value)
        lo, hi = int_range(dtype)
        if not lo <= value <= hi:
            raise TypeError(f"integer constant {value} does not fit in {_NUMPY_OF[dtype]}")
        return self.node("const", dtype, value)

    def fconst(self, value):
        return self.node("fconst", F, float(value))

    def cast(self, n, dtype):
        return n if n.dtype == dtype else self.node("cast", dtype, n)

    def array(self, name, source, desc):
        """The "array" leaf of a captured object `source`, whose shape and dtype `desc` gives
        (source itself for a NumPy array, a DevView for a CUDA one)."""
        known = self.arrays.get(name)
        if known is not None and known is not source:
            raise TypeError(f"two different arrays are captured under the name {name!r}")
        self.arrays[name] = source
        dt = desc.dtype.newbyteorder("=").name
        return self.node("array", value_dtype(desc.dtype), name, dt, tuple(int(s) for s in desc.shape))


def value_dtype(dtype):
    """The traced type of a NumPy dtype's values: B, one of INTS, F (every float, bfloat16 too:
    computed in the accumulation type), None for others."""
    if dtype == np.bool_:
        return B
    if dtype.kind in "iu":
        return ("i" if dtype.kind == "i" else "u") + str(8 * dtype.itemsize)
    if dtype.kind == "f" or dtype == _BF16:
        return F
    return None


def kind_of(dtype):
    """The kind of a traced type: B, I (every integer type) or F."""
    return I if dtype in INTS else dtype


def array_kind(dtype):
    """The kind of an array's elements: B, I, F (bfloat16 is a float), None for others."""
    return kind_of(value_dtype(dtype))


def is_int(dtype):
    """Whether a traced type is an integer one (INTS)."""
    return dtype in INTS


def int_range(dtype):
    """(min, max) of an integer type of INTS."""
    info = np.iinfo(_NUMPY_OF[dtype])
    return int(info.min), int(info.max)


def same_bits(dtype, source):
    """Whether a cast from integer or bool type source to integer type dtype keeps the int64
    the backends hold a value in (csrc/mod_ints.h: its value, a uint64's bits): a bool's 0 / 1,
    a widening, and any cast into int64 or uint64. Any other cast wraps."""
    if source == B or dtype in (I, "u64"):
        return True
    lo, hi = int_range(dtype)
    slo, shi = int_range(source)
    return lo <= slo and shi <= hi


def int_bits(value, dtype):
    """An integer constant of type dtype as the backends hold it: its value in int64, a uint64's
    as its bits."""
    return value - 2 ** 64 if dtype == "u64" and value > _I64_MAX else value


# --- tracing ---------------------------------------------------------------------------------

class Proxy:
    """A traced value: the Node it stands for and the graph it belongs to."""
    __slots__ = ("node", "graph")
    __hash__ = None

    def __init__(self, node, graph):
        self.node = node
        self.graph = graph

    def __repr__(self):
        return f"Proxy({format_expr(self.node, self.graph.params)} : {self.node.dtype})"

    def _expr(self):
        return format_expr(self.node, self.graph.params)

    # Python control flow and conversions ----------------------------------------------------
    def __bool__(self):
        raise TypeError(
            f"Python control flow on a traced value: bool({self._expr()}) (from `if`, `while`, "
            "`and` / `or` / `not`, a chained comparison, min() / max() or bool()); use "
            "np.where(cond, a, b) for values and & | ~ for conditions")

    def __int__(self):
        raise TypeError(f"int() of a traced value {self._expr()}: the value is not known while "
                        "tracing; keep it an expression")

    def __index__(self):
        raise TypeError(
            f"a traced value {self._expr()} used as a Python index (int() / __index__): only "
            "NumPy arrays captured by name (closure, global, default argument or self.attribute "
            "of a callable object) can be indexed with traced values, not lists, tuples, other "
            "objects' attributes or arrays built inside the function")

    def __float__(self):
        raise TypeError(f"float() of a traced value {self._expr()} (math.* functions call it): "
                        "use the NumPy ufunc, e.g. np.exp")

    def __complex__(self):
        raise TypeError(f"complex() of a traced value {self._expr()} is not supported")

    def __round__(self, ndigits=None):
        raise TypeError(f"round() of a traced value {self._expr()} is not supported (NumPy "
                        "arrays refuse it too): use np.round")

    def __trunc__(self):
        raise TypeError(f"math.trunc() of a traced value {self._expr()} is not supported: "
                        "use np.trunc")

    def __floor__(self):
        raise TypeError(f"math.floor() of a traced value {self._expr()} is not supported: "
                        "use np.floor")

    def __ceil__(self):
        raise TypeError(f"math.ceil() of a traced value {self._expr()} is not supported: "
                        "use np.ceil")

    def __iter__(self):
        raise TypeError(f"iterating over a traced value {self._expr()} is not supported")

    def __getitem__(self, key):
        if self.node.op == "load" and len(self.node.args) == 1:
            name = self.node.args[0].args[0]
            raise TypeError(f"{name}[{key!r}] on the captured 0-d array {name!r} is not "
                            f"supported: a 0-d array is traced as its value; write {name}")
        raise TypeError(f"indexing a traced value {self._expr()} with [{key!r}] is not supported: "
                        "only NumPy arrays captured by name can be looked up")

    # FlexAttention habits ---------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        """torch calls this for any torch function given a traced value (torch.where(...),
        torch.tanh(score), tensor[q_idx, kv_idx]): refused with the NumPy to write instead."""
        raise TypeError(_torch_call_message(func, args))

    def __getattr__(self, attr):
        # only for names the class lacks: score.exp(), x.clamp(0, 1), q_idx.item() (torch
        # tensor methods); NumPy's and Python's probes (dunders) get the plain AttributeError
        if attr.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")
        hint = _numpy_for(attr)
        if hint and hint.startswith("np.") and "(" not in hint:
            hint += "(x)"
        raise AttributeError(
            f"a traced value has no method .{attr}() (it is no torch tensor: attnext traces "
            f"NumPy functions and Python operators"
            + (f"): write {hint}" if hint else "; see docs/score_mod.md for the list)"))

    # operators -------------------------------------------------------------------------------
    def __add__(self, o): return _apply("add", self, o)
    def __radd__(self, o): return _apply("add", o, self)
    def __sub__(self, o): return _apply("sub", self, o)
    def __rsub__(self, o): return _apply("sub", o, self)
    def __mul__(self, o): return _apply("mul", self, o)
    def __rmul__(self, o): return _apply("mul", o, self)
    def __truediv__(self, o): return _apply("truediv", self, o)
    def __rtruediv__(self, o): return _apply("truediv", o, self)
    def __floordiv__(self, o): return _apply("floordiv", self, o)
    def __rfloordiv__(self, o): return _apply("floordiv", o, self)
    def __mod__(self, o): return _apply("mod", self, o)
    def __rmod__(self, o): return _apply("mod", o, self)
    def __pow__(self, o): return _apply("pow", self, o)
    def __rpow__(self, o): return _apply("pow", o, self)
    def __and__(self, o): return _apply("and", self, o)
    def __rand__(self, o): return _apply("and", o, self)
    def __or__(self, o): return _apply("or", self, o)
    def __ror__(self, o): return _apply("or", o, self)
    def __xor__(self, o): return _apply("xor", self, o)
    def __rxor__(self, o): return _apply("xor", o, self)
    def __lt__(self, o): return _apply("lt", self, o)
    def __le__(self, o): return _apply("le", self, o)
    def __gt__(self, o): return _apply("gt", self, o)
    def __ge__(self, o): return _apply("ge", self, o)
    def __eq__(self, o): return _apply("eq", self, o)
    def __ne__(self, o): return _apply("ne", self, o)
    def __neg__(self): return _apply("neg", self)
    def __pos__(self): return self
    def __abs__(self): return _apply("abs", self)
    def __invert__(self): return _apply("not", self)

    # NumPy ----------------------------------------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        name = f"np.{ufunc.__name__}"
        if method != "__call__":
            raise TypeError(f"{name}.{method} on a traced value is not supported")
        if kwargs:
            raise TypeError(f"{name} with keyword arguments {sorted(kwargs)} is not supported "
                            "on traced values")
        composite = _COMPOSITES.get(ufunc)
        if composite is not None:
            return composite(name, *(_coerce(x, self.graph, name) for x in inputs))
        op = _UFUNCS.get(ufunc)
        if op is None:
            known = sorted(u.__name__ for u in (*_UFUNCS, *_COMPOSITES))
            raise TypeError(f"unsupported operation {name} on a traced value (supported: "
                            f"{', '.join(known)})")
        if op == "pos":
            return _coerce(inputs[0], self.graph, name)
        if op == "square":
            return _apply("mul", inputs[0], inputs[0], what=name)
        return _apply(op, *inputs, what=name)

    def __array_function__(self, func, types_, args, kwargs):
        if func is np.where:
            if kwargs or len(args) != 3:
                raise TypeError("np.where on traced values needs exactly (cond, a, b)")
            return _apply("where", *args, what="np.where")
        if func is np.clip:
            if kwargs or len(args) != 3 or (args[1] is None and args[2] is None):
                raise TypeError("np.clip on traced values needs exactly (x, lo, hi), one of lo "
                                "and hi may be None")
            x, lo, hi = args            # NumPy's clip is minimum(maximum(x, lo), hi)
            x = x if lo is None else _apply("maximum", x, lo, what="np.clip")
            return x if hi is None else _apply("minimum", x, hi, what="np.clip")
        if func in (np.round, np.around):
            decimals = kwargs.pop("decimals", args[1] if len(args) > 1 else 0)
            if kwargs or len(args) > 2:
                raise TypeError(f"np.{func.__name__} on traced values takes (x, decimals)")
            return _round(args[0], decimals, f"np.{func.__name__}")
        raise TypeError(f"unsupported operation np.{func.__name__} on a traced value")


class ArrayProxy:
    """A captured array while tracing: indexing it records a lookup. source: the captured
    object; array: what gives its shape and dtype (source itself, or a DevView of a CUDA array);
    fixed: the int constants of leading axes already indexed (table[0] of a 3-d table is the
    2-d ArrayProxy with fixed (0,): NumPy's basic indexing, a view), prepended to the lookup."""
    __slots__ = ("name", "source", "array", "graph", "fixed")

    def __init__(self, name, source, array, graph, fixed=()):
        self.name, self.source, self.array, self.graph = name, source, array, graph
        self.fixed = fixed

    @property
    def shape(self): return tuple(self.array.shape[len(self.fixed):])
    @property
    def ndim(self): return len(self.shape)
    @property
    def size(self): return math.prod(self.shape)
    @property
    def dtype(self): return self.array.dtype

    def __len__(self):
        return self.shape[0]

    def __getattr__(self, attr):
        raise TypeError(f"array {self.name!r}: .{attr} is not traced; only lookups "
                        f"{self.name}[i, ...] and .shape / .ndim / .size / .dtype / len() are")

    def __repr__(self):
        return f"ArrayProxy({self._label()}, shape={self.shape}, dtype={self.array.dtype})"

    def _label(self):
        return repr(self.name) + "".join(f"[{i}]" for i in self.fixed)

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        shape = self.shape
        if len(key) < len(shape) and all(_is_int(k) for k in key):
            # a partial index of int constants: the view NumPy gives, looked up later
            for axis, k in enumerate(key):
                _in_bounds(int(k), axis, shape[axis], self._label())
            return ArrayProxy(self.name, self.source, self.array, self.graph,
                              self.fixed + tuple(int(k) for k in key))
        idx = []
        for k in key:
            axis = len(idx)
            if axis >= len(shape):
                raise IndexError(f"too many indices for array {self._label()}: it is "
                                 f"{len(shape)}-dimensional")
            if isinstance(k, Proxy):
                if k.graph is not self.graph:
                    raise TypeError("a traced value from another trace was used")
                if not is_int(k.node.dtype):
                    raise TypeError(f"array {self.name!r} indexed by a {k.node.dtype} expression "
                                    f"{k._expr()}: indices must be integer expressions")
                idx.append(k.node)
            elif _is_int(k):
                _in_bounds(int(k), axis, shape[axis], self._label())
                idx.append(self.graph.const(int(k)))
            else:
                raise TypeError(f"array {self._label()} indexed by {k!r}: only integer "
                                "expressions and ints are supported (no slices, None, ..., "
                                "floats, bools or arrays)")
        if len(idx) < len(shape):
            # table[i][j] is not table[i, j] on NumPy index arrays (the reference's calls).
            raise TypeError(f"array {self._label()} of shape {shape} indexed by "
                            f"{len(idx)} of its {len(shape)} axes: index every axis at "
                            "once, as table[i, j] (table[i][j] means something else on index "
                            "arrays; table[0][i, j] with int constants first is fine)")
        fixed = [self.graph.const(i) for i in self.fixed]
        return _load(self.graph, self.name, self.source, self.array, fixed + idx)

    def _unindexed(self, *_args, **_kw):
        raise TypeError(f"array {self._label()} of shape {self.shape} used in an expression "
                        "without indexing it down to one element")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _unindexed
    __truediv__ = __rtruediv__ = __lt__ = __le__ = __gt__ = __ge__ = _unindexed
    __eq__ = __ne__ = __neg__ = __abs__ = __bool__ = __array__ = _unindexed
    __hash__ = None


def _is_int(k):
    return isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))


def _in_bounds(i, axis, n, label):
    """IndexError, as NumPy words it, for an int constant index out of range at trace time."""
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of bounds for axis {axis} of array {label} "
                         f"with size {n}")


def _load(graph, name, source, desc, idx):
    if array_kind(desc.dtype) is None:
        raise TypeError(f"array {name!r} has dtype {desc.dtype}; lookups need bool, integer or "
                        "float arrays")
    a = graph.array(name, source, desc)
    return Proxy(graph.node("load", a.dtype, a, *idx), graph)


def _scalar(x):
    """A 0-d NumPy array as its scalar: what NumPy gives for an operation on plain constants
    (np.where(True, 2.0, 1.0), np.array(3)) is a constant like any Python or NumPy scalar."""
    return x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x


def _coerce(x, graph, what):
    """A Proxy for an operand: proxies as they are, Python / NumPy scalars as constants."""
    if isinstance(x, Proxy):
        if x.graph is not graph:
            raise TypeError("a traced value from another trace was used")
        return x
    x = _scalar(x)
    if isinstance(x, (bool, np.bool_)):
        return Proxy(graph.const(x), graph)
    if isinstance(x, np.integer):
        return Proxy(graph.const(x, value_dtype(x.dtype)), graph)
    if isinstance(x, int):
        if not _I64_MIN <= x <= _U64_MAX:
            raise TypeError(f"{what}: the integer constant {x} fits in no NumPy integer type")
        return Proxy(graph.const(x, I if x <= _I64_MAX else "u64"), graph)
    if isinstance(x, (float, np.floating)):
        return Proxy(graph.param(x), graph)
    if isinstance(x, ArrayProxy):
        x._unindexed()
    if isinstance(x, np.ndarray):
        raise TypeError(f"{what}: a NumPy array of shape {x.shape} that was not captured by name "
                        "is combined with a traced value; capture it (closure, global or "
                        "default argument) and index it")
    if is_torch(x):
        raise TypeError(f"{what}: {_torch_tensor_message(x)}")
    raise TypeError(f"{what}: unsupported operand of type {type(x).__name__} for a traced value")


# --- FlexAttention habits: torch inside a traced function -------------------------------------
# attnext never imports torch: its objects are known by their type's module.

def is_torch(x):
    """Whether x is a torch object (a tensor, a dtype, ...), without importing torch."""
    return (type(x).__module__ or "").split(".")[0] == "torch"


# torch names whose NumPy (or Python) spelling differs; a name NumPy shares (tanh, where,
# maximum, logical_and, ...) is written np.<name> when the tracer supports it (_numpy_for)
_TORCH_RENAMES = {
    "clamp": "np.clip(x, lo, hi)", "clip": "np.clip(x, lo, hi)", "clamp_min": "np.maximum(x, lo)",
    "clamp_max": "np.minimum(x, hi)", "sigmoid": "1 / (1 + np.exp(-x))",
    "softplus": "np.logaddexp(0, x)", "relu": "np.maximum(x, 0)", "rsqrt": "1 / np.sqrt(x)",
    "neg": "-x", "div": "x / y", "mul": "x * y", "add": "x + y", "sub": "x - y", "pow": "x ** y",
    "eq": "x == y", "ne": "x != y", "lt": "x < y", "le": "x <= y", "gt": "x > y", "ge": "x >= y",
    "full_like": "a Python number, e.g. np.where(cond, x, 1.0)",
    "zeros_like": "0.0 (a Python number)", "ones_like": "1.0 (a Python number)",
    "tensor": "a Python or NumPy scalar", "as_tensor": "a Python or NumPy scalar",
    "item": "the expression itself (its value is not known while tracing)",
    "float": "the expression itself (scores are floats already)",
    "to": "the expression itself (attnext picks the types)", "type": "the expression itself",
    "masked_fill": "np.where(cond, fill, x)", "fmod": "np.fmod has no traced op; % (np.remainder)",
}


def _numpy_for(name):
    """What to write instead of torch's `name` (a function or a tensor method), None if
    nothing traced is close."""
    name = name.rstrip("_")                 # in-place methods: clamp_, add_
    if name in _TORCH_RENAMES:
        return _TORCH_RENAMES[name]
    u = getattr(np, name, None)
    if u is not None and (u in _UFUNCS or u in _COMPOSITES or u in (np.where, np.clip, np.round)):
        return f"np.{name}"
    return None


def _caller_name(obj):
    """The name the user's traced function (the nearest frame outside attnext and torch) has
    for obj: a local or closure variable, a global, or an attribute of a local (self.table);
    None where it has none."""
    f = sys._getframe(1)
    while f is not None and (f.f_globals.get("__name__") or "").split(".")[0] in ("attnext", "torch"):
        f = f.f_back
    if f is None:
        return None
    local = f.f_locals
    for n, v in local.items():
        if v is obj:
            return n
    for n, v in local.items():
        attrs = getattr(v, "__dict__", None)
        if isinstance(attrs, dict):
            for a, w in attrs.items():
                if w is obj:
                    return f"{n}.{a}"
    for n, v in f.f_globals.items():
        if v is obj:
            return n
    return None


def _torch_tensor_message(t):
    """Why a torch tensor cannot be read inside a traced function, and what can."""
    name = _caller_name(t)
    what = f"the torch tensor {name!r}" if name else "a torch tensor"
    shape = tuple(getattr(t, "shape", ()))
    dtype = str(getattr(t, "dtype", "")).replace("torch.", "")
    device = str(getattr(t, "device", "cpu"))
    n = name or "t"
    to_numpy = (f"{n}.float().numpy(), or {n}.view(torch.int16).numpy().view(ml_dtypes.bfloat16)"
                if dtype == "bfloat16" else f"{n}.numpy()")
    return (f"{what} (shape {shape}, {dtype}, on {device}) is read with a traced value, but is "
            f"not captured: attnext looks up arrays captured by name (a closure variable, a "
            f"global, a default argument, or self.attribute of a callable object): host arrays "
            f"(NumPy, a torch CPU tensor, a JAX CPU array) on every backend, CUDA arrays (torch, "
            f"CuPy, JAX: any __cuda_array_interface__ or DLPack array on the call's device) when "
            f"the call runs on the GPU. Capture the tensor by name, or a NumPy copy made outside "
            f"the function ({to_numpy}; .detach() first if it requires grad)")


def _torch_call_message(func, args):
    """The TypeError message for torch's function or tensor method `func` called with a
    traced value among args (Proxy.__torch_function__)."""
    name = getattr(func, "__name__", "?")
    if name in ("__getitem__", "__setitem__") and args and is_torch(args[0]):
        return _torch_tensor_message(args[0])
    method = (getattr(func, "__qualname__", "") or "").split(".")[0] in ("TensorBase", "Tensor")
    label = f"the tensor method .{name}()" if method else f"torch.{name}"
    hint = _numpy_for(name.strip("_"))
    tensors = [a for a in args if is_torch(a)]
    if method and tensors:
        return _torch_tensor_message(tensors[0])
    return (f"{label} on a traced value: "
            + (f"write {hint} (attnext" if hint else "no traced NumPy function is close (attnext")
            + " traces NumPy functions and Python operators, not torch; docs/score_mod.md lists "
              "them)")


_ARITH = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "minimum", "maximum")
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_BITWISE = ("and", "or", "xor")
# Float functions computed in the accumulation dtype (an integer operand is cast first, as NumPy
# computes np.tan(int64) in float64). Each op is named as the C math library's function that
# computes it (the CPU interpreter calls that function, the CUDA code its float twin: tanf),
# mapped to the NumPy ufunc that defines it.
_UNARY_FLOAT = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
    "tanh": np.tanh, "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin,
    "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh, "asinh": np.arcsinh,
    "acosh": np.arccosh, "atanh": np.arctanh, "expm1": np.expm1, "log1p": np.log1p,
    "log10": np.log10, "cbrt": np.cbrt, "floor": np.floor, "ceil": np.ceil, "rint": np.rint,
    "trunc": np.trunc,
}
_BINARY_FLOAT = {"atan2": np.arctan2, "hypot": np.hypot, "copysign": np.copysign}
# the float functions NumPy gives an integer operand back unchanged (np.floor(int64) is int64
# since NumPy 2.3; asked of the NumPy at hand, not assumed)
_INT_IDENTITY = frozenset(op for op, u in _UNARY_FLOAT.items()
                          if u.resolve_dtypes((np.dtype(np.int64), None))[-1] == np.int64)
_OP_NAMES = {**_INFIX, "neg": "unary -", "abs": "abs()", "not": "~"}


def _apply(op, *operands, what=None):
    graph = next(x.graph for x in operands if isinstance(x, Proxy))
    what = what or _OP_NAMES.get(op, op)
    xs = [_coerce(x, graph, what).node for x in operands]
    g = graph
    dts = {x.dtype for x in xs}

    if op in _ARITH:
        if dts == {B}:
            raise TypeError(f"{what} on bool values is not supported; use np.where(c, 1, 0)")
        if op == "pow" and F not in dts:
            e = xs[1]
            if e.op != "const" or e.args[0] < 0:
                raise TypeError(f"{what}: an integer power needs a non-negative int constant "
                                "exponent; use a float base for anything else")
        dt = _promoted(op, operands, what)
        return Proxy(g.node(op, dt, *_as_type(operands, xs, dt, g)), g)
    if op in _COMPARE:
        if F in dts:
            return Proxy(g.node(op, B, *(g.cast(x, F) for x in xs)), g)
        return Proxy(_compare(op, operands, xs, g), g)
    if op in _BITWISE or op == "not":
        if F in dts:
            raise TypeError(f"{what} on a float value is not supported; & | ^ ~ take bool or "
                            "integer values")
        dt = _promoted(op, operands, what)
        return Proxy(g.node(op, dt, *_as_type(operands, xs, dt, g)), g)
    if op in ("land", "lor", "lxor", "lnot"):
        if dts != {B}:
            raise TypeError(f"{what} needs bool operands (got {sorted(dts)})")
        return Proxy(g.node({"land": "and", "lor": "or", "lxor": "xor", "lnot": "not"}[op],
                            B, *xs), g)
    if op in ("neg", "abs"):
        if dts == {B}:
            raise TypeError(f"{what} on a bool value is not supported")
        return Proxy(g.node(op, xs[0].dtype, xs[0]), g)
    if op in _UNARY_FLOAT:
        if op in _INT_IDENTITY and xs[0].dtype != F:
            if xs[0].dtype == B:
                raise TypeError(f"{what} on a bool value is not supported")
            return Proxy(xs[0], g)
        return Proxy(g.node(op, F, g.cast(xs[0], F)), g)
    if op in _BINARY_FLOAT:
        return Proxy(g.node(op, F, *(g.cast(x, F) for x in xs)), g)
    if op == "where":
        c = xs[0]
        if is_int(c.dtype):
            c = g.node("ne", B, c, g.const(0, c.dtype))
        elif c.dtype != B:
            raise TypeError(f"{what}: the condition is a float expression; compare it first")
        dt = _promoted(op, operands, what)
        return Proxy(g.node("where", dt, c, *_as_type(operands[1:], xs[1:], dt, g)), g)
    raise TypeError(f"unsupported operation {what} on a traced value")


# --- NumPy's promotion -----------------------------------------------------------------------
# The reference calls the function on NumPy arrays, so a value's type is what NumPy gives there:
# indices int64, the score float64 (the backends: the accumulation type), a lookup its array's
# dtype, a NumPy scalar its own (strong), a Python scalar the other operand's (weak: NEP 50).
# Arithmetic asks NumPy itself, on one-element samples of those types (an OverflowError where a
# Python int does not fit, as on the reference's call); every float result is F.
_SAMPLE_OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
               "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power,
               "minimum": np.minimum, "maximum": np.maximum, "and": np.bitwise_and,
               "or": np.bitwise_or, "xor": np.bitwise_xor, "not": np.invert,
               "where": lambda a, b: np.where(np.ones(1, np.bool_), a, b)}


def _sample(x):
    """What NumPy's promotion sees of an operand (already _coerce'd): a traced value as a
    one-element array of its type, a Python or NumPy scalar as itself."""
    return np.ones(1, _NUMPY_OF[x.node.dtype]) if isinstance(x, Proxy) else x


def _promoted(op, operands, what):
    """The traced type of NumPy's result of op (_SAMPLE_OPS; "where": of its two values)."""
    samples = [_sample(x) for x in (operands[1:] if op == "where" else operands)]
    try:
        with np.errstate(all="ignore"):
            r = _SAMPLE_OPS[op](*samples)
    except OverflowError as e:
        raise OverflowError(f"{what}: {e}") from None
    except TypeError as e:
        raise TypeError(f"{what}: {e}") from None
    dt = value_dtype(np.asarray(r).dtype)
    if dt is None:
        raise TypeError(f"{what} gives NumPy dtype {np.asarray(r).dtype}, which is not traced")
    return dt


def _weak_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _as_type(operands, xs, dt, g):
    """The operands' nodes in type dt: an int or bool constant as a constant of dt itself
    (wrapped into it, as np.where does a Python int; elsewhere NumPy has checked that it fits),
    anything else cast."""
    out = []
    for x, n in zip(operands, xs):
        if n.op == "const" and is_int(dt):
            lo, hi = int_range(dt)
            n = g.const((n.args[0] - lo) % (hi - lo + 1) + lo, dt)
        out.append(g.cast(n, dt))
    return out


_SWAPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


def _compare(op, operands, xs, g):
    """An integer / bool comparison, exact as NumPy 2's (its loops compare int64 with uint64
    exactly, and a Python int with any integer array, in range or not): in the operands' common
    type where there is one, else in int64 or uint64 where it holds both, else (a signed value
    against a uint64) the sign first."""
    a, b = xs
    weak = [_weak_int(x) for x in operands]
    if weak[0] or weak[1]:    # a Python int: in the other's type where it fits
        k = 0 if weak[0] else 1
        other = xs[1 - k].dtype
        v, dt = operands[k], I if other == B else other
        lo, hi = int_range(dt)
        c = g.const(v, dt) if lo <= v <= hi else xs[k]      # else as _coerce typed it
        a, b = (c, b) if k == 0 else (a, c)
    if a.dtype == b.dtype:
        return g.node(op, B, a, b)
    if "u64" not in (a.dtype, b.dtype):           # int64 holds both
        return g.node(op, B, g.cast(a, I), g.cast(b, I))
    signed = [x.dtype[0] == "i" for x in (a, b)]
    if not any(signed):       # uint64 against unsigned or bool
        return g.node(op, B, g.cast(a, "u64"), g.cast(b, "u64"))
    if not signed[0]:
        a, b, op = b, a, _SWAPPED[op]
    s = g.cast(a, I)          # s (signed) op u (uint64): a negative s is below every u
    neg = g.node("lt", B, s, g.const(0))
    cmp = g.node(op, B, g.cast(s, "u64"), b)
    if op in ("lt", "le", "ne"):
        return g.node("or", B, neg, cmp)
    return g.node("and", B, g.node("not", B, neg), cmp)


_UFUNCS = {
    np.add: "add", np.subtract: "sub", np.multiply: "mul", np.true_divide: "truediv",
    np.floor_divide: "floordiv", np.remainder: "mod", np.power: "pow", np.square: "square",
    np.negative: "neg", np.positive: "pos", np.absolute: "abs",
    np.minimum: "minimum", np.maximum: "maximum",
    np.less: "lt", np.less_equal: "le", np.greater: "gt", np.greater_equal: "ge",
    np.equal: "eq", np.not_equal: "ne",
    np.logical_and: "land", np.logical_or: "lor", np.logical_xor: "lxor", np.logical_not: "lnot",
    np.bitwise_and: "and", np.bitwise_or: "or", np.bitwise_xor: "xor", np.invert: "not",
    **{u: op for op, u in {**_UNARY_FLOAT, **_BINARY_FLOAT}.items()},
}


# --- ufuncs written with the ops above (their dtype rules and derivatives are those ops') ------

def _fconst(x, value):
    return Proxy(x.graph.fconst(value), x.graph)


def _float(x):
    return Proxy(x.graph.cast(x.node, F), x.graph)


def _no_bool(what, *xs):
    if all(x.node.dtype == B for x in xs):
        raise TypeError(f"{what} on bool values is not supported")


def _fmin_fmax(pick):
    """np.fmin / np.fmax: np.minimum / np.maximum less NaN, which only two NaN give; integers
    compare as they are."""
    def build(what, a, b):
        _no_bool(what, a, b)
        m = _apply(pick, a, b, what=what)
        if F not in (a.node.dtype, b.node.dtype):
            return m
        m = _apply("where", _apply("ne", b, b, what=what), a, m, what=what)
        return _apply("where", _apply("ne", a, a, what=what), b, m, what=what)
    return build


def _sign(what, x):
    """-1, 0 or 1 in x's dtype; NaN for NaN (x * 0), as np.sign."""
    _no_bool(what, x)
    zero = _apply("mul", x, 0, what=what)
    return _apply("where", _apply("gt", x, 0, what=what), 1,
                  _apply("where", _apply("lt", x, 0, what=what), -1, zero, what=what), what=what)


def _reciprocal(what, x):
    if x.node.dtype != F:
        raise TypeError(f"{what} of an integer value is not supported (NumPy's integer "
                        "reciprocal truncates to 0 or fails); write 1 / x for a float")
    return _apply("truediv", 1, x, what=what)


def _logaddexp(ln2, exp):
    """np.logaddexp / np.logaddexp2 as NumPy computes them (npy_logaddexp): the larger operand
    plus log(1 + exp(-|a - b|)); equal ones (infinities included) give a + log(2), written
    a / 2 + b / 2 + log(2) there so that the derivative is 1/2 to each, not 1 to one."""
    def build(what, a, b):
        a, b = _float(a), _float(b)
        half = _fconst(a, 0.5)
        tie = _apply("add", _apply("add", _apply("mul", a, half), _apply("mul", b, half)),
                     _fconst(a, ln2))
        gap = _apply("neg", _apply("abs", _apply("sub", a, b)))
        rest = _apply("log1p", _apply(exp, gap))
        if ln2 != _LN2:         # base 2: log2(1 + y) = log1p(y) / log(2)
            rest = _apply("mul", rest, _fconst(a, 1 / _LN2))
        far = _apply("add", _apply("maximum", a, b), rest)
        return _apply("where", _apply("eq", a, b), tie, far, what=what)
    return build


def _isinf_isfinite(op, ints):
    """|x| == inf / |x| < inf (false for NaN); integers are always finite."""
    def build(what, x):
        if x.node.dtype != F:
            return Proxy(x.graph.const(ints), x.graph)
        return _apply(op, _apply("abs", x), _fconst(x, math.inf), what=what)
    return build


def _round(x, decimals, what):
    """np.round(x, decimals) as NumPy computes it for floats: rint(x * 10**d) / 10**d, or with
    d < 0 rint(x / 10**-d) * 10**-d; integers with d >= 0 are returned as they are."""
    if not isinstance(decimals, (int, np.integer)) or isinstance(decimals, (bool, np.bool_)):
        raise TypeError(f"{what}: decimals must be an int, got {decimals!r}")
    if x.node.dtype != F:
        if decimals < 0:
            raise TypeError(f"{what} of an integer value to {decimals} decimals is not "
                            "supported")
        _no_bool(what, x)
        return x
    if decimals == 0:
        return _apply("rint", x, what=what)
    f = _fconst(x, 10.0 ** abs(decimals))
    up, down = ("mul", "truediv") if decimals > 0 else ("truediv", "mul")
    return _apply(down, _apply("rint", _apply(up, x, f, what=what), what=what), f, what=what)


_COMPOSITES = {
    np.fmin: _fmin_fmax("minimum"), np.fmax: _fmin_fmax("maximum"),
    np.sign: _sign, np.reciprocal: _reciprocal,
    np.fabs: lambda what, x: _apply("abs", _float(x), what=what),
    np.deg2rad: lambda what, x: _apply("mul", x, _fconst(x, math.pi / 180), what=what),
    np.radians: lambda what, x: _apply("mul", x, _fconst(x, math.pi / 180), what=what),
    np.rad2deg: lambda what, x: _apply("mul", x, _fconst(x, 180 / math.pi), what=what),
    np.degrees: lambda what, x: _apply("mul", x, _fconst(x, 180 / math.pi), what=what),
    np.float_power: lambda what, a, b: _apply("pow", _float(a), _float(b), what=what),
    np.logaddexp: _logaddexp(_LN2, "exp"), np.logaddexp2: _logaddexp(1.0, "exp2"),
    np.isnan: lambda what, x: (_apply("ne", x, x, what=what) if x.node.dtype == F
                               else Proxy(x.graph.const(False), x.graph)),
    np.isinf: _isinf_isfinite("eq", False), np.isfinite: _isinf_isfinite("lt", True),
    np.signbit: lambda what, x: (_apply("lt", _apply("copysign", 1, x, what=what), 0, what=what)
                                 if x.node.dtype == F else _apply("lt", x, 0, what=what)),
}


def _with_array_proxies(fn, graph):
    """fn rebuilt so that the arrays it names are ArrayProxy objects (module docstring)."""
    def proxy(name, value, desc):
        if desc.ndim == 0:
            return _load(graph, name, value, desc, [])
        return ArrayProxy(name, value, desc, graph)
    return _rebound(fn, proxy)


class Traced(NamedTuple):
    """A traced score_mod / mask_mod.

    kind "score_mod" or "mask_mod"; out the output Node (f32 or bool); params the float constants
    in the order they were met (kernel parameters); arrays name -> the captured array (the
    object itself, a NumPy or a CUDA array: its values are read at evaluation or binding);
    structure the canonical text of the graph and key its SHA-256 (see the module docstring);
    graph the node factory (grad() adds to it).
    """
    kind: str
    out: Node
    params: tuple
    arrays: dict
    structure: str
    key: str
    graph: _Graph


def structure_of(kind, roots, nparams):
    """Canonical text of the graphs at roots: one line per node, in post-order, arrays by
    position (dtype and shape, not name)."""
    num, arr_num, lines = {}, {}, [f"{kind} params={nparams}"]
    for n in topo(*roots):
        num[id(n)] = len(num)
        if n.op == "array":
            arr_num.setdefault(n.args[0], len(arr_num))
            body = f"array#{arr_num[n.args[0]]} {n.args[1]} {n.args[2]}"
        elif n.op in ("const", "fconst", "param"):
            body = f"{n.op} {n.args[0]!r}"
        elif n.op in _LEAVES:
            body = n.op
        else:
            body = f"{n.op} " + " ".join(f"%{num[id(a)]}" for a in n.args)
        lines.append(f"%{num[id(n)]} = {n.dtype} {body}")
    lines.append("return " + " ".join(f"%{num[id(r)]}" for r in roots))
    return "\n".join(lines)


def _naming(kind, e):
    """The TypeError / IndexError / AttributeError e, raised while tracing fn, with a message
    that names the argument (score_mod or mask_mod) first; other exceptions as they are."""
    if type(e) not in (TypeError, IndexError, AttributeError) or str(e).startswith(kind):
        return e
    return type(e)(f"{kind}: {e}")


# --- the trace cache ---------------------------------------------------------------------------
# Tracing costs 40-85 us a call (bench/lab_host.py --fake): a GPU call with a mask_mod spent a
# third of its host time here. A function is traced again only when something tracing read may
# have changed (fingerprint.py); where that cannot be known, every time.
TRACE_CACHE_CAPACITY = 64


# (kind, fingerprint) -> the Traced with its arrays' names only: the graph depends on each
# captured array's name, dtype and shape, all in the key, so a hit takes the arrays met now;
# nothing here keeps a user's array alive or a weak reference to it (NumPy refuses to resize an
# array that has one)
_traces = LRU(TRACE_CACHE_CAPACITY)


def _cached_trace(fn, kind):
    found = fingerprint(fn)
    if found is None:
        return _trace(fn, kind)
    fp, captured = found
    key = (kind, fp)                         # hashable: _fp admits only hashable parts
    hit = _traces.get(key)
    if hit is not None:
        return hit._replace(arrays={name: captured[name] for name in hit.arrays})
    traced = _trace(fn, kind)
    _traces.put(key, traced._replace(arrays=dict.fromkeys(traced.arrays)))
    return traced


def trace_cache_clear():
    """Forgets every cached trace."""
    _traces.clear()


def _trace(fn, kind):
    if not callable(fn):
        raise TypeError(f"{kind} must be callable, got {type(fn).__name__}")
    graph = _Graph()
    inputs = INPUTS if kind == "score_mod" else INPUTS[1:]
    proxies = [Proxy(graph.node(n, F if n == "score" else I), graph) for n in inputs]
    try:
        result = _with_array_proxies(fn, graph)(*proxies)
    except IndexError as e:
        # NumPy refuses a proxy as an index with this IndexError, never calling __index__.
        if not str(e).startswith("only integers, slices"):
            raise _naming(kind, e) from e
        raise TypeError(f"{kind}: a NumPy array that was not captured by name (an attribute "
                        "of an object other than the callable's own self, an item of a "
                        "container, an array built inside the function, ...) was indexed by a "
                        "traced value; only arrays captured by name (closure, global, default "
                        "argument, or self.attribute of a callable object or bound method) can "
                        "be looked up") from e
    except TypeError as e:
        if e.__traceback__.tb_next is None:
            # raised by the call itself, not inside fn: a callable whose signature Python cannot
            # read (a builtin such as int) refused the arguments
            raise TypeError(f"{kind} must take {len(inputs)} arguments ({', '.join(inputs)}); "
                            f"{getattr(fn, '__name__', type(fn).__name__)} refused them: {e}") from e
        raise _naming(kind, e) from e
    except AttributeError as e:      # score.exp(): a torch tensor method (Proxy.__getattr__)
        raise _naming(kind, e) from e
    if isinstance(result, ArrayProxy):
        result._unindexed()
    result = _scalar(result)
    if kind == "score_mod":
        if isinstance(result, (bool, np.bool_)) or (
                isinstance(result, Proxy) and result.node.dtype == B):
            raise TypeError("score_mod returned a bool value; it must return a float score "
                            "(a mask belongs in mask_mod)")
        if not isinstance(result, (Proxy, int, float, np.integer, np.floating)):
            raise TypeError(f"score_mod must return a float expression, got "
                            f"{type(result).__name__}")
        out = graph.cast(_coerce(result, graph, "return").node, F)
    else:
        if isinstance(result, (bool, np.bool_)) or (
                isinstance(result, Proxy) and result.node.dtype == B):
            out = _coerce(result, graph, "return").node
        else:
            got = (f"a {result.node.dtype} expression" if isinstance(result, Proxy)
                   else type(result).__name__)
            raise TypeError(f"mask_mod must return a bool expression, got {got}")
    traced = _made(kind, out, tuple(graph.params), graph.arrays, graph)
    graph.arrays = {}             # read while tracing only: a kept graph keeps no array alive
    return traced


def _made(kind, out, params, captured, graph):
    """The Traced of output node out: the arrays it reaches (from captured, name -> object), its
    structure and key."""
    arrays = {n.args[0]: captured[n.args[0]] for n in topo(out) if n.op == "array"}
    text = structure_of(kind, [out], len(params))
    return Traced(kind, out, params, arrays, text, hashlib.sha256(text.encode()).hexdigest(), graph)


def with_output(traced, out):
    """traced with another output node of its graph (attnext/band.py: a mask_mod less its band);
    the float constants stay whole, numbered as in traced."""
    return _made(traced.kind, out, traced.params, traced.arrays, traced.graph)


def trace_score_mod(fn):
    """Trace score_mod(score, b, h, q_idx, kv_idx) -> float into a Traced (cached: _fingerprint)."""
    return _cached_trace(fn, "score_mod")


def trace_mask_mod(fn):
    """Trace mask_mod(b, h, q_idx, kv_idx) -> bool into a Traced (cached: _fingerprint)."""
    return _cached_trace(fn, "mask_mod")


# --- evaluation ------------------------------------------------------------------------------

_EVAL = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
    "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power, "neg": np.negative,
    "abs": np.absolute, "minimum": np.minimum, "maximum": np.maximum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal,
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor, "not": np.invert,
    **_UNARY_FLOAT, **_BINARY_FLOAT, "where": np.where,
    # dmul(g, d) = g * d, but 0 where g == 0: an adjoint of 0 (an unchosen np.where branch, a
    # masked pair) contributes 0 even where the local derivative d is inf or NaN.
    "dmul": lambda g, d: np.where(g == 0, np.zeros((), g.dtype), g * d),
}


def _np_dtype(dtype, float_dtype):
    return float_dtype if dtype == F else _NUMPY_OF[dtype].type


def _normalised(name, shape, idx):
    """int64 index arrays with negative ones counted from the end; IndexError naming the array
    if one is out of range (checked before anything is read)."""
    idx = [np.asarray(i, dtype=np.int64) for i in idx]
    fixed = []
    for axis, (i, n) in enumerate(zip(idx, shape)):
        bad = (i < -n) | (i >= n)
        if bad.any():
            raise IndexError(f"index {int(i[bad].flat[0])} is out of bounds for axis {axis} of "
                             f"array {name!r} with size {n}")
        fixed.append(np.where(i < 0, i + n, i))
    return tuple(fixed)


def _run(roots, values, params, arrays, float_dtype):
    """Evaluate the nodes reachable from roots: id(node) -> value; values maps the input leaves'
    op names to arrays."""
    memo = {}
    with np.errstate(all="ignore"):
        for n in topo(*roots):
            a = [memo[id(x)] for x in _children(n)]
            if n.op in values:
                v = values[n.op]
                if v is None:
                    raise ValueError(f"evaluate needs a value for {n.op!r}")
                v = np.asarray(v, dtype=_np_dtype(n.dtype, float_dtype))
            elif n.op == "const":
                v = _np_dtype(n.dtype, float_dtype)(n.args[0])
            elif n.op == "fconst":
                v = float_dtype(n.args[0])
            elif n.op == "param":
                v = float_dtype(params[n.args[0]])
            elif n.op == "array":
                v = None
            elif n.op == "load":
                name = n.args[0].args[0]
                arr = np.asarray(arrays[name])
                v = arr[_normalised(name, arr.shape, a[1:])]
            elif n.op == "cast":
                v = np.asarray(a[0]).astype(_np_dtype(n.dtype, float_dtype))
            else:
                fn = _EVAL.get(n.op)
                if fn is None:
                    raise TypeError(f"evaluate: no rule for op {n.op!r}")
                v = fn(*a)
            if v is not None:
                v = np.asarray(v)
                want = _np_dtype(n.dtype, float_dtype)
                if v.dtype != want:
                    v = v.astype(want)
            memo[id(n)] = v
    return memo


def evaluate(traced, score, b, h, q_idx, kv_idx, params=None, arrays=None,
             float_dtype=np.float32):
    """traced's output on NumPy arrays (broadcast together), floats in float_dtype, indices in
    int64. score is ignored (may be None) for a mask_mod. params replaces traced.params and
    arrays (name -> array) the captured arrays, which are otherwise read as they are now."""
    values = {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
    memo = _run([traced.out], values, traced.params if params is None else params,
                {**traced.arrays, **(arrays or {})}, float_dtype)
    return memo[id(traced.out)]
