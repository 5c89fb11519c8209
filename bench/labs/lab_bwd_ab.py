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
import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(name, rows):
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, str(ROOT))                        # the repository's attnext
    import attnext
    import verify

    torch.manual_seed(0)
    det = os.environ.get("ATTNEXT_BWD_DQ") != "atomic"
    for row in rows:
        D, S, *rest = row.split(":")
        D, S, causal = int(D), int(S), rest == ["causal"]
        B, H = max(1, 16384 // S), 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
            dout = torch.randn_like(o)
            want = torch.autograd.grad(o, (q, k, v), dout)
        qd, kd, vd = (x.detach() for x in (q, k, v))
        out, lse = attnext.attention(qd, kd, vd, causal=causal, return_lse=True)

        def backward():
            return attnext.attention_backward(dout, qd, kd, vd, out, lse, causal=causal, deterministic=det)

        got = backward()
        label = f"{name:12s} D{D} S{S} B{B} {'causal' if causal else 'full  '}"
        try:
            err = verify.check(label, {"dq": (got[0], want[0]), "dk": (got[1], want[1]), "dv": (got[2], want[2])})
        except verify.WrongResult as e:
            print(e, flush=True)
            continue
        t = triton.testing.do_bench(backward, return_mode="median")
        print(f"{label}  attnext {flops / t / 1e9:6.1f}  err {err:.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", required=True, help="D:S[:causal] ...")
    ap.add_argument("--config", action="append", default=[], help="NAME=VAR=VALUE VAR=VALUE ... (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rows)
        return
    if not args.config:
        ap.error("at least one --config")
    configs = []
    for c in args.config:
        name, _, env = c.partition("=")
        configs.append((name, dict(kv.split("=", 1) for kv in env.split())))
    for _ in range(args.rounds):
        for name, env in configs:
            subprocess.run([sys.executable, __file__, "--child", name, "--rows", *args.rows],
                           env={**os.environ, **env}, check=False)


if __name__ == "__main__":
    main()
