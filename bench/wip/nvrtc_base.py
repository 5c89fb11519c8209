"""Scratch: baseline NVRTC times (median of 3) of the softcap / rel_bias entry points and the
plain whole attn_bwd.cu, through _C.nvrtc_compile and through ctypes (same thing)."""
import statistics
import sys
import time

from nvrtc_time import (FEATURES, Nvrtc, _C, bwd_args, fwd_args, gen_of, kernels, rel_bias,
                        softcap)

nv = Nvrtc()
print("NVRTC", nv.version, nv.path)


def c_median(args, n=3):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        _C.nvrtc_compile(*args)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


plain = kernels.compile_args("attn_bwd", kernels.bwd_defines(**FEATURES, tile=kernels.bwd_tile_config(128, 128)), "sm_90a")
rows = [("plain attn_bwd.cu whole (sm_90a)", plain)]
for mname, fn in (("softcap", softcap), ("rel_bias", rel_bias)):
    g = gen_of(fn)
    a, tile = fwd_args(g)
    rows.append((f"{mname} fwd attn_fwd_sm90 {tile}", a))
    for name, mode in (("attn_bwd_dkdv_sm90", "recompute"), ("attn_bwd_dq_sm90", "recompute"),
                       ("attn_bwd_dkdv_ws_sm90", "ordered")):
        if mname == "rel_bias" and mode == "ordered":
            continue
        rows.append((f"{mname} bwd {name} ({mode})", bwd_args(g, name, mode)))
only = sys.argv[1:]
for label, args in rows:
    if only and not any(o in label for o in only):
        continue
    m, ts = c_median(args)
    m2, ts2, (log, cubin) = nv.median(args)
    print(f"{label:55s} _C {m:5.2f}s {['%.2f' % t for t in ts]}  ctypes {m2:5.2f}s  cubin {len(cubin)} B")
