"""Every kernel variant compiles with NVRTC for every target architecture (no GPU needed).

CI installs the nvidia-cuda-nvrtc wheel (the `test` extra), so a kernel or code-generation
error fails CI even though CI has no GPU. Set ATTNEXT_NO_NVRTC=1 to skip on a machine that
cannot have NVRTC.
"""
import itertools
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from attnext.cuda import nvrtc, select


def test_warmup_check_compiles_every_variant(tmp_path):
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    env = dict(os.environ, ATTNEXT_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "attnext.warmup", "--check"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    for arch in select.ARCHS:
        assert f"{arch}: {len(select.variants(arch))} variants" in r.stdout, r.stdout
        assert (f"{arch}: {len(select.mod_variants(arch))} score_mod / mask_mod variants"
                in r.stdout), r.stdout
    # a second run finds every cubin on disk and compiles nothing
    r = subprocess.run([sys.executable, "-m", "attnext.warmup", "--check"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "compiles 0 " in r.stdout, r.stdout


# a lambda: its capture list ([], [&], [=, ...]), a template parameter list, annotations, parameters
LAMBDA = re.compile(r"\[(?:[&=][^\[\]]*)?\]\s*(<[^>]*>)?\s*((?:__\w+__\s*)*)\(([^()]*(?:\([^()]*\)[^()]*)*)\)")


def test_kernels_use_no_lambda_that_nvrtc_13_0_refuses():
    """NVRTC 13.0 refuses a generic lambda in device code (it takes it for a host function);
    13.5 takes it, so a compile test with 13.5 alone does not catch it. Both refuse a lambda
    annotated __device__ (13.0 wants --extended-lambda, 13.5 none in JIT mode). Lambdas with
    plain parameters are fine."""
    found = []
    for f in sorted(pathlib.Path(nvrtc.KERNEL_DIR).iterdir()):
        src = re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group(0)), f.read_text(),
                     flags=re.S)
        for m in LAMBDA.finditer(src):
            where = f"{f.name}:{src.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            found.append(where)
            assert not m.group(1), f"template lambda {where}"
            assert not m.group(2).strip(), f"annotated lambda {where}"
            assert not re.search(r"\bauto\b", m.group(3)), f"generic lambda {where}"
    assert len(found) >= 10, found      # the pattern finds the kernels' lambdas


def test_tile_configs_fit_shared_memory():
    """Every forward variant asks for no more shared memory than an sm_80 block may have."""
    for kernel, d in select.variants():
        if kernel == "attn_fwd":
            tile = (d["BLOCK_M"], d["BLOCK_N"], d["NUM_WARPS"])
            assert select.fwd_smem_bytes(d["HEAD_DIM"], d["HEAD_DIM_V"], tile) <= select.MAX_SMEM_SM80


def test_hopper_decode_by_tensor_copies_where_it_applies(monkeypatch):
    """TMA_KV: Hopper, 16-bit, D and Dv in {64, 128}, 16-byte rows, pages that tile its tiles
    evenly or else a k tensor of at least a tile's rows, a driver with tensor maps,
    ATTNEXT_DECODE_TMA not 0; two CTAs of its ring fit an SM."""
    from attnext import _C, _env
    monkeypatch.setattr(_C, "cuda_tensor_maps", lambda: True)
    assert select.decode_tma("sm_90a", 128, 128, True, "bfloat16", 4096)
    assert select.decode_tma("sm_90a", 64, 64, True, "float16", 16, page_size=16)
    assert select.decode_tma("sm_90a", 128, 128, True, "bfloat16", 256, page_size=256)
    bn = select.decode_tma_tile()[1]
    for args, kw in ((("sm_80", 128, 128, True, "bfloat16", 4096), {}), (("sm_90a", 96, 96, True, "bfloat16", 4096), {}),
                     (("sm_90a", 128, 128, False, "bfloat16", 4096), {}), (("sm_90a", 128, 128, True, "float32", 4096), {}),
                     (("sm_90a", 128, 128, True, "bfloat16", 8), {"page_size": 8}),
                     (("sm_90a", 128, 128, True, "bfloat16", 48), {"page_size": 48}),
                     (("sm_90a", 128, 128, True, "bfloat16", bn - 1), {}),
                     (("sm_90a", 128, 128, True, "bfloat16", 1), {})):
        assert not select.decode_tma(*args, **kw), (args, kw)
    monkeypatch.setattr(_C, "cuda_tensor_maps", lambda: False)
    assert not select.decode_tma("sm_90a", 128, 128, True, "bfloat16", 4096)
    monkeypatch.setattr(_C, "cuda_tensor_maps", lambda: True)
    _env.setenv("ATTNEXT_DECODE_TMA", "0")
    try:
        assert not select.decode_tma("sm_90a", 128, 128, True, "bfloat16", 4096)
    finally:
        _env.setenv("ATTNEXT_DECODE_TMA", None)
    tile = select.decode_tma_tile()
    assert select.fwd_kernel("sm_90a", 128, 128, True, True, 1, tma=True) == ("attn_fwd", tile)
    d = select.fwd_defines(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None,
                           alibi_dtype=None, mask=False, tile=tile, pack_gqa=True, tma=True)
    assert (d["TMA_KV"], d["STAGES"], d["MIN_BLOCKS"]) == (1, tile[3], 1)
    smem = select.fwd_smem_bytes(128, 128, tile, "attn_fwd", "bfloat16", tma=True)
    assert smem == 2 * (tile[3] * tile[1] * 256 + tile[0] * 136) + 1024
    assert 2 * (smem + 1024) <= 228 * 1024          # two CTAs an SM (each with the driver's 1 KiB)
    assert select.decode_ctas_per_sm(smem) == 2     # the split count aims at the CTAs the ring lets in
    two = select.fwd_smem_bytes(128, 128, tile[:3] + (2,), "attn_fwd", "bfloat16", tma=True)
    assert select.decode_ctas_per_sm(two) == 3 and select.decode_ctas_per_sm() == select.DECODE_CTAS_PER_SM
    assert any("TMA_KV" in d for k, d in select.variants("sm_90a"))
    assert not any("TMA_KV" in d for k, d in select.variants("sm_80"))


def test_hopper_long_forward_is_warp_specialised_where_it_applies(monkeypatch):
    """attn_fwd_sm90.cu's WS kernel: Hopper, 16-bit, D = Dv in {64, 128}, keys a bulk copy can
    read (never a page table's or a zero stride's) of at least a tile's rows, a driver with tensor
    maps, ATTNEXT_FWD_WS not 0, at any number of query rows (but D = 64's short ones with a
    softcap or a score_mod); its tile (64 keys with a score_mod, 128 once compiled for one that
    loads from no array per score), defines and shared memory (three stages of K and V still fit
    an SM)."""
    from attnext import _C, _env
    from attnext.mods import codegen, trace
    monkeypatch.setattr(_C, "cuda_tensor_maps", lambda: True)
    ok = dict(arch="sm_90a", D=128, Dv=128, vec=True, rows=1, key_rows=4096, dtype="bfloat16", copyable=True)
    assert select.fwd_ws(**ok) and select.fwd_ws(**{**ok, "dtype": "float16"}) and select.fwd_ws(**{**ok, "D": 64, "Dv": 64})
    for change in (dict(arch="sm_80"), dict(D=96, Dv=96), dict(Dv=64), dict(vec=False), dict(dtype="float32"),
                   dict(key_rows=127), dict(copyable=False)):
        assert not select.fwd_ws(**{**ok, **change}), change
    monkeypatch.setattr(_C, "cuda_tensor_maps", lambda: False)
    assert not select.fwd_ws(**ok)
    monkeypatch.setattr(_C, "cuda_tensor_maps", lambda: True)
    for name in ("ATTNEXT_FWD_WS", "ATTNEXT_FWD_SM90"):
        _env.setenv(name, "0")
        try:
            assert not select.fwd_ws(**ok), name
        finally:
            _env.setenv(name, None)
    assert select.fwd_ws(**{**ok, "key_rows": select.fwd_ws_tile()[1]}) and select.fwd_ws(**{**ok, "rows": 4096})
    # ... but for D = 64's short calls with a softcap or a score_mod (the two-warpgroup kernel there)
    softcap = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: 20 * np.tanh(s / 20)), None)
    window = codegen.generate(None, trace.trace_mask_mod(lambda b, h, q, kv: q - kv < 100))
    d64 = {**ok, "D": 64, "Dv": 64, "rows": select.SM90_SHORT_ROWS}
    assert select.fwd_ws(**d64) and select.fwd_ws(**d64, mods=window)
    assert select.fwd_ws(**ok, softcap=True) and select.fwd_ws(**ok, mods=softcap)
    for costly in (dict(softcap=True), dict(mods=softcap)):
        assert not select.fwd_ws(**d64, **costly) and not select.fwd_ws(**{**d64, "rows": 1}, **costly), costly
        assert select.fwd_ws(**{**d64, "rows": select.SM90_SHORT_ROWS + 1}, **costly), costly
    tile = select.fwd_ws_tile()
    assert select.fwd_kernel("sm_90a", 128, 128, True, False, 4096, ws=True) == ("attn_fwd_sm90", tile)
    assert select.fwd_kernel("sm_90a", 128, 128, True, False, 4096, softcap, ws=True) == \
        ("attn_fwd_sm90", select.SM90_TILE_WS_MODS)
    assert select.fwd_kernel("sm_90a", 128, 128, True, False, 4096, window, ws=True) == ("attn_fwd_sm90", tile)
    assert select.fwd_kernel("sm_90a", 128, 128, True, True, 1, ws=True)[0] == "attn_fwd"   # decode: never WS
    # D = 64 with no window, bias, mask, ALiBi, softcap or mods, past WS3_ROWS rows with no causal
    # mask or past CAUSAL_WS3_ROWS with one: three computing warpgroups (192 rows); the others keep 128
    long = select.CAUSAL_WS3_ROWS + 1
    assert select.fwd_ws3(64, select.WS3_ROWS + 1, False, False, False, None) and select.fwd_ws3(64, long, True, False, False, None)
    assert not select.fwd_ws3(64, select.CAUSAL_WS3_ROWS, True, False, False, None)
    assert not select.fwd_ws3(64, select.WS3_ROWS, False, False, False, None)
    assert not any(select.fwd_ws3(*args) for args in [(128, long, False, False, False, None), (64, long, False, True, False, None),
                                                      (64, long, False, False, True, None), (64, long, False, False, False, window),
                                                      (64, long, True, False, False, softcap)])
    assert select.fwd_kernel("sm_90a", 64, 64, True, False, 4096, ws=True, ws3=True) == \
        ("attn_fwd_sm90", select.SM90_TILE_WS3)
    assert select.fwd_kernel("sm_90a", 64, 64, True, False, 4096, ws=True) == ("attn_fwd_sm90", tile)
    assert select.fwd_smem_bytes(64, 64, select.SM90_TILE_WS3, "attn_fwd_sm90", ws=True) <= 227 * 1024
    # D = 128 plain calls over WIDE_KEYS keys or more, past the persistent grid's query tiles: 176
    # keys a tile, a CTA a tile; one short of either, a band, an option or a mod keep 128
    many, keys = select.PERSIST_TILES + 1, select.WIDE_KEYS
    assert select.fwd_wide_keys(128, many, keys, False, False, False, None)
    assert not any(select.fwd_wide_keys(*args) for args in [
        (64, many, keys, False, False, False, None), (128, many - 1, keys, False, False, False, None),
        (128, many, keys - 1, False, False, False, None), (128, many, keys, True, False, False, None),
        (128, many, keys, False, True, False, None), (128, many, keys, False, False, True, None),
        (128, many, keys, False, False, False, window)])
    assert select.fwd_kernel("sm_90a", 128, 128, True, False, 4096, ws=True, wide_keys=True) == \
        ("attn_fwd_sm90", select.SM90_TILE_WS_WIDE)
    assert select.SM90_TILE_WS_WIDE[1] == 176
    assert select.fwd_smem_bytes(128, 128, select.SM90_TILE_WS_WIDE, "attn_fwd_sm90", ws=True) + 1024 \
        <= select.SM90_SHARED_BYTES
    assert not select.fwd_persist(True, many - 1, False, select.SM90_TILE_WS_WIDE)
    wide = [d for k, d in select.variants("sm_90a") if k == "attn_fwd_sm90" and d.get("BLOCK_N") == 176]
    assert sorted((d["ELEM_BF16"], d.get("F16_SCALED", 0), d["HEAD_DIM"], d.get("PERSIST", 0), d.get("CLUSTER", 1))
                  for d in wide) == [(0, 0, 128, 0, 1), (0, 0, 128, 0, 2), (0, 1, 128, 0, 1), (0, 1, 128, 0, 2),
                                     (1, 0, 128, 0, 1), (1, 0, 128, 0, 2)], wide   # float16, tf32's copies, bfloat16
    # D = 128 calls a CTA a tile over a dense batch with an even number of query tiles and the same
    # keys for every tile of a head (no causal mask, window or mask_mod): CTAs in pairs, by default
    # for plain calls; the lab's ATTNEXT_FWD_CLUSTER decides for the rest
    ok = dict(D=128, q_tiles=32, dense=True, causal=False, window=False, options=False, mods=None, persist=False)
    assert select.fwd_cluster(**ok)
    for bad in (dict(D=64), dict(q_tiles=33), dict(dense=False), dict(causal=True), dict(window=True),
                dict(persist=True), dict(mods=window), dict(options=True), dict(mods=softcap)):
        assert not select.fwd_cluster(**{**ok, **bad}), bad
    _env.setenv("ATTNEXT_FWD_CLUSTER", "1")
    try:
        assert select.fwd_cluster(**{**ok, "options": True}) and select.fwd_cluster(**{**ok, "mods": softcap})
        assert not select.fwd_cluster(**{**ok, "mods": window}) and not select.fwd_cluster(**{**ok, "q_tiles": 33})
    finally:
        _env.setenv("ATTNEXT_FWD_CLUSTER", "0")
    try:
        assert not select.fwd_cluster(**ok)
    finally:
        _env.setenv("ATTNEXT_FWD_CLUSTER", None)
    paired = [d for k, d in select.variants("sm_90a") if k == "attn_fwd_sm90" and d.get("CLUSTER")]
    assert sorted((d["BLOCK_N"], d["ELEM_BF16"], d.get("F16_SCALED", 0)) for d in paired) == \
        [(bn, *e) for bn in (128, 176) for e in ((0, 0), (0, 1), (1, 0))], paired
    assert all(d["HEAD_DIM"] == 128 and not d.get("PERSIST") and not d["HAS_BIAS"] for d in paired), paired
    # the wide tile, once compiled, of a score_mod that loads from no array per score
    table, slopes = np.ones((2, 300), np.float32), np.ones(2, np.float32)
    alibi = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: s - slopes[h] * np.abs(q - kv)), None)
    relbias = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: s + table[h, q - kv + 150]), None)
    by_score = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: s + slopes[(s > 0) * 1]), None)
    assert select.fwd_ws_tile(True, wide=True) == select.SM90_TILE_WS != select.SM90_TILE_WS_MODS
    assert [select.fwd_ws_widens(g) for g in (softcap, alibi, relbias, by_score, window, None)] == \
        [True, True, False, False, False, False]
    _env.setenv("ATTNEXT_TILE_FWD_WS", "128,64,8,2")
    try:
        assert not select.fwd_ws_widens(softcap)
    finally:
        _env.setenv("ATTNEXT_TILE_FWD_WS", None)
    d = select.fwd_defines(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None,
                           alibi_dtype=None, mask=False, tile=tile, ws=True)
    assert (d["WS"], d["STAGES"], d["MIN_BLOCKS"], d["BLOCK_M"], d["BLOCK_N"]) == (1, tile[3], 1, 128, 128)
    smem = select.fwd_smem_bytes(128, 128, tile, "attn_fwd_sm90", ws=True)
    assert smem == 2 * (128 * 128 + tile[3] * 128 * 256) + 1024 + 32 * tile[3] + 8
    three = select.fwd_smem_bytes(128, 128, (128, 128, 8, 3), "attn_fwd_sm90", ws=True)
    assert three + 1024 <= select.SM90_SHARED_BYTES
    # the lab's fifth value: K's stages apart from V's (K_STAGES), persistent D = 128 at 3 + 2
    k3 = (128, 128, 8, 2, 3)
    d = select.fwd_defines(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None,
                           alibi_dtype=None, mask=False, tile=k3, ws=True, persist=True)
    assert (d["STAGES"], d["K_STAGES"], d["PERSIST"]) == (2, 3, 1), d
    smem = select.fwd_smem_bytes(128, 128, k3, "attn_fwd_sm90", ws=True, persist=True)
    # persist: 8 more mbarriers (64 B), 8 B to a 16-byte boundary, two 16-byte slots of the next tile
    assert smem == 2 * (2 * 128 * 128 + 3 * 128 * 128 + 2 * 128 * 128) + 1024 + 16 * 5 + 8 + 64 + 8 + 32
    assert smem + 1024 <= select.SM90_SHARED_BYTES
    assert any(d.get("WS") for k, d in select.variants("sm_90a"))
    assert not any(d.get("WS") for k, d in select.variants("sm_80"))
    # the persistent grid's tile: three stages at D = 64 on the two-warpgroup tile, compiled by warmup
    assert select.fwd_persist_tile(64, tile) == select.SM90_TILE_WS_PERSIST64 == (128, 128, 8, 3)
    assert [select.fwd_persist_tile(*a) for a in [(128, tile), (64, select.SM90_TILE_WS3)]] == [tile, select.SM90_TILE_WS3]
    assert select.fwd_smem_bytes(64, 64, select.SM90_TILE_WS_PERSIST64, "attn_fwd_sm90", ws=True, persist=True) + 1024 \
        <= select.SM90_SHARED_BYTES
    persistent = [d for k, d in select.variants("sm_90a") if d.get("PERSIST")]
    assert {(d["HEAD_DIM"], d["BLOCK_M"], d["STAGES"]) for d in persistent} >= {(64, 128, 3), (128, 128, 2)}
    assert not any(d["HEAD_DIM"] == 64 and d["BLOCK_M"] == 128 and d["STAGES"] == 2 for d in persistent)
    _env.setenv("ATTNEXT_TILE_FWD_WS", "128,128,8,2")
    try:
        assert select.fwd_persist_tile(64, tile) == tile
    finally:
        _env.setenv("ATTNEXT_TILE_FWD_WS", None)


