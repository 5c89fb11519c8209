"""CUDA code generation for traced score_mods / mask_mods (the GPU twin of interp.py).

A traced graph (trace.py) becomes C source: device functions that the kernels call from their
one score_mod slot and one mask_mod slot (kernels/attn_common.cuh: score_of, score_grad,
mask_keeps, and ds_tile for the array gradients):

    float mod_score(float score, int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, const attn_mods_gpu *m)
    float mod_dscore(... the same ..., float dout, m)      d out / d score times dout (trace.grad)
    void  mod_dtensors(... the same ..., float dout, m)    each float array's adjoint, scatter-added
    int   mod_mask(int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, m)

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

Table-driven rendering (STYLE.md #4): one op -> C-expression table per value type, fully
parenthesised; values are named in topological order, a value used once is inlined, and every
lookup is a statement of its own, evaluated whatever np.where chooses, so that a lookup out of
range is reported where the reference (which evaluates both branches) reports it. A node the
tables cannot render raises TypeError naming it.

Gradients of the captured float arrays are accumulated exactly: integer fixed-point limbs added
by atomics (attn_mods.cuh), so the result is the same bits whatever order the GPU threads add
in; kernels/attn_dtensors.cu turns them into the arrays' gradients on the device, by the rule
limbs_to_float spells out on the host (the tests hold the two to the same bits).
"""
import math
from typing import NamedTuple

import numpy as np

from . import bounds, trace
from .bounds import CHECKED
from .kernel_cache import CountedCache
from .trace import B, F, I

HEADER = "attn_mod_gen.cuh"
MAX_FLOATS = 64            # ATTN_MOD_FLOATS (csrc/attn_params.h)
MAX_ARRAYS = 8             # ATTN_MOD_ARRAYS
MAX_DIMS = 4               # ATTN_MOD_DIMS
LIMBS, LIMB_BITS, LIMB_LSB = 12, 24, -149      # attn_mods.cuh
WORDS = LIMBS + 1
CACHE_CAPACITY = 256

C_TYPE = {F: "float", I: "int64_t", B: "int"}
SCORE_ARGS = "float score, int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx"
MASK_ARGS = "int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx"
M_ARG = "const attn_mods_gpu *m"

# op -> C expression over the operands {0}, {1}, {2}, by the result's value type
_FLOAT_OPS = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "truediv": "({0} / {1})",
    "floordiv": "mod_ffloordiv({0}, {1})", "mod": "mod_fmod({0}, {1})", "pow": "powf({0}, {1})",
    "minimum": "mod_fmin({0}, {1})", "maximum": "mod_fmax({0}, {1})", "neg": "(-{0})",
    "abs": "fabsf({0})", "exp": "expf({0})", "exp2": "exp2f({0})", "log": "logf({0})",
    "log2": "log2f({0})", "sqrt": "sqrtf({0})", "tanh": "fast_tanh({0})", "sin": "sinf({0})",
    "cos": "cosf({0})", "where": "({0} ? {1} : {2})", "dmul": "mod_dmul({0}, {1})",
    "cast": "((float)({0}))",
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
_TABLES = {F: _FLOAT_OPS, I: _INT_OPS, B: _BOOL_OPS}
_LOAD = {F: "mod_load_f", I: "mod_load_i", B: "mod_load_b"}
_INPUT_NAMES = ("score", "b", "h", "q_idx", "kv_idx", "dout")

# every op the tracer can produce (trace.py's _ARITH, _COMPARE, _BITWISE, _UNARY_FLOAT, ...) and
# the derivative's own (dmul): tests/test_codegen.py checks that this covers trace's list
SUPPORTED_OPS = frozenset(_FLOAT_OPS) | frozenset(_INT_OPS) | frozenset(_BOOL_OPS) | {"load"}


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


