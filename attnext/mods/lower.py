"""A mask_mod's parts that need no mask code, moved into the call (both backends).

A traced mask_mod's conjuncts that bound kv_idx - q_idx (attnext/band.py) become the call's
causal / window, so the kernels visit only the band's tiles and test only the tiles it cuts; and
what is left, when it is exactly `doc[q_idx] == doc[kv_idx]` over contiguous runs of a captured
host array (NumPy's, or a torch CPU tensor: attnext.interop), becomes varlen attention over the
runs. The kept pairs are the same either way; results agree with the masked path's within
rounding, not bit for bit. The CUDA backend (cuda_backend._bind_mods) and the CPU backend
(api.py, before interp.bind) both call lower_mask, then run kernel_problem(o).
"""
import copy

import numpy as np

from .. import interop
from . import band


def lower_mask(o, ts, tm):
    """What is left of the traced mask_mod tm (None: nothing) once its band went into o's
    causal_code / window_left / window_right (lower_band) and, without a score_mod (ts None),
    documents into o.documents (documents; kernel_problem then runs o as varlen)."""
    tm = lower_band(o, tm)
    if ts is None and tm is not None and (found := _documents(o, tm)) is not None:
        o.documents, o.documents_read, tm = found[0], found[1:], None
    return tm


def kept_span(o, diag):
    """(lo, hi): the call's causal and window keep lo <= c - r <= hi (+-inf where unbounded), for
    sequences with diag = Lk - Lq; diag None where it differs between them (a top-left causal,
    not relative to that diagonal, then counts as unbounded: hi - lo is still the kept width)."""
    inf, d = float("inf"), diag or 0
    lo = d - o.window_left if o.window_left >= 0 else -inf
    hi = min(d + o.window_right if o.window_right >= 0 else inf, d if o.causal_code == 1 else inf,
             0 if o.causal_code == 2 and diag is not None else inf)
    return lo, hi


def lower_band(o, tm):
    """The traced mask_mod tm less its band (attnext/band.py: conjuncts bounding kv_idx - q_idx),
    which goes into o's causal_code / window_left / window_right instead: the kernels then visit
    only the band's tiles and test only the tiles it cuts, and a mask_mod that is only a band
    leaves no mask code (None). The kernels' window is relative to each sequence's diagonal c = r +
    Lk - Lq, mask_mod's indices to its top-left corner, so this takes place only where Lk - Lq is
    the same for every sequence (no seqused / seqlens; varlen: equal cu_seqlens), and a side
    only where the window can say it (a side that would end on the wrong side of the diagonal is
    left to mask_mod). The kept pairs are the same either way."""
    if o.used_q is not None or o.used_k is not None:
        return tm
    if o.varlen:
        if o.device_lengths:       # CUDA arrays the host does not read: equal as the same memory
            same = o.cu_q.ptr == o.cu_k.ptr
        else:
            same = o.cu_q is not None and o.cu_k is not None and np.array_equal(o.cu_q, o.cu_k)
        if not same:
            return tm
        diag = 0
    else:
        diag = o.Sk - o.Sq
    b = band.split(tm)
    if b.lo is None and b.hi is None:
        return tm
    lo, hi = kept_span(o, diag)                    # the call's own band
    take_lo = b.lo is not None and max(lo, b.lo) <= diag
    take_hi = b.hi is not None and min(hi, b.hi) >= diag
    if not (take_lo or take_hi):
        return tm
    if not (take_lo and take_hi):
        b = band.split(tm, lower=take_lo, upper=take_hi)
    far = o.Sq + o.Sk                               # api.py's clamp: a wider side is unbounded
    if take_lo:
        o.window_left = int(min(diag - max(lo, b.lo), far))
    if take_hi:   # a right side of 0 is causal (bottom-right), the kernels' own case
        right = int(min(min(hi, b.hi) - diag, far))
        o.window_right, o.causal_code = (-1, 1) if right == 0 else (right, 0)
    return b.rest


def documents(o, tm):
    """cu_seqlens of the documents where the mask_mod left after its band is `doc[q_idx] ==
    doc[kv_idx]` over a captured 1-D integer (or bool) host array (NumPy, a torch CPU tensor)
    whose equal values sit in contiguous runs: its kept pairs are then varlen attention's over
    the runs, which the varlen kernels run without a mask (causal and window are relative to
    each run's diagonal, the whole sequence's where Sq == Sk). Only where nothing else reads a
    position: B = 1, Sq == Sk, no score_mod (the caller's test), bias, mask, alibi or lengths;
    the array must reach Sq (else the lookup's IndexError is mask_mod's to raise). None
    otherwise."""
    found = _documents(o, tm)
    return None if found is None else found[0]


def _documents(o, tm):
    """(cu_seqlens, name, values) of documents(): the captured array's name and a copy of the
    values the runs were read from (its first Sq), or None."""
    if (o.varlen or o.B != 1 or o.Sq != o.Sk or not o.Sq or o.used_q is not None or o.used_k is not None
            or o.bias4 is not None or o.mask4 is not None or o.alibi is not None):
        return None
    n = tm.out
    if n.op != "eq" or any(a.op != "load" or len(a.args) != 2 for a in n.args):
        return None
    (arr, i), (arr2, j) = (a.args for a in n.args)
    if arr is not arr2 or {i.op, j.op} != {"q_idx", "kv_idx"}:
        return None
    doc = interop.host_view(arr.args[0], tm.arrays[arr.args[0]])     # None for a CUDA array
    if doc is None or doc.ndim != 1 or doc.dtype.kind not in "iub" or doc.shape[0] < o.Sq:
        return None
    d = np.array(doc[:o.Sq])          # a copy: what the runs are read from, for a replay's check
    cu = np.concatenate(([0], np.flatnonzero(d[1:] != d[:-1]) + 1, [o.Sq]))
    if len(set(d[cu[:-1]].tolist())) != cu.size - 1:      # a value in two runs: not documents
        return None
    return cu.astype(np.int32), arr.args[0], d


def kernel_problem(o):
    """The problem the kernels run: o, or where documents() found documents, o as varlen
    attention over them (its arrays, results and lse laid out as they are: B = 1 in memory)."""
    cu = getattr(o, "documents", None)
    if cu is None:
        return o
    varlen = copy.copy(o)
    varlen.varlen, varlen.B, varlen.cu_q, varlen.cu_k = True, cu.size - 1, cu, cu
    varlen.lse_shape, varlen.mask_mod = (o.Hq, o.Sq), None
    return varlen
