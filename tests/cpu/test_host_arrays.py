"""Other libraries' arrays in host memory ([3/7] point 3): a torch CPU tensor is read as the NumPy
array it shares memory with (attnext/interop.py), as an array a score_mod / mask_mod captures
and as q, k, v, bias, out=, and what attnext computes for it comes back as a torch tensor.

- Captured: on the CPU backend and the reference (NumPy's view, no copy: a change in place is
  seen by the next call), on the GPU uploaded as a NumPy array is (the fake driver here, `-m gpu`
  on a device); its gradient in dtensors is a torch CPU tensor of its dtype. A bfloat16 tensor
  (NumPy has no bfloat16) and one that requires grad are refused, naming the array and what to
  pass; a torch tensor reached other than by name says so.
- Inputs: torch CPU q, k, v give torch out, lse and gradients; out= a torch CPU tensor is
  written in place; out= overlapping a captured tensor is a ValueError.
"""
import numpy as np
import pytest

import attnext
from attnext import interop
from conftest import BF16, F16, F32, make_qkv, randn
from helpers.driver import run_on_fake as _run
from helpers.fake_arrays import NUMPY_CALLS as HELPERS

torch = pytest.importorskip("torch")

DEVICES = ["cpu", "reference"]
S = 24


def _gradients(device, fn, q, k, v, **opts):
    out, lse = attnext.attention(q, k, v, device=device, return_lse=True, **opts, score_mod=fn)
    g = attnext.attention_backward(np.ones_like(out), q, k, v, out, lse, device=device,
                                   score_mod=fn, **opts)
    return out, g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_captured_torch_cpu_table(device, dtype, rng):
    q, k, v = make_qkv(rng, 2, S, S, 2, 2, 16, 16, F32)
    table = (0.3 * torch.randn(2, 2 * S - 1)).to(dtype)
    copy = table.numpy().copy()

    def on_torch(s, b, h, qi, ki):
        return s + table[h, qi - ki + S - 1]

    def on_numpy(s, b, h, qi, ki):
        return s + copy[h, qi - ki + S - 1]
    out, g = _gradients(device, on_torch, q, k, v, causal=True)
    want, w = _gradients(device, on_numpy, q, k, v, causal=True)
    np.testing.assert_array_equal(out, want)
    d = g.dtensors["table"]
    assert list(g.dtensors) == ["table"] and isinstance(d, torch.Tensor) and d.device.type == "cpu"
    assert d.numpy().dtype == w.dtensors["copy"].dtype and d.shape == table.shape
    np.testing.assert_array_equal(d.numpy(), w.dtensors["copy"])
    # no copy is kept: the tensor changed in place is read as it is now
    table.mul_(0)
    np.testing.assert_array_equal(attnext.attention(q, k, v, score_mod=on_torch, device=device, causal=True),
                                  attnext.attention(q, k, v, device=device, causal=True))


@pytest.mark.parametrize("device", DEVICES)
def test_captured_torch_cpu_ids_in_a_mask_mod(device, rng):
    """An int64 tensor of document ids: the same kept pairs (and, lowered to varlen over the
    runs on the CPU backend, the same bits) as its NumPy copy; a mask over ids that repeat stays
    a mask_mod; attnext.block_mask reads it too."""
    q, k, v = make_qkv(rng, 1, S, S, 2, 2, 16, 16, F32)
    for ids in (np.repeat(np.arange(3), 8), np.repeat(np.arange(4) % 2, 6)):
        doc_t = torch.from_numpy(ids.copy())
        got = attnext.attention(q, k, v, device=device, mask_mod=lambda b, h, qi, ki: doc_t[qi] == doc_t[ki])
        want = attnext.attention(q, k, v, device=device, mask_mod=lambda b, h, qi, ki: ids[qi] == ids[ki])
        np.testing.assert_array_equal(got, want)
        bm = attnext.block_mask(lambda b, h, qi, ki: doc_t[qi] == doc_t[ki], S, S, block_size=8)
        assert bm.counts() == attnext.block_mask(lambda b, h, qi, ki: ids[qi] == ids[ki], S, S,
                                                 block_size=8).counts()


