"""attnext.cuda.pinning and staging's direct path: the caller's memory registered in place
(cuMemHostRegister), DMAs straight from and to it.

Without a GPU: the span arithmetic, and whole copies and NumPy forwards over test_staging's fake
of attnext._C (late DMAs, which assert that the memory they read or write is still page-locked
when they run), its host_register refusing overlapping ranges as the driver does. With
`-m gpu`: ring and register give the same bits on a real device.
"""

import numpy as np
import pytest

import attnext
from attnext import _C, _env
from attnext.cuda import backend as cuda_backend, pinning, staging
from attnext.cuda.devview import DevView
from conftest import BF16, assert_close, in_threads
from test_staging import _bits, _random, check_real, fake, fake_kernel, real_kernel  # noqa: F401  (fixtures)

PAGE = pinning.PAGE
JOIN_SECONDS = 120


# ---------------------------------------------------------------- the arithmetic
def test_unions_merge_overlaps_to_the_byte():
    """Registrations are the arrays' own bytes: CUDA refuses a copy that starts inside a
    registered range and ends past it, so widening to pages would break a neighbour's copies."""
    assert pinning.unions([(PAGE + 8, 3 * PAGE - 8)]) == [(PAGE + 8, 3 * PAGE - 8)]
    # a page shared by two arrays: two unions side by side; overlapping ranges merge
    assert pinning.unions([(0, PAGE + 8), (PAGE + 8, 2 * PAGE)]) == [(0, PAGE + 8), (PAGE + 8, 2 * PAGE)]
    assert pinning.unions([(0, PAGE + 8), (PAGE, 2 * PAGE)]) == [(0, 2 * PAGE)]
    assert pinning.unions([(2 * PAGE, 3 * PAGE), (0, 2 * PAGE)]) == [(0, 2 * PAGE), (2 * PAGE, 3 * PAGE)]
    # the same range twice, one inside another, and an empty one; widened when asked
    assert pinning.unions([(0, 100), (0, 100), (10, 20), (5 * PAGE, 5 * PAGE)]) == [(0, 100)]
    assert pinning.unions([(10, 100)], page=PAGE) == [(0, PAGE)]


def test_byte_counts_from_the_environment(monkeypatch):
    monkeypatch.delenv("ATTNEXT_PIN_KEEP_BYTES", raising=False)
    assert _env.nbytes("ATTNEXT_PIN_KEEP_BYTES", 7) == 7
    for text, want in (("", 7), (" 0 ", 0), ("4096", 4096)):
        monkeypatch.setenv("ATTNEXT_PIN_KEEP_BYTES", text)
        assert _env.nbytes("ATTNEXT_PIN_KEEP_BYTES", 7) == want
    for text in ("abc", "-1", "1.5"):
        monkeypatch.setenv("ATTNEXT_PIN_KEEP_BYTES", text)
        with pytest.raises(ValueError, match=f"ATTNEXT_PIN_KEEP_BYTES .*{text!r}"):
            _env.nbytes("ATTNEXT_PIN_KEEP_BYTES", 7)


def test_cut_in_whole_pages():
    assert pinning.cut(0, 5 * PAGE, 2 * PAGE) == [(0, 2 * PAGE), (2 * PAGE, 4 * PAGE), (4 * PAGE, 5 * PAGE)]
    assert pinning.cut(PAGE, 2 * PAGE, 10) == [(PAGE, 2 * PAGE)]       # never below a page
    assert pinning.cut(0, 3 * PAGE, 3 * PAGE + 5) == [(0, 3 * PAGE)]
    # cut at the multiples of the piece size: a range inside a union is cut where the union was
    assert pinning.cut(PAGE, 6 * PAGE, 2 * PAGE) == [(PAGE, 2 * PAGE), (2 * PAGE, 4 * PAGE),
                                                     (4 * PAGE, 6 * PAGE)]
    assert pinning.cut(3 * PAGE, 5 * PAGE, 2 * PAGE) == [(3 * PAGE, 4 * PAGE), (4 * PAGE, 5 * PAGE)]


