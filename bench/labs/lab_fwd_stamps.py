"""Kernel lab: where the warp-specialised forward's time goes, tile by tile, from globaltimer
stamps (attn_fwd_sm90.cu's WS kernel; the persistent grid's rows above all: bench/NOTES.md,
forward, "where the S2k rows' remaining time goes").

    python3 bench/labs/lab_fwd_stamps.py [D:S[:causal] ...]   (default: 128:2048 64:2048:causal 128:8192)

Writes an instrumented copy of kernels/ into a temporary folder (string edits of the WS kernel's
part of attn_fwd_sm90.cu at fixed anchors: the lab stops if one is missing) and points
ATTNEXT_KERNEL_DIR at it. The stamps go into the forward's o_accum slot (the split-KV scratch,
unused by the WS kernel), 176 int64 per CTA, written by the first computing warpgroup's thread
0: [0] the CTA's start, [1] its SM, [2] tiles done, [3] its end; for its turns j < 40:
[8 + 4j] the tile taken, [9 + 4j] its Q landed, [10 + 4j] its first S waited for, [11 + 4j] its
O stored. (A CTA a tile, without PERSIST, has no [8] / [9].) Prints medians over the CTAs' tiles
(bf16, B*S = 16k tokens, H = 2048 / D, torch tensors in place), once the stamped call's out is
checked against torch SDPA's, and the tail: how long SMs sit idle before the kernel's last CTA
ends.
"""
import sys

from stamping import macros, med, shapes, start

SLOTS, TURNS = 176, 40
EDITS = [   # (anchor, text, whether the text goes before the anchor)
    ("#if ENTRY(attn_fwd_sm90) && WS\n",
     macros(SLOTS) + f"#define TRJ(i) do {{ if (ctid == 0 && w == 0 && j < {TURNS}) TR(8 + 4 * j + (i), gtime()); }} while (0)\n"),
    ("    const int tid = threadIdx.x, warp = uniform_warp_index(), lane = tid & 31, wg = warp >> 2;"
     "   /* roles: uniform */\n",
     "    if (tid == 0) { TR(0, gtime()); unsigned sm; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(sm)); TR(1, sm); }\n"),
    ("        if (t >= total)\n            break;\n", "        TRJ(0);\n"),
    ("        mbar_wait(q_full + 8 * (qn & 1), (qn >> 1) & 1);\n", "        TRJ(1);\n"),
    ("                turn_pass(w);\n                wgmma_wait<0>();\n", "                TRJ(2);\n"),
    ("#if PERSIST\n        fence_proxy_async_shared();",
     "        TRJ(3);\n        if (ctid == 0 && w == 0) TR(2, j + 1);\n", True),
    ("    if (w == 0)\n        turn_wait(0);                                    /* the last warpgroup's last pass */\n",
     "    if (ctid == 0 && w == 0) TR(3, gtime());\n"),
]


def spans(t, a, b):
    """Stamp 8 + 4j + b - stamp 8 + 4j + a over every CTA's stamped turns j, None where either
    is missing."""
    out = []
    for r in t:
        for j in range(min(int(r[2]), TURNS)):
            x, y = r[8 + 4 * j + a], r[8 + 4 * j + b]
            out.append(y - x if x and y else None)
    return out


def gaps(t):
    """A tile's O stored -> the CTA's next tile taken."""
    out = []
    for r in t:
        for j in range(min(int(r[2]), TURNS) - 1):
            x, y = r[8 + 4 * j + 3], r[8 + 4 * (j + 1)]
            out.append(y - x if x and y else None)
    return out


def main():
    lend = start("attn_fwd_sm90.cu", EDITS, prefix="attnext-fwd-stamps-")
    import numpy as np
    import torch
    import attnext
    import verify

    for D, S, causal, B, H in shapes(sys.argv[1:], ["128:2048", "64:2048:causal", "128:8192"]):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for _ in range(3):
            attnext.attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        ctas = -(-S // 64) * H * B            # more than any grid of the call (64-row tiles)
        buf = torch.zeros(SLOTS * ctas, dtype=torch.int64, device="cuda")
        lend(buf)
        out = attnext.attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        lend(None)
        t = buf.view(-1, SLOTS).cpu().numpy()
        want = verify.sdpa(q, k, v, causal)
        verify.check(f"D{D} S{S} stamped", {"out": (out, want)})
        t = t[(t[:, 0] > 0) & (t[:, 2] > 0)]
        if not len(t):
            print(f"== D{D} S{S}: no stamps (did the call take the WS kernel?)")
            continue
        first, end = t[:, 0].min(), t[:, 3].max()
        print(f"== D{D} S{S} {'causal' if causal else 'full'}: {len(t)} CTAs, kernel {(end - first) / 1e3:.1f} us, "
              f"tiles a CTA median {np.median(t[:, 2]):.0f} (min {t[:, 2].min()}, max {t[:, 2].max()})")
        print("  a tile: taken -> Q in", med(spans(t, 0, 1)), " Q in -> first S", med(spans(t, 1, 2)),
              " first S -> O stored", med(spans(t, 2, 3)), " O stored -> next taken", med(gaps(t)))
        q_in = [r[8 + 1] - r[0] if r[9] else None for r in t]
        print("  CTA start -> its first Q in", med(q_in),
              " CTA end -> kernel end: median", med(list(end - t[:, 3])), " max", med([end - t[:, 3].min()]))


if __name__ == "__main__":
    main()
