"""Paged k / v caches (block_table=): attention and varlen_attention over pages against the same
keys laid out contiguously (the CPU bit for bit, every backend against the reference), decode and
prefill, GQA, sinks and options on top; page indices out of range (IndexError naming the entry),
bad tables, and what is refused (the backward); on a GPU (-m gpu) CUDA tensors, the split-KV
decode among them."""
import numpy as np
import pytest

import attnext
from conftest import BF16, F32, F64, TEST_DEVICE, assert_close, assert_lse_close, randn

HQ, HK, D = 4, 2, 16


def _cache(rng, lengths, page_size, dtype, spare=3):
    """A shuffled paged cache holding each sequence's keys: (k_pages, v_pages, block_table) and the
    same keys contiguous (k, v) of max_pages * page_size rows; table entries past a sequence's
    pages are -1 (never read)."""
    pages = [-(-int(n) // page_size) for n in lengths]
    max_pages = max(pages) + 1
    n_pages = sum(pages) + spare
    kp, vp = randn(rng, (n_pages, page_size, HK, D), dtype), randn(rng, (n_pages, page_size, HK, D), dtype)
    order = rng.permutation(n_pages)
    bt = np.full((len(lengths), max_pages), -1, np.int32)
    k = np.zeros((len(lengths), max_pages * page_size, HK, D), dtype)
    v = np.zeros_like(k)
    at = 0
    for b, n in enumerate(pages):
        for j in range(n):
            bt[b, j] = order[at]
            at += 1
            k[b, j * page_size:(j + 1) * page_size] = kp[bt[b, j]]
            v[b, j * page_size:(j + 1) * page_size] = vp[bt[b, j]]
    return kp, vp, bt, k, v


def _device():
    return TEST_DEVICE


CASES = {
    "decode": dict(sq=1, lengths=[37, 5, 64], page_size=16),
    "prefill_causal": dict(sq=23, lengths=[23, 40, 9], page_size=8, causal=True),
    "odd_pages_window": dict(sq=7, lengths=[30, 13], page_size=5, causal=True, window=(6, 0)),
    "sinks_softcap": dict(sq=4, lengths=[19, 3], page_size=4, softcap=5.0, sinks=True),
}


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_pages_equal_contiguous_keys(rng, case, dtype):
    opts = dict(CASES[case])
    sq, lengths, page_size = opts.pop("sq"), opts.pop("lengths"), opts.pop("page_size")
    if opts.pop("sinks", False):
        opts["sinks"] = randn(rng, (HQ,), F32)
    kp, vp, bt, k, v = _cache(rng, lengths, page_size, dtype)
    q = randn(rng, (len(lengths), sq, HQ, D), dtype)
    seqlens_k = np.array(lengths)
    device = _device()
    got, lse = attnext.attention(q, kp, vp, block_table=bt, seqlens_k=seqlens_k, return_lse=True,
                                 device=device, **opts)
    want, want_lse = attnext.attention(q, k, v, seqlens_k=seqlens_k, return_lse=True, device=device, **opts)
    if device == "cpu":
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(lse, want_lse)
    ref = attnext.reference.attention(q, kp, vp, block_table=bt, seqlens_k=seqlens_k, **opts)
    assert_close("out", got, ref, np.dtype(dtype))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: np.dtype(d).name)
def test_varlen_over_pages(rng, dtype):
    lengths = [21, 7, 33]
    kp, vp, bt, k, v = _cache(rng, lengths, 8, dtype)
    cu = np.array([0, 6, 7, 19], np.int32)
    q = randn(rng, (19, HQ, D), dtype)
    device = _device()
    got = attnext.varlen_attention(q, kp, vp, cu, None, seqused_k=np.array(lengths), block_table=bt,
                                   causal=True, device=device)
    # the same with cu_seqlens_k giving the lengths, and each sequence on its own contiguous keys
    also = attnext.varlen_attention(q, kp, vp, cu, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                                    block_table=bt, causal=True, device=device)
    np.testing.assert_array_equal(got, also)
    for b in range(3):
        want = attnext.attention(q[None, cu[b]:cu[b + 1]], k[b:b + 1], v[b:b + 1], seqlens_k=np.array(lengths[b:b + 1]),
                                 causal=True, device=device)[0]
        if device == "cpu":
            np.testing.assert_array_equal(got[cu[b]:cu[b + 1]], want)
        assert_close("out", got[cu[b]:cu[b + 1]], np.asarray(want, np.float64), np.dtype(dtype))


def test_page_indices_out_of_range_name_the_entry(rng):
    kp, vp, bt, _, _ = _cache(rng, [20, 9], 8, F32)
    q = randn(rng, (2, 1, HQ, D), F32)
    for bad, value in (((1, 1), kp.shape[0]), ((0, 0), -2)):
        table = bt.copy()
        table[bad] = value
        with pytest.raises(IndexError, match=rf"block_table\[{bad[0]}, {bad[1]}\] = {value} is out of range "
                                             rf"for {kp.shape[0]} pages"):
            attnext.attention(q, kp, vp, block_table=table, seqlens_k=np.array([20, 9]), device="cpu")
    table = bt.copy()
    table[1, 2:] = 10 ** 6              # past sequence 1's two pages: never read, not checked
    attnext.attention(q, kp, vp, block_table=table, seqlens_k=np.array([20, 9]), device="cpu")


def test_bad_tables_and_refusals(rng):
    kp, vp, bt, k, v = _cache(rng, [20, 9], 8, F32)
    q = randn(rng, (2, 3, HQ, D), F32)
    lens = np.array([20, 9])
    with pytest.raises(ValueError, match=r"block_table must be an int array \(B, max_pages\)"):
        attnext.attention(q, kp, vp, block_table=bt[:1], seqlens_k=lens, device="cpu")
    with pytest.raises(ValueError, match="block_table must be an int array"):
        attnext.attention(q, kp, vp, block_table=bt.astype(np.float32), seqlens_k=lens, device="cpu")
    with pytest.raises(ValueError, match=r"k and v are \(num_pages, page_size, Hk, D / Dv\)"):
        attnext.attention(q, kp, vp[:, :4], block_table=bt, seqlens_k=lens, device="cpu")
    with pytest.raises(ValueError, match="exceeds Sk"):
        attnext.attention(q, kp, vp, block_table=bt, seqlens_k=np.array([20, 10 ** 4]), device="cpu")
    with pytest.raises(ValueError, match="layout='bshd'"):
        attnext.attention(q.transpose(0, 2, 1, 3), kp, vp, block_table=bt, layout="bhsd", device="cpu")
    out, lse = attnext.attention(q, kp, vp, block_table=bt, seqlens_k=lens, return_lse=True, device="cpu")
    with pytest.raises(TypeError, match="unexpected keyword argument 'block_table'"):   # forward only
        attnext.attention_backward(out, q, kp, vp, out, lse, block_table=bt, seqlens_k=lens, device="cpu")
    before = bt.copy()
    attnext.attention(q, kp, vp, block_table=bt, seqlens_k=lens, device="cpu")
    np.testing.assert_array_equal(bt, before)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 1, [4000, 1500], 16), (3, 40, [40, 300, 77], 32), (1, 5, [9000], 64)],
                         ids=["decode_split", "prefill", "decode_long_pages"])
