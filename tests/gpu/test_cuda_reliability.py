"""Reliability on the GPU (`pytest -m gpu`): threads, the GIL, memory, CUDA failures, bad inputs
with CUDA arrays, NaN / Inf in CUDA arrays. The CPU side of the same promises is in
cpu/test_concurrency.py and contract/test_errors.py; the bad-input cases here are the latter's
tables (helpers/bad_inputs.py), fed as torch CUDA tensors.

- 8 threads (torch CUDA tensors, and NumPy float16 through the pinned staging rings) get the bits
  of the same calls run one at a time, with no deadlock.
- A long GPU call with NumPy inputs lets another Python thread run (the GIL is released).
- 10,000 small GPU calls grow neither device memory nor RSS, plain or with score_mod / mask_mod
  (their kernels, captured arrays' device copies and block masks kept between calls); NumPy
  calls reuse the pinned rings, which reset() and interpreter exit free.
- A failing CUDA call (out of memory, an invalid launch) raises the documented exception naming
  the call, and the next attention call still gives the reference's answer.
- Refused calls with CUDA arrays raise the CPU tables' exceptions naming the argument and leave
  every input unchanged; the GPU-only refusals (mixed host/GPU, other GPUs, out= on the host,
  aliasing, read-only, float32, score_mod) likewise.
- NaN and Inf in CUDA arrays reach exactly the rows the reference says.
"""
import gc
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import attnext
from attnext import _C, reference
from attnext.cuda import arrays as device, nvrtc, select, staging
from conftest import (BF16, F16, F32, F64, assert_close, assert_lse_close, compare_grads, in_threads,
                      make_qkv, make_varlen_qkv, randn)

from helpers import bad_inputs as bad
from helpers.paths import pythonpath

pytestmark = pytest.mark.gpu

N_THREADS = 8
JOIN_SECONDS = 120
MiB = 2 ** 20


# --- fixtures and conversions ---

@pytest.fixture(scope="module")
def cuda():
    """attnext's CUDA backend, or a skip saying why it is unusable."""
    from attnext.cuda import backend as cuda_backend
    why = cuda_backend.unavailable_reason()
    if why:
        pytest.skip(f"attnext's CUDA backend is unavailable: {why}")
    return 0


@pytest.fixture(scope="module")
def torch(cuda):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _tensor(torch, a, dtype=None):
    """A torch CUDA tensor with a's values (rounded to dtype first) and shape; a broadcast
    (stride-0) dim of a stays one (expand). None where torch has no such dtype."""
    a = np.asarray(a)
    base = np.array(staging.compact(a), dtype=dtype, order="C")     # 0-d stays 0-d
    try:
        t = (torch.from_numpy(base.view(np.int16)).view(torch.bfloat16) if base.dtype == BF16
             else torch.from_numpy(base))
    except TypeError:
        return None
    return t.cuda().expand(a.shape)


def _host(torch, t):
    """A NumPy copy of a torch CUDA tensor (bfloat16 as ml_dtypes.bfloat16)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(BF16)
    return t.cpu().numpy()


def _bits(x):
    return None if x is None else np.ascontiguousarray(x).view(np.uint8).copy()


class ReadOnlyCuda:
    """A CUDA array that says it is read-only (`__cuda_array_interface__` data = (ptr, True))."""

    def __init__(self, t):
        self.t = t

    @property
    def __cuda_array_interface__(self):
        cai = dict(self.t.__cuda_array_interface__)
        cai["data"] = (cai["data"][0], True)
        return cai


# --- 1. threads on the GPU ---

def _torch_problems(torch, rng):
    """Eight problems as torch CUDA tensors: (fwd, bwd, q, k, v, lengths, opts, dout). 0, 1 and 6
    read the same q, k, v (never written); the others cover GQA, bias, alibi + softcap on odd
    head dims (attn_fwd.cu's element loads), varlen with seqused, decode (split-KV), float16."""
    def t(x, dtype=None):
        return _tensor(torch, x, dtype)

    pad = (attnext.attention, attnext.attention_backward)
    shared = [t(x) for x in make_qkv(rng, 2, 300, 300, 8, 2, 128, 128, BF16)]
    problems = [
        (*pad, *shared, {}, dict(causal=True)),
        (*pad, *shared, {}, dict(window=(64, 0))),
        (*pad, *[t(x) for x in make_qkv(rng, 2, 177, 401, 4, 4, 64, 64, BF16, "bhsd")], {},
         dict(layout="bhsd", bias=t(randn(rng, (4, 177, 1), F32)))),
        (*pad, *[t(x) for x in make_qkv(rng, 1, 250, 190, 6, 3, 59, 40, BF16)], {},
         dict(causal="top_left", alibi_slopes=rng.random(6).astype(F32), softcap=8.0)),
        (attnext.varlen_attention, attnext.varlen_attention_backward,
         *[t(x) for x in make_varlen_qkv(rng, 420, 500, 8, 2, 128, 128, BF16)],
         dict(cu_seqlens_q=t(np.array([0, 100, 100, 420], np.int32)),
              cu_seqlens_k=t(np.array([0, 250, 260, 500], np.int32)),
              seqused_k=np.array([200, 0, 240], np.int32)), dict(causal=True)),
        (*pad, *[t(x) for x in make_qkv(rng, 2, 1, 3000, 8, 2, 128, 128, BF16)], {}, {}),
        (*pad, *shared, {}, dict(mask=t(rng.random((300, 300)) < 0.8))),
        (*pad, *[t(x) for x in make_qkv(rng, 1, 513, 513, 4, 4, 128, 128, F16)], {}, dict(causal=True)),
    ]
    out = []
    for fwd, bwd, q, k, v, lengths, opts in problems:
        o = fwd(q, k, v, **lengths, **opts)
        dtype = BF16 if q.dtype == torch.bfloat16 else F16
        out.append((fwd, bwd, q, k, v, lengths, opts, t(randn(rng, tuple(o.shape), dtype))))
    return out


def _torch_run(problem):
    fwd, bwd, q, k, v, lengths, opts, dout = problem
    out, lse = fwd(q, k, v, **lengths, **opts, return_lse=True)
    g = bwd(dout, q, k, v, out, lse, **lengths, **opts)
    return out, lse, g.dq, g.dk, g.dv, g.dbias


def _assert_same_bits(torch, got, want, what):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, want):
        if b is None:
            assert a is None, f"{what}: {name}"
        else:
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), f"{what}: {name} differs"


