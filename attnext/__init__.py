"""attnext: attention for NumPy buffers and GPU arrays, forward and backward.

    out = attnext.attention(q, k, v, causal=True)                 # q (B, Sq, Hq, D)
    out = attnext.attention(q, k, v, layout="bhsd")               # PyTorch SDPA / Flex tensors
    out, lse = attnext.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)   # packed (T, H, D)
    grads = attnext.attention_backward(dout, q, k, v, out, lse, causal=True)
    out = attnext.attention(q, k, v, score_mod=fn, mask_mod=keep)  # FlexAttention-style callbacks
    out, lse = attnext.merge([o1, o2], [lse1, lse2])              # parts over disjoint keys -> the whole

`attnext.reference` is the float64 NumPy definition every backend is tested against;
`attnext.testing.assert_close` holds any implementation to it; `attnext.info()` says which
backends this machine can run. help(attnext.attention) documents every option.
"""
from __future__ import annotations

import os as _os

from . import _env
from ._version import __version__


def _load_extension():
    """Import attnext._C with OpenMP's workers waiting passively.

    libgomp reads OMP_WAIT_POLICY once, when it loads with the extension. Its default spins idle
    workers after every call, and they fight NumPy's BLAS threads for the cores (alternating an
    attnext call with a matrix product ran 10x slower here). The variable is set only while the
    extension loads: it reaches the libgomp that loads with it (and any other user of that same
    libgomp), nothing loaded later; a value the user set wins, and a libgomp already loaded keeps
    its own setting.
    """
    simd = _env.get("ATTNEXT_SIMD")
    if simd is not None and simd not in ("portable", "avx2", "avx512", "neon"):
        raise ValueError(f"ATTNEXT_SIMD must be portable, avx2, avx512 or neon, got {simd!r}")
    ours = "OMP_WAIT_POLICY" not in _os.environ
    if ours:
        _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        from . import _C  # noqa: F401
    finally:
        if ours:
            del _os.environ["OMP_WAIT_POLICY"]


_load_extension()

from . import reference  # noqa: E402
from .types import CompileError, Grads  # noqa: E402
from .blockmask import BlockMask, block_mask  # noqa: E402
from .api import (attention, attention_backward, cache_info, info, varlen_attention,
                  varlen_attention_backward)
from .merge import merge  # noqa: E402

__all__ = ["attention", "varlen_attention", "attention_backward", "varlen_attention_backward", "merge",
           "info", "cache_info", "block_mask", "BlockMask", "reference", "Grads", "CompileError", "__version__"]
