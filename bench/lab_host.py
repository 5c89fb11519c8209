"""Kernel lab: the host path of one GPU call (api.py -> cuda_backend.py -> _C -> the driver), timed
per call over many calls, and where its time goes (cProfile's self time summed per module).

    python bench/lab_host.py --fake [--calls 10000] [--profile] [--cases plain,decode1,...]
    python bench/lab_host.py [--torch]          (a real GPU: DeviceArray or torch inputs)

--fake builds tests/fake_libcuda.c (the driver on host memory: launches do nothing) and runs
on it, so no GPU is needed and the numbers are the host path alone, this machine's. On a GPU
the calls are asynchronous: the per-call time is the host's as long as the kernels keep up.
Inputs are attnext.DeviceArrays (their __cuda_array_interface__ costs little); --torch takes
torch tensors instead (whose interface property costs ~10 us per array on the H100's host).
"""
import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, what, B, Sq, Sk, Hq, Hk, D, options): what is "fwd" (out= given, no lse: the bench's
# forward), "fwd_new" (fresh out and lse), "bwd" (attention_backward)
CASES = {
    "plain": ("fwd", 8, 2048, 2048, 16, 16, 128, {}),
    "plain_new": ("fwd_new", 8, 2048, 2048, 16, 16, 128, dict(return_lse=True)),
    "short": ("fwd", 32, 512, 512, 16, 16, 128, dict(causal=True)),
    "decode1": ("fwd", 1, 1, 32768, 32, 8, 128, {}),
    "decode8": ("fwd", 8, 1, 8192, 32, 8, 128, {}),
    "bwd": ("bwd", 8, 2048, 2048, 16, 16, 128, dict(causal=True)),
}


def _fake_driver():
    """Builds the fake libcuda and points attnext at it (before anything loads the driver)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_cuda
    lib = fake_cuda.build(tempfile.mkdtemp(prefix="attnext-fake-"))
    os.environ["ATTNEXT_LIBCUDA"] = lib
    return lib


def _inputs(attnext, device, case, use_torch):
    what, B, Sq, Sk, Hq, Hk, D, opts = case
    import ml_dtypes
    import numpy as np
    bf16 = np.dtype(ml_dtypes.bfloat16)
    if use_torch:
        import torch

        def make(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    else:
        def make(*shape):
            return device.empty(shape, bf16)
    q, k, v, out = make(B, Sq, Hq, D), make(B, Sk, Hk, D), make(B, Sk, Hk, D), make(B, Sq, Hq, D)
    if what == "fwd":
        return lambda: attnext.attention(q, k, v, out=out, **opts)
    if what == "fwd_new":
        return lambda: attnext.attention(q, k, v, **opts)
    o, lse = attnext.attention(q, k, v, return_lse=True, **opts)
    return lambda: attnext.attention_backward(out, q, k, v, o, lse, **opts)


def _module_of(func):
    filename, _, name = func
    if filename == "~":
        return f"C: {name.split(' of ')[0].strip('<>')}"
    return Path(filename).name


def profile(call, n):
    """{module: self seconds per call} from cProfile over n calls, and the profiled total."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    stats = pstats.Stats(prof)
    per = defaultdict(float)
    for func, (_, _, tottime, _, _) in stats.stats.items():
        per[_module_of(func)] += tottime / n
    return dict(per), stats


def timed(call, n, sync):
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    sync()
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", action="store_true", help="run on tests/fake_libcuda.c (no GPU)")
    ap.add_argument("--torch", action="store_true", help="torch CUDA tensors as inputs (a real GPU)")
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--profile", action="store_true", help="cProfile: self time per module")
    ap.add_argument("--top", type=int, default=0, help="with --profile: the top N functions too")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    if args.fake:
        _fake_driver()
    sys.path.insert(0, str(ROOT))
    import attnext
    from attnext import _C, device
    if args.torch:
        import torch
        sync = torch.cuda.synchronize
    elif args.fake:
        def sync():
            pass
    else:
        def sync():
            _C.stream_synchronize(0)
    print(f"{'fake driver' if args.fake else attnext.info()['device_name']}, {args.calls} calls per case")
    for name in args.cases.split(","):
        case = CASES[name]
        call = _inputs(attnext, device, case, args.torch)
        for _ in range(200):           # compiles, caches, pools
            call()
        per_call = min(timed(call, args.calls, sync) for _ in range(3))
        what, B, Sq, Sk, Hq, Hk, D, opts = case
        print(f"{name:10s} {what:7s} B{B} Sq{Sq} Sk{Sk} Hq{Hq} Hk{Hk} D{D} {opts}: "
              f"{per_call * 1e6:7.1f} us per call", flush=True)
        if args.profile:
            per, stats = profile(call, min(args.calls, 2000))
            total = sum(per.values())
            parts = sorted(per.items(), key=lambda kv: -kv[1])
            print("    self time under cProfile (scaled to the unprofiled call): " + ", ".join(
                f"{m} {t / total * per_call * 1e6:.1f}" for m, t in parts if t / total > 0.02))
            if args.top:
                stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
