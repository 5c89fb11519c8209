"""Kernel lab: where a fresh process's first score_mod call goes when its kernels are on disk
(the [3/4] target: under 50 ms). Run it twice with the same ATTNEXT_CACHE_DIR: the first run
compiles and fills the cache, the second shows the disk path under cProfile.

    ATTNEXT_CACHE_DIR=cache python3 bench/labs/lab_first.py [--case=relbias] [--bwd]
    ATTNEXT_CACHE_DIR=cache python3 bench/labs/lab_first.py [--case=relbias] [--bwd] --profile

--case names one of the bench's mod rows (attnext/bench/mods.py KINDS; softcap when left out);
--bwd profiles the first backward (after a first forward, timed but not profiled); a second
call of the one profiled is timed after it (what the first costs beyond its work); --loads
prints each module load of the timed calls (thread, start, end, cubin size).
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import attnext  # noqa: E402
from attnext.bench import mods as bench_mods  # noqa: E402

kind = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--case=")), "softcap")
case = bench_mods.mod_case(kind)
kw = dict(bench_mods.attnext_mods(case), device="cuda")
bwd_kw = dict(bench_mods.attnext_backward_mods(case), device="cuda")
q, k, v, dout = (torch.randn(case.B, case.S, case.H, case.D, device="cuda", dtype=torch.bfloat16)
                 for _ in range(4))
torch.cuda.synchronize()
prof = cProfile.Profile() if "--profile" in sys.argv else None


def timed(what, call, profile):
    loads.clear()
    t0 = time.perf_counter()
    if profile:
        prof.enable()
    result = call()
    torch.cuda.synchronize()
    if profile:
        prof.disable()
    print(f"{case.name}: first {what} {time.perf_counter() - t0:.4f} s", flush=True)
    for name, a, b, n in loads:
        print(f"  module load {1e3 * (a - t0):6.1f} -> {1e3 * (b - t0):6.1f} ms  {n >> 10:5d} KiB  {name}")
    return result


loads = []
if "--loads" in sys.argv:       # each module load: thread, start and end (ms from the call), size
    import threading
    from attnext import _C
    _load = _C.module_load

    def _timed_load(cubin, device=0):
        t = time.perf_counter()
        m = _load(cubin, device)
        loads.append((threading.current_thread().name, t, time.perf_counter(), len(cubin)))
        return m
    _C.module_load = _timed_load
bwd = "--bwd" in sys.argv
out, lse = timed("forward", lambda: attnext.attention(q, k, v, return_lse=True, **kw), prof and not bwd)
if bwd:
    timed("backward", lambda: attnext.attention_backward(dout, q, k, v, out, lse, **bwd_kw), prof)
    timed("backward, second call", lambda: attnext.attention_backward(dout, q, k, v, out, lse, **bwd_kw), False)
else:
    timed("forward, second call", lambda: attnext.attention(q, k, v, return_lse=True, **kw), False)
if prof:
    st = pstats.Stats(prof)
    st.sort_stats("cumulative").print_stats(35)
    st.sort_stats("tottime").print_stats(20)
