"""GPU timeline of NumPy-in/NumPy-out forwards (torch.profiler's CUPTI trace: every copy and
kernel of the process, attnext's driver-API ones included)."""
import json, sys, time
import ml_dtypes, numpy as np, torch
import attnext
B, S, H, D, causal = (2, 8192, 16, 128, True) if "--s8k" in sys.argv else (8, 2048, 16, 128, False)
rng = np.random.default_rng(1)
q, k, v = (rng.standard_normal((B, S, H, D), np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
for i in range(3):
    o = attnext.attention(q, k, v, causal=causal, device="cuda")
    del o
from torch.profiler import profile, ProfilerActivity
from attnext import _C
host = []
for name in ("memcpy_htod", "memcpy_dtoh", "cuda_launch_attention", "stream_synchronize", "stream_wait"):
    f = getattr(_C, name)
    def wrap(*a, _f=f, _n=name):
        t = time.perf_counter()
        r = _f(*a)
        host.append((_n, t, time.perf_counter()))
        return r
    setattr(_C, name, wrap)
marks = []
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(3):
        torch.cuda.synchronize()
        time.sleep(0.05)
        host.clear()
        t0 = time.perf_counter()
        o = attnext.attention(q, k, v, causal=causal, device="cuda")
        marks.append(1e3 * (time.perf_counter() - t0))
        del o
print("wall per call (ms):", [f"{m:.2f}" for m in marks])
print("host side of the last call (ms from its start):")
for n, a, b in host:
    if n != "stream_wait":
        print(f"  {1e3*(a-t0):7.3f} -> {1e3*(b-t0):7.3f}  {n}")
prof.export_chrome_trace("/tmp/tl.json")
ev = json.load(open("/tmp/tl.json"))["traceEvents"]
gpu = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
# the last call's GPU work: after the largest gap in the trace
starts = [i + 1 for i in range(len(gpu) - 1) if gpu[i + 1]["ts"] - (gpu[i]["ts"] + gpu[i]["dur"]) > 20000]
start = starts[-1] if starts else 0
t0 = gpu[start]["ts"]
print("GPU side of the last call (ms from its first event):")
for e in gpu[start:]:
    if True:
        a = e.get("args", {})
        nbytes = a.get("bytes")
        rate = f"{nbytes / e['dur'] / 1e3:6.1f} GB/s" if nbytes and e["dur"] else ""
        print(f"  {(e['ts'] - t0)/1e3:7.3f} -> {(e['ts'] + e['dur'] - t0)/1e3:7.3f} ms  stream {a.get('stream', '?'):>4}  "
              f"{e['name'][:40]:40s} {'' if nbytes is None else nbytes >> 20:>4} MiB {rate}")
