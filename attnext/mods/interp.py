"""Lowering traced score_mods / mask_mods to programs for the CPU interpreter (csrc/interp/interp.h).

A program is a flat list of instructions over registers that each hold a vector of pairs (the
C side runs it over a tile of scores, VL pairs at a time). Leaves live in fixed registers: the
score and dout (float 0 and 1), q_idx, kv_idx, b, h (int 0-3); every float constant of the
graph gets a float register whose value is given per call (a traced function's float constants
are parameters, so a sweep over one reuses the program), every int / bool constant an int
register (part of the program). Bools are int registers holding 0 / 1. Temporaries are
allocated in topological order and reused after their last use.

`lower(traced)` builds a score_mod's forward and derivative programs (grad.grad) or a
mask_mod's program; `programs(traced)` looks them up in a bounded LRU keyed by the graph's
structural key (Traced.key: never id() or a name), and `bind(...)` attaches one call's float
values and captured arrays, in the form attnext._C reads. A backward that asks for some array
gradients only (`dtensors=`) gets a derivative program without the others' scatters, nor the
values only they read: the C side accumulates nothing for them (their grad_offset is -1, and
the accumulator holds only the asked arrays' elements).
"""
import types
from typing import NamedTuple, Optional

import numpy as np

from .. import _C, interop
from ..lru import CountedCache
from . import grad as derivative, trace
from .trace import B, F, I

OPS = {name: code for code, name in enumerate(_C.interp_ops())}
F_SCORE, F_DOUT, F_FIRST_CONST = 0, 1, 2
I_LEAVES = {"q_idx": 0, "kv_idx": 1, "b": 2, "h": 3}
I_FIRST_CONST = 4
CACHE_CAPACITY = 256

_TYPED = ("add", "sub", "mul", "floordiv", "mod", "pow", "minimum", "maximum", "neg", "abs",
          "where")
_FLOAT_ONLY = ("truediv", "dmul")
# the C math library's functions: instructions named as the function (csrc/interp/interp.h INTERP_LIBM1)
_LIBM = frozenset(trace._UNARY_FLOAT) | frozenset(trace._BINARY_FLOAT)
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
# mod_ints.h's integer type codes (MOD_I64 ...), by trace.INTS name; an int instruction names
# its type in c (interp.h) unless it is one of these, whose c is a register or unused
INT_TYPES = {"i64": 0, "i8": 1, "i16": 2, "i32": 3, "u8": 4, "u16": 5, "u32": 6, "u64": 7}
_UNTYPED = ("i_where", "b_not", "i_and", "i_or", "i_xor", "i_eq", "i_ne")


class Program(NamedTuple):
    """One lowered graph. code packs the header and instructions for _C (see _pack); floats
    lists each float constant register's source: ("param", k) or ("fconst", value)."""
    code: np.ndarray
    floats: tuple
    n_instr: int


class Lowered(NamedTuple):
    """What the cache holds for one structure: the forward (score or mask) program; for a
    score_mod, the backward's forward program (which stashes, per pair, the n_fstash float and
    n_istash int values the derivative reads) and the derivative program; each captured array's
    value type (trace.INTS, F, B) by position, which of them have a gradient, and whether the result depends on h."""
    kind: str
    forward: Program
    forward_bwd: Optional[Program]
    grad: Optional[Program]
    n_fstash: int
    n_istash: int
    array_kinds: tuple
    grad_arrays: tuple
    uses_h: bool


def _opname(n):
    op, dt = n.op, n.dtype
    if op in _TYPED:
        return ("f_" if dt == F else "i_") + op
    if op in _FLOAT_ONLY:
        return "f_" + op
    if op in _LIBM:
        return op
    if op in _COMPARE:
        return ("f_" if n.args[0].dtype == F else "i_") + op
    if op in ("and", "or", "xor"):
        return "i_" + op
    if op == "not":
        return "b_not" if dt == B else "i_not"
    if op == "load":
        return "load_f" if dt == F else "load_i"
    if op == "cast" and dt == F:
        return "f_from_i"
    if op == "cast":
        return "i_cast"
    raise TypeError(f"the CPU interpreter has no instruction for {op!r} ({dt}): "
                    f"{trace.format_expr(n)}")


def _array_positions(out):
    """Captured array name -> position, in the forward graph's topological order (the same for
    every function of one structure)."""
    pos = {}
    for n in trace.topo(out):
        if n.op == "array":
            pos.setdefault(n.args[0], len(pos))
    return pos


