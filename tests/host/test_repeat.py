"""Repeated GPU calls replayed (attnext/cuda/repeat.py) on the fake driver (helpers/fake_libcuda.c):
an attention() call equal to an earlier one in its arrays (library, address, shape, strides,
dtype, device, stream) and options enqueues the launches the whole path gave the first, without
the checks; any difference takes the whole path again. So do varlen and padded calls with
lengths from the host (by their contents) or CUDA lengths read in place, and calls whose mask_mod
lowers whole (a document mask: while its array holds the runs it was lowered from); random
sequences of such calls launch what the whole path launches. `-m gpu` checks results on a device
(tests/gpu/test_cuda.py::test_repeated_calls_read_their_arrays_afresh and the tests beside it).
Last, the key read while another thread's first call is still importing the CUDA host side (a
fresh interpreter, no driver)."""
from helpers.driver import run_fresh, run_on_fake


def test_an_equal_call_replays_the_launches_of_the_first(fake_driver):
    run_on_fake(fake_driver, r"""
        import gc, weakref
        from attnext.cuda import repeat
        from helpers.spies import whole_path_calls
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])     # a score_mod's bytes dropped
        spy = whole_path_calls()          # kept: the spy lasts as long as this script
        whole = spy.__enter__()

        def call(*args, **kw):
            n, w = len(LAUNCHES), len(whole)
            res = attnext.attention(*args, **kw)
            return res, LAUNCHES[n:], len(whole) > w

        # decode (a split: scratch and a combine) and a plain forward, with out= given
        for shape in ((1, 1, 32768, 32, 8, 128), (2, 130, 200, 8, 2, 128)):
            q, k, v = qkv(*shape)
            out = dev(q.shape)
            res, first, took = call(q, k, v, out=out)
            assert took and res is out and first
            for _ in range(3):
                res, again, took = call(q, k, v, out=out)
                assert not took and res is out and repr(again) == repr(first), (again, first)   # repr: NaN fields
        # results allocated afresh on each replay, their addresses in the out and lse slots
        res, first, took = call(q, k, v, return_lse=True)
        seen, kept = set(), []
        for _ in range(3):
            (o2, l2), again, took = call(q, k, v, return_lse=True)
            assert not took and type(o2) is device.DeviceArray and o2.shape == res[0].shape
            assert (again[0][6][3], again[0][6][4]) == (o2.ptr, l2.ptr) and l2.shape == res[1].shape
            assert repr([l[:6] for l in again]) == repr([l[:6] for l in first])
            seen.add(o2.ptr)
            kept.append((o2, l2))
        assert len(seen) == 3                 # each result its own memory while the others live

        # each difference takes the whole path once, then replays (the arrays above stay alive:
        # memory at an address freed and made again with the same layout is the same call)
        kept.append(out)
        out = dev(q.shape)
        other = dev(q.shape)
        strided_k = device.DeviceArray(k.ptr, k.shape, BF16, 0, (200 * 2 * 256, 2 * 256, 128, 1), 0, k)
        on_stream = [dev(x.shape, stream=7) for x in (q, k, v, out)]
        differences = [
            lambda: call(q, k, v, out=out),
            lambda: call(q, k, v, out=other),
            lambda: call(other, k, v, out=out),
            lambda: call(q, strided_k, v, out=out),
            lambda: call(*on_stream[:3], out=on_stream[3]),
            lambda: call(q, k, v, out=out, causal=True),
            lambda: call(q, k, v, out=out, scale=0.5),
            lambda: call(q, k, v, out=out, softcap=30.0),
            lambda: call(q, k, v, out=out, window=(16, 0)),
        ]
        for d in differences:
            assert d()[2] and not d()[2]
        _env.setenv("ATTNEXT_DECODE_CTAS", "3")           # the settings' next generation
        try:
            assert call(q, k, v, out=out)[2] and not call(q, k, v, out=out)[2]
        finally:
            _env.setenv("ATTNEXT_DECODE_CTAS", None)
        assert call(q, k, v, out=out)[2]
        _env.setenv("ATTNEXT_REPEAT", "0")                # the lab's switch: the whole path always
        try:
            assert call(q, k, v, out=out)[2] and call(q, k, v, out=out)[2]
        finally:
            _env.setenv("ATTNEXT_REPEAT", None)
        cuda_backend.clear_plans()
        assert repeat.count() == 0 and call(q, k, v, out=out)[2] and not call(q, k, v, out=out)[2]
        # options equal in value but not in type are other calls: bad ones still raise
        assert call(q, k, v, out=out, window=[16, 0])[2] and not call(q, k, v, out=out, window=[16, 0])[2]
        for good, bad in ((dict(return_lse=True), dict(return_lse=1)), (dict(causal=True), dict(causal=1)),
                          (dict(scale=1), dict(scale=True)), (dict(softcap=1.0), dict(softcap=True)),
                          (dict(window=(16, 0)), dict(window=(16.0, 0)))):
            call(q, k, v, out=out, **good)
            assert not call(q, k, v, out=out, **good)[2]
            try:
                call(q, k, v, out=out, **bad)
            except (TypeError, ValueError):
                pass
            else:
                raise AssertionError(f"{bad} did not raise after {good} was replayed")
        # array options always take the whole path
        n = repeat.count()
        alibi = dev((8,), np.float32, zero=True)
        assert call(q, k, v, out=out, alibi_slopes=alibi)[2] and call(q, k, v, out=out, alibi_slopes=alibi)[2]
        assert call(q, k, v, out=out, score_mod=lambda s, b, h, qi, ki: s)[2]
        assert repeat.count() == n
        # a call that raised files nothing: out over q raises each time
        for _ in range(2):
            try:
                call(q, k, v, out=q)
            except ValueError as e:
                assert "shares memory" in str(e), e
            else:
                raise AssertionError("out=q did not raise")
        # recipes keep no array alive
        q2 = dev(q.shape)
        ref = weakref.ref(q2)
        call(q2, k, v, out=out)
        assert not call(q2, k, v, out=out)[2]
        del q2
        gc.collect()
        assert ref() is None
        # a fork while another thread holds the recipes' lock: the child's recipes are new ones
        held, done = threading.Event(), threading.Event()

        def hold():
            with repeat._recipes._lock:
                held.set()
                done.wait(10)
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_WRONLY)      # the parent's pipes closed: a hang fails, not stalls
            os.dup2(null, 1)
            os.dup2(null, 2)
            os._exit(0 if repeat.lookup(("none",)) is None and repeat.count() == 0 else 1)
        deadline = time.time() + 20
        while (got := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.time() < deadline:
            time.sleep(0.05)
        done.set()
        if got == (0, 0):
            os.kill(pid, 9)
        assert got[0] == pid and os.WEXITSTATUS(got[1]) == 0, f"the forked child hung or failed: {got}"
        print("ok")
    """)


