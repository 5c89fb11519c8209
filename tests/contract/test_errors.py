"""Bad inputs raise the documented exception (docs/design.md, Errors), naming the argument;
zero-size inputs are not errors; inputs are never modified; NaN and Inf in the data propagate.

The battery (helpers/bad_inputs.py's tables) meets each argument of each public function with
every kind of wrong value: wrong types, dtypes (int, complex, object, big-endian, mixed), ranks and
shapes, lengths and offsets, option values, out=, backward inputs from another forward, callbacks,
and sizes past the machine's memory (stride-0 views, so the test allocates nothing big). Each case
asserts the exception and that the message names the argument; where the message is documented
word for word (the *_MESSAGES tables below), the case asserts that message too. The hand-picked
cases (PADDED_CASES, ...) are refusals the battery has no case for, each with its exact message,
run through the forward and the backward (they share the argument checks) of the padded and the
packed (varlen) entry points. Then: environment variables, zero-size dimensions (empty results),
inputs never modified, and NaN / Inf in the data and in the backward's own inputs.

Every refusal case is a test named test_bad_input* (`-k bad_input` selects them); the other tests
(zero sizes, inputs unmodified, NaN / Inf) check results, not refusals. The count of refusal cases:
    python -m pytest tests/contract/test_errors.py --collect-only -q | grep -c '::test_bad_input'
"""
import math
import os
import re
import subprocess
import sys
import warnings
import zlib

import numpy as np
import pytest

import attnext
from attnext import reference
from conftest import make_qkv, make_varlen_qkv, randn

from helpers.bad_inputs import (BAD_COMBINATIONS, BAD_INPUTS, BAD_MISMATCHES, BAD_OUTS, B, BF16,
                                CU_K, CU_Q, D, DV, F16, F32, F64, FUNCTIONS, GOOD, HK, HQ, K,
                                NONFINITE, OUT, Q, SEQLENS, SEQUSED_K, SEQUSED_Q, SK, SQ, V, VDOUT,
                                VK, VQ, VV, call, case_id, randn_seeded)

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


# --- the battery's documented messages ---------------------------------------------------------
# (argument, label) of a BAD_INPUTS case -> the message's regex, for every function that takes the
# argument; PADDED_MESSAGES / VARLEN_MESSAGES where attention() and varlen_attention() word it apart

