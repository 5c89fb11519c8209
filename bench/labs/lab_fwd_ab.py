"""Kernel lab: forward configurations A / B, each in its own process, alternated, cuDNN beside.

    python bench/labs/lab_fwd_ab.py --rows 128:2048 128:8192:causal \
        --config default= --config n176=ATTNEXT_TILE_FWD_WS=128,176,8,2 [--rounds 2]

A configuration is NAME=ENV: space-separated VAR=VALUE settings of the environment (the labs' knobs:
ATTNEXT_TILE_FWD_WS, ATTNEXT_FWD_PERSIST, ATTNEXT_KERNEL_DIR for a copy of kernels/ ...), empty for
the defaults. Each round runs every configuration once, in order, as a child process, so a kernel's
first compile, the allocator and the clocks of one configuration do not carry into the next; rounds
alternate them. A row D:S[:causal] is bf16, B * S = 16k tokens (B = 1 past S16k), H = 2048 / D
heads; the child checks attnext's out against SDPA's cuDNN backend (verify.py) before timing both
with triton.testing.do_bench medians (no L2 flush), and prints TFLOP/s (4 B H S^2 D, halved for
causal), cuDNN's, their ratio and the error. Ratios, not absolute rates, carry between runs.
"""
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
    for D, S, causal, B, H in shapes(rows, []):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def cudnn():
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        out = torch.empty_like(q)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            want = cudnn().transpose(1, 2)
            t_cudnn = triton.testing.do_bench(cudnn, rep=300, return_mode="median")
        attnext.attention(q, k, v, causal=causal, out=out)
        label = f"{name:12s} D{D} S{S} B{B} {'causal' if causal else 'full  '}"
        try:
            err = verify.check(label, {"out": (out, want)})
        except verify.WrongResult as e:
            print(e, flush=True)
            continue
        t = triton.testing.do_bench(lambda: attnext.attention(q, k, v, causal=causal, out=out), rep=300,
                                    return_mode="median")
        print(f"{label}  attnext {flops / t / 1e9:6.1f}  cudnn {flops / t_cudnn / 1e9:6.1f}  "
              f"({t_cudnn / t:.3f}x)  err {err:.1e}", flush=True)


if __name__ == "__main__":
    alternate.main(__doc__, __file__, child)
