"""attnext/band.py (a mask_mod's band: the conjuncts that bound kv_idx - q_idx) and the
backends' use of it (attnext/lower.py: lower_band, that band moved into the call's causal /
window, and documents, a document mask over contiguous runs run as varlen attention).

On any machine: the split is exact (the mask_mod equals band & rest at every input), it finds
what it should and leaves the rest, and lower_band keeps a call's kept pairs (docs/design.md,
semantics 6) exactly over random shapes, options and mask_mods; the CPU backend lowers them
too, against the reference. Under `-m gpu`: the CUDA results with lowered bands against the
reference, forward and backward.
"""
import types

import numpy as np
import pytest

from attnext.mods import band, lower, trace
from conftest import BF16, check_backend, make_qkv, make_varlen_qkv

DOC = np.repeat(np.arange(5), [7, 13, 1, 20, 19])       # 60 positions, five documents


def _masks():
    """name -> mask_mod: bands, bands with a rest, and masks with no band."""
    doc = DOC
    return {
        "causal": lambda b, h, q, kv: q >= kv,
        "window": lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 9),
        "offset_band": lambda b, h, q, kv: (kv - q >= -5) & (kv <= q + 7),
        "doc_causal": lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q),
        "doc_window": lambda b, h, q, kv: (q - kv < 12) & (doc[q] == doc[kv]) & (q >= kv),
        "scaled": lambda b, h, q, kv: (2 * (q - kv) + 3 >= 1) & -(kv - q) - 4 < 7,
        "head_and_band": lambda b, h, q, kv: (h < 2) & (kv - 3 <= q) & (q % 3 != 1),
        "np_and": lambda b, h, q, kv: np.logical_and(kv <= q, q - kv <= 6),
        "or": lambda b, h, q, kv: (kv <= q) | (kv < 4),
        "not": lambda b, h, q, kv: ~(kv > q),
        "coefficient_2": lambda b, h, q, kv: kv <= 2 * q,
        "doc": lambda b, h, q, kv: doc[q] == doc[kv],
        "beside_diagonal": lambda b, h, q, kv: (kv <= q - 3) & (kv >= q - 20),
        "right_of_diagonal": lambda b, h, q, kv: kv >= q + 2,
        # int64 wraps at kv - q >= 1: the mask is kv <= q, not the bound kv - q >= 1 - 2**63
        "huge_constant": lambda b, h, q, kv: kv - q + (2 ** 63 - 1) >= 0,
    }


def _grid(n=60):
    return np.arange(n)[:, None], np.arange(n)[None, :]


def _eval(tm, h, q, kv):
    return np.broadcast_to(trace.evaluate(tm, None, 0, h, q, kv), np.broadcast_shapes(q.shape, kv.shape))


@pytest.mark.parametrize("name", sorted(_masks()))
def test_split_is_exact(name):
    tm = trace.trace_mask_mod(_masks()[name])
    q, kv = _grid()
    for take_lo in (True, False):
        for take_hi in (True, False):
            b = band.split(tm, take_lo, take_hi)
            for h in range(3):
                got = np.ones((60, 60), bool)
                if b.lo is not None:
                    got &= kv - q >= b.lo
                if b.hi is not None:
                    got &= kv - q <= b.hi
                if b.rest is not None:
                    got &= _eval(b.rest, h, q, kv)
                np.testing.assert_array_equal(got, _eval(tm, h, q, kv), err_msg=f"{name} h={h}")


@pytest.mark.parametrize("name, lo, hi, rest", [
    ("causal", None, 0, None),
    ("window", -8, 0, None),
    ("offset_band", -5, 7, None),
    ("doc_causal", None, 0, "(doc[q_idx] == doc[kv_idx])"),
    ("doc_window", -11, 0, "(doc[q_idx] == doc[kv_idx])"),
    ("np_and", -6, 0, None),
    ("head_and_band", None, 3, "((h < 2) & ((q_idx % 3) != 1))"),
    ("or", None, None, "((kv_idx <= q_idx) | (kv_idx < 4))"),
    ("coefficient_2", None, None, "(kv_idx <= (2 * q_idx))"),
    ("doc", None, None, "(doc[q_idx] == doc[kv_idx])"),
    ("huge_constant", None, None, "(((kv_idx - q_idx) + 9223372036854775807) >= 0)"),
])
def test_split_finds_the_band_and_leaves_the_rest(name, lo, hi, rest):
    b = band.split(trace.trace_mask_mod(_masks()[name]))
    assert (b.lo, b.hi) == (lo, hi)
    assert (None if b.rest is None else trace.format_expr(b.rest.out)) == rest


