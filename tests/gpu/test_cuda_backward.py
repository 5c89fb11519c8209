"""The CUDA backward (`pytest -m gpu`) against the float64 reference's analytic gradients.

The forward's out and lse come from the reference (out rounded to the input dtype, as a forward
stores it), so these tests hold the backward kernels alone to the reference; one test runs the
GPU forward first. Every check is conftest's three-way tolerance (accuracy.compare_grads with the
rounded-out allowance), plus exact zeros where the contract says exactly zero: padding rows,
rows after cu_seqlens[-1], rows that keep no key, and bit-identical reruns (deterministic=True).
"""
import numpy as np
import pytest

import attnext
from conftest import (BF16, F16, compare_grads, dead_rows, entry_points, make_qkv, make_varlen_qkv,
                      randn)

pytestmark = pytest.mark.gpu

HEAD_DIMS = [(64, 64), (128, 128), (59, 40), (96, 96), (192, 128), (256, 256)]
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (3, 1)}
LENGTHS = [(1, 1), (113, 203), (127, 129), (129, 127), (257, 129), (1, 257)]
CAUSAL = [False, True, "top_left"]


def _grads(q, k, v, rng, *, varlen=None, deterministic=True, gpu_forward=False, **opts):
    """Runs the GPU backward on the reference forward's (rounded) out and lse (gpu_forward: on
    the GPU forward's) and checks dq, dk, dv and dbias against the reference; returns (grads,
    reference grads, (dout, out, lse))."""
    dtype = np.dtype(q.dtype)
    lengths = dict(varlen or {})
    fwd, bwd, rfwd, rbwd = entry_points(varlen)
    r_out, r_lse = rfwd(q, k, v, **lengths, return_lse=True, **opts)
    if gpu_forward:
        out, lse = fwd(q, k, v, **lengths, return_lse=True, device="cuda", **opts)
    else:
        out, lse = r_out.astype(dtype), r_lse.astype(np.float32)
    dout = randn(rng, out.shape, dtype)
    g = bwd(dout, q, k, v, out, lse, **lengths, device="cuda", deterministic=deterministic, **opts)
    rg = rbwd(dout, q, k, v, out, lse, **lengths, **opts)
    problems = compare_grads(g, rg, q, k, v, dout, out, r_out, varlen, opts)
    assert not problems, "\n".join(problems)
    dead = dead_rows(r_lse, varlen is not None, opts.get("layout", "bshd"))
    assert (g.dq[dead] == 0).all(), "dq: a row that keeps no key is not exactly 0"
    return g, rg, (dout, out, lse)


# --- head dims, both dtypes ---

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, dv", HEAD_DIMS, ids=[f"d{a}_dv{b}" for a, b in HEAD_DIMS])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_head_dims(dtype, d, dv, causal, rng):
    q, k, v = make_qkv(rng, 2, 131, 197, 4, 2, d, dv, dtype)
    _grads(q, k, v, rng, causal=causal)


# --- the stacked grid: heads x causal x window x lengths ---

