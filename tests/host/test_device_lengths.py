"""Device lengths ([3/7] point 5; attnext/cuda/lengths.py): varlen_attention's cu_seqlens / seqused
as CUDA int32 arrays with max_seqlen_* given are read by the kernels in place, with no copy to the
host; the GPU checks them (kernels/attn_lengths.cu) and the next call raises ValueError for a
fault. Without max_seqlen_* they are read back and checked on the host, as before.

Without a GPU, on the fake driver (its attn_lengths played by NumPy, helpers/fake_arrays.py): no
device-to-host copy, the check launched before the attention kernels, the grid's rows and the
clamp's bound (attn_params.max_rows_*) from max_seqlen_*, each fault reported once by the next
call with the array, index and value, and the refusals of what the GPU path cannot read. With
`-m gpu`: the same calls on torch CUDA tensors against the reference, every fault kind reported,
and corrupt lengths that touch nothing outside the arrays (gpu/test_cuda_sanitize.py runs them
under compute-sanitizer).
"""
import numpy as np
import pytest

import attnext
from conftest import BF16, assert_close, make_varlen_qkv, randn

from helpers.driver import run_on_fake
from helpers.fake_arrays import FAKE_ARRAYS

BODY = FAKE_ARRAYS + r"""
import re

T = 300
qv, kv_, vv = dev((T, 2, 64)), dev((T, 2, 64)), dev((T, 2, 64))


def lengths_of(*values, dtype=np.int32):
    return CudaArray(fake_memory(np.array(values, dtype)))


def last_rows(call):
    # (max_rows_q, max_rows_k) of the call's last attention launch (the fake driver's record)
    call()
    p = fake_cuda.params_dict(fake_cuda.last_launch(lib).params)
    return p["max_rows_q"], p["max_rows_k"]


good = lengths_of(0, 100, 250, 300)
n_copies, n_checks = len(COPIES), len(CHECKS)
rows = last_rows(lambda: attnext.varlen_attention(qv, kv_, vv, good, good, max_seqlen_q=160, max_seqlen_k=170))
assert not [c for c in COPIES[n_copies:] if c[0] == "dtoh"], COPIES[n_copies:]
assert len(CHECKS) == n_checks + 1
p = CHECKS[-1]
assert (int(p["B"]), list(p["rows"]), list(p["max_len"])) == (3, [T, T], [160, 170]), p
assert int(p["used"][0]) == 0 and int(p["cu"][0]) == int(p["cu"][1])
assert rows == (160, 170), rows

# without max_seqlen_*: read back (a copy to the host) and checked there; the grid from the longest
n_copies = len(COPIES)
rows = last_rows(lambda: attnext.varlen_attention(qv, kv_, vv, good, good))
assert [c for c in COPIES[n_copies:] if c[0] == "dtoh"] and len(CHECKS) == n_checks + 1
assert rows == (150, 150), rows

# each fault: the call runs, the next one raises ValueError naming it, once
used = lengths_of(90, 150, 40)
faults = [
    ((lengths_of(0, 100, 90, 300), good, {}), r"cu_seqlens_q\[2\] = 90 is less than cu_seqlens_q\[1\] = 100"),
    ((good, lengths_of(3, 100, 250, 300), {}), r"cu_seqlens_k\[0\] = 3; it must start at 0"),
    ((good, lengths_of(0, 100, 250, 301), {}), r"cu_seqlens_k\[3\] = 301 is past the end of the packed tensor \(300 rows\)"),
    ((lengths_of(0, 10, 250, 300), good, {}), r"sequence 1 has 240 rows \(cu_seqlens_q\[2\] - cu_seqlens_q\[1\]\), more than max_seqlen_q = 160"),
    ((good, good, {"seqused_k": lengths_of(90, 151, 40)}), r"seqused_k\[1\] = 151 exceeds the segment's length 150"),
    ((good, good, {"seqused_q": lengths_of(-1, 150, 40)}), r"seqused_q\[0\] = -1 is negative"),
]
for (cq, ck, more), message in faults:
    attnext.varlen_attention(qv, kv_, vv, cq, ck, max_seqlen_q=160, max_seqlen_k=170, **more)
    try:
        attnext.varlen_attention(qv, kv_, vv, good, good, max_seqlen_q=160, max_seqlen_k=170)
    except ValueError as e:
        assert re.search(message, str(e)) and "earlier varlen call on cuda:0" in str(e), (message, str(e))
    else:
        raise AssertionError(f"no ValueError for {message}")
    attnext.varlen_attention(qv, kv_, vv, good, good, max_seqlen_q=160, max_seqlen_k=170)   # reported once
# the backward reports too
attnext.varlen_attention(qv, kv_, vv, lengths_of(0, 100, 90, 300), good, max_seqlen_q=160, max_seqlen_k=170)
out, lse = dev((T, 2, 64)), dev((2, T), np.float32)
try:
    attnext.varlen_attention_backward(dev((T, 2, 64)), qv, kv_, vv, out, lse, good, good, max_seqlen_q=160,
                                      max_seqlen_k=170)
except ValueError as e:
    assert "cu_seqlens_q[2] = 90" in str(e), str(e)
else:
    raise AssertionError("the backward did not report")
attnext.varlen_attention(qv, kv_, vv, good, good, seqused_q=used, max_seqlen_q=160, max_seqlen_k=170)
assert int(CHECKS[-1]["used"][0]) != 0 and int(CHECKS[-1]["used"][1]) == 0

# what the GPU path cannot read is refused by name
refusals = [
    (dict(cu_seqlens_q=lengths_of(0, 100, 250, 300, dtype=np.int64)), TypeError, "cu_seqlens_q has dtype int64"),
    (dict(seqused_q=np.array([90, 150, 40], np.int32)), TypeError, "seqused_q is a host array"),
    (dict(cu_seqlens_k=lengths_of(0, 100, 300)), ValueError, "cu_seqlens_k must have shape \\(4,\\)"),
    (dict(seqused_k=lengths_of(1, 2)), ValueError, "seqused_k must have shape \\(3,\\)"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q = -1 is negative"),
    (dict(max_seqlen_k=1.5), TypeError, "max_seqlen_k must be an int"),
]
for change, kind, message in refusals:
    args = {**dict(cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=160, max_seqlen_k=170), **change}
    try:
        attnext.varlen_attention(qv, kv_, vv, **args)
    except kind as e:
        assert re.search(message, str(e)), (message, str(e))
    else:
        raise AssertionError(f"no {kind.__name__} for {change}")
print("ok")
"""


