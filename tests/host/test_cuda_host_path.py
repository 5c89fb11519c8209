"""The GPU call's host path on the fake driver (helpers/fake_libcuda.c), without a GPU: plans
(cuda_backend's cache of everything a call's launches derive from), the launch template, and
the per-stream scratch buffer. `-m gpu` adds the same promises checked on a real device.

- A plan is reused only by calls of its key: calls differing in one stride, option, dtype,
  alignment or lab override get plans of their own, whose launches are those a cold cache
  gives; scale and softcap values reach the launch without a plan of their own. The cache is
  bounded (PLAN_CAPACITY).
- The split-KV forward's scratch is allocated once per stream and reused (not for the
  per-thread default stream); a call never shares its scratch with a call in flight (threads on
  one stream, threads on their own streams); release_scratch() frees it all.
- attn_template / cuda_launch_attention refuse malformed arguments with TypeError / ValueError.

The driver and NVRTC load once per process, so the fake-driver checks run in a subprocess; the
kernels there are stand-ins (the fake loads any image), so no kernel is compiled.
"""
import types

import ml_dtypes
import numpy as np
import pytest

from attnext import _C, _layout
from helpers import fake_cuda
from helpers.driver import run_on_fake

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_a_plan_is_reused_by_its_key_only(fake_driver):
    run_on_fake(fake_driver, r"""
        q, k, v = qkv(2, 130, 200, 8, 2, 128)
        out = dev((2, 130, 8, 128))
        base = dict(out=out)
        k_strided = device.DeviceArray(k.ptr, k.shape, BF16, 0, (200 * 2 * 256, 2 * 256, 128, 1), 0, k)
        q_odd = dev((2, 130, 8, 128), offset=4)            # 8 bytes past a 16-byte boundary
        out_heads_first = dev((2, 130, 8, 128), strides=(8 * 130 * 128, 128, 130 * 128, 1))
        cases = [
            ("plain", lambda: attnext.attention(q, k, v, **base)),
            ("k stride", lambda: attnext.attention(q, k_strided, v, **base)),
            ("causal", lambda: attnext.attention(q, k, v, causal=True, **base)),
            ("top_left", lambda: attnext.attention(q, k, v, causal="top_left", **base)),
            ("window", lambda: attnext.attention(q, k, v, window=(5, 0), **base)),
            ("window 6", lambda: attnext.attention(q, k, v, window=(6, 0), **base)),
            ("softcap", lambda: attnext.attention(q, k, v, softcap=3.0, **base)),
            ("lse", lambda: attnext.attention(q, k, v, return_lse=True, **base)),
            ("out stride", lambda: attnext.attention(q, k, v, out=out_heads_first)),
            ("unaligned q", lambda: attnext.attention(q_odd, k, v, **base)),
            ("alibi", lambda: attnext.attention(q, k, v, alibi_slopes=np.ones(8, np.float32), **base)),
            ("bias", lambda: attnext.attention(q, k, v, bias=dev((8, 130, 200), np.float32), **base)),
            ("bias bcast", lambda: attnext.attention(q, k, v, bias=dev((8, 1, 200), np.float32), **base)),
            ("mask", lambda: attnext.attention(q, k, v, mask=dev((130, 200), np.bool_), **base)),
            ("seqlens", lambda: attnext.attention(q, k, v, seqlens_k=np.array([3, 200]), **base)),
            ("decode", lambda: attnext.attention(*qkv(1, 1, 8192, 32, 8, 128))),
            ("backward", lambda: attnext.attention_backward(out, q, k, v, out, lse)),
            ("backward causal", lambda: attnext.attention_backward(out, q, k, v, out, lse, causal=True)),
            ("backward sinks", lambda: attnext.attention_backward(out, q, k, v, out, lse, sinks=sinks)),
        ]
        sinks = np.zeros(8, np.float32)
        lse = dev((2, 8, 130), np.float32)
        cuda_backend.clear_plans()
        warm = {}
        for i, (name, call) in enumerate(cases):
            first = record(call)
            assert cuda_backend.plan_count() == i + 1, (name, cuda_backend.plan_count())
            again = record(call)
            assert cuda_backend.plan_count() == i + 1, (name, "a second call made a plan")
            assert first == again and first, name
            warm[name] = first
        # each key's launches differ from plain's where they should, and a cold cache gives them too
        for name, call in cases:
            cuda_backend.clear_plans()
            assert record(call) == warm[name], name
            if name not in ("plain", "seqlens", "decode", "backward", "backward causal"):
                assert warm[name] != warm["plain"], name
        attnext.attention(q, k, v, seqlens_k=np.array([3, 200]), **base)
        assert LAUNCHES[-1][6][13] and not LAUNCHES[-1][6][12]       # seqused_k given, seqused_q not
        assert warm["k stride"][0][5]["k"] == (200 * 2 * 256, 2 * 256, 128, 1)
        assert dict(warm["unaligned q"][0][0][2])["VEC_LOAD"] == 0 == 1 - dict(warm["plain"][0][0][2])["VEC_LOAD"]
        assert [l[0][1] for l in warm["decode"]] == ["attn_fwd", "attn_fwd_combine"], warm["decode"]
        # sinks: an address in the forward's launch (the plain plan), attn_bwd_sinks (a block a
        # head) after attn_bwd_pre in the backward's, with dsinks' address
        at = cuda_backend.SLOT_SINKS
        attnext.attention(q, k, v, **base)
        n = cuda_backend.plan_count()
        attnext.attention(q, k, v, sinks=sinks, **base)
        assert cuda_backend.plan_count() == n and LAUNCHES[-1][6][at]
        names = [l[0][1] for l in warm["backward sinks"]]
        assert names.index("attn_bwd_sinks") > names.index("attn_bwd_pre"), names     # delta is ready
        assert warm["backward sinks"][names.index("attn_bwd_sinks")][1] == (8, 1, 1)
        assert "attn_bwd_sinks" not in [l[0][1] for l in warm["backward"]]
        attnext.attention_backward(out, q, k, v, out, lse, sinks=sinks)
        assert all(l[6][at] and l[6][at + 1] for l in LAUNCHES[-len(names):])
        # a paged cache: attn_fwd with PAGED (never the wgmma kernel), the page size and table
        # stride in the template, the uploaded table's address in its slot
        pages_k, pages_v = dev((10, 16, 2, 128)), dev((10, 16, 2, 128))
        table = np.arange(8, dtype=np.int32).reshape(2, 4)
        paged = record(lambda: attnext.attention(q, pages_k, pages_v, block_table=table, seqlens_k=np.array([64, 50])))
        assert [l[0][1] for l in paged] == ["attn_fwd"] and dict(paged[0][0][2])["PAGED"] == 1, paged
        assert (paged[0][5]["page_size"], paged[0][5]["bt_stride"], paged[0][5]["k"][0]) == (16, 4, 16 * 2 * 128)
        assert LAUNCHES[-1][6][cuda_backend.SLOT_BLOCK_TABLE]

        # a fresh (contiguous) out is out= of the same layout: one plan
        attnext.attention(q, k, v, **base)
        n = cuda_backend.plan_count()
        assert record(lambda: attnext.attention(q, k, v)) == warm["plain"] and cuda_backend.plan_count() == n

        # scale and softcap values ride on the plan of their key
        cuda_backend.clear_plans()
        a = record(lambda: attnext.attention(q, k, v, scale=0.5, softcap=2.0, **base))
        b = record(lambda: attnext.attention(q, k, v, scale=0.25, softcap=4.0, **base))
        assert cuda_backend.plan_count() == 1
        assert (a[0][5]["scale"], a[0][5]["softcap"], b[0][5]["scale"], b[0][5]["softcap"]) == (0.5, 2.0, 0.25, 4.0)
        assert {**a[0][5], "scale": 0, "softcap": 0} == {**b[0][5], "scale": 0, "softcap": 0}

        # the lab's overrides are part of the key
        dq, dk, dv = qkv(1, 1, 32768, 32, 8, 128)
        before = record(lambda: attnext.attention(dq, dk, dv))
        _env.setenv("ATTNEXT_DECODE_CTAS", "4")
        after = record(lambda: attnext.attention(dq, dk, dv))
        _env.setenv("ATTNEXT_DECODE_CTAS", None)
        assert after[0][1][0] == 2 * before[0][1][0], (before[0][1], after[0][1])
        assert record(lambda: attnext.attention(dq, dk, dv)) == before

        # bounded
        cuda_backend.clear_plans()
        for s in range(1, cuda_backend.PLAN_CAPACITY + 40):
            attnext.attention(*qkv(1, s, 8, 2, 2, 64))
        assert cuda_backend.plan_count() == cuda_backend.PLAN_CAPACITY
        print("ok")
    """)


