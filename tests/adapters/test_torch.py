"""attnext.torch: attention and varlen_attention as torch custom ops with autograd. gradcheck in
float64 on the CPU (every gradient: q, k, v, bias, lse's, a score_mod's captured tensors), the
same numbers as attnext's own API, torch.compile(fullgraph=True) equal to eager, gradients only
for captured tensors that require grad; on a GPU (-m gpu) against SDPA and FlexAttention."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnext  # noqa: E402
import attnext.torch as axt  # noqa: E402

F64 = torch.float64


def _qkv(gen, b, sq, sk, hq, hk, d, dtype=F64, layout="bshd", device="cpu"):
    def t(s, h):
        shape = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
        return torch.randn(shape, generator=gen, dtype=dtype).to(device).requires_grad_()
    return t(sq, hq), t(sk, hk), t(sk, hk)


@pytest.fixture
def gen():
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    return g


CASES = {
    "plain": dict(),
    "causal_softcap": dict(causal=True, softcap=2.5),
    "window_gqa": dict(window=(2, 1), hk=1),
    "bhsd_alibi": dict(layout="bhsd", alibi=True),
    "mask": dict(mask=True),
    "scale_top_left": dict(causal="top_left", scale=0.3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradcheck_padded(gen, case):
    opts = dict(CASES[case])
    hk = opts.pop("hk", 2)
    q, k, v = _qkv(gen, 2, 5, 7, 2, hk, 4, layout=opts.get("layout", "bshd"))
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.tensor([0.5, 0.25], dtype=torch.float32)
    if opts.pop("mask", False):
        opts["mask"] = torch.rand(2, 1, 5, 7, generator=gen) < 0.7
    assert torch.autograd.gradcheck(lambda q, k, v: axt.attention(q, k, v, **opts), (q, k, v))


def test_gradcheck_bias_and_lse(gen):
    q, k, v = _qkv(gen, 1, 4, 6, 2, 2, 3)
    bias = torch.randn(2, 4, 6, generator=gen, dtype=F64, requires_grad=True)

    def f(q, k, v, bias):
        out, lse = axt.attention(q, k, v, bias=bias, causal=True, return_lse=True)
        return out, lse          # gradcheck feeds both a gradient: lse's reaches dlse
    assert torch.autograd.gradcheck(f, (q, k, v, bias))


def test_gradcheck_varlen(gen):
    q, k, v = (torch.randn(11, 2, 3, generator=gen, dtype=F64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: axt.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True), (q, k, v))


def test_gradcheck_score_mod_captures(gen):
    """A table captured in the closure and a global-style default: both get their gradients."""
    q, k, v = _qkv(gen, 1, 5, 5, 2, 2, 3)
    table = torch.randn(2, 10, generator=gen, dtype=F64, requires_grad=True)
    scale = torch.tensor(0.7, dtype=F64, requires_grad=True)

    def f(q, table, scale):
        def rel(s, b, h, q_idx, kv_idx, w=scale):
            return s * w + table[h, q_idx - kv_idx + 5]
        return axt.attention(q, k, v, score_mod=rel, mask_mod=lambda b, h, qi, ki: ki <= qi + 1)
    assert torch.autograd.gradcheck(f, (q, table, scale))


def test_the_same_numbers_as_attnext(gen):
    q, k, v = _qkv(gen, 2, 9, 9, 4, 2, 8, dtype=torch.float32)
    dout = torch.randn(2, 9, 4, 8, generator=gen)
    out = axt.attention(q, k, v, causal=True)
    out.backward(dout)
    qn, kn, vn = (x.detach() for x in (q, k, v))
    want, lse = attnext.attention(qn, kn, vn, causal=True, return_lse=True, device="cpu")
    g = attnext.attention_backward(dout, qn, kn, vn, want, lse, causal=True, device="cpu")
    for got, ref in ((out, want), (q.grad, g.dq), (k.grad, g.dk), (v.grad, g.dv)):
        torch.testing.assert_close(got.detach(), torch.as_tensor(ref), rtol=0, atol=0)


def test_bfloat16_cpu_tensors(gen):
    """attnext reads a bfloat16 CPU tensor through NumPy's ml_dtypes view (NumPy has no torch
    bfloat16); results and gradients come back as bfloat16 tensors, equal to attnext's API on
    those views."""
    import ml_dtypes
    q, k, v = _qkv(gen, 1, 11, 13, 2, 1, 16, dtype=torch.bfloat16)
    bias = torch.randn(2, 11, 13, generator=gen).to(torch.bfloat16).requires_grad_()
    dout = torch.randn(1, 11, 2, 16, generator=gen).to(torch.bfloat16)
    out = axt.attention(q, k, v, bias=bias, causal=True)
    out.backward(dout)
    assert out.dtype == q.grad.dtype == bias.grad.dtype == torch.bfloat16

    def view(t):
        return t.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    want, lse = attnext.attention(view(q), view(k), view(v), bias=view(bias), causal=True, return_lse=True)
    g = attnext.attention_backward(view(dout), view(q), view(k), view(v), want, lse, bias=view(bias),
                                   causal=True)
    for got, ref in ((out, want), (q.grad, g.dq), (k.grad, g.dk), (v.grad, g.dv), (bias.grad, g.dbias)):
        np.testing.assert_array_equal(view(got), ref)


def test_only_captured_tensors_that_require_grad_are_asked(gen, monkeypatch):
    q, k, v = _qkv(gen, 1, 6, 6, 2, 2, 4, dtype=torch.float32)
    wanted = torch.randn(2, 12, generator=gen, requires_grad=True)
    fixed = torch.randn(2, 12, generator=gen)
    asked = []
    real = attnext.api.attention_backward

    def spy(*a, **kw):
        asked.append(kw.get("dtensors"))
        return real(*a, **kw)
    monkeypatch.setattr(attnext.api, "attention_backward", spy)

    def mod(s, b, h, q_idx, kv_idx):
        return s + wanted[h, q_idx - kv_idx + 6] + fixed[h, kv_idx]
    axt.attention(q, k, v, score_mod=mod).sum().backward()
    assert asked == [["wanted"]] and wanted.grad is not None and fixed.grad is None


def test_compile_fullgraph_equals_eager(gen):
    q, k, v = _qkv(gen, 2, 33, 33, 2, 1, 16, dtype=torch.float32)
    table = torch.randn(2, 66, generator=gen, requires_grad=True)
    sinks = torch.randn(2, generator=gen, requires_grad=True)

    def rel(s, b, h, q_idx, kv_idx):
        return s + table[h, q_idx - kv_idx + 33]

    def f(q, k, v):
        return axt.attention(q, k, v, causal=True, score_mod=rel, sinks=sinks).square().sum()
    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        for x in (q, k, v, table, sinks):
            x.grad = None
        fn(q, k, v).backward()
        grads.append([x.grad.clone() for x in (q, k, v, table, sinks)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_compile_refuses_a_grad_tensor_a_helper_holds(gen):
    q, k, v = _qkv(gen, 1, 8, 8, 2, 2, 4, dtype=torch.float32)
    inner = torch.randn(2, requires_grad=True)
    helper = _make_helper(inner)

    def mod(s, b, h, q_idx, kv_idx):
        return helper(s, h)
    with pytest.raises(Exception, match="captured by a helper"):
        torch.compile(lambda q, k, v: axt.attention(q, k, v, score_mod=mod), fullgraph=True)(q, k, v)


def _make_helper(t):
    def helper(s, h):
        return s + t[h]
    return helper


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_against_sdpa(causal):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    res = []
    for fn in (lambda: axt.attention(q, k, v, causal=causal, layout="bhsd"),
               lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)):
        for x in (q, k, v):
            x.grad = None
        out = fn()
        out.backward(dout.to(out.dtype))
        res.append([out.float()] + [x.grad.float() for x in (q, k, v)])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_score_mod_against_flex():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    from torch.nn.attention.flex_attention import flex_attention
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", generator=g).requires_grad_() for _ in range(3))
    table = torch.randn(4, 256, device="cuda", generator=g).requires_grad_()

    def rel(s, b, h, q_idx, kv_idx):
        return s + table[h, q_idx - kv_idx + 128]
    res = []
    for fn in (lambda: axt.attention(q, k, v, score_mod=rel, layout="bhsd"),
               lambda: flex_attention(q, k, v, score_mod=rel)):
        for x in (q, k, v, table):
            x.grad = None
        fn().square().sum().backward()
        res.append([x.grad.clone() for x in (q, k, v, table)])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def _eager_sinks(q, k, v, sinks, causal):
    """Attention with sinks in plain torch (bhsd): the sink a softmax column with no value."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    col = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)
    both = torch.cat([s, col], -1)
    return both.softmax(-1)[..., :-1] @ v, torch.logsumexp(both, -1)


