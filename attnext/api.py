"""The public functions: each call is checked (checks.py: one Problem) and dispatched to a
backend: `attnext._C` for the CPU, the GPU host side (cuda/backend.py), or `attnext.reference`.

Causal alignment when Sq != Sk (here Sq = 2, Sk = 5; x = attended)::

    causal=True / "bottom_right"        causal="top_left"
        k: 0 1 2 3 4                       k: 0 1 2 3 4
    q0:    x x x x .                   q0:    x . . . .
    q1:    x x x x x                   q1:    x x . . .

A row that keeps no key (fully masked, or past its sequence's length) returns out = 0 and
lse = -inf, with zero gradients; never NaN. The public functions' docstrings say the rest
(_documented fills in the texts they share).
"""
from __future__ import annotations

from typing import Any, Collection

import ml_dtypes
import numpy as np

from . import _C, _env, checks, interop, reference
from ._layout import CpuCall, dtype_code
from .cuda import repeat
from .cuda.devview import DevView
from .mods import codegen, fingerprint, interp, lower, trace
from .types import Array, Grads, MaskMod, ScoreMod


def _new_output(shape, dtype, pinned=False):
    """Every result buffer a backend fills (the tests poison these to catch unwritten elements).
    pinned: a NumPy call on the GPU, whose large results live in pooled pinned memory
    (staging.host_result), so their DMAs need no host copy."""
    if pinned:
        return checks.gpu_modules()[0].host_result(shape, dtype)
    return np.empty(shape, dtype=dtype)


def _c_view(a):
    """What the C extension reads: bfloat16 as uint16 (NumPy cannot export it as a buffer)."""
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


def _problem(o, out4, lse3):
    """The CpuCall _C.forward / _C.backward read (csrc/module.c)."""
    return CpuCall(
        dtype=dtype_code(o.q.dtype), B=o.B,
        q=_c_view(o.q4), k=_c_view(o.k4), v=_c_view(o.v4), out=_c_view(out4), lse=lse3,
        cu_seqlens_q=o.cu_q, cu_seqlens_k=o.cu_k, seqused_q=o.used_q, seqused_k=o.used_k,
        bias=None if o.bias4 is None else _c_view(o.bias4),
        bias_dtype=dtype_code(o.bias4.dtype) if o.bias4 is not None else 0,
        bias_heads=o.bias_heads,
        mask=o.mask4, mask_heads=o.mask_heads,
        alibi=o.alibi, alibi_dtype=dtype_code(o.alibi.dtype) if o.alibi is not None else 0,
        scale=o.scale_value, softcap=o.softcap_value, causal=o.causal_code,
        window_left=o.window_left, window_right=o.window_right, num_threads=checks._num_threads(),
        mods=None, sinks=o.sink_values,
        block_table=None if o.block_table is None else o.block_table.ravel(),
        bt_stride=0 if o.block_table is None else o.block_table.shape[1], page_size=o.page_size)


def _cpu_mods(o, backward):
    """(the problem the C backend runs, interp.bind's mods) for a CPU call: mask_mod's band and
    documents moved into o first (attnext/lower.py), as the CUDA backend does; the problem is o,
    or o as varlen over the documents (the same memory: B = 1)."""
    ts = trace.trace_score_mod(o.score_mod) if o.score_mod is not None else None
    tm = lower.lower_mask(o, ts, trace.trace_mask_mod(o.mask_mod)) if o.mask_mod is not None else None
    return lower.kernel_problem(o), interp.bind(ts, tm, o.acc_dtype, backward=backward,
                                                dtensors=o.dtensors_asked)


def _as_bshd(o, x):
    """A (B, S, H, D) view of an array in the caller's layout (varlen: a leading 1)."""
    if o.varlen:
        return x[None]
    return x.transpose(0, 2, 1, 3) if o.layout == "bhsd" else x


def _lse_3d(o, lse):
    return lse[None] if o.varlen else lse


def _runs_on_reference(o):
    return o.device == "reference"


def _trace_mods(o):
    """device="reference" calls score_mod / mask_mod itself on NumPy arrays (reference.py), yet
    refuses what the backends refuse: each is traced first, as the CPU backend's interp.bind
    does, so Python control flow on traced values, a wrong return type, a captured array no
    lookup can read, a builtin refusing the arguments or a constant index out of range raise
    the CPU's exception and message before the reference runs. Valid functions run as before."""
    if o.score_mod is not None:
        trace.trace_score_mod(o.score_mod)
    if o.mask_mod is not None:
        trace.trace_mask_mod(o.mask_mod)


def _reference_kwargs(o):
    kw = dict(causal=o.causal, window=o.window, scale=o.scale, softcap=o.softcap,
              alibi_slopes=o.alibi_slopes, bias=o.bias, mask=o.mask, score_mod=o.score_mod,
              mask_mod=o.mask_mod, sinks=o.sink_values)
    if o.block_table is not None:
        kw["block_table"] = o.block_table
    if o.varlen:
        kw.update(max_seqlen_q=o.max_q, max_seqlen_k=o.max_k, seqused_q=o.used_q, seqused_k=o.used_k)
    else:
        kw.update(seqlens_q=o.seqlens_q, seqlens_k=o.seqlens_k, layout=o.layout)
    return kw


