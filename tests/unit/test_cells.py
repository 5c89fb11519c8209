"""mod_mask_cell (attnext/codegen.py, kernels/attn_mods.cuh's block-mask cells) without a GPU:
mask_mod over a whole cell of pairs by intervals, which kernels/attn_block_mask.cu asks before
evaluating a cell pair by pair. Built as host C (helpers/host_c.py) and run over
random cells of helpers/mods.py's mask_mods and more: its answer always covers what the pairs
give (a cell it settles is settled right), a cell where a checked lookup may leave its array is
left to the pairs (which report it), and it settles the cells a document, causal or window mask
should settle."""
import numpy as np
import pytest

from attnext.mods import codegen, trace

from helpers import mods
from helpers.host_c import BOTH, CELL_HARNESS, bind, build, random_cells, run_cells, with_facts

DOC = mods.DOC_ID
SHORT = np.arange(mods.S_MAX - 4)            # doc-like, 4 short: lookups past its end
FLOATS = np.linspace(-1.0, 1.0, mods.S_MAX)


def extra_masks():
    """Ops the zoo lacks: integer rules over intervals, unknowns (pow, bitwise ints, floats),
    negative indices, a float array, lookups that may leave their array."""
    return {
        "int_rules": lambda b, h, q, k: ((q - k) // 3 + abs(k - 2 * q) % 4 - np.minimum(q, k) * 2
                                         + np.maximum(-q, k - 9) >= -h),
        "where_cast": lambda b, h, q, k: np.where(q > k, (q >= 3) * 5, -(k // 2)) + (q == k) > 1,
        "unknowns": lambda b, h, q, k: ((q ** 2) % 7 > (k ^ 3)) | (k * 0.5 > q - 3.2),
        "negative_index": lambda b, h, q, k: DOC[-1 - q] == DOC[k - mods.S_MAX],
        "float_lookup": lambda b, h, q, k: (FLOATS[k] > FLOATS[q]) & (q != k + 1),
        "may_leave": lambda b, h, q, k: SHORT[q] >= SHORT[k],
        "mod_negative": lambda b, h, q, k: ((k - q) % -3 == -1) | ((q + k) // -4 < -3),
        "divisor_ranges": lambda b, h, q, k: ((q % (k + 1) == k) | ((q - 7) % (-1 - k % 3) == -(k % 3))
                                              | ((q * 3 - 20) // (k % 4 + 1) == 2)),
        "floordiv_ranges": lambda b, h, q, k: ((q + 1) // (k + 1) == 0) ^ ((q - 8) // (k - 20) >= 1),
    }


def zoo():
    return {**mods.mask_mods(), **extra_masks()}


@pytest.mark.parametrize("facts", [False, True], ids=["checked", "facts"])
@pytest.mark.parametrize("name", sorted(zoo()))
def test_a_cell_covers_its_pairs(name, facts, cc, tmp_path, rng):
    t = trace.trace_mask_mod(zoo()[name])
    gen, bound = with_facts(None, t) if facts else (codegen.generate(None, t), None)
    bound = bound if facts else bind(t, gen, "mask_mod")
    exe = build(cc, tmp_path, gen, CELL_HARNESS)
    cells = random_cells(rng, 400)
    got, pairs, bad = run_cells(exe, tmp_path, gen, bound, cells, t.params)
    assert ((got & pairs) == pairs).all(), [(c, g, p) for c, g, p in zip(cells, got, pairs) if g & p != p][:5]
    assert (got[bad] == BOTH).all(), "a cell with a lookup out of range is left to its pairs"
    if name == "may_leave":
        assert bad.any() and (got[~bad] != BOTH).any()


def test_cells_settle_document_causal_and_window_masks(cc, tmp_path):
    """Over a 4096-token document-causal mask in 64 x 64 cells, only the cells a document edge
    or the diagonal crosses are left to the pairs; the others are settled, right."""
    S, cell = 4096, 64
    lens = [700, 1300, 64, 1032, 1000]
    doc = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    masks = {"doc_causal": lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q),
             "window": lambda b, h, q, k: (k <= q) & (q - k < 300)}
    n = S // cell
    cells = [(0, 0, i * cell, i * cell + cell - 1, j * cell, j * cell + cell - 1) for i in range(n) for j in range(n)]
    for name, fn in masks.items():
        t = trace.trace_mask_mod(fn)
        gen = codegen.generate(None, t)
        exe = build(cc, tmp_path, gen, CELL_HARNESS, folder=name)
        got, pairs, bad = run_cells(exe, tmp_path, gen, bind(t, gen, "mask_mod"), cells)
        assert not bad.any() and ((got & pairs) == pairs).all()
        settled = got != BOTH
        assert (got[settled] == pairs[settled]).all()
        r0, c0 = np.array(cells)[:, 2], np.array(cells)[:, 4]
        diagonal = r0 == c0
        if name == "doc_causal":
            edges = np.cumsum(lens)[:-1]
            crosses = lambda x: ((x[:, None] < edges) & (edges < x[:, None] + cell)).any(1)   # noqa: E731
            pure = ~crosses(r0) & ~crosses(c0) & ~diagonal
        else:
            lo, hi = r0 - c0 - (cell - 1), r0 - c0 + (cell - 1)        # q - k over the cell
            pure = ~((lo < 0) & (hi >= 0)) & ~((lo < 300) & (hi >= 300))
        assert settled[pure].all(), np.array(cells)[pure & ~settled][:5]
        assert settled.mean() > 0.9, settled.mean()


@pytest.mark.parametrize("slices, rows, cols", [(1, 256, 256), (1, 32, 32), (1, 100, 100), (16, 32, 32),
                                                (1, 1, 3), (2, 64, 200), (1, 1, 1), (3, 7, 1000)])
def test_block_mask_grid_covers_every_cell(slices, rows, cols):
    """attn_block_mask.cu divides a row of cells by the grid's width: no CTA gets more than
    BLOCK_CELLS (its shared list), every cell gets one, and a small mask still gets a CTA a cell
    up to BLOCK_MASK_CTAS."""
    gx, gy, gz = codegen.block_mask_grid(slices, rows, cols)
    per = -(-cols // gx)                          # the kernel's division
    assert (gy, gz) == (rows, slices) and per <= codegen.BLOCK_CELLS and gx * per >= cols
    if slices * rows * cols <= 2 * codegen.BLOCK_MASK_CTAS:
        assert gx * gy * gz >= min(slices * rows * cols, codegen.BLOCK_MASK_CTAS)


@pytest.mark.parametrize("name", sorted(extra_masks()))
def test_cpu_tiles_by_intervals_give_the_reference(name, rng):
    """The CPU backend settles its block mask's tiles by the same intervals (interp.c's
    interp_cell over the interpreter's program): the masks above, forward and backward against
    the reference; a lookup past the end raises IndexError as the reference's does."""
    from conftest import check_backend, make_qkv
    import attnext
    q, k, v = make_qkv(rng, 2, mods.S_MAX, mods.S_MAX, mods.H_MAX, 1, 8, 8, np.float32)
    if name == "may_leave":
        with pytest.raises(IndexError):
            attnext.attention(q, k, v, mask_mod=extra_masks()[name], device="cpu")
        return
    check_backend(q, k, v, rng, mask_mod=extra_masks()[name])