def test_eight_threads_on_torch_tensors_get_the_single_thread_bits(torch, rng):
    problems = _torch_problems(torch, rng)
    want = [_torch_run(p) for p in problems]       # also compiles every kernel, one at a time
    before = [[x.clone() for x in p[2:5]] for p in problems]

    def work(i):
        # its own problem three times, and the problem of thread i + 4 once
        return [(j, _torch_run(problems[j])) for j in (i, i, (i + 4) % N_THREADS, i)]

    results = in_threads(work, N_THREADS, JOIN_SECONDS)
    torch.cuda.synchronize()
    for i, runs in enumerate(results):
        for j, got in runs:
            _assert_same_bits(torch, got, want[j], f"thread {i}, problem {j}")
    for p, (q, k, v) in zip(problems, before):
        assert torch.equal(p[2], q) and torch.equal(p[3], k) and torch.equal(p[4], v), "an input changed"


def _numpy_problems(rng):
    """Eight float16 NumPy problems for device="cuda": the 256 MiB one (q, k, v, out) runs in
    batch slices with a background download thread and is shared read-only by threads 0 and 4;
    the others go through the pinned rings (each array above staging.SMALL_BYTES) or straight
    from pageable memory (the small varlen lengths)."""
    big = make_qkv(rng, 4, 4096, 4096, 16, 16, 128, 128, F16)
    for x in big:
        x.flags.writeable = False
    mid = make_qkv(rng, 2, 1024, 1100, 8, 2, 64, 64, F16)
    problems = [
        ("big", *big, {}, dict(causal=True)),
        ("padded", *mid, {}, dict(causal=True)),
        ("padded", *make_qkv(rng, 1, 700, 650, 4, 4, 59, 40, F16), {}, dict(window=(100, 20))),
        ("varlen", *make_varlen_qkv(rng, 1500, 1700, 8, 2, 64, 64, F16),
         dict(cu_seqlens_q=np.array([0, 700, 700, 1500]), cu_seqlens_k=np.array([0, 900, 1000, 1700])),
         dict(causal=True)),
        ("big", *big, {}, {}),
        ("padded", *mid, {}, dict(bias=randn(rng, (8, 1024, 1), F32))),
        ("padded", *make_qkv(rng, 2, 1, 4000, 8, 2, 128, 128, F16), {}, {}),
        ("padded", *mid, {}, dict(layout="bshd", window=(0, 300))),
    ]
    return [(kind, q, k, v, lengths, opts,
             None if kind == "big" else randn(rng, q.shape[:-1] + (v.shape[-1],), F16))
            for kind, q, k, v, lengths, opts in problems]


def _numpy_run(problem):
    kind, q, k, v, lengths, opts, dout = problem
    fwd, bwd = ((attnext.varlen_attention, attnext.varlen_attention_backward) if kind == "varlen"
                else (attnext.attention, attnext.attention_backward))
    out, lse = fwd(q, k, v, **lengths, **opts, return_lse=True, device="cuda")
    if dout is None:        # the big one: forward only (its backward would move another 256 MiB)
        return [_bits(out), _bits(lse)]
    g = bwd(dout, q, k, v, out, lse, **lengths, **opts, device="cuda")
    return [_bits(x) for x in (out, lse, g.dq, g.dk, g.dv, g.dbias)]


def test_eight_threads_on_numpy_float16_get_the_single_thread_bits(cuda, rng):
    problems = _numpy_problems(rng)
    want = [_numpy_run(p) for p in problems]
    checksums = [[_bits(x) for x in p[1:4]] for p in problems]

    def work(i):
        return [_numpy_run(problems[i]) for _ in range(2)]

    for i, runs in enumerate(in_threads(work, N_THREADS, JOIN_SECONDS)):
        for got in runs:
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, want[i]):
                assert (a is None and b is None) or np.array_equal(a, b), f"problem {i}: {name} differs"
    for p, sums in zip(problems, checksums):
        assert all(np.array_equal(_bits(x), s) for x, s in zip(p[1:4], sums)), "an input changed"
    # and the single-thread answer is the right one (spot check: problem 1)
    kind, q, k, v, lengths, opts, _ = problems[1]
    out = attnext.attention(q, k, v, **opts, device="cuda")
    assert_close("out", out, reference.attention(q, k, v, **opts), F16)