def test_device_lengths_on_the_fake_driver(fake_driver):
    run_on_fake(fake_driver, BODY)


PAGES = FAKE_ARRAYS + r"""
import re

q, kp, vp = dev((2, 3, 4, 64)), dev((9, 16, 2, 64)), dev((9, 16, 2, 64))
lens = np.array([40, 17])


def table_of(rows):
    return CudaArray(fake_memory(np.array(rows, np.int32)))


def raises(kind, pattern, call):
    # call() raises kind with a message matching pattern (the next call reporting a fault, or a refusal)
    try:
        call()
    except kind as e:
        assert re.search(pattern, str(e)), (pattern, str(e))
    else:
        raise AssertionError(f"no {kind.__name__}: {pattern}")


good = table_of([[3, 0, 8, -1], [5, 1, -1, -1]])
n_copies, n_checks = len(COPIES), len(PAGE_CHECKS)
attnext.attention(q, kp, vp, block_table=good, seqlens_k=lens)          # read in place: no read-back
assert not [c for c in COPIES[n_copies:] if c[0] == "dtoh"], COPIES[n_copies:]
assert len(PAGE_CHECKS) == n_checks + 1
p = PAGE_CHECKS[-1]
assert (int(p["B"]), int(p["max_pages"]), int(p["page_size"]), int(p["num_pages"])) == (2, 4, 16, 9)
assert p["used"] and p["table"] == good.__cuda_array_interface__["data"][0]
attnext.attention(q, kp, vp, block_table=good, seqlens_k=lens)          # nothing to report
# a page a sequence reads out of range: the call runs, the next one raises IndexError naming it
attnext.attention(q, kp, vp, block_table=table_of([[3, 0, 8, -1], [5, 9, -1, -1]]), seqlens_k=lens)
raises(IndexError, r"block_table\[1, 1\] = 9 is out of range for 9 pages",
       lambda: attnext.attention(q, kp, vp, block_table=good, seqlens_k=lens))
attnext.attention(q, kp, vp, block_table=good, seqlens_k=lens)          # reported once
# entries past a sequence's pages are never read, so never reported
attnext.attention(q, kp, vp, block_table=table_of([[3, 0, 8, 99], [5, 1, -7, 99]]), seqlens_k=lens)
attnext.attention(q, kp, vp, block_table=good, seqlens_k=lens)
# a CUDA seqlens_k beside a CUDA table is read in place too, checked by attn_pages: no read-back
dlens = CudaArray(fake_memory(lens.astype(np.int32)))
n_copies = len(COPIES)
attnext.attention(q, kp, vp, block_table=good, seqlens_k=dlens)
assert not [c for c in COPIES[n_copies:] if c[0] == "dtoh"], COPIES[n_copies:]
assert PAGE_CHECKS[-1]["used"] == dlens.__cuda_array_interface__["data"][0]
# a length outside the table's 64 rows: reported by the next call as a ValueError naming it
attnext.attention(q, kp, vp, block_table=good, seqlens_k=CudaArray(fake_memory(np.array([40, 65], np.int32))))
raises(ValueError, r"seqlens_k\[1\] = 65 is outside \[0, 64\]",
       lambda: attnext.attention(q, kp, vp, block_table=good, seqlens_k=dlens))
attnext.attention(q, kp, vp, block_table=good, seqlens_k=dlens)         # reported once
# what the GPU path cannot read is refused by name
raises(TypeError, "block_table as a CUDA array must be int32", lambda: attnext.attention(
    q, kp, vp, block_table=CudaArray(fake_memory(np.zeros((2, 4), np.int64))), seqlens_k=lens))
raises(TypeError, "seqlens_k as a CUDA array beside a CUDA block_table must be contiguous int32", lambda: attnext.attention(
    q, kp, vp, block_table=good, seqlens_k=CudaArray(fake_memory(lens.astype(np.int64)))))
print("ok")
"""


