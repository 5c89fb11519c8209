"""The float64 NumPy reference: what every attnext backend must compute.

Legend: B batch, Hq / Hk query / key-value heads, Sq / Sk padded sequence lengths, Tq / Tk packed
rows (varlen), D / Dv head dims of q-k / v. For one sequence b and query head h, Lq and Lk are the
actual lengths; r is a query row and c a key column, both counted from the start of the sequence.

    s0 = scale * q[r] . k[c]                     scale defaults to 1 / sqrt(D)
    s1 = softcap * tanh(s0 / softcap)            (s1 = s0 without softcap)
    s2 = s1 + bias[b, hb, r, c] - slope[b, h] * |r + Lk - Lq - c|
    s3 = score_mod(s2, b, h, r, c)
    P  = softmax of s3 over the kept c;  out[r] = sum_c P v[c];  lse[r] = log sum_c exp(s3)

With sinks (per query head logits, attention sinks as gpt-oss has them), exp(sinks[h]) joins
each real row's denominator and carries no value: lse[r] = log(sum_c exp(s3) + exp(sinks[h])),
P = exp(s3 - lse); a real row that keeps no key has out = 0 and lse = sinks[h].

Causal masks and windows are anchored on a diagonal. For Sq != Sk (x kept, . masked):

    causal=True / "bottom_right"         causal="top_left"
    keeps c <= r + Lk - Lq               keeps c <= r
          c: 0 1 2 3 4                         c: 0 1 2 3 4
    r = 0    x x x x .                   r = 0    x . . . .
    r = 1    x x x x x                   r = 1    x x . . .

With more queries than keys, the bottom-right alignment leaves the first rows with nothing:

          c: 0 1
    r = 0    . .    <- fully masked row: out = 0, lse = -inf, zero gradients
    r = 1    . .
    r = 2    . .
    r = 3    x .
    r = 4    x x

window=(left, right) keeps r + Lk - Lq - left <= c <= r + Lk - Lq + right (-1: that side
unbounded), always on the bottom-right diagonal. A row with no kept column (fully masked, or a
padding row r >= Lq), or whose kept scores are all -inf, gives out = 0, lse = -inf and zero
gradients, and adds nothing to dk, dv and dbias: never NaN (whatever NaN or inf sits in the
keys, values or bias it does not keep, in its q or in its dout), never a warning.

Everything is computed and returned in float64, one block of ROW_BLOCK query rows at a time, so
memory is O(ROW_BLOCK * Sk): nothing of size Sq * Sk is allocated (except a dbias whose given
bias has that shape). The functions take the public API's signatures; device, out, precision and
deterministic are accepted and ignored, and inputs are assumed valid (attnext.attention(...,
device="reference") checks them first).
"""
from typing import NamedTuple, Optional

import numpy as np

from .mods import fingerprint, grad, trace
from .types import Grads

ROW_BLOCK = 128
# Farther than any query is from any key: window sides are clamped to it so that int64 index
# arithmetic cannot wrap (a side that large is as good as unbounded).
_FAR = 2 ** 62
# score_mod's derivatives (w.r.t. the score and its float arrays) are central differences,
# each refined by one Richardson step (steps h and h / 2 cancel the h**2 term), at two step
# sizes relative to max(1, |x|): _FD_BIG (eps ** (1/5): truncation ~h**4 and rounding ~eps / h
# balance near 1e-12) where the two agree to _FD_AGREE, else _FD_SMALL (eps ** (1/3)), which
# straddles a kink (np.abs, np.minimum, np.clip) only within 6e-6 of it. There, the derivative
# w.r.t. the score comes from one-sided differences (_one_sided): the side away from the kink
# sees one smooth piece, and its estimates at steps h, h / 2, h / 4 agree (_FD_SIDED_AGREE),
# while the side across it does not (a central difference gave a slope between the pieces').
# Far from 0 the big step's own truncation may exceed _FD_AGREE on a smooth function (sin at
# |x| ~ 300: h ~ 0.2); where the small step then agrees with half of itself to _FD_HALF_AGREE,
# the point is smooth and the small step's estimate is taken. Where neither settles (a steep
# function: log, sqrt, cbrt within ~1e-3 of 0; or a kink within the small step), the steps
# shrink fourfold, up to _FD_SHRINK times, until two in a row agree (_shrinking); only where
# none do is the score's derivative taken from one side.
_FD_BIG = np.finfo(np.float64).eps ** (1 / 5)
_FD_SMALL = np.finfo(np.float64).eps ** (1 / 3)
_FD_AGREE = 1e-11
_FD_HALF_AGREE = 1e-9
_FD_SIDED_AGREE = 1e-7
_FD_SHRINK = 8
_FD_READ = 1e-7


