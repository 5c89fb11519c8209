"""compute-sanitizer over attnext's kernels, in a child process under the sanitizer each.

memcheck over corrupt device lengths ([3/7] point 5; attnext/cuda/lengths.py):
every fault kind of kernels/attn_lengths.cu, in bfloat16 and float32, causal, windowed and with a
score_mod, through the forward and the backward, in a child process under the sanitizer. Each
call must touch nothing outside its arrays (the kernels clamp the lengths: csrc/seqlen.h), and
each fault must be reported by the next call. Marked gpu and sanitize; skipped where
compute-sanitizer is not installed.

racecheck and synccheck over the Hopper kernels that take turns and wait on barriers (issue
[6/7]): the warp-specialised forward (TMA copies into mbarrier rings, two computing warpgroups
passing turns on named barriers) plain, causal, with a score_mod on its 64-key and 128-key tiles
and with varlen keys, and the backward's dK/dV and dQ kernels; each result against the
reference (a varlen backward's too: its Q and dO by bulk copies and by cp.async). Skipped off
Hopper.

memcheck, racecheck and synccheck over Hopper's float32 forward (attn_fwd_sm90_f32.cu: a splitter
warpgroup writing each tile's TF32 parts into mbarrier stages, the computing warpgroup's wgmma
reading them), at both head dims and precisions, dense, causal, windowed and varlen, and with
score options, a score_mod and a mask_mod.

memcheck, racecheck and synccheck over Hopper's float32 backward on bfloat16 planes
(attn_bwd_sm90_x3.cu: two warpgroups passing tiles through shared memory, dQ staged there for bulk
reductions in the key blocks' turns or as they land), at both head dims and precisions,
deterministic or not, dense, causal and varlen with GQA.
"""
import os
import shutil
import subprocess
import sys

import pytest

from helpers.paths import pythonpath

CHILD = r'''
import numpy as np
import torch
import attnext

T, H, D = 155, 4, 64
QKV = [[torch.randn(n, h, D, device="cuda", dtype=dt) for n, h in ((T, H), (160, 2), (160, 2))]
       for dt in (torch.bfloat16, torch.float32)]
cu = lambda *x: torch.tensor(x, dtype=torch.int32, device="cuda")
good = dict(cu_seqlens_q=cu(0, 50, 50, 130, 150), cu_seqlens_k=cu(0, 40, 70, 150, 160),
            seqused_q=cu(45, 0, 70, 20), seqused_k=cu(40, 30, 60, 10))
bad = [dict(cu_seqlens_q=cu(0, 50, 40, 130, 150)), dict(cu_seqlens_k=cu(7, 40, 70, 150, 160)),
       dict(cu_seqlens_q=cu(0, 50, 50, 130, 9999)), dict(cu_seqlens_k=cu(0, 40, 70, 150, -5000)),
       dict(cu_seqlens_q=cu(0, 50, 50, 150, 150)), dict(seqused_k=cu(40, 30, 61000, 10)),
       dict(seqused_q=cu(45, -3, 70, 20)), dict(cu_seqlens_q=cu(0, -40, 2**31 - 1, 5, 150)),
       dict(cu_seqlens_k=cu(0, 2**31 - 1, -2**31, 150, 160))]
reported = 0
for (q, k, v), b in [(x, b) for x in QKV for b in bad]:
    for opts in (dict(causal=True), dict(window=(20, 0)),
                 dict(score_mod=lambda s, b_, h, qi, ki: s - 0.1 * np.abs(qi - ki))):
        args = {**good, **b}
        out, lse = attnext.varlen_attention(q, k, v, **args, max_seqlen_q=96, max_seqlen_k=100,
                                            return_lse=True, **opts)
        torch.cuda.synchronize()
        for step in ("forward", "backward"):
            try:
                attnext.varlen_attention(q, k, v, **good, max_seqlen_q=96, max_seqlen_k=100)
            except ValueError as e:
                reported += 1
                print("reported:", step, str(e)[:160])
            if step == "forward":    # the backward's kernels on the bad lengths, then its report
                attnext.varlen_attention_backward(torch.ones_like(out), q, k, v, out, lse, **args,
                                                  max_seqlen_q=96, max_seqlen_k=100, **opts)
                torch.cuda.synchronize()
torch.cuda.synchronize()
print("reported", reported, "of", 12 * len(bad))
raise SystemExit(0 if reported == 12 * len(bad) else 1)
'''