def test_threads_on_the_per_thread_default_stream_with_captured_arrays(cuda, rng):
    """Threads whose inputs live on the per-thread default stream (another stream in each
    thread) call with a mask_mod and a score_mod that capture NumPy arrays: mod_cache gives
    such a call no copy or block mask another thread made, so each gets the reference's answer,
    twice."""
    S, H, D = 300, 2, 64
    doc = np.repeat(np.arange(3) % 2, 100)           # ids in two runs each: a block mask, not varlen
    table = rng.standard_normal((H, 2 * S)).astype(np.float32)

    def mask(b, h, q, k):
        return doc[q] == doc[k]

    def score(s, b, h, q, k):
        return s + table[h, q - k + S]
    problems = [[rng.standard_normal((1, S, H, D), dtype=np.float32).astype(F16) for _ in range(3)]
                for _ in range(N_THREADS)]
    want = [reference.attention(*p, score_mod=score, mask_mod=mask) for p in problems]

    def upload(x):
        d = device.empty(x.shape, x.dtype, 0, device.PER_THREAD_STREAM)
        _C.memcpy_htod(d.ptr, np.ascontiguousarray(x).view(np.uint8).reshape(-1), device.PER_THREAD_STREAM, 0)
        return d

    def work(i):
        q, k, v = (upload(x) for x in problems[i])
        return [attnext.attention(q, k, v, score_mod=score, mask_mod=mask).numpy() for _ in range(2)]

    for i, outs in enumerate(in_threads(work, N_THREADS, JOIN_SECONDS)):
        for out in outs:
            assert_close("out", out, want[i], F16)


# --- 2. the GIL ---

def test_gil_released_during_a_long_gpu_call_on_numpy_inputs(cuda, rng):
    """A Python thread keeps running while a ~0.3 s NumPy call (uploads, kernel, download) is on
    the GPU: with the GIL held, its longest pause would span the whole call. out= is given, so
    the call allocates no large host buffer itself."""
    s, hq, d = 98304, 16, 128
    q = rng.standard_normal((1, s, hq, d), dtype=np.float32).astype(F16)
    k = rng.standard_normal((1, s, 1, d), dtype=np.float32).astype(F16)
    v = rng.standard_normal((1, s, 1, d), dtype=np.float32).astype(F16)
    out = np.empty((1, s, hq, d), F16)
    attnext.attention(q, k, v, out=out, device="cuda")    # compiles; allocates the pinned rings
    started, done = threading.Event(), threading.Event()
    span = []

    def work():
        started.set()
        try:
            t0 = time.perf_counter()
            attnext.attention(q, k, v, out=out, device="cuda")
            span.append(time.perf_counter() - t0)
        finally:
            done.set()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    started.wait()
    last, longest_pause, ticks = time.perf_counter(), 0.0, 0
    deadline = last + JOIN_SECONDS
    while not done.is_set() and last < deadline:
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
        ticks += 1
    worker.join(JOIN_SECONDS)
    assert span and span[0] > 0.1, f"the call is too short to tell ({span})"
    assert longest_pause < span[0] / 3 and ticks > 1000, (longest_pause, span[0], ticks)
    # the answer too: a row of an unmasked call depends on no other row, so the first 16 rows
    # are the reference's for q[:, :16]
    assert_close("out", out[:, :16], reference.attention(np.ascontiguousarray(q[:, :16]), k, v), F16)


# --- 3. memory ---

def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device_held(torch):
    """Device memory this process holds once every result dropped so far is freed (stream-ordered
    frees done, and the memory pool trimmed: it keeps up to cuda_backend.POOL_KEEP_BYTES of freed
    memory at a synchronisation, and would hand the control's results that memory again).

    The process's own figure from nvidia-smi (NVML, 1 MiB units) where it lists this process:
    the device's free memory moves with every other process on the GPU (pytest -n workers), which
    made a leak-free run read 16 MiB of growth. Else the device's used memory."""
    from attnext import _C
    gc.collect()
    torch.cuda.synchronize()
    _C.mem_pool_trim(0)
    try:
        rows = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout
        mine = [int(used) for pid, used in (r.split(",") for r in rows.splitlines() if "," in r)
                if int(pid) == os.getpid()]
    except (OSError, ValueError, subprocess.SubprocessError):
        mine = []
    if len(mine) == 1:
        return mine[0] * MiB
    free, total = torch.cuda.mem_get_info()
    return total - free


def _flat_over_10000_calls(torch, turn, control):
    """turn(i) 500 times to warm up (kernels, pools, caches), then 10,000 times: device memory
    and RSS grow by less than 16 MiB; then 200 results of control() kept alive (50 MiB at these
    shapes) must show, so the measure can see such growth."""
    for i in range(500):
        turn(i)
    held0, rss0 = _device_held(torch), _rss()
    for i in range(10000):
        turn(i)
    held1, rss1 = _device_held(torch), _rss()
    assert held1 - held0 < 16 * MiB, f"device memory grew by {(held1 - held0) / MiB:.1f} MiB over 10,000 calls"
    assert rss1 - rss0 < 16 * MiB, f"RSS grew by {(rss1 - rss0) / MiB:.1f} MiB over 10,000 calls"
    kept = [control() for _ in range(200)]
    held2 = _device_held(torch)
    assert held2 - held1 > 25 * MiB, f"the control's 50 MiB did not show ({(held2 - held1) / MiB:.1f} MiB)"
    del kept