def _captured_inputs(o):
    """(what, array) for every array score_mod / mask_mod captures: inputs too, which out= must
    not overlap (a head written early would change the table a later head reads). A host array
    is given as NumPy's view of it (a torch CPU tensor's memory), a CUDA array as its DevView,
    whose pointer range the GPU call's check compares."""
    found = []
    for kind in ("score_mod", "mask_mod"):
        f = getattr(o, kind)
        if f is None:
            continue
        for name, a in fingerprint.captured_views(f).items():
            found.append((f"the array {name!r} that {kind} captures", a))
    return found


def _in_caller_library(o, x):
    """A result computed on the host (a NumPy array) in q's library: another library's host
    array (a torch CPU tensor, a JAX CPU array) gets its own back (attnext.interop)."""
    return x if x is None or isinstance(o.like, np.ndarray) else interop.to_library(x, o.like)


def _forward(o):
    inputs = [("q", o.q), ("k", o.k), ("v", o.v), ("bias", o.bias), ("mask", o.mask),
              ("alibi_slopes", o.alibi_slopes), ("cu_seqlens_q", o.cu_q), ("cu_seqlens_k", o.cu_k),
              ("seqused_q", o.used_q), ("seqused_k", o.used_k), ("sinks", o.sink_values)]
    if o.out is not None:
        inputs += _captured_inputs(o)
    if o.device == "cuda" and o.on_gpu:
        return _forward_on_gpu(o, inputs)
    checks.check_memory(o, backward=False, out_given=o.out is not None)
    gpu = o.device == "cuda"     # host q, k, v on the GPU: staged (cuda/staging.py), mods included
    if o.out is not None:
        out = checks.check_out("out", o.out, o.out_shape, o.q.dtype, inputs)
    else:
        out = _new_output(o.out_shape, o.q.dtype, pinned=gpu)
    lse = _new_output(o.lse_shape, o.acc_dtype, pinned=gpu)
    if _runs_on_reference(o):
        _trace_mods(o)
        if o.varlen:
            r_out, r_lse = reference.varlen_attention(o.q, o.k, o.v, o.cu_q, o.cu_k, return_lse=True,
                                                      **_reference_kwargs(o))
        else:
            r_out, r_lse = reference.attention(o.q, o.k, o.v, return_lse=True, **_reference_kwargs(o))
        out[...] = r_out.astype(out.dtype)
        lse[...] = r_lse
    elif gpu:
        checks.gpu_modules()[0].forward(o, out, lse)
    else:
        # the C backend writes through aligned element pointers; a misaligned out= gets a copy
        target = out if out.flags.aligned else _new_output(o.out_shape, o.q.dtype)
        ko, mods = _cpu_mods(o, backward=False)
        prob = _problem(ko, _as_bshd(o, target), _lse_3d(o, lse))
        prob.mods = mods
        _C.forward(prob)
        if target is not out:
            out[...] = target
    out = o.out if o.out is not None else _in_caller_library(o, out)
    return (out, _in_caller_library(o, lse)) if o.return_lse else out


def _forward_on_gpu(o, inputs):
    """CUDA arrays in, the caller's library's arrays out (or out= written in place)."""
    cuda_backend, device = checks.gpu_modules()
    user_out = o.out
    if o.out is not None:
        o.out = checks.check_device_out("out", o.out, o.out_shape, o.q.dtype, inputs)
    out, lse = cuda_backend.forward(o, None, None)
    if o.repeat_key is not None and o.recipe is not None:    # the next equal call replays it
        repeat.remember(o.repeat_key, o.recipe._replace(
            from_dlpack=interop.from_dlpack(o.like),
            captured=(o.documents_read,) if o.documents_read is not None else ()))
    out = user_out if user_out is not None else device.to_caller(out, o.like)
    return (out, device.to_caller(lse, o.like)) if o.return_lse else out


# --- the documentation the public functions share ----------------------------------------------

_ALIGNMENT = """\
    With Sq != Sk the causal diagonal is aligned to the bottom right, as FlashAttention >= 2.1
    does: query row r keeps key c when c <= r + Lk - Lq (Lq, Lk: the actual lengths). Here
    Sq = 2, Sk = 5 (x = attended):

        causal=True / "bottom_right"        causal="top_left"
            k: 0 1 2 3 4                       k: 0 1 2 3 4
        q0:    x x x x .                   q0:    x . . . .
        q1:    x x x x x                   q1:    x x . . .

    A row that keeps no key (fully masked, before its causal diagonal, outside its window, past
    its length, or with every kept score -inf) returns out = 0 and lse = -inf and gets zero
    gradients; never NaN. Finite scores however large (a -1e10 or finfo.min fill) are ordinary
    scores: equal ones give uniform attention and a finite lse."""