def test_split_kv_scratch_is_reused_per_stream(fake_driver):
    run_on_fake(fake_driver, r"""
        allocs, frees = (fake_cuda.counter(lib, n) for n in ("allocs", "frees"))
        q, k, v = qkv(1, 1, 32768, 32, 8, 128)
        out = dev((1, 1, 32, 128))
        attnext.attention(q, k, v, out=out)
        assert process.scratch_info() == {(0, 0): process.SCRATCH_MIN_BYTES}, process.scratch_info()
        a0, f0 = allocs.value, frees.value
        for _ in range(200):
            attnext.attention(q, k, v, out=out)
        assert (allocs.value, frees.value) == (a0, f0), "a call allocated"
        accums = {l[6][5] for l in LAUNCHES[-400:]}
        assert len(accums) == 1 and None not in accums        # one o_accum, every call
        # a larger need grows it (the smaller one freed), then it stays
        big = [dev((8, 4, 32, 128)), dev((8, 32768, 8, 128)), dev((8, 32768, 8, 128))]
        big_out = dev((8, 4, 32, 128))
        a0, f0 = allocs.value, frees.value
        attnext.attention(*big, out=big_out)
        grown = process.scratch_info()[(0, 0)]
        assert grown > process.SCRATCH_MIN_BYTES and (allocs.value - a0, frees.value - f0) == (1, 1)
        attnext.attention(q, k, v, out=out)
        assert process.scratch_info() == {(0, 0): grown}
        # the backward's delta uses it too
        lse = dev((1, 32, 1), np.float32)
        attnext.attention_backward(out, q, k, v, out, lse)
        assert process.scratch_info() == {(0, 0): grown}
        import gc
        gc.collect()
        process.release_scratch()
        assert process.scratch_info() == {}
        del big, big_out
        gc.collect()
        print("ok")
    """)


def test_scratch_under_threads(fake_driver):
    """8 threads on one stream and 8 on streams of their own: no buffer is lent to two calls at
    once, each stream keeps one, and every buffer is freed in the end."""
    run_on_fake(fake_driver, r"""
        import gc
        allocs, frees = (fake_cuda.counter(lib, n) for n in ("allocs", "frees"))
        lent, errors, lock = {}, [], threading.Lock()
        borrow, give_back = process.borrow_scratch, process.give_back_scratch

        def borrow_checked(nbytes, dev_, stream):
            buf = borrow(nbytes, dev_, stream)
            with lock:
                if buf[0] in lent:
                    errors.append(("lent twice", buf[0]))
                lent[buf[0]] = stream
            time.sleep(0.0005)           # hand the GIL over while the buffer is out
            return buf

        def give_back_checked(buf, dev_, stream):
            with lock:
                if lent.pop(buf[0], None) != stream:
                    errors.append(("given back wrong", buf[0]))
            give_back(buf, dev_, stream)

        process.borrow_scratch, process.give_back_scratch = borrow_checked, give_back_checked
        a0, f0 = allocs.value, frees.value
        problems = []
        for i in range(16):
            stream = 0 if i < 8 else 0x7000 + i          # 8 on the legacy stream, 8 on their own
            q, k, v = qkv(1, 1, 8192, 32, 8, 128, stream=stream)
            problems.append((q, k, v, dev((1, 1, 32, 128), stream=stream)))

        def work(i):
            q, k, v, out = problems[i]
            for _ in range(50):
                attnext.attention(q, k, v, out=out)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not errors and not lent, (errors, lent)
        idle = process.scratch_info()
        assert set(idle) == {(0, 0)} | {(0, 0x7000 + i) for i in range(8, 16)}, idle
        process.release_scratch()
        del problems, threads, q, k, v
        gc.collect()
        assert process.scratch_info() == {}
        assert allocs.value - a0 == frees.value - f0, (allocs.value - a0, frees.value - f0)
        print("ok")
    """)


def test_scratch_is_bounded_to_scratch_streams(fake_driver):
    run_on_fake(fake_driver, r"""
        for i in range(process.SCRATCH_STREAMS + 5):
            q, k, v = qkv(1, 1, 8192, 32, 8, 128, stream=0x9000 + i)
            attnext.attention(q, k, v)
        idle = process.scratch_info()
        assert len(idle) == process.SCRATCH_STREAMS, idle
        assert (0, 0x9000) not in idle and (0, 0x9000 + process.SCRATCH_STREAMS + 4) in idle
        # the per-thread default stream is another stream in every thread: nothing kept for it
        allocs, frees = (fake_cuda.counter(lib, n) for n in ("allocs", "frees"))
        q, k, v = qkv(1, 1, 8192, 32, 8, 128, stream=device.PER_THREAD_STREAM)
        out = dev((1, 1, 32, 128), stream=device.PER_THREAD_STREAM)
        a0, f0 = allocs.value, frees.value
        attnext.attention(q, k, v, out=out)
        assert (0, device.PER_THREAD_STREAM) not in process.scratch_info()
        assert (allocs.value - a0, frees.value - f0) == (1, 1)
        print("ok")
    """)


def test_lengths_take_one_upload_a_call(fake_driver):
    """NumPy cu_seqlens / seqused reach the kernels in one upload a call (cuda_backend._lengths):
    equal arrays share their elements, the others sit side by side; each call uploads afresh,
    so the kernels read the contents of the moment (an array changed in place included)."""
    run_on_fake(fake_driver, r"""
        names = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")

        def lengths(cu_q, cu_k, **kw):
            q, k, v = (dev((256, 2, 64)) for _ in range(3))
            n = fake_cuda.counter(lib, "allocs").value
            attnext.varlen_attention(q, k, v, cu_q, cu_k, **kw)
            p = fake_cuda.params_dict(fake_cuda.last_launch(lib).params)
            got = {n: p[n] for n in names if p[n]}
            for name, ptr in got.items():           # fake device memory is host memory
                want = np.asarray({"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}.get(name, kw.get(name)))
                read = np.ctypeslib.as_array((ctypes.c_int32 * len(want)).from_address(ptr))
                assert np.array_equal(read, want), (name, read, want)
            return got, fake_cuda.counter(lib, "allocs").value - n

        cu = np.array([0, 100, 256], np.int32)
        got, allocs = lengths(cu, cu.astype(np.int64))
        assert got["cu_seqlens_q"] == got["cu_seqlens_k"], got
        other = np.array([0, 50, 256], np.int32)
        got2, allocs2 = lengths(other, cu)
        assert got2["cu_seqlens_k"] == got2["cu_seqlens_q"] + 4 * 3 and allocs2 == allocs, (got2, allocs, allocs2)
        got3, allocs3 = lengths(cu, other, seqused_q=np.array([40, 100], np.int32),
                                seqused_k=np.array([50, 156], np.int32))
        assert got3["seqused_k"] == got3["seqused_q"] + 4 * 2 == got3["cu_seqlens_k"] + 4 * 5 and allocs3 == allocs
        cu[1] = 60                               # changed in place: read as it is now
        lengths(cu, cu)
        print("ok")
    """)


def test_a_forward_with_mods_and_lse_compiles_its_backward_ahead(fake_driver):
    """A forward with a score_mod / mask_mod that returns lse hands nvrtc.compile_ahead the
    entry points the default backward of the same problem then prefetches, less the forward's
    own (the block mask); so does one whose mask_mod was lowered to a band or to documents (the
    plain kernels); a forward without lse or without mods starts none."""
    run_on_fake(fake_driver, r"""
        AHEAD, PRE = [], []
        _C.cuda_launch_attention = _launch          # the fake's, which takes the mods' bytes too
        nvrtc.compile_ahead = lambda specs, arch, busy=1: AHEAD.append((specs, busy)) or []
        nvrtc.prefetch = lambda specs, arch, device: PRE.append(specs)
        q, k, v = qkv(1, 2048, 2048, 2, 2, 128)
        dout = dev((1, 2048, 2, 128))
        allowed = np.ones((4, 4), bool)
        softcap = dict(causal=True, score_mod=lambda s, b, h, qi, ki: 30.0 * np.tanh(s / 30.0))
        masked = dict(mask_mod=lambda b, h, qi, ki: allowed[qi % 4, ki % 4])
        doc = np.repeat(np.arange(4), 512).astype(np.int32)
        band = dict(mask_mod=lambda b, h, qi, ki: (ki <= qi) & (qi - ki < 256))      # a window
        docs = dict(mask_mod=lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi))   # documents
        attnext.attention(q, k, v, **softcap)
        attnext.attention(q, k, v, causal=True, return_lse=True)
        attnext.attention(q, k, v, **band)
        assert AHEAD == []
        for kw, block_mask in ((softcap, False), (masked, True), (band, False), (docs, False)):
            out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
            [(specs, busy)] = AHEAD
            fwd = PRE[-1]
            attnext.attention_backward(dout, q, k, v, out, lse, **kw)
            assert specs == [s for s in PRE[-1] if s not in fwd] and busy == len(fwd), (specs, PRE[-1])
            names = [s[1] for s in specs]
            assert "attn_bwd_dkdv_ws_sm90" in names and "attn_block_mask" not in names, names
            assert ("attn_block_mask" in [s[1] for s in fwd]) == block_mask
            AHEAD.clear()
        print("ok")
    """)


