"""The dQ kernels' tile sums of the array gradients (attn_mods.cuh: mod_tile): lookups whose indices
are affine in q_idx and kv_idx (codegen.affine) summed per tile in shared memory before the
accumulator. Without a GPU, and with `-m gpu` on one.

codegen.affine recognises the lookups whose indices are affine in q_idx and kv_idx with the
rest fixed for a tile (b, h, constants); only those take mod_scatter_tile and mod_tile_plan's
terms. select.tile_sums sizes the shared memory and picks the terms. The tile path itself is
plain C as well (helpers/host_c.py, as unit/test_codegen.py builds it): a host program plans one
tile, adds its pairs' adjoints through the sums and flushes them, and the accumulator's words must
be those of adding every adjoint directly, bit for bit, in any order; a tile whose lookups may
leave their array, or whose indices straddle 0, takes no path. The kernels with the tile path
compile with NVRTC here and in host/test_kernels_compile.py (warmup's mod_sample is a tile term).

On the GPU (`-m gpu`), every case against the float64 reference (helpers.gpu.run_gpu) and, bit
for bit, against the same call with ATTNEXT_TILE_SUMS=0 (every adjoint straight to the
accumulator: the sums are integers, so the words are the same). The reference differentiates the
tables one element at a time over every pair: tables of a few hundred elements, one or two
sequences and heads. The cases: lengths that are no multiple of the tiles, causal and not,
varlen, GQA, a table counted from the end (negative coefficients), forms that fit the slots and
one that does not, two lookups of one array, CTAs that take the sums beside CTAs that do not, a
table the bounds prove in range (the kernels then have no loop without the sums), a lookup out of
range (IndexError), and reruns.
"""
import os
import subprocess

import numpy as np
import pytest

import attnext
from attnext.cuda import nvrtc, select
from attnext.mods import bounds, codegen, grad as derivative, trace
from conftest import BF16, F16, entry_points, make_qkv, make_varlen_qkv, randn

from helpers.gpu import run_gpu, to_gpu, to_host
from helpers.host_c import PREAMBLE, build

S = 40
TABLE = np.zeros((4, 2 * S + 1), np.float32)
ROW = np.zeros(S, np.float32)
DOC = np.zeros(S, np.int64)
W = np.zeros((), np.float32)


def gen_of(fn, facts=None):
    return codegen.generate(trace.trace_score_mod(fn), None, facts)


def forms(fn):
    """codegen.affine of each index of each gradient lookup of fn, in grad.grad's order."""
    g = derivative.grad(trace.trace_score_mod(fn))
    return [tuple(codegen.affine(i) for i in idx) for name, ts in g.darrays.items() for idx, _ in ts]


AFFINE = {
    "relbias": (lambda s, b, h, q, kv: s + TABLE[h, q - kv + S], [((0, 0), (1, -1))]),
    "rows": (lambda s, b, h, q, kv: s * ROW[q], [((1, 0),)]),
    "columns": (lambda s, b, h, q, kv: s * ROW[kv], [((0, 1),)]),
    "two_q_minus_kv": (lambda s, b, h, q, kv: s + TABLE[h, 2 * q - kv + S], [((0, 0), (2, -1))]),
    "negative": (lambda s, b, h, q, kv: s + TABLE[h % 4, -1 - q], [((0, 0), (-1, 0))]),
    "per_head": (lambda s, b, h, q, kv: s + TABLE[h, 3], [((0, 0), (0, 0))]),
    "scalar": (lambda s, b, h, q, kv: s * W, [()]),
}

