"""CUDA code generation for traced score_mods / mask_mods (the GPU twin of interp.py).

A traced graph (trace.py) becomes C source: device functions that the kernels call from their
one score_mod slot and one mask_mod slot (kernels/attn_common.cuh: score_of, score_grad,
mask_keeps, and ds_tile for the array gradients):

    float mod_score(float score, int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, const attn_mods_gpu *m)
    float mod_dscore(... the same ..., float dout, m)      d out / d score times dout (grad.grad)
    void  mod_dtensors(... the same ..., float dout, t, m) each float array's adjoint, scatter-added
    int   mod_tile_plan(b, h, q_idx, kv_idx, rows, cols, m, t)   whether a tile sums its lookups first
    int   mod_mask(int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, m)
    void  mod_head(b, h, m, hv)    the score_mod's lookups of (b, h) alone (head_loads) into hv

The kernels inline the `_q` twins (a lookup out of range clamps and notes it) and, for the
score_mod, the `_h` ones, which read head_loads' lookups from the hv that make_score_ctx filled
once a (b, h) tile (attn_common.cuh: score_ctx.hv).

The source is one in-memory header, "attn_mod_gen.cuh", handed to NVRTC beside the fixed ones
(kernels.py); the kernels include it, with kernels/attn_mods.cuh (NumPy's integer and float
rules, checked lookups, the exact gradient scatter), when HAS_SCORE_MOD / HAS_MASK_MOD are set.
The cubin cache keys on the header's text and the options, and the text depends only on the
graph's structure (Traced.key: ops, integer constants, array dtypes and shapes), never on a
name, an id() or a float constant's value.

How one call's values reach the kernel: `attn_mods_gpu` (csrc/attn_params.h), the last field of
the one __grid_constant__ attn_params, holds the float constants (m->f: a sweep over a constant
reuses the kernel), each captured array's pointer, shape and strides, the device error flag, the
gradient accumulator and the block mask; the generated code reads it through the pointer
score_ctx carries. A field of attn_params rather than a second kernel parameter: every kernel
keeps its one-argument signature and launch, and the CPU side ignores it (it is zeroed there).
Only kernels with mods declare it (ATTN_GMODS), so plain kernels' launches copy ~940 fewer
parameter bytes. Arrays are numbered score_mod's first, then mask_mod's; float constants
likewise.

Table-driven rendering (after tinygrad's CStyleLanguage): one op -> C-expression table per value
type, fully parenthesised; values are named in topological order, a value used once is inlined,
and every lookup is a statement of its own, evaluated whatever np.where chooses, so that a lookup
out of range is reported where the reference (which evaluates both branches) reports it. A node the
tables cannot render raises TypeError naming it.

Gradients of the captured float arrays are accumulated exactly: integer fixed-point limbs added
by atomics (attn_mods.cuh), so the result is the same bits whatever order the GPU threads add
in; kernels/attn_dtensors.cu turns them into the arrays' gradients on the device, by the rule
limbs_to_float spells out on the host (the tests hold the two to the same bits). A lookup whose
indices are affine in q_idx and kv_idx with the rest fixed for a tile (b, h, constants: a tile
term, affine()) lands on few elements over a tile of the dQ kernels: mod_tile_plan places its
span in the tile's shared-memory sums (attn_mods.cuh: mod_tile), mod_dtensors adds into those,
and the kernel adds each element's sums into the accumulator once (the same words).
Only the arrays a backward asks for (`dtensors=`: generate's wanted) get scatters: the header of
a call that asks for none has neither mod_dtensors nor HAS_DTENSORS, so its kernels are those of
a score_mod without array gradients, and its text (the cubin cache's key) tells the selections
apart.
"""
import math
from typing import NamedTuple

import numpy as np

from ..lru import CountedCache
from . import bounds, grad, trace
from .bounds import CHECKED
from .trace import B, F, I

HEADER = "attn_mod_gen.cuh"
MAX_FLOATS = 64            # ATTN_MOD_FLOATS (csrc/attn_params.h)
MAX_ARRAYS = 8             # ATTN_MOD_ARRAYS
MAX_DIMS = 4               # ATTN_MOD_DIMS
# a value used once is inlined into its user unless that nests deeper than this: a chain of
# thousands of operations becomes statements, not one expression past the compilers' nesting
# limits (and past their recursion: NVRTC's front end recurses per parenthesis)
MAX_INLINE_DEPTH = 32
LIMBS, LIMB_BITS, LIMB_LSB = 12, 24, -149      # attn_mods.cuh
WORDS = LIMBS + 1
MAX_TILE_TERMS = 4         # MOD_TILE_TERMS: lookups that may take a tile's path
MAX_HEAD = 4               # score_mod lookups of (b, h) alone held in score_ctx (head_loads)
MAX_TILE_COEF = 1 << 15    # a larger coefficient never fits a tile's slots
TILE_SLOT_BYTES = 2 * LIMBS * 4     # a tile's shared sums of one element: MOD_CHUNKS 32-bit words
CACHE_CAPACITY = 256

C_TYPE = {F: "float", I: "int64_t", B: "int"}
SCORE_ARGS = "float score, int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx"
PLAN_ARGS = "int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, int rows, int cols"
MASK_ARGS = "int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx"
M_ARG = "const attn_mods_gpu *m"