def _sanitizer():
    found = shutil.which("compute-sanitizer")
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if not found and root and os.path.exists(os.path.join(root, "bin", "compute-sanitizer")):
            found = os.path.join(root, "bin", "compute-sanitizer")
    return found


def _clean_under(tool_name, child, args, env):
    """child (a Python program) with args under compute-sanitizer's tool_name: it must exit 0
    and the tool report nothing."""
    tool = _sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer is not installed (CUDA toolkit)")
    res = subprocess.run([tool, "--tool", tool_name, "--error-exitcode", "3", "--print-limit", "20",
                          sys.executable, "-c", child, *args], capture_output=True, text=True, timeout=540,
                         env={**os.environ, "PYTHONPATH": pythonpath(), **env})
    tail = (res.stdout + res.stderr)[-4000:]
    summary = "RACECHECK SUMMARY: 0 hazards displayed" if tool_name == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert summary in tail and res.returncode == 0, tail


@pytest.mark.gpu
@pytest.mark.sanitize
def test_corrupt_device_lengths_under_memcheck(gpu, torch):
    _clean_under("memcheck", CHILD, [], {})


RACE_CHILD = r'''
import os
import sys
import numpy as np
import torch
import attnext
from attnext import reference
from attnext.cuda import nvrtc

torch.manual_seed(0)
# past 1024 rows: the WS forward; B x H x 18 row tiles fill 132 SMs: no split keys (a decode's plan)
B, S, H, D = 2, 1100, 4, int(sys.argv[1])
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
dout = torch.randn_like(q)
# an integer constant from the OS: no disk cache holds this score_mod's kernels, so its first call
# runs the 64-key tile and a later one the 128-key tile (|q - kv| mod c is |q - kv| here)
c = 5000 + int.from_bytes(os.urandom(4), "little") % (1 << 30)
alibi = lambda s, b, h, qi, ki: s - 0.05 * (np.abs(qi - ki) % c)
tiles, bulk = [], []
function = nvrtc.function
def spy(kernel, name, defines, *rest):
    if name == "attn_fwd_sm90":
        tiles.append((defines.get("WS", 0), defines["BLOCK_N"], defines["BLOCK_M"], defines.get("CLUSTER", 1)))
    if name == "attn_bwd_dkdv_ws_sm90":
        bulk.append(defines.get("BWD_TMA", 0))
    return function(kernel, name, defines, *rest)
nvrtc.function = spy
worst = 0.0
def check(got, want):
    global worst
    got, want = got.float().cpu().numpy(), np.asarray(want, np.float32)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    worst = max(worst, err if np.isfinite(err) else np.inf)     # max() would drop a NaN
qn, kn, vn, dn = (x.float().cpu().numpy() for x in (q, k, v, dout))
for opts in (dict(), dict(causal=True), dict(causal=True, score_mod=alibi), dict(window=(300, 20))):
    out, lse = attnext.attention(q, k, v, return_lse=True, **opts)
    check(out, reference.attention(qn, kn, vn, **opts))
    g = attnext.attention_backward(dout, q, k, v, out, lse, **opts)
    want = reference.attention_backward(dn, qn, kn, vn, None, None, **opts)
    for a, b in zip((g.dq, g.dk, g.dv), (want.dq, want.dk, want.dv)):
        check(a, b)
# every forward above ran the WS kernel, the score_mod's on its 64-key tile, the first at D = 64
# on three computing warpgroups (192 rows); the backward's dK/dV kernel took Q and dO by bulk copies
assert [t[0] for t in tiles] == [1] * 4 and tiles[2][1] == 64, tiles
assert [t[2] for t in tiles] == [192 if D == 64 else 128, 128, 128, 128], tiles
assert bulk and all(bulk), bulk
nvrtc.finish_ahead()                           # the score_mod's 128-key tile, compiled meanwhile
del tiles[:]
out = attnext.attention(q, k, v, causal=True, score_mod=alibi)
check(out, reference.attention(qn, kn, vn, causal=True, score_mod=alibi))
assert tiles == [(1, 128, 128, 1)], tiles
cu = torch.tensor([0, 1050, 1100], dtype=torch.int32, device="cuda")
qv, kv, vv = (x[0] for x in (q, k, v))
# a plain varlen call (D = 64: three warpgroups), whose first sequence's last key tile brings
# rows of the next: the producer zeroes their V rows
del tiles[:]
out = attnext.varlen_attention(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1050, max_seqlen_k=1050)
check(out, reference.varlen_attention(qn[0], kn[0], vn[0], cu_seqlens_q=cu.cpu().numpy(), cu_seqlens_k=cu.cpu().numpy()))
assert tiles == [(1, 128, 192 if D == 64 else 128, 1)], tiles
out = attnext.varlen_attention(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1050, max_seqlen_k=1050,
                               causal=True)
check(out[:1050], reference.attention(qn[:1, :1050], kn[:1, :1050], vn[:1, :1050], causal=True)[0])
check(out[1050:], reference.attention(qn[:1, 1050:], kn[:1, 1050:], vn[:1, 1050:], causal=True)[0])
# the backward's Q and dO by bulk copies, and by cp.async for the first sequence's last tile (its
# rows past 1050 are the next sequence's); GQA, so that a kv head's items go on from that tile
# to the next query head's first, by a bulk copy into the other stage
kv2, vv2 = kv[:, :2].contiguous(), vv[:, :2].contiguous()
planned = len(bulk)
out, lse = attnext.varlen_attention(qv, kv2, vv2, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1050,
                                    max_seqlen_k=1050, causal=True, return_lse=True)
g = attnext.varlen_attention_backward(dout[0], qv, kv2, vv2, out, lse, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      max_seqlen_q=1050, max_seqlen_k=1050, causal=True)
for lo, hi in ((0, 1050), (1050, 1100)):
    want = reference.attention_backward(dn[:1, lo:hi], qn[:1, lo:hi], kn[:1, lo:hi, :2], vn[:1, lo:hi, :2],
                                        None, None, causal=True)
    for a, b in zip((g.dq, g.dk, g.dv), (want.dq, want.dk, want.dv)):
        check(a[lo:hi], b[0])
assert len(bulk) > planned and all(bulk), bulk     # this backward's plan, with bulk copies too
# a split-KV decode (TMA_KV on Hopper): the last CTA of each query tile merges the splits in the
# shared memory its ring is done with; twice, the second on the counters the first set back to 0
qd = torch.randn(1, 1, 8, D, device="cuda", dtype=torch.bfloat16)
kd, vd = (torch.randn(1, 4096, 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
want = reference.attention(*(x.float().cpu().numpy() for x in (qd, kd, vd)))
for _ in range(2):
    check(attnext.attention(qd, kd, vd), want)
# a CTA a tile whose last tile leaves its last warpgroup no row (1050 = 8 x 128 + 26 = 5 x 192 +
# 90): that warpgroup only takes its turns and releases the stages
from attnext import _env
_env.setenv("ATTNEXT_FWD_PERSIST", "0")
q1 = torch.randn(B, 1050, H, D, device="cuda", dtype=torch.bfloat16)
for opts in (dict(), dict(causal=True)):
    check(attnext.attention(q1, k, v, **opts), reference.attention(q1.float().cpu().numpy(), kn, vn, **opts))
if D == 128:
    # CTAs in pairs (a CTA a tile, as set above: 10 query tiles a head), each bringing a panel of
    # every K and V tile into both, over keys past the last whole tile; the last tile's 48 rows
    # leave its second warpgroup none, which still arrives in both CTAs' stages
    qp = torch.randn(B, 1200, H, D, device="cuda", dtype=torch.bfloat16)
    del tiles[:]
    check(attnext.attention(qp, k, v), reference.attention(qp.float().cpu().numpy(), kn, vn))
    assert tiles == [(1, 128, 128, 2)], tiles
torch.cuda.synchronize()
print("worst", worst)
raise SystemExit(0 if worst < 2e-2 else 1)
'''


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("tool_name", ["racecheck", "synccheck"])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_kernels_under_racecheck_and_synccheck(gpu, torch, tool_name, d):
    from attnext.cuda import backend
    if backend.device_arch(0) != "sm_90a":
        pytest.skip("the warp-specialised kernels are Hopper's")
    _clean_under(tool_name, RACE_CHILD, [str(d)], {"ATTNEXT_COMPILE_AHEAD": "1"})