_OPTIONS = """\
    causal: False; True or "bottom_right" (the alignment above); "top_left": c <= r.
    window: None, or (left, right) ints, -1 = unbounded on that side: row r keeps
        r + Lk - Lq - left <= c <= r + Lk - Lq + right, relative to the bottom-right diagonal
        whatever causal says. A side wider than Sq + Sk is the same as -1.
    scale: the factor on q . k; default 1 / sqrt(D).
    softcap: None, or a positive float: s = softcap * tanh(s / softcap), before bias.
    alibi_slopes: None, or a float array (Hq,) or (B, Hq): s -= slope * |r + Lk - Lq - c|.
    bias: None, or a float array broadcastable to (B, H, Sq, Sk), H being 1, Hk or Hq (varlen:
        (B, H, max_seqlen_q, max_seqlen_k), by sequence and positions inside it). Read through
        its strides, never expanded: s += bias. Its gradient is the backward's dbias.
    mask: None, or a bool array broadcastable like bias; True = attend.
    sinks: None, or a float array (Hq,): attention sinks (gpt-oss), a logit per query head in
        the units of the final scores that joins each row's softmax denominator and carries no
        value: lse = log(sum_c exp(s_c) + exp(sinks[h])), out = sum_c exp(s_c - lse) v_c. A row
        that keeps no key gives out 0 and lse = sinks[h] (padding rows stay 0 and -inf). Host
        arrays of any float dtype, finite or -inf (no sink); on a GPU call a CUDA float32 array
        is read in place. Its gradient is the backward's Grads.dsinks.
    score_mod: None, or score_mod(score, b, h, q_idx, kv_idx) -> the new score. b is the batch
        item (varlen: the sequence), h the query head, q_idx and kv_idx positions inside the
        sequence, all int64; score is in the accumulation dtype. Write it with NumPy operations
        (np.where, not if): the reference calls it on NumPy arrays, the backends trace it once
        and compile it, forward and backward. Arrays it reads by name (closure, globals,
        defaults) are captured, read afresh at every call: NumPy arrays, other libraries' host
        arrays (a torch CPU tensor, as NumPy's view of it) and CUDA arrays (GPU calls only);
        their gradients are the backward's dtensors, each in its array's library. Called only
        at pairs every mask keeps. Guide: docs/score_mod.md.
    mask_mod: None, or mask_mod(b, h, q_idx, kv_idx) -> bool, True = attend (same arguments).
        Tiles it masks entirely are skipped, tiles it keeps entirely skip the test
        (attnext.block_mask draws them). FlexAttention's block_mask= is not taken: pass
        mask_mod= itself; attnext builds the block mask."""

_WHERE = """\
    device: None: the GPU when one is usable and has kernels for q's dtype (float16, bfloat16,
        float32), else the CPU (ATTNEXT_DEVICE overrides), with or without score_mod /
        mask_mod; "cpu"; "cuda"; "reference": the float64 NumPy reference with the arguments
        checked. CUDA arrays (PyTorch, CuPy, JAX, anything with __cuda_array_interface__ or
        __dlpack__) always run on the GPU, in place, on their stream, and results come back in
        their library. Host arrays (NumPy; a torch CPU tensor or a JAX CPU array, read as
        NumPy's view of its memory) are copied to the GPU when the call runs there, callbacks
        included (their generated kernels run, not the CPU interpreter), and results come
        back in q's library. A callback's captured CUDA array is read in place on the GPU
        (cuda:0 for host q, k, v) and refused on "cpu" and "reference".
    precision: None: float32 keeps float32 accuracy on the GPU (TF32 products of split operands);
        "tf32": float32 multiplies in single-pass TF32 on the GPU (10-bit mantissa, ~2.5x faster).
        The CPU keeps float32 accuracy either way."""

_PRECISION = """\
    dtypes: q, k, v float16, bfloat16 (ml_dtypes.bfloat16), float32, or float64 (CPU only), all
    alike, native byte order; products and sums accumulate in float32 (float64 for float64).
    Errors: TypeError for types and dtypes, ValueError for shapes and options that disagree,
    IndexError for a callback's lookup out of range, MemoryError, attnext.CompileError,
    RuntimeError for device faults (docs/design.md, Errors). Inputs are never modified."""


def _documented(f):
    """f with the shared texts put into its docstring's {ALIGNMENT}, {OPTIONS}, {WHERE},
    {PRECISION}."""
    for key, text in (("{ALIGNMENT}", _ALIGNMENT), ("{OPTIONS}", _OPTIONS), ("{WHERE}", _WHERE),
                      ("{PRECISION}", _PRECISION)):
        f.__doc__ = f.__doc__.replace(key, text.strip("\n").lstrip())
    return f