def test_10000_small_torch_calls_grow_neither_device_memory_nor_rss(torch, rng):
    """10,000 calls in turns of five: forward with lse, forward into out=, backward, a decode
    forward (split-KV scratch), backward; every tenth turn also a refused call. Each result is
    >= 8 KiB, so one buffer leaked per call would be >= 80 MB: the bound is 16 MiB. The control
    keeps 200 outputs (50 MiB), which must show."""
    q, k, v = (_tensor(torch, x) for x in make_qkv(rng, 2, 128, 160, 8, 2, 64, 64, BF16))
    dec_q, dec_k, dec_v = (_tensor(torch, x) for x in make_qkv(rng, 1, 1, 2048, 8, 2, 64, 64, BF16))
    out, lse = attnext.attention(q, k, v, causal=True, return_lse=True)
    dout = _tensor(torch, randn(rng, tuple(out.shape), BF16))
    dst = torch.empty_like(out)

    def turn(i):
        r = i % 5
        if r == 0:
            attnext.attention(q, k, v, causal=True, return_lse=True)
        elif r == 1:
            attnext.attention(q, k, v, out=dst)
        elif r == 3:
            attnext.attention(dec_q, dec_k, dec_v)
        else:
            attnext.attention_backward(dout, q, k, v, out, lse, causal=True)
        if i % 50 == 0:
            with pytest.raises(ValueError, match="window"):
                attnext.attention(q, k, v, window=(-3, 0))

    _flat_over_10000_calls(torch, turn, lambda: attnext.attention(q, k, v))
    assert_close("out", _host(torch, dst), reference.attention(*(_host(torch, x) for x in (q, k, v))), BF16)


def test_10000_score_mod_and_mask_mod_calls_grow_neither_device_memory_nor_rss(torch, rng):
    """The check above with score_mod / mask_mod, whose calls keep things for the next ones:
    kernels and generated sources found again by structure (the callbacks are closures made
    afresh every turn, traced at every call), mod_cache's device copies of captured NumPy arrays
    (a document-id array changed in place every other turn among six contents, more than
    mod_cache.PER_SHAPE: copies uploaded, found again and pushed out) and the block masks made
    from them (keyed by those contents and a window constant over seven values: more than
    mod_cache.MASK_ENTRIES keys, masks kept, found and pushed out), a captured torch table read in
    place, array gradients (a NumPy array's downloaded, a torch tensor's made on the device), a
    decode forward reading captured slopes. Turns of five: forward with lse, forward into out=,
    backward, decode forward, backward (causal); every tenth turn also a lookup out of range
    refused (IndexError from the device's error record) and a callback refused while tracing.
    Same bounds and control as the plain test; then one call against the reference."""
    q, k, v = (_tensor(torch, x) for x in make_qkv(rng, 2, 128, 160, 8, 2, 64, 64, BF16))
    dec_q, dec_k, dec_v = (_tensor(torch, x) for x in make_qkv(rng, 1, 1, 2048, 8, 2, 64, 64, BF16))
    table = randn(rng, (8, 2 * 160 + 1), F32)              # relative position (q_idx - kv_idx)
    ttable = _tensor(torch, table)                         # the same values as a torch tensor
    slopes = rng.uniform(0.05, 0.5, 8).astype(F32)
    small = np.zeros(3, F32)
    # six document layouts of the 160 key positions, every id 0-3 present in each (the same
    # value range: the generated code does not change with the contents)
    docs = [np.repeat(np.arange(4), rng.multinomial(128, [0.25] * 4) + 8).astype(np.int32)
            for _ in range(6)]
    doc = docs[0].copy()

    def callbacks(i):
        """Call i's score_mods and mask_mod, made afresh; doc and the window w change with i."""
        doc[:] = docs[i // 10 % len(docs)]
        w = 24.0 + 8.0 * (i // 5 % 7)

        def score_mod(s, b, h, qi, ki):
            return s + table[h, qi - ki + 160] * 0.5

        def torch_score_mod(s, b, h, qi, ki):
            return s + ttable[h, qi - ki + 160] * 0.5

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (np.abs(qi - ki) < w)

        return score_mod, torch_score_mod, mask_mod

    score_mod, _, mask_mod = callbacks(0)
    out, lse = attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    dout = _tensor(torch, randn(rng, tuple(out.shape), BF16))
    dst = torch.empty_like(out)

    def turn(i):
        score_mod, torch_score_mod, mask_mod = callbacks(i)
        r = i % 5
        if r == 0:
            attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
        elif r == 1:
            attnext.attention(q, k, v, score_mod=torch_score_mod, mask_mod=mask_mod, out=dst)
        elif r == 2:
            g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, mask_mod=mask_mod)
            assert isinstance(g.dtensors["table"], np.ndarray)
        elif r == 3:
            attnext.attention(dec_q, dec_k, dec_v,
                              score_mod=lambda s, b, h, qi, ki: s - slopes[h] * np.abs(qi - ki))
        else:
            g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=torch_score_mod, causal=True)
            assert isinstance(g.dtensors["ttable"], torch.Tensor)
        if i % 50 == 0:
            with pytest.raises(IndexError, match="'small'"):
                attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + small[ki])
            with pytest.raises(TypeError, match="Python control flow"):
                attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s if qi > ki else -s)

    _flat_over_10000_calls(torch, turn,
                           lambda: attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod))
    score_mod, torch_score_mod, mask_mod = callbacks(10001)
    attnext.attention(q, k, v, score_mod=torch_score_mod, mask_mod=mask_mod, out=dst)
    want = reference.attention(*(_host(torch, x) for x in (q, k, v)), score_mod=score_mod, mask_mod=mask_mod)
    assert_close("out", _host(torch, dst), want, BF16)