# The float32 children's start: a spy on the kernels each plan loads (names), and check(got, want,
# tol), which keeps in worst the largest error over tol of got against want (or of each pair of
# two tuples of arrays)
SPY_PRELUDE = r'''
import numpy as np
import torch
import attnext
from attnext import reference
from attnext.cuda import nvrtc

torch.manual_seed(0)
names = []
function = nvrtc.function
def spy(kernel, name, *rest):
    names.append(name)
    return function(kernel, name, *rest)
nvrtc.function = spy
worst = 0.0
def check(got, want, tol):
    global worst
    for a, b in zip(got, want) if isinstance(got, tuple) else ((got, want),):
        a, b = a.cpu().numpy(), np.asarray(b, np.float32)
        err = float(np.abs(a - b).max() / np.abs(b).max())
        worst = max(worst, err / tol if np.isfinite(err) else np.inf)
'''

F32_CHILD = SPY_PRELUDE + r'''
for D in (64, 128):
    q, k, v = (torch.randn(2, n, 2, D, device="cuda") for n in (150, 230, 230))
    qn, kn, vn = (x.cpu().numpy() for x in (q, k, v))
    for precision, tol in ((None, 1e-5), ("tf32", 3e-3)):
        for opts in (dict(), dict(causal=True), dict(window=(60, 9))):
            check(attnext.attention(q, k, v, precision=precision, **opts), reference.attention(qn, kn, vn, **opts), tol)
    # score options and generated mods (the default there at float32 accuracy): a mask_mod's
    # narrowed key range, a score_mod reading a captured table
    table = torch.randn(2, 400, device="cuda")
    slopes = torch.rand(2, device="cuda")
    opts = dict(softcap=5.0, causal=True, mask_mod=lambda b, h, qi, ki: (qi - ki) % 5 != 2)
    tn, sn = table.cpu().numpy(), slopes.cpu().numpy()
    check(attnext.attention(q, k, v, alibi_slopes=slopes, score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki + 230], **opts),
          reference.attention(qn, kn, vn, alibi_slopes=sn, score_mod=lambda s, b, h, qi, ki: s + tn[h, qi - ki + 230], **opts),
          1e-5)
    # varlen: the first sequence's last key tile holds the next one's rows (the splitter zeroes them)
    cu_q = torch.tensor([0, 100, 150], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 70, 230], dtype=torch.int32, device="cuda")
    got = attnext.varlen_attention(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    for (a, b), (c, d) in zip(((0, 100), (100, 150)), ((0, 70), (70, 230))):
        check(got[a:b], reference.attention(qn[:1, a:b], kn[:1, c:d], vn[:1, c:d], causal=True)[0], 1e-5)
torch.cuda.synchronize()
assert names.count("attn_fwd_sm90_f32") == 16, names
print("worst", worst)
raise SystemExit(0 if worst < 1 else 1)
'''


