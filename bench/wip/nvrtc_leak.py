"""Scratch: does an --Ofast-compile compile change later compiles (no such option) in the process?"""
import sys
from nvrtc_elf import same_sass, sass_summary
from nvrtc_time import Nvrtc, fwd_args, gen_of, softcap, with_options

nv = Nvrtc()
a, _ = fwd_args(gen_of(softcap))
ref = nv.compile(*a)[3]
for opts in ([], [sys.argv[1]], [], [], ["--split-compile=0"], []):
    s, rc, log, out = nv.compile(*with_options(a, add=opts))
    print(opts, f"{s:.2f}s", "same" if same_sass(out, ref) else "DIFFERS", sass_summary(out).get(".text.attn_fwd_sm90"))
