"""Kernel lab: how many exp2 a clock an SM computes, by instruction: ex2.approx.ftz.f32 against the
packed ex2.approx.f16x2 and ex2.approx.ftz.bf16x2 (two values an instruction), on this GPU.

    python bench/labs/lab_mufu.py

The question behind it (bench/NOTES.md, the Hopper forward's D64 rows): the softmax's exp2 runs
on the MUFU pipe at 16 a clock an SM, as fast as D64's two products per score on the tensor
cores; a packed exp2 that ran two values at the f32 rate would halve that. Each thread keeps 8
independent chains in a loop (no dependency stalls), compiled for sm_90a by CuPy's NVRTC (CuPy
is the lab's, not attnext's); one launch timed with CUDA events after a warm-up, the rate given
per clock at the device's maximum clock. Times instructions, not attnext's kernels: checks
nothing."""
import cupy as cp, numpy as np
src = r'''
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void k_f32(float *out, int iters) {
    float x[8]; for (int i = 0; i < 8; i++) x[i] = -0.001f * (threadIdx.x + i);
    for (int it = 0; it < iters; it++)
#pragma unroll
        for (int i = 0; i < 8; i++) { float y; asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[i])); x[i] = y - 1.0f; }
    float s = 0; for (int i = 0; i < 8; i++) s += x[i]; out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void k_f16x2(float *out, int iters) {
    unsigned x[8]; for (int i = 0; i < 8; i++) { __half2 h = __floats2half2_rn(-0.001f * (threadIdx.x + i), -0.002f); x[i] = *(unsigned *)&h; }
    for (int it = 0; it < iters; it++)
#pragma unroll
        for (int i = 0; i < 8; i++) { unsigned y; asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x[i])); x[i] = y ^ 0x80008000u; }
    float s = 0; for (int i = 0; i < 8; i++) { __half2 h = *(__half2 *)&x[i]; s += __low2float(h); } out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void k_bf16x2(float *out, int iters) {
    unsigned x[8]; for (int i = 0; i < 8; i++) { __nv_bfloat162 h = __floats2bfloat162_rn(-0.001f * (threadIdx.x + i), -0.002f); x[i] = *(unsigned *)&h; }
    for (int it = 0; it < iters; it++)
#pragma unroll
        for (int i = 0; i < 8; i++) { unsigned y; asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(y) : "r"(x[i])); x[i] = y ^ 0x80008000u; }
    float s = 0; for (int i = 0; i < 8; i++) { __nv_bfloat162 h = *(__nv_bfloat162 *)&x[i]; s += __low2float(h); } out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
'''
mod = cp.RawModule(code=src, options=("-arch=sm_90a",))
dev = cp.cuda.Device()
sms = dev.attributes["MultiProcessorCount"]; clk = dev.attributes["ClockRate"] * 1e3
blocks, threads, iters = sms * 8, 256, 4096
out = cp.zeros(blocks * threads, cp.float32)
for name, per in (("k_f32", 1), ("k_f16x2", 2), ("k_bf16x2", 2)):
    f = mod.get_function(name)
    f((blocks,), (threads,), (out, np.int32(iters)))
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record(); f((blocks,), (threads,), (out, np.int32(iters))); e.record(); e.synchronize()
    ms = cp.cuda.get_elapsed_time(s, e)
    n = blocks * threads * iters * 8 * per
    print(f"{name}: {n / (ms * 1e-3) / 1e12:.2f} T exp2/s, {n / (ms * 1e-3) / sms / clk:.1f} per clk per SM (at the max clock {clk/1e9:.2f} GHz)")