def test_pages_on_cuda_tensors(shape, rng, torch):
    from helpers.gpu import run_gpu
    b, sq, lengths, page_size = shape
    kp, vp, bt, _, _ = _cache(rng, lengths, page_size, BF16)
    q = randn(rng, (b, sq, HQ, D), BF16)
    run_gpu(torch, q, kp, vp, backward=False, block_table=bt, seqlens_k=np.array(lengths), causal=True,
            sinks=randn(rng, (HQ,), F32))


@pytest.mark.gpu
def test_pages_with_fewer_threads_than_tile_rows(rng, torch):
    """A decode tile of one warp over 64 keys (the kernel lab's override): each thread looks up
    two rows of a tile."""
    from attnext import _env
    from helpers.gpu import run_gpu
    kp, vp, bt, _, _ = _cache(rng, [3000, 700], 16, BF16)
    q = randn(rng, (2, 1, HQ, D), BF16)
    _env.setenv("ATTNEXT_TILE_DECODE", "16,64,1")
    try:
        run_gpu(torch, q, kp, vp, backward=False, block_table=bt, seqlens_k=np.array([3000, 700]))
    finally:
        _env.setenv("ATTNEXT_TILE_DECODE", None)


@pytest.mark.gpu
def test_cuda_seqlens_k_beside_a_cuda_table(rng, torch):
    """A CUDA int32 seqlens_k beside a CUDA block table is read in place (no synchronisation):
    the same result as host lengths; a length past the table's rows is clamped by the kernels
    and reported by the next call as ValueError naming it."""
    from helpers.gpu import to_gpu, to_host
    lengths = [3000, 700, 1]
    kp, vp, bt, k, v = _cache(rng, lengths, 16, BF16)
    q = randn(rng, (3, 1, HQ, D), BF16)
    tq, tk, tv, tbt = (to_gpu(torch, x) for x in (q, kp, vp, bt))
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    got, lse = attnext.attention(tq, tk, tv, block_table=tbt, seqlens_k=lens, return_lse=True)
    ref, ref_lse = attnext.attention(q, k, v, seqlens_k=np.array(lengths), return_lse=True, device="reference")
    assert_close("out", to_host(torch, got), ref, BF16)
    assert_lse_close(to_host(torch, lse), ref_lse, BF16)
    attnext.attention(tq, tk, tv, block_table=tbt, seqlens_k=torch.tensor([3000, 10 ** 6, 1], dtype=torch.int32,
                                                                              device="cuda"))
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=rf"seqlens_k\[1\] = {10 ** 6} is outside \[0, {bt.shape[1] * 16}\]"):
        attnext.attention(tq, tk, tv, block_table=tbt, seqlens_k=lens)
    attnext.attention(tq, tk, tv, block_table=tbt, seqlens_k=lens)        # once


@pytest.mark.gpu
def test_cuda_block_table_faults_are_reported_by_the_next_call(rng, torch):
    """A CUDA table is checked on the GPU: a page out of range reads nothing outside k and v (the
    kernels clamp it) and the next call raises IndexError naming the entry."""
    from helpers.gpu import to_gpu
    kp, vp, bt, _, _ = _cache(rng, [40, 17], 16, BF16)
    q = randn(rng, (2, 1, HQ, D), BF16)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, kp, vp))
    lens = np.array([40, 17])
    bad = bt.copy()
    bad[1, 1] = 10 ** 6
    attnext.attention(tq, tk, tv, block_table=to_gpu(torch, bad), seqlens_k=lens)
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=rf"block_table\[1, 1\] = {10 ** 6} is out of range"):
        attnext.attention(tq, tk, tv, block_table=to_gpu(torch, bt), seqlens_k=lens)
    attnext.attention(tq, tk, tv, block_table=to_gpu(torch, bt), seqlens_k=lens)       # once
