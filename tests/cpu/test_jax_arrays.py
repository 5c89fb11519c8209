"""JAX arrays in, JAX arrays out ([3/7] point 6), as torch and CuPy already are.

- A JAX array on the CPU is a host array (attnext/interop.py): read as NumPy's view of its
  buffer, no copy (read-only: out= a JAX array is refused, JAX arrays being immutable); results,
  gradients and a captured JAX array's dtensors come back as JAX arrays (jax.numpy.from_dlpack,
  jax.numpy.asarray for bfloat16). On the CPU backend, the reference and (staged, on the fake
  driver) the GPU.
- A JAX array on a GPU is a CUDA array, read in place; results come back through
  jax.numpy.from_dlpack (`-m gpu`, with a CUDA jax on the device).
"""
import numpy as np
import pytest

import attnext
from attnext import checks, interop
from attnext.cuda import arrays as device
from conftest import BF16, F32, assert_close, assert_lse_close, make_qkv, make_varlen_qkv, randn
from helpers.driver import run_on_fake as _run
from helpers.fake_arrays import NUMPY_CALLS as HELPERS

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

DEVICES = ["cpu", "reference"]


def _on_cpu(*xs):
    cpu = jax.devices("cpu")[0]
    return tuple(None if x is None else jax.device_put(jnp.asarray(x), cpu) for x in xs)


def _is_jax(x):
    return isinstance(x, jax.Array)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_jax_cpu_arrays_in_and_out(device, dtype, rng):
    q, k, v = make_qkv(rng, 2, 19, 33, 4, 2, 16, 16, dtype)
    bias = randn(rng, (1, 4, 19, 33), F32)
    jq, jk, jv, jb = _on_cpu(q, k, v, bias)
    out, lse = attnext.attention(jq, jk, jv, bias=jb, causal=True, return_lse=True, device=device)
    want, want_lse = attnext.attention(q, k, v, bias=bias, causal=True, return_lse=True, device=device)
    assert _is_jax(out) and _is_jax(lse) and out.dtype == want.dtype and out.shape == want.shape
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
    dout = randn(rng, want.shape, dtype)
    g = attnext.attention_backward(_on_cpu(dout)[0], jq, jk, jv, out, lse, bias=jb, causal=True,
                                   device=device)
    w = attnext.attention_backward(dout, q, k, v, want, want_lse, bias=bias, causal=True, device=device)
    for got, ref in zip(g[:4], w[:4]):
        assert _is_jax(got) and got.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(got), ref)


def test_jax_cpu_varlen_against_the_reference(rng):
    cu = np.array([0, 7, 7, 30], np.int32)
    q, k, v = make_varlen_qkv(rng, 30, 30, 2, 1, 16, 8, F32)
    jq, jk, jv, jcu = _on_cpu(q, k, v, cu)
    out, lse = attnext.varlen_attention(jq, jk, jv, jcu, jcu, causal=True, return_lse=True, device="cpu")
    r_out, r_lse = attnext.reference.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    assert _is_jax(out) and _is_jax(lse)
    assert_close("out", np.asarray(out), r_out, F32)
    assert_lse_close(np.asarray(lse), r_lse, F32)


def test_jax_cpu_arrays_are_read_in_place_and_never_written():
    x = _on_cpu(np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4))[0]
    view = checks.float_array("q", x)
    assert view.ctypes.data == x.unsafe_buffer_pointer() and not view.flags.writeable
    q = _on_cpu(np.ones((1, 8, 2, 16), np.float32))[0]
    with pytest.raises(ValueError, match=r"^out is read-only \(NumPy's view of this jaxlib \w+ is; "
                                         r"JAX arrays are immutable\)"):
        attnext.attention(q, q, q, out=jnp.zeros((1, 8, 2, 16)), device="cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_captured_jax_cpu_array(device, rng):
    q, k, v = make_qkv(rng, 1, 24, 24, 2, 2, 16, 16, F32)
    host = (0.2 * rng.standard_normal((2, 47))).astype(np.float32)
    table = _on_cpu(host)[0]

    def on_jax(s, b, h, qi, ki):
        return s + table[h, qi - ki + 23]

    def on_numpy(s, b, h, qi, ki):
        return s + host[h, qi - ki + 23]
    out, lse = attnext.attention(q, k, v, score_mod=on_jax, return_lse=True, device=device)
    want = attnext.attention(q, k, v, score_mod=on_numpy, device=device)
    np.testing.assert_array_equal(out, want)
    dout = np.ones_like(out)
    g = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=on_jax, device=device)
    w = attnext.attention_backward(dout, q, k, v, out, lse, score_mod=on_numpy, device=device)
    d = np.asarray(g.dtensors["table"])
    assert _is_jax(g.dtensors["table"])
    # the reference's float64 gradient is float32 in JAX unless jax_enable_x64 is set
    np.testing.assert_array_equal(d, w.dtensors["host"].astype(d.dtype))


def test_results_go_back_through_jax_numpy():
    x = jnp.ones(3)
    assert interop.library(x) == "jaxlib" and interop.from_dlpack(x) is jnp.from_dlpack
    bf = np.ones(3, BF16)           # NumPy cannot export bfloat16 through DLPack: jnp.asarray
    back = interop.to_library(bf, x)
    assert _is_jax(back) and back.dtype == jnp.bfloat16


