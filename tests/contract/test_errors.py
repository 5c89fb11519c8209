"""Bad inputs raise the documented exception, naming the argument; zero-size inputs are not errors.

Every check in attnext/api.py has a case here, run through the forward and the backward (they
share the argument checks) of the padded and the packed (varlen) entry points.
"""
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import attnext
from conftest import BF16, F16, F32, F64, make_qkv, make_varlen_qkv, randn

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

B, SQ, SK, HQ, HK, D, DV = 2, 5, 7, 4, 2, 8, 6
_rng = np.random.default_rng(0)
Q, K, V = make_qkv(_rng, B, SQ, SK, HQ, HK, D, DV, F32)
OUT, LSE = attnext.attention(Q, K, V, device="cpu", return_lse=True)
DOUT = randn(_rng, OUT.shape, F32)

CU_Q, CU_K = np.array([0, 3, 3, 9], np.int32), np.array([0, 4, 6, 6], np.int32)
TQ, TK = 11, 8
VQ, VK, VV = make_varlen_qkv(_rng, TQ, TK, HQ, HK, D, DV, F32)
VOUT, VLSE = attnext.varlen_attention(VQ, VK, VV, CU_Q, CU_K, device="cpu", return_lse=True)
VDOUT = randn(_rng, VOUT.shape, F32)


def forward(q=Q, k=K, v=V, **opts):
    return attnext.attention(q, k, v, **{"device": "cpu", **opts})


def backward(q=Q, k=K, v=V, dout=DOUT, out=OUT, lse=LSE, **opts):
    return attnext.attention_backward(dout, q, k, v, out, lse, **{"device": "cpu", **opts})


def varlen_forward(q=VQ, k=VK, v=VV, cu_q=CU_Q, cu_k=CU_K, **opts):
    return attnext.varlen_attention(q, k, v, cu_q, cu_k, **{"device": "cpu", **opts})


def varlen_backward(q=VQ, k=VK, v=VV, cu_q=CU_Q, cu_k=CU_K, dout=VDOUT, out=VOUT, lse=VLSE,
                    **opts):
    return attnext.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                             **{"device": "cpu", **opts})


def _big_endian(x):
    return x.astype(x.dtype.newbyteorder(">"))


# arrays the callbacks below capture: dtypes a lookup cannot read, and a 0-d array (its value)
TABLE_C64 = np.ones(HQ, np.complex64)
TABLE_OBJECT = np.ones(HQ, object)
TABLE_DATETIME = np.arange(HQ).astype("datetime64[s]")
SCALE_0D = np.array(0.5, F32)
TABLE_F32 = np.ones((HQ, 4), F32)