def test_cover_splits_at_pieces_and_finds_gaps():
    pieces = [(0, 10, "a"), (10, 20, "b"), (30, 40, "c")]
    assert pinning.cover(5, 15, pieces) == [(0, 5, "a"), (5, 5, "b")]
    assert pinning.cover(10, 20, pieces) == [(0, 10, "b")]
    assert pinning.cover(32, 35, pieces) == [(0, 3, "c")]
    assert pinning.cover(15, 35, pieces) is None                       # 20..30 is not pinned
    assert pinning.cover(35, 45, pieces) is None


def test_mode_reads_the_environment(monkeypatch):
    monkeypatch.delenv("ATTNEXT_STAGING", raising=False)
    assert pinning.mode() == pinning.DEFAULT_MODE
    monkeypatch.setenv("ATTNEXT_STAGING", "ring")
    assert pinning.mode() == "ring"
    monkeypatch.setenv("ATTNEXT_STAGING", "pinned")
    with pytest.raises(ValueError, match="ATTNEXT_STAGING"):
        pinning.mode()


# ---------------------------------------------------------------- over the fake
@pytest.fixture
def pins(fake, monkeypatch):
    """The fake with pinning on (ATTNEXT_STAGING=register) for arrays of a page or more, in pieces
    of two pages; checks that nothing attnext registered outlives the test."""
    monkeypatch.setenv("ATTNEXT_STAGING", "register")
    monkeypatch.setattr(pinning, "MIN_BYTES", PAGE)
    monkeypatch.setattr(pinning, "PIECE_BYTES", 2 * PAGE)
    monkeypatch.setattr(pinning, "KEEP_BYTES", 0)        # per call; test_kept_* keep them
    pinning.forget_kept()
    yield fake
    assert pinning.registered() == []


def _through(a, out_like=None, pin=True):
    """a uploaded, its device copy downloaded into a fresh array: both pinned (unless pin is
    False), as a call's inputs and outputs are."""
    base = staging.compact(a)
    got = np.empty(base.shape, a.dtype) if out_like is None else out_like
    with staging.Staging(0, 0) as stage:
        if pin:
            stage.pin([a], [got])
        view = stage.upload(a)
        stage.download(DevView.contiguous(view.ptr, base.shape, a.dtype, 0, 0), got)
    return base, got


def _own_pages(shape, dtype):
    """An array that shares no page with another."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    room = np.empty(nbytes + 2 * PAGE, np.uint8)
    start = -room.ctypes.data % PAGE + PAGE
    return room[start:start + nbytes].view(dtype).reshape(shape)


def _arrays(rng, dtype):
    x = _random(rng, (9, 7001), dtype)
    return {"contiguous": x, "odd_offset": x.reshape(-1)[13:-29],
            "broadcast": np.broadcast_to(x[:1], (5,) + x.shape[1:]),    # its compact base travels
            "readonly": np.frombuffer(x.tobytes(), dtype).reshape(x.shape)}


@pytest.mark.parametrize("dtype", [BF16, np.float32, np.uint8], ids=lambda d: np.dtype(d).name)
def test_pinned_roundtrips_skip_the_ring(pins, rng, dtype):
    for name, a in _arrays(rng, dtype).items():
        before = pins.registrations
        base, got = _through(a)
        np.testing.assert_array_equal(_bits(got), _bits(base), err_msg=name)
        assert pins.registrations > before, name
        assert pins.registered == [], name
    assert pins.pinned == [], "a ring slot was allocated: some copy did not go direct"


def test_read_only_inputs_register_read_only(pins, rng, monkeypatch):
    flags = []
    monkeypatch.setattr(_C, "host_register", lambda ptr, n, device=0, read_only=False: (
        flags.append(read_only) or pins.host_register(ptr, n, device, read_only)))
    a = _arrays(rng, BF16)["readonly"]
    base, got = _through(a, _own_pages(a.shape, BF16))  # the output shares no page with the input
    np.testing.assert_array_equal(_bits(got), _bits(base))
    assert True in flags and False in flags           # the input read-only, the output writable
    del got


def test_non_contiguous_arrays_use_the_ring(pins, rng):
    a = _random(rng, (64, 300), np.float32).T
    got = np.empty((600, 64), np.float32)[::2]
    base, got = _through(a, got)
    np.testing.assert_array_equal(got, base)
    assert pins.registrations == 0 and pins.pinned != []


def test_ring_mode_registers_nothing(pins, rng, monkeypatch):
    monkeypatch.setenv("ATTNEXT_STAGING", "ring")
    base, got = _through(_random(rng, (9, 7001), np.float32))
    np.testing.assert_array_equal(got, base)
    assert pins.registrations == 0


@pytest.fixture
def kept(pins, monkeypatch):
    """pins, with the registrations of inputs seen again kept (up to 128 pages)."""
    monkeypatch.setattr(pinning, "KEEP_BYTES", 128 * PAGE)
    yield pins
    pinning.forget_kept()


def _registered_in(fake, a):
    """The registrations that hold some of a's bytes."""
    lo, hi = pinning.byte_range(a)
    return [r for r in fake.registered if r[0] < hi and lo < r[1]]