@checks.flex_keywords
@_documented
def attention(q: Array, k: Array, v: Array, *, causal: bool | str = False,
              window: tuple[int, int] | None = None, scale: float | None = None,
              softcap: float | None = None, alibi_slopes: Array | None = None,
              bias: Array | None = None, mask: Array | None = None,
              score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None,
              seqlens_q: Array | None = None, seqlens_k: Array | None = None,
              layout: str = "bshd", return_lse: bool = False, device: str | None = None,
              out: Array | None = None, precision: str | None = None,
              sinks: Array | None = None,
              block_table: Array | None = None) -> Array | tuple[Array, Array]:
    """Scaled-dot-product attention: softmax(scale * q k^T + bias ...) v, per batch item and head.

    q: (B, Sq, Hq, D); k: (B, Sk, Hk, D); v: (B, Sk, Hk, Dv) for layout="bshd" (the default).
    layout="bhsd" puts heads second, q (B, Hq, Sq, D): PyTorch SDPA and FlexAttention tensors
    need it. Hq must be a multiple of Hk (grouped-query / multi-query attention: query head h
    reads kv head h // (Hq // Hk)); D and Dv up to 256. NumPy arrays, or CUDA arrays of any
    library; any strides, broadcast (stride-0) dims included.

    {ALIGNMENT}

    {OPTIONS}
    seqlens_q, seqlens_k: None, or int arrays (B,): each batch item's actual lengths Lq <= Sq,
        Lk <= Sk; query rows past Lq are padding (out 0, lse -inf), keys past Lk are not read.
    block_table: None, or an int array (B, max_pages): a paged k / v cache (FlashAttention's
        and vLLM's): k (num_pages, page_size, Hk, D), v (num_pages, page_size, Hk, Dv), and key
        c of batch item b is row c % page_size of page block_table[b, c // page_size]; Sk is
        max_pages * page_size, seqlens_k the lengths. A page index a sequence reads outside
        [0, num_pages) is an IndexError: at once for a host table; for a CUDA int32 table on a
        GPU call (read in place, no synchronisation) from the next GPU call, as device lengths
        report theirs; beside such a table seqlens_k may be a CUDA int32 array, read in place
        too (a length outside [0, Sk]: ValueError from the next call). Forward only (decode
        and prefill), layout "bshd".
    layout: "bshd" or "bhsd" (above).
    return_lse: also return lse.
    {WHERE}
    out: None, or an array to write out into (out's shape, q's dtype; a CUDA array when q is
        one, else a writable host array: NumPy's, or a torch CPU tensor), overlapping no input
        (captured arrays included); it is returned.

    Returns out, or (out, lse) with return_lse=True:
        out: q's dtype, (B, Sq, Hq, Dv) ("bhsd": (B, Hq, Sq, Dv)), in q's library.
        lse: the natural log of the sum of exp over each row's kept scores, (B, Hq, Sq), float32
            (float64 for float64 q). attention_backward takes it.

    {PRECISION}

    Example:
        >>> out = attnext.attention(q, k, v, causal=True)            # q (B, Sq, Hq, D)
        >>> out = attnext.attention(q, k, v, layout="bhsd")          # torch SDPA's layout
    """
    key = None
    # lengths from the host (keyed by their contents), or a paged cache's CUDA seqlens_k (read in
    # place); CUDA seqlens elsewhere are read back to the host, which a key by address cannot follow
    lengths = (_all_host(seqlens_q, seqlens_k) or (seqlens_q is None and block_table is not None))
    if (score_mod is None and alibi_slopes is None and bias is None and mask is None and sinks is None
            and lengths and _env.get("ATTNEXT_REPEAT") != "0"):
        seqlens_q, seqlens_k = _held(seqlens_q), _held(seqlens_k)
        key, replayed = _repeat((q, k, v, out, seqlens_q, seqlens_k, block_table), mask_mod,
                                (causal, window, scale, softcap, layout, return_lse, device, precision), out)
        if replayed is not None:
            return replayed
    o = checks.normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=seqlens_q,
        seqlens_k=seqlens_k, layout=layout, return_lse=return_lse, device=device, out=out,
        precision=precision, sinks=sinks, block_table=block_table))
    o.repeat_key = key
    return _forward(o)


def _all_host(*arrays):
    """Whether every one of these arrays given is a NumPy array."""
    return all(x is None or isinstance(x, np.ndarray) for x in arrays)


def _held(x):
    """A small NumPy lengths array as a copy of its own: the key, the checks and the upload of a
    call that may replay all read the same values, whatever another thread writes meanwhile."""
    return x.copy() if isinstance(x, np.ndarray) and x.nbytes <= repeat.HOST_KEY_BYTES else x


def _repeat(args, mask_mod, options, out):
    """(key, result) of a call that may replay (cuda/repeat.py): its key (None: it cannot) and
    the replay's result where an earlier call left a recipe under the key, else None. A mask_mod
    enters the key by its fingerprint (mods/fingerprint.py), only where every array it captures
    is a host array; a recipe whose mask_mod was lowered to documents replays only while the
    array it read them from holds the values it read (Recipe.captured)."""
    key = repeat.key(args, options)
    captured = {}
    if key is not None and mask_mod is not None:
        found = fingerprint.fingerprint(mask_mod)
        if found is None or not all(isinstance(a, np.ndarray) for a in found[1].values()):
            return None, None
        key, captured = (key, found[0]), found[1]
    if key is None:
        return None, None
    recipe = repeat.lookup(key)
    if recipe is None or not all(name in captured and _starts_with(captured[name], kept)
                                 for name, kept in recipe.captured):
        return key, None
    return key, checks.gpu_modules()[0].replay(recipe, out)