def test_rest_keys_follow_the_structure():
    """The rest is a Traced of its own: its key is that of the same conjuncts traced alone."""
    doc = DOC
    with_band = trace.trace_mask_mod(lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q))
    alone = trace.trace_mask_mod(lambda b, h, q, kv: doc[q] == doc[kv])
    assert band.split(with_band).rest.key == alone.key
    assert band.split(with_band).rest.arrays.keys() == {"doc"}


def _kept(o, lq, lk):
    """docs/design.md semantics 6's kept pairs of the causal / window options alone."""
    r, c = np.arange(lq)[:, None], np.arange(lk)[None, :]
    d, diag = c - r, lk - lq
    keep = np.ones((lq, lk), bool)
    if o.causal_code == 1:
        keep &= d <= diag
    if o.causal_code == 2:
        keep &= d <= 0
    if o.window_left >= 0:
        keep &= d >= diag - o.window_left
    if o.window_right >= 0:
        keep &= d <= diag + o.window_right
    return keep


def _problem(sq, sk, causal_code, window, varlen=None):
    cu = None if varlen is None else np.asarray(varlen[0], np.int32)
    cu_k = None if varlen is None else np.asarray(varlen[1], np.int32)
    return types.SimpleNamespace(Sq=sq, Sk=sk, causal_code=causal_code, window_left=window[0],
                                 window_right=window[1], varlen=varlen is not None, cu_q=cu, cu_k=cu_k,
                                 used_q=None, used_k=None, device_lengths=False)


def test_lowering_keeps_the_kept_pairs():
    """Random shapes, causal / window options and mask_mods: the kept pairs after lower_band
    (its window, its causal, the rest it returns) are those before, in every case."""
    rng = np.random.default_rng(3)
    masks = _masks()
    lowered = 0
    for _ in range(400):
        sq, sk = (int(x) for x in rng.integers(1, 60, 2))
        if rng.random() < 0.4:
            sk = sq
        causal = int(rng.integers(0, 3))
        window = tuple(int(x) if rng.random() < 0.5 else -1 for x in rng.integers(0, 30, 2))
        name = str(rng.choice(sorted(masks)))
        tm = trace.trace_mask_mod(masks[name])
        o = _problem(sq, sk, causal, window)
        before = _kept(o, sq, sk) & _eval(tm, 1, *(a[:n] if a.shape[0] > 1 else a[:, :n]
                                                    for a, n in zip(_grid(), (sq, sk))))
        rest = lower.lower_band(o, tm)
        lowered += rest is not tm
        q, kv = np.arange(sq)[:, None], np.arange(sk)[None, :]
        after = _kept(o, sq, sk) & (True if rest is None else _eval(rest, 1, q, kv))
        np.testing.assert_array_equal(after, before, err_msg=f"{name} {sq}x{sk} causal={causal} window={window}")
        assert o.window_left >= -1 and o.window_right >= -1
    assert lowered > 100      # the test saw many lowerings, not only the cases left alone


@pytest.mark.parametrize("name, sq, sk, opts, want", [
    ("window", 50, 50, dict(), (1, 8, -1, None)),                       # only a band: no mask_mod left
    ("causal", 50, 50, dict(causal_code=1), (1, -1, -1, None)),
    ("doc_causal", 50, 50, dict(), (1, -1, -1, "(doc[q_idx] == doc[kv_idx])")),
    ("window", 40, 50, dict(), (0, 18, -1, "keep_upper")),             # Lk > Lq: c <= r is left of c = r + 10
    ("offset_band", 40, 50, dict(), (0, 15, -1, "keep_upper")),        # kv <= q + 7 is left of it too
    ("right_of_diagonal", 50, 50, dict(), (0, -1, -1, "keep")),        # c >= r + 2: no window says it
    ("causal", 50, 40, dict(), (0, -1, 10, None)),                     # Lq > Lk: c <= r is right of c = r - 10
    ("window", 50, 50, dict(window_left=3, window_right=-1), (1, 3, -1, None)),   # the narrower side wins
])
def test_lowering_fields(name, sq, sk, opts, want):
    o = _problem(sq, sk, opts.get("causal_code", 0), (opts.get("window_left", -1), opts.get("window_right", -1)))
    tm = trace.trace_mask_mod(_masks()[name])
    rest = lower.lower_band(o, tm)
    assert (o.causal_code, o.window_left, o.window_right) == want[:3]
    if want[3] == "keep":
        assert rest is tm
    elif want[3] == "keep_upper":         # the upper bound stays in mask_mod, the lower is gone
        assert rest is not None and band.split(rest).hi is not None and band.split(rest).lo is None
    else:
        assert (None if rest is None else trace.format_expr(rest.out)) == want[3]