def _alias(n):
    """The node whose register n shares: a cast that keeps the register's int64
    (trace.same_bits)."""
    while n.op == "cast" and n.dtype != F:
        if n.args[0].dtype == F:
            raise TypeError(f"the CPU interpreter cannot cast a float to {n.dtype}")
        if not trace.same_bits(n.dtype, n.args[0].dtype):
            break
        n = n.args[0]
    return n


def _lower(result, scatters, arrays, want_int, stash_out=None, stash_in=None):
    """A Program computing `result` and, for a derivative, scatter-adding each (array name,
    index nodes, adjoint node) of `scatters`. arrays: name -> position. stash_out: id(node) ->
    stash slot of the values to keep for the derivative program; stash_in: id(node) -> slot
    of those the derivative reads back instead of computing (nothing above them is lowered)."""
    stash_out, stash_in = stash_out or {}, stash_in or {}
    kept = [n for n in trace.topo(*[result] + [x for _, idx, adj in scatters
                                               for x in (*idx, adj)]) if id(n) in stash_out]
    roots = [result] + [x for _, idx, adj in scatters for x in (*idx, adj)] + kept
    reach, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if id(n) in reach:
            continue
        reach.add(id(n))
        if id(n) not in stash_in and n.op not in trace._LEAVES:
            stack.extend(n.args)
    order = [n for n in trace.topo(*roots) if id(n) in reach]
    where = {}             # id(node) -> ("f" | "i", register)
    floats, iconsts, temps = [], [], []
    for n in order:
        if n.op == "param":
            where[id(n)] = ("f", F_FIRST_CONST + len(floats))
            floats.append(("param", n.args[0]))
        elif n.op == "fconst":
            where[id(n)] = ("f", F_FIRST_CONST + len(floats))
            floats.append(("fconst", n.args[0]))
        elif n.op == "const":
            where[id(n)] = ("i", I_FIRST_CONST + len(iconsts))
            iconsts.append(trace.int_bits(int(n.args[0]), n.dtype))
        elif n.op in ("score", "dout"):
            where[id(n)] = ("f", F_SCORE if n.op == "score" else F_DOUT)
        elif n.op in I_LEAVES:
            where[id(n)] = ("i", I_LEAVES[n.op])
        elif id(n) in stash_in:
            temps.append(n)
        elif n.op == "array" or _alias(n) is not n:
            pass
        elif n.op in trace._LEAVES:
            raise TypeError(f"the CPU interpreter has no input {n.op!r}")
        else:
            temps.append(n)

    def operands(n):
        if id(n) in stash_in:
            return []
        return [_alias(a) for a in (n.args[1:] if n.op == "load" else n.args)]

    last = {}              # id(temporary) -> index of the instruction that reads it last
    for i, n in enumerate(temps):
        for a in operands(n):
            last[id(a)] = i
    for r in roots:
        last[id(_alias(r))] = len(temps)
    free = {"f": [], "i": []}
    count = {"f": F_FIRST_CONST + len(floats), "i": I_FIRST_CONST + len(iconsts)}
    instr, aux = [], []

    def reg(x):
        return where[id(_alias(x))][1]

    def index_list(idx):
        aux.extend(reg(x) for x in idx)
        return len(aux) - len(idx)

    is_temp = {id(n) for n in temps}
    for i, n in enumerate(temps):
        # operands read for the last time free their registers first: every instruction is
        # elementwise, so its result may overwrite an operand
        for a in {id(a): a for a in operands(n)}.values():
            if id(a) in is_temp and last[id(a)] == i:
                free[where[id(a)][0]].append(where[id(a)])
        file = "f" if n.dtype == F else "i"
        loc = free[file].pop() if free[file] else (file, count[file])
        if loc[1] == count[file]:
            count[file] += 1
        if id(n) in stash_in:
            instr.append([OPS["unstash_" + file], loc[1], stash_in[id(n)], 0, 0])
            where[id(n)] = loc
            continue
        if n.op == "load":
            ops = [arrays[n.args[0].args[0]], index_list(n.args[1:]), len(n.args) - 1]
        else:
            ops = [reg(a) for a in n.args] + [0] * (3 - len(n.args))
            name = _opname(n)
            if name.startswith("i_") and name not in _UNTYPED or name == "f_from_i":
                # the type of the result, or of the operands of a comparison or conversion
                # (bools: their 0 / 1 as int64)
                ops[2] = INT_TYPES.get(n.args[0].dtype if name == "f_from_i" or n.dtype == B
                                       else n.dtype, 0)
        instr.append([OPS[_opname(n)], loc[1]] + ops)
        where[id(n)] = loc
    for name, idx, adj in scatters:
        instr.append([OPS["scatter"], reg(adj), arrays[name], index_list(idx), len(idx)])
    for n in kept:
        file = where[id(_alias(n))][0]
        instr.append([OPS["stash_" + file], reg(n), stash_out[id(n)], 0, 0])
    out_file, out_reg = where[id(_alias(result))]
    if (out_file == "i") != want_int:
        raise TypeError("the program's result has the wrong type")
    return Program(_pack(instr, aux, iconsts, count, out_reg, want_int), tuple(floats),
                   len(instr))