def test_gradcheck_sinks(gen):
    """sinks' gradient (and q, k, v's with sinks), lse's too; the same numbers as plain torch."""
    q, k, v = _qkv(gen, 2, 5, 5, 4, 2, 3, layout="bhsd")
    sinks = torch.randn(4, generator=gen, dtype=F64, requires_grad=True)

    def f(q, k, v, sinks):
        return axt.attention(q, k, v, sinks=sinks, causal=True, layout="bhsd", return_lse=True)
    assert torch.autograd.gradcheck(f, (q, k, v, sinks))
    out, lse = f(q, k, v, sinks)
    want_out, want_lse = _eager_sinks(q, k, v, sinks, True)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_bfloat16_sinks_parameter(gen):
    """A bfloat16 sinks parameter (as gpt-oss holds them) with float32 q, k, v: cast for attnext,
    its gradient comes back in bfloat16."""
    q, k, v = _qkv(gen, 1, 6, 6, 2, 2, 8, dtype=torch.float32)
    sinks = torch.randn(2, generator=gen).to(torch.bfloat16).requires_grad_()
    axt.attention(q, k, v, sinks=sinks).square().sum().backward()
    got = sinks.grad
    sinks.grad = None
    out, _ = _eager_sinks(*(x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)),
                          sinks.float(), False)
    out.transpose(1, 2).square().sum().backward()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), sinks.grad.float(), rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
def test_cuda_sinks_against_eager():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    sinks = torch.randn(8, device="cuda", generator=g).requires_grad_()
    dout = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    res = []
    for fn in (lambda: axt.attention(q, k, v, causal=True, layout="bhsd", sinks=sinks),
               lambda: _eager_sinks(q.float(), k.float(), v.float(), sinks, True)[0]):
        for x in (q, k, v, sinks):
            x.grad = None
        out = fn()
        out.backward(dout.to(out.dtype))
        res.append([out.float()] + [x.grad.float() for x in (q, k, v, sinks)])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