def _spy_acquire(monkeypatch):
    """The `how` of every piece a call acquires (on a pool thread, or shared at once)."""
    seen = []
    acquire, share = pinning._acquire, pinning._share

    def spy(*args):
        entry, how = acquire(*args)
        seen.append(how)
        return entry, how

    def spy_share(*args):
        got = share(*args)
        if got is not None:
            seen.append(got[1])
        return got
    monkeypatch.setattr(pinning, "_acquire", spy)
    monkeypatch.setattr(pinning, "_share", spy_share)
    return seen


def test_an_input_seen_again_keeps_its_registration(kept, rng, monkeypatch):
    """The first call with an array registers and releases its memory; a later call with the
    same owner keeps its registration (the owner's whole data, one writable piece), and the
    calls after it register nothing and DMA straight from it (a view of it at another page offset
    too); the registration goes when the owner is deallocated."""
    a = _own_pages((9, 7001), np.float32)          # page-aligned: a[2:] starts mid-piece
    a[...] = _random(rng, (9, 7001), np.float32)
    hows = _spy_acquire(monkeypatch)
    for i in range(4):
        before, dma = kept.registrations, kept.dma["htod"]
        x = a if i < 3 else a[2:]
        hows.clear()
        base, got = _through(x, _own_pages(x.shape, x.dtype))
        np.testing.assert_array_equal(got, base)
        assert kept.dma["htod"] > dma
        assert pinning.REFUSED not in hows, (i, hows)
        if i >= 2:      # the kept owner is one piece, shared
            assert hows.count(pinning.SHARED) == 1, (i, hows)
        if i == 0:
            assert kept.registrations > before and _registered_in(kept, a) == []
        elif i == 1:
            assert kept.registrations > before and _registered_in(kept, a) != []
            assert pinning.kept_bytes() >= a.nbytes
        else:                                   # the output is still registered per call
            [(lo, hi)] = pinning.unions([pinning.byte_range(got)])
            assert kept.registrations - before == len(pinning.cut(lo, hi, pinning.PIECE_BYTES))
        if i >= 1:      # the owner's whole data in one writable registration: the caller's copies work
            lo, hi = pinning.byte_range(pinning.root(a))
            assert [r for r in kept.registered if r[0] <= lo and hi <= r[1] and not r[2]] != [], kept.registered
    assert [r for r in kept.registered if not _registered_in(kept, a).count(r)] == []
    del a, x, base
    assert kept.registered == [] and pinning.kept_bytes() == 0


def test_views_of_one_owner_in_a_first_call_are_not_kept(kept, rng):
    """q, k, v as views of one packed buffer: the first call sees the owner once, not thrice
    (the second call keeps it: the buffer is small enough to be kept)."""
    qkv = _random(rng, (3, 9, 2001), np.float32)
    q, k, v = qkv

    def call():
        with staging.Staging(0, 0) as stage:
            stage.pin([q, k, v], [])
            for x in (q, k, v):
                stage.upload(x)
    call()
    assert pinning.kept_bytes() == 0 and _registered_in(kept, qkv) == []
    call()
    assert pinning.kept_bytes() > 0 and _registered_in(kept, qkv) != []
    del q, k, v, qkv


