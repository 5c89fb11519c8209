"""The caller's NumPy memory page-locked in place for one call (cuMemHostRegister), so its DMAs
run straight from and to it, with no host copy through staging.py's pinned rings.

    pins = Pins(device, inputs, outputs)         # plans the pieces
    pins.start(pool)                             # registration runs on the pool's threads
    parts = pins.parts(a)                        # [(offset, nbytes, piece)] or None: the rings
    piece.direct()                               # waits for the piece: True = page-locked
    pins.take_read()                             # the input-only pieces, to give back early
    pins.release()                               # after every DMA using them is done

Spans. An array travels directly when it is C-contiguous (its bytes one run) and at least
MIN_BYTES long. Its span is that run, to the byte: the driver locks the whole pages under it but
tracks the range registered, and two ranges that share a page register side by side. A span is
never widened to pages: CUDA refuses a copy (cudaMemcpy, torch's .cuda(), cupy.asarray) that
starts inside a registered range and ends past it (H200, session 26), so a registration must
never begin inside memory that is not the call's own arrays'. The spans of one call that
overlap merge into one union (q, k, v slices of one buffer; the same array passed twice), since
the driver refuses a range that overlaps one registered already. A union is cut into pieces of
PIECE_BYTES, each one registration, submitted in the order the call uses them: the first
piece's DMA starts while later ones are still being locked, and a fresh output's pages (never
touched: locking them is their first touch) fault in while the inputs upload.

Ownership. A table, process-wide, holds attnext's own registrations and the number of calls
using each: a piece inside one of them is shared (the last user unregisters it), a piece
partly overlapping one goes through the rings. A piece the driver refuses as registered
already while none of ours overlaps it was pinned by the caller (cuMemHostRegister,
cudaHostAlloc, torch's pin_memory): used as it is when its first and last data bytes are
page-locked host memory, and never unregistered. Any other failure (no memory to lock, an
unsupported mapping, a faulted context) sends the piece's bytes through the rings: a failed
registration never fails the call.

Read-only. A piece is registered CU_MEMHOSTREGISTER_READ_ONLY (where the device supports it) when
no output touches it and an array in it is not writeable: a read-only mapping (np.frombuffer of
bytes, a read-only np.memmap) takes no other registration. Every other piece is registered
writable: CUDA refuses a copy into read-only registered memory, and a kept registration must not
stop the caller's own later copies into its arrays (torch's .copy_, cupy's .get(out=)).

Kept registrations. An input array's memory registered by one call stays registered after it
when the call saw that memory's owner (the ndarray that owns the data at the root of the
array's bases) in an earlier call too: a caller who passes the same arrays again (a loop, a
benchmark, a notebook cell run twice) pays for registering them once, not per call, and their
DMAs start at once. The kept registration is the owner's whole data in one piece, however
little of it the call reads: any copy the caller makes later of the owner or a view of it
(torch.from_numpy(q).cuda()) then lies inside one registration, which CUDA needs. The
registration goes when the owner is deallocated (a weakref finalizer: NumPy clears weak
references before it frees the data, and refuses to resize an array that has them, so the data
never moves meanwhile) or when the kept bytes pass KEEP_BYTES (least recently used first).
Memory whose root is a PinnedBuffer (attnext's pinned results) is used as it is, with no driver
call.

ATTNEXT_STAGING=register (the default) pins; =ring keeps every copy on the rings (the kernel
lab compares the two).
"""
import collections
import mmap
import os
import threading
import weakref

import numpy as np

from .. import _C, _env

PAGE = mmap.PAGESIZE
MIN_BYTES = 8 << 20        # a smaller array goes through the rings (to be tuned on the GPU)
PIECE_BYTES = 32 << 20     # one registration: its DMAs start once it is locked
MODES = ("register", "ring")
# H100 host (bench/lab_register.py, session 5): pinning runs at 37-53 GB/s for touched memory and
# 5-7 GB/s for a fresh np.empty, so register + unregister costs about what the ring's copies
# cost. With the results in pinned memory (staging.host_result) the register path measured
# 3.9x the pinned-copy floor against the ring's 4.4x, and 1.4x with the inputs' registrations
# kept (bench/lab_pinned.py, session 16).
DEFAULT_MODE = "register"