class _Renderer:
    """Renders the nodes reachable from some roots as C statements of one function."""

    def __init__(self, arrays, float_base, check=False, modes=None, narrow=frozenset()):
        self.arrays = arrays          # array name -> its global number
        self.float_base = float_base  # this function's first float constant in m->f
        self.check = check            # the _check twin: lookups report, nothing else is done
        self.modes = modes or {}      # (array name, id of each index) -> lookup mode (Facts)
        self.narrow = narrow          # global numbers of the integer arrays stored as int32
        self.lines = []
        self.expr = {}
        self.lookups = False

    def render(self, roots):
        order = trace.topo(*roots)
        uses = {}
        for n in order:
            for a in trace._children(n):
                uses[id(a)] = uses.get(id(a), 0) + 1
        for r in roots:
            uses[id(r)] = uses.get(id(r), 0) + 2          # a root is always named
        for n in order:
            e = self._expr_of(n)
            if e is None:
                continue
            named = n.op == "load" or (n.op not in trace._LEAVES and uses.get(id(n), 0) > 1)
            if named:
                name = f"v{len(self.lines)}"
                self.lines.append(f"    const {C_TYPE[n.dtype]} {name} = {e};")
                e = name
            self.expr[id(n)] = e

    def _expr_of(self, n):
        op = n.op
        if op in _INPUT_NAMES:
            return op
        if op == "const":
            return _int_literal(n.args[0], n.dtype)
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
        if op == "load":
            arr = self.arrays[n.args[0].args[0]]
            load = "mod_load_i32" if n.dtype == I and arr in self.narrow else _LOAD[n.dtype]
            return f"{load}(m, {arr}, {self.offset(n.args[0], n.args[1:])})"
        table = _TABLES.get(n.dtype, {})
        if op not in table:
            raise TypeError(f"the GPU code generator cannot render {op!r} ({n.dtype}): "
                            f"{trace.format_expr(n)}")
        return table[op].format(*(self.expr[id(a)] for a in n.args))

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


