"""Kernel lab: the NumPy-in/NumPy-out forward as it ships (register staging, kept registrations,
pooled pinned results) against the pinned-copy floor, per bench case, and where its time goes.

    python bench/labs/lab_numpy.py [--profile] [--slices] [--calls]

Rows per case: the same arrays every call (what bench_cuda's NumPy row times: the registrations
are kept from the second call on), fresh copies of the inputs every call (made outside the
timing: each call registers its inputs and gives them back), and ATTNEXT_STAGING=ring;
--slices: the same arrays with other slices (cuda_backend.SLICE_BYTES, TAIL_SHARE), and batch
slices only (no row slices). The call on torch arrays (one launch) is checked against torch
SDPA, and the first result of each row against it (bitwise, or within the labs' tolerance where
row slices take other tiles). --calls: each call's time, in order. --profile: cProfile of 10
same-array calls.
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository's attnext
import attnext  # noqa: E402
from attnext import _C, _env  # noqa: E402
from attnext.cuda import pinning  # noqa: E402
from attnext.bench.cuda import Run, pinned_copies  # noqa: E402
import verify  # noqa: E402

CASES = ((8, 2048, 16, 128, False), (2, 8192, 16, 128, True))
REPS = 10


def floor_ms(nin, nout):
    """bench_cuda's floor for these bytes."""
    copies = pinned_copies(nin, nout, "cuda")
    copies()
    return Run("cuda", None, (), torch.cuda.synchronize).wall_median(copies, REPS)


def timed(call, prepare, check=None):
    out = call(*(prepare() or ()))
    if check is not None:
        check(out)
    times = []
    for _ in range(REPS):
        args = prepare()
        t0 = time.perf_counter()
        call(*(args or ()))
        times.append(time.perf_counter() - t0)
    if "--calls" in sys.argv:
        print("    calls (ms):", " ".join(f"{1e3 * t:.2f}" for t in times), flush=True)
    return 1e3 * float(np.median(times))


def main():
    print(torch.cuda.get_device_name(), flush=True)
    rng = np.random.default_rng(1)
    for B, S, H, D, causal in CASES:
        q, k, v = (rng.standard_normal((B, S, H, D), np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
        nin, nout = 3 * q.nbytes, q.nbytes
        fl = floor_ms(nin, nout)
        tq, tk, tv = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) for x in (q, k, v))
        want = attnext.attention(tq, tk, tv, causal=causal)
        verify.check(f"B{B} S{S} on torch arrays", {"out": (want, verify.sdpa(tq, tk, tv, causal))})
        want = want.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        del tq, tk, tv                         # the same call on the GPU's arrays: one launch
        print(f"B{B} S{S} H{H} D{D} causal={causal}: floor {fl:.3f} ms", flush=True)

        def check(out):        # row slices may take other tiles: bits may differ, values may not
            if not np.array_equal(out.view(np.uint16), want.view(np.uint16)):
                err = verify.check("the NumPy call", {"out": (out.astype(np.float32), want.astype(np.float32))})
                print(f"    NOT the bits of the call on torch arrays: off by {err:.3g}", flush=True)

        def same():
            return attnext.attention(q, k, v, causal=causal, device="cuda")

        def fresh(qq, kk, vv):
            return attnext.attention(qq, kk, vv, causal=causal, device="cuda")
        for mode in ("register", "ring"):
            _env.setenv("ATTNEXT_STAGING", mode)
            t = timed(same, lambda: None, check)
            print(f"  {mode:8s} same arrays      {t:7.3f} ms  {t / fl:5.2f}x floor", flush=True)
            t = timed(fresh, lambda: (q.copy(), k.copy(), v.copy()), check)
            print(f"  {mode:8s} fresh copies     {t:7.3f} ms  {t / fl:5.2f}x floor", flush=True)
        _env.setenv("ATTNEXT_STAGING", "register")
        if "--slices" in sys.argv:   # cuda_backend.SLICE_BYTES and TAIL_SHARE; batch slices only
            from attnext.cuda import backend as cuda_backend
            saved = cuda_backend.SLICE_BYTES, cuda_backend.TAIL_SHARE, cuda_backend._rows_sliceable
            for mib, tail in ((64, 0), (32, 0), (64, 1 / 4), (64, 1 / 8), (64, 1 / 16), (32, 1 / 8)):
                cuda_backend.SLICE_BYTES, cuda_backend.TAIL_SHARE = mib << 20, tail or 1 / 8
                cuda_backend._rows_sliceable = saved[2] if tail else (lambda o: False)
                t = timed(same, lambda: None, check)
                print(f"  slices of {mib:3d} MiB, {f'tail {tail:.4g}' if tail else 'batch only':10s} same arrays "
                      f"{t:7.3f} ms  {t / fl:5.2f}x floor", flush=True)
            cuda_backend.SLICE_BYTES, cuda_backend.TAIL_SHARE, cuda_backend._rows_sliceable = saved
        print(f"  kept {pinning.kept_bytes() / 2**20:.0f} MiB, pool {_C.host_pool()}", flush=True)
        if "--profile" in sys.argv:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(REPS):
                attnext.attention(q, k, v, causal=causal, device="cuda")
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        pinning.forget_kept()


if __name__ == "__main__":
    main()
