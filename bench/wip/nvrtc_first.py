"""Scratch: the first compile in a fresh process (NVRTC load, builtins dlopen) against repeats,
and --no-cache (NVRTC 12.9+'s own cache). Usage: python nvrtc_first.py [--no-cache]"""
import sys
import time

t0 = time.perf_counter()
from nvrtc_time import Nvrtc, fwd_args, gen_of, softcap, with_options  # noqa: E402
t1 = time.perf_counter()
nv = Nvrtc()
t2 = time.perf_counter()
args, _ = fwd_args(gen_of(softcap))
t3 = time.perf_counter()
if "--no-cache" in sys.argv:
    args = with_options(args, add=["--no-cache"])
ts = [nv.compile(*args)[0] for _ in range(4)]
print(f"import {t1 - t0:.2f}s nvrtc load {t2 - t1:.3f}s trace+codegen+args {t3 - t2:.3f}s "
      f"compiles {['%.2f' % t for t in ts]}")
