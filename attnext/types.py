"""Small public types shared by the API and the reference, and the aliases its annotations use."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

# A NumPy array, another library's host array (a torch CPU tensor, a JAX CPU array: read as
# NumPy's view, attnext/interop.py), or a CUDA array of any library (PyTorch, CuPy, JAX, Numba,
# attnext's own DeviceArray): anything with the buffer protocol, __cuda_array_interface__ or
# __dlpack__.
Array = Any
# score_mod(score, b, h, q_idx, kv_idx) -> the new score
ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]
# mask_mod(b, h, q_idx, kv_idx) -> bool, True = attend
MaskMod = Callable[[Any, Any, Any, Any], Any]


class _GradFields(NamedTuple):
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dbias: np.ndarray | None
    dtensors: dict


class Grads(_GradFields):
    """Gradients of attention: a named tuple (dq, dk, dv, dbias, dtensors) with one attribute
    beside it, dsinks.

    dq, dk, dv have the shapes of q, k, v as given (a broadcast k gets a full-shape dk);
    dbias has the shape of the bias given (summed over its broadcast dimensions), None without
    a bias; dtensors maps the name of each float array a score_mod reads (those the backward's
    dtensors argument asks for: by default every one) to its gradient. dsinks: the gradient
    of sinks= ((Hq,), float32; float64 for float64 q), None without sinks. It is an attribute,
    not a sixth field, so that `dq, dk, dv, dbias, dtensors = grads` keeps working.
    """
    dsinks = None     # the instance's, set by __new__ (a tuple subclass keeps it in __dict__)

    def __new__(cls, dq, dk, dv, dbias, dtensors, dsinks=None):
        self = super().__new__(cls, dq, dk, dv, dbias, dtensors)
        self.dsinks = dsinks
        return self

    def _replace(self, **changes):
        dsinks = changes.pop("dsinks", self.dsinks)
        return Grads(*_GradFields._replace(self, **changes), dsinks=dsinks)

    def __getnewargs__(self):
        return (*self, self.dsinks)

    def __repr__(self):
        return f"{super().__repr__()[:-1]}, dsinks={self.dsinks!r})"


class CompileError(RuntimeError):
    """A score_mod / mask_mod could not be compiled; carries the generated source and the log."""

    def __init__(self, message: str, source: str = "", log: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.log = log