# (id, keyword changes, exception, regex the message must match); every case runs through both
# the forward and the backward of the padded entry point.
PADDED_CASES = [
    # q / k / v types and dtypes
    ("q_list_of_str", dict(q=["a", "b"]), TypeError, r"\bq must be a NumPy array"),
    ("q_none", dict(q=None), TypeError, r"\bq must be a NumPy array, got NoneType"),
    ("k_int", dict(k=np.ones(K.shape, np.int64)), TypeError, r"\bk has dtype int64"),
    ("v_complex", dict(v=V.astype(np.complex64)), TypeError, r"\bv has dtype complex64"),
    ("q_object", dict(q=Q.astype(object)), TypeError, r"\bq has dtype object"),
    ("q_bool", dict(q=Q > 0), TypeError, r"\bq has dtype bool"),
    ("mixed_dtypes", dict(k=K.astype(F64)), TypeError, r"q, k and v must share one dtype"),
    ("mixed_f16_bf16", dict(q=Q.astype(F16), k=K.astype(BF16), v=V.astype(F16)), TypeError,
     r"share one dtype"),
    ("q_big_endian", dict(q=_big_endian(Q)), TypeError, r"\bq has non-native byte order"),
    ("v_big_endian", dict(v=_big_endian(V)), TypeError, r"\bv has non-native byte order"),
    # shapes
    ("q_3d", dict(q=Q[0]), ValueError, r"\bq must have 4 dims"),
    ("k_5d", dict(k=K[None]), ValueError, r"\bk must have 4 dims"),
    ("bad_layout", dict(layout="sbhd"), ValueError, r"layout must be one of"),
    ("layout_thd", dict(layout="thd"), ValueError, r"layout must be one of"),
    ("k_batch", dict(k=K[:1]), ValueError, r"shapes disagree.*\bk \(1, 7, 2, 8\)"),
    ("k_head_dim", dict(k=K[..., :5]), ValueError, r"shapes disagree"),
    ("v_seq", dict(v=V[:, :4]), ValueError, r"shapes disagree.*\bv \(2, 4, 2, 6\)"),
    ("v_heads", dict(v=V[:, :, :1]), ValueError, r"shapes disagree"),
    ("bhsd_v_seq", dict(layout="bhsd", q=Q.transpose(0, 2, 1, 3), k=K.transpose(0, 2, 1, 3),
                        v=V.transpose(0, 2, 1, 3)[:, :, :6]), ValueError,
     r"shapes disagree for layout 'bhsd'"),
    ("hq_not_multiple", dict(k=K[:, :, :1].repeat(3, axis=2), v=V[:, :, :1].repeat(3, axis=2)),
     ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    ("hk_zero", dict(k=K[:, :, :0], v=V[:, :, :0]), ValueError, r"key/value heads \(0\)"),
    ("d_257", dict(q=np.ones((B, SQ, HQ, 257), F32), k=np.ones((B, SK, HK, 257), F32)),
     ValueError, r"head dim D = 257 is outside \[1, 256\]"),
    ("dv_300", dict(v=np.ones((B, SK, HK, 300), F32)), ValueError, r"head dim Dv = 300"),
    ("d_zero", dict(q=Q[..., :0], k=K[..., :0]), ValueError, r"head dim D = 0"),
    ("dv_zero", dict(v=V[..., :0]), ValueError, r"head dim Dv = 0"),
    # lengths
    ("seqlens_q_too_long", dict(seqlens_q=np.array([5, 6])), ValueError,
     r"seqlens_q \[5, 6\] exceeds Sq = 5"),
    ("seqlens_k_too_long", dict(seqlens_k=np.array([8, 1])), ValueError,
     r"seqlens_k .* exceeds Sk = 7"),
    ("seqlens_q_length", dict(seqlens_q=np.array([1, 2, 3])), ValueError,
     r"seqlens_q must have shape \(2,\)"),
    ("seqlens_k_float", dict(seqlens_k=np.array([1.0, 2.0])), TypeError,
     r"seqlens_k must hold integers"),
    ("seqlens_q_negative", dict(seqlens_q=np.array([-1, 2])), ValueError,
     r"seqlens_q must hold values in"),
    ("seqlens_q_list_of_str", dict(seqlens_q=["1", "2"]), TypeError,
     r"seqlens_q must be a NumPy array"),
    # scalar options
    ("scale_nan", dict(scale=float("nan")), ValueError, r"scale must be finite"),
    ("scale_inf", dict(scale=np.float32(np.inf)), ValueError, r"scale must be finite"),
    ("scale_str", dict(scale="0.1"), TypeError, r"scale must be a real number"),
    ("scale_bool", dict(scale=True), TypeError, r"scale must be a real number"),
    ("scale_array", dict(scale=np.array([0.1, 0.2])), TypeError, r"scale must be a real number"),
    ("softcap_zero", dict(softcap=0), ValueError, r"softcap must be positive and finite, got 0"),
    ("softcap_negative", dict(softcap=-5.0), ValueError, r"softcap must be positive"),
    ("softcap_nan", dict(softcap=float("nan")), ValueError, r"softcap must be positive and finite"),
    ("softcap_inf", dict(softcap=float("inf")), ValueError, r"softcap must be positive and finite"),
    ("softcap_str", dict(softcap="30"), TypeError, r"softcap must be a positive real number"),
    ("causal_string", dict(causal="bottom-right"), ValueError, r"causal must be False, True, "),
    ("causal_upper", dict(causal="TOP_LEFT"), ValueError, r"causal must be .*got 'TOP_LEFT'"),
    ("causal_two", dict(causal=2), ValueError, r"causal must be"),
    ("causal_list", dict(causal=[True]), ValueError, r"causal must be"),
    ("window_3_tuple", dict(window=(1, 2, 3)), ValueError, r"window must be a pair of ints"),
    ("window_int", dict(window=4), ValueError, r"window must be a pair of ints"),
    ("window_floats", dict(window=(2.0, 1.0)), ValueError, r"window must be a pair of ints"),
    ("window_bools", dict(window=(True, False)), ValueError, r"window must be a pair of ints"),
    ("window_minus_2", dict(window=(-2, 3)), ValueError, r"window sides must be >= -1"),
    ("window_right_minus_5", dict(window=(0, -5)), ValueError, r"window sides must be >= -1"),
    ("precision", dict(precision="fp8"), ValueError, r"precision must be one of"),
    ("score_mod_not_callable", dict(score_mod=3.0), TypeError, r"score_mod must be callable"),
    ("mask_mod_not_callable", dict(mask_mod="causal"), TypeError, r"mask_mod must be callable"),
    # callbacks: what they return, what they capture, builtins whose signature Python cannot read
    ("score_mod_returns_bool", dict(score_mod=lambda s, b, h, q, k: q >= k), TypeError,
     r"score_mod returned a bool value; it must return a float score"),
    ("score_mod_returns_none", dict(score_mod=lambda s, b, h, q, k: None), TypeError,
     r"score_mod must return a float expression, got NoneType"),
    ("score_mod_returns_tuple", dict(score_mod=lambda s, b, h, q, k: (s, s)), TypeError,
     r"score_mod must return a float expression, got tuple"),
    ("mask_mod_returns_float", dict(mask_mod=lambda b, h, q, k: q * 0.5), TypeError,
     r"mask_mod must return a bool expression, got a f32 expression"),
    ("mask_mod_returns_int", dict(mask_mod=lambda b, h, q, k: q - k), TypeError,
     r"mask_mod must return a bool expression, got a i64 expression"),
    ("score_mod_complex64_array", dict(score_mod=lambda s, b, h, q, k: s + TABLE_C64[h]), TypeError,
     r"^score_mod: array 'TABLE_C64' has dtype complex64; lookups need bool, integer or float"),
    ("score_mod_object_array", dict(score_mod=lambda s, b, h, q, k: s + TABLE_OBJECT[h]), TypeError,
     r"^score_mod: array 'TABLE_OBJECT' has dtype object"),
    ("score_mod_datetime64_array", dict(score_mod=lambda s, b, h, q, k: s + TABLE_DATETIME[h]),
     TypeError, r"^score_mod: array 'TABLE_DATETIME' has dtype datetime64\[s\]"),
    ("mask_mod_complex64_array", dict(mask_mod=lambda b, h, q, k: TABLE_C64[h] == 1), TypeError,
     r"^mask_mod: array 'TABLE_C64' has dtype complex64"),
    ("score_mod_indexes_0d_array", dict(score_mod=lambda s, b, h, q, k: s * SCALE_0D[()]), TypeError,
     r"^score_mod: SCALE_0D\[\(\)\] on the captured 0-d array 'SCALE_0D' is not supported: a 0-d "
     r"array is traced as its value; write SCALE_0D$"),
    ("score_mod_builtin_int", dict(score_mod=int), TypeError,
     r"^score_mod must take 5 arguments \(score, b, h, q_idx, kv_idx\); int refused them: int\(\)"),
    ("mask_mod_builtin_bool", dict(mask_mod=bool), TypeError,
     r"^mask_mod must take 4 arguments \(b, h, q_idx, kv_idx\); bool refused them"),
    ("score_mod_python_control_flow", dict(score_mod=lambda s, b, h, q, k: s if q > k else -s),
     TypeError, r"^score_mod: Python control flow on a traced value"),
    ("mask_mod_constant_index_out_of_range", dict(mask_mod=lambda b, h, q, k: TABLE_F32[h, 9] > 0),
     IndexError, r"^mask_mod: index 9 is out of bounds for axis 1 of array 'TABLE_F32' with size 4$"),
    ("score_mod_index_out_of_range_at_run_time", dict(score_mod=lambda s, b, h, q, k: s + TABLE_F32[h, q + k]),
     IndexError, r"^score_mod: index \d+ is out of bounds for axis 1 of array 'TABLE_F32' with size 4$"),
    ("mask_mod_index_out_of_range_at_run_time", dict(mask_mod=lambda b, h, q, k: TABLE_F32[h, k] > 0),
     IndexError, r"^mask_mod: index \d is out of bounds for axis 1 of array 'TABLE_F32' with size 4$"),
    ("mask_mod_python_and", dict(mask_mod=lambda b, h, q, k: q >= k and k >= 0), TypeError,
     r"^mask_mod: Python control flow on a traced value: bool\(\(q_idx >= kv_idx\)\)"),
    ("score_mod_unsupported_ufunc", dict(score_mod=lambda s, b, h, q, k: np.spacing(s)), TypeError,
     r"^score_mod: unsupported operation np.spacing on a traced value"),
    ("score_mod_math_function", dict(score_mod=lambda s, b, h, q, k: math.exp(s)), TypeError,
     r"^score_mod: float\(\) of a traced value score \(math.\* functions call it\)"),
    ("score_mod_chained_index", dict(score_mod=lambda s, b, h, q, k: s + TABLE_F32[h][k]),
     TypeError, r"^score_mod: array 'TABLE_F32' of shape \(4, 4\) indexed by 1 of its 2 axes"),
    ("score_mod_float_index", dict(score_mod=lambda s, b, h, q, k: s + TABLE_F32[h, s]), TypeError,
     r"^score_mod: array 'TABLE_F32' indexed by a f32 expression score"),
    # alibi
    ("alibi_shape", dict(alibi_slopes=np.ones(HK)), ValueError,
     r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(2,\)"),
    ("alibi_3d", dict(alibi_slopes=np.ones((1, B, HQ))), ValueError,
     r"alibi_slopes must have shape"),
    ("alibi_int", dict(alibi_slopes=np.ones(HQ, np.int32)), TypeError,
     r"alibi_slopes must be a float array"),
    ("alibi_nan", dict(alibi_slopes=np.array([0.1, np.nan, 0.2, 0.3])), ValueError,
     r"alibi_slopes must be finite"),
    ("alibi_list_of_str", dict(alibi_slopes=["a"] * HQ), TypeError,
     r"alibi_slopes must be a NumPy array"),
    # bias and mask
    ("bias_not_broadcastable", dict(bias=np.ones((SQ, SK + 1), F32)), ValueError,
     r"bias of shape \(5, 8\) does not broadcast"),
    ("bias_bad_heads", dict(bias=np.ones((3, SQ, SK), F32)), ValueError,
     r"bias of shape \(3, 5, 7\) does not broadcast.*H = 1 or 2 or 4"),
    ("bias_bad_batch", dict(bias=np.ones((3, 1, SQ, SK), F32)), ValueError,
     r"bias of shape .* does not broadcast"),
    ("bias_5d", dict(bias=np.ones((1, 1, 1, SQ, SK), F32)), ValueError,
     r"bias must have at most 4 dims"),
    ("bias_int", dict(bias=np.ones((SQ, SK), np.int32)), TypeError, r"bias has dtype int32"),
    ("bias_bool", dict(bias=np.ones((SQ, SK), bool)), TypeError, r"bias has dtype bool"),
    ("bias_big_endian", dict(bias=_big_endian(np.ones((SQ, SK), F32))), TypeError,
     r"bias has non-native byte order"),
    ("bias_none_list", dict(bias=[None]), TypeError, r"bias must be a NumPy array"),
    ("mask_not_broadcastable", dict(mask=np.ones((SK, SQ), bool)), ValueError,
     r"mask of shape \(7, 5\) does not broadcast"),
    ("mask_bad_batch", dict(mask=np.ones((B + 1, 1, 1, 1), bool)), ValueError, r"mask of shape"),
    ("mask_float", dict(mask=np.ones((SQ, SK), F32)), TypeError, r"mask must be a bool array"),
    ("mask_uint8", dict(mask=np.ones((SQ, SK), np.uint8)), TypeError, r"mask must be a bool array"),
    ("mask_5d", dict(mask=np.ones((1, 1, 1, SQ, SK), bool)), ValueError,
     r"mask must have at most 4 dims"),
    # device
    ("device_unknown", dict(device="gpu"), ValueError, r"device must be one of"),
    ("device_cpu_upper", dict(device="CPU"), ValueError, r"device must be one of"),
    ("device_cuda", dict(device="cuda"), RuntimeError, r"device='cuda'"),
    # keywords
    ("unknown_keyword", dict(casual=True), TypeError, r"unexpected keyword argument 'casual'"),
]


@pytest.mark.parametrize("entry", [forward, backward], ids=["forward", "backward"])
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in PADDED_CASES],
                         ids=[c[0] for c in PADDED_CASES])
