"""Kernel lab: the host path of one GPU call (api.py -> cuda/backend.py -> _C -> the driver), timed
per call over many calls, and where its time goes (cProfile's self time summed per module).

    python bench/labs/lab_host.py --fake [--calls 10000] [--parts] [--profile] [--cases plain,decode1,...]
    python bench/labs/lab_host.py [--torch] [--parts]   (a real GPU: DeviceArray or torch inputs)

--fake builds tests/helpers/fake_libcuda.c (the driver on host memory: launches do nothing) and
runs on it, so no GPU is needed and the numbers are the host path alone, this machine's. On a GPU
the calls are asynchronous: the per-call time is the host's as long as the kernels keep up.
Inputs are attnext.cuda.arrays.DeviceArray objects (their __cuda_array_interface__ costs little); --torch takes
torch tensors instead (whose interface property builds a dict on every read).

--parts splits the call: "checks" is checks.normalise replayed alone (argument checks, views of
the CUDA arrays), "launch" the call's _C.cuda_launch_attention calls replayed alone (argument
parsing and the driver's launch), "backend" the rest (out= checks, plan, scratch, results).
Repeated forward calls replay their launches (attnext/cuda/repeat.py); --whole times the whole
path instead (ATTNEXT_REPEAT=0), which --parts implies.
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

ROOT = Path(__file__).resolve().parents[2]

# (name, what, B, Sq, Sk, Hq, Hk, D, options): what is "fwd" (out= given, no lse: the bench's
# forward), "fwd_new" (fresh out and lse), "bwd" (attention_backward)
CASES = {
    "plain": ("fwd", 8, 2048, 2048, 16, 16, 128, {}),
    "plain_new": ("fwd_new", 8, 2048, 2048, 16, 16, 128, dict(return_lse=True)),
    "short": ("fwd", 32, 512, 512, 16, 16, 128, dict(causal=True)),
    "decode1": ("fwd", 1, 1, 32768, 32, 8, 128, {}),
    "decode8": ("fwd", 8, 1, 8192, 32, 8, 128, {}),
    "bwd": ("bwd", 8, 2048, 2048, 16, 16, 128, dict(causal=True)),
    # score_mod / mask_mod ([3/4]'s rows, bench/labs/lab_mods.py): the trace, the captured arrays and
    # the block mask are part of every call's host path
    "softcap": ("fwd", 2, 8192, 8192, 16, 16, 128, dict(causal=True, score_mod="softcap")),
    "relbias": ("fwd", 2, 8192, 8192, 16, 16, 128, dict(causal=True, score_mod="relbias")),
    "doc": ("fwd", 1, 16384, 16384, 16, 16, 128, dict(mask_mod="doc")),
    "doc_bwd": ("bwd", 1, 16384, 16384, 16, 16, 128, dict(mask_mod="doc")),
    "window_bwd": ("bwd", 2, 8192, 8192, 16, 16, 128, dict(mask_mod="window")),
}


def _mods(opts, Sk, Hq):
    """opts with the named score_mod / mask_mod made into functions (their arrays: NumPy)."""
    import numpy as np
    opts = dict(opts)
    if opts.get("score_mod") == "softcap":
        opts["score_mod"] = lambda s, b, h, qi, ki: 30.0 * np.tanh(s / 30.0)
    elif opts.get("score_mod") == "relbias":
        table = np.random.default_rng(0).standard_normal((Hq, 2 * Sk)).astype(np.float32)
        opts["score_mod"] = lambda s, b, h, qi, ki: s + table[h, qi - ki + Sk]
    if opts.get("mask_mod") == "doc":
        from attnext.bench.cuda import document_lengths
        doc = np.repeat(np.arange(len(document_lengths())), document_lengths())
        opts["mask_mod"] = lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi)
    elif opts.get("mask_mod") == "window":
        opts["mask_mod"] = lambda b, h, qi, ki: (ki <= qi) & (qi - ki < 1024)
    return opts


def _fake_driver():
    """Builds the fake libcuda and points attnext at it (before anything loads the driver)."""
    sys.path.insert(0, str(ROOT / "tests"))        # the helpers package
    from helpers import fake_cuda
    lib = fake_cuda.build(tempfile.mkdtemp(prefix="attnext-fake-"))
    os.environ["ATTNEXT_LIBCUDA"] = lib
    return lib


def _inputs(attnext, device, case, use_torch):
    what, B, Sq, Sk, Hq, Hk, D, opts = case
    opts = _mods(opts, Sk, Hq)
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


def parts(attnext, _C, call, n, sync):
    """(seconds per call of checks.normalise, of the call's launches), each replayed alone with
    the arguments one call gave them."""
    from attnext import checks
    normalise, launch = checks.normalise, _C.cuda_launch_attention
    seen = {"normalise": [], "launch": []}

    def spy_normalise(*a, **kw):
        seen["normalise"].append((a, kw))
        return normalise(*a, **kw)

    def spy_launch(*a):
        seen["launch"].append(a)
        return launch(*a)

    checks.normalise, _C.cuda_launch_attention = spy_normalise, spy_launch
    try:
        call()
    finally:
        checks.normalise, _C.cuda_launch_attention = normalise, launch
    (a, kw), = seen["normalise"]
    launches = seen["launch"]
    t_checks = min(timed(lambda: normalise(*a, **kw), n, sync) for _ in range(3))

    def relaunch():
        for args in launches:
            launch(*args)
    return t_checks, min(timed(relaunch, n, sync) for _ in range(3))


def timed(call, n, sync):
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    sync()
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", action="store_true",
                    help="run on tests/helpers/fake_libcuda.c (no GPU)")
    ap.add_argument("--torch", action="store_true", help="torch CUDA tensors as inputs (a real GPU)")
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--profile", action="store_true", help="cProfile: self time per module")
    ap.add_argument("--top", type=int, default=0, help="with --profile: the top N functions too")
    ap.add_argument("--parts", action="store_true", help="time checks, backend and launch apart (implies --whole)")
    ap.add_argument("--whole", action="store_true", help="no replay of repeated calls (ATTNEXT_REPEAT=0)")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    if args.whole or args.parts:
        os.environ["ATTNEXT_REPEAT"] = "0"         # read when attnext is imported, below
    if args.fake:
        _fake_driver()
    sys.path.insert(0, str(ROOT))
    import attnext
    from attnext import _C
    from attnext.cuda import arrays as device
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
        if args.parts:
            checks, launch = parts(attnext, _C, call, args.calls, sync)
            print(f"    checks {checks * 1e6:.1f} us, backend {(per_call - checks - launch) * 1e6:.1f} us, "
                  f"launch {launch * 1e6:.1f} us", flush=True)
        if args.profile:
            per, stats = profile(call, min(args.calls, 2000))
            total = sum(per.values())
            shares = sorted(per.items(), key=lambda kv: -kv[1])
            print("    self time under cProfile (scaled to the unprofiled call): " + ", ".join(
                f"{m} {t / total * per_call * 1e6:.1f}" for m, t in shares if t / total > 0.02))
            if args.top:
                stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