def test_a_paged_call_replays_with_its_table_checked_again(fake_driver):
    """A paged decode whose CUDA block_table and seqlens_k lie where the caller keeps them (read
    in place) replays too: each replay enqueues attn_pages again, under a new launch number, on
    the same table and lengths (their values may have changed), before the same launches; a
    fault that check finds is raised by the next call, replayed or not. Another table, other
    lengths or host lengths (uploaded a call) take the whole path."""
    run_on_fake(fake_driver, r"""
        from attnext.cuda import lengths
        from helpers.spies import whole_path_calls
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])
        CHECKS = []

        def check_launch(fn, grid, block, smem, stream, params):
            p = np.frombuffer(params, lengths.PAGES_PARAMS)[0]
            CHECKS.append((FN[id(fn)][1], tuple(grid), stream, int(p["table"]), int(p["used"]), int(p["call"])))
        _C.launch = check_launch
        spy = whole_path_calls()
        whole = spy.__enter__()

        def call(*args, **kw):
            n, w = len(LAUNCHES), len(whole)
            res = attnext.attention(*args, **kw)
            return res, LAUNCHES[n:], len(whole) > w

        q, kp, vp = dev((4, 1, 32, 128)), dev((600, 16, 8, 128)), dev((600, 16, 8, 128))
        table, lens = dev((4, 512), np.int32), dev((4,), np.int32)
        out = dev(q.shape)
        res, first, took = call(q, kp, vp, out=out, block_table=table, seqlens_k=lens)
        assert took and res is out and first and len(CHECKS) == 1 and CHECKS[0][0] == "attn_pages"
        assert CHECKS[0][3:5] == (table.ptr, lens.ptr), CHECKS
        for i in range(3):
            res, again, took = call(q, kp, vp, out=out, block_table=table, seqlens_k=lens)
            assert not took and res is out and repr(again) == repr(first), (again, first)
            assert len(CHECKS) == 2 + i and CHECKS[-1][:5] == CHECKS[0][:5] and CHECKS[-1][5] > CHECKS[-2][5]
        # a fault the last check found (played here in its record): the next call raises it, once
        words = lengths._record[1]
        words[[lengths.CODE, lengths.INDEX, lengths.COLUMN, lengths.VALUE, lengths.BOUND]] = (
            lengths.PAGE_OUT_OF_RANGE, 2, 7, 999, 600)
        try:
            call(q, kp, vp, out=out, block_table=table, seqlens_k=lens)
        except IndexError as e:
            assert "block_table[2, 7] = 999 is out of range for 600 pages" in str(e), e
        else:
            raise AssertionError("the check's fault was not raised")
        assert not call(q, kp, vp, out=out, block_table=table, seqlens_k=lens)[2]
        # other arrays: the whole path once, then replays; host lengths: the whole path each time
        table2, lens2 = dev((4, 512), np.int32), dev((4,), np.int32)
        for kw in (dict(block_table=table2, seqlens_k=lens), dict(block_table=table, seqlens_k=lens2),
                   dict(block_table=table)):
            assert call(q, kp, vp, out=out, **kw)[2] and not call(q, kp, vp, out=out, **kw)[2]
        host = np.array([100, 3000, 0, 8192], np.int32)
        n = len(CHECKS)
        assert call(q, kp, vp, out=out, block_table=table, seqlens_k=host)[2]
        assert call(q, kp, vp, out=out, block_table=table, seqlens_k=host)[2]
        assert len(CHECKS) == n + 2 and CHECKS[-1][4] not in (0, lens.ptr)
        print("ok")
    """)


