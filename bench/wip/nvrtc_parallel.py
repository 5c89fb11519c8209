"""Scratch: do compiles in parallel threads slow each other? (wall of each alone, then together;
_C.nvrtc_compile releases the GIL, as kernels.prefetch uses it). Median of 3."""
import concurrent.futures
import os
import statistics
import time

from nvrtc_time import _C, bwd_args, fwd_args, gen_of, kernels, rel_bias, softcap

kernels.nvrtc()
sc, rb = gen_of(softcap), gen_of(rel_bias)
JOBS = {"fwd": fwd_args(sc)[0], "dkdv": bwd_args(sc, "attn_bwd_dkdv_sm90", "recompute"),
        "dq": bwd_args(sc, "attn_bwd_dq_sm90", "recompute"),
        "dkdv_ws": bwd_args(sc, "attn_bwd_dkdv_ws_sm90", "ordered"),
        "rel_dkdv": bwd_args(rb, "attn_bwd_dkdv_sm90", "recompute"),
        "rel_dq": bwd_args(rb, "attn_bwd_dq_sm90", "recompute")}
print("cores:", os.cpu_count(), "load:", os.getloadavg())


def one(name):
    t0 = time.perf_counter()
    c0 = time.thread_time()
    _C.nvrtc_compile(*JOBS[name])
    return time.perf_counter() - t0, time.thread_time() - c0


def together(names):
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        t0 = time.perf_counter()
        fs = [pool.submit(one, n) for n in names]
        res = [f.result() for f in fs]
        return time.perf_counter() - t0, res


alone = {}
for n in JOBS:
    runs = [one(n) for _ in range(3)]
    alone[n] = statistics.median(r[0] for r in runs)
    print(f"alone {n:9s} wall {alone[n]:.2f}s cpu {statistics.median(r[1] for r in runs):.2f}s")
for names in (("dkdv", "dq"), ("rel_dkdv", "rel_dq"), ("fwd", "dkdv"), ("fwd", "fwd"),
              ("fwd", "dkdv", "dq"), ("fwd", "dkdv", "dq", "rel_dkdv")):
    runs = [together(names) for _ in range(3)]
    wall = statistics.median(r[0] for r in runs)
    each = [statistics.median(r[1][i][0] for r in runs) for i in range(len(names))]
    cpu = [statistics.median(r[1][i][1] for r in runs) for i in range(len(names))]
    print(f"together {'+'.join(names):30s} wall {wall:.2f}s (slowest alone {max(alone[n] for n in names):.2f}, "
          f"sum alone {sum(alone[n] for n in names):.2f}); each wall {['%.2f' % e for e in each]} "
          f"thread cpu {['%.2f' % c for c in cpu]}")