@pytest.mark.parametrize("sq, sk", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
@pytest.mark.parametrize("window", [None, (19, 7), (0, -1)], ids=["nowin", "win19_7", "win0_inf"])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_grid(heads, causal, window, sq, sk, rng):
    hq, hk = HEADS[heads]
    q, k, v = make_qkv(rng, 2, sq, sk, hq, hk, 64, 64, BF16)
    _grads(q, k, v, rng, causal=causal, window=window)


@pytest.mark.parametrize("sq, sk", [(256, 256), (200, 64), (64, 300)], ids=["256x256", "200x64", "64x300"])
def test_long_window_and_layout(sq, sk, rng):
    """Tiles wholly inside and wholly outside the band (skipped, not masked), bhsd layout."""
    q, k, v = make_qkv(rng, 1, sq, sk, 4, 2, 128, 128, F16, layout="bhsd")
    _grads(q, k, v, rng, layout="bhsd", causal=True, window=(70, 0))
    _grads(q, k, v, rng, layout="bhsd", window=(33, 45))


# --- score options ---

@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_softcap_alibi_mask(dtype, rng):
    q, k, v = make_qkv(rng, 2, 113, 150, 4, 2, 64, 64, dtype)
    _grads(q, k, v, rng, softcap=2.0, causal=True)
    _grads(q, k, v, rng, alibi_slopes=rng.random((2, 4)).astype(np.float32), window=(40, 10))
    mask = rng.random((2, 1, 113, 150)) > 0.3
    mask[0, 0, 5] = False                                  # a row that keeps nothing
    _grads(q, k, v, rng, mask=mask)


BIAS_SHAPES = {"full": (2, 4, 113, 150), "batch1": (1, 4, 113, 150), "cols": (2, 1, 1, 150),
               "rows": (113, 1), "kvheads": (2, 113, 150), "scalar": (1, 1, 1, 1), "2d": (113, 150),
               "heads_rows": (1, 4, 113, 1)}


@pytest.mark.parametrize("bias_dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", list(BIAS_SHAPES))
def test_bias_shapes(shape, bias_dtype, rng):
    """dbias summed over every broadcast pattern (batch, heads, rows, columns), GQA."""
    q, k, v = make_qkv(rng, 2, 113, 150, 4, 2, 64, 64, BF16)
    bias = randn(rng, BIAS_SHAPES[shape], bias_dtype)
    _grads(q, k, v, rng, bias=bias, causal=True)


def test_everything_at_once(rng):
    """bias (broadcast, non-contiguous), mask, alibi, softcap, window, GQA, bhsd, element loads."""
    q, k, v = make_qkv(rng, 2, 77, 150, 6, 2, 59, 40, F16, layout="bhsd")
    bias = randn(rng, (6, 150, 1), np.float32).transpose(0, 2, 1)   # (6, 1, 150), strided
    mask = rng.random((2, 1, 77, 150)) > 0.2
    slopes = rng.random(6).astype(np.float32)
    _grads(q, k, v, rng, layout="bhsd", bias=bias, mask=mask, alibi_slopes=slopes, softcap=5.0,
           window=(40, 3), causal=True)


# --- lengths: seqlens, varlen with empty sequences, seqused and trailing padding ---

def test_seqlens(rng):
    q, k, v = make_qkv(rng, 3, 150, 140, 4, 2, 64, 64, BF16)
    sq, sk = np.array([150, 0, 37]), np.array([100, 140, 0])
    g, _, _ = _grads(q, k, v, rng, seqlens_q=sq, seqlens_k=sk, causal=True)
    for b in range(3):
        assert (g.dq[b, sq[b]:] == 0).all() and (g.dk[b, sk[b]:] == 0).all() and (g.dv[b, sk[b]:] == 0).all()
    assert (g.dq[2] == 0).all() and (g.dk[1] == 0).all()


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal", "top_left"])
@pytest.mark.parametrize("dv", [64, 128])
def test_varlen(causal, dv, rng):
    cu_q = np.array([0, 50, 50, 179, 180, 300], np.int32)      # an empty sequence; 20 rows after
    cu_k = np.array([0, 70, 71, 71, 241, 290], np.int32)      # an empty key sequence; 10 after
    used_q = np.array([50, 0, 100, 1, 120], np.int32)         # rows 129..178 of sequence 2 unused
    used_k = np.array([64, 1, 0, 170, 40], np.int32)
    q, k, v = make_varlen_qkv(rng, 320, 300, 4, 2, dv, dv, BF16)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
    g, _, _ = _grads(q, k, v, rng, varlen=varlen, causal=causal, window=(90, 30) if causal else None)
    real_q = np.zeros(320, bool)
    real_k = np.zeros(300, bool)
    for b in range(5):
        real_q[cu_q[b]:cu_q[b] + used_q[b]] = True
        real_k[cu_k[b]:cu_k[b] + used_k[b]] = True
    assert (g.dq[~real_q] == 0).all(), "dq: padding rows are not exactly 0"
    assert (g.dk[~real_k] == 0).all() and (g.dv[~real_k] == 0).all(), "dk/dv: padding rows are not 0"


@pytest.mark.parametrize("d", [64, 128])
def test_nan_in_rows_past_a_sequence_never_reaches_dk_dv(d, rng, monkeypatch):
    """q's and dout's rows past a sequence's used rows (seqused_q's padding, the rows after
    cu_seqlens_q[-1]) hold NaN. On Hopper the dK/dV kernel brings a tile whose rows past the
    sequence lie inside the tensor by cp.async, which zeroes them (a bulk copy would bring the
    NaN, and 0 * NaN would reach dK and dV): every gradient matches the reference, the padding
    rows' dq is exactly 0, and the bits are those of the cp.async loads everywhere
    (ATTNEXT_BWD_TMA=0)."""
    cu_q, used_q = np.array([0, 150, 300], np.int32), np.array([130, 150], np.int32)
    cu_k = np.array([0, 160, 300], np.int32)
    q, k, v = make_varlen_qkv(rng, 340, 300, 4, 2, d, d, BF16)
    real = np.zeros(340, bool)
    real[0:130] = real[150:300] = True
    q[~real] = np.nan
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q)
    _, bwd, rfwd, rbwd = entry_points(varlen)
    r_out, r_lse = rfwd(q, k, v, **varlen, return_lse=True, causal=True)
    out, lse = r_out.astype(BF16), r_lse.astype(np.float32)
    dout = randn(rng, out.shape, BF16)
    dout[~real] = np.nan
    g = bwd(dout, q, k, v, out, lse, **varlen, device="cuda", causal=True)
    rg = rbwd(dout, q, k, v, out, lse, **varlen, causal=True)
    problems = compare_grads(g, rg, q, k, v, dout, out, r_out, varlen, dict(causal=True))
    assert not problems, "\n".join(problems)
    assert np.isfinite(g.dk).all() and np.isfinite(g.dv).all() and (g.dq[~real] == 0).all()
    monkeypatch.setenv("ATTNEXT_BWD_TMA", "0")
    loads = bwd(dout, q, k, v, out, lse, **varlen, device="cuda", causal=True)
    assert all(np.array_equal(a, b) for a, b in zip(_bits(g), _bits(loads)))


