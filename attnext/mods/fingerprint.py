"""What a score_mod / mask_mod reaches: the arrays it captures by name, and the fingerprint of
everything else tracing may read.

Captured arrays (trace.py's module docstring says how they are found and named): _rebound
rebuilds a function with each array it names replaced, captured_arrays lists them, with_arrays
swaps them. fingerprint(fn) keys trace.py's cache of traces: a function is traced again only
when something tracing read may have changed; where that cannot be known, every time.
"""
import functools
import math
import operator
import types

import ml_dtypes
import numpy as np

from .. import interop
from ..cuda.devview import may_be_device_array


def _global_names(code):
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _captured(name, value):
    """What tracing sees of a value fn names: a NumPy array itself, NumPy's view of another
    library's host array (a torch CPU tensor, a JAX CPU array: attnext.interop), a DevView of a
    CUDA array (shape, dtype, device; its memory is not read), None for anything else. An array
    whose library refuses to share it (or whose dtype NumPy cannot read) raises, naming it."""
    if isinstance(value, np.ndarray):
        return value
    if not may_be_device_array(value):
        return None
    from ..cuda import arrays as device        # the CUDA host side: loaded only when such an object is captured
    try:
        view = device.as_device_view(value)
        return view if view is not None else interop.host_view(name, value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"captured array {name!r}: {e}") from None


def _helper(value):
    """Whether value is a plain function whose arrays tracing captures too: a helper the traced
    function calls (not NumPy's, math's, ...: their module-level arrays are no user's)."""
    return (isinstance(value, types.FunctionType)
            and (value.__module__ or "").split(".")[0] not in _STABLE_MODULES)


def _rebound(fn, replace, memo=None, first=None):
    """fn rebuilt from the same code object with every NumPy or CUDA array it names (closure
    cells, globals named in its code, default arguments; module docstring) replaced by
    replace(name, value, desc), desc what _captured gives; the plain functions it names (a
    helper, in this module or another) rebuilt alike, so that a helper's own globals are
    captured under their names. fn itself where nothing is replaced. Non-function callables
    are returned as they are. memo: id(function) -> its rebuilt self (None while it is being
    rebuilt: a recursive helper keeps calling the original). A bound method or a callable
    object (its class's __call__) is its function rebound, called on a _SelfView of its self.
    first(name, value), where given, replaces each named value before _captured sees it."""
    if not isinstance(fn, types.FunctionType):
        bound = _bound_self(fn)
        if bound is None:
            return fn
        func, obj = bound
        view = _SelfView.of(func, obj, replace, memo if memo is not None else {})
        return fn if view is None else types.MethodType(_rebound(func, replace, view._memo, first), view)
    memo = {} if memo is None else memo
    if id(fn) in memo:
        return memo[id(fn)] or fn
    memo[id(fn)] = None

    def swap(name, value):
        if _helper(value):
            return _rebound(value, replace, memo, first)
        if first is not None:
            value = first(name, value)
        desc = _captured(name, value)
        return value if desc is None else replace(name, value, desc)

    code = fn.__code__
    closure = fn.__closure__
    if closure is not None:
        cells = []
        for name, cell in zip(code.co_freevars, closure):
            try:
                value = cell.cell_contents
            except ValueError:   # an empty cell (a variable assigned later)
                cells.append(cell)
                continue
            new = swap(name, value)
            cells.append(cell if new is value else types.CellType(new))
        closure = tuple(cells)
    glob = fn.__globals__
    swapped = {n: swap(n, glob[n]) for n in _global_names(code) if n in glob}
    swapped = {n: v for n, v in swapped.items() if v is not glob[n]}
    if swapped:
        glob = dict(glob)
        glob.update(swapped)
    defaults = fn.__defaults__
    if defaults:
        pos = code.co_varnames[:code.co_argcount]
        defaults = tuple(swap(n, d) for n, d in zip(pos[len(pos) - len(defaults):], defaults))
    kwdefaults = fn.__kwdefaults__ and {n: swap(n, d) for n, d in fn.__kwdefaults__.items()}
    same = (glob is fn.__globals__
            and all(a is b for a, b in zip(closure or (), fn.__closure__ or ()))
            and all(v is fn.__kwdefaults__[n] for n, v in (kwdefaults or {}).items())
            and all(a is b for a, b in zip(defaults or (), fn.__defaults__ or ())))
    if same:
        new = fn
    else:
        new = types.FunctionType(code, glob, fn.__name__, defaults, closure)
        new.__kwdefaults__ = kwdefaults or None
    memo[id(fn)] = new
    return new


