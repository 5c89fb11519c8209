"""Threads and memory on the CPU backend: 8 threads calling forward and backward at once get the
single-thread bits without deadlock, with score_mods and mask_mods traced concurrently on their
first calls too; the backward releases the GIL too; 10,000 small calls, with and without
score_mod / mask_mod, do not grow RSS.

Already elsewhere: a forward's GIL release and 4 forward threads (test_cpu_attention.py), fork
after use (test_cpu_attention.py), two processes filling one kernel cache (test_kernel_cache.py).
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import attnext
from conftest import BF16, F16, F32, F64, in_threads, make_qkv, make_varlen_qkv, randn

N_THREADS = 8
JOIN_SECONDS = 300


def _bits(x):
    return None if x is None else np.ascontiguousarray(x).view(np.uint8).copy()


def _problem(rng, i):
    """Eight different problems: dtypes, layouts, GQA, masks, biases, varlen, lengths."""
    dtype = [F32, F16, BF16, F64][i % 4]
    if i % 3 == 2:
        cu_q, cu_k = np.array([0, 37, 37, 140]), np.array([0, 50, 91, 200])
        q, k, v = make_varlen_qkv(rng, 150, 200, 4, 2, 32, 24, dtype)
        opts = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=bool(i % 2),
                    bias=randn(rng, (3, 1, 103, 109), F32), seqused_k=np.array([50, 30, 109]))
        return "varlen", q, k, v, opts
    layout = "bhsd" if i % 2 else "bshd"
    q, k, v = make_qkv(rng, 2, 90 + 7 * i, 130 - 5 * i, 4, 1 + i % 2, 40, 32, dtype, layout)
    sq, sk = 90 + 7 * i, 130 - 5 * i
    opts = dict(layout=layout, causal="top_left" if i % 4 == 1 else True, window=(64, -1),
                mask=rng.random((sq, sk)) < 0.9, bias=randn(rng, (1, 1, sq, sk), F32),
                softcap=20.0 if i % 2 else None)
    return "padded", q, k, v, opts


def _run(kind, q, k, v, opts, dout):
    fwd, bwd = ((attnext.attention, attnext.attention_backward) if kind == "padded" else
                (attnext.varlen_attention, attnext.varlen_attention_backward))
    out, lse = fwd(q, k, v, **opts, return_lse=True, device="cpu")
    g = bwd(dout, q, k, v, out, lse, **opts, device="cpu")
    return [_bits(x) for x in (out, lse, g.dq, g.dk, g.dv, g.dbias)]


@pytest.mark.parametrize("omp_threads", ["1", "2"])
def test_eight_threads_forward_and_backward_get_the_single_thread_bits(rng, monkeypatch, omp_threads):
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", omp_threads)
    problems = [_problem(rng, i) for i in range(N_THREADS)]
    douts = []
    for kind, q, k, v, opts in problems:
        douts.append(randn(rng, q.shape[:-1] + (v.shape[-1],), q.dtype))   # out's shape
    want = [_run(*p, d) for p, d in zip(problems, douts)]

    def work(i):
        return [_run(*problems[i], douts[i]) for _ in range(5)]

    for i, runs in enumerate(in_threads(work, N_THREADS, JOIN_SECONDS)):
        for r in runs:
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), r, want[i]):
                assert (a is None and b is None) or np.array_equal(a, b), f"problem {i}: {name}"


def test_eight_threads_on_one_problem_share_inputs(rng):
    """The same (read-only) arrays in every thread, and each thread's own out= buffer."""
    q, k, v = make_qkv(rng, 2, 200, 260, 4, 2, 64, 64, F32)
    for x in (q, k, v):
        x.flags.writeable = False
    want, lse = attnext.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    dout = randn(rng, want.shape, F32)
    g_want = attnext.attention_backward(dout, q, k, v, want, lse, causal=True, device="cpu")

    def work(i):
        out = np.full(want.shape, np.nan, F32)
        for _ in range(4):
            attnext.attention(q, k, v, causal=True, out=out, device="cpu")
            g = attnext.attention_backward(dout, q, k, v, want, lse, causal=True, device="cpu")
        return out, g

    for out, g in in_threads(work, N_THREADS, JOIN_SECONDS):
        assert np.array_equal(_bits(out), _bits(want))
        for a, b in zip(g[:3], g_want[:3]):
            assert np.array_equal(_bits(a), _bits(b))


def _mod_problem(rng, i):
    """q, k, v and dtype of problem i of eight: lengths over several 64-wide tiles, so the
    block masks of _mod_functions have empty, partial and full tiles."""
    j = i % 4
    dtype = [F32, F64][i % 2]
    sq, sk = 150 + 23 * j, 190 - 17 * j
    q, k, v = make_qkv(rng, 2, sq, sk, 4, 2, 32, 24, dtype)
    return q, k, v, dtype