# op -> C expression over the operands {0}, {1}, {2}, by the result's value type
_FLOAT_OPS = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "truediv": "mod_fdiv({0}, {1})",
    "floordiv": "mod_ffloordiv({0}, {1})", "mod": "mod_fmod({0}, {1})", "pow": "powf({0}, {1})",
    "minimum": "mod_fmin({0}, {1})", "maximum": "mod_fmax({0}, {1})", "neg": "(-{0})",
    "abs": "fabsf({0})", "where": "({0} ? {1} : {2})", "dmul": "mod_dmul({0}, {1})",
    "cast": "((float)({0}))",
    # the C math library's functions by their float names (tanf: NVRTC's built-ins, no header)
    **{op: f"{op}f({{0}})" for op in trace._UNARY_FLOAT},
    **{op: f"{op}f({{0}}, {{1}})" for op in trace._BINARY_FLOAT},
    "tanh": "fast_tanh({0})",
}
_INT_OPS = {
    "add": "mod_iadd({0}, {1})", "sub": "mod_isub({0}, {1})", "mul": "mod_imul({0}, {1})",
    "floordiv": "mod_ifloordiv({0}, {1})", "mod": "mod_imod({0}, {1})",
    "pow": "mod_ipow({0}, {1})", "minimum": "({0} <= {1} ? {0} : {1})",
    "maximum": "({0} >= {1} ? {0} : {1})", "neg": "mod_ineg({0})", "abs": "mod_iabs({0})",
    "and": "({0} & {1})", "or": "({0} | {1})", "xor": "({0} ^ {1})", "not": "(~{0})",
    "where": "({0} ? {1} : {2})", "cast": "((int64_t)({0}))",
}
_BOOL_OPS = {
    "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "and": "({0} & {1})", "or": "({0} | {1})",
    "xor": "({0} ^ {1})", "not": "(!{0})", "where": "({0} ? {1} : {2})",
}
# a narrower integer type's ops (trace.INTS; values held in int64_t as csrc/mod_ints.h says):
# mod_ints.h's typed rules, {t} the type's code there; int64 keeps _INT_OPS
_TYPED_INT_OPS = {
    "add": "mod_tadd({0}, {1}, {t})", "sub": "mod_tsub({0}, {1}, {t})", "mul": "mod_tmul({0}, {1}, {t})",
    "floordiv": "mod_tfloordiv({0}, {1}, {t})", "mod": "mod_tmod({0}, {1}, {t})",
    "pow": "mod_tpow({0}, {1}, {t})", "minimum": "mod_tmin({0}, {1}, {t})",
    "maximum": "mod_tmax({0}, {1}, {t})", "neg": "mod_tneg({0}, {t})", "abs": "mod_tabs({0}, {t})",
    "not": "mod_tnot({0}, {t})", "cast": "mod_wrap({0}, {t})",
    **{op: _INT_OPS[op] for op in ("and", "or", "xor", "where")},
}
# comparisons of uint64 operands (the others compare the values held)
_U64_COMPARE = {"lt": "mod_tlt({0}, {1}, MOD_U64)", "le": "mod_tle({0}, {1}, MOD_U64)",
                "gt": "mod_tlt({1}, {0}, MOD_U64)", "ge": "mod_tle({1}, {0}, MOD_U64)"}
_MOD_TYPE = {t: "MOD_" + t.upper() for t in trace.INTS}
_TABLES = {F: _FLOAT_OPS, I: _INT_OPS, B: _BOOL_OPS}


def _op_format(n):
    """The C format of node n's op (its operands {0} {1} {2}, its type's code {t}), or None."""
    op, dt, src = n.op, n.dtype, n.args[0].dtype if n.args and isinstance(n.args[0], trace.Node) else None
    if op == "cast" and dt == F and src == "u64":
        return "((float)(uint64_t)({0}))"
    if op == "cast" and trace.is_int(dt) and trace.same_bits(dt, src):
        return _INT_OPS["cast"]
    if trace.is_int(dt) and dt != I:
        return _TYPED_INT_OPS.get(op)
    if dt == B and src == "u64" and op in _U64_COMPARE:
        return _U64_COMPARE[op]
    return _TABLES.get(dt, {}).get(op)
_LOAD = {F: "mod_load_f", I: "mod_load_i", B: "mod_load_b"}
_INPUT_NAMES = ("score", "b", "h", "q_idx", "kv_idx", "dout")

# every op the tracer can produce (trace.py's _ARITH, _COMPARE, _BITWISE, _UNARY_FLOAT, ...) and
# the derivative's own (dmul): tests/unit/test_codegen.py checks that this covers trace's list
SUPPORTED_OPS = frozenset(_FLOAT_OPS) | frozenset(_INT_OPS) | frozenset(_BOOL_OPS) | {"load"}

# a float quotient that only these ops read is computed by the divisor's reciprocal
# (attn_mods.cuh: mod_fdiv_tanh): the hardware's tanh takes a far coarser error than its one
# extra rounding (a softcap score_mod's s / cap)
_LOOSE_DIV_READERS = {"tanh"}


def _float_literal(x):
    if math.isnan(x):
        return "(0.f / 0.f)"
    if math.isinf(x):
        return "(1.f / 0.f)" if x > 0 else "(-1.f / 0.f)"
    return f"((float){float(x)!r})"


def _int_literal(n, dtype):
    if dtype == B:
        return "1" if n else "0"
    n = int(n)
    if n == -2 ** 63:
        return "((int64_t)(-9223372036854775807LL - 1))"
    return f"((int64_t){n}LL)"


# every integer input of the kernels' calls lies in [0, 2^31) (their lengths, heads and batch are
# int32): an int64 expression of them whose interval (bounds.py) stays within int32 for every
# call is computed (mod_ints.h: mod_sadd ...), converted and compared as an int (an int64
# subtraction is two instructions and its abs four more, an int64 -> float conversion a
# multi-instruction sequence; int32's are one each). Exact: the operands and the result of such
# an op all lie in int32, so int32 arithmetic neither wraps nor differs from int64's
_STATIC_EXTENTS = bounds.Extents(2 ** 31, 2 ** 31, 2 ** 31, 2 ** 31)
_INT32 = (-2 ** 31, 2 ** 31 - 1)
_COMPARES = frozenset(("lt", "le", "gt", "ge", "eq", "ne"))
_SMALL_INT_OPS = {
    "add": "mod_sadd({0}, {1})", "sub": "mod_ssub({0}, {1})", "mul": "mod_smul({0}, {1})",
    "neg": "mod_sneg({0})", "abs": "mod_sabs({0})", "minimum": "mod_smin({0}, {1})",
    "maximum": "mod_smax({0}, {1})",
}