def test_hopper_takes_the_wgmma_forward_where_it_applies(monkeypatch):
    assert select.fwd_kernel("sm_90a", 128, 128, True, False, 4096) == ("attn_fwd_sm90", select.SM90_TILE_LONG)
    assert select.fwd_kernel("sm_90a", 128, 128, True, False, 512) == ("attn_fwd_sm90", select.SM90_TILE_SHORT)
    import numpy as np

    from attnext.mods import codegen, trace
    table = np.zeros((4, 9), np.float32)
    doc = np.zeros(9, np.int64)
    lookups = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: s + table[h, q - kv]))
    arithmetic = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: 30.0 * np.tanh(s / 30.0)),
                                  trace.trace_mask_mod(lambda b, h, q, kv: doc[q] == doc[kv]))
    mask_alone = codegen.generate(None, trace.trace_mask_mod(lambda b, h, q, kv: doc[q] == doc[kv]))
    for score_mod in (lookups, arithmetic):     # 64 keys a tile: lookups' registers, the compile
        assert select.fwd_kernel("sm_90a", 128, 128, True, False, 4096, score_mod) == ("attn_fwd_sm90",
                                                                                       select.SM90_TILE_MODS)
    assert select.fwd_kernel("sm_90a", 128, 128, True, False, 4096, mask_alone) == ("attn_fwd_sm90",
                                                                                    select.SM90_TILE_LONG)
    assert select.fwd_kernel("sm_90a", 64, 128, True, False, 4096)[0] == "attn_fwd_sm90"
    # other head dims, element loads, decode and other architectures: attn_fwd.cu
    for args in (("sm_90a", 96, 96, True, False), ("sm_90a", 128, 128, False, False),
                 ("sm_90a", 128, 128, True, True), ("sm_80", 128, 128, True, False)):
        assert select.fwd_kernel(*args, 4096)[0] == "attn_fwd", args
    monkeypatch.setenv("ATTNEXT_FWD_SM90", "0")
    assert select.fwd_kernel("sm_90a", 128, 128, True, False, 4096)[0] == "attn_fwd"


