"""What a GPU call with score_mod / mask_mod keeps on the device for the calls after it: the
device copies of the functions' captured NumPy arrays, found again by content, and mask_mod's
block masks, found again by everything they are made from.

Captured arrays. A NumPy array a function captures is read afresh at every call (the user may
change it in place between calls), but uploading it every time costs a copy through pageable
memory. `ArrayCopies` keeps, per (device, dtype, shape), the last few arrays uploaded with a
private host copy of each: a call's array is compared with those copies bit for bit
(np.array_equal on the raw bits: a changed element, even a NaN's payload, is a new entry) and
only uploaded when none matches. Each entry has a serial number, never reused, that names its
contents in the block masks' keys; it also keeps the integer array's (min, max) for
attnext.bounds.

Block masks. A mask_mod's block mask (kernels/attn_block_mask.cu) depends on the generated
code, the float constants, the captured arrays' contents, the lengths and the layout of cells;
when all of these are known on the host (the captured arrays are NumPy arrays, hence entries of
ArrayCopies) the mask built by one call serves the next ones with the same key (the backward
after its forward, the next training step). A mask_mod reading a CUDA array is rebuilt every
call: its contents cannot be compared without reading them.

Both live in device memory from attnext.cuda.arrays.empty, allocated on the stream of the call that
made them; a call on another stream waits for that stream first (DeviceArray._order_before), and
an entry pushed out is freed after the streams that read it. A call on the per-thread default
stream, which names another stream in every thread, is left out of both: it finds and keeps
nothing. Both caches are bounded LRUs (entries and bytes); `clear()` empties them, `info()`
counts.

Not handled: an entry outlives the user's stream it was made on (it is freed there later), so a
stream destroyed while its entries are kept is waited on after it is gone.
"""
import collections
import itertools
import threading

import numpy as np

from .. import _C
from ..mods import bounds
from . import arrays as device

ARRAY_ENTRIES = 64               # device copies kept, and their bytes
ARRAY_BYTES = 256 << 20
MASK_ENTRIES = 32                # block masks kept, and their bytes
MASK_BYTES = 256 << 20
PER_SHAPE = 4                    # arrays of one (device, dtype, shape) compared at most

_serial = itertools.count(1)


def _bits(a):
    """a's raw bits as an unsigned integer array (a view): equal bits, equal contents."""
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


class _Lru:
    """An LRU of entries with a size in bytes, bounded in entries and bytes."""

    def __init__(self, entries, nbytes):
        self.max_entries, self.max_bytes = entries, nbytes
        self.items = collections.OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def get(self, key):
        e = self.items.get(key)
        if e is not None:
            self.items.move_to_end(key)
        return e

    def put(self, key, value, nbytes):
        old = self.items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self.items[key] = (value, nbytes)
        self.nbytes += nbytes
        while self.items and (len(self.items) > self.max_entries or self.nbytes > self.max_bytes):
            _, (_, n) = self.items.popitem(last=False)
            self.nbytes -= n

    def clear(self):
        self.items.clear()
        self.nbytes = 0


class ArrayEntry:
    """A captured array's device copy: serial (names its contents), dev (the DeviceArray, in the
    kernels' storage type), host (the private copy it was made from), values ((min, max) of an
    integer array, else None)."""
    __slots__ = ("serial", "dev", "host", "values")

    def __init__(self, dev, host, values):
        self.serial, self.dev, self.host, self.values = next(_serial), dev, host, values


_lock = threading.Lock()
_arrays = _Lru(ARRAY_ENTRIES, ARRAY_BYTES)     # (device, dtype, shape) -> [ArrayEntry], newest last
_masks = _Lru(MASK_ENTRIES, MASK_BYTES)        # key -> DeviceArray


def array_copy(src, stored, dev, stream):
    """The ArrayEntry holding src's contents on device dev, usable on `stream`: found by content,
    else made by uploading stored(src) (the kernels' storage type, C-contiguous) on `stream`.
    A call on the per-thread default stream (device.PER_THREAD_STREAM: another stream in every
    thread, so no other call could be ordered after it, nor a later free after its kernels)
    neither finds nor keeps one: its copy is its own, freed with the call."""
    key = (dev, src.dtype.str, src.shape)
    shared = stream != device.PER_THREAD_STREAM
    with _lock:
        found = _arrays.get(key) if shared else None
        for e in reversed(found[0] if found else ()):
            if np.array_equal(_bits(e.host), _bits(src)):
                _arrays.hits += 1
                e.dev._order_before(stream)
                return e
        _arrays.misses += 1
    host = np.array(src, copy=True, order="C")
    a = stored(host)
    d = device.empty(a.shape, a.dtype, dev, stream)
    if a.size:      # from pageable memory: the driver has taken the bytes when this returns
        _C.memcpy_htod(d.ptr, a.reshape(-1).view(np.uint8), stream, dev)
    e = ArrayEntry(d, host, bounds.value_range(host))
    if not shared:
        return e
    with _lock:
        found = _arrays.get(key)
        group = [x for x in (found[0] if found else ()) if x is not e][-(PER_SHAPE - 1):] + [e]
        _arrays.put(key, group, sum(x.host.nbytes + x.dev.nbytes for x in group))
    return e


def block_mask(key, stream):
    """The block mask kept under key, usable on `stream`, or None."""
    with _lock:
        found = _masks.get(key)
        if found is None:
            _masks.misses += 1
            return None
        _masks.hits += 1
    found[0]._order_before(stream)
    return found[0]


def keep_block_mask(key, mask):
    """Keeps mask (a DeviceArray the call filled on its stream) for later calls with key."""
    with _lock:
        _masks.put(key, mask, mask.nbytes)


def clear():
    """Forgets every kept array copy and block mask (their memory is freed in stream order)."""
    with _lock:
        _arrays.clear()
        _masks.clear()


def info():
    """{"arrays": {...}, "block_masks": {...}}: entries, bytes, hits and misses of each cache."""
    with _lock:
        return {name: {"entries": sum(len(v[0]) for v in c.items.values()) if name == "arrays"
                       else len(c.items), "bytes": c.nbytes, "hits": c.hits, "misses": c.misses}
                for name, c in (("arrays", _arrays), ("block_masks", _masks))}
