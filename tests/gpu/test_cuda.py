"""The CUDA backend (`pytest -m gpu`, on a machine with a GPU) against the float64 reference.

What the CPU suite checks reruns here on the GPU (test_cpu_suite_on_cuda); the rest is what only
the GPU has: CUDA array inputs read in place (CuPy, PyTorch), results as the caller's arrays,
out= on the device, head dims and tile edges of the GPU kernels.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import attnext
from attnext import reference
from conftest import BF16, F16, assert_close, assert_lse_close, make_qkv, make_varlen_qkv, randn

from helpers.paths import ROOT, TESTS, pythonpath

pytestmark = pytest.mark.gpu

HEAD_DIMS = [(64, 64), (128, 128), (256, 256), (96, 96), (192, 128), (59, 40), (40, 59), (8, 8), (1, 3)]
LENGTHS = [(1, 1), (113, 203), (127, 129), (129, 127), (128, 128), (239, 1), (1, 4097), (4095, 4097)]


def _check_forward(q, k, v, dtype, *, varlen=None, **opts):
    fwd, rfwd = ((attnext.attention, reference.attention) if varlen is None
                 else (attnext.varlen_attention, reference.varlen_attention))
    lengths = varlen or {}
    out, lse = fwd(q, k, v, **lengths, device="cuda", return_lse=True, **opts)
    r_out, r_lse = rfwd(q, k, v, **lengths, return_lse=True, **opts)
    assert out.dtype == dtype and out.shape == r_out.shape
    assert_close("out", out, r_out, dtype)
    assert_lse_close(lse, r_lse, dtype)
    return out, lse


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d, dv", HEAD_DIMS, ids=[f"d{a}_dv{b}" for a, b in HEAD_DIMS])
def test_head_dims(dtype, d, dv, rng):
    q, k, v = make_qkv(rng, 2, 131, 197, 4, 2, d, dv, dtype)
    _check_forward(q, k, v, dtype)
    _check_forward(q, k, v, dtype, causal=True)


@pytest.mark.parametrize("causal", [False, True, "top_left"], ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("sq, sk", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
def test_lengths(sq, sk, causal, rng):
    q, k, v = make_qkv(rng, 1, sq, sk, 2, 1, 64, 64, BF16)
    _check_forward(q, k, v, BF16, causal=causal)


def test_everything_at_once(rng):
    """bias (broadcast, odd strides), mask, alibi, softcap, window, GQA, bhsd, element loads."""
    q, k, v = make_qkv(rng, 2, 77, 150, 6, 2, 59, 40, F16, layout="bhsd")
    bias = randn(rng, (6, 1, 150), np.float32)            # broadcast over batch and rows
    mask = rng.random((2, 1, 77, 150)) > 0.2
    slopes = rng.random(6).astype(np.float32)
    _check_forward(q, k, v, F16, layout="bhsd", bias=bias, mask=mask, alibi_slopes=slopes,
                   softcap=5.0, window=(40, 3), causal=True)


def test_varlen_with_padding(rng):
    cu_q = np.array([0, 0, 37, 300, 301, 520], np.int32)
    cu_k = np.array([0, 5, 5, 270, 400, 640], np.int32)
    used_q = np.array([0, 30, 263, 1, 100], np.int32)
    q, k, v = make_varlen_qkv(rng, 530, 650, 4, 2, 128, 128, BF16)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q)
    out, lse = _check_forward(q, k, v, BF16, varlen=varlen, causal=True)
    assert (out[520:] == 0).all() and np.isneginf(lse[:, 520:]).all()


def _check_every_option(q, k, v, rng, windows):
    """q, k, v (bshd, bf16) through the options one forward kernel meets: none, causal both
    ways (top-left with windows[0]), then bias (broadcast over batch and keys), mask, ALiBi and
    softcap together, causal with windows[1]."""
    B, Sq, Hq, _ = q.shape
    _check_forward(q, k, v, BF16)
    _check_forward(q, k, v, BF16, causal=True)
    _check_forward(q, k, v, BF16, causal="top_left", window=windows[0])
    bias = randn(rng, (Hq, Sq, 1), np.float32)
    mask = rng.random((B, 1, Sq, k.shape[1])) > 0.1
    slopes = rng.random(Hq).astype(np.float32)
    _check_forward(q, k, v, BF16, bias=bias, mask=mask, alibi_slopes=slopes, softcap=5.0,
                   window=windows[1], causal=True)


@pytest.mark.parametrize("kernel", ["default", "mma_sync", "two_warpgroups"])
@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (128, 64), (64, 128)],
                         ids=["d64", "d128", "d128_dv64", "d64_dv128"])
def test_forward_kernels_with_every_option(kernel, d, dv, rng, monkeypatch):
    """On Hopper these head dims run attn_fwd_sm90 (wgmma) by default, the warp-specialised
    kernel where D = Dv (on Hopper every such plan is WS but D = 64's softcap call, else none);
    "mma_sync" forces attn_fwd.cu, and "two_warpgroups" (ATTNEXT_FWD_WS=0) attn_fwd_sm90's kernel
    without WS, so each kernel meets every option on tile edges (300 x 333: neither length a
    multiple of 64) and on a packed batch."""
    if kernel == "mma_sync":
        monkeypatch.setenv("ATTNEXT_FWD_SM90", "0")
    if kernel == "two_warpgroups":
        monkeypatch.setenv("ATTNEXT_FWD_WS", "0")
    chosen, hopper = _spy_ws(monkeypatch)
    q, k, v = make_qkv(rng, 2, 300, 333, 4, 2, d, dv, BF16)
    _check_every_option(q, k, v, rng, windows=((70, 0), (100, 7)))
    cu_q = np.array([0, 1, 130, 130, 400], np.int32)
    cu_k = np.array([0, 200, 200, 329, 600], np.int32)
    q, k, v = make_varlen_qkv(rng, 410, 600, 4, 1, d, dv, F16)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=np.array([150, 0, 129, 33], np.int32))
    out, lse = _check_forward(q, k, v, F16, varlen=varlen, causal=True)
    assert (out[400:] == 0).all() and np.isneginf(lse[:, 400:]).all()
    ws = kernel == "default" and hopper and d == dv
    # D = 64's softcap call at these short rows keeps the two-warpgroup kernel (select.fwd_ws)
    assert chosen and set(chosen) == ({True, False} if ws and d == 64 else {ws}), chosen


def _spy_ws(monkeypatch, rows=None):
    """(chosen, hopper): chosen collects whether each forward plan made from here on takes the
    warp-specialised kernel (the plans are cleared first); rows, a list, collects the WS plans'
    (BLOCK_M, ws3: whether select.fwd_ws3 asked for the 192-row tile); hopper: whether the GPU is
    sm_90a."""
    from attnext.cuda import backend, select
    chosen = []
    fwd_kernel = select.fwd_kernel

    def spy(*args, **kw):
        chosen.append(bool(kw.get("ws", args[10] if len(args) > 10 else False)))
        kernel, tile = fwd_kernel(*args, **kw)
        if chosen[-1] and rows is not None:
            rows.append((tile[0], args[11] if len(args) > 11 else kw.get("ws3", False)))
        return kernel, tile
    monkeypatch.setattr(select, "fwd_kernel", spy)
    backend.clear_plans()
    return chosen, backend.device_arch(0) == "sm_90a"


@pytest.mark.parametrize("d", [64, 128])
def test_ws_forward_on_varlen_and_mods(d, rng, monkeypatch):
    """The warp-specialised forward also takes varlen and seqused_k keys, whose rows past Lk
    inside the tensor its copies bring along (the producer zeroes them in V: a NaN there must
    not reach out), and score_mod / mask_mod calls; against the reference, and on Hopper every
    plan made here on the WS kernel."""
    ws_rows = []
    chosen, hopper = _spy_ws(monkeypatch, ws_rows)

    # key rows no sequence uses hold inf in k and NaN in v: their scores must be masked and their
    # v rows read as 0 (the packed rows past the last sequence, which its last tile's copy brings
    # along; with seqused_k the unused rows of each sequence, all of sequence 1's, which sequence
    # 0's last tile reads as the next sequence's)
    cu_q = np.array([0, 1100, 2400, 3100], np.int32)
    cu_k = np.array([0, 1200, 2533, 3433], np.int32)
    used_k = np.array([1100, 0, 517], np.int32)
    q, k, v = make_varlen_qkv(rng, 3100, 3500, 4, 2, d, d, BF16)
    k[3433:], v[3433:] = np.inf, np.nan
    _check_forward(q, k, v, BF16, varlen=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    assert not hopper or ws_rows == [(192, True) if d == 64 else (128, False)], ws_rows       # a plain call
    for b in range(3):
        k[cu_k[b] + used_k[b]:cu_k[b + 1]], v[cu_k[b] + used_k[b]:cu_k[b + 1]] = np.inf, np.nan
    _check_forward(q, k, v, BF16, varlen=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k),
                   causal=True)

    q, k, v = make_qkv(rng, 2, 1100, 1333, 4, 2, d, d, BF16)
    lens_k, k_inf, v_nan = np.array([1333, 1001], np.int32), k.copy(), v.copy()
    k_inf[1, 1001:], v_nan[1, 1001:] = np.inf, np.nan
    _check_forward(q, k_inf, v_nan, BF16, seqlens_k=lens_k, causal=True)
    _check_forward(q, k_inf, v_nan, BF16, seqlens_k=lens_k, window=(400, 3),
                   score_mod=lambda s, b, h, qi, ki: 20.0 * np.tanh(s / 20.0))
    _check_forward(q, k, v, BF16, causal=True, mask_mod=lambda b, h, qi, ki: (qi - ki) % 5 != 3)
    _check_forward(q, k, v, BF16, mask_mod=lambda b, h, qi, ki: (qi - ki) % 5 != 3,
                   score_mod=lambda s, b, h, qi, ki: s - 0.01 * np.abs(qi - ki))
    assert chosen and all(chosen) == hopper, chosen


def test_causal_d64_past_2048_rows_takes_three_warpgroups(rng, monkeypatch):
    """A causal mask alone at D = 64 past 2048 query rows runs the WS kernel's 192-row tile
    (select.fwd_ws3), with the tiles longest first: causal both ways on tile edges (2500 = 13 x 192
    + 4; 2049: 11 x 192 + 129, whose last tile's third warpgroup has no rows) with GQA, more keys
    than queries and fewer, sinks, rows of huge finite scores, a varlen batch whose longest
    sequence passes 2048 and a dense one with an exact count of tiles; each against the reference,
    and on Hopper each plan's tile is the one asked for (a window, or 2048 rows, keep 128)."""
    ws_rows = []
    chosen, hopper = _spy_ws(monkeypatch, ws_rows)
    q, k, v = make_qkv(rng, 2, 2500, 2600, 4, 2, 64, 64, BF16)
    _check_forward(q, k, v, BF16, causal=True)
    _check_forward(q, k, v, BF16, causal="top_left")
    _check_forward(q, k, v, BF16, causal=True, sinks=randn(rng, (4,), np.float32))
    _check_forward((q.astype(np.float32) * 3e4).astype(BF16), k, v, BF16, causal=True)   # huge finite scores
    q, k, v = make_qkv(rng, 1, 2049, 1500, 6, 3, 64, 64, BF16)
    _check_forward(q, k, v, BF16, causal=True)
    _check_forward(q, k, v, BF16, causal="top_left")
    q, k, v = make_qkv(rng, 1, 2304, 2304, 2, 2, 64, 64, BF16, layout="bhsd")
    _check_forward(q, k, v, BF16, causal=True, layout="bhsd")
    cu_q = np.array([0, 300, 2700, 2701], np.int32)
    cu_k = np.array([0, 500, 3000, 3100], np.int32)
    q, k, v = make_varlen_qkv(rng, 2701, 3100, 4, 4, 64, 64, BF16)
    _check_forward(q, k, v, BF16, varlen=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), causal=True)
    three = len(ws_rows)
    q, k, v = make_qkv(rng, 1, 2048, 2048, 2, 2, 64, 64, BF16)
    _check_forward(q, k, v, BF16, causal=True)
    q, k, v = make_qkv(rng, 1, 2500, 2500, 2, 2, 64, 64, BF16)
    _check_forward(q, k, v, BF16, causal=True, window=(700, 0))
    if hopper:
        assert chosen and all(chosen), chosen
        assert ws_rows == [(192, True)] * three + [(128, False)] * 2, ws_rows


def test_long_keys_take_the_wide_key_tile(rng, monkeypatch):
    """A plain D = 128 call over WIDE_KEYS keys or more, past the persistent grid's query tiles,
    runs the WS kernel's 176-key tile (select.fwd_wide_keys): keys past the last whole tile (8300 =
    47 x 176 + 28), GQA, a query tile whose second warpgroup has no rows (2100 = 16 x 128 + 52),
    bhsd in float16, sinks, a varlen batch whose longest key sequence is long (its others short,
    one empty) with seqused_k rows holding inf and NaN; each against the reference, and on Hopper
    each plan's key tile is the one asked for (a causal mask, or keys one short of WIDE_KEYS,
    keep 128)."""
    from attnext.cuda import select
    blocks = []
    fwd_kernel = select.fwd_kernel

    def spy(*args, **kw):
        kernel, tile = fwd_kernel(*args, **kw)
        if kernel == "attn_fwd_sm90":
            blocks.append(tile[1])
        return kernel, tile
    monkeypatch.setattr(select, "fwd_kernel", spy)
    from attnext.cuda import backend
    backend.clear_plans()
    hopper = backend.device_arch(0) == "sm_90a"
    wide = select.WIDE_KEYS
    q, k, v = make_qkv(rng, 1, 2100, wide + 108, 4, 2, 128, 128, BF16)
    _check_forward(q, k, v, BF16)
    _check_forward(q, k, v, BF16, sinks=randn(rng, (4,), np.float32))
    q, k, v = make_qkv(rng, 1, 2200, wide, 2, 2, 128, 128, F16, layout="bhsd")
    _check_forward(q, k, v, F16, layout="bhsd")
    cu_q = np.array([0, 2300, 2400, 2400], np.int32)
    cu_k = np.array([0, wide + 40, wide + 340, wide + 400], np.int32)
    used_k = np.array([wide + 1, 300, 0], np.int32)
    q, k, v = make_varlen_qkv(rng, 2400, wide + 400, 2, 1, 128, 128, BF16)
    k[wide + 1:wide + 40], v[wide + 1:wide + 40] = np.inf, np.nan
    _check_forward(q, k, v, BF16, varlen=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k))
    many = len(blocks)
    q, k, v = make_qkv(rng, 1, 2100, wide - 1, 2, 2, 128, 128, BF16)
    _check_forward(q, k, v, BF16)
    _check_forward(q, k, v, BF16, causal=True)
    if hopper:
        assert blocks == [176] * 3 + [128] * 2 and many == 3, blocks     # sinks: the first plan again