MESSAGES = {
    ("q", "list_of_str"): r"\bq must be a NumPy array",
    ("q", "none"): r"\bq must be a NumPy array, got NoneType",
    ("q", "dtype_object"): r"\bq has dtype object",
    ("q", "dtype_bool"): r"\bq has dtype bool",
    ("q", "big_endian"): r"\bq has non-native byte order",
    ("k", "dtype_int64"): r"\bk has dtype int64",
    ("v", "dtype_complex64"): r"\bv has dtype complex64",
    ("v", "big_endian"): r"\bv has non-native byte order",
    ("dout", "dtype_int32"): r"dout has dtype int32",
    ("dout", "none"): r"dout must be a NumPy array",
    ("out", "rank_plus_1"): r"\bout must have the forward output's shape",
    ("layout", "sbhd"): r"layout must be one of",
    ("layout", "thd"): r"layout must be one of",
    ("seqlens_q", "past_sq"): r"seqlens_q \[6, 1\] exceeds Sq = 5",
    ("seqlens_k", "past_sk"): r"seqlens_k .* exceeds Sk = 7",
    ("seqlens_q", "too_long"): r"seqlens_q must have shape \(2,\)",
    ("seqlens_k", "dtype_float64"): r"seqlens_k must hold integers",
    ("seqlens_q", "negative"): r"seqlens_q must hold values in",
    ("seqlens_q", "list_of_str"): r"seqlens_q must be a NumPy array",
    ("cu_seqlens_q", "none"): r"cu_seqlens_q and cu_seqlens_k are required",
    ("cu_seqlens_q", "rank_2"): r"cu_seqlens_q must have shape \(B \+ 1,\)",
    ("cu_seqlens_q", "empty"): r"cu_seqlens_q must have shape",
    ("cu_seqlens_q", "not_starting_at_0"): r"cu_seqlens_q must start at 0, got 1",
    ("cu_seqlens_k", "not_starting_at_0"): r"cu_seqlens_k must start at 0",
    ("cu_seqlens_q", "decreasing"): r"cu_seqlens_q must not decrease",
    ("cu_seqlens_k", "decreasing"): r"cu_seqlens_k must not decrease",
    ("cu_seqlens_q", "past_packed_length"):
        r"cu_seqlens_q\[-1\] = 12 is past the end of the packed tensor \(11 rows\)",
    ("cu_seqlens_k", "past_packed_length"): r"cu_seqlens_k\[-1\] = 9 is past the end",
    ("cu_seqlens_k", "too_short"): r"cu_seqlens_k must have shape \(4,\)",
    ("cu_seqlens_q", "dtype_float32"): r"cu_seqlens_q must hold integers",
    ("cu_seqlens_k", "dtype_float64"): r"cu_seqlens_k must hold integers",
    ("cu_seqlens_q", "negative"): r"cu_seqlens_q must hold values in \[0, 2\*\*31\)",
    ("cu_seqlens_q", "past_int32"): r"cu_seqlens_q must hold values in",
    ("cu_seqlens_q", "list_of_str"): r"cu_seqlens_q must be a NumPy array",
    ("seqused_q", "past_segment"): r"seqused_q \[3, 1, 5\] exceeds the segment lengths \[3, 0, 6\]",
    ("seqused_k", "past_segment"): r"seqused_k .* exceeds the segment lengths",
    ("seqused_q", "too_short"): r"seqused_q must have shape \(3,\)",
    ("seqused_k", "dtype_float64"): r"seqused_k must hold integers",
    ("seqused_q", "negative"): r"seqused_q must hold values in",
    ("max_seqlen_q", "too_small"): r"max_seqlen_q = 5 is smaller than the longest sequence \(6\)",
    ("max_seqlen_k", "too_small"): r"max_seqlen_k = 3 is smaller than the longest sequence \(4\)",
    ("max_seqlen_q", "float"): r"max_seqlen_q must be an int",
    ("max_seqlen_k", "bool"): r"max_seqlen_k must be an int",
    ("scale", "nan"): r"scale must be finite",
    ("scale", "inf"): r"scale must be finite",
    ("scale", "str"): r"scale must be a real number",
    ("scale", "bool"): r"scale must be a real number",
    ("scale", "array"): r"scale must be a real number",
    ("softcap", "zero"): r"softcap must be positive and finite, got 0",
    ("softcap", "negative"): r"softcap must be positive",
    ("softcap", "nan"): r"softcap must be positive and finite",
    ("softcap", "inf"): r"softcap must be positive and finite",
    ("softcap", "str"): r"softcap must be a positive real number",
    ("causal", "misspelt"): r"causal must be False, True, ",
    ("causal", "upper"): r"causal must be .*got 'TOP_LEFT'",
    ("causal", "int"): r"causal must be",
    ("causal", "float"): r"causal must be",
    ("causal", "bytes"): r"causal must be",
    ("causal", "list"): r"causal must be",
    ("window", "triple"): r"window must be a pair of ints",
    ("window", "int"): r"window must be a pair of ints",
    ("window", "floats"): r"window must be a pair of ints",
    ("window", "bools"): r"window must be a pair of ints",
    ("window", "minus_2"): r"window sides must be >= -1",
    ("window", "right_minus_5"): r"window sides must be >= -1",
    ("precision", "fp8"): r"precision must be one of",
    ("device", "gpu"): r"device must be one of",
    ("device", "upper"): r"device must be one of",
    ("deterministic", "str"): r"deterministic must be a bool",
    ("deterministic", "int"): r"deterministic must be a bool",
    ("alibi_slopes", "rank_3"): r"alibi_slopes must have shape",
    ("alibi_slopes", "int"): r"alibi_slopes must be a float array",
    ("alibi_slopes", "nan"): r"alibi_slopes must be finite",
    ("alibi_slopes", "list_of_str"): r"alibi_slopes must be a NumPy array",
    ("bias", "not_broadcastable"): r"bias of shape \(5, 8\) does not broadcast",
    ("bias", "bad_heads"): r"bias of shape \(3, 5, 7\) does not broadcast.*H = 1 or 2 or 4",
    ("bias", "bad_batch"): r"bias of shape .* does not broadcast",
    ("bias", "rank_5"): r"bias must have at most 4 dims",
    ("bias", "dtype_int32"): r"bias has dtype int32",
    ("bias", "dtype_bool"): r"bias has dtype bool",
    ("bias", "big_endian"): r"bias has non-native byte order",
    ("bias", "list_of_str"): r"bias must be a NumPy array",
    ("mask", "not_broadcastable"): r"mask of shape \(7, 5\) does not broadcast",
    ("mask", "float"): r"mask must be a bool array",
    ("mask", "uint8"): r"mask must be a bool array",
    ("mask", "int8"): r"mask must be a bool array",
    ("mask", "rank_5"): r"mask must have at most 4 dims",
    ("score_mod", "float"): r"score_mod must be callable",
    ("mask_mod", "str"): r"mask_mod must be callable",
    ("score_mod", "returns_bool"): r"score_mod returned a bool value; it must return a float score",
    ("score_mod", "returns_none"): r"score_mod must return a float expression, got NoneType",
    ("score_mod", "returns_tuple"): r"score_mod must return a float expression, got tuple",
    ("mask_mod", "returns_float"): r"mask_mod must return a bool expression, got a f32 expression",
    ("mask_mod", "returns_int"): r"mask_mod must return a bool expression, got a i64 expression",
    ("score_mod", "captures_complex64"):
        r"^score_mod: array 'TABLE_C64' has dtype complex64; lookups need bool, integer or float",
    ("score_mod", "captures_object"): r"^score_mod: array 'TABLE_OBJECT' has dtype object",
    ("score_mod", "captures_datetime64"):
        r"^score_mod: array 'TABLE_DATETIME' has dtype datetime64\[s\]",
    ("mask_mod", "captures_complex64"): r"^mask_mod: array 'TABLE_C64' has dtype complex64",
    ("score_mod", "indexes_0d_array"):
        r"^score_mod: SCALAR_0D\[\(\)\] on the captured 0-d array 'SCALAR_0D' is not supported: a "
        r"0-d array is traced as its value; write SCALAR_0D$",
    ("score_mod", "builtin_int"):
        r"^score_mod must take 5 arguments \(score, b, h, q_idx, kv_idx\); int refused them: "
        r"int\(\)",
    ("mask_mod", "builtin_bool"):
        r"^mask_mod must take 4 arguments \(b, h, q_idx, kv_idx\); bool refused them",
}
PADDED_MESSAGES = {
    ("q", "rank_minus_1"): r"\bq must have 4 dims",
    ("k", "rank_plus_1"): r"\bk must have 4 dims",
    ("alibi_slopes", "kv_heads"): r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(2,\)",
}
VARLEN_MESSAGES = {
    ("q", "rank_plus_1"): r"\bq must have 3 dims \(T, H, D\) for varlen",
    ("v", "rank_minus_1"): r"\bv must have 3 dims",
    ("lse", "rank_plus_1"): r"lse must have shape \(4, 11\)",
    ("alibi_slopes", "padded_batch"): r"alibi_slopes must have shape \(4,\) or \(3, 4\)",
    ("bias", "padded_shape"): r"bias of shape \(2, 1, 5, 7\) does not broadcast to \(B, H, "
                              r"max_seqlen_q, max_seqlen_k\) = \(3, H, 6, 4\)",
}
# BAD_COMBINATIONS' label -> the message beyond the table's own match (VARLEN_: packed calls only)
COMBINATION_MESSAGES = {
    "k_float64": r"q, k and v must share one dtype",
    "head_dim_257": r"head dim D = 257 is outside \[1, 256\]",
    "return_lse_keyword": r"unexpected keyword argument 'return_lse'",
    "deterministic_keyword": r"unexpected keyword argument 'deterministic'",
    "layout_keyword": r"unexpected keyword argument 'layout'",
    "seqlens_keyword": r"unexpected keyword argument 'seqlens_q'",
}
VARLEN_COMBINATION_MESSAGES = {
    "k_other_head_dim": r"shapes disagree: q \(11, 4, 8\), k \(8, 2, 7\)",
}
# BAD_OUTS' (function, label) -> the message
OUT_MESSAGES = {
    ("attention", "wider"): r"out must have shape \(2, 5, 4, 6\)",
    ("attention", "f64"): r"out must have dtype float32, got float64",
    ("attention", "list"): r"out must be a NumPy array",
    ("attention", "read_only"): r"out is read-only",
    ("attention", "zero_stride"): r"out has a zero stride",
    ("attention", "aliases_q"): r"out shares memory with q\b",
    ("attention", "aliases_k"): r"out shares memory with k\b",
    ("attention", "aliases_v"): r"out shares memory with v\b",
    ("attention", "aliases_bias"): r"out shares memory with bias",
}
# BAD_MISMATCHES' test id -> the message
MISMATCH_MESSAGES = {
    "attention_backward-dout-0": r"dout must have the forward output's shape \(2, 5, 4, 6\)",
    "attention_backward-lse-2": r"lse must have shape \(2, 4, 5\)",
    "attention_backward-lse-3": r"lse must have dtype float32, got float64",
    "attention_backward-lse-4": r"lse must have shape",
    "attention_backward-out-7": r"\bout must have the forward",
    "attention_backward-dout-8": r"dout must have the forward output's dtype float32, got float64",
    "attention_backward-out-9": r"\bout must have the forward output's shape",
    "varlen_attention_backward-lse-11": r"lse must have shape \(4, 11\)",
}


