"""Kernel lab: the forward's tile configurations side by side on one GPU, each validated first.

    python bench/labs/lab_fwd.py "128,64,4" "sm90" "sm90:128,64,8" ...

A configuration is attn_fwd.cu's tile "BLOCK_M,BLOCK_N,NUM_WARPS" (ATTNEXT_TILE_FWD, the wgmma
kernel off), or "sm90" / "sm90:BLOCK_M,BLOCK_N,WARPS" for attn_fwd_sm90.cu (ATTNEXT_TILE_SM90).
For each head dim / causal case: attnext under each configuration against
PyTorch SDPA's flash backend, bf16, triton.testing.do_bench medians, B*S = 16k tokens.
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
         (128, 2048, True), (128, 8192, True), (128, 16384, False)]


def main(configs):
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  configs {configs}")
    for D, S, causal in CASES:
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
            t_flash = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal), return_mode="median")
        row = [f"D{D} S{S} {'causal' if causal else 'full  '}  flash {flops / t_flash / 1e9:6.1f}"]
        out = torch.empty_like(q)
        for cfg in configs:
            kind, _, tile = cfg.partition(":") if cfg.startswith("sm90") else ("", "", cfg)
            _env.setenv("ATTNEXT_FWD_SM90", "1" if kind == "sm90" else "0")
            _env.setenv("ATTNEXT_TILE_FWD", None)
            _env.setenv("ATTNEXT_TILE_SM90", None)
            if tile:
                _env.setenv("ATTNEXT_TILE_SM90" if kind == "sm90" else "ATTNEXT_TILE_FWD", tile)
            try:
                out.fill_(float("nan"))
                attnext.attention(q, k, v, causal=causal, out=out)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                if not err < 2e-2:
                    row.append(f"{cfg}: WRONG {err:.2g}")
                    continue
                t = triton.testing.do_bench(lambda: attnext.attention(q, k, v, causal=causal, out=out),
                                            return_mode="median")
                row.append(f"{cfg} {flops / t / 1e9:6.1f} ({t_flash / t:.2f}x)")
            except Exception as e:   # a configuration that does not fit this head dim
                row.append(f"{cfg}: {type(e).__name__} {str(e)[:60]}")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["128,64,4", "128,32,4", "sm90"])
