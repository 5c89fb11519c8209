"""Kernel lab: how close a NumPy-in/NumPy-out forward comes to the pinned-copy floor when its
host memory is already page-locked (the question before a registration cache for inputs and a
pool of pinned outputs: is the host side then the floor's DMAs, or is something else left?).

    python bench/lab_pinned.py

The bench's NumPy case (B8 S2048 H16 D128 bf16): the floor as bench_cuda measures it; attnext on
pageable inputs (ring; register), on inputs the lab registered beforehand (what a cache of
registrations would give from the second call on), with a fresh pageable output and with out=
page-locked memory (what a pool of pinned outputs would give); torch's own pinned pipeline.
Every result is checked against the first one. Wall-clock medians of REPS calls.
"""
import os
import time

import ml_dtypes
import numpy as np
import torch

import attnext
from attnext import _C, pinning
from attnext.bench_cuda import Run, pinned_copies

B, S, H, D = 8, 2048, 16, 128
REPS = 10


def median_ms(fn, reps=REPS):
    """bench_cuda's wall-clock median after one call."""
    fn()
    return Run("cuda", None, (), torch.cuda.synchronize).wall_median(fn, reps)


def pinned_like(a):
    buf = _C.host_alloc(a.nbytes, 0)
    return np.frombuffer(buf, a.dtype).reshape(a.shape), buf


def main():
    print(torch.cuda.get_device_name(), flush=True)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, S, H, D), np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    nin, nout = 3 * q.nbytes, q.nbytes
    t_floor = median_ms(pinned_copies(nin, nout, "cuda"))
    print(f"floor {t_floor:.3f} ms ({(nin + nout) / t_floor / 1e6:.1f} GB/s)", flush=True)

    want = attnext.attention(q, k, v, device="cuda")
    rows = []

    def row(name, fn):
        got = fn()
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), name
        t = median_ms(fn)
        rows.append((name, t))
        print(f"  {name:58s} {t:7.3f} ms  {t / t_floor:5.2f}x floor", flush=True)

    out_pinned, _keep = pinned_like(q)
    out_page = np.empty_like(q)
    out_page[...] = 0
    for mode in ("ring", "register"):
        os.environ["ATTNEXT_STAGING"] = mode
        row(f"{mode}: pageable in, fresh out", lambda: attnext.attention(q, k, v, device="cuda"))
        row(f"{mode}: pageable in, out= touched pageable",
            lambda: attnext.attention(q, k, v, device="cuda", out=out_page))
        row(f"{mode}: pageable in, out= pinned",
            lambda: attnext.attention(q, k, v, device="cuda", out=out_pinned))
    spans = pinning.unions([pinning.byte_range(x) for x in (q, k, v)])
    for lo, hi in spans:
        _C.host_register(lo, hi - lo, 0, False)
    t0 = time.perf_counter()
    print(f"  (registering the inputs: {len(spans)} spans)", flush=True)
    for mode in ("ring", "register"):
        os.environ["ATTNEXT_STAGING"] = mode
        row(f"{mode}: inputs registered, fresh out", lambda: attnext.attention(q, k, v, device="cuda"))
        row(f"{mode}: inputs registered, out= pinned",
            lambda: attnext.attention(q, k, v, device="cuda", out=out_pinned))
    for lo, _ in spans:
        _C.host_unregister(lo, 0)
    del t0

    # what a cache of registrations would hold: q, k, v and out= registered through pinning's
    # table by the lab (one user each), so every call's pieces find them (SHARED, no driver call)
    os.environ["ATTNEXT_STAGING"] = "register"
    held = []
    for lo, hi in pinning.unions([pinning.byte_range(x) for x in (q, k, v, out_page)]):
        for plo, phi in pinning.cut(lo, hi, pinning.PIECE_BYTES):
            entry, how = pinning._acquire(plo, phi, 0, False, (plo, phi - 1))
            assert how == pinning.OWN, how
            held.append(entry)
    row("register: q, k, v, out= held in pinning's table",
        lambda: attnext.attention(q, k, v, device="cuda", out=out_page))
    from attnext import cuda_backend
    saved = cuda_backend.SLICE_BYTES
    cuda_backend.SLICE_BYTES = 1 << 40
    row("  the same, no batch slices", lambda: attnext.attention(q, k, v, device="cuda", out=out_page))
    cuda_backend.SLICE_BYTES = saved
    pooled = np.frombuffer(_C.host_alloc(q.nbytes, 0, True), q.dtype).reshape(q.shape)
    row("register: q, k, v held, out= a pooled PinnedBuffer",
        lambda: attnext.attention(q, k, v, device="cuda", out=pooled))
    pinning.release_entries(held)
    tq_dev = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda() for x in (q, k, v)]
    t = median_ms(lambda: attnext.attention(*tq_dev))
    print(f"  {'kernel alone (torch CUDA inputs)':58s} {t:7.3f} ms", flush=True)

    # torch's pinned pipeline: pinned q, k, v -> device -> SDPA (flash) -> pinned out
    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).pin_memory() for x in (q, k, v))
    tout = torch.empty_like(tq).pin_memory()

    def torch_pinned():
        d = [x.to("cuda", non_blocking=True).transpose(1, 2) for x in (tq, tk, tv)]
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(*d)
        tout.copy_(o.transpose(1, 2), non_blocking=True)
    t = median_ms(torch_pinned)
    print(f"  {'torch: pinned in, flash, pinned out (serial)':58s} {t:7.3f} ms  {t / t_floor:5.2f}x floor")

    # the pieces: a fresh output's first touch; allocating pinned memory
    t = median_ms(lambda: np.empty_like(q).fill(0))
    print(f"  first touch of a fresh 64 MiB array: {t:.2f} ms")
    t = median_ms(lambda: _C.host_alloc(q.nbytes, 0), reps=3)
    print(f"  host_alloc + free of 64 MiB: {t:.2f} ms")
    t = median_ms(lambda: _C.host_alloc(nin, 0), reps=3)
    print(f"  host_alloc + free of 192 MiB: {t:.2f} ms")


if __name__ == "__main__":
    main()
