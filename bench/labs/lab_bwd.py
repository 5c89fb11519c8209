"""Kernel lab: the backward's kernels side by side on one GPU, each validated first.

    python bench/labs/lab_bwd.py mma sm90 "sm90:8,8" ... [64:16384 128:2048:causal ...]

A configuration is "mma" (attn_bwd.cu; ATTNEXT_BWD_SM90=0) or "sm90" / "sm90:KV_WARPS,Q_WARPS"
(attn_bwd_sm90.cu; ATTNEXT_TILE_BWD_SM90), with "+recompute", "+ordered" or "+atomic" (deterministic=False)
naming the dq mode (ATTNEXT_BWD_DQ; none: the default's), "+ordered@4" its chains too (ATTNEXT_BWD_DQ_CHAINS); an argument D:S[:causal] names a case in place of
CASES. A configuration may be named twice, to alternate. For each head dim / causal case: attnext's backward
(from a forward's out and lse) against PyTorch SDPA's flash backend (autograd), bf16,
triton.testing.do_bench medians, B*S = 16k tokens (B = 1 past S16k), TFLOP/s counting 2.5x the forward's FLOPs.
"""
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository's attnext
import attnext  # noqa: E402
from attnext import _env  # noqa: E402

CASES = [(64, 512, False), (64, 2048, False), (64, 2048, True), (128, 512, False), (128, 2048, False),
         (128, 2048, True), (128, 8192, True)]


def main(configs, cases=CASES):
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  configs {configs}")
    for D, S, causal in cases:
        B, H = max(1, 16384 // S), 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
            dout = torch.randn_like(o)
            ref = torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)
            t_flash = triton.testing.do_bench(
                lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True), return_mode="median")
        row = [f"D{D} S{S} {'causal' if causal else 'full  '}  flash {flops / t_flash / 1e9:6.1f}"]
        qd, kd, vd = (x.detach() for x in (q, k, v))
        out, lse = attnext.attention(qd, kd, vd, causal=causal, return_lse=True)
        for cfg in configs:
            base, _, mode = cfg.partition("+")
            kind, _, tile = base.partition(":")
            mode, _, chains = mode.partition("@")
            det = mode != "atomic"
            _env.setenv("ATTNEXT_BWD_DQ", mode)
            _env.setenv("ATTNEXT_BWD_DQ_CHAINS", chains or None)
            _env.setenv("ATTNEXT_BWD_SM90", "1" if kind == "sm90" else "0")
            _env.setenv("ATTNEXT_TILE_BWD_SM90", tile or None)
            try:
                g = attnext.attention_backward(dout, qd, kd, vd, out, lse, causal=causal, deterministic=det)
                err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                          for a, b in zip(g[:3], ref))
                if not err < 2e-2:
                    row.append(f"{cfg}: WRONG {err:.2g}")
                    continue
                t = triton.testing.do_bench(
                    lambda: attnext.attention_backward(dout, qd, kd, vd, out, lse, causal=causal,
                                                       deterministic=det),
                    return_mode="median")
                row.append(f"{cfg} {flops / t / 1e9:6.1f} ({t_flash / t:.2f}x)")
            except Exception as e:   # a configuration that does not fit this head dim
                row.append(f"{cfg}: {type(e).__name__} {str(e)[:60]}")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    cases = [(int(a.split(":")[0]), int(a.split(":")[1]), a.endswith(":causal")) for a in args if a[0].isdigit()]
    main([a for a in args if not a[0].isdigit()] or ["mma", "sm90", "sm90+atomic"], cases or CASES)
