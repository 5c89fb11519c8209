"""score_mod / mask_mod on the GPU (`pytest -m gpu`): the code generator's kernels (codegen.py)
against the float64 reference, on torch CUDA tensors (float16, bfloat16).

The zoo of tests/mods.py forward and backward with the array gradients (dtensors), the built-in
options combined with them, varlen (b is the sequence), lookups out of range (IndexError through
the device error record; nothing observable where a mask removes the pair), bit-identical
reruns of the backward, and the kernel cache: two different functions get two kernels, the same
function defined twice shares one, a sweep over a float constant compiles once.
"""
import numpy as np
import pytest

import attnext
from attnext.cuda import mod_cache, nvrtc, select
from conftest import BF16, F16, make_qkv, make_varlen_qkv, randn

from helpers import mods
from helpers.gpu import run_gpu, to_gpu, to_host
from test_score_mod import COMBOS

pytestmark = pytest.mark.gpu

S, H = mods.S_MAX, mods.H_MAX
DTYPES = [F16, BF16]


# --- the zoo ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("name", sorted(mods.score_mods()))
def test_score_mod_zoo(name, dtype, rng, torch):
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 64, 64, dtype)
    run_gpu(torch, q, k, v, score_mod=mods.score_mods()[name])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("name", sorted(mods.mask_mods()))
def test_mask_mod_zoo(name, dtype, rng, torch):
    q, k, v = make_qkv(rng, 2, S, 11, H, 1, 64, 64, dtype)
    run_gpu(torch, q, k, v, mask_mod=mods.mask_mods()[name])


@pytest.mark.parametrize("d", [59, 128], ids=["d59", "d128"])
def test_odd_and_wgmma_head_dims(d, rng, torch):
    """Element loads (D = 59) and, on Hopper, the wgmma kernels (D = 128)."""
    q, k, v = make_qkv(rng, 2, S, S, H, 2, d, d, BF16)
    run_gpu(torch, q, k, v, score_mod=mods.score_mods()["softcap_alibi_rel"],
            mask_mod=mods.mask_mods()["document_causal"])


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_combined_with_builtin_options(combo, rng, torch):
    spec = dict(COMBOS[combo])
    score_mod = mods.score_mods()[spec.pop("score")]
    mask_mod = mods.mask_mods()[spec.pop("mask_mod")] if "mask_mod" in spec else None
    layout = spec.pop("layout", "bshd")
    q, k, v = make_qkv(rng, 2, 15, S, H, 2, 64, 64, F16, layout)
    opts = dict(score_mod=score_mod, mask_mod=mask_mod, layout=layout)
    if spec.pop("bias", False):
        opts["bias"] = randn(rng, (2, 1, 15, S), np.float32)
    if spec.pop("bool_mask", False):
        opts["mask"] = rng.random((15, S)) < 0.8
    if spec.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.1, 0.5, H).astype(np.float32)
    opts.update(spec)
    run_gpu(torch, q, k, v, **opts)


def test_longer_sequences_cross_tiles(rng, torch):
    """Several query and key tiles (full, partial and masked ones), GQA, a table over the
    relative position of every pair, with its gradient."""
    sq, sk = 300, 263
    table = rng.standard_normal((4, sq + sk + 1)).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s + table[h, qi - ki + sk] * 0.5

    doc = np.repeat(np.arange(6), [64, 64, 30, 40, 2, 100])
    doc_k = np.concatenate([doc[:sk], np.full(max(0, sk - doc.size), 9)])

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc_k[ki]) | (ki < 5)

    q, k, v = make_qkv(rng, 1, sq, sk, 4, 2, 64, 64, BF16)
    run_gpu(torch, q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    run_gpu(torch, q, k, v, score_mod=score_mod, causal=True)


@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (128, 64), (64, 128)],
                         ids=["d64", "d128", "d128_dv64", "d64_dv128"])
def test_long_rows_take_the_long_forward_tiles(d, dv, rng, torch):
    """Past select.SM90_SHORT_ROWS query rows a score_mod takes the 128 x 64 forward tile on
    Hopper, except at D = 64, Dv = 128, where its staged output would not fit (128 x 128)."""
    q, k, v = make_qkv(rng, 1, 1100, 1100, 2, 1, d, dv, BF16)
    run_gpu(torch, q, k, v, score_mod=mods.score_mods()["softcap"], causal=True)