def test_lengths_and_lowered_mask_mods_replay_as_their_contents_allow(fake_driver):
    """Lengths given as NumPy arrays (varlen_attention's cu_seqlens, attention()'s seqlens_k) and
    a document mask_mod lowered to varlen (mods/lower.py) over a captured NumPy array replay: the
    key holds the lengths' contents, the recipe keeps the first call's upload (the replays address
    it, and it holds those lengths) and the values the documents were read from, compared with the
    array before each replay. Lengths or a document array changed in place take the whole path, whose upload holds
    the new values; the old lengths again replay the old recipe (another key), the old document
    array the whole path once (the same key: one recipe, the last). A mask_mod that leaves
    generated code, or captures a CUDA array, takes the whole path each time. Lengths rewritten
    while a call runs (another thread) leave a recipe of the values its key holds; on the
    per-thread default stream no upload is kept (no replay). CUDA lengths with max_seqlen_*
    replay too, their device check enqueued again each time."""
    run_on_fake(fake_driver, r"""
        from attnext._layout import SLOT
        from helpers.spies import whole_path_calls
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])
        spy = whole_path_calls()
        whole = spy.__enter__()

        def call(fn, *args, **kw):
            n, w = len(LAUNCHES), len(whole)
            res = fn(*args, **kw)
            return res, LAUNCHES[n:], len(whole) > w

        def lengths(launches, slot, n):
            # the int32 lengths the launch reads at that address slot
            return device.DeviceArray(launches[0][6][SLOT[slot]], (n,), np.int32, 0, None, 0, None).numpy().tolist()

        T = 700
        q, k, v, out = (dev((T, 8, 128)) for _ in range(4))
        cu = np.array([0, 130, 400, 700], np.int32)
        varlen = lambda: call(attnext.varlen_attention, q, k, v, cu, cu, causal=True, out=out)
        res, first, took = varlen()
        assert took and res is out and lengths(first, "cu_seqlens_q", 4) == [0, 130, 400, 700]
        for _ in range(3):
            res, again, took = varlen()
            assert not took and res is out and repr(again) == repr(first), (again, first)
        assert lengths(again, "cu_seqlens_k", 4) == [0, 130, 400, 700]
        cu[1] = 200                                        # changed in place: the whole path, once
        res, moved, took = varlen()
        assert took and lengths(moved, "cu_seqlens_q", 4) == [0, 200, 400, 700]
        assert not varlen()[2]
        cu = np.array([0, 130, 400, 700], np.int32)        # the first contents: the first recipe
        res, again, took = varlen()
        assert not took and repr(again) == repr(first) and lengths(again, "cu_seqlens_q", 4) == [0, 130, 400, 700]
        assert call(attnext.varlen_attention, q, k, v, cu, cu, out=out)[2]       # another option
        # lengths another thread rewrites while a call runs: its key, checks and upload read one copy
        from attnext import checks as checks_module
        inner, raced_cu = checks_module.normalise, np.array([0, 100, 300, 700], np.int32)

        def racing(*a, **kw):
            raced_cu[1] = 650
            return inner(*a, **kw)
        checks_module.normalise = racing
        try:
            res, raced, took = call(attnext.varlen_attention, q, k, v, raced_cu, raced_cu, out=out)
        finally:
            checks_module.normalise = inner
        assert took and lengths(raced, "cu_seqlens_q", 4) == [0, 100, 300, 700]
        raced_cu[1] = 100
        res, again, took = call(attnext.varlen_attention, q, k, v, raced_cu, raced_cu, out=out)
        assert not took and lengths(again, "cu_seqlens_q", 4) == [0, 100, 300, 700]
        # on the per-thread default stream (another stream in each thread) no upload is kept
        per_thread = [dev((T, 8, 128), stream=device.PER_THREAD_STREAM) for _ in range(4)]
        assert all(call(attnext.varlen_attention, *per_thread[:3], cu, cu, out=per_thread[3])[2] for _ in range(2))

        # CUDA lengths with max_seqlen_*: read in place, attn_lengths' check enqueued by each replay
        # before the same launches; a fault it finds is raised by the next call. Without max_seqlen_*
        # they are read back to the host: the whole path each time
        from attnext.cuda import lengths as device_lengths
        CHECKS = []
        _C.launch = lambda fn, grid, block, smem, stream, params: CHECKS.append((FN[id(fn)][1], tuple(grid), params))
        cu_d = dev((4,), np.int32, zero=True)
        on_gpu = lambda **kw: call(attnext.varlen_attention, q, k, v, cu_d, cu_d, causal=True, out=out, **kw)
        res, first, took = on_gpu(max_seqlen_q=300, max_seqlen_k=300)
        assert took and [c[0] for c in CHECKS] == ["attn_lengths"]
        for i in range(3):
            res, again, took = on_gpu(max_seqlen_q=300, max_seqlen_k=300)
            assert not took and repr(again) == repr(first) and len(CHECKS) == 2 + i and CHECKS[-1] == CHECKS[0]
        words = device_lengths._record[1]
        words[[device_lengths.CODE, device_lengths.ARRAY, device_lengths.INDEX, device_lengths.VALUE]] = (1, 0, 0, 5)
        try:
            on_gpu(max_seqlen_q=300, max_seqlen_k=300)
        except ValueError as e:
            assert "cu_seqlens_q[0] = 5" in str(e), e
        else:
            raise AssertionError("the check's fault was not raised")
        assert not on_gpu(max_seqlen_q=300, max_seqlen_k=300)[2]
        assert on_gpu()[2] and on_gpu()[2]

        # attention()'s seqlens_k from the host
        q4, k4, v4 = qkv(3, 64, 300, 8, 8, 128)
        out4 = dev(q4.shape)
        used = np.array([300, 17, 120], np.int32)
        padded = lambda: call(attnext.attention, q4, k4, v4, out=out4, seqlens_k=used)
        res, first, took = padded()
        assert took and not padded()[2] and lengths(first, "seqused_k", 3) == [300, 17, 120]
        used[1] = 18
        res, moved, took = padded()
        assert took and lengths(moved, "seqused_k", 3) == [300, 18, 120] and not padded()[2]

        # a document mask_mod over a NumPy array: lowered to varlen over its runs
        q1, k1, v1 = qkv(1, T, T, 8, 8, 128)
        out1 = dev(q1.shape)
        doc = np.repeat(np.arange(3), [130, 270, 300])
        same_doc = lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]
        documents = lambda: call(attnext.attention, q1, k1, v1, out=out1, causal=True, mask_mod=same_doc)
        res, first, took = documents()
        assert took and lengths(first, "cu_seqlens_q", 4) == [0, 130, 400, 700]
        for _ in range(3):
            res, again, took = documents()
            assert not took and repr(again) == repr(first), (again, first)
        doc[130:200] = 0                                   # the first document grows, in place
        res, moved, took = documents()
        assert took and lengths(moved, "cu_seqlens_q", 4) == [0, 200, 400, 700] and not documents()[2]
        doc = np.repeat(np.arange(3), [130, 270, 300])     # the first contents again: one recipe a
        res, back, took = documents()                      # key (the last), so the whole path once
        assert took and lengths(back, "cu_seqlens_q", 4) == [0, 130, 400, 700] and not documents()[2]

        # a mask_mod left as generated code, or capturing a CUDA array: the whole path each time
        gdoc = dev((T,), np.int64, zero=True)
        for mm in (lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 != 0,
                   lambda b, h, q_idx, kv_idx: gdoc[q_idx] == gdoc[kv_idx]):
            assert all(call(attnext.attention, q1, k1, v1, out=out1, mask_mod=mm)[2] for _ in range(2))
        print("ok")
    """)