def _starts_with(a, values):
    """Whether the 1-D array a begins with these values."""
    return a.ndim == 1 and a.shape[0] >= values.shape[0] and np.array_equal(a[:values.shape[0]], values)


@checks.flex_keywords
@_documented
def varlen_attention(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, *,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                     seqused_q: Array | None = None, seqused_k: Array | None = None,
                     causal: bool | str = False, window: tuple[int, int] | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     alibi_slopes: Array | None = None, bias: Array | None = None,
                     mask: Array | None = None, score_mod: ScoreMod | None = None,
                     mask_mod: MaskMod | None = None, return_lse: bool = False,
                     device: str | None = None, out: Array | None = None,
                     precision: str | None = None,
                     sinks: Array | None = None,
                     block_table: Array | None = None) -> Array | tuple[Array, Array]:
    """Attention over a packed batch of sequences of different lengths (FlashAttention's varlen).

    q: (Tq, Hq, D); k: (Tk, Hk, D); v: (Tk, Hk, Dv): the B sequences' rows one after another.
    cu_seqlens_q, cu_seqlens_k: int arrays (B + 1,), non-decreasing from 0: sequence i is rows
        cu_seqlens[i]:cu_seqlens[i + 1]. Rows after cu_seqlens[-1] are padding (out 0).
    max_seqlen_q, max_seqlen_k: upper bounds on the lengths; default the longest actual length.
        A bias or mask broadcasts to (B, H, max_seqlen_q, max_seqlen_k): pass them to give it
        room for whole segments.
    seqused_q, seqused_k: None, or int arrays (B,): only the first seqused[i] rows of sequence
        i are real; the rest is padding between sequences (out and gradients exactly 0).
    Lengths given as NumPy arrays are checked on the host without waiting for the GPU; as CUDA
    arrays they are read back first (a synchronisation).
    block_table: None, or an int array (B, max_pages): k and v are a paged cache (num_pages,
        page_size, Hk, D / Dv) as attention()'s block_table says; sequence b has seqused_k[b]
        keys (else cu_seqlens_k's segment lengths; cu_seqlens_k may then be None).

    {ALIGNMENT}

    {OPTIONS}
    return_lse: also return lse.
    {WHERE}
    out: None, or an array to write out into ((Tq, Hq, Dv), q's dtype; a CUDA array when q is
        one, else a writable host array), overlapping no input; it is returned.

    Returns out (Tq, Hq, Dv), q's dtype, or (out, lse) with return_lse=True, lse (Hq, Tq)
    float32 (float64 for float64 q); padding rows have out 0 and lse -inf.

    {PRECISION}
    """
    key = None
    # lengths from the host (keyed by their contents), or on the GPU where they stay there (read
    # in place and checked by each replay: max_seqlen_* given); CUDA lengths without them are read
    # back to the host, which a key by address cannot follow
    lens = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    lengths = _all_host(*lens) or (max_seqlen_q is not None and max_seqlen_k is not None
                                   and not any(isinstance(x, np.ndarray) for x in lens))
    if (score_mod is None and alibi_slopes is None and bias is None and mask is None and sinks is None
            and block_table is None and lengths and _env.get("ATTNEXT_REPEAT") != "0"):
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = (_held(x) for x in lens)
        key, replayed = _repeat((q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), mask_mod,
                                ("varlen", max_seqlen_q, max_seqlen_k, causal, window, scale, softcap, return_lse,
                                 device, precision), out)
        if replayed is not None:
            return replayed
    o = checks.normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=None,
        seqlens_k=None, layout="thd", return_lse=return_lse, device=device, out=out,
        precision=precision, sinks=sinks, block_table=block_table), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, seqused_q, seqused_k, varlen=True)
    o.repeat_key = key
    return _forward(o)