def test_an_owner_evicted_and_kept_again_leaves_no_finalizer_behind(kept, rng, monkeypatch):
    """An owner past KEEP_BYTES is never kept; owners evicted for others give their finalizers
    back (a call after call that keeps and evicts them grows nothing)."""
    import weakref
    a = _random(rng, (9, 7001), np.float32)
    monkeypatch.setattr(pinning, "KEEP_BYTES", PAGE)
    for _ in range(3):
        _through(a, _own_pages(a.shape, a.dtype))
    assert pinning.kept_bytes() == 0 and _registered_in(kept, a) == []
    monkeypatch.setattr(pinning, "KEEP_BYTES", a.nbytes + 2 * PAGE)    # room for one owner
    b = _random(rng, (9, 7001), np.float32)
    start = len(weakref.finalize._registry)
    for _ in range(6):
        for x in (a, b):
            _through(x, _own_pages(x.shape, x.dtype))
    assert len(weakref.finalize._registry) <= start + 1
    assert pinning.kept_bytes() <= pinning.KEEP_BYTES


_GC_IN_ACQUIRE = r"""
import faulthandler, gc, sys
import numpy as np
from attnext import _C
from attnext.cuda import pinning
_C.host_register = lambda lo, n, dev=0, ro=False: True
_C.host_unregister = lambda lo, dev=0: None
k = int(sys.argv[1])
gc.disable()
owner = np.zeros(1 << 16, np.uint8)
lo, hi = pinning.unions([pinning.byte_range(owner)])[0]
entry, how = pinning._acquire(lo, hi, 0, False, (lo, hi - 1))
pinning._to_give_back([(entry, how)], [(lo, hi, owner)])
cycle = [owner]
cycle.append(cycle)                    # only the collector frees the owner
del owner, cycle, entry
other = np.zeros(1 << 16, np.uint8)
olo, ohi = pinning.unions([pinning.byte_range(other)])[0]
faulthandler.dump_traceback_later(20, exit=True)
gc.set_threshold(gc.get_count()[0] + k)
gc.enable()
pinning._acquire(olo, ohi, 0, False, (olo, ohi - 1))
faulthandler.cancel_dump_traceback_later()
gc.collect()
pinning._drain()
print(pinning.kept_bytes(), len(pinning.registered()))
"""