def test_padded_bad_input(entry, changes, exc, match):
    with pytest.raises(exc, match=match):
        entry(**changes)


CALLBACK_CASES = [c for c in PADDED_CASES if {"score_mod", "mask_mod"} & set(c[1])]


@pytest.mark.parametrize("entry", [forward, backward], ids=["forward", "backward"])
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in CALLBACK_CASES],
                         ids=[c[0] for c in CALLBACK_CASES])
def test_callback_refused_on_the_reference(entry, changes, exc, match):
    """device="reference" calls the callbacks on NumPy arrays, where most of these would run
    (and some give an answer: a bool score, np.spacing, table[h][k]); it traces them first and
    refuses them as the CPU backend does, with the same message."""
    with pytest.raises(exc, match=match):
        entry(**changes, device="reference")


def test_options_are_keyword_only():
    with pytest.raises(TypeError, match=r"positional argument"):
        attnext.attention(Q, K, V, True)
    with pytest.raises(TypeError, match=r"positional argument"):
        attnext.attention_backward(DOUT, Q, K, V, OUT, LSE, True)


def test_forward_only_keywords_refused_by_backward():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'return_lse'"):
        backward(return_lse=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'deterministic'"):
        forward(deterministic=True)


# --- out= ---

OUT_CASES = [
    ("wrong_shape", np.empty((B, SQ, HQ, DV + 1), F32), ValueError,
     r"out must have shape \(2, 5, 4, 6\)"),
    ("wrong_dtype", np.empty((B, SQ, HQ, DV), F64), TypeError,
     r"out must have dtype float32, got float64"),
    ("wrong_dtype_and_shape", np.empty((B, SQ, HQ, DV + 1), F16), TypeError,
     r"out must have dtype float32, got float16"),
    ("bhsd_shape_for_bshd", np.empty((B, HQ, SQ, DV), F32), ValueError, r"out must have shape"),
    ("list", [[0.0]], TypeError, r"out must be a NumPy array"),
]


@pytest.mark.parametrize("bad, exc, match", [c[1:] for c in OUT_CASES],
                         ids=[c[0] for c in OUT_CASES])
def test_bad_out(bad, exc, match):
    with pytest.raises(exc, match=match):
        forward(out=bad)


def test_out_read_only():
    out = np.empty(OUT.shape, F32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"out is read-only"):
        forward(out=out)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_out_aliasing_an_input(which):
    """out= may not share memory with q, k or v (q and out have one shape when Dv = D, Sq = Sk)."""
    rng = np.random.default_rng(1)
    q, k, v = make_qkv(rng, 1, 6, 6, 2, 2, 4, 4, F32)
    arrays = dict(q=q, k=k, v=v)
    with pytest.raises(ValueError, match=rf"out shares memory with {which}\b"):
        attnext.attention(q, k, v, out=arrays[which], device="cpu")


def test_out_aliasing_through_a_view():
    rng = np.random.default_rng(2)
    big = randn(rng, (1, 6, 2, 8), F32)
    q = big[..., :4]
    k, v = big[..., 4:].copy(), big[..., 4:].copy()
    with pytest.raises(ValueError, match=r"out shares memory with q"):
        attnext.attention(q, k, v, out=big[..., ::2], device="cpu")


# --- the backward's own arguments ---

BACKWARD_CASES = [
    ("dout_shape", dict(dout=DOUT[:, :4]), ValueError,
     r"dout must have the forward output's shape \(2, 5, 4, 6\)"),
    ("dout_dtype", dict(dout=DOUT.astype(F64)), TypeError,
     r"dout must have the forward output's dtype float32, got float64"),
    ("dout_int", dict(dout=DOUT.astype(np.int32)), TypeError, r"dout has dtype int32"),
    ("dout_none", dict(dout=None), TypeError, r"dout must be a NumPy array"),
    ("out_shape", dict(out=OUT[..., :5]), ValueError,
     r"\bout must have the forward output's shape"),
    ("out_dtype", dict(out=OUT.astype(F16)), TypeError, r"\bout must have .* dtype float32"),
    ("out_bhsd_for_bshd", dict(out=OUT.transpose(0, 2, 1, 3)), ValueError,
     r"\bout must have the forward"),
    ("lse_shape", dict(lse=LSE[:, :, :4]), ValueError, r"lse must have shape \(2, 4, 5\)"),
    ("lse_dtype", dict(lse=LSE.astype(F64)), TypeError,
     r"lse must have dtype float32, got float64"),
    ("lse_transposed", dict(lse=LSE.transpose(0, 2, 1)), ValueError, r"lse must have shape"),
    ("lse_list", dict(lse=[1.0]), TypeError, r"lse must be a NumPy array"),
    ("deterministic_str", dict(deterministic="yes"), TypeError, r"deterministic must be a bool"),
    ("deterministic_int", dict(deterministic=1), TypeError, r"deterministic must be a bool"),
]


@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in BACKWARD_CASES],
                         ids=[c[0] for c in BACKWARD_CASES])