def _message(fn, arg, label):
    """The documented message of the battery's case, or None."""
    apart = VARLEN_MESSAGES if fn.startswith("varlen") else PADDED_MESSAGES
    return apart.get((arg, label), MESSAGES.get((arg, label)))


def test_every_documented_message_has_its_case():
    """A key that names no case would check nothing: each one names a case of its table."""
    def varlen(fn):
        return fn.startswith("varlen")

    cases = {(fn, arg, label) for fn, arg, label, _, _ in BAD_INPUTS}
    assert set(MESSAGES) <= {(arg, label) for _, arg, label in cases}
    assert set(PADDED_MESSAGES) <= {(arg, label) for fn, arg, label in cases if not varlen(fn)}
    assert set(VARLEN_MESSAGES) <= {(arg, label) for fn, arg, label in cases if varlen(fn)}
    assert set(COMBINATION_MESSAGES) <= {c[1] for c in BAD_COMBINATIONS}
    assert set(VARLEN_COMBINATION_MESSAGES) <= {c[1] for c in BAD_COMBINATIONS if varlen(c[0])}
    assert set(OUT_MESSAGES) <= {(c[0], c[1]) for c in BAD_OUTS}
    assert set(MISMATCH_MESSAGES) <= {f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(BAD_MISMATCHES)}


# --- the battery: every function x every argument x every kind of wrong value ------------------

@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case_id(c) for c in BAD_INPUTS])
def test_bad_input(case):
    fn, arg, label, value, exc = case
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(exc) as info:
            call(fn, **{arg: value})
    message = str(info.value)
    assert re.search(rf"\b{re.escape(arg)}\b", message), f"{exc.__name__} does not name {arg}: {message}"
    documented = _message(fn, arg, label)
    assert documented is None or re.search(documented, message), (documented, message)


# --- callbacks on the reference: refused as on the CPU, with the same message ---

CALLBACK_CASES = [c for c in BAD_INPUTS if c[1] in ("score_mod", "mask_mod")]


@pytest.mark.parametrize("case", CALLBACK_CASES, ids=[case_id(c) for c in CALLBACK_CASES])
def test_bad_input_callback_on_the_reference(case):
    """device="reference" calls score_mod / mask_mod itself on NumPy arrays, where a bool
    score, a float mask or a None would pass unnoticed; it traces them first, so each callback
    the CPU backend refuses is refused there with the same exception and message."""
    fn, arg, label, value, exc = case
    with pytest.raises(exc) as on_cpu:
        call(fn, **{arg: value})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(exc) as on_reference:
            call(fn, device="reference", **{arg: value})
    assert type(on_reference.value) is type(on_cpu.value)
    assert str(on_reference.value) == str(on_cpu.value)


# --- mixed dtypes, disagreeing shapes, unknown keywords: several arguments at once ---

@pytest.mark.parametrize("fn, label, changes, exc, match", BAD_COMBINATIONS,
                         ids=[f"{c[0]}-{c[1]}" for c in BAD_COMBINATIONS])
def test_bad_input_combination(fn, label, changes, exc, match):
    with pytest.raises(exc, match=match) as info:
        call(fn, **changes)
    documented = (VARLEN_COMBINATION_MESSAGES.get(label) if fn.startswith("varlen") else None) \
        or COMBINATION_MESSAGES.get(label)
    assert documented is None or re.search(documented, str(info.value)), (documented, info.value)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_bad_input_extra_positional(fn):
    with pytest.raises(TypeError, match="positional argument"):
        getattr(attnext, fn)(*GOOD[fn].values(), True)


def test_bad_input_info_takes_nothing():
    with pytest.raises(TypeError):
        attnext.info(1)
    with pytest.raises(TypeError):
        attnext.info(device="cpu")


@pytest.mark.parametrize("args, kw", [((1,), {}), (("cpu",), {}), ((), {"backend": "cpu"})],
                         ids=["int", "str", "keyword"])
def test_bad_input_cache_info_takes_nothing(args, kw):
    with pytest.raises(TypeError, match=r"cache_info\(\)"):
        attnext.cache_info(*args, **kw)


# --- out= ---

@pytest.mark.parametrize("fn, label, value, exc", BAD_OUTS, ids=[f"{c[0]}-{c[1]}" for c in BAD_OUTS])
def test_bad_input_out(fn, label, value, exc):
    changes = {}
    if isinstance(value, tuple):
        name, shared, value = value
        changes[name] = shared
    with pytest.raises(exc, match=r"\bout\b") as info:
        call(fn, out=value, **changes)
    documented = OUT_MESSAGES.get((fn, label))
    assert documented is None or re.search(documented, str(info.value)), (documented, info.value)
    if label.startswith("aliases_") and "mod" in label:
        with pytest.raises(exc, match=rf"out shares memory with the array '\w+' that {name} captures"):
            call(fn, out=value, **changes)


# --- backward inputs that do not match the forward ---

@pytest.mark.parametrize("fn, arg, value, exc", BAD_MISMATCHES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(BAD_MISMATCHES)])
def test_bad_input_backward_mismatch(fn, arg, value, exc, request):
    with pytest.raises(exc, match=rf"\b{arg}\b") as info:
        call(fn, **{arg: value})
    documented = MISMATCH_MESSAGES.get(request.node.callspec.id)
    assert documented is None or re.search(documented, str(info.value)), (documented, info.value)


def test_backward_of_a_varlen_forward_with_other_lengths():
    """Lengths that differ from the forward's but fit the same packed tensors cannot be detected;
    they run (the gradient is then of another problem) and must not crash."""
    g = call("varlen_attention_backward", cu_seqlens_q=np.array([0, 1, 2, 3]))
    assert g.dq.shape == VQ.shape


# --- sizes past the machine's memory: MemoryError before any allocation or work ---

