"""Kernel lab: where the warp-specialised forward's time goes at a tile's boundary, from
globaltimer stamps (attn_fwd_sm90.cu's WS kernel as a persistent grid: the short rows;
bench/NOTES.md, forward v21-v23).

    python3 bench/labs/lab_fwd_stamps.py [D:S[:causal] ...]   (default: 64:2048:causal 128:2048)

Writes an instrumented copy of kernels/ into a temporary folder (string edits of the WS kernel's
part of attn_fwd_sm90.cu at fixed anchors: the lab stops if one is missing) and points
ATTNEXT_KERNEL_DIR at it. The stamps go into the forward's o_accum slot (the split-KV scratch,
unused by the WS kernel), 268 int64 per CTA: [0] the CTA's start, [1] its SM, [2] tiles done,
[3] its end; for its turns j < 13, 20 slots at 8 + 20 j: the first computing warpgroup's thread 0
writes c0 the tile taken, c1 its Q landed, c2 its first K landed, c3 its turn taken and first S
issued, c4 its key loop done (the last P V next), c5 its O stored (its bulk copies issued, where
out has a map), c6 its key tiles, and within c4..c5: c11 the last V landed, c12 the last P V
done, c13 finish_rows done (inv taken, lse stored), c14 O in the Q block (its warpgroup synced;
where out has a map); the second warpgroup's thread 0 writes c15 its c5; the producer thread
writes p7 the tile's Q issued, p8 its first K and V issued, p9 its last V issued, p10 the next
tile posted, and between p9 and the next tile's p7: p16 the next tile's number known (the
atomic's answer), p17 its place decoded, p18 its slot free, p19 (the next tile's) its extents
decoded. The stamps are pinned (stamping.macros): no load or store moves across one. The calls
take the persistent grid only where select.fwd_persist does (short rows without score options;
ATTNEXT_FWD_PERSIST=1 asks for it). Prints medians (and the 10th / 90th percentiles) over the
CTAs' tiles, in us (bf16, B*S = 16k tokens, H = 2048 / D, torch tensors in place), once the
stamped call's out is checked against torch SDPA's, and the tail: how long SMs sit idle before the
kernel's last CTA ends.
"""
import sys

import numpy as np

from stamping import macros, shapes, start

SLOTS, TURNS, W = 268, 13, 20
EDITS = [   # (anchor, text, whether the text goes before the anchor)
    ("#if ENTRY(attn_fwd_sm90) && WS\n",
     macros(SLOTS, pinned=True)
     + f"#define TRJ(i) do {{ if (ctid == 0 && w == 0 && j < {TURNS}) TR(8 + {W} * j + (i), gtime()); }} while (0)\n"
     + f"#define TRP(i) do {{ if (j < {TURNS}) TR(8 + {W} * j + (i), gtime()); }} while (0)\n"
     + f"#define TRJ1(i) do {{ if (ctid == 0 && w == 1 && j < {TURNS}) TR(8 + {W} * j + (i), gtime()); }} while (0)\n"),
    ("    const int tid = threadIdx.x, warp = uniform_warp_index(), lane = tid & 31, wg = warp >> 2;"
     "   /* roles: uniform */\n",
     "    if (tid == 0) { TR(0, gtime()); unsigned sm; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(sm)); TR(1, sm); }\n"),
    ("                qn++;\n#endif\n", "                TRP(7);\n"),
    ("                load(0, STAGES, empty_v, sV, &maps.v, V_BYTES, HEAD_DIM_V, full_v, tail_rows > 0);\n", "                TRP(8);\n"),
    ("            kv += tiles;\n#if PERSIST\n", "            TRP(9);\n"),
    ("            const ws_tile tl = ws_tile_at(p, pl.x, tiles_x, pl.h, pl.b);\n",
     "            asm volatile(\"\" ::\"r\"(tl.n_last), \"r\"(tl.m0) : \"memory\");\n            TRP(19);\n"),
    ("                taken = p.counters ? atomicAdd(p.counters, 1) : 0;\n",
     "            asm volatile(\"\" ::\"r\"(taken) : \"memory\");\n            TRP(16);\n"),
    ("                pl = ws_place_of(p, next, tiles_x, sec);\n",
     "            asm volatile(\"\" ::\"r\"(pl.x), \"r\"(pl.h), \"r\"(pl.b) : \"memory\");\n            TRP(17);\n"),
    ("            asm volatile(\"st.shared.v4.b32 [%0], {%1, %2, %3, %4};\"\n                         ::\"r\"(next_slot",
     "            TRP(18);\n", True),
    ("            mbar_arrive(next_full + 8 * s);\n", "            TRP(10);\n"),
    ("        if (t >= total)\n            break;\n", "        TRJ(0);\n"),
    ("        mbar_wait(q_full + 8 * (qn & 1), (qn >> 1) & 1);\n", "        TRJ(1);\n"),
    ("            float s[1][NT][4], corrs[2];\n            mbar_wait(full_k + 8 * st, (g / K_STAGES) & 1);\n",
     "            if (i == 0) TRJ(2);\n"),
    ("            turn_wait(w);\n            issue_s(s[0], st);\n", "            if (i == 0) TRJ(3);\n"),
    ("        {\n            const int g = kv + tiles - 1, pst = g % STAGES;\n",
     f"        TRJ(4);\n        if (ctid == 0 && w == 0 && j < {TURNS}) TR(8 + {W} * j + 6, tiles);\n", True),
    ("            issue_pv(pst);\n            wgmma_wait<0>();\n", "            TRJ(11);\n", True),
    ("        kv += tiles;\n        float inv[2];\n", "        TRJ(12);\n", True),
    ("        finish_rows<1>(p, sq, sc.to_natural, m, l, row0, b, h, 1, 0, Lq, inv);\n",
     "        asm volatile(\"\" ::\"f\"(inv[0]), \"f\"(inv[1]) : \"memory\");\n        TRJ(13);\n"),
    ("            fence_proxy_async_shared();                  /* the block's writes before the copies read it */\n",
     "            TRJ(14);\n", True),
    ("            pend = qn & 1;\n", "            TRJ(5);\n            TRJ1(15);\n            if (ctid == 0 && w == 0) TR(2, j + 1);\n", True),
    ("#if PERSIST\n        fence_proxy_async_shared();", "        TRJ(5);\n        if (ctid == 0 && w == 0) TR(2, j + 1);\n", True),
    ("    if (w == 0)\n        turn_wait(0);                                    /* the last warpgroup's last pass */\n",
     "    if (ctid == 0 && w == 0) TR(3, gtime());\n"),
]
# (name, what it is) of the spans printed: c0..c15 and p7..p19 as in the docstring, "next" the next turn's
SPANS = [("Q wait", "c1 - c0"), ("K0 wait", "c2 - c1"), ("turn+S", "c3 - c2"), ("loop", "c4 - c3"),
         ("per key", "(c4 - c3) / c6"), ("P V+O", "c5 - c4"), ("to next", "next - c5"),
         ("Q issued", "p7 - c0"), ("K0 issued", "p8 - c0"), ("last V", "p9 - c5"), ("posted", "p10 - c5"),
         ("V in", "c11 - c4"), ("last PV", "c12 - c11"), ("finish", "c13 - c12"), ("O smem", "c14 - c13"),
         ("copies", "c5 - c14"), ("WG1 end", "c15 - c5"),
         ("atomic", "p16 - p9"), ("place", "p17 - p16"), ("slot", "p18 - p17"), ("post", "p10 - p18"),
         ("decode", "next p19 - p10"), ("Q issue", "next p7 - next p19")]


