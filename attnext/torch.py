"""attnext in PyTorch training loops: attention and varlen_attention with gradients flowing, in eager
mode and under torch.compile(fullgraph=True), on CPU and CUDA tensors.

    import attnext.torch as axt
    out = axt.attention(q, k, v, causal=True)                   # q (B, S, H, D), requires_grad
    out, lse = axt.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=m, max_seqlen_k=m,
                                    return_lse=True)            # lse's gradient flows too
    out = axt.attention(q, k, v, score_mod=fn)                  # fn's captured tensors get .grad

Both are torch.library custom ops (attnext::attention, attnext::attention_backward) with fake
(meta) implementations and registered autograd. Every option of attnext.attention is accepted;
the backward gets the same options (it cannot be called with others). Gradients reach q, k, v,
bias, sinks, and each tensor a score_mod captures that requires grad (only those:
attention_backward's dtensors=). A CPU tensor runs on attnext's CPU backend, a CUDA tensor on its
device in place.

score_mod and mask_mod are not tensors, so the ops take an integer key into a registry of the
callbacks seen (strong references: a process that makes a new lambda every step grows it by a
small entry a step); torch.compile traces the key as a constant, and the op is opaque to it (no
graph break). The tensors a score_mod captures that require grad are op inputs, found in its
closure, globals or defaults under torch.compile (docs/torch.md).
torch is imported by this module alone: attnext's core never imports it.
"""
from __future__ import annotations

from typing import List, Optional

import ml_dtypes
import numpy as np
import torch

from . import api
from .merge import lse_shape
from .mods import fingerprint

__all__ = ["attention", "varlen_attention", "register_transformers"]

Tensor = torch.Tensor
_CALLBACKS: dict = {}      # id -> callback: strong references (see _key)
AUX = ("bias", "mask", "alibi_slopes", "seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k",
       "seqused_q", "seqused_k")


@torch._dynamo.assume_constant_result
def _key(fn):
    """The op's integer key for a callback, registered for the op to find it: torch.compile runs
    this while tracing and keeps its result as a constant."""
    if fn is None:
        return 0
    _CALLBACKS[id(fn)] = fn
    return id(fn)


def _callback(key, what):
    if not key:
        return None
    fn = _CALLBACKS.get(key)
    if fn is None:
        raise RuntimeError(f"attnext.torch: no {what} is registered under key {key} in this process "
                           f"(a graph traced in another process?); call the function once here first")
    return fn


def _grad_tensors(fn):
    """name -> each floating tensor fn captures that requires grad."""
    found = {}

    def note(name, value):
        if isinstance(value, Tensor) and value.requires_grad:
            if value.is_floating_point():
                found[name] = value
            return value.detach()
        return value
    if fn is not None:
        fingerprint.with_values(fn, note)
    return found


def _grad_names(fn):
    """The names of the tensors fn captures that require grad, in a fixed order."""
    return sorted(_grad_tensors(fn))


@torch._dynamo.assume_constant_result
def _grad_places(fn):
    """Where fn holds each tensor _grad_names lists, for torch.compile, which cannot trace the
    introspection but can trace _fetch: ("closure", i, name), ("default", i, name) or ("global",
    0, name). A tensor a helper or a callable object holds is refused under compile."""
    places = []
    code = getattr(fn, "__code__", None)
    for name in _grad_names(fn):
        if code is not None and name in code.co_freevars:
            places.append(("closure", code.co_freevars.index(name), name))
            continue
        args = code.co_varnames[:code.co_argcount] if code is not None else ()
        defaults = getattr(fn, "__defaults__", None) or ()
        if name in args[len(args) - len(defaults):]:
            places.append(("default", args.index(name) - (len(args) - len(defaults)), name))
        elif code is not None and name in code.co_names and name in fn.__globals__:
            places.append(("global", 0, name))
        else:
            raise TypeError(f"attnext.torch under torch.compile: the tensor {name!r} that requires grad "
                            f"is captured by a helper or an object the score_mod calls; capture it in "
                            f"the score_mod itself (closure, global or default), or run eagerly")
    return tuple(places)


def _fetch(fn, where, i, name):
    if where == "closure":
        return fn.__closure__[i].cell_contents
    if where == "default":
        return fn.__defaults__[i]
    return fn.__globals__[name]


def _detached(fn):
    """fn with its captured tensors detached (attnext reads their memory; it refuses a tensor
    that requires grad)."""
    if fn is None:
        return None
    return fingerprint.with_values(
        fn, lambda name, value: value.detach() if isinstance(value, Tensor) and value.requires_grad else value)