def test_varlen_bias_and_no_sequences(rng):
    cu_q = np.array([0, 40, 41, 140], np.int32)
    cu_k = np.array([0, 0, 60, 200], np.int32)
    q, k, v = make_varlen_qkv(rng, 150, 210, 4, 4, 64, 64, F16)
    bias = randn(rng, (3, 1, 99, 140), np.float32)
    _grads(q, k, v, rng, varlen=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), bias=bias, causal=True)
    empty = np.zeros(1, np.int32)
    g, _, _ = _grads(q, k, v, rng, varlen=dict(cu_seqlens_q=empty, cu_seqlens_k=empty))
    assert (g.dq == 0).all() and (g.dk == 0).all() and (g.dv == 0).all()


# --- determinism, the atomic path, the GPU forward ---

def _bits(g):
    return [np.asarray(x).view(np.uint8).copy() for x in g[:4] if x is not None]


def test_deterministic(rng):
    """The same bits on every run, with GQA sums and a broadcast bias (ordered reductions)."""
    q, k, v = make_qkv(rng, 2, 300, 333, 6, 2, 128, 128, BF16)
    bias = randn(rng, (1, 6, 1, 333), np.float32)
    g, _, (dout, out, lse) = _grads(q, k, v, rng, bias=bias, causal=True)
    for _ in range(2):
        again = attnext.attention_backward(dout, q, k, v, out, lse, bias=bias, causal=True, device="cuda")
        assert all(np.array_equal(a, b) for a, b in zip(_bits(g), _bits(again)))


@pytest.mark.parametrize("mode", ["atomic", "ordered"])
@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (128, 64), (59, 40), (256, 256)],
                         ids=["d64", "d128", "d128_dv64", "d59_40", "d256"])
def test_dq_added_by_the_dkdv_kernel(d, dv, kernel, mode, rng, monkeypatch):
    """dq as additions of dS K into dq_accum from the dK/dV kernel (select.bwd_dq_mode), by
    plain atomics (deterministic=False) or in a fixed order (then the same bits on a second run),
    within the same tolerance; on Hopper through attn_bwd_sm90.cu ("default": the warp-specialised
    kernel at D = 128 and D = Dv = 64, the dQ kernel elsewhere) and attn_bwd.cu ("mma_sync": atomic only, ordered
    falls back to the dQ kernel)."""
    monkeypatch.setenv("ATTNEXT_BWD_DQ", mode)
    if kernel == "mma_sync":
        monkeypatch.setenv("ATTNEXT_BWD_SM90", "0")
    det = mode == "ordered"
    q, k, v = make_qkv(rng, 2, 257, 190, 4, 2, d, dv, BF16)
    g, _, (dout, out, lse) = _grads(q, k, v, rng, deterministic=det, causal=True)
    if det:
        again = attnext.attention_backward(dout, q, k, v, out, lse, causal=True, device="cuda")
        assert all(np.array_equal(a, b) for a, b in zip(_bits(g), _bits(again)))
    cu = np.array([0, 0, 100, 257], np.int32)
    qv, kv, vv = (x[0] for x in (q, k, v))
    cu_k = np.array([0, 10, 10, 150], np.int32)
    _grads(qv, kv, vv, rng, varlen=dict(cu_seqlens_q=cu, cu_seqlens_k=cu_k), deterministic=det)
    _grads(q, k, v, rng, deterministic=det, window=(70, 3), causal="bottom_right")
    _grads(q, k, v, rng, deterministic=det)