def test_backward_bad_input(changes, exc, match):
    with pytest.raises(exc, match=match):
        backward(**changes)


# --- varlen ---

VARLEN_CASES = [
    ("q_4d", dict(q=VQ[None]), ValueError, r"\bq must have 3 dims \(T, H, D\) for varlen"),
    ("v_2d", dict(v=VV[0]), ValueError, r"\bv must have 3 dims"),
    ("k_head_dim", dict(k=VK[..., :3]), ValueError,
     r"shapes disagree: q \(11, 4, 8\), k \(8, 2, 3\)"),
    ("v_rows", dict(v=VV[:5]), ValueError, r"shapes disagree"),
    ("hq_not_multiple", dict(k=np.ones((TK, 3, D), F32), v=np.ones((TK, 3, DV), F32)), ValueError,
     r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    ("cu_q_none", dict(cu_q=None), ValueError, r"cu_seqlens_q and cu_seqlens_k are required"),
    ("cu_q_2d", dict(cu_q=CU_Q[None]), ValueError, r"cu_seqlens_q must have shape \(B \+ 1,\)"),
    ("cu_q_empty", dict(cu_q=np.array([], np.int32)), ValueError, r"cu_seqlens_q must have shape"),
    ("cu_not_zero_start", dict(cu_q=np.array([1, 3, 3, 9])), ValueError,
     r"cu_seqlens_q must start at 0, got 1"),
    ("cu_k_not_zero_start", dict(cu_k=np.array([2, 4, 6, 6])), ValueError,
     r"cu_seqlens_k must start at 0"),
    ("cu_decreasing", dict(cu_q=np.array([0, 5, 3, 9])), ValueError,
     r"cu_seqlens_q must not decrease"),
    ("cu_k_decreasing", dict(cu_k=np.array([0, 4, 2, 6])), ValueError,
     r"cu_seqlens_k must not decrease"),
    ("cu_past_end", dict(cu_q=np.array([0, 3, 3, 12])), ValueError,
     r"cu_seqlens_q\[-1\] = 12 is past the end of the packed tensor \(11 rows\)"),
    ("cu_k_past_end", dict(cu_k=np.array([0, 4, 6, 9])), ValueError,
     r"cu_seqlens_k\[-1\] = 9 is past the end"),
    ("cu_k_wrong_length", dict(cu_k=np.array([0, 4, 6])), ValueError,
     r"cu_seqlens_k must have shape \(4,\)"),
    ("cu_float", dict(cu_q=CU_Q.astype(F32)), TypeError, r"cu_seqlens_q must hold integers"),
    ("cu_k_float", dict(cu_k=CU_K.astype(F64)), TypeError, r"cu_seqlens_k must hold integers"),
    ("cu_negative", dict(cu_q=np.array([0, -1, 3, 9])), ValueError,
     r"cu_seqlens_q must hold values in \[0, 2\*\*31\)"),
    ("cu_too_big", dict(cu_q=np.array([0, 3, 3, 2**31])), ValueError,
     r"cu_seqlens_q must hold values in"),
    ("cu_list_of_str", dict(cu_q=["0", "3"]), TypeError, r"cu_seqlens_q must be a NumPy array"),
    ("seqused_q_too_big", dict(seqused_q=np.array([3, 1, 2])), ValueError,
     r"seqused_q \[3, 1, 2\] exceeds the segment lengths \[3, 0, 6\]"),
    ("seqused_k_too_big", dict(seqused_k=np.array([4, 3, 0])), ValueError,
     r"seqused_k .* exceeds the segment lengths"),
    ("seqused_wrong_length", dict(seqused_q=np.array([1, 1])), ValueError,
     r"seqused_q must have shape \(3,\)"),
    ("seqused_float", dict(seqused_k=np.array([1.0, 1.0, 0.0])), TypeError,
     r"seqused_k must hold integers"),
    ("seqused_negative", dict(seqused_q=np.array([1, -1, 0])), ValueError,
     r"seqused_q must hold values in"),
    ("max_seqlen_q_small", dict(max_seqlen_q=5), ValueError,
     r"max_seqlen_q = 5 is smaller than the longest sequence \(6\)"),
    ("max_seqlen_k_small", dict(max_seqlen_k=3), ValueError,
     r"max_seqlen_k = 3 is smaller than the longest sequence \(4\)"),
    ("max_seqlen_float", dict(max_seqlen_q=6.0), TypeError, r"max_seqlen_q must be an int"),
    ("max_seqlen_bool", dict(max_seqlen_k=True), TypeError, r"max_seqlen_k must be an int"),
    ("bias_for_padded_shape", dict(bias=np.ones((3, 1, 7, 7), F32)), ValueError,
     r"bias of shape \(3, 1, 7, 7\) does not broadcast to \(B, H, max_seqlen_q, max_seqlen_k\) = \(3, H, 6, 4\)"),
    ("mask_int", dict(mask=np.ones((6, 4), np.int8)), TypeError, r"mask must be a bool array"),
    ("alibi_shape", dict(alibi_slopes=np.ones((2, HQ))), ValueError,
     r"alibi_slopes must have shape \(4,\) or \(3, 4\)"),
    ("layout_keyword", dict(layout="thd"), TypeError, r"unexpected keyword argument 'layout'"),
    ("seqlens_keyword", dict(seqlens_q=np.array([1, 1, 1])), TypeError,
     r"unexpected keyword argument 'seqlens_q'"),
    ("window_bad", dict(window=(-3, 0)), ValueError, r"window sides must be >= -1"),
    ("device_cuda", dict(device="cuda"), RuntimeError, r"device='cuda'"),
]


@pytest.mark.parametrize("entry", [varlen_forward, varlen_backward], ids=["forward", "backward"])
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in VARLEN_CASES],
                         ids=[c[0] for c in VARLEN_CASES])
