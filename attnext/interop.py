"""Other libraries' arrays: which library an array comes from, NumPy's view of one that lives on
the host, and results handed back in the caller's library. attnext never imports those
libraries: it looks a library up in sys.modules, where the caller's own import put it.

Host arrays. A torch CPU tensor, a JAX array on the CPU, or any object whose `__dlpack_device__`
says kDLCPU is read as NumPy's view of its memory, with no copy (its `__array__` where it has one,
which knows JAX's bfloat16 as ml_dtypes.bfloat16, else `np.from_dlpack`): as q, k, v and every
other argument, as out= where the view is writable (a JAX array's is not: JAX arrays are
immutable), and as an array a score_mod / mask_mod captures, on every backend (on the GPU it is
uploaded as a NumPy array is). Results computed for one come back in its library (to_library:
the library's `from_dlpack` over the NumPy result, its `asarray` where NumPy cannot export the
dtype through DLPack, bfloat16). A torch bfloat16 CPU tensor is refused (TypeError saying how to
pass it: NumPy has no bfloat16), as is a tensor that requires grad (pass `.detach()`).

CUDA arrays are attnext.cuda.arrays' (`as_device_view`, `to_caller`); to_caller takes results
into a library through from_dlpack() here, so both directions know one table of where each
library keeps its `from_dlpack` (JAX: `jax.numpy`, not the `jaxlib` module its arrays' type
comes from).
"""
import sys

import numpy as np

KDL_CPU = 1         # DLPack's device type of host memory

# the module whose from_dlpack / asarray take arrays into a library, by the top-level module of
# its arrays' type, where that is not the library's own
_MODULES = {"jaxlib": "jax.numpy", "jax": "jax.numpy"}


def library(x):
    """The top-level module x's type comes from: "numpy", "torch", "cupy", "jaxlib", ..."""
    return (type(x).__module__ or "").partition(".")[0]


def _module(like):
    top = library(like)
    return sys.modules.get(_MODULES.get(top, top))


def from_dlpack(like):
    """The function that takes a DLPack producer into like's library (torch.from_dlpack,
    cupy.from_dlpack, jax.numpy.from_dlpack), None where the library has none (or is not
    imported)."""
    return getattr(_module(like), "from_dlpack", None)


def _on_host(x):
    """Whether x is another library's array in host memory (`__dlpack_device__` says kDLCPU)."""
    if not hasattr(type(x), "__dlpack_device__") or isinstance(x, type):
        return False
    try:
        return int(x.__dlpack_device__()[0]) == KDL_CPU
    except Exception:        # a producer that cannot say (a JAX tracer): not an array here
        return False


def torch_bfloat16_message(name, x):
    """A torch bfloat16 tensor on the host: NumPy has no bfloat16, ml_dtypes does."""
    grad = ".detach()" if getattr(x, "requires_grad", False) else ""
    return (f"{name} is a torch bfloat16 tensor on the {x.device.type}, which NumPy cannot read "
            f"(NumPy has no bfloat16); pass a NumPy array of ml_dtypes.bfloat16 over the same "
            f"memory, {name}{grad}.view(torch.int16).numpy().view(ml_dtypes.bfloat16) (no copy), "
            f"or {name}{grad}.float().numpy() (float32); a CUDA tensor is read as it is")


def host_view(name, x):
    """NumPy's view of x where x is a host array: x itself for a NumPy array; for another
    library's array on the host (module docstring) a view of its memory, no copy. None for
    anything else (a CUDA array, a list, a scalar). TypeError naming `name` where the library
    refuses to share the memory or NumPy cannot read its dtype."""
    if isinstance(x, np.ndarray):
        return x
    if not _on_host(x):
        return None
    try:
        return np.asarray(x) if hasattr(type(x), "__array__") else np.from_dlpack(x)
    except Exception as e:
        if library(x) == "torch" and str(getattr(x, "dtype", "")) == "torch.bfloat16":
            raise TypeError(torch_bfloat16_message(name, x)) from None
        if getattr(x, "requires_grad", False):
            raise TypeError(f"{name} is a {type(x).__name__} that requires grad, which its library "
                            f"does not share; pass {name}.detach()") from None
        raise TypeError(f"{name}: NumPy cannot read this {type(x).__name__} on the host ({e})") from None


def to_library(a, like):
    """a, a NumPy array attnext computed for `like` (an input on the host), in like's library:
    a itself for NumPy (and for a library with no from_dlpack); else the library's from_dlpack
    over a's memory (torch.from_dlpack shares it; JAX may copy it into a buffer of its own), or
    its asarray where NumPy cannot export a's dtype (bfloat16)."""
    if isinstance(like, np.ndarray) or library(like) == "numpy":
        return a
    module = _module(like)
    take = getattr(module, "from_dlpack", None)
    if take is None:
        return a
    try:
        return take(a)
    except BufferError:
        asarray = getattr(module, "asarray", None)
        return a if asarray is None else asarray(a)