def _backward(o, dout, out, lse, deterministic, dtensors, dlse):
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {checks.fmt(deterministic)}")
    o.dtensors_asked = checks.dtensors_asked(o, dtensors)
    dout = checks.float_array("dout", dout)
    out = checks.float_array("out", out)
    lse = checks.float_array("lse", lse)
    for name, x in (("dout", dout), ("out", out)):
        checks.check_form(name, x.shape, x.dtype, o.out_shape, o.q.dtype, of="the forward output's ")
    checks.check_form("lse", lse.shape, lse.dtype, o.lse_shape, o.acc_dtype)
    if dlse is not None:
        dlse = checks.float_array("dlse", dlse)
        checks.check_form("dlse", dlse.shape, dlse.dtype, o.lse_shape, o.acc_dtype, of="lse's ")
    if o.device == "cuda" and o.on_gpu:
        return _backward_on_gpu(o, dout, out, lse, deterministic, dlse)
    if o.device != "cuda" and any(isinstance(x, DevView) for x in (dout, out, lse, dlse)):
        raise TypeError("dout, out, lse or dlse are CUDA arrays but q, k, v live on the host; pass "
                        "all of them on the GPU or all on the host")
    checks.check_memory(o, backward=True)
    if _runs_on_reference(o):
        _trace_mods(o)
        asked = True if o.dtensors_asked is None else o.dtensors_asked
        if o.varlen:
            g = reference.varlen_attention_backward(dout, o.q, o.k, o.v, out, lse, o.cu_q, o.cu_k,
                                                    dtensors=asked, dlse=dlse, **_reference_kwargs(o))
        else:
            g = reference.attention_backward(dout, o.q, o.k, o.v, out, lse, dtensors=asked, dlse=dlse,
                                             **_reference_kwargs(o))
        dbias = None if g.dbias is None else g.dbias.astype(o.bias.dtype)
        captured = {} if not g.dtensors else fingerprint.captured_arrays(o.score_mod)
        return _host_grads(o, g.dq.astype(o.q.dtype), g.dk.astype(o.q.dtype), g.dv.astype(o.q.dtype),
                           dbias, {n: interop.to_library(x, captured[n]) for n, x in g.dtensors.items()},
                           None if g.dsinks is None else g.dsinks.astype(o.acc_dtype))
    gpu = o.device == "cuda"     # host q, k, v on the GPU: staged (cuda/staging.py), mods included
    dq = _new_output(o.q.shape, o.q.dtype, pinned=gpu)
    dk = _new_output(o.k.shape, o.q.dtype, pinned=gpu)
    dv = _new_output(o.v.shape, o.q.dtype, pinned=gpu)
    if gpu:
        cuda_backend = checks.gpu_modules()[0]
        dbias_acc = None
        if o.bias is not None:
            dbias_acc = np.zeros((1,) * (4 - o.bias.ndim) + o.bias.shape, dtype=o.acc_dtype)
        dsinks = cuda_backend.backward(o, dout, out, lse, dq, dk, dv, dbias_acc, deterministic, dlse)[4]
        dbias = None if dbias_acc is None else dbias_acc.reshape(o.bias.shape).astype(o.bias.dtype)
        return _host_grads(o, dq, dk, dv, dbias, o.dtensors if o.dtensors is not None else {}, dsinks)
    ko, mods = _cpu_mods(o, backward=True)
    prob = _problem(ko, _as_bshd(o, out), _lse_3d(o, lse))
    prob.dout = _c_view(_as_bshd(o, dout))
    prob.dq, prob.dk, prob.dv = (_c_view(_as_bshd(o, x)) for x in (dq, dk, dv))
    prob.dbias = dbias_acc = None
    prob.dlse = None if dlse is None else _lse_3d(o, dlse)
    prob.mods = mods
    if o.bias is not None:
        # accumulate into the bias's own (compact) shape; broadcast dims get stride 0
        compact = o.bias.reshape((1,) * (4 - o.bias.ndim) + o.bias.shape)
        dbias_acc = np.zeros(compact.shape, dtype=o.acc_dtype)
        target = o.bias4.shape
        strides = tuple(0 if c == 1 and t != 1 else s
                        for c, t, s in zip(compact.shape, target, dbias_acc.strides))
        prob.dbias = np.lib.stride_tricks.as_strided(dbias_acc, target, strides)
    _C.backward(prob)
    dbias = None if dbias_acc is None else dbias_acc.reshape(o.bias.shape).astype(o.bias.dtype)
    dsinks = None if o.sink_values is None else _dsinks_on_host(o, dout, out, lse, dlse)
    return _host_grads(o, dq, dk, dv, dbias, interp.dtensors(prob.mods), dsinks)


def _dsinks_on_host(o, dout, out, lse, dlse):
    """The CPU backend's sinks gradient, from the forward's results: d lse / d sink = exp(sink -
    lse) = P_sink and d out / d sink = -P_sink out, so dsinks[h] = -sum over rows of P_sink
    (rowsum(dout * out) - dlse), in float64 a sequence at a time. A row whose lse is its sink's
    keeps no key (the backends' rule: what it keeps weighs under rounding): out 0, P_sink 1, it
    gives its dlse alone. Rows of lse -inf (padding, or no key and no sink) give nothing."""
    dout4, out4 = _as_bshd(o, dout), _as_bshd(o, out)
    lse3 = _lse_3d(o, lse)
    dlse3 = None if dlse is None else _lse_3d(o, dlse)
    sinks = o.sink_values.astype(np.float64)[:, None]
    dsinks = np.zeros(o.Hq)
    for b in range(lse3.shape[0]):
        lse_b = lse3[b].astype(np.float64)
        dead = lse_b == sinks
        live = (lse_b != -np.inf) & ~dead
        delta = np.einsum("shd,shd->hs", dout4[b].astype(np.float64), out4[b].astype(np.float64))
        dl = 0.0 if dlse3 is None else dlse3[b].astype(np.float64)
        with np.errstate(invalid="ignore"):        # a -inf sink at a -inf row: not live
            p_sink = np.where(live, np.exp(sinks - lse_b), 0.0)
        dsinks -= np.where(live, p_sink * (delta - dl), 0.0).sum(axis=1)
        dsinks += np.where(dead & (lse_b != -np.inf), dl, 0.0).sum(axis=1)
    return dsinks.astype(o.acc_dtype)