def _bound_self(fn):
    """(function, self) of a bound method or a callable object whose class defines __call__ in
    Python (a user's: not NumPy's, torch's, functools.partial ...); None for anything else."""
    if isinstance(fn, types.MethodType):
        func, obj = fn.__func__, fn.__self__
    elif isinstance(fn, (types.BuiltinFunctionType, np.ufunc, type)) or not callable(fn):
        return None
    else:
        func, obj = _method(type(fn), "__call__"), fn
    if (not _helper(func) or isinstance(obj, (type, types.ModuleType))
            or (type(obj).__module__ or "").split(".")[0] in _FOREIGN_MODULES
            or not isinstance(getattr(obj, "__dict__", None), dict)):
        return None
    return func, obj


def _method(cls, name):
    """The plain function a class defines as method `name` (found along its MRO, as Python
    finds it), None for anything else: a staticmethod, a classmethod, a property, a builtin."""
    for klass in cls.__mro__:
        if name in vars(klass):
            f = vars(klass)[name]
            return f if isinstance(f, types.FunctionType) else None
    return None


class _SelfView:
    """The `self` a callable object's __call__ (or a bound method) is traced with: the arrays
    among the attributes its code names (its own, and those of the methods of its class it
    names, self.helper()) replaced as _rebound replaces arrays, each named "self.table" (the
    function's first parameter, a dot, the attribute); the class's methods bound to the view;
    every other attribute read from the object itself."""
    __slots__ = ("_obj", "_swapped", "_memo", "_replace")

    @classmethod
    def of(cls, func, obj, replace, memo):
        """The view, or None where no attribute is replaced (the object is called as it is).
        obj may be a view itself (a function rebuilt twice: the reference calls
        numpy_views(with_arrays(...))): the new view is of its object, its attributes as that
        view gives them."""
        if isinstance(obj, _SelfView):
            obj, attrs = obj._obj, {**vars(obj._obj), **obj._swapped}
        else:
            attrs = vars(obj)
        me = func.__code__.co_varnames[0] if func.__code__.co_argcount else "self"
        names, todo, seen = set(), [func], set()
        while todo:                     # the attribute names of func and the methods it names
            f = todo.pop()
            if id(f) in seen:
                continue
            seen.add(id(f))
            for n in _global_names(f.__code__):
                names.add(n)
                m = _method(type(obj), n)
                if m is not None:
                    todo.append(m)
        swapped = {}
        for n in sorted(names & attrs.keys()):
            label = f"{me}.{n}"
            desc = _captured(label, attrs[n])
            if desc is not None:
                swapped[n] = replace(label, attrs[n], desc)
        if not swapped:
            return None
        view = object.__new__(cls)
        view._obj, view._swapped, view._memo, view._replace = obj, swapped, memo, replace
        return view

    def __getattr__(self, name):
        if name in self._swapped:
            return self._swapped[name]
        method = _method(type(self._obj), name)
        if method is not None and name not in vars(self._obj):
            return types.MethodType(_rebound(method, self._replace, self._memo), self)
        return getattr(self._obj, name)

    def __repr__(self):
        return repr(self._obj)


# modules whose callable objects are not a user's (their __call__ is not rebound)
_FOREIGN_MODULES = ("numpy", "functools", "torch", "builtins")


def _names_arrays(fn, views):
    """name -> each array fn names the way tracing captures them: the object itself, or with
    views how attnext reads it (_rebound's desc)."""
    found = {}

    def record(name, value, desc):
        found[name] = desc if views else value
        return value
    _rebound(fn, record)
    return found


def captured_arrays(fn):
    """name -> array (the object itself: a NumPy array, another library's host array or a CUDA
    array), for every array fn names the way tracing captures them (closure, globals named in
    its code, defaults), whether or not fn reads it."""
    return _names_arrays(fn, views=False)


def captured_views(fn):
    """captured_arrays(fn) as attnext reads them: a NumPy array for a host array of any library
    (NumPy's view of a torch CPU tensor's memory, say), a DevView for a CUDA array."""
    return _names_arrays(fn, views=True)


