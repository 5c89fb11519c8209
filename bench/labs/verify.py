"""The kernel labs' rule (llm.c's dev/cuda): a lab checks one call's results against a reference or
a peer before it times anything. A result passes when max|got - want| / max|want| < TOL (bf16
outputs, as the bench's check); NaN anywhere fails. Imported by the labs as `verify` (python puts
the script's folder, bench/labs/, first on sys.path).
"""
import math

import numpy as np

TOL = 2e-2


class WrongResult(AssertionError):
    """A lab's result is off: nothing after it is timed."""


def rel_err(got, want):
    """max|got - want| / max|want| (torch tensors on their device in float32, else NumPy float64);
    inf for NaN or a shape mismatch."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    if hasattr(got, "float") and hasattr(want, "float"):        # torch
        err = float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-30)
    else:
        g, w = (np.asarray(x, dtype=np.float64) for x in (got, want))
        err = float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1e-30)
    return err if math.isfinite(err) else math.inf


def check(label, pairs, tol=TOL):
    """pairs: {name: (got, want)}. Raises WrongResult naming every result off by tol or more;
    else returns the largest error."""
    errs = {name: rel_err(got, want) for name, (got, want) in pairs.items()}
    bad = [f"{n} off by {e:.3g}" for n, e in errs.items() if not e < tol]
    if bad:
        raise WrongResult(f"{label}: {'; '.join(bad)} (max|x - ref| / max|ref|, tolerance {tol:g}): not timed")
    return max(errs.values())


def sdpa(q, k, v, causal=False, mask=None, dout=None):
    """A peer's answer on (B, S, H, D) torch tensors: torch SDPA (whichever backend it picks) on
    the transposed views, GQA by enable_gqa, mask a bool (Sq, Sk) tensor of kept pairs. Returns out,
    or (out, (dq, dk, dv)) with dout."""
    import torch
    import torch.nn.functional as F
    leaves = [x.detach().requires_grad_(dout is not None) for x in (q, k, v)]
    with torch.set_grad_enabled(dout is not None):
        o = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), attn_mask=mask,
                                           is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
        o = o.transpose(1, 2)
        if dout is None:
            return o
        return o.detach(), torch.autograd.grad(o, leaves, dout)