def test_lowering_needs_one_diagonal():
    """seqused, or varlen with cu_seqlens_q != cu_seqlens_k: each sequence has its own Lk - Lq,
    so the band stays in mask_mod."""
    tm = trace.trace_mask_mod(_masks()["window"])
    o = _problem(50, 50, 0, (-1, -1))
    o.used_q = np.array([30, 50], np.int32)
    assert lower.lower_band(o, tm) is tm and o.window_left == -1
    o = _problem(90, 90, 0, (-1, -1), ([0, 40, 90], [0, 50, 90]))
    assert lower.lower_band(o, tm) is tm
    o = _problem(90, 90, 0, (-1, -1), ([0, 40, 90], [0, 40, 90]))
    assert lower.lower_band(o, tm) is None and (o.causal_code, o.window_left, o.window_right) == (1, 8, -1)


def _doc_problem(**kw):
    o = dict(varlen=False, B=1, Sq=60, Sk=60, used_q=None, used_k=None, bias4=None, mask4=None, alibi=None,
             device_lengths=False)
    o.update(kw)
    return types.SimpleNamespace(**o)


def _doc_mask(doc):
    return trace.trace_mask_mod(lambda b, h, q, kv: doc[q] == doc[kv])


def test_documents_are_the_runs():
    cu = lower.documents(_doc_problem(), _doc_mask(DOC))
    np.testing.assert_array_equal(cu, [0, 7, 20, 21, 41, 60])
    assert cu.dtype == np.int32
    swapped = trace.trace_mask_mod(lambda b, h, q, kv: DOC[kv] == DOC[q])
    np.testing.assert_array_equal(lower.documents(_doc_problem(), swapped), cu)
    longer = np.concatenate([DOC, np.full(10, 9)])          # the array may run past Sq
    np.testing.assert_array_equal(lower.documents(_doc_problem(), _doc_mask(longer)), cu)
    one = np.zeros(60, np.int8)
    np.testing.assert_array_equal(lower.documents(_doc_problem(), _doc_mask(one)), [0, 60])


@pytest.mark.parametrize("why", ["repeated_value", "float_ids", "short_array", "batch", "cross", "empty",
                                 "bias", "varlen", "seqused", "not_eq", "two_arrays", "offset_index"])
def test_documents_refused(why):
    doc, o = DOC.copy(), _doc_problem()
    tm = None
    if why == "repeated_value":
        doc[50:] = 0                        # document 0 again at the end: not contiguous runs
    elif why == "float_ids":
        doc = doc.astype(np.float32)        # NaN != NaN: not an equivalence
    elif why == "short_array":
        doc = doc[:50]
    elif why == "batch":
        o.B = 2
    elif why == "cross":
        o.Sk = 70
    elif why == "empty":
        o.Sq = o.Sk = 0
    elif why == "bias":
        o.bias4 = object()
    elif why == "varlen":
        o.varlen = True
    elif why == "seqused":
        o.used_k = np.array([50], np.int32)
    elif why == "not_eq":
        tm = trace.trace_mask_mod(lambda b, h, q, kv: DOC[q] <= DOC[kv])
    elif why == "two_arrays":
        other = DOC.copy()
        tm = trace.trace_mask_mod(lambda b, h, q, kv: DOC[q] == other[kv])
    elif why == "offset_index":
        tm = trace.trace_mask_mod(lambda b, h, q, kv: DOC[q] == DOC[kv + 1])
    assert lower.documents(o, tm or _doc_mask(doc)) is None