def _pack(instr, aux, iconsts, count, out, out_is_int):
    """The int64 array _C reads: n_instr, n_fregs, n_iregs, out, out_is_int, n_aux, n_iconst,
    then the instructions (5 each), the aux entries and the int constants."""
    head = [len(instr), count["f"], count["i"], out, int(out_is_int), len(aux), len(iconsts)]
    body = [x for ins in instr for x in ins] + list(aux) + list(iconsts)
    return np.array(head + body, dtype=np.int64)


def lower(traced, wanted=None):
    """The Lowered programs of a traced score_mod or mask_mod. wanted: the positions of the
    arrays whose gradients the derivative program scatters (grad.positions), None for all."""
    arrays = _array_positions(traced.out)
    kinds = {}
    for n in trace.topo(traced.out):
        if n.op == "array":
            kinds[n.args[0]] = n.dtype      # its values' type: _bind_arrays' kind
    array_kinds = tuple(kinds[name] for name in arrays)
    uses_h = any(n.op == "h" for n in trace.topo(traced.out))
    if traced.kind == "mask_mod":
        return Lowered("mask_mod", _lower(traced.out, [], arrays, True), None, None, 0, 0,
                       array_kinds, (), uses_h)
    forward = _lower(traced.out, [], arrays, False)
    g = derivative.grad(traced)
    keep = None if wanted is None else {name for name, pos in arrays.items() if pos in wanted}
    darrays = {name: terms for name, terms in g.darrays.items() if keep is None or name in keep}
    scatters = [(name, idx, adj) for name, terms in darrays.items() for idx, adj in terms]
    # the forward's computed values that the derivative reads: stashed, not computed twice
    forward_ids = {id(n) for n in trace.topo(traced.out)}

    def computed(n):
        n = _alias(n)
        return id(n) in forward_ids and n.op not in trace._LEAVES

    grad_roots = [g.dscore] + [x for _, idx, adj in scatters for x in (*idx, adj)]
    crossing = {}
    for n in trace.topo(*grad_roots):
        if id(n) in forward_ids or n.op in trace._LEAVES:
            continue
        for a in (n.args[1:] if n.op == "load" else n.args):
            if computed(a):
                crossing.setdefault(id(_alias(a)), _alias(a))
    for r in grad_roots:
        if computed(r):
            crossing.setdefault(id(_alias(r)), _alias(r))
    slots, count = {}, {F: 0, I: 0}
    for key, n in crossing.items():
        kind = F if n.dtype == F else I
        slots[key] = count[kind]
        count[kind] += 1
    forward_bwd = _lower(traced.out, [], arrays, False, stash_out=slots)
    grad = _lower(g.dscore, scatters, arrays, False, stash_in=slots)
    if forward_bwd.floats != forward.floats:
        raise TypeError("the backward's forward program has other float constants")
    grad_arrays = tuple(sorted(arrays[name] for name in darrays))
    return Lowered("score_mod", forward, forward_bwd, grad, count[F], count[I], array_kinds,
                   grad_arrays, uses_h)


# --- the cache ------------------------------------------------------------------------------

_cache = CountedCache(CACHE_CAPACITY)


def programs(traced, wanted=None):
    """lower(traced, wanted), from the cache when a function of the same structure was lowered
    before with the same wanted."""
    key = (traced.kind, traced.key, None if wanted is None else tuple(wanted))
    return _cache.get_or_make(key, lambda: lower(traced, wanted))


def cache_info():
    """The program cache's counters: hits, misses, compiles (lowerings), compile_seconds, and
    entries / capacity."""
    return _cache.info()


def cache_clear():
    """Forgets every lowered program (the counters are kept)."""
    _cache.clear()


# --- one call -------------------------------------------------------------------------------

_KIND_CODES = {F: 0, I: 1, B: 2, "u64": 3}     # interp_array_kind (a uint64 array: its bits)