class _Renderer:
    """Renders the nodes reachable from some roots as C statements of one function."""

    def __init__(self, arrays, float_base, check=False, modes=None, narrow=frozenset(), head=None):
        self.arrays = arrays          # array name -> its global number
        self.float_base = float_base  # this function's first float constant in m->f
        self.check = check            # the _check twin: lookups report, nothing else is done
        self.modes = modes or {}      # (array name, id of each index) -> lookup mode (Facts)
        self.narrow = narrow          # global numbers of the integer arrays stored as int32
        self.head = head or {}        # id of a lookup of (b, h) alone -> its slot in hv (head_loads)
        self.lines = []
        self.expr = {}
        self.lookups = False
        self.small = set()            # ids of the int64 nodes within int32 on every call

    def render(self, roots):
        order = trace.topo(*roots)
        self.small = {i for i, r in bounds.ranges(roots, _STATIC_EXTENTS).items()
                      if r is not None and _INT32[0] <= r[0] and r[1] <= _INT32[1]}
        uses = {}
        self.readers = {}                                   # id -> the ops that read it
        for n in order:
            for a in trace._children(n):
                uses[id(a)] = uses.get(id(a), 0) + 1
                self.readers.setdefault(id(a), set()).add(n.op)
        for r in roots:
            uses[id(r)] = uses.get(id(r), 0) + 2          # a root is always named
            self.readers.setdefault(id(r), set()).add(None)
        depth = {}        # how deep an inlined value's expression nests
        for n in order:
            e = self._expr_of(n)
            if e is None:
                continue
            d = 1 + max((depth.get(id(a), 0) for a in trace._children(n)), default=0)
            named = n.op == "load" or (n.op not in trace._LEAVES and
                                       (uses.get(id(n), 0) > 1 or d > MAX_INLINE_DEPTH))
            if named:
                name = f"v{len(self.lines)}"
                self.lines.append(f"    const {C_TYPE[trace.kind_of(n.dtype)]} {name} = {e};")
                e, d = name, 0
            self.expr[id(n)] = e
            depth[id(n)] = d

    def _expr_of(self, n):
        op = n.op
        if op in _INPUT_NAMES:
            return op
        if op == "const":
            return _int_literal(n.args[0], B) if n.dtype == B else _int_literal(trace.int_bits(n.args[0], n.dtype), I)
        if op == "fconst":
            return _float_literal(n.args[0])
        if op == "param":
            k = self.float_base + n.args[0]
            if k >= MAX_FLOATS:
                raise TypeError(f"the GPU code generator takes at most {MAX_FLOATS} float "
                                "constants in score_mod and mask_mod together")
            return f"m->f[{k}]"
        if op == "array":
            return None
        if op == "load" and id(n) in self.head:
            return f"hv[{self.head[id(n)]}]"
        if op == "load":
            arr = self.arrays[n.args[0].args[0]]
            kind = trace.kind_of(n.dtype)
            load = "mod_load_i32" if kind == I and arr in self.narrow else _LOAD[kind]
            return f"{load}(m, {arr}, {self.offset(n.args[0], n.args[1:])})"
        if op == "cast" and n.dtype == F and n.args[0].op == "abs" and self._small_op(n.args[0]):
            # (float)|x| is |(float)x| (rounding is symmetric), and |.| of a float is free in the
            # instruction that reads it
            return f"fabsf((float)((int)({self.expr[id(n.args[0].args[0])]})))"
        form = (self._small_op(n) and _SMALL_INT_OPS.get(op)) or _op_format(n)
        if op == "truediv" and n.dtype == F and self.readers.get(id(n)) == _LOOSE_DIV_READERS:
            form = "mod_fdiv_tanh({0}, {1})"
        if form is None:
            raise TypeError(f"the GPU code generator cannot render {op!r} ({n.dtype}): "
                            f"{trace.format_expr(n)}")
        args = [self.expr[id(a)] for a in n.args]
        if self._as_int(n):
            args = [f"(int)({x})" for x in args]
        return form.format(*args, t=_MOD_TYPE.get(n.dtype))

    def _small_op(self, n):
        """Whether n is an int64 op whose operands and result stay within int32 on every call."""
        return (n.dtype == I and id(n) in self.small and
                all(isinstance(a, trace.Node) and a.dtype == I and id(a) in self.small for a in n.args))

    def _as_int(self, n):
        """Whether n converts or compares int64 operands that stay within int32 on every call."""
        if not (n.op == "cast" and n.dtype == F or n.op in _COMPARES and n.dtype == B):
            return False
        return all(isinstance(a, trace.Node) and a.dtype == I and id(a) in self.small for a in n.args)

    def offset(self, array_node, idx):
        name, shape = array_node.args[0], array_node.args[2]
        if len(shape) > MAX_DIMS:
            raise TypeError(f"array {name!r} has {len(shape)} dims; the GPU code generator "
                            f"takes arrays of at most {MAX_DIMS}")
        args = [self.expr[id(i)] for i in idx] + ["0"] * (MAX_DIMS - len(idx))
        mode = self.modes.get((name, tuple(id(i) for i in idx)), CHECKED)
        if mode != CHECKED:           # proven in range (bounds.py): no check, no clamp
            return f"mod_offset_in(m, {self.arrays[name]}, {len(idx)}, {', '.join(args)}, {mode})"
        self.lookups = True
        return (f"mod_offset(m, {self.arrays[name]}, {len(idx)}, {', '.join(args)}, "
                f"{'0' if self.check else 'bad'})")


