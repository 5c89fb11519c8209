"""Shared test helpers: seeded random data, q/k/v makers, and the three-way accuracy check.

The accuracy rules (the three-way check, its allowances for gradients and rounded outputs) are
attnext/testing/accuracy.py's, shared with the differential fuzzer and public as
attnext.testing.assert_close; this file wraps them in asserts.
"""
import os
import shutil
import threading
import time
import types
import zlib

# The tests alternate the CPU backend with the NumPy reference, whose OpenBLAS threads spin a while
# after each product and take the cores from the backend's OpenMP workers (attnext makes its own
# workers wait passively, but cannot change OpenBLAS's). The reference's matrices are small, so
# one BLAS thread costs it nothing. Must be set before NumPy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# JAX takes 75% of a GPU's memory at its first use by default: the xdist worker that runs the JAX
# adapter's tests then holds ~105 GiB of an H200 for the rest of its run, and the other workers'
# GPU tests fail for memory (session 51's `-n 8` run of tests/ outside tests/gpu: 253 of them).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import attnext  # noqa: E402
import attnext.testing  # noqa: E402
from attnext import _C, _env, reference  # noqa: E402
from attnext.testing import accuracy  # noqa: E402
from attnext.testing.accuracy import (BF16, F16, F32, F64, acc_dtype, compare,  # noqa: E402,F401
                                      compare_dtensors, compare_grads)


DTYPES = [F16, BF16, F32, F64]
DTYPE_IDS = {F16: "f16", BF16: "bf16", F32: "f32", F64: "f64"}

# The backend the CPU suite runs on: ATTNEXT_TEST_DEVICE=cuda reruns the whole suite on the GPU
# (gpu/test_cuda.py does that under `pytest -m gpu`); dtypes the GPU has no kernels for skip.
TEST_DEVICE = os.environ.get("ATTNEXT_TEST_DEVICE", "cpu")
# ATTNEXT_TEST_PRECISION=tf32: the suite's float32 calls run with precision="tf32", held to float16's
# rule (accuracy.product_dtype); gpu/test_cuda.py reruns the CPU suite's float32 cases so on cuda.
TEST_PRECISION = os.environ.get("ATTNEXT_TEST_PRECISION") or None
GPU_DTYPES = (F16, BF16, F32)

class EnvMonkeyPatch(pytest.MonkeyPatch):
    """pytest's MonkeyPatch, whose setenv / delenv of an ATTNEXT_* variable (and its undo) also
    refresh attnext's copy of its settings (attnext/_env.py reads them once, at import)."""

    def setenv(self, name, value, prepend=None):
        super().setenv(name, value, prepend)
        if name.startswith("ATTNEXT_"):
            _env.reload()

    def delenv(self, name, raising=True):
        super().delenv(name, raising)
        if name.startswith("ATTNEXT_"):
            _env.reload()

    def undo(self):
        super().undo()
        _env.reload()


@pytest.fixture
def monkeypatch():
    """pytest's monkeypatch fixture, as EnvMonkeyPatch: a test sets ATTNEXT_* as it would any
    variable, and attnext sees the change at its next call."""
    mp = EnvMonkeyPatch()
    yield mp
    mp.undo()


def dtype_id(dt):
    return DTYPE_IDS[np.dtype(dt)]


# --- random data ---

# ATTNEXT_TEST_SEED: mixed into every seed where not 0, so the suite runs on other data (a test
# that passes on its own data alone is fragile: tests/README.md)
TEST_SEED = int(os.environ.get("ATTNEXT_TEST_SEED") or 0)


def seed_of(nodeid):
    """A test's seed: its node id with its file named as tests/<file> whatever its folder, so a
    file moved between tests/'s folders keeps its data (the ids of the flat tests/ it grew in);
    ATTNEXT_TEST_SEED, where not 0, before it."""
    path, _, test = nodeid.partition("::")
    salt = f"{TEST_SEED}:" if TEST_SEED else ""
    return zlib.crc32(f"{salt}tests/{os.path.basename(path)}::{test}".encode())


