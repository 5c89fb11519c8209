"""Kernel lab: what building a mask_mod's block mask (kernels/attn_block_mask.cu) costs against the
attention call it serves (the issue: under 10% for a document mask over 16k tokens).

    python3 bench/labs/lab_blockmask.py [--S 16384] [--reps 7] [--cells 8,16,32]

The bench's document masks run as varlen (lower.documents) and its window as a band (lower.
lower_band): neither builds a block mask. Here both lowerings are turned off, so each mask_mod
below takes the block-mask path, and mod_cache is cleared before every call so that every call
builds its mask. Times: CUDA events around each launch of a forward (median of --reps calls;
the first launch is the block mask's), and do_bench of the whole forward with the mask kept
(mod_cache left alone) and rebuilt (cleared before each call). --cells: the values of
codegen.BLOCK_CELLS (cells per CTA of the block-mask kernel) to run each case with. Each case's
first call is checked against torch SDPA given the mask's kept pairs as a dense bool mask.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import attnext  # noqa: E402
from attnext.bench import cuda as bench_cuda  # noqa: E402
from attnext.cuda import mod_cache  # noqa: E402
from attnext.mods import codegen, lower  # noqa: E402
import verify  # noqa: E402
from lab_mods import kernel_times  # noqa: E402


def cases(S):
    lens = bench_cuda.document_lengths() if S == 16384 else (S // 4, S // 4, S // 2)
    doc = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    prefix = S // 4
    return {
        "doc": (dict(mask_mod=lambda b, h, q, k: doc[q] == doc[k]), {}),
        "doc causal": (dict(mask_mod=lambda b, h, q, k: doc[q] == doc[k]), dict(causal=True)),
        "doc&causal in mask": (dict(mask_mod=lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)), {}),
        "window1024": (dict(mask_mod=lambda b, h, q, k: (k <= q) & (q - k < 1024)), {}),
        "prefix-lm": (dict(mask_mod=lambda b, h, q, k: (k <= q) | (k < prefix)), {}),
    }


def kept_pairs(mask_mod, S, causal, device):
    """mask_mod's kept pairs (and causality) as a bool (S, S) tensor, a chunk of rows at a time."""
    kv, rows = np.arange(S)[None, :], []
    for r0 in range(0, S, 1024):
        q = np.arange(r0, min(S, r0 + 1024))[:, None]
        m = np.broadcast_to(mask_mod(0, 0, q, kv), (len(q), S)) & ((kv <= q) if causal else True)
        rows.append(torch.from_numpy(np.ascontiguousarray(m)).to(device))
    return torch.cat(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cells", default=str(codegen.BLOCK_CELLS))
    args = ap.parse_args()
    lower.documents = lambda o, tm: None                 # the block-mask path for every case
    lower.lower_band = lambda o, tm: tm
    q, k, v = (torch.randn(1, args.S, args.H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    print(f"{torch.cuda.get_device_name()}, B1 S{args.S} H{args.H} D128 bf16, forward, every mask_mod "
          "on the block-mask path; ms", flush=True)
    print(f"{'case':22s} {'cells':>5s} {'build':>7s} {'attn':>7s} {'build/attn':>10s} {'call kept':>9s} "
          f"{'call built':>10s}")
    for name, (mods, opts) in cases(args.S).items():
        kw = dict(mods, **opts, out=out)
        want = verify.sdpa(q, k, v, mask=kept_pairs(mods["mask_mod"], args.S, opts.get("causal"), q.device))
        for cells in map(int, args.cells.split(",")):
            codegen.BLOCK_CELLS = cells
            mod_cache.clear()
            out.fill_(float("nan"))
            attnext.attention(q, k, v, **kw)              # compiles
            verify.check(f"{name}, {cells} cells", {"out": (out, want)})

            def built():
                mod_cache.clear()
                attnext.attention(q, k, v, **kw)
            launches = kernel_times(built, args.reps)
            build, attn = launches[0][1], sum(ms for _, ms in launches[1:])
            kept = triton.testing.do_bench(lambda: attnext.attention(q, k, v, **kw), warmup=25, rep=100)
            rebuilt = triton.testing.do_bench(built, warmup=25, rep=100)
            print(f"{name:22s} {cells:5d} {build:7.3f} {attn:7.3f} {build / attn:9.1%} {kept:9.3f} {rebuilt:10.3f}"
                  f"   ({', '.join(f'{g} {ms:.3f}' for g, ms in launches)})", flush=True)


if __name__ == "__main__":
    main()
