"""What attnext keeps per process, and the hooks that keep it right across fork and exit.

Hooks. attnext registers one os.register_at_fork and one atexit handler (and one hook before the
interpreter joins its threads at exit), here; each module registers its own hooks with them,
beside the state they guard:

    process.at_fork(before=pinning.forget_kept, after_in_child=_forget_after_fork)   # staging
    process.at_exit(reset)                                                             # staging
    process.before_thread_join(_drop_queued)                                           # nvrtc

They run in Python's orders: before a fork and at exit the last registered first, in a forked
child in the order of registration. A hook that raises is reported on stderr and the others run.
A forked child cannot use its parent's CUDA state or threads: each module's after_in_child
hook starts it again from nothing (new locks, no pools, no threads); before a fork, pinned
registrations are given back (pinning.forget_kept). At exit the copy threads and rings
(staging), compile_ahead's queued compiles (nvrtc) and the idle scratch buffers and split
counters (below) go.

Scratch (`borrow_scratch`): the memory a call needs only while its kernels run (the split-KV
forward's partial results, the backward's row sums) is one buffer per (device, stream), kept
between calls and grown on demand. A call borrows it (no other call can hold it meanwhile),
enqueues its kernels on that stream, and gives it back: a later call on the same stream is
ordered after those kernels, so it may reuse the memory at once. Concurrent calls on one stream
get a buffer each. At most SCRATCH_STREAMS streams keep one; a buffer pushed out, and every
buffer at exit (`release_scratch`), is freed after a device-wide synchronisation, so a stream
destroyed meanwhile is never named again. The per-thread default stream (2) names a different
stream in each thread, so its scratch is not kept: freed after each call, in order.
"""
import atexit
import collections
import concurrent.futures.thread  # noqa: F401  (its exit hook first: ours, after, runs before it)
import os
import sys
import threading
import traceback

from .. import _C
from .arrays import PER_THREAD_STREAM, _legacy

_before_fork = []          # hooks, in the order registered
_after_fork_in_child = []
_at_exit = []
_before_join = []


def at_fork(*, before=None, after_in_child=None):
    """Runs before() before each os.fork() (the last registered first) and after_in_child() in
    the child (in the order registered)."""
    if before is not None:
        _before_fork.append(before)
    if after_in_child is not None:
        _after_fork_in_child.append(after_in_child)


def at_exit(fn):
    """Runs fn() at the interpreter's exit (the last registered first), after its threads are
    joined."""
    _at_exit.append(fn)
    return fn


def before_thread_join(fn):
    """Runs fn() at the interpreter's exit before non-daemon threads and thread pools are joined
    (the last registered first): e.g. to cancel a pool's queued work, so that exit waits only for
    what is under way."""
    _before_join.append(fn)
    return fn


def _run(hooks, when):
    for fn in hooks:
        try:
            fn()
        except Exception:
            sys.stderr.write(f"attnext: a hook run {when} failed ({getattr(fn, '__qualname__', fn)}):\n")
            traceback.print_exc()


def _run_before_fork():
    _run(reversed(_before_fork), "before fork")


def _run_after_fork_in_child():
    _run(list(_after_fork_in_child), "in a forked child")


def _run_at_exit():
    _run(reversed(_at_exit), "at exit")


def _run_before_join():
    _run(reversed(_before_join), "at exit, before the threads are joined")


atexit.register(_run_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_run_before_fork, after_in_child=_run_after_fork_in_child)
# threading's exit hooks (concurrent.futures joins its pools' workers in one) run the last
# registered first, before atexit's. No public API runs a hook before that join, so this takes
# threading's private registration, as concurrent.futures does
threading._register_atexit(_run_before_join)


# ---------------------------------------------------------------- scratch
SCRATCH_STREAMS = 32             # streams that keep a scratch buffer between calls
SCRATCH_MIN_BYTES = 1 << 20      # scratch grows in powers of two from here
SCRATCH_KEEP_BYTES = 64 << 20    # a larger buffer is freed after its call, not kept

_scratch = collections.OrderedDict()   # (device, stream) -> (ptr, nbytes): idle buffers, LRU first
_counters = collections.OrderedDict()  # (device, stream) -> (ptr, count): launch counters (below), LRU first
_scratch_lock = threading.Lock()