def _mod_functions(rng, nonce):
    """Four (score_mod, mask_mod) pairs of different structures that capture arrays (a
    relative-bias table with its gradient, a document id per position). Threads i and i + 4
    share pair i % 4 (one first trace raced by two threads); `nonce`, an int constant every
    function holds, makes each test's structures new to the program cache, so the threads
    trace, lower and cache them concurrently on their first calls."""
    smax = 256
    table = rng.standard_normal((4, 2 * smax + 1)).astype(np.float32)
    slopes = rng.uniform(0.1, 0.5, 4)
    doc = np.sort(rng.integers(0, 5, smax))
    big = 10 ** 6 + nonce     # q_idx, kv_idx < big always: an int constant (structure), no effect
    return [
        (lambda s, b, h, qi, ki: s + table[h, qi - ki + smax] - (qi >= big),
         lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki < big)),
        (lambda s, b, h, qi, ki: s - slopes[h] * np.abs(qi - ki) + (ki >= big),
         lambda b, h, qi, ki: (qi - ki < 70) & (ki - qi < 3) & (qi < big)),
        (lambda s, b, h, qi, ki: 3.0 * np.tanh(s / 3.0) + table[h, qi] * (ki < big),
         lambda b, h, qi, ki: (ki <= qi) | (doc[ki] == 4) | (ki >= big)),
        (lambda s, b, h, qi, ki: (np.where(doc[qi] == doc[ki], s, s - 1.0)
                                  + table[b, ki + big - big]),
         lambda b, h, qi, ki: ((qi + ki + b) % 3 != 1) & (ki < big)),
    ]


def _run_mods(q, k, v, dout, score_mod, mask_mod):
    out, lse = attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True,
                                 device="cpu")
    g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod,
                                   mask_mod=mask_mod, device="cpu")
    return ([_bits(x) for x in (out, lse, g.dq, g.dk, g.dv)]
            + [(n, _bits(g.dtensors[n])) for n in sorted(g.dtensors)])


@pytest.mark.parametrize("omp_threads", ["1", "2"])
def test_eight_threads_with_score_mod_and_mask_mod_first_calls(rng, monkeypatch, omp_threads):
    """8 threads whose first calls trace, lower and cache score_mods / mask_mods concurrently
    (two threads per function), with captured arrays, block masks and array gradients: each
    thread's results, in every round, are the bits the same calls give on one thread afterwards
    (the programs then cached)."""
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", omp_threads)
    nonce = int(rng.integers(1, 10 ** 6)) * 2 + int(omp_threads)
    compiles = attnext.cache_info()["cpu"]["compiles"]
    funcs = _mod_functions(rng, nonce)
    problems = [_mod_problem(rng, i) for i in range(N_THREADS)]
    douts = [randn(rng, q.shape[:-1] + (v.shape[-1],), dtype) for q, k, v, dtype in problems]

    def work(i):
        q, k, v, _ = problems[i]
        return [_run_mods(q, k, v, douts[i], *funcs[i % 4]) for _ in range(3)]

    got = in_threads(work, N_THREADS, JOIN_SECONDS)
    # every structure is new: one program per score_mod (forward and backward) and mask_mod
    # (at most: a race may lower one twice, but no more than once per thread)
    made = attnext.cache_info()["cpu"]["compiles"] - compiles
    assert 8 <= made <= 8 * 2, made
    for i, runs in enumerate(got):
        q, k, v, _ = problems[i]
        want = _run_mods(q, k, v, douts[i], *funcs[i % 4])
        assert want[5:], f"problem {i}: no array gradient"
        for r in runs:
            assert len(r) == len(want), f"problem {i}"
            for n, (a, b) in enumerate(zip(r, want)):
                same = (a[0] == b[0] and np.array_equal(a[1], b[1])) if isinstance(a, tuple) \
                    else np.array_equal(a, b)
                assert same, f"problem {i}: result {n} differs from the single-thread bits"


def test_threads_mixing_good_and_bad_calls(rng):
    """Errors raised in some threads leave the others' results and the library intact."""
    q, k, v = make_qkv(rng, 1, 120, 120, 2, 2, 32, 32, F32)
    want = attnext.attention(q, k, v, device="cpu")

    def work(i):
        got = []
        for j in range(20):
            if (i + j) % 2:
                with pytest.raises(ValueError):
                    attnext.attention(q, k, v, window=(-3, 0), device="cpu")
            else:
                got.append(attnext.attention(q, k, v, device="cpu"))
        return got

    for got in in_threads(work, N_THREADS, JOIN_SECONDS):
        assert all(np.array_equal(x, want) for x in got)


def test_gil_released_during_a_backward(rng, monkeypatch):
    """As test_cpu_attention.py's forward check: a Python thread keeps running while a long
    backward is in C (with the GIL held its longest pause would span the whole call)."""
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", "1")
    q, k, v = make_qkv(rng, 1, 2048, 2048, 4, 4, 64, 64, F32)
    out, lse = attnext.attention(q, k, v, return_lse=True, device="cpu")
    started, done = threading.Event(), threading.Event()
    span = []

    def work():
        started.set()
        t0 = time.perf_counter()
        attnext.attention_backward(out, q, k, v, out, lse, device="cpu")
        span.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    last, longest_pause, ticks = time.perf_counter(), 0.0, 0
    while not done.is_set():
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
        ticks += 1
    worker.join()
    assert span[0] > 0.05, "the call is too short to tell"
    assert longest_pause < span[0] / 3 and ticks > 100, (longest_pause, span[0], ticks)