def _function(ret, name, params, roots, arrays, float_base, tail, modes=None, narrow=frozenset(), head=None):
    """Three functions for `ret name(params)`, computing roots then tail (str formats of the
    roots' expressions, or callables of the renderer):
      name_q (..., int *bad)  what the kernels inline at every score: a lookup out of range is
                              clamped and sets *bad, branch-free
      name_check (...)        MOD_COLD (attn_mods.cuh): the same lookups, each reporting an index
                              out of range (mod_fail); nothing else. A kernel calls it once per
                              tile that noted one (attn_common.cuh: mods_report)
      name (...)              name_q, then name_check if it noted one (the host C tests)
    head (the score_mod's functions: head_loads' slots): a fourth, name_h (..., const float *hv,
    int *bad), name_q with the lookups of (b, h) alone read from hv, which mod_head filled (the
    kernels call it with score_ctx's hv, filled once a (b, h) tile); name_q is then mod_head
    and name_h. modes, narrow: _Renderer's."""
    r = _Renderer(arrays, float_base, modes=modes, narrow=narrow, head=head)
    r.render(roots)
    body = [t.format(*(r.expr[id(x)] for x in roots)) if isinstance(t, str) else t(r) for t in tail]
    c = _Renderer(arrays, float_base, check=True, modes=modes, narrow=narrow)
    c.render(roots)
    check = c.lines + [t(c) for t in tail if not isinstance(t, str)] if c.lookups else []
    names = [p.split()[-1].lstrip("*") for p in params.split(", ")]
    call = f"{name}_q({', '.join(names)}, &bad)"
    computed = ("" if r.lookups else "    (void)bad;\n") + "\n".join(r.lines + body) + "\n}\n\n"
    if head is None:
        kernels = f"DEV {ret} {name}_q({params}, int *bad)\n{{\n" + computed
    else:
        h_call = f"{name}_h({', '.join(names)}, hv, bad)"
        kernels = (f"DEV {ret} {name}_h({params}, const float *hv, int *bad)\n{{\n"
                   + ("" if head else "    (void)hv;\n") + computed
                   + f"DEV {ret} {name}_q({params}, int *bad)\n{{\n"
                   + "    float hv[MOD_HEAD_SIZE];\n    mod_head(b, h, m, hv);\n"
                   + (f"    {h_call};\n" if ret == "void" else f"    return {h_call};\n") + "}\n\n")
    return (f"MOD_COLD void {name}_check({params})\n{{\n" + "\n".join(check or ["    (void)m;"])
            + "\n}\n\n" + kernels
            + f"DEV {ret} {name}({params})\n{{\n    int bad = 0;\n"
            + (f"    {call};\n" if ret == "void" else f"    const {ret} v = {call};\n")
            + f"    if (bad)\n        {name}_check({', '.join(names)});\n"
            + ("" if ret == "void" else "    return v;\n") + "}\n")


def head_loads(traced, modes):
    """The score_mod's float lookups whose indices depend on b, h and constants alone, proven in
    range (Facts' modes), at most MAX_HEAD of them: {id(load node): slot}. The kernels read them
    once a (b, h) tile, where score_ctx is made (mod_head), rather than at every score: in a
    loop of tensor-core products a lookup at every score is a global load the products' waits
    keep from issuing early (ALiBi's slopes[h]: one exposed load a tile, 7% of the backward:
    bench/NOTES.md, mods table)."""
    alone = {}                   # id -> whether the node depends on b, h and constants alone
    out = {}
    for n in trace.topo(traced.out):
        if n.op in ("score", "q_idx", "kv_idx", "dout"):
            alone[id(n)] = False
        elif n.op in trace._LEAVES:
            alone[id(n)] = True
        elif n.op == "load":
            idx = n.args[1:]
            proven = modes.get((n.args[0].args[0], tuple(id(i) for i in idx)), CHECKED) != CHECKED
            alone[id(n)] = proven and all(alone[id(i)] for i in idx)
            if alone[id(n)] and trace.kind_of(n.dtype) == F and len(out) < MAX_HEAD:
                out[id(n)] = len(out)
        else:
            alone[id(n)] = all(alone[id(a)] for a in trace._children(n))
    return out


def _head_function(traced, head, arrays, modes, narrow):
    """mod_head(b, h, m, hv): head_loads' lookups into hv, and MOD_HEAD_SIZE (hv's length, at
    least 1)."""
    by_id = {id(n): n for n in trace.topo(traced.out)}
    nodes = sorted((k, by_id[i]) for i, k in head.items())
    r = _Renderer(arrays, 0, modes=modes, narrow=narrow)
    r.render([n for _, n in nodes])
    assert not r.lookups, "head_loads takes proven lookups alone"
    lines = r.lines + [f"    hv[{k}] = {r.expr[id(n)]};" for k, n in nodes]
    return (f"#define MOD_HEAD_SIZE {max(len(head), 1)}\n"
            f"DEV void mod_head(int64_t b, int64_t h, {M_ARG}, float *hv)\n{{\n"
            + "    (void)b;\n    (void)h;\n    (void)m;\n    (void)hv;\n" + "".join(x + "\n" for x in lines) + "}\n")


# mod_mask_cell: mask_mod over a cell of pairs (attn_mods.cuh's block-mask cells); what the
# integer and bool ops become over intervals (int) and value sets (bool); any other op, and every
# float, is unknown there (mod_iv_top(), 3)
_CELL_INT = {"add": "mod_iv_add({0}, {1})", "sub": "mod_iv_sub({0}, {1})", "mul": "mod_iv_mul({0}, {1})",
             "neg": "mod_iv_neg({0})", "abs": "mod_iv_abs({0})", "minimum": "mod_iv_min({0}, {1})",
             "maximum": "mod_iv_max({0}, {1})", "floordiv": "mod_iv_floordiv({0}, {1})",
             "mod": "mod_iv_mod({0}, {1})", "where": "mod_iv_where({0}, {1}, {2})"}
_CELL_CMP = {"lt": "mod_iv_lt({0}, {1})", "le": "mod_iv_le({0}, {1})", "gt": "mod_iv_lt({1}, {0})",
             "ge": "mod_iv_le({1}, {0})", "eq": "mod_iv_eq({0}, {1})", "ne": "mod_set_not(mod_iv_eq({0}, {1}))"}
_CELL_BOOL = {"and": "mod_set_and({0}, {1})", "or": "mod_set_or({0}, {1})", "xor": "mod_set_xor({0}, {1})",
              "not": "mod_set_not({0})", "where": "mod_set_where({0}, {1}, {2})"}
