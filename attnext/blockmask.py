"""mask_mod's block sparsity, for a notebook: which tiles a mask_mod masks entirely (skipped by the
kernels), keeps entirely (no per-element test) or cuts through.

    bm = attnext.block_mask(mask_mod, Sq, Sk, B=1, H=1)
    print(bm)            # a picture, one character per tile: its density
    bm.sparsity          # the fraction of tiles skipped

The states are those the backends compute for themselves at every call (the CPU's block_mask_build
in csrc/cpu/cpu_impl.h, the GPU's kernels/attn_block_mask.cu): mask_mod is evaluated at every pair
inside the lengths, and a tile is EMPTY when it keeps none, FULL when it keeps all, else PARTIAL.
mask_mod is checked as attention() checks it (its arity, then traced once: the same TypeError for
a function the backends cannot run, or one that returns no bool), then called on NumPy index
arrays as the reference calls it, one row of tiles at a time: memory grows with block_size * Sk,
never Sq * Sk, and a size past the machine's memory is a MemoryError before any work.
"""
from __future__ import annotations

import numpy as np

from .mods import fingerprint, trace
from .checks import check_arity, check_fits, fmt
from .types import MaskMod

EMPTY, PARTIAL, FULL = 0, 1, 2
SHADES = " .:-=+*#%@"          # density 0 (nothing kept) .. 1 (everything kept)


