"""Kernel lab: one attnext forward call (for ncu / compute-sanitizer to look at).

    python bench/lab_one.py D S [causal]
"""
import sys

import torch

import attnext

D, S = int(sys.argv[1]), int(sys.argv[2])
causal = len(sys.argv) > 3
B, H = 16384 // S, 2048 // D
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = torch.empty_like(q)
for _ in range(3):
    attnext.attention(q, k, v, causal=causal, out=out)
torch.cuda.synchronize()