def test_a_score_mod_forward_takes_the_wide_tile_once_it_is_compiled(tmp_path):
    """A WS forward whose score_mod loads from no array per score runs SM90_TILE_WS_MODS while
    SM90_TILE_WS's kernel compiles in the background (one nvrtc.compile_ahead, busy 0: after the
    call's own compiles), and the wide tile from the first call after that compile is done, or at
    once where a cache holds it; a failed compile leaves the narrow tile for good (no new plan
    tries it again); a score_mod with a lookup per score never asks. On the fake driver built
    with tensor maps (WS needs them)."""
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler for the fake libcuda")
    run_on_fake(fake_cuda.build(tmp_path, "tma", ["-DTENSOR_MAPS"]), r"""
        import concurrent.futures
        AHEAD, HELD = [], set()
        # the fake's launch, which takes the mods' bytes too; the launched kernel recorded
        _C.cuda_launch_attention = lambda fn, *rest: (_launch(fn, *rest), LAUNCHES.append((FN[id(fn)],)))

        def ahead(specs, arch, busy=1):
            f = concurrent.futures.Future()
            AHEAD.append((specs, busy, f))
            return [f]
        nvrtc.compile_ahead = ahead
        nvrtc.cached = lambda specs, arch: all((tuple(sorted(s[2].items())), s[3]) in HELD for s in specs)
        q, k, v = qkv(2, 2048, 2048, 16, 16, 128)        # tiles enough to fill the SMs: no split keys
        table = np.ones((16, 4096), np.float32)

        def tile(**kw):
            [(fn, *_)] = record(lambda: attnext.attention(q, k, v, causal=True, **kw))
            d = dict(fn[2])
            assert fn[1] == "attn_fwd_sm90" and d["WS"] == 1, fn
            return d["BLOCK_M"], d["BLOCK_N"]
        narrow, wide = select.SM90_TILE_WS_MODS[:2], select.SM90_TILE_WS[:2]
        assert narrow != wide
        alibi = dict(score_mod=lambda s, b, h, qi, ki: s - 0.0625 * np.abs(qi - ki))
        assert tile(**alibi) == narrow
        [(specs, busy, done)] = AHEAD
        assert busy == 0 and [(s[0], s[1]) for s in specs] == [("attn_fwd_sm90", "attn_fwd_sm90")]
        assert (specs[0][2]["BLOCK_M"], specs[0][2]["BLOCK_N"]) == wide
        assert tile(**alibi) == narrow and len(AHEAD) == 1          # compiling: the narrow plan stays
        HELD.add((tuple(sorted(specs[0][2].items())), specs[0][3]))
        done.set_result(None)
        assert tile(**alibi) == wide == tile(**alibi) and len(AHEAD) == 1
        cuda_backend.clear_plans()
        assert tile(**alibi) == wide and len(AHEAD) == 1            # a cache holds it: at once
        softcap = dict(score_mod=lambda s, b, h, qi, ki: 30.0 * np.tanh(s / 30.0))
        assert tile(**softcap) == narrow and len(AHEAD) == 2
        AHEAD[-1][2].set_exception(RuntimeError("compile failed"))
        assert tile(**softcap) == narrow == tile(**softcap) and len(AHEAD) == 2
        cuda_backend.clear_plans()                                  # a new plan: the failure is remembered
        assert tile(**softcap) == narrow and len(AHEAD) == 2
        relbias = dict(score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki + 2048])
        assert tile(**relbias) == narrow and len(AHEAD) == 2
        assert fake_cuda.counter(lib, "tensor_maps").value > 0
        print("ok")
    """)


def test_a_split_decode_merges_in_its_last_ctas(tmp_path):
    """A TMA_KV split decode with a few packed rows a tile (4: one query row of a GQA group of 4)
    is one launch, its counters lent by the stream: the same buffer call after call, another for a
    call while one is held, one kept afterwards. attn_fwd_combine follows the split kernel on the
    per-thread default stream, under ATTNEXT_DECODE_COMBINE=kernel, past FUSED_COMBINE_SPLITS
    splits and past FUSED_COMBINE_ROWS rows a tile, launched as a programmatic dependent of it
    (cuLaunchKernelEx) unless ATTNEXT_DEPENDENT_LAUNCH=0. K's and V's maps ask for 128-byte L2
    fills. release_scratch frees the idle counters. On the fake driver built with tensor maps
    (TMA_KV needs them)."""
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler for the fake libcuda")
    run_on_fake(fake_cuda.build(tmp_path, "tma", ["-DTENSOR_MAPS"]), r"""
        at = cuda_backend.SLOT_COUNTERS
        allocs = fake_cuda.counter(lib, "allocs")

        def launched(call):
            n = len(LAUNCHES)
            call()
            return LAUNCHES[n:]
        short, out = qkv(1, 1, 2048, 32, 8, 128), dev((1, 1, 32, 128))
        maps = fake_cuda.counter(lib, "tensor_maps")
        n_maps = maps.value
        (name, grid, _, _, _, p, ptrs), = launched(lambda: attnext.attention(*short, out=out))
        assert name[1] == "attn_fwd" and dict(name[2])["TMA_KV"] == 1, name
        # K's and V's maps: read once, so L2 fills of 128 bytes
        l2 = (ctypes.c_int * 4).in_dll(lib, "map_l2")
        assert maps.value - n_maps == 2 and l2[(maps.value - 1) % 4] == l2[(maps.value - 2) % 4] == 2
        assert 1 < p["num_splits"] <= cuda_backend.FUSED_COMBINE_SPLITS and grid == (p["num_splits"], 8, 1)
        assert ptrs[at] and ptrs[at] == process._counters[(0, 0)][0]
        a0 = allocs.value
        (again,) = launched(lambda: attnext.attention(*short, out=out))
        assert again[6][at] == ptrs[at] and allocs.value == a0, (allocs.value, a0)
        held = process.borrow_counters(8, 0, 0)
        assert held[0] == ptrs[at] and (0, 0) not in process._counters
        (other,) = launched(lambda: attnext.attention(*short))
        assert other[6][at] not in (None, held[0])
        process.give_back_counters(held, 0, 0)
        assert list(process._counters) == [(0, 0)]
        _env.setenv("ATTNEXT_DECODE_COMBINE", "kernel")
        try:
            knob = launched(lambda: attnext.attention(*short))
        finally:
            _env.setenv("ATTNEXT_DECODE_COMBINE", None)
        per_thread = qkv(1, 1, 2048, 32, 8, 128, stream=device.PER_THREAD_STREAM)
        many_splits, many_rows = qkv(1, 1, 32768, 32, 8, 128), qkv(1, 4, 2048, 32, 8, 128)
        dependent = fake_cuda.counter(lib, "dependent_launches")
        d0 = dependent.value
        for two in (knob, *(launched(lambda x=x: attnext.attention(*x)) for x in (per_thread, many_splits, many_rows))):
            assert [l[0][1] for l in two] == ["attn_fwd", "attn_fwd_combine"], two
            assert two[0][5]["num_splits"] > 1 and not any(two[0][6][at:at + 1]), two
        assert dependent.value - d0 == 3, (dependent.value, d0)      # the three new calls' attn_fwd_combine
        _env.setenv("ATTNEXT_DEPENDENT_LAUNCH", "0")
        try:
            d0 = dependent.value
            assert [l[0][1] for l in launched(lambda: attnext.attention(*many_splits))] == ["attn_fwd", "attn_fwd_combine"]
            assert dependent.value == d0
        finally:
            _env.setenv("ATTNEXT_DEPENDENT_LAUNCH", None)
        process.release_scratch()
        assert not process._counters
        print("ok")
    """)


