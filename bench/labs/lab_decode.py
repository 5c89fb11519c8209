"""Kernel lab: the decode rows (B1 Sk32k, B8 Sk8k, B64 Sk4k; Hq32 Hk8 D128 bf16, causal bottom-right,
out= given, torch inputs), whether a call waits for the GPU, and where the host time goes.

    python bench/labs/lab_decode.py [--profile N] [--rows 1,8,64] [--kernels]

For each row: the host time per asynchronous call (200 calls queued behind a long GPU sleep, so
the queue never drains; a call that waits for the GPU shows as the sleep's length), do_bench
medians with and without the L2 flush for attnext and the peers (SDPA flash, cuDNN), GB/s of K
and V; attnext's out is checked against torch SDPA first. --profile N: cProfile's top N functions (self time) of the B1 call.
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository's attnext
import attnext  # noqa: E402
import verify  # noqa: E402


def peers(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            call()
            out[name] = call
        except RuntimeError as e:
            print(f"    {name}: {str(e).splitlines()[0]}")
    return out


def host_per_call(f, n=200):
    """Seconds of host time per call with the GPU kept busy: a call that synchronises waits
    for the sleep and shows up as ~sleep / n."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)          # ~1 s of GPU time ahead of the calls
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--kernels", action="store_true", help="torch.profiler: kernel times of 50 calls")
    args = ap.parse_args()
    sk_of = {1: 32768, 8: 8192, 64: 4096}
    for B in map(int, args.rows.split(",")):
        Sk = sk_of[B]
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Sk, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = torch.empty_like(q)
        gb = 2 * B * Sk * 8 * 128 * 2 / 1e9
        calls = {"attnext": lambda: attnext.attention(q, k, v, causal="bottom_right", out=out)}
        calls.update(peers(q, k, v))
        calls["attnext"]()
        verify.check(f"decode B{B}", {"out": (out, verify.sdpa(q, k, v))})   # Sq = 1: every key kept
        print(f"decode B{B} Sk{Sk} Hq32 Hk8 D128 ({gb * 1e3:.0f} MB of K and V)", flush=True)
        for name, f in calls.items():
            f()
            torch.cuda.synchronize()
            host = host_per_call(f)
            t_flush = triton.testing.do_bench(f, return_mode="median") * 1e-3
            # without the L2 flush: back-to-back calls timed by events around 100 of them
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            for _ in range(100):
                f()
            loop_host = (time.perf_counter() - t0) / 100
            e1.record()
            torch.cuda.synchronize()
            t_loop = e0.elapsed_time(e1) * 1e-3 / 100
            print(f"  {name:8s} host/call {host * 1e6:6.1f} us | do_bench {t_flush * 1e6:6.1f} us "
                  f"({gb / t_flush:5.0f} GB/s) | back-to-back {t_loop * 1e6:6.1f} us "
                  f"({gb / t_loop:5.0f} GB/s, host {loop_host * 1e6:.1f} us)", flush=True)
        if args.kernels:
            from torch.profiler import ProfilerActivity, profile
            for name, f in calls.items():
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(50):
                        f()
                    torch.cuda.synchronize()
                print(f"  {name}: kernels of 50 back-to-back calls")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
        if args.profile and B == 1:
            print_profile(calls["attnext"], args.profile)


def print_profile(f, top, n=500):
    """cProfile's top functions (self time) over n calls of f."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        f()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