def borrow_scratch(nbytes, device, stream):
    """(ptr, size): at least nbytes of device memory for work enqueued on `stream` (and on no
    other stream) until give_back_scratch(). Uninitialised; MemoryError when the device is out of
    memory."""
    key = (device, _legacy(stream))
    with _scratch_lock:
        buf = _scratch.pop(key, None)
    if buf is not None:
        if buf[1] >= nbytes:
            return buf
        _C.mem_free(buf[0], stream, device)      # after the work that used it, on this stream
    size = max(SCRATCH_MIN_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
    return _C.mem_alloc(size, stream, device), size


def give_back_scratch(buf, device, stream):
    """Returns borrow_scratch's buffer once the work using it is enqueued on `stream`."""
    if _legacy(stream) == PER_THREAD_STREAM:
        _C.mem_free(buf[0], stream, device)
        return
    _give_back(_scratch, buf, device, stream, SCRATCH_KEEP_BYTES)


def _give_back(pool, buf, device, stream, keep_limit=None):
    """buf back into pool (_scratch, _counters) for (device, stream): of it and the idle buffer
    another call on the stream gave back meanwhile, the larger is kept and the other freed in
    the stream's order (buf too, past keep_limit); past SCRATCH_STREAMS streams the least
    recently used buffers go."""
    key = (device, _legacy(stream))
    with _scratch_lock:
        idle = pool.pop(key, None)
        if (keep_limit is not None and buf[1] > keep_limit) or (idle is not None and idle[1] >= buf[1]):
            keep, drop = idle, buf
        else:
            keep, drop = buf, idle
        if keep is not None:
            pool[key] = keep
        evicted = []
        while len(pool) > SCRATCH_STREAMS:
            evicted.append(pool.popitem(last=False))
    if drop is not None:
        _C.mem_free(drop[0], stream, device)     # the stream is alive: its call just used it
    if evicted:
        _free_scratch(evicted)


def _free_scratch(entries):
    """Frees buffers whose streams may be gone: after a synchronisation of their devices."""
    for device in sorted({device for (device, _), _ in entries}):
        try:
            _C.device_synchronize(device)
            for (d, _), (ptr, _) in entries:
                if d == device:
                    _C.mem_free(ptr, 0, device)
        except RuntimeError:
            pass    # a faulted context: the driver frees everything with the process


def release_scratch():
    """Frees every idle scratch buffer and every stream's launch counters (at exit; the tests
    call it too)."""
    with _scratch_lock:
        entries = list(_scratch.items()) + list(_counters.items())
        _scratch.clear()
        _counters.clear()
    if entries:
        _free_scratch(entries)


def scratch_info():
    """{(device, stream): bytes} of the idle scratch buffers."""
    with _scratch_lock:
        return {key: size for key, (_, size) in _scratch.items()}


def _forget_scratch_after_fork():
    global _scratch_lock
    _scratch_lock = threading.Lock()
    _scratch.clear()
    _counters.clear()


# ---------------------------------------------------------------- launch counters
# int32 counters a launch finds at 0 and leaves at 0 (attn_params.counters): the split-KV
# forward's own merge (attn_fwd.cu) counts each query tile's finished splits in one, the
# launch's last CTA of the tile setting it back to 0; the persistent WS forward counts its
# tiles taken in the first, its last taker setting it back.
# So a stream keeps a buffer of them, zeroed once when made and lent to nothing but these: the
# launches of one stream run in order, each finding the zeros the one before left. Borrowed and
# given back around a call's launches like scratch (a call on the same stream meanwhile gets a
# buffer of its own; only idle buffers are ever freed), at most SCRATCH_STREAMS streams keep one.
# None where such a buffer could outlive its stream's order: the per-thread default stream (a
# different stream in each thread), a stream capturing a CUDA graph (a replay beside later calls
# would share the counters), or no memory for one; the call then launches attn_fwd_combine
# (the persistent grid takes every gridDim.x-th tile).


def keeps_across_calls(stream, device):
    """Whether device memory a call fills on `stream` may be kept for later calls on it to read
    (launch counters, a replay's upload): not on the per-thread default stream (a different
    stream in each thread, so a later call is not ordered after it), nor while the stream
    captures a CUDA graph (a replay of the graph beside later calls would share it)."""
    return _legacy(stream) != PER_THREAD_STREAM and not _C.stream_capturing(stream, device)


def borrow_counters(count, device, stream):
    """(ptr, n): n >= count zeroed int32 counters for launches on `stream` until
    give_back_counters(), or None (above)."""
    if not keeps_across_calls(stream, device):
        return None
    key = (device, _legacy(stream))
    with _scratch_lock:
        buf = _counters.pop(key, None)
    if buf is not None and buf[1] >= count:
        return buf
    try:
        if buf is not None:
            _C.mem_free(buf[0], stream, device)      # after the launches that used it, in order
        n = max(1024, 1 << (count - 1).bit_length())
        buf = (_C.mem_alloc(4 * n, stream, device), n)
    except MemoryError:
        return None
    _C.memset_d8(buf[0], 0, 4 * n, stream, device)
    return buf


def give_back_counters(buf, device, stream):
    """Returns borrow_counters' buffer once the launches using it are enqueued on `stream` (one
    freed here was left zero by its own call's launches)."""
    _give_back(_counters, buf, device, stream)


at_exit(release_scratch)
at_fork(after_in_child=_forget_scratch_after_fork)
