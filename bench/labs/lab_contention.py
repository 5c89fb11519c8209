"""Kernel lab: how much NVRTC compiles running side by side slow each other on this host (the cold
first call's forward compiles while nvrtc.compile_ahead compiles the backward beside it).

    python3 bench/labs/lab_contention.py [--case softcap|doc_causal] [--repeat 2]

Needs NVRTC and a C compiler, not a GPU: the entry points come from the fake driver
(tests/helpers/fake_libcuda.c), as the bench's mods row plans them on Hopper (sm_90a), and each
compile calls _C.nvrtc_compile straight (no cache of attnext's, and CUDA_CACHE_DISABLE=1: NVRTC 13.0 on
the H100 hosts otherwise serves a program it compiled before from ~/.nv/ComputeCache in 0.06 s,
which made every number after the first of this lab's first run a hit). Prints the forward's
compile seconds alone, then beside 1..N of the backward's compiles started with it in threads
(each of those once), and the backward's compiles alone one after another; also the host's CPUs.
"""
import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))        # the helpers package


os.environ["CUDA_CACHE_DISABLE"] = "1"       # before NVRTC loads


def specs_of(case):
    """(forward specs, backward specs) of the case's call: (kernel, defines, generated) modules."""
    from helpers import fake_cuda
    os.environ["ATTNEXT_LIBCUDA"] = fake_cuda.build(tempfile.mkdtemp(prefix="attnext-fake-"))
    os.environ["ATTNEXT_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnext-lab-")
    import ml_dtypes
    import numpy as np
    import attnext
    from attnext.cuda import arrays as device
    from attnext.cuda import nvrtc, select
    got = {"fwd": [], "ahead": []}
    nvrtc.prefetch = lambda specs, arch, dev: got["fwd"].extend(specs) if not got["fwd"] else None
    nvrtc.compile_ahead = lambda specs, arch, busy=1: got["ahead"].extend(specs) or []
    nvrtc.cubin = lambda *a, **k: b"\x7fELF" + bytes(60)
    doc = np.repeat(np.arange(7), 8192 // 7 + 1)[:8192].astype(np.int32)
    kw = {"softcap": dict(causal=True, score_mod=lambda s, b, h, qi, ki: 30.0 * np.tanh(s / 30.0)),
          "doc_causal": dict(causal=True, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])}[case]
    q, k, v = (device.empty((2, 8192, 16, 128), np.dtype(ml_dtypes.bfloat16)) for _ in range(3))
    attnext.attention(q, k, v, return_lse=True, **kw)
    arch = "sm_90a"
    mods = lambda specs: [nvrtc.module_for(kn, name, d, g, arch) for kn, name, d, g in specs]
    return mods(got["fwd"]), mods(got["ahead"])


def compile_s(module):
    from attnext import _C
    from attnext.cuda import nvrtc, select
    t = time.perf_counter()
    _C.nvrtc_compile(*nvrtc.compile_args(*module[:2], "sm_90a", module[2]))
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="softcap")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    fwd, bwd = specs_of(args.case)
    from attnext.cuda import nvrtc, select
    nvrtc.nvrtc()
    print(f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable; case {args.case}: "
          f"forward {[m[0] for m in fwd]}, backward {len(bwd)} modules", flush=True)
    main_fwd = fwd[0]
    for _ in range(args.repeat):
        print(f"forward alone                {compile_s(main_fwd):.2f} s", flush=True)
    for n in range(1, len(bwd) + 1):
        for _ in range(args.repeat):
            others = [threading.Thread(target=compile_s, args=(m,)) for m in bwd[:n]]
            for t in others:
                t.start()
            s = compile_s(main_fwd)
            for t in others:
                t.join()
            print(f"forward beside {n} backward   {s:.2f} s", flush=True)
    for m in bwd:
        entry = [k[len("ATTN_ENTRY_"):] for k in m[1] if k.startswith("ATTN_ENTRY_") and k != "ATTN_ENTRY_ONLY"]
        print(f"backward {m[0]:14s} alone {compile_s(m):.2f} s  {entry or '(whole file)'}", flush=True)


if __name__ == "__main__":
    main()
