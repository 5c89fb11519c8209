"""Kernel lab: backward configurations A / B, each in its own process, alternated.

    python bench/labs/lab_bwd_ab.py --rows 128:131072:causal 64:2048 \
        --config head=ATTNEXT_KERNEL_DIR=bench/wip/kern_head --config new= \
        --config atomic=ATTNEXT_BWD_DQ=atomic [--rounds 2]

lab_fwd_ab.py's shape for the backward: a configuration is NAME=ENV (space-separated VAR=VALUE
settings of the environment: ATTNEXT_KERNEL_DIR for a copy of kernels/, ATTNEXT_BWD_DQ,
ATTNEXT_BWD_DQ_CHAINS ...; empty for the defaults); ATTNEXT_BWD_DQ=atomic runs it with
deterministic=False. Each round runs every configuration once, in order, as a child process, so
one configuration's compiles, allocator and clocks do not carry into the next. A row D:S[:causal]
is bf16, B * S = 16k tokens (B = 1 past S16k), H = 2048 / D; the child checks dq, dk, dv
against SDPA's flash backward (verify.py) before timing attnext's backward alone (from a forward's
out and lse) with triton.testing.do_bench medians, and prints TFLOP/s (2.5 x 4 B H S^2 D, halved
for causal). No peer is timed: lab_bwd.py puts flash beside, in one process.
"""
import os
import sys
from pathlib import Path

import alternate

ROOT = Path(__file__).resolve().parents[2]


def child(name, rows):
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, str(ROOT))                        # the repository's attnext
    import attnext
    import verify
    from stamping import shapes

    torch.manual_seed(0)
    det = os.environ.get("ATTNEXT_BWD_DQ") != "atomic"
    for D, S, causal, B, H in shapes(rows, []):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        dout = torch.randn_like(q)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            _, want = verify.sdpa(q, k, v, causal, dout=dout)
        out, lse = attnext.attention(q, k, v, causal=causal, return_lse=True)

        def backward():
            return attnext.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)

        got = backward()
        label = f"{name:12s} D{D} S{S} B{B} {'causal' if causal else 'full  '}"
        try:
            err = verify.check(label, {"dq": (got[0], want[0]), "dk": (got[1], want[1]), "dv": (got[2], want[2])})
        except verify.WrongResult as e:
            print(e, flush=True)
            continue
        t = triton.testing.do_bench(backward, return_mode="median")
        print(f"{label}  attnext {flops / t / 1e9:6.1f}  err {err:.1e}", flush=True)


if __name__ == "__main__":
    alternate.main(__doc__, __file__, child)
