"""score_mod / mask_mod with NumPy q, k, v on the GPU ([3/7] point 2): a call that runs on the
GPU (device="cuda", or device=None choosing it) runs the generated CUDA kernels for its
callbacks, with q, k, v, the captured arrays and the results staged through host memory; the
CPU interpreter runs only where the CPU backend is chosen.

On the fake driver (tests/fake_libcuda.c, no GPU; the stand-ins of test_mod_arrays.py play the
kernels that convert and sum): the attention kernels launch with the callbacks' attn_mods_gpu
bytes and the CPU backend is never called, forward and backward, device None and "cuda"; a
mask_mod's block mask is built on the device; a band and documents are lowered to the plain
kernels' window and varlen; a lookup out of range raises IndexError from the device's error
record; dtensors come back as NumPy arrays; a captured CUDA array on the call's device is read
in place (refused on the CPU and the reference, and on another device); out= is checked against
the captured arrays; float64 stays on the CPU, as without callbacks.

`-m gpu`: the zoo of tests/helpers/mods.py and the combinations of tests/cpu/test_score_mod.py on NumPy float16
/ bfloat16 inputs against the reference (check_backend on the GPU), block masks, documents and
bands at lengths past a tile, varlen, lookups out of range, and a captured torch CUDA table.
"""
import numpy as np
import pytest

import attnext
import conftest
from conftest import BF16, F16, check_backend, check_dtensors, make_qkv, make_varlen_qkv, randn
from helpers import mods
from helpers.driver import run_on_fake as _run
from helpers.fake_arrays import NUMPY_CALLS as HELPERS

CALLBACKS = r"""
tab = rng.standard_normal((2, 2 * S + 1)).astype(np.float32)
repeat = np.repeat(np.arange(4) % 2, S // 4)          # ids that repeat: stays a mask_mod


def relbias(s, b, h, qi, ki):
    return s + tab[h, qi - ki + S]


def same_doc(b, h, qi, ki):
    return repeat[qi] == repeat[ki]


for device in (None, "cuda"):
    (out, lse), names = launched(lambda: attnext.attention(hq, hk, hv, score_mod=relbias, mask_mod=same_doc,
                                                           device=device, return_lse=True))
    assert isinstance(out, np.ndarray) and out.dtype == BF16 and out.shape == hq.shape, out
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.shape == (1, 2, S), lse
    assert mods_kernels(names, "attn_fwd"), names
    # the block mask is built on the device by the first call, and kept for the next (mod_cache)
    assert mods_kernels(names, "attn_block_mask") == (["attn_block_mask"] if device is None else []), names
    STATE["grad"] = (5, 1.5)
    g, names = launched(lambda: attnext.attention_backward(out, hq, hk, hv, out, lse, score_mod=relbias,
                                                           mask_mod=same_doc, device=device))
    STATE["grad"] = None
    assert mods_kernels(names, "attn_bwd"), names
    assert all(isinstance(x, np.ndarray) and x.dtype == BF16 for x in g[:3]) and g.dbias is None
    d = g.dtensors["tab"]
    assert list(g.dtensors) == ["tab"] and isinstance(d, np.ndarray) and d.dtype == np.float32, g.dtensors
    want = np.zeros(tab.shape, np.float32)
    want.flat[5] = 1.5
    np.testing.assert_array_equal(d, want)
assert CPU == [], CPU
# a lookup the bounds cannot prove: its IndexError comes from the device's error record
w = rng.standard_normal(S).astype(np.float32)
STATE["error"] = [1, 0, 0, S, S]
try:
    attnext.attention(hq, hk, hv, score_mod=lambda s, b, h, qi, ki: s + w[qi + 1])
    raise SystemExit("no IndexError")
except IndexError as e:
    assert str(e) == f"score_mod: index {S} is out of bounds for axis 0 of array 'w' with size {S}", e
STATE["error"] = None
assert CPU == [], CPU
print("ok")
"""