# --- on the GPU -----------------------------------------------------------------------------------

def _named_mask(name):
    """_masks()[name], or "doc_repeated": a document mask whose id 0 comes back after the others
    (not contiguous runs: kept as a mask_mod)."""
    if name != "doc_repeated":
        return _masks()[name]
    doc = DOC.copy()
    doc[45:] = 0
    return lambda b, h, q, kv: doc[q] == doc[kv]


def _spy(monkeypatch, name):
    """Every result of lower.<name>, in a list."""
    seen, real = [], getattr(lower, name)
    monkeypatch.setattr(lower, name, lambda *a: seen.append(real(*a)) or seen[-1])
    return seen


@pytest.mark.parametrize("name, opts", [
    ("doc", dict()), ("doc_causal", dict()), ("doc", dict(causal=True)), ("doc_window", dict()),
    ("doc", dict(window=(5, 2), layout="bhsd")), ("doc_repeated", dict(causal=True)),
    ("window", dict()), ("offset_band", dict(causal=True))])
def test_lowered_on_the_cpu(name, opts, rng, monkeypatch):
    """The CPU backend lowers as the CUDA one does (api._cpu_mods): bands into causal / window,
    documents over contiguous runs into varlen; forward and backward against the reference."""
    bands, found = _spy(monkeypatch, "lower_band"), _spy(monkeypatch, "_documents")
    mask_mod = _named_mask(name)
    q, k, v = make_qkv(rng, 1, 60, 60, 4, 2, 16, 16, np.float32, opts.get("layout", "bshd"))
    check_backend(q, k, v, rng, mask_mod=mask_mod, **opts)
    assert bands, "the forward and the backward lower the band first"
    if name in ("window", "offset_band"):
        assert all(rest is None for rest in bands) and not found, (bands, found)
    else:
        assert found and all((cu is None) == (name == "doc_repeated") for cu in found), found


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("shape", [(60, 60), (45, 60), (60, 41)], ids=["square", "sk_longer", "sq_longer"])
@pytest.mark.parametrize("name, opts", [
    ("window", dict()), ("doc_causal", dict()), ("offset_band", dict(causal=True)),
    ("doc_window", dict(window=(20, 3))), ("head_and_band", dict(causal="top_left")),
    ("beside_diagonal", dict())])
def test_lowered_bands_on_the_gpu(name, opts, shape, d, gpu, rng, torch, monkeypatch):
    """Fixed shapes, causal / window options and head dims 32 (attn_bwd.cu), 64 and 128 (the
    Hopper kernels): forward and backward against the reference, and the band did go into the
    window where it is the whole mask on a square problem."""
    from helpers.gpu import run_gpu
    lowered = _spy(monkeypatch, "lower_band")
    q, k, v = make_qkv(rng, 2, shape[0], shape[1], 4, 2, d, d, BF16)
    run_gpu(torch, q, k, v, mask_mod=_masks()[name], **opts)
    if shape[0] == shape[1] and name in ("window", "offset_band"):
        assert lowered and all(rest is None for rest in lowered), lowered


@pytest.mark.gpu
@pytest.mark.parametrize("same", [True, False], ids=["equal_lengths", "unequal_lengths"])
def test_lowered_bands_varlen_on_the_gpu(same, gpu, rng, torch):
    from helpers.gpu import run_gpu
    cu_q = np.array([0, 20, 60, 61, 120], np.int32)
    cu_k = cu_q if same else np.array([0, 25, 60, 70, 120], np.int32)
    q, k, v = make_varlen_qkv(rng, 120, 120, 4, 2, 64, 64, BF16)
    run_gpu(torch, q, k, v, varlen=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=59, max_seqlen_k=59),
            mask_mod=_masks()["window"])


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("name, opts", [
    ("doc", dict()), ("doc_causal", dict()), ("doc", dict(causal=True)), ("doc_window", dict()),
    ("doc", dict(window=(5, 2), layout="bhsd")), ("doc_repeated", dict(causal=True))])
