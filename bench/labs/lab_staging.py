"""Kernel lab: where a NumPy-in/NumPy-out forward's time goes (attnext/staging.py).

    python bench/lab_staging.py

On the bench's NumPy case (B8 S2048 H16 D128 bf16, q k v in, out back: 192 + 64 MiB): the
pinned-copy floor as bench_cuda measures it (and each direction alone, and both at once), the
host's copy rate into pinned memory per thread count, the first touch of a fresh output, staging's
uploads and downloads alone per ring setting, the kernel alone, and the whole call in one go and
in batch slices. Each result is checked before it is timed. Wall-clock medians.
"""
import concurrent.futures
import time

import ml_dtypes
import numpy as np
import torch

import attnext
from attnext import cuda_backend, staging

B, S, H, D = 8, 2048, 16, 128
MiB = 1 << 20


def median_ms(fn, reps=7, sync=True):
    times = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def floors(nin, nout):
    host_in, host_out = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in (nin, nout))
    dev_in, dev_out = (torch.empty(n, dtype=torch.uint8, device="cuda") for n in (nin, nout))
    side = torch.cuda.Stream()

    def both():
        dev_in.copy_(host_in, non_blocking=True)
        host_out.copy_(dev_out, non_blocking=True)

    def duplex():
        with torch.cuda.stream(side):
            host_out.copy_(dev_out, non_blocking=True)
        dev_in.copy_(host_in, non_blocking=True)
        side.synchronize()
    both()
    t = {"floor (bench)": median_ms(both),
         "htod alone": median_ms(lambda: dev_in.copy_(host_in, non_blocking=True)),
         "dtoh alone": median_ms(lambda: host_out.copy_(dev_out, non_blocking=True)),
         "both at once (2 streams)": median_ms(duplex)}
    for k, v in t.items():
        print(f"  {k:28s} {v:7.3f} ms", flush=True)
    print(f"  pinned GB/s: htod {nin / t['htod alone'] / 1e6:.1f}, dtoh {nout / t['dtoh alone'] / 1e6:.1f}")
    return t


def host_copy_rates(nbytes):
    src = np.random.default_rng(0).integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy().view(np.uint16)
    for threads in (1, 2, 4, 8, 12, 16):
        pool = concurrent.futures.ThreadPoolExecutor(threads)
        parts = np.array_split(np.arange(src.size), threads)

        def run():
            list(pool.map(lambda r: np.copyto(pinned[r[0]:r[-1] + 1], src[r[0]:r[-1] + 1]), parts))
        run()
        assert np.array_equal(pinned, src)
        ms = median_ms(run, sync=False)
        # the other way, into a pre-touched pageable array
        back = np.empty_like(src)

        def run_back():
            list(pool.map(lambda r: np.copyto(back[r[0]:r[-1] + 1], pinned[r[0]:r[-1] + 1]), parts))
        run_back()
        ms_back = median_ms(run_back, sync=False)

        def fresh():
            out = np.empty_like(src)
            list(pool.map(lambda r: np.copyto(out[r[0]:r[-1] + 1], pinned[r[0]:r[-1] + 1]), parts))
        ms_fresh = median_ms(fresh, sync=False)
        pool.shutdown()
        print(f"  {threads:2d} threads: to pinned {nbytes / ms / 1e6:6.1f} GB/s, from pinned "
              f"{nbytes / ms_back / 1e6:6.1f} GB/s, into a fresh array {nbytes / ms_fresh / 1e6:6.1f} GB/s",
              flush=True)


def staging_alone(q, k, v, label):
    out = np.empty_like(q)
    with staging.Staging(0, 0) as stage:
        views = [stage.upload(x) for x in (q, k, v)]
        stage.download(views[0], out)
    assert np.array_equal(out.view(np.uint16), q.view(np.uint16))

    def up():
        with staging.Staging(0, 0) as stage:
            for x in (q, k, v):
                stage.upload(x)
    keep = staging.Staging(0, 0)
    dev = keep.upload(q)

    def down_touched():
        keep.download(dev, out)

    def down_fresh():
        keep.download(dev, np.empty_like(q))
    t_up, t_dt, t_df = median_ms(up), median_ms(down_touched), median_ms(down_fresh)
    n_up = 3 * q.nbytes
    print(f"  {label:34s} up {t_up:6.2f} ms ({n_up / t_up / 1e6:5.1f} GB/s)  down {t_dt:5.2f} ms "
          f"({q.nbytes / t_dt / 1e6:5.1f} GB/s), into a fresh array {t_df:5.2f} ms", flush=True)


def main():
    print(torch.cuda.get_device_name(), flush=True)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, S, H, D), np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    nin, nout = 3 * q.nbytes, q.nbytes
    print(f"case B{B} S{S} H{H} D{D} bf16: {nin / MiB:.0f} MiB in, {nout / MiB:.0f} MiB out")
    print("floor (torch pinned tensors):")
    t_floor = floors(nin, nout)["floor (bench)"]

    print("host copies, 64 MiB:")
    host_copy_rates(q.nbytes)

    print("staging alone (chunk, slots, threads):")
    defaults = (staging.CHUNK_BYTES, staging.RING_SLOTS, staging.COPY_THREADS)
    for chunk, slots, threads in ((8, 4, 8), (4, 4, 8), (16, 4, 8), (8, 4, 4), (16, 4, 12)):
        staging.CHUNK_BYTES, staging.RING_SLOTS, staging.COPY_THREADS = chunk * MiB, slots, threads
        staging.reset()
        staging_alone(q, k, v, f"{chunk} MiB x {slots}, {threads} threads")
    staging.CHUNK_BYTES, staging.RING_SLOTS, staging.COPY_THREADS = defaults
    staging.reset()

    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda() for x in (q, k, v))
    want = attnext.attention(tq, tk, tv)
    t_kernel = median_ms(lambda: attnext.attention(tq, tk, tv))
    print(f"kernel alone (torch inputs): {t_kernel:.3f} ms")
    want = want.cpu().view(torch.int16).numpy().view(np.uint16)

    print("whole NumPy call (chunk, slots, threads):")
    for chunk, slots, threads in ((8, 4, 8), (16, 4, 12)):
        staging.CHUNK_BYTES, staging.RING_SLOTS, staging.COPY_THREADS = chunk * MiB, slots, threads
        staging.reset()
        for label, slice_bytes in (("one go", 1 << 62), ("2 slices", 128 * MiB),
                                   ("4 slices", 64 * MiB), ("8 slices", 32 * MiB)):
            cuda_backend.SLICE_BYTES = slice_bytes
            got = attnext.attention(q, k, v)
            ok = np.array_equal(got.view(np.uint16), want)
            t = median_ms(lambda: attnext.attention(q, k, v), reps=10)
            print(f"  {chunk} MiB x {slots}, {threads} threads, {label:9s} {t:7.3f} ms = "
                  f"{t / t_floor:.2f}x floor  bitwise {'ok' if ok else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