def _broadcast(shape, dtype=F32):
    """A full-looking array of any size that owns one element (stride 0 everywhere)."""
    return np.broadcast_to(np.ones((1,) * len(shape), dtype), shape)


HUGE = [
    # (function, arguments): out alone would be 1 TiB; the last overflows 2**63 bytes
    ("attention", dict(q=_broadcast((2 ** 16, 2 ** 16, 8, 8)), k=_broadcast((2 ** 16, 1, 8, 8)),
                       v=_broadcast((2 ** 16, 1, 8, 8)))),
    ("attention", dict(q=_broadcast((1, 2 ** 34, 1, 16)), k=_broadcast((1, 1, 1, 16)),
                       v=_broadcast((1, 1, 1, 16)), return_lse=True)),
    ("attention", dict(q=_broadcast((2 ** 24, 2 ** 24, 128, 1)), k=_broadcast((2 ** 24, 1, 1, 1)),
                       v=_broadcast((2 ** 24, 1, 1, 256)))),
    ("attention", dict(q=_broadcast((1, 2 ** 20, 1, 16)), k=_broadcast((1, 2 ** 36, 1, 16)),
                       v=_broadcast((1, 2 ** 36, 1, 16)))),
    ("varlen_attention", dict(q=_broadcast((2 ** 38, 2, 16)), k=_broadcast((4, 2, 16)),
                              v=_broadcast((4, 2, 16)), cu_seqlens_q=np.array([0, 2]),
                              cu_seqlens_k=np.array([0, 4]))),
    ("attention_backward", dict(dout=_broadcast((2 ** 16, 2 ** 16, 8, 8)), q=_broadcast((2 ** 16, 2 ** 16, 8, 8)),
                                k=_broadcast((2 ** 16, 1, 8, 8)), v=_broadcast((2 ** 16, 1, 8, 8)),
                                out=_broadcast((2 ** 16, 2 ** 16, 8, 8)), lse=_broadcast((2 ** 16, 8, 2 ** 16)))),
    ("varlen_attention_backward", dict(dout=_broadcast((2 ** 38, 2, 16)), q=_broadcast((2 ** 38, 2, 16)),
                                       k=_broadcast((4, 2, 16)), v=_broadcast((4, 2, 16)),
                                       out=_broadcast((2 ** 38, 2, 16)), lse=_broadcast((2, 2 ** 38)),
                                       cu_seqlens_q=np.array([0, 2]), cu_seqlens_k=np.array([0, 4]))),
]


@pytest.mark.parametrize("device", ["cpu", "reference"])
@pytest.mark.parametrize("fn, args", HUGE, ids=[f"{c[0]}-{i}" for i, c in enumerate(HUGE)])
def test_bad_input_past_memory(fn, args, device, monkeypatch):
    def no_work(*a, **kw):
        raise AssertionError("work started before the size was refused")

    for name in ("forward", "backward"):
        monkeypatch.setattr(attnext.api._C, name, no_work)
    monkeypatch.setattr(attnext.api, "_new_output", no_work)
    for name in ("attention", "varlen_attention", "attention_backward", "varlen_attention_backward"):
        monkeypatch.setattr(attnext.api.reference, name, no_work)
    with pytest.raises(MemoryError, match=r"GiB.*more than this machine's memory") as info:
        getattr(attnext, fn)(**args, device=device)
    assert re.search(r"\bq \(", str(info.value)), str(info.value)


# --- hand-picked refusals the battery has no case for, each with its exact message -------------

# arrays the callbacks below capture, and the callbacks' refusals the battery's tables lack
TABLE_F32 = np.ones((HQ, 4), F32)

# (id, keyword changes, exception, regex the message must match); every case runs through both
# the forward and the backward of the padded entry point.
PADDED_CASES = [
    ("mixed_f16_bf16", dict(q=Q.astype(F16), k=K.astype(BF16), v=V.astype(F16)), TypeError,
     r"share one dtype"),
    ("k_batch", dict(k=K[:1]), ValueError, r"shapes disagree.*\bk \(1, 7, 2, 8\)"),
    ("v_seq", dict(v=V[:, :4]), ValueError, r"shapes disagree.*\bv \(2, 4, 2, 6\)"),
    ("bhsd_v_seq", dict(layout="bhsd", q=Q.transpose(0, 2, 1, 3), k=K.transpose(0, 2, 1, 3),
                        v=V.transpose(0, 2, 1, 3)[:, :, :6]), ValueError,
     r"shapes disagree for layout 'bhsd'"),
    ("hk_zero", dict(k=K[:, :, :0], v=V[:, :, :0]), ValueError, r"key/value heads \(0\)"),
    ("dv_300", dict(v=np.ones((B, SK, HK, 300), F32)), ValueError, r"head dim Dv = 300"),
    ("d_zero", dict(q=Q[..., :0], k=K[..., :0]), ValueError, r"head dim D = 0"),
    ("dv_zero", dict(v=V[..., :0]), ValueError, r"head dim Dv = 0"),
    # callbacks: Python control flow, lookups out of range, what the tracer cannot follow
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
    # mask and device
    ("mask_bad_batch", dict(mask=np.ones((B + 1, 1, 1, 1), bool)), ValueError, r"mask of shape"),
    ("device_cuda", dict(device="cuda"), RuntimeError, r"device='cuda'"),
]


@pytest.mark.parametrize("fn", ["attention", "attention_backward"], ids=["forward", "backward"])
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in PADDED_CASES],
                         ids=[c[0] for c in PADDED_CASES])
def test_bad_input_padded(fn, changes, exc, match):
    with pytest.raises(exc, match=match):
        call(fn, **changes)


PICKED_CALLBACK_CASES = [c for c in PADDED_CASES if {"score_mod", "mask_mod"} & set(c[1])]


@pytest.mark.parametrize("fn", ["attention", "attention_backward"], ids=["forward", "backward"])
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in PICKED_CALLBACK_CASES],
                         ids=[c[0] for c in PICKED_CALLBACK_CASES])
def test_bad_input_padded_callback_on_the_reference(fn, changes, exc, match):
    """device="reference" calls the callbacks on NumPy arrays, where most of these would run
    (and some give an answer: table[h][k]); it traces them first and refuses them as the CPU
    backend does, with the same message."""
    with pytest.raises(exc, match=match):
        call(fn, **changes, device="reference")


OUT_CASES = [
    ("wrong_dtype_and_shape", np.empty((B, SQ, HQ, DV + 1), F16), TypeError,
     r"out must have dtype float32, got float16"),
    ("bhsd_shape_for_bshd", np.empty((B, HQ, SQ, DV), F32), ValueError, r"out must have shape"),
]