def _host_grads(o, dq, dk, dv, dbias, dtensors, dsinks=None):
    """A host call's gradients: dq, dk, dv, dbias and dsinks in q's library, dtensors as the
    backends give them (each in its captured array's library)."""
    return Grads(*(_in_caller_library(o, x) for x in (dq, dk, dv, dbias)), dtensors,
                 dsinks=_in_caller_library(o, dsinks))


def _backward_on_gpu(o, dout, out, lse, deterministic, dlse):
    """CUDA arrays in, gradients back as the caller's library's arrays."""
    cuda_backend, device = checks.gpu_modules()
    dq, dk, dv, dbias, dsinks = cuda_backend.backward(o, dout, out, lse, None, None, None, None, deterministic,
                                                      dlse)
    dq, dk, dv = (device.to_caller(x, o.like) for x in (dq, dk, dv))
    dbias, dsinks = (None if x is None else device.to_caller(x, o.like) for x in (dbias, dsinks))
    return Grads(dq, dk, dv, dbias, o.dtensors if o.dtensors is not None else {}, dsinks=dsinks)


_GRADS = """\
    dout: the gradient of out: out's shape, q's dtype.
    out, lse: the forward's results for these inputs and options (lse as return_lse=True gives
        it: float32, float64 for float64 q). They are read as given, as FlashAttention's
        backward does: P = exp(s - lse), delta = rowsum(dout * out); an lse of -inf is a row
        that keeps no key.
    deterministic: True (default): the GPU backward gives the same bits on every run. False
        lets the Hopper kernels add dQ in whatever order the additions land where a row sees
        more than 1024 keys (a little faster there). The CPU is deterministic either way.
    dtensors: which captured arrays' gradients to compute: True (default) every float array the
        score_mod reads, False none, or a collection of their names (a list, tuple or set of
        str, as dtensors keys them; a str alone is refused: write ["rel"]). An array left out
        costs nothing: no accumulation for it runs, and with none asked the GPU backward runs
        the kernels of a score_mod without array gradients (the dQ kernels' scatter, which
        makes a table's backward several times slower, is gone). TypeError for another type,
        ValueError for a name that is not a captured float array (the valid ones are listed)
        or for names without a score_mod.
    dlse: None (default), or the gradient of the lse the forward returned, in lse's shape and
        dtype (FlashAttention-4's and FlexAttention's lse gradient): d lse / d s = P, so it
        joins each row's dS as delta does, dS = P (dP - rowsum(dout * out) + dlse). A row that
        keeps no key ignores it (with sinks its lse is the sink's: its dlse goes to dsinks).
        dout may be zeros where only lse is used.
    sinks: as given to the forward; their gradient is the result's dsinks."""

_RETURNS = """\
    Returns attnext.Grads(dq, dk, dv, dbias, dtensors), a named tuple: dq, dk, dv in the shapes
    of q, k, v as given (a broadcast k gets a full-shape dk), q's dtype, in q's library; dbias
    in the shape and dtype of the bias given (summed over its broadcast dims), None without
    one; dtensors: {name: gradient} of each float array the dtensors argument asks for (by
    default every one the score_mod reads), in the array's shape, dtype and library (a torch
    CPU tensor's is a torch CPU tensor; {} without a score_mod or with dtensors=False). A row
    that keeps no key has dq exactly 0 and adds nothing to dk, dv, dbias or dtensors. The
    attribute dsinks (not a tuple field: five names unpack it) is sinks' gradient, (Hq,)
    float32 (float64 for float64 q) in q's library, or None without sinks."""


def _documented_backward(f):
    f.__doc__ = f.__doc__.replace("{GRADS}", _GRADS.lstrip()).replace("{RETURNS}", _RETURNS.lstrip())
    return _documented(f)


@checks.flex_keywords
@_documented_backward
def attention_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *,
                       causal: bool | str = False, window: tuple[int, int] | None = None,
                       scale: float | None = None, softcap: float | None = None,
                       alibi_slopes: Array | None = None, bias: Array | None = None,
                       mask: Array | None = None, score_mod: ScoreMod | None = None,
                       mask_mod: MaskMod | None = None, seqlens_q: Array | None = None,
                       seqlens_k: Array | None = None, layout: str = "bshd",
                       device: str | None = None, precision: str | None = None,
                       deterministic: bool = True,
                       dtensors: bool | Collection[str] = True, dlse: Array | None = None,
                       sinks: Array | None = None) -> Grads:
    """Gradients of attention(q, k, v, ...) for the output gradient dout.

    q, k, v and every option as given to attention() (the same shapes, layout and options:
    the backward recomputes the scores from them).
    {GRADS}

    {ALIGNMENT}

    {OPTIONS}
    seqlens_q, seqlens_k: None, or int arrays (B,): as attention's.
    layout: "bshd" (default) or "bhsd" (PyTorch SDPA / FlexAttention tensors).
    {WHERE}

    {RETURNS}

    {PRECISION}

    Example:
        >>> out, lse = attnext.attention(q, k, v, causal=True, return_lse=True)
        >>> dq, dk, dv, dbias, dtensors = attnext.attention_backward(dout, q, k, v, out, lse,
        ...                                                           causal=True)
        >>> out, lse = attnext.attention(q, k, v, score_mod=alibi, return_lse=True)
        >>> g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=alibi,
        ...                                dtensors=False)     # dq, dk, dv; no slopes gradient
    """
    o = checks.normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=seqlens_q,
        seqlens_k=seqlens_k, layout=layout, return_lse=False, device=device, out=None,
        precision=precision, sinks=sinks))
    return _backward(o, dout, out, lse, deterministic, dtensors, dlse)