@pytest.mark.parametrize("d", [64, 128])
def test_score_mod_forward_takes_the_wide_tile_once_compiled(d, rng, monkeypatch, request):
    """A score_mod that loads from no array per score runs the WS forward's 64-key tile on its
    first call while the 128-key one compiles in the background; once that compile is done
    (nvrtc.finish_ahead) the same call runs the wide tile, and so does a window's first call (the
    same kernel). Each against the reference, with GQA. The mod's integer constant is drawn from
    the OS on each run, so no disk cache holds its kernels ((q - kv) mod c is q - kv for c past
    every distance), and the background compile is asked for whatever the machine's cores
    (ATTNEXT_COMPILE_AHEAD=1)."""
    from attnext import _env
    from attnext.cuda import backend, nvrtc, select
    if backend.device_arch(0) != "sm_90a":
        pytest.skip("the WS forward is Hopper's")
    launched = []
    function = nvrtc.function

    def spy(kernel, name, defines, *rest):
        if name == "attn_fwd_sm90":
            launched.append(defines["BLOCK_N"])
        return function(kernel, name, defines, *rest)
    monkeypatch.setattr(nvrtc, "function", spy)
    backend.clear_plans()
    before = os.environ.get("ATTNEXT_COMPILE_AHEAD")
    _env.setenv("ATTNEXT_COMPILE_AHEAD", "1")
    request.addfinalizer(lambda: _env.setenv("ATTNEXT_COMPILE_AHEAD", before))
    c = 5000 + int.from_bytes(os.urandom(4), "little") % (1 << 30)
    q, k, v = make_qkv(rng, 2, 1100, 1333, 4, 2, d, d, BF16)
    score_mod = lambda s, b, h, qi, ki: s - 0.01 * ((qi - ki) % c)
    _check_forward(q, k, v, BF16, causal=True, score_mod=score_mod)
    nvrtc.finish_ahead()
    _check_forward(q, k, v, BF16, causal=True, score_mod=score_mod)
    _check_forward(q, k, v, BF16, causal=True, score_mod=score_mod)
    assert launched == [select.SM90_TILE_WS_MODS[1], select.SM90_TILE_WS[1]], launched
    # a window is no kernel switch: its first plan finds the wide kernel compiled
    _check_forward(q, k, v, BF16, window=(300, 40), score_mod=score_mod)
    assert launched[2:] == [select.SM90_TILE_WS[1]], launched


