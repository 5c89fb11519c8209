"""Kernel lab: what a first call from the disk cache pays to load its modules (cuModuleLoadData),
per cubin, with and without -lineinfo, one after another and in threads.

    ATTNEXT_CACHE_DIR=cache python3 bench/labs/lab_modload.py

Fills the cache folder with the relative-bias score_mod's forward and backward kernels (a first
call, compiled), then times loading each cubin in the folder in this process (fresh modules each
time: a module per load), the same kernels compiled without -lineinfo, and all of them loaded in
parallel threads (module_load releases the GIL).
"""
import concurrent.futures
import glob
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository's attnext
import attnext  # noqa: E402
from attnext import _C  # noqa: E402
from attnext.bench import mods as bench_mods  # noqa: E402
from attnext.cuda import cache as kernel_cache, nvrtc, select  # noqa: E402


def ms(fn, reps=3):
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best.append(1e3 * (time.perf_counter() - t0))
    return min(best)


def loads(cubins, label):
    """Each cubin loaded (its best of 3), one after another."""
    total = 0.0
    for c in cubins:
        t = ms(lambda: _C.module_load(c, 0))
        total += t
        print(f"  {label}load {len(c) / 1024:7.0f} KiB: {t:6.2f} ms", flush=True)
    print(f"  {label}serial total {total:.1f} ms")


def main():
    case = bench_mods.mod_case("relbias")
    kw = dict(bench_mods.attnext_mods(case), device="cuda")
    q, k, v, dout = (torch.randn(case.B, case.S, case.H, case.D, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
    attnext.attention_backward(dout, q, k, v, out, lse, **kw)
    torch.cuda.synchronize()
    folder = os.path.join(kernel_cache.default_cache_dir(), f"v{kernel_cache.FORMAT_VERSION}")
    cubins = []
    for path in sorted(glob.glob(os.path.join(folder, "*.cubin"))):
        key = os.path.basename(path)[:-6]
        cubins.append(kernel_cache.decode_entry(key, open(path, "rb").read()))
    loads(cubins, "")
    with concurrent.futures.ThreadPoolExecutor(len(cubins)) as pool:
        t = ms(lambda: list(pool.map(lambda c: _C.module_load(c, 0), cubins)))
    print(f"  all in {len(cubins)} threads: {t:.1f} ms", flush=True)
    # the same kernels without -lineinfo
    orig = nvrtc.options
    nvrtc.options = lambda defines, arch: [o for o in orig(defines, arch) if o != "-lineinfo"]
    seen = []
    nvrtc._cubins = kernel_cache.CubinCache(nvrtc._compile, cache_dir=False)
    nvrtc._functions.clear()
    nvrtc._modules.clear()
    load = _C.module_load
    _C.module_load = lambda c, d=0: seen.append(c) or load(c, d)
    out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
    attnext.attention_backward(dout, q, k, v, out, lse, **kw)
    _C.module_load = load
    loads(seen, "no lineinfo: ")


if __name__ == "__main__":
    main()
