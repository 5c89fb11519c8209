"""The option cases the lse gradient's and the sinks' tests run every backend on against the
reference, and the small problem each makes (2 sequences of 19 queries and 23 keys, or a packed
batch of 3; D 16)."""
import numpy as np

from conftest import F32, make_qkv, make_varlen_qkv, randn

CASES = {
    "plain": dict(),
    "causal_gqa": dict(causal=True, hk=1),
    "window_bias": dict(window=(3, 1), bias=True),
    "softcap_bhsd": dict(softcap=3.0, layout="bhsd"),
    "score_mod": dict(score_mod=lambda s, b, h, q_idx, kv_idx: s - 0.25 * np.abs(q_idx - kv_idx)),
    "varlen": dict(varlen=True, causal=True),
    "lengths": dict(seqlens=True, causal=True),   # the second sequence has no key
}


def problem(rng, case, dtype, H, sq=19, sk=23, d=16):
    """(q, k, v, varlen, opts) of CASES[case] with H query heads: varlen None, or the lengths'
    keywords; opts the rest of the call's keywords."""
    opts = dict(CASES[case])
    hk = opts.pop("hk", H)
    varlen = None
    if opts.pop("varlen", False):
        q, k, v = make_varlen_qkv(rng, 40, 46, H, hk, d, dtype=dtype)
        varlen = dict(cu_seqlens_q=np.array([0, 1, 17, 40], np.int32),
                      cu_seqlens_k=np.array([0, 9, 30, 46], np.int32))
    else:
        q, k, v = make_qkv(rng, 2, sq, sk, H, hk, d, dtype=dtype, layout=opts.get("layout", "bshd"))
    if opts.pop("bias", False):
        opts["bias"] = randn(rng, (H, sq, sk), F32)
    if opts.pop("seqlens", False):
        opts.update(seqlens_q=np.array([sq, sq - 4]), seqlens_k=np.array([sk - 3, 0]))
    return q, k, v, varlen, opts