def numpy_views(fn):
    """fn with every captured host array of another library replaced by NumPy's view of it (fn
    itself where there is none): what the reference and attnext.block_mask call, on NumPy index
    arrays, so that a torch CPU tensor is indexed as the NumPy array it shares memory with."""
    swapped = []

    def replace(name, value, desc):
        if isinstance(desc, np.ndarray) and desc is not value:
            swapped.append(name)
            return desc
        return value
    new = _rebound(fn, replace)
    return new if swapped else fn


def with_arrays(fn, arrays):
    """fn rebuilt with the captured arrays named in `arrays` (name -> array) replaced."""
    return _rebound(fn, lambda name, value, desc: arrays.get(name, value))


def with_values(fn, first):
    """fn rebuilt with each value it names the way tracing captures arrays replaced by
    first(name, value) before attnext reads it (attnext.torch: its captured tensors detached,
    which attnext may then read; the originals, which require grad, it refuses)."""
    return _rebound(fn, lambda name, value, desc: value, first=first)


# modules whose attributes a traced function may read (np.where, math.pi) and that never change;
# a name bound to any other module (a user's, which importlib.reload refills) is not cached
_STABLE_MODULES = ("numpy", "math", "operator", "ml_dtypes")
# builtins that read state a fingerprint cannot see (names, files, ids, iterators)
_DYNAMIC_BUILTINS = frozenset({"globals", "vars", "locals", "eval", "exec", "compile", "__import__",
                               "open", "input", "id", "hash", "iter", "next", "breakpoint"})
_STATEFUL_NAMES = frozenset({"random"})      # np.random.*: state behind a stable module
_PLAIN = (type(None), bool, int, str, bytes)
_EXACT_FLOATS = (float, complex, np.float64, np.complex128)


class _Uncacheable(Exception):
    pass


def fingerprint(fn):
    """(fingerprint, captured) of a plain Python function, or None where it cannot be known that
    tracing it again would give the same graph. The fingerprint (hashable, compared with ==)
    changes whenever what tracing reads may have: the code, the closure cells, the globals and
    builtins its code names (present or not), the defaults, the function's attributes,
    recursively through the plain functions among them (each by the order it was met, not its
    code alone); exact Python and NumPy scalars (floats by repr: -0.0 is not 0.0; NumPy ones with
    their dtype); the arrays the function and its helpers name -- the ones tracing captures, whose
    contents are read at every call -- by name, shape and dtype; the stable modules, their
    functions and the builtins by identity, and of every stable module met (its submodules the
    code names too) each attribute the code names (or holds as a string) that is no longer what
    the module had at attnext's import (or first sight): np.tanh replaced by a user's function
    counts as that function. Anything else makes the function uncacheable: an array reached any
    other way (its contents may be read while tracing), a list, dict, object or subclass, a bound
    method, a CUDA array, a user module, np.random, globals() / eval(). captured: name -> the
    array tracing captures under that name, now."""
    if not isinstance(fn, types.FunctionType):
        return None
    captured, walk = {}, _Walk()
    try:
        fp = _fp_function(fn, captured, walk, 0, named=True)
        return (fp, _modules_fp(walk, captured)), captured
    except (_Uncacheable, RecursionError):
        return None


class _Walk:
    """What a fingerprint met: the plain functions in order (id -> place), the stable modules (id
    -> module, in order) and the names the functions' code holds (in order)."""
    __slots__ = ("order", "modules", "names")

    def __init__(self):
        self.order, self.modules, self.names = {}, {}, {}


_MISSING = object()
_first_seen = {}          # stable module -> its attributes when attnext first saw it


def _originals(module):
    found = _first_seen.get(module)
    if found is None:
        found = _first_seen.setdefault(module, dict(module.__dict__))
    return found


for _module in (np, math, operator, ml_dtypes):   # as imported, before a caller could patch them
    _originals(_module)