def _pinned(rings):
    return [slot.buf for ring in rings for slot in ring.slots if slot.buf is not None]


def test_numpy_calls_reuse_the_pinned_rings(cuda, rng, monkeypatch):
    """2,000 rounds of a float16 NumPy forward + backward on the GPU (fewer than 10,000: each
    round moves ~2 MiB through the rings) allocate no pinned memory after the warm-up: the same
    PinnedBuffers, at most RING_SLOTS per direction; RSS stays flat. staging.reset() frees the
    rings, and the next call builds them again and is right."""
    q, k, v = make_qkv(rng, 2, 256, 300, 4, 2, 64, 64, F16)     # 256 KiB: past SMALL_BYTES
    assert q.nbytes > staging.SMALL_BYTES
    allocs = []
    host_alloc = _C.host_alloc

    def counting(*args, **kw):
        allocs.append(args)
        return host_alloc(*args, **kw)

    monkeypatch.setattr(_C, "host_alloc", counting)

    def round_():
        out, lse = attnext.attention(q, k, v, causal=True, return_lse=True, device="cuda")
        attnext.attention_backward(out, q, k, v, out, lse, causal=True, device="cuda")
        return out

    for _ in range(20):
        round_()
    rings = staging._rings()
    buffers = _pinned(rings)
    assert 0 < len(buffers) <= 2 * staging.RING_SLOTS
    pinned_bytes = sum(len(b) for b in buffers)
    n_allocs = len(allocs)
    gc.collect()
    rss0 = _rss()
    for _ in range(2000):
        round_()
    gc.collect()
    rss1 = _rss()
    assert len(allocs) == n_allocs, f"{len(allocs) - n_allocs} pinned allocations after the warm-up"
    assert staging._rings() == rings, "the rings were rebuilt"
    now = _pinned(rings)
    assert len(now) == len(buffers) and all(a is b for a, b in zip(now, buffers))
    assert sum(len(b) for b in now) == pinned_bytes
    assert rss1 - rss0 < 16 * MiB, f"RSS grew by {(rss1 - rss0) / MiB:.1f} MiB over 4,000 NumPy calls"

    staging.reset()
    assert staging._up is None and staging._down is None and staging._pool is None
    assert all(slot.buf is None for ring in rings for slot in ring.slots), "reset left pinned memory"
    out = round_()
    assert len(allocs) > n_allocs, "the rings were not built again"
    assert_close("out", out, reference.attention(q, k, v, causal=True), F16)


EXIT_SCRIPT = textwrap.dedent("""
    import numpy as np
    import attnext
    from attnext.cuda import staging
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 512, 4, 64)).astype(np.float16) for _ in range(3))
    out = attnext.attention(q, k, v, device="cuda")
    assert any(s.buf is not None for ring in staging._rings() for s in ring.slots)
    print(float(np.abs(out.astype(np.float32)).sum()) > 0)
""")


def test_pinned_rings_freed_at_exit(cuda):
    """A process that used the rings exits cleanly and promptly (atexit: staging.reset)."""
    env = dict(os.environ, PYTHONPATH=pythonpath())
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "True"
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60


# --- 4. CUDA failures leave the library usable ---

OOM = r"cuMemAlloc(Async|_v2) of \d+ bytes on device \d+ failed: CUDA_ERROR_OUT_OF_MEMORY"


def _assert_usable(torch, rng):
    """A torch forward + backward and a NumPy forward right after a failure: the reference's answer."""
    q, k, v = make_qkv(rng, 2, 150, 170, 4, 2, 64, 64, BF16)
    tq, tk, tv = (_tensor(torch, x) for x in (q, k, v))
    out, lse = attnext.attention(tq, tk, tv, causal=True, return_lse=True)
    r_out, r_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert_close("out", _host(torch, out), r_out, BF16)
    assert_lse_close(_host(torch, lse), r_lse, BF16)
    dout = randn(rng, r_out.shape, BF16)
    g = attnext.attention_backward(_tensor(torch, dout), tq, tk, tv, out, lse, causal=True)
    h_out, h_lse = _host(torch, out), _host(torch, lse)
    rg = reference.attention_backward(dout, q, k, v, h_out, h_lse, causal=True)
    g = attnext.Grads(*(_host(torch, x) for x in g[:3]), None, {})
    problems = compare_grads(g, rg, q, k, v, dout, h_out, r_out, None, dict(causal=True))
    assert not problems, "\n".join(problems)
    assert_close("out", attnext.attention(q, k, v, causal=True, device="cuda"), r_out, BF16)