def test_sm90_forward_tiles_stage_their_output(monkeypatch):
    """Every tile fwd_kernel gives attn_fwd_sm90.cu, with or without mods, passes its staged
    output's static_assert (sm90_staged_o_fits); NVRTC proves the mirror at the head dims where
    a score_mod's 128 x 64 tile would not (D = 64, Dv = 128: the 128 x 128 tile instead)."""
    from attnext import _C
    from attnext.mods import codegen, trace
    softcap = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: 30.0 * np.tanh(s / 30.0)))
    window = codegen.generate(None, trace.trace_mask_mod(lambda b, h, q, kv: q - kv < 100))
    for (D, Dv), rows, mods in itertools.product(((64, 64), (128, 128), (128, 64), (64, 128)), (512, 4096),
                                                 (None, softcap, window)):
        kernel, tile = select.fwd_kernel("sm_90a", D, Dv, True, False, rows, mods)
        assert kernel == "attn_fwd_sm90" and select.sm90_staged_o_fits(D, Dv, tile), (D, Dv, rows, tile)
    assert select.fwd_kernel("sm_90a", 64, 128, True, False, 4096, softcap)[1] == select.SM90_TILE_LONG
    assert not select.sm90_staged_o_fits(64, 128, select.SM90_TILE_MODS)
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    nvrtc.nvrtc()
    features = dict(dtype="bfloat16", D=64, Dv=128, vec=True, softcap=False, bias_dtype=None,
                    alibi_dtype=None, mask=False)
    for tile in (select.SM90_TILE_LONG, select.SM90_TILE_MODS):
        d = select.fwd_defines(**features, tile=tile, mods=softcap)
        if select.sm90_staged_o_fits(64, 128, tile):
            _C.nvrtc_compile(*nvrtc.compile_args("attn_fwd_sm90", d, "sm_90a", softcap.source))
        else:
            with pytest.raises(RuntimeError, match="staged O tile does not fit"):
                _C.nvrtc_compile(*nvrtc.compile_args("attn_fwd_sm90", d, "sm_90a", softcap.source))