@pytest.mark.parametrize("write_last, chains", [("0", "1"), ("0", "2"), ("0", "4"), ("1", "2")],
                         ids=["dq_convert", "two_chains", "four_chains", "last_turn_writes"])
@pytest.mark.parametrize("d", [64, 128])
def test_ordered_dq_after_a_larger_call(d, write_last, chains, rng, monkeypatch):
    """The ordered mode's first turn at a query tile stores into dq_accum, which nothing zeroes
    (the stream's scratch still holds an earlier call's sums): after a larger call, dq matches the
    reference and is exactly 0 on the tiles no key block sees (bottom-right causal and a window
    with Sq > Sk leave whole 64- and 128-row tiles without keys), whether the last turn at each
    tile writes dq (short keys) or attn_bwd_dq_convert does (ATTNEXT_BWD_DQ_WRITE), the latter
    with the turns in 1, 2 or 4 chains (ATTNEXT_BWD_DQ_CHAINS; a tile seen by fewer key blocks
    than chains leaves copies of dq_accum unwritten: 200 keys are two blocks, a narrow window
    one), the same bits on a second run; with a document mask_mod, whose blocks may pass their
    turns, the host zeroes dq_accum first (one chain)."""
    monkeypatch.setenv("ATTNEXT_BWD_DQ_WRITE", write_last)
    monkeypatch.setenv("ATTNEXT_BWD_DQ_CHAINS", chains)
    big = make_qkv(rng, 2, 1024, 1024, 4, 4, d, d, BF16)
    g, _, (dout, out, lse) = _grads(*big, rng)
    again = attnext.attention_backward(dout, *big, out, lse, device="cuda")
    assert all(np.array_equal(a, b) for a, b in zip(_bits(g), _bits(again)))
    q, k, v = make_qkv(rng, 2, 700, 200, 4, 2, d, d, BF16)
    _grads(q, k, v, rng, causal="bottom_right")
    _grads(q, k, v, rng, window=(30, 0))
    _grads(*big, rng, causal=True)
    # varlen: an empty sequence, unused rows (seqused), packed rows after the last sequence
    cu_q = np.array([0, 50, 50, 179, 180, 300], np.int32)
    cu_k = np.array([0, 70, 71, 71, 241, 290], np.int32)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=np.array([50, 0, 100, 1, 120], np.int32),
                  seqused_k=np.array([64, 1, 0, 170, 40], np.int32))
    g, _, _ = _grads(*make_varlen_qkv(rng, 320, 300, 4, 2, d, d, BF16), rng, varlen=varlen, causal=True,
                     window=(90, 30))
    assert (g.dq[300:] == 0).all(), "dq: the packed rows after the last sequence are not 0"
    # top-left causal with more keys than rows and no left window: no row keeps a key, yet the
    # key block at 0 is still sent to the tile
    _grads(*make_qkv(rng, 2, 7, 22, 4, 2, d, d, BF16), rng, causal="top_left", window=(0, -1))
    doc = np.repeat(np.arange(4), [300, 1, 400, 323]).astype(np.int32)
    _grads(*big, rng, mask_mod=lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx])


@pytest.mark.parametrize("chains", ["2", "32"])
@pytest.mark.parametrize("d", [64, 128])
def test_ordered_dq_chains_across_sem_words(d, chains, rng, monkeypatch):
    """The ordered turns in 2 and 32 chains over 4200 keys: 33 key blocks, so a query tile's turn
    bits span two of dq_sem's words (a chain's bits in the second word, and in 32 chains one bit a
    word); dq against the reference, the same bits on a second run, and on Hopper the chains the
    lab asked for in the dK/dV kernel and the convert that adds their copies."""
    from attnext.cuda import backend, nvrtc
    monkeypatch.setenv("ATTNEXT_BWD_DQ_CHAINS", chains)
    built = []
    function = nvrtc.function

    def spy(kernel, name, defines, *rest):
        if name in ("attn_bwd_dkdv_ws_sm90", "attn_bwd_dq_convert"):
            built.append((name, defines.get("DQ_CHAINS", 1)))
        return function(kernel, name, defines, *rest)
    monkeypatch.setattr(nvrtc, "function", spy)
    backend.clear_plans()
    q, k, v = make_qkv(rng, 1, 300, 4200, 2, 2, d, d, BF16)
    g, _, (dout, out, lse) = _grads(q, k, v, rng)
    again = attnext.attention_backward(dout, q, k, v, out, lse, device="cuda")
    assert all(np.array_equal(a, b) for a, b in zip(_bits(g), _bits(again)))
    if backend.device_arch(0) == "sm_90a":
        assert sorted(set(built)) == [("attn_bwd_dkdv_ws_sm90", int(chains)), ("attn_bwd_dq_convert", int(chains))], built