RSS_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import attnext

    import ctypes
    try:
        _trim = ctypes.CDLL("libc.so.6").malloc_trim     # glibc: give freed heap pages back
    except (OSError, AttributeError):
        _trim = lambda pad: 0

    def rss():
        # freed heap pages back to the system first: RSS then counts what is still held, and
        # the control's kept arrays cannot hide in memory freed earlier
        _trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    rng = np.random.default_rng(0)
    f32 = np.float32
    q, k, v = (rng.standard_normal(s).astype(f32) for s in ((1, 16, 2, 16), (1, 24, 1, 16), (1, 24, 1, 16)))
    vq, vk, vv = (rng.standard_normal(s).astype(np.float16) for s in ((20, 2, 8), (30, 2, 8), (30, 2, 8)))
    cu_q, cu_k = np.array([0, 7, 20]), np.array([0, 12, 30])
    bias = rng.standard_normal((16, 24)).astype(f32)
    mask = rng.random((1, 1, 16, 24)) < 0.8
    out_buf = np.empty((1, 16, 2, 16), f32)

    def one_round(i):
        out, lse = attnext.attention(q, k, v, causal=i % 2 == 0, bias=bias, mask=mask,
                                     return_lse=True, device="cpu")
        attnext.attention(q, k, v, out=out_buf, window=(3, 3), device="cpu")
        g = attnext.attention_backward(out, q, k, v, out, lse, causal=i % 2 == 0, bias=bias,
                                       mask=mask, device="cpu")
        o2, l2 = attnext.varlen_attention(vq, vk, vv, cu_q, cu_k, return_lse=True, device="cpu")
        attnext.varlen_attention_backward(o2, vq, vk, vv, o2, l2, cu_q, cu_k, device="cpu")
        try:
            attnext.attention(q, k, v, scale=float("nan"), device="cpu")
        except ValueError:
            pass
        return g

    # score_mod / mask_mod calls: captured arrays (a float table with a gradient, document
    # ids) converted at every call, a closure made afresh each round (traced again, its program
    # found in the cache), block masks over several tiles, array gradients, a lookup out of
    # range refused
    table = rng.standard_normal((2, 2 * 24 + 1)).astype(f32)
    doc = np.sort(rng.integers(0, 3, 200))
    mq, mk, mv = (rng.standard_normal(s).astype(f32)
                  for s in ((1, 150, 2, 16), (1, 200, 2, 16), (1, 200, 2, 16)))
    small = np.zeros(3, f32)

    def mods_round(i):
        score_mod = lambda s, b, h, qi, ki: s + table[h, np.clip(qi - ki, -24, 24) + 24] * 0.5
        mask_mod = lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi + i % 3)
        out, lse = attnext.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                     return_lse=True, device="cpu")
        g = attnext.attention_backward(out, q, k, v, out, lse, score_mod=score_mod,
                                       mask_mod=mask_mod, device="cpu")
        o2, l2 = attnext.attention(mq, mk, mv, mask_mod=mask_mod, score_mod=score_mod,
                                   return_lse=True, device="cpu")
        attnext.attention_backward(o2, mq, mk, mv, o2, l2, mask_mod=mask_mod,
                                   score_mod=score_mod, device="cpu")
        try:
            attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + small[ki],
                              device="cpu")
        except IndexError:
            pass
        return g

    if sys.argv[2] == "mods":
        one_round = mods_round
    calls_per_round = 5
    n = int(sys.argv[1])
    for i in range(300):                                   # warm-up: allocator pools, caches
        one_round(i)
    before = rss()
    for i in range(n // calls_per_round):
        one_round(i)
    after = rss()
    # the control: the same count of rounds keeping one 1 KiB result each is seen as growth
    kept = [one_round(i).dq.ravel()[:256].copy() for i in range(n // calls_per_round)]
    print(before, after, rss())
""")


@pytest.mark.parametrize("calls", ["plain", "mods"])
def test_rss_stays_flat_over_10000_calls(calls):
    """10,000 small calls after a warm-up: RSS may not grow by more than 2 MiB, about 1 KiB a
    round of 5 calls; a control that keeps 1 KiB a round must show as growth. "plain": forward
    and backward, padded and varlen, with bias, mask, out= and a refused call among them;
    "mods": forward and backward with a score_mod and a mask_mod capturing arrays (a float table
    with its gradient, document ids; block masks over several tiles), a closure made afresh
    each round, and a lookup out of range refused."""
    r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, "10000", calls], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, ATTNEXT_NUM_THREADS="2"))
    assert r.returncode == 0, r.stderr[-3000:]
    before, after, control = (int(x) for x in r.stdout.split())
    grown = after - before
    assert grown < 2 * 2 ** 20, f"RSS grew by {grown / 2 ** 20:.2f} MiB over 10,000 calls"
    assert control - after > 1.5 * 2 ** 20, "the control's kept 2 MiB (1 KiB a round) did not show in RSS"