CELL_ARGS = "int64_t b, int64_t h, int64_t r0, int64_t r1, int64_t c0, int64_t c1"


def _cell_function(mask, arrays, modes, narrow):
    """DEV int mod_mask_cell(b, h, r0, r1, c0, c1, m): what mask_mod may give over the pairs
    q_idx in [r0, r1], kv_idx in [c0, c1] of sequence b, head h -- ATTN_BLOCK_KEPT if some pair
    may be kept, ATTN_BLOCK_MASKED if some may be masked, both where it cannot tell or where a
    checked lookup may leave its array there (the cell is then evaluated pair by pair, which
    reports it). Every node is evaluated, as the pair code evaluates every lookup."""
    expr, lines = {}, []
    inputs = {"b": "mod_iv_point(b)", "h": "mod_iv_point(h)", "q_idx": "mod_iv_range(r0, r1)",
              "kv_idx": "mod_iv_range(c0, c1)"}
    for n in trace.topo(mask.out):
        op, a = n.op, [expr.get(id(x)) for x in trace._children(n)]
        if op != "where" and any(x.dtype == "u64" for x in trace._children(n)) and None not in a:
            # a uint64 op reads its operands as uint64s (interp.c's interp_cell alike): a
            # constant past int64 (negative bits) is no interval of its value
            a = [f"mod_iv_fit({x}, MOD_U64)" if c.dtype == "u64" else x
                 for x, c in zip(a, trace._children(n))]
        if n.dtype == F and op != "load":
            continue
        if op in inputs:
            e = inputs[op]
        elif op == "const":
            e = (f"mod_iv_point({_int_literal(trace.int_bits(n.args[0], n.dtype), I)})"
                 if trace.is_int(n.dtype) else ("1" if n.args[0] else "2"))
        elif op == "array":
            continue
        elif op == "load":
            name, shape = n.args[0].args[0], n.args[0].args[2]
            arr = arrays[name]
            kind = -1 if n.dtype == F else 2 if n.dtype == B else 1 if arr in narrow else 0
            checked = int(modes.get((name, tuple(id(i) for i in n.args[1:])), CHECKED) == CHECKED)
            idx = [expr.get(id(i)) or "mod_iv_top()" for i in n.args[1:]] + ["mod_iv_point(0)"] * (MAX_DIMS - len(shape))
            e = f"mod_cell_load(m, {arr}, {len(shape)}, {', '.join(idx)}, {kind}, {checked}, &must)"
            if n.dtype == F:
                lines.append(f"    (void){e};")
                continue
            if n.dtype == B:
                e = f"mod_cell_set({e})"
            elif n.dtype == "u64":        # its values past int64 read as negative: unknown
                e = f"mod_iv_fit({e}, MOD_U64)"
        elif trace.is_int(n.dtype):
            if op == "cast" and n.args[0].dtype == B:
                e = f"mod_iv_of_set({a[0]})"
            elif op == "cast" and a[0] is not None:
                e = a[0]
            elif op in _CELL_INT and None not in a:
                e = _CELL_INT[op].format(*a)
            else:
                e = "mod_iv_top()"
            if n.dtype != I:      # exact where nothing wrapped (mod_iv_fit)
                e = f"mod_iv_fit({e}, {_MOD_TYPE[n.dtype]})"
        elif op in _CELL_CMP and all(trace.is_int(x.dtype) for x in n.args):
            e = _CELL_CMP[op].format(*a)
        elif op in _CELL_BOOL and None not in a:
            e = _CELL_BOOL[op].format(*a)
        else:
            e = "3"
        name = f"v{len(lines)}"
        lines.append(f"    const {'mod_iv' if trace.is_int(n.dtype) else 'int'} {name} = {e};")
        expr[id(n)] = name
    return (f"DEV int mod_mask_cell({CELL_ARGS}, {M_ARG})\n{{\n    int must = 0;\n"
            + "\n".join(lines)
            + f"\n    return must ? ATTN_BLOCK_KEPT | ATTN_BLOCK_MASKED : {expr[id(mask.out)]};\n}}\n")


# leaves a tile of the dQ kernels fixes: a CTA has one b and h, floats are call constants
_TILE_FIXED = frozenset({"b", "h", "const", "fconst", "param"})


def _affine_form(n, memo):
    """n's (a, c) from its arguments' (memo: id -> form, each argument's already there: nodes
    are taken in trace.topo's order, so an index of any depth recurses nowhere)."""
    op = n.op
    if op == "q_idx":
        f = (1, 0)
    elif op == "kv_idx":
        f = (0, 1)
    elif op in _TILE_FIXED:
        f = (0, 0)
    elif op in trace._LEAVES or op == "load":     # score, dout, a lookup (nested: its own faults)
        f = None
    else:
        args = [memo[id(a)] for a in n.args]
        if None in args:
            f = None
        elif all(x == (0, 0) for x in args):
            f = (0, 0)                             # fixed for the tile, whatever the op
        elif n.dtype != I:
            f = None
        elif op in ("add", "sub"):
            sign = 1 if op == "add" else -1
            f = (args[0][0] + sign * args[1][0], args[0][1] + sign * args[1][1])
        elif op == "neg":
            f = (-args[0][0], -args[0][1])
        elif op == "mul" and any(a.op == "const" and a.dtype == I for a in n.args):
            const, other = (0, 1) if n.args[0].op == "const" else (1, 0)
            v = n.args[const].args[0]
            f = (v * args[other][0], v * args[other][1])
        else:
            f = None
    return f


def affine(n):
    """(a, c) when the integer index node n is base + a * q_idx + c * kv_idx with base made of
    b, h and constants only (fixed over a tile of the dQ kernels), |a| and |c| at most
    MAX_TILE_COEF; else None (a product of two indices, a division, a nested lookup, ...).
    The generated code's integers wrap, as do these forms' operations: the form holds modulo
    2^64, so exactly wherever the tile's indices lie in range (mod_tile_term checks)."""
    if n.dtype != I:
        return None
    memo = {}
    for x in trace.topo(n):
        memo[id(x)] = _affine_form(x, memo)
    f = memo[id(n)]
    return f if f is not None and max(abs(f[0]), abs(f[1])) <= MAX_TILE_COEF else None


