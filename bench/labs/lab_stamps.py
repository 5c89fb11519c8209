"""Kernel lab: where a backward CTA of attn_bwd_dkdv_ws_sm90 spends its time, from globaltimer
stamps (H100: bench/HISTORY.md, session 18).

    python3 bench/labs/lab_stamps.py [D:S[:causal] ...]      (default: 64:512 64:512:causal 128:512)

Writes an instrumented copy of kernels/ into a temporary folder (string edits of
attn_bwd_sm90.cu at fixed anchors: the lab stops if one is missing) and points
ATTNEXT_KERNEL_DIR at it. The stamps go into the backward's unused o_accum slot, 64 int64 per CTA:
[0] start, [1] K and V in, [2] the consumers' end (dK, dV stored), [3] the writer's end, [4] the
SM, [5] items; for items j < 8: [8 + j] the consumers start it, [24 + j] its dq_full, [40 + j]
the writer's turn granted, [56 + j] the writer done with it; over all the CTA's items, summed:
[16] the writers' waits for their turns (ordered mode), [17] their additions' issue to landing,
[18] consumer thread 0's waits for a free dQ stage, [19] its waits for Q and dO. Prints medians
over the CTAs (bf16, B*S = 16k tokens and B = 1 past S16k, H = 2048 / D, deterministic), once the
stamped call's dq, dk, dv are checked against torch SDPA's. With ATTNEXT_BWD_DQ=atomic the calls
run deterministic=False (dQ by atomics: no turns, so no writer's waits), for a stamped run beside
the ordered one.
"""
import os
import sys

from stamping import macros, med, shapes, start

EDITS = [   # (anchor, text inserted after it)
    ("#if ENTRY(attn_bwd_dkdv_ws_sm90)\n", macros(64)),
    ("    const int tid = threadIdx.x, warp = DQ_BY_ROWS ? tid >> 5 : uniform_warp_index(), wg = warp >> 2;\n"
     "    const int64_t hk = blockIdx.y, b = blockIdx.z;\n",
     "    if (tid == 0) { TR(0, gtime()); unsigned sm; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(sm)); TR(4, sm); }\n"),
    ("                mbar_wait(dq_full + 8 * x, (j >> 1) & 1);\n",
     "                const long long w0 = gtime();\n"),
    ("                if (wl == 0 && !alone) {\n#if DQ_ORDERED\n                    fence_proxy_async_global();\n#endif\n",
     "                    const long long w1 = gtime();\n                    if (j < 8) TR(40 + j, w1);\n"
     "                    if (p.o_accum) atomicAdd(SUM(16), (unsigned long long)(w1 - w0));\n"),
    ("                    bulk_wait();\n                    fence_proxy_async_global();\n",
     "                    if (p.o_accum) atomicAdd(SUM(17), (unsigned long long)(gtime() - w1));\n"),
    ("                __syncwarp();\n                mbar_arrive(dq_empty + 8 * x);\n",
     "                if (wl == 0 && j < 8) TR(56 + j, gtime());\n"),
    ("            if (wl == 0)\n                bulk_wait();\n", "            if (wl == 0) TR(3, gtime());\n"),
    ("    named_sync(1, KV_THREADS);            /* K and V in */\n",
     "    if (ctid == 0) { TR(1, gtime()); TR(5, items); }\n"),
    ("        mbar_wait(q_full + 8 * x, (j >> 1) & 1);\n",
     "        if (ctid == 0 && j < 8) TR(8 + j, gtime());\n"
     "        if (ctid == 0 && p.o_accum) atomicAdd(SUM(19), (unsigned long long)(gtime() - c0));\n"),
    ("        const score_ctx sc = make_score_ctx(p, b, h, sq, sk);\n",
     "        const long long c0 = gtime();\n"),
    ("        if (j >= 2)\n            mbar_wait(dq_empty + 8 * x, ((j >> 1) - 1) & 1);\n",
     "        if (ctid == 0 && p.o_accum) atomicAdd(SUM(18), (unsigned long long)(gtime() - c1));\n"),
    ("        fence_acc(acc);\n\n",
     "        const long long c1 = gtime();\n"),
    ("        mbar_arrive(dq_full + 8 * x);\n", "        if (ctid == 0 && j < 8) TR(24 + j, gtime());\n"),
    ("    store_dkdv_staged(p, sk, hk, dk, dv, n0w, sQ + (items & 1) * KQ_BYTES + cwarp * 2048);\n",
     "    if (ctid == 0) TR(2, gtime());\n"),
]


