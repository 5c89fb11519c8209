"""Kernel lab: one attnext forward (and with "bwd" its backward) call, for ncu /
compute-sanitizer to look at.

    python bench/labs/lab_one.py D S [causal] [bwd] [f32]

f32: float32 inputs (the default precision: three TF32 passes) in place of bfloat16.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository's attnext
import attnext  # noqa: E402

D, S = int(sys.argv[1]), int(sys.argv[2])
causal = "causal" in sys.argv[3:]
B, H = 16384 // S, 2048 // D
dtype = torch.float32 if "f32" in sys.argv[3:] else torch.bfloat16
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype) for _ in range(3))
out = torch.empty_like(q)
for _ in range(3):
    out, lse = attnext.attention(q, k, v, causal=causal, return_lse=True)
    if "bwd" in sys.argv[3:]:
        attnext.attention_backward(torch.randn_like(out), q, k, v, out, lse, causal=causal)
torch.cuda.synchronize()
