"""Scratch: time NVRTC compiles of a generated score_mod's entry points (softcap, rel_bias).

Helpers used by the other bench/wip/nvrtc_*.py scripts. Not part of attnext.
"""
import ctypes
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from attnext import _C, codegen, kernels, trace  # noqa: E402

D = 128
FEATURES = dict(dtype="bfloat16", D=D, Dv=D, vec=True, softcap=False, bias_dtype=None,
                alibi_dtype=None, mask=False)
S = 2048
TABLE = np.zeros((8, 2 * S + 1), np.float32)


def softcap(s, b, h, q, kv):
    return 30.0 * np.tanh(s / 30.0)


def rel_bias(s, b, h, q, kv):
    return s + TABLE[h, q - kv + S]


def gen_of(fn):
    return codegen.generate(trace.trace_score_mod(fn))


def fwd_args(gen, rows=S, arch="sm_90a"):
    """compile_args of the forward entry a causal D=128 bf16 call with this mod compiles."""
    kernel, tile = kernels.fwd_kernel(arch, D, D, True, False, rows, gen)
    defines = kernels.fwd_defines(**FEATURES, tile=tile, mods=gen)
    k, d, g = kernels.module_of(kernel, kernel, defines, gen.source)
    return kernels.compile_args(k, d, arch, g), tile


def bwd_args(gen, name, mode, arch="sm_90a"):
    """compile_args of attn_bwd_sm90.cu's entry `name` for dq mode `mode`."""
    tile = kernels.bwd_sm90_tile(D, mode)
    defines = kernels.bwd_defines(**FEATURES, tile=tile, dq=mode, mods=gen)
    k, d, g = kernels.module_of("attn_bwd_sm90", name, defines, gen.source)
    return kernels.compile_args(k, d, arch, g)


class Nvrtc:
    def __init__(self):
        self.version = kernels.nvrtc()
        self.path = _C.nvrtc_load(kernels.nvrtc_candidates())
        self.lib = ctypes.CDLL(self.path)
        L = self.lib
        for name in ("nvrtcGetPTXSize", "nvrtcGetCUBINSize", "nvrtcGetProgramLogSize"):
            getattr(L, name).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        L.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        L.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcGetPTX.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

    def compile(self, source, filename, options, headers, want="cubin"):
        """(seconds of nvrtcCompileProgram, rc, log, output bytes or None)."""
        L, prog = self.lib, ctypes.c_void_p()
        n = len(headers)
        names = (ctypes.c_char_p * n)(*[h[0].encode() for h in headers])
        texts = (ctypes.c_char_p * n)(*[h[1].encode() for h in headers])
        rc = L.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), n, texts, names)
        assert rc == 0, rc
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        t0 = time.perf_counter()
        rc = L.nvrtcCompileProgram(prog, len(options), opts)
        secs = time.perf_counter() - t0
        size = ctypes.c_size_t()
        L.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        L.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        out = None
        if rc == 0 and want:
            getsize, get = ((L.nvrtcGetPTXSize, L.nvrtcGetPTX) if want == "ptx"
                            else (L.nvrtcGetCUBINSize, L.nvrtcGetCUBIN))
            if getsize(prog, ctypes.byref(size)) == 0 and size.value:
                b = ctypes.create_string_buffer(size.value)
                get(prog, b)
                out = b.raw
        L.nvrtcDestroyProgram(ctypes.byref(prog))
        return secs, rc, log, out

    def median(self, args, n=3, want="cubin"):
        times, last = [], None
        for _ in range(n):
            secs, rc, log, out = self.compile(*args, want=want)
            if rc:
                raise RuntimeError(f"rc {rc}: {log[-2000:]}")
            times.append(secs)
            last = (log, out)
        return statistics.median(times), times, last


def with_options(args, drop=(), add=(), replace=None):
    src, fn, opts, hdrs = args
    opts = [o for o in opts if o not in drop]
    if replace:
        opts = [replace.get(o, o) for o in opts]
    return src, fn, opts + list(add), hdrs


def to_ptx(args):
    return with_options(args, replace={"--gpu-architecture=sm_90a": "--gpu-architecture=compute_90a"})
