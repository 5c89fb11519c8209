"""attnext.jax: attention and varlen_attention as jax.custom_vjp functions over XLA FFI calls
(csrc/xla/ffi.c). jax.test_util.check_grads in float64 on the CPU (q, k, v, bias, sinks, lse's
gradient; varlen), jit and grad against the reference in float32 and bfloat16, options that are
static, errors raised with attnext's message; on a GPU (-m gpu) against the reference."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import attnext.jax as axj  # noqa: E402
from attnext import reference  # noqa: E402
from conftest import BF16, assert_close, randn  # noqa: E402


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _qkv(rng, b, sq, sk, hq, hk, d, dtype=np.float64):
    return (randn(rng, (b, sq, hq, d), dtype), randn(rng, (b, sk, hk, d), dtype), randn(rng, (b, sk, hk, d), dtype))


CASES = {
    "plain": dict(),
    "causal_gqa": dict(causal=True, hk=1),
    "window_softcap": dict(window=(2, 1), softcap=2.5),
    "bhsd": dict(layout="bhsd", causal="top_left"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_grads(rng, x64, case):
    opts = dict(CASES[case])
    hk = opts.pop("hk", 2)
    q, k, v = _qkv(rng, 2, 5, 6, 2, hk, 4)
    if opts.get("layout") == "bhsd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    check_grads(lambda q, k, v: axj.attention(q, k, v, **opts), (q, k, v), order=1, modes=["rev"],
                eps=1e-4, atol=1e-6, rtol=1e-6)


def test_check_grads_bias_sinks_and_lse(rng, x64):
    q, k, v = _qkv(rng, 1, 4, 6, 2, 2, 3)
    bias = randn(rng, (2, 4, 6))
    sinks = randn(rng, (2,))

    def f(q, k, v, bias, sinks):
        out, lse = axj.attention(q, k, v, bias=bias, sinks=sinks, causal=True, return_lse=True)
        return out, lse             # both get a cotangent: lse's reaches dlse
    check_grads(f, (q, k, v, bias, sinks), order=1, modes=["rev"], eps=1e-4, atol=1e-6, rtol=1e-6)


def test_check_grads_varlen(rng, x64):
    q, k, v = (randn(rng, (11, 2, 3)) for _ in range(3))
    cu = jnp.asarray([0, 4, 11], jnp.int32)
    check_grads(lambda q, k, v: axj.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True),
                (q, k, v), order=1, modes=["rev"], eps=1e-4, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_jit_grad_against_the_reference(rng, dtype):
    q, k, v = _qkv(rng, 2, 19, 23, 4, 2, 16, dtype)
    mask = rng.random((2, 1, 19, 23)) < 0.8
    sinks = randn(rng, (4,), np.float32)
    dout = randn(rng, (2, 19, 4, 16), dtype)

    @jax.jit
    def loss(q, k, v, sinks):
        out = axj.attention(q, k, v, mask=jnp.asarray(mask), sinks=sinks, softcap=3.0)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        *(jnp.asarray(x) for x in (q, k, v, sinks)))
    r_out = reference.attention(q, k, v, mask=mask, sinks=sinks, softcap=3.0)
    assert out.dtype == q.dtype
    assert_close("out", np.asarray(out), r_out, np.dtype(dtype))
    rg = reference.attention_backward(dout, q, k, v, np.asarray(out), None, mask=mask, sinks=sinks, softcap=3.0)
    for name, got, want in zip(("dq", "dk", "dv"), grads, rg[:3]):
        assert got.dtype == q.dtype, name
        assert_close(name, np.asarray(got), want, np.dtype(dtype), floor=1e-2 if dtype == BF16 else 0.0)
    tol = 5e-2 if dtype == BF16 else 1e-4
    np.testing.assert_allclose(np.asarray(grads[3]), rg.dsinks, rtol=tol, atol=tol)


def test_varlen_under_jit_needs_max_seqlen(rng):
    q, k, v = (jnp.asarray(randn(rng, (9, 2, 8), np.float32)) for _ in range(3))
    cu = jnp.asarray([0, 4, 9], jnp.int32)
    with pytest.raises(ValueError, match="needs max_seqlen_q"):
        jax.jit(lambda q, k, v, cu: axj.varlen_attention(q, k, v, cu, cu))(q, k, v, cu)
    out = jax.jit(lambda q, k, v, cu: axj.varlen_attention(q, k, v, cu, cu, max_seqlen_q=5, max_seqlen_k=5))(q, k, v, cu)
    want = reference.varlen_attention(*(np.asarray(x) for x in (q, k, v)), np.asarray(cu), np.asarray(cu))
    assert_close("out", np.asarray(out), want, np.dtype(np.float32))


def test_score_mod_and_vmap(rng):
    table = randn(rng, (4, 40), np.float32)

    def rel(s, b, h, q_idx, kv_idx):
        return s + table[h, q_idx - kv_idx + 20]
    q, k, v = _qkv(rng, 1, 9, 11, 4, 4, 8, np.float32)
    out = axj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), score_mod=rel)
    assert_close("out", np.asarray(out), reference.attention(q, k, v, score_mod=rel), np.dtype(np.float32))
    stacked = jnp.stack([jnp.asarray(q), 2 * jnp.asarray(q)])
    many = jax.vmap(lambda q: axj.attention(q, jnp.asarray(k), jnp.asarray(v), causal=True))(stacked)
    for i in range(2):
        want = reference.attention(np.asarray(stacked[i]), k, v, causal=True)
        assert_close("out", np.asarray(many[i]), want, np.dtype(np.float32))


def test_errors_carry_attnexts_message(rng):
    q, k, v = (jnp.asarray(x) for x in _qkv(rng, 1, 4, 4, 3, 2, 8, np.float32))
    with pytest.raises(Exception, match="multiple of key/value heads"):
        axj.attention(q, k, v)
    q, k, v = (jnp.asarray(x) for x in _qkv(rng, 1, 4, 4, 2, 2, 8, np.float32))
    with pytest.raises(Exception, match=r"sinks must have shape \(2,\)"):
        axj.attention(q, k, v, sinks=jnp.zeros(3))


@pytest.mark.gpu
def test_cuda_jit_grad_against_the_reference(rng):
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("no GPU for jax")
    q, k, v = _qkv(rng, 2, 300, 300, 4, 2, 64, BF16)
    sinks = randn(rng, (4,), np.float32)
    dout = randn(rng, (2, 300, 4, 64), BF16)
    gpu = jax.devices("gpu")[0]
    args = [jax.device_put(jnp.asarray(x), gpu) for x in (q, k, v, sinks)]

    @jax.jit
    def loss(q, k, v, sinks):
        out = axj.attention(q, k, v, causal=True, sinks=sinks)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    assert_close("out", np.asarray(out), reference.attention(q, k, v, causal=True, sinks=sinks), np.dtype(BF16))
    rg = reference.attention_backward(dout, q, k, v, np.asarray(out), None, causal=True, sinks=sinks)
    for name, got, want in zip(("dq", "dk", "dv"), grads, rg[:3]):
        assert_close(name, np.asarray(got), want, np.dtype(BF16), floor=1e-2)
    np.testing.assert_allclose(np.asarray(grads[3]), rg.dsinks, rtol=5e-2, atol=5e-2)