def test_sm90_forward_fits_shared_memory():
    for kernel, d in select.variants("sm_90a"):
        if kernel == "attn_fwd_sm90":
            tile = (d["BLOCK_M"], d["BLOCK_N"], d["NUM_WARPS"], d.get("STAGES", 2))
            assert select.fwd_smem_bytes(d["HEAD_DIM"], d["HEAD_DIM_V"], tile, kernel, ws=bool(d.get("WS")),
                                         persist=bool(d.get("PERSIST"))) <= 227 * 1024, d


def test_hopper_float32_wgmma_forward_where_it_applies(monkeypatch):
    """attn_fwd_sm90_f32.cu runs a float32 forward on sm_90a with 16-byte rows, D and Dv in
    {64, 128}, no decode path or paged cache: by default with three passes at D = Dv, score
    options and generated mods too (bench/NOTES.md, float32 forward w2-w5), wherever it applies under ATTNEXT_FWD_F32_SM90=1, nowhere
    under 0 or ATTNEXT_FWD_SM90=0; it fits an SM's shared memory, compiles in both precisions and
    is among the variants warmup compiles."""
    ok = dict(arch="sm_90a", D=128, Dv=128, vec=True, decode=False, paged=False, dtype="float32")
    args = ("sm_90a", 128, 128, True, False, 4096)
    assert select.fwd_f32_sm90(**ok)
    assert select.fwd_kernel(*args, dtype="float32") == ("attn_fwd_sm90_f32", select.SM90_TILE_F32)
    assert select.fwd_kernel(*args, dtype="float32", tf32=True)[0] == "attn_fwd"
    assert select.fwd_f32_sm90(**{**ok, "D": 64, "Dv": 64})
    assert select.fwd_kernel("sm_90a", 64, 64, True, False, 4096, dtype="float32")[0] == "attn_fwd_sm90_f32"
    for change in (dict(D=64), dict(Dv=64), dict(tf32=True)):
        assert not select.fwd_f32_sm90(**{**ok, **change}), change
    for change in (dict(arch="sm_80"), dict(D=96, Dv=96), dict(Dv=256), dict(vec=False), dict(decode=True),
                   dict(paged=True), dict(dtype="bfloat16")):
        assert not select.fwd_f32_sm90(**{**ok, **change}), change
    monkeypatch.setenv("ATTNEXT_FWD_F32_SM90", "1")
    for change in (dict(D=64, Dv=64), dict(D=64), dict(Dv=64), dict(tf32=True)):
        assert select.fwd_f32_sm90(**{**ok, **change}), change
    assert not select.fwd_f32_sm90(**{**ok, "D": 96, "Dv": 96})
    monkeypatch.setenv("ATTNEXT_FWD_F32_SM90", "0")
    assert not select.fwd_f32_sm90(**ok)
    monkeypatch.delenv("ATTNEXT_FWD_F32_SM90")
    monkeypatch.setenv("ATTNEXT_FWD_SM90", "0")
    assert not select.fwd_f32_sm90(**ok)
    assert {(d["HEAD_DIM"], d["HEAD_DIM_V"]) for k, d in select.variants("sm_90a")
            if k == "attn_fwd_sm90_f32"} == {(64, 64), (128, 128)}
    assert not any(k == "attn_fwd_sm90_f32" for k, _ in select.variants("sm_80"))
    # the lab's fifth number: K's slots (one more here: a slot of both parts and its two barriers)
    five = select.SM90_TILE_F32 + (select.SM90_TILE_F32[3] + 1,)
    assert select.fwd_defines(dtype="float32", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None,
                              alibi_dtype=None, mask=False, tile=five, sm90_f32=True)["K_STAGES"] == five[4]
    assert select.fwd_smem_bytes(128, 128, five, "attn_fwd_sm90_f32", "float32") \
        - select.fwd_smem_bytes(128, 128, select.SM90_TILE_F32, "attn_fwd_sm90_f32", "float32") \
        == 2 * select.SM90_TILE_F32[1] * 128 * 4 + 16
    for tf32 in (False, True):
        for d in (64, 128):
            assert select.fwd_smem_bytes(d, d, select.SM90_TILE_F32, "attn_fwd_sm90_f32", "float32",
                                         tf32=tf32) <= 227 * 1024
            defines = select.fwd_defines(dtype="float32", D=d, Dv=d, vec=True, softcap=True, bias_dtype="float32",
                                         alibi_dtype="float32", mask=True, tile=select.SM90_TILE_F32, tf32=tf32,
                                         sm90_f32=True)
            assert defines["STAGES"] == select.SM90_TILE_F32[3] and defines["MIN_BLOCKS"] == 1
            assert "K_STAGES" not in defines    # the kernel's own: STAGES
            if os.environ.get("ATTNEXT_NO_NVRTC") != "1":
                assert nvrtc.cubin("attn_fwd_sm90_f32", defines, "sm_90a")