def _modules_fp(walk, captured):
    """The stable modules' part of a fingerprint: (module, name, value's part) for each name the
    code holds whose attribute is not what the module first had (replaced, added or removed);
    the unchanged submodules among them are looked into too (np.emath.sqrt). A replacement's own
    part may meet more names and modules: until none is left unchecked."""
    out, checked, grown = [], set(), True
    while grown:
        grown = False
        for m in list(walk.modules.values()):
            now, first = m.__dict__, _originals(m)
            for n in list(walk.names):
                if (id(m), n) in checked:
                    continue
                checked.add((id(m), n))
                grown = True
                v = now.get(n, _MISSING)
                if v is first.get(n, _MISSING):
                    if isinstance(v, types.ModuleType) and v.__name__.split(".")[0] in _STABLE_MODULES:
                        walk.modules.setdefault(id(v), v)
                    continue
                out.append((m.__name__, n, "absent" if v is _MISSING else _fp(v, captured, walk, 1)))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _code_names(code):
    """(the global and attribute names code and its nested code use, the same with its string
    constants (getattr(np, "tanh")), in a fixed order)."""
    names, strings = set(code.co_names), set()
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            inner, inner_all = _code_names(c)
            names |= set(inner)
            strings |= set(inner_all)
        elif isinstance(c, str):
            strings.add(c)
    return tuple(sorted(names)), tuple(sorted(names | strings))


def _fp(x, captured, walk, depth, name=None):
    """x's part of a fingerprint; name: the name tracing captures x under (a value the traced
    function itself names), else None."""
    if depth > 8:
        raise _Uncacheable
    t = type(x)
    if t in _EXACT_FLOATS:
        return (t, repr(x))
    if t in _PLAIN:
        return (t, x)
    if isinstance(x, np.generic):
        if x.dtype.hasobject or t.__module__ != "numpy":
            raise _Uncacheable
        return (t, x.dtype.str, x.tobytes())
    if t is np.ndarray:
        if name is None or x.dtype.hasobject or captured.setdefault(name, x) is not x:
            raise _Uncacheable      # not captured (tracing may read it), or two arrays under one name
        return ("array", name, x.shape, x.dtype.str)
    if t is tuple:
        return ("tuple",) + tuple(_fp(v, captured, walk, depth + 1) for v in x)
    if isinstance(x, types.ModuleType):
        if x.__name__.split(".")[0] not in _STABLE_MODULES or x.__name__ == "numpy.random":
            raise _Uncacheable
        walk.modules.setdefault(id(x), x)
        return ("module", x)
    if isinstance(x, types.BuiltinFunctionType):
        owner = x.__self__
        if x.__name__ in _DYNAMIC_BUILTINS or not (
                owner is None or (isinstance(owner, types.ModuleType)
                                  and owner.__name__ in ("builtins",) + _STABLE_MODULES)):
            raise _Uncacheable      # a bound method of a mutable object, random(), ...
        return ("builtin", x)
    if isinstance(x, np.ufunc):
        if getattr(np, x.__name__, None) is not x:
            raise _Uncacheable      # np.frompyfunc's: arbitrary Python inside
        return ("builtin", x)
    if isinstance(x, types.FunctionType):
        return _fp_function(x, captured, walk, depth, named=_helper(x))
    raise _Uncacheable


def _fp_function(x, captured, walk, depth, named):
    """x's part of a fingerprint; named: the arrays it names are captured under those names
    (the traced function and its helpers, as _rebound captures them)."""
    if id(x) in walk.order:         # met before (or recursive): by the order it was met
        return ("seen", walk.order[id(x)])
    walk.order[id(x)] = len(walk.order)
    code, glob = x.__code__, x.__globals__
    used, held = _code_names(code)
    if _STATEFUL_NAMES.intersection(used):
        raise _Uncacheable
    for n in held:
        walk.names[n] = None
    d = depth + 1
    cells = []
    for var, cell in zip(code.co_freevars, x.__closure__ or ()):
        try:
            cells.append(_fp(cell.cell_contents, captured, walk, d, var if named else None))
        except ValueError:          # an empty cell: a variable assigned later
            raise _Uncacheable from None
    builtins = x.__builtins__
    names = []
    for n in used:
        if n in glob:
            names.append((n, _fp(glob[n], captured, walk, d, n if named else None)))
        elif n in builtins:
            names.append((n, "builtin", _fp(builtins[n], captured, walk, d)))
        else:
            names.append((n, "absent"))
    pos = code.co_varnames[:code.co_argcount]
    defaults = x.__defaults__ or ()
    dfp = tuple(_fp(v, captured, walk, d, n if named else None)
                for n, v in zip(pos[len(pos) - len(defaults):], defaults))
    kw = tuple(sorted((k, _fp(v, captured, walk, d, k if named else None))
                      for k, v in (x.__kwdefaults__ or {}).items()))
    attrs = tuple(sorted((k, _fp(v, captured, walk, d)) for k, v in x.__dict__.items()))
    return ("function", code, tuple(cells), tuple(names), dfp, kw, attrs)