def _function(ret, name, params, roots, arrays, float_base, tail, modes=None, narrow=frozenset()):
    """Three functions for `ret name(params)`, computing roots then tail (str formats of the
    roots' expressions, or callables of the renderer):
      name_q (..., int *bad)  what the kernels inline at every score: a lookup out of range is
                              clamped and sets *bad, branch-free
      name_check (...)        MOD_COLD (attn_mods.cuh): the same lookups, each reporting an index
                              out of range (mod_fail); nothing else. A kernel calls it once per
                              tile that noted one (attn_common.cuh: mods_report)
      name (...)              name_q, then name_check if it noted one (the host C tests)
    modes, narrow: _Renderer's."""
    r = _Renderer(arrays, float_base, modes=modes, narrow=narrow)
    r.render(roots)
    body = [t.format(*(r.expr[id(x)] for x in roots)) if isinstance(t, str) else t(r) for t in tail]
    c = _Renderer(arrays, float_base, check=True, modes=modes, narrow=narrow)
    c.render(roots)
    check = c.lines + [t(c) for t in tail if not isinstance(t, str)] if c.lookups else []
    names = [p.split()[-1].lstrip("*") for p in params.split(", ")]
    call = f"{name}_q({', '.join(names)}, &bad)"
    return (f"MOD_COLD void {name}_check({params})\n{{\n" + "\n".join(check or ["    (void)m;"])
            + "\n}\n\n"
            + f"DEV {ret} {name}_q({params}, int *bad)\n{{\n" + ("" if r.lookups else "    (void)bad;\n")
            + "\n".join(r.lines + body) + "\n}\n\n"
            + f"DEV {ret} {name}({params})\n{{\n    int bad = 0;\n"
            + (f"    {call};\n" if ret == "void" else f"    const {ret} v = {call};\n")
            + f"    if (bad)\n        {name}_check({', '.join(names)});\n"
            + ("" if ret == "void" else "    return v;\n") + "}\n")


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
    score_mod's float arrays that have a gradient term; n_score_floats: where mask_mod's float
    constants start in m->f; uses_h: whether a mod reads h; mask_uses_b / mask_uses_h: whether
    mask_mod reads b / h (the block mask has one slice per b / h only then)."""
    source: str
    defines: dict
    arrays: tuple
    grad_arrays: tuple
    n_score_floats: int
    uses_h: bool
    mask_uses_b: bool = False
    mask_uses_h: bool = False


def generate(score=None, mask=None, facts=None):
    """The Generated code of a traced score_mod and / or mask_mod (trace.Traced or None), for a
    call with these Facts (None: every lookup checked, every integer array int64)."""
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
            arrays.append((kind, name, node.dtype))
    if len(arrays) > MAX_ARRAYS:
        raise TypeError(f"the GPU code generator takes at most {MAX_ARRAYS} captured arrays in "
                        f"score_mod and mask_mod together, got {len(arrays)}")
    defines = dict(HAS_SCORE_MOD=int(score is not None), HAS_MASK_MOD=int(mask is not None),
                   HAS_DTENSORS=0)
    grad_arrays, uses_h = [], False
    n_score_floats = len(score.params) if score is not None else 0
    if score is not None:
        amap = {name: numbers[("score_mod", name)] for name in array_order(score)}
        how = dict(modes=_modes(score, facts.score), narrow=narrow)
        g = trace.grad(score)
        uses_h |= any(n.op == "h" for n in trace.topo(score.out))
        parts.append(f"/* score_mod {score.key[:16]} */")
        parts.append(_function("float", "mod_score", f"{SCORE_ARGS}, {M_ARG}", [score.out], amap, 0,
                               ["    return {0};"], **how))
        parts.append(_function("float", "mod_dscore", f"{SCORE_ARGS}, float dout, {M_ARG}", [g.dscore],
                               amap, 0, ["    return {0};"], **how))
        terms = [(name, idx, adj) for name, ts in g.darrays.items() for idx, adj in ts]
        if terms:
            defines["HAS_DTENSORS"] = 1
            grad_arrays = sorted({amap[name] for name, _, _ in terms})
            roots = [x for _, idx, adj in terms for x in (*idx, adj)]

            def scatters(r):      # the _check twin only checks the offsets
                return "\n".join(
                    f"    {'(void)' if r.check else f'mod_scatter(m, {amap[name]}, '}"
                    f"{r.offset(next(n for n in trace.topo(score.out) if n.op == 'array' and n.args[0] == name), idx)}"
                    f"{';' if r.check else f', {r.expr[id(adj)]});'}" for name, idx, adj in terms)
            parts.append(_function("void", "mod_dtensors", f"{SCORE_ARGS}, float dout, {M_ARG}", roots,
                                   amap, 0, [scatters], **how))
    if mask is not None:
        amap = {name: numbers[("mask_mod", name)] for name in array_order(mask)}
        uses_h |= any(n.op == "h" for n in trace.topo(mask.out))
        parts.append(f"/* mask_mod {mask.key[:16]} */")
        parts.append(_function("int", "mod_mask", f"{MASK_ARGS}, {M_ARG}", [mask.out], amap,
                               n_score_floats, ["    return {0};"], modes=_modes(mask, facts.mask),
                               narrow=narrow))
    if n_score_floats + (len(mask.params) if mask is not None else 0) > MAX_FLOATS:
        raise TypeError(f"the GPU code generator takes at most {MAX_FLOATS} float constants in "
                        "score_mod and mask_mod together")
    parts.append("#endif\n")
    leaves = {n.op for n in trace.topo(mask.out)} if mask is not None else set()
    return Generated("\n".join(parts), defines, tuple(arrays), tuple(grad_arrays),
                     n_score_floats, uses_h, "b" in leaves, "h" in leaves)


# --- the cache ------------------------------------------------------------------------------

_cache = CountedCache(CACHE_CAPACITY)


def generated(score=None, mask=None, facts=None):
    """generate(score, mask, facts), from an LRU keyed by the graphs' structural keys and the
    facts."""
    key = (score.key if score is not None else None, mask.key if mask is not None else None,
           facts or Facts())
    return _cache.get_or_make(key, lambda: generate(score, mask, facts))


def cache_info():
    """The generator cache's counters (code generations; NVRTC's are kernels.cache_info())."""
    return _cache.info()


# --- one call's parameters -------------------------------------------------------------------

ARRAY_DTYPE = np.dtype([("ptr", "u8"), ("shape", "i8", MAX_DIMS), ("s", "i8", MAX_DIMS),
                        ("grad", "i8")], align=True)
MODS_DTYPE = np.dtype([("f", "f4", MAX_FLOATS), ("a", ARRAY_DTYPE, MAX_ARRAYS), ("err", "u8"),
                       ("dacc", "u8"), ("blocks", "u8"), ("blk", "i8", 4)], align=True)
BLOCK = 64                 # ATTN_BLOCK: the block mask's cells are BLOCK x BLOCK pairs
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