@pytest.mark.parametrize("bad, exc, match", [c[1:] for c in OUT_CASES],
                         ids=[c[0] for c in OUT_CASES])
def test_bad_input_out_padded(bad, exc, match):
    with pytest.raises(exc, match=match):
        call("attention", out=bad)


def test_bad_input_out_aliasing_through_a_view():
    rng = np.random.default_rng(2)
    big = randn(rng, (1, 6, 2, 8), F32)
    q = big[..., :4]
    k, v = big[..., 4:].copy(), big[..., 4:].copy()
    with pytest.raises(ValueError, match=r"out shares memory with q"):
        attnext.attention(q, k, v, out=big[..., ::2], device="cpu")


def test_bad_input_out_aliasing_the_alibi_slopes():
    """out= overlapping the slopes would change them mid-call."""
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(rng, 1, 8, 8, 2, 2, 16, 16, F32)
    out = np.zeros((1, 8, 2, 16), F32)
    slopes = out.reshape(-1)[:2]
    with pytest.raises(ValueError, match="out shares memory with alibi_slopes"):
        attnext.attention(q, k, v, alibi_slopes=slopes, out=out, device="cpu")


# the backward's own arguments
BACKWARD_CASES = [
    ("out_dtype", dict(out=OUT.astype(F16)), TypeError, r"\bout must have .* dtype float32"),
    ("lse_list", dict(lse=[1.0]), TypeError, r"lse must be a NumPy array"),
]


@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in BACKWARD_CASES],
                         ids=[c[0] for c in BACKWARD_CASES])
def test_bad_input_backward(changes, exc, match):
    with pytest.raises(exc, match=match):
        call("attention_backward", **changes)


VARLEN_CASES = [
    ("v_rows", dict(v=VV[:5]), ValueError, r"shapes disagree"),
    ("device_cuda", dict(device="cuda"), RuntimeError, r"device='cuda'"),
]


@pytest.mark.parametrize("fn", ["varlen_attention", "varlen_attention_backward"],
                         ids=["forward", "backward"])
@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in VARLEN_CASES],
                         ids=[c[0] for c in VARLEN_CASES])
def test_bad_input_varlen(fn, changes, exc, match):
    with pytest.raises(exc, match=match):
        call(fn, **changes)


VARLEN_BACKWARD_CASES = [
    ("dout_shape", dict(dout=VDOUT[:10]), ValueError,
     r"dout must have the forward output's shape \(11, 4, 6\)"),
]


@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in VARLEN_BACKWARD_CASES],
                         ids=[c[0] for c in VARLEN_BACKWARD_CASES])
def test_bad_input_varlen_backward(changes, exc, match):
    with pytest.raises(exc, match=match):
        call("varlen_attention_backward", **changes)


@pytest.mark.parametrize("causal", [0, "causal"])
def test_bad_input_causal_takes_only_bools_and_the_two_names(causal):
    """Beside the battery's ints, floats and bytes: 0 (no bool), and "causal" (no name of it)."""
    rng = np.random.default_rng(14)
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 8, 8, F32)
    with pytest.raises(ValueError, match="causal must be"):
        attnext.attention(q, k, v, causal=causal, device="cpu")


