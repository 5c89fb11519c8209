"""The dQ kernels' tile sums of the array gradients on the GPU (`pytest -m gpu`): lookups whose
indices are affine in q_idx and kv_idx (codegen.affine) summed per tile in shared memory before
the accumulator (attn_mods.cuh: mod_tile).

Every case against the float64 reference (test_score_mod_cuda.run_gpu) and, bit for bit,
against the same call with ATTNEXT_TILE_SUMS=0 (every adjoint straight to the accumulator: the
sums are integers, so the words are the same). The reference differentiates the tables one
element at a time over every pair: tables of a few hundred elements, one or two sequences and
heads. The cases: lengths that are no multiple of the tiles,
causal and not, varlen, GQA, a table counted from the end (negative coefficients), forms that
fit the slots and one that does not, two lookups of one array, CTAs that take the sums beside
CTAs that do not, a table the bounds prove in range (the kernels then have no loop without the
sums), a lookup out of range (IndexError), and reruns.
"""
import numpy as np
import pytest

import attnext
from conftest import BF16, F16, entry_points, make_qkv, make_varlen_qkv, randn

from helpers.gpu import run_gpu, to_gpu, to_host

pytestmark = pytest.mark.gpu


def both_ways(torch, monkeypatch, q, k, v, *, varlen=None, **opts):
    """run_gpu with the sums (against the reference), then the same call without them
    (ATTNEXT_TILE_SUMS=0, run_gpu's dout): the same bits."""
    with_sums = run_gpu(torch, q, k, v, varlen=varlen, **opts).grads
    monkeypatch.setenv("ATTNEXT_TILE_SUMS", "0")
    fwd, bwd, _, _ = entry_points(varlen)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    lengths = {n: to_gpu(torch, x) for n, x in (varlen or {}).items()}
    out, lse = fwd(tq, tk, tv, return_lse=True, **lengths, **opts)
    dout = randn(np.random.default_rng(5), tuple(out.shape), np.dtype(q.dtype))
    direct = bwd(to_gpu(torch, dout), tq, tk, tv, out, lse, **lengths, **opts)
    monkeypatch.delenv("ATTNEXT_TILE_SUMS")
    assert sorted(with_sums.dtensors) == sorted(direct.dtensors)
    for name in direct.dtensors:
        assert np.array_equal(with_sums.dtensors[name], direct.dtensors[name]), name
    for a, b in zip(with_sums[:3], direct[:3]):
        assert np.array_equal(a, to_host(torch, b))
    return with_sums


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [59, 64, 128], ids=["d59", "d64", "d128"])
def test_relative_bias_table(d, causal, rng, torch, monkeypatch):
    """The relbias row's lookup over partial tiles at both ends, GQA; D = 59 runs attn_bwd.cu's
    dQ kernel, 64 and 128 attn_bwd_sm90.cu's on Hopper."""
    sq, sk = 150, 133
    table = rng.standard_normal((2, sq + sk + 1)).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s + table[h, qi - ki + sk]

    q, k, v = make_qkv(rng, 1, sq, sk, 2, 1, d, d, BF16)
    both_ways(torch, monkeypatch, q, k, v, score_mod=score_mod, causal=causal)


def test_a_table_the_bounds_prove_in_range(rng, torch, monkeypatch):
    """A table over every difference the call's extents allow (they round up to 128 rows and
    columns): select.tile_sums says every tile takes the sums, and the kernels compile no loop
    without them."""
    sq = sk = 200
    table = rng.standard_normal((2, 2 * 256 + 1)).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s * 0.5 + table[h, qi - ki + 256]

    q, k, v = make_qkv(rng, 1, sq, sk, 2, 2, 128, 128, F16)
    both_ways(torch, monkeypatch, q, k, v, score_mod=score_mod, causal=True)


