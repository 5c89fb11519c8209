"""attnext.merge for CUDA arrays: kernels/attn_merge.cu on the parts' device and stream (the first
out's: its library's current stream), results in new device arrays (attnext/merge.py checked
the parts)."""
import math

import numpy as np

from .. import _C
from .._layout import dtype_code
from . import arrays, nvrtc
from .backend import device_arch
from .staging import Staging

# kernels/attn_merge.cu's merge_part and merge_params
PART = np.dtype([("out", "u8"), ("lse", "u8"), ("out_s", "i8", 4), ("lse_s", "i8", 3)])
PARAMS = np.dtype([("parts", "u8"), ("out", "u8"), ("lse", "u8"), ("rows", "i8", 3), ("out_s", "i8", 4),
                   ("lse_s", "i8", 3), ("dv", "i8"), ("n_parts", "i8")])
ROWS_PER_BLOCK = 4               # attn_merge.cu's: a warp a row
MAX_PARTS = 1024                 # their weights in shared memory: 32 KiB in float64


def _strides(out, lse, layout):
    """(out's strides in lse's axis order, then along Dv; lse's three) in elements."""
    if len(out.shape) == 3:      # varlen: out (T, H, Dv), lse (H, T) as (1, H, T)
        return (0, out.strides[1], out.strides[0], out.strides[2]), (0,) + tuple(lse.strides)
    s = out.strides
    return ((s[0], s[2], s[1], s[3]) if layout == "bshd" else tuple(s)), tuple(lse.strides)


def merge(outs, lses, layout, acc):
    """(out, lse) as DeviceArrays: the merge of DevViews outs and lses (every one on one device)."""
    if len(outs) > MAX_PARTS:
        raise ValueError(f"merge on the GPU takes at most {MAX_PARTS} parts, got {len(outs)}: merge "
                         f"groups of them, then the groups' results")
    first = outs[0]
    device, stream = first.device, first.stream
    out = arrays.empty(first.shape, first.dtype, device, stream)
    lse = arrays.empty(lses[0].shape, acc, device, stream)
    rows = (1,) + tuple(lse.shape) if len(first.shape) == 3 else tuple(lse.shape)
    n_rows = math.prod(rows)
    if n_rows == 0:
        return out, lse
    table = np.zeros(len(outs), PART)
    for i, (o, l) in enumerate(zip(outs, lses)):
        table[i]["out"], table[i]["lse"] = o.ptr, l.ptr
        table[i]["out_s"], table[i]["lse_s"] = _strides(o, l, layout)
    p = np.zeros((), PARAMS)
    p["out"], p["lse"], p["rows"], p["dv"], p["n_parts"] = out.ptr, lse.ptr, rows, first.shape[-1], len(outs)
    p["out_s"], p["lse_s"] = _strides(out, lse, layout)
    smem = ROWS_PER_BLOCK * len(outs) * np.dtype(acc).itemsize
    arch = device_arch(device)
    fn = nvrtc.function("attn_merge", "attn_merge", {"MERGE_DT": dtype_code(first.dtype)}, device, arch, smem)
    with Staging(device, stream) as stage:
        p["parts"] = stage.upload(table.view(np.uint8)).ptr
        _C.launch(fn, (-(-n_rows // ROWS_PER_BLOCK), 1, 1), (32 * ROWS_PER_BLOCK, 1, 1), smem, stream,
                  p.tobytes())
    return out, lse