def test_replays_launch_what_the_whole_path_launches(fake_driver):
    """Random sequences of calls (varlen with NumPy lengths, a document mask_mod, attention() with
    NumPy seqlens_k), their lengths and document arrays rewritten in place, replaced or left alone
    between calls: each call, replayed or not, launches what the whole path (no recipe looked up
    or filed) launches for the same arrays as they are then: the same kernels, grids and parameters, and
    lengths of the same values at every lengths address."""
    run_on_fake(fake_driver, r"""
        from attnext._layout import SLOT
        from attnext.cuda import repeat
        _C.cuda_launch_attention = lambda fn, *rest: launch(fn, *rest[:8])
        rng = np.random.default_rng(7401)
        T = 512
        q, k, v, out = (dev((T, 4, 64)) for _ in range(4))
        q1, k1, v1 = qkv(1, T, T, 4, 4, 64)
        out1 = dev(q1.shape)
        qb, kb, vb = qkv(3, 64, 256, 4, 4, 64)
        outb = dev(qb.shape)
        state = {"cu": np.array([0, 100, 300, T], np.int32), "doc": np.repeat(np.arange(3), [100, 200, T - 300]),
                 "used": np.array([256, 17, 120], np.int32)}

        doc = state["doc"]

        def same_doc(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

        def new_cuts(n):
            return np.sort(rng.choice(np.arange(1, n), 2, replace=False))

        def seen(launches):
            # what a launch does, without addresses: its record, and the values at its lengths slots
            found = []
            for l in launches:
                lens = {}
                for name, n in (("cu_seqlens_q", 4), ("cu_seqlens_k", 4), ("seqused_k", 3)):
                    ptr = l[6][SLOT[name]] if len(l[6]) > SLOT[name] else None
                    if ptr:
                        lens[name] = device.DeviceArray(ptr, (n,), np.int32, 0, None, 0, None).numpy().tolist()
                found.append((repr(l[:6]), lens))
            return found

        calls = {
            "varlen": lambda: attnext.varlen_attention(q, k, v, state["cu"], state["cu"], causal=True, out=out),
            "documents": lambda: attnext.attention(q1, k1, v1, out=out1, causal=True, mask_mod=same_doc),
            "seqlens": lambda: attnext.attention(qb, kb, vb, out=outb, seqlens_k=state["used"]),
        }
        from helpers.spies import whole_path_calls
        spy = whole_path_calls()
        whole = spy.__enter__()
        replayed = {name: 0 for name in calls}
        for step in range(150):
            name = rng.choice(list(calls))
            what = rng.integers(4)
            if name == "varlen" and what == 0:
                state["cu"][1:3] = new_cuts(T)
            elif name == "varlen" and what == 1:
                state["cu"] = np.concatenate(([0], new_cuts(T), [T])).astype(np.int32)
            elif name == "documents" and what == 0:
                doc[:] = np.repeat(np.arange(3), np.diff(np.concatenate(([0], new_cuts(T), [T]))))
            elif name == "documents" and what == 1:
                doc = np.repeat(np.arange(3), np.diff(np.concatenate(([0], new_cuts(T), [T]))))
            elif name == "seqlens" and what == 0:
                state["used"][rng.integers(3)] = rng.integers(0, 257)
            n, w = len(LAUNCHES), len(whole)
            calls[name]()
            got = seen(LAUNCHES[n:])
            replayed[name] += len(whole) == w
            lookup, remember = repeat.lookup, repeat.remember     # the whole path, filing nothing
            repeat.lookup, repeat.remember = (lambda key: None), (lambda key, recipe: None)
            try:
                n = len(LAUNCHES)
                calls[name]()
                want = seen(LAUNCHES[n:])
            finally:
                repeat.lookup, repeat.remember = lookup, remember
            assert got == want, (step, name, what, got, want)
        assert all(n >= 10 for n in replayed.values()), replayed      # the replays were exercised
        print("ok")
    """)


