"""NumPy arrays to torch CUDA tensors and back (the bits kept, bfloat16 included), and run_gpu:
a call on them against the float64 reference, conftest.check_backend's twin for the GPU."""
import types

import numpy as np

from conftest import (BF16, assert_close, assert_lse_close, check_dtensors, compare_grads, dead_rows,
                      entry_points, randn)


def to_gpu(torch, x):
    """A NumPy float16 / bfloat16 (or int / bool) array as a CUDA tensor with the same bits."""
    if x is None or not isinstance(x, np.ndarray):
        return x
    if x.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def to_host(torch, t):
    if t is None:
        return None
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(BF16)
    return t.cpu().numpy()


GPU_OPTS = ("bias", "mask", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqused_q",
            "seqused_k", "sinks", "block_table")


def run_gpu(torch, q, k, v, *, varlen=None, backward=True, dlse=None, **opts):
    """Forward (and backward) on CUDA tensors, then the reference on the same NumPy inputs;
    checks out, lse, dq, dk, dv, dbias and the dtensors (conftest.check_dtensors). Returns what
    conftest.check_backend returns (out, lse, grads and dout on the host, the reference's ref_out, ref_lse, ref_grads);
    grads, ref_grads and dout None without the backward. dlse: as check_backend's (a function of
    the host lse; the GPU call gets its result as a CUDA tensor)."""
    lengths = dict(varlen or {})
    fwd, bwd, rfwd, rbwd = entry_points(varlen)
    dtype = np.dtype(q.dtype)
    gopts = {n: (to_gpu(torch, x) if n in GPU_OPTS else x) for n, x in {**opts, **lengths}.items()}
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    t_out, t_lse = fwd(tq, tk, tv, return_lse=True, **gopts)
    assert isinstance(t_out, torch.Tensor) and t_out.is_cuda
    out, lse = to_host(torch, t_out), to_host(torch, t_lse)
    r_out, r_lse = rfwd(q, k, v, return_lse=True, **lengths, **opts)
    assert_close("out", out, r_out, dtype)
    assert_lse_close(lse, r_lse, dtype)
    dead = dead_rows(r_lse, varlen is not None, opts.get("layout", "bshd"))
    assert (out[dead] == 0).all(), "out: a row that keeps no key is not exactly 0"
    result = types.SimpleNamespace(out=out, lse=lse, ref_out=r_out, ref_lse=r_lse, grads=None,
                                   ref_grads=None, dout=None, inputs=(q, k, v, varlen, opts))
    if not backward:
        return result
    dout = randn(np.random.default_rng(5), out.shape, dtype)
    h_dlse = None if dlse is None else dlse(lse)
    more = {} if dlse is None else {"dlse": to_gpu(torch, h_dlse)}
    g = bwd(to_gpu(torch, dout), tq, tk, tv, t_out, t_lse, **gopts, **more)
    host = type(g)(*(to_host(torch, x) for x in g[:4]), g.dtensors, dsinks=to_host(torch, g.dsinks))
    rg = rbwd(dout, q, k, v, out, lse, **lengths, **opts, **({} if dlse is None else {"dlse": h_dlse}))
    problems = compare_grads(host, rg, q, k, v, dout, out, r_out, varlen, opts)
    assert not problems, "\n".join(problems)
    result.grads, result.ref_grads, result.dout = host, rg, dout
    if rg.dtensors:
        check_dtensors(result, opts["score_mod"], dtype)
    return result