def test_varlen_bad_input(entry, changes, exc, match):
    with pytest.raises(exc, match=match):
        entry(**changes)


VARLEN_BACKWARD_CASES = [
    ("dout_shape", dict(dout=VDOUT[:10]), ValueError,
     r"dout must have the forward output's shape \(11, 4, 6\)"),
    ("out_padded_shape", dict(out=VOUT[None]), ValueError,
     r"\bout must have the forward output's shape"),
    ("lse_shape", dict(lse=VLSE.T), ValueError, r"lse must have shape \(4, 11\)"),
    ("lse_3d", dict(lse=VLSE[None]), ValueError, r"lse must have shape \(4, 11\)"),
]


@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in VARLEN_BACKWARD_CASES],
                         ids=[c[0] for c in VARLEN_BACKWARD_CASES])
def test_varlen_backward_bad_input(changes, exc, match):
    with pytest.raises(exc, match=match):
        varlen_backward(**changes)


# --- environment variables ---

@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", " ", "100000"])
@pytest.mark.parametrize("entry", [forward, backward, varlen_forward, varlen_backward],
                         ids=["forward", "backward", "varlen_forward", "varlen_backward"])
def test_bad_num_threads(entry, value, monkeypatch):
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", value)
    message = rf"ATTNEXT_NUM_THREADS must be an integer in \[1, 1024\], got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        entry()


