"""GPU calls repeated with the same arrays and options: the recipe of their launches, by key.

A decode loop or a benchmark calls attention() on the same CUDA arrays (the same addresses,
shapes, strides and dtypes) with the same options again and again. The first such call takes the
whole path (checks.normalise, the views, the plan: 30-60 us of Python, more than a decode's
kernels on a fast GPU); backend.forward leaves the recipe of its launches on the call (`o.recipe`)
and api.py files it here under the call's key. The next call with an equal key has backend.replay
run it: the pending device-length errors raised (lengths.raise_pending), new results allocated
where the caller gave no out= (and an lse where asked for), the plan's launches enqueued
(backend._launch: scratch and launch counters lent as on the whole path).

The key holds everything the first call's checks, plan and launches depended on: each array's
library, address, shape, strides, dtype and device (a DeviceArray's stream too; torch tensors
are read on the legacy stream), every option, and the generation of attnext's settings
(_env.generation), each option with its type (True and 1 are told apart by the checks). Any
difference is a miss, which takes the whole path; clear() (backend's clear_plans) and a fork
forget every recipe. No caller's array is kept alive here (a recipe keeps only attnext's own
upload of host lengths): arrays freed and made again at the same addresses with the same layout
make the same call, and replay it correctly.

Taken by attention() and varlen_attention() with q, k, v (and out) plain CUDA torch tensors or
attnext DeviceArrays; lengths (seqlens, cu_seqlens, seqused) as small NumPy integer arrays, keyed
by their contents (the whole path uploads them; the recipe keeps that upload, `keep`), varlen
lengths as CUDA arrays with max_seqlen_* (read in place), or a paged cache's block_table and
seqlens_k as CUDA arrays; no score_mod, bias, mask, alibi or sinks; a mask_mod only where its
fingerprint is known (mods/fingerprint.py: the key holds it) and every array it captures is a
host array (one lowered to documents: the recipe keeps the values the runs were read from,
`captured`, which api.py compares before a replay). backend.forward leaves a recipe only where
its call had nothing else: no generated code (a mask_mod lowered whole into causal / window /
documents: mods/lower.py), lengths uploaded from the host, or CUDA lengths or a paged call's
table and lengths read in place, whose check (attn_lengths, attn_pages) the replay enqueues
again; once a GPU call has loaded the CUDA host side. A call that raised left no recipe. This
module is part of `import attnext` (api.py asks it for every call's key): it imports no other
part of the CUDA host side.
"""
import sys

import numpy as np

from .. import _env
from ..lru import LRU

CAPACITY = 64              # recipes kept (each holds its plan and so its loaded kernels)
HOST_KEY_BYTES = 4096      # a host integer array up to this size is keyed by its contents

_recipes = LRU(CAPACITY)


def _array_key(x, arrays_module):
    """What the whole path reads of an array, as a hashable tuple: a CUDA array's place and
    layout, a small NumPy integer array's contents; None for anything else (a larger or float
    host array, another library's, a torch tensor arrays.plain_cuda_tensor refuses: the whole
    path decides about those)."""
    t = type(x)
    if t is np.ndarray:         # lengths: the whole path uploads their contents, which the key holds
        if x.dtype.kind in "iu" and x.nbytes <= HOST_KEY_BYTES:
            return t, x.dtype.str, x.shape, x.tobytes()
        return None
    if t is arrays_module.DeviceArray:
        return t, x.ptr, x.shape, x.strides, x.dtype, x.device, x.stream
    if not arrays_module.plain_cuda_tensor(x):
        return None
    return t, x.data_ptr(), x.shape, x.stride(), x.dtype, x.get_device()


def key(args, options):
    """The key of an attention() call (args: its array arguments, None where absent; options: its
    scalar options as a tuple), or None where the call cannot replay."""
    arrays_module = sys.modules.get("attnext.cuda.arrays")
    if not getattr(arrays_module, "LOADED", False):     # no GPU call yet (import attnext leaves the
        return None                                      # CUDA host side unloaded), or its import under way
    arrays = []
    for x in args:
        if x is None:
            arrays.append(None)
            continue
        a = _array_key(x, arrays_module)
        if a is None:
            return None
        arrays.append(a)
    try:
        k_ = (tuple(arrays), _typed(options), _env.generation())
        hash(k_)
    except TypeError:               # an option of no hashable value: the whole path
        return None
    return k_


def _typed(x):
    """x with every value beside its type: options that compare equal but that the checks tell
    apart (True and 1, 16 and 16.0, a tuple and a list) make different keys."""
    if isinstance(x, (tuple, list)):
        return type(x), tuple(_typed(e) for e in x)
    return type(x), x


def lookup(k):
    """The recipe filed under key k (backend.Recipe), or None."""
    return _recipes.get(k)


def remember(k, recipe):
    _recipes.put(k, recipe)


def clear():
    """Forgets every recipe (the plans were cleared)."""
    _recipes.clear()


def forget_after_fork():
    """A forked child's recipes: none, under a new lock (a thread of the parent may have held
    the old one at the fork). backend.py registers it with process.at_fork."""
    global _recipes
    _recipes = LRU(CAPACITY)


def count():
    return len(_recipes)

