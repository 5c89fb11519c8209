"""Kernel lab: host overhead of one attnext call against its kernel alone (same launch, replayed);
the call's out is checked against torch SDPA first.

    python bench/labs/lab_overhead.py [--profile]     (--profile: cProfile of 200 calls per case)
"""
import cProfile
import pstats
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository's attnext
import attnext  # noqa: E402
from attnext import _C  # noqa: E402
from attnext.cuda import nvrtc, select  # noqa: E402
import verify  # noqa: E402


def main():
    captured = {}
    launch = _C.cuda_launch_attention

    def capture(*args):
        captured["args"] = args        # fn, grid, block, smem, stream, template, ptrs, scale, softcap
        return launch(*args)

    _C.cuda_launch_attention = capture
    for D, S, causal in ((64, 2048, False), (128, 2048, False), (128, 8192, True)):
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        out.fill_(float("nan"))
        attnext.attention(q, k, v, causal=causal, out=out)
        verify.check(f"D{D} S{S} causal={causal}", {"out": (out, verify.sdpa(q, k, v, causal))})
        t_call = triton.testing.do_bench(lambda: attnext.attention(q, k, v, causal=causal, out=out),
                                         return_mode="median")
        keep = attnext.attention(q, k, v, causal=causal, out=out, return_lse=True)   # noqa: F841 (lse stays alive)
        args = captured["args"]
        t_kernel = triton.testing.do_bench(lambda: launch(*args), return_mode="median")
        attrs = _C.function_attributes(args[0])
        import time
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            attnext.attention(q, k, v, causal=causal, out=out)
        host = (time.perf_counter() - t0) / 50
        torch.cuda.synchronize()
        if "--profile" in sys.argv:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                attnext.attention(q, k, v, causal=causal, out=out)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        print(f"D{D} S{S} causal={causal}: call {flops / t_call / 1e9:.1f} TF/s, kernel alone "
              f"{flops / t_kernel / 1e9:.1f} TF/s, host per call (async) {host * 1e3:.3f} ms, "
              f"kernel {t_kernel:.3f} ms; regs {attrs['num_regs']} local {attrs['local_size_bytes']} B "
              f"tile {select.tile_config(D, D)} grid {args[1]}", flush=True)


if __name__ == "__main__":
    main()
