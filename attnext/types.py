"""Small public types shared by the API and the reference."""
from typing import NamedTuple, Optional

import numpy as np


class Grads(NamedTuple):
    """Gradients of attention.

    dq, dk, dv have the shapes of q, k, v as given (a broadcast k gets a full-shape dk);
    dbias has the shape of the bias given (summed over its broadcast dimensions), None without
    a bias; dtensors maps the name of each float array a score_mod reads to its gradient.
    """
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dbias: Optional[np.ndarray]
    dtensors: dict


class CompileError(RuntimeError):
    """A score_mod / mask_mod could not be compiled; carries the generated source and the log."""

    def __init__(self, message, source="", log=""):
        super().__init__(message)
        self.source = source
        self.log = log