@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id (seed_of): fresh data per test, identical on a
    rerun."""
    return np.random.default_rng(seed_of(request.node.nodeid))


def _why_no_gpu():
    """Why CUDA does not load here (the driver's message), or "" where it does."""
    try:
        _C.cuda_load()
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.fixture
def gpu():
    """The ordinal of a usable GPU (0), or the test is skipped with why CUDA is unavailable."""
    why = _why_no_gpu()
    if why:
        pytest.skip(why)
    return 0


def pytest_runtest_setup(item):
    """`-m gpu` on a machine without a usable GPU skips the gpu-marked tests, saying why, rather
    than failing each one on its first CUDA call."""
    if item.get_closest_marker("gpu") is not None and (why := _why_no_gpu()):
        pytest.skip(f"no usable GPU: {why}")


@pytest.fixture(scope="module")
def cc():
    """A C compiler (CC, else cc or gcc) for the tests that build the generated code on the host,
    or the test is skipped."""
    exe = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if exe is None:
        pytest.skip("no C compiler")
    return exe


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    """The fake driver (tests/helpers/fake_libcuda.c) built as {"full": path, "old": path}, the
    second lacking cuMemAllocAsync; or the test is skipped without a C compiler."""
    from helpers import fake_cuda
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler for the fake libcuda")
    d = tmp_path_factory.mktemp("fake_libcuda")
    return {name: fake_cuda.build(d, name, flags)
            for name, flags in (("full", []), ("old", ["-DNO_ALLOC_ASYNC"]))}


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    """The fake driver's path (helpers.driver.run_on_fake runs code on it), or the test is
    skipped without a C compiler."""
    from helpers import fake_cuda
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler for the fake libcuda")
    return fake_cuda.build(tmp_path_factory.mktemp("fake_libcuda"))


@pytest.fixture(scope="module")
def torch():
    """PyTorch with a CUDA device (the GPU tests' way to hand attnext CUDA arrays), or the test is
    skipped. A test file may define its own."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    return torch


def randn(rng, shape, dtype=F64):
    """Fresh standard normal data (never zeros) rounded to `dtype`."""
    return rng.standard_normal(shape).astype(dtype)


def make_qkv(rng, b, sq, sk, hq, hk, d, dv=None, dtype=F32, layout="bshd"):
    """q, k, v in `layout` ("bshd" or "bhsd") and `dtype`."""
    dv = d if dv is None else dv

    def shape(s, h, n):
        return (b, s, h, n) if layout == "bshd" else (b, h, s, n)

    return (randn(rng, shape(sq, hq, d), dtype), randn(rng, shape(sk, hk, d), dtype),
            randn(rng, shape(sk, hk, dv), dtype))


def make_varlen_qkv(rng, tq, tk, hq, hk, d, dv=None, dtype=F32):
    """Packed q (Tq, Hq, D), k (Tk, Hk, D), v (Tk, Hk, Dv)."""
    dv = d if dv is None else dv
    return (randn(rng, (tq, hq, d), dtype), randn(rng, (tk, hk, d), dtype),
            randn(rng, (tk, hk, dv), dtype))


def skip_unless_device_has(*dtypes):
    """Skips a test of the CPU suite rerun on the GPU when the GPU has no kernel for a dtype."""
    if TEST_DEVICE == "cuda" and any(np.dtype(d) not in GPU_DTYPES for d in dtypes):
        pytest.skip(f"cuda: no kernels for {[str(np.dtype(d)) for d in dtypes]}")



def in_threads(work, n, join_seconds):
    """work(i) in n threads started together (a barrier); their results, after asserting none
    raised and all finished within join_seconds (else: a deadlock)."""
    errors, results = [], [None] * n
    barrier = threading.Barrier(n)

    def target(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as e:                     # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {join_seconds} s: deadlock?"
    assert not errors, errors
    return results

_new_output = attnext.api._new_output


def poisoned(shape, dtype, pinned=False):
    """An output buffer full of NaN: an element the kernel forgets to write fails the check
    (a GPU call's in the pinned memory it would have had)."""
    out = _new_output(shape, dtype, pinned)
    out[...] = np.nan
    return out


@pytest.fixture(autouse=True)
def poison_results(monkeypatch):
    """Every result buffer attnext allocates (out, lse, dq, dk, dv) starts as NaN, so an element a
    backend forgets to write fails the test instead of passing on recycled zeros."""
    monkeypatch.setattr(attnext.api, "_new_output", poisoned)


# --- the accuracy check ---

def assert_close(name, actual, expected, dtype=None, floor=0.0, extra=None, cond=1.0):
    """attnext.testing.assert_close, the public three-way rule, with the name first (dtype
    defaults to actual's)."""
    attnext.testing.assert_close(actual, expected, dtype=dtype, name=name, floor=floor,
                                 extra=extra, cond=cond)


def assert_lse_close(lse, expected, q_dtype, cond=1.0, precision=None):
    assert lse.dtype == acc_dtype(q_dtype), f"lse dtype {lse.dtype} for {q_dtype} inputs"
    rule = lse.dtype if precision is None else accuracy.product_dtype(q_dtype, precision)
    assert_close("lse", lse, expected, rule, cond=cond)


# --- running the CPU backend next to the reference ---

def dead_rows(ref_lse, varlen, layout):
    """Where the reference's lse is -inf (a row that keeps no key), as a mask over out's and dq's
    leading dims: (Tq, Hq) varlen, (B, Sq, Hq) "bshd", (B, Hq, Sq) "bhsd"."""
    dead = np.isneginf(ref_lse)
    if varlen:
        return dead.T
    return dead if layout == "bhsd" else dead.transpose(0, 2, 1)



def entry_points(varlen):
    """(forward, backward, reference forward, reference backward): attention's (varlen None) or
    varlen_attention's."""
    if varlen is None:
        return (attnext.attention, attnext.attention_backward, reference.attention,
                reference.attention_backward)
    return (attnext.varlen_attention, attnext.varlen_attention_backward, reference.varlen_attention,
            reference.varlen_attention_backward)

def check_backend(q, k, v, rng, *, varlen=None, backward=True, out=None, dout=None, cond=1.0,
              dlse=None, **opts):
    """Runs the TEST_DEVICE backend's forward (and backward) and the reference on the same inputs; checks
    out, lse, dq, dk, dv and dbias (shapes, dtypes, values). Returns what it computed.

    varlen: None for attention(), else the dict of varlen_attention's length arguments
    (cu_seqlens_q, cu_seqlens_k and optionally max_seqlen_*, seqused_*). opts are the shared
    keyword options (causal, window, bias, mask, layout, ...). cond multiplies the relative
    float32 / float64 allowance, for problems whose scores are large enough that their own
    round-off (eps * |score|) exceeds it. dlse: a function of the forward's lse giving the
    backward's lse gradient (both backends get it), or None.
    """
    fwd, bwd, rfwd, rbwd = entry_points(varlen)
    lengths = dict(varlen or {})
    dtype = np.dtype(q.dtype)
    skip_unless_device_has(dtype)
    if TEST_PRECISION is not None and dtype == F32 and "precision" not in opts:
        opts = dict(opts, precision=TEST_PRECISION)
    precision = opts.get("precision")
    res_out, lse = fwd(q, k, v, **lengths, device=TEST_DEVICE, return_lse=True, out=out, **opts)
    r_out, r_lse = rfwd(q, k, v, **lengths, return_lse=True, **opts)
    if out is not None:
        assert res_out is out
    assert res_out.dtype == dtype and res_out.shape == r_out.shape
    tf32 = (lambda: accuracy.tf32_out_allowance(q, k, v, varlen, opts)) if precision == "tf32" else None
    assert_close("out", res_out, r_out, accuracy.product_dtype(dtype, precision), extra=tf32,
                 cond=cond)
    assert_lse_close(lse, r_lse, dtype, cond, precision)
    dead = dead_rows(r_lse, varlen is not None, opts.get("layout", "bshd"))
    assert (res_out[dead] == 0).all(), "out: a row that keeps no key is not exactly 0"
    result = types.SimpleNamespace(out=res_out, lse=lse, ref_out=r_out, ref_lse=r_lse,
                                   grads=None, ref_grads=None, dout=None,
                                   inputs=(q, k, v, varlen, opts))
    if not backward:
        return result
    if dout is None:
        dout = randn(rng, res_out.shape, dtype)
    more = {} if dlse is None else {"dlse": dlse(lse)}
    g = bwd(dout, q, k, v, res_out, lse, **lengths, device=TEST_DEVICE, **opts, **more)
    rg = rbwd(dout, q, k, v, res_out, lse, **lengths, **opts, **more)
    problems = compare_grads(g, rg, q, k, v, dout, res_out, r_out, varlen, opts, cond)
    assert not problems, "\n".join(problems)
    assert (g.dq[dead] == 0).all(), "dq: a row that keeps no key is not exactly 0"
    result.grads, result.ref_grads, result.dout = g, rg, dout
    return result


def check_dtensors(res, score_mod, dtype):
    """The dtensors of check_backend's (or helpers.gpu.run_gpu's) backward, its result res,
    against the reference's: accuracy.compare_dtensors (every float array the traced score_mod
    reads, in its dtype; arrays the reference names beyond those have zero gradient) with
    accuracy.dtensors_allowance where its limit is exceeded, the rule of the fuzzer and
    attnext.testing: a backward forms delta = dout . out from out at q's dtype, which moves an
    array's gradient by a sum that may not shrink with it (a scalar read by every pair, whose
    gradient cancels)."""
    q, k, v, varlen, opts = res.inputs
    opts = dict(opts, score_mod=score_mod)
    extra = accuracy.dtensors_allowance(q, k, v, res.dout, res.out, res.ref_out, varlen, opts)
    problems = compare_dtensors(res.grads, res.ref_grads, score_mod, dtype, extra=extra,
                                precision=opts.get("precision"))
    assert not problems, "\n".join(problems)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """On the GPU rerun, a test of the CPU suite that feeds float64 to the GPU (which has no
    kernels for it: attnext raises TypeError saying so) is reported as skipped."""
    outcome = yield
    if TEST_DEVICE != "cuda" or outcome.excinfo is None:
        return
    exc = outcome.excinfo[1]
    if isinstance(exc, TypeError) and "(float64 stays on the CPU)" in str(exc):
        outcome.force_exception(pytest.skip.Exception(f"cuda: {exc}", _use_item_location=True))