def test_the_hopper_backward_takes_q_and_dout_by_tensor_maps(tmp_path):
    """On a driver with tensor maps the warp-specialised dK/dV kernel is built with BWD_TMA and
    its launch alone asks for the maps of q and dout (tma_rows_q: a query tile's rows; the
    other backward kernels take none): 4-d (D, Hq, rows, batch) with each array's own byte
    strides, varlen's packed rows and one batch, boxes of 64 columns x 1 x the tile. A dout
    broadcast along its rows, a q of fewer rows than a tile, sequences all shorter than one,
    ATTNEXT_BWD_TMA=0 (a plan of its own) and a recomputed dQ keep the cp.async loads. The
    fake driver refuses maps the real one would (0 or unaligned strides, boxes past a
    dimension)."""
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler for the fake libcuda")
    run_on_fake(fake_cuda.build(tmp_path, "tma", ["-DTENSOR_MAPS"]), r"""
        import ctypes
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])     # the mods' bytes dropped
        maps = fake_cuda.counter(lib, "tensor_maps")

        def made(back):     # the map made `back` maps ago: (dims, byte strides, box)
            at = (maps.value - back) % 4
            return tuple(tuple((t * 16).in_dll(lib, name)[4 * at:4 * at + 4]) for t, name in
                         ((ctypes.c_ulonglong, "map_dims"), (ctypes.c_ulonglong, "map_strides"), (ctypes.c_uint, "map_box")))

        def backward(q, k, v, dout, **kw):
            out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
            n = maps.value
            got = record(lambda: attnext.attention_backward(dout, q, k, v, out, lse, **kw))
            ws = [(dict(l[0][2]), l[5]["tma_rows_q"]) for l in got if l[0][1] == "attn_bwd_dkdv_ws_sm90"]
            assert all(l[5]["tma_rows_q"] == 0 for l in got if l[0][1] != "attn_bwd_dkdv_ws_sm90"), got
            return ws, maps.value - n

        for D, rows in ((128, 64), (64, 128)):
            q, k, v = qkv(2, 300, 300, 4, 2, D)
            # dout with rows twice as long as its data (another layout than q's)
            dout = dev((2, 300, 4, D), strides=(300 * 8 * D, 8 * D, D, 1))
            [(d, tma_rows)], encoded = backward(q, k, v, dout, causal=True)
            assert d["BWD_TMA"] == 1 and tma_rows == rows == d["KV_BLOCK_M"] and encoded == 2, (d, tma_rows)
            # q's map, then dout's: (D, Hq, rows, B), byte strides of a head, a row, a sequence
            assert made(2) == ((D, 4, 300, 2), (2 * D, 8 * D, 2400 * D, 0), (64, 1, rows, 1)), made(2)
            assert made(1) == ((D, 4, 300, 2), (2 * D, 16 * D, 4800 * D, 0), (64, 1, rows, 1)), made(1)
            l2 = (ctypes.c_int * 4).in_dll(lib, "map_l2")
            assert l2[(maps.value - 1) % 4] == l2[(maps.value - 2) % 4] == 3     # 256-byte L2 fills
            # a dout broadcast along its rows: no maps
            [(d, tma_rows)], encoded = backward(q, k, v, dev((2, 300, 4, D), strides=(4 * D, 0, D, 1)), causal=True)
            assert "BWD_TMA" not in d and tma_rows == 0 and encoded == 0, d
            # the lab's switch, on the same call: a plan of its own, without maps
            _env.setenv("ATTNEXT_BWD_TMA", "0")
            [(d, tma_rows)], encoded = backward(q, k, v, dout, causal=True)
            _env.setenv("ATTNEXT_BWD_TMA", None)
            assert "BWD_TMA" not in d and tma_rows == 0 and encoded == 0, d
            assert backward(q, k, v, dout, causal=True)[1] == 2
        # fewer query rows than a tile: no maps (a box is a whole tile)
        q, k, v = qkv(2, 40, 300, 4, 2, 128)
        [(d, tma_rows)], encoded = backward(q, k, v, dev((2, 40, 4, 128)))
        assert "BWD_TMA" not in d and tma_rows == 0 and encoded == 0, d
        # varlen: the packed rows, one batch
        qv, kv, vv = dev((700, 4, 128)), dev((700, 2, 128)), dev((700, 2, 128))
        cu = np.array([0, 300, 700], np.int32)
        lens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=400, max_seqlen_k=400, causal=True)
        out, lse = attnext.varlen_attention(qv, kv, vv, return_lse=True, **lens)
        got = record(lambda: attnext.varlen_attention_backward(dev((700, 4, 128)), qv, kv, vv, out, lse, **lens))
        assert [l[5]["tma_rows_q"] for l in got if l[0][1] == "attn_bwd_dkdv_ws_sm90"] == [64], got
        assert made(1)[0] == (128, 4, 700, 1) and made(1)[2] == (64, 1, 64, 1), made(1)
        # sequences all shorter than a tile: no tile could take a bulk copy
        short = dict(lens, cu_seqlens_q=np.array([0, 60, 120], np.int32), cu_seqlens_k=cu)
        qs = dev((120, 4, 128))
        out, lse = attnext.varlen_attention(qs, kv, vv, return_lse=True, **short)
        got = record(lambda: attnext.varlen_attention_backward(dev((120, 4, 128)), qs, kv, vv, out, lse, **short))
        assert [l[5]["tma_rows_q"] for l in got if l[0][1] == "attn_bwd_dkdv_ws_sm90"] == [0], got
        # a recomputed dQ (the mods' array gradients) runs no WS kernel
        table = np.ones(4, np.float32)
        assert backward(q, k, v, dev((2, 40, 4, 128)), score_mod=lambda s, b, h, qi, ki: s * table[h])[0] == []
        print("ok")
    """)


# --- the C entry points' argument checks (no driver needed: they refuse before using it) ---

def _prob(**changes):
    t = ((0, (2, 16, 4, 64), (4096, 256, 64, 1)))
    prob = types.SimpleNamespace(
        device=0, dtype=1, B=2, causal=0, window_left=-1, window_right=-1, bias_dtype=2, alibi_dtype=2,
        bias_heads=1, mask_heads=1, num_splits=1, dq_write_last=0, k_rows_max=0, max_rows_q=0, max_rows_k=9, page_size=0,
        bt_stride=0, tma_rows=0, tma_rows_q=0, tma_read_once=0, tma_out=0,
        q=t, k=t, v=t, out=t, lse=None, bias=None, mask=None,
        alibi=None, dout=None, dq=None, dk=None, dv=None, dbias=None, dlse=None, delta=None, dq_accum=None, dq_sem=None)
    vars(prob).update(changes)
    return prob


def test_attn_template_reads_shapes_and_strides():
    import ctypes
    template = _C.attn_template(_prob())
    p = fake_cuda.AttnParams.from_buffer_copy(template[:ctypes.sizeof(fake_cuda.AttnParams)])
    assert (p.B, p.Sq, p.Hq, p.D, p.Sk, p.Hk, p.Dv, p.dtype) == (2, 16, 4, 64, 16, 4, 64, 1)
    assert tuple(p.k.s) == (4096, 256, 64, 1) and not p.q.ptr and not p.out.ptr
    assert (p.max_rows_q, p.max_rows_k) == (16, 9)       # 0: the tensor's rows


@pytest.mark.parametrize("changes, exc, match", [
    (dict(k=(0, (2, 16, 3, 64), (3072, 192, 64, 1))), ValueError, "heads disagree"),
    (dict(q=(0, (2, 16, 4), (64, 4, 1))), ValueError, "q must have 4 dims"),
    (dict(lse=(0, (2, 4, 16, 1), (64, 16, 1, 1))), ValueError, "lse must have 3 dims"),
    (dict(B="two"), TypeError, "integer"),
])
def test_attn_template_refuses(changes, exc, match):
    with pytest.raises(exc, match=match):
        _C.attn_template(_prob(**changes))


@pytest.mark.parametrize("i, value, exc, match", [
    (1, (1, 1), TypeError, "grid must be a 3-tuple"),
    (2, [128, 1, 1], TypeError, "block must be a 3-tuple"),
    (5, b"short", TypeError, "template must come from attn_template"),
    (6, (1,) * (len(_layout.PTR_FIELDS) + 1), TypeError,
     f"ptrs must be a tuple of at most {len(_layout.PTR_FIELDS)}"),
    (6, (None, 16, 16), ValueError, "q, k, v missing"),
    (6, (16, None, 16), ValueError, "q, k, v missing"),
    (0, "not a capsule", TypeError, "capsule from module_function"),
])
def test_cuda_launch_attention_refuses(i, value, exc, match):
    args = ["fn", (1, 1, 1), (128, 1, 1), 0, 0, _C.attn_template(_prob()), (16, 16, 16, 16), 1.0, 0.0]
    args[i] = value
    with pytest.raises(exc, match=match):
        _C.cuda_launch_attention(*args)
    with pytest.raises(TypeError, match="takes 9 or 10 arguments"):
        _C.cuda_launch_attention(*args[:8])


# --- the same on a GPU ---

@pytest.fixture(scope="module")
def torch_cuda():
    from attnext.cuda import backend as cuda_backend
    if cuda_backend.unavailable_reason():
        pytest.skip(f"attnext's CUDA backend is unavailable: {cuda_backend.unavailable_reason()}")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 32768, 32, 8), (8, 1, 8192, 32, 8), (2, 300, 300, 8, 2)],
                         ids=["decode_b1", "decode_b8", "plain"])