@pytest.mark.parametrize("k", range(1, 6))
def test_a_kept_owner_collected_inside_the_table_lock_does_not_deadlock(k):
    """The garbage collector may run a kept owner's finalizer at any allocation, also inside
    a section that holds the table's lock: its registration is given back after that section
    (the k-th allocation triggers the collection)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _GC_IN_ACQUIRE, str(k)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["0", "1"], r.stdout      # the owner's entry gone, other's held


def test_kept_registrations_stay_under_their_bound(kept, rng, monkeypatch):
    """Past KEEP_BYTES the least recently used owner's registrations go; an owner attnext
    remembers cannot be resized (NumPy refuses it with weak references), so its data stays."""
    a = np.empty((9, 7001), np.float32)
    a[...] = _random(rng, (9, 7001), np.float32)
    for _ in range(2):
        _through(a, _own_pages(a.shape, a.dtype))
    assert _registered_in(kept, a)
    with pytest.raises(ValueError, match="resize"):
        a.resize((20, 7001), refcheck=False)
    monkeypatch.setattr(pinning, "KEEP_BYTES", pinning.kept_bytes() + PAGE)
    b = _random(rng, (9, 7001), np.float32)
    for _ in range(2):
        base, got = _through(b, _own_pages(b.shape, b.dtype))
        np.testing.assert_array_equal(got, base)
    assert _registered_in(kept, b) and not _registered_in(kept, a)      # a was the older
    assert 0 < pinning.kept_bytes() <= pinning.KEEP_BYTES


def test_pinned_results_travel_without_registering(pins, rng):
    """An array in attnext's own pinned memory (a PinnedBuffer at its root: the fake's are
    mmaps) travels as it is, both ways: no registration, no ring."""
    x = _random(rng, (9, 7001), np.float32)
    a = np.frombuffer(_C.host_alloc(x.nbytes, 0, True), np.float32).reshape(x.shape)
    a[...] = x
    got = np.frombuffer(_C.host_alloc(x.nbytes, 0, True), np.float32).reshape(x.shape)
    rings = len(pins.pinned)
    base, got = _through(a[1:], got[1:])
    np.testing.assert_array_equal(got, x[1:])
    assert pins.registrations == 0 and len(pins.pinned) == rings and pins.dma["dtoh"] > 0


def test_a_failed_registration_falls_back_to_the_ring(pins, rng):
    pins.register_error = RuntimeError("cuMemHostRegister_v2 failed: CUDA_ERROR_NOT_SUPPORTED")
    base, got = _through(_random(rng, (9, 7001), BF16))
    np.testing.assert_array_equal(_bits(got), _bits(base))
    assert pins.registrations == 0 and pins.pinned != []


def test_some_pieces_failing_mix_direct_and_ring(pins, rng, monkeypatch):
    calls = []

    def every_other(ptr, n, device=0, read_only=False):
        calls.append(ptr)
        if len(calls) % 2:
            raise MemoryError("cuMemHostRegister_v2 failed: CUDA_ERROR_OUT_OF_MEMORY")
        return pins.host_register(ptr, n, device, read_only)
    monkeypatch.setattr(_C, "host_register", every_other)
    base, got = _through(_random(rng, (9, 7001), BF16))
    np.testing.assert_array_equal(_bits(got), _bits(base))
    assert pins.registrations > 0 and pins.pinned != [] and pins.registered == []


def test_memory_the_caller_registered_is_used_and_kept(pins, rng):
    a = _random(rng, (9, 7001), np.float32)
    lo = a.ctypes.data
    assert pins.host_register(lo, a.nbytes)               # the caller's own, not page-aligned
    try:
        got = np.empty_like(a)
        with staging.Staging(0, 0) as stage:
            stage.pin([a], [])
            view = stage.upload(a)
            stage.download(view, got)
        np.testing.assert_array_equal(got, a)
        assert pins.registered == [(lo, lo + a.nbytes, False)]
        assert pins.dma["htod"] >= 1
    finally:
        pins.host_unregister(lo)


def test_a_range_partly_registered_by_someone_else_uses_the_ring(pins, rng):
    a = _random(rng, (9, 7001), np.float32)
    lo = (a.ctypes.data // PAGE + 2) * PAGE                # one page inside, not covering it
    assert pins.host_register(lo, PAGE)
    try:
        base, got = _through(a)
        np.testing.assert_array_equal(got, base)
        assert pins.registered == [(lo, lo + PAGE, False)]
    finally:
        pins.host_unregister(lo)


def test_nothing_stays_registered_when_the_call_raises(pins, rng, monkeypatch):
    a = _random(rng, (9, 7001), np.float32)
    with pytest.raises(ZeroDivisionError):
        with staging.Staging(0, 0) as stage:
            stage.pin([a], [])
            stage.upload(a)
            raise ZeroDivisionError
    assert pins.registered == []
    count = []

    def failing(dst, src, stream, device=0):
        count.append(1)
        if len(count) == 2:
            raise RuntimeError("cuMemcpyHtoDAsync_v2 failed: CUDA_ERROR_ILLEGAL_ADDRESS")
        return pins.memcpy_htod(dst, src, stream, device)
    monkeypatch.setattr(_C, "memcpy_htod", failing)
    with pytest.raises(RuntimeError, match="ILLEGAL_ADDRESS"):
        _through(a)
    assert pins.registered == []


def test_input_pins_are_given_back_once_the_uploads_are_done(pins, rng):
    """uploads_done(): the input's pieces are unregistered after their DMAs (a late DMA from
    memory no longer locked fails the fake), the output's stay until the stage finishes."""
    n, gap = 9 * 7001, 2 * PAGE // 4                       # two pages apart: no shared page
    buf = np.empty(2 * n + gap, np.float32)
    a, got = buf[:n], buf[n + gap:]
    a[...] = _random(rng, n, np.float32)
    with staging.Staging(0, 0) as stage:
        stage.pin([a], [got])
        view = stage.upload(a)
        stage.uploads_done()
        assert stage._early
        for f in stage._early:
            f.result()
        out_lo, out_hi = pinning.unions([pinning.byte_range(got)])[0]
        assert pins.registered and all(out_lo <= lo and hi <= out_hi for lo, hi, _ in pins.registered)
        stage.download(view, got)
    np.testing.assert_array_equal(got, a)
    assert pins.registered == []


