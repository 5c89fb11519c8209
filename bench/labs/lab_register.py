"""Kernel lab: NumPy in / NumPy out with the caller's memory registered in place
(attnext/pinning.py) against the pinned rings (attnext/staging.py).

    python3 bench/lab_register.py

1. What pinning costs alone, in GB/s of the range: cuMemHostRegister and cuMemHostUnregister of
   64 MiB, for an array already touched (read-only and writable registration) and for a fresh
   np.empty (registering faults its pages in: the first touch), as one registration and as
   pinning.PIECE_BYTES pieces on staging's copy threads (what a call does).
2. For each NumPy case of the bench (attnext/bench_cuda.py's NUMPY_CASES, bf16): the pinned-copy
   floor as the bench measures it (q, k, v in and out back through pinned torch tensors), then
   attnext's NumPy call with ATTNEXT_STAGING=ring and =register (several piece sizes, one go and
   batch slices, with a fresh output and with out=). Every result is checked before it is timed:
   bitwise equal to the same call on torch CUDA inputs (the same kernel), so ring and register
   agree bit for bit. Wall-clock medians; for the default register setting, where its time
   goes: waiting for pieces to be locked, and giving them back at the end.
"""
import collections
import concurrent.futures
import os
import sys
import time

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attnext  # noqa: E402
from attnext import _C, bench_cuda, cuda_backend, pinning, staging  # noqa: E402

MiB = 1 << 20
REPS = 7
ALONE_BYTES = 64 * MiB


def median_ms(fn, reps=REPS):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def gbps(nbytes, ms):
    return nbytes / ms / 1e6


# ---------------------------------------------------------------- 1. pinning alone
def _span(a):
    lo, hi = pinning.byte_range(a)
    return pinning.unions([(lo, hi)])[0]


def _register_times(make, pieces, read_only):
    """Median ms of registering and of unregistering make()'s span (a fresh array each rep), in
    `pieces` bytes on the copy threads (None: one registration)."""
    pool = concurrent.futures.ThreadPoolExecutor(staging.COPY_THREADS)
    reg, unreg = [], []
    for _ in range(REPS):
        a = make()
        lo, hi = _span(a)
        parts = [(lo, hi)] if pieces is None else pinning.cut(lo, hi, pieces)
        t0 = time.perf_counter()
        ok = list(pool.map(lambda p: _C.host_register(p[0], p[1] - p[0], 0, read_only), parts))
        t1 = time.perf_counter()
        list(pool.map(lambda p: _C.host_unregister(p[0], 0), parts))
        t2 = time.perf_counter()
        assert all(ok), "a range was registered already"
        reg.append(t1 - t0)
        unreg.append(t2 - t1)
        del a
    pool.shutdown()
    return 1e3 * float(np.median(reg)), 1e3 * float(np.median(unreg))


def pinning_alone():
    ro_ok = pinning.read_only_supported(0)
    print(f"pinning alone, {ALONE_BYTES // MiB} MiB (GB/s of the range; read-only registration "
          f"{'supported' if ro_ok else 'NOT supported'}):")
    touched = np.ones(ALONE_BYTES, np.uint8)
    rows = [("touched", lambda: touched, False), ("fresh np.empty", lambda: np.empty(ALONE_BYTES, np.uint8), False)]
    if ro_ok:
        rows.insert(1, ("touched, read-only", lambda: touched, True))
    print(f"  {'array':22s} {'pieces':>14s} {'register':>16s} {'unregister':>16s} {'both':>8s}")
    for label, make, ro in rows:
        for pieces in (None, pinning.PIECE_BYTES):
            r, u = _register_times(make, pieces, ro)
            where = "one" if pieces is None else f"{pieces // MiB} MiB x {staging.COPY_THREADS}t"
            print(f"  {label:22s} {where:>14s} {r:6.2f} ms {gbps(ALONE_BYTES, r):5.1f} "
                  f"{u:6.2f} ms {gbps(ALONE_BYTES, u):5.1f} {gbps(ALONE_BYTES, r + u):6.1f}", flush=True)


# ---------------------------------------------------------------- 2. the NumPy calls
def floor_ms(nin, nout):
    """bench_cuda.numpy_row's floor: the same bytes through pinned torch tensors, one stream."""
    host_in, host_out = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in (nin, nout))
    dev_in, dev_out = (torch.empty(n, dtype=torch.uint8, device="cuda") for n in (nin, nout))

    def copies():
        dev_in.copy_(host_in, non_blocking=True)
        host_out.copy_(dev_out, non_blocking=True)
    copies()
    return median_ms(copies)