def physical_bytes():
    """The machine's memory (16 GiB where it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


# kept registrations at most (page-locked memory the system cannot swap out)
KEEP_BYTES = _env.nbytes("ATTNEXT_PIN_KEEP_BYTES", min(8 << 30, physical_bytes() // 8))
SEEN = 64                  # owners remembered for the "seen in an earlier call" test
PINNED_TYPES = (_C.PinnedBuffer,) if hasattr(_C, "PinnedBuffer") else ()   # attnext's own

OWN, SHARED, FOREIGN, REFUSED = "own", "shared", "foreign", "refused"   # how a piece is held
PENDING, LIVE, FAILED, CLOSING = "pending", "live", "failed", "closing"  # a table entry's state


def mode():
    """ATTNEXT_STAGING, looked up at every call (attnext._env): "register" (the default) or "ring"."""
    m = _env.get("ATTNEXT_STAGING") or DEFAULT_MODE
    if m not in MODES:
        raise ValueError(f"ATTNEXT_STAGING must be one of {MODES}, got {m!r}")
    return m


# ---------------------------------------------------------------- planning (pure, no CUDA)
def byte_range(a):
    """[lo, hi) host addresses of a C-contiguous array's bytes."""
    lo = a.__array_interface__["data"][0]
    return lo, lo + a.nbytes