@checks.flex_keywords
@_documented_backward
def varlen_attention_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array,
                              cu_seqlens_q: Array, cu_seqlens_k: Array, *,
                              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                              seqused_q: Array | None = None, seqused_k: Array | None = None,
                              causal: bool | str = False, window: tuple[int, int] | None = None,
                              scale: float | None = None, softcap: float | None = None,
                              alibi_slopes: Array | None = None, bias: Array | None = None,
                              mask: Array | None = None, score_mod: ScoreMod | None = None,
                              mask_mod: MaskMod | None = None, device: str | None = None,
                              precision: str | None = None, deterministic: bool = True,
                              dtensors: bool | Collection[str] = True,
                              dlse: Array | None = None, sinks: Array | None = None) -> Grads:
    """Gradients of varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, ...) for dout.

    q (Tq, Hq, D), k (Tk, Hk, D), v (Tk, Hk, Dv), the lengths (cu_seqlens_*, max_seqlen_*,
    seqused_*) and every option as given to varlen_attention(). Padding rows (after
    cu_seqlens[-1], or past seqused inside a sequence) get exactly zero gradients.
    {GRADS}

    {ALIGNMENT}

    {OPTIONS}
    {WHERE}

    {RETURNS}

    {PRECISION}
    """
    o = checks.normalise(q, k, v, dict(
        causal=causal, window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, seqlens_q=None,
        seqlens_k=None, layout="thd", return_lse=False, device=device, out=None,
        precision=precision, sinks=sinks), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
        seqused_k, varlen=True)
    return _backward(o, dout, out, lse, deterministic, dtensors, dlse)


# what info() says of a build without OpenMP (setup.py's message says the same at build time)
_ONE_THREAD = ("no OpenMP: one thread; for threads build again with OpenMP (Apple's clang: brew "
               "install libomp)")
# The caches of compiled score_mod / mask_mod programs, by backend: name -> function returning
# a dict with at least hits, misses, compiles and compile_seconds ("cuda": the generated
# sources; NVRTC's cubins are nvrtc.cache_info()).
_PROGRAM_CACHES = {"cpu": interp.cache_info, "cuda": codegen.cache_info}


def cache_info() -> dict[str, Any]:
    """Counters of the score_mod / mask_mod program caches: hits, misses, compiles and
    compile_seconds summed over the backends, and each backend's own counters under its name
    ("cpu": the interpreter's lowered programs, "cuda": the generated CUDA sources, both keyed by
    the graph's structure)."""
    per = {name: fn() for name, fn in _PROGRAM_CACHES.items()}
    total = {k: sum(p[k] for p in per.values())
             for k in ("hits", "misses", "compiles", "compile_seconds")}
    return {**total, **per}


def info() -> dict[str, Any]:
    """What this build can run, and why not where it cannot.

    Returns a dict: "version"; "backends": {"reference", "cpu", "cuda"} -> "usable (...)" (the
    CPU's SIMD variant and threads, the GPU's dtypes) or "unavailable: <why>" (no driver, no
    NVRTC, no GPU, ...); "score_mod": where callbacks run; "device_name": GPU 0's name and
    architecture, or None; "nvrtc_version": "major.minor" or None; "cache_dir": the compiled
    kernels' folder on disk, or None (memory only, or no GPU).
    """
    from ._version import __version__
    from .cuda import backend as cuda_backend, nvrtc
    why = cuda_backend.unavailable_reason()
    device_name = None
    if not why:
        d = cuda_backend.device_info(0)
        device_name = f"{d['name']} (sm_{d['compute_capability'][0]}{d['compute_capability'][1]})"
    try:
        nvrtc_version = ".".join(map(str, nvrtc.nvrtc()))
    except RuntimeError:
        nvrtc_version = None
    cache = nvrtc.cache_info()
    return {
        "version": __version__,
        "backends": {
            "reference": "usable",
            "cpu": f"usable ({_C.simd()} SIMD, "
                   f"{'OpenMP, %d threads' % _C.openmp_threads() if _C.openmp_threads() else _ONE_THREAD})",
            "cuda": "usable (float16, bfloat16, float32)" if not why else f"unavailable: {why}",
        },
        "score_mod": "on the GPU (CUDA arrays, or host arrays the call runs there): generated CUDA "
                     "code compiled into the kernels; on the CPU: the CPU backend's interpreter "
                     "(forward, backward and mask_mod block skipping on both)",
        "device_name": device_name,
        "nvrtc_version": nvrtc_version,
        "cache_dir": cache["cache_dir"] if cache else None,
    }