def test_float32_backward_split_once_where_asked(monkeypatch):
    """float32's backward splits its shared tiles once (F32_PRESPLIT) by default on sm_90a up to
    D + Dv = 256 with three passes (precision=None), not with one (precision="tf32", where it
    measured slower) and nowhere else; ATTNEXT_BWD_F32_PRESPLIT=1 / 0 takes it / leaves it where
    it applies. With three passes its lo planes take the tiles bwd_tile_config gives for them
    (D64: 32-row dK/dV and 32-key dQ tiles; D128: 8 warps over 128 keys, one CTA an SM), each
    kernel within 227 KB (the dQ kernel's two CTAs an SM within half), and warmup's sm_90a
    variants take it as calls do, and compile."""
    monkeypatch.delenv("ATTNEXT_BWD_F32_PRESPLIT", raising=False)
    ok = ("sm_90a", "float32", 128, 128)
    never = (("sm_80", "float32", 128, 128), ("sm_90a", "bfloat16", 128, 128), ("sm_90a", "float32", 256, 64),
             ("sm_90a", "float32", 192, 128))
    assert select.bwd_f32_presplit(*ok, 3) and select.bwd_f32_presplit("sm_90a", "float32", 64, 128, 3)
    assert not select.bwd_f32_presplit(*ok, 1)
    for args in never:
        assert not select.bwd_f32_presplit(*args, 3), args
    monkeypatch.setenv("ATTNEXT_BWD_F32_PRESPLIT", "1")
    assert select.bwd_f32_presplit(*ok, 1) and select.bwd_f32_presplit(*ok, 3)
    for args in never:
        assert not select.bwd_f32_presplit(*args, 3), args
    monkeypatch.setenv("ATTNEXT_BWD_F32_PRESPLIT", "0")
    assert not select.bwd_f32_presplit(*ok, 3) and not select.bwd_f32_presplit(*ok, 1)
    tile = select.bwd_tile_config
    for atomic in (False, True):
        assert tile(64, 64, "float32", atomic, True)["kv_block_m"] == tile(64, 64, "float32", atomic, True)["q_block_n"] \
            == 32
        wide = tile(128, 128, "float32", atomic, True)
        assert (wide["kv_warps"], wide["kv_minb"], wide["kv_block_m"]) == (8, 1, 16)
        assert tile(128, 128, "float32", atomic) == {**wide, "kv_warps": 4, "kv_minb": 2}
        for d in (64, 128):
            plain = select.bwd_smem_bytes(d, d, tile(d, d, "float32", atomic), atomic, 0, "float32")
            t = tile(d, d, "float32", atomic, True)
            split = select.bwd_smem_bytes(d, d, t, atomic, 0, "float32", True)
            assert max(split.values()) <= 227 * 1024 and split["attn_bwd_dq"] <= 113 * 1024
            lo = 4 * t["kv_block_m"] * 2 * (d + 4)          # the item's Q and dO, a plane each
            assert split["attn_bwd_dkdv"] == select.bwd_smem_bytes(d, d, t, atomic, 0, "float32")["attn_bwd_dkdv"] + lo
            assert plain["attn_bwd_dkdv"] <= 113 * 1024
    # warmup's lists as calls run them: sm_90a's three-pass float32 backward variants all split
    # (D64, D128 with both dQ modes, 59 / 40 on element loads; the row kernels of the planes'
    # ordered dQ at D128 in one chain and in two), sm_80's none, every arch's both
    monkeypatch.delenv("ATTNEXT_BWD_F32_PRESPLIT")
    f32 = {arch: [d for k, d in select.variants(arch) if k == "attn_bwd" and d.get("TF32_PASSES") == 3]
           for arch in ("sm_80", "sm_90a", None)}
    presplit = [d for d in f32["sm_90a"] if d.get("F32_PRESPLIT")]
    assert len(presplit) == len(f32["sm_90a"]) == 7 and not any(d.get("F32_PRESPLIT") for d in f32["sm_80"])
    assert len(f32[None]) == len(f32["sm_80"]) + len(presplit)
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        return
    for d in presplit:
        assert nvrtc.cubin("attn_bwd", d, "sm_90a")


def test_hopper_backward_choice_and_shared_memory(monkeypatch):
    """attn_bwd_sm90 takes D, Dv in {64, 128} with 16-byte rows on sm_90a and fits 227 KB of
    shared memory in every tile the lab can ask for."""
    assert select.bwd_sm90_applies("sm_90a", 128, 64, True)
    for args in (("sm_80", 128, 128, True), ("sm_90a", 96, 96, True), ("sm_90a", 128, 128, False)):
        assert not select.bwd_sm90_applies(*args), args
    for mode in select.DQ_MODES:
        for warps in ("4,4", "8,4", "4,8", "8,8"):
            monkeypatch.setenv("ATTNEXT_TILE_BWD_SM90", warps)
            tile = select.bwd_sm90_tile(128, mode)
            assert max(select.bwd_sm90_smem_bytes(128, 128, tile).values()) <= 227 * 1024, warps
    monkeypatch.delenv("ATTNEXT_TILE_BWD_SM90")
    monkeypatch.setenv("ATTNEXT_BWD_SM90", "0")
    assert not select.bwd_sm90_applies("sm_90a", 128, 128, True)