@pytest.mark.parametrize("kernel", ["ws", "ws_a_cta_a_tile", "two_warpgroups"])
@pytest.mark.parametrize("d", [64, 128])
def test_long_forward_with_every_option(kernel, d, rng, monkeypatch):
    """D = Dv = 64 or 128 past 1024 query rows over dense keys: on Hopper attn_fwd_sm90.cu's
    warp-specialised kernel (a producer warpgroup's tensor copies, two computing warpgroups taking
    turns; three at D = 64 in a plain call: no band, bias, mask, ALiBi or softcap; these rows'
    plain calls as a persistent grid by default, "ws_a_cta_a_tile" with ATTNEXT_FWD_PERSIST=0), and
    with ATTNEXT_FWD_WS=0 the two-warpgroup kernel, all on every option: a last query tile whose
    second warpgroup has no rows (1050 = 8 x 128 + 26; 5 x 192 + 90: two), keys past the last whole
    tile (1333), GQA, bhsd, causal both ways, windows, bias, mask, ALiBi, softcap, sinks, rows of
    huge finite scores (the softmax's exact path), a strided out; an expanded (zero-stride) k / v
    never takes the WS kernel. The plans' kernel choices are recorded: on Hopper each kernel
    named is the one that ran."""
    if kernel == "two_warpgroups":
        monkeypatch.setenv("ATTNEXT_FWD_WS", "0")
    if kernel == "ws_a_cta_a_tile":
        monkeypatch.setenv("ATTNEXT_FWD_PERSIST", "0")
    ws_rows = []
    chosen, hopper = _spy_ws(monkeypatch, ws_rows)
    q, k, v = make_qkv(rng, 2, 1050, 1333, 4, 2, d, d, BF16)
    _check_every_option(q, k, v, rng, windows=((300, 0), (500, 7)))
    # the WS plans' row tiles: 192 at D = 64 for plain calls (and causal ones past 2048 rows, not
    # these), else 128 (and at D = 128)
    assert all(bm == (192 if ws3 else 128) for bm, ws3 in ws_rows), ws_rows
    ws = kernel != "two_warpgroups"
    assert not (hopper and ws) or {ws3 for _, ws3 in ws_rows} == {d == 64, False}, ws_rows
    _check_forward(q, k, v, BF16, sinks=randn(rng, (4,), np.float32), causal=True)
    _check_forward((q.astype(np.float32) * 3e4).astype(BF16), k, v, BF16, causal=True)   # huge finite scores
    # plain calls again (D = 64: the three-warpgroup tile), with sinks, and the options without a band
    _check_forward(q, k, v, BF16, sinks=randn(rng, (4,), np.float32))
    _check_forward((q.astype(np.float32) * 3e4).astype(BF16), k, v, BF16)
    _check_forward(q, k, v, BF16, bias=randn(rng, (1, 4, 1050, 1), np.float32), mask=rng.random((2, 1, 1050, 1333)) > 0.1,
                   alibi_slopes=rng.random(4).astype(np.float32), softcap=5.0)
    q, k, v = make_qkv(rng, 1, 1300, 1200, 8, 8, d, d, F16, layout="bhsd")
    _check_forward(q, k, v, F16, layout="bhsd", causal=True)
    torch = pytest.importorskip("torch")
    out = torch.zeros((1, 8, 1300, d + 2), dtype=torch.float16, device="cuda")[..., 1:d + 1]   # no 16-byte rows
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    attnext.attention(tq, tk, tv, layout="bhsd", out=out)
    assert_close("out", out.cpu().numpy(), reference.attention(q, k, v, layout="bhsd"), F16)
    assert chosen and all(chosen) == (hopper and ws) and any(chosen) == all(chosen), chosen
    chosen.clear()
    kb, vb = (x[:1].expand(2, -1, -1, -1) for x in (tk, tv))     # a batch stride of 0: no tensor maps
    qb = torch.cat([tq, tq])
    got = attnext.attention(qb, kb, vb, layout="bhsd", causal=True)
    want = reference.attention(np.concatenate([q, q]), np.concatenate([k, k]), np.concatenate([v, v]),
                               layout="bhsd", causal=True)
    assert_close("out", got.cpu().numpy(), want, F16)
    assert chosen == [False], chosen


