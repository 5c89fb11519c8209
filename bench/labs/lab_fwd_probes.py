"""What the end of a visit costs the persistent WS forward (attn_fwd_sm90.cu, the short rows):
the forward again with a part of each tile's end taken away, each a copy of kernels/ with string
edits (stamping.instrumented) run in a process of its own, TFLOP/s beside the kernel as it is. The
probes give a wrong out (O unnormalised, or never written), so nothing is checked and nothing here
is a measurement of attnext: only the rates side by side.

    python bench/labs/lab_fwd_probes.py [D:S[:causal] ...] [--probes nofin,noo,noend]
                                        (default rows: 64:2048:causal 128:2048:causal)

  as is   the kernel unchanged
  nofin   no finish_rows (no quad sums, no rcp or lg2, no lse): O is scaled by 1
  noo     O is not written into the Q block (its bulk copies still leave)
  noend   nofin and noo

bench/NOTES.md, open item 0 (session 70's stamps): after the key loop, finish_rows took 0.29 us
and O into the Q block 0.29 at D64 S2k causal, about four times their instructions' latencies;
these probes say whether that time is on the visit's path at all, or runs while the other
warpgroup's work keeps the SM busy.
"""
import argparse

from stamping import run_probes, shapes

KERNEL = "attn_fwd_sm90.cu"
NEVER = "        if (n_first < 0)\n"   # n_first >= 0 always: the statement after it is skipped
NOFIN = [("        finish_rows<1>(p, sq, sc.to_natural, m, l, row0, b, h, 1, 0, Lq, inv);\n",
          "        inv[0] = inv[1] = 1.f;\n" + NEVER, True)]
NOO = [("        {   /* the warp's 16 rows, 16 columns a stmatrix", NEVER, True)]
PROBES = {"nofin": NOFIN, "noo": NOO, "noend": NOFIN + NOO}

TIME = r"""
import sys
import torch
from triton.testing import do_bench
sys.path.insert(0, sys.argv[1])
import attnext
for spec in sys.argv[2].split(";"):
    B, S, H, D, causal = (int(x) for x in spec.split(","))
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = do_bench(lambda: attnext.attention(q, k, v, causal=bool(causal)), return_mode="median")
    print(f"{spec}\t{ms:.3f}\t{4 * B * H * S * S * D / (2 if causal else 1) / ms / 1e9:.1f}", flush=True)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="*", help="D:S[:causal] (bf16, B * S = 16k tokens, B = 1 past S16k, H = 2048 / D)")
    ap.add_argument("--probes", default="nofin,noo,noend")
    ap.add_argument("--rounds", type=int, default=2, help="times each probe runs, in turn with the others")
    args = ap.parse_args()
    rows = ";".join(f"{B},{S},{H},{D},{int(c)}" for D, S, c, B, H in
                    shapes(args.rows, ["64:2048:causal", "128:2048:causal"]))
    print(f"{'probe':8} {'row (B,S,H,D,causal)':24} {'ms':>9} {'TFLOP/s':>8}")
    for _ in range(args.rounds):
        run_probes(KERNEL, PROBES, ["as is", *args.probes.split(",")], TIME, [rows])


if __name__ == "__main__":
    main()