def test_dq_mode(monkeypatch):
    """dQ added by attn_bwd_sm90's warp-specialised dK/dV kernel on Hopper at D = 128 and at D =
    Dv = 64 (in turns when deterministic), by the dQ kernel elsewhere; the lab's ATTNEXT_BWD_DQ
    never makes a deterministic call order-dependent, nor asks for additions no kernel makes."""
    mode = select.bwd_dq_mode
    assert mode(True, 128, True) == "ordered" and mode(True, 128, False) == "atomic"
    assert mode(True, 64, True) == "ordered" and mode(True, 64, False) == "atomic"
    assert mode(True, 64, True, 128) == mode(True, 64, False, 128) == "recompute"
    assert mode(False, 128, True) == mode(False, 128, False) == "recompute"
    # deterministic=False keeps the ordered mode where it is the faster: up to 1024 keys
    assert mode(True, 64, False, 64, 1024) == mode(True, 128, False, 128, 512) == "ordered"
    assert mode(True, 64, False, 64, 1025) == mode(True, 128, False, 128, 16384) == "atomic"
    assert mode(False, 64, False, 64, 512) == "recompute"
    # ... and at D = Dv = 64 past 8192 keys without a causal mask, where atomics ran no faster
    assert mode(True, 64, False, 64, 8193) == mode(True, 64, True, 64, 16384) == "ordered"
    assert mode(True, 64, False, 64, 8192) == mode(True, 64, False, 64, 16384, causal=True) == "atomic"
    assert mode(True, 128, False, 128, 16384) == "atomic" and mode(True, 64, False, 128, 16384) == "recompute"
    # float32 on Hopper (attn_bwd.cu): deterministic=False past 1024 keys adds dQ at D = Dv = 128,
    # and at D = Dv = 64 with three TF32 passes; the dK/dV tile then 32 rows at D = 64
    assert mode(False, 128, False, 128, 1025, 3) == mode(False, 128, False, 128, 1025, 1) == "atomic"
    assert mode(False, 64, False, 64, 1025, 3) == "atomic" != mode(False, 64, False, 64, 1025, 1)
    assert mode(False, 128, True, 128, 1025, 3) == mode(False, 128, False, 128, 1024, 3) == "recompute"
    assert mode(False, 128, False, 64, 4096, 3) == mode(False, 96, False, 96, 4096, 3) == "recompute"
    assert mode(False, 128, False, 128, 4096, 0) == "recompute"
    tile = select.bwd_tile_config
    assert tile(64, 64, "float32", True)["kv_block_m"] == 32 != tile(64, 64, "float32")["kv_block_m"]
    assert tile(64, 64, "bfloat16", True) == tile(64, 64) and tile(128, 128, "float32", True) == tile(128, 128, "float32")
    write = select.bwd_dq_write_last   # the last turn writes dq: short keys, no mask_mod
    assert write("ordered", False, 1024) and not write("ordered", False, 1025)
    assert not write("ordered", True, 512) and not write("atomic", False, 512)
    assert not write("ordered", False, 512, planes=True)    # the planes' turns leave dq to the convert
    monkeypatch.setenv("ATTNEXT_BWD_DQ_WRITE", "0")
    assert not write("ordered", False, 512)
    monkeypatch.setenv("ATTNEXT_BWD_DQ_WRITE", "1")
    assert write("ordered", False, 8192) and not write("ordered", True, 512)
    monkeypatch.delenv("ATTNEXT_BWD_DQ_WRITE")
    # two chains of turns: ordered, first turns store, dq converted, unbanded, up to CHAIN_KEYS keys
    chains = select.bwd_dq_chains
    assert chains("ordered", False, False, False, 2048) == chains("ordered", False, False, False, 8192) \
        == select.DQ_CHAINS == 2
    assert chains("ordered", False, False, False, 8193) == chains("ordered", False, False, True, 2048) == 1
    assert chains("ordered", True, False, False, 2048) == 1
    assert chains("ordered", False, True, False, 1024) == chains("atomic", False, False, False, 2048) == 1
    # the planes' turns: two chains banded too, one past CHAIN_KEYS keys
    assert chains("ordered", False, False, True, 2048, planes=True) == select.DQ_CHAINS
    assert chains("ordered", False, False, True, 8193, planes=True) == 1
    monkeypatch.setenv("ATTNEXT_BWD_DQ_CHAINS", "4")
    assert chains("ordered", False, False, True, 16384) == 4 and chains("ordered", False, True, False, 512) == 1
    monkeypatch.setenv("ATTNEXT_BWD_DQ_CHAINS", "3")    # not a divisor of 32: the default
    assert chains("ordered", False, False, False, 2048) == 2
    monkeypatch.delenv("ATTNEXT_BWD_DQ_CHAINS")
    tile = select.bwd_sm90_tile(128, "ordered")
    assert tile == select.bwd_sm90_tile(128, "atomic") and tile["kv_warps"] == 8
    assert tile["kv_block_m"] == 64 and select.bwd_sm90_tile(64, "ordered")["kv_block_m"] == 128
    assert select.bwd_sm90_kv_kernel("ordered", tile) == ("attn_bwd_dkdv_ws_sm90", 12)
    recompute = select.bwd_sm90_tile(128, "recompute")
    assert select.bwd_sm90_kv_kernel("recompute", recompute) == ("attn_bwd_dkdv_sm90", 4)
    for D in (64, 128):   # the warp-specialised kernel fits 227 KB without the base's rounding slack
        assert select.bwd_sm90_smem_bytes(D, D, select.bwd_sm90_tile(D, "ordered"))["attn_bwd_dkdv_ws_sm90"] \
            <= 232448
    monkeypatch.setenv("ATTNEXT_BWD_DQ", "atomic")
    assert mode(True, 128, False) == "atomic" and mode(True, 128, True) == "ordered"
    assert mode(True, 128, False, 128, 512) == "atomic"
    assert mode(True, 64, False) == "atomic" and mode(True, 64, True) == "ordered"
    assert mode(True, 64, False, 128) == mode(True, 64, True, 128) == "recompute"
    assert mode(False, 64, False) == "atomic" and mode(False, 64, True) == "recompute"
    monkeypatch.setenv("ATTNEXT_BWD_DQ", "recompute")
    assert mode(True, 128, True) == mode(True, 128, False) == "recompute"
    monkeypatch.setenv("ATTNEXT_TILE_BWD_SM90", "4,4")
    assert select.bwd_sm90_tile(128, "ordered")["kv_warps"] == 8   # the lab's override: recompute only


