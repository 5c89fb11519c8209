"""attnext: attention for NumPy buffers (and, later, GPU arrays).

    out = attnext.attention(q, k, v, causal=True)                 # q (B, Sq, Hq, D)
    out, lse = attnext.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)
    grads = attnext.attention_backward(dout, q, k, v, out, lse, causal=True)

`attnext.reference` is the float64 NumPy definition every backend is tested against.
"""
__version__ = "0.1.0"

from . import reference
from ._types import CompileError, Grads
from .api import (attention, attention_backward, info, varlen_attention,
                  varlen_attention_backward)

__all__ = ["attention", "varlen_attention", "attention_backward", "varlen_attention_backward",
           "info", "reference", "Grads", "CompileError", "__version__"]
