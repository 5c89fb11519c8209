"""csrc/cpu/simd.c's tables checked entry by entry (gemm, gemm_tn, softmax_cols, exp_rows; float
and double) by a C driver of their own, tests/helpers/simd_check.c, built without Python from
the same sources and flags as the extension: every variant this machine runs, and the aarch64
build (its NEON variant and the portable one) cross-compiled and run under qemu-user.

The aarch64 leg skips without `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian:
gcc-aarch64-linux-gnu, qemu-user), unless ATTNEXT_REQUIRE_AARCH64=1 (set by .ci/run, which
installs them) makes their absence a failure.
"""
import os
import platform
import shutil
import subprocess

import pytest

from conftest import seed_of
from helpers.paths import CSRC, TESTS, setup_py

CPU = CSRC / "cpu"
SOURCES = [TESTS / "helpers" / "simd_check.c", CPU / "simd.c", *sorted(CPU.glob("softmax_*.c"))]
# the variants each architecture has, worst first (simd.c's levels)
LEVELS = {"x86_64": ["portable", "avx2", "avx512"], "aarch64": ["portable", "neon"]}
QEMU_SYSROOT = "/usr/aarch64-linux-gnu"


def _build(compiler, out):
    """simd_check built by `compiler` into out, with the extension's flags: `omp simd` loops as
    the extension has them (-fopenmp-simd: the pragmas without the OpenMP runtime)."""
    flags = [f for f in setup_py()["CFLAGS"] if f != "-fvisibility=hidden"]
    cmd = [compiler, *flags, "-fopenmp-simd", f"-I{CPU}", *map(str, SOURCES), "-o", str(out), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-4000:]}"
    return out


def _run(prefix, variant=None, seed=None):
    """simd_check's output: the variant picked (variant None), else its check of `variant`, which
    ATTNEXT_SIMD caps the process to."""
    env = {k: v for k, v in os.environ.items() if k != "ATTNEXT_SIMD"}
    args = []
    if variant:
        env["ATTNEXT_SIMD"] = variant
        args = [variant, str(seed)]
    r = subprocess.run([*prefix, *args], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(map(str, prefix + args))}: exit {r.returncode}\n" \
                              f"{r.stdout[-4000:]}{r.stderr[-2000:]}"
    return r.stdout.strip()


def _check_every_level(prefix, levels, seed):
    """Every variant of `levels` up to the one the process picks by itself."""
    best = _run(prefix)
    assert best in levels, f"simd_check picks {best!r}, not one of {levels}"
    for variant in levels[:levels.index(best) + 1]:
        assert _run(prefix, variant, seed).splitlines()[-1] == f"{variant}: 0 failures (seed {seed})"
    return best


def test_native_tables(cc, tmp_path, request):
    levels = LEVELS.get(platform.machine(), ["portable"])
    exe = _build(cc, tmp_path / "simd_check")
    _check_every_level([str(exe)], levels, seed_of(request.node.nodeid))


def test_aarch64_tables_under_qemu(tmp_path, request):
    """The NEON variant (the default on aarch64) and the portable one, built for aarch64."""
    tools = {t: shutil.which(t) for t in ("aarch64-linux-gnu-gcc", "qemu-aarch64")}
    missing = [t for t, path in tools.items() if path is None]
    if missing:
        why = f"no {' or '.join(missing)} (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)"
        if os.environ.get("ATTNEXT_REQUIRE_AARCH64") == "1":
            pytest.fail(f"ATTNEXT_REQUIRE_AARCH64=1 but {why}")
        pytest.skip(why)
    exe = _build(tools["aarch64-linux-gnu-gcc"], tmp_path / "simd_check_aarch64")
    prefix = [tools["qemu-aarch64"], "-L", QEMU_SYSROOT, str(exe)]
    best = _check_every_level(prefix, LEVELS["aarch64"], seed_of(request.node.nodeid))
    assert best == "neon"