def test_warm_plans_and_reused_scratch_give_the_cold_bits(torch_cuda, shape):
    import attnext
    from attnext.cuda import backend as cuda_backend, process
    torch = torch_cuda
    B, Sq, Sk, Hq, Hk = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for s, h in ((Sq, Hq), (Sk, Hk), (Sk, Hk)))
    cuda_backend.clear_plans()
    process.release_scratch()
    cold, cold_lse = attnext.attention(q, k, v, return_lse=True)
    for _ in range(3):
        warm, warm_lse = attnext.attention(q, k, v, return_lse=True)
        assert torch.equal(warm, cold) and torch.equal(warm_lse, cold_lse)


@pytest.mark.gpu
def test_threads_on_their_own_streams_get_the_single_thread_bits(torch_cuda):
    """Split-KV decode from 8 threads, each on a stream of its own (its scratch reused across its
    calls), gives the bits of one thread on the legacy stream. The inputs are DeviceArrays over
    torch's memory naming the thread's stream (torch's own interface names none)."""
    import threading
    import attnext
    from attnext.cuda import arrays as device, process
    torch = torch_cuda
    g = torch.Generator(device="cuda").manual_seed(1)
    tensors = [[torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                for s, h in ((1, 32), (4096 * (i % 3 + 1), 8), (4096 * (i % 3 + 1), 8))] for i in range(8)]
    torch.cuda.synchronize()
    streams = [_C.stream_create(0, True) for _ in range(8)]

    def on(t, stream):
        return device.DeviceArray(t.data_ptr(), tuple(t.shape), BF16, 0, None, stream, t)

    want = [attnext.attention(*(on(t, 0) for t in p)).numpy() for p in tensors]
    got, errors = [None] * 8, []

    def work(i):
        try:
            for _ in range(20):
                out = attnext.attention(*(on(t, streams[i]) for t in tensors[i]))
            got[i] = out.numpy()            # in the order of the thread's stream
        except Exception as e:     # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i in range(8):
        assert np.array_equal(got[i].view(np.uint16), want[i].view(np.uint16)), f"thread {i}"
    assert {(0, s) for s in streams} <= set(process.scratch_info())
    process.release_scratch()
    for s in streams:
        _C.stream_destroy(s, 0)


def test_the_persistent_ws_forward_plan(tmp_path):
    """A dense batch's WS forward of at most select.PERSIST_TILES query tiles
    (select.PERSIST_TILES_CAUSAL with a causal mask) without score options is a persistent grid by
    default, and any dense one where the lab asks (ATTNEXT_FWD_PERSIST=1):
    min(tiles, SMs) CTAs on one axis, four tensor maps (k, v, then q and out by boxes of
    PERSIST_Q_ROWS rows; out's only where its address and strides are 16-byte aligned, and not
    under ATTNEXT_FWD_TMA_STORE=0), the stream's counters in their slot and the second Q's shared
    memory; a varlen call and one with seqused_k keep a CTA a tile, as do longer rows, a call with
    a score option and every call under ATTNEXT_FWD_PERSIST=0. Short calls (512 query rows) run the
    persistent grid too, D = 64's plain ones on the 128-row tile with three stages, not the 192-row
    one (select.WS3_ROWS), but for D = 64's with a softcap or a score_mod, which keep the
    two-warpgroup kernel, as every call does under ATTNEXT_FWD_WS=0. On the fake driver built
    with tensor maps (WS needs them)."""
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler for the fake libcuda")
    run_on_fake(fake_cuda.build(tmp_path, "tma", ["-DTENSOR_MAPS"]), r"""
        at = cuda_backend.SLOT_COUNTERS
        maps = fake_cuda.counter(lib, "tensor_maps")
        box = ((ctypes.c_uint * 4) * 4).in_dll(lib, "map_box")
        sms = cuda_backend.device_info(0)["multiprocessor_count"]
        q, k, v = qkv(2, 2048, 2048, 16, 16, 128)

        def launched(call):
            n, m = len(LAUNCHES), maps.value
            call()
            (fn, grid, _, smem, _, _, ptrs), = LAUNCHES[n:]
            return dict(fn[2]), grid, smem, ptrs, maps.value - m
        ws_tile = select.SM90_TILE_WS
        _env.setenv("ATTNEXT_FWD_PERSIST", "1")
        try:
            for causal in (False, True):
                d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(q, k, v, causal=causal))
                assert d["WS"] == 1 and d["PERSIST"] == 1 and grid == (min(16 * 16 * 2, sms), 1, 1), (d, grid)
                assert n_maps == 4 and box[(maps.value - 1) % 4][2] == select.PERSIST_Q_ROWS, (n_maps, list(box[0]))
                assert ptrs[at] and ptrs[at] == process._counters[(0, 0)][0], ptrs
                assert smem == select.fwd_smem_bytes(128, 128, ws_tile, "attn_fwd_sm90", ws=True, persist=True)
            qp, kp, vp = dev((4096, 16, 128)), dev((4096, 16, 128)), dev((4096, 16, 128))
            cu = np.array([0, 2048, 4096], np.int32)
            for call in (lambda: attnext.varlen_attention(qp, kp, vp, cu, cu),
                         lambda: attnext.attention(q, k, v, seqlens_k=np.array([2000, 1500]))):
                d, grid, smem, ptrs, n_maps = launched(call)
                assert d["WS"] == 1 and "PERSIST" not in d and grid[1:] != (1, 1) and n_maps == 2, (d, grid)
            qs, ks, vs = qkv(2, 1024 + 16 * 128, 4096, 16, 16, 128)     # 24 query tiles
            d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(qs, ks, vs))
            assert d["PERSIST"] == 1 and grid == (min(24 * 16 * 2, sms), 1, 1), (d, grid)
            # out's map: an out 16 bytes off takes one, 2 bytes off none (its O leaves by the
            # threads' stores), nor any out under ATTNEXT_FWD_TMA_STORE=0
            for offset, want in ((8, 4), (1, 3)):
                dst = dev((2, 2048, 16, 128), offset=offset)
                d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(q, k, v, out=dst))
                assert d["PERSIST"] == 1 and n_maps == want, (offset, n_maps)
            _env.setenv("ATTNEXT_FWD_TMA_STORE", "0")
            try:
                d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(q, k, v))
                assert d["PERSIST"] == 1 and n_maps == 3, n_maps
            finally:
                _env.setenv("ATTNEXT_FWD_TMA_STORE", None)
        finally:
            _env.setenv("ATTNEXT_FWD_PERSIST", None)
        # by default: 16 query tiles a head with or without a causal mask, and with one up to
        # PERSIST_TILES_CAUSAL (24 here, then one tile past it), but no score option
        for causal in (False, True):
            d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(q, k, v, causal=causal))
            assert d["PERSIST"] == 1 and grid == (min(16 * 16 * 2, sms), 1, 1) and n_maps == 4, (d, grid)
        d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(qs, ks, vs, causal=True))
        assert d["PERSIST"] == 1 and grid == (min(24 * 16 * 2, sms), 1, 1) and n_maps == 4, (d, grid)
        ql, kl, vl = qkv(1, select.PERSIST_TILES_CAUSAL * 128 + 1, 4096, 2, 2, 128)   # one tile past
        d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(ql, kl, vl, causal=True))
        assert "PERSIST" not in d and grid == (select.PERSIST_TILES_CAUSAL + 1, 2, 1), (d, grid)
        # ... and its CTAs in pairs (select.fwd_cluster: a plain D = 128 call, an even number of tiles)
        d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(qs, ks, vs))
        assert d["CLUSTER"] == 2 and grid == (24, 16, 2) and n_maps == 2, (d, grid)
        bias, mask = dev((1, 16, 2048, 2048), np.float32), dev((2, 1, 2048, 2048), np.bool_)
        first = lambda: attnext.attention(qs, ks, vs)
        for call in (first, lambda: attnext.attention(q, k, v, softcap=30.0),
                     lambda: attnext.attention(q, k, v, bias=bias), lambda: attnext.attention(q, k, v, mask=mask),
                     lambda: attnext.attention(q, k, v, alibi_slopes=dev((16,), np.float32, zero=True))):
            d, grid, smem, ptrs, n_maps = launched(call)
            assert d["WS"] == 1 and "PERSIST" not in d and grid[1:] == (16, 2) and n_maps == 2, (d, grid)
            assert d.get("CLUSTER") == (2 if call is first else None), d     # score options: alone
        # the three-warpgroup tile (a plain D = 64 call) keeps a CTA a tile: 11 of its 192-row tiles
        d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(*qkv(2, 2048, 2048, 16, 16, 64)))
        assert d["BLOCK_M"] == 192 and "PERSIST" not in d and grid == (11, 16, 2), (d, grid)
        _env.setenv("ATTNEXT_FWD_PERSIST", "0")
        try:
            d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(q, k, v))
        finally:
            _env.setenv("ATTNEXT_FWD_PERSIST", None)
        assert "PERSIST" not in d and grid == (16, 16, 2) and n_maps == 2 and not any(ptrs[at:at + 1]), (d, grid, ptrs)
        assert smem == select.fwd_smem_bytes(128, 128, ws_tile, "attn_fwd_sm90", ws=True)
        # a 512-row call: the persistent grid, 4 query tiles a head; at D = 64 three stages of
        # the 128-row tile, not the 192-row one (3 tiles, 64 rows of them idle)
        short = qkv(32, 512, 512, 16, 16, 128)
        d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(*short))
        assert d["WS"] == 1 and d["PERSIST"] == 1 and grid == (min(4 * 16 * 32, sms), 1, 1) and n_maps == 4, (d, grid)
        short64 = qkv(32, 512, 512, 16, 16, 64)
        d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(*short64))
        assert d["PERSIST"] == 1 and (d["BLOCK_M"], d["STAGES"]) == (128, 3) and grid == (min(4 * 16 * 32, sms), 1, 1), d
        # ... but D = 64's with a softcap (or a score_mod: select.fwd_ws) keep the two-warpgroup kernel
        d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(*short64, softcap=30.0))
        assert "WS" not in d and d["BLOCK_M"] == select.SM90_TILE_SHORT[0], d
        d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(*short, softcap=30.0))
        assert d["WS"] == 1, d
        _env.setenv("ATTNEXT_FWD_WS", "0")
        try:
            d, grid, smem, ptrs, n_maps = launched(lambda: attnext.attention(*short))
        finally:
            _env.setenv("ATTNEXT_FWD_WS", None)
        assert "WS" not in d and d["BLOCK_M"] == select.SM90_TILE_SHORT[0], d
        print("ok")
    """)