@pytest.mark.parametrize("device", DEVICES)
def test_refused_torch_cpu_tensors_are_named(device):
    q = np.ones((1, 8, 2, 16), np.float32)
    rel_bf16 = torch.zeros(16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^score_mod: captured array 'rel_bf16': rel_bf16 is a torch "
                                        r"bfloat16 tensor on the cpu, which NumPy cannot read") as e:
        attnext.attention(q, q, q, device=device, score_mod=lambda s, b, h, qi, ki: s + rel_bf16[qi])
    assert "rel_bf16.view(torch.int16).numpy().view(ml_dtypes.bfloat16) (no copy)" in str(e.value)
    param = torch.zeros(16, requires_grad=True)
    with pytest.raises(TypeError, match=r"^mask_mod: captured array 'param': param is a Tensor that "
                                        r"requires grad, which its library does not share; pass "
                                        r"param\.detach\(\)$"):
        attnext.attention(q, q, q, device=device, mask_mod=lambda b, h, qi, ki: param[qi] > 0)
    tables = [torch.zeros(16)]          # reached through a list: not captured, and said so
    with pytest.raises(TypeError, match=r"is read with a traced value, but is not captured"):
        attnext.attention(q, q, q, device=device, score_mod=lambda s, b, h, qi, ki: s + tables[0][qi])


def test_out_overlapping_a_captured_torch_tensor(rng):
    q, k, v = make_qkv(rng, 1, S, S, 2, 2, 16, 16, F32)
    scratch = torch.zeros(1, S, 2, 16)
    with pytest.raises(ValueError, match=r"^out shares memory with the array 'scratch' that "
                                         r"score_mod captures$"):
        attnext.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + scratch[0, qi, h, 0],
                          out=scratch, device="cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_torch_cpu_inputs_come_back_as_torch(device, rng):
    q, k, v = make_qkv(rng, 2, 17, 29, 4, 2, 16, 12, F32)
    bias = randn(rng, (4, 17, 29), F32)
    tq, tk, tv, tb = (torch.from_numpy(x) for x in (q, k, v, bias))
    out, lse = attnext.attention(tq, tk, tv, bias=tb, causal=True, return_lse=True, device=device)
    want, want_lse = attnext.attention(q, k, v, bias=bias, causal=True, return_lse=True, device=device)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    dout = randn(rng, want.shape, F32)
    g = attnext.attention_backward(torch.from_numpy(dout), tq, tk, tv, out, lse, bias=tb, causal=True,
                                   device=device)
    w = attnext.attention_backward(dout, q, k, v, want, want_lse, bias=bias, causal=True, device=device)
    for got, ref in zip(g[:4], w[:4]):
        assert isinstance(got, torch.Tensor)
        np.testing.assert_array_equal(got.numpy(), ref)
    # out= a torch CPU tensor: written in place, returned
    target = torch.full(want.shape, float("nan"))
    assert attnext.attention(tq, tk, tv, bias=tb, causal=True, out=target, device=device) is target
    np.testing.assert_array_equal(target.numpy(), want)


def test_interop_views_share_memory():
    t = torch.arange(12.0).reshape(3, 4)
    view = interop.host_view("t", t)
    assert view.ctypes.data == t.data_ptr() and view.flags.writeable
    assert interop.host_view("x", [1.0, 2.0]) is None and interop.host_view("x", 3.0) is None
    back = interop.to_library(view * 2, t)
    assert isinstance(back, torch.Tensor) and back.tolist() == (t * 2).tolist()
    a = np.ones(3)
    assert interop.to_library(a, np.zeros(1)) is a and interop.library(t) == "torch"


# --- on the GPU -----------------------------------------------------------------------------------

