"""attnext.cuda.staging: NumPy arrays to and from the GPU through the pinned rings.

Without a GPU: the chunking arithmetic, and the whole copy pipeline over a fake of attnext._C's
memory, copy and stream primitives whose copies land late (a DMA happens only when the host
synchronises its stream or another stream waits for it), so a slot written again, read or freed
too early shows up as wrong data. With `-m gpu`: the same round trips on the device, concurrent
calls, and NumPy forwards (batch-sliced or not) against the same inputs as torch CUDA tensors.
"""
import collections
import ctypes
import gc
import mmap
import threading
import types

import numpy as np
import pytest

import attnext
from attnext import _C, reference
from attnext.cuda import backend as cuda_backend, pinning, staging
from attnext.cuda.devview import DevView
from conftest import BF16, assert_close, assert_lse_close, in_threads

from helpers import fake_cuda

JOIN_SECONDS = 120       # the concurrent tests' deadlock guard

SMALL_RING = dict(CHUNK_BYTES=4096, RING_SLOTS=3, SHARE_BYTES=512, SMALL_BYTES=256, COPY_THREADS=4)


# ---------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("n, chunk", [(1, 1), (10, 3), (4096, 1024), (4097, 1024), (7, 100)])
def test_chunk_sizes(n, chunk):
    sizes = staging.chunk_sizes(n, chunk)
    assert sum(sizes) == n and max(sizes) <= chunk and len(sizes) == -(-n // chunk)
    assert max(sizes) - min(sizes) <= 1
    assert staging.chunk_sizes(0, chunk) == []


def test_shares():
    assert staging.shares(1000, 2, 8, 4096) == [1000]                 # below one share
    assert staging.shares(1 << 20, 1, 8, 1 << 16) == [1 << 17] * 8    # at most one per thread
    assert staging.shares(5 << 16, 1, 8, 1 << 16) == [1 << 16] * 5    # at least share_bytes each


def _strided_cases():
    base = np.arange(2 * 3 * 5 * 7).reshape(2, 3, 5, 7)
    return {"contiguous": base, "transposed": base.transpose(0, 2, 1, 3),
            "reversed": base[::-1, :, ::-2], "every_other": base[:, :, :, ::2],
            "one_row": base[1:2, 2:3], "vector": np.arange(100)[3:97:3], "scalar": np.asarray(5)}


@pytest.mark.parametrize("name", list(_strided_cases()))
def test_blocks_cover_every_range_in_order(name):
    a = staging.collapse(_strided_cases()[name])
    flat = a.ravel()
    n = flat.size
    for e0, e1 in [(0, n), (0, 1), (n - 1, n), (1, n - 1), (n // 3, 2 * n // 3), (5, 5)]:
        if not 0 <= e0 <= e1 <= n:
            continue
        got = [a[idx].ravel() for idx in staging.blocks(a.shape, e0, e1)]
        assert len(got) <= max(1, 2 * a.ndim - 1)
        np.testing.assert_array_equal(np.concatenate(got) if got else flat[:0], flat[e0:e1])


def test_collapse_keeps_order_and_merges():
    cases = _strided_cases()
    for a in cases.values():
        c = staging.collapse(a)
        np.testing.assert_array_equal(c.ravel(), np.asarray(a).ravel())
    assert staging.collapse(cases["contiguous"]).shape == (210,)
    assert staging.collapse(cases["transposed"]).shape == (2, 5, 3, 7)
    assert staging.collapse(cases["one_row"]).shape == (35,)


def test_compact_cuts_broadcast_dims():
    x = np.arange(6.0).reshape(2, 1, 3)
    b = np.broadcast_to(x, (4, 2, 5, 3))
    assert staging.compact(b).shape == (1, 2, 1, 3)
    assert staging.compact(np.asarray(1.0)).shape == ()


# ---------------------------------------------------------------- a fake CUDA with late copies
class FakeCuda:
    """attnext._C's memory, copy and stream primitives on the host, with CUDA's ordering and
    nothing more: each stream is a queue of operations, a stream_wait enqueues "stream `on` has
    run what it held then", and an operation runs only once what it depends on has run.

    mode "late": everything runs as late as possible (when the host synchronises a stream, or a
    pageable copy needs it): a pinned slot written again, read or freed too early shows up as
    wrong data. "early": every operation runs as soon as it is enqueued (its dependencies
    first). "kernels_late": copies early, kernels (fake launches) late: a copy that is not
    ordered after a kernel overtakes it. Pageable copies are synchronous, as in CUDA."""

    def __init__(self, mode):
        self.mode = mode
        self.lock = threading.RLock()
        self.mem = {}                                  # device address -> uint8 array
        self.pinned = []                               # (lo, hi) host addresses
        self.registered = []                           # (lo, hi, read_only) host_register'ed
        self.registrations = 0
        self.register_error = None                     # set: host_register raises this
        self.queues = collections.defaultdict(list)    # stream -> operations, in order
        self.done = collections.Counter()              # stream -> operations run
        self.next_ptr, self.next_stream = 1 << 40, 1000
        self.events = {}                                # event -> (stream, queue length) recorded
        self.dma = collections.Counter()
        self.htod_bytes = 0                            # every byte uploaded, pinned or not

    def _find(self, ptr, n):
        for base, arr in self.mem.items():
            if base <= ptr and ptr + n <= base + arr.size:
                return arr, ptr - base
        raise AssertionError(f"device range 0x{ptr:x} + {n} is not allocated (freed too early?)")

    def _is_pinned(self, host, writes=False):
        """host's bytes lie in page-locked memory (a PinnedBuffer, or a registration: one the
        device may write when `writes`)."""
        lo, hi = host.ctypes.data, host.ctypes.data + host.nbytes
        with self.lock:
            return (any(a <= lo and hi <= b for a, b in self.pinned)
                    or any(a <= lo and hi <= b and not (writes and ro) for a, b, ro in self.registered))

    def _run(self, stream, upto=None):
        with self.lock:
            upto = len(self.queues[stream]) if upto is None else upto
            while self.done[stream] < upto:
                op = self.queues[stream][self.done[stream]]
                self.queues[stream][self.done[stream]] = None     # what it held can go
                self.done[stream] += 1
                op()

    def enqueue(self, stream, op, kernel=False):
        with self.lock:
            self.queues[stream].append(op)
            if self.mode == "early" or (self.mode == "kernels_late" and not kernel):
                self._run(stream)

    def mem_alloc(self, nbytes, stream, device=0):
        """Stream-ordered, as cuMemAllocAsync: the memory exists once the stream gets there."""
        with self.lock:
            if nbytes == 0:
                return 0
            ptr, self.next_ptr = self.next_ptr, self.next_ptr + nbytes + 4096
            self.enqueue(stream, lambda: self.mem.__setitem__(ptr, np.full(nbytes, 0xA5, np.uint8)))
            return ptr

    def mem_free(self, ptr, stream, device=0):
        self.enqueue(stream, lambda: self.mem.pop(ptr))

    def host_alloc(self, nbytes, device=0, pooled=False):
        """Pinned memory as an mmap (pinning.PINNED_TYPES is (mmap,) under the fake)."""
        buf = mmap.mmap(-1, max(nbytes, 1))
        raw = np.frombuffer(buf, np.uint8)
        raw[:] = 0x5A
        with self.lock:
            self.pinned.append((raw.ctypes.data, raw.ctypes.data + max(nbytes, 1)))
        return buf

    def memcpy_htod(self, dst, src, stream, device=0):
        data = np.frombuffer(src, np.uint8)
        pinned = self._is_pinned(data)
        if not pinned:
            data = data.copy()                         # pageable: staged at once

        def copy():
            assert not pinned or self._is_pinned(data), "a DMA from memory no longer page-locked"
            arr, off = self._find(dst, data.size)
            arr[off:off + data.size] = data
        self.dma["htod"] += pinned
        self.htod_bytes += data.size
        self.enqueue(stream, copy)

    def memcpy_dtoh(self, dst, src, stream, device=0):
        out = np.asarray(memoryview(dst)).view(np.uint8).reshape(-1)

        def copy():
            assert not pinned or self._is_pinned(out, True), "a DMA into memory no longer page-locked"
            arr, off = self._find(src, out.size)
            out[:] = arr[off:off + out.size]
        pinned = self._is_pinned(out, True)
        self.dma["dtoh"] += pinned
        self.enqueue(stream, copy)
        if not pinned:                                 # pageable: done on return
            self._run(stream)

    def stream_synchronize(self, stream, device=0):
        self._run(stream)

    def stream_wait(self, stream, on, device=0):
        with self.lock:
            n = len(self.queues[on])
            self.enqueue(stream, lambda: self._run(on, n))

    def event_create(self, device=0):
        with self.lock:
            self.next_stream += 1
            self.events[self.next_stream] = None
            return self.next_stream

    def event_record(self, event, stream, device=0):
        with self.lock:
            self.events[event] = (stream, len(self.queues[stream]))

    def stream_wait_event(self, stream, event, device=0):
        with self.lock:
            on, n = self.events[event]
            self.enqueue(stream, lambda: self._run(on, n))

    def event_destroy(self, event, device=0):
        pass                                           # waits already enqueued still run

    def stream_create(self, device=0, non_blocking=True):
        with self.lock:
            self.next_stream += 1
            return self.next_stream

    def stream_destroy(self, stream, device=0):
        pass                                           # what it holds still runs when needed

    def host_register(self, ptr, nbytes, device=0, read_only=False):
        """As the driver: False for a range overlapping a registered one."""
        with self.lock:
            if self.register_error is not None:
                raise self.register_error
            if any(a < ptr + nbytes and ptr < b for a, b, _ in self.registered):
                return False
            self.registered.append((ptr, ptr + nbytes, read_only))
            self.registrations += 1
            return True

    def host_unregister(self, ptr, device=0):
        with self.lock:
            for r in self.registered:
                if r[0] == ptr:
                    self.registered.remove(r)
                    return
        raise RuntimeError(f"cuMemHostUnregister(0x{ptr:x}) failed: CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")

    def host_pinned(self, ptr, device=0):
        with self.lock:
            return any(a <= ptr < b for a, b, _ in self.registered) or any(a <= ptr < b for a, b in self.pinned)

    def cuda_info(self, device=0):
        return {"read_only_host_register": True}


@pytest.fixture(params=["late", "early", "kernels_late"])
def fake(request, monkeypatch):
    f = FakeCuda(request.param)
    staging.reset()
    for name in ("mem_alloc", "mem_free", "host_alloc", "memcpy_htod", "memcpy_dtoh",
                 "stream_synchronize", "stream_wait", "stream_create", "stream_destroy", "event_create",
                 "event_record", "stream_wait_event", "event_destroy",
                 "host_register", "host_unregister", "host_pinned", "cuda_info"):
        monkeypatch.setattr(_C, name, getattr(f, name))
    for name, value in SMALL_RING.items():
        monkeypatch.setattr(staging, name, value)
    monkeypatch.setattr(pinning, "_read_only_ok", {})   # the fake's answer, not a real device's
    monkeypatch.setattr(pinning, "PINNED_TYPES", (mmap.mmap,))
    yield f
    gc.collect()
    staging.reset()                                   # with the fake still in place
    monkeypatch.undo()


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _random(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if dtype.kind in "iu":
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _inputs(rng, dtype, big):
    """Arrays of many shapes and strides; `big` elements make several chunks of any ring."""
    x = _random(rng, (3, big // 3 + 7), dtype)
    four = _random(rng, (2, 7, 5, 33), dtype)
    return {
        "contiguous": x,
        "odd_size": x.reshape(-1)[:big - 13],
        "transposed": four.transpose(0, 2, 1, 3),
        "reversed": x[::-1, ::-3],
        "sliced": four[:, 1:6, :, 3:30],
        "broadcast": np.broadcast_to(four[:, :1, None], (2, 4, 9, 5, 33)),
        "broadcast_rows": np.broadcast_to(x[:, None, :], (3, 5, x.shape[1])),
        "readonly": np.frombuffer(x.tobytes(), dtype).reshape(x.shape),
        "tiny": x[:1, :3],
        "zero_size": x[:, :0],
    }


def _roundtrip(stage, a, dst_layout="c"):
    """Uploads a, downloads the device copy of its compact base into a fresh array."""
    view = stage.upload(a)
    assert view.shape == a.shape
    base = staging.compact(a)
    got = np.empty(base.shape, a.dtype)
    if dst_layout == "f":
        got = np.asfortranarray(got)
    elif dst_layout == "strided":
        got = np.empty(base.shape[:-1] + (2 * base.shape[-1],), a.dtype)[..., ::2] if base.ndim else got
    stage.download(DevView.contiguous(view.ptr, base.shape, a.dtype, 0, 0), got)
    return base, got


DTYPES = [BF16, np.float16, np.float32, np.float64, np.int32, np.uint8, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_fake_roundtrips(fake, dtype, rng):
    inputs = _inputs(rng, dtype, 5000)
    with staging.Staging(0, 0) as stage:
        for name, a in inputs.items():
            for layout in ("c", "f", "strided"):
                base, got = _roundtrip(stage, a, layout)
                np.testing.assert_array_equal(_bits(got), _bits(base), err_msg=f"{name} {layout}")
    assert fake.dma["htod"] > 3 * SMALL_RING["RING_SLOTS"] and fake.dma["dtoh"] > 3 * SMALL_RING["RING_SLOTS"]


def test_fake_download_converts_dtype(fake, rng):
    a = _random(rng, (40, 70), BF16)
    with staging.Staging(0, 0) as stage:
        view = stage.upload(a)
        got = np.empty(a.shape, np.float32)
        stage.download(view, got)
    np.testing.assert_array_equal(got, a.astype(np.float32))


def test_fake_background_downloads_and_fences(fake, rng):
    """copy_in into slices of one allocation after a fence; downloads queued for the stage's
    thread, all done when the stage finishes."""
    a = _random(rng, (6, 50, 40), np.float16)
    got = np.full(a.shape, np.nan, np.float16)
    with staging.Staging(0, 0, background=True) as stage:
        dev = stage.allocate(a)
        after = stage.fence()
        for b0, b1 in ((0, 2), (2, 3), (3, 6)):
            rows = cuda_backend._rows(dev, b0, b1)
            stage.copy_in(a[b0:b1], rows, after=after)
            stage.download(rows, got[b0:b1])
    np.testing.assert_array_equal(_bits(got), _bits(a))
    assert stage.fences == [] and stage._thread is None


def test_fake_background_error_is_raised(fake, rng):
    """An error on the download thread (here a read-only destination) reaches the caller."""
    a = _random(rng, (4, 3000), np.float32)
    dst = np.zeros(a.shape, np.float32)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        with staging.Staging(0, 0, background=True) as stage:
            stage.download(stage.upload(a), dst)
    with staging.Staging(0, 0) as stage:                   # the ring still works
        base, got = _roundtrip(stage, a)
    np.testing.assert_array_equal(got, base)


def test_fake_concurrent_calls(fake, rng):
    arrays = [_random(rng, (7, 1111 + 13 * i), [BF16, np.float32][i % 2]) for i in range(8)]

    def work(i):
        for _ in range(5):
            with staging.Staging(0, 0) as stage:
                base, got = _roundtrip(stage, arrays[i])
                if not np.array_equal(_bits(got), _bits(base)):
                    return "mismatch"
        return "ok"
    assert in_threads(work, 8, JOIN_SECONDS) == ["ok"] * 8


def test_fake_rings_are_bounded_and_freed(fake, rng):
    with staging.Staging(0, 0) as stage:
        for n in (10_000, 100_000, 300_000):
            _roundtrip(stage, _random(rng, (n,), np.float32))
    slots = SMALL_RING["RING_SLOTS"]
    assert len(fake.pinned) == 2 * slots             # one ring per direction, never grown
    assert all(b - a == SMALL_RING["CHUNK_BYTES"] for a, b in fake.pinned)
    staging.reset()
    assert staging._up is None and staging._pool is None


def test_copy_in_and_download_check_the_view(fake, rng):
    with staging.Staging(0, 0) as stage:
        view = stage.allocate(np.zeros((4, 5), np.float32))
        with pytest.raises(ValueError, match="copy_in"):
            stage.copy_in(np.zeros((4, 6), np.float32), view)
        with pytest.raises(ValueError, match="not C-contiguous"):
            stage.download(view.transpose(1, 0), np.zeros((5, 4), np.float32))


def _fake_view(fake, arr_tuple, dtype):
    ptr, shape, strides = arr_tuple
    dtype = np.dtype(dtype)
    mem, off = fake._find(ptr, dtype.itemsize)
    return np.ndarray(shape, dtype, buffer=mem, offset=off,
                      strides=tuple(st * dtype.itemsize for st in strides))


@pytest.fixture
def fake_kernel(fake, monkeypatch):
    """cuda_backend over the fake, its forward kernel a stand-in on the call's stream: with d =
    s + Sk - Sq (row s's bottom-right diagonal; s where the causal code is not 1), out[b, s] = v[b, d] and lse[b, h, s] =
    q[b, s, h, 0] + k[b, d, h, 0] + k[b, 0, h, 0] (float32), read and written through the views
    the kernel gets (the addresses of the launch, the shapes and strides of its template). Where
    Sq == Sk, out = v; a row slice of a causal call reads the diagonal of its rows and its
    sequence's first key (uploaded by the first slice)."""
    def launch(fn, grid, block, smem, stream, template, ptrs, scale, softcap):
        p = fake_cuda.AttnParams.from_buffer_copy(template[:ctypes.sizeof(fake_cuda.AttnParams)])

        def view(name, ptr, shape, dtype):
            return _fake_view(fake, (ptr, shape, tuple(getattr(p, name).s)[4 - len(shape):]), dtype)

        def run():
            q = view("q", ptrs[0], (p.B, p.Sq, p.Hq, p.D), BF16)
            k = view("k", ptrs[1], (p.B, p.Sk, p.Hk, p.D), BF16)
            v = view("v", ptrs[2], (p.B, p.Sk, p.Hk, p.Dv), BF16)
            out = view("out", ptrs[3], (p.B, p.Sq, p.Hq, p.Dv), BF16)
            lse = _fake_view(fake, (ptrs[4], (p.B, p.Hq, p.Sq), tuple(p.lse.s)[:3]), np.float32)
            d = (p.Sk - p.Sq if p.causal == 1 else 0) + np.arange(p.Sq)
            out[...] = v[:, d]
            kd = k[:, d][..., 0].astype(np.float32) + k[:, :1, :, 0].astype(np.float32)
            lse[...] = (q[..., 0].astype(np.float32) + kd).transpose(0, 2, 1)
        fake.enqueue(stream, run, kernel=True)
    _stand_in(monkeypatch, launch)
    yield fake
    cuda_backend.clear_plans()


def _stand_in(monkeypatch, launch):
    """cuda_backend on an sm_90a device of one SM whose attention launches go to launch (the
    fake kernels above); no plan made before survives (plans made here hold the stand-in)."""
    monkeypatch.setattr(_C, "cuda_launch_attention", launch, raising=False)
    monkeypatch.setattr(cuda_backend, "_status", "")
    monkeypatch.setattr(cuda_backend, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(cuda_backend, "device_info", lambda device: {"multiprocessor_count": 1})
    monkeypatch.setattr(cuda_backend.nvrtc, "function", lambda *a, **kw: "fn")
    cuda_backend.clear_plans()


def _fake_want(q4, k4):
    """The fake kernel's lse for a whole call (Sq == Sk)."""
    kd = k4[..., 0].astype(np.float32) + k4[:, :1, :, 0].astype(np.float32)
    return (q4[..., 0].astype(np.float32) + kd).transpose(0, 2, 1)


@pytest.mark.parametrize("sliced", [False, True], ids=["one_go", "batch_slices"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_fake_forward_through_staging(fake_kernel, monkeypatch, rng, sliced, layout):
    """A NumPy forward's inputs reach the kernel and its results come back, in one go and in
    batch slices (a batch-broadcast k, a v whose batch is not outermost, an out= slice)."""
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 1 << 12 if sliced else 1 << 60)
    B, S, H, D = 5, 40, 3, 16
    shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    q, k, v = (_random(rng, shape, BF16) for _ in range(3))
    k = np.broadcast_to(k[:1], k.shape)
    v = np.ascontiguousarray(v.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)
    out = np.full((B + 2,) + shape[1:], np.nan, BF16)[1:-1]
    calls = []
    sliced_forward = cuda_backend._forward_sliced
    monkeypatch.setattr(cuda_backend, "_forward_sliced",
                        lambda o, *a: calls.append(a[-1]) or sliced_forward(o, *a))
    got, lse = attnext.attention(q, k, v, layout=layout, device="cuda", return_lse=True, out=out)
    assert got is out and calls == ([[(b, b + 1, 0, S) for b in range(B)]] if sliced else [])
    np.testing.assert_array_equal(_bits(out), _bits(v))
    q4, k4 = (x if layout == "bshd" else x.transpose(0, 2, 1, 3) for x in (q, k))
    np.testing.assert_array_equal(lse, _fake_want(q4, k4))


@pytest.mark.parametrize("B, S", [(1, 1000), (2, 300), (3, 129), (4, 100)])
def test_fake_forward_in_row_slices(fake_kernel, monkeypatch, rng, B, S):
    """A causal self-attention's last sequence in two row slices (select.TILE_EDGE, 128 here):
    the last rows' kernel gets them and the keys up to their end, bottom-right aligned; every
    key row travels once. Fewer rows than two tiles: batch slices only."""
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 1 << 12)
    monkeypatch.setattr(cuda_backend, "TAIL_SHARE", 1 / 8)
    monkeypatch.setattr(cuda_backend.select, "TILE_EDGE", 128)
    q, k, v = (_random(rng, (B, S, 2, 8), BF16) for _ in range(3))
    calls, launches = [], []
    sliced_forward = cuda_backend._forward_sliced
    monkeypatch.setattr(cuda_backend, "_forward_sliced",
                        lambda o, *a: calls.append(a[-1]) or sliced_forward(o, *a))
    launch = _C.cuda_launch_attention
    monkeypatch.setattr(_C, "cuda_launch_attention", lambda *a: launches.append(a[5]) or launch(*a))
    got, lse = attnext.attention(q, k, v, causal=True, device="cuda", return_lse=True)
    assert fake_kernel.htod_bytes == 3 * q.nbytes
    cut = (S - max(128, S // 8)) // 128 * 128
    want = [(b, b + 1, 0, S) for b in range(B - 1)] + ([(B - 1, B, 0, cut), (B - 1, B, cut, S)] if cut >= 128
                                                       else [(B - 1, B, 0, S)])
    assert calls == [want] and len(launches) == len(want)
    np.testing.assert_array_equal(_bits(got), _bits(v))
    np.testing.assert_array_equal(lse, _fake_want(q, k))


@pytest.fixture
def real_kernel(fake, monkeypatch):
    """cuda_backend over the fake, its forward kernel attention itself (float64, on the call's
    stream) from the launch's params: shapes, strides, GQA, causal code (1 bottom-right, 2
    top-left), scale; slices of 4 KiB on 64-row tiles. Yields the launches' (Sq, Sk, causal)."""
    launched = []

    def launch(fn, grid, block, smem, stream, template, ptrs, scale, softcap):
        p = fake_cuda.AttnParams.from_buffer_copy(template[:ctypes.sizeof(fake_cuda.AttnParams)])
        launched.append((p.Sq, p.Sk, p.causal))

        def view(name, ptr, shape, dtype):
            return _fake_view(fake, (ptr, shape, tuple(getattr(p, name).s)[4 - len(shape):]), dtype)

        def run():
            q = view("q", ptrs[0], (p.B, p.Sq, p.Hq, p.D), BF16).astype(np.float64)
            k = view("k", ptrs[1], (p.B, p.Sk, p.Hk, p.D), BF16).astype(np.float64)
            v = view("v", ptrs[2], (p.B, p.Sk, p.Hk, p.Dv), BF16).astype(np.float64)
            out = view("out", ptrs[3], (p.B, p.Sq, p.Hq, p.Dv), BF16)
            k, v = (np.repeat(x, p.Hq // p.Hk, axis=2) for x in (k, v))
            s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
            i, j = np.arange(p.Sq)[:, None], np.arange(p.Sk)[None]
            if p.causal:
                s = np.where(j <= i + (p.Sk - p.Sq if p.causal == 1 else 0), s, -np.inf)
            m = s.max(-1, keepdims=True)
            e = np.exp(s - m)
            total = e.sum(-1, keepdims=True)
            out[...] = np.einsum("bhqk,bkhd->bqhd", e / total, v).astype(BF16)
            if ptrs[4]:
                lse = _fake_view(fake, (ptrs[4], (p.B, p.Hq, p.Sq), tuple(p.lse.s)[:3]), np.float32)
                lse[...] = (m + np.log(total))[..., 0]
        fake.enqueue(stream, run, kernel=True)
    _stand_in(monkeypatch, launch)
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 1 << 12)
    monkeypatch.setattr(cuda_backend.select, "TILE_EDGE", 64)
    yield launched
    cuda_backend.clear_plans()


def check_real(q, k, v, causal, out=None):
    """A NumPy forward over real_kernel against the reference."""
    got, lse = attnext.attention(q, k, v, causal=causal, device="cuda", return_lse=True, out=out)
    want, want_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=1e-4)
    return got, lse


@pytest.mark.parametrize("B, S, Hq, Hk", [(1, 200, 2, 2), (3, 150, 4, 2), (2, 300, 4, 1)])
@pytest.mark.parametrize("causal", [True, "top_left"])
def test_row_slices_match_reference(real_kernel, rng, B, S, Hq, Hk, causal):
    """Row slices of the last sequence (GQA, MQA, both causal alignments) give the reference's
    answer; every row slice runs bottom-right."""
    q = _random(rng, (B, S, Hq, 8), BF16)
    k, v = (_random(rng, (B, S, Hk, 8), BF16) for _ in range(2))
    check_real(q, k, v, causal)
    assert any(sq != sk for sq, sk, _ in real_kernel)                   # row slices ran
    assert all(c == 1 for sq, sk, c in real_kernel if sq != sk)


@pytest.mark.parametrize("kind", ["c", "strided", "fortran"])
def test_row_slices_into_out(real_kernel, rng, kind):
    B, S, H = 2, 200, 2
    q, k, v = (_random(rng, (B, S, H, 8), BF16) for _ in range(3))
    out = {"c": lambda: np.full((B, S, H, 8), np.nan, BF16),
           "strided": lambda: np.full((B, S, H, 16), np.nan, BF16)[..., ::2],
           "fortran": lambda: np.asfortranarray(np.full((B, S, H, 8), np.nan, BF16))}[kind]()
    got, _ = check_real(q, k, v, True, out=out)
    assert got is out and any(sq != sk for sq, sk, _ in real_kernel)


def test_slices(monkeypatch):
    """Batch slices of about SLICE_BYTES moved; a causal self-attention's last sequence then
    ends in a row slice of about its last TAIL_SHARE rows (from a TILE_EDGE edge, at least one
    tile)."""
    monkeypatch.setattr(cuda_backend, "TAIL_SHARE", 1 / 8)
    x = np.zeros((6, 1024, 2, 32), BF16)
    o = types.SimpleNamespace(varlen=False, bias4=None, mask4=None, B=6, Sq=1024, Sk=1024, q=x, q4=x, k4=x,
                              v4=x, out_shape=x.shape, causal_code=0, window_left=-1, window_right=-1,
                              alibi=None, used_q=None, used_k=None, layout="bshd", block_table=None)
    moved = 4 * x.nbytes
    for slice_bytes, want in ((moved, None), (moved // 2, [(0, 3), (3, 6)]),
                              (moved // 4, [(0, 1), (1, 3), (3, 4), (4, 6)]),
                              (1, [(b, b + 1) for b in range(6)])):
        monkeypatch.setattr(cuda_backend, "SLICE_BYTES", slice_bytes)
        assert cuda_backend._slices(o) == (want and [w + (0, 1024) for w in want])
        if want:
            last = [(want[-1][0], 5, 0, 1024)] if want[-1][0] < 5 else []
            causal = types.SimpleNamespace(**{**vars(o), "causal_code": 1})
            assert cuda_backend._slices(causal) == \
                [w + (0, 1024) for w in want[:-1]] + last + [(5, 6, 0, 896), (5, 6, 896, 1024)]
    causal = types.SimpleNamespace(**{**vars(o), "causal_code": 2})        # top-left: the same
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", moved // 2)
    assert cuda_backend._slices(causal)[-2:] == [(5, 6, 0, 896), (5, 6, 896, 1024)]
    for S, cut in ((1000, 768), (4096, 3584), (300, 128), (256, 128)):      # TAIL_SHARE of the rows
        odd = types.SimpleNamespace(**{**vars(causal), "Sq": S, "Sk": S})
        assert cuda_backend._slices(odd)[-2:] == [(5, 6, 0, cut), (5, 6, cut, S)]
    for S in (128, 255):                                  # under two tiles: no row slices
        small = types.SimpleNamespace(**{**vars(causal), "Sq": S, "Sk": S})
        assert cuda_backend._slices(small) == [(0, 3, 0, S), (3, 6, 0, S)]
    batches = [(0, 3, 0, 1024), (3, 6, 0, 1024)]
    for name, value in (("causal_code", 0), ("Sk", 600), ("window_left", 3), ("window_right", 0),
                        ("alibi", np.ones((6, 2))), ("used_k", np.ones(6)), ("layout", "bhsd"),
                        ("k4", x.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3))):
        assert cuda_backend._slices(types.SimpleNamespace(**{**vars(causal), name: value})) == batches, name
    for name, value in (("bias4", x), ("mask4", x), ("varlen", True)):
        assert cuda_backend._slices(types.SimpleNamespace(**{**vars(o), name: value})) is None
    one = types.SimpleNamespace(**{**vars(o), "B": 1, "q4": x[:1], "k4": x[:1], "v4": x[:1],
                                   "out_shape": x[:1].shape})
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 4 * x[:1].nbytes // 2)
    assert cuda_backend._slices(one) is None
    assert cuda_backend._slices(types.SimpleNamespace(**{**vars(one), "causal_code": 1})) == \
        [(0, 1, 0, 896), (0, 1, 896, 1024)]
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 4 * x[:1].nbytes // 2 + 1)    # moves too little
    assert cuda_backend._slices(types.SimpleNamespace(**{**vars(one), "causal_code": 1})) is None


# ---------------------------------------------------------------- on the GPU
@pytest.fixture(params=["default", "small"])
def ring(request, monkeypatch, gpu):
    """The shipped ring, and a small one (many chunks, every slot reused)."""
    staging.reset()
    if request.param == "small":
        for name, value in SMALL_RING.items():
            monkeypatch.setattr(staging, name, value)
    yield request.param
    staging.reset()
    monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gpu_roundtrips(ring, dtype, rng):
    big = (3 << 20) // np.dtype(dtype).itemsize + 12345     # several default chunks, odd sizes
    inputs = _inputs(rng, dtype, big if ring == "default" else 5000)
    with staging.Staging(0, 0) as stage:
        for name, a in inputs.items():
            for layout in ("c", "strided"):
                base, got = _roundtrip(stage, a, layout)
                np.testing.assert_array_equal(_bits(got), _bits(base), err_msg=f"{name} {layout}")


@pytest.mark.gpu
def test_gpu_to_host(gpu, rng):
    a = _random(rng, (5, 7), np.int32)
    with staging.Staging(0, 0) as stage:
        view = stage.upload(a)
        np.testing.assert_array_equal(staging.to_host(view.transpose(1, 0)), a.T)
        assert staging.to_host(DevView(view.ptr, (0, 3), (3, 1), np.int32, 0)).shape == (0, 3)


@pytest.mark.gpu
def test_gpu_concurrent_calls(ring, rng):
    n = (1 << 20) if ring == "default" else 20_000      # the small ring: ~40 chunks a copy
    arrays = [_random(rng, (3, n + 77 * i), [BF16, np.float16][i % 2]) for i in range(8)]

    def work(i):
        for _ in range(4):
            with staging.Staging(0, 0) as stage:
                base, got = _roundtrip(stage, arrays[i], "strided")
                if not np.array_equal(_bits(got), _bits(base)):
                    return "mismatch"
        return "ok"
    assert in_threads(work, 8, JOIN_SECONDS) == ["ok"] * 8


@pytest.fixture
def torch(gpu):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _to_torch(torch, x):
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("B, S, D, causal", [(1, 1000, 64, True), (2, 700, 128, "top_left"), (1, 4096, 128, True),
                                           (2, 2048, 128, True)])
def test_gpu_numpy_row_slices(torch, monkeypatch, rng, B, S, D, causal):
    """A causal NumPy forward whose last rows run in a slice of their own (over the keys up to
    their end) matches the reference, and the same call on torch arrays (one launch over every
    row) to a rounding: other lengths compile other code (H100: 10-30% of the outputs one bf16
    ulp apart, lse within 1e-6)."""
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 1 << 16)
    q, k, v = (_random(rng, (B, S, 4, D), BF16) for _ in range(3))
    calls = []
    sliced_forward = cuda_backend._forward_sliced
    monkeypatch.setattr(cuda_backend, "_forward_sliced",
                        lambda o, *a: calls.append(a[-1]) or sliced_forward(o, *a))
    out_np, lse_np = attnext.attention(q, k, v, causal=causal, device="cuda", return_lse=True)
    assert calls and calls[0][-1][2] > 0                  # the last rows in a slice of their own
    want, want_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert_close("out", out_np, want)
    assert_lse_close(lse_np, want_lse, q.dtype)
    tq, tk, tv = (_to_torch(torch, x) for x in (q, k, v))
    out_t, lse_t = attnext.attention(tq, tk, tv, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    one_go = out_t.cpu().view(torch.int16).numpy().view(BF16).astype(np.float32)
    np.testing.assert_allclose(out_np.astype(np.float32), one_go, rtol=2 ** -7, atol=1e-3)
    np.testing.assert_allclose(lse_np, lse_t.cpu().numpy(), rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("sliced", [False, True], ids=["one_go", "batch_slices"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gpu_numpy_forward_equals_torch_bit_for_bit(torch, monkeypatch, rng, sliced, layout):
    monkeypatch.setattr(cuda_backend, "SLICE_BYTES", 1 << 16 if sliced else 1 << 60)
    shape = (5, 300, 4, 64) if layout == "bshd" else (5, 4, 300, 64)
    q, k, v = (_random(rng, shape, BF16) for _ in range(3))
    k = np.broadcast_to(k[:1], k.shape)                         # a batch-broadcast k
    v = np.ascontiguousarray(v.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)   # batch not outermost
    calls = []
    sliced_forward = cuda_backend._forward_sliced
    monkeypatch.setattr(cuda_backend, "_forward_sliced",
                        lambda o, *a: calls.append(a[-1]) or sliced_forward(o, *a))
    out_np, lse_np = attnext.attention(q, k, v, causal=True, layout=layout, device="cuda",
                                       return_lse=True)
    assert calls == ([[(b, b + 1, 0, 300) for b in range(5)]] if sliced else [])
    tq, tk, tv = (_to_torch(torch, x) for x in (q, k, v))
    out_t, lse_t = attnext.attention(tq, tk, tv, causal=True, layout=layout, return_lse=True)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out_np.view(np.uint16),
                                  out_t.cpu().view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(lse_np.view(np.uint32),
                                  lse_t.cpu().numpy().view(np.uint32))
