"""The accuracy rules every backend is held to (docs/design.md "Testing"; the public face is
`attnext.testing.assert_close`): one copy, used by the test suite (tests/conftest.py), the
differential fuzzer (attnext/testing/fuzz.py) and users' tests.

Accuracy (the three-way check: a float64 reference, the same computation at the kernel's dtype,
the kernel). A backend result is cast to float64 and compared with the float64 reference fed
the *same* inputs (a float16 / bfloat16 input converts to float64 exactly, so the reference gives
the exact answer for the rounded inputs). With `scale` = the largest |reference| value of the
array, the largest error allowed is:

* float64: 1e-10 * scale + 1e-12.
* float32: F32_RTOL * scale + F32_ATOL (about 1e-5 relative).
* float16 / bfloat16: LOW_FACTOR * same_dtype + the float32 allowance, where `same_dtype` is
  the error of the same computation done at that dtype. It is estimated by the error that
  merely *storing* the reference's own result at that dtype makes, half an ulp at the array's
  largest magnitude (0.5 * eps(dtype) * scale): every implementation returning that dtype has
  at least this error, and a NumPy computation at that dtype has more (its products and sums
  round too), so this is stricter than comparing with a plain float16 NumPy attention. The
  float32 allowance covers the backend's float32 accumulation.

Gradients need two more terms, both from honest sources of error, not slack:

* Cancellation. dS = P * (dP - delta) cancels (exactly, with one key per row: dq = dk = 0), so
  round-off in dq, dk and dbias is relative to the size of dP, not of the result. For them
  (and dv) the float32 term is relative to the largest gradient of the call (`floor`). A
  broadcast bias's dbias sums many dS (over heads, rows or keys), whose total can be 0 exactly
  (a bias constant along the keys, a zero softmax scale) while every gradient is small: it gets
  the float32 term relative to the sum of the terms before they cancel as well,
  F32_RTOL * sum P_ij (|dP_ij| + |delta_i|) over the scores it sums (`dbias_terms`).
* 16-bit products. Tensor cores multiply 16-bit operands, so a GPU backward rounds P and dS to
  q's dtype before dS K and dS^T Q: each term is off by up to eps |dS k|, however much the terms
  cancel; `rounded_out_allowance` adds LOW_FACTOR * eps * scale * sqrt(sum (dS k)^2) (the
  roundings are independent) to dq, dk for float16 / bfloat16.
* The rounded forward output. The backward reads `out`, which is stored at q's dtype, and forms
  delta_i = sum(dout_i * out_i) from it (as FlashAttention does); the float64 reference uses the
  exact output. For every dtype, `rounded_out_allowance` bounds, per element, how far an exact
  backward fed that rounded `out` lands from the reference. It is computed only when the limit
  above is exceeded, and it is the whole error where the exact gradient is 0, e.g. the dbias of
  a bias constant along the keys (the softmax ignores such a bias), or dq where every key of a
  row is alike. The backward's own products dP = dout . v and delta round too (at the
  accumulation dtype, by about its unit roundoff times the sum of their terms' magnitudes), and
  the cancellation leaves that whole: the bound adds LOW_FACTOR times it. float32 needs both:
  over a long row of alike keys they passed float32's term relative to the largest gradient
  (the fuzzer, seed 7272: dq off by 1.26e-5 where that term allows 4.95e-6 and this bound 4.1e-5).

* Single-pass TF32 (float32 with precision="tf32"). The tensor cores round every operand to TF32
  (float16's 10-bit mantissa): unlike a float16 input, a float32 one is not exact there, so the
  scores move by eps |q| . |k| * scale, dP by eps |dout| . |v|, and the rounded P, V, dS and K by
  eps of themselves. `tf32_out_allowance`, `tf32_lse_allowance` and
  `rounded_out_allowance(precision="tf32")` carry these to out, lse, dq, dk and dbias, to first
  order, LOW_FACTOR times the root of the sum of their squares (the roundings are independent;
  eps is float16's), lse with its second-order term too (which never cancels). dP's rounding
  matters most where dS cancels: with one key per row dq = dk = 0 exactly, but the kernel's dP
  and delta = dout . out differ by it. An emulated TF32 attention sits at 0.1-0.3 of this bound,
  one rounding to 6 mantissa bits (16x coarser) past it (tests/unit/test_testing.py).

A gradient computed at q's dtype but stored in a finer one (a float32 dbias for float16 q) gets
the coarser dtype's allowance. lse is float32 for float16 / bfloat16 / float32 inputs and is
computed from exact inputs in float32, so it is held to the float32 allowance whatever q's dtype.

NaN always fails. Where the reference is -inf (lse of a row that keeps no key) the backend must
give exactly -inf, and where the reference is finite the backend must be finite. Rows that keep
no key must have out and dq exactly 0.
"""
import ml_dtypes
import numpy as np

