"""CPU lab: how close the CPU backend runs to one core's roof. lab_cpu_roof.c, built here with the
extension's flags (setup.py's CFLAGS as tests/helpers reads them, `omp simd` without the OpenMP
runtime), prints a pure FMA loop's rate per vector width (x86: 256-bit, and 512-bit where the CPU
has AVX-512), the SIMD table's gemm / gemm_tn at the CPU tiles' shapes (the best of --reps runs
of 200 calls), its softmax_cols on a 64 x 64 tile (ns a score) and the forward's key-tile step
(K Q^T, softmax_cols, P V over a head's 16 K / V tiles at D64 and D128: the forward less its
packing, Q tiles and output); then one thread's forward (ATTNEXT_NUM_THREADS=1, float32, B1 H8,
the p10 of --calls calls, after a check against attnext.reference) in a fresh process per row,
as GF/s and as a share of the table's gemm rate.
No GPU, no torch.

    python bench/labs/lab_cpu_roof.py [--rows 64:1024 128:1024 64:2048:causal] [--reps 30] [--calls 15]
    ATTNEXT_SIMD=avx2 python bench/labs/lab_cpu_roof.py      # a narrower variant, both parts

Timings on a shared VM move with its neighbours: compare runs side by side, alternated.
"""
import argparse
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "csrc" / "cpu"


def build(out):
    sys.path.insert(0, str(ROOT / "tests"))        # the helpers package: setup.py's CFLAGS
    from helpers.paths import setup_py

    flags = [f for f in setup_py()["CFLAGS"] if f != "-fvisibility=hidden"]
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"
    sources = [Path(__file__).with_suffix(".c"), CPU / "simd.c", *sorted(CPU.glob("softmax_*.c"))]
    cmd = [cc, *flags, "-fopenmp-simd", f"-I{CPU}", *map(str, sources), "-o", str(out), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{r.stderr[-4000:]}")


def child(row, calls):
    import time

    import numpy as np

    sys.path.insert(0, str(ROOT))
    import attnext
    from attnext import reference

    D, S, *rest = row.split(":")
    D, S, causal = int(D), int(S), rest == ["causal"]
    rng = np.random.default_rng(0)
    small = [rng.standard_normal((1, 128, 2, D), dtype=np.float32) for _ in range(3)]
    got, want = attnext.attention(*small, causal=causal), reference.attention(*small, causal=causal)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    if not err < 1e-4:
        raise SystemExit(f"D{D} S{S}: wrong result on a small check (relative error {err:.1e})")
    q, k, v = (rng.standard_normal((1, S, 8, D), dtype=np.float32) for _ in range(3))
    out = np.empty_like(q)
    for _ in range(2):
        attnext.attention(q, k, v, causal=causal, out=out)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        attnext.attention(q, k, v, causal=causal, out=out)
        times.append(time.perf_counter() - t)
    t = sorted(times)[len(times) // 10]
    flops = 4 * 8 * S * S * D / (2 if causal else 1)
    print(f"{flops / t / 1e9:.1f} {t * 1e3:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=["64:1024", "128:1024", "64:2048:causal", "128:2048"],
                    help="D:S[:causal] (float32, B1 H8)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.calls)
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "lab_cpu_roof"
        build(exe)
        report = subprocess.run([str(exe), str(a.reps)], capture_output=True, text=True, check=True).stdout
    print(report, end="")
    gemm = max(float(x) for x in re.findall(r"^gemm\s+M\d+ N\d+ K\d+: ([\d.]+)", report, re.M))
    env = dict(os.environ, ATTNEXT_NUM_THREADS="1")
    print(f"forward, one thread (share: of the table's best gemm, {gemm:.1f})")
    for row in a.rows:
        r = subprocess.run([sys.executable, __file__, "--child", row, "--calls", str(a.calls)], env=env,
                           capture_output=True, text=True)
        if r.returncode:
            print(f"  {row}: failed\n{r.stdout}{r.stderr[-2000:]}")
            continue
        rate, ms = map(float, r.stdout.split())
        print(f"  {row:16s} {ms:8.2f} ms  {rate:6.1f} GF/s  {rate / gemm:.2f}")


if __name__ == "__main__":
    main()
