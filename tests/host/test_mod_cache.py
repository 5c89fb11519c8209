"""attnext.cuda.mod_cache on the fake driver (no GPU): a mask_mod's block mask is built once and
reused by the calls that have the same mask_mod structure, float constants, captured-array
contents, lengths and cells; anything else differing rebuilds it, an array changed in place is
uploaded again, and both caches stay bounded. The GPU tests (cpu/test_score_mod.py) check that
the reused masks give the reference's answers."""
import numpy as np

from helpers.driver import run_on_fake

BODY = r"""
from attnext.cuda import mod_cache
from attnext.mods import codegen

MASKS = []          # (block mask address, gmods) of every attn_block_mask launch
CALLS = []          # block mask address each attention launch reads
_plain = _launch          # the driver's own (the prelude's wrapper takes no gmods)


def launch(fn, *args):
    _plain(fn, *args)
    if len(args) > 8:
        blocks = int(np.frombuffer(args[-1], codegen.MODS_DTYPE, count=1)["blocks"][0])
        (MASKS if FN[id(fn)][1] == "attn_block_mask" else CALLS).append(blocks)


_C.cuda_launch_attention = launch


def run(mask_mod, S=256, B=1, **kw):
    q, k, v = qkv(B, S, S, 2, 2, 64)
    n = len(MASKS)
    attnext.attention(q, k, v, mask_mod=mask_mod, **kw)
    return len(MASKS) - n, CALLS[-1]


# documents that repeat an id (0, 1, 0, 1): not contiguous runs, so the CUDA backend keeps the
# mask_mod (a document mask over contiguous runs runs as varlen, with no block mask)
doc = np.repeat(np.arange(4) % 2, 64)

def doc_mask(b, h, qi, ki):
    return doc[qi] == doc[ki]

built, first = run(doc_mask)
assert built == 1, built
# the same function again, and the same function defined anew: no build, the same mask
for f in (doc_mask, lambda b, h, qi, ki: doc[qi] == doc[ki]):
    built, addr = run(f)
    assert (built, addr) == (0, first), (built, addr, first)
# a backward with the same mask_mod reuses it too
q, k, v = qkv(1, 256, 256, 2, 2, 64)
n = len(MASKS)
out, lse = attnext.attention(q, k, v, mask_mod=doc_mask, return_lse=True)
attnext.attention_backward(out, q, k, v, out, lse, mask_mod=doc_mask)
assert len(MASKS) == n and CALLS[-1] == first
# the captured array changed in place: uploaded again, rebuilt
misses = mod_cache.info()["arrays"]["misses"]
doc[100:110] = 7
built, addr = run(doc_mask)
assert built == 1 and mod_cache.info()["arrays"]["misses"] == misses + 1
# ... and changed back: the first copy and mask are found again
doc[100:110] = np.repeat(np.arange(4) % 2, 64)[100:110]
assert run(doc_mask) == (0, first)
# a float constant, the lengths, the batch: each its own mask
width = 10.0
assert run(lambda b, h, qi, ki: qi - ki < width)[0] == 1
assert run(lambda b, h, qi, ki: qi - ki < width)[0] == 0
width = 20.0
assert run(lambda b, h, qi, ki: qi - ki < width)[0] == 1
doc2 = np.repeat(np.arange(4) % 2, 80)
mask2 = lambda b, h, qi, ki: doc2[qi] == doc2[ki]
assert run(mask2, S=320)[0] == 1
assert run(mask2, S=300)[0] == 1
assert run(mask2, S=300, B=2)[0] == 1
assert run(mask2, S=300, B=2)[0] == 0
# bounded: many different masks keep at most MASK_ENTRIES, the arrays at most ARRAY_ENTRIES
for i in range(mod_cache.MASK_ENTRIES + 8):
    t = np.full(256, i)
    run(lambda b, h, qi, ki: t[qi] >= t[ki])
info = mod_cache.info()
assert info["block_masks"]["entries"] <= mod_cache.MASK_ENTRIES, info
assert info["arrays"]["entries"] <= mod_cache.ARRAY_ENTRIES, info
mod_cache.clear()
assert mod_cache.info()["block_masks"]["entries"] == 0
assert run(doc_mask)[0] == 1
# the error record is read back (the call waits for its kernels) only when attnext.bounds cannot
# prove every lookup in range: doc[qi] over 256 rows of a 256-long array can never fail
from attnext.cuda import staging
reads = []
_download = staging.Staging.download
staging.Staging.download = lambda self, view, dst: (reads.append(dst.shape), _download(self, view, dst))[1]
run(doc_mask)
assert reads == [], reads
run(lambda b, h, qi, ki: doc[qi + 1] == doc[ki])
assert reads == [(5,)], reads
print("ok")
"""


def test_block_masks_are_reused_by_their_key_only(fake_driver):
    run_on_fake(fake_driver, BODY)


def test_array_copies_are_found_by_bits():
    from attnext.cuda import mod_cache
    a = np.array([1.0, np.nan, -0.0], np.float32)
    b = a.copy()
    assert np.array_equal(mod_cache._bits(a), mod_cache._bits(b))
    b[2] = 0.0                                   # -0.0 == 0.0, but not the same bits
    assert not np.array_equal(mod_cache._bits(a), mod_cache._bits(b))
    assert np.array_equal(mod_cache._bits(np.array([True, False])), [1, 0])


def test_the_per_thread_default_stream_finds_and_keeps_nothing(fake_driver):
    """A call on the per-thread default stream (another stream in every thread) neither finds
    nor keeps an array copy or a block mask: it uploads and builds its own every call, and what
    it made is freed with it; a call on a stream of its own then keeps them as before."""
    run_on_fake(fake_driver, BODY.split("# documents that repeat")[0] + r"""
from attnext.cuda import arrays as device

doc = np.repeat(np.arange(4) % 2, 64)
def doc_mask(b, h, qi, ki):
    return doc[qi] == doc[ki]

def on(stream):
    q, k, v = qkv(1, 256, 256, 2, 2, 64, stream=stream)
    n = len(MASKS)
    attnext.attention(q, k, v, mask_mod=doc_mask)
    return len(MASKS) - n

mod_cache.clear()
allocs, frees = (fake_cuda.counter(lib, n) for n in ("allocs", "frees"))
for _ in range(2):
    a0, f0 = allocs.value, frees.value
    assert on(device.PER_THREAD_STREAM) == 1
    info = mod_cache.info()
    assert info["arrays"]["entries"] == 0 and info["block_masks"]["entries"] == 0, info
    assert allocs.value - a0 == frees.value - f0 > 0, (allocs.value - a0, frees.value - f0)
assert on(0x7000) == 1 and on(0x7000) == 0
assert mod_cache.info()["block_masks"]["entries"] == 1
print("ok")
""")