def _bhsd(x, layout):
    """View x as (batch, heads, rows, dim) without copying; packed "thd" becomes a batch of one."""
    if layout == "bshd":
        return x.transpose(0, 2, 1, 3)
    if layout == "bhsd":
        return x
    return x.transpose(1, 0, 2)[None]


def _seq(b, cu_seqlens, seqused, static_len):
    """(batch index into the _bhsd view, first row, actual length) of sequence b.

    The one place that knows where a sequence lives: seqused (seqlens_* for padded batches)
    first, then the cu_seqlens segment, then the static length.
    """
    if cu_seqlens is None:
        view_b, start, length = b, 0, static_len
    else:
        view_b, start = 0, int(cu_seqlens[b])
        length = int(cu_seqlens[b + 1]) - start
    if seqused is not None:
        length = int(seqused[b])
    return view_b, start, length


def _as_4d(x):
    """A bias or mask as a (B, H, rows, cols) view with size-1 axes where it broadcasts."""
    x = np.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


class _Head(NamedTuple):
    """One (sequence, query head) problem: q (Lq, D), k (Lk, D), v (Lk, Dv) in float64."""
    b: int
    h: int
    hk: int
    bq: int      # batch index of the sequence's rows in the q / out / dout views
    q0: int      # first row of the sequence there
    lq: int
    bk: int      # same for the k / v views
    k0: int
    lk: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


class _Scores(NamedTuple):
    """Scores of one row block (rows, Lk): s0 and s2 as in the module docstring, s3 with -inf
    where a pair is not kept, the kept mask, and the (b, h, q_idx, kv_idx) arrays of the kept
    pairs that score_mod was called on (None without a score_mod or without a kept pair)."""
    s0: np.ndarray
    s2: np.ndarray
    s3: np.ndarray
    keep: np.ndarray
    pairs: Optional[tuple]


class _Problem:
    """The arguments of one call, normalised so that every layout and varlen read alike."""

    def __init__(self, q, k, v, *, layout, cu_q, cu_k, used_q, used_k, causal, window, scale,
                 softcap, alibi_slopes, bias, mask, score_mod, mask_mod, sinks=None):
        self.varlen = cu_q is not None
        self.layout = "thd" if self.varlen else layout
        self.q, self.k, self.v = (np.asarray(x) for x in (q, k, v))
        self.q4, self.k4, self.v4 = (_bhsd(x, self.layout) for x in (self.q, self.k, self.v))
        self.hq, self.hk = self.q4.shape[1], self.k4.shape[1]
        self.nseq = len(cu_q) - 1 if self.varlen else self.q4.shape[0]
        self.cu_q, self.cu_k, self.used_q, self.used_k = cu_q, cu_k, used_q, used_k
        self.scale = 1 / np.sqrt(self.q.shape[-1]) if scale is None else float(scale)
        self.softcap = None if softcap is None else float(softcap)
        self.causal = causal if isinstance(causal, str) else ("bottom_right" if causal else None)
        self.window = window
        self.slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
        self.bias_shape = None if bias is None else np.shape(bias)
        self.bias4 = None if bias is None else _as_4d(bias)
        self.mask4 = None if mask is None else _as_4d(mask)
        # a captured torch CPU tensor (any library's host array) is called as its NumPy view
        self.score_mod = None if score_mod is None else fingerprint.numpy_views(score_mod)
        self.mask_mod = None if mask_mod is None else fingerprint.numpy_views(mask_mod)
        self.sinks = None if sinks is None else np.asarray(sinks, dtype=np.float64)

    def sink(self, h):
        """Query head h's sink logit, -inf without sinks (exp(-inf) = 0 joins no sum)."""
        return -np.inf if self.sinks is None else float(self.sinks[h])

    def keyless_rows(self):
        """Yield (h, bq, rows) for every (sequence, query head) with no key: rows the slice of
        its real query rows in the q / out / lse views (heads() skips these sequences)."""
        for b in range(self.nseq):
            bq, q0, lq = _seq(b, self.cu_q, self.used_q, self.q4.shape[2])
            if _seq(b, self.cu_k, self.used_k, self.k4.shape[2])[2] == 0:
                for h in range(self.hq):
                    yield h, bq, slice(q0, q0 + lq)

    def out_and_lse(self):
        """Zeroed out (q's shape, last dim Dv) and lse (-inf), with their (batch, head, row) views."""
        out = np.zeros(self.q.shape[:-1] + self.v.shape[-1:])
        s = self.q4.shape
        lse = np.full((self.hq, s[2]) if self.varlen else (s[0], self.hq, s[2]), -np.inf)
        return out, lse, _bhsd(out, self.layout), (lse[None] if self.varlen else lse)

    def heads(self):
        """Yield a _Head for every (sequence, query head) with at least one query and one key."""
        group = self.hq // self.hk
        for b in range(self.nseq):
            bq, q0, lq = _seq(b, self.cu_q, self.used_q, self.q4.shape[2])
            bk, k0, lk = _seq(b, self.cu_k, self.used_k, self.k4.shape[2])
            if lq == 0 or lk == 0:
                continue
            for hk in range(self.hk):
                k = np.asarray(self.k4[bk, hk, k0:k0 + lk], dtype=np.float64)
                v = np.asarray(self.v4[bk, hk, k0:k0 + lk], dtype=np.float64)
                for h in range(hk * group, (hk + 1) * group):
                    q = np.asarray(self.q4[bq, h, q0:q0 + lq], dtype=np.float64)
                    yield _Head(b, h, hk, bq, q0, lq, bk, k0, lk, q, k, v)

    def block_index(self, x4, hd, r0, r1):
        """Index of the rows r0:r1, columns :Lk block of a 4-D bias or mask for head hd.

        Broadcast (size-1) axes are indexed 0:1 so the block stays broadcastable; the bias head
        read by query head h is h // (Hq // H), H being 1, Hk or Hq.
        """
        nb, nh, nr, nc = x4.shape
        return (hd.b if nb > 1 else 0, hd.h // (self.hq // nh),
                slice(r0, r1) if nr > 1 else slice(0, 1),
                slice(0, hd.lk) if nc > 1 else slice(0, 1))


