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


@pytest.mark.parametrize("args, kw, exc, word", [
    ((lambda b, h, q, k: q >= k, -1, 4), {}, ValueError, "Sq"),
    ((lambda b, h, q, k: q >= k, 4, 4.0), {}, ValueError, "Sk"),
    ((lambda b, h, q, k: q >= k, 4, 4), {"B": True}, ValueError, "B"),
    ((lambda b, h, q, k: q >= k, 4, 4), {"block_size": 0}, ValueError, "block_size"),
    (("not a function", 4, 4), {}, TypeError, "mask_mod"),
])
def test_bad_arguments_name_themselves(args, kw, exc, word):
    with pytest.raises(exc, match=word):
        attnext.block_mask(*args, **kw)


def test_empty_sizes():
    bm = attnext.block_mask(lambda b, h, q, k: q >= k, 0, 5)
    assert bm.kinds.shape == (1, 1, 0, 1) and bm.sparsity == 0.0