# The float32 backward children's varlen case with GQA (a key block's items go from one sequence's
# query tiles to the next head's), at precision against the reference within tol
VARLEN_BACKWARD = r'''
def varlen_backward(q, k, v, qn, kn, vn, precision, tol):
    cu_q = torch.tensor([0, 100, 150], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 70, 230], dtype=torch.int32, device="cuda")
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, precision=precision)
    out, lse = attnext.varlen_attention(q[0], k[0], v[0], return_lse=True, **args)
    dout = torch.randn_like(out)
    g = attnext.varlen_attention_backward(dout, q[0], k[0], v[0], out, lse, **args)
    for (a, b), (c, d) in zip(((0, 100), (100, 150)), ((0, 70), (70, 230))):
        want = reference.attention_backward(dout[a:b].cpu().numpy()[None], qn[:1, a:b], kn[:1, c:d],
                                            vn[:1, c:d], None, None, causal=True)
        check((g[0][a:b], g[1][c:d], g[2][c:d]), tuple(w[0] for w in want[:3]), tol)
'''


PLANES_CHILD = SPY_PRELUDE + VARLEN_BACKWARD + r'''
for D in (64, 128):
    q, k, v = (torch.randn(2, n, h, D, device="cuda") for n, h in ((150, 4), (230, 2), (230, 2)))
    qn, kn, vn = (x.cpu().numpy() for x in (q, k, v))
    for precision, tol in ((None, 1e-5), ("tf32", 3e-3)):
        for deterministic in (True, False):
            for opts in (dict(), dict(causal=True)):
                out, lse = attnext.attention(q, k, v, precision=precision, return_lse=True, **opts)
                dout = torch.randn_like(out)
                g = attnext.attention_backward(dout, q, k, v, out, lse, precision=precision,
                                               deterministic=deterministic, **opts)
                want = reference.attention_backward(dout.cpu().numpy(), qn, kn, vn, None, None, **opts)
                check(tuple(g[:3]), tuple(want[:3]), tol)
        varlen_backward(q, k, v, qn, kn, vn, precision, tol)
torch.cuda.synchronize()
assert "attn_bwd_dkdv_x3" in names and "attn_bwd_dq_x3" in names and "attn_bwd_dq_convert" in names, names
assert "attn_scale16_max" in names and "attn_scale16_convert" in names, names    # tf32's dense calls
print("worst", worst)
raise SystemExit(0 if worst < 1 else 1)
'''