def _row_blocks(lq):
    for r0 in range(0, lq, ROW_BLOCK):
        yield r0, min(r0 + ROW_BLOCK, lq)


def _pairs(hd, q_idx, kv_idx):
    """The int64 (b, h, q_idx, kv_idx) arrays a score_mod / mask_mod is called with."""
    n = q_idx.size
    return (np.full(n, hd.b, dtype=np.int64), np.full(n, hd.h, dtype=np.int64),
            q_idx.astype(np.int64), kv_idx.astype(np.int64))


def _scores(pb, hd, r0, r1):
    """Steps 1-6 of the semantics for query rows r0:r1 of one (sequence, head): a _Scores."""
    r = np.arange(r0, r1)[:, None]
    c = np.arange(hd.lk)[None, :]
    diag = r + hd.lk - hd.lq   # the key column on row r's bottom-right diagonal
    s0 = pb.scale * (hd.q[r0:r1] @ hd.k.T)
    s = s0 if pb.softcap is None else pb.softcap * np.tanh(s0 / pb.softcap)
    if pb.bias4 is not None:
        s = s + np.asarray(pb.bias4[pb.block_index(pb.bias4, hd, r0, r1)], dtype=np.float64)
    if pb.slopes is not None:
        slope = pb.slopes[hd.h] if pb.slopes.ndim == 1 else pb.slopes[hd.b, hd.h]
        s = s - slope * np.abs(diag - c)

    keep = np.ones(s.shape, dtype=bool)
    if pb.causal == "top_left":
        keep &= c <= r
    elif pb.causal == "bottom_right":
        keep &= c <= diag
    if pb.window is not None:
        left, right = (min(int(w), _FAR) for w in pb.window)
        if left >= 0:
            keep &= c >= diag - left
        if right >= 0:
            keep &= c <= diag + right
    if pb.mask4 is not None:
        keep &= np.asarray(pb.mask4[pb.block_index(pb.mask4, hd, r0, r1)], dtype=bool)
    rr, cc = np.broadcast_arrays(r, c)
    if pb.mask_mod is not None:
        kept = _call_mod("mask_mod", pb.mask_mod, _pairs(hd, rr.ravel(), cc.ravel()))
        keep &= np.broadcast_to(np.asarray(kept, dtype=bool), (keep.size,)).reshape(keep.shape)

    s3 = np.where(keep, s, -np.inf)
    pairs = None
    if pb.score_mod is not None and keep.any():
        pairs = _pairs(hd, rr[keep], cc[keep])
        s3[keep] = _call_score_mod(pb.score_mod, s[keep], pairs)
    return _Scores(s0, s, s3, keep, pairs)


def _call_score_mod(score_mod, s, pairs):
    return np.broadcast_to(np.asarray(_call_mod("score_mod", score_mod, (s, *pairs)), dtype=np.float64),
                           s.shape)