def _variants():
    """(label, ATTNEXT_STAGING, PIECE_BYTES, SLICE_BYTES, out=)."""
    piece, sliced = pinning.PIECE_BYTES, cuda_backend.SLICE_BYTES
    one_go = 1 << 62
    return [("ring", "ring", piece, sliced, False),
            ("ring, out=", "ring", piece, sliced, True),
            (f"register {piece // MiB} MiB", "register", piece, sliced, False),
            (f"register {piece // MiB} MiB, out=", "register", piece, sliced, True),
            (f"register {piece // MiB} MiB, one go", "register", piece, one_go, False),
            ("register 16 MiB", "register", 16 * MiB, sliced, False),
            ("register 64 MiB", "register", 64 * MiB, sliced, False),
            ("register whole arrays", "register", one_go, sliced, False)]


def on_torch_inputs(q, k, v, causal):
    """(the result's bits, ms) of the same call on torch CUDA tensors: the kernel alone."""
    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda() for x in (q, k, v))
    want = attnext.attention(tq, tk, tv, causal=causal)
    t_kernel = median_ms(lambda: attnext.attention(tq, tk, tv, causal=causal))
    return want.cpu().view(torch.int16).numpy().view(np.uint16), t_kernel


def where_register_waits(call):
    """ms per call spent waiting for pieces' registrations (Piece.direct, every thread that
    copies) and in the stage's final unpinning (streams synchronised, pieces unregistered)."""
    spent = collections.Counter()

    def timed(fn, key):
        def wrapper(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper
    direct, unpin = pinning.Piece.direct, staging.Staging._unpin
    pinning.Piece.direct, staging.Staging._unpin = timed(direct, "pieces"), timed(unpin, "unpin")
    try:
        for _ in range(REPS):
            call()
    finally:
        pinning.Piece.direct, staging.Staging._unpin = direct, unpin
    return {k: 1e3 * spent[k] / REPS for k in ("pieces", "unpin")}


def numpy_case(B, S, D, causal):
    H = bench_cuda.HEAD_FEATURES // D
    rng = np.random.default_rng(B * S)
    q, k, v = (rng.standard_normal((B, S, H, D), np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    nin, nout = 3 * q.nbytes, q.nbytes
    t_floor = floor_ms(nin, nout)
    print(f"\ncase B{B} S{S} H{H} D{D} bf16{' causal' if causal else ''}: {nin // MiB} MiB in, "
          f"{nout // MiB} MiB out; pinned-copy floor {t_floor:.3f} ms "
          f"({gbps(nin + nout, t_floor):.1f} GB/s)", flush=True)
    want, t_kernel = on_torch_inputs(q, k, v, causal)
    print(f"  kernel alone (torch inputs) {t_kernel:.3f} ms")
    print(f"  {'staging':30s} {'ms':>8s} {'x floor':>8s}  bitwise")
    saved = (os.environ.get("ATTNEXT_STAGING"), pinning.PIECE_BYTES, cuda_backend.SLICE_BYTES)
    out = np.zeros_like(q)                       # touched once: what out= reuses
    try:
        for label, mode, piece, slice_bytes, use_out in _variants():
            os.environ["ATTNEXT_STAGING"] = mode
            pinning.PIECE_BYTES, cuda_backend.SLICE_BYTES = piece, slice_bytes

            def call():
                return attnext.attention(q, k, v, causal=causal, out=out if use_out else None)
            ok = np.array_equal(call().view(np.uint16), want)
            t = median_ms(call)
            assert pinning.registered() == [], "a call left memory registered"
            print(f"  {label:30s} {t:8.3f} {t / t_floor:8.2f}  {'ok' if ok else 'WRONG'}", flush=True)
            if mode == "register" and piece == saved[1] and slice_bytes == saved[2] and not use_out:
                spent = where_register_waits(call)
                print(f"    per call: {spent['pieces']:.2f} ms waiting for pieces to be locked "
                      f"(summed over the threads copying), {spent['unpin']:.2f} ms giving them back "
                      f"at the end", flush=True)
    finally:
        env, pinning.PIECE_BYTES, cuda_backend.SLICE_BYTES = saved
        if env is None:
            os.environ.pop("ATTNEXT_STAGING", None)
        else:
            os.environ["ATTNEXT_STAGING"] = env


def main():
    print(torch.cuda.get_device_name(), f"- copy threads {staging.COPY_THREADS}, "
          f"MIN_BYTES {pinning.MIN_BYTES // MiB} MiB, PIECE_BYTES {pinning.PIECE_BYTES // MiB} MiB, "
          f"SLICE_BYTES {cuda_backend.SLICE_BYTES // MiB} MiB", flush=True)
    pinning_alone()
    for B, S, D, causal in bench_cuda.NUMPY_CASES:
        numpy_case(B, S, D, causal)


if __name__ == "__main__":
    main()