def test_concurrent_calls_share_one_array(pins, rng):
    shared = _random(rng, (9, 7001), BF16)

    def work(i):
        for _ in range(4):
            base, got = _through(shared)
            if not np.array_equal(_bits(got), _bits(base)):
                return "mismatch"
        return "ok"
    assert in_threads(work, 6, JOIN_SECONDS) == ["ok"] * 6
    assert pins.registered == []


def _forward(q, k, v, **kw):
    return attnext.attention(q, k, v, device="cuda", return_lse=True, **kw)


@pytest.mark.parametrize("sliced", [False, True], ids=["one_go", "batch_slices"])
def test_forward_with_views_of_one_buffer(fake_kernel, pins, monkeypatch, rng, sliced):
    """q, k, v slices of one qkv buffer (their pages shared), k passed again as v, an out=:
    the same results as the ring, every copy direct."""
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 1 << 12 if sliced else 1 << 60)
    B, S, H, D = 4, 70, 3, 32
    qkv = _random(rng, (3 * B * S * H * D + 5,), BF16)[5:].reshape(3, B, S, H, D)   # not page-aligned
    q, k, v = qkv
    results = {}
    for mode in ("register", "ring"):
        monkeypatch.setenv("ATTNEXT_STAGING", mode)
        out = np.full(q.shape, np.nan, BF16)
        results[mode] = (_forward(q, k, v), _forward(q, k, k), _forward(q, k, v, out=out))
        if mode == "register":      # every upload direct: the upload ring never got memory
            assert pins.registrations > 0
            assert staging._up is None or all(slot.buf is None for slot in staging._up.slots)
    for got, want in zip(results["register"], results["ring"]):
        np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
        np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(_bits(results["register"][0][0]), _bits(v))
    np.testing.assert_array_equal(_bits(results["register"][1][0]), _bits(k))
    assert pins.registered == []


# ---------------------------------------------------------------- on the GPU
@pytest.fixture
def gpu_pins(gpu, monkeypatch):
    """Pinning (ATTNEXT_STAGING=register) for arrays of 1 MiB and more, in 1 MiB pieces (several
    per array)."""
    monkeypatch.setenv("ATTNEXT_STAGING", "register")
    monkeypatch.setattr(pinning, "MIN_BYTES", 1 << 20)
    monkeypatch.setattr(pinning, "PIECE_BYTES", 1 << 20)
    yield
    assert pinning.registered() == []


def _both_modes(monkeypatch, call):
    got = {}
    for mode in ("ring", "register"):
        monkeypatch.setenv("ATTNEXT_STAGING", mode)
        got[mode] = call()
    return got["ring"], got["register"]


def _same_bits(a, b):
    for x, y in zip(a, b):
        if x is not None:
            np.testing.assert_array_equal(_bits(np.asarray(x)), _bits(np.asarray(y)))


@pytest.mark.gpu
@pytest.mark.parametrize("sliced", [False, True], ids=["one_go", "batch_slices"])
def test_gpu_register_equals_ring_bit_for_bit(gpu_pins, monkeypatch, rng, sliced):
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 1 << 20 if sliced else 1 << 60)
    shape = (4, 1024, 8, 64)
    q, k, v = (_random(rng, shape, BF16) for _ in range(3))
    ring, reg = _both_modes(monkeypatch, lambda: attnext.attention(q, k, v, causal=True, return_lse=True))
    _same_bits(ring, reg)
    out = np.full(shape, np.nan, BF16)
    _, reg_out = _both_modes(monkeypatch, lambda: attnext.attention(q, k, v, causal=True, out=out).copy())
    _same_bits([ring[0]], [reg_out])
    dout = _random(rng, shape, BF16)
    g_ring, g_reg = _both_modes(monkeypatch, lambda: attnext.attention_backward(
        dout, q, k, v, ring[0], ring[1], causal=True)[:3])
    _same_bits(g_ring, g_reg)