def test_numpy_callbacks_launch_the_generated_kernels(fake_driver):  # noqa: F811
    _run(fake_driver, HELPERS + CALLBACKS)


LOWERED = r"""
def params(call):
    _, names = launched(call)
    p = fake_cuda.last_launch(lib).params
    return names, p


# a causal sliding window written as a mask_mod: the plain kernels' window, no mods
names, p = params(lambda: attnext.attention(hq, hk, hv, mask_mod=lambda b, h, qi, ki: (ki <= qi) & (qi - ki < 64)))
assert names and not any(m for _, m in names), names
assert (p.causal, p.window_left) == (1, 63), (p.causal, p.window_left)
# documents over contiguous runs: varlen over the runs, no mods
doc = np.repeat(np.arange(4), S // 4)
names, p = params(lambda: attnext.attention(hq, hk, hv, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki]))
assert names and not any(m for _, m in names) and p.cu_seqlens_q and p.B == 4, (names, p.B)
assert CPU == [], CPU
print("ok")
"""


def test_numpy_mask_mods_are_lowered_on_the_gpu(fake_driver):  # noqa: F811
    _run(fake_driver, HELPERS + LOWERED)


CUDA_CAPTURED = r"""
base = fake_memory(rng.standard_normal((2, 2 * S + 1)).astype(np.float32))
table = CudaArray(base)


def on_device(s, b, h, qi, ki):
    return s + table[h, qi - ki + S]


# read in place: its address in attn_mods_gpu, nothing copied from it
n = len(GMODS)
out, lse = attnext.attention(hq, hk, hv, score_mod=on_device, device="cuda", return_lse=True)
assert all(int(r["a"][0]["ptr"]) == base.ctypes.data for _, r in GMODS[n:]) and len(GMODS) > n
STATE["grad"] = (7, 2.0)
g = attnext.attention_backward(out, hq, hk, hv, out, lse, score_mod=on_device)
STATE["grad"] = None
d = g.dtensors["table"]
assert isinstance(d, device.DeviceArray) and d.shape == base.shape and d.dtype == np.float32, d
assert d.numpy().flat[7] == 2.0 and np.count_nonzero(d.numpy()) == 1
# out= a NumPy array: nothing to compare with device memory; one that overlaps a captured host
# array is a ValueError naming it
target = np.empty(hq.shape, BF16)
assert attnext.attention(hq, hk, hv, score_mod=on_device, out=target) is target
shared = target.reshape(-1)[:S]
try:
    attnext.attention(hq, hk, hv, score_mod=lambda s, b, h, qi, ki: s + shared[qi], out=target)
    raise SystemExit("no ValueError")
except ValueError as e:
    assert str(e) == "out shares memory with the array 'shared' that score_mod captures", e
# the CPU backend and the reference cannot read it
for where in ("cpu", "reference"):
    try:
        attnext.attention(hq, hk, hv, score_mod=on_device, device=where)
        raise SystemExit("no TypeError")
    except TypeError as e:
        assert str(e).startswith(f"score_mod captures 'table', a CUDA array (CudaArray), but the call "
                                 f"runs on device={where!r}"), e
# another device than the call's (cuda:0 for host q, k, v)
count, pointer_device = device._count[:], _C.pointer_device
device._count[:] = [2]
_C.pointer_device = lambda ptr: 1 if ptr == base.ctypes.data else 0
try:
    attnext.attention(hq, hk, hv, score_mod=on_device)
    raise SystemExit("no ValueError")
except ValueError as e:
    assert str(e) == ("score_mod: captured array 'table' lives on cuda:1, but the call runs on cuda:0; "
                      "move it to cuda:0"), e
device._count[:], _C.pointer_device = count, pointer_device
# float64 has no GPU kernels: device=None keeps it on the CPU, callbacks or not
f64 = hq.astype(np.float64)
local = rng.standard_normal((2, 2 * S + 1))
attnext.attention(f64, f64, f64, score_mod=lambda s, b, h, qi, ki: s + local[h, qi - ki + S])
assert CPU == ["forward"], CPU
print("ok")
"""


