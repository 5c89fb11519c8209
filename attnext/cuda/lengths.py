"""Device lengths (and a paged cache's CUDA block table, by launch_pages): varlen_attention's
cu_seqlens_* and seqused_* as CUDA int32 arrays, with
max_seqlen_q and max_seqlen_k given, are read by the kernels where they lie, so a call never
waits for the GPU to learn them (FlashAttention's varlen takes them so). The host checks only
their dtypes and shapes (checks._device_lengths); their values are checked on the GPU, by
kernels/attn_lengths.cu on the call's stream before the attention kernels, and the attention
kernels clamp them meanwhile (csrc/seqlen.h), so wrong lengths read and write nothing outside
the arrays: the call's results are then undefined.

A fault is reported by the next GPU call that starts after the check ran (raise_pending, at the
start of every GPU forward and backward): ValueError naming the array, the index and the value,
as the host's checks name them. The record is a few words of pinned host memory the GPU writes
at its host address, read here without a synchronisation; it is made by the first call with
device lengths and cleared when reported. Two calls whose checks fault at the same moment may
mix their words (the GPU's stores to host memory are plain ones): the error is still raised.
A caller that must know before going on synchronises its stream and makes any GPU call."""
import collections
import itertools
import threading

import numpy as np

from .. import _C
from . import nvrtc, process

ARRAYS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "block_table", "seqlens_k")
# kernels/attn_lengths.cu's lengths_params and its record's words
PARAMS = np.dtype([("cu", "u8", 2), ("used", "u8", 2), ("record", "u8"), ("B", "i8"), ("device", "i8"),
                   ("rows", "i8", 2), ("max_len", "i8", 2)])
CODE, ARRAY, INDEX, VALUE, BOUND, DEVICE, COLUMN, WORDS = 0, 1, 2, 3, 4, 5, 6, 8
SPEC = ("attn_lengths", "attn_lengths", {}, "")
# attn_pages's pages_params: a paged cache's CUDA block table, checked on the device
PAGES_PARAMS = np.dtype([("table", "u8"), ("used", "u8"), ("record", "u8"), ("B", "i8"), ("device", "i8"),
                         ("bt_stride", "i8"), ("max_pages", "i8"), ("page_size", "i8"), ("num_pages", "i8"),
                         ("call", "u8")])
PAGES_SPEC = ("attn_lengths", "attn_pages", {}, "")
PAGE_OUT_OF_RANGE, SEQLENS_K_OUTSIDE = 7, 8
PAGES_THREADS = 256     # attn_pages: one table entry a thread; grid (columns / 256, rows)
MAX_GRID_Y = 65535      # rows past it loop in the kernel
_page_calls = itertools.count(1)    # attn_pages' launch numbers: one CTA a call reports a fault
# a check's launch as launch / launch_pages made it: relaunch enqueues it again (a replayed call)
Check = collections.namedtuple("Check", "fn grid block params")

_lock = threading.Lock()
_record = None          # (PinnedBuffer, its int64 view), made by the first call with device lengths


def _the_record(device):
    global _record
    with _lock:
        if _record is None:
            buf = _C.host_alloc(WORDS * 8, device)
            words = np.frombuffer(buf, np.int64)
            words[:] = 0
            _record = (buf, words)
        return _record


def _forget_after_fork():
    global _record, _lock
    _record, _lock = None, threading.Lock()


process.at_fork(after_in_child=_forget_after_fork)


def launch(stage, o, arch):
    """Enqueues attn_lengths.cu on the call's stream for o's device lengths (DevViews); arch:
    NVRTC's name for the device's architecture. Returns the launch (Check) for a repeat of the
    call."""
    buf, _ = _the_record(stage.device)
    params = np.zeros((), PARAMS)
    params["cu"] = (o.cu_q.ptr, o.cu_k.ptr)
    params["used"] = tuple(0 if u is None else u.ptr for u in (o.used_q, o.used_k))
    params["record"] = buf.ptr
    params["B"], params["device"] = o.B, stage.device
    params["rows"] = (o.q4.shape[1], o.k4.shape[1])
    params["max_len"] = (o.max_q, o.max_k)
    kernel, name, defines, generated = SPEC
    fn = nvrtc.function(kernel, name, defines, stage.device, arch, 0, generated)
    check = Check(fn, (1, 1, 1), (256, 1, 1), params)
    relaunch(check, stage.stream)
    return check