def test_device_block_table_on_the_fake_driver(fake_driver):
    """A paged call's CUDA block table is read in place (no device-to-host copy), checked by
    attn_pages on the call's stream (played by NumPy), and a page a sequence reads out of range
    is an IndexError from the next call, once; entries past a sequence's pages are not checked.
    A CUDA seqlens_k beside it is read in place as well, a length outside the table's rows a
    ValueError from the next call."""
    run_on_fake(fake_driver, PAGES)


# --- on the GPU -------------------------------------------------------------------------------------

def _case(rng, dtype=BF16):
    """Packed, causal, GQA: (Lq, Lk) = (45, 40) used of (50, 40), (0, 30), (70, 60) used of
    (80, 80), (20, 10), five padding rows after the last sequence."""
    q, k, v = make_varlen_qkv(rng, 155, 160, 4, 2, 64, 64, dtype)
    lengths = dict(cu_seqlens_q=np.array([0, 50, 50, 130, 150], np.int32),
                   cu_seqlens_k=np.array([0, 40, 70, 150, 160], np.int32),
                   seqused_q=np.array([45, 0, 70, 20], np.int32),
                   seqused_k=np.array([40, 30, 60, 10], np.int32))
    return q, k, v, lengths


@pytest.mark.gpu
@pytest.mark.parametrize("with_used", [False, True], ids=["cu_only", "seqused"])
def test_device_lengths_on_the_gpu(with_used, rng, torch):
    """Torch CUDA lengths with max_seqlen_* (larger than the longest, as a bound may be): the
    reference's out, lse and gradients, the same bits as NumPy lengths (the kernels read the same
    values; only the grid's bound differs), and no host synchronisation: the call returns while
    a kernel queued before it on the stream still runs."""
    from helpers.gpu import to_gpu, to_host
    q, k, v, lengths = _case(rng)
    if not with_used:
        lengths = {n: x for n, x in lengths.items() if n.startswith("cu")}
    dev_lengths = {n: torch.from_numpy(x).cuda() for n, x in lengths.items()}
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    out, lse = attnext.varlen_attention(tq, tk, tv, **dev_lengths, max_seqlen_q=96, max_seqlen_k=100,
                                        causal=True, return_lse=True)
    r_out, r_lse = attnext.reference.varlen_attention(q, k, v, **lengths, causal=True, return_lse=True)
    assert_close("out", to_host(torch, out), r_out, BF16)
    host_lengths = {n: to_gpu(torch, x).cpu().numpy() for n, x in lengths.items()}
    h_out, h_lse = attnext.varlen_attention(tq, tk, tv, **host_lengths, causal=True, return_lse=True)
    assert torch.equal(out, h_out) and torch.equal(lse, h_lse)
    dout = to_gpu(torch, randn(rng, q.shape[:2] + v.shape[2:], BF16))
    g = attnext.varlen_attention_backward(dout, tq, tk, tv, out, lse, **dev_lengths, max_seqlen_q=96,
                                          max_seqlen_k=100, causal=True)
    h = attnext.varlen_attention_backward(dout, tq, tk, tv, out, lse, **host_lengths, causal=True)
    for a, b in zip(g[:3], h[:3]):
        assert torch.equal(a, b)
    # no synchronisation: a long kernel ahead on the stream is still running when the call returns
    big = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    start, done = torch.cuda.Event(), torch.cuda.Event()
    start.record()
    for _ in range(20):
        big = big @ big
        big /= big.norm()
    attnext.varlen_attention(tq, tk, tv, **dev_lengths, max_seqlen_q=96, max_seqlen_k=100, causal=True)
    done.record()
    assert not done.query(), "the call waited for the GPU"
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_corrupt_device_lengths_are_reported(rng, torch):
    """Every fault kind on the GPU's own check: the call with corrupt lengths returns (its
    results are undefined, nothing outside its arrays is touched: compute-sanitizer), and the
    next call raises ValueError naming the array, index and value; the one after runs."""
    from helpers.gpu import to_gpu
    q, k, v, lengths = _case(rng)
    tq, tk, tv = (to_gpu(torch, x) for x in (q, k, v))
    good = {n: torch.from_numpy(x).cuda() for n, x in lengths.items()}
    cu = lambda *x: torch.tensor(x, dtype=torch.int32, device="cuda")    # noqa: E731
    faults = [
        (dict(cu_seqlens_q=cu(0, 50, 40, 130, 150)), r"cu_seqlens_q\[2\] = 40 is less than"),
        (dict(cu_seqlens_k=cu(7, 40, 70, 150, 160)), r"cu_seqlens_k\[0\] = 7; it must start at 0"),
        (dict(cu_seqlens_q=cu(0, 50, 50, 130, 9999)), r"cu_seqlens_q\[4\] = 9999 is past the end"),
        (dict(cu_seqlens_k=cu(0, 40, 70, 150, -5000)), r"cu_seqlens_k\[4\] = -5000 is less than"),
        (dict(cu_seqlens_q=cu(0, 50, 50, 150, 150)), r"sequence 2 has 100 rows .* more than max_seqlen_q = 96"),
        (dict(seqused_k=cu(40, 30, 61000, 10)), r"seqused_k\[2\] = 61000 exceeds the segment's length 80"),
        (dict(seqused_q=cu(45, -3, 70, 20)), r"seqused_q\[1\] = -3 is negative"),
    ]
    for bad, message in faults:
        for backward in (False, True):     # the forward's check, or the backward's (a good forward)
            args = {**good, **bad}
            out, lse = attnext.varlen_attention(tq, tk, tv, **(good if backward else args), max_seqlen_q=96,
                                                max_seqlen_k=100, return_lse=True, causal=True)
            if backward:
                attnext.varlen_attention_backward(torch.ones_like(out), tq, tk, tv, out, lse, **args,
                                                  max_seqlen_q=96, max_seqlen_k=100, causal=True)
            torch.cuda.synchronize()
            with pytest.raises(ValueError, match=message):
                attnext.varlen_attention(tq, tk, tv, **good, max_seqlen_q=96, max_seqlen_k=100)
            attnext.varlen_attention(tq, tk, tv, **good, max_seqlen_q=96, max_seqlen_k=100)
    torch.cuda.synchronize()
