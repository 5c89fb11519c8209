"""What the ordered dQ mode costs at long rows (attn_bwd_sm90.cu's warp-specialised dK/dV kernel,
its dQ writers): the deterministic backward again with a part of the writers' turn taken away,
each a copy of kernels/ with string edits (stamping.instrumented) run in a process of its own,
TFLOP/s beside the kernel as it is and beside deterministic=False (atomic dQ). The probes give
wrong dq (the turns' order or their completion is gone), so nothing is checked and nothing here
is a measurement of attnext: only the rates side by side.

    python bench/labs/lab_bwd_probes.py [D:S[:causal] ...] [--probes noturn,noland,both]
                                        (default rows: 128:16384:causal 128:262144:causal)

  as is     the kernel unchanged (deterministic: the ordered mode)
  atomic    deterministic=False (ATTNEXT_BWD_DQ=atomic): the additions in any order
  noturn    a writer does not wait for its turn (sem_wait not called)
  noland    a writer does not wait for its addition to land before it sets its bit (bulk_wait
            and the proxy fence after it skipped; it waits for the stage's reads, as the atomic
            writer does)
  both      noturn and noland

bench/NOTES.md, open item 10 (session 64's stamps): the ordered mode's items take 8.7% longer
than the atomic mode's at S256k, the consumers waiting longer for Q and dO; these probes say
whether the turns' order, or the writers' wait for their additions, is what costs it.
"""
import argparse

from stamping import run_probes, shapes

KERNEL = "attn_bwd_sm90.cu"
NEVER = "if (last < 0) "              # last >= 0 always: what follows is skipped
NOTURN = [("sem_wait(sem, n_block, last, wl);", NEVER, True)]
NOLAND = [("bulk_wait();\n                    fence_proxy_async_global();\n                    sem_set<true>", NEVER, True),
          ("fence_proxy_async_global();\n                    sem_set<true>", NEVER, True),
          ("sem_set<true>(sem, n_block);\n", "                    bulk_wait_read();\n", False)]
PROBES = {"noturn": NOTURN, "noland": NOLAND, "both": NOTURN + NOLAND}

TIME = r"""
import os
import sys
import torch
from triton.testing import do_bench
sys.path.insert(0, sys.argv[1])
import attnext
det = os.environ.get("ATTNEXT_BWD_DQ") != "atomic"
for spec in sys.argv[2].split(";"):
    B, S, H, D, causal = (int(x) for x in spec.split(","))
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    out, lse = attnext.attention(q, k, v, causal=bool(causal), return_lse=True)
    ms = do_bench(lambda: attnext.attention_backward(dout, q, k, v, out, lse, causal=bool(causal),
                                                     deterministic=det), return_mode="median")
    print(f"{spec}\t{ms:.3f}\t{2.5 * 4 * B * H * S * S * D / (2 if causal else 1) / ms / 1e9:.1f}", flush=True)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="*", help="D:S[:causal] (bf16, B * S = 16k tokens, B = 1 past S16k, H = 2048 / D)")
    ap.add_argument("--probes", default="noturn,noland,both")
    args = ap.parse_args()
    rows = ";".join(f"{B},{S},{H},{D},{int(c)}" for D, S, c, B, H in
                    shapes(args.rows, ["128:16384:causal", "128:262144:causal"]))
    print(f"{'probe':8} {'row (B,S,H,D,causal)':24} {'ms':>9} {'TFLOP/s':>8}")
    names = ["as is", "atomic", *args.probes.split(",")]
    run_probes(KERNEL, PROBES, names, TIME, [rows],
               lambda name: {"ATTNEXT_BWD_DQ": "atomic"} if name == "atomic" else {})


if __name__ == "__main__":
    main()
