"""C's layouts as Python writes them, each written once: the dtype codes of csrc/attn_params.h's
attn_dtype, the address slots of _C.cuda_launch_attention (csrc/cuda/attention.c's PTR_FIELDS), and
the records _C.forward / _C.backward (csrc/module.c) and _C.attn_template (csrc/cuda/attention.c)
read by attribute name. tests/test_layout.py reads those C files and holds the two sides
together (until _C exports its layout by name)."""
from dataclasses import dataclass
from typing import Any, Optional

import ml_dtypes
import numpy as np

# attn_params.h: typedef enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2, DT_F64 = 3 } attn_dtype
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_NAMES)}
NUMPY_DTYPES = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


def dtype_name(dt):
    """The attn_dtype name of a NumPy dtype ("bfloat16" for ml_dtypes.bfloat16)."""
    return NUMPY_DTYPES[np.dtype(dt)]


def dtype_code(dt):
    """The attn_dtype code of a NumPy dtype."""
    return DTYPE_CODES[NUMPY_DTYPES[np.dtype(dt)]]


# cuda/attention.c's PTR_FIELDS: the attn_params fields cuda_launch_attention's `ptrs` fill, in order
PTR_FIELDS = ("q", "k", "v", "out", "lse", "o_accum", "lse_accum", "bias", "mask", "alibi",
              "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "dout", "dq", "dk", "dv",
              "dbias", "delta", "dq_accum", "dq_sem", "dead", "row_mz")
SLOT = {name: i for i, name in enumerate(PTR_FIELDS)}


@dataclass(slots=True)
class CpuCall:
    """What _C.forward / _C.backward read (csrc/module.c, by these names). Tensors are NumPy
    arrays (bfloat16 viewed as uint16): q, k, v, out, dout, dq, dk, dv (B, S, H, D); lse
    (B, Hq, Sq); bias (B, Hb, Sq, Sk); mask likewise, bool; alibi (B, Hq); None where off."""
    dtype: int
    B: int
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    cu_seqlens_q: Optional[np.ndarray]
    cu_seqlens_k: Optional[np.ndarray]
    seqused_q: Optional[np.ndarray]
    seqused_k: Optional[np.ndarray]
    bias: Any
    bias_dtype: int
    bias_heads: int
    mask: Any
    mask_heads: int
    alibi: Optional[np.ndarray]
    alibi_dtype: int
    scale: float
    softcap: float
    causal: int
    window_left: int
    window_right: int
    num_threads: int
    mods: Any = None             # interp.bind's programs, or None
    dout: Any = None
    dq: Any = None
    dk: Any = None
    dv: Any = None
    dbias: Any = None


@dataclass(slots=True)
class KernelCall:
    """What _C.attn_template reads (csrc/cuda/attention.c, by these names): the GPU call's options and
    its tensors as (ptr, shape, strides in elements) tuples (DevView.as_tuple) or None."""
    device: int
    dtype: int
    B: int
    causal: int
    window_left: int
    window_right: int
    bias_dtype: int
    alibi_dtype: int
    bias_heads: int
    mask_heads: int
    q: Any
    k: Any
    v: Any
    bias: Any
    mask: Any
    alibi: Any
    out: Any = None
    lse: Any = None
    dout: Any = None
    dq: Any = None
    dk: Any = None
    dv: Any = None
    dbias: Any = None
    delta: Any = None
    dq_accum: Any = None
    dq_sem: Any = None
    num_splits: int = 1
    dq_write_last: int = 0
    k_rows_max: int = 0