class TileTerm(NamedTuple):
    """A tile term's offset coefficients in q_idx and kv_idx (a, c: for its C-contiguous array,
    which a gradient's array always is: mod_arrays.py) and whether the call's Facts prove its
    lookup in range with every index in [0, n) (mode 0): then every tile of the call can take
    it, wherever it fits."""
    a: int
    c: int
    proven: bool


def _tile_terms(terms, array_node, modes):
    """The positions in terms (name, indices, adjoint) of the lookups that take the tiles' path,
    and each one's TileTerm; modes: _modes'. At most MAX_TILE_TERMS, the narrowest spans first:
    they fit more often, and the fewer elements a tile's adjoints fall on, the more atomics on
    each the tile saves (table[h]: every pair's on one)."""
    found = []
    for pos, (name, idx, _) in enumerate(terms):
        forms = [affine(i) for i in idx]
        if None in forms:
            continue
        shape = array_node(name).args[2]
        strides = [math.prod(shape[ax + 1:]) for ax in range(len(shape))]
        found.append((pos, TileTerm(sum(a * s for (a, _), s in zip(forms, strides)),
                                    sum(c * s for (_, c), s in zip(forms, strides)),
                                    modes.get((name, tuple(id(i) for i in idx)), CHECKED) == 0)))
    found = sorted(found, key=lambda x: (abs(x[1].a) + abs(x[1].c), x[0]))[:MAX_TILE_TERMS]
    return [pos for pos, _ in found], tuple(t for _, t in found)


def _tile_plan(terms, tiled, amap, how):
    """mod_tile_plan: each tile term's indices at the tile's first pair (q_idx, kv_idx) and
    coefficients, to mod_tile_term (attn_mods.cuh); whether the tile takes its path."""
    r = _Renderer(amap, 0, **how)
    r.render([i for pos in tiled for i in terms[pos][1]])
    body = ["    mod_tile_start(t);"] + r.lines
    for k, pos in enumerate(tiled):
        name, idx, _ = terms[pos]
        if not idx:                   # a 0-d array: one element
            body.append(f"    mod_tile_term(m, t, {k}, {amap[name]}, 0, 0, 0, 0, rows, cols);")
            continue
        forms = [affine(i) for i in idx]
        body += ["    {",
                 f"        const int64_t i0[] = {{{', '.join(r.expr[id(i)] for i in idx)}}};",
                 f"        const int64_t a[] = {{{', '.join(_int_literal(a, I) for a, _ in forms)}}};",
                 f"        const int64_t c[] = {{{', '.join(_int_literal(c, I) for _, c in forms)}}};",
                 f"        mod_tile_term(m, t, {k}, {amap[name]}, {len(idx)}, i0, a, c, rows, cols);",
                 "    }"]
    return (f"DEV int mod_tile_plan({PLAN_ARGS}, {M_ARG}, mod_tile *t)\n{{\n"
            "    (void)b; (void)h; (void)q_idx; (void)kv_idx;\n" + "\n".join(body)
            + "\n    return mod_tile_done(t);\n}\n")


def array_order(traced):
    """Captured array names of a traced function by position (its graph's topological order,
    the same for every function of one structure)."""
    pos = []
    for n in trace.topo(traced.out):
        if n.op == "array" and n.args[0] not in pos:
            pos.append(n.args[0])
    return pos


class Facts(NamedTuple):
    """What one call proves about its generated code, part of the code's key: for each lookup
    of score_mod and of mask_mod (bounds.loads order), its mode (bounds.lookup_modes: CHECKED, or
    read directly, counting the axes of these bits from the end when negative), and for each
    captured array by global number whether its integers are stored as int32 (storage). No
    Facts: every lookup checked, every integer array int64."""
    score: tuple = ()
    mask: tuple = ()
    narrow: tuple = ()


def _modes(traced, modes):
    """(array name, ids of the indices) -> mode, for traced's lookups: the derivative's scatters
    take the mode of the lookup whose indices they share."""
    return {(n.args[0].args[0], tuple(id(i) for i in n.args[1:])): m
            for n, m in zip(bounds.loads(traced), modes)} if modes else {}


class Generated(NamedTuple):
    """The generated header and what a call binds to it. source: the header's text; defines:
    the kernel switches (HAS_SCORE_MOD, HAS_MASK_MOD, HAS_DTENSORS); arrays: (kind "score_mod"
    / "mask_mod", name, value type) by global number; grad_arrays: the global numbers of the
    score_mod's float arrays that have a gradient term the backward computes (generate's
    wanted); n_score_floats: where mask_mod's float constants start in m->f; uses_h: whether a
    mod reads h; mask_uses_b / mask_uses_h: whether mask_mod reads b / h (the block mask has one
    slice per b / h only then); tile_terms: the TileTerms in mod_tile_plan's order
    (select.tile_sums); pair_loads: whether the score_mod looks up an array at an index that
    reads q_idx, kv_idx or the score (a load per score: its registers decide the forward's tile,
    select.fwd_ws_tile)."""
    source: str
    defines: dict
    arrays: tuple
    grad_arrays: tuple
    n_score_floats: int
    uses_h: bool
    mask_uses_b: bool = False
    mask_uses_h: bool = False
    tile_terms: tuple = ()
    pair_loads: bool = False


def _pair_loads(traced):
    """Whether a traced mod loads from an array at an index that depends on q_idx, kv_idx or the
    score (an index that varies from score to score)."""
    for n in trace.topo(traced.out):
        if n.op == "load" and any(x.op in ("q_idx", "kv_idx", "score") for x in trace.topo(*n.args[1:])):
            return True
    return False