@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "bottom_right"])
@pytest.mark.parametrize("d", [64, 128])
def test_ordered_dq_turns_past_32_sem_words(d, causal, rng):
    """A query tile seen by 1100 key blocks of 128 keys (140,000 keys): its turn bits span 35 of
    dq_sem's words, more than the writer's warp polls in one round (a lane a word,
    attn_bwd_tile.cuh: sem_wait), so the turns of the blocks more than 32 words under the last
    poll in two rounds; dq against the reference and the same bits on a second run."""
    q, k, v = make_qkv(rng, 1, 70, 140_000, 1, 1, d, d, BF16)
    g, _, (dout, out, lse) = _grads(q, k, v, rng, causal=causal)
    again = attnext.attention_backward(dout, q, k, v, out, lse, causal=causal, device="cuda")
    assert all(np.array_equal(a, b) for a, b in zip(_bits(g), _bits(again)))


def test_after_gpu_forward(rng):
    q, k, v = make_qkv(rng, 2, 200, 177, 4, 1, 96, 96, F16)
    _grads(q, k, v, rng, gpu_forward=True, causal=True)


# --- CUDA arrays in place ---

def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    q, k, v = make_qkv(rng, 2, 129, 140, 4, 2, 64, 64, BF16)
    bias = randn(rng, (4, 1, 140), np.float32)
    g, _, (dout, out, lse) = _grads(q, k, v, rng, bias=bias, causal=True)

    def t(x):
        dt = torch.bfloat16 if x.dtype == BF16 else torch.float32
        return torch.from_numpy(np.asarray(x, np.float32)).to("cuda", dt)

    args = [t(x) for x in (dout, q, k, v, out, lse)]
    before = [x.clone() for x in args]
    tb = t(bias)
    gt = attnext.attention_backward(*args, bias=tb, causal=True)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(args, before)), "an input was modified"
    for name in ("dq", "dk", "dv", "dbias"):
        x = getattr(gt, name)
        assert isinstance(x, torch.Tensor) and x.is_cuda, (name, type(x))
        want = getattr(g, name)
        assert tuple(x.shape) == want.shape
        assert np.array_equal(x.float().cpu().numpy(), np.asarray(want, np.float32)), name


@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (128, 64), (64, 128)],
                         ids=["d64", "d128", "d128_dv64", "d64_dv128"])
def test_backward_kernels_with_every_option(kernel, d, dv, rng, monkeypatch):
    """On Hopper these head dims run attn_bwd_sm90 (wgmma dK, dV, dQ) by default; "mma_sync"
    forces attn_bwd.cu: both under every option on tile edges, GQA, and a packed batch."""
    if kernel == "mma_sync":
        monkeypatch.setenv("ATTNEXT_BWD_SM90", "0")
    q, k, v = make_qkv(rng, 2, 300, 333, 6, 2, d, dv, BF16)
    _grads(q, k, v, rng)
    _grads(q, k, v, rng, causal=True)
    _grads(q, k, v, rng, causal="top_left", window=(70, 0))
    bias = randn(rng, (6, 300, 1), np.float32)
    mask = rng.random((2, 1, 300, 333)) > 0.1
    slopes = rng.random(6).astype(np.float32)
    _grads(q, k, v, rng, bias=bias, mask=mask, alibi_slopes=slopes, softcap=5.0, window=(100, 7), causal=True)
    cu_q = np.array([0, 1, 130, 130, 400], np.int32)
    cu_k = np.array([0, 200, 200, 329, 600], np.int32)
    q, k, v = make_varlen_qkv(rng, 410, 600, 4, 1, d, dv, F16)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=np.array([150, 0, 129, 33], np.int32))
    g, _, _ = _grads(q, k, v, rng, varlen=varlen, causal=True)
    assert (g.dq[400:] == 0).all() and (g.dk[600:] == 0).all() and (g.dv[600:] == 0).all()