def _call_mod(kind, fn, args):
    """fn(*args). A lookup out of range raises NumPy's IndexError, which names no array: it is
    raised again as the CPU and CUDA backends word it (the callback, the array, the index), found
    by evaluating the traced function on the same arguments."""
    try:
        return fn(*args)
    except IndexError as e:
        traced = trace.trace_score_mod(fn) if kind == "score_mod" else trace.trace_mask_mod(fn)
        try:
            trace.evaluate(traced, *(args if kind == "score_mod" else (None, *args)),
                           float_dtype=np.float64)
        except IndexError as named:
            raise IndexError(f"{kind}: {named}") from e
        raise


def _softmax(s3, sink=-np.inf):
    """Row softmax and log-sum-exp of scores with -inf where masked, exp(sink) joining each
    row's sum (an attention sink: no value; -inf: none).

    A row with no finite score gives p = 0 and lse = sink (-inf without one; no NaN, no warning).
    """
    m = np.maximum(s3.max(axis=1, keepdims=True), sink)
    m = np.where(np.isfinite(m), m, 0.0)   # an all -inf row: exp(-inf - 0) = 0, not NaN
    e = np.exp(s3 - m)
    total = e.sum(axis=1, keepdims=True) + np.exp(sink - m)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[:, 0]
    return e / np.where(total > 0, total, 1.0), lse


def _refined(quotient, h):
    """quotient(h) refined by one Richardson step: the central difference's h**2 term cancels
    between steps h and h / 2."""
    coarse, fine = quotient(h), quotient(h / 2)
    return fine + (fine - coarse) / 3


def _derivative(quotient, x, fmag=None):
    """A derivative at x (an array, or a scalar) from quotient(h), the central difference
    quotient with steps h (an array like x), as the module's _FD_* constants say, and where it
    took the big step (smooth). Steps at a non-finite x are relative to 1 (see _step). fmag:
    None, or |f| near x: the two steps' estimates then also agree within the small step's
    rounding (eps |f| / h, Richardson's factors included), which an f much larger than x makes
    the larger term (s - 700 * slope at s ~ 1: 2.5e-8), not taken for a kink."""
    x = np.asarray(x, dtype=np.float64)
    scale = np.where(np.isfinite(x), np.maximum(1.0, np.abs(x)), 1.0)

    with np.errstate(all="ignore"):
        big, small = _refined(quotient, _FD_BIG * scale), _refined(quotient, _FD_SMALL * scale)
        rounding = 0.0 if fmag is None else 8 * np.finfo(np.float64).eps * np.abs(fmag) / (_FD_SMALL * scale)
        close = np.abs(big - small) <= _FD_AGREE * np.maximum(1.0, np.abs(small)) + rounding
        smooth = close.copy()
        if not smooth.all():
            # where only the big step's truncation disagrees (~h**4, h relative to |x|: sin's
            # derivative at |x| ~ 300 is off by ~5e-6 there), the small step agrees with half of
            # itself and its estimate stands; a kink within the small step moves a straddling
            # quotient by O(1) of the slopes' jump as the step halves
            half = _refined(quotient, _FD_SMALL * scale / 2)
            smooth |= np.abs(small - half) <= _FD_HALF_AGREE * np.maximum(1.0, np.abs(small)) + 2 * rounding
        return np.where(close, big, small), smooth


def _shrinking(quotient, x, fmag):
    """(derivative, settled) at the finite points x where _derivative's steps did not settle,
    from quotient(h) as there: central differences refined as there, at steps shrinking
    fourfold from _FD_SMALL's quarter (relative to max(1, |x|)) for _FD_SHRINK steps, settled
    at the first step whose estimate agrees with the step before it to _FD_HALF_AGREE and whose
    rounding (8 eps |fmag| / h; fmag: |f| near x, or None) is under _FD_READ. A steep smooth
    function (log, sqrt, cbrt at 1e-5) settles once the step is small beside |x|. Near a kink or
    a jump, the steps that straddle it disagree, and those past it are small, so they settle
    only where f is small enough to be read at that step (two numerators rounded to 0 would
    agree); elsewhere the caller takes one side. No allowance for rounding in the agreement
    itself, unlike _derivative's: it let two straddling estimates (both near the slopes' mean)
    pass."""
    scale = np.maximum(1.0, np.abs(x))
    with np.errstate(all="ignore"):
        size = 0.0 if fmag is None else 8 * np.finfo(np.float64).eps * np.abs(fmag)
        h = _FD_SMALL * scale
        before = _refined(quotient, h)
        found, settled = np.zeros_like(before), np.zeros(np.shape(x), dtype=bool)
        for _ in range(_FD_SHRINK):
            h = h / 4
            now = _refined(quotient, h)
            unit = np.maximum(1.0, np.abs(now))
            agree = ~settled & (np.abs(now - before) <= _FD_HALF_AGREE * unit) & (size / h <= _FD_READ * unit)
            found, settled = np.where(agree, now, found), settled | agree
            if settled.all():
                break
            before = now
    return found, settled & np.isfinite(found)


