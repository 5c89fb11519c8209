"""attnext in a JAX training loop: gradient steps on q, k, v and per-head attention sinks through
attnext.jax.attention under jax.jit (XLA FFI calls; CPU here, a GPU when JAX has one).

Prints the loss of a few steps and checks the first gradient against the float64 reference.
"""
import jax
import jax.numpy as jnp
import numpy as np

import attnext
import attnext.jax as axj

B, S, H, D = 2, 64, 4, 32
key = jax.random.PRNGKey(0)
kq, kk, kv, kt = jax.random.split(key, 4)
params = {"q": jax.random.normal(kq, (B, S, H, D)), "k": jax.random.normal(kk, (B, S, H, D)),
          "v": jax.random.normal(kv, (B, S, H, D)), "sinks": jnp.zeros(H)}
target = jax.random.normal(kt, (B, S, H, D))


def loss_fn(p):
    out = axj.attention(p["q"], p["k"], p["v"], causal=True, sinks=p["sinks"])
    return jnp.mean((out - target) ** 2)


step = jax.jit(jax.value_and_grad(loss_fn))
for i in range(3):
    loss, grads = step(params)
    params = jax.tree_util.tree_map(lambda x, g: x - 0.5 * g, params, grads)
    print(f"step {i}: loss {float(loss):.5f}")

# the sinks' gradient against the float64 reference's, at the final parameters
p = {n: np.asarray(x, np.float64) for n, x in params.items()}
out = attnext.reference.attention(p["q"], p["k"], p["v"], causal=True, sinks=p["sinks"])
dout = 2 * (out - np.asarray(target)) / out.size
ref = attnext.reference.attention_backward(dout, p["q"], p["k"], p["v"], out, None, causal=True, sinks=p["sinks"])
_, grads = step(params)
print("dsinks:", np.asarray(grads["sinks"]), "reference:", ref.dsinks)