FORMS = {
    "rows": lambda t: lambda s, b, h, qi, ki: s * t[h, qi],
    "columns": lambda t: lambda s, b, h, qi, ki: s + t[h, ki] * 0.25,
    # (times s: a term that is one constant per row has the gradient sum_j dS_ij = 0, which only
    # the rounding of out to bf16 in delta moves)
    "from_the_end": lambda t: lambda s, b, h, qi, ki: s + t[h, -1 - qi] * s,
    "per_head": lambda t: lambda s, b, h, qi, ki: s + t[h, 3] * s,
    "two_q_minus_kv": lambda t: lambda s, b, h, qi, ki: s + t[h, 2 * qi - ki + 150],   # past the slots
    "two_lookups": lambda t: lambda s, b, h, qi, ki: s * t[h, qi] + t[h, qi - ki + 150],
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_affine_forms(form, causal, rng, torch, monkeypatch):
    sq, sk = 130, 150
    table = rng.standard_normal((2, 3 * 150)).astype(np.float32)
    q, k, v = make_qkv(rng, 1, sq, sk, 2, 2, 64, 64, BF16)
    both_ways(torch, monkeypatch, q, k, v, score_mod=FORMS[form](table), causal=causal)


def test_a_scalar_array(rng, torch, monkeypatch):
    w = np.array(0.75, np.float32)
    q, k, v = make_qkv(rng, 2, 100, 90, 2, 2, 128, 128, BF16)
    both_ways(torch, monkeypatch, q, k, v, score_mod=lambda s, b, h, qi, ki: s * w)


def test_ctas_with_and_without_the_sums(rng, torch, monkeypatch):
    """table[q - kv] counts negative differences from the end: the CTAs whose rows are all at or
    past the keys take the sums, the others (their differences straddle 0) do not."""
    sq, sk = 320, 100
    table = rng.standard_normal(sq).astype(np.float32)
    q, k, v = make_qkv(rng, 1, sq, sk, 1, 1, 128, 128, BF16)
    both_ways(torch, monkeypatch, q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[qi - ki])


def test_varlen(rng, torch, monkeypatch):
    """b is the sequence (the table's row), lengths of every kind, rows past the last sequence."""
    cu_q, cu_k = np.array([0, 9, 9, 95, 130], np.int32), np.array([0, 14, 14, 90, 160], np.int32)
    used_q, used_k = np.array([7, 0, 80, 35], np.int32), np.array([12, 0, 70, 66], np.int32)
    q, k, v = make_varlen_qkv(rng, 133, 162, 2, 1, 128, 128, F16)
    table = rng.standard_normal((4, 2 * 100 + 1)).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s + table[b, qi - ki + 100] * (h + 1) * 0.5

    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
    both_ways(torch, monkeypatch, q, k, v, varlen=varlen, score_mod=score_mod, causal=True)


def test_lookup_out_of_range_raises_index_error(rng, torch):
    """An affine lookup past its table: the tiles that reach past it take no sums, their lookups
    clamp and the call raises."""
    q, k, v = (to_gpu(torch, x) for x in make_qkv(rng, 1, 130, 130, 2, 2, 64, 64, F16))
    table = rng.standard_normal((2, 200)).astype(np.float32)

    def score_mod(s, b, h, qi, ki):
        return s + table[h, qi - ki + 100]

    out, lse = attnext.attention(q, k, v, return_lse=True)
    with pytest.raises(IndexError, match=r"score_mod: index .* out of bounds for axis 1 of array 'table' "
                                         r"with size 200"):
        attnext.attention_backward(torch.ones_like(out), q, k, v, out, lse, score_mod=score_mod)
    attnext.attention(q, k, v)          # the library stays usable


def test_reruns_are_bit_identical(rng, torch):
    sq = 257
    q, k, v = (to_gpu(torch, x) for x in make_qkv(rng, 2, sq, sq, 4, 4, 128, 128, BF16))
    table = rng.standard_normal((4, 2 * sq + 1)).astype(np.float32)

    def sm(s, b, h, qi, ki):
        return s * table[h, qi] + table[h, qi - ki + sq]

    out, lse = attnext.attention(q, k, v, score_mod=sm, return_lse=True, causal=True)
    dout = torch.randn_like(out)
    runs = [attnext.attention_backward(dout, q, k, v, out, lse, score_mod=sm, causal=True) for _ in range(3)]
    for g in runs[1:]:
        assert np.array_equal(g.dtensors["table"], runs[0].dtensors["table"])
        assert torch.equal(g.dq, runs[0].dq)