def test_hopper_kernels_keep_their_wgmma_asynchronous():
    """ptxas serialises every wgmma of a function (its -v log's "Potential Performance Loss",
    C75xx) when it cannot prove that no other instruction reads or writes their registers while
    they run: an accumulator read between issue and wait, a wgmma in flight around a loop's back
    edge, the k loop not unrolled (bench/NOTES.md, float32 forward w4). The products then run one
    at a time. No Hopper wgmma variant that warmup compiles may be serialised (attn_bwd_dkdv_sm90
    at D = 64, Dv = 128 was, on D64's tile, till select.bwd_sm90_tile took it by both head dims)."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    from attnext import _C
    nvrtc.nvrtc()
    serialised, checked = set(), 0
    for kernel, d in select.variants("sm_90a"):
        if kernel not in ("attn_fwd_sm90", "attn_fwd_sm90_f32", "attn_bwd_sm90", "attn_bwd_sm90_x3"):
            continue
        src, name, opts, headers = nvrtc.compile_args(kernel, d, "sm_90a")
        log = _C.nvrtc_compile(src, name, opts + ["--ptxas-options=-v"], headers)[1]
        checked += 1
        for entry in re.findall(r"\(C75\d\d\) Potential Performance Loss: wgmma[^\n]*function '(\w+)'", log):
            serialised.add((entry, d["HEAD_DIM"], d["HEAD_DIM_V"]))
    assert checked >= 60
    assert not serialised, serialised


def test_a_call_with_mods_compiles_its_entry_points_alone():
    """nvrtc.module_of: with mods, an entry point that reads none of them comes from the plain
    variant (warmup's), every other one is compiled alone (ATTN_ENTRY_ONLY); without mods, the
    whole file. The entry point compiled alone is the only function in its cubin."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    from attnext import _C
    from attnext.mods import codegen, trace
    gen = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: s + (q - kv) * 0.5))
    features = dict(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None,
                    alibi_dtype=None, mask=True)
    plain = select.bwd_defines(**features, tile=select.bwd_sm90_tile(128, "recompute"))
    with_mods = select.bwd_defines(**features, tile=select.bwd_sm90_tile(128, "recompute"), mods=gen)
    assert select.plain_defines(with_mods) == plain and select.plain_defines(plain) is plain
    assert nvrtc.module_of("attn_bwd", "attn_bwd_dq_convert", with_mods, gen.source) == ("attn_bwd", plain, None)
    # attn_bwd_pre reads the score_mod: it recomputes the rows whose lse is lost
    assert nvrtc.module_of("attn_bwd", "attn_bwd_pre", with_mods, gen.source)[2] == gen.source
    assert nvrtc.module_of("attn_bwd_sm90", "attn_bwd_dq_sm90", plain, None) == ("attn_bwd_sm90", plain, None)
    k, d, g = nvrtc.module_of("attn_bwd_sm90", "attn_bwd_dq_sm90", with_mods, gen.source)
    assert d["ATTN_ENTRY_ONLY"] == 1 and d["ATTN_ENTRY_attn_bwd_dq_sm90"] == 1 and g == gen.source
    nvrtc.nvrtc()
    cubin, _ = _C.nvrtc_compile(*nvrtc.compile_args(k, d, "sm_90a", g))
    assert b"attn_bwd_dq_sm90" in cubin and b"attn_bwd_dkdv_sm90" not in cubin


def test_compile_ahead_starts_the_compiles_where_the_cores_allow(tmp_path, monkeypatch):
    """nvrtc.compile_ahead compiles its entry points' cubins in background threads, each module
    once, as module_for chooses them (a plain entry point alone while its whole file is in no
    cache), where the machine has a core for each beside the caller's (busy);
    ATTNEXT_COMPILE_AHEAD=1 always, =0 never."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    from attnext.mods import codegen, trace
    from attnext.cuda.cache import CubinCache
    monkeypatch.setattr(nvrtc, "_cubins", CubinCache(nvrtc._compile, cache_dir=tmp_path))
    made = []
    monkeypatch.setattr(nvrtc, "cubin", lambda k, d, arch, g=None: made.append((k, d, g)) or b"cubin")
    gen = codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: s * 0.5))
    features = dict(dtype="bfloat16", D=128, Dv=128, vec=True, softcap=False, bias_dtype=None,
                    alibi_dtype=None, mask=False)
    defines = select.bwd_defines(**features, tile=select.bwd_sm90_tile(128, "recompute"), mods=gen)
    specs = [("attn_bwd_sm90", "attn_bwd_dq_sm90", defines, gen.source),
             ("attn_bwd", "attn_bwd_dq_convert", defines, gen.source), ("attn_bwd", "attn_bwd_dq_convert", defines, gen.source)]
    monkeypatch.setattr(nvrtc, "_cpus", lambda: 3)
    monkeypatch.setenv("ATTNEXT_COMPILE_AHEAD", "0")
    assert nvrtc.compile_ahead(specs, "sm_90a") == []
    monkeypatch.delenv("ATTNEXT_COMPILE_AHEAD")
    assert nvrtc.compile_ahead(specs, "sm_90a", busy=2) == [] and made == []
    assert [f.result() for f in nvrtc.compile_ahead(specs, "sm_90a", busy=1)] == [b"cubin"] * 2
    plain = select.plain_defines(defines)
    assert sorted(made, key=str) == sorted([
        ("attn_bwd_sm90", select.entry_defines(defines, "attn_bwd_dq_sm90"), gen.source),
        ("attn_bwd", select.entry_defines(plain, "attn_bwd_dq_convert"), None)], key=str)
    monkeypatch.setattr(nvrtc, "_cpus", lambda: 1)
    monkeypatch.setenv("ATTNEXT_COMPILE_AHEAD", "1")
    assert len(nvrtc.compile_ahead(specs, "sm_90a", busy=1)) == 2


def test_compile_ahead_counts_its_running_compiles_and_skips_cached_ones(tmp_path, monkeypatch):
    """The cores' rule counts compile_ahead's compiles still running from earlier calls; an entry
    point a cache holds is not compiled again; "off" is "0"; a forward's head start never raises
    (cuda_backend._compile_backward_ahead: the backward meets its own errors)."""
    import threading
    from attnext.cuda import backend as cuda_backend
    from attnext.cuda.cache import CubinCache
    monkeypatch.setattr(nvrtc, "_cubins", CubinCache(nvrtc._compile, cache_dir=tmp_path))
    release, made = threading.Event(), []

    def slow_cubin(k, d, arch, g=None):
        made.append(d)
        release.wait(10)
        return b"cubin"
    monkeypatch.setattr(nvrtc, "cubin", slow_cubin)
    monkeypatch.setattr(nvrtc, "module_for", lambda kernel, name, defines, generated, arch: (kernel, defines, None))
    monkeypatch.setattr(nvrtc, "compile_args", lambda k, d, arch, g=None: (str(sorted(d.items())), "x.cu", [], []))
    monkeypatch.setattr(nvrtc, "_cpus", lambda: 3)
    monkeypatch.delenv("ATTNEXT_COMPILE_AHEAD", raising=False)
    spec = lambda i: ("attn_bwd", f"e{i}", {"E": i}, None)
    first = nvrtc.compile_ahead([spec(0), spec(1)], "sm_90a", busy=1)
    assert len(first) == 2
    assert nvrtc.compile_ahead([spec(2)], "sm_90a", busy=1) == []     # 1 + 1 + 2 running > 3 cores
    release.set()
    assert [f.result() for f in first] == [b"cubin"] * 2
    for _ in range(100):
        if nvrtc._ahead_running == 0:
            break
        threading.Event().wait(0.01)
    assert nvrtc._ahead_running == 0
    [third] = nvrtc.compile_ahead([spec(2)], "sm_90a", busy=1)
    assert third.result() == b"cubin"
    monkeypatch.setattr(nvrtc._cubins, "has", lambda *args: True)
    assert nvrtc.compile_ahead([spec(3)], "sm_90a", busy=1) == []
    monkeypatch.setattr(nvrtc._cubins, "has", lambda *args: False)
    monkeypatch.setenv("ATTNEXT_COMPILE_AHEAD", "off")
    assert nvrtc.compile_ahead([spec(4)], "sm_90a", busy=1) == []
    assert {d["E"] for d in made} == {0, 1, 2}
    cuda_backend._compile_backward_ahead(object(), 0, {}, 1, None, [])   # a broken problem: no raise


def test_block_mask_kernel_compiles_alone_and_reports_out_of_line():
    """A call with a mask_mod prefetches attn_block_mask beside its entry points (block_mask_specs:
    none without one); it is compiled alone like them, and its lookups report through the
    generated mod_mask_check (once per thread, as the tiles do), not inline at every pair."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    import numpy as np

    from attnext import _C
    from attnext.mods import codegen, trace
    doc = np.repeat(np.arange(4), 16)
    gen = codegen.generate(None, trace.trace_mask_mod(lambda b, h, q, kv: doc[q] == doc[kv]))
    assert select.block_mask_specs(None) == []
    assert select.block_mask_specs(codegen.generate(trace.trace_score_mod(lambda s, b, h, q, kv: s * 2.0))) == []
    [spec] = select.block_mask_specs(gen)
    k, d, g = nvrtc.module_of(*spec)
    assert k == "attn_block_mask" and d["ATTN_ENTRY_ONLY"] == 1 and d["ATTN_ENTRY_attn_block_mask"] == 1
    nvrtc.nvrtc()
    for arch in ("sm_80", "sm_90a"):
        cubin, _ = _C.nvrtc_compile(*nvrtc.compile_args(k, d, arch, g))
        assert b"attn_block_mask" in cubin and b"mod_mask_check" in cubin, arch