def test_the_ordered_backward_runs_its_turns_in_chains(tmp_path):
    """A deterministic Hopper backward without a causal mask or window, past SHORT_KEYS keys and up
    to CHAIN_KEYS, runs the ordered dQ turns in select.DQ_CHAINS chains: the WS dK/dV kernel and
    attn_bwd_dq_convert both built with DQ_CHAINS and the key block it counts, dq_accum's heads
    DQ_CHAINS copies apart (the kernels find chain c's copy c * s[2] / DQ_CHAINS along). A causal
    call, a window, short keys (the last turn writes dq), long keys, a mask_mod and
    deterministic=False keep one copy; the lab's ATTNEXT_BWD_DQ_CHAINS sets the count, banded calls
    too."""
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler for the fake libcuda")
    run_on_fake(fake_cuda.build(tmp_path, "tma", ["-DTENSOR_MAPS"]), r"""
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])     # the mods' bytes dropped

        def backward(q, k, v, deterministic=True, **kw):
            out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
            n = len(LAUNCHES)
            attnext.attention_backward(dev(q.shape), q, k, v, out, lse, deterministic=deterministic, **kw)
            got = {l[0][1]: (dict(l[0][2]), l[5]) for l in LAUNCHES[n:]}
            ws, convert = got.get("attn_bwd_dkdv_ws_sm90"), got.get("attn_bwd_dq_convert")
            chains = ws[0].get("DQ_CHAINS", 1) if ws else None
            if convert:
                assert convert[0].get("DQ_CHAINS", 1) == chains, (convert[0], chains)
            if chains and chains > 1:
                assert ws[0]["DQ_KEY_BLOCK"] == convert[0]["DQ_KEY_BLOCK"] == 128, ws[0]
            return chains, (ws or convert or (None, {}))[1].get("dq_accum")

        for D in (64, 128):
            q, k, v = qkv(2, 2048, 2048, 4, 2, D)
            chains, strides = backward(q, k, v)
            assert chains == select.DQ_CHAINS == 2, chains
            # (B, S, Hq, D) over (B, Hq, chains, S, D) in memory
            assert tuple(strides) == (4 * 2 * 2048 * D, D, 2 * 2048 * D, 1), strides
            chains, strides = backward(q, k, v, causal=True)
            assert chains == 1 and tuple(strides) == (4 * 2048 * D, D, 2048 * D, 1), (chains, strides)
            assert backward(q, k, v, window=(300, 300))[0] == 1
            assert backward(q, k, v, deterministic=False)[0] == 1
            assert backward(*qkv(1, 1024, select.CHAIN_KEYS + 1, 4, 2, D))[0] == 1     # long keys: one copy
            doc = np.repeat(np.arange(2), 1024).astype(np.int32)
            assert backward(q, k, v, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])[0] == 1
            assert backward(*qkv(2, 1024, 1024, 4, 2, D))[0] == 1      # short keys: the last turn writes dq
            _env.setenv("ATTNEXT_BWD_DQ_CHAINS", "4")
            try:
                chains, strides = backward(q, k, v, causal=True)
                assert chains == 4 and tuple(strides) == (4 * 4 * 2048 * D, D, 4 * 2048 * D, 1), (chains, strides)
            finally:
                _env.setenv("ATTNEXT_BWD_DQ_CHAINS", None)
        print("ok")
    """)


def test_the_float32_backward_on_bfloat16_planes_plan(fake_driver):
    """Hopper's float32 backward on bfloat16 planes (by default, select.bwd_f32_x3): attn_bwd_pre,
    then attn_bwd_sm90_x3.cu's attn_bwd_dkdv_x3 over 64-key blocks of each kv head (float32 in
    memory, bfloat16 planes: ELEM_F32 and ELEM_BF16; their shared memory), then attn_bwd_dead.
    D = 64: one warpgroup, and attn_bwd_dq_x3 over 64-row query tiles of each head recomputes dQ
    (no dq_accum), deterministic or not. D = 128: two warpgroups that add dQ into dq_accum,
    attn_bwd_dq_convert writing dq: deterministic, in the key blocks' turns (DQ_ORDERED: dq_sem's
    words for the 64-key blocks, which attn_bwd_pre zeroes; in DQ_CHAINS chains, causal too; the
    first turns store, nothing zeroes dq_accum), else as they land (attn_bwd_pre zeroes dq_accum);
    with ATTNEXT_BWD_X3_DQ=recompute, as at D = 64. precision="tf32": the same kernels on two
    planes (TF32_PASSES 1; ATTNEXT_BWD_TF32_F16=0: dense calls take float16 copies by default, next
    test). Every launch among the variants warmup compiles. With ATTNEXT_BWD_F32_X3=0, D = 96,
    bfloat16 inputs or a score_mod: attn_bwd.cu's kernels."""
    run_on_fake(fake_driver, r"""
        import itertools
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])     # the mods' bytes dropped
        F32 = np.float32
        warm = {(k, tuple(sorted(d.items()))) for k, d in select.variants("sm_90a")}

        def backward(q, k, v, deterministic=True, **kw):
            out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
            n = len(LAUNCHES)
            attnext.attention_backward(dev(q.shape, q.dtype), q, k, v, out, lse, deterministic=deterministic, **kw)
            return [(l[0][1], dict(l[0][2]), l[1], l[2], l[3], l[5], l[0][0]) for l in LAUNCHES[n:]]

        def recomputes(got, D):
            names = [g[0] for g in got]
            assert names == ["attn_bwd_pre", "attn_bwd_dkdv_x3", "attn_bwd_dq_x3", "attn_bwd_dead"], names
            for name, d, grid, block, smem, p, _ in got[1:3]:
                assert d["ELEM_F32"] == d["ELEM_BF16"] == 1 and d["HEAD_DIM"] == d["HEAD_DIM_V"] == D, d
                threads = 32 * d["KV_WARPS"] if name == "attn_bwd_dkdv_x3" else 128
                assert threads == (256 if D == 128 and name == "attn_bwd_dkdv_x3" else 128), (name, threads)
                assert block == (threads, 1, 1) and smem == select.bwd_x3_smem_bytes(D, d)[name], (block, smem)
                assert not any(p["dq_accum"]) and d["DQ_ATOMIC"] == 0, (p["dq_accum"], d)
            assert got[1][2] == (4, 2, 2) and got[2][2] == (5, 4, 2), (got[1][2], got[2][2])

        mod = lambda s, b, h, qi, ki: s * 0.5
        for D in (64, 128):
            q, k, v = dev((2, 300, 4, D), F32), dev((2, 200, 2, D), F32), dev((2, 200, 2, D), F32)
            for det, causal, tf32 in itertools.product((True, False), (True, False), (False, True)):
                got = backward(q, k, v, causal=causal, deterministic=det, precision="tf32" if tf32 else None)
                assert all((g[6], tuple(sorted(g[1].items()))) in warm for g in got), [g[:2] for g in got]
                assert all(g[1]["TF32_PASSES"] == (1 if tf32 else 3) for g in got), [g[1] for g in got]
                if D == 64:
                    recomputes(got, D)
                    continue
                names = [g[0] for g in got]
                assert names == ["attn_bwd_pre", "attn_bwd_dkdv_x3", "attn_bwd_dq_convert", "attn_bwd_dead"], names
                name, d, grid, block, smem, p, _ = got[1]
                assert d["DQ_ATOMIC"] == 1 and d["KV_WARPS"] == 8 and block == (256, 1, 1), (d, block)
                assert smem == select.bwd_x3_smem_bytes(D, d)[name] <= 227 * 1024, smem
                assert any(p["dq_accum"]) and got[0][1]["DQ_ATOMIC"] == 1, (p["dq_accum"], got[0][1])
                chains = select.DQ_CHAINS if det else 1
                for _, dd, *_ in got:
                    assert dd["DQ_ORDERED"] == det and dd.get("DQ_CHAINS", 1) == chains, dd
                    assert dd.get("DQ_KEY_BLOCK", 64) == 64 and dd["DQ_TILE_M"] == (64 if det else 0), dd
                assert any(p["dq_sem"]) == det and p["dq_write_last"] == 0, (p["dq_sem"], p["dq_write_last"])
                if det:                   # (B, Hq, query tiles x words): 5 tiles of 300 rows, a word
                    assert grid == (4, 2, 2) and p["dq_sem"][1] == 5, (p["dq_sem"], grid)
            _env.setenv("ATTNEXT_BWD_X3_DQ", "recompute")
            try:
                for det in (True, False):
                    recomputes(backward(q, k, v, causal=True, deterministic=det), D)
            finally:
                _env.setenv("ATTNEXT_BWD_X3_DQ", None)
            others = [backward(q, k, v, score_mod=mod),
                      backward(dev((2, 300, 4, 96), F32), dev((2, 200, 2, 96), F32), dev((2, 200, 2, 96), F32)),
                      backward(*qkv(2, 300, 200, 4, 2, D))]
            _env.setenv("ATTNEXT_BWD_F32_X3", "0")
            try:
                others += [backward(q, k, v), backward(q, k, v, precision="tf32")]
            finally:
                _env.setenv("ATTNEXT_BWD_F32_X3", None)
            for got in others:
                assert not any(g[0].endswith("_x3") for g in got), [g[0] for g in got]
        print("ok")
    """, ATTNEXT_BWD_TF32_F16="0")