def generate(score=None, mask=None, facts=None, wanted=None):
    """The Generated code of a traced score_mod and / or mask_mod (trace.Traced or None), for a
    call with these Facts (None: every lookup checked, every integer array int64). wanted: the
    positions (grad.positions) of the score_mod's arrays whose gradients a backward computes,
    None for all: the others get no scatter, and without any HAS_DTENSORS is 0 and neither
    mod_dtensors nor mod_tile_plan is generated, as for a score_mod without array gradients
    (the backward's kernels are then those of such a score_mod: dQ need not be recomputed)."""
    facts = facts or Facts()
    narrow = frozenset(i for i, x in enumerate(facts.narrow) if x)
    parts = [f"/* generated by attnext/codegen.py: {HEADER} */",
             "#ifndef ATTNEXT_ATTN_MOD_GEN_CUH", "#define ATTNEXT_ATTN_MOD_GEN_CUH", ""]
    arrays, numbers = [], {}
    for kind, t in (("score_mod", score), ("mask_mod", mask)):
        if t is None:
            continue
        for name in array_order(t):
            node = next(n for n in trace.topo(t.out) if n.op == "array" and n.args[0] == name)
            numbers[(kind, name)] = len(arrays)
            arrays.append((kind, name, trace.kind_of(node.dtype)))
    if len(arrays) > MAX_ARRAYS:
        raise TypeError(f"the GPU code generator takes at most {MAX_ARRAYS} captured arrays in "
                        f"score_mod and mask_mod together, got {len(arrays)}")
    defines = dict(HAS_SCORE_MOD=int(score is not None), HAS_MASK_MOD=int(mask is not None),
                   HAS_DTENSORS=0)
    grad_arrays, uses_h, tile_terms = [], False, ()
    n_score_floats = len(score.params) if score is not None else 0
    if score is not None:
        amap = {name: numbers[("score_mod", name)] for name in array_order(score)}
        how = dict(modes=_modes(score, facts.score), narrow=narrow)
        g = grad.grad(score)
        uses_h |= any(n.op == "h" for n in trace.topo(score.out))
        parts.append(f"/* score_mod {score.key[:16]} */")
        head = head_loads(score, how["modes"])
        parts.append(_head_function(score, head, amap, **how))
        parts.append(_function("float", "mod_score", f"{SCORE_ARGS}, {M_ARG}", [score.out], amap, 0,
                               ["    return {0};"], head=head, **how))
        parts.append(_function("float", "mod_dscore", f"{SCORE_ARGS}, float dout, {M_ARG}", [g.dscore],
                               amap, 0, ["    return {0};"], head=head, **how))
        keep = None if wanted is None else {array_order(score)[i] for i in wanted}
        terms = [(name, idx, adj) for name, ts in g.darrays.items() for idx, adj in ts
                 if keep is None or name in keep]
        if terms:
            defines["HAS_DTENSORS"] = 1
            grad_arrays = sorted({amap[name] for name, _, _ in terms})
            roots = [x for _, idx, adj in terms for x in (*idx, adj)]

            def array_node(name):
                return next(n for n in trace.topo(score.out) if n.op == "array" and n.args[0] == name)

            tiled, tile_terms = _tile_terms(terms, array_node, how["modes"])
            k_of = {pos: k for k, pos in enumerate(tiled)}

            def scatter(r, pos):  # the _check twin only checks the offsets
                name, idx, adj = terms[pos]
                off = r.offset(array_node(name), idx)
                if r.check:
                    return f"    (void){off};"
                if pos in k_of:
                    return f"    mod_scatter_tile(m, t, {k_of[pos]}, {amap[name]}, {off}, {r.expr[id(adj)]});"
                return f"    mod_scatter(m, {amap[name]}, {off}, {r.expr[id(adj)]});"
            parts.append(_function("void", "mod_dtensors", f"{SCORE_ARGS}, float dout, const mod_tile *t, {M_ARG}",
                                   roots, amap, 0,
                                   [lambda r: "\n".join(scatter(r, pos) for pos in range(len(terms)))],
                                   head=head, **how))
            parts.append(_tile_plan(terms, tiled, amap, how))
    if mask is not None:
        amap = {name: numbers[("mask_mod", name)] for name in array_order(mask)}
        uses_h |= any(n.op == "h" for n in trace.topo(mask.out))
        parts.append(f"/* mask_mod {mask.key[:16]} */")
        parts.append(_function("int", "mod_mask", f"{MASK_ARGS}, {M_ARG}", [mask.out], amap,
                               n_score_floats, ["    return {0};"], modes=_modes(mask, facts.mask),
                               narrow=narrow))
        parts.append(_cell_function(mask, amap, _modes(mask, facts.mask), narrow))
    if n_score_floats + (len(mask.params) if mask is not None else 0) > MAX_FLOATS:
        raise TypeError(f"the GPU code generator takes at most {MAX_FLOATS} float constants in "
                        "score_mod and mask_mod together")
    parts.append("#endif\n")
    leaves = {n.op for n in trace.topo(mask.out)} if mask is not None else set()
    return Generated("\n".join(parts), defines, tuple(arrays), tuple(grad_arrays),
                     n_score_floats, uses_h, "b" in leaves, "h" in leaves, tile_terms,
                     score is not None and _pair_loads(score))


# --- the cache ------------------------------------------------------------------------------

_cache = CountedCache(CACHE_CAPACITY)


def generated(score=None, mask=None, facts=None, wanted=None):
    """generate(score, mask, facts, wanted), from an LRU keyed by the graphs' structural keys,
    the facts and wanted (positions, so that functions of one structure share it)."""
    key = (score.key if score is not None else None, mask.key if mask is not None else None,
           facts or Facts(), None if wanted is None else tuple(wanted))
    return _cache.get_or_make(key, lambda: generate(score, mask, facts, wanted))


def cache_info():
    """The generator cache's counters (code generations; NVRTC's are nvrtc.cache_info())."""
    return _cache.info()


# --- one call's parameters -------------------------------------------------------------------

ARRAY_DTYPE = np.dtype([("ptr", "u8"), ("shape", "i8", MAX_DIMS), ("s", "i8", MAX_DIMS),
                        ("grad", "i8")], align=True)