def _float_values(prog, params):
    return np.array([params[v] if src == "param" else v for src, v in prog.floats],
                    dtype=np.float64)


def _host(name, source):
    """NumPy's view of a captured host array (a NumPy array, a torch CPU tensor, ...:
    attnext.interop); api.py refuses a CPU call whose function captures a CUDA array."""
    a = interop.host_view(name, source)
    if a is None:
        raise TypeError(f"captured array {name!r} ({type(source).__name__}) is not in host memory: "
                        "the CPU backend reads host arrays only")
    return a


def _bind_arrays(traced, lowered, acc_dtype):
    """The captured arrays by position, as the interpreter reads them (contiguous; floats in
    acc_dtype, ints int64, bools one byte), read afresh now."""
    out = []
    for name, dtype in zip(_array_positions(traced.out), lowered.array_kinds):
        a = _host(name, traced.arrays[name])
        kind = trace.kind_of(dtype)
        dt = {F: acc_dtype, I: np.int64, B: np.uint8}[kind]
        out.append((_KIND_CODES.get(dtype, _KIND_CODES[kind]), np.asarray(a, dtype=dt, order="C")))
    return tuple(out)


def bind(score_mod, mask_mod, acc_dtype, backward=False, dtensors=None):
    """The `mods` object _C.forward / _C.backward read for one call (None without mods):
    programs, float values, captured arrays; for the backward also the gradient accumulator
    (float64) and where each float array's gradient lies in it. Traces the functions (TypeError
    for an unsupported one); either may also come traced already (a trace.Traced).
    dtensors: the names of the score_mod's arrays whose gradients the backward computes (and
    dtensors() returns), None for every float array."""
    if score_mod is None and mask_mod is None:
        return None
    m = types.SimpleNamespace(score=None, score_floats=None, score_bwd=None, grad=None,
                              grad_floats=None, n_fstash=0, n_istash=0, score_arrays=(),
                              score_names=(), mask=None, mask_floats=None, mask_arrays=(),
                              mask_names=(), mask_uses_h=0, grad_offsets=(), dtensors=None,
                              asked=dtensors)
    if score_mod is not None:
        t = score_mod if isinstance(score_mod, trace.Traced) else trace.trace_score_mod(score_mod)
        low = programs(t, derivative.positions(t, dtensors) if backward else None)
        m.score, m.score_floats = low.forward.code, _float_values(low.forward, t.params)
        m.score_arrays = _bind_arrays(t, low, acc_dtype)
        m.score_names = tuple(_array_positions(t.out))
        m.score_sources = tuple(t.arrays[name] for name in m.score_names)
        if backward:
            m.score_bwd, m.n_fstash, m.n_istash = low.forward_bwd.code, low.n_fstash, low.n_istash
            m.grad, m.grad_floats = low.grad.code, _float_values(low.grad, t.params)
            offsets, total = [], 0
            for pos, (_, data) in enumerate(m.score_arrays):
                offsets.append(total if pos in low.grad_arrays else -1)
                total += data.size if pos in low.grad_arrays else 0
            m.grad_offsets = tuple(offsets)
            m.dtensors = np.zeros(total, dtype=np.float64)
    if mask_mod is not None:
        t = mask_mod if isinstance(mask_mod, trace.Traced) else trace.trace_mask_mod(mask_mod)
        low = programs(t)
        m.mask, m.mask_floats = low.forward.code, _float_values(low.forward, t.params)
        m.mask_arrays = _bind_arrays(t, low, acc_dtype)
        m.mask_names = tuple(_array_positions(t.out))
        m.mask_uses_h = int(low.uses_h)
    return m


def dtensors(mods):
    """{name: gradient} after a backward with bound mods: each float array the score_mod reads
    (those bind's dtensors named), in its own dtype and shape and its own library (a NumPy array
    for a NumPy array, a torch CPU tensor for one: attnext.interop.to_library), zeros for an
    array that reaches the score only through comparisons or indices; {} without a score_mod."""
    out = {}
    if mods is None:
        return out
    for pos, name in enumerate(mods.score_names):
        kind, data = mods.score_arrays[pos]
        if kind != _KIND_CODES[F] or (mods.asked is not None and name not in mods.asked):
            continue
        src = mods.score_sources[pos]
        host = _host(name, src)
        off = mods.grad_offsets[pos]
        g = (np.zeros(host.shape) if off < 0
             else mods.dtensors[off:off + data.size].reshape(host.shape))
        out[name] = interop.to_library(g.astype(host.dtype), src)
    return out
