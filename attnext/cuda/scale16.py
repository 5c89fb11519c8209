"""precision="tf32" of float32 on float16 products (Hopper): q, k, v (and the backward's out and
dout) copied into float16, each scaled by a power of two (kernels/attn_scale16.cu), then the
float16 kernels with F16_SCALED (kernels/attn_common.cuh), which read the factors that undo the
scaling from the device (attn_params.grad_scales): the backward writes float32 dq, dk and dv;
the forward writes a float16 out, which unscale() takes into the caller's float32 out. No host
synchronisation: the maxima, the factors and the copies stay on the device.

float16 carries TF32's 11-bit significand down to 2^-14; the powers of two give it float32's
range for each array's largest elements: each array's largest finite magnitude lands in
[2^(top - 1), 2^top), so every element within 2^-(13 + top) of it keeps TF32's rounding (smaller
ones round to float16's subnormals or to 0, where TF32 would keep them; NaN and inf, which rows
that keep no key may hold, count as 0 in the maxima), and the tops below keep what the kernels
round to float16 in range: P in [0, 1], and dS = P (dP - delta) with |dP|, |delta| <= Dv
max|dout'| max|v'| < Dv 2^(top_dout + TOP_V), so |dS| < 2^15 (float16's largest finite value is
65504). q and k take 2^8 (scores up to D 2^16 in float32), v and out 2^4, dout the rest of
2^15 / (2 Dv).
"""
import math

import numpy as np

from .. import _C
from . import arrays, nvrtc, select
from .devview import DevView

# kernels/attn_scale16.cu's scale16_params
PARAMS = np.dtype([("src", "<u8", 5), ("dst", "<u8", 5), ("shape", "<i8", (5, 4)), ("strides", "<i8", (5, 4)),
                   ("n", "<i8", 5), ("contig", "<i4", 5), ("top", "<i4", 5), ("maxima", "<u8"),
                   ("scales", "<u8")])
THREADS = 256
CTAS = 1056                    # a grid-stride loop's CTAs an array at most (8 of 256 threads on each of 132 SMs)
TOP_QK, TOP_V = 8, 4
ALIGN = 256


def top_dout(Dv):
    """dout's top: 2 Dv 2^(top + TOP_V) <= 2^15 (module docstring)."""
    return 15 - 1 - math.ceil(math.log2(Dv)) - TOP_V


def _contiguous(view):
    return arrays.is_contiguous(view.shape, view.strides) and view.ptr % 16 == 0


def copies(views, Dv, stage, arch):
    """The float16 copies of views (q4, k4, v4, out4, dout4, or the forward's q4, k4, v4: float32
    DevViews) as C-contiguous DevViews of the same shapes, grad_scales (4 float64) on the device
    and the params unscale() takes, enqueued on the call's stream; the last item returned holds
    their memory (keep it until the launches are enqueued: it is freed in the stream's order)."""
    sizes = [math.prod(v.shape) for v in views]
    offsets, total = [], 16 + 32          # maxima (4 uint32), grad_scales (4 double)
    for n in sizes:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += 2 * n
    mem = arrays.empty((total,), np.uint8, stage.device, stage.stream)
    base = mem.ptr
    _C.memset_d8(base, 0, 16, stage.stream, stage.device)
    out = [DevView.contiguous(base + off, v.shape, np.float16, stage.device) for v, off in zip(views, offsets)]
    p = np.zeros((), PARAMS)
    for t, (v, c) in enumerate(zip(views, out)):
        p["src"][t], p["dst"][t], p["n"][t] = v.ptr, c.ptr, sizes[t]
        p["shape"][t], p["strides"][t] = v.shape, v.strides
        p["contig"][t] = int(_contiguous(v))
    p["top"] = (TOP_QK, TOP_QK, TOP_V, TOP_V, top_dout(Dv))
    p["maxima"], p["scales"] = base, base + 16
    ctas = max(1, min(CTAS, -(-max(sizes) // (4 * THREADS))))
    # the maxima (grid y: q, k, v, then dout's, which the forward's three views leave out), a copy a view
    _C.launch(_function("attn_scale16_max", stage, arch), (ctas, min(len(views), 4), 1), (THREADS, 1, 1), 0,
              stage.stream, p.tobytes())
    _C.launch(_function("attn_scale16_convert", stage, arch), (ctas, len(views), 1), (THREADS, 1, 1), 0,
              stage.stream, p.tobytes())
    scales = DevView.contiguous(base + 16, (4,), np.float64, stage.device)
    return out, scales, p, mem


def unscale(params, out16, out4, stage, arch):
    """The forward's float16 out16 (C-contiguous, the kernels' output over copies() of q4, k4 and
    v4, whose params those are) into the float32 DevView out4 (any strides), times 1 / v's power
    of two, on the call's stream."""
    p = params.copy()
    n = math.prod(out4.shape)
    p["src"][3], p["dst"][3], p["n"][3] = out16.ptr, out4.ptr, n
    p["shape"][3], p["strides"][3] = out4.shape, out4.strides
    p["contig"][3] = int(_contiguous(out4))
    ctas = max(1, min(CTAS, -(-n // (4 * THREADS))))
    if n:
        _C.launch(_function("attn_scale16_unscale", stage, arch), (ctas, 1, 1), (THREADS, 1, 1), 0,
                  stage.stream, p.tobytes())


def _function(name, stage, arch):
    src, _, d, _ = next(s for s in select.SCALE16_SPECS if s[1] == name)
    return nvrtc.function(src, name, d, stage.device, arch, 0)
