"""Kernel lab: the GPU timeline of one NumPy-in/NumPy-out forward, from CUDA events around each
copy and launch attnext enqueues (torch events recorded on attnext's streams).

    python bench/labs/lab_timeline.py [B S H D causal] [--batch-only] [--tail SHARE]

Prints, per operation in the order the GPU began them: its start and end (ms from the call's
start), the GB/s of a copy, the stream, and when the host enqueued it. The call runs a few
times first (kept registrations, plans, pools; the first one's out is checked against torch
SDPA on the same inputs); the timeline is of the last call. Events cost
a few microseconds each, so the call is a little slower than in lab_numpy.
"""
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository's attnext
import attnext  # noqa: E402
from attnext import _C  # noqa: E402
from attnext.cuda import backend as cuda_backend  # noqa: E402
import verify  # noqa: E402

WRAPPED = {"memcpy_htod": (2, "htod"), "memcpy_dtoh": (2, "dtoh"), "cuda_launch_attention": (4, "kernel"),
           "launch": (4, "kernel"), "memset_d8": (3, "memset")}


def nbytes(name, args):
    if name == "memcpy_htod":
        return memoryview(args[1]).nbytes
    if name == "memcpy_dtoh":
        return memoryview(args[0]).nbytes
    return 0


class Timeline:
    def __init__(self):
        self.ops = []
        self.saved = {}
        self.streams = {}

    def stream(self, handle):
        if handle not in self.streams:
            self.streams[handle] = torch.cuda.ExternalStream(handle) if handle else torch.cuda.default_stream()
        return self.streams[handle]

    def wrap(self, name):
        fn = getattr(_C, name)
        index, kind = WRAPPED[name]

        def wrapped(*args):
            s = self.stream(args[index])
            t = time.perf_counter()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(s)
            res = fn(*args)
            e1.record(s)
            label = kind if kind != "kernel" else f"kernel grid {tuple(args[1])}"
            self.ops.append((label, nbytes(name, args), args[index], t, e0, e1))
            return res
        self.saved[name] = fn
        setattr(_C, name, wrapped)

    def __enter__(self):
        for name in WRAPPED:
            self.wrap(name)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(_C, name, fn)


def copy_rates(nin, nout):
    """ms of nin bytes host->device alone, nout back alone, and both at once on two streams."""
    hi, ho = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in (nin, nout))
    di, do = (torch.empty(n, dtype=torch.uint8, device="cuda") for n in (nin, nout))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t) / 5

    def both():
        with torch.cuda.stream(s1):
            di.copy_(hi, non_blocking=True)
        with torch.cuda.stream(s2):
            ho.copy_(do, non_blocking=True)
    up = timed(lambda: di.copy_(hi, non_blocking=True))
    down = timed(lambda: ho.copy_(do, non_blocking=True))
    print(f"pinned copies: in {up:.3f} ms ({nin / up / 1e6:.1f} GB/s), out {down:.3f} ms "
          f"({nout / down / 1e6:.1f} GB/s), both at once {timed(both):.3f} ms, one after the other {up + down:.3f}")


def main():
    args = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and sys.argv[i - 1] != "--tail"]
    B, S, H, D = (int(x) for x in args[:4]) if args else (2, 8192, 16, 128)
    causal = args[4] == "1" if len(args) > 4 else True
    if "--batch-only" in sys.argv:
        cuda_backend._rows_sliceable = lambda o: False
    if "--tail" in sys.argv:
        cuda_backend.TAIL_SHARE = float(sys.argv[sys.argv.index("--tail") + 1])
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, S, H, D), np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    copy_rates(3 * q.nbytes, q.nbytes)
    got = attnext.attention(q, k, v, causal=causal, device="cuda")
    tq, tk, tv, tgot = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) for x in (q, k, v, got))
    verify.check("the NumPy call", {"out": (tgot, verify.sdpa(tq, tk, tv, causal))})
    del tq, tk, tv, tgot
    for _ in range(5):
        attnext.attention(q, k, v, causal=causal, device="cuda")
    torch.cuda.synchronize()
    with Timeline() as tl:
        base = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        base.record()
        attnext.attention(q, k, v, causal=causal, device="cuda")
        t1 = time.perf_counter()
        torch.cuda.synchronize()
    print(f"B{B} S{S} H{H} D{D} causal={causal}: wall {1e3 * (t1 - t0):.3f} ms, {len(tl.ops)} operations")
    names = {}
    rows = []
    for label, n, handle, t, e0, e1 in tl.ops:
        a, b = base.elapsed_time(e0), base.elapsed_time(e1)
        rows.append((a, b, label, n, names.setdefault(handle, f"s{len(names)}"), 1e3 * (t - t0)))
    for a, b, label, n, sname, host in sorted(rows):
        rate = f"{n / (b - a) / 1e6:6.1f} GB/s" if n and b > a else ""
        size = f"{n / 2**20:7.2f} MiB" if n else ""
        print(f"  {a:7.3f} - {b:7.3f} ({b - a:6.3f})  {sname:4s} {label:28s} {size:11s} {rate:12s} host {host:7.3f}")


if __name__ == "__main__":
    main()