def launch_pages(stage, table, used, B, page_size, num_pages, arch):
    """Enqueues attn_pages on the call's stream for a paged cache's CUDA block table (a DevView,
    int32 (B, max_pages), rows contiguous); used: the keys' lengths on the device (a DevView) or
    None (every page of a row). Returns the launch (Check) for a repeat of the call."""
    buf, _ = _the_record(stage.device)
    params = np.zeros((), PAGES_PARAMS)
    params["table"], params["used"], params["record"] = table.ptr, 0 if used is None else used.ptr, buf.ptr
    params["B"], params["device"] = B, stage.device
    params["bt_stride"], params["max_pages"] = table.strides[0], table.shape[1]
    params["page_size"], params["num_pages"] = page_size, num_pages
    kernel, name, defines, generated = PAGES_SPEC
    fn = nvrtc.function(kernel, name, defines, stage.device, arch, 0, generated)
    check = Check(fn, (-(-table.shape[1] // PAGES_THREADS), min(B, MAX_GRID_Y), 1), (PAGES_THREADS, 1, 1), params)
    relaunch(check, stage.stream)
    return check


def relaunch(check, stream):
    """Enqueues a check (launch's or launch_pages') on stream, under a new launch number where
    its parameters hold one (attn_pages'): the arrays' values as they are when it runs."""
    if all(check.grid):
        params = check.params
        if "call" in params.dtype.names:
            params = params.copy()
            params["call"] = next(_page_calls)
        _C.launch(check.fn, check.grid, check.block, 0, stream, params.tobytes())


def _describe(code, array, index, value, bound):
    name = ARRAYS[array]
    side = name[-1]
    return {
        1: f"{name}[0] = {value}; it must start at 0",
        2: f"{name}[{index}] = {value} is less than {name}[{index - 1}] = {bound}; it must not decrease",
        3: f"{name}[{index}] = {value} is past the end of the packed tensor ({bound} rows)",
        4: f"sequence {index} has {value} rows ({name}[{index + 1}] - {name}[{index}]), more than "
           f"max_seqlen_{side} = {bound}",
        5: f"{name}[{index}] = {value} is negative",
        6: f"{name}[{index}] = {value} exceeds the segment's length {bound}",
    }.get(code, f"fault code {code} at {name}[{index}] = {value}")


def raise_pending():
    """ValueError for a fault the GPU found in an earlier call's device lengths (once: the
    record is cleared); nothing when none waits or no call had device lengths."""
    rec = _record
    if rec is None:
        return
    words = rec[1]
    code = int(words[CODE])
    if not code:
        return
    array, index, value, bound, device = (int(words[i]) for i in (ARRAY, INDEX, VALUE, BOUND, DEVICE))
    column = int(words[COLUMN])
    words[:] = 0
    if code == PAGE_OUT_OF_RANGE:
        raise IndexError(
            f"the block table of an earlier paged call on cuda:{device} was wrong: block_table[{index}, "
            f"{column}] = {value} is out of range for {bound} pages. That call's results are undefined "
            f"(its kernels clamped the page indices and read nothing outside k and v). A CUDA "
            f"block_table is checked on the GPU, without a synchronisation, and reported by the next "
            f"call; pass it as a host array to have it checked before the call runs")
    if code == SEQLENS_K_OUTSIDE:
        raise ValueError(
            f"the seqlens_k of an earlier paged call on cuda:{device} was wrong: seqlens_k[{index}] = "
            f"{value} is outside [0, {bound}] (the block table's rows). That call's results are undefined "
            f"(its kernels clamped the length). A CUDA seqlens_k beside a CUDA block_table is checked "
            f"on the GPU, without a synchronisation, and reported by the next call; pass it as a host "
            f"array to have it checked before the call runs")
    raise ValueError(
        f"the device lengths of an earlier varlen call on cuda:{device} were wrong: "
        f"{_describe(code, array, index, value, bound)}. That call's results are undefined (its "
        f"kernels clamped the lengths and touched nothing outside its arrays). CUDA int32 "
        f"cu_seqlens / seqused with max_seqlen_* given are checked on the GPU, without a "
        f"synchronisation, and reported by the next call; leave max_seqlen_* out to have them "
        f"checked on the host before the call runs")