def _one_sided(f, x, f0, central):
    """The derivative of f (an elementwise function of an array; f0 = f(x)) at the points x near
    a kink: from the side whose one-sided differences (refined by one Richardson step, at steps h,
    h / 2 and h / 4 relative to max(1, |x|)) agree with themselves, the other side's straddling
    the kink; `central` (the central difference) where both sides or neither agree (x on the kink
    itself, or no kink at all)."""
    h = _FD_SMALL * np.maximum(1.0, np.abs(x))

    def side(sign):
        q = [sign * (f(x + sign * t) - f0) / (sign * ((x + sign * t) - x)) for t in (h, h / 2, h / 4)]
        a, b = 2 * q[1] - q[0], 2 * q[2] - q[1]
        return b, np.abs(a - b) <= _FD_SIDED_AGREE * np.maximum(1.0, np.abs(b))

    with np.errstate(all="ignore"):
        (left, left_ok), (right, right_ok) = side(-1.0), side(1.0)
    return np.where(left_ok & ~right_ok, left, np.where(right_ok & ~left_ok, right, central))


def _kept(ds3, sc):
    """(s2, dS3, pairs) at the kept pairs whose dS3 is not 0 (None if there is none): the only
    pairs through which score_mod reaches the loss. s2 as it is, -inf included: a score_mod may
    revive a -inf score (np.maximum(s, -10) after a -inf bias), and its derivatives are taken
    there, not at a stand-in."""
    if sc.pairs is None:
        return None
    d = ds3[sc.keep]
    live = d != 0
    if not live.any():
        return None
    return sc.s2[sc.keep][live], d[live], tuple(p[live] for p in sc.pairs)


def _step(x, h):
    """The step actually taken by the central difference at x: (x + h) - (x - h), rounding
    included. At an infinite x, x +- h is x itself (a -inf bias stays -inf whatever the
    scores around it), so the quotient's numerator is score_mod(x) - score_mod(x) = 0 where
    score_mod(x) is finite: the derivative there is 0, the limit of score_mod' at -inf of any
    score_mod with a finite limit (max(s, -10), exp(s), np.where(s < -1e30, c, s)). The
    step is then h + h, so the quotient stays 0 rather than 0 / 0."""
    return np.where(np.isfinite(x), (x + h) - (x - h), h + h)


def _through_score_mod(score_mod, ds3, sc):
    """dS2 = dS3 * score_mod'(s2) on the kept pairs (0 where dS3 is exactly 0: masked, or a
    -inf score, whatever the difference quotient is there)."""
    ds2 = np.zeros_like(ds3)
    kept = _kept(ds3, sc)
    if kept is None:
        return ds2
    s, d, pairs = kept

    def quotient(h):
        return (_call_score_mod(score_mod, s + h, pairs)
                - _call_score_mod(score_mod, s - h, pairs)) / _step(s, h)

    where = np.flatnonzero(sc.keep.ravel())[ds3[sc.keep] != 0]
    with np.errstate(invalid="ignore", over="ignore"):
        deriv, smooth = _derivative(quotient, s, fmag=np.where(np.isfinite(s), _call_score_mod(score_mod, s, pairs), 0.0))
        rough = np.flatnonzero(~smooth & np.isfinite(s))
        if rough.size:
            sub, sr = tuple(p[rough] for p in pairs), s[rough]

            def f(t):
                return _call_score_mod(score_mod, t, sub)

            def sub_quotient(h):
                return (f(sr + h) - f(sr - h)) / _step(sr, h)
            # steep (log, cbrt near 0) or near a kink: steps that shrink until they settle,
            # else the side that does not cross the kink
            f0 = f(sr)
            fine, settled = _shrinking(sub_quotient, sr, f0)
            deriv[rough] = np.where(settled, fine, _one_sided(f, sr, f0, deriv[rough]))
        ds2.ravel()[where] = d * deriv
    return ds2