@pytest.mark.parametrize("kernel", ["ws", "two_warpgroups", "mma_sync"])
@pytest.mark.parametrize("d", [64, 128])
def test_rising_maxima_lag_behind_their_rows(kernel, d, rng, monkeypatch):
    """softmax_update lets a row's running maximum lag up to STALE_MAX_LOG2 (2^8) behind its
    scores, moving it (and rescaling O) only past that: rows whose scores rise along the keys
    by about 1, 3, 10 and 40 log2 units a 128-key tile (m lags by up to 2^8, P reaching ~2^8
    before it moves; or m moves every tile), fall by 3 or 40 (the kernels take key tiles last to
    first: rising scores to them), or stay level, and in a band of rows one in four falling by
    200, through the WS kernel (three and two computing warpgroups; on these plain calls its
    LAZY_MAX softmax: P against m without the tile's maxima, the scores back by lg2 where a sum
    says m must move, and by s_again's products in the band's warps, where a p overflows), the
    two-warpgroup kernel (ATTNEXT_FWD_WS=0) and the mma.sync one (64-key tiles), and split-KV
    decode rows of each slope, in bf16 and fp16; then float32 (Hopper's TF32 kernel there) on
    gentler slopes, as scores of a few hundred round past float32's rule."""
    if kernel == "two_warpgroups":
        monkeypatch.setenv("ATTNEXT_FWD_WS", "0")
    if kernel == "mma_sync":
        monkeypatch.setenv("ATTNEXT_FWD_SM90", "0")
    sq, sk, scale = 1100, 1333, 1 / np.sqrt(d)
    # score (r, j) = a_r t_j: t_j rises by ln 2 / 128 a key (1 log2 unit a 128-key tile) with a
    # little noise, a_r the row's slope in those units
    t = np.log(2) / 128 * np.arange(sk) + 0.05 * rng.standard_normal(sk)
    for dtypes, slopes, steep in (((BF16, F16), [1, 3, 10, 40, -3, -40, 0], -200),
                                  ((np.float32,), [0.5, 1, 3, -1, 0], -1)):
        a = np.array(slopes, dtype=np.float64)[np.arange(sq) % len(slopes)]
        a[sq // 2:sq // 2 + 64:4] = steep                   # s_again's warps; the others' m moves by lg2
        a *= 1 + 0.01 * rng.standard_normal(sq)
        q = np.ones((2, sq, 4, d)) * a[None, :, None, None] + 0.01 * rng.standard_normal((2, sq, 4, d))
        k = np.ones((2, sk, 2, d)) * (t / (scale * d))[None, :, None, None]
        v = rng.standard_normal((2, sk, 2, d))
        for dtype in dtypes:
            qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
            _check_forward(qd, kd, vd, dtype)
            _check_forward(qd, kd, vd, dtype, causal=True)
            for r in range(sq - len(slopes), sq):                # one query row: split-KV decode
                _check_forward(qd[:, r:r + 1], kd, vd, dtype)


@pytest.mark.parametrize("d", [64, 128])
def test_level_rows_of_every_magnitude(d, rng):
    """Rows whose scores are all one value X, from |X to_log2| ~ 2^4 to 2^121 (to_log2 = scale
    log2 e), so each row attends to its keys uniformly, through the WS kernel in bf16: its LAZY_MAX
    softmax takes P = exp2(s to_log2 - m to_log2) with m to_log2 rounded, which only rows of
    |m to_log2| < LAZY_MC_MAX (2^8) may (lazy_rows); past 2^31 that rounding alone is more than
    126 log2 units, a p of 0 or inf, and a key tile lost. X = D a 2^e exactly (q = a 2^e with a
    in 1.25 .. 1.75, k = 1), so X to_log2 is no power of 2 and rounds; the rows' magnitudes change
    every 16 rows (a warp's) and V rises along the keys, so a tile lost moves the mean."""
    sq, sk = 1100, 1333
    exps = [0, 4, 9, 14, 20, 28, 33, 40, 52, 64, 77, 90, 101, 110, 116]
    mants = [1.25, 1.375, 1.5, 1.625, 1.75]
    block = np.arange(sq) // 16
    a = (np.take(mants, block % len(mants)) * np.exp2(np.take(exps, block % len(exps)))
         * np.where(block // len(exps) % 2, -1.0, 1.0))
    q = np.ones((1, sq, 2, d)) * a[None, :, None, None]
    k = np.ones((1, sk, 1, d))
    v = (np.arange(sk) / sk)[None, :, None, None] * (1 + 0.5 * rng.random((1, 1, 1, d)))
    qd, kd, vd = (x.astype(BF16) for x in (q, k, v))
    assert np.array_equal(qd.astype(np.float64), q)                # so every score is exact
    _check_forward(qd, kd, vd, BF16)
    _check_forward(qd, kd, vd, BF16, causal=True)


def _spy_persist(monkeypatch):
    """The (ATTNEXT_FWD_PERSIST, whether the plan took the persistent grid) of each forward plan
    made from here on."""
    from attnext.cuda import select
    persisted = []
    fwd_persist = select.fwd_persist

    def spy(*args, **kw):
        persisted.append((os.environ.get("ATTNEXT_FWD_PERSIST"), fwd_persist(*args, **kw)))
        return persisted[-1][1]
    monkeypatch.setattr(select, "fwd_persist", spy)
    return persisted


@pytest.mark.parametrize("counters", ["lent", "none"])
@pytest.mark.parametrize("d", [64, 128])
def test_persistent_ws_forward(d, counters, rng, monkeypatch):
    """A dense batch's WS forward runs as a persistent grid: a CTA an SM takes the query tiles in
    turn, its next one from a count in the counters the stream lends (left 0 for the next launch),
    or every gridDim.x-th where none is lent. More tiles than SMs, tiles of unequal work (causal),
    tiles with no key (causal with Sq > Sk: their rows write zeros and an lse of -inf), a partial
    last tile, GQA, a window, ALiBi and softcap; each call twice (a count left anything but 0
    would skip tiles the second time), against the reference and bit for bit against a CTA a
    tile (ATTNEXT_FWD_PERSIST=0). O leaves by bulk tensor copies (out's map) or by the threads'
    stores (ATTNEXT_FWD_TMA_STORE=0, or an out whose rows are not 16-byte aligned), into an out
    whose rows are padded (the copies write no column past Dv) or not, the same bits every way. On
    Hopper every such plan takes the persistent grid where the lab asks for it
    (ATTNEXT_FWD_PERSIST=1)."""
    from attnext.cuda import process
    monkeypatch.setenv("ATTNEXT_FWD_PERSIST", "1")
    if counters == "none":
        monkeypatch.setattr(process, "borrow_counters", lambda *args: None)
    persisted = _spy_persist(monkeypatch)
    chosen, hopper = _spy_ws(monkeypatch)
    cases = [((3, 2000, 2100, 8, 2), dict(causal=True)), ((3, 2000, 2100, 8, 2), {}),
             ((2, 2100, 1000, 4, 4), dict(causal=True)), ((2, 1500, 1600, 8, 8), dict(window=(300, 0))),
             ((2, 1500, 1600, 8, 8), dict(alibi_slopes=rng.random(8).astype(np.float32), softcap=5.0))]
    torch = pytest.importorskip("torch")
    from helpers.gpu import to_gpu, to_host
    for (b, sq, sk, hq, hk), opts in cases:
        q, k, v = make_qkv(rng, b, sq, sk, hq, hk, d, d, BF16)
        out, lse = _check_forward(q, k, v, BF16, **opts)
        # the same call on torch tensors, into outputs of NaN (a tile skipped stays NaN): twice on
        # the same counts, then a CTA a tile
        tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
        topts = {n: to_gpu(torch, x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
        for mode, tma_store, pad in (("1", "1", 0), ("1", "1", 0), ("1", "1", 8), ("1", "1", 1), ("1", "0", 8),
                                     ("0", "1", 0)):
            monkeypatch.setenv("ATTNEXT_FWD_PERSIST", mode)
            monkeypatch.setenv("ATTNEXT_FWD_TMA_STORE", tma_store)
            whole = torch.full((*tq.shape[:3], d + pad), float("nan"), dtype=tq.dtype, device=tq.device)
            dst = whole[..., :d]
            _, lse_got = attnext.attention(tq, tk, tv, out=dst, return_lse=True, **topts)
            np.testing.assert_array_equal(to_host(torch, dst.contiguous()), out)
            np.testing.assert_array_equal(lse_got.cpu().numpy(), lse)
            assert torch.isnan(whole[..., d:]).all(), (mode, tma_store, pad)     # the padding untouched
        monkeypatch.setenv("ATTNEXT_FWD_PERSIST", "1")
        monkeypatch.setenv("ATTNEXT_FWD_TMA_STORE", "1")
    if hopper:
        assert chosen and all(chosen), chosen
        assert persisted and all(chose == (knob == "1") for knob, chose in persisted), persisted
        assert {knob for knob, _ in persisted} == {"0", "1"}, persisted


def test_ws_forward_in_cta_pairs(rng, monkeypatch):
    """A D = 128 WS forward a CTA a tile over a dense batch with an even number of query tiles runs
    its CTAs in pairs (select.fwd_cluster: a cluster of two, whose copies each bring one 64-column
    panel of every K and V tile into both CTAs): the reference's answer and the same bits as the
    CTAs alone (ATTNEXT_FWD_CLUSTER=0), over keys past the last whole tile, a last query tile whose
    second warpgroup has no row, GQA, bhsd, fewer keys than rows, the 176-key tile over long keys,
    and under the lab's ATTNEXT_FWD_CLUSTER=1 a bias, mask, ALiBi and softcap, sinks and a
    generated score_mod. By default a plain call pairs its CTAs; an odd number of query tiles, a
    causal mask, a window or seqused_k keep them alone."""
    from attnext.cuda import select
    monkeypatch.setenv("ATTNEXT_FWD_PERSIST", "0")
    paired = []
    fwd_cluster = select.fwd_cluster

    def spy(*args, **kw):
        paired.append(fwd_cluster(*args, **kw))
        return paired[-1]
    monkeypatch.setattr(select, "fwd_cluster", spy)
    chosen, hopper = _spy_ws(monkeypatch)
    c = 3 + int.from_bytes(os.urandom(2), "little") % 1000
    cases = [((2, 1280, 1333, 8, 2, "bshd"), {}),                 # 10 query tiles a head
             ((2, 1460, 700, 4, 2, "bhsd"), {}),                  # 12, over 6 key tiles; the last
                                                                  # tile's second warpgroup has no row
             ((1, 2304, 8300, 4, 4, "bshd"), {}),                 # the 176-key tile
             ((2, 1280, 1333, 8, 2, "bshd"), dict(bias=randn(rng, (1, 8, 1280, 1), np.float32),
                                                  mask=rng.random((2, 1, 1280, 1333)) > 0.1,
                                                  alibi_slopes=rng.random(8).astype(np.float32), softcap=5.0)),
             ((2, 1280, 1333, 8, 2, "bshd"), dict(sinks=randn(rng, (8,), np.float32),
                                                  score_mod=lambda s, b, h, qi, ki: s - 0.01 * ((qi - ki) % c)))]
    for (b, sq, sk, hq, hk, layout), opts in cases:
        q, k, v = make_qkv(rng, b, sq, sk, hq, hk, 128, 128, BF16, layout=layout)
        monkeypatch.setenv("ATTNEXT_FWD_CLUSTER", "1")
        del paired[:]
        out, lse = _check_forward(q, k, v, BF16, layout=layout, **opts)
        assert not hopper or paired == [True], (sq, paired)
        monkeypatch.setenv("ATTNEXT_FWD_CLUSTER", "0")
        alone, alone_lse = attnext.attention(q, k, v, layout=layout, device="cuda", return_lse=True, **opts)
        np.testing.assert_array_equal(out, alone)
        np.testing.assert_array_equal(lse, alone_lse)
    monkeypatch.delenv("ATTNEXT_FWD_CLUSTER")
    q, k, v = make_qkv(rng, 2, 1280, 1333, 8, 2, 128, 128, BF16)
    del paired[:]
    _check_forward(q, k, v, BF16)
    assert not hopper or paired == [True], paired
    odd = make_qkv(rng, 2, 1100, 1333, 8, 2, 128, 128, BF16)           # 9 query tiles
    for qkv, opts in ((odd, {}), ((q, k, v), dict(causal=True)), ((q, k, v), dict(window=(300, 20))),
                      ((q, k, v), dict(seqlens_k=np.array([1333, 900])))):
        del paired[:]
        _check_forward(*qkv, BF16, **opts)
        assert not any(paired), (opts, paired)
    assert not hopper or (chosen and all(chosen)), chosen


@pytest.mark.parametrize("d", [64, 128])
def test_causal_tiles_in_sections(d, rng, monkeypatch):
    """A causal WS forward takes its tiles longest first in sections of (sequence, head) pairs
    whose K and V fit 32 MiB of L2 (attn_fwd_sm90.cu's ws_section): here 21 pairs of 8192 keys, in
    sections of 16 pairs (D = 64) or 8 (D = 128), the last one partial. A CTA a tile and the
    persistent grid each write every row (into outputs of NaN) as torch's float32 attention does."""
    torch = pytest.importorskip("torch")
    from helpers.gpu import to_gpu, to_host
    persisted = _spy_persist(monkeypatch)
    chosen, hopper = _spy_ws(monkeypatch)
    q, k, v = make_qkv(rng, 3, 8192, 8192, 7, 7, d, d, BF16)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (tq, tk, tv)),
                                                           is_causal=True).transpose(1, 2)
    ref = ref.cpu().numpy()
    for mode in ("0", "1"):
        monkeypatch.setenv("ATTNEXT_FWD_PERSIST", mode)
        dst = torch.full_like(tq, float("nan"))
        attnext.attention(tq, tk, tv, causal=True, out=dst)
        assert_close("out", to_host(torch, dst), ref, BF16)
    if hopper:
        assert chosen and all(chosen), chosen
        assert {knob for knob, _ in persisted} == {"0", "1"}, persisted
        assert all(chose == (knob == "1") for knob, chose in persisted), persisted


@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
@pytest.mark.parametrize("sq, sk", [(200, 300), (1, 5000)], ids=["tiles", "split_kv"])
def test_nan_propagates(kernel, sq, sk, rng, monkeypatch):
    """A NaN in a query row makes that row's out and lse NaN, as IEEE and the reference say; it is
    not taken for a row that keeps no key (0, -inf). Other rows are untouched. "split_kv": the
    decode path's combine step."""
    if kernel == "mma_sync":
        monkeypatch.setenv("ATTNEXT_FWD_SM90", "0")
    q, k, v = make_qkv(rng, 2, sq, sk, 8, 2, 128, 128, BF16)
    q[1, sq - 1, 3, 5] = np.nan
    out, lse = attnext.attention(q, k, v, device="cuda", return_lse=True)
    r_out, r_lse = reference.attention(q, k, v, return_lse=True)
    assert np.isnan(out[1, sq - 1, 3].astype(np.float32)).all() and np.isnan(lse[1, 3, sq - 1])
    keep = np.ones(out.shape[:3], bool)
    keep[1, sq - 1, 3] = False
    assert_close("out", out[keep], r_out[keep], BF16)
    assert np.isfinite(lse[keep.transpose(0, 2, 1)]).all()


@pytest.mark.parametrize("sq, sk", [(19, 0), (0, 33), (0, 0)], ids=["no_keys", "no_queries", "neither"])
def test_empty_sequences(sq, sk, rng):
    """S = 0 (an empty q, k or v may come with no address at all): out rows 0, lse -inf, zero
    gradients, never an error (the fuzzer found Sk = 0 refused by the launch's checks)."""
    q, k, v = make_qkv(rng, 2, sq, sk, 4, 2, 64, 64, BF16)
    out, lse = attnext.attention(q, k, v, device="cuda", return_lse=True)
    assert out.shape == (2, sq, 4, 64) and (out == 0).all() and np.isneginf(lse).all()
    g = attnext.attention_backward(np.ones_like(out), q, k, v, out, lse, device="cuda")
    assert all((x == 0).all() for x in g[:3])
    cu_q, cu_k = np.array([0, 7, 12], np.int32), np.array([0, 0, 0], np.int32)
    qv, kv, vv = make_varlen_qkv(rng, 12, 0, 4, 2, 64, 64, F16)
    out = attnext.varlen_attention(qv, kv, vv, cu_q, cu_k, device="cuda")
    assert (out == 0).all()


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_torch_tensors_in_place(layout, rng, torch):
    q, k, v = make_qkv(rng, 2, 300, 300, 8, 2, 128, 128, BF16, layout=layout)
    tq, tk, tv = (torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda()
                  for x in (q, k, v))
    out = attnext.attention(tq, tk, tv, causal=True, layout=layout)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.bfloat16
    got = out.float().cpu().numpy()
    assert_close("out", got.astype(BF16), reference.attention(q, k, v, causal=True, layout=layout), BF16)
    # out= on the device is written in place and returned
    dst = torch.empty_like(out)
    res = attnext.attention(tq, tk, tv, causal=True, layout=layout, out=dst)
    assert res is dst and torch.equal(dst, out)


@pytest.mark.parametrize("sq, sk", [(300, 300), (1, 5000)], ids=["tiles", "split_kv"])
def test_torch_without_lse(sq, sk, rng, torch):
    """A GPU call that does not ask for lse writes none (no buffer): the same out as with it."""
    q, k, v = make_qkv(rng, 2, sq, sk, 8, 2, 128, 128, BF16)
    tq, tk, tv = (torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda()
                  for x in (q, k, v))
    out = attnext.attention(tq, tk, tv, causal=True)
    again, lse = attnext.attention(tq, tk, tv, causal=True, return_lse=True)
    assert torch.equal(out, again) and lse.shape == (2, 8, sq)
    assert_close("out", out.float().cpu().numpy().astype(BF16), reference.attention(q, k, v, causal=True), BF16)


@pytest.mark.parametrize("sq, sk", [(1, 5000), (300, 300)], ids=["split_kv", "tiles"])
def test_repeated_calls_read_their_arrays_afresh(sq, sk, rng, torch):
    """Calls equal in their arrays and options replay the first call's launches (cuda/repeat.py):
    each reads what the arrays hold now (q and v written in place between calls), a fresh out and
    lse each time where no out= is given, out= written in place; a new tensor, a new option and
    a new out= each take the whole path, and every result matches the reference."""
    from attnext.cuda import backend, repeat
    from helpers.gpu import to_gpu
    from helpers.spies import whole_path_calls
    backend.clear_plans()     # and the recipes: an earlier test's arrays may have had these addresses
    with whole_path_calls() as whole:
        q, k, v = make_qkv(rng, 2, sq, sk, 8, 2, 128, 128, BF16)
        t = lambda x: to_gpu(torch, x)
        tq, tk, tv = t(q), t(k), t(v)
        dst = torch.empty_like(tq)
        results = []
        for i in range(4):
            if i:                         # new values in the same memory: the replay must read them
                q, _, v = make_qkv(rng, 2, sq, sk, 8, 2, 128, 128, BF16)
                tq.copy_(t(q))
                tv.copy_(t(v))
            n = len(whole)
            out, lse = attnext.attention(tq, tk, tv, causal=True, return_lse=True)
            res = attnext.attention(tq, tk, tv, causal=True, out=dst)
            assert (len(whole) - n == 2) == (i == 0), (i, len(whole) - n)     # replays after the first
            r_out, r_lse = reference.attention(q, k, v, causal=True, return_lse=True)
            assert isinstance(out, torch.Tensor) and res is dst
            assert_close("out", out.float().cpu().numpy().astype(BF16), r_out, BF16)
            assert_close("out=", dst.float().cpu().numpy().astype(BF16), r_out, BF16)
            assert_lse_close(lse.cpu().numpy(), r_lse, BF16)
            results.append(out)
        assert len({o.data_ptr() for o in results}) == len(results)     # fresh results, all alive
        n = len(whole)
        other = t(q)
        assert_close("new q", attnext.attention(other, tk, tv, causal=True).float().cpu().numpy().astype(BF16),
                     reference.attention(q, k, v, causal=True), BF16)
        assert_close("no mask", attnext.attention(tq, tk, tv).float().cpu().numpy().astype(BF16),
                     reference.attention(q, k, v), BF16)
        assert len(whole) - n == 2 and repeat.count() > 0


def test_repeated_calls_with_host_lengths_and_document_masks_follow_their_contents(rng, torch):
    """Calls with NumPy lengths (varlen cu_seqlens) and with a document mask_mod over a NumPy array
    (lowered to varlen) replay after their first call, reading q as it is now; lengths or the
    document array rewritten in place take the whole path with the new values. CUDA lengths with
    max_seqlen_* replay throughout, rewritten in place included. Every result matches the
    reference."""
    from attnext.cuda import backend
    from helpers.gpu import to_gpu
    from helpers.spies import whole_path_calls
    backend.clear_plans()
    T, H, D = 700, 4, 128
    t = lambda x: to_gpu(torch, x)
    q, k, v = make_varlen_qkv(rng, T, T, H, H, D, dtype=BF16)
    tq, tk, tv = t(q), t(k), t(v)
    cu = np.array([0, 130, 400, T], np.int32)
    doc = np.repeat(np.arange(3), np.diff(cu))
    cu_t = torch.from_numpy(cu.copy()).cuda()

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    with whole_path_calls() as whole:
        for step in range(4):
            if step == 2:                 # new lengths and documents, in place
                cu[1] = 200
                doc[130:200] = 0
                cu_t.copy_(torch.from_numpy(cu.copy()))
            if step:                      # new values in the same memory
                q = make_varlen_qkv(rng, T, T, H, H, D, dtype=BF16)[0]
                tq.copy_(t(q))
            n = len(whole)
            got = attnext.varlen_attention(tq, tk, tv, cu, cu, causal=True)
            assert_close("varlen", got.float().cpu().numpy().astype(BF16),
                         reference.varlen_attention(q, k, v, cu, cu, causal=True), BF16)
            got = attnext.attention(tq[None], tk[None], tv[None], causal=True, mask_mod=same_doc)
            assert_close("documents", got[0].float().cpu().numpy().astype(BF16),
                         reference.varlen_attention(q, k, v, cu, cu, causal=True), BF16)
            got = attnext.varlen_attention(tq, tk, tv, cu_t, cu_t, max_seqlen_q=300, max_seqlen_k=300, causal=True)
            assert_close("CUDA lengths", got.float().cpu().numpy().astype(BF16),
                         reference.varlen_attention(q, k, v, cu, cu, causal=True), BF16)
            assert len(whole) - n == {0: 3, 2: 2}.get(step, 0), (step, len(whole) - n)


def test_repeated_paged_calls_read_their_table_and_lengths_afresh(rng, torch):
    """A paged decode whose CUDA block_table and seqlens_k are read in place replays (after the
    first call, none takes the whole path): each replay reads the table and lengths as they are
    now (rewritten in place between calls: pages moved, sequences grown), the reference's out
    each time, and a page out of range written into the table is reported by the next call."""
    from attnext.cuda import backend
    from helpers.gpu import to_gpu
    from helpers.spies import whole_path_calls
    backend.clear_plans()
    B, Hq, Hk, D, page, pages = 3, 8, 2, 128, 16, 40
    q = randn(rng, (B, 1, Hq, D), BF16)
    kc, vc = randn(rng, (pages, page, Hk, D), BF16), randn(rng, (pages, page, Hk, D), BF16)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, kc, vc))
    table = torch.zeros((B, 10), dtype=torch.int32, device="cuda")
    lens = torch.zeros((B,), dtype=torch.int32, device="cuda")
    out = torch.empty_like(tq)
    with whole_path_calls() as whole:
        for i in range(4):
            t = rng.permutation(pages)[:B * 10].reshape(B, 10).astype(np.int32)
            n = rng.integers(1, 10 * page + 1, B).astype(np.int32)
            table.copy_(torch.from_numpy(t))
            lens.copy_(torch.from_numpy(n))
            w = len(whole)
            attnext.attention(tq, tk, tv, block_table=table, seqlens_k=lens, out=out)
            assert (len(whole) - w == 1) == (i == 0), (i, len(whole) - w)
            want = reference.attention(q, kc, vc, block_table=t, seqlens_k=n)
            assert_close("out", out.float().cpu().numpy().astype(BF16), want, BF16)
        table[1, 0] = pages + 5                          # read by sequence 1 (it has a page at least)
        attnext.attention(tq, tk, tv, block_table=table, seqlens_k=lens, out=out)
        with pytest.raises(IndexError, match=rf"block_table\[1, 0\] = {pages + 5} is out of range"):
            torch.cuda.synchronize()
            attnext.attention(tq, tk, tv, block_table=table, seqlens_k=lens, out=out)


def test_torch_noncontiguous_and_sdpa(torch):
    """A transposed (B, H, S, D) torch view read in place; agrees with PyTorch's own SDPA."""
    x = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.float16)
    out = attnext.attention(x, k, v, layout="bhsd", causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(x.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - want).abs().max().item() < 2e-3


def test_cupy_arrays(rng):
    cp = pytest.importorskip("cupy")
    q, k, v = make_qkv(rng, 1, 200, 333, 4, 4, 64, 64, F16)
    out = attnext.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True)
    assert isinstance(out, cp.ndarray)
    assert_close("out", cp.asnumpy(out), reference.attention(q, k, v, causal=True), F16)