ON_THE_FAKE_GPU = r"""
import torch
table = torch.from_numpy(rng.standard_normal((2, 2 * S + 1)).astype(np.float32))
ids = torch.from_numpy(np.repeat(np.arange(4) % 2, S // 4))


def relbias(s, b, h, qi, ki):
    return s + table[h, qi - ki + S]


def same_doc(b, h, qi, ki):
    return ids[qi] == ids[ki]


# uploaded as NumPy's view is: the kernels read a device copy of its bytes
n = len(GMODS)
out, lse = attnext.attention(hq, hk, hv, score_mod=relbias, mask_mod=same_doc, device="cuda", return_lse=True)
rec = GMODS[-1][1]
a = rec["a"][0]
np.testing.assert_array_equal(at(a["ptr"], a["shape"][:2], a["s"][:2], np.float32), table.numpy())
STATE["grad"] = (3, 0.5)
g = attnext.attention_backward(out, hq, hk, hv, out, lse, score_mod=relbias, mask_mod=same_doc)
STATE["grad"] = None
d = g.dtensors["table"]
assert isinstance(d, torch.Tensor) and d.dtype == torch.float32 and tuple(d.shape) == tuple(table.shape), d
assert d.flatten()[3].item() == 0.5 and int(torch.count_nonzero(d)) == 1
# torch CPU q, k, v on the GPU: staged as NumPy's views, results as torch tensors
tq = torch.from_numpy(hq.astype(np.float16))
out, lse = attnext.attention(tq, tq, tq, score_mod=relbias, return_lse=True)
assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and isinstance(lse, torch.Tensor)
g = attnext.attention_backward(out, tq, tq, tq, out, lse, score_mod=relbias)
assert all(isinstance(x, torch.Tensor) for x in g[:3]) and isinstance(g.dtensors["table"], torch.Tensor)
assert CPU == [], CPU
print("ok")
"""


def test_captured_torch_cpu_tensor_on_the_fake_gpu(fake_driver):  # noqa: F811
    _run(fake_driver, HELPERS + ON_THE_FAKE_GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_captured_torch_cpu_tensor_on_gpu(dtype, rng, gpu):
    """NumPy q, k, v on the GPU with a captured torch CPU table and ids: the same bits as their
    NumPy copies, the table's gradient a torch CPU tensor."""
    n = 200
    q, k, v = make_qkv(rng, 2, n, n, 4, 2, 64, 64, dtype)
    table = (0.1 * torch.randn(4, 2 * n - 1))
    ids = torch.from_numpy(np.repeat(np.arange(5) % 3, 40))
    t_copy, i_copy = table.numpy().copy(), ids.numpy().copy()
    on_torch = dict(score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki + n - 1],
                    mask_mod=lambda b, h, qi, ki: (ids[qi] == ids[ki]) | (ki == 0))
    on_numpy = dict(score_mod=lambda s, b, h, qi, ki: s + t_copy[h, qi - ki + n - 1],
                    mask_mod=lambda b, h, qi, ki: (i_copy[qi] == i_copy[ki]) | (ki == 0))
    out, lse = attnext.attention(q, k, v, return_lse=True, device="cuda", **on_torch)
    want, want_lse = attnext.attention(q, k, v, return_lse=True, device="cuda", **on_numpy)
    np.testing.assert_array_equal(out, want)
    dout = randn(rng, out.shape, dtype)
    g = attnext.attention_backward(dout, q, k, v, out, lse, device="cuda", **on_torch)
    w = attnext.attention_backward(dout, q, k, v, out, lse, device="cuda", **on_numpy)
    d = g.dtensors["table"]
    assert isinstance(d, torch.Tensor) and d.device.type == "cpu"
    np.testing.assert_array_equal(d.numpy(), w.dtensors["t_copy"])
    ref = attnext.reference.attention(q, k, v, **on_numpy)
    attnext.testing.assert_close(out, ref, dtype=dtype, name="out")