def _add_dtensors(score_mod, arrays, ds3, sc, dtensors):
    """dtensors[name] += d(sum of dS3 * score_mod(s2)) / d array, for each float array the
    score_mod captures, one element at a time on a float64 working copy (independent of the
    tracer's symbolic derivative; keep the arrays small)."""
    kept = _kept(ds3, sc)
    if kept is None:
        return
    s, d, pairs = kept
    for name, base in arrays.items():
        work = np.array(base, dtype=np.float64)
        fn = fingerprint.with_arrays(score_mod, {name: work})
        flat, acc = work.reshape(-1), dtensors[name].reshape(-1)
        for e in range(flat.size):
            x0 = flat[e]

            def at(t):
                flat[e] = t
                try:
                    return _call_score_mod(fn, s, pairs)
                finally:
                    flat[e] = x0

            def quotient(h):
                hi, lo = x0 + h, x0 - h
                # pair by pair first: the pairs that do not read element e cancel exactly
                return np.sum(d * (at(hi) - at(lo))) / (hi - lo)
            size = _reader_size(at, x0, d)
            deriv, smooth = _derivative(quotient, x0, fmag=size)
            if not smooth and np.isfinite(x0):     # steep, or near a kink: smaller steps
                fine, settled = _shrinking(quotient, x0, size)
                deriv = fine if settled else deriv
            acc[e] += deriv


def _reader_size(at, x0, d):
    """The size of the sum that element x0's difference quotient takes apart: sum |d * at(x0)|
    over the pairs that read the element (those that move when it moves by the big step; the
    others cancel exactly). Each read pair's numerator rounds to about eps times its value,
    which the two steps' estimates may then differ by with no kink between them (_derivative's
    fmag). None where it is not finite (the quotient is then judged without it)."""
    h = _FD_BIG * max(1.0, abs(float(x0))) if np.isfinite(x0) else 0.0
    with np.errstate(all="ignore"):
        a0 = at(x0)
        reads = (at(x0 + h) != a0) | (at(x0 - h) != a0)
        size = float(np.sum(np.abs(d * a0)[reads]))
    return size if np.isfinite(size) else None


def _live(s3):
    """(rows, 1) mask of the rows that keep a key (a score above -inf; a NaN one counts). A row
    that keeps none has no path to out or to q, k, v, bias (its lse is -inf, or its sink), so
    whatever NaN or inf sits in the keys, values or bias it does not keep (or in its dout) must
    not reach them as 0 * NaN."""
    return s3.max(axis=1, keepdims=True) != -np.inf


def _forward(pb, return_lse):
    out, lse, out4, lse3 = pb.out_and_lse()
    if pb.sinks is not None:        # the rows of a sequence without keys keep their sink alone
        for h, bq, rows in pb.keyless_rows():
            lse3[bq, h, rows] = pb.sink(h)
    for hd in pb.heads():
        for r0, r1 in _row_blocks(hd.lq):
            s3 = _scores(pb, hd, r0, r1).s3
            p, lse_block = _softmax(s3, pb.sink(hd.h))
            rows = slice(hd.q0 + r0, hd.q0 + r1)
            out4[hd.bq, hd.h, rows] = np.where(_live(s3), p @ hd.v, 0.0)
            lse3[hd.bq, hd.h, rows] = lse_block
    return (out, lse) if return_lse else out


def _float_arrays(score_mod):
    """name -> array: the float arrays score_mod captures (closure, globals, defaults)."""
    return {} if score_mod is None else {
        n: a for n, a in fingerprint.captured_arrays(score_mod).items()
        if trace.array_kind(a.dtype) == trace.F}