def test_out_of_memory_is_memory_error_and_the_library_stays_usable(torch, rng):
    with pytest.raises(MemoryError, match=OOM):
        _C.mem_alloc(1 << 50, 0, 0)
    _assert_usable(torch, rng)
    # an attention call whose out (2**38 bytes) no GPU holds: stride-0 inputs cost nothing
    one = torch.randn(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    q, kv = one.expand(1, 2 ** 25, 64, 64), one.expand(1, 1, 64, 64)
    with pytest.raises(MemoryError, match=OOM):
        attnext.attention(q, kv, kv, return_lse=True)
    _assert_usable(torch, rng)
    lse = torch.zeros(1, 1, 1, device="cuda").expand(1, 64, 2 ** 25)
    with pytest.raises(MemoryError, match=OOM):
        attnext.attention_backward(q, q, kv, kv, q, lse)
    _assert_usable(torch, rng)


def test_invalid_launch_raises_and_the_library_stays_usable(torch, rng):
    """cuLaunchKernel refusing a configuration (too many threads, too much shared memory) is a
    RuntimeError naming the call and the error, and does not poison the context."""
    from helpers.driver import FILL_HEADER, TINY_KERNEL
    nvrtc.nvrtc()
    major, minor = _C.cuda_info(0)["compute_capability"]
    cubin, _ = _C.nvrtc_compile(TINY_KERNEL, "fill.cu", [f"--gpu-architecture=sm_{major}{minor}"],
                                [FILL_HEADER])
    fn = _C.module_function(_C.module_load(cubin, 0), "fill", 0)
    n = 256
    x = device.empty((n,), np.float32, 0)
    params = struct.pack("<Qfi", x.ptr, 1.5, n)
    too_many = _C.function_attributes(fn)["max_threads_per_block"] * 2
    launch = r"cuLaunchKernel failed: CUDA_ERROR_[A-Z_]+ \(.*\) at .*:\d+"
    with pytest.raises(RuntimeError, match=launch):
        _C.launch(fn, (1, 1, 1), (too_many, 1, 1), too_many * 4, 0, params)
    with pytest.raises(RuntimeError, match=launch):
        _C.launch(fn, (1, 1, 1), (n, 1, 1), 64 * MiB, 0, params)
    _C.launch(fn, (1, 1, 1), (n, 1, 1), n * 4, 0, params)
    np.testing.assert_array_equal(x.numpy(), np.full(n, 3.0, np.float32))
    _assert_usable(torch, rng)


# --- 5. bad inputs with CUDA arrays ---

# the tables' float32 data arguments run as bfloat16 on the GPU; their bfloat16 (a dtype that
# must disagree with q's) as float16
_DATA_ARGS = ("q", "k", "v", "dout", "out")
_ARRAY_ARGS = _DATA_ARGS + ("lse", "bias", "mask", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k",
                            "seqused_q", "seqused_k", "seqlens_q", "seqlens_k")


def _gpu_value(torch, arg, value):
    """The table's value as a CUDA array where torch can hold it (read-only arrays as a
    ReadOnlyCuda), else as it is (non-arrays, big-endian, masked, object, ... stay on the host)."""
    if arg not in _ARRAY_ARGS or type(value) is not np.ndarray:
        return value
    if not value.dtype.isnative or (value.dtype.kind not in "biufc" and value.dtype != BF16):
        return value
    dtype = value.dtype
    if arg in _DATA_ARGS:
        dtype = {F32: BF16, BF16: F16}.get(dtype, dtype)
    t = _tensor(torch, value, dtype)
    if t is None:
        return value
    return t if value.flags.writeable else ReadOnlyCuda(t)


def _is_cuda(x):
    return hasattr(type(x), "__cuda_array_interface__") and getattr(x, "is_cuda", True)


@pytest.fixture(scope="module")
def gpu_good(torch):
    """The battery's valid call of each function, its arrays as torch CUDA tensors."""
    return {fn: {arg: _gpu_value(torch, arg, x) for arg, x in args.items()}
            for fn, args in bad.GOOD.items()}


def _same_bits(torch, a, b):
    """Bit-for-bit equality (torch.equal says NaN != NaN, so an unchanged NaN input would fail)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _refused(torch, gpu_good, fn, changes, exc, match):
    """Calls fn on the GPU inputs with changes; asserts exc matching match and every CUDA input
    (the good ones and the changed ones) unchanged."""
    args = {**gpu_good[fn], "device": "cuda", **changes}
    cuda_args = {n: x for n, x in args.items() if isinstance(x, torch.Tensor) and x.is_cuda}
    before = {n: x.clone() for n, x in cuda_args.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(exc, match=match) as info:
            getattr(attnext, fn)(**args)
    for n, x in cuda_args.items():
        assert _same_bits(torch, x, before[n]), f"{n} changed by a refused call"
    return info


def _names(arg):
    return rf"\b{re.escape(arg)}\b"


@pytest.mark.parametrize("case", bad.BAD_INPUTS, ids=[bad.case_id(c) for c in bad.BAD_INPUTS])
def test_bad_input_with_cuda_arrays(case, torch, gpu_good):
    """The bad-input battery (contract/test_errors.py) with q, k, v (and every array it can) as
    CUDA tensors."""
    fn, arg, label, value, exc = case
    _refused(torch, gpu_good, fn, {arg: _gpu_value(torch, arg, value)}, exc, _names(arg))


@pytest.mark.parametrize("fn, label, changes, exc, match", bad.BAD_COMBINATIONS,
                         ids=[f"{c[0]}-{c[1]}" for c in bad.BAD_COMBINATIONS])
def test_bad_combination_with_cuda_arrays(fn, label, changes, exc, match, torch, gpu_good):
    changes = {arg: _gpu_value(torch, arg, x) for arg, x in changes.items()}
    _refused(torch, gpu_good, fn, changes, exc, match)


@pytest.mark.parametrize("fn, arg, value, exc", bad.BAD_MISMATCHES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(bad.BAD_MISMATCHES)])
def test_backward_mismatch_with_cuda_arrays(fn, arg, value, exc, torch, gpu_good):
    _refused(torch, gpu_good, fn, {arg: _gpu_value(torch, arg, value)}, exc, _names(arg))


_PLAIN_OUTS = [c for c in bad.BAD_OUTS if not isinstance(c[2], tuple)]


@pytest.mark.parametrize("fn, label, value, exc", _PLAIN_OUTS, ids=[f"{c[0]}-{c[1]}" for c in _PLAIN_OUTS])
def test_bad_out_with_cuda_arrays(fn, label, value, exc, torch, gpu_good):
    """The battery's out= cases: as CUDA arrays the table's exception; what stays on the host
    (big-endian, lists, str) is a TypeError: a GPU call writes only CUDA arrays."""
    value = _gpu_value(torch, "out", value)
    if not _is_cuda(value):
        exc = TypeError
    _refused(torch, gpu_good, fn, {"out": value}, exc, r"\bout\b")


@pytest.mark.parametrize("fn", bad.FORWARD)
@pytest.mark.parametrize("name", ["q", "k", "v", "bias"])
def test_out_aliasing_an_input_on_the_gpu(fn, name, torch, gpu_good):
    """out= sharing device memory with an input (both views of one torch buffer)."""
    good = gpu_good[fn]
    shape = (bad.B, bad.SQ, bad.HQ, bad.DV) if fn == "attention" else (bad.TQ, bad.HQ, bad.DV)
    size = int(np.prod(shape))
    if name == "bias":
        cols = bad.SK if fn == "attention" else 4      # varlen: max_seqlen_k
        buf = torch.randn(size, device="cuda")
        shared, out = buf[:cols], buf.view(torch.bfloat16)[:size].view(shape)
    else:
        x = good[name]
        buf = torch.empty(max(size, x.numel()), device="cuda", dtype=torch.bfloat16)
        shared = buf[:x.numel()].view(x.shape)
        shared.copy_(x)
        out = buf[:size].view(shape)
    _refused(torch, gpu_good, fn, {name: shared, "out": out}, ValueError, rf"out shares memory with {name}")


@pytest.mark.parametrize("fn", bad.FORWARD)
@pytest.mark.parametrize("kind", ["score_mod", "mask_mod"])
def test_out_aliasing_a_captured_array_on_the_gpu(fn, kind, torch, gpu_good):
    """out= sharing device memory with a CUDA array that score_mod / mask_mod captures (found by
    their pointer ranges, as for the inputs): heads written early would change what later heads
    read."""
    shape = (bad.B, bad.SQ, bad.HQ, bad.DV) if fn == "attention" else (bad.TQ, bad.HQ, bad.DV)
    buf = torch.zeros(int(np.prod(shape)), device="cuda", dtype=torch.bfloat16)
    if kind == "score_mod":
        table = buf[-bad.HQ:]

        def f(s, b, h, qi, ki):
            return s + table[h]
    else:
        ints = buf[:2 * bad.HQ].view(torch.int32)

        def f(b, h, qi, ki):
            return ints[h] == 0
    _refused(torch, gpu_good, fn, {kind: f, "out": buf.view(shape)}, ValueError,
             rf"out shares memory with the array '\w+' that {kind} captures")


def test_q_on_the_gpu_with_k_on_the_host(torch, gpu_good):
    host_k = _host(torch, gpu_good["attention"]["k"])
    _refused(torch, gpu_good, "attention", {"k": host_k}, TypeError,
             "q, k and v must all live on the GPU or all on the host, got q on cuda, k on the host, v on cuda")
    _refused(torch, gpu_good, "attention_backward", {"q": _host(torch, gpu_good["attention"]["q"])},
             TypeError, "all live on the GPU")


def test_arrays_on_different_gpus(torch, gpu_good):
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    g = gpu_good["attention"]
    _refused(torch, gpu_good, "attention", {"k": g["k"].to("cuda:1")}, ValueError, "different GPUs")
    bias = torch.ones(bad.SQ, bad.SK, device="cuda:1")
    _refused(torch, gpu_good, "attention", {"bias": bias}, TypeError, r"bias is a CUDA array on cuda:1")


def test_out_on_the_host_for_a_gpu_call(torch, gpu_good):
    out = np.zeros((bad.B, bad.SQ, bad.HQ, bad.DV), BF16)
    _refused(torch, gpu_good, "attention", {"out": out}, TypeError, r"out must be a CUDA array")
    assert not out.view(np.uint16).any(), "the host out= was written"


def test_read_only_cuda_arrays(torch, gpu_good, rng):
    """A read-only CUDA array (`__cuda_array_interface__` data flag) is read as an input and
    refused as out=."""
    q, k, v = make_qkv(rng, 1, 100, 120, 4, 2, 64, 64, BF16)
    ro = [ReadOnlyCuda(_tensor(torch, x)) for x in (q, k, v)]
    out = attnext.attention(*ro, causal=True)
    assert_close("out", np.asarray(out), reference.attention(q, k, v, causal=True), BF16)
    dst = ReadOnlyCuda(torch.zeros(1, 100, 4, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out is read-only"):
        attnext.attention(*ro, out=dst)
    assert not dst.t.any()


def test_read_only_dlpack():
    pytest.skip("neither torch nor CuPy exports a read-only (DLPack 1.0 READ_ONLY flag) CUDA tensor; "
                "the read-only flag is tested through __cuda_array_interface__ (test_read_only_cuda_arrays)")


def test_float32_cuda_tensors_run_on_the_gpu(torch, rng):
    """float32 CUDA tensors, forward and backward, on the GPU in place; the inputs untouched."""
    host = make_qkv(rng, 1, 20, 30, 2, 2, 16, 16, F32)
    q, k, v = (_tensor(torch, x) for x in host)
    before = [x.clone() for x in (q, k, v)]
    out, lse = attnext.attention(q, k, v, return_lse=True)
    assert out.dtype == torch.float32 and out.is_cuda
    g = attnext.attention_backward(out, q, k, v, out, lse)
    assert g.dq.dtype == torch.float32 and g.dq.is_cuda
    assert_close("out", _host(torch, out), reference.attention(*host), F32)
    assert all(_same_bits(torch, a, b) for a, b in zip((q, k, v), before))


# --- 6. NaN and Inf in CUDA arrays ---

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "minus_inf"])
@pytest.mark.parametrize("where, index", bad.NONFINITE, ids=[w for w, _ in bad.NONFINITE])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_nonfinite_cuda_data_propagate(dtype, where, index, value, causal, torch):
    """The NaN / Inf cases of contract/test_errors.py as torch CUDA tensors: out is NaN exactly
    where the reference's is (a NaN q row, a +inf score: that row; a NaN key: every row that
    keeps it), lse is non-finite exactly where the reference's is, finite values agree, and no
    NaN of the reference's gradients goes missing."""
    arrays = dict(q=bad.randn_seeded(21, (2, 9, 2, 8), dtype), k=bad.randn_seeded(22, (2, 11, 2, 8), dtype),
                  v=bad.randn_seeded(23, (2, 11, 2, 8), dtype), bias=bad.randn_seeded(24, (2, 2, 9, 11), F32))
    arrays[where][index] = value
    opts = dict(causal=causal)
    bias = arrays.pop("bias")
    gpu = {n: _tensor(torch, x) for n, x in arrays.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = attnext.attention(**gpu, bias=_tensor(torch, bias), **opts, return_lse=True)
        out, lse = _host(torch, out), _host(torch, lse)
        r_out, r_lse = reference.attention(**arrays, bias=bias, **opts, return_lse=True)
        assert np.array_equal(np.isnan(out), np.isnan(r_out)), \
            f"NaN at {np.argwhere(np.isnan(out) != np.isnan(r_out))[:6].tolist()}"
        assert np.array_equal(np.isfinite(lse), np.isfinite(r_lse))
        assert np.array_equal(lse == -np.inf, r_lse == -np.inf)
        finite = np.isfinite(r_out)
        np.testing.assert_allclose(out[finite].astype(F64), r_out[finite], rtol=5e-2, atol=5e-2)
        dout = bad.randn_seeded(25, out.shape, dtype)
        g = attnext.attention_backward(_tensor(torch, dout), **gpu, out=_tensor(torch, out),
                                       lse=_tensor(torch, lse), bias=_tensor(torch, bias), **opts)
        rg = reference.attention_backward(dout, **arrays, out=r_out.astype(dtype), lse=r_lse, bias=bias, **opts)
    # A pair the causal mask removes is never computed: its dbias is exactly 0 even in a NaN row
    # (the reference's 0 * NaN there is not a value of the gradient). README: NaN rows.
    sq, sk = arrays["q"].shape[1], arrays["k"].shape[1]
    masked = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq) if causal else np.zeros((sq, sk), bool)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), g[:4], rg[:4]):
        a = _host(torch, a).astype(F64)
        lost = np.isnan(b.astype(F64)) & ~np.isnan(a)
        if name == "dbias":
            lost &= ~masked
        assert not lost.any(), f"{name}: NaN of the reference's missing at {np.argwhere(lost)[:4].tolist()}"
    for name, x in gpu.items():
        assert np.array_equal(_bits(_host(torch, x)), _bits(arrays[name])), f"{name} changed"
