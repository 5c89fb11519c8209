"""NumPy arrays to and from the GPU through pinned staging buffers: one call's host<->device traffic.

A copy goes through a ring of pinned chunks (RING_SLOTS slots of CHUNK_BYTES, one ring per
direction, allocated on first use, kept for the process and freed at exit):

    upload    threads copy chunk i+1 (any strides) into a free slot  | DMA of chunk i
    download  DMA of chunks i+1 .. i+RING_SLOTS-1                    | threads copy chunk i out

Each slot has a DMA stream of its own (per device), and a slot is written again only after the
host has synchronised that stream: its last DMA is done. A ring is locked by one copy at a time,
so concurrent calls never share a slot in flight. The host copies run on a small pool of threads
(NumPy releases the GIL for large copies) in runs of at least SHARE_BYTES (a copy of one
chunk in one run is the calling thread's: a handoff costs more than it saves); arrays of at most
SMALL_BYTES skip the ring and go straight from or to pageable memory on the call's stream,
through a copy in pages of their own (_private).

Streams. The call's stream orders allocations and kernels. An upload's DMAs wait for the call's
stream as it was when the copy began (its destination allocated), or for an earlier Fence, and
the call's stream waits for them before its next kernel; a download's DMAs wait for the call's
stream (its kernels done), or a Fence. A Fence is a point in the call's stream that later copies
can wait for (a stream of its own waiting on it: the primitives here have no event object).

Pinned in place (pinning.py, ATTNEXT_STAGING=register): a Staging told the call's large host
arrays up front (pin()) registers their memory on the copy threads meanwhile, and a copy
from or to a C-contiguous array inside those registrations skips the ring: DMAs straight from
and to the caller's pages, on a DMA stream per direction of the stage's own (ordered like a
slot's stream), each registered piece's DMA as soon as it is locked; a piece that could not be
registered goes through the ring. The pins only uploads read are given back once the caller
says the uploads are done (uploads_done(): on the copy threads, after the upload DMAs, while the
kernels run), the rest when the stage finishes, after its DMA streams have been synchronised.

Layout legend: a host array has any strides and may be broadcast (stride 0); its compact base
(broadcast dims cut to 1) is what travels, C-contiguous in device memory.
"""
import collections
import concurrent.futures
import functools
import math
import mmap
import os
import queue
import threading

import numpy as np

from .. import _C, _env
from . import pinning, process
from .arrays import empty, is_contiguous
from .devview import DevView

# H100 host (bench/lab_staging.py, B8 S2k D128 bf16): 16 MiB x 4 with 12 threads and 2 batch
# slices measured 4.1x the pinned-copy floor; 8 MiB x 4 with 8 threads 4.8x
CHUNK_BYTES = 16 << 20     # one ring slot, one DMA
RING_SLOTS = 4             # per direction: 2 x 4 x 16 MiB of pinned memory at most
SHARE_BYTES = 1 << 20      # the least one copy thread is handed
SMALL_BYTES = 64 << 10     # up to this, straight from / to pageable memory
COPY_THREADS = min(12, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ---------------------------------------------------------------- planning (pure, no CUDA)
def split(n, parts):
    """n as `parts` nearly equal positive sizes (the larger first)."""
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)


