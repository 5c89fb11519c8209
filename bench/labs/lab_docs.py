"""Kernel lab: the document-causal packed row (the bench's 7 documents in 16k tokens, D = 128,
16 heads) as one varlen call (cu_seqlens on the GPU, then on the host) against each document as
its own plain causal call, forward and backward, so the varlen grid's cost shows apart from the
kernel's and the host's; and the same documents as one sequence with a document mask_mod
(alone, and beside causal=True; forward and backward), and a mask_mod of plain causality against
causal=True, so the generated kernels' cost shows apart from the block sparsity's.

    python bench/lab_docs.py            (timings)
    python bench/lab_docs.py once       (one call of each, for ncu)
    python bench/lab_docs.py aligned    (documents of lengths a multiple of 128, the same total:
                                         a mask_mod's partial tiles only on the diagonal, as varlen's)
"""
import sys

import numpy as np
import torch
import triton

import attnext
from attnext.bench_cuda import document_lengths

H, D = 16, 128


ALIGNED = (640, 3712, 640, 3328, 2048, 3456, 2560)


def main(once, aligned=False):
    lens = ALIGNED if aligned else document_lengths()
    T = sum(lens)
    q, k, v, dout = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    cu_host = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu = torch.tensor(cu_host, device="cuda")
    longest = max(lens)
    kw = dict(max_seqlen_q=longest, max_seqlen_k=longest, causal=True)
    out, lse = attnext.varlen_attention(q, k, v, cu, cu, return_lse=True, **kw)
    bounds = np.concatenate([[0], np.cumsum(lens)])
    docs = [tuple(x[a:b][None] for x in (q, k, v, dout)) for a, b in zip(bounds[:-1], bounds[1:])]
    per_doc = [attnext.attention(dq, dk, dv, causal=True, return_lse=True) for dq, dk, dv, _ in docs]

    def varlen_fwd():
        attnext.varlen_attention(q, k, v, cu, cu, out=out, **kw)

    def varlen_fwd_host_cu():
        attnext.varlen_attention(q, k, v, cu_host, cu_host, out=out, **kw)

    def varlen_bwd_host_cu():
        attnext.varlen_attention_backward(dout, q, k, v, out, lse, cu_host, cu_host, **kw)

    def varlen_bwd():
        attnext.varlen_attention_backward(dout, q, k, v, out, lse, cu, cu, **kw)

    def docs_fwd():
        for (dq, dk, dv, _), (o, _) in zip(docs, per_doc):
            attnext.attention(dq, dk, dv, causal=True, out=o)

    def docs_bwd():
        for (dq, dk, dv, do), (o, l) in zip(docs, per_doc):
            attnext.attention_backward(do, dq, dk, dv, o, l, causal=True)

    doc = np.repeat(np.arange(len(lens)), lens)
    q1, k1, v1, o1 = (x[None] for x in (q, k, v, out))

    def mask_fwd():
        attnext.attention(q1, k1, v1, out=o1, mask_mod=lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi))

    def mask_causal_fwd():
        attnext.attention(q1, k1, v1, out=o1, causal=True, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])

    def causal_mod_fwd():
        attnext.attention(q1, k1, v1, out=o1, mask_mod=lambda b, h, qi, ki: ki <= qi)

    def causal_fwd():
        attnext.attention(q1, k1, v1, out=o1, causal=True)

    def doc_causal(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    do1 = dout[None]
    mo, ml = attnext.attention(q1, k1, v1, mask_mod=doc_causal, return_lse=True)

    def mask_bwd():
        attnext.attention_backward(do1, q1, k1, v1, mo, ml, mask_mod=doc_causal)

    def mask_causal_bwd():
        attnext.attention_backward(do1, q1, k1, v1, mo, ml, causal=True, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])

    flops = sum(4 * H * n * n * D / 2 for n in lens)
    full = 4 * H * T * T * D / 2
    for name, fn, mult in (("varlen fwd", varlen_fwd, 1), ("  host cu", varlen_fwd_host_cu, 1),
                           ("per-doc fwd", docs_fwd, 1), ("mask_mod fwd", mask_fwd, 1),
                           ("  +causal", mask_causal_fwd, 1), ("causal mod", causal_mod_fwd, full / flops),
                           ("causal=True", causal_fwd, full / flops), ("varlen bwd", varlen_bwd, 2.5),
                           ("  host cu", varlen_bwd_host_cu, 2.5), ("per-doc bwd", docs_bwd, 2.5),
                           ("mask_mod bwd", mask_bwd, 2.5), ("  +causal", mask_causal_bwd, 2.5)):
        if once:
            fn()
            torch.cuda.synchronize()
            continue
        t = triton.testing.do_bench(fn, return_mode="median")
        print(f"{name:12s} {t:7.3f} ms  {mult * flops / t / 1e9:6.1f} TFLOP/s")
    print(f"documents {lens}")


if __name__ == "__main__":
    main("once" in sys.argv[1:], "aligned" in sys.argv[1:])
