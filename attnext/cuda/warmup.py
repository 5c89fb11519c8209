"""Compile the common kernel variants ahead of time: `python -m attnext.warmup`.

    python -m attnext.warmup                 # for this machine's GPU, into the disk cache
    python -m attnext.warmup --arch sm_90a   # for an architecture, no GPU needed
    python -m attnext.warmup --check         # every variant for every architecture attnext
                                             # targets (CI: a kernel that does not compile fails)

Prints how many variants were compiled (or found in the cache) and how long it took; exits 1
when one fails to compile, printing NVRTC's log.
"""
import argparse
import sys
import time

from ..types import CompileError
from . import nvrtc, select


def run(archs, out=sys.stdout):
    """Compiles every variant for each arch; returns the number of failures."""
    failures = 0
    for arch in archs:
        t0 = time.perf_counter()
        n = 0
        for kernel, defines in select.variants(arch):
            try:
                nvrtc.cubin(kernel, defines, arch)
                n += 1
            except CompileError as e:
                failures += 1
                print(f"{kernel} {arch} {defines}: {e}\n{e.log}", file=out)
        print(f"{arch}: {n} variants in {time.perf_counter() - t0:.1f} s", file=out)
        t0, n = time.perf_counter(), 0
        for kernel, defines, generated in select.mod_variants(arch):
            try:
                nvrtc.cubin(kernel, defines, arch, generated)
                n += 1
            except CompileError as e:
                failures += 1
                print(f"{kernel} {arch} {defines} with score_mod / mask_mod: {e}\n{e.log}", file=out)
        print(f"{arch}: {n} score_mod / mask_mod variants in {time.perf_counter() - t0:.1f} s",
              file=out)
    info = nvrtc.cache_info()
    if info:
        print(f"compiles {info['compiles']} ({info['compile_seconds']:.1f} s), "
              f"disk hits {info['disk_hits']}, cache {info['cache_dir']}", file=out)
    return failures


def _device_arch():
    from . import backend as cuda_backend
    return cuda_backend.device_arch(0)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m attnext.warmup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="sm_80, sm_90a, ... (repeatable)")
    ap.add_argument("--check", action="store_true",
                    help=f"compile for every target architecture: {', '.join(select.ARCHS)}")
    args = ap.parse_args(argv)
    try:
        nvrtc.nvrtc()
        archs = select.ARCHS if args.check else args.arch or [_device_arch()]
    except RuntimeError as e:
        print(f"attnext.warmup: {e}", file=sys.stderr)
        return 2
    print(f"NVRTC {'.'.join(map(str, nvrtc.nvrtc()))}")
    return 1 if run(archs) else 0


if __name__ == "__main__":
    sys.exit(main())