from .. import reference
from ..mods import fingerprint

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

F64_RTOL, F64_ATOL = 1e-10, 1e-12
F32_RTOL, F32_ATOL = 2e-5, 1e-6
LOW_FACTOR = 3.0
EPS = {F16: float(np.finfo(np.float16).eps), BF16: float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps),
        F32: float(np.finfo(np.float32).eps), F64: float(np.finfo(np.float64).eps)}

# The largest problem a case may be: B * Hq * Sq * Sk * (D + Dv) multiply-adds, so that one case
# (the reference's float64 forward and backward included) takes well under a second here.


def coarser(a, b):
    a, b = np.dtype(a), np.dtype(b)
    return a if EPS[a] >= EPS[b] else b


def acc_dtype(dtype):
    return F64 if np.dtype(dtype) == F64 else F32


def product_dtype(dtype, precision=None):
    """The dtype whose rule a result of inputs in `dtype` is held to: dtype itself, or float16
    for float32 under precision="tf32" (TF32 products carry float16's 10-bit mantissa in float32's
    range; results are stored in float32, so out rounds as float32's does)."""
    dtype = np.dtype(dtype)
    return F16 if precision == "tf32" and dtype == F32 else dtype


def allowed_error(dtype, scale, floor=0.0, cond=1.0, factor=LOW_FACTOR):
    """The largest |actual - expected| allowed for a result of `dtype` whose reference has
    largest magnitude `scale`; `floor` is the magnitude the float32 round-off is relative to when
    it exceeds `scale`, `cond` a factor on the relative terms for an ill-conditioned problem,
    `factor` the multiple of the same-dtype error allowed for float16 / bfloat16."""
    dtype = np.dtype(dtype)
    big = max(scale, floor)
    if dtype == F64:
        return cond * F64_RTOL * big + F64_ATOL
    if dtype == F32:
        return cond * F32_RTOL * big + F32_ATOL
    same_dtype = 0.5 * EPS[dtype] * scale
    return factor * same_dtype + cond * F32_RTOL * big + F32_ATOL


def _where(mask):
    return tuple(int(i) for i in np.argwhere(mask)[0])


def compare(name, actual, expected, dtype=None, floor=0.0, extra=None, cond=1.0,
            factor=LOW_FACTOR):
    """The three-way check of one result: None if `actual` passes, else what is wrong. dtype
    defaults to actual's; extra: None, or a function returning a per-element allowance
    (broadcastable to actual) added to the limit, called only when the limit alone is exceeded;
    factor: allowed_error's."""
    actual = np.asarray(actual)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return f"{name}: shape {actual.shape} != {expected.shape}"
    dtype = np.dtype(actual.dtype if dtype is None else dtype)
    a = actual.astype(np.float64)
    nan = np.isnan(a)
    if nan.any():
        return f"{name}: NaN at {_where(nan)} ({int(nan.sum())} NaN in all)"
    if np.isnan(expected).any():
        return f"{name}: the reference has NaN"
    neg = np.isneginf(expected)
    bad = np.isneginf(a) != neg
    if bad.any():
        return (f"{name}: -inf pattern differs at {_where(bad)}: got {a[_where(bad)]}, "
                f"reference {expected[_where(bad)]}")
    finite = np.isfinite(expected)
    if finite.sum() + neg.sum() != expected.size:
        return f"{name}: the reference has +inf"
    bad = finite & ~np.isfinite(a)
    if bad.any():
        return f"{name}: {a[_where(bad)]} at {_where(bad)} where the reference is finite"
    if not finite.any():
        return None
    err = np.where(finite, np.abs(a - np.where(finite, expected, 0.0)), 0.0)
    scale = float(np.abs(expected[finite]).max())
    limit = allowed_error(dtype, scale, floor, cond, factor)
    if err.max() <= limit:
        return None
    excess = err - limit
    note = ""
    if extra is not None:
        allowance = np.broadcast_to(extra(), err.shape) * (1 + LOW_FACTOR * 0.5 * EPS[dtype])
        excess = excess - allowance
        note = " + the per-element allowance"
    worst = _where(excess == excess.max())
    if excess.max() <= 0:
        return None
    return (f"{name} ({dtype}): error {err[worst]:.3g} at {worst} (got {a[worst]!r}, reference "
            f"{expected[worst]!r}) exceeds {limit:.3g}{note} by {excess[worst]:.3g} "
            f"(max |reference| {scale:.3g})")


