"""Kernel lab: how fast this GPU's SMs read from L2, against HBM: every CTA streams a buffer that
fits L2 (8-32 MB, read many times) or one that does not (2 GB), by 16-byte ld.global.cg loads.

    python bench/labs/lab_l2.py

The question behind it (bench/NOTES.md, the Hopper forward's D64 rows): does a key loop that
reads its K and V tiles at ~3.3 TB/s over the chip (D64 S2k causal: 32 KB a key tile an SM every
~1.26 us) sit at the L2's read rate? Compiled by CuPy's NVRTC (CuPy is the lab's, not
attnext's); triton.testing.do_bench medians; the loads' values are folded into one store that
never happens, so nothing is checked."""
import cupy as cp
import triton.testing as tt

SRC = r'''
extern "C" __global__ void rd(const int4 *__restrict__ a, long n, int passes, int4 *out) {
    int4 acc = make_int4(0, 0, 0, 0);
    const long stride = (long)gridDim.x * blockDim.x;
    for (int p = 0; p < passes; p++)
        for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x + (long)p * 4099 % 1024; i < n; i += stride) {
            const int4 v = __ldcg(a + i);
            acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
        }
    if (acc.x == 0x12345 && acc.y == 7)   /* never with the buffer's ones: keeps the loads */
        out[0] = acc;
}
'''


def main():
    k = cp.RawKernel(SRC, "rd")
    out = cp.zeros(4, dtype=cp.int32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), f"{sms} SMs")
    for mb in (8, 16, 24, 32, 48, 2048):
        n = mb * 2**20 // 16
        a = cp.ones(n * 4, dtype=cp.int32)
        passes = max(1, 512 // mb)
        for per_sm, threads in ((1, 1024), (2, 1024), (4, 512)):
            grid = sms * per_sm

            def call():
                k((grid,), (threads,), (a, cp.int64(n), cp.int32(passes), out))
            call()
            cp.cuda.Device().synchronize()
            ms = tt.do_bench(call, warmup=25, rep=200)
            print(f"{mb:5d} MB x {passes:3d} passes, {grid} CTAs x {threads}: {mb * 2**20 * passes / ms / 1e9:7.2f} TB/s")


if __name__ == "__main__":
    main()
