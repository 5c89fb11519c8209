"""The CUDA host side without a GPU: code run in a fresh interpreter (NVRTC and libcuda load once
per process, so what must start from nothing runs in one), the fake driver's prelude and runner,
and a tiny NVRTC kernel for the compile and launch tests."""
import os
import subprocess
import sys
import textwrap

from helpers.paths import pythonpath

TINY_KERNEL = textwrap.dedent("""
    #include "fill.h"
    struct fill_params { float *x; float value; int n; };
    extern "C" __global__ void fill(struct fill_params p)
    {
        extern __shared__ float scratch[];
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        scratch[threadIdx.x] = p.value * SCALE;
        if (i < p.n)
            p.x[i] = scratch[threadIdx.x];
    }
""")
FILL_HEADER = ("fill.h", "#define SCALE 2.0f\n")


def run_fresh(code, **env):
    """Runs code in a fresh interpreter; returns its stdout (fails the test on a crash)."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


# What every subprocess starts with: attnext on the fake driver, nvrtc.function standing in
# for NVRTC (a capsule per kernel variant, named in FN), launches recorded in LAUNCHES.
PRELUDE = r"""
import ctypes, os, sys, threading, time
import numpy as np, ml_dtypes
import attnext
from helpers import fake_cuda
from attnext import _C, _env
from attnext.cuda import arrays as device, backend as cuda_backend, nvrtc, process, select

BF16 = np.dtype(ml_dtypes.bfloat16)
lib = ctypes.CDLL(os.environ["ATTNEXT_LIBCUDA"])
fake_cuda.counter(lib, "record").value = 1
FN, LAUNCHES = {}, []
_module = None


def function(kernel, name, defines, dev, arch, smem, generated=None):
    global _module
    if _module is None:
        _module = _C.module_load(b"\x7fELF", dev)
    fn = _C.module_function(_module, name, smem, nvrtc._dependent(name, arch))
    FN[id(fn)] = (kernel, name, tuple(sorted(defines.items())), smem)
    KEEP.append(fn)
    return fn


KEEP = []
nvrtc.function = function
nvrtc.prefetch = lambda specs, arch, device: None
_launch = _C.cuda_launch_attention


def launch(fn, grid, block, smem, stream, template, ptrs, scale, softcap):
    _launch(fn, grid, block, smem, stream, template, ptrs, scale, softcap)
    rec = fake_cuda.last_launch(lib)
    p = fake_cuda.params_dict(rec.params)
    p = {k: (v[1] if isinstance(v, tuple) else v) for k, v in p.items()    # strides, not addresses
         if k not in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "o_accum", "lse_accum", "counters", "sinks",
                      "dsinks", "block_table")}
    LAUNCHES.append((FN[id(fn)], tuple(rec.grid), tuple(rec.block), rec.smem, rec.stream or 0, p, ptrs))


_C.cuda_launch_attention = launch


def dev(shape, dtype=BF16, stream=0, strides=None, offset=0, zero=False):
    # a DeviceArray of fake device memory (the kernels are stand-ins), uninitialised unless zero:
    # zero it where the host reads it (alibi_slopes must be finite)
    base = device.empty((int(np.prod(shape)) * 2 + 64,), dtype, 0, stream)
    if zero:
        _C.memset_d8(base.ptr, 0, base.nbytes, 0)
    return device.DeviceArray(base.ptr + offset * np.dtype(dtype).itemsize, shape, dtype, 0, strides,
                              stream, base)


def qkv(B, Sq, Sk, Hq, Hk, D, stream=0):
    return dev((B, Sq, Hq, D), stream=stream), dev((B, Sk, Hk, D), stream=stream), dev((B, Sk, Hk, D), stream=stream)


def record(call):
    # the launches of one call, without addresses
    n = len(LAUNCHES)
    call()
    return [l[:6] for l in LAUNCHES[n:]]
"""


def run_on_fake(fake_driver, body, **env):
    """PRELUDE, then body, in a fresh interpreter on the fake driver (its path: the fake_driver
    fixture's); body prints "ok" last. Returns its stdout."""
    code = PRELUDE + textwrap.dedent(body)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ATTNEXT_LIBCUDA": fake_driver,
                              "PYTHONPATH": pythonpath(),
                              **env})
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip().endswith("ok"), res.stdout[-2000:]
    return res.stdout