def diff(t, a, b):
    """Stamp b - stamp a per CTA, None where either was never written."""
    return [r[b] - r[a] if r[a] and r[b] else None for r in t]


def main():
    lend = start("attn_bwd_sm90.cu", EDITS, prefix="attnext-stamps-")
    import numpy as np
    import torch
    import attnext
    import verify

    det = os.environ.get("ATTNEXT_BWD_DQ") != "atomic"
    for D, S, causal, B, H in shapes(sys.argv[1:], ["64:512", "64:512:causal", "128:512"]):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = attnext.attention(q, k, v, causal=causal, return_lse=True)
        dout = torch.randn_like(out)
        ctas = -(-S // 128) * H * B           # the grid: key blocks of 128 x kv heads x sequences
        buf = torch.zeros(64 * ctas, dtype=torch.int64, device="cuda")
        for _ in range(3):
            attnext.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
        torch.cuda.synchronize()
        lend(buf)
        g = attnext.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
        torch.cuda.synchronize()
        lend(None)
        _, want = verify.sdpa(q, k, v, causal, dout=dout)    # the stamped kernel's answer, checked
        verify.check(f"D{D} S{S} stamped", {n: (x, w) for n, x, w in zip(("dq", "dk", "dv"), g, want)})
        t = buf.view(-1, 64).cpu().numpy()
        t = t[(t[:, 0] > 0) & (t[:, 5] > 0)]
        if not len(t):
            print(f"== D{D} S{S}: no stamps (did the call take attn_bwd_dkdv_ws_sm90?)")
            continue
        items = t[:, 5]
        end = np.maximum(t[:, 2], t[:, 3])
        print(f"== D{D} S{S} {'causal' if causal else 'full'}: {len(t)} CTAs, kernel "
              f"{(end.max() - t[:, 0].min()) / 1e3:.1f} us, items median {np.median(items)}")
        print("  start->kv_in", med(diff(t, 0, 1)), " kv_in->item0", med(diff(t, 1, 8)),
              " consumers' end->writer's end", med(diff(t, 2, 3)), " start->end", med(end - t[:, 0]))
        for j in range(8):
            sel = t[items > j]
            if len(sel) < len(t) // 2:
                break
            nxt = diff(sel, 24 + j, 9 + j) if j < 7 else [None]
            print(f"  item {j}: consumers {med(diff(sel, 8 + j, 24 + j))}  to the next {med(nxt)}"
                  f"  writer waits {med(diff(sel, 24 + j, 40 + j))}  writer's turn {med(diff(sel, 40 + j, 56 + j))}")
        few = t[items <= 8]                   # the last item stamped: the store follows it
        print("  dK, dV store (consumers' end - last dq_full)",
              med([r[2] - r[24 + r[5] - 1] for r in few]) if len(few) else "      -")
        ends, gaps = {}, []
        for r, e in sorted(zip(t, end), key=lambda x: x[0][0]):
            if r[4] in ends:
                gaps.append(r[0] - ends[r[4]])
            ends[r[4]] = e
        print("  a CTA's end -> the next's start on its SM", med(gaps))
        per = lambda i: med([r[i] / r[5] for r in t])   # noqa: E731  (a sum over the CTA's items, per item)
        print(f"  per item, over all items: writer's turn wait {per(16)}  its addition to landing {per(17)}"
              f"  consumers wait for a dQ stage {per(18)}, for Q / dO {per(19)}")


if __name__ == "__main__":
    main()