def _options(aux, score_key, mask_key, causal, window, scale, softcap, layout, precision, varlen,
             max_q, max_k):
    opts = {name: _arg(x) for name, x in zip(AUX, aux)}
    opts.update(score_mod=_detached(_callback(score_key, "score_mod")),
                mask_mod=_detached(_callback(mask_key, "mask_mod")),
                causal={"": False, "true": True}.get(causal, causal),
                window=None if window is None else tuple(window), scale=scale, softcap=softcap,
                precision=precision or None)
    lengths = {n: opts.pop(n) for n in AUX[5:]}
    if varlen:
        for n in ("seqlens_q", "seqlens_k"):
            opts.pop(n)
        lengths.update(max_seqlen_q=max_q, max_seqlen_k=max_k)
    else:
        opts["layout"] = layout
    return opts, lengths


def _device(q):
    return "cpu" if q.device.type == "cpu" else None


def _arg(x):
    """x detached, as attnext reads it: a bfloat16 CPU tensor as NumPy's ml_dtypes view of its
    memory (NumPy cannot read torch's bfloat16)."""
    if x is None:
        return None
    x = x.detach()
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x


def _tensor(a):
    """attnext's result as a torch tensor: a NumPy array (what bfloat16 CPU inputs give) wrapped."""
    if isinstance(a, np.ndarray):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return a


@torch.library.custom_op("attnext::attention", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], sinks: Optional[Tensor],
                aux: List[Optional[Tensor]], captured: List[Tensor],
                score_key: int, mask_key: int, causal: str, window: Optional[List[int]],
                scale: Optional[float], softcap: Optional[float], layout: str, precision: str,
                varlen: bool, max_q: Optional[int], max_k: Optional[int],
                deterministic: bool) -> List[Tensor]:
    """(out, lse). aux: AUX's tensors after bias (no gradient); captured: the tensors the
    score_mod captures that require grad (it reads them through its closure; they are inputs so
    that autograd hands them their gradients)."""
    opts, lengths = _options([bias] + aux, score_key, mask_key, causal, window, scale, softcap, layout,
                             precision, varlen, max_q, max_k)
    opts["sinks"] = _arg(sinks)
    device = _device(q)
    q, k, v = (_arg(x) for x in (q, k, v))
    if varlen:
        out, lse = api.varlen_attention(q, k, v, lengths.pop("cu_seqlens_q"), lengths.pop("cu_seqlens_k"),
                                        **lengths, **opts, return_lse=True, device=device)
    else:
        out, lse = api.attention(q, k, v, **opts, return_lse=True, device=device)
    return [_tensor(out), _tensor(lse)]


@_forward_op.register_fake
def _(q, k, v, bias, sinks, aux, captured, score_key, mask_key, causal, window, scale, softcap, layout,
      precision, varlen, max_q, max_k, deterministic):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return [q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(lse_shape(q.shape, layout), dtype=acc)]


@torch.library.custom_op("attnext::attention_backward", mutates_args=())
def _backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 dlse: Optional[Tensor], bias: Optional[Tensor], sinks: Optional[Tensor],
                 aux: List[Optional[Tensor]], captured: List[Tensor], score_key: int, mask_key: int, causal: str, window: Optional[List[int]],
                 scale: Optional[float], softcap: Optional[float], layout: str, precision: str,
                 varlen: bool, max_q: Optional[int], max_k: Optional[int],
                 deterministic: bool) -> List[Tensor]:
    """[dq, dk, dv, dbias, dsinks (each empty without its input), the gradient of each tensor in
    captured]."""
    opts, lengths = _options([bias] + aux, score_key, mask_key, causal, window, scale, softcap, layout,
                             precision, varlen, max_q, max_k)
    opts["sinks"] = _arg(sinks)
    names = _grad_names(_callback(score_key, "score_mod"))
    args = [_arg(x) for x in (dout, q, k, v, out, lse)]
    more = dict(opts, device=_device(q), deterministic=deterministic,
                dtensors=names if opts["score_mod"] is not None else True, dlse=_arg(dlse))
    if varlen:
        g = api.varlen_attention_backward(*args, lengths.pop("cu_seqlens_q"), lengths.pop("cu_seqlens_k"),
                                          **lengths, **more)
    else:
        g = api.attention_backward(*args, **more)
    dbias = _tensor(g.dbias) if g.dbias is not None else q.new_empty(0)
    dsinks = _tensor(g.dsinks).to(sinks.dtype) if g.dsinks is not None else q.new_empty(0)
    return ([_tensor(g.dq), _tensor(g.dk), _tensor(g.dv), dbias, dsinks]
            + [torch.as_tensor(g.dtensors[n]).to(c) for n, c in zip(names, captured)])


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, bias, sinks, aux, captured, *rest):
    return ([torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
             torch.empty_like(bias) if bias is not None else q.new_empty(0),
             torch.empty_like(sinks) if sinks is not None else q.new_empty(0)]
            + [torch.empty_like(c) for c in captured])