MODS_DTYPE = np.dtype([("f", "f4", MAX_FLOATS), ("a", ARRAY_DTYPE, MAX_ARRAYS), ("err", "u8"),
                       ("dacc", "u8"), ("blocks", "u8"), ("blk", "i8", 4)], align=True)
BLOCK = 64                 # ATTN_BLOCK: the block mask's cells are BLOCK x BLOCK pairs
BLOCK_CELLS = 16           # ATTN_BLOCK_CELLS: cells of a row a CTA of attn_block_mask.cu takes at most
BLOCK_MASK_CTAS = 512      # ... once the grid has this many CTAs (fewer: one cell a CTA, up to it)


def block_mask_grid(slices, rows, cols):
    """attn_block_mask.cu's grid over a block mask of slices x rows x cols cells: each CTA takes
    up to BLOCK_CELLS cells of a row (the kernel divides a row by the grid's width), fewer where
    the mask is small, so that a mask whose cells the intervals cannot settle, evaluated pair by
    pair one cell after another, still spreads over BLOCK_MASK_CTAS CTAs."""
    per = max(1, min(BLOCK_CELLS, slices * rows * cols // BLOCK_MASK_CTAS))
    return -(-cols // per), rows, slices


STORAGE = {F: np.dtype(np.float32), I: np.dtype(np.int64), B: np.dtype(np.bool_)}   # by value type
NARROW = np.dtype(np.int32)      # integers whose values fit (Facts.narrow): half the registers
_NARROW_SOURCES = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16))


def storage_dtype(kind, values=None, dtype=None):
    """The dtype the kernels read a captured array of value type kind in (a bool as its one
    byte): float32, bool, and for integers int32 when their values are known to fit (values:
    (min, max)), or dtype (a CUDA array's, values unseen) holds nothing wider; else int64."""
    if kind == I and (bounds.fits_int32(values) or dtype in _NARROW_SOURCES):
        return NARROW
    return STORAGE[kind]


def storage(a, kind, narrow=False):
    """A NumPy array as the kernels read it, C-contiguous in storage_dtype (narrow: int32 for
    integers whose values fit; else int64, what generate without Facts reads)."""
    a = np.asarray(a)
    values = bounds.value_range(a) if narrow and kind == I else None
    return np.ascontiguousarray(a, dtype=storage_dtype(kind, values)).reshape(a.shape)   # 0-d stays 0-d


def pack(gen, floats, arrays, err_ptr, dacc_ptr, grad_offsets, blocks=(0, 0, 0, 0, 0)):
    """The bytes of one call's attn_mods_gpu. floats: the float constants in m->f order;
    arrays: (ptr, shape, element strides) by global number; grad_offsets: global number ->
    first gradient element (others -1); blocks: the block mask's (ptr, blk_sb, blk_sh,
    blk_rows, blk_cols), ptr 0 for none."""
    rec = np.zeros((), MODS_DTYPE)
    rec["f"][:len(floats)] = np.asarray(floats, np.float32)
    rec["a"]["grad"] = -1
    for i, off in grad_offsets.items():
        rec["a"][i]["grad"] = off
    for i, (ptr, shape, strides) in enumerate(arrays):
        a = rec["a"][i]
        a["ptr"] = ptr
        a["shape"][:] = 1
        a["s"][:] = 0
        a["shape"][:len(shape)] = shape
        a["s"][:len(strides)] = strides
        if 0 in tuple(shape):
            # the kernels read element 0 of an empty array, unused (a lookup into it is always
            # out of range; attn_mods.cuh): any readable word serves, the error record's
            a["ptr"] = err_ptr
            a["grad"] = -1                  # and its gradient has no element to add into
    rec["err"] = err_ptr
    rec["dacc"] = dacc_ptr
    rec["blocks"] = blocks[0]
    rec["blk"][:] = blocks[1:]
    return rec.tobytes()


def _carry(limbs):
    """Carries up in place, so that every limb but the last is a digit in [0, 2^LIMB_BITS)."""
    for j in range(LIMBS - 1):
        carry = limbs[..., j] >> LIMB_BITS     # arithmetic shift: floor division
        limbs[..., j] &= (1 << LIMB_BITS) - 1
        limbs[..., j + 1] += carry


def limbs_to_float(words):
    """The float64 values of gradient accumulators: words (..., WORDS) uint64 as the kernels
    left them (attn_mods.cuh: signed limbs, then a flags word). Negative sums are negated
    first, so the float64 sum of the digits adds terms of one sign, from the largest: within an
    ulp of float64, whatever the magnitudes."""
    w = np.asarray(words, dtype=np.uint64)
    limbs = w[..., :LIMBS].view(np.int64).copy()
    flags = w[..., LIMBS]
    _carry(limbs)
    neg = limbs[..., LIMBS - 1] < 0
    limbs[neg] = -limbs[neg]
    _carry(limbs)
    out = np.zeros(limbs.shape[:-1], np.float64)
    for j in reversed(range(LIMBS)):
        out += np.ldexp(limbs[..., j].astype(np.float64), LIMB_BITS * j + LIMB_LSB)
    out = np.where(neg, -out, out)
    nan = ((flags & 1) != 0) | (((flags & 2) != 0) & ((flags & 4) != 0))
    out = np.where((flags & 2) != 0, np.inf, out)
    out = np.where((flags & 4) != 0, -np.inf, out)
    return np.where(nan, np.nan, out)


def call_arrays(score=None, mask=None):
    """(kind, name) of a call's captured arrays by global number, in its own functions' names:
    gen.arrays holds the names of whichever function of that structure was generated first
    (`table` in one lambda is `REL_TABLE` in another)."""
    return [(kind, name) for kind, t in (("score_mod", score), ("mask_mod", mask)) if t is not None
            for name in array_order(t)]


def index_error(names, err):
    """The IndexError for a device error record err = (flag, array, axis, index, size); names:
    call_arrays()."""
    kind, name = names[int(err[1])]
    return IndexError(f"{kind}: index {int(err[3])} is out of bounds for axis {int(err[2])} of "
                      f"array {name!r} with size {int(err[4])}")
