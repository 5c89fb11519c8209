"""Kernel lab: attnext's decode B1 host time per call as the process around it changes (fresh;
after torch.compile(flex_attention) has run; with gc off), and under cProfile in the slow state.

    python bench/lab_host_env.py
"""
import gc
import sys

import torch
import triton

import attnext
from lab_decode import host_per_call, print_profile   # bench/ is the script's folder


def main():
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 32768, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)

    def f():
        return attnext.attention(q, k, v, causal=False, device="cuda", out=out)
    f()

    def report(state):
        hosts = sorted(host_per_call(f, 300) for _ in range(5))
        t = triton.testing.do_bench(f, return_mode="median")
        print(f"{state:40s} host/call {hosts[0] * 1e6:6.1f}-{hosts[-1] * 1e6:6.1f} us, do_bench {t * 1e3:6.1f} us, "
              f"gc counts {gc.get_count()}, tracked {len(gc.get_objects()) if 'objs' in sys.argv else '-'}",
              flush=True)
    report("fresh")
    gc.disable()
    report("fresh, gc off")
    gc.enable()
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    report("after importing flex_attention")
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k[:, :4096], v[:, :4096]))
    flex(qt, kt, vt, enable_gqa=True)
    torch.cuda.synchronize()
    report("after a compiled flex call")
    gc.disable()
    report("after a compiled flex call, gc off")
    gc.enable()
    print("sys.gettrace", sys.gettrace(), "sys.getprofile", sys.getprofile(), flush=True)
    print_profile(f, 20)


if __name__ == "__main__":
    main()
