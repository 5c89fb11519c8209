"""Builds tests/helpers/fake_libcuda.c, the fake driver that runs attnext's CUDA host side on host
memory (the tests of tests/host/, the fake-driver tests elsewhere and bench/labs/lab_host.py load
it through ATTNEXT_LIBCUDA). Not a test file: a helper both the tests and the labs import."""
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fake_libcuda.c"
CSRC = SOURCE.parents[2] / "csrc"        # attn_params.h, for the launch record


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


def counter(lib, name):
    """The fake's int counter `name` (waits, launches, allocs, frees, registered, registrations,
    register_error, record) as a ctypes int."""
    return ctypes.c_int.in_dll(lib, name)


class Tensor4(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("s", ctypes.c_int64 * 4)]


_I64, _INT, _PTR, _F64 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_double
# attn_mods_gpu: 64 floats, 8 arrays of (ptr, shape[4], s[4], grad), err, dacc, blocks and the
# block mask's 4 strides / sizes (attnext.codegen's MODS_DTYPE reads these bytes)
GMODS_BYTES = 64 * 4 + 8 * (8 + 4 * 8 + 4 * 8 + 8) + 3 * 8 + 4 * 8


class AttnParams(ctypes.Structure):
    """csrc/attn_params.h's attn_params, field for field."""
    _fields_ = ([(n, _I64) for n in ("B", "Sq", "Sk", "Hq", "Hk", "D", "Dv")] + [("dtype", _INT)]
                + [(n, Tensor4) for n in ("q", "k", "v", "out", "lse", "dlse")] + [("sinks", _PTR), ("dsinks", _PTR)]
                + [("block_table", _PTR), ("bt_stride", _I64), ("page_size", _I64), ("num_pages", _I64),
                   ("tma_rows", _I64), ("tma_rows_q", _I64), ("tma_out", _I64)]
                + [(n, _PTR) for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")]
                + [("max_rows_q", _I64), ("max_rows_k", _I64)]
                + [("bias", Tensor4), ("bias_dtype", _INT), ("bias_heads", _I64), ("mask", Tensor4),
                   ("mask_heads", _I64), ("alibi", Tensor4), ("alibi_dtype", _INT), ("scale", _F64),
                   ("softcap", _F64), ("causal", _INT), ("window_left", _I64), ("window_right", _I64)]
                + [(n, Tensor4) for n in ("dout", "dq", "dk", "dv", "dbias", "delta", "dq_accum", "dq_sem")]
                + [("o_accum", _PTR), ("lse_accum", _PTR), ("counters", _PTR), ("num_splits", _INT), ("dq_write_last", _INT),
                   ("dead", _PTR), ("k_rows_max", _I64), ("row_mz", _PTR), ("grad_scales", _PTR),
                   ("num_threads", _INT),
                   ("mods", _PTR), ("gmods", ctypes.c_uint64 * (GMODS_BYTES // 8))])


class LaunchRecord(ctypes.Structure):
    """The fake's `last_launch`."""
    _fields_ = [("fn", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("params", AttnParams)]


def last_launch(lib):
    return LaunchRecord.in_dll(lib, "last_launch")


def params_dict(p):
    """An AttnParams as a dict of plain values (tensors as (ptr, strides), gmods as bytes)."""
    out = {}
    for name, _ in AttnParams._fields_:
        v = getattr(p, name)
        if name == "gmods":
            out[name] = bytes(v)
            continue
        out[name] = (v.ptr or 0, tuple(v.s)) if isinstance(v, Tensor4) else (v or 0 if name in (
            "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "o_accum", "lse_accum", "counters", "mods",
            "row_mz", "grad_scales", "sinks", "dsinks", "block_table") else v)
    return out
