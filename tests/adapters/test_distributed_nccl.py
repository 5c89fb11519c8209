"""attnext.distributed on a GPU (-m gpu): a one-rank NCCL group in this process, CUDA bf16 tensors,
against attnext.torch on the whole. The ring's transfers need two GPUs (the gloo tests run them
between CPU processes: tests/adapters/test_distributed.py); one rank runs only its own block (step
0): the whole-block call with position tables captured as CUDA tensors, the float32 accumulators
and the captured tensors' path; ring_varlen_attention's gather and call likewise. The steps after
it (row ranges of blocks, attnext.merge on CUDA views, the dK / dV hand-off) run on one GPU in
test_distributed_threads.py (ranks as threads), and on two GPUs, where a machine has them, in the
example under torchrun."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import attnext.distributed as axd  # noqa: E402
import attnext.torch as axt  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl(gpu):
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("torch without CUDA or NCCL")
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _close(name, got, want):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= 2e-2 * scale + 1e-3, f"{name}: max |ring - whole| = {err:.3g} (max |whole| {scale:.3g})"


def _with_mods(opts, heads):
    """opts, its "mods": True replaced by an ALiBi score_mod (slopes a CUDA tensor) and a
    strided mask_mod that keeps the diagonal."""
    opts = dict(opts)
    if opts.pop("mods", False):
        slopes = torch.linspace(0.01, 0.1, heads, device="cuda")
        opts.update(score_mod=lambda s, b, h, q, kv: s - slopes[h] * (q - kv),
                    mask_mod=lambda b, h, q, kv: (q - kv) % 7 != 3)
    return opts


def _check_all(out, lse, ring_inputs, want, want_lse, whole_inputs):
    """out, lse and the inputs' gradients of the ring against the whole call's."""
    _close("out", out, want)
    assert (lse - want_lse).abs().max().item() < 1e-2
    for name, a, b in zip(("dq", "dk", "dv"), ring_inputs, whole_inputs):
        _close(name, a.grad, b.grad)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=False, window=(300, 200)),
                                  dict(causal=True, mods=True)], ids=["causal", "window", "mods"])
def test_ring_on_one_gpu_matches_the_whole(nccl, opts):
    seed = int(np.random.default_rng().integers(1 << 31))
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, S, Hq, Hk, D = 2, 2048, 8, 2, 128
    Q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    K, V = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dO = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    opts = _with_mods(opts, Hq)
    causal = opts["causal"]
    q, k, v = (axd.shard(x, causal=causal).requires_grad_() for x in (Q, K, V))
    out, lse = axd.ring_attention(q, k, v, return_lse=True, **opts)
    out.backward(axd.shard(dO, causal=causal))
    Qw, Kw, Vw = (x.clone().requires_grad_() for x in (Q, K, V))
    want, want_lse = axt.attention(Qw, Kw, Vw, return_lse=True, **dict(opts, causal=causal and "top_left"))
    want.backward(dO)
    _check_all(out, lse, (q, k, v), want, want_lse, (Qw, Kw, Vw))


@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=False, window=(200, 0), mods=True)],
                         ids=["causal", "window_mods"])
def test_varlen_ring_on_one_gpu_matches_the_whole(nccl, opts):
    """ring_varlen_attention (the all-gather variant) on CUDA tensors in a one-rank NCCL group:
    out, lse and dq, dk, dv against attnext.torch.varlen_attention on the same packed batch."""
    seed = int(np.random.default_rng().integers(1 << 31))
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [700, 1, 1500, 0, 1847]                       # documents of a packed batch, T = 4048
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    T, Hq, Hk, D = sum(lengths), 8, 2, 128
    Q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    K, V = (torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dO = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    opts = _with_mods(opts, Hq)
    q, k, v = (axd.shard(x, dim=0).requires_grad_() for x in (Q, K, V))
    out, lse = axd.ring_varlen_attention(q, k, v, cu, max(lengths), return_lse=True, **opts)
    out.backward(axd.shard(dO, dim=0))
    Qw, Kw, Vw = (x.clone().requires_grad_() for x in (Q, K, V))
    want, want_lse = axt.varlen_attention(Qw, Kw, Vw, cu, cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                                          return_lse=True, **opts)
    want.backward(dO)
    _check_all(out, lse, (q, k, v), want, want_lse, (Qw, Kw, Vw))


def test_the_example_on_two_gpus(gpu):
    """examples/ring_attention.py under torchrun on two GPUs (NCCL, bf16, causal, an ALiBi
    score_mod in global positions): the ring's out and gradients, gathered whole, within bf16
    rounding of one GPU's. Skipped on a machine with one GPU."""
    from test_distributed import example_diffs
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: NCCL takes one rank a GPU")
    diffs = example_diffs(timeout=300)
    assert all(d < 5e-2 for d in diffs.values()), diffs    # bf16 values of size ~1-4
