"""attnext.merge: attention over disjoint key sets merged equals attention over their union (out,
lse; padded bshd / bhsd and varlen; parts whose rows keep no key), its edge rules (-inf parts drop
out whatever their out holds, NaN spreads, a row with no part gives 0 and -inf), bad arguments,
other libraries' arrays; the backward of one part given the whole's out and lse is that part's
share of the whole's gradients (what ring attention sums). GPU: the same on CUDA tensors."""
import re

import numpy as np
import pytest

import attnext
from attnext import reference
from attnext.cuda.nvrtc import KERNEL_DIR
from conftest import BF16, F32, F64, TEST_DEVICE, assert_close, make_qkv, make_varlen_qkv, randn, \
    skip_unless_device_has

H = 2


def _cuts(rng, n, parts):
    """parts disjoint, contiguous key ranges covering range(n), some of them empty-ish."""
    edges = np.sort(rng.choice(np.arange(1, n), parts - 1, replace=False))
    return list(zip(np.r_[0, edges], np.r_[edges, n]))


def _split_padded(rng, dtype, layout, parts, device):
    """(whole (out, lse) from the reference, [(out, lse)] of the parts from `device`, mask)."""
    q, k, v = make_qkv(rng, 2, 13, 29, H, 1, 16, dtype=dtype, layout=layout)
    mask = rng.random((2, H, 13, 29)) < 0.7
    mask[0, 1, 4] = False                     # a row that keeps no key anywhere
    axis = 1 if layout == "bshd" else 2
    pieces = []
    for lo, hi in _cuts(rng, 29, parts):
        keys = [slice(None)] * 4
        keys[axis] = slice(lo, hi)
        pieces.append(attnext.attention(q, k[tuple(keys)], v[tuple(keys)], mask=mask[..., lo:hi],
                                        layout=layout, return_lse=True, device=device))
    whole = reference.attention(q, k, v, mask=mask, layout=layout, return_lse=True)
    return whole, pieces


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_merge_of_key_splits_is_attention_over_all_keys(rng, dtype, layout, parts):
    skip_unless_device_has(np.dtype(dtype))
    (want_out, want_lse), pieces = _split_padded(rng, dtype, layout, parts, TEST_DEVICE)
    out, lse = attnext.merge([p[0] for p in pieces], [p[1] for p in pieces], layout=layout)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert lse.dtype == (F64 if dtype == F64 else F32) and lse.shape == want_lse.shape
    assert_close("out", out, want_out, dtype)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    live = ~np.isneginf(want_lse)
    np.testing.assert_allclose(lse[live], want_lse[live], rtol=1e-5 if dtype != F64 else 1e-12, atol=1e-5)
    assert (out[0, 4, 1] if layout == "bshd" else out[0, 1, 4]).tolist() == [0.0] * 16


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: np.dtype(d).name)
def test_merge_of_varlen_key_splits(rng, dtype):
    skip_unless_device_has(np.dtype(dtype))
    q, k, v = make_varlen_qkv(rng, 20, 30, H, H, 16, dtype=dtype)
    cu_q = np.array([0, 7, 20], np.int32)
    whole = reference.varlen_attention(q, k, v, cu_q, np.array([0, 10, 30], np.int32), return_lse=True)
    # each sequence's keys cut in two: the first part holds keys [0, 4) and [10, 22)
    first = np.r_[0:4, 10:22]
    second = np.r_[4:10, 22:30]
    parts = [attnext.varlen_attention(q, k[ix], v[ix], cu_q, np.array(cu, np.int32), return_lse=True,
                                      device=TEST_DEVICE)
             for ix, cu in ((first, [0, 4, 16]), (second, [0, 6, 14]))]
    out, lse = attnext.merge([p[0] for p in parts], [p[1] for p in parts])
    assert_close("out", out, whole[0], dtype)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=lambda d: np.dtype(d).name)
