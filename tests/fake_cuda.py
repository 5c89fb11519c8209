"""Builds tests/fake_libcuda.c, the fake driver that runs attnext's CUDA host side on host memory
(test_cuda_host.py, test_cuda_host_path.py and bench/lab_host.py load it through ATTNEXT_LIBCUDA).
Not a test file: a helper both the tests and the lab import."""
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fake_libcuda.c"
CSRC = SOURCE.parent.parent / "csrc"     # attn_params.h, for the launch record


def compiler():
    """The C compiler's path, or None."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(out_dir, name="full", flags=()):
    """Compiles the fake into out_dir/libcuda_<name>.so (flags: e.g. ["-DNO_ALLOC_ASYNC"]) and
    returns its path. RuntimeError without a C compiler."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler for the fake libcuda")
    lib = Path(out_dir) / f"libcuda_{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", f"-I{CSRC}", *flags, str(SOURCE), "-o", str(lib)],
                   check=True)
    return str(lib)


class LaunchRecord(ctypes.Structure):
    """The fake's `last_launch` without its attn_params, which follow it (params_offset)."""
    _fields_ = [("fn", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p)]


def counter(lib, name):
    """The fake's int counter `name` (waits, launches, allocs, frees, record) as a ctypes int."""
    return ctypes.c_int.in_dll(lib, name)
