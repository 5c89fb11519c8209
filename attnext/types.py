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


class Grads(NamedTuple):
    """Gradients of attention.

    dq, dk, dv have the shapes of q, k, v as given (a broadcast k gets a full-shape dk);
    dbias has the shape of the bias given (summed over its broadcast dimensions), None without
    a bias; dtensors maps the name of each float array a score_mod reads (those the backward's
    dtensors argument asks for: by default every one) to its gradient.
    """
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dbias: np.ndarray | None
    dtensors: dict


class CompileError(RuntimeError):
    """A score_mod / mask_mod could not be compiled; carries the generated source and the log."""

    def __init__(self, message: str, source: str = "", log: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.log = log
