"""Differential fuzzing: random problems, every backend against the float64 reference.

    python -m attnext.fuzz --minutes 10 [--seed 0] [--backends cpu,cuda] [--verbose]
    python -m attnext.fuzz --replay "{'seed': ..., ...}"      # rerun one printed case

Hypothesis draws a *spec* for a whole case: a plain dict of Python values (shapes, dtype,
layout, options, how each array is laid out in memory, a seed for the data). `Case(spec)`
turns it into arrays, so a printed spec replays exactly (`run_case(spec)`, or `--replay`).

What a spec covers: forward, or forward + backward; attention() (B, Sq, Sk from 0, mostly
small, now and then up to ~1100; seqlens_q/k) or varlen_attention() (cu_seqlens with empty
segments, seqused, trailing padding rows, max_seqlen_* above the longest); float16, bfloat16,
float32, float64; MHA / GQA / MQA; D and Dv in 1..256; "bshd" / "bhsd"; causal False / True /
"top_left"; window (left, right) with -1; softcap; scale (zero and negative included); ALiBi
slopes (Hq,) or (B, Hq); a bias of any float dtype and broadcast shape (with heads 1, Hk or Hq),
passed compact, as a stride-0 broadcast view, reversed or strided, now and then holding -inf; a
bool mask of broadcast shape with some rows fully False; q, k, v non-contiguous (Fortran order,
padded last dim, strided, reversed, permuted in memory, stride-0 broadcast), read-only inputs,
out= buffers. A third of the cases add a score_mod, a mask_mod or both from a small library,
whatever the size and dtype, forward and backward: closed-form ones, and lookups into captured
arrays (relative-bias tables, full and bucketed, ALiBi slopes, per-head gains and penalties, in
float64 / float32 / float16, whose gradients come back as dtensors; document ids per position;
a bool table). A backward case draws a score_mod whose float arrays the reference can
differentiate in its budget (MAX_DTENSOR_WORK), and for float16 / bfloat16 one of slope at
most 1 (SLOPE: the rounded-out allowance's bound).

How a case is checked (`run_case`), for each backend in the set (cpu always; cuda where
`attnext.info()` says it is usable, for float16 / bfloat16; a case with a score_mod / mask_mod
then passes q, k, v and dout in GPU memory, see `_check_one`):
* out, lse, dq, dk, dv, dbias against the reference with the three-way tolerance the test
  suite uses (attnext/accuracy.py), plus the `_cond` term below. NaN is always a mismatch, and
  so are a different -inf pattern, a wrong dtype or shape, and an exception from a backend
  where the reference ran;
* dtensors (the score_mod's float array gradients) against the reference's, as
  tests/cpu/test_score_mod.py holds them (`accuracy.compare_dtensors`), with `accuracy.dtensors_allowance`;
* result buffers attnext allocates start as NaN (as the test suite poisons them), so an
  unwritten element is a NaN mismatch;
* rows that keep no key (reference lse = -inf) have out and dq exactly 0; in varlen, packed
  rows outside every real sequence have dk and dv exactly 0;
* no input is modified (each array and the buffer it views are compared before and after).
"""
import argparse
import ast
import collections
import contextlib
import functools
import math
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as tests/conftest.py: see the note there

import numpy as np  # noqa: E402

import attnext  # noqa: E402
from attnext import reference  # noqa: E402
from attnext.mods import fingerprint  # noqa: E402
from attnext.testing.accuracy import (BF16, EPS, F16, F32, F32_RTOL, F64,  # noqa: E402
                              acc_dtype, canonical, compare, compare_dtensors, compare_grads,
                              dtensors_allowance)

DTYPES = {"float16": F16, "bfloat16": BF16, "float32": F32, "float64": F64}
GPU_DTYPES = (F16, BF16)

# The largest problem a case may be: B * Hq * Sq * Sk * (D + Dv) multiply-adds, so that one case
# (the reference's float64 forward and backward included) takes well under a second here.
MAX_WORK = 1.5e7
# The reference's dtensors take a pass over the pairs per float element a score_mod captures:
# elements * Hq * pairs at most (~60 ns each), or the case draws a score_mod without such arrays.
MAX_DTENSOR_WORK = 5e6


# Captured arrays. Lookups stay in range at every pair inside the lengths: q_idx < Sq and
# kv_idx < Sk (positions inside a sequence; Sq, Sk are max_seqlen_* in varlen).
BUCKET = 8          # rel_bias_bucket's table covers q_idx - kv_idx in [-BUCKET, BUCKET]


def _doc_ids(rng, n):
    """A sorted document id per position (0..3): documents of random lengths, some empty."""
    return np.sort(rng.integers(0, 4, max(n, 1)))