@pytest.mark.parametrize("d", [64, 128])
def test_narrowed_key_blocks_add_dq_in_order(d, rng, torch):
    """D = 128 (64-row query tiles) and D = 64 (128-row ones): on Hopper the dK/dV kernel adds dQ
    (select.bwd_dq_mode) while a mask_mod's block mask takes query tiles off each key block's ends; in the ordered mode those tiles' turns pass
    at once (a bit per key block), so a rerun gives the same bits, and deterministic=False the
    same values within rounding. Masks with and without keys every query sees."""
    doc = np.repeat(np.arange(5), [150, 10, 260, 200, 80])
    masks = {"doc": lambda b, h, qi, ki: doc[qi] == doc[ki],
             "doc_global": lambda b, h, qi, ki: (doc[qi] == doc[ki]) | (ki < 5)}
    q, k, v = make_qkv(rng, 2, 700, 700, 4, 2, d, d, BF16)
    for name, mask_mod in masks.items():
        g = run_gpu(torch, q, k, v, mask_mod=mask_mod).grads
        tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
        t_out, t_lse = attnext.attention(tq, tk, tv, mask_mod=mask_mod, return_lse=True)
        dout = to_gpu(torch, randn(rng, q.shape, BF16))
        runs = [attnext.attention_backward(dout, tq, tk, tv, t_out, t_lse, mask_mod=mask_mod,
                                           deterministic=det) for det in (True, True, False)]
        first, again, unordered = ([to_host(torch, x).astype(np.float32) for x in r[:3]] for r in runs)
        assert all(np.array_equal(a, b) for a, b in zip(first, again)), name
        for a, b in zip(first, unordered):
            np.testing.assert_allclose(b, a, rtol=0, atol=2e-2 * float(np.abs(a).max()), err_msg=name)


def test_varlen_b_is_the_sequence(rng, torch):
    cu_q, cu_k = np.array([0, 9, 9, 25, 30], np.int32), np.array([0, 14, 14, 30, 46], np.int32)
    used_q, used_k = np.array([7, 0, 16, 5], np.int32), np.array([12, 0, 16, 11], np.int32)
    q, k, v = make_varlen_qkv(rng, 33, 48, H, 2, 64, 64, F16)
    table = rng.standard_normal((4, 2 * S + 1))
    doc = mods.DOC_ID

    def score_mod(s, b, h, qi, ki):
        return s + table[b, qi - ki + S] * (h + 1) * 0.5

    def mask_mod(b, h, qi, ki):
        return (ki <= qi + b) | (doc[qi] == doc[ki])

    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
    g = run_gpu(torch, q, k, v, varlen=varlen, score_mod=score_mod, mask_mod=mask_mod).grads
    assert (g.dq[30:] == 0).all() and (g.dk[[12, 13, 41, 42]] == 0).all()


# --- block sparsity -----------------------------------------------------------------------------
# Lengths of several 64-pair cells and kernel tiles, so mask_mod's block mask has empty tiles at
# the ends of a tile's range (skipped), empty ones between kept ones, full tiles (no per-element
# test) and partial ones; every result against the reference.

# 700 positions, uneven documents; the ids repeat (0 1 2 0 1), so these masks stay mask_mods with
# block masks (a document mask over contiguous runs runs as varlen: tests/test_band.py)
DOCS = np.repeat(np.arange(5) % 3, [70, 200, 64, 1, 365])


def _doc_causal(b, h, qi, ki):
    return (DOCS[qi] == DOCS[ki]) & (ki <= qi)


def _global_and_window(b, h, qi, ki):
    return (ki < 8) | (np.abs(qi - ki) < 64)        # tiles between the first and the band: empty


@pytest.mark.parametrize("d", [59, 64, 128], ids=["d59", "d64", "d128"])
@pytest.mark.parametrize("mask", ["doc_causal", "global_and_window"])
def test_block_sparse_masks(mask, d, rng, torch):
    mask_mod = {"doc_causal": _doc_causal, "global_and_window": _global_and_window}[mask]
    q, k, v = make_qkv(rng, 1, 700, 700, 2, 1, d, d, BF16)
    run_gpu(torch, q, k, v, mask_mod=mask_mod)


def test_block_sparse_with_causal_window_and_score_mod(rng, torch):
    """mask_mod's tiles beside the built-in band (causal, window), with a score_mod reading a table."""
    table = rng.standard_normal(1400).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s + table[qi - ki + 700] * 0.25

    q, k, v = make_qkv(rng, 2, 600, 700, 2, 2, 128, 128, BF16)
    run_gpu(torch, q, k, v, mask_mod=_doc_causal, causal=True)
    run_gpu(torch, q, k, v, mask_mod=_global_and_window, window=(300, 0), score_mod=score_mod)


