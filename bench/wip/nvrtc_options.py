"""Scratch: NVRTC options against compile time (median of 3, with --time=- phase split) and
whether the SASS changes (.text sections against the baseline's).
Usage: python nvrtc_options.py [fwd|dkdv|dkdv_ws|dq|relfwd|reldkdv|reldq] [label filter...]"""
import re
import statistics
import sys

from nvrtc_elf import same_sass, sass_summary
from nvrtc_time import Nvrtc, bwd_args, fwd_args, gen_of, rel_bias, softcap, to_ptx, with_options

which = sys.argv[1] if len(sys.argv) > 1 else "fwd"
filters = sys.argv[2:]
sc, rb = gen_of(softcap), gen_of(rel_bias)
base = {"fwd": lambda: fwd_args(sc)[0], "relfwd": lambda: fwd_args(rb)[0],
        "dkdv": lambda: bwd_args(sc, "attn_bwd_dkdv_sm90", "recompute"),
        "dq": lambda: bwd_args(sc, "attn_bwd_dq_sm90", "recompute"),
        "dkdv_ws": lambda: bwd_args(sc, "attn_bwd_dkdv_ws_sm90", "ordered"),
        "reldkdv": lambda: bwd_args(rb, "attn_bwd_dkdv_sm90", "recompute"),
        "reldq": lambda: bwd_args(rb, "attn_bwd_dq_sm90", "recompute")}[which]()
nv = Nvrtc()
PH = re.compile(r"^[^,]+, ([^,]+), (\d+), ms$", re.M)

CASES = [
    ("baseline", {}),
    ("PTX only (compute_90a)", {"ptx": True}),
    ("no -lineinfo", {"drop": ["-lineinfo"]}),
    ("-Xptxas -O0", {"add": ["-Xptxas", "-O0"]}),
    ("-Xptxas -O1", {"add": ["-Xptxas", "-O1"]}),
    ("-Xptxas -O2", {"add": ["-Xptxas", "-O2"]}),
    ("-Xptxas --allow-expensive-optimizations=false", {"add": ["--ptxas-options=--allow-expensive-optimizations=false"]}),
    ("--dopt=on", {"add": ["--dopt=on"]}),
    ("-default-device", {"add": ["-default-device"]}),
    ("--extra-device-vectorization", {"add": ["--extra-device-vectorization"]}),
    ("-fmad=false", {"add": ["-fmad=false"]}),
    ("--use_fast_math", {"add": ["--use_fast_math"]}),
    ("--minimal", {"add": ["--minimal"]}),
    ("--Ofast-compile=min", {"add": ["--Ofast-compile=min"]}),
    ("--Ofast-compile=mid", {"add": ["--Ofast-compile=mid"]}),
    ("--Ofast-compile=max", {"add": ["--Ofast-compile=max"]}),
    ("--split-compile=0", {"add": ["--split-compile=0"]}),
    ("--no-cache", {"add": ["--no-cache"]}),
    ("--fdevice-syntax-only", {"add": ["--fdevice-syntax-only"], "ptx": True, "nosass": True}),
    ("-std=c++14", {"replace": {"--std=c++17": "--std=c++14"}}),
]


def run(case):
    args = with_options(base, drop=case.get("drop", ()), add=list(case.get("add", ())) + ["--time=-"],
                        replace=case.get("replace"))
    if case.get("ptx"):
        args = to_ptx(args)
    ts, phases, out = [], [], None
    for _ in range(3):
        secs, rc, log, out = nv.compile(*args, want=None if case.get("nosass") else ("ptx" if case.get("ptx") else "cubin"))
        if rc:
            return None, log.strip().splitlines()[-1][:150], None, None
        ts.append(secs)
        phases.append({k: int(v) for k, v in PH.findall(log)})
    ph = {k: statistics.median(p.get(k, 0) for p in phases) for k in phases[0]}
    return statistics.median(ts), ph, out, ts


print(f"{which}: {base[1]} {[o for o in base[2] if 'ENTRY_' in o or 'BLOCK' in o]}")
ref = None
for label, case in CASES:
    if filters and label != "baseline" and not any(f in label for f in filters):
        continue
    med, ph, out, ts = run(case)
    if med is None:
        print(f"  {label:48s} FAILED: {ph}")
        continue
    if label == "baseline":
        ref = out
    sass = ""
    if out is not None and not case.get("ptx") and ref is not None:
        sass = "SASS same" if same_sass(out, ref) else f"SASS differs {sass_summary(out)} vs {sass_summary(ref)}"
    phs = " ".join(f"{k.split()[-1] if k != 'CUDA C++ Frontend' else 'FE'}={v / 1000:.2f}" for k, v in ph.items())
    print(f"  {label:48s} {med:5.2f}s [{' '.join('%.2f' % t for t in ts)}]  {phs}  {sass}", flush=True)