_SCALARS = ("score_key", "mask_key", "causal", "window", "scale", "softcap", "layout", "precision",
            "varlen", "max_q", "max_k", "deterministic")


def _setup(ctx, inputs, output):
    q, k, v, bias, sinks, aux, captured = inputs[:7]
    ctx.scalars = inputs[7:]
    ctx.has_aux = [a is not None for a in [bias, sinks] + aux]
    ctx.n_captured = len(captured)
    ctx.save_for_backward(q, k, v, output[0], output[1], *[a for a in [bias, sinks] + aux if a is not None],
                          *captured)


def _backward(ctx, grads):
    dout, dlse = grads
    q, k, v, out, lse, *rest = ctx.saved_tensors
    given = iter(rest[:len(rest) - ctx.n_captured])
    aux = [next(given) if has else None for has in ctx.has_aux]
    captured = list(rest[len(rest) - ctx.n_captured:])
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias, dsinks, *dcaptured = _backward_op(dout, q, k, v, out, lse, dlse, aux[0], aux[1], aux[2:],
                                                         captured, *ctx.scalars)
    return ((dq, dk, dv, dbias if ctx.has_aux[0] else None, dsinks if ctx.has_aux[1] else None, None, dcaptured)
            + (None,) * len(_SCALARS))


_forward_op.register_autograd(_backward, setup_context=_setup)


def _encode(causal, window):
    if causal is True:
        causal = "true"
    elif causal is False or causal is None:
        causal = ""
    return causal, None if window is None else [int(window[0]), int(window[1])]


def _call(q, k, v, aux, sinks, varlen, max_q, max_k, causal, window, scale, softcap, score_mod, mask_mod,
          layout, precision, deterministic, return_lse):
    causal, window = _encode(causal, window)
    if sinks is not None:       # as attnext reads them (a bfloat16 parameter, as gpt-oss has, too)
        sinks = sinks.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()
    if torch.compiler.is_compiling():
        captured = [_fetch(score_mod, *place) for place in _grad_places(score_mod)]
    else:
        found = _grad_tensors(score_mod)
        captured = [found[n] for n in sorted(found)]
    out, lse = _forward_op(q, k, v, aux[0], sinks, aux[1:], captured, _key(score_mod), _key(mask_mod), causal, window,
                           None if scale is None else float(scale), None if softcap is None else float(softcap),
                           layout, precision or "", varlen, max_q, max_k, bool(deterministic))
    return (out, lse) if return_lse else out


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal=False, window=None, scale=None, softcap=None,
              alibi_slopes=None, bias=None, mask=None, score_mod=None, mask_mod=None, seqlens_q=None,
              seqlens_k=None, layout="bshd", precision=None, deterministic=True, return_lse=False,
              sinks=None):
    """attnext.attention on torch tensors, differentiable: out, or (out, lse) with return_lse
    (lse's gradient flows into the backward's dlse). Options as attnext.attention's (sinks: a
    tensor (Hq,) of any float dtype, cast to float32 for attnext, its gradient flowing back);
    deterministic as attention_backward's."""
    aux = [bias, mask, alibi_slopes, seqlens_q, seqlens_k, None, None, None, None]
    return _call(q, k, v, aux, sinks, False, None, None, causal, window, scale, softcap, score_mod, mask_mod,
                 layout, precision, deterministic, return_lse)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None, causal=False,
                     window=None, scale=None, softcap=None, alibi_slopes=None, bias=None, mask=None,
                     score_mod=None, mask_mod=None, precision=None, deterministic=True, return_lse=False,
                     sinks=None):
    """attnext.varlen_attention on torch tensors, differentiable (as attention())."""
    aux = [bias, mask, alibi_slopes, None, None, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k]
    return _call(q, k, v, aux, sinks, True, max_seqlen_q, max_seqlen_k, causal, window, scale, softcap,
                 score_mod, mask_mod, "bshd", precision, deterministic, return_lse)


def register_transformers(name="attnext"):
    """Registers attnext with Hugging Face transformers as attn_implementation=name (attnext/hf.py):
    its attention function and its mask function, which keeps padding and causal masks as
    lengths-sized masks (docs/transformers.md). transformers is imported here, not before."""
    from . import hf
    hf.register(attention, name)