def boundary_spans(t):
    """name -> the spans (ns) over every CTA's stamped turns that have the stamps they need."""
    got = {name: [] for name, _ in SPANS}
    for r in t:
        n = min(int(r[2]), TURNS)
        turns = [[r[8 + W * j + i] for i in range(W)] for j in range(n)]
        for j, c in enumerate(turns):
            nxt = turns[j + 1] if j + 1 < n else [0] * W    # the next turn's stamps (0: none)
            if not all(c[:6]):
                continue
            got["Q wait"].append(c[1] - c[0])
            got["K0 wait"].append(c[2] - c[1])
            got["turn+S"].append(c[3] - c[2])
            got["loop"].append(c[4] - c[3])
            got["per key"].append((c[4] - c[3]) / max(1, c[6]))
            got["P V+O"].append(c[5] - c[4])
            if nxt[0]:
                got["to next"].append(nxt[0] - c[5])
            for name, i, at in (("Q issued", 7, c[0]), ("K0 issued", 8, c[0]), ("last V", 9, c[5]), ("posted", 10, c[5])):
                if c[i]:
                    got[name].append(c[i] - at)
            if all(c[16:19]) and c[9] and c[10]:
                for name, i, at in (("atomic", 16, c[9]), ("place", 17, c[16]), ("slot", 18, c[17]),
                                    ("post", 10, c[18])):
                    got[name].append(c[i] - at)
                if nxt[19] and nxt[7]:
                    got["decode"].append(nxt[19] - c[10])
                    got["Q issue"].append(nxt[7] - nxt[19])
            if all(c[11:16]):
                for name, i, at in (("V in", 11, c[4]), ("last PV", 12, c[11]), ("finish", 13, c[12]),
                                    ("O smem", 14, c[13]), ("copies", 5, c[14]), ("WG1 end", 15, c[5])):
                    got[name].append(c[i] - at)
    return got


def main():
    lend = start("attn_fwd_sm90.cu", EDITS, prefix="attnext-fwd-stamps-")
    import torch
    import attnext
    import verify

    for D, S, causal, B, H in shapes(sys.argv[1:], ["64:2048:causal", "128:2048"]):
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
        verify.check(f"D{D} S{S} stamped", {"out": (out, verify.sdpa(q, k, v, causal))})
        t = t[(t[:, 0] > 0) & (t[:, 2] > 0)]
        if not len(t):
            print(f"== D{D} S{S}: no stamps (did the call take the persistent WS grid?)")
            continue
        first, end = t[:, 0].min(), t[:, 3].max()
        print(f"== D{D} S{S} {'causal' if causal else 'full'}: {len(t)} CTAs, kernel {(end - first) / 1e3:.1f} us, "
              f"tiles a CTA median {np.median(t[:, 2]):.0f} (min {t[:, 2].min()}, max {t[:, 2].max()})")
        got = boundary_spans(t)
        print("  a tile (medians, us): " + "  ".join(f"{name} {np.median(got[name]) / 1e3:.2f}"
                                                     for name, _ in SPANS if got[name]))
        print("  10th / 90th: " + "  ".join(f"{name} {np.percentile(got[name], 10) / 1e3:.2f} / "
                                            f"{np.percentile(got[name], 90) / 1e3:.2f}" for name, _ in SPANS if got[name]))
        print("  " + ", ".join(f"{name}: {what}" for name, what in SPANS))
        q_in = [r[9] - r[0] for r in t if r[9]]
        print(f"  CTA start -> its first Q in {np.median(q_in) / 1e3:.2f}  CTA end -> kernel end: median "
              f"{np.median(end - t[:, 3]) / 1e3:.2f}  max {(end - t[:, 3].min()) / 1e3:.2f}")


if __name__ == "__main__":
    main()