def test_bad_input_simd_variant_at_import():
    env = dict(os.environ, ATTNEXT_SIMD="portible")
    r = subprocess.run([sys.executable, "-c", "import attnext"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "ATTNEXT_SIMD must be portable, avx2, avx512 or neon" in r.stderr


# --- environment variables ---

@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", " ", "100000"])
@pytest.mark.parametrize("fn", FUNCTIONS,
                         ids=["forward", "varlen_forward", "backward", "varlen_backward"])
def test_bad_input_num_threads_variable(fn, value, monkeypatch):
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", value)
    message = rf"ATTNEXT_NUM_THREADS must be an integer in \[1, 1024\], got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        call(fn)


def test_bad_input_device_variable(monkeypatch):
    monkeypatch.setenv("ATTNEXT_DEVICE", "tpu")
    with pytest.raises(ValueError, match=r"device must be one of .* got 'tpu'"):
        attnext.attention(Q, K, V)
    monkeypatch.setenv("ATTNEXT_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match=r"device='cuda'"):
        attnext.attention(Q, K, V)
    # an explicit device wins over the variable
    assert attnext.attention(Q, K, V, device="cpu").shape == OUT.shape


# --- zero-size dimensions: empty results, never errors, forward and backward ---

ZERO_PADDED = [  # (B, Sq, Sk, Hq, Hk)
    (0, 5, 7, 4, 2), (2, 0, 7, 4, 2), (2, 5, 0, 4, 2), (0, 0, 0, 4, 2), (2, 0, 0, 4, 2),
    (2, 5, 7, 0, 2), (0, 5, 7, 0, 2), (1, 1, 0, 1, 1), (3, 0, 1, 2, 1),
]
ZERO_OPTIONS = {
    "plain": {}, "causal": dict(causal=True), "top_left": dict(causal="top_left"),
    "window": dict(window=(2, 0)), "softcap": dict(softcap=5.0),
    "bias_mask": dict(bias=np.ones(1, F32), mask=np.ones(1, bool)),
    "alibi": "alibi", "seqlens": "seqlens",
}


def _opts(name, b, hq, sq, sk):
    o = ZERO_OPTIONS[name]
    if o == "alibi":
        return dict(alibi_slopes=np.ones((b, hq), F32))
    if o == "seqlens":
        return dict(seqlens_q=np.full(b, sq), seqlens_k=np.zeros(b, np.int64))
    return o


@pytest.mark.parametrize("opt", list(ZERO_OPTIONS))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dims", ZERO_PADDED, ids=["B{}_Sq{}_Sk{}_Hq{}_Hk{}".format(*d) for d in ZERO_PADDED])
def test_zero_size_padded(dims, layout, opt):
    b, sq, sk, hq, hk = dims
    seed = zlib.crc32(repr((dims, layout, opt)).encode())

    def arr(s, h, n):
        return randn_seeded(seed, (b, s, h, n) if layout == "bshd" else (b, h, s, n), F32)

    q, k, v = arr(sq, hq, D), arr(sk, hk, D), arr(sk, hk, DV)
    opts = dict(layout=layout, device="cpu", **_opts(opt, b, hq, sq, sk))
    out, lse = attnext.attention(q, k, v, return_lse=True, **opts)
    want = (b, sq, hq, DV) if layout == "bshd" else (b, hq, sq, DV)
    assert out.shape == want and lse.shape == (b, hq, sq) and out.dtype == F32
    if sk == 0 or opt == "seqlens":
        assert (out == 0).all() and (lse == -np.inf).all()
    g = attnext.attention_backward(np.ones(want, F32), q, k, v, out, lse, **opts)
    assert (g.dq.shape, g.dk.shape, g.dv.shape) == (q.shape, k.shape, v.shape)
    assert all(np.isfinite(x).all() for x in g[:3])
    if "bias" in opts:
        assert g.dbias.shape == (1,) and np.isfinite(g.dbias).all()


ZERO_VARLEN = [  # (Tq, Tk, cu_q, cu_k, seqused_q, seqused_k)
    (0, 6, [0, 0], [0, 6], None, None), (5, 0, [0, 5], [0, 0], None, None),
    (0, 0, [0, 0, 0], [0, 0, 0], None, None), (0, 0, [0], [0], None, None),
    (4, 3, [0], [0], None, None), (6, 5, [0, 3, 6], [0, 2, 5], [0, 0], [2, 3]),
    (6, 5, [0, 3, 6], [0, 2, 5], [3, 1], [0, 0]),
]


@pytest.mark.parametrize("opt", ["plain", "causal", "window", "bias_mask", "alibi"])
@pytest.mark.parametrize("case", ZERO_VARLEN, ids=[f"Tq{c[0]}_Tk{c[1]}_nseq{len(c[2]) - 1}_{i}"
                                                   for i, c in enumerate(ZERO_VARLEN)])
def test_zero_size_varlen(case, opt):
    tq, tk, cu_q, cu_k, used_q, used_k = case
    nseq = len(cu_q) - 1
    q, k, v = randn_seeded(1, (tq, HQ, D)), randn_seeded(2, (tk, HK, D)), randn_seeded(3, (tk, HK, DV))
    lengths = dict(cu_seqlens_q=np.array(cu_q), cu_seqlens_k=np.array(cu_k))
    if used_q is not None:
        lengths.update(seqused_q=np.array(used_q), seqused_k=np.array(used_k))
    opts = _opts(opt, nseq, HQ, 0, 0)
    out, lse = attnext.varlen_attention(q, k, v, **lengths, return_lse=True, device="cpu", **opts)
    assert out.shape == (tq, HQ, DV) and lse.shape == (HQ, tq)
    assert (out == 0).all() and (lse == -np.inf).all()
    g = attnext.varlen_attention_backward(np.ones_like(out), q, k, v, out, lse, **lengths,
                                          device="cpu", **opts)
    assert (g.dq.shape, g.dk.shape, g.dv.shape) == (q.shape, k.shape, v.shape)
    assert all((x == 0).all() for x in g[:3])


# --- zero sizes with out= and every dtype, no keys, no query heads, no sequences ---

ZERO_SHAPES = [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0), (2, 0, 0)]
ZERO_SHAPES_IDS = ["B0", "Sq0", "Sk0", "all0", "Sq0_Sk0"]


def _zero_padded_case(dtype, b, sq, sk, layout):
    rng = np.random.default_rng(4)
    q, k, v = make_qkv(rng, b, sq, sk, HQ, HK, D, DV, dtype, layout)
    opts = dict(layout=layout, device="cpu", causal=True, bias=np.ones((1, 1, sq, sk), F32),
                mask=np.ones((sq, sk), bool))
    out_shape = (b, sq, HQ, DV) if layout == "bshd" else (b, HQ, sq, DV)
    return q, k, v, opts, out_shape


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("b, sq, sk", ZERO_SHAPES, ids=ZERO_SHAPES_IDS)
@pytest.mark.parametrize("dtype", [F16, F32, F64], ids=["f16", "f32", "f64"])
def test_zero_size_forward(dtype, b, sq, sk, layout):
    q, k, v, opts, out_shape = _zero_padded_case(dtype, b, sq, sk, layout)
    out = np.full(out_shape, np.nan, dtype)
    res, lse = attnext.attention(q, k, v, return_lse=True, out=out, **opts)
    assert res is out and res.shape == out_shape and lse.shape == (b, HQ, sq)
    assert (res == 0).all() and (lse == -np.inf).all()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("b, sq, sk", [c for c in ZERO_SHAPES if c[0]],
                         ids=[i for c, i in zip(ZERO_SHAPES, ZERO_SHAPES_IDS) if c[0]])
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


ZERO_PACKED = [
    (0, 6, [0, 0], [0, 6]),            # no query rows at all
    (5, 0, [0, 5], [0, 0]),            # no key rows
    (0, 0, [0, 0, 0], [0, 0, 0]),      # empty sequences
    (0, 0, [0], [0]),                  # no sequences, nothing packed
    (4, 3, [0], [0]),                  # no sequences: every row is padding
]
ZERO_PACKED_IDS = ["Tq0", "Tk0", "empty_seqs", "B0_T0", "B0_padding"]


@pytest.mark.parametrize("tq, tk, cu_q, cu_k", ZERO_PACKED, ids=ZERO_PACKED_IDS)
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


# --- inputs are never modified; read-only inputs work ---

def _checksum(x):
    return zlib.crc32(np.ascontiguousarray(x).view(np.uint8).tobytes()), x.shape, x.dtype, x.strides


UNCHANGED_OPTIONS = {
    "plain": {}, "causal_window": dict(causal=True, window=(3, 1)),
    "bias_mask_alibi": "arrays", "softcap_scale": dict(softcap=3.0, scale=0.7),
    "score_mod": "mods",
}


def _option_arrays(opt, varlen):
    o = UNCHANGED_OPTIONS[opt]
    if o == "arrays":
        rows, cols = (5, 4) if varlen else (SQ, SK)   # varlen: the longest seqused
        return dict(bias=randn_seeded(9, (HQ, rows, cols)), mask=np.random.default_rng(10).random((rows, cols)) < 0.8,
                    alibi_slopes=np.abs(randn_seeded(11, (HQ,))))
    if o == "mods":
        table = randn_seeded(12, (HQ, 16))
        return dict(score_mod=lambda s, b, h, qi, ki: s + table[h, np.abs(qi - ki) % 16],
                    mask_mod=lambda b, h, qi, ki: (qi + ki) % 3 != 0)
    return dict(o)


@pytest.mark.parametrize("read_only", [False, True], ids=["writeable", "read_only"])
@pytest.mark.parametrize("opt", list(UNCHANGED_OPTIONS))
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=["f16", "bf16", "f32", "f64"])
def test_inputs_never_modified(dtype, varlen, opt, read_only):
    if varlen:
        arrays = dict(q=VQ.astype(dtype), k=VK.astype(dtype), v=VV.astype(dtype),
                      cu_seqlens_q=CU_Q.copy(), cu_seqlens_k=CU_K.copy(),
                      seqused_q=SEQUSED_Q.copy(), seqused_k=SEQUSED_K.copy())
        fwd, bwd = attnext.varlen_attention, attnext.varlen_attention_backward
    else:
        arrays = dict(q=Q.astype(dtype), k=K.astype(dtype), v=V.astype(dtype), seqlens_q=SEQLENS.copy())
        fwd, bwd = attnext.attention, attnext.attention_backward
    arrays.update(_option_arrays(opt, varlen))
    if read_only:
        for name, x in arrays.items():
            if isinstance(x, np.ndarray):
                x.flags.writeable = False
    before = {n: _checksum(x) for n, x in arrays.items() if isinstance(x, np.ndarray)}
    out, lse = fwd(**arrays, return_lse=True, device="cpu")
    dout = randn_seeded(13, out.shape, dtype)
    if read_only:
        for x in (out, lse, dout):
            x.flags.writeable = False
    seen = {"out": _checksum(out), "lse": _checksum(lse), "dout": _checksum(dout)}
    g = bwd(dout, out=out, lse=lse, **arrays, device="cpu")
    after = {n: _checksum(x) for n, x in arrays.items() if isinstance(x, np.ndarray)}
    assert after == before
    assert {"out": _checksum(out), "lse": _checksum(lse), "dout": _checksum(dout)} == seen
    assert g.dq.shape == arrays["q"].shape


# --- NaN and Inf in the data propagate as IEEE arithmetic says; never a crash ---

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "minus_inf"])
@pytest.mark.parametrize("where, index", NONFINITE, ids=[w for w, _ in NONFINITE])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=["f16", "bf16", "f32", "f64"])
def test_nonfinite_data_propagate(dtype, where, index, value, causal):
    """out is NaN exactly where the reference's is (a NaN or +inf score poisons its row, a NaN key
    every row that sees it), lse is non-finite exactly where the reference's is, and no NaN of the
    reference's gradients goes missing (the backend may have more: 0 * NaN is NaN)."""
    arrays = dict(q=randn_seeded(21, (2, 9, 2, 8), dtype), k=randn_seeded(22, (2, 11, 2, 8), dtype),
                  v=randn_seeded(23, (2, 11, 2, 8), dtype), bias=randn_seeded(24, (2, 2, 9, 11), F32))
    arrays[where][index] = value
    opts = dict(causal=causal, bias=arrays.pop("bias"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = attnext.attention(**arrays, **opts, return_lse=True, device="cpu")
        r_out, r_lse = reference.attention(**arrays, **opts, return_lse=True)
        assert np.array_equal(np.isnan(out), np.isnan(r_out))
        assert np.array_equal(np.isfinite(lse), np.isfinite(r_lse))
        assert np.array_equal(lse == -np.inf, r_lse == -np.inf)
        finite = np.isfinite(r_out)
        tol = 1e-10 if dtype == F64 else 1e-5 if dtype == F32 else 5e-2
        np.testing.assert_allclose(out[finite].astype(F64), r_out[finite], rtol=tol, atol=tol)
        dout = randn_seeded(25, out.shape, dtype)
        g = attnext.attention_backward(dout, **arrays, out=out, lse=lse, **opts, device="cpu")
        rg = reference.attention_backward(dout, **arrays, out=r_out.astype(dtype), lse=r_lse, **opts)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), g[:4], rg[:4]):
        lost = np.isnan(b.astype(F64)) & ~np.isnan(a.astype(F64))
        assert not lost.any(), f"{name}: NaN of the reference's missing at {np.argwhere(lost)[:4].tolist()}"