def test_the_tf32_backward_on_scaled_float16_plan(fake_driver):
    """precision="tf32"'s backward of dense float32 calls on Hopper (select.bwd_tf32_f16): first
    attn_scale16.cu's two launches (the maxima over (CTAs, 4) arrays, the copies over (CTAs, 5)),
    then attn_bwd_pre, attn_bwd_sm90.cu's float16 kernels and attn_bwd.cu's row kernels with
    F16_SCALED (float16 elements), reading the
    copies (not the caller's q, k, v, out, dout), the factors in grad_scales, writing the
    caller's float32 dq, dk, dv (among warmup's variants up to BWD_TMA: this driver makes no tensor
    maps), with attn_bwd_dq_convert writing dq (no last turn's store),
    deterministic or not, causal or not, at D = 64 and 128. Left to the planes: varlen, a bias,
    seqused, sinks, a mask_mod (here one lowered whole, to a band), float32 accuracy, and every
    call with ATTNEXT_BWD_TF32_F16=0."""
    run_on_fake(fake_driver, r"""
        import itertools
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])     # the mods' bytes dropped
        OTHER = []
        _plain = _C.launch

        def plain(fn, grid, block, smem, stream, params):
            OTHER.append((FN[id(fn)][1], grid, block))
            _plain(fn, grid, block, smem, stream, params)
        _C.launch = plain
        F32 = np.float32
        SLOT = cuda_backend.SLOT_GRAD_SCALES
        # warmup's variants, up to BWD_TMA (this driver makes no tensor maps)
        warm = {(k, tuple(sorted((n, x) for n, x in d.items() if n != "BWD_TMA"))) for k, d in select.variants("sm_90a")}

        def backward(q, k, v, deterministic=True, precision="tf32", varlen=None, **kw):
            if varlen:
                out, lse = attnext.varlen_attention(q, k, v, **varlen, return_lse=True, precision=precision, **kw)
            else:
                out, lse = attnext.attention(q, k, v, return_lse=True, precision=precision, **kw)
            n, m = len(LAUNCHES), len(OTHER)
            dout = dev(q.shape, q.dtype)
            if varlen:
                attnext.varlen_attention_backward(dout, q, k, v, out, lse, **varlen, precision=precision, **kw)
            else:
                attnext.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, precision=precision,
                                           **kw)
            return [(l[0][1], dict(l[0][2]), l[5], l[6], l[0][0]) for l in LAUNCHES[n:]], OTHER[m:], (q, k, v, out, dout)

        for D in (64, 128):
            q, k, v = dev((2, 300, 4, D), F32), dev((2, 200, 2, D), F32), dev((2, 200, 2, D), F32)
            for det, causal in itertools.product((True, False), (True, False)):
                got, pre, arrays = backward(q, k, v, causal=causal, deterministic=det)
                assert [x[0] for x in pre] == ["attn_scale16_max", "attn_scale16_convert"], pre
                assert pre[0][1][1:] == (4, 1) and pre[1][1][1:] == (5, 1) and pre[0][2] == (256, 1, 1), pre
                names = [g[0] for g in got]
                assert names[0] == "attn_bwd_pre" and names[-2:] == ["attn_bwd_dq_convert", "attn_bwd_dead"], names
                assert not any(n.endswith("_x3") for n in names), names
                for name, d, p, ptrs, kernel in got:
                    assert (kernel, tuple(sorted(d.items()))) in warm and "BWD_TMA" not in d, (kernel, d)
                    assert d["F16_SCALED"] == 1 and d["ELEM_BF16"] == 0 and "ELEM_F32" not in d, (name, d)
                    assert d["HEAD_DIM"] == D and p["dq_write_last"] == 0, (name, d, p["dq_write_last"])
                    assert ptrs[SLOT] is not None, name
                    assert not {ptrs[i] for i in (0, 1, 2, 3, cuda_backend.SLOT["dout"])} & {a.ptr for a in arrays}
                    assert ptrs[cuda_backend.SLOT["dq"]] is not None
                assert "attn_bwd_dkdv_ws_sm90" in names or "attn_bwd_dkdv_sm90" in names, names
        # left to the planes
        D = 128
        q, k, v = dev((2, 300, 4, D), F32), dev((2, 200, 2, D), F32), dev((2, 200, 2, D), F32)
        cu = np.array([0, 100, 300], np.int32)
        qv, kv, vv = dev((300, 4, D), F32), dev((300, 2, D), F32), dev((300, 2, D), F32)
        sinks = dev((4,), F32, zero=True)
        others = [backward(q, k, v, bias=dev((4, 300, 200), F32, zero=True)),
                  backward(q, k, v, precision=None),
                  backward(q, k, v, seqlens_k=np.array([150, 200], np.int32)),
                  backward(q, k, v, sinks=sinks),
                  backward(q, k, v, mask_mod=lambda b, h, qi, ki: qi >= ki),     # lowered to a band
                  backward(qv, kv, vv, varlen=dict(cu_seqlens_q=cu, cu_seqlens_k=cu))]
        _env.setenv("ATTNEXT_BWD_TF32_F16", "0")
        try:
            others.append(backward(q, k, v))
        finally:
            _env.setenv("ATTNEXT_BWD_TF32_F16", None)
        for got, pre, _ in others:
            assert not pre and not any(g[1].get("F16_SCALED") for g in got), ([g[0] for g in got], pre)
        print("ok")
    """)


