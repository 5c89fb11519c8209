"""What binds Hopper's float32 forward (attn_fwd_sm90_f32.cu, three passes): the kernel again with
one side's work taken away, each a copy of kernels/ with string edits (stamping.instrumented) run
in a process of its own, TFLOP/s beside the kernel as it is. The probes give wrong results, so
nothing is checked and nothing here is a measurement of attnext: only the rates side by side.

    python bench/labs/lab_f32_probes.py [--rows "4,4096,16,128;4,4096,16,128,causal"] [--probes noload,noprod]

  as is     the kernel unchanged
  noload    the splitters' K and V loads replaced by values of the thread (no global traffic
            for K and V; the splits and shared-memory stores remain)
  noprod    the computing warpgroup's products not issued (its waits, softmax, parts and adds
            remain; the accumulators hold what they held)
  both      noload and noprod

Session 44 ran this question by hand on w1 (59.9 TFLOP/s; 74.6 without loads, 82.7 without
products), session 52 with this lab on w4 (65.1; 87.5, 103.9, both 227): bench/NOTES.md, float32
forward.
"""
import argparse

from stamping import run_probes

# (anchor, text, before): stamping.instrumented's edits. The loads' results overwritten (the loads
# then go unissued: nothing reads them); the products behind a condition that is never true
NOLOAD = [("x[j] = load4(gk + (c0 + r) * ks + (tid % CH) * 4, c0 + r < Lk);",
           "\n        x[j] = make_float4(1e-3f * (tid & 7), 1e-3f * j, 2e-3f, 3e-3f);", False),
          ("x[j] = load4(gv + (c0 + key) * vs + c * 4, c0 + key < Lk);",
           "\n        x[j] = make_float4(1e-3f * (tid & 7), 1e-3f * j, 2e-3f, 3e-3f);", False)]
NOPROD = [("wgmma_m64n64k8_tf32_ss(s[0],", "if (accumulate < 0) ", True),
          ("wgmma_m64n128k8_tf32_rs(f, a, dv, accumulate);", "if (accumulate < 0) ", True),
          ("wgmma_m64n64k8_tf32_rs(f, a, dv, accumulate);", "if (accumulate < 0) ", True)]
PROBES = {"noload": NOLOAD, "noprod": NOPROD, "both": NOLOAD + NOPROD}
KERNEL = "attn_fwd_sm90_f32.cu"

TIME = r"""
import sys
import torch
from triton.testing import do_bench
sys.path.insert(0, sys.argv[1])
import attnext
for spec in sys.argv[2].split(";"):
    B, S, H, D, *c = spec.split(",")
    B, S, H, D, causal = int(B), int(S), int(H), int(D), bool(c)
    q, k, v = (torch.randn(B, S, H, D, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    ms = do_bench(lambda: attnext.attention(q, k, v, causal=causal, out=out), warmup=25, rep=100)
    print(f"{spec}\t{ms:.3f}\t{4 * B * H * S * S * D / (2 if causal else 1) / ms / 1e9:.1f}", flush=True)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4,4096,16,128;4,4096,16,128,causal", help="B,S,H,D[,causal] separated by ';'")
    ap.add_argument("--probes", default="noload,noprod,both")
    args = ap.parse_args()
    print(f"{'probe':8} {'row':24} {'ms':>9} {'TFLOP/s':>8}")
    run_probes(KERNEL, PROBES, ["as is", *args.probes.split(",")], TIME, [args.rows])


if __name__ == "__main__":
    main()