def test_block_sparse_per_head_under_gqa(rng, torch):
    """A mask_mod reading h: one block mask per query head; the dK/dV kernels take the union of
    the group's heads."""
    def mask_mod(b, h, qi, ki):
        return np.abs(qi - ki) <= 40 * (h + 1) + (h == 3) * 1000

    for d in (64, 128):
        q, k, v = make_qkv(rng, 1, 520, 520, 4, 2, d, d, F16)
        run_gpu(torch, q, k, v, mask_mod=mask_mod)


def test_block_sparse_varlen_per_sequence(rng, torch):
    """varlen: one block mask per sequence (b is the sequence; lengths differ), padding rows 0."""
    cu_q, cu_k = np.array([0, 300, 300, 710], np.int32), np.array([0, 260, 260, 760], np.int32)
    used_q = np.array([290, 0, 400], np.int32)

    def mask_mod(b, h, qi, ki):
        span = 100 + b * 40
        return (qi // span == ki // span) | (ki == 0)

    q, k, v = make_varlen_qkv(rng, 720, 770, 2, 2, 128, 128, BF16)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q)
    g = run_gpu(torch, q, k, v, varlen=varlen, mask_mod=mask_mod).grads
    assert (g.dq[290:300] == 0).all() and (g.dq[700:] == 0).all()


def test_block_sparse_decode_and_everything_or_nothing(rng, torch):
    """Few query rows against many keys (split-KV), interior empty key tiles; a mask_mod that
    keeps nothing (zeros, no NaN) and one that keeps everything (the plain result)."""
    q, k, v = make_qkv(rng, 2, 5, 900, 4, 2, 128, 128, BF16)
    run_gpu(torch, q, k, v, mask_mod=lambda b, h, qi, ki: ki % 256 < 100)
    q, k, v = make_qkv(rng, 1, 300, 330, 2, 2, 64, 64, BF16)
    g = run_gpu(torch, q, k, v, mask_mod=lambda b, h, qi, ki: ki < 0).grads
    assert not any(np.any(x) for x in g[:3])
    run_gpu(torch, q, k, v, mask_mod=lambda b, h, qi, ki: ki >= 0, causal=True)


def test_block_mask_kept_across_calls_follows_the_captured_array(rng, torch):
    """A call's block mask serves the next calls with the same mask_mod (mod_cache), and a
    captured array changed in place between calls gives the new mask; a call whose mask_mod
    looks up out of range raises every time (its mask is not kept)."""
    docs = DOCS.copy()

    def mask_mod(b, h, qi, ki):
        return (docs[qi] == docs[ki]) & (ki <= qi)

    q, k, v = make_qkv(rng, 1, 700, 700, 2, 1, 128, 128, BF16)
    hits = mod_cache.info()["block_masks"]["hits"]
    run_gpu(torch, q, k, v, mask_mod=mask_mod)
    run_gpu(torch, q, k, v, mask_mod=mask_mod)
    assert mod_cache.info()["block_masks"]["hits"] >= hits + 3    # backward, forward, backward
    docs[:] = np.repeat(np.arange(3) % 2, [300, 100, 300])
    run_gpu(torch, q, k, v, mask_mod=mask_mod)
    flags = np.ones(600, bool)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    for _ in range(2):
        with pytest.raises(IndexError, match="'flags'"):
            attnext.attention(tq, tk, tv, mask_mod=lambda b, h, qi, ki: flags[qi] & flags[ki])


