"""Numerical derivatives the reference's gradients are checked against."""
import numpy as np


def central(loss, x, eps=1e-6):
    """d loss / d x by central differences, element by element (x float64, small, changed in place
    and restored)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        x0 = x[i]
        x[i] = x0 + eps
        hi = loss()
        x[i] = x0 - eps
        lo = loss()
        x[i] = x0
        g[i] = (hi - lo) / (2 * eps)
    return g
