"""C's layouts, each written once: the dtype codes of csrc/attn_params.h's attn_dtype and the
address slots of _C.cuda_launch_attention come from _C.layout() by name; the records _C.forward /
_C.backward (csrc/module.c) and _C.attn_template (csrc/cuda/attention.c) read by attribute name
are typed here, and tests/unit/test_layout.py holds them to what those C files read."""
from dataclasses import dataclass
from typing import Any, Optional

import ml_dtypes
import numpy as np

from . import _C

_LAYOUT = _C.layout()
# attn_params.h's attn_dtype
DTYPE_CODES = dict(_LAYOUT["dtypes"])
DTYPE_NAMES = tuple(sorted(DTYPE_CODES, key=DTYPE_CODES.get))
NUMPY_DTYPES = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


def dtype_name(dt):
    """The attn_dtype name of a NumPy dtype ("bfloat16" for ml_dtypes.bfloat16)."""
    return NUMPY_DTYPES[np.dtype(dt)]


def dtype_code(dt):
    """The attn_dtype code of a NumPy dtype."""
    return DTYPE_CODES[NUMPY_DTYPES[np.dtype(dt)]]


# cuda/attention.c's PTR_FIELDS: the attn_params fields cuda_launch_attention's `ptrs` fill, in order
PTR_FIELDS = _LAYOUT["ptr_fields"]
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
    dlse: Any = None             # backward: lse's gradient, laid out as lse, or None
    sinks: Any = None            # (Hq,) in lse's dtype, or None
    block_table: Any = None      # a paged cache: int32 (B * bt_stride,), k and v (num_pages, page_size, Hk, D)
    bt_stride: int = 0
    page_size: int = 0


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
    dlse: Any = None
    delta: Any = None
    dq_accum: Any = None
    dq_sem: Any = None
    num_splits: int = 1
    dq_write_last: int = 0
    k_rows_max: int = 0
    max_rows_q: int = 0          # varlen: the grid's rows per segment (0: the tensor's)
    max_rows_k: int = 0
    page_size: int = 0           # a paged cache: k's rows a page, block_table's row stride
    bt_stride: int = 0
    tma_rows: int = 0            # attn_fwd.cu TMA_KV: the rows of a tensor map's box (0: no maps)
    tma_rows_q: int = 0          # attn_bwd_sm90.cu BWD_TMA, the persistent WS forward: the rows of q's (and dout's) boxes (0: no maps)
    tma_read_once: int = 0       # 1: K and V stream past once (TMA_KV decode): their maps fill L2 by 128 B, not 256
    tma_out: int = 0             # 1: the persistent WS forward's O leaves by bulk tensor copies where out's rows allow