@pytest.mark.gpu
def test_gpu_views_of_one_buffer_and_a_repeated_array(gpu_pins, monkeypatch, rng):
    qkv = _random(rng, (3 * 2 * 1024 * 8 * 64 + 3,), BF16)[3:].reshape(3, 2, 1024, 8, 64)
    q, k, v = qkv
    _same_bits(*_both_modes(monkeypatch, lambda: attnext.attention(q, k, v, return_lse=True)))
    _same_bits(*_both_modes(monkeypatch, lambda: attnext.attention(q, k, k, return_lse=True)))
    ro = np.frombuffer(q.tobytes(), BF16).reshape(q.shape)          # read-only input
    _same_bits(*_both_modes(monkeypatch, lambda: attnext.attention(ro, k, v, return_lse=True)))


@pytest.mark.gpu
def test_gpu_the_callers_own_copies_of_kept_arrays_work(gpu, torch, monkeypatch, rng):
    """Arrays attnext keeps registered (passed in two calls) stay the caller's: torch copies the
    whole array, a view of it and its neighbour onto the GPU and back into it. CUDA refuses a
    copy that starts inside a registered range and ends past it, or writes into read-only
    registered memory: both happened while kept registrations were read-only pieces widened to
    pages (torch.from_numpy(q).cuda(): "invalid argument")."""
    monkeypatch.setenv("ATTNEXT_STAGING", "register")
    monkeypatch.setattr(pinning, "MIN_BYTES", 1 << 20)
    monkeypatch.setattr(pinning, "PIECE_BYTES", 1 << 20)
    pinning.forget_kept()
    buf = rng.standard_normal(2 * 3 * 1024 * 8 * 64 + 1000).astype(np.float32)
    q = buf[1000:].reshape(2, 3, 1024, 8, 64)[0]          # a view at an odd offset, pieces of 1 MiB
    k, v = (rng.standard_normal(q.shape).astype(np.float32) for _ in range(2))
    for _ in range(3):
        attnext.attention(q, k, v, device="cuda")
    assert pinning.kept_bytes() > 0
    for a in (q, q[1], k, buf, buf[:2000]):
        t = torch.from_numpy(a).cuda()
        np.testing.assert_array_equal(t.cpu().numpy(), a)
        new = torch.randn(a.shape, device="cuda")
        torch.from_numpy(a).copy_(new)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(a, new.cpu().numpy())
    want = attnext.reference.attention(q, k, v)
    assert_close("out", attnext.attention(q, k, v, device="cuda"), want, np.float32)
    pinning.forget_kept()
    assert pinning.registered() == []


@pytest.mark.gpu
def test_gpu_memory_the_caller_pinned_stays_pinned(gpu_pins, monkeypatch, rng):
    q, k, v = (_random(rng, (2, 1024, 8, 64), BF16) for _ in range(3))
    pinned = _C.host_alloc(q.nbytes)
    qp = np.frombuffer(pinned, BF16).reshape(q.shape)
    qp[...] = q
    _same_bits(*_both_modes(monkeypatch, lambda: attnext.attention(qp, k, v, return_lse=True)))
    assert _C.host_pinned(qp.ctypes.data)
    assert not _C.host_pinned(k.ctypes.data)                           # ours were let go
    del qp, pinned


@pytest.mark.gpu
def test_gpu_concurrent_calls_share_inputs(gpu_pins, monkeypatch, rng):
    monkeypatch.setenv("ATTNEXT_STAGING", "register")
    q, k, v = (_random(rng, (2, 1024, 8, 64), BF16) for _ in range(3))
    want = attnext.attention(q, k, v)

    def work(i):
        for _ in range(3):
            if not np.array_equal(_bits(attnext.attention(q, k, v)), _bits(want)):
                return "mismatch"
        return "ok"
    assert in_threads(work, 4, JOIN_SECONDS) == ["ok"] * 4