_FRESH = r"""
import json, sys
from attnext import _C
from attnext.cuda import nvrtc, select
nvrtc.cubin("attn_convert", {}, "sm_80")
try:
    _C.nvrtc_version()
    loaded = True
except RuntimeError:            # "NVRTC is not loaded"
    loaded = False
print(json.dumps(dict(loaded=loaded, info=nvrtc.cache_info(), version=nvrtc.nvrtc_version())))
"""


def _fresh(cache_dir):
    env = dict(os.environ, ATTNEXT_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_disk_hit_loads_no_nvrtc_while_its_files_are_unchanged(tmp_path):
    """The cache key's NVRTC version comes from the record the first load wrote, checked by
    stats of the files that decide which library loads: a fresh process that finds its cubin on
    disk does not dlopen NVRTC. A record that no longer matches is not trusted: NVRTC loads."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    import json
    cold = _fresh(tmp_path)
    assert cold["loaded"] and cold["info"]["compiles"] == 1
    record = tmp_path / nvrtc.NVRTC_RECORD
    rec = json.loads(record.read_text())
    assert rec["version"] == cold["version"] and os.path.exists(rec["library"])
    warm = _fresh(tmp_path)
    assert not warm["loaded"] and warm["info"]["disk_hits"] == 1 and warm["info"]["compiles"] == 0
    assert warm["version"] == cold["version"]
    for change in (dict(fingerprint="0" * 64), dict(library_id=[0, 0, 0, 0]), None):
        if change is None:
            record.write_text("{not json")
        else:
            record.write_text(json.dumps({**rec, **change}))
        again = _fresh(tmp_path)
        assert again["loaded"] and again["info"]["disk_hits"] == 1, change
        assert json.loads(record.read_text()) == rec          # written again by the load


def test_nvrtc_fingerprint_follows_the_candidates_files(tmp_path, monkeypatch):
    """A library added to, changed in or removed from a candidate folder, a candidate file
    changed, or another LD_LIBRARY_PATH changes the fingerprint; nothing else does."""
    folder, lib = tmp_path / "lib", tmp_path / "libnvrtc.so.99"
    folder.mkdir()
    (folder / "unrelated.txt").write_text("x")
    lib.write_text("a")
    cands = [str(folder), str(lib), "libnvrtc.so.12"]
    seen = [nvrtc.nvrtc_fingerprint(cands)]
    (folder / "other.so").write_text("x")
    assert nvrtc.nvrtc_fingerprint(cands) == seen[0]
    for step in (lambda: (folder / "libnvrtc.so.13").write_text("b"),
                 lambda: (folder / "libnvrtc.so.13").write_text("bb"),
                 lambda: lib.write_text("aa"),
                 lambda: (folder / "libnvrtc.so.13").unlink(),
                 lambda: monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))):
        step()
        seen.append(nvrtc.nvrtc_fingerprint(cands))
    assert len(set(seen)) == len(seen)


def test_an_entry_point_compiles_alone_until_its_whole_file_is_cached(tmp_path, monkeypatch):
    """A plain entry point is served by its whole file's cubin once a cache holds it (warmup's,
    in memory or on disk), and compiled alone before that; a single-entry file stays whole."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    from attnext.cuda.cache import CubinCache
    monkeypatch.setattr(nvrtc, "_cubins", CubinCache(nvrtc._compile, cache_dir=tmp_path))
    [(_, plain)] = select.fwd_variants()[:1]
    k, d, g = nvrtc.module_for("attn_fwd", "attn_fwd_combine", plain, None, "sm_80")
    assert (k, d, g) == ("attn_fwd", select.entry_defines(plain, "attn_fwd_combine"), None)
    assert nvrtc.module_for("attn_convert", "attn_convert", {}, None, "sm_80")[1] == {}
    nvrtc.cubin(k, d, "sm_80")                 # the entry alone: the whole file still missing
    assert nvrtc.module_for("attn_fwd", "attn_fwd_combine", plain, None, "sm_80")[1] == d
    nvrtc.cubin("attn_fwd", plain, "sm_80")
    assert nvrtc.module_for("attn_fwd", "attn_fwd_combine", plain, None, "sm_80")[1] == plain
    monkeypatch.setattr(nvrtc, "_cubins", CubinCache(nvrtc._compile, cache_dir=tmp_path))
    assert nvrtc.module_for("attn_fwd", "attn_fwd_combine", plain, None, "sm_80")[1] == plain  # disk


def test_a_stale_nvrtc_record_never_keys_a_compile(tmp_path):
    """A record that names another NVRTC version than the one that loads (a soname resolved
    differently) keys no cubin: the compile that loads NVRTC finds the version changed, and the
    cubin is stored under the loaded version's key; the record is written again."""
    if os.environ.get("ATTNEXT_NO_NVRTC") == "1":
        pytest.skip("ATTNEXT_NO_NVRTC=1")
    import json
    cold = _fresh(tmp_path)
    record = tmp_path / nvrtc.NVRTC_RECORD
    rec = json.loads(record.read_text())
    for entry in (tmp_path / "v1").iterdir():
        entry.unlink()                                  # the cubin must be compiled again
    record.write_text(json.dumps({**rec, "version": [1, 0]}))
    again = _fresh(tmp_path)
    assert again["loaded"] and again["version"] == cold["version"]
    assert again["info"]["compiles"] == 1 and json.loads(record.read_text()) == rec
    warm = _fresh(tmp_path)                               # found under the loaded version's key
    assert not warm["loaded"] and warm["info"]["disk_hits"] == 1 and warm["info"]["compiles"] == 0
