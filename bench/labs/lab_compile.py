"""Kernel lab: what a new score_mod's first CUDA call compiles, and for how long.

    python bench/labs/lab_compile.py [--arch sm_90a] [--mods rel_bias,doc_mask] [--all] [--split]

Needs NVRTC, not a GPU. The cache is a fresh temporary folder (ATTNEXT_CACHE_DIR), so every
mod misses it whatever ran before. For each mod (D = 128, bfloat16, no other option):
  per kernel   the NVRTC seconds of each module a call compiles, as cuda_backend plans it:
               the forward (on sm_90a the warp-specialised kernel past 1024 rows,
               SM90_TILE_WS_MODS with a score_mod, else attn_fwd_sm90's short tile;
               attn_fwd.cu's generic kernel), the backward's entry points
               (attn_bwd_pre comes from the plain variant: warmup's cache, no compile) and,
               with a mask_mod, attn_block_mask (shared by both); with --split the front end
               (source -> PTX for compute_XX) and ptxas (the rest) of each
  first call   the wall time of the compiles of a forward call and of a backward call
               (nvrtc.prefetch: a call's entry points and the block-mask kernel in parallel
               threads); with a GPU (torch) the wall time of the real calls instead, S = 2048,
               causal
  disk hit     a fresh Python process with the disk cache filled: tracing, code generation,
               hashing and reading the cubins (with a GPU: the real calls, after a plain call
               has initialised CUDA)
The score_mods: softcap, rel_bias (a table lookup), alibi (slopes lookup), doc_mask (a mask_mod
over a document-id array), rel_bias+doc_mask; --all adds `heavy` (select.mod_sample's pair:
integer rules, three arrays, tanh).

    python bench/labs/lab_compile.py --speed [--mods ...]

times the mods' kernels instead (GPU, torch: forward and backward ms, B = 8, S = 2048, H = 8,
causal, medians of 20 after a warm-up, each mod's first batch item checked against
the CPU backend first), through the public API only; --env NAME=V1,V2 times each
mod under each value of a plan knob in one process (e.g. ATTNEXT_BWD_DQ=ordered,atomic). Copied into
another checkout's bench/labs/ and run there, --speed times that checkout's kernels.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

D, S, HEADS = 128, 2048, 8
TABLE = np.random.default_rng(0).standard_normal((HEADS, 2 * S + 1)).astype(np.float32) * 0.1
SLOPES = np.linspace(0.01, 0.1, HEADS).astype(np.float32)
DOC = np.repeat(np.arange(S // 256), 256)
ALLOWED = np.ones((S, 64), bool)


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * np.tanh(score / 30.0)


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + TABLE[h, q_idx - kv_idx + S]


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * np.abs(q_idx - kv_idx)


def doc_mask(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx]


def heavy_score(score, b, h, q_idx, kv_idx):
    s = 30.0 * np.tanh(score / 30.0) + TABLE[h, q_idx - kv_idx + S] * SLOPES[0]
    return np.where((q_idx - kv_idx) % 4 == 0, s, np.maximum(s, -1.0) - (kv_idx // 3) * 0.01)


def heavy_mask(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & ALLOWED[q_idx, kv_idx % 64] | (kv_idx == 0)


MODS = {"softcap": (softcap, None), "rel_bias": (rel_bias, None), "alibi": (alibi, None),
        "doc_mask": (None, doc_mask), "rel_bias+doc_mask": (rel_bias, doc_mask),
        "heavy": (heavy_score, heavy_mask)}
DEFAULT_MODS = ("softcap", "rel_bias", "alibi", "doc_mask", "rel_bias+doc_mask")
FEATURES = dict(dtype="bfloat16", D=D, Dv=D, vec=True, softcap=False, bias_dtype=None,
                alibi_dtype=None, mask=False)


def generated(name):
    from attnext.mods import codegen
    from attnext.mods import trace
    sm, mm = MODS[name]
    return codegen.generated(trace.trace_score_mod(sm) if sm else None,
                             trace.trace_mask_mod(mm) if mm else None)


def forward_specs(arch, gen, rows=S, generic=False):
    """The (kernel, entry point, defines, generated) a forward call loads (cuda_backend's plan),
    the block-mask kernel last when there is a mask_mod."""
    from attnext.cuda import nvrtc, select
    # the WS kernel where a Hopper driver takes it (dense keys of a tile's rows at least)
    ws = not generic and select.fwd_ws(arch, D, D, True, rows, rows, "bfloat16", True, tensor_maps=True, mods=gen)
    kernel, tile = select.fwd_kernel(arch, D, D, True, False, rows, gen, ws=ws)
    if generic:
        kernel, tile = "attn_fwd", select.tile_config(D, D)
    return ([(kernel, kernel, select.fwd_defines(**FEATURES, tile=tile, mods=gen, ws=ws), gen.source)]
            + select.block_mask_specs(gen))


def backward_specs(arch, gen):
    from attnext.cuda import nvrtc, select
    tile = select.bwd_tile_config(D, D)
    defines = select.bwd_defines(**FEATURES, tile=tile, mods=gen)
    out = [("attn_bwd", "attn_bwd_pre", defines, gen.source)]
    if select.bwd_sm90_applies(arch, D, D, True):
        d90 = select.bwd_defines(**FEATURES, tile=select.bwd_sm90_tile(D, "recompute"), mods=gen)
        return (out + [("attn_bwd_sm90", n, d90, gen.source) for n in ("attn_bwd_dkdv_sm90", "attn_bwd_dq_sm90")]
                + select.block_mask_specs(gen))
    kv = ("attn_bwd_dv", "attn_bwd_dk") if tile["kv_split"] else ("attn_bwd_dkdv",)
    return out + [("attn_bwd", n, defines, gen.source) for n in kv + ("attn_bwd_dq",)] + select.block_mask_specs(gen)


class PtxOnly:
    """NVRTC through ctypes, for the front end alone (_C.nvrtc_compile wants a cubin)."""

    def __init__(self):
        from attnext import _C
        from attnext.cuda import nvrtc, select
        nvrtc.nvrtc()
        self.lib = ctypes.CDLL(_C.nvrtc_load(nvrtc.nvrtc_candidates()))

    def seconds(self, source, filename, options, headers):
        lib, prog = self.lib, ctypes.c_void_p()
        n = len(headers)
        names = (ctypes.c_char_p * n)(*[h[0].encode() for h in headers])
        texts = (ctypes.c_char_p * n)(*[h[1].encode() for h in headers])
        if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), n, texts, names):
            raise RuntimeError("nvrtcCreateProgram failed")
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        t0 = time.perf_counter()
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        seconds = time.perf_counter() - t0
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        if rc:
            raise RuntimeError(f"nvrtcCompileProgram of {filename}: error {rc}")
        return seconds


def per_kernel(arch, specs, ptx):
    """[(entry point, seconds, front-end seconds or None, 'plain' when it is warmup's module)]."""
    from attnext import _C
    from attnext.cuda import nvrtc, select
    out = []
    for kernel, name, defines, gen_src in specs:
        k, d, g = nvrtc.module_of(kernel, name, defines, gen_src)
        if g is None:
            out.append((name, None, None, "plain variant: warmup's cache"))
            continue
        args = nvrtc.compile_args(k, d, arch, g)
        t0 = time.perf_counter()
        _C.nvrtc_compile(*args)
        total = time.perf_counter() - t0
        front = None
        if ptx:
            src, fn, opts, hdrs = args
            virtual = f"--gpu-architecture={arch.replace('sm_', 'compute_')}"
            opts = [virtual if o == f"--gpu-architecture={arch}" else o for o in opts]
            front = ptx.seconds(src, fn, opts, hdrs)
        out.append((name, total, front, ""))
    return out


def print_kernels(rows):
    for name, total, front, note in rows:
        if total is None:
            print(f"    {name:22s} {'-':>7s}  {note}")
        elif front is None:
            print(f"    {name:22s} {total:6.2f}s")
        else:
            print(f"    {name:22s} {total:6.2f}s  front end {front:5.2f}s  ptxas {total - front:5.2f}s")


def gpu():
    """torch when a CUDA GPU and attnext's CUDA backend are usable, else None."""
    try:
        import torch
        from attnext.cuda import backend as cuda_backend
        return torch if torch.cuda.is_available() and cuda_backend.usable() else None
    except ImportError:
        return None


def gpu_calls(torch, name):
    """Seconds of the first forward and the first backward call with this mod (real calls)."""
    import attnext
    sm, mm = MODS[name]
    q, k, v = (torch.randn(1, S, HEADS, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, lse = attnext.attention(q, k, v, causal=True, score_mod=sm, mask_mod=mm, return_lse=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    attnext.attention_backward(torch.randn_like(out), q, k, v, out, lse, causal=True, score_mod=sm, mask_mod=mm)
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1


def warm_plain(arch, specs):
    """Compiles the plain modules among specs' (on a used machine: warmup's disk cache)."""
    from attnext.cuda import nvrtc, select
    for spec in specs:
        k, d, g = nvrtc.module_of(*spec)
        if g is None:
            nvrtc.cubin(k, d, arch)


def compile_call(arch, specs):
    """What a call's plan does before loading: prefetch (parallel), then each cubin (from memory)."""
    from attnext.cuda import nvrtc, select
    nvrtc.prefetch(specs, arch)
    for spec in specs:
        k, d, g = nvrtc.module_of(*spec)
        nvrtc.cubin(k, d, arch, g)


def init_gpu(torch):
    """A plain forward and backward: CUDA's and attnext's one-time costs are no part of a mod's."""
    import attnext
    x = torch.randn(1, S, HEADS, D, device="cuda", dtype=torch.bfloat16)
    out, lse = attnext.attention(x, x, x, causal=True, return_lse=True)
    attnext.attention_backward(out, x, x, x, out, lse, causal=True)
    torch.cuda.synchronize()


def check_first_item(name, inputs, out, g, sm, mm):
    """The first batch item's out, dq, dk, dv against the CPU backend's (float32, which the tests
    hold to attnext.reference; the float64 reference takes minutes a mod here), before the mod
    is timed."""
    import attnext
    import verify
    q, k, v, dout = (x[:1].float().cpu().numpy() for x in inputs)
    kw = dict(causal=True, score_mod=sm, mask_mod=mm, device="cpu")
    want, lse = attnext.attention(q, k, v, return_lse=True, **kw)
    grads = attnext.attention_backward(dout, q, k, v, want, lse, **kw)
    got = [x[:1].float().cpu().numpy() for x in (out, g.dq, g.dk, g.dv)]
    verify.check(name, dict(zip(("out", "dq", "dk", "dv"), zip(got, [want, grads.dq, grads.dk, grads.dv]))))


def speed(names, env=None):
    """ms of each mod's forward and backward (real kernels; compiles happen in the warm-up).
    env: (variable, [values]): each mod timed under each value of the variable in turn (one of
    the plans' knobs, select.FWD_KNOBS / BWD_KNOBS, such as ATTNEXT_BWD_DQ)."""
    import torch
    import attnext
    from attnext import _env
    B, H = 16384 // S, HEADS                 # the tables have HEADS rows
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    print(f"{torch.cuda.get_device_name()}, attnext from {os.path.dirname(attnext.__file__)}; "
          f"B={B} S={S} H={H} D={D} causal bf16, ms (median of 20)")

    def ms(fn):
        fn()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    knob, values = env if env else (None, [None])
    for name in ["plain"] + names:
        sm, mm = MODS.get(name, (None, None))
        for value in values:         # each value's kernels in turn, one mod after another
            if knob:
                _env.setenv(knob, value)
            out, lse = attnext.attention(q, k, v, causal=True, score_mod=sm, mask_mod=mm, return_lse=True)
            g = attnext.attention_backward(dout, q, k, v, out, lse, causal=True, score_mod=sm, mask_mod=mm)
            check_first_item(name, (q, k, v, dout), out, g, sm, mm)
            fwd = ms(lambda: attnext.attention(q, k, v, causal=True, score_mod=sm, mask_mod=mm))
            bwd = ms(lambda: attnext.attention_backward(dout, q, k, v, out, lse, causal=True, score_mod=sm,
                                                        mask_mod=mm))
            label = f"{name} {knob}={value}" if knob else name
            print(f"    {label:40s} forward {fwd:7.3f} ms  backward {bwd:7.3f} ms", flush=True)


def hit(arch, names):
    """The disk-cache hit of a fresh process (run by main in a subprocess): JSON on stdout."""
    t0 = time.perf_counter()
    from attnext.cuda import nvrtc, select
    nvrtc.nvrtc()
    torch = gpu()
    if torch is not None:
        init_gpu(torch)
    res = {"startup": time.perf_counter() - t0}
    for name in names:
        before = nvrtc.cache_info()["compiles"]
        if torch is not None:
            fwd, bwd = gpu_calls(torch, name)
        else:
            t0 = time.perf_counter()
            compile_call(arch, forward_specs(arch, generated(name)))
            t1 = time.perf_counter()
            compile_call(arch, backward_specs(arch, generated(name)))
            fwd, bwd = t1 - t0, time.perf_counter() - t1
        res[name] = (fwd, bwd, nvrtc.cache_info()["compiles"] - before)
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", help="default: the GPU's, else sm_90a")
    ap.add_argument("--mods", help=f"comma-separated, of {', '.join(MODS)}")
    ap.add_argument("--all", action="store_true", help="every mod, the heavy one too")
    ap.add_argument("--split", action="store_true", help="front end and ptxas of each kernel")
    ap.add_argument("--speed", action="store_true", help="time the mods' kernels (GPU) instead")
    ap.add_argument("--env", help="with --speed: NAME=V1,V2 times each mod under each value "
                    "(e.g. ATTNEXT_BWD_DQ=ordered,atomic)")
    ap.add_argument("--hit", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = list(MODS) if args.all else args.mods.split(",") if args.mods else list(DEFAULT_MODS)
    if args.speed:
        env = None
        if args.env:
            knob, values = args.env.split("=", 1)
            env = (knob, values.split(","))
        return speed(names, env)
    if args.hit:
        return hit(args.arch, args.hit.split(","))
    cache = tempfile.mkdtemp(prefix="attnext-lab-compile-")
    os.environ["ATTNEXT_CACHE_DIR"] = cache
    from attnext import _C
    from attnext.cuda import nvrtc, select
    torch = gpu()
    arch = args.arch or ("sm_%d%d" % torch.cuda.get_device_capability() if torch else "sm_90a")
    arch = "sm_90a" if arch == "sm_90" else arch
    print(f"NVRTC {'.'.join(map(str, nvrtc.nvrtc()))}, {arch}, D={D} bf16, {os.cpu_count()} CPUs, "
          f"{'GPU: ' + torch.cuda.get_device_name() if torch else 'no GPU'}; cache {cache}")
    ptx = PtxOnly() if args.split else None
    if torch is not None:
        init_gpu(torch)
    print("plain kernels (for comparison; warmup compiles these, whole files):")
    plain = [("attn_fwd", select.fwd_defines(**FEATURES, tile=select.tile_config(D, D)))]
    if arch == "sm_90a":
        plain.insert(0, ("attn_fwd_sm90", select.fwd_defines(**FEATURES, tile=select.SM90_TILE_LONG)))
    for kernel, defines in plain:
        t0 = time.perf_counter()
        _C.nvrtc_compile(*nvrtc.compile_args(kernel, defines, arch))
        print(f"    {kernel:22s} {time.perf_counter() - t0:6.2f}s")
    for name in names:
        gen = generated(name)
        print(f"{name}:")
        print("  forward, per kernel:")
        rows = per_kernel(arch, forward_specs(arch, gen), ptx)
        if arch == "sm_90a":
            rows += [(n + " short", t, f, note) for n, t, f, note in
                     per_kernel(arch, forward_specs(arch, gen, rows=512)[:1], ptx)]
            rows += [(n + " generic", t, f, note) for n, t, f, note in
                     per_kernel(arch, forward_specs(arch, gen, generic=True)[:1], ptx)]
        print_kernels(rows)
        print("  backward, per kernel (attn_block_mask: the forward's):")
        print_kernels(per_kernel(arch, [s for s in backward_specs(arch, gen) if s[0] != "attn_block_mask"], ptx))
        warm_plain(arch, forward_specs(arch, gen) + backward_specs(arch, gen))
        before = nvrtc.cache_info()["compiles"]
        if torch is not None:
            fwd, bwd = gpu_calls(torch, name)
        else:
            t0 = time.perf_counter()
            compile_call(arch, forward_specs(arch, gen))
            t1 = time.perf_counter()
            compile_call(arch, backward_specs(arch, gen))
            fwd, bwd = t1 - t0, time.perf_counter() - t1
        compiles = nvrtc.cache_info()["compiles"] - before
        print(f"  first call: forward {fwd:.2f}s, backward {bwd:.2f}s ({compiles} compiles"
              f"{', real calls' if torch else ''})")
    r = subprocess.run([sys.executable, __file__, "--arch", arch, "--hit", ",".join(names)],
                       capture_output=True, text=True, env=os.environ)
    if r.returncode:
        sys.exit(r.stderr)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"fresh process, disk cache hit (startup: import, NVRTC load{', CUDA init' if torch else ''}: "
          f"{res.pop('startup') * 1e3:.0f} ms):")
    for name, (fwd, bwd, compiles) in res.items():
        print(f"    {name:22s} forward {fwd * 1e3:6.1f} ms  backward {bwd * 1e3:6.1f} ms  ({compiles} compiles)")


if __name__ == "__main__":
    main()