def test_captured_cuda_array_with_numpy_inputs(fake_driver):  # noqa: F811
    _run(fake_driver, HELPERS + CUDA_CAPTURED)


# --- on a GPU ------------------------------------------------------------------------------------

DTYPES = [F16, BF16]
S, H = mods.S_MAX, mods.H_MAX


@pytest.fixture
def on_gpu(gpu, monkeypatch):
    """check_backend's calls run with device=<the parameter> (conftest.TEST_DEVICE)."""
    def set_device(device):
        monkeypatch.setattr(conftest, "TEST_DEVICE", device)
    return set_device


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", None], ids=["cuda", "default"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("name", sorted(mods.score_mods()))
def test_numpy_score_mod_zoo_on_gpu(name, dtype, device, rng, on_gpu):
    on_gpu(device)
    score_mod = mods.score_mods()[name]
    q, k, v = make_qkv(rng, 2, 13, S, H, 2, 64, 64, dtype)
    before = attnext.cache_info()["cpu"]["misses"] + attnext.cache_info()["cpu"]["hits"]
    res = check_backend(q, k, v, rng, score_mod=score_mod)
    check_dtensors(res, score_mod, dtype)
    assert all(isinstance(x, np.ndarray) for x in res.grads.dtensors.values())
    after = attnext.cache_info()["cpu"]["misses"] + attnext.cache_info()["cpu"]["hits"]
    assert after == before, "the CPU interpreter ran"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("name", sorted(mods.mask_mods()))
def test_numpy_mask_mod_zoo_on_gpu(name, dtype, rng, on_gpu):
    on_gpu("cuda")
    q, k, v = make_qkv(rng, 2, S, 11, H, 1, 64, 64, dtype)
    check_backend(q, k, v, rng, mask_mod=mods.mask_mods()[name])


@pytest.mark.gpu
@pytest.mark.parametrize("combo", ["causal_rel_bias", "window_alibi_doc", "softcap_bias_trig",
                                   "builtin_alibi_softcap_mod", "mask_and_mask_mod", "bhsd_top_left",
                                   "scale_head_dep"])
def test_numpy_callbacks_with_builtin_options_on_gpu(combo, rng, on_gpu):
    on_gpu("cuda")
    spec = dict(mods.COMBOS[combo])
    score_mod = mods.score_mods()[spec.pop("score")]
    mask_mod = mods.mask_mods()[spec.pop("mask_mod")] if "mask_mod" in spec else None
    layout = spec.pop("layout", "bshd")
    q, k, v = make_qkv(rng, 2, 15, S, H, 2, 64, 64, BF16, layout)
    opts = dict(score_mod=score_mod, mask_mod=mask_mod, layout=layout)
    if spec.pop("bias", False):
        opts["bias"] = randn(rng, (2, 1, 15, S), np.float32)
    if spec.pop("bool_mask", False):
        opts["mask"] = rng.random((15, S)) < 0.8
    if spec.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.1, 0.5, H).astype(np.float32)
    opts.update(spec)
    res = check_backend(q, k, v, rng, **opts)
    check_dtensors(res, score_mod, BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["block_mask", "documents", "band", "rel_table"])
