"""The CUDA backend's host side: where each array lives, NumPy staging, kernel choice, launches.

api.py has checked every argument; arrays arrive as NumPy views or DevViews (GPU memory read in
place). NumPy inputs travel through staging.py (their memory registered in place where it can
be, else its pinned rings), results come back the same way (a large NumPy forward runs in batch
slices, and a causal one's last sequence in row slices, whose copies overlap the kernels). GPU
inputs are read where they are, on the stream their protocol names (0, the legacy default
stream, when it names none), and results come back as the caller's library's arrays (DLPack)
or attnext.DeviceArray.

Plans. Everything a call's launches are derived from -- its arrays' shapes, strides and dtypes,
whether q, k, v start on 16-byte boundaries, its options, the device and the kernel lab's
overrides -- keys a plan: the kernels (loaded), grids, shared memory, scratch sizes and the
launch template (_C.attn_template) of every launch. A call with the key of an earlier one
reuses its plan and only hands the launches its addresses and scalars (scale, softcap), so the
decisions below run once per shape, not once per call. The plans sit in a bounded LRU.

score_mod / mask_mod. The generated code (codegen.py, keyed by the traced graphs' structure) is
part of a plan's key: it changes the kernels. What one call binds to it -- the float constants,
the captured arrays (mod_inputs.py: host ones uploaded, CUDA ones in place or converted on the
device), the error record and the gradient accumulator -- travels with the call's addresses as
the attn_mods_gpu bytes cuda_launch_attention copies into attn_params. NumPy and CUDA calls
bind them alike.
"""
import collections
import copy
import math
import threading
import types

import ml_dtypes
import numpy as np

from .. import _C, _env
from .._layout import DTYPE_CODES, SLOT, KernelCall, dtype_name
from ..lru import LRU
from ..mods import bounds, codegen, grad, lower, trace
from . import arrays as _device, lengths as lengths_check, mod_cache, mod_inputs as mod_arrays, nvrtc, process
from . import repeat, scale16, select, staging
from .devview import DevView
from .staging import host_result, to_host  # noqa: F401  (api.py's: results, lengths)

# what the GPU kernels take (float32 on TF32 tensor cores, by split products unless
# precision="tf32"); float64 stays on the CPU
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))
_lock = threading.Lock()
_status = None            # None: not probed yet; "" usable; else why not


def unavailable_reason():
    """'' when the CUDA backend can run here, else why not (driver, device or NVRTC)."""
    global _status
    with _lock:
        if _status is None:
            try:
                _C.cuda_load()
                _status = nvrtc.driver_mismatch(nvrtc.nvrtc_version(), nvrtc.driver_version())
            except RuntimeError as e:
                _status = str(e)
            except AttributeError:
                _status = "this build of attnext._C has no CUDA host code"
        return _status


def usable():
    return unavailable_reason() == ""


def device_arch(device):
    """NVRTC's architecture name for the device: sm_90a on Hopper (its wgmma path), else sm_XY."""
    major, minor = device_info(device)["compute_capability"]      # cached: no driver call per launch
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


_info_cache = {}


# freed device memory the device's current pool keeps reserved at a synchronisation, at least
# (the driver's default is none): a NumPy call synchronises at its end, and its next call would
# map its buffers again
POOL_KEEP_BYTES = _env.nbytes("ATTNEXT_POOL_KEEP_BYTES", 1 << 30)


def device_info(device):
    """The device's properties (cached); on a device's first use, its pool's keep (above)."""
    if device not in _info_cache:
        info = _C.cuda_info(device)
        try:
            _C.mem_pool_keep(POOL_KEEP_BYTES, device)
        except RuntimeError:
            pass            # a driver that refuses it: memory goes back at each sync, as before
        _info_cache[device] = info
    return _info_cache[device]


# ---------------------------------------------------------------- device memory
def empty(shape, dtype, device, stream):
    return _device.empty(shape, dtype, device, stream)


# ---------------------------------------------------------------- plans
PLAN_CAPACITY = 256        # plans kept (each holds its loaded kernels)
SCRATCH_ALIGN = 256        # bytes: where each scratch array of a plan starts
_plans = LRU(PLAN_CAPACITY)
process.at_fork(after_in_child=repeat.forget_after_fork)


def clear_plans():
    """Forgets every plan (the tests that stand in for kernels or devices call it), and the
    recipes of repeated calls that hold them."""
    _plans.clear()
    repeat.clear()


def plan_count():
    return len(_plans)


class _Plan:
    """A call's launches: template (the attn_params less addresses and scalars), launches
    [(fn, grid, block, smem)] in order, scratch bytes (0: none) and offsets, a pair (address
    slot, byte offset in the scratch buffer) per scratch array; zero: (address slot, bytes) of
    the scratch arrays zeroed before the launches; upgrade: the futures of a faster kernel's
    background compile (nvrtc.compile_ahead), after which the call's plan is made anew, or ();
    counters: the int32 counters (process.borrow_counters) the launches take where the stream
    lends them (attn_params.counters), or 0; skipped: the last launches they make unnecessary
    (the split-KV forward's own merge: attn_fwd_combine)."""

    __slots__ = ("template", "launches", "scratch", "offsets", "zero", "upgrade", "counters", "skipped")

    def __init__(self, template, launches, scratch=0, offsets=(), zero=(), upgrade=(), counters=0, skipped=0):
        self.template, self.launches, self.scratch, self.offsets = template, launches, scratch, offsets
        self.zero, self.upgrade, self.counters, self.skipped = zero, upgrade, counters, skipped


def _desc(view):
    """What a plan depends on of an array: shape, strides and dtype (None: absent)."""
    return None if view is None else (view.shape, view.strides, view.dtype)