def unions(spans, page=1):
    """The byte ranges (lo, hi) widened to multiples of `page` (registrations: none), overlapping
    ones merged, in address order."""
    out = []
    for lo, hi in sorted((lo // page * page, -(-hi // page) * page) for lo, hi in spans if hi > lo):
        if out and lo < out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [tuple(u) for u in out]


def cut(lo, hi, piece, page=PAGE):
    """[lo, hi) as consecutive pieces of at most `piece` bytes, cut at the multiples of that size
    (whole pages) in the address space: any range inside a registered union is cut at the same
    places as the union was (a view of an array registered in pieces finds whole pieces)."""
    step = max(page, piece // page * page)
    edges = [lo] + list(range((lo // step + 1) * step, hi, step)) + [hi]
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


def cover(lo, hi, pieces):
    """[lo, hi) along the sorted, disjoint pieces [(plo, phi, x)]: [(offset from lo, nbytes, x)],
    or None when some byte lies outside every piece."""
    out, at = [], lo
    for plo, phi, x in pieces:
        if phi <= at or plo >= hi:
            continue
        if plo > at:
            return None
        end = min(phi, hi)
        out.append((at - lo, end - at, x))
        at = end
        if at == hi:
            return out
    return out if at >= hi else None


# ---------------------------------------------------------------- attnext's registrations
class _Entry:
    """One range attnext registered (or is registering), and the calls using it."""

    __slots__ = ("lo", "hi", "device", "read_only", "users", "state", "done", "orphan")

    def __init__(self, lo, hi, device, read_only):
        self.lo, self.hi, self.device, self.read_only = lo, hi, device, read_only
        self.orphan = False        # its kept owner went; it waits in _orphans for _drain
        self.users = 1
        self.state = PENDING
        self.done = threading.Event()      # set when the state leaves PENDING


_table_lock = threading.Lock()
_table = []          # never two overlapping entries: the driver would refuse the second


def _acquire(lo, hi, device, read_only, probe):
    """Locks [lo, hi) for one call: (entry, OWN) registered now, (entry, SHARED) another call's
    (perhaps still pending: the user waits for entry.done, never a pool thread), (None, FOREIGN)
    the caller's own pinned memory, or (None, REFUSED): its bytes go through the rings.
    probe: the first and last data bytes of the piece, for the caller-pinned check."""
    entry = _Entry(lo, hi, device, read_only)     # made before the lock: see _owner_gone
    try:
        return _acquire_as(entry, probe)
    finally:
        _drain()


def _take_covering(lo, hi, device, read_only):
    """Under _table_lock, takes a use of a table entry that covers [lo, hi) and may serve it:
    (entry, SHARED) with entry.users counted, (None, REFUSED) when an entry overlaps [lo, hi)
    otherwise (or is an orphan: its owner's memory may be another array's by now), else None."""
    for e in _table:
        if e.lo < hi and lo < e.hi:
            if (e.lo <= lo and hi <= e.hi and e.device == device and e.state != CLOSING
                    and not e.orphan and (read_only or not e.read_only)):
                e.users += 1
                return e, SHARED
            return None, REFUSED
    return None


def _acquire_as(entry, probe):
    lo, hi, device, read_only = entry.lo, entry.hi, entry.device, entry.read_only
    with _table_lock:
        found = _take_covering(lo, hi, device, read_only)
        if found is not None:
            return found
        _table.append(entry)
    try:
        ok = _C.host_register(lo, hi - lo, device, read_only)
    except (RuntimeError, MemoryError, ValueError):
        ok = None
    with _table_lock:
        entry.state = LIVE if ok else FAILED
        if not ok:
            _table.remove(entry)
    entry.done.set()
    if ok:
        return entry, OWN
    if ok is False and _pinned(probe, device):
        return None, FOREIGN
    return None, REFUSED


def _share(lo, hi, device, read_only):
    """(entry, SHARED) when a registration in the table (another call's, or kept) covers
    [lo, hi) and may serve it, else None: no driver call, so the caller's thread asks this
    before it hands the piece to a pool thread (the hand-over cost ~0.15 ms before the first
    DMA of a call whose inputs were all kept)."""
    try:
        with _table_lock:
            found = _take_covering(lo, hi, device, read_only)
        return found if found is not None and found[1] == SHARED else None     # a use taken iff SHARED
    finally:
        _drain()


def _pinned(probe, device):
    try:
        return all(_C.host_pinned(p, device) for p in probe)
    except RuntimeError:
        return False


def _release(entry):
    """One user fewer; the last one unregisters (the entry stays in the table, CLOSING, until
    the driver has let go, so no call mistakes the range for the caller's own meanwhile)."""
    try:
        _release_one(entry)
    finally:
        _drain()


def _release_one(entry):
    with _table_lock:
        entry.users -= 1
        if entry.users:
            return
        entry.state = CLOSING
    try:
        _C.host_unregister(entry.lo, entry.device)
    finally:
        with _table_lock:
            _table.remove(entry)


def registered():
    """[(lo, hi)] attnext holds registered now (the tests check that a call leaves none)."""
    with _table_lock:
        return [(e.lo, e.hi) for e in _table]


def forget_after_fork():
    """A forked child holds none of its parent's registrations (its owners' finalizers then
    find nothing to give back)."""
    global _table_lock, _table, _kept_lock, _kept, _kept_ids, _kept_bytes, _seen, _orphans
    _table_lock = threading.Lock()
    _table = []
    _kept_lock = threading.RLock()
    _kept, _kept_ids, _kept_bytes, _seen = collections.OrderedDict(), set(), 0, collections.OrderedDict()
    _orphans = []


_read_only_ok = {}         # device -> whether it takes CU_MEMHOSTREGISTER_READ_ONLY


def read_only_supported(device):
    if device not in _read_only_ok:
        try:
            _read_only_ok[device] = bool(_C.cuda_info(device).get("read_only_host_register"))
        except RuntimeError:
            return False          # no answer: register writable (a read-only mapping then fails)
    return _read_only_ok[device]


# ---------------------------------------------------------------- one call's pins
class Piece:
    """A page-aligned range of one call's memory and its registration (a future on the pool)."""

    __slots__ = ("lo", "hi", "written", "future")

    def __init__(self, lo, hi, written, future):
        self.lo, self.hi, self.written, self.future = lo, hi, written, future

    def direct(self):
        """Waits until the piece is settled: True when page-locked (DMA straight from / to it),
        False when its bytes go through the rings."""
        entry, how = self.future.result()
        if how == SHARED:
            entry.done.wait()
            return entry.state == LIVE
        return how in (OWN, FOREIGN)

    def held(self):
        """(table entry this call must give back, how it holds it) after direct() has settled,
        or None."""
        entry, how = self.future.result()
        return (entry, how) if how == OWN or (how == SHARED and self.direct()) else None


class _Settled:
    """A future already done: pinned memory of attnext's own (a PinnedBuffer: None, FOREIGN),
    or a registration the caller's thread found in the table (_share)."""

    __slots__ = ("value",)

    def __init__(self, value=(None, FOREIGN)):
        self.value = value

    def result(self):
        return self.value


_SETTLED = _Settled()


class Pins:
    """One call's registrations of its large C-contiguous host arrays (inputs read, outputs
    written): planned here, started by start(), given back by release()."""

    def __init__(self, device, inputs, outputs):
        self.device = device
        spans = []               # (lo, hi, written, order of first use, memory read-only)
        resident = []            # byte ranges inside attnext's PinnedBuffers
        self.keep = []           # (lo, hi, owner) of inputs whose registrations stay after
        owners = set()           # id() of the owners noted in this call (q, k, v of one buffer)
        _drain()
        for i, (a, written) in enumerate([(a, False) for a in inputs] + [(a, True) for a in outputs]):
            if a is None or not a.flags.c_contiguous or a.nbytes == 0:
                continue
            owner = root(a)
            if isinstance(owner, PINNED_TYPES):          # attnext's pinned memory, any size
                resident.append(byte_range(a))
                continue
            if a.nbytes < MIN_BYTES:
                continue
            spans.append(byte_range(a) + (written, i, not a.flags.writeable))
            if not written and isinstance(owner, np.ndarray) and id(owner) not in owners:
                owners.add(id(owner))
                if _seen_before(owner):
                    self.keep.append(byte_range(owner) + (owner,))
                    if owner.nbytes <= KEEP_BYTES:    # the owner's whole data, in one piece
                        spans.append(byte_range(owner) + (False, i, not owner.flags.writeable))
        self.resident = [Piece(lo, hi, True, _SETTLED) for lo, hi in unions(resident)]
        read_only = read_only_supported(device) if spans else False
        self.plan = []           # (first use, lo, hi, written, probe, memory read-only)
        for ulo, uhi in unions([s[:2] for s in spans]):
            whole = any(ulo <= lo and hi <= uhi and hi - lo <= KEEP_BYTES for lo, hi, _ in self.keep)
            for lo, hi in [(ulo, uhi)] if whole else cut(ulo, uhi, PIECE_BYTES):
                touching = [s for s in spans if s[0] < hi and lo < s[1]]
                probe = (max(lo, min(s[0] for s in touching)), min(hi, max(s[1] for s in touching)) - 1)
                self.plan.append((min(s[3] for s in touching), lo, hi, any(s[2] for s in touching), probe,
                                  any(s[4] for s in touching)))
        self.plan.sort()         # in the order the call uses them
        self.read_only = read_only
        self.pieces = list(self.resident)      # sorted by address

    def start(self, pool):
        """Submits every piece's registration to pool, but takes those a registration in the
        table covers at once (the pieces taken before an error are still given back by
        release())."""
        for _, lo, hi, written, probe, read_only_memory in self.plan:
            read_only = self.read_only and read_only_memory and not written
            shared = _share(lo, hi, self.device, read_only)
            future = (_Settled(shared) if shared is not None
                      else pool.submit(_acquire, lo, hi, self.device, read_only, probe))
            self.pieces = sorted(self.pieces + [Piece(lo, hi, written, future)], key=lambda p: p.lo)

    def take_read(self):
        """The pieces no output touches, taken out of this call's pins (later copies of their
        bytes go through the rings): the table entries to give back once the uploads from them
        are done (release_entries), waiting for their registrations first."""
        taken = [p for p in self.pieces if not p.written]
        self.pieces = [p for p in self.pieces if p.written]
        return _to_give_back([p.held() for p in taken], self.keep)

    def parts(self, a):
        """a's bytes (C-contiguous) along this call's pieces: [(offset, nbytes, piece)], or None
        when some of them lies outside every piece."""
        if not self.pieces or not a.flags.c_contiguous or a.nbytes == 0:
            return None
        lo, hi = byte_range(a)
        return cover(lo, hi, [(p.lo, p.hi, p) for p in self.pieces])

    def release(self, pool=None):
        """Waits for every registration still running, then gives back what this call holds
        (the unregistering on `pool` when given). Call it only once every DMA from or to the
        pieces is done. Raises the first unregister error, after trying them all."""
        pieces, self.pieces = self.pieces, []
        release_entries(_to_give_back([p.held() for p in pieces], self.keep), pool)


def release_entries(held, pool=None):
    """Gives back table entries (unregistering what no other call uses), on `pool` when given;
    raises the first error after trying them all."""
    if pool is not None and len(held) > 1:
        errors = [f.exception() for f in [pool.submit(_release, e) for e in held]]
    else:
        errors = []
        for e in held:
            try:
                _release(e)
            except RuntimeError as err:
                errors.append(err)
    errors = [e for e in errors if e is not None]
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- kept registrations
def root(a):
    """What holds a's memory: the ndarray at the root of its bases that owns its data, or the
    object a memoryview at that root exports (a PinnedBuffer, an mmap, bytes...)."""
    x = a
    while isinstance(x, np.ndarray) and x.base is not None:
        x = x.base
    return x.obj if isinstance(x, memoryview) else x


class _Kept:
    """One owner's registrations kept after the calls that made them, and the finalizer that
    gives them back when the owner goes."""

    __slots__ = ("entries", "nbytes", "finalizer")

    def __init__(self):
        self.entries, self.nbytes, self.finalizer = [], 0, None


_kept_lock = threading.RLock()     # a finalizer may run inside code that holds it
_kept = collections.OrderedDict()  # id(owner) -> _Kept, least recently used first
_kept_ids = set()                  # id() of the table entries _kept holds
_kept_bytes = 0
_seen = collections.OrderedDict()  # id(owner) -> weakref to it, SEEN at most
_orphans = []                      # entries of owners gone while the table lock was taken


def _seen_before(owner):
    """Whether an earlier call saw this owner; notes this one. (Its data cannot have moved
    since: NumPy refuses to resize an array that has weak references.)"""
    key = id(owner)
    with _kept_lock:
        ref = _seen.pop(key, None)
        seen = ref is not None and ref() is owner
        try:
            _seen[key] = weakref.ref(owner)
        except TypeError:
            return False
        while len(_seen) > SEEN:
            _seen.popitem(last=False)
        if key in _kept:
            _kept.move_to_end(key)
    return seen


def _forget(key):
    """The entries kept for owner id `key`, taken out of the cache (the caller releases them)."""
    global _kept_bytes
    with _kept_lock:
        kept = _kept.pop(key, None)
        if kept is None:
            return []
        _kept_bytes -= kept.nbytes
        for e in kept.entries:
            _kept_ids.discard(id(e))
        if kept.finalizer is not None:
            kept.finalizer.detach()
        return kept.entries


def _owner_gone(key):
    """The owner's finalizer: its registrations go before NumPy frees the data, unless this
    thread is inside a section that holds the table's lock (the garbage collector may run a
    finalizer at any allocation): then as soon as that section ends (_drain). The pages stay
    locked by the driver until then, so the DMA never meets freed memory; a new array at those
    addresses meanwhile is refused the orphaned entries (_take_covering) and goes through the
    rings."""
    gone = _forget(key)
    for entry in gone:
        entry.orphan = True            # a plain store: no lock needed
    _orphans.extend(gone)
    _drain()


def _drain():
    """Gives back the entries of owners that went while the table's lock was taken; a no-op
    while some thread holds it (that one drains when it is done)."""
    while _orphans:
        if not _table_lock.acquire(blocking=False):
            return
        _table_lock.release()
        try:
            entry = _orphans.pop()
        except IndexError:
            return
        try:
            _release_one(entry)
        except RuntimeError:
            pass        # a faulted or torn-down context: nothing left to give back


def _to_give_back(held, keep):
    """Of one call's (entry, how) pairs: the entries to release now. An entry the call
    registered inside the memory of an owner in `keep` is handed to the kept registrations
    instead (the call's use becomes theirs)."""
    global _kept_bytes
    out, evicted = [], []
    with _kept_lock:
        for pair in held:
            if pair is None:
                continue
            entry, how = pair
            span = next(((lo, hi, o) for lo, hi, o in keep if lo <= entry.lo and entry.hi <= hi), None)
            if how != OWN or span is None or id(entry) in _kept_ids or span[1] - span[0] > KEEP_BYTES:
                out.append(entry)
                continue
            owner = span[2]
            key = id(owner)
            kept = _kept.get(key)
            if kept is None:
                kept = _kept[key] = _Kept()
                kept.finalizer = weakref.finalize(owner, _owner_gone, key)
                kept.finalizer.atexit = False
            kept.entries.append(entry)
            kept.nbytes += entry.hi - entry.lo
            _kept_bytes += entry.hi - entry.lo
            _kept_ids.add(id(entry))
            _kept.move_to_end(key)
        current = {id(o) for _, _, o in keep}
        for key in [k for k in _kept if k not in current]:      # least recently used first
            if _kept_bytes <= KEEP_BYTES:
                break
            evicted += _forget(key)
        while _kept_bytes > KEEP_BYTES and _kept:               # this call's own owners last
            evicted += _forget(next(iter(_kept)))
    return out + evicted


def forget_kept():
    """Gives back every kept registration (the tests; a caller that wants its pages unlocked)."""
    with _kept_lock:
        keys = list(_kept)
        _seen.clear()
    entries = []
    for key in keys:
        entries += _forget(key)
    release_entries(entries)


def kept_bytes():
    with _kept_lock:
        return _kept_bytes