def test_the_edge_rules(rng, dtype):
    """A part with lse -inf drops out even where its out is NaN; a row with no live part gives
    0 and -inf; a NaN lse makes its row NaN; one part merges to itself; the inputs stay."""
    acc = F64 if dtype == F64 else F32
    outs = [randn(rng, (1, 3, 2, 8), dtype) for _ in range(3)]
    lses = [randn(rng, (1, 2, 3), acc) for _ in range(3)]
    lses[0][0, 0, 0] = -np.inf
    outs[0][0, 0, 0] = np.nan                          # dropped: its lse is -inf
    for x in lses:
        x[0, 1, 2] = -np.inf                           # no part left at (row 2, head 1)
    lses[2][0, 0, 1] = np.nan                          # spreads
    before = [x.copy() for x in outs + lses]
    out, lse = attnext.merge(outs, lses)
    for a, b in zip(outs + lses, before):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    ls = np.stack([np.asarray(x, np.float64) for x in lses])
    with np.errstate(invalid="ignore", divide="ignore"):
        want_lse = np.logaddexp.reduce(ls, axis=0)
        w = np.where(np.isneginf(ls), 0.0, np.exp(ls - want_lse))
    want = sum(np.where(wi.transpose(0, 2, 1)[..., None] > 0, wi.transpose(0, 2, 1)[..., None] * np.asarray(o, np.float64), 0.0)
               for wi, o in zip(w, outs))
    assert np.isneginf(lse[0, 1, 2]) and (out[0, 2, 1] == 0).all()
    assert np.isnan(lse[0, 0, 1]) and np.isnan(np.asarray(out[0, 1, 0], np.float64)).all()
    ok = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[ok], want_lse[ok], rtol=1e-6 if acc == F32 else 1e-13)
    keep = ok.transpose(0, 2, 1)
    assert_close("out", np.asarray(out)[keep], want[keep], dtype)
    same_out, same_lse = attnext.merge(outs[1:2], lses[1:2])
    np.testing.assert_array_equal(np.asarray(same_out, np.float64), np.where(
        np.isneginf(lses[1]).transpose(0, 2, 1)[..., None], 0.0, np.asarray(outs[1], np.float64)))
    np.testing.assert_array_equal(same_lse, lses[1])


def test_bad_arguments(rng):
    o, l = randn(rng, (1, 3, 2, 8), F32), randn(rng, (1, 2, 3), F32)
    cases = [
        ((o, [l]), TypeError, "outs must be a list or tuple"),
        (([], []), ValueError, "outs is empty"),
        (([o, o], [l]), ValueError, "one entry per part, got 2 and 1"),
        (([o, o[:, :2]], [l, l]), ValueError, r"outs\[1\] must have outs\[0\]'s shape"),
        (([o, o.astype(F64)], [l, l]), TypeError, r"outs\[1\] must have outs\[0\]'s dtype float32"),
        (([o], [l.astype(F64)]), TypeError, r"lses\[0\] must have dtype float32"),
        (([o], [l[:, :, :2]]), ValueError, r"lses\[0\] must have shape \(1, 2, 3\)"),
        (([o[0]], [l]), ValueError, r"lses\[0\] must have shape \(2, 3\)"),
        (([o], ["x"]), TypeError, r"lses\[0\]"),
        (([o[0, 0]], [l]), ValueError, "outs\\[0\\] must have shape"),
    ]
    for (outs, lses), exc, match in cases:
        with pytest.raises(exc, match=match):
            attnext.merge(outs, lses)
    with pytest.raises(ValueError, match="layout must be one of"):
        attnext.merge([o], [l], layout="thd")


def test_torch_cpu_tensors_come_back_as_torch(rng):
    torch = pytest.importorskip("torch")
    (want_out, want_lse), pieces = _split_padded(rng, F32, "bshd", 3, "cpu")
    out, lse = attnext.merge([torch.from_numpy(p[0]) for p in pieces], [torch.from_numpy(p[1]) for p in pieces])
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert_close("out", out.numpy(), want_out, F32)