ON_THE_FAKE_GPU = r"""
import jax, jax.numpy as jnp
jq = jax.device_put(jnp.asarray(hq), jax.devices("cpu")[0])
tab = jnp.asarray(rng.standard_normal((2, 2 * S + 1)).astype(np.float32))


def relbias(s, b, h, qi, ki):
    return s + tab[h, qi - ki + S]


n = len(NAMES)
out, lse = attnext.attention(jq, jq, jq, score_mod=relbias, return_lse=True)
assert mods_kernels(NAMES[n:], "attn_fwd"), NAMES[n:]
assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16 and isinstance(lse, jax.Array)
STATE["grad"] = (1, 0.25)
g = attnext.attention_backward(out, jq, jq, jq, out, lse, score_mod=relbias)
STATE["grad"] = None
assert all(isinstance(x, jax.Array) for x in g[:3]) and isinstance(g.dtensors["tab"], jax.Array)
assert float(g.dtensors["tab"].reshape(-1)[1]) == 0.25
assert CPU == [], CPU
print("ok")
"""


def test_jax_cpu_arrays_on_the_fake_gpu(fake_driver):  # noqa: F811
    _run(fake_driver, HELPERS + ON_THE_FAKE_GPU)


# --- JAX on a GPU ---------------------------------------------------------------------------------

@pytest.fixture
def jax_gpu(gpu):
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"no CUDA device for jax: {e}")


@pytest.mark.gpu
def test_jax_cuda_arrays_in_and_out(rng, jax_gpu):
    q, k, v = make_qkv(rng, 2, 130, 200, 4, 2, 64, 64, BF16)
    jq, jk, jv = (jax.device_put(jnp.asarray(x), jax_gpu) for x in (q, k, v))
    out, lse = attnext.attention(jq, jk, jv, causal=True, return_lse=True)
    assert _is_jax(out) and out.devices() == {jax_gpu} and out.dtype == jnp.bfloat16
    r_out, r_lse = attnext.reference.attention(q, k, v, causal=True, return_lse=True)
    assert_close("out", np.asarray(out), r_out, BF16)
    assert_lse_close(np.asarray(lse), r_lse, BF16)
    dout = randn(rng, r_out.shape, BF16)
    g = attnext.attention_backward(jax.device_put(jnp.asarray(dout), jax_gpu), jq, jk, jv, out, lse,
                                   causal=True)
    assert all(_is_jax(x) and x.devices() == {jax_gpu} for x in g[:3])
    attnext.testing.assert_grads_close(g, attnext.reference.attention_backward(
        dout, q, k, v, np.asarray(out), np.asarray(lse), causal=True), q=q, k=k, v=v, dout=dout,
        out=np.asarray(out), causal=True)


@pytest.mark.gpu
def test_jax_cuda_arrays_with_a_captured_jax_table(rng, jax_gpu):
    n = 150
    q, k, v = make_qkv(rng, 1, n, n, 4, 2, 64, 64, BF16)
    host = (0.1 * rng.standard_normal((4, 2 * n - 1))).astype(np.float32)
    jq, jk, jv, table = (jax.device_put(jnp.asarray(x), jax_gpu) for x in (q, k, v, host))

    def on_jax(s, b, h, qi, ki):
        return s + table[h, qi - ki + n - 1]

    def on_numpy(s, b, h, qi, ki):
        return s + host[h, qi - ki + n - 1]
    out, lse = attnext.attention(jq, jk, jv, score_mod=on_jax, causal=True, return_lse=True)
    assert _is_jax(out)
    assert_close("out", np.asarray(out), attnext.reference.attention(q, k, v, score_mod=on_numpy,
                                                                     causal=True), BF16)
    dout = randn(rng, q.shape, BF16)
    g = attnext.attention_backward(jax.device_put(jnp.asarray(dout), jax_gpu), jq, jk, jv, out, lse,
                                   score_mod=on_jax, causal=True)
    d = g.dtensors["table"]
    assert _is_jax(d) and d.devices() == {jax_gpu} and d.dtype == jnp.float32
    # the same bits as the table captured as a NumPy array beside the same JAX inputs
    w = attnext.attention_backward(jax.device_put(jnp.asarray(dout), jax_gpu), jq, jk, jv, out, lse,
                                   score_mod=on_numpy, causal=True)
    np.testing.assert_array_equal(np.asarray(d), w.dtensors["host"])
    rg = attnext.reference.attention_backward(dout, q, k, v, np.asarray(out), np.asarray(lse),
                                              score_mod=on_numpy, causal=True)
    attnext.testing.assert_grads_close(
        type(g)(*(np.asarray(x) for x in g[:3]), None, {"host": np.asarray(d)}), rg, q=q, k=k, v=v,
        dout=dout, out=np.asarray(out), score_mod=on_numpy, causal=True)


@pytest.mark.gpu
def test_device_array_results_become_jax_arrays(jax_gpu):
    """attnext.cuda.arrays.to_caller hands a DeviceArray to jax.numpy.from_dlpack: a JAX array
    on the same GPU with the same values."""
    like = jax.device_put(jnp.zeros(1), jax_gpu)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = device.empty(x.shape, x.dtype, 0, 0)
    from attnext import _C
    _C.memcpy_htod(d.ptr, x.reshape(-1).view(np.uint8), 0, 0)
    back = device.to_caller(d, like)
    assert _is_jax(back) and back.devices() == {jax_gpu}
    np.testing.assert_array_equal(np.asarray(back), x)
