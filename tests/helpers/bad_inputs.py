"""The bad-input battery's tables: one valid call of each public function (GOOD) and, per
argument, every kind of wrong value: wrong types, dtypes (int, complex, object, big-endian,
mixed), ranks and shapes, lengths and offsets, option values, out=, backward inputs from another
forward, callbacks. contract/test_errors.py runs them on the CPU (and the reference);
gpu/test_cuda_reliability.py feeds them as CUDA arrays. Each case is (function, argument, label,
value, exception) or, for several arguments at once, carries its own changes and message."""
import ml_dtypes
import numpy as np

import attnext

F16, BF16, F32, F64 = np.float16, ml_dtypes.bfloat16, np.float32, np.float64
B, SQ, SK, HQ, HK, D, DV = 2, 5, 7, 4, 2, 8, 6
TQ, TK = 11, 8
CU_Q, CU_K = np.array([0, 3, 3, 9], np.int32), np.array([0, 4, 6, 6], np.int32)
NSEQ = len(CU_Q) - 1


def randn_seeded(seed, shape, dtype=F32):
    """Standard normal data in dtype, the same for the same seed."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# one valid call of each public function; a case changes one argument of it
Q, K, V = (randn_seeded(1, (B, SQ, HQ, D)), randn_seeded(2, (B, SK, HK, D)),
           randn_seeded(3, (B, SK, HK, DV)))
OUT, LSE = attnext.attention(Q, K, V, device="cpu", return_lse=True)
DOUT = randn_seeded(4, OUT.shape)
VQ, VK, VV = (randn_seeded(5, (TQ, HQ, D)), randn_seeded(6, (TK, HK, D)),
              randn_seeded(7, (TK, HK, DV)))
VOUT, VLSE = attnext.varlen_attention(VQ, VK, VV, CU_Q, CU_K, device="cpu", return_lse=True)
VDOUT = randn_seeded(8, VOUT.shape)

GOOD = {
    "attention": dict(q=Q, k=K, v=V),
    "varlen_attention": dict(q=VQ, k=VK, v=VV, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K),
    "attention_backward": dict(dout=DOUT, q=Q, k=K, v=V, out=OUT, lse=LSE),
    "varlen_attention_backward": dict(dout=VDOUT, q=VQ, k=VK, v=VV, out=VOUT, lse=VLSE,
                                      cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K),
}
FUNCTIONS = list(GOOD)
PADDED = ["attention", "attention_backward"]
VARLEN = ["varlen_attention", "varlen_attention_backward"]
FORWARD = ["attention", "varlen_attention"]
BACKWARD = ["attention_backward", "varlen_attention_backward"]


def call(fn, **changes):
    args = {**GOOD[fn], "device": "cpu", **changes}
    return getattr(attnext, fn)(**args)


def _big_endian(x):
    return x.astype(x.dtype.newbyteorder(">"))


def _read_only(x):
    x = x.copy()
    x.flags.writeable = False
    return x


class _Unconvertible:
    """Claims the array protocol but fails converting, as a CUDA tensor asked for host data does."""

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("cannot convert")


# --- the kinds of wrong value, per kind of argument: (label, value, exception) ---

def _wrong_types(x, optional):
    cases = [("str", "abc", TypeError), ("float", 1.5, TypeError), ("bytes", b"\0" * 16, TypeError),
             ("list_of_str", ["a", "b"], TypeError), ("dict", {"a": x}, TypeError),
             ("unconvertible", _Unconvertible(), TypeError)]
    if not optional:
        cases.append(("none", None, TypeError))
    return cases


def float_tensor_cases(x, optional=False, rank_checked=True):
    """q, k, v, dout, out, lse, bias: a float array of one rank (bias: of rank <= 4)."""
    cases = _wrong_types(x, optional)
    for dt in (np.int8, np.int32, np.int64, np.uint16, np.bool_, np.complex64, np.complex128,
               object, np.longdouble, "datetime64[s]", [("re", "f4")]):
        label = np.dtype(dt).name if not isinstance(dt, list) else "structured"
        cases.append((f"dtype_{label}", np.zeros(x.shape, dt), TypeError))
    cases += [("big_endian", _big_endian(x), TypeError),
              ("big_endian_f16", _big_endian(x.astype(F16)), TypeError),
              ("masked_array", np.ma.masked_array(x, mask=np.zeros(x.shape, bool)), TypeError)]
    if rank_checked:
        cases += [("rank_minus_1", x[0], ValueError), ("rank_plus_1", x[None], ValueError),
                  ("rank_0", np.array(1.0, x.dtype), ValueError)]
    else:
        cases.append(("rank_5", x.reshape((1,) * (5 - x.ndim) + x.shape), ValueError))
    return cases


def int_array_cases(x, optional):
    """cu_seqlens, seqused, seqlens: 1-D integer arrays of a given length."""
    cases = [c for c in _wrong_types(x, optional) if c[0] != "none"]
    cases += [("list", x.tolist(), TypeError), ("tuple", tuple(x.tolist()), TypeError),
              ("int", int(x[-1]), TypeError)]
    for dt in (np.float32, np.float64, np.bool_, np.complex128, object, np.float16):
        cases.append((f"dtype_{np.dtype(dt).name}", x.astype(dt), TypeError))
    big = x.astype(np.int64)
    big[-1] = 2 ** 31
    huge = x.astype(np.uint64)
    huge[-1] = 2 ** 64 - 1
    neg = x.astype(np.int64)
    neg[len(x) // 2] = -1
    cases += [("rank_2", x[None], ValueError), ("rank_0", np.array(x[0]), ValueError),
              ("too_long", np.append(x, x[-1]), ValueError), ("too_short", x[:-1], ValueError),
              ("empty", x[:0], ValueError), ("negative", neg, ValueError),
              ("past_int32", big, ValueError), ("uint64_max", huge, ValueError)]
    return cases


def _cu_cases(x, rows):
    bad_start, bad_order, past = x.copy(), x.copy(), x.copy()
    bad_start[0] = 1
    bad_order[1], bad_order[2] = x[2] + 1, x[1]
    past[-1] = rows + 1
    return [("not_starting_at_0", bad_start, ValueError), ("decreasing", bad_order, ValueError),
            ("past_packed_length", past, ValueError), ("none", None, ValueError)]


SEQUSED_Q, SEQUSED_K = np.array([3, 0, 5]), np.array([4, 1, 0])
SEQLENS = np.array([SQ, SQ - 1])


def _not_callable():
    return [("float", 3.0, TypeError), ("str", "causal", TypeError), ("list", [abs], TypeError)]


# arrays a score_mod / mask_mod may capture but not look up (lookups read bool, int or float)
TABLE_C64, TABLE_OBJECT = np.ones(HQ, np.complex64), np.ones(HQ, object)
TABLE_DATETIME = np.arange(HQ).astype("datetime64[s]")
SCALAR_0D = np.array(0.5, F32)


SCALAR_CASES = {
    "scale": [("nan", float("nan"), ValueError), ("inf", float("inf"), ValueError),
              ("minus_inf", -np.inf, ValueError), ("f16_nan", np.float16("nan"), ValueError),
              ("huge_int", 10 ** 400, ValueError), ("str", "0.1", TypeError),
              ("bool", True, TypeError), ("complex", 1j, TypeError),
              ("array", np.array([0.1, 0.2]), TypeError), ("list", [0.1], TypeError)],
    "softcap": [("zero", 0, ValueError), ("zero_float", 0.0, ValueError),
                ("negative", -30.0, ValueError), ("nan", float("nan"), ValueError),
                ("inf", np.inf, ValueError), ("huge_int", 10 ** 400, ValueError),
                ("str", "30", TypeError), ("bool", True, TypeError),
                ("complex", np.complex64(30), TypeError)],
    "window": [("int", 4, ValueError), ("triple", (1, 2, 3), ValueError),
               ("single", (1,), ValueError), ("floats", (2.0, 1.0), ValueError),
               ("bools", (True, False), ValueError), ("none_side", (None, 2), ValueError),
               ("str", "(1, 2)", ValueError), ("minus_2", (-2, 0), ValueError),
               ("right_minus_5", (0, -5), ValueError), ("array", np.array([1, 2]), ValueError)],
    "causal": [("misspelt", "bottom-right", ValueError), ("upper", "TOP_LEFT", ValueError),
               ("int", 1, ValueError), ("float", 1.0, ValueError), ("bytes", b"top_left", ValueError),
               ("list", [True], ValueError)],
    "device": [("gpu", "gpu", ValueError), ("upper", "CPU", ValueError), ("int", 0, ValueError),
               ("list", ["cpu"], ValueError)],
    "precision": [("fp8", "fp8", ValueError), ("upper", "TF32", ValueError), ("int", 1, ValueError)],
    "alibi_slopes": [("kv_heads", np.ones(HK, F32), ValueError),
                     ("rank_3", np.ones((1, 1, HQ), F32), ValueError),
                     ("int", np.ones(HQ, np.int32), TypeError),
                     ("complex", np.ones(HQ, np.complex64), TypeError),
                     ("big_endian", np.ones(HQ, ">f4"), TypeError),
                     ("nan", np.array([0.1, np.nan, 0.2, 0.3]), ValueError),
                     ("inf", np.full(HQ, np.inf), ValueError),
                     ("scalar", 0.5, TypeError), ("list_of_str", ["a"] * HQ, TypeError),
                     ("masked", np.ma.masked_array(np.ones(HQ)), TypeError)],
    "mask": [("float", np.ones((SQ, SK), F32), TypeError), ("int8", np.ones((SQ, SK), np.int8), TypeError),
             ("uint8", np.ones((SQ, SK), np.uint8), TypeError), ("object", np.ones((SQ, SK), object), TypeError),
             ("list", [[True] * SK] * SQ, TypeError), ("rank_5", np.ones((1, 1, 1, SQ, SK), bool), ValueError),
             ("not_broadcastable", np.ones((SK, SQ), bool), ValueError),
             ("bad_heads", np.ones((3, SQ, SK), bool), ValueError)],
    "bias": float_tensor_cases(np.ones((SQ, SK), F32), optional=True, rank_checked=False) + [
             ("not_broadcastable", np.ones((SQ, SK + 1), F32), ValueError),
             ("bad_heads", np.ones((3, SQ, SK), F32), ValueError),
             ("bad_batch", np.ones((B + 1, 1, SQ, SK), F32), ValueError)],
    "score_mod": _not_callable() + [
        ("arity_3", lambda s, b, h: s, TypeError), ("arity_4", lambda s, b, h, q: s, TypeError),
        ("arity_6", lambda s, b, h, q, kv, x: s, TypeError), ("ufunc_2", np.add, TypeError),
        ("ufunc_1", np.tanh, TypeError), ("keyword_only", lambda *, s, b, h, q, kv: s, TypeError),
        ("builtin_int", int, TypeError), ("builtin_float", float, TypeError),
        ("returns_bool", lambda s, b, h, q, kv: q >= kv, TypeError),
        ("returns_none", lambda s, b, h, q, kv: None, TypeError),
        ("returns_tuple", lambda s, b, h, q, kv: (s, s), TypeError),
        ("returns_str", lambda s, b, h, q, kv: "s", TypeError),
        ("captures_complex64", lambda s, b, h, q, kv: s + TABLE_C64[h], TypeError),
        ("captures_object", lambda s, b, h, q, kv: s + TABLE_OBJECT[h], TypeError),
        ("captures_datetime64", lambda s, b, h, q, kv: s + TABLE_DATETIME[h], TypeError),
        ("indexes_0d_array", lambda s, b, h, q, kv: s * SCALAR_0D[()], TypeError)],
    "mask_mod": _not_callable() + [
        ("arity_5", lambda s, b, h, q, kv: True, TypeError),
        ("arity_3", lambda b, h, q: True, TypeError), ("ufunc_2", np.less, TypeError),
        ("builtin_int", int, TypeError), ("builtin_bool", bool, TypeError),
        ("returns_float", lambda b, h, q, kv: q * 0.5, TypeError),
        ("returns_int", lambda b, h, q, kv: q - kv, TypeError),
        ("returns_int_constant", lambda b, h, q, kv: 1, TypeError),
        ("returns_none", lambda b, h, q, kv: None, TypeError),
        ("returns_array", lambda b, h, q, kv: np.ones(3, bool), TypeError),
        ("captures_complex64", lambda b, h, q, kv: TABLE_C64[h] == 1, TypeError),
        ("captures_datetime64", lambda b, h, q, kv: TABLE_DATETIME[h] == TABLE_DATETIME[0], TypeError),
        ("indexes_0d_array", lambda b, h, q, kv: q * SCALAR_0D[()] > 1, TypeError)],
}
# the varlen functions read bias and mask at (B, H, max_seqlen_q, max_seqlen_k) = (3, H, 6, 4)
VARLEN_SCALAR_CASES = dict(SCALAR_CASES)
VARLEN_SCALAR_CASES["alibi_slopes"] = [c for c in SCALAR_CASES["alibi_slopes"]] + [
    ("padded_batch", np.ones((B, HQ), F32), ValueError)]
VARLEN_SCALAR_CASES["mask"] = [c for c in SCALAR_CASES["mask"] if c[0] != "bad_heads"] + [
    ("padded_shape", np.ones((SQ, SK), bool), ValueError)]
VARLEN_SCALAR_CASES["bias"] = [c for c in SCALAR_CASES["bias"] if c[0] not in ("bad_heads", "bad_batch")] + [
    ("padded_shape", np.ones((B, 1, SQ, SK), F32), ValueError)]


def _build_cases():
    cases = []   # (function, argument, label, value, exception)

    def add(fns, arg, entries):
        for fn in fns:
            for label, value, exc in entries:
                cases.append((fn, arg, label, value, exc))

    for fn in FUNCTIONS:
        for arg, x in GOOD[fn].items():
            if arg.startswith("cu_seqlens"):
                rows = TQ if arg.endswith("q") else TK
                add([fn], arg, int_array_cases(x, optional=False) + _cu_cases(x, rows))
            else:
                add([fn], arg, float_tensor_cases(x))
        table = VARLEN_SCALAR_CASES if fn in VARLEN else SCALAR_CASES
        for arg, entries in table.items():
            add([fn], arg, entries)
    # lengths
    add(PADDED, "seqlens_q", int_array_cases(SEQLENS, optional=True)
        + [("past_sq", np.array([SQ + 1, 1]), ValueError)])
    add(PADDED, "seqlens_k", int_array_cases(SEQLENS, optional=True)
        + [("past_sk", np.array([1, SK + 1]), ValueError)])
    add(VARLEN, "seqused_q", int_array_cases(SEQUSED_Q, optional=True)
        + [("past_segment", np.array([3, 1, 5]), ValueError)])
    add(VARLEN, "seqused_k", int_array_cases(SEQUSED_K, optional=True)
        + [("past_segment", np.array([4, 3, 0]), ValueError)])
    for arg, longest in (("max_seqlen_q", 6), ("max_seqlen_k", 4)):
        add(VARLEN, arg, [("float", float(longest), TypeError), ("bool", True, TypeError),
                          ("str", str(longest), TypeError), ("array", np.array([longest]), TypeError),
                          ("negative", -1, ValueError), ("too_small", longest - 1, ValueError),
                          ("past_int32", 2 ** 31, ValueError), ("huge", 2 ** 62, ValueError)])
    # layout (padded only) and the flags
    add(PADDED, "layout", [("thd", "thd", ValueError), ("sbhd", "sbhd", ValueError),
                           ("upper", "BSHD", ValueError), ("none", None, ValueError),
                           ("list", ["bshd"], ValueError)])
    add(FORWARD, "return_lse", [("str", "yes", TypeError), ("int", 1, TypeError),
                                ("none", None, TypeError), ("array", np.array([1, 0]), TypeError)])
    add(BACKWARD, "deterministic", [("str", "yes", TypeError), ("int", 1, TypeError),
                                    ("none", None, TypeError)])
    return cases


BAD_INPUTS = _build_cases()


def case_id(case):
    fn, arg, label = case[:3]
    return f"{fn}-{arg}-{label}"


# --- mixed dtypes, disagreeing shapes, unknown keywords: several arguments at once ---

def _mixed_cases():
    cases = []
    for fn in FUNCTIONS:
        g = GOOD[fn]
        for dt in (F64, F16, BF16):
            cases.append((fn, f"k_{np.dtype(dt).name}", dict(k=g["k"].astype(dt)), TypeError, "q, k and v"))
        cases.append((fn, "v_f64_q_f16", dict(q=g["q"].astype(F16), v=g["v"].astype(F64)), TypeError, "q, k and v"))
        cases.append((fn, "k_fewer_rows_than_v", dict(k=g["k"][:-1] if fn in VARLEN else g["k"][:, :-1]),
                      ValueError, "shapes disagree"))
        cases.append((fn, "k_other_head_dim", dict(k=g["k"][..., :-1]), ValueError, "shapes disagree"))
        cases.append((fn, "v_other_heads", dict(v=g["v"][..., :1, :]), ValueError, "shapes disagree"))
        cases.append((fn, "hq_not_multiple_of_hk",
                      dict(k=np.ones(g["k"].shape[:-2] + (3, D), F32), v=np.ones(g["v"].shape[:-2] + (3, DV), F32)),
                      ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)"))
        cases.append((fn, "head_dim_257",
                      dict(q=np.ones(g["q"].shape[:-1] + (257,), F32), k=np.ones(g["k"].shape[:-1] + (257,), F32)),
                      ValueError, r"head dim D = 257"))
        for kw in ("casual", "dropout_p", "seqlen_q", "is_causal", "attn_mask"):
            cases.append((fn, f"unknown_keyword_{kw}", {kw: True}, TypeError, rf"unexpected keyword argument '{kw}'"))
    for fn in BACKWARD:
        cases += [(fn, "return_lse_keyword", dict(return_lse=True), TypeError, "return_lse"),
                  (fn, "out_of_place_keyword", dict(out_=None), TypeError, "out_")]
    for fn in FORWARD:
        cases.append((fn, "deterministic_keyword", dict(deterministic=True), TypeError, "deterministic"))
    for fn in VARLEN:
        cases += [(fn, "layout_keyword", dict(layout="thd"), TypeError, "layout"),
                  (fn, "seqlens_keyword", dict(seqlens_q=np.array([1, 1, 1])), TypeError, "seqlens_q")]
    return cases


BAD_COMBINATIONS = _mixed_cases()


# --- out= ---

def _out_cases():
    cases = []
    for fn, shape in (("attention", OUT.shape), ("varlen_attention", VOUT.shape)):
        g = GOOD[fn]
        good = np.zeros(shape, F32)
        zero_stride = np.lib.stride_tricks.as_strided(np.zeros(shape[-1], F32), shape,
                                                      (0,) * (len(shape) - 1) + (4,))
        cases += [
            (fn, "wider", np.empty(shape[:-1] + (shape[-1] + 1,), F32), ValueError),
            (fn, "rank_plus_1", good[None], ValueError),
            (fn, "transposed", np.empty(shape[::-1], F32), ValueError),
            (fn, "f64", good.astype(F64), TypeError), (fn, "f16", good.astype(F16), TypeError),
            (fn, "int32", good.astype(np.int32), TypeError),
            (fn, "big_endian", _big_endian(good), TypeError),
            (fn, "list", good.tolist(), TypeError), (fn, "str", "out", TypeError),
            (fn, "read_only", _read_only(good), ValueError),
            (fn, "zero_stride", zero_stride, ValueError),
        ]
        # aliasing an input: out and the input are views of one buffer
        for name in ("q", "k", "v"):
            buf = np.zeros(max(good.size, g[name].size), F32)
            x = buf[:g[name].size].reshape(g[name].shape)
            x[...] = g[name]
            cases.append((fn, f"aliases_{name}", (name, x, buf[:good.size].reshape(shape)), ValueError))
        bias = np.zeros(good.size, F32)
        cols = SK if fn == "attention" else 4      # varlen: max_seqlen_k
        cases.append((fn, "aliases_bias", ("bias", bias[:cols], bias.reshape(shape)), ValueError))
        # aliasing an array a callback captures: heads written early would change what later
        # heads read (a closure's float table, a mask_mod's int view, a default argument)
        for label, (name, make) in _CAPTURING.items():
            buf = np.zeros(good.size, F32)
            cases.append((fn, f"aliases_{label}", (name, make(buf), buf.reshape(shape)), ValueError))
    return cases


def _closure_table(buf):
    table = buf[:HQ]
    return lambda s, b, h, qi, ki: s + table[h]


def _mask_view(buf):
    ints = buf[8:8 + HQ].view(np.int32)
    return lambda b, h, qi, ki: ints[h] == 0


def _default_table(buf):
    def score_mod(s, b, h, qi, ki, slopes=buf[-HQ:]):
        return s - slopes[h] * (qi - ki)
    return score_mod


_CAPTURING = {"score_mod_closure": ("score_mod", _closure_table),
              "mask_mod_int_view": ("mask_mod", _mask_view),
              "score_mod_default": ("score_mod", _default_table)}


BAD_OUTS = _out_cases()


# --- backward inputs that do not match the forward ---

def _mismatch_cases():
    lse_f64, out_bhsd = LSE.astype(F64), OUT.transpose(0, 2, 1, 3)
    other_out, other_lse = attnext.attention(Q[:, :4], K, V, device="cpu", return_lse=True)
    cases = [
        ("attention_backward", "dout", other_out, ValueError),
        ("attention_backward", "out", other_out, ValueError),
        ("attention_backward", "lse", other_lse, ValueError),
        ("attention_backward", "lse", lse_f64, TypeError),
        ("attention_backward", "lse", LSE.transpose(0, 2, 1), ValueError),
        ("attention_backward", "lse", LSE[..., None], ValueError),
        ("attention_backward", "lse", VLSE, ValueError),
        ("attention_backward", "out", out_bhsd, ValueError),
        ("attention_backward", "dout", DOUT.astype(F64), TypeError),
        ("attention_backward", "out", OUT[..., :-1], ValueError),
        ("varlen_attention_backward", "lse", LSE, ValueError),
        ("varlen_attention_backward", "lse", VLSE.T, ValueError),
        ("varlen_attention_backward", "lse", VLSE[:, :-1], ValueError),
        ("varlen_attention_backward", "out", VOUT[:-1], ValueError),
        ("varlen_attention_backward", "dout", VDOUT[None], ValueError),
        ("varlen_attention_backward", "dout", VDOUT.astype(F16), TypeError),
    ]
    return cases


BAD_MISMATCHES = _mismatch_cases()


# --- NaN and Inf in the data: (argument, index) ---

NONFINITE = [("q", (0, 2, 1, 3)), ("k", (1, 3, 0, 0)), ("v", (0, 4, 1, 5)), ("bias", (0, 1, 2, 3))]