def _backward(pb, dout, dtensors, dlse=None):
    dq, dk, dv = (np.zeros(x.shape) for x in (pb.q, pb.k, pb.v))
    dq4, dk4, dv4 = (_bhsd(x, pb.layout) for x in (dq, dk, dv))
    dout4 = _bhsd(np.asarray(dout), pb.layout)
    dlse3 = None if dlse is None else np.asarray(dlse)[None] if pb.varlen else np.asarray(dlse)
    dbias4 = None if pb.bias4 is None else np.zeros(pb.bias4.shape)
    arrays = _float_arrays(pb.score_mod)
    names = grad.asked(dtensors, lambda: None if pb.score_mod is None else list(arrays))
    if names is not None:             # the finite differences cost a pass per element: only these
        arrays = {n: a for n, a in arrays.items() if n in names}
    dtensors = {n: np.zeros(a.shape) for n, a in arrays.items()}
    # d lse / d sink = exp(sink - lse) = P_sink, d out / d sink = -P_sink out: the sink's
    # gradient is -sum over real rows of P_sink (rowsum(dout * out) - dlse). A real row that keeps
    # no key has lse = sink (P_sink = 1) and out = 0: it gives its dlse alone.
    dsinks = None if pb.sinks is None else np.zeros(pb.sinks.shape)
    if dsinks is not None and dlse3 is not None:
        for h, bq, rows in pb.keyless_rows():
            if np.isfinite(pb.sink(h)):
                dsinks[h] += np.asarray(dlse3[bq, h, rows], dtype=np.float64).sum()
    for hd in pb.heads():
        keys = slice(hd.k0, hd.k0 + hd.lk)
        for r0, r1 in _row_blocks(hd.lq):
            sc = _scores(pb, hd, r0, r1)
            p, lse_block = _softmax(sc.s3, pb.sink(hd.h))
            live = _live(sc.s3)   # a dead row's dout, q and dS are taken as 0
            rows = slice(hd.q0 + r0, hd.q0 + r1)
            do = np.where(live, np.asarray(dout4[hd.bq, hd.h, rows], dtype=np.float64), 0.0)
            dp = do @ hd.v.T
            delta = (p * dp).sum(axis=1, keepdims=True)         # rowsum(dout * out)
            if dlse3 is not None:     # d lse / d s = P: the lse gradient joins dS as -delta does
                delta = delta - np.asarray(dlse3[hd.bq, hd.h, rows], dtype=np.float64)[:, None]
            ds = np.where(live, p * (dp - delta), 0.0)   # dS3
            if dsinks is not None:    # a dead row: dout is taken as 0, delta = -dlse, P_sink = 1
                with np.errstate(invalid="ignore"):               # sink and lse -inf: P_sink 0
                    p_sink = np.where(lse_block == -np.inf, 0.0, np.exp(pb.sink(hd.h) - lse_block))
                dsinks[hd.h] -= (p_sink[:, None] * delta).sum()
            if pb.score_mod is not None:
                if arrays:
                    _add_dtensors(pb.score_mod, arrays, ds, sc, dtensors)
                ds = _through_score_mod(pb.score_mod, ds, sc)      # dS2
            if dbias4 is not None:
                _, _, nr, nc = dbias4.shape
                dbias4[pb.block_index(dbias4, hd, r0, r1)] += ds.sum(
                    axis=tuple(a for a, n in ((0, nr), (1, nc)) if n == 1), keepdims=True)
            if pb.softcap is not None:
                ds = np.where(live, ds * (1 - np.tanh(sc.s0 / pb.softcap) ** 2), 0.0)   # dS0
            dq4[hd.bq, hd.h, rows] = np.where(live, pb.scale * (ds @ hd.k), 0.0)
            dk4[hd.bk, hd.hk, keys] += pb.scale * (ds.T @ np.where(live, hd.q[r0:r1], 0.0))
            dv4[hd.bk, hd.hk, keys] += p.T @ do
    dbias = None if dbias4 is None else dbias4.reshape(pb.bias_shape)
    return Grads(dq, dk, dv, dbias, dtensors, dsinks=dsinks)