NOT_AFFINE = {
    "product": lambda s, b, h, q, kv: s + TABLE[h, (q * kv) % 8],
    "nested": lambda s, b, h, q, kv: s + TABLE[h, DOC[q]],
    "nested_fixed": lambda s, b, h, q, kv: s + TABLE[DOC[h], q],
    "floordiv": lambda s, b, h, q, kv: s + ROW[q // 2],
    "head_times_q": lambda s, b, h, q, kv: s + TABLE[0, h * q],
    "where": lambda s, b, h, q, kv: s + ROW[np.where(q > kv, q, kv)],
}


@pytest.mark.parametrize("name", sorted(AFFINE))
def test_affine_lookups_are_tile_terms(name):
    fn, want = AFFINE[name]
    assert forms(fn) == want
    gen = gen_of(fn)
    assert len(gen.tile_terms) == 1
    assert "mod_scatter_tile(m, t, 0," in gen.source and "mod_scatter(m," not in gen.source
    assert "mod_tile_term(m, t, 0," in gen.source


@pytest.mark.parametrize("name", sorted(NOT_AFFINE))
def test_other_lookups_scatter_one_by_one(name):
    fn = NOT_AFFINE[name]
    assert all(None in f for f in forms(fn)), forms(fn)
    gen = gen_of(fn)
    assert gen.tile_terms == ()
    assert "mod_scatter_tile" not in gen.source and "mod_scatter(m," in gen.source
    assert "mod_tile_term" not in gen.source and "return mod_tile_done(t);" in gen.source
    assert select.tile_sums(gen, 64, 64) == (0, 0, False)


def test_mixed_lookups_take_their_own_paths():
    """An affine lookup and a nested one of the same array: the first a tile term, the second
    scattered one by one; the narrowest span first among several terms."""
    gen = gen_of(lambda s, b, h, q, kv: s * TABLE[h, q - kv + S] + TABLE[h, DOC[kv]] + ROW[kv] * W)
    spans = [abs(t.a) + abs(t.c) for t in gen.tile_terms]
    assert spans == sorted(spans) and len(spans) == 3
    assert gen.source.count("mod_scatter_tile(") == 3 and gen.source.count("mod_scatter(m,") == 1


def test_huge_coefficients_are_not_affine():
    assert forms(lambda s, b, h, q, kv: s + ROW[(q * (1 << 40)) % S]) == [(None,)]
    big = np.zeros(1 << 17, np.float32)
    assert forms(lambda s, b, h, q, kv: s + big[q * 40000]) == [(None,)]


def test_tile_sums_sizes_and_admits():
    relbias = gen_of(AFFINE["relbias"][0])
    assert relbias.tile_terms == (codegen.TileTerm(1, -1, False),)   # A = stride of axis 1
    assert select.tile_sums(relbias, 64, 64) == (127, 1, False)
    assert select.tile_sums(relbias, 64, 32) == (95, 1, False)
    two = gen_of(lambda s, b, h, q, kv: s * TABLE[h, q - kv + S] + TABLE[h, kv - q + S] + TABLE[h, 0])
    # narrowest first: table[h, 0] (1 slot), then one diagonal (127); the second does not fit
    assert select.tile_sums(two, 64, 64) == (128, 0b011, False)
    assert select.tile_sums(gen_of(AFFINE["two_q_minus_kv"][0]), 64, 64) == (0, 0, False)   # 190 slots
    rows = gen_of(lambda s, b, h, q, kv: s + TABLE[q, kv])          # A = 2S + 1: past the slots
    assert rows.tile_terms == (codegen.TileTerm(2 * S + 1, 1, False),)
    assert select.tile_sums(rows, 64, 64) == (0, 0, False)


def test_proven_terms_compile_the_sums_loop_only():
    ts = trace.trace_score_mod(AFFINE["relbias"][0])
    for ext, always in ((bounds.Extents(2, 4, S, S), True), (bounds.Extents(2, 4, S + 2, S), False)):
        facts = codegen.Facts(bounds.lookup_modes(ts, ext), (), (False,))
        gen = codegen.generate(ts, None, facts)
        assert select.tile_sums(gen, 64, 64) == (127, 1, always)
    neg = trace.trace_score_mod(AFFINE["negative"][0])       # in range, but counted from the end
    facts = codegen.Facts(bounds.lookup_modes(neg, bounds.Extents(2, 4, S, S)), (), (False,))
    assert facts.score != (bounds.CHECKED,)
    assert select.tile_sums(codegen.generate(neg, None, facts), 64, 64) == (64, 1, False)


def test_backward_defines_and_shared_memory(monkeypatch):
    gen = gen_of(AFFINE["relbias"][0])
    every = dict(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None, mask=False,
                 alibi_dtype=None)
    tile = select.bwd_sm90_tile(128, "recompute")
    d = select.bwd_defines(**every, tile=tile, mods=gen)
    assert (d["MOD_TILE_SLOTS"], d["MOD_TILE_ADMIT"], d["MOD_TILE_ALWAYS"]) == (127, 1, 0)
    plain = select.bwd_sm90_smem_bytes(128, 128, tile)
    more = select.bwd_sm90_smem_bytes(128, 128, tile, d["MOD_TILE_SLOTS"])
    assert {k: more[k] - plain[k] for k in plain} == {**{k: 0 for k in plain},
                                                      "attn_bwd_dq_sm90": 127 * codegen.TILE_SLOT_BYTES}
    # two of the H100's dQ CTAs an SM still fit (228 KB an SM, 1 KB reserved a CTA)
    assert 2 * (more["attn_bwd_dq_sm90"] + 1024) <= 228 * 1024
    t80 = select.bwd_tile_config(128, 128)
    d80 = select.bwd_defines(**every, tile=t80, mods=gen)
    more80 = select.bwd_smem_bytes(128, 128, t80, False, d80["MOD_TILE_SLOTS"])
    assert more80["attn_bwd_dq"] - select.bwd_smem_bytes(128, 128, t80, False)["attn_bwd_dq"] == 127 * 96
    assert more80["attn_bwd_dq"] <= select.MAX_SMEM_SM80
    monkeypatch.setenv("ATTNEXT_TILE_SUMS", "0")
    assert "MOD_TILE_SLOTS" not in select.bwd_defines(**every, tile=tile, mods=gen)
    assert "MOD_TILE_SLOTS" not in select.bwd_defines(**every, tile=tile, mods=None)


# --- the tile path in host C -------------------------------------------------------------------

HARNESS = PREAMBLE + r"""
/* in: n, narr, words, b, h, q0, kv0, rows, cols, slots, threads; attn_mods_gpu; the arrays;
 * score[n], dout[n] (float), q[n], kv[n] (int64). out: the plan's answer and slots used,
 * whether the sums were all zero after the flush, the words added directly, then through the
 * sums (the sums' pass where the plan said no). */
int main(int argc, char **argv)
{
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    int64_t *hdr = (int64_t *)take(in, 11 * 8);
    const int64_t n = hdr[0], narr = hdr[1], words = hdr[2], b = hdr[3], h = hdr[4];
    const int q0 = (int)hdr[5], kv0 = (int)hdr[6], rows = (int)hdr[7], cols = (int)hdr[8];
    const int slots = (int)hdr[9], threads = (int)hdr[10];
    int64_t err[5];
    attn_mods_gpu *m = take_mods(in, narr, err);
    float *score = (float *)take(in, n * 4), *dout = (float *)take(in, n * 4);
    int64_t *q = (int64_t *)take(in, n * 8), *kv = (int64_t *)take(in, n * 8);
    uint64_t *direct = (uint64_t *)calloc((size_t)(words + 1), 8), *summed = (uint64_t *)calloc((size_t)(words + 1), 8);
    int bad = 0;
    m->dacc = direct;
    for (int64_t i = 0; i < n; i++)
        mod_dtensors_q(score[i], b, h, q[i], kv[i], dout[i], 0, m, &bad);
    mod_tile t;
    t.acc = (uint32_t *)calloc((size_t)(MOD_CHUNKS * slots + 1), 4);
    t.slots = slots;
    m->dacc = summed;
    const int ok = mod_tile_plan(b, h, q0, kv0, rows, cols, m, &t);
    for (int64_t i = 0; i < n; i++)
        mod_dtensors_q(score[i], b, h, q[i], kv[i], dout[i], ok ? &t : 0, m, &bad);
    for (int tid = 0; tid < threads && ok; tid++)
        mod_tile_flush(&t, tid, threads);
    int zero = 1;
    for (int i = 0; i < MOD_CHUNKS * slots; i++)
        zero &= t.acc[i] == 0;
    const int64_t res[3] = {ok, ok ? t.used : 0, zero};
    fwrite(res, 8, 3, out);
    fwrite(direct, 8, (size_t)words, out);
    fwrite(summed, 8, (size_t)words, out);
    fclose(out);
    return 0;
}
"""


def tile_run(cc, tmp_path, fn, pairs, tile, threads=5, b=1, h=2, sums=None):
    """Runs the harness on fn's gradient lookups over pairs (q, kv) of the tile (q0, kv0, rows,
    cols), MOD_TILE_ADMIT and the slots as select.tile_sums gives them for 64 x 64 tiles, or
    sums = (slots, admit). Returns (plan ok, slots used, sums zero after the flush, words added
    directly, words through the sums)."""
    t = trace.trace_score_mod(fn)
    gen = codegen.generate(t)
    slots, admit = sums or select.tile_sums(gen, 64, 64)[:2]
    exe = build(cc, tmp_path, gen, HARNESS, [f"-DMOD_TILE_ADMIT={admit}"], "tile")
    bound = [codegen.storage(t.arrays[name], vt) for _, name, vt in gen.arrays]
    offsets, total = {}, 0
    for i in gen.grad_arrays:
        offsets[i] = total
        total += bound[i].size
    refs = [(0, a.shape, [s // a.itemsize for s in a.strides]) for a in bound]
    q, kv = (np.asarray(x, np.int64) for x in pairs)
    n = q.size
    mix = (q * 2654435761 + kv * 40503 + 12345) % (1 << 32)     # values of the pair, not its position
    score = ((mix >> 8) % 997 / 498.5 - 1.0).astype(np.float32)
    dout = ((mix % 10007 / 5003.0 - 1.0) * 2.0 ** ((mix >> 16) % 120 - 60)).astype(np.float32)
    blob = [np.array([n, len(bound), total * codegen.WORDS, b, h, *tile, max(slots, 1), threads],
                     np.int64).tobytes(),
            codegen.pack(gen, t.params, refs, 0, 0, offsets)]
    for a in bound:
        blob += [np.array([a.nbytes], np.int64).tobytes(), a.tobytes()]
    blob += [score.tobytes(), dout.tobytes(), q.tobytes(), kv.tobytes()]
    (tmp_path / "in.bin").write_bytes(b"".join(blob))
    subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    raw = np.frombuffer((tmp_path / "out.bin").read_bytes(), np.int64)
    words = total * codegen.WORDS
    return int(raw[0]), int(raw[1]), bool(raw[2]), raw[3:3 + words], raw[3 + words:3 + 2 * words]


def rect(q0, kv0, rows, cols, rng=None, keep=None):
    """The pairs of a tile, shuffled; keep(q, kv): only the pairs it keeps (a causal band)."""
    q, kv = np.meshgrid(np.arange(q0, q0 + rows), np.arange(kv0, kv0 + cols), indexing="ij")
    q, kv = q.ravel(), kv.ravel()
    if keep is not None:
        k = keep(q, kv)
        q, kv = q[k], kv[k]
    order = (rng or np.random.default_rng(1)).permutation(q.size)
    return q[order], kv[order]


def test_tile_sums_are_the_direct_words(cc, tmp_path):
    """A relative-bias table over a full tile and an edge tile: the plan takes it, and the words
    through the sums are the direct words, bit for bit, with the sums zero after the flush."""
    table = np.zeros((4, 2 * 200 + 1), np.float32)

    def fn(s, b, h, q, kv):
        return s + table[h, q - kv + 200]

    for tile in ((64, 128, 64, 64), (128, 0, 9, 37)):
        ok, used, zero, direct, summed = tile_run(cc, tmp_path, fn, rect(*tile), tile)
        assert ok and used == tile[2] + tile[3] - 1 and zero
        assert direct.any() and np.array_equal(direct, summed)


def test_tile_sums_in_another_order_are_the_same_words(cc, tmp_path):
    table = np.zeros((4, 2 * 200 + 1), np.float32)

    def fn(s, b, h, q, kv):
        return s * table[h, q - kv + 200] + table[h, q]

    runs = [tile_run(cc, tmp_path, fn, rect(10, 30, 64, 64, np.random.default_rng(seed)), (10, 30, 64, 64),
                     threads=threads) for seed, threads in ((1, 1), (2, 7), (3, 128))]
    for ok, used, zero, direct, summed in runs:     # table[h, q] first; the diagonal does not fit
        assert ok and used == 64 and zero and np.array_equal(direct, summed)
    assert np.array_equal(runs[0][4], runs[1][4]) and np.array_equal(runs[0][4], runs[2][4])


@pytest.mark.parametrize("case", ["two_q_minus_kv", "negative", "per_head", "scalar", "rows", "columns"])
def test_each_affine_form_through_the_sums(case, cc, tmp_path):
    """Each form with room for its span (2 q - kv's, 2 * 63 + 63 + 1, never fits a 64 x 64 tile's
    128 slots: the sums are given more here)."""
    fn = AFFINE[case][0]
    tile = (8, 3, 8, 20)
    ok, used, zero, direct, summed = tile_run(cc, tmp_path, fn, rect(*tile), tile, sums=(64, 1))
    assert ok and zero and direct.any() and np.array_equal(direct, summed)


def test_two_lookups_of_one_array_and_a_nested_one(cc, tmp_path):
    """Both affine lookups of the table through the sums (64 + 1 slots), the nested one straight
    to the accumulator, all into the same array's words."""
    table = np.zeros((4, 2 * S + 1), np.float32)
    doc = (np.arange(S) * 7) % (2 * S + 1)

    def fn(s, b, h, q, kv):
        return s * table[h, q] + table[h, 5] - table[h, doc[kv]]

    tile = (0, 0, S, S)
    ok, used, zero, direct, summed = tile_run(cc, tmp_path, fn, rect(*tile), tile)
    assert ok and used == S + 1 and zero and np.array_equal(direct, summed)


def test_special_adjoints_set_the_flags_word(cc, tmp_path):
    """NaN and infinities go to the flags word whichever path; the finite sums stay exact."""
    table = np.zeros((4, 2 * S + 1), np.float32)
    big = np.float32(3e38)

    def fn(s, b, h, q, kv):
        return s + table[h, q - kv + S] * big * big      # adjoints dout * inf: +-inf, NaN at 0

    tile = (0, 0, 8, 8)
    ok, _, zero, direct, summed = tile_run(cc, tmp_path, fn, rect(*tile), tile)
    flags = direct.reshape(-1, codegen.WORDS)[:, -1]
    assert ok and zero and flags.any() and np.array_equal(direct, summed)


@pytest.mark.parametrize("where", ["past_the_end", "straddles_zero", "span_too_wide"])
def test_tiles_that_take_no_path(where, cc, tmp_path):
    """A tile whose indices may leave the array, whose indices straddle 0 (NumPy counts the
    negative ones from the end: not affine), or whose span exceeds the slots takes no path; its
    words are the direct ones (the harness adds them directly then)."""
    short = np.zeros((4, 50), np.float32)
    if where == "past_the_end":
        def fn(s, b, h, q, kv):
            return s + short[h, q - kv + 30]
        tile = (10, 0, 16, 16)            # q - kv + 30 up to 55
        pairs = rect(*tile, keep=lambda q, kv: q - kv + 30 < 50)
    elif where == "straddles_zero":
        def fn(s, b, h, q, kv):
            return s + short[h, q - kv]
        tile = (0, 0, 16, 16)
        pairs = rect(*tile)
    else:
        def fn(s, b, h, q, kv):
            return s + short[h, 2 * q + 2 * kv]
        tile = (0, 0, 4, 4)               # span 2 * 63 + 2 * 63 + 1 at 64 x 64: past 128 slots
        pairs = rect(*tile)
    ok, used, _, direct, summed = tile_run(cc, tmp_path, fn, pairs, tile)
    assert not ok and used == 0 and np.array_equal(direct, summed) and direct.any()


def test_a_tile_in_range_where_its_band_is_not(cc, tmp_path):
    """Only the tile's pairs matter for the plan, not the band: a causal table over q - kv >= 0
    in a tile below the diagonal takes the path; one on the diagonal (negative differences in its
    corner, masked in the call) takes none: the kernels then scatter its CTA's tiles directly."""
    table = np.zeros((4, 200), np.float32)

    def fn(s, b, h, q, kv):
        return s + table[h, q - kv]

    below = (64, 0, 64, 64)
    ok, _, _, direct, summed = tile_run(cc, tmp_path, fn, rect(*below), below)
    assert ok and np.array_equal(direct, summed)
    diag = (0, 0, 64, 64)
    ok, _, _, direct, summed = tile_run(cc, tmp_path, fn, rect(*diag, keep=lambda q, kv: kv <= q), diag)
    assert not ok and np.array_equal(direct, summed)


@pytest.mark.parametrize("proven", [False, True], ids=["both_loops", "sums_only"])
def test_dq_kernels_compile_with_the_sums(proven):
    """NVRTC, sm_80 and sm_90a: the dQ entry points with the relbias row's tile term, with both
    key-tile loops (a call whose bounds prove nothing) and with the sums' loop alone
    (MOD_TILE_ALWAYS: warmup's mod_sample compiles only this one)."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    from attnext import _C
    ts = trace.trace_score_mod(AFFINE["relbias"][0])
    facts = codegen.Facts(bounds.lookup_modes(ts, bounds.Extents(2, 4, S, S)), (), (False,)) if proven else None
    gen = codegen.generate(ts, None, facts)
    every = dict(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None, mask=False,
                 alibi_dtype=None)
    nvrtc.nvrtc()
    for arch, kernel, name, tile in (("sm_80", "attn_bwd", "attn_bwd_dq", select.bwd_tile_config(128, 128)),
                                     ("sm_90a", "attn_bwd_sm90", "attn_bwd_dq_sm90",
                                      select.bwd_sm90_tile(128, "recompute"))):
        d = select.entry_defines(select.bwd_defines(**every, tile=tile, mods=gen), name)
        assert d["MOD_TILE_ALWAYS"] == int(proven)
        cubin, _ = _C.nvrtc_compile(*nvrtc.compile_args(kernel, d, arch, gen.source))
        assert name.encode() in cubin


# --- on the GPU (-m gpu) ------------------------------------------------------------------------

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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


GPU_FORMS = {
    "rows": lambda t: lambda s, b, h, qi, ki: s * t[h, qi],
    "columns": lambda t: lambda s, b, h, qi, ki: s + t[h, ki] * 0.25,
    # (times s: a term that is one constant per row has the gradient sum_j dS_ij = 0, which only
    # the rounding of out to bf16 in delta moves)
    "from_the_end": lambda t: lambda s, b, h, qi, ki: s + t[h, -1 - qi] * s,
    "per_head": lambda t: lambda s, b, h, qi, ki: s + t[h, 3] * s,
    "two_q_minus_kv": lambda t: lambda s, b, h, qi, ki: s + t[h, 2 * qi - ki + 150],   # past the slots
    "two_lookups": lambda t: lambda s, b, h, qi, ki: s * t[h, qi] + t[h, qi - ki + 150],
}


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", sorted(GPU_FORMS))
def test_affine_forms(form, causal, rng, torch, monkeypatch):
    sq, sk = 130, 150
    table = rng.standard_normal((2, 3 * 150)).astype(np.float32)
    q, k, v = make_qkv(rng, 1, sq, sk, 2, 2, 64, 64, BF16)
    both_ways(torch, monkeypatch, q, k, v, score_mod=GPU_FORMS[form](table), causal=causal)


@pytest.mark.gpu
def test_a_scalar_array(rng, torch, monkeypatch):
    w = np.array(0.75, np.float32)
    q, k, v = make_qkv(rng, 2, 100, 90, 2, 2, 128, 128, BF16)
    both_ways(torch, monkeypatch, q, k, v, score_mod=lambda s, b, h, qi, ki: s * w)


@pytest.mark.gpu
def test_ctas_with_and_without_the_sums(rng, torch, monkeypatch):
    """table[q - kv] counts negative differences from the end: the CTAs whose rows are all at or
    past the keys take the sums, the others (their differences straddle 0) do not."""
    sq, sk = 320, 100
    table = rng.standard_normal(sq).astype(np.float32)
    q, k, v = make_qkv(rng, 1, sq, sk, 1, 1, 128, 128, BF16)
    both_ways(torch, monkeypatch, q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[qi - ki])


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