# precision="tf32"'s forward of dense calls from 256 query rows: attn_scale16.cu's copies, the float16
# kernels with F16_SCALED (the short rows' tile at 300 rows; at 1100 the WS kernel, persistent but
# at D = 64 without a causal mask, which takes the three-warpgroup tile), attn_scale16_unscale
SCALED16_FORWARD_CHILD = SPY_PRELUDE + r'''
for D in (64, 128):
    for rows in (300, 1100):
        q, k, v = (torch.randn(2, rows, h, D, device="cuda") for h in (4, 2, 2))
        qn, kn, vn = (x.cpu().numpy() for x in (q, k, v))
        for opts in (dict(), dict(causal=True)):
            check(attnext.attention(q, k, v, precision="tf32", **opts), reference.attention(qn, kn, vn, **opts), 3e-3)
torch.cuda.synchronize()
assert {"attn_scale16_max", "attn_scale16_convert", "attn_scale16_unscale"} <= set(names), names
print("worst", worst)
raise SystemExit(0 if worst < 1 else 1)
'''


# Hopper's float32 kernels: the forward (attn_fwd_sm90_f32.cu, its wgmma path asked for; precision=
# "tf32"'s on scaled float16 copies) and the backward on bfloat16 planes (attn_bwd_sm90_x3.cu, the
# default; precision="tf32"'s dense calls on scaled float16 copies: attn_scale16.cu and the float16
# kernels with F16_SCALED)
F32_KERNELS = {"forward": (F32_CHILD, {"ATTNEXT_FWD_F32_SM90": "1"}), "tf32 forward": (SCALED16_FORWARD_CHILD, {}),
               "backward": (PLANES_CHILD, {})}


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("tool_name", ["memcheck", "racecheck", "synccheck"])
@pytest.mark.parametrize("kernel", sorted(F32_KERNELS))
def test_hopper_float32_under_the_sanitizers(gpu, torch, kernel, tool_name):
    from attnext.cuda import backend
    if backend.device_arch(0) != "sm_90a":
        pytest.skip("the float32 wgmma kernels are Hopper's")
    child, env = F32_KERNELS[kernel]
    _clean_under(tool_name, child, [], env)