class BlockMask:
    """The tiles of a mask_mod, as attnext.block_mask computes them (attention() builds its own).

    kinds: (B, H, query tiles, key tiles) uint8: EMPTY (0, nothing kept: the kernels skip the
        tile), PARTIAL (1, the mask is evaluated pair by pair) or FULL (2, every pair kept: no
        per-pair test). Query tile i covers q_idx in [i * block_size, (i + 1) * block_size).
    density: the same shape, float64: the fraction of each tile's pairs kept.
    block_size: the tiles' side; Sq, Sk: the lengths it covers.

    repr() shows the shape, the counts and sparsity, and for small masks a picture; .picture(b, h)
    draws one (batch item, head).
    """

    def __init__(self, kinds: np.ndarray, density: np.ndarray, block_size: int, Sq: int,
                 Sk: int) -> None:
        self.kinds, self.density, self.block_size = kinds, density, block_size
        self.Sq, self.Sk = Sq, Sk

    @property
    def sparsity(self) -> float:
        """The fraction of tiles that are EMPTY (skipped, not computed)."""
        return float((self.kinds == EMPTY).mean()) if self.kinds.size else 0.0

    def counts(self) -> dict[str, int]:
        """{"empty": n, "partial": n, "full": n} over every tile."""
        return {name: int((self.kinds == k).sum())
                for name, k in (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}

    def picture(self, b: int = 0, h: int = 0) -> str:
        """The tiles of (b, h) as text, a character per tile from SHADES by density: ' ' skipped,
        '@' every pair kept. b and h count from the end when negative, as NumPy's indices do."""
        for name, i, n in (("b", b, self.kinds.shape[0]), ("h", h, self.kinds.shape[1])):
            if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
                raise TypeError(f"picture: {name} must be an int, got {fmt(i)}")
            if not -n <= i < n:
                raise IndexError(f"picture: {name} = {i} is out of range for "
                                 f"{'B' if name == 'b' else 'H'} = {n}")
        d = self.density[b, h]
        idx = np.minimum((d * (len(SHADES) - 1)).round().astype(int), len(SHADES) - 1)
        idx[(self.kinds[b, h] != EMPTY) & (idx == 0)] = 1        # a kept pair is never blank
        idx[(self.kinds[b, h] != FULL) & (idx == len(SHADES) - 1)] = len(SHADES) - 2
        return "\n".join("|" + "".join(SHADES[i] for i in row) + "|" for row in idx)

    def __repr__(self) -> str:
        B, H, nq, nk = self.kinds.shape
        c = self.counts()
        head = (f"BlockMask(B={B}, H={H}, Sq={self.Sq}, Sk={self.Sk}, block_size={self.block_size}: "
                f"{nq}x{nk} tiles, {c['empty']} empty, {c['partial']} partial, {c['full']} full, "
                f"sparsity {self.sparsity:.1%})")
        return head if nq > 64 or nk > 128 or not B * H else head + "\n" + self.picture()


def _check_size(name, x, least):
    """Sizes as attention() takes lengths: an int (TypeError otherwise, bool included), at least
    `least` (ValueError)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"block_mask: {name} must be an int, got {fmt(x)}")
    if x < least:
        raise ValueError(f"block_mask: {name} must be >= {least}, got {x}")


def block_mask(mask_mod: MaskMod, Sq: int, Sk: int, *, B: int = 1, H: int = 1,
               block_size: int = 64) -> BlockMask:
    """The BlockMask of mask_mod(b, h, q_idx, kv_idx) over b < B, h < H, q_idx < Sq, kv_idx < Sk,
    in block_size x block_size tiles (64: the GPU kernels' cells): which tiles attention() skips.

    mask_mod: mask_mod(b, h, q_idx, kv_idx) -> bool, True = attend; the indices are int64
        (NumPy arrays here, as the reference calls it), written as for attention()'s mask_mod.
    Sq, Sk: the query and key lengths, ints >= 0.
    B, H: the batch items and heads to evaluate (default 1 each: a mask_mod that ignores b, h).
    block_size: the tiles' side, >= 1.

    It is checked as attention() checks it (the same TypeError for a function the backends cannot
    run, or one that returns no bool). Memory grows with block_size * Sk, never Sq * Sk.

        >>> bm = attnext.block_mask(lambda b, h, q, kv: kv <= q, 300, 300)
        >>> bm.sparsity, bm.counts()
        (0.4, {'empty': 10, 'partial': 5, 'full': 10})
    """
    if not callable(mask_mod):
        raise TypeError(f"block_mask: mask_mod must be callable, got {type(mask_mod).__name__}")
    check_arity("mask_mod", mask_mod)
    for name, x in (("Sq", Sq), ("Sk", Sk), ("B", B), ("H", H)):
        _check_size(name, x, 0)
    _check_size("block_size", block_size, 1)
    Sq, Sk, B, H, block_size = (int(x) for x in (Sq, Sk, B, H, block_size))
    nq, nk = -(-Sq // block_size), -(-Sk // block_size)
    rows = min(block_size, Sq)
    check_fits(f"block_mask(Sq={Sq}, Sk={Sk}, B={B}, H={H}, block_size={block_size})", [
        ("density", (B, H, nq, nk), np.float64), ("states", (B, H, nq, nk), np.uint8),
        ("index arrays of a row of tiles", (4, rows, Sk), np.int64),
        ("its mask", (rows, Sk), np.bool_), ("kv_idx and key tiles", (2, Sk), np.int64)])
    trace.trace_mask_mod(mask_mod)
    mask_mod = fingerprint.numpy_views(mask_mod)      # a captured torch CPU tensor as NumPy's view
    density = np.zeros((B, H, nq, nk))
    cols = np.arange(Sk, dtype=np.int64)
    col_tile = cols // block_size
    col_count = np.bincount(col_tile, minlength=nk)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                rows = np.arange(i * block_size, min((i + 1) * block_size, Sq), dtype=np.int64)
                r, c = (x.ravel() for x in np.broadcast_arrays(rows[:, None], cols[None, :]))
                kept = np.asarray(mask_mod(np.full(r.size, b, np.int64),
                                           np.full(r.size, h, np.int64), r, c))
                if kept.dtype != np.bool_ or kept.shape not in ((), (r.size,)):
                    raise TypeError(f"mask_mod must return bool values, one per pair, got "
                                    f"{kept.dtype} of shape {kept.shape} for {r.size} pairs")
                kept = np.broadcast_to(kept, (r.size,)).reshape(rows.size, Sk)
                per_tile = np.bincount(col_tile, weights=kept.sum(axis=0), minlength=nk)
                density[b, h, i] = per_tile / np.maximum(col_count * rows.size, 1)
    kinds = np.full(density.shape, PARTIAL, np.uint8)
    kinds[density == 0] = EMPTY
    kinds[density == 1] = FULL
    return BlockMask(kinds, density, block_size, Sq, Sk)