def test_the_tf32_forward_on_scaled_float16_plan(fake_driver):
    """precision="tf32"'s forward of dense float32 calls on Hopper by default
    (select.fwd_tf32_f16): attn_scale16.cu's maxima and copies of q, k and v over (CTAs, 3) (out's
    and dout's slots empty), one attn_fwd_sm90.cu launch with F16_SCALED (float16 elements, a
    variant warmup compiles) reading the copies and the factors in grad_scales, writing a float16
    out of its own and the caller's lse, then attn_scale16_unscale from that out into the caller's
    out (its strides: bhsd too); causal or not, D = 64 and 128, with out= or not. Left on
    attn_fwd.cu's single-pass TF32: varlen, seqused, a mask_mod (lowered whole, to a band), D !=
    Dv, fewer than SCALED16_FWD_ROWS query rows, a batch-broadcast k (stride 0), and every call
    with ATTNEXT_FWD_TF32_F16=0. Repeated calls do not replay (the copies are made afresh)."""
    run_on_fake(fake_driver, r"""
        from attnext.cuda import scale16
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])     # the mods' bytes dropped
        OTHER = []
        _plain = _C.launch

        def plain(fn, grid, block, smem, stream, params):
            OTHER.append((FN[id(fn)][1], grid, block, np.frombuffer(bytes(params), scale16.PARAMS)[0]))
            _plain(fn, grid, block, smem, stream, params)
        _C.launch = plain
        F32 = np.float32
        SLOT = cuda_backend.SLOT_GRAD_SCALES
        warm = {(k, tuple(sorted(d.items()))) for k, d in select.variants("sm_90a")}

        def forward(q, k, v, varlen=None, **kw):
            n, m = len(LAUNCHES), len(OTHER)
            if varlen:
                res = attnext.varlen_attention(q, k, v, **varlen, return_lse=True, precision="tf32", **kw)
            else:
                res = attnext.attention(q, k, v, return_lse=True, precision="tf32", **kw)
            return [(l[0][1], dict(l[0][2]), l[6], l[0][0]) for l in LAUNCHES[n:]], OTHER[m:], res

        for D in (64, 128):
            q, k, v = dev((2, 300, 4, D), F32), dev((2, 200, 2, D), F32), dev((2, 200, 2, D), F32)
            for causal, layout in ((False, "bshd"), (True, "bshd"), (True, "bhsd")):
                if layout == "bhsd":
                    qh, kh, vh = dev((2, 4, 300, D), F32), dev((2, 2, 200, D), F32), dev((2, 2, 200, D), F32)
                    given = dev((2, 4, 300, D), F32)
                    got, pre, (out, lse) = forward(qh, kh, vh, causal=causal, layout="bhsd", out=given)
                    assert out is given
                    inputs = (qh, kh, vh)
                else:
                    got, pre, (out, lse) = forward(q, k, v, causal=causal)
                    inputs = (q, k, v)
                assert [x[0] for x in pre] == ["attn_scale16_max", "attn_scale16_convert", "attn_scale16_unscale"], pre
                assert [x[1][1:] for x in pre] == [(3, 1), (3, 1), (1, 1)], pre
                assert list(pre[0][3]["n"][3:]) == [0, 0], pre[0][3]["n"]
                (name, d, ptrs, source), = got
                assert name.startswith("attn_fwd") and d["F16_SCALED"] == 1 and d["ELEM_BF16"] == 0, (name, d)
                assert (source, tuple(sorted(d.items()))) in warm, (source, d)
                assert "ELEM_F32" not in d and d["HEAD_DIM"] == D, d
                assert ptrs[SLOT] is not None and ptrs[SLOT] == pre[0][3]["scales"], (ptrs[SLOT], pre[0][3])
                copies = [int(pre[1][3]["dst"][t]) for t in range(3)]
                assert list(ptrs[:3]) == copies and not set(copies) & {a.ptr for a in inputs}, (ptrs[:3], copies)
                assert ptrs[4] == lse.ptr and ptrs[3] != out.ptr, ptrs
                un = pre[2][3]
                assert (un["src"][3], un["dst"][3]) == (ptrs[3], out.ptr), un
                assert un["n"][3] == out.size and un["maxima"] == pre[0][3]["maxima"], un
                want = (4 * 300 * D, D, 300 * D, 1) if layout == "bhsd" else (300 * 4 * D, 4 * D, D, 1)
                assert tuple(un["shape"][3]) == (2, 300, 4, D) and tuple(un["strides"][3]) == want, un
                assert un["contig"][3] == (layout == "bshd"), un
                got2, pre2, _ = forward(*inputs, causal=causal, **({"layout": "bhsd", "out": given}
                                                                   if layout == "bhsd" else {}))
                assert [x[0] for x in pre2] == [x[0] for x in pre], pre2      # not replayed: copies again
        # left on attn_fwd.cu
        D = 128
        q, k, v = dev((2, 300, 4, D), F32), dev((2, 200, 2, D), F32), dev((2, 200, 2, D), F32)
        cu = np.array([0, 100, 300], np.int32)
        qv, kv, vv = dev((300, 4, D), F32), dev((300, 2, D), F32), dev((300, 2, D), F32)
        others = [forward(q, k, v, seqlens_k=np.array([150, 200], np.int32)),
                  forward(q, k, v, mask_mod=lambda b, h, qi, ki: qi >= ki),       # lowered to a band
                  forward(q, k, dev((2, 200, 2, 64), F32)),
                  forward(dev((2, select.SCALED16_FWD_ROWS - 1, 4, D), F32), k, v),
                  forward(q, device.DeviceArray(k.ptr, k.shape, F32, 0, (0,) + k.strides[1:], 0, k), v),
                  forward(qv, kv, vv, varlen=dict(cu_seqlens_q=cu, cu_seqlens_k=cu))]
        _env.setenv("ATTNEXT_FWD_TF32_F16", "0")
        try:
            others.append(forward(q, k, v))
        finally:
            _env.setenv("ATTNEXT_FWD_TF32_F16", None)
        for got, pre, _ in others:
            assert not pre and not any(g[1].get("F16_SCALED") for g in got), ([g[0] for g in got], pre)
            assert all(g[1].get("ELEM_F32") == 1 and g[1].get("TF32_PASSES") == 1 for g in got), got
        print("ok")
    """)


def test_the_float32_forward_on_hopper_plan(fake_driver):
    """Hopper's float32 forward at D = Dv in {64, 128} at float32 accuracy (select.fwd_f32_sm90):
    attn_fwd_sm90_f32.cu's entry over 64-row query tiles of each head and batch, 384 threads (two
    splitter warpgroups, then the computing one), its tile's shared memory, for plain scores, a
    causal band, every score option, and a score_mod with a mask_mod; the plain variants and at
    D = 128 softcap's and the score arrays' among those warmup compiles. precision="tf32", D != Dv
    and bfloat16 inputs take the other kernels (precision="tf32" with ATTNEXT_FWD_TF32_F16=0 here:
    its dense calls take scaled float16 copies by default, as
    test_the_tf32_forward_on_scaled_float16_plan checks)."""
    run_on_fake(fake_driver, r"""
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])     # the mods' bytes dropped
        F32 = np.float32
        warm = {(k, tuple(sorted(d.items()))) for k, d in select.variants("sm_90a")}

        def forward(q, k, v, **kw):
            n = len(LAUNCHES)
            attnext.attention(q, k, v, **kw)
            return [(l[0][0], l[0][1], dict(l[0][2]), l[1], l[2], l[3]) for l in LAUNCHES[n:]]

        def qkv(D, Dv=None, dtype=F32):
            return dev((2, 300, 4, D), dtype), dev((2, 200, 2, D), dtype), dev((2, 200, 2, Dv or D), dtype)

        slopes = dev((4,), F32, zero=True)
        arrays = dict(alibi_slopes=slopes, bias=dev((1, 4, 1, 200), F32), mask=dev((2, 1, 300, 200), np.bool_))
        options = dict(softcap=5.0, **arrays)
        mods = dict(score_mod=lambda s, b, h, qi, ki: s * 0.5, mask_mod=lambda b, h, qi, ki: (qi - ki) % 5 != 2)
        tile = select.SM90_TILE_F32
        for D in (64, 128):
            plain, causal, softcap = dict(), dict(causal=True), dict(softcap=5.0)
            for kw in (plain, causal, softcap, arrays, options, mods):
                got = forward(*qkv(D), **kw)
                assert [g[1] for g in got][-1:] == ["attn_fwd_sm90_f32"], [g[1] for g in got]
                source, name, d, grid, block, smem = got[-1]
                assert source == "attn_fwd_sm90_f32" and d["ELEM_F32"] == 1 and d["TF32_PASSES"] == 3, (source, d)
                assert (d["BLOCK_M"], d["BLOCK_N"], d["NUM_WARPS"], d["STAGES"]) == tile, d
                assert grid == (5, 4, 2) and block == (384, 1, 1), (grid, block)
                assert smem == select.fwd_smem_bytes(D, D, tile, "attn_fwd_sm90_f32", "float32"), smem
                if kw is mods:
                    assert d["HAS_SCORE_MOD"] == d["HAS_MASK_MOD"] == 1, d
                elif kw is options:
                    assert d["HAS_SOFTCAP"] == d["HAS_ALIBI"] == d["HAS_BIAS"] == d["HAS_MASK"] == 1, d
                if kw is plain or kw is causal or D == 128 and (kw is softcap or kw is arrays):
                    assert (source, tuple(sorted(d.items()))) in warm, d
            for kw in (dict(precision="tf32"), dict(precision="tf32", **options)):
                assert [g[1] for g in forward(*qkv(D), **kw)] == ["attn_fwd"], kw
        assert [g[1] for g in forward(*qkv(64, 128))] == ["attn_fwd"]
        assert [g[1] for g in forward(*qkv(96))] == ["attn_fwd"]
        assert [g[1] for g in forward(*qkv(128, dtype=BF16))][-1] == "attn_fwd_sm90"
        print("ok")
    """, ATTNEXT_FWD_TF32_F16="0")