# The CPU suite's rerun in shards, so each fits one command on a lent GPU machine (several minutes
# apiece: thousands of small cases, each checked against the float64 reference).
_MAIN_GROUPS = ["test_grid", "test_head_dims or test_windows or test_small_grid or test_varlen or test_seqlens",
                "test_bias or test_mask or test_fully_masked or test_alibi or test_softcap or test_score",
                # the rest in two (as one shard it ran past a 10-minute command twice on the H100)
                "test_scale or test_large_scores or test_everything_together or test_noncontiguous "
                "or test_misaligned or test_backward_reads or test_inputs_read_only or test_out_"]
CPU_SUITE_SHARDS = _MAIN_GROUPS + [" and ".join(f"not ({g})" for g in _MAIN_GROUPS)]


@pytest.mark.parametrize("precision", [None, "tf32"], ids=["default", "tf32"])
@pytest.mark.parametrize("shard", CPU_SUITE_SHARDS, ids=[f"shard{i}" for i in range(len(CPU_SUITE_SHARDS))])
def test_cpu_suite_on_cuda(shard, precision):
    """The CPU backend's test file, rerun with device="cuda": its float16, bfloat16 and float32
    cases at the default precision, and its float32 cases again with precision="tf32" (held to
    float16's rule: conftest.TEST_PRECISION)."""
    env = dict(os.environ, ATTNEXT_TEST_DEVICE="cuda", PYTHONPATH=pythonpath())
    if precision is not None:
        env["ATTNEXT_TEST_PRECISION"] = precision
        shard = f"f32 and ({shard})"
    try:
        import xdist  # noqa: F401  (the reference's CPU work dominates: spread it over the cores)
        workers = ["-n", str(min(14, os.cpu_count() or 1))]
    except ImportError:
        workers = []
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--maxfail=10", "-p", "no:cacheprovider",
                        *workers, str(TESTS / "cpu" / "test_cpu_attention.py"), "-k",
                        f"not simd_variants and ({shard})"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    print(r.stdout[-6000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-6000:]


DECODE = [(1, "none"), (1, "causal"), (3, "causal"), (16, "top_left"), (5, "window")]


@pytest.mark.parametrize("sq, mask", DECODE, ids=[f"sq{a}_{b}" for a, b in DECODE])
@pytest.mark.parametrize("b, sk", [(1, 5000), (3, 2000)], ids=["B1_Sk5000", "B3_Sk2000"])
def test_decode_split_kv(b, sk, sq, mask, rng):
    """KV-cache shapes: packed GQA and split-KV (B * Hk blocks cannot fill the GPU)."""
    from attnext.cuda import backend as cuda_backend
    q, k, v = make_qkv(rng, b, sq, sk, 8, 2, 128, 128, BF16)
    opts = {"none": {}, "causal": {"causal": True}, "top_left": {"causal": "top_left"},
            "window": {"window": (700, 0)}}[mask]
    seqlens_k = rng.integers(1, sk + 1, size=b).astype(np.int32)
    seqlens_k[0] = sk
    o = attnext.checks.normalise(q, k, v, dict(causal=opts.get("causal", False), window=opts.get("window"), scale=None, softcap=None, alibi_slopes=None,
                               bias=None, mask=None, score_mod=None, mask_mod=None, seqlens_q=None,
                               seqlens_k=None, layout="bshd", return_lse=False, device="cuda",
                               out=None, precision=None))
    pack, splits, _ = cuda_backend._decode_plan(o, dict(dtype="bfloat16", bias_dtype=None, alibi_dtype=None, mask=False,
                                                     vec=True), 0)
    assert pack and splits > 1
    _check_forward(q, k, v, BF16, seqlens_k=seqlens_k, **opts)


TMA_CASES = [(128, None), (64, None), (128, 16), (128, 64), (128, 128), (64, 32)]
# the shipped tile, and two stages (three CTAs an SM: the split count follows the ring's size)
TMA_TILES = [None, "16,64,1,2"]


@pytest.mark.parametrize("tile", TMA_TILES, ids=lambda t: f"tile{t}".replace(",", "_"))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d, page", TMA_CASES, ids=[f"d{a}_page{b}" for a, b in TMA_CASES])
def test_decode_by_tensor_copies(dtype, d, page, tile, rng):
    """Hopper's TMA_KV decode (a producer warp's tensor copies into a ring of stages; the shipped
    ring and a two-stage one), contiguous and over pages, against the reference; lengths ending
    inside a tile, NaN keys past them (never seen), and the same call on the cp.async kernel
    (ATTNEXT_DECODE_TMA=0) agreeing."""
    from attnext import _env
    from attnext.cuda import backend as cuda_backend, select
    _env.setenv("ATTNEXT_TILE_DECODE_TMA", tile)
    try:
        if not select.decode_tma(cuda_backend.device_arch(0), d, d, True, "bfloat16", 3000, page or 0):
            pytest.skip("no TMA_KV here (not Hopper, or no tensor maps in this driver)")
        b, sk, hq, hk = 3, 3000, 8, 2
        q, k, v = make_qkv(rng, b, 1, sk, hq, hk, d, d, dtype)
        lens = np.array([sk, 1777, 45], np.int32)
        for i, n in enumerate(lens):
            k[i, n:], v[i, n:] = np.nan, np.nan
        opts = dict(seqlens_k=lens)
        if page:
            pages = -(-sk // page)
            order = rng.permutation(b * pages)
            table = order.reshape(b, pages).astype(np.int32)
            kp, vp = np.empty((b * pages, page, hk, d), dtype), np.empty((b * pages, page, hk, d), dtype)
            pad = pages * page - sk
            for i in range(b):
                kp[table[i]] = np.pad(k[i], ((0, pad), (0, 0), (0, 0))).reshape(pages, page, hk, d)
                vp[table[i]] = np.pad(v[i], ((0, pad), (0, 0), (0, 0))).reshape(pages, page, hk, d)
            out, lse = attnext.attention(q, kp, vp, block_table=table, device="cuda", return_lse=True, **opts)
        else:
            out, lse = attnext.attention(q, k, v, device="cuda", return_lse=True, **opts)
    finally:
        _env.setenv("ATTNEXT_TILE_DECODE_TMA", None)
    r_out, r_lse = reference.attention(q, k, v, return_lse=True, **opts)
    assert_close("out", out, r_out, dtype)
    assert_lse_close(lse, r_lse, dtype)
    _env.setenv("ATTNEXT_DECODE_TMA", "0")
    try:
        old = attnext.attention(q, k, v, device="cuda", **opts)
    finally:
        _env.setenv("ATTNEXT_DECODE_TMA", None)
    assert_close("out (cp.async kernel)", old, r_out, dtype)


@pytest.mark.parametrize("tma", ["1", "0"], ids=["tma", "cp_async"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", ["packed", "sinks", "bias", "three_rows"])
def test_decode_combine_in_the_split_kernel(case, d, tma, rng, monkeypatch):
    """A split-KV forward's partials merged by the TMA_KV kernel's last CTA of each query tile
    (a few packed rows a tile: counters lent per stream) and by attn_fwd_combine (more rows a
    tile, "three_rows": three query rows of four heads; the cp.async kernel; and
    ATTNEXT_DECODE_COMBINE=kernel), each against the reference, out and lse; each twice, the
    second on the counters the first set back to 0, which are read back as zeros. "bias": heads
    unpacked (a tile a head)."""
    from attnext import _C, _env
    from attnext.cuda import backend as cuda_backend, process, select
    lent = []
    borrow = process.borrow_counters
    monkeypatch.setattr(process, "borrow_counters", lambda *a: lent.append(borrow(*a)) or lent[-1])
    sq = 3 if case == "three_rows" else 1
    q, k, v = make_qkv(rng, 2, sq, 3000, 8, 2, d, d, BF16)
    opts = {"packed": {}, "three_rows": {"causal": True},
            "sinks": {"sinks": randn(rng, (8,), np.float32) + 2.0},
            "bias": {"bias": randn(rng, (2, 8, sq, 3000), np.float32)}}[case]
    r_out, r_lse = reference.attention(q, k, v, return_lse=True, **opts)
    _env.setenv("ATTNEXT_DECODE_TMA", tma)
    try:
        for mode in (None, "kernel"):
            _env.setenv("ATTNEXT_DECODE_COMBINE", mode)
            try:
                for _ in range(2):
                    out, lse = attnext.attention(q, k, v, device="cuda", return_lse=True, **opts)
                    assert_close(f"out ({mode or 'split'})", out, r_out, BF16)
                    assert_lse_close(lse, r_lse, BF16)
            finally:
                _env.setenv("ATTNEXT_DECODE_COMBINE", None)
    finally:
        _env.setenv("ATTNEXT_DECODE_TMA", None)
    own = (tma == "1" and case != "three_rows"
           and select.decode_tma(cuda_backend.device_arch(0), d, d, True, "bfloat16", 3000, 0))
    assert len(lent) == (2 if own else 0) and all(lent), lent      # the default calls' counters
    if own:
        ptr, n = process._counters[(0, 0)]
        back = bytearray(4 * n)
        _C.memcpy_dtoh(back, ptr, 0, 0)
        assert not any(back), "a counter left non-zero"


def test_decode_with_bias_is_not_packed(rng):
    q, k, v = make_qkv(rng, 1, 2, 3000, 8, 2, 64, 64, F16)
    bias = randn(rng, (1, 8, 2, 3000), np.float32)
    _check_forward(q, k, v, F16, bias=bias, causal=True)