# ---------------------------------------------------------------- row slices, the caller's thread, orphans
def test_row_slices_pinned_with_out(real_kernel, pins, rng):
    """A causal forward in row slices from pinned inputs into a pinned out= (direct DMAs;
    background downloads that do not wait): the reference's answer, twice."""
    q, k, v = (_random(rng, (2, 256, 4, 16), BF16) for _ in range(3))
    out = np.full(q.shape, np.nan, BF16)
    for _ in range(2):
        check_real(q, k, v, True, out=out)
    assert pins.dma["dtoh"] > 0 and pins.registrations > 0
    assert any(sq != sk for sq, sk, _ in real_kernel)


def test_error_in_the_last_row_slice_leaves_nothing(real_kernel, pins, rng, monkeypatch):
    """A launch failing in the last row slice: the call raises it, nothing stays registered
    (the pins fixture checks)."""
    launch, n = _C.cuda_launch_attention, []

    def failing(*a):
        n.append(1)
        if len(n) == 3:                        # B=2: slices (0,1), (1,2,0,192), (1,2,192,256)
            raise RuntimeError("boom")
        return launch(*a)
    monkeypatch.setattr(_C, "cuda_launch_attention", failing)
    q, k, v = (_random(rng, (2, 256, 4, 16), BF16) for _ in range(3))
    with pytest.raises(RuntimeError, match="boom"):
        attnext.attention(q, k, v, causal=True, device="cuda", return_lse=True)
    assert len(n) == 3 and pins.registered == []


def test_kept_inputs_never_reach_the_pool(kept, rng, monkeypatch):
    """Once an input's registration is kept, a later call takes its pieces in the caller's
    thread (_share): only the output's pieces go to the pool's _acquire."""
    a = _own_pages((9, 7001), np.float32)
    a[...] = _random(rng, a.shape, np.float32)
    for _ in range(2):                                   # the second call keeps a's registration
        _through(a, _own_pages(a.shape, a.dtype))
    assert pinning.kept_bytes() >= a.nbytes
    pooled, acquire = [], pinning._acquire
    monkeypatch.setattr(pinning, "_acquire", lambda lo, hi, *r: pooled.append((lo, hi)) or acquire(lo, hi, *r))
    base, got = _through(a, _own_pages(a.shape, a.dtype))
    np.testing.assert_array_equal(got, base)
    alo, ahi = pinning.unions([pinning.byte_range(a)])[0]
    assert pooled and not [p for p in pooled if alo <= p[0] and p[1] <= ahi], pooled
    del a, base


def test_an_orphaned_entry_is_refused(monkeypatch):
    """An owner whose finalizer ran while another thread held the table lock leaves its entry
    in the table (an orphan) until that thread drains: meanwhile no call may share it (the
    memory may be another array's by then)."""
    monkeypatch.setattr(pinning._C, "host_register", lambda lo, n, dev=0, ro=False: True)
    monkeypatch.setattr(pinning._C, "host_unregister", lambda lo, dev=0: None)
    owner = np.zeros(1 << 16, np.uint8)
    lo, hi = pinning.unions([pinning.byte_range(owner)])[0]
    entry, how = pinning._acquire(lo, hi, 0, True, (lo, hi - 1))
    pinning._to_give_back([(entry, how)], [(lo, hi, owner)])
    with pinning._table_lock:           # another thread's section ...
        pinning._owner_gone(id(owner))  # ... when the collector runs the finalizer
    assert entry in pinning._orphans
    try:
        with pinning._table_lock:       # still inside that section: no call may take it
            assert pinning._take_covering(lo, lo + PAGE, 0, True) == (None, pinning.REFUSED)
        assert pinning._share(lo, lo + PAGE, 0, True) is None
    finally:
        pinning._drain()
    assert pinning.registered() == []