def test_bad_device_variable(monkeypatch):
    monkeypatch.setenv("ATTNEXT_DEVICE", "tpu")
    with pytest.raises(ValueError, match=r"device must be one of .* got 'tpu'"):
        attnext.attention(Q, K, V)
    monkeypatch.setenv("ATTNEXT_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match=r"device='cuda'"):
        attnext.attention(Q, K, V)
    # an explicit device wins over the variable
    assert attnext.attention(Q, K, V, device="cpu").shape == OUT.shape


# --- zero-size dims: empty or zero results, never errors ---

ZERO_PADDED = [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0), (2, 0, 0)]
ZERO_PADDED_IDS = ["B0", "Sq0", "Sk0", "all0", "Sq0_Sk0"]


def _zero_padded_case(dtype, b, sq, sk, layout):
    rng = np.random.default_rng(4)
    q, k, v = make_qkv(rng, b, sq, sk, HQ, HK, D, DV, dtype, layout)
    opts = dict(layout=layout, device="cpu", causal=True, bias=np.ones((1, 1, sq, sk), F32),
                mask=np.ones((sq, sk), bool))
    out_shape = (b, sq, HQ, DV) if layout == "bshd" else (b, HQ, sq, DV)
    return q, k, v, opts, out_shape


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("b, sq, sk", ZERO_PADDED, ids=ZERO_PADDED_IDS)
@pytest.mark.parametrize("dtype", [F16, F32, F64], ids=["f16", "f32", "f64"])
def test_zero_size_forward(dtype, b, sq, sk, layout):
    q, k, v, opts, out_shape = _zero_padded_case(dtype, b, sq, sk, layout)
    out = np.full(out_shape, np.nan, dtype)
    res, lse = attnext.attention(q, k, v, return_lse=True, out=out, **opts)
    assert res is out and res.shape == out_shape and lse.shape == (b, HQ, sq)
    assert (res == 0).all() and (lse == -np.inf).all()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("b, sq, sk", [c for c in ZERO_PADDED if c[0]],
                         ids=[i for c, i in zip(ZERO_PADDED, ZERO_PADDED_IDS) if c[0]])