def test_a_call_beside_another_threads_first_import_of_the_cuda_side():
    """A thread's first call imports the CUDA host side (checks.gpu_modules, even for a CPU call);
    sys.modules holds attnext.cuda.arrays from its first line. Another thread calling attention()
    meanwhile must not read that module half-made (session 73: a ring of threads on the CPU
    raised AttributeError, 'partially initialized module ... has no attribute DeviceArray', from
    repeat.key). The import is held half-made here until the second call has read its key."""
    out = run_fresh(r"""
        import importlib.abc, importlib.util, sys, threading
        import numpy as np
        import attnext
        from attnext import reference
        from attnext.testing import assert_close
        assert "attnext.cuda.arrays" not in sys.modules     # import attnext leaves it unloaded

        begun, release = threading.Event(), threading.Event()

        class Held(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path, target=None):
                if name != "attnext.cuda.arrays":
                    return None
                sys.meta_path.remove(self)
                spec = importlib.util.find_spec(name)
                self.real = spec.loader
                spec.loader = self
                return spec

            def create_module(self, spec):
                return None

            def exec_module(self, module):                  # in sys.modules, still empty
                begun.set()
                release.wait(30)
                self.real.exec_module(module)
        sys.meta_path.insert(0, Held())
        from attnext.cuda import repeat
        real_key = repeat.key

        def key(*args):                                     # the second call's key read, the
            try:                                            # import goes on
                return real_key(*args)
            finally:
                if threading.current_thread() is threading.main_thread():
                    release.set()
        repeat.key = key

        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((2, 33, 4, 32)).astype(np.float32) for _ in range(3))
        results = {}

        def call(who):
            try:
                results[who] = attnext.attention(q, k, v, device="cpu")
            except Exception as e:
                results[who] = e
        first = threading.Thread(target=call, args=("first",))
        first.start()
        assert begun.wait(30)
        call("second")
        first.join(60)
        for who in ("first", "second"):
            assert not isinstance(results[who], Exception), f"{who}: {results[who]!r}"
            assert_close(results[who], reference.attention(q, k, v), name=who)
        print("ok")
    """)
    assert out.strip() == "ok"