def test_numpy_callbacks_past_a_tile_on_gpu(kind, rng, on_gpu):
    """Lengths past the 64-row cells: a mask_mod's block mask (ids that repeat), documents over
    contiguous runs (lowered to varlen), a sliding window (lowered to the window), and a
    relative-bias table with its gradient."""
    on_gpu(None)
    n = 300
    q, k, v = make_qkv(rng, 1, n, n, 4, 2, 128, 128, BF16)
    ids = np.repeat(np.arange(5) % 3, 60)
    runs = np.repeat(np.arange(4), [70, 90, 100, 40])
    table = (0.1 * rng.standard_normal((4, 2 * n - 1))).astype(np.float32)
    opts = {"block_mask": dict(mask_mod=lambda b, h, qi, ki: (ids[qi] == ids[ki]) | (ki == 0)),
            "documents": dict(mask_mod=lambda b, h, qi, ki: (runs[qi] == runs[ki]) & (ki <= qi)),
            "band": dict(mask_mod=lambda b, h, qi, ki: (ki <= qi) & (qi - ki < 100)),
            "rel_table": dict(score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki + n - 1],
                              causal=True)}[kind]
    res = check_backend(q, k, v, rng, **opts)
    if "score_mod" in opts:
        check_dtensors(res, opts["score_mod"], BF16)


@pytest.mark.gpu
def test_numpy_varlen_callbacks_on_gpu(rng, on_gpu):
    on_gpu("cuda")
    cu_q = np.array([0, 5, 5, 16, 30], np.int32)
    cu_k = np.array([0, 7, 16, 20, 33], np.int32)
    q, k, v = make_varlen_qkv(rng, 30, 33, H, 2, 64, 64, F16)
    score_mod = mods.score_mods()["softcap_alibi_rel"]
    res = check_backend(q, k, v, rng, varlen=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
                        score_mod=score_mod, mask_mod=mods.mask_mods()["prefix_lm"])
    check_dtensors(res, score_mod, F16)


@pytest.mark.gpu
def test_numpy_lookup_out_of_range_on_gpu(rng, gpu):
    """The GPU's IndexError for a NumPy call is the CPU's (an evaluated pair out of range)."""
    q, k, v = make_qkv(rng, 1, 40, 40, 2, 2, 64, 64, BF16)
    short = rng.standard_normal(30).astype(np.float32)

    def reads_past(s, b, h, qi, ki):
        return s + short[qi]
    errors = []
    for device in ("cuda", "cpu"):
        with pytest.raises(IndexError) as e:
            attnext.attention(q, k, v, score_mod=reads_past, device=device)
        errors.append(str(e.value))
    assert errors[0].startswith("score_mod: index ") and "array 'short' with size 30" in errors[0]
    # a mask that removes the pairs out of range leaves nothing observable
    out = attnext.attention(q, k, v, score_mod=reads_past, mask_mod=lambda b, h, qi, ki: qi < 30,
                            device="cuda")
    assert not np.isnan(out.astype(np.float32)).any()


@pytest.mark.gpu
def test_numpy_inputs_with_a_captured_torch_cuda_table(rng, gpu):
    """A captured CUDA array beside NumPy q, k, v on the GPU: read in place, its gradient a
    torch CUDA tensor; the same answers as a NumPy copy of the table."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    q, k, v = make_qkv(rng, 2, 70, 90, 4, 2, 64, 64, BF16)
    host = (0.1 * rng.standard_normal((4, 160))).astype(np.float32)
    table = torch.from_numpy(host).cuda()

    def on_device(s, b, h, qi, ki):
        return s + table[h, qi - ki + 89]

    def on_host(s, b, h, qi, ki):
        return s + host[h, qi - ki + 89]
    out, lse = attnext.attention(q, k, v, score_mod=on_device, return_lse=True, device="cuda")
    want, want_lse = attnext.attention(q, k, v, score_mod=on_host, return_lse=True, device="cuda")
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    dout = randn(rng, out.shape, BF16)
    g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=on_device)
    w = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=on_host)
    d = g.dtensors["table"]
    assert isinstance(d, torch.Tensor) and d.is_cuda and d.dtype == torch.float32
    np.testing.assert_array_equal(d.cpu().numpy(), w.dtensors["host"])
    np.testing.assert_array_equal(g.dq, w.dq)
    with pytest.raises(TypeError, match="score_mod captures 'table', a CUDA array"):
        attnext.attention(q, k, v, score_mod=on_device, device="cpu")
