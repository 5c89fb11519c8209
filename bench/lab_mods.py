"""Kernel lab: score_mod / mask_mod on the GPU against FlexAttention (torch.compile'd), same run,
bf16, forward and backward, and the first call's time (NVRTC compiles included).

    python3 bench/lab_mods.py [--cases softcap,relbias,doc,doc_causal,window] [--kernels]

Rows ([3/4]'s): softcap and a relative-bias table (causal, D=128, S=8k, B=2, H=16), the document
causal mask (16k tokens, the bench's 7 documents, H=16, D=128) given as a mask_mod alone and as
causal=True plus a document mask_mod, and a causal sliding window of 1024 as a mask_mod (S=8k).
Flex gets the same functions in torch and a block mask made once, outside the timing; attnext
builds its block mask inside every call. Times are triton.testing.do_bench medians; TFLOP/s count
the pairs each mask keeps. attnext is checked against Flex (max |x - y| / max |y|).
"""
import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attnext  # noqa: E402
from attnext.bench_cuda import document_lengths  # noqa: E402

S, B, H, D, T = 8192, 2, 16, 128, 16384
WINDOW = 1024


def rel(x, y):
    return float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30))


def make_case(name):
    """(attnext kwargs, flex score_mod, flex mask_mod, shape (B, S), kept pairs per head)."""
    if name == "softcap":
        return (dict(causal=True, score_mod=lambda s, b, h, qi, ki: 30.0 * np.tanh(s / 30.0)),
                lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0),
                lambda b, h, qi, ki: qi >= ki, (B, S), S * (S + 1) / 2)
    if name == "relbias":
        table = np.random.default_rng(0).standard_normal((H, 2 * S)).astype(np.float32)
        tt = torch.from_numpy(table).cuda()
        return (dict(causal=True, score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki + S]),
                lambda s, b, h, qi, ki: s + tt[h, qi - ki + S],
                lambda b, h, qi, ki: qi >= ki, (B, S), S * (S + 1) / 2)
    if name in ("doc", "doc_causal"):
        lens = document_lengths()
        doc = np.repeat(np.arange(len(lens)), lens)
        dt = torch.from_numpy(doc).cuda()
        kept = sum(n * (n + 1) / 2 for n in lens)
        if name == "doc":
            mm = dict(mask_mod=lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi))
        else:
            mm = dict(causal=True, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])
        return (mm, None, lambda b, h, qi, ki: (dt[qi] == dt[ki]) & (qi >= ki), (1, T), kept)
    if name == "window":
        kept = sum(min(i + 1, WINDOW) for i in range(S))
        return (dict(mask_mod=lambda b, h, qi, ki: (ki <= qi) & (qi - ki < WINDOW)), None,
                lambda b, h, qi, ki: (qi >= ki) & (qi - ki < WINDOW), (B, S), kept)
    raise SystemExit(f"unknown case {name}")


def run(name, flex):
    kw, f_score, f_mask, (b, s), kept = make_case(name)
    fwd_flops = 4 * b * H * kept * D
    q, k, v, dout = (torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    row = {"case": name}
    # attnext: first call (compiles), then timed
    t0 = time.perf_counter()
    out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
    torch.cuda.synchronize()
    row["first_fwd_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = attnext.attention_backward(dout, q, k, v, out, lse, **kw)
    torch.cuda.synchronize()
    row["first_bwd_s"] = time.perf_counter() - t0
    o = torch.empty_like(q)
    row["ax_fwd"] = triton.testing.do_bench(lambda: attnext.attention(q, k, v, out=o, **kw))
    row["ax_bwd"] = triton.testing.do_bench(lambda: attnext.attention_backward(dout, q, k, v, out, lse, **kw))
    # flex: block mask once, outside the timing
    bm = create_block_mask(f_mask, None, None, s, s, device="cuda")
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    fo = flex(qt, kt, vt, score_mod=f_score, block_mask=bm)
    fg = torch.autograd.grad(fo, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
    row["err_out"] = rel(out, fo.transpose(1, 2))
    row["err_grads"] = max(rel(a, b_.transpose(1, 2)) for a, b_ in zip((g.dq, g.dk, g.dv), fg))
    with torch.no_grad():
        row["flex_fwd"] = triton.testing.do_bench(lambda: flex(qt, kt, vt, score_mod=f_score, block_mask=bm))
    row["flex_bwd"] = triton.testing.do_bench(
        lambda: torch.autograd.grad(fo, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True))
    for d, factor in (("fwd", 1.0), ("bwd", 2.5)):
        row[f"ax_{d}_tflops"] = factor * fwd_flops / row[f"ax_{d}"] / 1e9
        row[f"flex_{d}_tflops"] = factor * fwd_flops / row[f"flex_{d}"] / 1e9
        row[f"{d}_ratio"] = row[f"flex_{d}"] / row[f"ax_{d}"]
    return row


def kernel_times(call, reps=5):
    """[(grid, ms)] of the launches one call makes: CUDA events around each launch on its stream,
    the median over reps calls (a replay alone would read the call's scratch after its end)."""
    from attnext import _C
    launch, seen = _C.cuda_launch_attention, []

    def timed(*args):
        stream = torch.cuda.ExternalStream(args[4]) if args[4] else torch.cuda.default_stream()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        launch(*args)
        e1.record(stream)
        seen.append(("x".join(map(str, args[1])), e0, e1))
    _C.cuda_launch_attention = timed
    runs = []
    try:
        for _ in range(reps):
            seen.clear()
            call()
            torch.cuda.synchronize()
            runs.append([(g, e0.elapsed_time(e1)) for g, e0, e1 in seen])
    finally:
        _C.cuda_launch_attention = launch
    return [(runs[0][i][0], float(np.median([r[i][1] for r in runs]))) for i in range(len(runs[0]))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="softcap,relbias,doc,doc_causal,window")
    ap.add_argument("--kernels", action="store_true", help="also time each launch of a call alone")
    args = ap.parse_args()
    flex = torch.compile(flex_attention, dynamic=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H{H} D{D}", flush=True)
    print(f"{'case':11} {'ax fwd ms':>9} {'flex':>7} {'x':>6} {'ax bwd ms':>9} {'flex':>7} {'x':>6} "
          f"{'ax TF f/b':>11} {'first f/b s':>11} {'err o/g':>13}", flush=True)
    for name in args.cases.split(","):
        try:
            r = run(name, flex)
        except Exception as e:                      # one failing row does not hide the others
            print(f"{name:11} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        if args.kernels:
            kw, _, _, (b, s), _ = make_case(name)
            q, k, v, dout = (torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
            for d, call in (("fwd", lambda: attnext.attention(q, k, v, **kw)),
                            ("bwd", lambda: attnext.attention_backward(dout, q, k, v, out, lse, **kw))):
                print(f"  {name} {d} kernels: " + ", ".join(f"{g} {ms:.3f} ms" for g, ms in kernel_times(call)),
                      flush=True)
        print(f"{name:11} {r['ax_fwd']:9.3f} {r['flex_fwd']:7.3f} {r['fwd_ratio']:5.2f}x "
              f"{r['ax_bwd']:9.3f} {r['flex_bwd']:7.3f} {r['bwd_ratio']:5.2f}x "
              f"{r['ax_fwd_tflops']:5.0f}/{r['ax_bwd_tflops']:<5.0f} "
              f"{r['first_fwd_s']:5.1f}/{r['first_bwd_s']:<5.1f} {r['err_out']:.1e}/{r['err_grads']:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