def _gather_pages(k, v, block_table, lengths):
    """A paged cache's k and v (num_pages, page_size, H, D) as contiguous (B, max_pages *
    page_size, H, D): sequence b's pages block_table[b] in order; entries past its lengths'
    pages (which may hold anything) read page 0, and those keys are never kept."""
    bt = np.array(block_table, dtype=np.int64)
    n_pages, page_size = k.shape[:2]
    if lengths is not None:
        for b, n in enumerate(lengths):
            bt[b, -(-int(n) // page_size):] = 0
    bt = np.where((bt >= 0) & (bt < n_pages), bt, 0)
    B, pages = bt.shape
    k, v = np.asarray(k)[bt], np.asarray(v)[bt]           # (B, pages, page_size, H, D)
    return (k.reshape(B, pages * page_size, *k.shape[3:]), v.reshape(B, pages * page_size, *v.shape[3:]))


def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
              bias=None, mask=None, score_mod=None, mask_mod=None, seqlens_q=None,
              seqlens_k=None, layout="bshd", return_lse=False, device=None, out=None,
              precision=None, sinks=None, block_table=None):
    """Attention over padded batches, in float64: out, or (out, lse) with return_lse.

    q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) for layout "bshd"; "bhsd" puts heads
    second. out is q's shape with last dim Dv, lse (B, Hq, Sq). seqlens_q / seqlens_k (B,) give
    the actual lengths; rows past them are padding. bias and mask broadcast to (B, H, Sq, Sk)
    whatever the layout. The semantics, the causal alignment for Sq != Sk and what a fully
    masked row returns (out = 0, lse = -inf) are in the module docstring. block_table (B,
    max_pages): k and v are a paged cache (num_pages, page_size, Hk, D), gathered first.
    """
    if block_table is not None:
        k, v = _gather_pages(k, v, block_table, seqlens_k)
    pb = _Problem(q, k, v, layout=layout, cu_q=None, cu_k=None, used_q=seqlens_q,
                  used_k=seqlens_k, causal=causal, window=window, scale=scale, softcap=softcap,
                  alibi_slopes=alibi_slopes, bias=bias, mask=mask, score_mod=score_mod,
                  mask_mod=mask_mod, sinks=sinks)
    return _forward(pb, return_lse)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                     seqused_q=None, seqused_k=None, causal=False, window=None, scale=None,
                     softcap=None, alibi_slopes=None, bias=None, mask=None, score_mod=None,
                     mask_mod=None, return_lse=False, device=None, out=None, precision=None,
                     sinks=None, block_table=None):
    """Attention over packed sequences, in float64: out, or (out, lse) with return_lse.

    q (Tq, Hq, D), k (Tk, Hk, D), v (Tk, Hk, Dv); sequence i occupies rows
    cu_seqlens[i]:cu_seqlens[i + 1], of which the first seqused[i] are real when seqused is
    given. out (Tq, Hq, Dv), lse (Hq, Tq); rows that are not real are padding (out = 0,
    lse = -inf). bias and mask broadcast to (num_seqs, H, max_seqlen_q, max_seqlen_k) and are
    read at the in-sequence positions; max_seqlen_* only bound those shapes (the API checks
    them) and are not needed here.
    """
    if block_table is not None:     # a paged cache: each sequence's pages gathered, packed
        lengths = seqused_k if seqused_k is not None else np.diff(np.asarray(cu_seqlens_k))
        k, v = _gather_pages(k, v, block_table, lengths)
        B, Sk = k.shape[:2]
        k, v = k.reshape(B * Sk, *k.shape[2:]), v.reshape(B * Sk, *v.shape[2:])
        cu_seqlens_k, seqused_k = np.arange(B + 1) * Sk, np.asarray(lengths)
    pb = _Problem(q, k, v, layout="thd", cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
                  used_q=seqused_q, used_k=seqused_k, causal=causal, window=window, scale=scale,
                  softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
                  score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
    return _forward(pb, return_lse)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, scale=None,
                       softcap=None, alibi_slopes=None, bias=None, mask=None, score_mod=None,
                       mask_mod=None, seqlens_q=None, seqlens_k=None, layout="bshd", device=None,
                       precision=None, deterministic=True, dtensors=True, dlse=None, sinks=None):
    """Gradients of attention() in float64: Grads(dq, dk, dv, dbias, dtensors).

    The forward is recomputed: out and lse are not read. dlse, lse's shape: the gradient of
    the returned lse (d lse / d score = P, so dS = P (dP - rowsum(dout * out) + dlse)). dq, dk, dv have the shapes of q, k, v
    (a broadcast k gets a full-shape dk); dbias has the bias's shape (summed over its broadcast
    axes), None without a bias; padding and fully masked rows get zero gradients. score_mod's
    derivatives are extrapolated central differences; dtensors maps each float array the
    score_mod captures (closure, globals, defaults) to its gradient, a float64 NumPy array (a
    captured torch CPU tensor is read as its NumPy view, and its gradient is NumPy's too). The
    dtensors argument: True (every such array), False (none) or a collection of their names:
    only those are computed (a pass over the pairs per array element each). With sinks (Hq,),
    the Grads' dsinks attribute is their gradient (float64), else None.
    """
    pb = _Problem(q, k, v, layout=layout, cu_q=None, cu_k=None, used_q=seqlens_q,
                  used_k=seqlens_k, causal=causal, window=window, scale=scale, softcap=softcap,
                  alibi_slopes=alibi_slopes, bias=bias, mask=mask, score_mod=score_mod,
                  mask_mod=mask_mod, sinks=sinks)
    return _backward(pb, dout, dtensors, dlse)


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                              seqused_k=None, causal=False, window=None, scale=None,
                              softcap=None, alibi_slopes=None, bias=None, mask=None,
                              score_mod=None, mask_mod=None, device=None, precision=None,
                              deterministic=True, dtensors=True, dlse=None, sinks=None):
    """Gradients of varlen_attention() in float64: Grads(dq, dk, dv, dbias, dtensors).

    As attention_backward; rows that are not real (past seqused, or after cu_seqlens[-1]) get
    exactly zero dq, dk, dv.
    """
    pb = _Problem(q, k, v, layout="thd", cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
                  used_q=seqused_q, used_k=seqused_k, causal=causal, window=window, scale=scale,
                  softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
                  score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
    return _backward(pb, dout, dtensors, dlse)