def test_dtensor_sums_on_the_device_are_the_host_rule(rng, torch):
    """kernels/attn_dtensors.cu against codegen.limbs_to_float, bit for bit: limbs of both signs
    and any size (carries, negative totals, the last limb's rounding), and the flags."""
    from attnext.cuda import backend as cuda_backend, staging
    from attnext.mods import codegen
    n = 4096
    limbs = rng.integers(-2 ** 40, 2 ** 40, (n, codegen.LIMBS))
    limbs[: n // 4, 6:] = 0                                   # small sums
    limbs[n // 4: n // 2, -1] = rng.integers(-2 ** 62, 2 ** 62, n // 4)
    words = np.zeros((n, codegen.WORDS), np.uint64)
    words[:, :codegen.LIMBS] = limbs.view(np.uint64)
    words[-8:, -1] = [1, 2, 4, 6, 3, 5, 7, 0]
    with staging.Staging(0, 0) as stage:
        sums = np.zeros(n, np.float64)
        stage.download(cuda_backend._dtensor_sums(stage, stage.upload(words)), sums)
    want = codegen.limbs_to_float(words)
    assert np.array_equal(sums.view(np.uint64), want.view(np.uint64))


# --- lookups out of range -----------------------------------------------------------------------

def test_lookup_out_of_range_raises_index_error(rng, torch):
    q, k, v = (to_gpu(torch, x) for x in make_qkv(rng, 1, 10, 12, 2, 2, 64, 64, F16))
    table = rng.standard_normal(5)

    def score_mod(s, b, h, qi, ki):
        return s + table[ki]

    # the GPU names the first out-of-range lookup a thread records (any of 5..11 here), the
    # reference the first in row order
    with pytest.raises(IndexError, match=r"score_mod: index ([5-9]|1[01]) is out of bounds for axis 0 of "
                                         r"array 'table' with size 5"):
        attnext.attention(q, k, v, score_mod=score_mod)
    out, lse = attnext.attention(q, k, v, return_lse=True)
    with pytest.raises(IndexError, match="'table'"):
        attnext.attention_backward(torch.ones_like(out), q, k, v, out, lse, score_mod=score_mod)
    flags = np.ones(10, dtype=bool)
    with pytest.raises(IndexError, match=r"mask_mod: index 1\d .* array 'flags' with size 10"):
        attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: flags[ki])
    attnext.attention(q, k, v)          # the library stays usable


def test_lookup_out_of_range_only_where_masked_is_not_observable(rng, torch):
    q, k, v = make_qkv(rng, 1, 10, 12, 2, 2, 64, 64, F16)
    table = rng.standard_normal(5)
    run_gpu(torch, q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[ki],
            mask_mod=lambda b, h, qi, ki: ki < 5)
    run_gpu(torch, q, k, v, score_mod=lambda s, b, h, qi, ki: s * table[qi - ki - 2],
            causal=True, window=(2, 0))


# --- determinism --------------------------------------------------------------------------------

def test_backward_is_bit_identical_run_to_run(rng, torch):
    """The array gradients are integer sums on the device: the same bits whatever order the
    threads add in (a table read twice per pair, many pairs per element)."""
    sq = 150
    q, k, v = (to_gpu(torch, x) for x in make_qkv(rng, 2, sq, sq, 4, 4, 64, 64, BF16))
    table = rng.standard_normal((4, 2 * sq + 1)).astype(np.float32)

    def sm(s, b, h, qi, ki):
        return s * table[h, qi] + table[h, qi - ki + sq]

    out, lse = attnext.attention(q, k, v, score_mod=sm, return_lse=True)
    dout = torch.randn_like(out)
    runs = [attnext.attention_backward(dout, q, k, v, out, lse, score_mod=sm) for _ in range(3)]
    for g in runs[1:]:
        assert np.array_equal(g.dtensors["table"], runs[0].dtensors["table"])
        assert torch.equal(g.dq, runs[0].dq) and torch.equal(g.dk, runs[0].dk)


# --- the kernel cache ---------------------------------------------------------------------------

def _lookups():
    """Cubins that had to be produced (compiled now or read from the disk cache): a kernel this
    process had not built yet."""
    info = nvrtc.cache_info()
    return info["compiles"] + info["disk_hits"]


def test_cache_two_different_lambdas_get_two_kernels(rng, torch):
    q, k, v = (to_gpu(torch, x) for x in make_qkv(rng, 1, 8, 8, 1, 1, 64, 64, F16))
    attnext.attention(q, k, v)
    before = _lookups()
    attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + qi * 7919)
    attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + ki * 7919)
    assert _lookups() == before + 2


def test_cache_the_same_function_defined_twice_shares_one(rng, torch):
    q, k, v = (to_gpu(torch, x) for x in make_qkv(rng, 1, 8, 8, 1, 1, 64, 64, F16))

    def first(s, b, h, qi, ki):
        return s - (qi - ki) % 7907

    def second(s, b, h, qi, ki):
        return s - (qi - ki) % 7907

    before = _lookups()
    a = attnext.attention(q, k, v, score_mod=first)
    b = attnext.attention(q, k, v, score_mod=second)
    assert _lookups() == before + 1
    assert torch.equal(a, b)


def test_cache_a_float_sweep_compiles_once(rng, torch):
    q, k, v = (to_gpu(torch, x) for x in make_qkv(rng, 1, 8, 8, 1, 1, 64, 64, F16))
    counts = []
    for c in np.linspace(0.25, 7.0, 6):
        def sm(s, b, h, qi, ki):
            return s * c - 7901.5
        out, lse = attnext.attention(q, k, v, score_mod=sm, return_lse=True)
        attnext.attention_backward(torch.ones_like(out), q, k, v, out, lse, score_mod=sm)
        want = attnext.attention(q, k, v, scale=float(c) / 8.0)     # s * c - const: softmax of s * c
        counts.append(_lookups())
        assert torch.allclose(out.float(), want.float(), atol=2e-3, rtol=2e-3)
    assert len(set(counts)) == 1, counts