@pytest.mark.parametrize("parts", [2, 3])
def test_a_parts_backward_from_the_wholes_out_and_lse(rng, parts):
    """attention_backward over one part's keys, given the whole's out and lse, gives that part's
    dk, dv and its share of dq: the parts' dq sum to the whole's (ring attention's backward)."""
    skip_unless_device_has(np.dtype(F32))
    q, k, v = make_qkv(rng, 2, 11, 23, H, 1, 16, dtype=F32)
    mask = rng.random((2, H, 11, 23)) < 0.8
    out, lse = attnext.attention(q, k, v, mask=mask, return_lse=True, device=TEST_DEVICE)
    dout = randn(rng, out.shape, F32)
    want = reference.attention_backward(dout, q, k, v, out, lse, mask=mask)
    dq = np.zeros(q.shape)
    for lo, hi in _cuts(rng, 23, parts):
        g = attnext.attention_backward(dout, q, k[:, lo:hi], v[:, lo:hi], out, lse, mask=mask[..., lo:hi],
                                       device=TEST_DEVICE)
        assert_close("dk", g.dk, want.dk[:, lo:hi], F32)
        assert_close("dv", g.dv, want.dv[:, lo:hi], F32)
        dq += g.dq
    assert_close("dq", dq, want.dq, F32)


def test_kernel_dtype_codes_are_attn_params():
    """attn_merge.cu spells attn_dtype's values for #if: they must be _C's."""
    src = (KERNEL_DIR / "attn_merge.cu").read_text()
    codes = {name: int(v) for name, v in re.findall(r"#define MERGE_(F16|BF16|F32|F64) (\d)", src)}
    from attnext._layout import DTYPE_CODES
    assert codes == {"F16": DTYPE_CODES["float16"], "BF16": DTYPE_CODES["bfloat16"],
                     "F32": DTYPE_CODES["float32"], "F64": DTYPE_CODES["float64"]}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_merge_on_cuda_tensors(rng, torch, dtype, layout):
    """CUDA tensors (parts from the host backend, copied over; float64 too: merge runs it):
    attn_merge.cu against the host merge, results as CUDA tensors, the edge rules included."""
    from helpers.gpu import to_gpu, to_host
    _, pieces = _split_padded(rng, dtype, layout, 3, "cpu")
    outs, lses = [p[0] for p in pieces], [p[1] for p in pieces]
    outs[1] = outs[1].copy()
    lses[1] = lses[1].copy()
    lses[1][1, 0, 2] = np.nan
    host = attnext.merge(outs, lses, layout=layout)
    out, lse = attnext.merge([to_gpu(torch, x) for x in outs], [to_gpu(torch, x) for x in lses], layout=layout)
    assert out.is_cuda and lse.is_cuda
    got_out, got_lse = to_host(torch, out), to_host(torch, lse)
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(host[1]))
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(host[1]))
    fin = np.isfinite(host[1])
    np.testing.assert_allclose(got_lse[fin], host[1][fin], rtol=1e-6 if dtype != F64 else 1e-14)
    got, want = np.asarray(got_out, np.float64), np.asarray(host[0], np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want).any()
    assert_close("out", np.nan_to_num(got), np.nan_to_num(want), dtype)


@pytest.mark.gpu
def test_merge_of_gpu_attention_parts(rng, torch):
    from helpers.gpu import to_gpu, to_host
    q, k, v = make_varlen_qkv(rng, 300, 700, 4, 2, 64, dtype=BF16)
    cu_q = to_gpu(torch, np.array([0, 100, 300], np.int32))
    whole = reference.varlen_attention(q, k, v, np.array([0, 100, 300], np.int32),
                                       np.array([0, 350, 700], np.int32), return_lse=True)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    a = np.r_[0:200, 350:500]
    b = np.r_[200:350, 500:700]
    parts = [attnext.varlen_attention(tq, tk[ix], tv[ix], cu_q, to_gpu(torch, np.array(cu, np.int32)), return_lse=True)
             for ix, cu in ((torch.from_numpy(a).cuda(), [0, 200, 350]), (torch.from_numpy(b).cuda(), [0, 150, 350]))]
    out, lse = attnext.merge([p[0] for p in parts], [p[1] for p in parts])
    assert_close("out", to_host(torch, out), whole[0], BF16)
    np.testing.assert_allclose(to_host(torch, lse), whole[1], rtol=1e-4, atol=1e-4)