def canonical(x, varlen, layout):
    if varlen:
        return x.transpose(1, 0, 2)[None]
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def from_canonical(x, varlen, layout):
    if varlen:
        return x[0].transpose(1, 0, 2)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def sum_to_bias_shape(full, bias_shape):
    b4 = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    nb, hq, sq, sk = full.shape
    full = full.reshape(nb, b4[1], hq // b4[1], sq, sk).sum(axis=2)
    axes = tuple(i for i in (0, 2, 3) if b4[i] == 1 and full.shape[i] != 1)
    return full.sum(axis=axes, keepdims=True).reshape(bias_shape)


def _probabilities(q, k, lengths, opts):
    """The reference's softmax probabilities P, canonical (b, h, i, j): attention of v = the
    identity over the keys. lengths: None for attention(), else varlen_attention's length
    arguments."""
    layout = opts.get("layout", "bshd")
    is_varlen = lengths is not None
    sk = k.shape[0] if is_varlen else (k.shape[1] if layout == "bshd" else k.shape[2])
    eye = np.eye(sk)
    if is_varlen:
        v_eye = np.broadcast_to(eye[:, None, :], (sk, k.shape[1], sk))
        p = reference.varlen_attention(q, k, v_eye, **lengths, **opts)
    else:
        eye4 = eye[None, :, None, :] if layout == "bshd" else eye[None, None]
        p = reference.attention(q, k, np.broadcast_to(eye4, k.shape[:3] + (sk,)), **opts)
    return canonical(p, is_varlen, layout)


def _softmax_scale(q, opts):
    scale = opts.get("scale")
    return abs(1 / np.sqrt(q.shape[-1]) if scale is None else float(scale))


def _product_rounding(a, b):
    """TF32's rounding of the products a_i . b_j (both operands rounded to TF32, independently):
    u sqrt(2 sum_d (a_id b_jd)^2), u its unit roundoff."""
    return 0.5 * EPS[F16] * np.sqrt(2 * np.einsum("bhid,bhjd->bhij", a ** 2, b ** 2))


def _score_rounding(q, k, lengths, opts):
    """The reference's P and single-pass TF32's bound on each score's rounding (dS: the product's
    rounding times the softmax scale), canonical (b, h, i, j), for the tf32 allowances."""
    is_varlen, layout = lengths is not None, opts.get("layout", "bshd")
    qc, kc = (canonical(np.asarray(x, np.float64), is_varlen, layout) for x in (q, k))
    kg = np.repeat(kc, qc.shape[1] // kc.shape[1], axis=1)
    return _probabilities(q, k, lengths, opts), _product_rounding(qc, kg) * _softmax_scale(q, opts)


def tf32_out_allowance(q, k, v, lengths, opts):
    """Per-element bound on how far a single-pass TF32 forward's out lands from the float64 one
    (module docstring): the scores' rounding through the softmax (P_ij dS_ij (v_j - out_i)) and
    P's and V's own rounding (u sqrt(2) P_ij v_j), the roundings independent: LOW_FACTOR times
    the root of their sum of squares."""
    is_varlen, layout = lengths is not None, opts.get("layout", "bshd")
    p, ds = _score_rounding(q, k, lengths, opts)
    vc = canonical(np.asarray(v, np.float64), is_varlen, layout)
    vg = np.repeat(vc, p.shape[1] // vc.shape[1], axis=1)
    ps = p * ds
    out = np.einsum("bhij,bhjd->bhid", p, vg)
    # sum_j (ps_ij (v_jd - out_id))^2, expanded so that no (b, h, i, j, d) array is formed
    scores = (np.einsum("bhij,bhjd->bhid", ps ** 2, vg ** 2)
              - 2 * out * np.einsum("bhij,bhjd->bhid", ps ** 2, vg)
              + out ** 2 * (ps ** 2).sum(axis=-1, keepdims=True))
    products = 0.5 * EPS[F16] ** 2 * np.einsum("bhij,bhjd->bhid", p ** 2, vg ** 2)
    bound = LOW_FACTOR * np.sqrt(np.maximum(scores, 0) + products)
    return from_canonical(bound, is_varlen, layout)


def tf32_lse_allowance(q, k, lengths, opts):
    """Per-element bound on how far a single-pass TF32 forward's lse lands from the float64 one,
    the scores moved by their rounding dS: to first order sum_j P_ij dS_ij (the roundings
    independent: the root of the sum of their squares), to second order the variance of dS under
    P, at most 1/2 sum_j P_ij dS_ij^2 (lse is convex: it lifts lse whatever the signs; it leads
    where the products cancel, q . k small beside |q| |k|); LOW_FACTOR times their sum. In lse's
    shape: (B, Hq, Sq), or (Hq, T) for varlen_attention."""
    p, ds = _score_rounding(q, k, lengths, opts)
    bound = LOW_FACTOR * (np.sqrt(((p * ds) ** 2).sum(axis=-1)) + 0.5 * (p * ds ** 2).sum(axis=-1))
    return bound[0] if lengths is not None else bound


def rounded_out_allowance(q, k, v, dout, out, ref_out, lengths, opts, precision=None):
    """Per-element bounds (dq, dk, dbias, dv) on how far a backward that reads the forward's
    rounded `out` lands from the float64 gradients: an exact one's error, the rounding of its
    dP and delta products at the accumulation dtype, and single-pass TF32's roundings where
    precision="tf32" (module docstring); dbias None without a bias, dv None but for TF32.
    lengths: None for attention(), else varlen_attention's length arguments."""
    layout = opts.get("layout", "bshd")
    is_varlen = lengths is not None
    lengths = dict(lengths or {})
    p = _probabilities(q, k, lengths if is_varlen else None, opts)
    qc, kc = (np.abs(canonical(np.asarray(x, np.float64), is_varlen, layout)) for x in (q, k))
    e = np.abs(np.sum(canonical(np.asarray(dout, np.float64), is_varlen, layout)
                      * (canonical(np.asarray(out, np.float64), is_varlen, layout)
                         - canonical(ref_out, is_varlen, layout)), axis=-1))
    group = qc.shape[1] // kc.shape[1]
    scale = _softmax_scale(q, opts)
    kg = np.repeat(kc, group, axis=1)
    vg = np.repeat(canonical(np.asarray(v, np.float64), is_varlen, layout), group, axis=1)
    do = canonical(np.asarray(dout, np.float64), is_varlen, layout)
    delta = np.sum(do * canonical(ref_out, is_varlen, layout), axis=-1)
    dp_delta = np.einsum("bhid,bhjd->bhij", do, vg) - delta[..., None]
    # the backward's own products dP_ij = dout_i . v_j and delta_i = dout_i . out_i round at the
    # accumulation dtype by about its unit roundoff times the sum of their terms' magnitudes,
    # which the cancellation in dP - delta leaves whole; where the keys are alike every j makes
    # the same error, so it adds up over j as e does, not by squares (float32, keys and values
    # alike: at most 1.4x that sum, tests/unit/test_testing.py)
    oc = np.abs(canonical(np.asarray(out, np.float64), is_varlen, layout))
    dp_round = 0.5 * EPS[acc_dtype(q.dtype)] * (np.einsum("bhid,bhjd->bhij", np.abs(do), np.abs(vg))
                                                + np.sum(np.abs(do) * oc, axis=-1)[..., None])
    pr = p * (e[..., None] + LOW_FACTOR * dp_round)      # each dS_ij's error from both
    ds2 = (p * dp_delta) ** 2
    tf32 = precision == "tf32" and np.dtype(q.dtype) == F32
    eps = EPS[F16 if tf32 else np.dtype(q.dtype)]
    # tensor-core products take 16-bit operands: dS (and the P it comes from) rounded to q's
    # dtype before dS K and dS^T Q, each term dS_j k_j off by up to eps |dS_j k_j|, however much
    # the terms cancel (keys all alike: dq exactly 0); for TF32 also the scores' rounding (which
    # moves P) and dP's (dout . v from rounded operands), which the cancellation in dP - delta
    # leaves whole. The roundings are independent, so their sum grows like the root of the sum
    # of squares: LOW_FACTOR of that (the worst case, the plain sum, would let a bf16 dq be 50%
    # off at S = 4k). ds2: each dS_ij's roundings, squared.
    moved2 = 0.0        # the dS error that dbias (summed from unrounded dS) sees too
    if tf32:
        moved2 = ((p * _product_rounding(qc, kg) * scale * dp_delta) ** 2
                  + (p * _product_rounding(do, vg)) ** 2)
    ds2 = eps ** 2 * ds2 + moved2
    a_dq = scale * np.einsum("bhij,bhjd->bhid", pr, kg)
    a_dk = scale * np.einsum("bhij,bhid->bhjd", pr, qc)
    a_dq = a_dq + LOW_FACTOR * scale * np.sqrt(np.einsum("bhij,bhjd->bhid", ds2, kg ** 2))
    a_dk = a_dk + LOW_FACTOR * scale * np.sqrt(np.einsum("bhij,bhid->bhjd", ds2, qc ** 2))
    a_dk = a_dk.reshape(kc.shape[0], kc.shape[1], group, *kc.shape[2:]).sum(axis=2)
    a_dv = None
    if tf32:    # dv = P^T dout from rounded operands, P moved by the scores' rounding
        pt2 = (p ** 2 * (0.5 * EPS[F16] ** 2 + (_product_rounding(qc, kg) * scale) ** 2))
        a_dv = LOW_FACTOR * np.sqrt(np.einsum("bhij,bhid->bhjd", pt2, do ** 2))
        a_dv = from_canonical(np.sqrt((a_dv.reshape(kc.shape[0], kc.shape[1], group, *a_dv.shape[2:])
                                       ** 2).sum(axis=2)), is_varlen, layout)
    a_dq, a_dk = (from_canonical(x, is_varlen, layout) for x in (a_dq, a_dk))
    bias = opts.get("bias")
    if bias is None:
        return a_dq, a_dk, None, a_dv
    pe = pr + LOW_FACTOR * np.sqrt(moved2)
    return a_dq, a_dk, _to_bias(pe, lengths if is_varlen else None, np.shape(bias)), a_dv


def _to_bias(x, lengths, bias_shape):
    """A canonical (b, h, i, j) array of per-score terms summed as dbias sums dS: to the bias's
    shape, varlen_attention's packed scores (lengths: its length arguments, else None) first
    laid out per sequence, padded to the longest."""
    if lengths is not None:
        cu_q, cu_k = (np.asarray(lengths[n]) for n in ("cu_seqlens_q", "cu_seqlens_k"))
        lq = np.diff(cu_q) if lengths.get("seqused_q") is None else np.asarray(lengths["seqused_q"])
        lk = np.diff(cu_k) if lengths.get("seqused_k") is None else np.asarray(lengths["seqused_k"])
        mq = max(int(lengths.get("max_seqlen_q") or 0), int(lq.max(initial=0)))
        mk = max(int(lengths.get("max_seqlen_k") or 0), int(lk.max(initial=0)))
        full = np.zeros((len(lq), x.shape[1], mq, mk))
        for b in range(len(lq)):
            full[b, :, :lq[b], :lk[b]] = x[0, :, cu_q[b]:cu_q[b] + lq[b], cu_k[b]:cu_k[b] + lk[b]]
        x = full
    return sum_to_bias_shape(x, bias_shape)


def dbias_terms(q, k, v, dout, ref_out, lengths, opts):
    """Per-element size of the terms a dbias entry sums before they cancel: sum over its scores
    of P_ij (|dP_ij| + |delta_i|), dS_ij = P_ij (dP_ij - delta_i) (module docstring,
    "Cancellation"). A bias broadcast over heads, rows or keys sums many dS whose total may be 0
    exactly (a bias constant along the keys, a zero softmax scale), while their float32
    round-off is relative to this size, not to any gradient's. lengths: None for attention(),
    else varlen_attention's length arguments."""
    layout = opts.get("layout", "bshd")
    is_varlen = lengths is not None
    p = _probabilities(q, k, lengths, opts)
    do = canonical(np.asarray(dout, np.float64), is_varlen, layout)
    vc = canonical(np.asarray(v, np.float64), is_varlen, layout)
    vg = np.repeat(vc, do.shape[1] // vc.shape[1], axis=1)
    delta = np.abs(np.sum(do * canonical(ref_out, is_varlen, layout), axis=-1))
    terms = p * (np.abs(np.einsum("bhid,bhjd->bhij", do, vg)) + delta[..., None])
    return _to_bias(terms, lengths, np.shape(opts["bias"]))


# --- score_mods and mask_mods (after tests/helpers/mods.py) -------------------------------------


def compare_grads(g, rg, q, k, v, dout, out, ref_out, lengths, opts, cond=1.0, dbias_cond=None):
    """The checks of a backward's dq, dk, dv and dbias (shapes, dtypes, values) against the
    reference's gradients rg, with the rounded-out allowance (every dtype; TF32's roundings too
    for precision="tf32"; computed once, only when the plain limit is exceeded). lengths: None,
    or varlen_attention's length arguments; opts: the shared keyword options (bias included);
    dbias_cond: cond for dbias (default cond). Returns what is wrong, an empty list when
    everything passes."""
    dtype = np.dtype(q.dtype)
    precision = opts.get("precision")
    rule = product_dtype(dtype, precision)      # float16's for precision="tf32"
    floor = max(float(np.abs(x).max(initial=0.0)) for x in rg[:3])
    allowance = []

    def extra(i):
        if i == 3 and rule == dtype:    # dv reads no delta: only TF32's roundings move it
            return None

        def get():
            if not allowance:
                allowance.extend(rounded_out_allowance(q, k, v, dout, out, ref_out, lengths, opts,
                                                       precision))
            return allowance[i]
        return get

    problems = []
    for name, got, want, x, ex in (("dq", g.dq, rg.dq, q, extra(0)), ("dk", g.dk, rg.dk, k, extra(1)),
                                   ("dv", g.dv, rg.dv, v, extra(3))):
        if got.shape != np.shape(x) or got.dtype != dtype:
            problems.append(f"{name}: {got.shape} {got.dtype}, expected {np.shape(x)} {dtype}")
        else:
            problems.append(compare(name, got, want, rule, floor, ex, cond))
    bias = opts.get("bias")
    if bias is None:
        if g.dbias is not None:
            problems.append("dbias: given without a bias")
    elif g.dbias is None or g.dbias.shape != np.shape(bias) or g.dbias.dtype != bias.dtype:
        got = (None, None) if g.dbias is None else (g.dbias.shape, g.dbias.dtype)
        problems.append(f"dbias: {got[0]} {got[1]}, expected {np.shape(bias)} {bias.dtype}")
    else:
        low = extra(2)

        def dbias_extra():      # the summed terms' float32 (float64) round-off, then low's
            rtol = F64_RTOL if rule == F64 else F32_RTOL
            terms = rtol * dbias_terms(q, k, v, dout, ref_out, lengths, opts)
            return terms if low is None else terms + low()
        problems.append(compare("dbias", g.dbias, rg.dbias, coarser(rule, bias.dtype), floor,
                                dbias_extra, cond if dbias_cond is None else dbias_cond))
    return [p for p in problems if p]


def compare_dtensors(g, rg, score_mod, dtype, cond=1.0, extra=None, precision=None):
    """The dtensors of a backward (g) against the reference's (rg), as the CPU tests and the fuzzer
    hold them: each float array the traced score_mod reads, in the array's shape
    and dtype, within the allowance of the coarser of q's accumulation dtype and the array's,
    relative to the largest of the reference's dq, dk, dv (an array added to every score of a
    row has gradient 0 up to their round-off); an array the reference names beyond those must
    have a zero gradient. cond: as for dq, dk (fuzz._cond); extra: None, or name -> a function
    returning a per-element allowance added where that limit is exceeded (dtensors_allowance);
    precision: the call's (float16's rule joins for "tf32": product_dtype). Returns what is wrong
    (an empty list when all agree)."""
    got, want = g.dtensors, rg.dtensors
    acc = coarser(acc_dtype(dtype), product_dtype(dtype, precision))
    problems = []
    if not set(got) <= set(want):
        problems.append(f"dtensors: {sorted(set(got) - set(want))} are not float arrays the "
                        f"score_mod captures (the reference's: {sorted(want)})")
    floor = max(float(np.abs(x).max(initial=0.0)) for x in rg[:3])
    arrays = fingerprint.captured_arrays(score_mod) if want else {}
    for name, w in want.items():
        if name not in got:
            if np.any(w):
                problems.append(f"dtensors[{name!r}]: missing, the reference's is not 0")
            continue
        x, src = got[name], np.asarray(arrays[name])
        if x.shape != src.shape or x.dtype != src.dtype:
            problems.append(f"dtensors[{name!r}]: {x.shape} {x.dtype}, expected {src.shape} "
                            f"{src.dtype}")
            continue
        problems.append(compare(f"dtensors[{name!r}]", x, w, coarser(acc, src.dtype),
                                floor, None if extra is None else extra(name), cond))
    return [p for p in problems if p]


def dtensors_allowance(q, k, v, dout, out, ref_out, lengths, opts, cond=1.0):
    """name -> a function giving a per-element allowance on dtensors[name] (compare_dtensors'
    extra), for the two honest sources of error the plain limit does not scale with: the rounded
    forward output, and the round-off of a sum whose terms are much larger than the result.
    The differential fuzzer's allowance, for any call: lengths None (attention()) or
    varlen_attention's length arguments; opts the call's keyword options, score_mod included.

    Both go through d lse_i / d x = sum_j P_ij d score_mod(s_ij) / d x, a central difference of
    the reference's float64 lse (two forwards per element of the array: computed only when the
    limit alone is exceeded):
    * the backward forms delta_i = dout_i . out_i from `out` stored at q's dtype, off by
      e_i = dout_i . (out_i - ref_out_i), which moves x's gradient by at most
      sum_i |e_i| |d lse_i / d x|;
    * x's gradient sums dS_ij d score_mod(s_ij) / d x over every pair that reads x, with
      |dS_ij| <= P_ij M_i, M_i = 2 |dout_i| max_j |v_j|; where the derivative keeps one sign
      over the pairs (a bias table, an ALiBi slope), row i's terms sum to at most
      M_i |d lse_i / d x|, and the accumulation's round-off is rtol * cond times that."""
    layout = opts.get("layout", "bshd")
    lengths = dict(lengths or {})
    is_varlen = bool(lengths)
    do = np.asarray(dout, np.float64)
    e = np.abs(np.sum(do * (np.asarray(out, np.float64) - ref_out), axis=-1))
    vv = np.asarray(v, np.float64)
    vmax = float(np.sqrt(np.sum(vv * vv, axis=-1)).max(initial=0.0))
    rtol = F64_RTOL if np.dtype(q.dtype) == F64 else F32_RTOL
    w = e + rtol * cond * 2 * np.sqrt(np.sum(do * do, axis=-1)) * vmax
    if is_varlen:
        w = w.T                                        # (Tq, Hq) -> lse's (Hq, Tq)
    elif layout == "bshd":
        w = w.transpose(0, 2, 1)                       # (B, Sq, Hq) -> lse's (B, Hq, Sq)
    score_mod = opts["score_mod"]
    rfwd = reference.varlen_attention if is_varlen else reference.attention

    def allowance(name):
        def get():
            work = np.array(fingerprint.captured_arrays(score_mod)[name], dtype=np.float64)
            fn = fingerprint.with_arrays(score_mod, {name: work})
            flat, acc = work.reshape(-1), np.zeros(work.size)
            for i in range(flat.size):
                x0 = flat[i]
                h = 1e-5 * max(1.0, abs(x0))
                lse = []
                for x in (x0 + h, x0 - h):
                    flat[i] = x
                    lse.append(rfwd(q, k, v, **lengths, return_lse=True,
                                    **dict(opts, score_mod=fn))[1])
                flat[i] = x0
                live = np.isfinite(lse[0]) & np.isfinite(lse[1])
                d = np.where(live, lse[0] - np.where(live, lse[1], 0.0), 0.0) / (2 * h)
                acc[i] = np.sum(w * np.abs(d))
            return acc.reshape(work.shape)
        return get
    return allowance