@pytest.mark.parametrize("dtype", [F16, F32, F64], ids=["f16", "f32", "f64"])
def test_zero_size_backward(dtype, b, sq, sk, layout):
    q, k, v, opts, out_shape = _zero_padded_case(dtype, b, sq, sk, layout)
    out, lse = attnext.attention(q, k, v, return_lse=True, **opts)
    g = attnext.attention_backward(np.ones(out_shape, dtype), q, k, v, out, lse, **opts)
    assert g.dq.shape == q.shape and g.dk.shape == k.shape and g.dv.shape == v.shape
    assert g.dbias.shape == (1, 1, sq, sk)
    assert all((x == 0).all() for x in g[:4])


def test_sk_zero_gives_zero_rows():
    """No keys at all: every row is fully masked (out 0, lse -inf, dq 0)."""
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 2, 9, 0, 2, 1, 4, 3, F32)
    out, lse = attnext.attention(q, k, v, return_lse=True, device="cpu")
    assert out.shape == (2, 9, 2, 3) and (out == 0).all() and (lse == -np.inf).all()
    g = attnext.attention_backward(np.ones_like(out), q, k, v, out, lse, device="cpu")
    assert (g.dq == 0).all() and g.dk.shape == (2, 0, 1, 4)


def test_zero_query_heads():
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, 2, 5, 7, 0, 2, 4, 3, F32)
    bias = np.ones(7, F32)
    out, lse = attnext.attention(q, k, v, return_lse=True, device="cpu", bias=bias)
    assert out.shape == (2, 5, 0, 3) and lse.shape == (2, 0, 5)
    g = attnext.attention_backward(out, q, k, v, out, lse, device="cpu", bias=bias)
    assert (g.dk == 0).all() and (g.dv == 0).all() and (g.dbias == 0).all()


ZERO_VARLEN = [
    (0, 6, [0, 0], [0, 6]),            # no query rows at all
    (5, 0, [0, 5], [0, 0]),            # no key rows
    (0, 0, [0, 0, 0], [0, 0, 0]),      # empty sequences
    (0, 0, [0], [0]),                  # no sequences, nothing packed
    (4, 3, [0], [0]),                  # no sequences: every row is padding
]
ZERO_VARLEN_IDS = ["Tq0", "Tk0", "empty_seqs", "B0_T0", "B0_padding"]