# --- NaN and Inf in the backward's own inputs (dout, out, lse), and in packed q / k / v ---

def _flash_backward_head(dout, q, k, v, out, lse, keep, scale):
    """One (sequence, head) of what a backend's backward computes from the arrays it is given, in
    float64 with IEEE arithmetic (FlashAttention's backward): P = exp(s - lse);
    delta = rowsum(dout * out); dS = P * (dout v^T - delta). A row whose lse is -inf keeps no key
    and has no gradient path: its P, dS and dq are 0 and its q and dout are not read, so nothing
    of it reaches dk or dv (DESIGN, 7). Every pair of the sequence is computed, masked or not (a
    sequence shorter than the CPU's 64-row tiles is one tile): in a row that keeps a key, a
    masked pair gives 0 * NaN = NaN where a NaN reaches its dout v^T."""
    s = np.where(keep, scale * (q @ k.T), -np.inf)
    live = (lse != -np.inf)[:, None]
    p = np.where(live, np.exp(s - lse[:, None]), 0.0)
    do = np.where(live, dout, 0.0)
    ds = np.where(live, p * (do @ v.T - (do * out).sum(axis=1, keepdims=True)), 0.0)
    return (np.where(live, scale * (ds @ k), 0.0), scale * (ds.T @ np.where(live, q, 0.0)),
            p.T @ do)


def _flash_backward(dout, q, k, v, out, lse, causal, cu_seqlens_q=None, cu_seqlens_k=None):
    """(dq, dk, dv) of _flash_backward_head over every sequence and head, "bshd" or packed; rows
    after cu_seqlens_q[-1] get none."""
    dout, q, k, v, out, lse = (np.asarray(x, F64) for x in (dout, q, k, v, out, lse))
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    if cu_seqlens_q is None:
        segments = [(b, b, lse[b]) for b in range(q.shape[0])]
    else:
        segments = [(slice(q0, q1), slice(k0, k1), lse[:, q0:q1]) for q0, q1, k0, k1 in
                    zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:])]
    group = q.shape[-2] // k.shape[-2]
    for rows, keys, seg_lse in segments:
        lq, lk = q[rows].shape[0], k[keys].shape[0]
        keep = np.ones((lq, lk), bool)
        if causal:
            keep = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq
        dq, dk, dv = grads[0][rows], grads[1][keys], grads[2][keys]
        for h in range(q.shape[-2]):
            hk = h // group
            a, b, c = _flash_backward_head(dout[rows][:, h], q[rows][:, h], k[keys][:, hk], v[keys][:, hk],
                                           out[rows][:, h], seg_lse[h], keep, 1 / np.sqrt(q.shape[-1]))
            dq[:, h] = a
            dk[:, hk] += b
            dv[:, hk] += c
    return grads