def _score_mods(hq, sq, sk, rng, fdtype=np.float64):
    """name -> score_mod for a problem with hq query heads, at most sq query and sk key positions
    a sequence; float arrays it captures (whose gradients the backward returns as dtensors) have
    dtype fdtype, integer ones are document ids."""
    smax = max(sq, sk, 1)
    table = rng.standard_normal((hq, 2 * smax + 1)).astype(fdtype)
    bucket = rng.standard_normal((hq, 2 * BUCKET + 1)).astype(fdtype)
    slopes = rng.uniform(0.1, 1.0, hq).astype(fdtype)
    gain = rng.uniform(0.5, 1.5, hq).astype(fdtype)
    penalty = rng.uniform(0.0, 2.0, hq).astype(fdtype)
    doc_q, doc_k = _doc_ids(rng, sq), _doc_ids(rng, sk)
    return {
        "times_two": lambda s, b, h, q, kv: s * 2,
        "trig": lambda s, b, h, q, kv: np.sin(s) + np.cos(0.5 * s) * 0.25,
        "head_offset": lambda s, b, h, q, kv: s + h * 0.125 - b,
        "where_causal_decay": lambda s, b, h, q, kv: np.where(q >= kv, s, s * 0.5 - 1.0),
        # kinks at values no float16 / bfloat16 holds: a zero scale puts scores on the bias's
        # values, and on a kink the reference's central difference averages the two slopes
        # where attnext's derivative takes one (ties go to the first operand: mods/grad.py);
        # seed 7273 found dbias twice the reference's with kinks at -1, 0.5 and 2
        "clamp": lambda s, b, h, q, kv: np.minimum(np.maximum(s, -0.9), np.clip(s, 0.45, 1.9)),
        "int_arith": lambda s, b, h, q, kv: s + (q % 3) * 0.1 - (kv // 2) * 0.01,
        "softcap": lambda s, b, h, q, kv: 2.5 * np.tanh(s / 2.5),
        "rel_bias": lambda s, b, h, q, kv: s + table[h, q - kv + smax],
        "rel_bias_bucket": lambda s, b, h, q, kv: s + bucket[h, np.clip(q - kv, -BUCKET, BUCKET)
                                                             + BUCKET],
        "alibi": lambda s, b, h, q, kv: s - slopes[h] * np.abs(q - kv),
        # smooth (the reference's differences cannot see through a kink near s = 0, where
        # small or zero scales put every score) and one-signed in gain[h]
        "head_gain": lambda s, b, h, q, kv: s + gain[h] * np.tanh(s) ** 2 + bucket[h, BUCKET],
        "doc_penalty": lambda s, b, h, q, kv: np.where(doc_q[q] == doc_k[kv], s,
                                                       s - penalty[h]),
        "doc_rel_bias": lambda s, b, h, q, kv: np.where(
            doc_q[q] == doc_k[kv], s + bucket[h, np.clip(kv - q, -BUCKET, BUCKET) + BUCKET], s),
    }


# How many float elements a score_mod's arrays hold (the reference differentiates through each
# one separately, so its backward costs that many times the pairs), and the largest |d out / d s|
# (score_mod's slope in the score).
def _grad_elements(name, hq, sq, sk):
    smax = max(sq, sk, 1)
    return {"rel_bias": hq * (2 * smax + 1), "rel_bias_bucket": hq * (2 * BUCKET + 1),
            "alibi": hq, "head_gain": hq + hq * (2 * BUCKET + 1), "doc_penalty": hq,
            "doc_rel_bias": hq * (2 * BUCKET + 1)}.get(name, 0)


SLOPE = {"times_two": 2.0, "trig": 1.125, "head_gain": 2.2}     # the others: at most 1

# The score_mods' kinks (where their derivative jumps). A kept score within the backends' rounding
# of one may fall on either side of it in the backend and in the float64 reference: its gradient
# is then defined by neither (seed 7305's case 18972: a float32 score 4e-9 from clamp's -0.9, dq
# off by the slope's jump), and such a case's gradients are not compared (_near_kink).
KINKS = {"clamp": (-0.9, 0.45, 1.9)}


def _mask_mods(sq=1, sk=1, rng=None):
    rng = np.random.default_rng(0) if rng is None else rng
    doc_q, doc_k = _doc_ids(rng, sq), _doc_ids(rng, sk)
    allowed = rng.random((max(sq, 1), max(sk, 1))) < 0.7
    return {
        "causal": lambda b, h, q, kv: q >= kv,
        "sliding_window": lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 3),
        "prefix_lm": lambda b, h, q, kv: (kv < 5) | (q >= kv),
        "not_diagonal": lambda b, h, q, kv: ~(q == kv),
        "head_dependent": lambda b, h, q, kv: (h % 2 == 0) | ((q >= kv) & ~(kv == 0)),
        "parity": lambda b, h, q, kv: (q + kv + b) % 2 == 0,
        "document": lambda b, h, q, kv: doc_q[q] == doc_k[kv],
        "document_causal": lambda b, h, q, kv: (doc_q[q] == doc_k[kv]) & (q >= kv),
        "document_or_near": lambda b, h, q, kv: (doc_q[q] == doc_k[kv]) | (np.abs(q - kv) < 4),
        "allowed_table": lambda b, h, q, kv: allowed[q, kv] | (h == b),
    }


SCORE_MODS = sorted(_score_mods(1, 1, 1, np.random.default_rng(0)))
MASK_MODS = sorted(_mask_mods())
VIEWS = ["contig", "fortran", "pad", "step", "flip", "perm", "bcast"]
ARG_VIEWS = ["plain", "bcast", "flip", "step"]


# --- the strategy -----------------------------------------------------------------------------

