"""Which split of float32 operands into tensor-core parts carries float32's accuracy: NumPy
emulation, no GPU. Each operand x is split into parts (TF32: hi = x rounded to TF32, lo = x - hi
rounded; bf16x3: three bfloat16 parts b0 + b1 + b2), the chosen products of parts are formed
exactly and summed in float64 (the tensor cores' own rounding of the sums is not modelled), and
the result's error against float64 (max|x - ref| / max|ref|) is printed beside NumPy's float32
matmul of the same operands.

    python bench/labs/lab_split.py [--shape 256,128,256] [--trials 3]
"""
import argparse

import ml_dtypes
import numpy as np


def tf32(x):
    """x rounded to TF32 (to nearest, ties away: attn_common.cuh's to_tf32)."""
    return ((x.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xffffe000)).view(np.float32)


def tf32_parts(x):
    hi = tf32(x)
    return hi, tf32(x - hi)


def bf16_parts(x, n=3):
    parts, r = [], x
    for _ in range(n):
        p = r.astype(ml_dtypes.bfloat16).astype(np.float32)
        parts.append(p)
        r = r - p
    return parts


def products(a, b, pairs):
    """sum of a[i] @ b[j] over (i, j) in pairs, exactly formed, summed in float64"""
    return sum(a[i].astype(np.float64) @ b[j].astype(np.float64) for i, j in pairs)


SPLITS = {
    "3xTF32 (hi hi, hi lo, lo hi)": (tf32_parts, ((0, 0), (0, 1), (1, 0))),
    "TF32 (hi hi)": (tf32_parts, ((0, 0),)),
    "bf16x3, 3 products (order <= 1)": (bf16_parts, ((0, 0), (0, 1), (1, 0))),
    "bf16x3, 6 products (order <= 2)": (bf16_parts, ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0))),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="256,128,256", help="M,K,N of the product")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    M, K, N = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(0)
    for t in range(args.trials):
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((K, N)).astype(np.float32)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        err = lambda x: float(np.abs(x - ref).max() / np.abs(ref).max())
        print(f"trial {t}: NumPy float32 matmul {err(a @ b):.2e}")
        for name, (split, pairs) in SPLITS.items():
            print(f"  {name:34} {err(products(split(a), split(b), pairs)):.2e}")


if __name__ == "__main__":
    main()