@pytest.mark.parametrize("tq, tk, cu_q, cu_k", ZERO_VARLEN, ids=ZERO_VARLEN_IDS)
def test_varlen_zero_size(tq, tk, cu_q, cu_k):
    rng = np.random.default_rng(6)
    q, k, v = make_varlen_qkv(rng, tq, tk, HQ, HK, D, DV, F32)
    cu_q, cu_k = np.array(cu_q), np.array(cu_k)
    out, lse = attnext.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, device="cpu",
                                        out=np.full((tq, HQ, DV), np.nan, F32))
    assert out.shape == (tq, HQ, DV) and lse.shape == (HQ, tq)
    assert (out == 0).all() and (lse == -np.inf).all()
    g = attnext.varlen_attention_backward(np.ones_like(out), q, k, v, out, lse, cu_q, cu_k,
                                          device="cpu")
    assert g.dq.shape == q.shape and g.dk.shape == k.shape and g.dv.shape == v.shape
    assert all((x == 0).all() for x in g[:3])


ZERO_BATCH_SCRIPT = """
import numpy as np, attnext
varlen, tq, tk = {varlen}, {tq}, {tk}
if varlen:
    q, k, v = np.ones((tq, 4, 8), "f4"), np.ones((tk, 2, 8), "f4"), np.ones((tk, 2, 6), "f4")
    cu = np.array([0])
    out, lse = attnext.varlen_attention(q, k, v, cu, cu, return_lse=True, device="cpu")
    g = attnext.varlen_attention_backward(out, q, k, v, out, lse, cu, cu, device="cpu")
else:
    q, k, v = np.ones((0, 5, 4, 8), "f4"), np.ones((0, 7, 2, 8), "f4"), np.ones((0, 7, 2, 6), "f4")
    out, lse = attnext.attention(q, k, v, return_lse=True, device="cpu")
    g = attnext.attention_backward(out, q, k, v, out, lse, device="cpu")
assert g.dq.shape == q.shape and (g.dq == 0).all() and (g.dk == 0).all()
print("ok")
"""


@pytest.mark.parametrize("varlen, tq, tk", [(False, 0, 0), (True, 0, 0), (True, 4, 3)],
                         ids=["padded_B0", "varlen_B0", "varlen_B0_padding"])
def test_backward_of_zero_sequences(varlen, tq, tk):
    """In a subprocess: this once crashed (SIGFPE), which would take pytest down with it."""
    code = ZERO_BATCH_SCRIPT.format(varlen=varlen, tq=tq, tk=tk)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


# --- found in review ---

def test_out_aliasing_any_input_is_refused():
    """out= overlapping the bias, mask, slopes or lengths would change them mid-call."""
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(rng, 1, 8, 8, 2, 2, 16, 16, F32)
    out = np.zeros((1, 8, 2, 16), F32)
    bias = out.reshape(1, 2, 8, 16)[..., :8]
    with pytest.raises(ValueError, match="out shares memory with bias"):
        attnext.attention(q, k, v, bias=bias, out=out, device="cpu")
    slopes = out.reshape(-1)[:2]
    with pytest.raises(ValueError, match="out shares memory with alibi_slopes"):
        attnext.attention(q, k, v, alibi_slopes=slopes, out=out, device="cpu")


def test_out_with_a_zero_stride_is_refused():
    rng = np.random.default_rng(12)
    q, k, v = make_qkv(rng, 1, 8, 8, 2, 2, 16, 16, F32)
    out = np.lib.stride_tricks.as_strided(np.zeros(16, F32), (1, 8, 2, 16), (0, 0, 0, 4))
    with pytest.raises(ValueError, match="out has a zero stride"):
        attnext.attention(q, k, v, out=out, device="cpu")


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_complex_scale_and_softcap_are_refused(name):
    rng = np.random.default_rng(13)
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 8, 8, F32)
    with pytest.raises(TypeError, match=name):
        attnext.attention(q, k, v, device="cpu", **{name: np.complex128(1 + 1j)})


@pytest.mark.parametrize("causal", [1, 1.0, 0, "causal", b"top_left"])
def test_causal_takes_only_bools_and_the_two_names(causal):
    rng = np.random.default_rng(14)
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 8, 8, F32)
    with pytest.raises(ValueError, match="causal must be"):
        attnext.attention(q, k, v, causal=causal, device="cpu")


def test_unknown_simd_variant_is_refused_at_import():
    env = dict(os.environ, ATTNEXT_SIMD="portible")
    r = subprocess.run([sys.executable, "-c", "import attnext"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "ATTNEXT_SIMD must be portable, avx2 or avx512" in r.stderr