def test_documents_on_the_gpu(name, opts, d, gpu, rng, torch, monkeypatch):
    """Document masks over contiguous runs (run as varlen) and over a repeated value (kept as a
    mask_mod), with causal, window and bhsd: forward and backward against the reference."""
    from helpers.gpu import run_gpu
    found = _spy(monkeypatch, "_documents")
    mask_mod = _named_mask(name)
    layout = opts.get("layout", "bshd")
    q, k, v = make_qkv(rng, 1, 60, 60, 4, 2, d, d, BF16, layout)
    run_gpu(torch, q, k, v, mask_mod=mask_mod, **opts)
    assert found and all((cu is None) == (name == "doc_repeated") for cu in found), found


# --- on the fake driver: the launches are the plain kernels' ---------------------------------------

FAKE_BODY = r"""
def same(a, b, docs_mode=False):
    # the launches a and b alike, else what differs first (kernel, grid, block, smem, a field)
    if [l[0][1] for l in a] != [l[0][1] for l in b]:
        return f"kernels {[l[0][1] for l in a]} != {[l[0][1] for l in b]}"
    for x, y in zip(a, b):
        for i, what in enumerate(("kernel", "grid", "block", "smem", "stream")):
            if x[i] != y[i]:
                return f"{x[0][1]} {what}: {x[i]} != {y[i]}"
        for key in x[5]:
            u, w = x[5][key], y[5][key]
            if isinstance(u, tuple) and len(u) == 4 and docs_mode:
                u, w = u[1:], w[1:]     # the batch stride of B = 1 in memory is never read
            if u != w:
                return f"{x[0][1]} {key}: {x[5][key]} != {y[5][key]}"
    return None

S, H, D = 300, 2, 64
q, k, v = qkv(1, S, S, H, H, D)
dout, out = dev((1, S, H, D)), dev((1, S, H, D))

# a causal window written as a mask_mod: the launches of causal=True, window=(9, -1)
W = 10
band = record(lambda: attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: (ki <= qi) & (qi - ki < W)))
plain = record(lambda: attnext.attention(q, k, v, causal=True, window=(W - 1, -1)))
assert same(band, plain) is None, same(band, plain)
lse = dev((1, H, S), np.float32)
band = record(lambda: attnext.attention_backward(dout, q, k, v, out, lse,
                                                 mask_mod=lambda b, h, qi, ki: (ki <= qi) & (qi - ki < W)))
plain = record(lambda: attnext.attention_backward(dout, q, k, v, out, lse, causal=True, window=(W - 1, -1)))
assert same(band, plain) is None, same(band, plain)
assert any(l[0][1] == "attn_bwd_dead" for l in band)

# documents over contiguous runs: the launches of varlen attention over the runs, causal
doc = np.repeat(np.arange(4), [70, 100, 1, 129])
cu = np.array([0, 70, 170, 171, 300], np.int32)
docs = record(lambda: attnext.attention(q, k, v, mask_mod=lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi)))
pq, pk, pv = (device.DeviceArray(x.ptr, (S, H, D), BF16, 0, None, 0, x) for x in (q, k, v))
varlen = record(lambda: attnext.varlen_attention(pq, pk, pv, cu, cu, causal=True))
assert same(docs, varlen, True) is None, same(docs, varlen, True)
assert not any(l[0][0] == "attn_block_mask" for l in docs)
plse = device.DeviceArray(lse.ptr, (H, S), np.float32, 0, None, 0, lse)
pdout, pout = (device.DeviceArray(x.ptr, (S, H, D), BF16, 0, None, 0, x) for x in (dout, out))
docs = record(lambda: attnext.attention_backward(dout, q, k, v, out, lse,
                                                 mask_mod=lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi)))
varlen = record(lambda: attnext.varlen_attention_backward(pdout, pq, pk, pv, pout, plse, cu, cu, causal=True))
assert same(docs, varlen, True) is None, same(docs, varlen, True)
print("ok")
"""


def test_lowered_calls_launch_the_plain_kernels(tmp_path_factory):
    """On the fake driver (no GPU): a causal-window mask_mod launches what causal=True with that
    window launches, and a document-causal mask_mod over contiguous runs what varlen attention
    over the runs launches (kernels, defines, grids, every attn_params field but addresses),
    forward and backward; no block mask is built."""
    from helpers import fake_cuda
    from helpers.driver import run_on_fake
    if fake_cuda.compiler() is None:
        pytest.skip("no C compiler for the fake libcuda")
    run_on_fake(fake_cuda.build(tmp_path_factory.mktemp("fake_libcuda")), FAKE_BODY)
