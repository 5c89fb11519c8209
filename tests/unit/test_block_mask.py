"""attnext.block_mask: the tile states and densities of a mask_mod against a dense evaluation of
the same function on fresh random inputs, its picture and its argument checks."""
import numpy as np
import pytest

import attnext
from attnext.blockmask import EMPTY, FULL, PARTIAL


def dense(mask_mod, B, H, Sq, Sk):
    b, h, q, k = np.meshgrid(np.arange(B), np.arange(H), np.arange(Sq), np.arange(Sk), indexing="ij")
    out = mask_mod(b.ravel(), h.ravel(), q.ravel(), k.ravel())
    return np.broadcast_to(np.asarray(out, bool), (b.size,)).reshape(B, H, Sq, Sk)


@pytest.mark.parametrize("bs", [16, 64])
def test_states_and_density_match_a_dense_evaluation(bs, rng):
    Sq, Sk = int(rng.integers(1, 200)), int(rng.integers(1, 200))
    doc = np.sort(rng.integers(0, 5, max(Sq, Sk)))
    keep = rng.random((3, Sq, Sk)) < 0.5

    def mask_mod(b, h, q, k):
        return ((doc[q] == doc[k]) & (k <= q + b)) | (keep[h, q, k] & (h == 2))

    bm = attnext.block_mask(mask_mod, Sq, Sk, B=2, H=3, block_size=bs)
    want = dense(mask_mod, 2, 3, Sq, Sk)
    nq, nk = -(-Sq // bs), -(-Sk // bs)
    assert bm.kinds.shape == bm.density.shape == (2, 3, nq, nk)
    for i in range(nq):
        for j in range(nk):
            tile = want[:, :, i * bs:(i + 1) * bs, j * bs:(j + 1) * bs]
            frac = tile.mean(axis=(2, 3))
            np.testing.assert_allclose(bm.density[:, :, i, j], frac)
            kind = np.where(frac == 0, EMPTY, np.where(frac == 1, FULL, PARTIAL))
            np.testing.assert_array_equal(bm.kinds[:, :, i, j], kind)
    assert bm.sparsity == pytest.approx((bm.kinds == EMPTY).mean())
    assert sum(bm.counts().values()) == bm.kinds.size


def test_picture_shows_every_tile_and_its_state(rng):
    S = 64 * int(rng.integers(4, 10)) + int(rng.integers(2, 64))     # no 1 x 1 corner tile
    bm = attnext.block_mask(lambda b, h, q, k: k <= q, S, S)
    n = -(-S // 64)
    rows = bm.picture().splitlines()
    assert len(rows) == n and all(len(r) == n + 2 for r in rows)
    for i, row in enumerate(rows):
        for j, ch in enumerate(row[1:-1]):
            assert (ch == " ") == (j > i)                         # above the diagonal: skipped
            assert (ch == "@") == (j < i)                         # below it: every pair kept
    assert "sparsity" in repr(bm) and "@" in repr(bm)


def _never_called(b, h, q, k):
    raise AssertionError("mask_mod was called: work started before the arguments were refused")


CAUSAL = lambda b, h, q, k: q >= k       # noqa: E731


@pytest.mark.parametrize("args, kw, exc, word", [
    # sizes: a wrong type is a TypeError (DESIGN, Errors; attention() refuses max_seqlen_q=4.0
    # and True alike), a wrong value a ValueError
    ((CAUSAL, -1, 4), {}, ValueError, "Sq"),
    ((CAUSAL, 4, -3), {}, ValueError, "Sk"),
    ((CAUSAL, 4.0, 4), {}, TypeError, "Sq"),
    ((CAUSAL, "4", 4), {}, TypeError, "Sq"),
    ((CAUSAL, 4, 4.0), {}, TypeError, "Sk"),
    ((CAUSAL, 4, np.array([4])), {}, TypeError, "Sk"),
    ((CAUSAL, 4, 4), {"B": True}, TypeError, "B"),
    ((CAUSAL, 4, 4), {"H": 2.0}, TypeError, "H"),
    ((CAUSAL, 4, 4), {"H": -1}, ValueError, "H"),
    ((CAUSAL, 4, 4), {"block_size": 0}, ValueError, "block_size"),
    ((CAUSAL, 4, 4), {"block_size": 16.0}, TypeError, "block_size"),
    ((CAUSAL, 4, 4), {"block_size": "64"}, TypeError, "block_size"),
    # mask_mod: not callable, or of the wrong arity (attention()'s own check)
    (("not a function", 4, 4), {}, TypeError, "mask_mod"),
    ((lambda b, h, q: q >= 0, 4, 4), {}, TypeError, r"mask_mod must take 4 arguments"),
    ((lambda s, b, h, q, k: q >= k, 4, 4), {}, TypeError, r"mask_mod must take 4 arguments"),
    ((np.less, 4, 4), {}, TypeError, r"mask_mod must take 4 arguments.*ufunc less takes 2"),
    ((int, 4, 4), {}, TypeError, r"mask_mod must take 4 arguments"),
])
def test_bad_arguments_name_themselves(args, kw, exc, word):
    with pytest.raises(exc, match=word):
        attnext.block_mask(*args, **kw)


@pytest.mark.parametrize("returns", [
    lambda b, h, q, k: None,
    lambda b, h, q, k: q * 0.5,
    lambda b, h, q, k: q - k,
    lambda b, h, q, k: np.ones(3, bool),
    lambda b, h, q, k: 1,
], ids=["none", "float", "int", "array", "int_constant"])
def test_a_mask_mod_returning_no_bool_is_refused_as_attention_refuses_it(returns, rng):
    """None used to make every tile empty, and q * 0.5 every nonzero pair kept."""
    q, k, v = (rng.standard_normal((1, 4, 1, 8)).astype(np.float32) for _ in range(3))
    with pytest.raises(TypeError, match="mask_mod") as want:
        attnext.attention(q, k, v, mask_mod=returns, device="cpu")
    with pytest.raises(TypeError) as got:
        attnext.block_mask(returns, 4, 4)
    assert str(got.value) == str(want.value)


def test_a_mask_mod_that_gives_arrays_other_values_than_the_tracer_is_refused():
    """Traced, it returns a bool; called on index arrays, floats: the tiles would be wrong."""
    from attnext.mods.trace import Proxy

    def two_faced(b, h, q, k):
        return q >= k if isinstance(q, Proxy) else q * 0.5

    with pytest.raises(TypeError, match=r"mask_mod must return bool values.*float64"):
        attnext.block_mask(two_faced, 8, 8)


@pytest.mark.parametrize("sizes", [
    dict(Sq=2 ** 40, Sk=2 ** 40, block_size=1),
    dict(Sq=2 ** 20, Sk=2 ** 40),
    dict(Sq=1, Sk=1, B=2 ** 40, H=2 ** 40),
    dict(Sq=2 ** 62, Sk=2 ** 62, B=2 ** 62, H=2 ** 62, block_size=1),
])
def test_sizes_past_memory_are_refused_before_any_work(sizes):
    kw = {n: sizes[n] for n in ("B", "H", "block_size") if n in sizes}
    with pytest.raises(MemoryError, match=r"block_mask\(Sq=.*GiB.*more than this machine's memory"):
        attnext.block_mask(_never_called, sizes["Sq"], sizes["Sk"], **kw)


@pytest.mark.parametrize("kw, exc, word", [
    (dict(b=99), IndexError, r"\bb = 99 is out of range for B = 2"),
    (dict(b=-3), IndexError, r"\bb = -3 is out of range"),
    (dict(h=3), IndexError, r"\bh = 3 is out of range for H = 3"),
    (dict(b=1.0), TypeError, r"\bb must be an int, got 1.0"),
    (dict(h="0"), TypeError, r"\bh must be an int"),
    (dict(h=True), TypeError, r"\bh must be an int"),
])
def test_picture_of_a_missing_head_names_the_index(kw, exc, word):
    bm = attnext.block_mask(lambda b, h, q, k: k <= q + b + h, 70, 70, B=2, H=3)
    with pytest.raises(exc, match=word):
        bm.picture(**kw)


def test_picture_counts_negative_indices_from_the_end():
    bm = attnext.block_mask(lambda b, h, q, k: k <= q + 64 * (b + h), 200, 200, B=2, H=3)
    assert bm.picture(-1, -1) == bm.picture(1, 2) != bm.picture(0, 0)
    assert bm.picture(-2, -3) == bm.picture(0, 0)


def test_empty_sizes():
    bm = attnext.block_mask(lambda b, h, q, k: q >= k, 0, 5)
    assert bm.kinds.shape == (1, 1, 0, 1) and bm.sparsity == 0.0


@pytest.mark.parametrize("B, H", [(0, 1), (1, 0), (0, 0)])
def test_repr_of_no_heads(B, H):
    bm = attnext.block_mask(lambda b, h, q, k: q >= k, 5, 5, B=B, H=H)
    assert bm.kinds.shape == (B, H, 1, 1)
    assert repr(bm).startswith(f"BlockMask(B={B}, H={H},") and "\n" not in repr(bm)
