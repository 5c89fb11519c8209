"""attnext as a Hugging Face transformers attention implementation: `attn_implementation="attnext"`
after `attnext.torch.register_transformers()` (which calls register() here with its attention).

    import attnext.torch as axt
    axt.register_transformers()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnext")

Two functions are registered under the name: attention_forward in transformers'
AttentionInterface (each layer's attention, through attnext.torch's differentiable op) and
mask in its AttentionMaskInterface (what the model builds once and hands every layer). The
mask is kept small: for the standard masks (causal, sliding-window causal, bidirectional, each
with a 2D padding mask) it is the 2D padding mask itself, or None without padding, and the
layer reads it as a (B, 1, 1, Sk) broadcast mask beside causal= and window=, so nothing of size
Sq x Sk is made. Masks transformers marks as non-standard (extra and / or functions, packed
sequences, block overlays: allow_is_*_skip False) are built as transformers' own 4D bool mask,
which the layer passes as mask= (exact, at the cost of the materialised mask).

What the layer reads from the call: scaling (scale=), is_causal / module.is_causal (causal=,
aligned bottom-right: queries after a cache attend to every cached key, as transformers'
q_offset says), sliding_window (window=(sliding_window - 1, 0): key j kept when i - j <
sliding_window), softcap, s_aux (attention sinks, gpt-oss's sinks=; their gradient flows), GQA
from the heads' counts. dropout > 0 is refused (attnext has no dropout). Returns (out, None): no
attention weights.
torch and transformers are imported by this module and attnext.torch only; it imports nothing of
attnext (attnext.torch hands it the op).
"""
from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "attnext"


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
         attention_mask=None, **kwargs):
    """transformers' mask interface: the 2D padding mask (B, kv_length) bool, or None without
    padding, for a standard mask; transformers' 4D bool mask (sdpa_mask) for any other."""
    standard = kwargs.get("allow_is_causal_skip", kwargs.get("allow_is_bidirectional_skip", False))
    if not standard:
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def attention_forward(attention, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface once register() binds attention (attnext.torch's): query
    (B, Hq, Sq, D), key and value (B, Hk, Sk, D) in, (B, Sq, Hq, Dv) out."""
    if dropout:
        raise ValueError(f"attnext: dropout={dropout} is not supported (attnext has no dropout); set the "
                         f"model's attention_dropout to 0 or train in eval mode for attention")
    if kwargs.get("output_attentions"):
        raise ValueError("attnext: output_attentions=True needs the attention weights, which attnext "
                         "never forms; use attn_implementation='eager' for them")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    opts = {}
    if attention_mask is not None:
        if attention_mask.ndim == 2:          # mask(): the keys' padding
            opts["mask"] = attention_mask[:, None, None, -key.shape[2]:].to(torch.bool)
        else:                                 # a 4D mask holds the causal and window rules itself
            opts["mask" if attention_mask.dtype == torch.bool else "bias"] = attention_mask
            causal, sliding_window = False, None
    if causal and sliding_window:
        opts["window"] = (int(sliding_window) - 1, 0)
    out = attention(query, key, value, causal=causal, scale=scaling, softcap=softcap, sinks=s_aux,
                    layout="bhsd", **opts)
    return out.transpose(1, 2).contiguous(), None


def register(attention, name=NAME):
    """Registers attention_forward calling attention (attnext.torch.attention) and mask under name
    (default "attnext")."""
    AttentionInterface.register(name, functools.partial(attention_forward, attention))
    AttentionMaskInterface.register(name, mask)
