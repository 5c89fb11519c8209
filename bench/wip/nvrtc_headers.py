"""Scratch: what the included headers cost (a trivial kernel that includes them, same defines),
and NVRTC's precompiled headers (--pch automatic; --create-pch / --use-pch explicit)."""
import os
import re
import shutil
import statistics
import sys

from nvrtc_time import Nvrtc, fwd_args, gen_of, softcap, to_ptx, with_options

nv = Nvrtc()
print("NVRTC", nv.version)
args, _ = fwd_args(gen_of(softcap))
src, fn, opts, hdrs = args
PH = re.compile(r"^[^,]+, ([^,]+), (\d+), ms$", re.M)


def timed(label, a, want="cubin", n=3):
    ts, phs, logs = [], [], []
    for _ in range(n):
        s, rc, log, out = nv.compile(*with_options(a, add=["--time=-"]), want=want)
        if rc:
            print(f"  {label:55s} FAILED rc={rc}: {log.strip()[-300:]}")
            return None
        ts.append(s)
        phs.append({k: int(v) for k, v in PH.findall(log)})
        logs.append(log)
    ph = {k: statistics.median(p.get(k, 0) for p in phs) for k in phs[0]}
    print(f"  {label:55s} {statistics.median(ts) * 1000:6.0f} ms [{' '.join('%.0f' % (t * 1000) for t in ts)}]  "
          + " ".join(f"{k}={v:.0f}" for k, v in ph.items()), flush=True)
    return logs


TRIVIAL = 'extern "C" __global__ void k(float *x) { x[threadIdx.x] = 1.0f; }\n'
INCL = "".join(f'#include "{h}"\n' for h in ("attn_fwd_tile.cuh", "wgmma.cuh"))
BWD_INCL = "".join(f'#include "{h}"\n' for h in ("attn_bwd_tile.cuh", "wgmma.cuh", "sm90_pipe.cuh"))
ALL_INCL = "".join(f'#include "{h}"\n' for h in ("attn_fwd_tile.cuh", "attn_bwd_tile.cuh", "wgmma.cuh", "sm90_pipe.cuh"))
print("front end only (--fdevice-syntax-only; ms):")
timed("trivial kernel, no include", (TRIVIAL, "t.cu", opts, hdrs), want=None)
timed("trivial kernel + attn_fwd_sm90.cu's includes", (INCL + TRIVIAL, "t.cu", opts, hdrs), want=None)
print("to PTX (compute_90a):")
timed("trivial kernel, no include", to_ptx((TRIVIAL, "t.cu", opts, hdrs)), want="ptx")
timed("trivial + fwd includes (attn_common, attn_mods, gen, ...)", to_ptx((INCL + TRIVIAL, "t.cu", opts, hdrs)), want="ptx")
timed("trivial + every kernel header", to_ptx((ALL_INCL + TRIVIAL, "t.cu", opts, hdrs)), want="ptx")
timed("attn_fwd_sm90.cu (softcap)", to_ptx(args), want="ptx")
print("to cubin (sm_90a):")
timed("trivial kernel, no include", (TRIVIAL, "t.cu", opts, hdrs))
timed("trivial + fwd includes", (INCL + TRIVIAL, "t.cu", opts, hdrs))
timed("trivial + every kernel header", (ALL_INCL + TRIVIAL, "t.cu", opts, hdrs))
base = timed("attn_fwd_sm90.cu (softcap)", args)

print("precompiled headers:")
d = "/tmp/attnext_pch"
shutil.rmtree(d, ignore_errors=True)
os.makedirs(d)
for i in range(3):
    logs = timed(f"--pch --pch-dir (auto), run {i}", with_options(args, add=["--pch", f"--pch-dir={d}"]), n=1)
    if logs:
        print("    log:", [l for l in logs[0].splitlines() if "pch" in l.lower() or "PCH" in l][:4])
print("    pch dir:", os.listdir(d))
# explicit: a header that includes the kernel's headers, then the source includes it first
pch_src = INCL
hdrs2 = hdrs + [("pre.cuh", pch_src)]
src2 = '#include "pre.cuh"\n' + src
logs = timed("--create-pch", (src2, fn, opts + [f"--create-pch={d}/x.pch"], hdrs2), n=1)
if logs:
    print("    log:", [l for l in logs[0].splitlines() if "pch" in l.lower()][:4])
logs = timed("--use-pch", (src2, fn, opts + [f"--use-pch={d}/x.pch"], hdrs2))
if logs:
    print("    log:", [l for l in logs[0].splitlines() if "pch" in l.lower()][:4])
print("    pch dir:", {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)})