# padded: q (2, 9, 4, 8), k and v (2, 11, 2, 8 / 6). Packed: q of 12 rows, the last one padding,
# sequences of (4, 3), (0, 6) and (7, 5) rows; under causal the first rows of the first and the
# last sequence keep no key. (arrays' varlen flag, where, index)
PACKED_CU_Q, PACKED_CU_K = np.array([0, 4, 4, 11]), np.array([0, 3, 9, 14])
NONFINITE_BACKWARD = [
    (False, "dout", (0, 2, 1, 3)), (False, "out", (1, 5, 3, 2)), (False, "lse", (0, 1, 2)),
    (True, "dout", (6, 3, 2)), (True, "out", (7, 2, 0)), (True, "lse", (1, 8)),
    (True, "dout", (11, 0, 0)),            # the padding row: not read
    (True, "q", (6, 1, 3)), (True, "k", (10, 0, 2)), (True, "v", (12, 1, 1)),
]


def _by_lse_row(x, varlen):
    """out or dq as (..., H, S, D), indexed like lse."""
    return x.transpose(1, 0, 2) if varlen else x.transpose(0, 2, 1, 3)


def _nonfinite_problem(dtype, varlen, causal):
    if varlen:
        arrays = dict(q=randn_seeded(31, (12, 4, 8), dtype), k=randn_seeded(32, (14, 2, 8), dtype),
                      v=randn_seeded(33, (14, 2, 6), dtype))
        lengths = dict(cu_seqlens_q=PACKED_CU_Q, cu_seqlens_k=PACKED_CU_K)
        names = ("varlen_attention", "varlen_attention_backward")
    else:
        arrays = dict(q=randn_seeded(31, (2, 9, 4, 8), dtype), k=randn_seeded(32, (2, 11, 2, 8), dtype),
                      v=randn_seeded(33, (2, 11, 2, 6), dtype))
        lengths = {}
        names = ("attention", "attention_backward")
    return arrays, dict(lengths, causal=causal), names


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_flash_backward_model_is_the_reference_on_finite_data(varlen, causal):
    """The model the next test holds the backward to computes the reference's gradients."""
    arrays, opts, (fwd, bwd) = _nonfinite_problem(F64, varlen, causal)
    out, lse = getattr(reference, fwd)(**arrays, **opts, return_lse=True)
    dout = randn_seeded(35, out.shape, F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model = _flash_backward(dout, **arrays, out=out, lse=lse, **opts)
    want = getattr(reference, bwd)(dout, **arrays, out=out, lse=lse, **opts)
    for name, a, b in zip(("dq", "dk", "dv"), model, want[:3]):
        assert np.abs(b).max() > 0.1, name
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "minus_inf"])
@pytest.mark.parametrize("varlen, where, index", NONFINITE_BACKWARD,
                         ids=[f"{'varlen' if c[0] else 'padded'}-{c[1]}-{'_'.join(map(str, c[2]))}"
                              for c in NONFINITE_BACKWARD])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=["f16", "bf16", "f32", "f64"])
def test_nonfinite_backward_inputs_propagate(dtype, varlen, where, index, value, causal):
    """The rule for non-finite values: IEEE arithmetic on what each backend computes.

    The backward reads out and lse as given (FlashAttention's algorithm: P = exp(s - lse),
    delta = rowsum(dout * out), dS = P * (dout v^T - delta)); the reference recomputes both from
    q, k, v and reads neither. So the gradients are held to those formulas evaluated in float64
    on the very arrays the backend was given (_flash_backward): non-finite exactly where they
    are non-finite, finite values within the dtype's tolerance elsewhere. NaN and +-inf are not
    told apart: which one comes out depends on how a sum is ordered (for an infinite dout, the
    reference's delta = sum P * dP adds +inf and -inf into NaN where dout . out gives +-inf, so
    its dk is NaN where the backend's is +-inf). Against the reference: for a non-finite dout
    (out and lse the forward's) the gradients are non-finite exactly where its are; for
    non-finite q, k, v none of its non-finite gradients goes missing. The forward of non-finite
    packed q, k, v: lse non-finite (and -inf) exactly where the reference's is, out NaN exactly
    where its is, and out = 0 in a row that keeps no key (DESIGN, 7), on both, whatever NaN
    sits in v. Padding rows after cu_seqlens[-1] get zero gradients whatever their dout.
    """
    arrays, opts, (fwd, bwd) = _nonfinite_problem(dtype, varlen, causal)
    if where in arrays:
        arrays[where][index] = value
    tol = {F64: 1e-10, F32: 1e-5, F16: 5e-3, BF16: 1e-2}[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = getattr(attnext, fwd)(**arrays, **opts, return_lse=True, device="cpu")
        r_out, r_lse = getattr(reference, fwd)(**arrays, **opts, return_lse=True)
        assert np.array_equal(np.isfinite(lse), np.isfinite(r_lse))
        keeps_none = lse == -np.inf
        assert np.array_equal(keeps_none, r_lse == -np.inf)
        rows, r_rows = (_by_lse_row(x, varlen) for x in (out.astype(F64), r_out))
        assert (rows[keeps_none] == 0).all() and (r_rows[keeps_none] == 0).all()
        rows, r_rows = rows[~keeps_none], r_rows[~keeps_none]
        assert np.array_equal(np.isnan(rows), np.isnan(r_rows))
        finite = np.isfinite(r_rows)
        np.testing.assert_allclose(rows[finite], r_rows[finite], rtol=tol, atol=tol)
        given = dict(dout=randn_seeded(35, out.shape, dtype), out=out.copy(), lse=lse.copy())
        if where in given:
            given[where][index] = value
        g = getattr(attnext, bwd)(**given, **arrays, **opts, device="cpu")
        rg = getattr(reference, bwd)(**given, **arrays, **opts)
        model = _flash_backward(**given, **arrays, **opts)
    for name, got, want, ref in zip(("dq", "dk", "dv"), g[:3], model, rg[:3]):
        got = got.astype(F64)
        differ = np.isfinite(got) != np.isfinite(want)
        assert not differ.any(), (f"{name}: finite in one and not the other of the backend and the "
                                  f"model at {np.argwhere(differ)[:4].tolist()}")
        both = np.isfinite(want)
        np.testing.assert_allclose(got[both], want[both], rtol=tol, atol=tol, err_msg=name)
        if where == "dout":
            assert np.array_equal(np.isfinite(got), np.isfinite(ref)), name
        elif where in arrays:
            lost = ~np.isfinite(ref) & np.isfinite(got)
            assert not lost.any(), (f"{name}: finite where the reference's is not, at "
                                    f"{np.argwhere(lost)[:4].tolist()}")
    if varlen:
        assert (g.dq[PACKED_CU_Q[-1]:] == 0).all()