def _scratch_layout(*sizes):
    """(total bytes, byte offset of each array) of arrays of these byte sizes in one buffer."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return total, tuple(offsets)


def _launch(plan, device, stream, ptrs, scale, softcap, gmods=None):
    """plan's launches on the call's device and stream with these addresses (in
    _C.cuda_launch_attention's order) and the call's scale and softcap values. The slots of the
    plan's scratch arrays (None in ptrs) get addresses in the stream's
    scratch buffer, borrowed until the launches are enqueued. gmods: the call's bound score_mod /
    mask_mod (the attn_mods_gpu bytes) or None."""
    if not plan.launches:
        return
    launch = _C.cuda_launch_attention if gmods is None else _with_gmods(gmods)
    launches = plan.launches
    counters = process.borrow_counters(plan.counters, device, stream) if plan.counters else None
    if counters is not None:
        ptrs, launches = _at_slots(ptrs, {SLOT_COUNTERS: counters[0]}), launches[:len(launches) - plan.skipped]
    buf = process.borrow_scratch(plan.scratch, device, stream) if plan.scratch else None
    try:
        if buf is not None:
            ptrs = list(ptrs)
            for slot, offset in plan.offsets:
                ptrs[slot] = buf[0] + offset
            ptrs = tuple(ptrs)
        for slot, nbytes in plan.zero:
            _C.memset_d8(ptrs[slot], 0, nbytes, stream, device)
        for fn, grid, block, smem, *own in launches:     # own: a launch's own template
            launch(fn, grid, block, smem, stream, own[0] if own else plan.template, ptrs, scale, softcap)
    finally:
        if buf is not None:
            process.give_back_scratch(buf, device, stream)
        if counters is not None:
            process.give_back_counters(counters, device, stream)


# what a replay of a forward needs of its first call (cuda/repeat.py files it): plan, ptrs
# (_C.cuda_launch_attention's addresses; slots 3 and 4 out's and lse's), device and stream, the
# launch's scale and softcap values, and for results the replay allocates (no out= given, an lse
# asked for): out_new, their shapes and dtypes, the caller's library's from_dlpack (None:
# DeviceArrays back), the checks enqueued before the launches (device lengths' attn_lengths, a
# CUDA block table's attn_pages: lengths.Check), keep: what the first call uploaded that ptrs
# address (host lengths, whose contents are in the key), captured: (name, values) of the array a
# mask_mod lowered to documents read its runs from (api.py fills it; a replay first finds the
# array still beginning with those values)
Recipe = collections.namedtuple("Recipe", "plan ptrs device stream scale_value softcap_value out_new out_shape "
                                          "out_dtype lse_shape lse_dtype from_dlpack checks keep captured",
                                defaults=((), ()))


def replay(r, out):
    """A repeated forward's result by its recipe r: the pending device-length errors raised, its
    results allocated (out: the call's out=, returned as it is, or None), its checks (a CUDA
    block table's) and launches enqueued."""
    lengths_check.raise_pending()
    ptrs = r.ptrs
    new_out = lse = None
    if r.out_new or r.lse_shape is not None:
        ptrs = list(ptrs)
        if r.out_new:
            new_out = empty(r.out_shape, r.out_dtype, r.device, r.stream)
            ptrs[3] = new_out.ptr
        if r.lse_shape is not None:
            lse = empty(r.lse_shape, r.lse_dtype, r.device, r.stream)
            ptrs[4] = lse.ptr
        ptrs = tuple(ptrs)
    for check in r.checks:
        lengths_check.relaunch(check, r.stream)
    _launch(r.plan, r.device, r.stream, ptrs, r.scale_value, r.softcap_value)
    result = out if new_out is None else _caller(new_out, r.from_dlpack)
    return result if lse is None else (result, _caller(lse, r.from_dlpack))


def _caller(devarr, from_dlpack):
    return devarr if from_dlpack is None else from_dlpack(devarr)


def _with_gmods(gmods):
    """_C.cuda_launch_attention with these attn_mods_gpu bytes as its last argument."""
    def launch(*args):
        _C.cuda_launch_attention(*args, gmods)
    return launch


# _C.cuda_launch_attention's address slots of the plans' scratch arrays, by name (_layout.PTR_FIELDS)
SLOT_O_ACCUM, SLOT_LSE_ACCUM, SLOT_DELTA, SLOT_DQ_ACCUM, SLOT_DQ_SEM, SLOT_DEAD, SLOT_ROW_MZ = (
    SLOT[name] for name in ("o_accum", "lse_accum", "delta", "dq_accum", "dq_sem", "dead", "row_mz"))
SLOT_SINKS = SLOT["sinks"]        # dsinks follows it
SLOT_COUNTERS = SLOT["counters"]
SLOT_BLOCK_TABLE = SLOT["block_table"]
SLOT_GRAD_SCALES = SLOT["grad_scales"]


def _at_slots(ptrs, at):
    """ptrs with at's {slot: address} filled in (None where neither gives one)."""
    if not at:
        return ptrs
    out = list(ptrs) + [None] * (max(at) + 1 - len(ptrs))
    for slot, ptr in at.items():
        out[slot] = ptr
    return tuple(out)


def _sinks_view(o, stage):
    """The call's sinks (Hq,) float32 on the device (host ones uploaded), or None."""
    s = o.sink_values
    if s is None or isinstance(s, DevView):
        return s
    return stage.upload(np.ascontiguousarray(s, np.float32))


def _with_sinks(ptrs, sinks, dsinks=None):
    """ptrs with the sinks' (and the backward's dsinks') addresses in their slots."""
    if sinks is None:
        return ptrs
    return _at_slots(ptrs, {SLOT_SINKS: sinks.ptr, **({} if dsinks is None else {SLOT_SINKS + 1: dsinks.ptr})})


def _vec_ok(view, D):
    """16-byte cp.async loads: D a multiple of 16 bytes' elements, contiguous, on 16-byte rows."""
    chunk = 16 // view.itemsize
    return (D % chunk == 0 and view.strides[3] == 1 and view.ptr % 16 == 0
            and all(s % chunk == 0 for s in view.strides[:3]))


def _t(x):
    return None if x is None else x.as_tuple()


def _put(stage, x):
    """A DevView of x: GPU arrays as they are, NumPy arrays uploaded."""
    return None if x is None else stage.upload(x) if isinstance(x, np.ndarray) else x


def _result(stage, host, shape, dtype):
    """(view the kernel writes, what the caller gets): a scratch buffer for a NumPy call (copied
    out afterwards), else a DeviceArray the caller keeps."""
    if host:
        v = stage.scratch(shape, dtype)
        return v, v
    arr = empty(shape, dtype, stage.device, stage.stream)
    return DevView(arr.ptr, arr.shape, arr.strides, arr.dtype, stage.device, stage.stream, arr), arr


def _kernel_layout(o, x):
    """A result in the caller's layout as the kernels' (Bm, S, H, D) view."""
    if o.varlen:
        return x[None]
    return x.transpose(0, 2, 1, 3) if o.layout == "bhsd" else x


_NO_EXTRAS = (None,) * 7


def _extras(o, stage):
    """(bias4, mask4, alibi, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) as DevViews (NumPy
    ones uploaded), None where absent. Device lengths are checked on the stream first (their
    launch left in o.lengths_check for a repeat of the call)."""
    if (o.bias4 is None and o.mask4 is None and o.alibi is None and o.cu_q is None
            and o.used_q is None and o.used_k is None):
        return _NO_EXTRAS
    bias4 = _put(stage, o.bias4)
    mask4 = None if o.mask4 is None else _put(stage, o.mask4.view(np.uint8) if isinstance(o.mask4, np.ndarray) else o.mask4)
    alibi = None if o.alibi is None else stage.upload(np.ascontiguousarray(o.alibi, np.float32))
    lengths = (o.cu_q, o.cu_k, o.used_q, o.used_k)
    if o.device_lengths:          # CUDA int32 arrays, read in place (checks._device_lengths)
        o.lengths_check = lengths_check.launch(stage, o, device_arch(stage.device))
        return (bias4, mask4, alibi) + lengths
    return (bias4, mask4, alibi) + _lengths(stage, lengths)


def _lengths(stage, arrays):
    """DevViews of the host-checked lengths arrays (cu_seqlens / seqused: NumPy, None where
    absent), uploaded in one copy, an array equal to one before it sharing that one's elements
    (cu_seqlens_q and _k are often the same): one small upload through pageable memory a call,
    not up to four."""
    views, parts, at = [], [], {}
    for a in arrays:
        if a is None or isinstance(a, DevView):     # a paged decode's CUDA seqlens_k stays in place
            views.append(a)
            continue
        a = np.ascontiguousarray(a, np.int32)
        key = a.tobytes()
        if key not in at:
            at[key] = sum(p.size for p in parts)
            parts.append(a)
        views.append((at[key], a.size))
    if not parts:
        return tuple(views)
    base = stage.upload(np.concatenate(parts))
    return tuple(v if v is None or isinstance(v, DevView)
                 else DevView.contiguous(base.ptr + 4 * v[0], (v[1],), np.int32, stage.device, stage.stream, base.keep)
                 for v in views)


def _extras_key(o, extra):
    """The part of a plan's key the optional arrays and options decide."""
    if extra is _NO_EXTRAS:
        return None
    return (_desc(extra[0]), _desc(extra[1]), _desc(extra[2]), o.bias_heads, o.mask_heads,
            o.cu_q is None, o.used_q is None, o.used_k is None)


def _common(o, device, q4, k4, v4, extra):
    """Everything forward and backward templates share: options, masks, kernel features. Returns
    (prob, features): prob the _layout.KernelCall _C.attn_template reads, its tensors filled by the
    caller."""
    bias4, mask4, alibi = extra[:3]
    features = dict(
        dtype=dtype_name(o.q.dtype), D=o.D, Dv=o.Dv,
        vec=all(_vec_ok(x, x.shape[3]) for x in (q4, k4, v4)), softcap=o.softcap_value > 0,
        bias_dtype=None if bias4 is None else dtype_name(bias4.dtype),
        alibi_dtype=None if alibi is None else "float32", mask=mask4 is not None,
        tf32=o.precision == "tf32" and o.q.dtype == np.float32)
    prob = KernelCall(
        device=device, dtype=DTYPE_CODES[features["dtype"]],
        B=o.B, causal=o.causal_code, window_left=o.window_left, window_right=o.window_right,
        bias_dtype=DTYPE_CODES[features["bias_dtype"] or "float32"],
        alibi_dtype=DTYPE_CODES["float32"], bias_heads=o.bias_heads,
        mask_heads=o.mask_heads, q=_t(q4), k=_t(k4), v=_t(v4), bias=_t(bias4), mask=_t(mask4),
        alibi=_t(alibi), max_rows_q=_query_rows(o) if o.varlen else 0,
        max_rows_k=_key_rows(o) if o.varlen else 0)
    return prob, features


# ---------------------------------------------------------------- score_mod / mask_mod
def _has_mods(o):
    return getattr(o, "score_mod", None) is not None or getattr(o, "mask_mod", None) is not None


def _bind_mods(o, stage, backward):
    """One call's generated score_mod / mask_mod, or None without them: a namespace with gen
    (codegen.Generated), gmods (the attn_mods_gpu bytes cuda_launch_attention copies into
    attn_params), err (the device error record, zeroed) and, for a backward with array
    gradients, dacc (the zeroed accumulator) and offsets (array number -> first element).
    Traces the functions (TypeError for an unsupported one); the captured arrays are read
    afresh (mod_inputs.py: host ones uploaded, CUDA ones read in place or converted on the
    device). A backward computes the gradients of o.dtensors_asked's arrays only (None: every
    float array): the code is generated for that selection (codegen.generate's wanted), so an
    array left out has no scatter, no accumulator and no gradient field (-1)."""
    if not _has_mods(o):
        return None
    ts = trace.trace_score_mod(o.score_mod) if o.score_mod is not None else None
    tm = lower.lower_mask(o, ts, trace.trace_mask_mod(o.mask_mod)) if o.mask_mod is not None else None
    if ts is None and tm is None:   # the mask_mod was a band, or documents: the plain kernels,
        o.mask_mod = None           # planned as a plain call is (_decode_plan asks _has_mods)
        o.mods_lowered = True       # (its forward still compiles the backward ahead)
        return None
    asked = getattr(o, "dtensors_asked", None) if backward else None
    wanted = grad.positions(ts, asked) if ts is not None else None
    layout = codegen.generated(ts, tm, None, wanted)   # the arrays and gradients; the code: gen below
    floats = list(ts.params if ts is not None else ()) + list(tm.params if tm is not None else ())
    names, arch = codegen.call_arrays(ts, tm), device_arch(stage.device)
    arrays = [mod_arrays.bind(kind, name, (ts if kind == "score_mod" else tm).arrays[name], vt, stage, arch,
                              backward and i in layout.grad_arrays)
              for i, ((kind, name), (_, _, vt)) in enumerate(zip(names, layout.arrays))]
    facts = _facts(o, ts, tm, names, arrays)
    gen = codegen.generated(ts, tm, facts, wanted)
    bound = types.SimpleNamespace(gen=gen, names=names, arrays=arrays, dacc=None, offsets={}, keep_mask=None,
                                  build_mask=False, mask_built=False, backward=backward,
                                  asked=asked,
                                  can_fail=bounds.CHECKED in facts.score + facts.mask)
    bound.err = stage.scratch((5,), np.int64)
    _C.memset_d8(bound.err.ptr, 0, 5 * 8, stage.stream, stage.device)
    dacc_ptr = 0
    if backward and gen.grad_arrays:
        total = 0
        for i in gen.grad_arrays:
            bound.offsets[i] = total
            total += arrays[i].size
        if total:
            bound.dacc = stage.scratch((total, codegen.WORDS), np.uint64)
            _C.memset_d8(bound.dacc.ptr, 0, total * codegen.WORDS * 8, stage.stream, stage.device)
            dacc_ptr = bound.dacc.ptr
    bound.cells = _block_cells(o, gen) if tm is not None else None
    blocks = (0, 0, 0, 0, 0)
    if bound.cells is not None:
        nb, nh, rows, cols = bound.cells
        serials = [a.serial for (kind, _), a in zip(names, arrays) if kind == "mask_mod"]
        # a CUDA array's contents are not seen (serial None): its mask is made every call, not
        # kept; nor is one on the per-thread default stream (mod_cache.array_copy says why)
        # nor is one of device lengths, whose contents the host does not read
        key = (None if None in serials or stage.stream == _device.PER_THREAD_STREAM or o.device_lengths
               else _block_mask_key(o, stage, tm, serials, bound.cells))
        bound.blocks = None if key is None else mod_cache.block_mask(key, stage.stream)
        if bound.blocks is None:                        # built by this call's first launch
            bound.blocks = _device.empty((max(nb * nh * rows * cols, 1),), np.uint8, stage.device, stage.stream)
            bound.build_mask, bound.keep_mask = True, key
        blocks = (bound.blocks.ptr, nh * rows * cols if nb > 1 else 0, rows * cols if nh > 1 else 0, rows, cols)
    bound.gmods = codegen.pack(gen, floats, [a.ref for a in arrays], bound.err.ptr, dacc_ptr, bound.offsets, blocks)
    return bound


def _facts(o, ts, tm, names, arrays):
    """The call's codegen.Facts: how each lookup may be read (attnext.bounds over the call's
    extents -- the longest sequence's rows and columns rounded up to select.TILE_EDGE, where a
    branch-free tile still evaluates the mods, every head and sequence -- and the NumPy integer
    arrays' values) and which integer arrays are stored as int32. A call none of whose lookups
    may leave its array leaves the error record zero: it need not wait for the kernels to read
    it."""
    edge = select.TILE_EDGE
    extents = bounds.Extents(o.B, o.Hq, -(-_query_rows(o) // edge) * edge, -(-_key_rows(o) // edge) * edge)
    values = {}
    for (kind, name), a in zip(names, arrays):
        if a.values is not None:
            values.setdefault(kind, {})[name] = a.values
    modes = [bounds.lookup_modes(t, extents, values.get(kind)) if t is not None else ()
             for kind, t in (("score_mod", ts), ("mask_mod", tm))]
    return codegen.Facts(modes[0], modes[1], tuple(a.stored == codegen.NARROW for a in arrays))


def _block_cells(o, gen):
    """The block mask's layout for this call, (sequences, heads, row cells, column cells): one
    slice per sequence when mask_mod reads b or the lengths differ between them (varlen,
    seqlens), one per query head when it reads h; codegen.BLOCK-square cells of the longest
    sequence's rows and columns."""
    per_b = gen.mask_uses_b or o.varlen or o.used_q is not None or o.used_k is not None
    return (o.B if per_b else min(o.B, 1), o.Hq if gen.mask_uses_h else min(o.Hq, 1),
            -(-_query_rows(o) // codegen.BLOCK), -(-_key_rows(o) // codegen.BLOCK))


def _block_mask_key(o, stage, tm, serials, cells):
    """What a block mask is made from (mod_cache keeps it under this): mask_mod's structure and
    float constants, its captured arrays' contents (mod_cache's serials), the lengths and the
    cells."""
    lengths = tuple(None if a is None else np.asarray(a, np.int64).tobytes()
                    for a in (o.cu_q, o.cu_k, o.used_q, o.used_k))
    return (stage.device, tm.key, tuple(tm.params), tuple(serials), o.B, o.Sq, o.Sk, lengths, cells)


def _build_block_mask(plan, stage, ptrs, o, bound, device):
    """Launches attn_block_mask.cu, which fills the call's block mask (bound.blocks) on the
    call's stream before the attention kernels that read it, unless an earlier call's mask
    (mod_cache) serves this one."""
    if (bound is None or bound.cells is None or not bound.build_mask or not plan.launches
            or not all(bound.cells)):
        return
    nb, nh, rows, cols = bound.cells
    fn = nvrtc.function("attn_block_mask", "attn_block_mask", select.block_mask_defines(bound.gen), device,
                          device_arch(device), 0, bound.gen.source)
    _C.cuda_launch_attention(fn, codegen.block_mask_grid(nb * nh, rows, cols), (128, 1, 1), 0, stage.stream,
                             plan.template, tuple(ptrs), o.scale_value, o.softcap_value, bound.gmods)
    bound.mask_built = True


def _finish_mods(stage, bound):
    """After the launches: IndexError for a lookup the kernels found out of range; else, for a
    backward, the score_mod's array gradients {name: array of the captured array's shape and
    dtype} of the float arrays it asked for (zeros for one the score reaches only through
    indices or comparisons)."""
    if bound is None:
        return {}
    err = np.zeros(5, np.int64)
    if bound.can_fail:          # no lookup that may leave its array: no need to wait
        stage.download(bound.err, err)
    if err[0]:
        raise codegen.index_error(bound.names, err)
    if bound.mask_built and bound.keep_mask is not None:   # no lookup out of range: later calls use it
        mod_cache.keep_block_mask(bound.keep_mask, bound.blocks)
    if not bound.backward:
        return {}
    sums = None if bound.dacc is None else _dtensor_sums(stage, bound.dacc)
    floats = [(i, name, a) for i, ((kind, name), (_, _, vt), a) in
              enumerate(zip(bound.names, bound.gen.arrays, bound.arrays)) if kind == "score_mod" and vt == trace.F
              and (bound.asked is None or name in bound.asked)]
    return mod_arrays.gradients(floats, sums, bound.offsets, stage, device_arch(stage.device))


# attn_mods.cuh reaches NVRTC beside a generated header; this kernel needs only the former
DTENSORS_SPEC = ("attn_dtensors", "attn_dtensors", {}, "")


def _dtensor_sums(stage, dacc):
    """The float64 values of the exact gradient accumulators dacc (n, codegen.WORDS), summed on
    the device (kernels/attn_dtensors.cu: codegen.limbs_to_float's steps) into call scratch."""
    n = dacc.shape[0]
    sums = stage.scratch((n,), np.float64)
    kernel, name, defines, generated = DTENSORS_SPEC
    fn = nvrtc.function(kernel, name, defines, stage.device, device_arch(stage.device), 0, generated)
    params = np.array([(dacc.ptr, sums.ptr, n)], np.dtype([("dacc", "u8"), ("out", "u8"), ("n", "i8")]))
    _C.launch(fn, (-(-n // 256), 1, 1), (256, 1, 1), 0, stage.stream, params.tobytes())
    return sums


def _query_rows(o):
    """The longest query segment's rows (varlen; max_seqlen_q for device lengths) or Sq."""
    if o.device_lengths:
        return o.max_q
    return (int(np.max(np.diff(o.cu_q))) if o.B else 0) if o.varlen else o.Sq


def _query_tiles(rows, block_m):
    """Query tiles per (head, sequence) for the longest query segment's rows."""
    return max(1, math.ceil(rows / block_m))


def _decode_plan(o, features, device):
    """(pack_gqa, num_splits, tma) for the forward. Decode-shaped calls (few query rows, GQA,
    long K/V) pack the query heads of a group into one block's rows, and when the blocks cannot
    fill the GPU, split the keys over several blocks (attn_fwd.cu's PACK_GQA / SPLIT_KV); tma:
    such a call runs TMA_KV (_decode_tma), whose tile the split count is reckoned with."""
    group = o.Hq // o.Hk if o.Hk else 1
    per_head = (features["bias_dtype"] is None and features["alibi_dtype"] is None and not features["mask"]
                and not _has_mods(o))
    pack = group > 1 and not o.varlen and per_head and o.Sq * group <= select.DECODE_PACK_ROWS
    tma = _decode_tma(o, features, device_arch(device))
    if o.varlen or not o.B or not o.Hq or getattr(o, "whole_rows", None) is not None:
        return pack, 1, pack and tma  # a row slice (_forward_sliced) shares the GPU with copies
    tile = select.decode_tma_tile() if tma else select.decode_tile(o.D, o.Dv, features["dtype"])
    bm, bn = tile[:2]
    blocks = math.ceil(o.Sq * (group if pack else 1) / bm) * (o.Hk if pack else o.Hq) * o.B
    sms = device_info(device)["multiprocessor_count"]
    key_tiles = math.ceil(o.Sk / bn)
    if blocks >= sms or key_tiles < 8:
        return pack, 1, pack and tma
    ctas = select.decode_ctas_per_sm(tma and select.fwd_smem_bytes(o.D, o.Dv, tile, "attn_fwd", features["dtype"], True))
    splits = max(1, min(MAX_SPLITS, (ctas * sms) // blocks, key_tiles // 4))
    return pack, splits, tma and (pack or splits > 1)


MAX_SPLITS = 128    # attn_fwd_combine keeps one weight per split in shared memory
# The TMA_KV decode's last CTA of a query tile merges the tile's partials itself (its one warp,
# four packed rows at a time) up to this many splits and packed rows a tile; past them
# attn_fwd_combine's grid (a block a row) merges faster. H200, bf16 decode Hq32 Hk8 D128
# against attn_fwd_combine: B8 Sk8k (4 splits, 4 rows) 3126 -> 3207 GB/s, B1 Sk32k (33 splits)
# 2387-2447 -> 2124-2295; Sk8k with 8-16 rows a tile 1.14-1.46x slower; the cp.async kernel's
# merge (a row at a time) 1.07-3.4x slower (bench/NOTES.md)
FUSED_COMBINE_SPLITS = 16
FUSED_COMBINE_ROWS = 4
COMBINE_THREADS = 256   # attn_fwd.cu's: a block per row, its splits' loads spread over them


def _decode_tma(o, features, arch):
    """Whether a decode-shaped forward runs attn_fwd.cu's TMA_KV (select.decode_tma), and not
    with a score_mod / mask_mod: those stay on the cp.async kernel, the one their decode has run
    and been tested on a GPU with."""
    return (not _has_mods(o) and _tma_strides(o.k4, o.v4)
            and select.decode_tma(arch, o.D, o.Dv, features["vec"], features["dtype"], o.k4.shape[1], o.page_size))


def _tma_strides(*views):
    """Whether these arrays' strides suit a tensor map (k and v for the forward's, q and dout for
    the backward's): none 0 along a dimension of more than one element (a broadcast array,
    e.g. torch's expand: the bulk copies' maps describe memory by strides, which
    cuTensorMapEncodeTiled may refuse at 0); such calls keep the cp.async kernels. A dimension
    of one element (varlen's batch, a single head) is never stepped: attention.c gives its map
    another stride where the array's is 0."""
    return all(s > 0 or n == 1 for x in views for n, s in zip(x.shape[:3], x.strides[:3]))


def _forward_plan(o, device, q4, k4, v4, out4, lse3, extra, gen=None, scaled16=False):
    """The forward's plan for this call (made on the first call of its key); gen: the generated
    score_mod / mask_mod (codegen.Generated) or None; scaled16: q4, k4 and v4 are float16 copies of
    float32 arrays (scale16.copies), out4 a float16 out that scale16.unscale takes further."""
    rows = _query_rows(o) if o.varlen else o.Sq
    # the template clamps each key segment to the longest (attn_params.h: max_rows_k)
    key = ("fwd", device, o.B, o.Sq, o.Sk, rows, _key_rows(o) if o.varlen else o.Sk, o.varlen,
           getattr(o, "whole_rows", None), o.causal_code, o.window_left, o.window_right, o.softcap_value > 0,
           (q4.ptr | k4.ptr | v4.ptr) % 16 == 0, _desc(q4), _desc(k4), _desc(v4), _desc(out4), _desc(lse3), _extras_key(o, extra),
           select.knobs(select.FWD_KNOBS), None if gen is None else gen.source, o.precision,
           None if o.block_table is None else o.block_table.shape, scaled16)
    plan = _plans.get(key)
    if plan is None or (plan.upgrade and all(f.done() for f in plan.upgrade)):
        if plan is not None and any(f.cancelled() or f.exception() for f in plan.upgrade):
            _failed_wide.add(gen.source)
        plan = _new_forward_plan(o, device, q4, k4, v4, out4, lse3, extra, rows, gen, upgrade=plan is None,
                                 scaled16=scaled16)
        _plans.put(key, plan)
    return plan


_failed_wide = set()    # the generated sources whose wide forward failed to compile: not tried again


def _windowed(o):
    """Whether a window bands the keys each query row sees."""
    return o.window_left >= 0 or o.window_right >= 0


def _banded(o):
    """Whether a causal mask or a window bands the keys each query row sees."""
    return o.causal_code != 0 or _windowed(o)


def _new_forward_plan(o, device, q4, k4, v4, out4, lse3, extra, rows, gen, upgrade=True, scaled16=False):
    """The plan _forward_plan keeps. A WS forward whose score_mod has a wider tile once compiled
    (select.fwd_ws_widens) takes it when a cache holds its cubin; else the narrow tile now and,
    where upgrade allows, the wide one compiled in the background (_Plan.upgrade: the next call
    after it is done plans again and finds it; a compile that failed leaves the narrow tile, and
    is not tried again for that source: _failed_wide)."""
    prob, features = _common(o, device, q4, k4, v4, extra)
    if scaled16:                # the float16 kernels over float16 copies (fwd_tf32_f16)
        features.update(dtype="float16", tf32=False, scaled16=True)
        prob.dtype = DTYPE_CODES["float16"]
    generated = None if gen is None else gen.source
    pack, splits, tma = _decode_plan(o, features, device)
    arch = device_arch(device)
    paged = o.block_table is not None
    decode = pack or splits > 1
    copyable = not paged and getattr(o, "whole_rows", None) is None and _tma_strides(o.k4, o.v4)
    # key_rows: the rows of k's tensor (varlen: the packed rows), which a copy's box may not exceed
    ws = not decode and select.fwd_ws(arch, o.D, o.Dv, features["vec"], rows, o.k4.shape[1], features["dtype"],
                                      copyable, softcap=bool(features["softcap"]), mods=gen)
    options = select.score_options(features)
    ws3 = select.fwd_ws3(o.D, rows, o.causal_code != 0, _windowed(o), options, gen)
    wide_keys = select.fwd_wide_keys(o.D, _query_tiles(rows, select.SM90_TILE_WS[0]),
                                     _key_rows(o) if o.varlen else o.Sk, o.causal_code != 0, _windowed(o), options, gen)
    kernel, tile = select.fwd_kernel(arch, o.D, o.Dv, features["vec"], decode, rows, gen,
                                     features["dtype"], paged, tma, ws, ws3, features["tf32"], wide_keys)
    # the persistent grid: a dense batch whose q a tensor map can describe, in tiles an int32
    # counts, with a second Q beside the tile in shared memory
    row_tiles = _query_tiles(rows, tile[0])
    dense = (not o.varlen and o.used_q is None and o.used_k is None and _tma_strides(o.q4)
             and row_tiles * o.Hq * o.B < 2 ** 31)
    persist_tile = select.fwd_persist_tile(o.D, tile)
    persist = (ws and select.fwd_persist(dense, row_tiles, options, tile, gen, o.causal_code != 0)
               and select.fwd_smem_bytes(o.D, o.Dv, persist_tile, kernel, features["dtype"], tma, ws, True) + 1024
               <= select.SM90_SHARED_BYTES)
    if persist:
        tile = persist_tile
    cluster = ws and select.fwd_cluster(o.D, row_tiles, dense, o.causal_code != 0, _windowed(o), options, gen, persist)

    def defines_of(tile):
        return select.fwd_defines(**features, tile=tile, pack_gqa=pack, split_kv=splits > 1, mods=gen, paged=paged,
                                  tma=tma, ws=ws, persist=persist, sm90_f32=kernel == "attn_fwd_sm90_f32",
                                  cluster=cluster)
    wide_specs = ()
    if ws and select.fwd_ws_widens(gen) and generated not in _failed_wide:
        wide = select.fwd_ws_tile(True, wide=True)
        wide_specs = [(kernel, kernel, defines_of(wide), generated)]
        if nvrtc.cached(wide_specs, arch):
            tile, wide_specs = wide, ()
    defines = defines_of(tile)
    smem = select.fwd_smem_bytes(o.D, o.Dv, tile, kernel, features["dtype"], tma, ws, persist, features["tf32"])
    q_tiles = math.ceil(o.Sq * (o.Hq // o.Hk) / tile[0]) if pack else _query_tiles(rows, tile[0])
    grid = (q_tiles * splits, o.Hk if pack else o.Hq, o.B + (1 if o.varlen else 0))
    if persist:     # a CTA an SM (one fits), taking the B x Hq x q_tiles tiles in turn
        grid = (min(q_tiles * o.Hq * o.B, device_info(device)["multiprocessor_count"]), 1, 1)
        prob.tma_rows_q = select.PERSIST_Q_ROWS
        prob.tma_out = int(select.fwd_tma_store())
    prob.out, prob.lse, prob.num_splits = _t(out4), _t(lse3), splits
    if paged:
        prob.page_size, prob.bt_stride = o.page_size, o.block_table.shape[1]
    if tma or ws:        # the rows of a tensor copy: a tile's, or a page's
        prob.tma_rows = min(tile[1], o.page_size) if paged else tile[1]
        prob.tma_read_once = int(tma and q_tiles == 1)   # K and V read once: 128-byte L2 fills
    template = _C.attn_template(prob)
    if not all(grid):                       # an empty grid (no heads, rows or batch) has nothing to write
        return _Plan(template, ())
    counters = 1 if persist else 0          # the persistent grid's count of tiles taken
    names = [kernel] if splits == 1 else [kernel, "attn_fwd_combine"]
    specs = [(kernel, name, defines, generated) for name in names] + select.block_mask_specs(gen)
    if o.return_lse and (gen is not None or getattr(o, "mods_lowered", False)):
        _compile_backward_ahead(o, device, features, rows, gen, specs)
    nvrtc.prefetch(specs, arch, device)
    launches = [(nvrtc.function(kernel, kernel, defines, device, arch, smem, generated), grid,
                 ((tile[2] + tma + 4 * ws) * 32, 1, 1), smem)]   # the producer warp (TMA_KV) or warpgroup (WS)
    if splits == 1:
        ahead = ()
        try:    # only a head start: whatever goes wrong here, the call runs the narrow tile
            ahead = nvrtc.compile_ahead(wide_specs, arch, busy=0) if upgrade and wide_specs else ()
        except Exception:
            pass
        return _Plan(template, tuple(launches), upgrade=tuple(ahead), counters=counters)
    combine = nvrtc.function("attn_fwd", "attn_fwd_combine", defines, device, arch, 0, generated)
    own_template = ()
    if prob.tma_rows:       # attn_fwd_combine reads no tensor map: a template that asks for none
        prob.tma_rows = 0
        own_template = (_C.attn_template(prob),)
    launches.append((combine, (o.Sq, o.Hq, o.B), (COMBINE_THREADS, 1, 1), 0, *own_template))
    partials = splits * o.B * o.Hq * o.Sq
    # lse_accum: each partial's maximum, then its sum (attn_fwd_combine)
    total, (o_off, lse_off) = _scratch_layout(4 * partials * o.Dv, 2 * 4 * partials)
    # the TMA_KV kernel with up to FUSED_COMBINE_ROWS packed rows a tile and FUSED_COMBINE_SPLITS
    # splits merges its own partials where the stream lends counters (_launch): attn_fwd_combine
    # is then not launched; ATTNEXT_DECODE_COMBINE=kernel keeps it (the lab, tests)
    own = (tma and splits <= FUSED_COMBINE_SPLITS and o.Sq * (o.Hq // o.Hk if pack else 1) <= FUSED_COMBINE_ROWS
           and _env.get("ATTNEXT_DECODE_COMBINE") != "kernel")
    counters = grid[0] // splits * grid[1] * grid[2] if own else 0
    return _Plan(template, tuple(launches), total, ((SLOT_O_ACCUM, o_off), (SLOT_LSE_ACCUM, lse_off)),
                 counters=counters, skipped=1)


def _compile_backward_ahead(o, device, features, q_rows, gen, fwd_specs):
    """Starts compiling the backward a forward with mods expects (nvrtc.compile_ahead): the
    default one (deterministic, dout laid out as q, no dbias) of the same problem, less the
    forward's own compiles (the block mask). A backward that differs compiles what it lacks.
    A mask_mod that _bind_mods lowered to a band or documents (gen None) runs plain kernels,
    which a fresh cache does not hold either: their backward is compiled ahead too."""
    try:        # only a head start: whatever goes wrong here, the backward meets (and raises) itself
        k_rows = _key_rows(o) if o.varlen else o.Sk
        ns = _backward_kernels(o, device, dict(features), True, q_rows, k_rows, gen)
        specs = [s for s in _backward_specs(ns, gen) if s not in fwd_specs]
        nvrtc.compile_ahead(specs, device_arch(device), busy=len(fwd_specs))
    except Exception:
        pass


def forward(o, out_host, lse_host, stage=None):
    """The forward of a problem api.py normalised. With NumPy inputs, fills out_host and lse_host
    and returns them; with GPU inputs (both None) returns (out, lse) as DeviceArrays, or o.out
    (a DevView from out=) in place of out. stage: _forward_sliced's, for one slice; there
    o.lse_rows (a row slice's, a strided view of its sequence's lse) is where the kernel writes
    the lse, which _forward_sliced downloads (lse_host None)."""
    own_stage = stage is None
    if own_stage:
        lengths_check.raise_pending()
    host = out_host is not None
    if host and own_stage and (slices := _slices(o)):
        return _forward_sliced(o, out_host, lse_host, slices)
    pin = host and own_stage
    with stage or staging.Staging(o.cuda_device, o.cuda_stream) as stage:
        if pin:
            stage.pin(_host_inputs(o), (out_host, lse_host))
        q4, k4, v4 = (_put(stage, x) for x in (o.q4, o.k4, o.v4))
        if isinstance(o.out, DevView):
            out, out_res = o.out, o.out
        else:
            out, out_res = _result(stage, host, o.out_shape, o.q.dtype)
        lse = lse_res = lse3 = None           # a GPU call that returns no lse writes none
        if getattr(o, "lse_rows", None) is not None:     # a row slice's: the caller downloads it
            lse = lse3 = o.lse_rows
        elif host or o.return_lse:
            lse, lse_res = _result(stage, host, o.lse_shape, np.float32)
            lse3 = lse[None] if o.varlen else lse
        out4 = _kernel_layout(o, out)
        mods = _bind_mods(o, stage, backward=False)
        ko = lower.kernel_problem(o)
        extra = _extras(ko, stage)
        if pin:
            stage.uploads_done()
        arch = device_arch(stage.device)
        # (asked of tf32 calls only: every other call would scan the strides for nothing)
        scaled16 = o.precision == "tf32" and select.fwd_tf32_f16(
            arch, dtype_name(o.q.dtype), True, o.D, o.Dv, o.Sq, varlen=o.varlen or ko.varlen,
            seqused=o.used_q is not None or o.used_k is not None, paged=o.block_table is not None,
            mods=mods is not None or getattr(o, "mods_lowered", False),
            broadcast=any(s == 0 and n > 1 for x in (q4, k4, v4) for s, n in zip(x.strides, x.shape)))
        kernel_out4, grad_scales, held = out4, None, None
        if scaled16:            # float16 copies scaled by powers of two (scale16.py); held until enqueued
            (q4, k4, v4), grad_scales, scaling, held = scale16.copies((q4, k4, v4), o.Dv, stage, arch)
            out16 = empty(out4.shape, np.float16, stage.device, stage.stream)
            kernel_out4 = DevView.contiguous(out16.ptr, out4.shape, np.float16, stage.device)
            held = (held, out16)
            ko = copy.copy(ko)  # the plan reads the copies' strides (tensor maps, the persistent grid)
            ko.q4, ko.k4, ko.v4 = q4, k4, v4
        plan = _forward_plan(ko, stage.device, q4, k4, v4, kernel_out4, lse3, extra,
                             None if mods is None else mods.gen, scaled16)
        ptrs = (q4.ptr, k4.ptr, v4.ptr, kernel_out4.ptr, None if lse3 is None else lse3.ptr)
        if extra is not _NO_EXTRAS:
            ptrs += (None, None) + tuple(None if x is None else x.ptr for x in extra)
        elif plan.scratch:
            ptrs += (None, None)
        ptrs = _with_sinks(ptrs, _sinks_view(o, stage))
        if grad_scales is not None:
            ptrs = _at_slots(ptrs, {SLOT_GRAD_SCALES: grad_scales.ptr})
        page_checks = ()
        if isinstance(o.block_table, DevView):   # read in place, checked on the stream first
            page_checks = (lengths_check.launch_pages(stage, o.block_table, None if extra is _NO_EXTRAS else extra[6],
                                                 o.B, o.page_size, o.k4.shape[0], device_arch(stage.device)),)
            ptrs = _at_slots(ptrs, {SLOT_BLOCK_TABLE: o.block_table.ptr})
        elif o.block_table is not None:   # checked on the host (checks._check_pages), uploaded
            ptrs = _at_slots(ptrs, {SLOT_BLOCK_TABLE: stage.upload(o.block_table).ptr})
        if mods is None:
            _launch(plan, stage.device, stage.stream, ptrs, o.scale_value, o.softcap_value)
        else:
            _build_block_mask(plan, stage, ptrs, o, mods, stage.device)
            _launch(plan, stage.device, stage.stream, ptrs, o.scale_value, o.softcap_value, mods.gmods)
            _finish_mods(stage, mods)
        if scaled16:
            scale16.unscale(scaling, kernel_out4, out4, stage, arch)
        del held                 # freed in the stream's order, after the launches
        if host:
            stage.download(out, out_host)
            if lse_host is not None:
                stage.download(lse, lse_host)
            return out_host, lse_host
        # repeatable where nothing but host lengths was uploaded for this call alone: no optional
        # array; a paged call's CUDA table and lengths, which lie where the caller keeps them (its
        # repeats read them afresh and check them afresh); or lengths from the host (or a
        # document mask_mod's, mods/lower.py), whose contents the key holds: the recipe keeps
        # this call's upload. A host table, bias, mask or alibi are uploaded a call
        no_arrays = extra is not _NO_EXTRAS and o.block_table is None and all(x is None for x in extra[:3])
        # a kept upload is ordered on its own stream only (process.keeps_across_calls)
        host_lengths = (no_arrays and not o.device_lengths
                        and process.keeps_across_calls(stage.stream, stage.device))
        device_lengths = no_arrays and o.device_lengths       # checked again by each replay
        paged_in_place = (o.block_table is not None and isinstance(o.used_k, DevView)
                          and all(x is None for x in extra[:6]))
        in_place = ((extra is _NO_EXTRAS or host_lengths or device_lengths or paged_in_place)
                    and (o.block_table is None or page_checks))
        checks_again = page_checks + ((ko.lengths_check,) if device_lengths else ())
        if own_stage and mods is None and in_place and not plan.upgrade and not scaled16:
            # what a repeat of this call needs (cuda/repeat.py; api.py files it under the call's key)
            o.recipe = Recipe(plan, ptrs, stage.device, stage.stream, o.scale_value, o.softcap_value,
                              out_res is not o.out, o.out_shape, o.q.dtype,
                              None if lse_res is None else o.lse_shape, np.float32, None, checks_again,
                              extra if host_lengths else ())
        return out_res, lse_res


def _host_inputs(o, *more):
    """The large arrays a NumPy call uploads (staging pins those it can)."""
    return (o.q4, o.k4, o.v4, o.bias4, o.mask4) + more


# a NumPy forward moving at least twice this runs in slices (H100, bench/lab_numpy.py --slices,
# kept registrations and pinned results: B8 S2k 5.77 ms at 64 MiB against 6.10 at 128 and 6.18
# at 32; B2 S8k causal 6.35 at 32-128 MiB in batch slices)
SLICE_BYTES = 64 << 20
# a causal call's last sequence ends in a row slice of this share of its rows (see _slices).
# Its upload should outlast the kernel of the rows before it: H100, B2 S8k causal (lab_timeline,
# lab_numpy --slices): 1/8 left that kernel (0.57 ms) in the tail after a 0.24 ms upload and
# measured 1.17x the floor; 1/4, 1.10x; batch slices only, 1.18x
TAIL_SHARE = 1 / 4


def _slices(o):
    """[(b0, b1, r0, r1), ...]: the slices of a NumPy forward worth pipelining (each slice's
    upload overlapping the kernels and downloads of the ones before), batches b0:b1 and query
    rows r0:r1, or None to run it in one go: batch slices of about SLICE_BYTES moved each.

    What is left after the last upload is the last slice's kernel and download. In a causal
    self-attention (Sq == Sk, q, k, v C-contiguous in (B, S, H, D), no window, alibi or
    lengths) the last sequence's last rows are the costliest, so its rows are cut: rows 0:c
    first, then about the last TAIL_SHARE of them (at least a tile: c on a select.TILE_EDGE
    edge, where the one-go call's tiles start) over keys 0:S, the only work left after the
    uploads (rows r0:r1 need only keys 0:r1)."""
    if (o.varlen or o.bias4 is not None or o.mask4 is not None or _has_mods(o)
            or o.block_table is not None):
        return None
    moved = sum(x.size * x.itemsize for x in (o.q4, o.k4, o.v4))
    moved += math.prod(o.out_shape) * np.dtype(o.q.dtype).itemsize
    n = min(o.B, moved // SLICE_BYTES)
    edges = [o.B * i // n for i in range(n + 1)] if n else [0, o.B]
    slices = [(b0, b1, 0, o.Sq) for b0, b1 in zip(edges[:-1], edges[1:])]
    edge = select.TILE_EDGE
    cut = (o.Sq - max(edge, int(o.Sq * TAIL_SHARE))) // edge * edge     # a tile edge of the one-go call
    if moved >= 2 * SLICE_BYTES and cut >= edge and o.B and _rows_sliceable(o):
        b0, b1 = slices.pop()[:2]
        if b1 - 1 > b0:
            slices.append((b0, b1 - 1, 0, o.Sq))
        slices += [(b1 - 1, b1, 0, cut), (b1 - 1, b1, cut, o.Sq)]
    return slices if len(slices) > 1 else None


def _rows_sliceable(o):
    """Whether _slices may cut o's query rows (see there)."""
    if (o.causal_code == 0 or o.Sq != o.Sk or _windowed(o)
            or o.alibi is not None or o.used_q is not None or o.used_k is not None or o.layout != "bshd"):
        return False
    return all(isinstance(x, np.ndarray) and x.flags.c_contiguous for x in (o.q4, o.k4, o.v4))


def _cut(view, axis, lo, hi):
    """view with its dim `axis` cut to lo:hi (a DevView)."""
    shape = list(view.shape)
    shape[axis] = hi - lo
    return DevView(view.ptr + lo * view.strides[axis] * view.itemsize, tuple(shape), view.strides, view.dtype,
                   view.device, view.stream, view.keep)


def _rows(view, b0, b1, r0=0, r1=None):
    """view[b0:b1, r0:r1] of a DevView."""
    return _cut(_cut(view, 0, b0, b1), 1, r0, view.shape[1] if r1 is None else r1)


def _forward_sliced(o, out_host, lse_host, slices):
    """forward() as one forward per slice of _slices. The device memory of q, k, v is allocated
    first and every upload waits for those allocations only, so slice i+1 uploads while slice i
    computes; the stage downloads each slice's results on a thread of its own meanwhile.

    A row slice r0:r1 (of one sequence) is the causal problem of its rows over keys 0:r1,
    bottom-right aligned: row i of it keeps the keys up to r0 + i, as the whole problem's row
    r0 + i does. It uploads the keys its sequence's earlier slices have not, never splits K/V
    (whole_rows marks it), and writes its lse into its sequence's, which goes down in one piece
    after the sequence's last slice. Its results match one launch over every row to a rounding,
    not bit for bit: other lengths compile other code (H100: 10-30% of the bf16 outputs one ulp
    apart, even in the first slice, with the whole call's tile)."""
    with staging.Staging(o.cuda_device, o.cuda_stream, background=True) as stage:
        stage.pin(_host_inputs(o), (out_host, lse_host))
        inputs = [(x, stage.allocate(x)) for x in (o.q4, o.k4, o.v4)]
        allocated = stage.fence()
        keys_up, lse_rows = 0, None        # a sequence in row slices: its keys uploaded, its lse
        for b0, b1, r0, r1 in slices:
            whole = (r0, r1) == (0, o.Sq)
            part = copy.copy(o)
            part.B = b1 - b0
            for name in ("alibi", "used_q", "used_k"):
                x = getattr(o, name)
                setattr(part, name, None if x is None else x[b0:b1])
            if whole:
                keys_up, lse_dst = 0, lse_host[b0:b1]
                part.out_shape = (b1 - b0,) + tuple(o.out_shape[1:])
                part.lse_shape = (b1 - b0,) + tuple(o.lse_shape[1:])
            else:                           # _slices: one sequence, bshd, Sq == Sk
                if r0 == 0:
                    keys_up, lse_rows = 0, stage.scratch((b1 - b0,) + tuple(o.lse_shape[1:]), np.float32)
                part.Sq, part.Sk, part.causal_code, part.whole_rows = r1 - r0, r1, 1, o.Sq
                part.out_shape = (b1 - b0, r1 - r0) + tuple(o.out_shape[2:])
                part.lse_shape = (b1 - b0, o.Hq, r1 - r0)
                part.lse_rows, lse_dst = _cut(lse_rows, 2, r0, r1), None
            views = []
            for i, (x, dev) in enumerate(inputs):
                rows = (r0, r1) if i == 0 else (0, part.Sk)     # q: the slice's rows; k, v: its keys
                new = (r0, r1) if i == 0 else (keys_up, part.Sk)
                if (dev.strides[0] or b0 == 0) and new[1] > new[0]:    # a batch-broadcast input travels once
                    piece = x[b0:b1] if whole else x[b0:b1, new[0]:new[1]]
                    stage.copy_in(piece, _rows(dev, b0, b1, *new), after=allocated)
                views.append(_rows(dev, b0, b1, *rows))
            part.q4, part.k4, part.v4 = views
            keys_up = part.Sk
            forward(part, out_host[b0:b1] if whole else out_host[b0:b1, r0:r1], lse_dst, stage)
            if not whole and r1 == o.Sq:
                stage.download(lse_rows, lse_host[b0:b1])
        stage.uploads_done()
    return out_host, lse_host


# ---------------------------------------------------------------- backward
PRE_ROWS, PRE_THREADS = 64, 256   # attn_bwd.cu's row kernels (delta, dq_convert)


def _key_rows(o):
    """The longest key segment's rows (varlen; max_seqlen_k for device lengths, the longest
    seqused_k over a paged cache) or Sk."""
    if not o.varlen:
        return o.Sk
    if o.device_lengths or o.cu_k is None:
        return o.max_k
    return int(np.max(np.diff(o.cu_k))) if o.B else 0


def _dbias_buffer(stage, o, host):
    """dbias in the bias's own dtype and compact shape, zeroed (elements past every sequence's
    length are never written): (kernel view broadcast to (B, Hb, Sq, Sk) with stride 0 along the
    bias's broadcast dims, what the caller gets)."""
    dtype = np.dtype(o.bias.dtype)
    compact = (1,) * (4 - len(o.bias.shape)) + tuple(o.bias.shape)
    if host:
        res = stage.scratch(compact, dtype)
        ptr = res.ptr
    else:
        res = empty(tuple(o.bias.shape), dtype, stage.device, stage.stream)
        ptr = res.ptr
    nbytes = math.prod(compact) * dtype.itemsize
    if nbytes:
        _C.memset_d8(ptr, 0, nbytes, stage.stream, stage.device)
    view = DevView.contiguous(ptr, compact, dtype, stage.device, stage.stream, res)
    return view.broadcast_to(tuple(o.bias4.shape)), res


def _backward_plan(o, device, views, extra, deterministic, gen=None, scaled16=False):
    """The backward's plan for this call (made on the first call of its key). views: q4, k4, v4,
    dout4, out4, lse3, dq4, dk4, dv4, dbias4, dlse3 (the kernels' views, dbias4 None without a
    bias, dlse3 without lse's gradient);
    gen: the generated score_mod / mask_mod or None; scaled16: q4, k4, v4, dout4 and out4 are
    float16 copies of float32 arrays (scale16.copies), dq4, dk4, dv4 float32."""
    q_rows = _query_rows(o) if o.varlen else o.Sq
    k_rows = _key_rows(o) if o.varlen else o.Sk
    q4, k4, v4, dout4 = views[:4]
    key = ("bwd", device, o.B, o.Sq, o.Sk, q_rows, k_rows, o.varlen, o.causal_code, o.window_left,
           o.window_right, o.softcap_value > 0, (q4.ptr | k4.ptr | v4.ptr | dout4.ptr) % 16 == 0,
           tuple(_desc(x) for x in views), _extras_key(o, extra), bool(deterministic),
           select.knobs(select.BWD_KNOBS), None if gen is None else gen.source, o.precision,
           o.sink_values is not None, scaled16)
    plan = _plans.get(key)
    if plan is None:
        plan = _new_backward_plan(o, device, views, extra, deterministic, q_rows, k_rows, gen, scaled16)
        _plans.put(key, plan)
    return plan


def _backward_kernels(o, device, features, deterministic, q_rows, k_rows, gen, dbias4=None, qo4=None):
    """The kernels a backward of o runs, in a namespace: wanted ((source, name, defines, smem,
    grid, warps) each, in launch order) and what the plan's scratch follows from the dq mode
    (atomic, ordered, sem_words, write_last, mask_mod, grads); tma_kernel, tma_rows_q: the
    kernel that takes Q and dO by bulk copies (select.bwd_tma) and the rows of a copy, its
    launch's own template then asking for the maps of q and dout; else None and 0. features:
    _common's, vec already anded with dout's; dbias4: the dbias view or None; qo4: the views of
    q and dout (None: a forward's guess, o.q4 for both). A forward with mods asks it for the
    backward it expects (_compile_backward_ahead), the backward's plan for its launches."""
    arch = device_arch(device)
    sm90 = select.bwd_sm90_applies(arch, o.D, o.Dv, features["vec"], features["dtype"])
    # the dQ kernels scatter the score_mod's array gradients (ds_tile): with those dQ is
    # recomputed whatever deterministic and ATTNEXT_BWD_DQ say
    grads = gen is not None and gen.defines.get("HAS_DTENSORS")
    # how many keys a query row may see: its window's width where the window bounds it (a key block
    # then meets as few query tiles, and a query tile as few key blocks, as at that many keys)
    lo, hi = lower.kept_span(o, None if o.varlen or o.used_q is not None or o.used_k is not None else o.Sk - o.Sq)
    reach = k_rows if math.isinf(hi - lo) else min(k_rows, max(int(hi - lo) + 1, 0))
    passes = select.dtype_defines(features["dtype"], features["tf32"]).get("TF32_PASSES", 0)   # float32's
    f32_passes = passes if arch == "sm_90a" else 0
    # float32 on bfloat16 planes (attn_bwd_sm90_x3.cu, Hopper's default): its dQ kernel recomputes
    x3 = select.bwd_f32_x3(arch, features["dtype"], o.D, o.Dv, features["vec"], passes, gen)
    if x3:
        dq_mode = select.bwd_x3_dq_mode(o.D, deterministic)
    else:
        dq_mode = "recompute" if grads else select.bwd_dq_mode(sm90, o.D, deterministic, o.Dv, reach, f32_passes,
                                                                     o.causal_code != 0)
    atomic = dq_mode != "recompute"
    presplit = select.bwd_f32_presplit(arch, features["dtype"], o.D, o.Dv, passes)
    planes = presplit and passes == 3
    tile = select.bwd_tile_config(o.D, o.Dv, features["dtype"], atomic, planes)
    # the ordered mode's key blocks take turns at each query tile: without a mask_mod the first turn
    # stores, so nothing zeroes dq_accum, and with short keys the last writes dq (attn_bwd_sm90.cu:
    # DQ_STORE_FIRST, dq_write_last; attn_bwd_pre writes dq's other rows), else the turns run in
    # chains, each into its own copy of dq_accum (DQ_CHAINS); a mask_mod's block may pass its turn,
    # so then dq_accum starts zeroed and every turn adds; attn_bwd_dq_convert writes dq unless the
    # last turns do
    mask_mod = bool(gen is not None and gen.defines.get("HAS_MASK_MOD"))
    # float32 dq (scaled16) leaves the last turns' store (16-bit) to attn_bwd_dq_convert
    write_last = select.bwd_dq_write_last(dq_mode, mask_mod, reach, x3) and not features.get("scaled16")
    chains = select.bwd_dq_chains(dq_mode, mask_mod, write_last, _banded(o), reach, x3)
    defines = select.bwd_defines(**features, tile=tile, dq=dq_mode, mods=gen, chains=chains, presplit=presplit,
                                 key_block=64 if x3 else None)
    smem = select.bwd_smem_bytes(o.D, o.Dv, tile, atomic, defines.get("MOD_TILE_SLOTS", 0), features["dtype"], planes)
    hopper = select.bwd_sm90_tile(o.D, dq_mode, o.Dv) if sm90 else None
    # the dK/dV grid's x (its key blocks)
    kv_blocks = _query_tiles(k_rows, 16 * hopper["kv_warps"]) if hopper else _query_tiles(k_rows, 64) if x3 else 0
    ns = types.SimpleNamespace(atomic=atomic, ordered=dq_mode == "ordered",
                               sem_words=-(-kv_blocks // 32) if dq_mode == "ordered" else 0,
                               mask_mod=mask_mod, write_last=write_last, chains=chains, grads=grads, wanted=[],
                               tma_kernel=None, tma_rows_q=0)
    tail = 1 if o.varlen else 0

    def launch(name, grid, warps, source="attn_bwd", defs=defines, smem_of=smem):
        if all(grid):
            ns.wanted.append((source, name, defs, smem_of[name], grid, warps))

    if o.Hq:
        launch("attn_bwd_pre", (_query_tiles(q_rows, PRE_ROWS), o.Hq, o.B + (tail if write_last else 0)),
               PRE_THREADS // 32)
        if hopper:               # dK, dV and dQ on wgmma (attn_bwd_sm90.cu)
            q4, dout4 = qo4 or (o.q4, o.q4)
            # a copy's box is a whole tile: of the tensor's rows, and of a sequence's (a tile
            # crossing a sequence's end inside the tensor goes by cp.async)
            tma = select.bwd_tma(dq_mode, hopper, min(q4.shape[1], q_rows), _tma_strides(q4, dout4))
            defs90 = select.bwd_defines(**features, tile=hopper, dq=dq_mode, mods=gen, tma=tma, chains=chains)
            smem90 = select.bwd_sm90_smem_bytes(o.D, o.Dv, hopper, defs90.get("MOD_TILE_SLOTS", 0))
            kv_name, kv_warps = select.bwd_sm90_kv_kernel(dq_mode, hopper)
            launch(kv_name, (kv_blocks, o.Hk, o.B + tail), kv_warps, "attn_bwd_sm90", defs90, smem90)
            if tma:
                ns.tma_kernel, ns.tma_rows_q = kv_name, hopper["kv_block_m"]
            if not atomic:
                launch("attn_bwd_dq_sm90", (_query_tiles(q_rows, hopper["q_block_m"]), o.Hq, o.B + tail),
                       hopper["q_warps"], "attn_bwd_sm90", defs90, smem90)
        elif x3:                 # float32 as bfloat16 planes on wgmma (attn_bwd_sm90_x3.cu)
            defs_x3 = select.bwd_x3_defines(defines, o.D)
            smem_x3 = select.bwd_x3_smem_bytes(o.D, defs_x3)
            launch("attn_bwd_dkdv_x3", (kv_blocks, o.Hk, o.B + tail), defs_x3["KV_WARPS"],
                   "attn_bwd_sm90_x3", defs_x3, smem_x3)
            if not atomic:
                launch("attn_bwd_dq_x3", (_query_tiles(q_rows, 64), o.Hq, o.B + tail), 4, "attn_bwd_sm90_x3",
                       defs_x3, smem_x3)
        else:
            kv_grid = (_query_tiles(k_rows, 16 * tile["kv_warps"]), o.Hk, o.B + tail)
            for name in (("attn_bwd_dv", "attn_bwd_dk") if tile["kv_split"] else ("attn_bwd_dkdv",)):
                launch(name, kv_grid, tile["kv_warps"])
        if atomic and not write_last:
            launch("attn_bwd_dq_convert", (_query_tiles(q_rows, PRE_ROWS), o.Hq, o.B + tail),
                   PRE_THREADS // 32)
        elif not hopper and not x3:
            launch("attn_bwd_dq", (_query_tiles(q_rows, tile["q_block_m"]), o.Hq, o.B + tail), tile["q_warps"])
        # rows that keep no key (lse -inf): attn_bwd_pre marks them in the dead words, and this
        # redoes the dK / dV they touched and zeroes their dq; with none it returns at once
        launch("attn_bwd_dead", (device_info(device)["multiprocessor_count"] * tile["kv_minb"], 1, 1),
               tile["kv_warps"])
        if o.sink_values is not None:     # after attn_bwd_pre's delta
            launch("attn_bwd_sinks", (o.Hq, 1, 1), PRE_THREADS // 32)
        if dbias4 is not None:
            bcast = [s == 0 for s in dbias4.strides]
            rows, cols = dbias4.shape[2], dbias4.shape[3]
            grid = (1 if bcast[2] else math.ceil(rows / tile["q_block_m"]),
                    1 if bcast[3] else math.ceil(cols / tile["q_block_n"]),
                    (1 if bcast[0] else o.B) * o.bias_heads)
            launch("attn_bwd_dbias", grid, tile["q_warps"])
    return ns


def _backward_specs(ns, gen):
    """prefetch's specs of the kernels _backward_kernels found (the array gradients' sums
    (_dtensor_sums) run after them: their module is loaded with them, not between launches, as
    a module load waits for the kernels in flight: ~35 ms, relbias)."""
    generated = None if gen is None else gen.source
    return ([(src, name, defs, generated) for src, name, defs, *_ in ns.wanted] + select.block_mask_specs(gen)
            + ([DTENSORS_SPEC] if ns.grads else []))


def _new_backward_plan(o, device, views, extra, deterministic, q_rows, k_rows, gen, scaled16=False):
    q4, k4, v4, dout4, out4, lse3, dq4, dk4, dv4, dbias4, dlse3 = views
    prob, features = _common(o, device, q4, k4, v4, extra)
    if scaled16:                # the float16 kernels over float16 copies, float32 gradients
        features.update(dtype="float16", tf32=False, scaled16=True)
        prob.dtype = DTYPE_CODES["float16"]
    generated = None if gen is None else gen.source
    features["vec"] = features["vec"] and _vec_ok(dout4, o.Dv)
    arch = device_arch(device)
    ns = _backward_kernels(o, device, features, deterministic, q_rows, k_rows, gen, dbias4, (q4, dout4))
    delta = DevView.contiguous(0, o.lse_shape, np.float32, device)   # laid out like lse
    # dq_accum (B, Hq, S, D) in memory, so a head's 64-row tile is one contiguous block (with
    # chains, (B, Hq, chains, S, D): the kernels find a chain's copy s[2] / chains after the
    # previous one's); dq_sem for the ordered additions: per (sequence, head, 64-row query tile) a
    # bit per key block of the dK/dV kernel (its grid's x) in 32-bit words
    accum_shape = (q4.shape[0], o.Hq * ns.chains, q4.shape[1], o.D + o.D % 2)
    sem_shape = (o.B, o.Hq, _query_tiles(q_rows, PRE_ROWS) * ns.sem_words)
    prob.out, prob.dout, prob.lse, prob.dbias, prob.dlse = _t(out4), _t(dout4), _t(lse3), _t(dbias4), _t(dlse3)
    prob.dq, prob.dk, prob.dv = _t(dq4), _t(dk4), _t(dv4)
    prob.delta = _t(delta[None] if o.varlen else delta)
    if ns.atomic:
        sb, sh, ss, sd = DevView.contiguous(0, accum_shape, np.float32, device).strides
        prob.dq_accum = _t(DevView(0, (accum_shape[0], accum_shape[2], o.Hq, accum_shape[3]),
                                   (sb, ss, sh * ns.chains, sd), np.float32, device))
    if ns.ordered:
        prob.dq_sem = _t(DevView.contiguous(0, sem_shape, np.int32, device))
    prob.dq_write_last = int(ns.write_last)
    prob.k_rows_max = k_rows
    template = _C.attn_template(prob)
    own = {}                  # the dK/dV kernel's template asks for the maps of q and dout
    if ns.tma_kernel:
        prob.tma_rows_q = ns.tma_rows_q
        own = {ns.tma_kernel: (_C.attn_template(prob),)}
    nvrtc.prefetch(_backward_specs(ns, gen), arch, device)
    launches = [(nvrtc.function(src, name, defs, device, arch, sm, generated), grid, (warps * 32, 1, 1), sm,
                 *own.get(name, ())) for src, name, defs, sm, grid, warps in ns.wanted]
    dead_bytes = 4 * (1 + o.B * o.Hq)     # attn_params.h: dead
    slots = ((SLOT_DELTA, 4 * delta.size),) + (((SLOT_DQ_ACCUM, 4 * math.prod(accum_shape)),) if ns.atomic else ()) \
        + (((SLOT_DQ_SEM, 4 * math.prod(sem_shape)),) if ns.ordered else ()) + ((SLOT_DEAD, dead_bytes),) \
        + ((SLOT_ROW_MZ, 8 * delta.size),)   # row_mz: a float2 per row, laid out like delta
    total, offsets = _scratch_layout(*(n for _, n in slots))
    zero = tuple((slot, n) for slot, n in slots
                 if slot == SLOT_DEAD or (slot == SLOT_DQ_ACCUM and ns.ordered and ns.mask_mod))
    return _Plan(template, tuple(launches), total, tuple((slot, off) for (slot, _), off in zip(slots, offsets)), zero)


def backward(o, dout, out, lse, dq_host, dk_host, dv_host, dbias_host, deterministic, dlse=None):
    """The backward of a problem api.py normalised; dout, out (caller's layout) and lse as the
    forward returned them, dlse (lse's gradient, lse's layout) or None (NumPy arrays or DevViews).

    NumPy call (dq_host, dk_host, dv_host given; dbias_host the float32 compact dbias when there
    is a bias): fills them and returns them with dsinks (a new float32 host array). GPU call (all
    None): returns (dq, dk, dv, dbias, dsinks) as DeviceArrays, dbias None without a bias, dsinks
    None without sinks (attn_bwd_sinks, after attn_bwd_pre).

    dq: select.bwd_dq_mode chooses between the dQ kernel's recomputation (attn_bwd_dq /
    attn_bwd_dq_sm90: owns its dq rows) and the dK/dV kernel adding dS K into a float32 dq_accum,
    either in a fixed order (dq_sem's counters: the same bits every run) or, with
    deterministic=False, by plain atomics. delta (the row sums of dout * out), dq_accum and dq_sem
    live in the stream's scratch buffer.

    score_mod / mask_mod: o.dtensors receives the score_mod's array gradients in the captured
    arrays' dtypes and libraries (host arrays for host ones, the library's device arrays for
    CUDA ones: mod_inputs.py), scattered exactly by the dQ kernels (codegen.py), so the same bits every run
    (dQ is always recomputed with mods); a lookup out of range raises IndexError after the
    launches.
    """
    lengths_check.raise_pending()
    host = dq_host is not None
    with staging.Staging(o.cuda_device, o.cuda_stream) as stage:
        if host:
            stage.pin(_host_inputs(o, dout, out, lse, dlse), (dq_host, dk_host, dv_host))
        q4, k4, v4 = (_put(stage, x) for x in (o.q4, o.k4, o.v4))
        dout4 = _kernel_layout(o, _put(stage, dout))
        out4 = _kernel_layout(o, _put(stage, out))
        lse_v = _put(stage, lse)
        lse3 = lse_v[None] if o.varlen else lse_v
        dlse3 = None if dlse is None else _put(stage, dlse)
        dlse3 = None if dlse3 is None else dlse3[None] if o.varlen else dlse3
        dq, dq_res = _result(stage, host, o.q.shape, o.q.dtype)
        dk, dk_res = _result(stage, host, o.k.shape, o.q.dtype)
        dv, dv_res = _result(stage, host, o.v.shape, o.q.dtype)
        dq4, dk4, dv4 = (_kernel_layout(o, x) for x in (dq, dk, dv))
        dbias = dbias_res = None
        if o.bias is not None:
            dbias, dbias_res = _dbias_buffer(stage, o, host)
        mods = _bind_mods(o, stage, backward=True)
        ko = lower.kernel_problem(o)
        extra = _extras(ko, stage)
        if host:
            stage.uploads_done()
        sinks = _sinks_view(o, stage)
        dsinks = dsinks_res = None
        if sinks is not None:
            dsinks, dsinks_res = _result(stage, host, (o.Hq,), np.float32)
        arch = device_arch(stage.device)
        # (a mask_mod lowered whole, to a band or documents, leaves mods None: still a call with mods)
        scaled16 = select.bwd_tf32_f16(arch, dtype_name(o.q.dtype), o.precision == "tf32", o.D, o.Dv,
                                       varlen=o.varlen or ko.varlen,
                                       seqused=o.used_q is not None or o.used_k is not None, bias=o.bias is not None,
                                       mods=mods is not None or getattr(o, "mods_lowered", False),
                                       sinks=sinks is not None, dlse=dlse3 is not None)
        grad_scales = held = None
        if scaled16:            # float16 copies scaled by powers of two (scale16.py); held until enqueued
            (q4, k4, v4, out4, dout4), grad_scales, _, held = scale16.copies((q4, k4, v4, out4, dout4), o.Dv,
                                                                              stage, arch)
        views = (q4, k4, v4, dout4, out4, lse3, dq4, dk4, dv4, dbias, dlse3)
        plan = _backward_plan(ko, stage.device, views, extra, deterministic, None if mods is None else mods.gen,
                              scaled16)
        ptrs = ((q4.ptr, k4.ptr, v4.ptr, out4.ptr, lse3.ptr, None, None)
                + tuple(None if x is None else x.ptr for x in extra)
                + (dout4.ptr, dq4.ptr, dk4.ptr, dv4.ptr, None if dbias is None else dbias.ptr,
                   None if dlse3 is None else dlse3.ptr, None, None, None, None, None))
        ptrs = _with_sinks(ptrs, sinks, dsinks)
        if grad_scales is not None:
            ptrs = _at_slots(ptrs, {SLOT_GRAD_SCALES: grad_scales.ptr})
        if mods is None:
            _launch(plan, stage.device, stage.stream, ptrs, o.scale_value, o.softcap_value)
        else:
            _build_block_mask(plan, stage, ptrs, o, mods, stage.device)
            _launch(plan, stage.device, stage.stream, ptrs, o.scale_value, o.softcap_value, mods.gmods)
            o.dtensors = _finish_mods(stage, mods)
        del held                 # freed in the stream's order, after the launches
        if host:
            for view, dst in ((dq, dq_host), (dk, dk_host), (dv, dv_host)):
                stage.download(view, dst)
            if dbias is not None:
                stage.download(dbias_res, dbias_host.reshape(dbias_res.shape))
            dsinks_host = None
            if dsinks is not None:
                dsinks_host = np.empty((o.Hq,), np.float32)
                stage.download(dsinks, dsinks_host)
            return dq_host, dk_host, dv_host, dbias_host, dsinks_host
        return dq_res, dk_res, dv_res, dbias_res, dsinks_res