def _strategies():
    """Hypothesis is imported only when fuzzing (the package does not depend on it)."""
    from hypothesis import strategies as st

    def length(draw, label, zero=True):
        bucket = draw(st.integers(0, 99), label=f"{label}_bucket")
        if bucket < 3 and zero:
            return 0
        if bucket < 80:
            return draw(st.integers(1, 40), label=label)
        if bucket < 97:
            return draw(st.integers(41, 300), label=label)
        return draw(st.integers(301, 1100), label=label)

    def head_dim(draw, label):
        if draw(st.integers(0, 9)) < 8:
            return draw(st.integers(1, 64), label=label)
        return draw(st.integers(65, 256), label=label)

    def view(draw, ndim, shape):
        kind = draw(st.sampled_from(VIEWS))
        if kind == "contig" or kind == "fortran" or kind == "pad":
            return (kind, draw(st.integers(1, 5))) if kind == "pad" else (kind,)
        if kind == "perm":
            return (kind, tuple(draw(st.permutations(range(ndim)))))
        axis = draw(st.integers(0, ndim - 1))
        if kind == "bcast" and shape[axis] < 2:
            return ("contig",)
        return (kind, axis)

    def broadcast_shape(draw, full, heads):
        nb, sq, sk = full
        shape = [draw(st.sampled_from([1, nb])), draw(st.sampled_from(heads)),
                 draw(st.sampled_from([1, sq])), draw(st.sampled_from([1, sk]))]
        while len(shape) > 1 and shape[0] == 1 and draw(st.booleans()):
            shape.pop(0)
        return tuple(shape)

    @st.composite
    def specs(draw, cuda=False):
        spec = {"seed": draw(st.integers(0, 2**32 - 1), label="seed")}
        spec["api"] = draw(st.sampled_from(["attention", "varlen"]))
        spec["backward"] = draw(st.booleans())
        dtypes = ["float16", "bfloat16"] if cuda and draw(st.booleans()) else list(DTYPES)
        spec["dtype"] = dtype = draw(st.sampled_from(dtypes))
        hk = draw(st.integers(1, 4))
        group = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
        d, dv = head_dim(draw, "D"), head_dim(draw, "Dv")
        if spec["api"] == "attention":
            nb = 0 if draw(st.integers(0, 49)) == 0 else draw(st.integers(1, 4))
            sq, sk = length(draw, "Sq"), length(draw, "Sk")
            spec["layout"] = draw(st.sampled_from(["bshd", "bhsd"]))
            lq = lk = None
            if nb and draw(st.integers(0, 3)) == 0:
                lq = [draw(st.integers(0, sq)) for _ in range(nb)]
                lk = [draw(st.integers(0, sk)) for _ in range(nb)]
            spec.update(seqlens_q=lq, seqlens_k=lk)
            rows_q, rows_k = sq, sk
        else:
            nb = draw(st.integers(1, 5))
            seg_q = [0 if draw(st.integers(0, 5)) == 0 else length(draw, "seg_q")
                     for _ in range(nb)]
            seg_k = [0 if draw(st.integers(0, 5)) == 0 else length(draw, "seg_k")
                     for _ in range(nb)]
            while sum(seg_q) > 1200 or sum(seg_k) > 1200:   # a packed batch stays moderate
                seg_q, seg_k = [n // 2 for n in seg_q], [n // 2 for n in seg_k]
            lq, lk = seg_q, seg_k
            used = draw(st.integers(0, 3)) == 0
            if used:
                lq = [draw(st.integers(0, n)) for n in seg_q]
                lk = [draw(st.integers(0, n)) for n in seg_k]
            spec.update(seg_q=seg_q, seg_k=seg_k, used_q=lq if used else None,
                        used_k=lk if used else None,
                        pad_q=draw(st.sampled_from([0, 0, 1, 3, 17])),
                        pad_k=draw(st.sampled_from([0, 0, 1, 3, 17])),
                        max_q=max(lq) + draw(st.sampled_from([0, 0, 1, 5])),
                        max_k=max(lk) + draw(st.sampled_from([0, 0, 2, 7])))
            sq, sk = spec["max_q"], spec["max_k"]
            rows_q, rows_k = sum(seg_q) + spec["pad_q"], sum(seg_k) + spec["pad_k"]
            spec["layout"] = "thd"
        # keep one case cheap: halve head dims, then heads, until the work fits
        pairs = (max(nb, 1) * sq * sk if spec["api"] == "attention"
                 else sum(a * b for a, b in zip(spec["seg_q"], spec["seg_k"])))
        while True:
            work = hk * group * pairs * (d + dv)
            if work <= MAX_WORK:
                break
            if d + dv > 16:
                d, dv = max(1, d // 2), max(1, dv // 2)
            elif hk * group > 1:
                hk, group = max(1, hk // 2), (group // 2 if hk == 1 else group)
                group = max(1, group)
            else:
                break
        hq = hk * group
        spec.update(B=nb, Sq=sq, Sk=sk, Hq=hq, Hk=hk, D=d, Dv=dv)
        if spec["layout"] == "thd":
            shapes = {"q": (rows_q, hq, d), "k": (rows_k, hk, d), "v": (rows_k, hk, dv)}
        elif spec["layout"] == "bshd":
            shapes = {"q": (nb, sq, hq, d), "k": (nb, sk, hk, d), "v": (nb, sk, hk, dv)}
        else:
            shapes = {"q": (nb, hq, sq, d), "k": (nb, hk, sk, d), "v": (nb, hk, sk, dv)}
        spec["views"] = {n: view(draw, len(s), s) for n, s in shapes.items()}
        spec["readonly"] = draw(st.integers(0, 4)) == 0
        spec["mag"] = draw(st.sampled_from([1.0, 1.0, 1.0, 0.01, 3.0, 10.0]))
        spec["causal"] = draw(st.sampled_from([False, False, True, "top_left"]))
        spec["window"] = None
        if draw(st.integers(0, 3)) == 0:
            side = st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, max(sk, 1)))
            spec["window"] = (draw(side), draw(side))
        spec["softcap"] = draw(st.sampled_from([0.05, 0.5, 1.0, 5.0, 30.0])) \
            if draw(st.integers(0, 3)) == 0 else None
        spec["scale"] = draw(st.sampled_from([0.0, -0.3, 0.05, 0.4, 1.0, -1.5])) \
            if draw(st.integers(0, 3)) == 0 else None
        spec["alibi"] = draw(st.sampled_from([None, None, None, "h", "bh"]))
        heads = sorted({1, hk, hq})
        spec["bias"] = None
        if draw(st.integers(0, 2)) == 0:
            bdtypes = ["float16", "bfloat16", "float32"] if cuda else list(DTYPES)
            spec["bias"] = {"shape": broadcast_shape(draw, (nb, sq, sk), heads),
                            "dtype": draw(st.sampled_from([dtype, dtype] + bdtypes)),
                            "view": draw(st.sampled_from(ARG_VIEWS)),
                            "mag": draw(st.sampled_from([0.1, 1.0, 4.0])),
                            "neginf": draw(st.integers(0, 9)) == 0}
        spec["mask"] = None
        if draw(st.integers(0, 2)) == 0:
            spec["mask"] = {"shape": broadcast_shape(draw, (nb, sq, sk), heads),
                            "p": draw(st.sampled_from([0.0, 0.3, 0.7, 0.95, 1.0])),
                            "dead_rows": draw(st.integers(0, 3)),
                            "view": draw(st.sampled_from(ARG_VIEWS))}
        spec["score_mod"] = spec["mask_mod"] = spec["mod_dtype"] = None
        if draw(st.integers(0, 2)) == 0:              # a third of the cases: a callback
            kinds = draw(st.sampled_from(["score_mod", "mask_mod", "both"]))
            if kinds != "mask_mod":
                names = SCORE_MODS
                if spec["backward"]:
                    if dtype in ("float16", "bfloat16"):
                        # the rounded-out allowance holds for a slope of at most 1 (see SLOPE)
                        names = [n for n in names if SLOPE.get(n, 1.0) <= 1.0]
                    names = [n for n in names if _grad_elements(n, hq, sq, sk) * hq * pairs
                             <= MAX_DTENSOR_WORK]
                spec["score_mod"] = draw(st.sampled_from(names))
                spec["mod_dtype"] = draw(st.sampled_from(["float64", "float32", "float32",
                                                          "float16"]))
                if spec["bias"] is not None:
                    spec["bias"]["neginf"] = False   # sin(-inf) etc.: NaN by the user's function
            if kinds != "score_mod":
                spec["mask_mod"] = draw(st.sampled_from(MASK_MODS))
        spec["out"] = draw(st.sampled_from([None, None, None, "contig", "step"]))
        spec["deterministic"] = draw(st.booleans())
        return spec

    return specs


# --- building a case --------------------------------------------------------------------------

def _randn_mag(rng, shape, dtype, mag=1.0):
    return (mag * rng.standard_normal(shape)).astype(dtype)


_randn = _randn_mag


def _materialise(rng, shape, dtype, how, mag=1.0):
    """Random data of `shape` (standard normal times mag) laid out in memory as `how` says."""
    kind = how[0]
    _randn = functools.partial(_randn_mag, mag=mag)
    if kind == "contig":
        return _randn(rng, shape, dtype)
    if kind == "fortran":
        return np.asfortranarray(_randn(rng, shape, dtype))
    if kind == "pad":       # a slice of a wider last dim
        return _randn(rng, shape[:-1] + (shape[-1] + how[1],), dtype)[..., :shape[-1]]
    if kind == "perm":      # allocated in another axis order
        perm = how[1]
        base = _randn(rng, tuple(shape[p] for p in perm), dtype)
        return base.transpose(np.argsort(perm))
    axis = how[1]
    if kind == "step":      # every other element along one axis
        big = list(shape)
        big[axis] = 2 * shape[axis]
        return _randn(rng, big, dtype)[(slice(None),) * axis + (slice(None, None, 2),)]
    if kind == "flip":      # negative stride along one axis
        return np.flip(_randn(rng, shape, dtype), axis)
    if kind == "bcast":     # stride 0 along one axis
        small = list(shape)
        small[axis] = 1
        return np.broadcast_to(_randn(rng, small, dtype), shape)
    raise ValueError(f"unknown view {how!r}")


def _arg_view(rng, arr, full_shape, how):
    """bias / mask passed compact, as a broadcast view toward full_shape, reversed or strided."""
    if how == "bcast":
        target = tuple(f if s == 1 and rng.random() < 0.5 else s
                       for s, f in zip(arr.shape, full_shape[4 - arr.ndim:]))
        return np.broadcast_to(arr, target)
    if how == "flip" and arr.ndim:
        return np.flip(arr, -1)
    if how == "step" and arr.ndim:
        return np.repeat(arr, 2, axis=-1)[..., ::2]
    return arr


class Case:
    """The arrays of one spec: q, k, v, the length arguments and the keyword options."""

    def __init__(self, spec):
        self.spec = spec
        rng = np.random.default_rng(spec["seed"])
        self.dtype = dtype = DTYPES[spec["dtype"]]
        self.varlen = spec["api"] == "varlen"
        nb, hq, hk = spec["B"], spec["Hq"], spec["Hk"]
        sq, sk, d, dv = spec["Sq"], spec["Sk"], spec["D"], spec["Dv"]
        layout = spec["layout"]
        if self.varlen:
            rows_q = sum(spec["seg_q"]) + spec["pad_q"]
            rows_k = sum(spec["seg_k"]) + spec["pad_k"]
            shapes = {"q": (rows_q, hq, d), "k": (rows_k, hk, d), "v": (rows_k, hk, dv)}
        elif layout == "bshd":
            shapes = {"q": (nb, sq, hq, d), "k": (nb, sk, hk, d), "v": (nb, sk, hk, dv)}
        else:
            shapes = {"q": (nb, hq, sq, d), "k": (nb, hk, sk, d), "v": (nb, hk, sk, dv)}
        mag = spec.get("mag", 1.0)   # the size of q and k: large scores, or nearly uniform ones
        self.q, self.k, self.v = (_materialise(rng, shapes[n], dtype, spec["views"][n],
                                               mag if n != "v" else 1.0) for n in ("q", "k", "v"))
        if self.varlen:
            self.lengths = dict(cu_seqlens_q=np.cumsum([0] + spec["seg_q"]),
                                cu_seqlens_k=np.cumsum([0] + spec["seg_k"]),
                                max_seqlen_q=spec["max_q"], max_seqlen_k=spec["max_k"])
            if spec["used_q"] is not None:
                self.lengths.update(seqused_q=np.array(spec["used_q"]),
                                    seqused_k=np.array(spec["used_k"]))
        else:
            self.lengths = {}
        opts = {"causal": spec["causal"]}
        if not self.varlen:
            opts["layout"] = layout
            if spec["seqlens_q"] is not None:
                opts.update(seqlens_q=np.array(spec["seqlens_q"]),
                            seqlens_k=np.array(spec["seqlens_k"]))
        for name in ("window", "softcap", "scale"):
            if spec[name] is not None:
                opts[name] = spec[name]
        if spec["alibi"] is not None:
            shape = (hq,) if spec["alibi"] == "h" else (nb, hq)
            opts["alibi_slopes"] = rng.uniform(0.0, 1.0, shape)
        full = (nb, hq, sq, sk)
        if spec["bias"] is not None:
            b = spec["bias"]
            bias = (b["mag"] * rng.standard_normal(b["shape"])).astype(DTYPES[b["dtype"]])
            if b["neginf"] and bias.size:
                bias[rng.random(bias.shape) < 0.2] = -np.inf
            opts["bias"] = _arg_view(rng, bias, full, b["view"])
        if spec["mask"] is not None:
            m = spec["mask"]
            mask = rng.random(m["shape"]) < m["p"]
            if mask.ndim >= 2 and mask.shape[-2] > 1:
                for _ in range(m["dead_rows"]):
                    mask[..., rng.integers(mask.shape[-2]), :] = False
            opts["mask"] = _arg_view(rng, mask, full, m["view"])
        if spec["score_mod"] is not None:
            fdtype = DTYPES[spec.get("mod_dtype") or "float64"]
            opts["score_mod"] = _score_mods(hq, sq, sk, rng, fdtype)[spec["score_mod"]]
        if spec["mask_mod"] is not None:
            opts["mask_mod"] = _mask_mods(sq, sk, rng)[spec["mask_mod"]]
        self.opts = opts
        self.rng = rng
        if spec["readonly"]:
            for x in self.arrays():
                with contextlib.suppress(ValueError):
                    x.flags.writeable = False

    def arrays(self):
        """Every array argument (to check that none is modified)."""
        xs = [self.q, self.k, self.v]
        xs += [x for x in self.lengths.values() if isinstance(x, np.ndarray)]
        xs += [x for x in self.opts.values() if isinstance(x, np.ndarray)]
        return xs


def _snapshot(arrays):
    """Copies of the arrays and of the memory they view, to compare after the calls."""
    snap = []
    for x in arrays:
        base = x
        while isinstance(base.base, np.ndarray):
            base = base.base
        snap.append((x, np.array(x, copy=True), base, np.array(base, copy=True)))
    return snap


def _modified(snap):
    for i, (x, xc, base, bc) in enumerate(snap):
        if not (np.array_equal(x, xc, equal_nan=True) and np.array_equal(base, bc, equal_nan=True)):
            return i
    return None


@contextlib.contextmanager
def _poisoned_outputs():
    """Result buffers attnext allocates start as NaN (tests/conftest.py `poison_results`)."""
    api = attnext.api
    saved = getattr(api, "_new_output", None)
    if saved is None:
        yield
        return
    def poisoned(shape, dtype, pinned=False):
        out = saved(shape, dtype, pinned)
        out[...] = np.nan
        return out
    api._new_output = poisoned
    try:
        yield
    finally:
        api._new_output = saved


def usable_backends(requested=("cpu", "cuda")):
    ok = [b for b in requested if b == "cpu"]
    if "cuda" in requested and str(attnext.info()["backends"].get("cuda", "")).startswith("usable"):
        ok.append("cuda")
    return ok


def _cond(case):
    """A factor on the relative float32 / float64 allowance (tests/conftest.py's `cond`) for
    problems whose scores are large: a score s computed in float32 is off by about eps * |s|
    before the softmax exponentiates it, so every probability is off by that much relative.
    cond is 1 until 4 ulps at the largest |score| exceed F32_RTOL. The largest |score| is bounded
    by the largest |scale * q.k| (computed; packed rows of different sequences included) plus
    the largest finite |bias| and the largest ALiBi term (built-in, or the alibi score_mod's)."""
    o, spec = case.opts, case.spec
    layout = "thd" if case.varlen else spec["layout"]
    q = canonical(np.asarray(case.q, np.float32), case.varlen, layout)
    k = canonical(np.asarray(case.k, np.float32), case.varlen, layout)
    scale = o.get("scale", 1 / np.sqrt(spec["D"]))
    smax = 0.0
    if q.size and k.size:
        k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
        smax = abs(scale) * max(float(np.abs(q[b, h] @ k[b, h].T).max(initial=0.0))
                                for b in range(q.shape[0]) for h in range(q.shape[1]))
    # softcap's slope is at most 1, so s0's error passes to s undiminished; the backward's
    # factor 1 - tanh^2(s0 / softcap) is off by up to 2 err(s0) / softcap relative
    if o.get("softcap") is not None and spec["backward"]:
        smax *= 1 + 2 / o["softcap"]
    bias = o.get("bias")
    if bias is not None and bias.size:
        b64 = np.asarray(bias, np.float64)
        smax += float(np.abs(b64[np.isfinite(b64)]).max(initial=0.0))
    if o.get("alibi_slopes") is not None:
        smax += float(np.abs(o["alibi_slopes"]).max(initial=0.0)) * (spec["Sq"] + spec["Sk"])
    if spec.get("score_mod") == "alibi":
        # the score_mod's ALiBi term, as the built-in one. It also bounds the reference's own
        # float64 error: its central differences of score_mod take steps relative to |s| but
        # round relative to |score_mod(s)|, hundreds of times larger at long distances (twice the
        # term: seed 0's case 7085, float64 varlen with float16 slopes, found dk 1.002x over the
        # bound of the term once, with out and dv exact to 1e-14: the reference's dscore)
        slopes = np.asarray(fingerprint.captured_arrays(o["score_mod"])["slopes"], np.float64)
        smax += 2 * float(np.abs(slopes).max(initial=0.0)) * (spec["Sq"] + spec["Sk"])
    return max(1.0, 4 * EPS[F32] * smax / F32_RTOL)


def _reduced(bias, spec):
    """How many (b, h, r, c) terms each dbias element sums: round-off in a float32 sum grows
    like its square root (cancelling terms: a bias constant along the keys has exact dbias 0)."""
    full = max(spec["B"], 1) * spec["Hq"] * max(spec["Sq"], 1) * max(spec["Sk"], 1)
    return max(1, full // max(1, bias.size))


def run_case(spec, backends=("cpu",), stats=None):
    """Runs one spec on each backend (those that apply) and the reference; returns a list of
    mismatch messages (empty: all agree). stats: None, or a collections.Counter that counts what
    was checked ("cpu", "cuda", "cpu+mods", "cuda+mods", "dtensors")."""
    case = Case(spec)
    o, lengths, dtype = case.opts, case.lengths, case.dtype
    if case.varlen:
        fwd, bwd = attnext.varlen_attention, attnext.varlen_attention_backward
        rfwd, rbwd = reference.varlen_attention, reference.varlen_attention_backward
    else:
        fwd, bwd = attnext.attention, attnext.attention_backward
        rfwd, rbwd = reference.attention, reference.attention_backward
    problems = []
    snap = _snapshot(case.arrays())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        try:
            r_out, r_lse = rfwd(case.q, case.k, case.v, **lengths, return_lse=True, **o)
        except Exception as e:  # a spec the reference refuses is a bug of the strategy or of it
            return [f"reference forward raised {type(e).__name__}: {e}"]
    dout = _randn(case.rng, r_out.shape, dtype) if spec["backward"] else None
    cond = _cond(case)
    for backend in backends:
        if backend == "cuda" and dtype not in GPU_DTYPES:
            continue
        tag = f"[{backend}] "
        try:
            with _poisoned_outputs(), warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                found = _check_one(case, backend, fwd, bwd, r_out, r_lse, dout, rfwd, rbwd,
                                   cond, stats)
            problems += [tag + p for p in found]
        except Exception as e:
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            problems.append(f"{tag}raised {tb}")
        i = _modified(snap)
        if i is not None:
            problems.append(f"{tag}input #{i} (q, k, v, lengths, options in order) was modified")
            snap = _snapshot(case.arrays())
    return problems


def _to_device(x):
    """A copy of NumPy array x in GPU memory (C order), as an attnext DeviceArray."""
    from attnext import _C
    from attnext.cuda import arrays as device
    host = np.ascontiguousarray(x)
    a = device.empty(host.shape, host.dtype)
    if host.size:
        _C.memcpy_htod(a.ptr, host.reshape(-1).view(np.uint8), 0)
    return a


def _check_one(case, backend, fwd, bwd, r_out, r_lse, dout, rfwd, rbwd, cond, stats=None):
    spec, o, lengths, dtype = case.spec, case.opts, case.lengths, case.dtype
    mods = spec["score_mod"] is not None or spec["mask_mod"] is not None
    if stats is not None:
        stats[backend + ("+mods" if mods else "")] += 1
    problems = []
    q, k, v = case.q, case.k, case.v
    # A score_mod / mask_mod with host q, k, v runs on the CPU's interpreter whatever device=
    # says (api.py); the CUDA kernels run it for q, k, v (and dout) in GPU memory. Results then
    # come back as DeviceArrays, read back with np.asarray; the captured NumPy arrays, bias, mask
    # and lengths stay on the host (attnext uploads them). No out= there: out= must then be a
    # GPU array too.
    on_gpu = backend == "cuda" and mods
    put, get = (_to_device, np.asarray) if on_gpu else ((lambda x: x), (lambda x: x))
    if on_gpu:
        q, k, v = (put(x) for x in (q, k, v))
    out_buf = None
    if spec["out"] == "contig" and not on_gpu:
        out_buf = np.full(r_out.shape, np.nan, dtype)
    elif spec["out"] == "step" and not on_gpu:
        out_buf = np.full(r_out.shape[:-1] + (2 * r_out.shape[-1],), np.nan, dtype)[..., ::2]
    res_dev, lse_dev = fwd(q, k, v, **lengths, device=backend, return_lse=True, out=out_buf,
                           **o)
    res, lse = get(res_dev), get(lse_dev)
    if out_buf is not None and res is not out_buf:
        problems.append("out: the result is not the out= buffer")
    if res.dtype != dtype or res.shape != r_out.shape:
        return problems + [f"out: {res.shape} {res.dtype}, expected {r_out.shape} {dtype}"]
    if lse.dtype != acc_dtype(dtype):
        problems.append(f"lse dtype {lse.dtype} for {dtype} inputs")
    # lse = m + log(sum): its round-off is relative to the row maximum and log(n), not to lse
    # itself (they cancel to 0.016 from +-3 at 23 keys); |m| <= |lse| + log(n)
    finite = np.abs(r_lse[np.isfinite(r_lse)])
    log_n = float(np.log(max(2, *case.k.shape[:-1])))
    lse_floor = (float(finite.max()) if finite.size else 0.0) + 2 * log_n
    for p in (compare("out", res, r_out, dtype, cond=cond),
              compare("lse", lse, r_lse, lse.dtype, floor=lse_floor, cond=cond)):
        if p:
            problems.append(p)
    dead = np.isneginf(r_lse)
    if case.varlen:
        dead = dead.T
    elif spec["layout"] == "bshd":
        dead = dead.transpose(0, 2, 1)
    if not (res[dead] == 0).all():
        problems.append("out: a row that keeps no key is not exactly 0")
    if not spec["backward"]:
        return problems
    g = bwd(put(dout), q, k, v, res_dev, lse_dev, **lengths, device=backend,
            deterministic=spec["deterministic"], **o)
    if on_gpu:
        g = type(g)(*(None if x is None else get(x) for x in g[:4]), g.dtensors)
    rg = rbwd(dout, case.q, case.k, case.v, res, lse, **lengths, **o)
    if _near_kink(case, rfwd):
        if stats is not None:
            stats["near a kink"] += 1
    else:
        bias = o.get("bias")
        dbias_cond = None if bias is None else cond * np.sqrt(_reduced(bias, spec))
        problems += compare_grads(g, rg, case.q, case.k, case.v, dout, res, r_out,
                                  lengths if case.varlen else None, o, cond, dbias_cond)
        extra = (dtensors_allowance(case.q, case.k, case.v, dout, res, r_out, lengths, o, cond)
                 if rg.dtensors else None)
        problems += compare_dtensors(g, rg, o.get("score_mod"), dtype, cond, extra)
        if stats is not None and rg.dtensors:
            stats["dtensors"] += 1
    if g.dq.shape == case.q.shape and not (g.dq[dead] == 0).all():
        problems.append("dq: a row that keeps no key is not exactly 0")
    if case.varlen:
        real_k = np.zeros(case.k.shape[0], bool)
        cu_k = lengths["cu_seqlens_k"]
        lk = spec["used_k"] if spec["used_k"] is not None else spec["seg_k"]
        for b, n in enumerate(lk):
            real_k[cu_k[b]:cu_k[b] + n] = True
        for name, got in (("dk", g.dk), ("dv", g.dv)):
            if got.shape[0] == real_k.size and not (got[~real_k] == 0).all():
                problems.append(f"{name}: a packed row outside every sequence is not exactly 0")
    return problems


def _near_kink(case, rfwd):
    """Whether a kept score lies within the backends' rounding of one of its score_mod's kinks
    (KINKS): the scores as the reference computes them, read by a score_mod that records them,
    against 4 D eps of the accumulation (scale q . k sums D products) times max(1, |s|)."""
    kinks = KINKS.get(case.spec["score_mod"])
    if kinks is None:
        return False
    seen = []

    def record(s, b, h, q, kv):
        seen.append(np.array(s, dtype=np.float64).ravel())
        return s
    rfwd(case.q, case.k, case.v, **case.lengths, **{**case.opts, "score_mod": record})
    if not seen:
        return False
    s = np.concatenate(seen)
    s = s[np.isfinite(s)]
    tol = 4 * case.q.shape[-1] * float(np.finfo(acc_dtype(case.dtype)).eps) * np.maximum(1.0, np.abs(s))
    return bool(any((np.abs(s - kink) <= tol).any() for kink in kinks))


# --- the driver -------------------------------------------------------------------------------

class _TimeUp(BaseException):
    """Ends a hypothesis run when the time budget is spent (a BaseException, so hypothesis does
    not take it for a failing example and shrink it)."""


def describe(spec):
    """One line naming the case's shapes and options (the spec itself replays it)."""
    s = spec
    shape = (f"{s['api']} {s['dtype']} B={s['B']} Sq={s['Sq']} Sk={s['Sk']} Hq={s['Hq']} "
             f"Hk={s['Hk']} D={s['D']} Dv={s['Dv']} layout={s['layout']}")
    if s["api"] == "varlen":
        shape += f" seg_q={s['seg_q']} seg_k={s['seg_k']} used_q={s['used_q']} used_k={s['used_k']}"
    keys = ("mag", "backward", "causal", "window", "softcap", "scale", "alibi", "bias", "mask",
            "score_mod", "mask_mod", "views", "out", "readonly")
    return shape + " " + " ".join(f"{k}={s[k]}" for k in keys if s.get(k) not in (None, False))


def describe_stats(stats):
    """"cpu 120 (41 with mods), dtensors 18" from run_case's counter (and ", gradients near a
    kink 2" where some were left uncompared)."""
    parts = [f"{b} {stats[b] + stats[b + '+mods']} ({stats[b + '+mods']} with mods)"
             for b in ("cpu", "cuda") if stats[b] + stats[b + "+mods"]]
    kinks = [f"gradients near a kink {stats['near a kink']}"] if stats["near a kink"] else []
    return ", ".join(parts + [f"dtensors {stats['dtensors']}"] + kinks)


def fuzz(seconds, seed=0, backends=("cpu",), verbose=False, log=print, max_examples=10**9,
         stats=None):
    """Runs hypothesis for about `seconds` (a case in flight is finished) with a fixed seed and
    no example database; returns (cases run, [(spec, problems), ...]). stats: None, or a
    collections.Counter that counts what was checked (run_case's)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed

    backends = tuple(backends)
    specs = _strategies()
    stop = time.monotonic() + seconds
    ran, mismatches = [0], []

    @hyp_seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much, HealthCheck.large_base_example],
              derandomize=False, print_blob=False)
    @given(spec=specs(cuda="cuda" in backends))
    def one(spec):
        if time.monotonic() > stop:
            raise _TimeUp
        t0 = time.monotonic()
        try:
            problems = run_case(spec, backends, stats)
        except Exception:   # the harness itself failed: report it like a mismatch
            problems = ["fuzz harness error: " + traceback.format_exc(limit=-3)]
        ran[0] += 1
        if verbose:
            log(f"case {ran[0]} ({time.monotonic() - t0:.2f} s): {describe(spec)}"
                + (f"  -> {len(problems)} MISMATCH" if problems else ""))
        if problems:
            mismatches.append((spec, problems))
            log(f"MISMATCH in case {ran[0]} (seed {seed}): {describe(spec)}")
            for p in problems:
                log(f"    {p}")
            log(f"    replay: python -m attnext.fuzz --replay \"{spec!r}\"")

    with contextlib.suppress(_TimeUp):
        one()
    return ran[0], mismatches


def _minutes(text):
    """argparse type for --minutes: a positive, finite number. 0 and less are refused rather
    than run as "no cases, no mismatches", which would read as a pass."""
    try:
        m = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not (math.isfinite(m) and m > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of minutes, got "
                                         f"{text} (to run one printed case, use --replay)")
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m attnext.fuzz",
                                 description="\n".join(__doc__.split("\n")[:5]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=_minutes, default=1.0,
                    help="time budget, a positive number of minutes (default 1; 0 or less is "
                         "refused: it would run nothing and exit 0)")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ap.add_argument("--backends", default="cpu,cuda",
                    help="comma-separated; cuda runs only where it is usable (default cpu,cuda)")
    ap.add_argument("--verbose", action="store_true", help="print every case")
    ap.add_argument("--replay", metavar="SPEC", help="run one printed spec and exit")
    args = ap.parse_args(argv)
    requested = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in requested if b not in ("cpu", "cuda")]
    if bad:
        ap.error(f"unknown backends {bad}; choose from cpu, cuda")
    backends = usable_backends(requested)
    if args.replay:
        spec = ast.literal_eval(args.replay)
        problems = run_case(spec, backends)
        print(describe(spec))
        for p in problems:
            print(f"    {p}")
        print("mismatch" if problems else "ok")
        return 1 if problems else 0
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"attnext.fuzz: seed {seed}, backends {','.join(backends)}, {args.minutes} min",
          flush=True)
    t0 = time.monotonic()
    stats = collections.Counter()
    ran, mismatches = fuzz(args.minutes * 60, seed, backends, args.verbose,
                           log=lambda s: print(s, flush=True), stats=stats)
    print(f"cases run: {ran}, mismatches: {len(mismatches)} ({time.monotonic() - t0:.0f} s, "
          f"seed {seed}); checked: {describe_stats(stats)}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