def chunk_sizes(n, chunk):
    """n elements in ceil(n / chunk) chunks of nearly equal size (none above chunk)."""
    return split(n, -(-n // chunk)) if n > 0 else []


def shares(n, itemsize, threads, share_bytes):
    """n elements of one chunk as the runs the copy threads take: at most `threads`, each of at
    least share_bytes (one run when the chunk is smaller)."""
    return split(n, max(1, min(threads, n * itemsize // share_bytes)))


def blocks(shape, e0, e1):
    """Index tuples into an array of this shape whose elements, each block in C order, are its
    C-order elements [e0, e1): at most 2 * ndim - 1 blocks, each ints then one slice."""
    if e0 >= e1:
        return []
    if len(shape) == 1:
        return [(slice(e0, e1),)]
    inner = math.prod(shape[1:])
    i0, r0 = divmod(e0, inner)
    i1, r1 = divmod(e1, inner)
    if i0 == i1:
        return [(i0,) + b for b in blocks(shape[1:], r0, r1)]
    out = []
    if r0:
        out += [(i0,) + b for b in blocks(shape[1:], r0, inner)]
        i0 += 1
    if i1 > i0:
        out.append((slice(i0, i1),))
    if r1:
        out += [(i1,) + b for b in blocks(shape[1:], 0, r1)]
    return out


def collapse(a):
    """A view of a with the same elements in the same C order and the fewest dims: size-1 dims
    dropped, neighbours merged where one stride steps over the other's whole extent."""
    shape, strides = [], []
    for n, s in zip(a.shape, a.strides):
        if n == 1:
            continue
        if shape and s and strides[-1] == n * s:
            shape[-1] *= n
            strides[-1] = s
        else:
            shape.append(n)
            strides.append(s)
    if not shape:
        shape, strides = [1], [a.itemsize]
    return np.lib.stride_tricks.as_strided(a, shape, strides)


def compact(a):
    """a's broadcast dims (stride 0, size > 1) cut to size 1: the elements that differ."""
    return a[tuple(slice(0, 1) if s == 0 and n > 1 else slice(None)
                   for s, n in zip(a.strides, a.shape)) + (Ellipsis,)]


def _bits(a):
    """a as unsigned ints of its itemsize: copies that never convert (and run without the GIL,
    bfloat16 included)."""
    t = _BITS.get(a.dtype.itemsize)
    return a if t is None or a.dtype.hasobject else a.view(t)


def _private(nbytes):
    """nbytes of pageable host memory in pages of its own (an anonymous mapping). A small copy's
    host side goes through one: a pageable copy whose range starts inside memory another call
    has page-locked (pinning.py registers the caller's arrays widened to whole pages, which may
    take in the start of a neighbouring small array) and runs past it fails with
    CUDA_ERROR_INVALID_VALUE (seen with concurrent calls), and nobody registers these pages."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)[:nbytes]


def _pack(dst, src, e0, e1):
    """src's C-order elements [e0, e1) into dst (1-D, exactly that many elements)."""
    pos = 0
    for idx in blocks(src.shape, e0, e1):
        part = src[idx]
        np.copyto(dst[pos:pos + part.size].reshape(part.shape), part)
        pos += part.size


def _unpack(src, dst, e0, e1):
    """src (1-D) into dst's C-order elements [e0, e1), converting to dst's dtype."""
    pos = 0
    for idx in blocks(dst.shape, e0, e1):
        part = dst[idx]
        np.copyto(part, src[pos:pos + part.size].reshape(part.shape), casting="unsafe")
        pos += part.size


# ---------------------------------------------------------------- the rings
class _Slot:
    """One pinned chunk, its DMA stream per device, and the DMA it may still be part of."""

    def __init__(self):
        self.buf = None          # PinnedBuffer, allocated on first use
        self.raw = None          # the same memory as a uint8 NumPy array
        self.streams = {}        # device -> stream
        self.busy = None         # (stream, device) of a DMA the host has not seen finish

    def settle(self):
        """Returns once the slot's last DMA is done."""
        if self.busy is not None:
            _C.stream_synchronize(*self.busy)
            self.busy = None

    def ready(self, device, nbytes, limit):
        """This slot once its last DMA is done, with room for nbytes: allocated on first use,
        grown when too small, in powers of two from 1 MiB up to `limit` (a first call that moves
        a few small arrays does not pin a whole chunk: 16 MiB cost 6 ms on the H100 host)."""
        self.settle()
        if self.buf is None or len(self.buf) < nbytes:
            size = min(limit, max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length()))
            self.raw = self.buf = None
            self.buf = _C.host_alloc(size, device)
            self.raw = np.frombuffer(self.buf, np.uint8)
        return self

    def stream(self, device):
        if device not in self.streams:
            self.streams[device] = _C.stream_create(device, True)
        return self.streams[device]


class _Ring:
    """One direction's slots, taken in turn by one copy at a time (the lock)."""

    def __init__(self, slots, chunk_bytes):
        self.lock = threading.Lock()
        # a copy fills one slot while the one before it is sent: two at least
        self.slots = [_Slot() for _ in range(max(2, slots))]
        self.chunk_bytes = chunk_bytes
        self.turn = 0

    def take(self, device, nbytes):
        """The next slot, with room for nbytes (at most chunk_bytes)."""
        slot = self.slots[self.turn]
        self.turn = (self.turn + 1) % len(self.slots)
        return slot.ready(device, nbytes, self.chunk_bytes)

    def release(self, timeout):
        """Waits for the DMAs in flight and frees the pinned memory and the streams."""
        if not self.lock.acquire(timeout=timeout):
            return      # a copy still runs (a daemon thread at exit): the process frees it all
        try:
            for slot in self.slots:
                try:
                    slot.settle()
                    for device, stream in slot.streams.items():
                        _C.stream_destroy(stream, device)
                except RuntimeError:
                    pass    # a faulted context: the driver frees everything with the process
                slot.raw = slot.buf = None
                slot.streams = {}
        finally:
            self.lock.release()


_state_lock = threading.Lock()
_up = _down = _pool = None
_threads = 1


def _rings():
    global _up, _down
    with _state_lock:
        if _up is None:
            _up, _down = _Ring(RING_SLOTS, CHUNK_BYTES), _Ring(RING_SLOTS, CHUNK_BYTES)
        return _up, _down


def _workers():
    global _pool, _threads
    with _state_lock:
        if _pool is None:
            _threads = max(1, COPY_THREADS)
            _pool = concurrent.futures.ThreadPoolExecutor(_threads, "attnext-copy")
        return _pool, _threads


def reset(timeout=10.0):
    """Frees the rings (after their DMAs) and stops the copy threads; the next copy builds them
    again from the module's constants (the tests and the lab change those; also run at exit)."""
    global _up, _down, _pool
    with _state_lock:
        rings, pool = (_up, _down), _pool
        _up = _down = _pool = None
    for ring in rings:
        if ring is not None:
            ring.release(timeout)
    if pool is not None:
        pool.shutdown(wait=True)


def _forget_after_fork():
    """A forked child cannot use its parent's CUDA state or threads: start again from nothing."""
    global _state_lock, _up, _down, _pool
    _state_lock = threading.Lock()
    _up = _down = _pool = None
    pinning.forget_after_fork()
    if hasattr(_C, "host_pool_forget"):
        _C.host_pool_forget()


process.at_exit(reset)
# kept registrations go before a fork: on kernels before 5.9 a forked child made the parent's
# pinned pages copy-on-write, and the parent's next write would miss the DMA's pages
process.at_fork(before=pinning.forget_kept, after_in_child=_forget_after_fork)


def _spread(pool, copy, flat, array, e0, size, whole, item, threads):
    """copy(flat's part, array, its first element, its end) for a chunk of size elements from
    array's element e0, flat the chunk's slot, in runs of SHARE_BYTES or more on the pool; the
    futures. One chunk of one run (whole: the array in one chunk) is copied here, with no thread
    to hand it to."""
    runs = shares(size, item, threads, SHARE_BYTES)
    if len(runs) == 1 and whole:
        copy(flat, array, e0, e0 + size)
        return []
    futures, s0 = [], 0
    for run in runs:
        futures.append(pool.submit(copy, flat[s0:s0 + run], array, e0 + s0, e0 + s0 + run))
        s0 += run
    return futures


def _wait(futures):
    for f in futures:
        f.result()


def _settle(futures):
    """Waits for every copy still running (on an error path: none may touch a slot after)."""
    for f in futures:
        f.exception()


def _order(stream, after, call_stream, device):
    """Work enqueued on stream from now on comes after `after` (a Fence) or the call's stream."""
    if after is not None:
        after.order(stream)
    else:
        _C.stream_wait(stream, call_stream, device)


def _upload(a, ptr, device, stream, after):
    """The NumPy array a (any strides, no broadcast) into C-contiguous device memory at ptr."""
    n, item = a.size, a.dtype.itemsize
    if n == 0:
        return
    if n * item <= SMALL_BYTES:
        src = _bits(a)
        raw = _private(n * item)
        np.copyto(raw.view(src.dtype).reshape(a.shape), src)
        _C.memcpy_htod(ptr, raw, stream, device)      # from pageable memory: taken on return
        return
    src = collapse(_bits(a))
    ring = _rings()[0]
    pool, threads = _workers()
    with ring.lock:
        started, ordered = [], set()       # futures; slot streams ordered after `after`
        filling = None                     # (slot, e0, size, futures): copied, not yet sent

        def send(slot, e0, size, futures):
            _wait(futures)
            s = slot.stream(device)
            if s not in ordered:
                _order(s, after, stream, device)
                ordered.add(s)
            _C.memcpy_htod(ptr + e0 * item, slot.raw[:size * item], s, device)
            slot.busy = (s, device)

        try:
            e0 = 0
            for size in chunk_sizes(n, max(1, ring.chunk_bytes // item)):
                slot = ring.take(device, size * item)
                dst = slot.raw[:size * item].view(src.dtype)
                futures = _spread(pool, _pack, dst, src, e0, size, size == n, item, threads)
                started += futures
                if filling is not None:
                    send(*filling)
                filling = (slot, e0, size, futures)
                e0 += size
            send(*filling)
        finally:
            _settle(started)
            for s in ordered:              # the call's kernels read what these streams wrote
                _C.stream_wait(stream, s, device)


def _download(ptr, dtype, dst, device, stream, after):
    """C-contiguous device memory at ptr (dtype, dst's shape) into the NumPy array dst (any
    strides; converted when dst's dtype differs)."""
    n, item = dst.size, dtype.itemsize
    if n == 0:
        return
    same = dst.dtype == dtype
    out = collapse(_bits(dst) if same else dst)
    src_dtype = out.dtype if same else dtype
    if n * item <= SMALL_BYTES and after is None:
        raw = _private(n * item)
        _C.memcpy_dtoh(raw, ptr, stream, device)      # into pageable memory: done on return
        _unpack(raw.view(src_dtype), out, 0, n)
        return
    ring = _rings()[1]
    pool, threads = _workers()
    with ring.lock:
        sizes = chunk_sizes(n, max(1, ring.chunk_bytes // item))
        starts = np.cumsum([0] + sizes[:-1]).tolist()
        started, taken, ordered = [], [], set()
        inflight = collections.deque()     # (slot, e0, size) with a DMA enqueued
        fetched = 0

        def fetch():
            nonlocal fetched
            e0, size = starts[fetched], sizes[fetched]
            slot = ring.take(device, size * item)
            taken.append(slot)
            s = slot.stream(device)
            if s not in ordered:
                _order(s, after, stream, device)
                ordered.add(s)
            _C.memcpy_dtoh(slot.raw[:size * item], ptr + e0 * item, s, device)
            slot.busy = (s, device)
            inflight.append((slot, e0, size))
            fetched += 1

        try:
            while fetched < min(len(ring.slots), len(sizes)):
                fetch()
            previous = None
            while inflight:
                slot, e0, size = inflight.popleft()
                slot.settle()              # its DMA is done
                src = slot.raw[:size * item].view(src_dtype)
                futures = _spread(pool, _unpack, src, out, e0, size, size == n, item, threads)
                started += futures
                if previous is not None:
                    _wait(previous)        # the slot before this one is free again
                    if fetched < len(sizes):
                        fetch()
                previous = futures
            _wait(previous or [])
        finally:
            _settle(started)
            for slot in taken:
                slot.settle()


# ---------------------------------------------------------------- results in pinned memory
RESULT_MIN_BYTES = 1 << 20       # a smaller result is a plain np.empty
# pooled results alive at once at most (the caller's to keep; the pool keeps up to 1 GiB of
# free blocks: csrc/cuda/pinned.c, _C.host_pool)
RESULTS_MAX_BYTES = _env.nbytes("ATTNEXT_PINNED_RESULTS_BYTES",
                                 min(8 << 30, pinning.physical_bytes() // 8))


def host_result(shape, dtype, device=0):
    """An uninitialised NumPy array for a GPU call's result. Of RESULT_MIN_BYTES or more, in a
    pooled PinnedBuffer (its block goes back to the pool when the array and every view of it
    are gone): the result's DMA lands in it with no host copy and no first touch of fresh
    pages, which cost more than the DMA itself (a fresh 64 MiB array: 22-39 ms to fault in on
    the H100 host, bench/lab_pinned.py). A plain np.empty when smaller, when the pooled results
    alive would pass RESULTS_MAX_BYTES, or when pinned memory cannot be had."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < RESULT_MIN_BYTES or dtype.hasobject:
        return np.empty(shape, dtype)
    if _C.host_pool()[2] + nbytes > RESULTS_MAX_BYTES:
        return np.empty(shape, dtype)
    try:
        buf = _C.host_alloc(nbytes, device, True)
    except (RuntimeError, MemoryError):
        return np.empty(shape, dtype)
    return np.frombuffer(buf, dtype, count).reshape(shape)


# ---------------------------------------------------------------- one call's traffic
class Fence:
    """A point in a stream's order (now) that copies enqueued later on other streams, or from
    another thread, can wait for."""

    def __init__(self, stream, device):
        self.device = device
        self.event = _C.event_create(device)
        try:
            _C.event_record(self.event, stream, device)
        except BaseException:
            self.close()
            raise

    def order(self, stream):
        """Work enqueued on stream from now on comes after the fence."""
        _C.stream_wait_event(stream, self.event, self.device)

    def close(self):
        if self.event is not None:
            event, self.event = self.event, None
            _C.event_destroy(event, self.device)   # pending waits still complete


class Staging:
    """One call's host<->device traffic for NumPy arrays: uploads into device buffers it keeps
    alive, scratch buffers, downloads after the kernels.

        with Staging(device, stream) as stage:
            q = stage.upload(q_host)          # a DevView; broadcast views travel compact
            out = stage.scratch(shape, dtype)
            ... launches on `stream` ...
            stage.download(out, out_host)     # any strides; done on return

    background=True: download() only queues its copy (after the kernels enqueued so far) for a
    thread of the stage's own, so the caller goes on with further uploads and launches; the
    copies are done, or their first error raised, when the outermost `with` ends. Nested
    `with` blocks on one stage are allowed (only the outermost one finishes).

    pin(inputs, outputs) first: the copies from and to those arrays' memory run without the
    rings where it can be registered (pinning.py); uploads_done() after the last upload lets
    the inputs' registrations go early, the rest go when the stage finishes.
    """

    def __init__(self, device, stream, background=False):
        self.device, self.stream = device, stream
        self.keep = []
        self.fences = []
        self.background = background
        self._depth = 0
        self._queue = self._thread = None
        self._errors = []
        self._pins = None
        self._dma = {}           # "up" / "down" -> the stream of this stage's direct DMAs
        self._early = []         # futures: input pins given back while the kernels run

    def __enter__(self):
        self._depth += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        self._depth -= 1
        if self._depth == 0:
            self.finish(raise_errors=exc_type is None)
        return False

    def finish(self, raise_errors=True):
        """Waits for the queued downloads, closes the fences, waits for the direct DMAs and gives
        back the pins; raises the first error (unless the caller is already raising one of its
        own)."""
        try:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._queue = self._thread = None
        finally:
            fences, self.fences = self.fences, []
            for f in fences:
                f.close()
            self._unpin()
        if self._errors and raise_errors:
            raise self._errors[0]

    def pin(self, inputs=(), outputs=()):
        """Starts registering the call's large C-contiguous NumPy arrays (inputs only read, by
        their compact bases; outputs written) on the copy threads, unless ATTNEXT_STAGING=ring.
        None entries and GPU arrays are ignored; call it once, before the copies."""
        if self._pins is not None or pinning.mode() != "register":
            return
        pins = pinning.Pins(self.device, [compact(a) for a in inputs if isinstance(a, np.ndarray)],
                            [a for a in outputs if isinstance(a, np.ndarray)])
        if pins.plan or pins.resident:
            self._pins = pins
            pins.start(_workers()[0])

    def uploads_done(self):
        """The call uploads nothing more: the pins only uploads read are given back on the copy
        threads once the upload DMAs are done, beside the kernels and the downloads (unpinning
        is not free), not at the call's end."""
        if self._pins is None or self._early:
            return
        up = self._dma.get("up")
        pool = _workers()[0]

        def give_back(entry):
            try:
                if up is not None:
                    _C.stream_synchronize(up, self.device)    # GPU work only: no pool task awaited
            finally:                                  # a faulted stream runs no DMA any more
                pinning.release_entries([entry])
        self._early = [pool.submit(give_back, e) for e in self._pins.take_read()]

    def _unpin(self):
        """After every direct DMA: synchronises and destroys the DMA streams, gives back the pins.
        Errors go to self._errors (the first one raised by finish)."""
        early, self._early = self._early, []
        dma, self._dma = self._dma, {}
        pins, self._pins = self._pins, None
        steps = [f.result for f in early]       # before the upload stream goes
        steps += [functools.partial(_C.stream_synchronize, s, self.device) for s in dma.values()]
        steps += [functools.partial(_C.stream_destroy, s, self.device) for s in dma.values()]
        if pins is not None:
            steps.append(functools.partial(pins.release, _workers()[0]))
        for step in steps:        # each one tried: a faulted stream still lets the pins go
            try:
                step()
            except BaseException as e:
                self._errors.append(e)

    def _dma_stream(self, direction):
        if direction not in self._dma:
            self._dma[direction] = _C.stream_create(self.device, True)
        return self._dma[direction]

    def _parts(self, a):
        """[(offset, nbytes, piece)] of a's bytes inside the pins, or None: the ring."""
        if self._pins is None:
            return None
        return self._pins.parts(a)

    def _upload_direct(self, raw, parts, ptr, after):
        """raw (an array's bytes) into ptr, each part straight from its registered piece on the
        stage's upload stream, or through the ring where the piece is not registered."""
        s = self._dma_stream("up")
        _order(s, after, self.stream, self.device)
        try:
            for off, n, piece in parts:
                if piece.direct():
                    _C.memcpy_htod(ptr + off, raw[off:off + n], s, self.device)
                else:
                    _upload(raw[off:off + n], ptr + off, self.device, self.stream, after)
        finally:
            _C.stream_wait(self.stream, s, self.device)    # the kernels read what it wrote

    def _download_direct(self, ptr, raw, parts, after):
        """Device bytes at ptr into raw (an array's bytes), each part straight into its
        registered piece, or through the ring. Done on return in a foreground stage; in a
        background one the direct DMAs are only enqueued (finish() -> _unpin synchronises the
        stream before the pins go), so the download thread moves on to its next job at once."""
        s = self._dma_stream("down")
        _order(s, after, self.stream, self.device)
        try:
            for off, n, piece in parts:
                if piece.direct():
                    _C.memcpy_dtoh(raw[off:off + n], ptr + off, s, self.device)
                else:
                    _download(ptr + off, raw.dtype, raw[off:off + n], self.device, self.stream, after)
        finally:
            if not self.background:
                _C.stream_synchronize(s, self.device)

    def _copy_out(self, view, dst, after):
        """A contiguous DevView into dst: direct when dst is C-contiguous in the pins with the
        view's dtype, else through the ring."""
        parts = self._parts(dst) if dst.dtype == view.dtype else None
        if parts is None:
            _download(view.ptr, view.dtype, dst, self.device, self.stream, after)
        else:
            self._download_direct(view.ptr, dst.reshape(-1).view(np.uint8), parts, after)

    def fence(self):
        """A Fence at the call's stream as it is now (closed when the stage finishes)."""
        f = Fence(self.stream, self.device)
        self.fences.append(f)
        return f

    def allocate(self, a):
        """Uninitialised device memory for a's compact base, viewed with a's shape (stride 0
        where a is broadcast)."""
        a = np.asarray(a)
        base = compact(a)
        buf = empty(base.shape, base.dtype, self.device, self.stream)
        self.keep.append(buf)
        view = DevView.contiguous(buf.ptr, base.shape, base.dtype, self.device, self.stream, buf)
        return view.broadcast_to(a.shape)

    def copy_in(self, a, view, after=None):
        """a's compact base into view, which allocate() made (or a slice of it along its first
        dim, the same slice of a). after: a Fence the copy waits for (default: the call's
        stream as it is now); the call's stream waits for the copy."""
        base = compact(np.asarray(a))
        want = tuple(1 if s == 0 and n > 1 else n for n, s in zip(view.shape, view.strides))
        if base.shape != want or base.dtype != view.dtype:
            raise ValueError(f"copy_in: {base.shape} {base.dtype} into a view of compact shape "
                             f"{want} {view.dtype}")
        parts = self._parts(base)
        if parts is None:
            _upload(base, view.ptr, self.device, self.stream, after)
        else:
            self._upload_direct(base.reshape(-1).view(np.uint8), parts, view.ptr, after)

    def upload(self, a):
        """A DevView of a NumPy array, copied to the device (a broadcast view uploads only its
        compact base)."""
        view = self.allocate(a)
        self.copy_in(a, view)
        return view

    def scratch(self, shape, dtype):
        buf = empty(shape, dtype, self.device, self.stream)
        self.keep.append(buf)
        return DevView.contiguous(buf.ptr, shape, dtype, self.device, self.stream, buf)

    def download(self, view, dst):
        """Copies a contiguous DevView into the NumPy array dst (same shape, any strides,
        converted to dst's dtype)."""
        if tuple(dst.shape) != tuple(view.shape):
            raise ValueError(f"download: {view.shape} into an array of shape {dst.shape}")
        if view.size and not is_contiguous(view.shape, view.strides):
            raise ValueError(f"download: a view of strides {view.strides} is not C-contiguous")
        if not self.background:
            self._copy_out(view, dst, None)
            return
        after = self.fence()
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._downloads, args=(self._queue,),
                                            name="attnext-download", daemon=True)
            self._thread.start()
        self._queue.put((view, dst, after))

    def _downloads(self, jobs):
        while (job := jobs.get()) is not None:
            view, dst, after = job
            if not self._errors:
                try:
                    self._copy_out(view, dst, after)
                except BaseException as e:     # raised by finish() in the caller's thread
                    self._errors.append(e)


def to_host(view):
    """A NumPy copy of a DevView (the small arrays the checks read: lengths, slopes), taken in
    the order of the view's stream."""
    if view.size == 0:
        return np.empty(view.shape, view.dtype)
    lo, hi = view.byte_span()
    raw = np.empty(hi - lo, np.uint8)
    _C.memcpy_dtoh(raw, lo, view.stream, view.device)     # into pageable memory: done on return
    return np.ndarray(view.shape, view.dtype, buffer=raw, offset=view.ptr - lo,
                      strides=tuple(st * view.itemsize for st in view.strides)).copy()
