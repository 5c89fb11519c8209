"""Smoke tests for `python -m attnext.bench`: the quick CPU table runs, validates and writes its
JSON; the CUDA benchmark's helpers and its row logic work without a GPU."""
import json
import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import attnext
from attnext.bench import cli, cuda as bc
from test_bench_mods import TINY as TINY_MODS
from test_bench_mods import ModAttnext

TIMED = ("attnext_fwd_ms", "attnext_bwd_ms", "reference_fwd_ms", "reference_bwd_ms")
KEYS = {"case", "B", "H", "S", "D", "causal", "seqlens", "note", "reps", "validated_on",
        "torch_fwd_ms", "torch_bwd_ms", "torch_over_attnext_fwd", "torch_over_attnext_bwd",
        "reference_over_attnext_fwd", "reference_over_attnext_bwd", "attnext_fwd_gflops",
        "attnext_bwd_gflops", *TIMED}


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_quick_bench_writes_valid_rows(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "attnext.bench", "--quick", "--reps", "2",
                           "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    table = json.loads(path.read_text())
    rows, sgemm = table["rows"], table["sgemm_gflops"]
    assert len(rows) >= 3 and any(r["seqlens"] for r in rows)
    assert _positive(sgemm) and f"runs at {sgemm:.1f} GFLOP/s" in proc.stdout
    assert "SIMD" in table["header"][0] and "threads" in table["header"][0]
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert "error" not in row
        for key in TIMED + ("attnext_fwd_gflops", "attnext_bwd_gflops"):
            assert _positive(row[key]), (row["case"], key, row[key])
        for d in ("fwd", "bwd"):       # the share of the machine's sgemm rate
            assert row[f"attnext_{d}_of_sgemm"] == pytest.approx(row[f"attnext_{d}_gflops"] / sgemm)
        torch_ran = row["torch_fwd_ms"] is not None
        for key in ("torch_fwd_ms", "torch_bwd_ms", "torch_over_attnext_fwd",
                    "torch_over_attnext_bwd"):
            assert (_positive(row[key]) if torch_ran else row[key] is None), (row["case"], key)


# --- the CUDA benchmark, on a machine without CUDA ---

def _torch_has_cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_torch_has_cuda(), reason="this machine has CUDA: the benchmark would run")
def test_cuda_bench_without_cuda_says_so_and_exits_2(tmp_path):
    """Documented: exit status 2 and one clear line when nothing can be measured; no traceback,
    no JSON written."""
    path = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "attnext.bench", "--device", "cuda", "--quick",
                           "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nothing measured" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert not path.exists()


def test_cuda_bench_help_and_bad_peer():
    proc = subprocess.run([sys.executable, "-m", "attnext.bench", "--device=cuda", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--plot" in proc.stdout and "--peers" in proc.stdout
    assert "--first-call" in proc.stdout and "ATTNEXT_CACHE_DIR" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "attnext.bench", "--device", "cuda", "--peers",
                           "flash,sdpa"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown peers" in proc.stderr


def test_bench_cuda_imports_without_torch():
    """attnext.bench.cuda (and the CPU benchmark's dispatch to it) import torch only to run."""
    code = "import sys, attnext.bench.cuda; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_flops_counting():
    assert bc.attention_flops(2, 16, 2048, 2048, 128) == 4 * 2 * 16 * 2048 * 2048 * 128
    assert bc.attention_flops(2, 16, 2048, 2048, 128, causal=True) == 2 * 2 * 16 * 2048 * 2048 * 128
    assert bc.attention_flops(1, 8, 512, 512, 64, causal=True, backward=True) == \
        2.5 * bc.attention_flops(1, 8, 512, 512, 64, causal=True)
    # every plain row does the same work per token-pair budget: B*S = 16k tokens, H*D = 2048
    case = bc.plain_case(4096, 64, False)
    assert (case.B, case.Hq, case.Hk) == (4, 32, 32)
    assert case.flops() == 4 * 4 * 32 * 4096 ** 2 * 64
    assert case.flops(backward=True) == 2.5 * case.flops()
    assert bc.tflops(1e12, 1000.0) == pytest.approx(1.0) and bc.tflops(1e12, None) is None


def test_packed_flops_and_document_split():
    lens = bc.document_lengths()
    assert len(lens) == bc.DOCS == 7 and sum(lens) == bc.TOKENS == 16384
    assert all(n >= 1 for n in lens) and len(set(lens)) > 1
    assert lens == bc.document_lengths()                       # seeded: the same every run
    assert sum(bc.document_lengths(100, 7, seed=3)) == 100
    packed = next(c for c in bc.cases() if c.kind == "packed")
    assert packed.lens == lens and packed.causal and (packed.Hq, packed.D) == (16, 128)
    assert packed.flops() == sum(2 * 16 * n * n * 128 for n in lens)   # causal: half of 4*H*n^2*D
    assert packed.flops() < bc.attention_flops(1, 16, 16384, 16384, 128, causal=True)


def test_decode_bytes_and_case_grid():
    decode = [c for c in bc.cases() if c.kind == "decode"]
    assert [(c.B, c.Sk) for c in decode] == [(1, 32768), (8, 8192), (64, 4096)]
    assert all((c.Sq, c.Hq, c.Hk, c.D) == (1, 32, 8, 128) for c in decode)
    assert decode[0].kv_bytes() == 2 * 32768 * 8 * 128 * 2
    assert bc.gbps(1e9, 1000.0) == pytest.approx(1.0)
    full = bc.cases()
    plain = [c for c in full if c.kind == "plain"]
    assert len(plain) == 24 and {c.Sq for c in plain} == set(bc.SEQLENS)
    assert all(c.B * c.Sq == 16384 and c.Hq * c.D == 2048 for c in plain)
    assert len({c.name for c in full}) == len(full)
    quick = bc.cases(quick=True)
    assert {c.kind for c in quick} == {"plain", "float32", "tf32", "packed", "decode", "numpy", "adapter", "paged"}
    paged = [c for c in full if c.kind == "paged"]
    assert [(c.B, c.Sk, c.page) for c in paged] == list(bc.PAGED) and all(c.Sk % c.page == 0 for c in paged)
    [adapter] = [c for c in full if c.kind == "adapter"]
    assert (adapter.Sq, adapter.D, adapter.causal, adapter.B * adapter.Sq) == (4096, 128, True, 16384)
    assert all(c.Sq == 2048 and c.D == 128 for c in quick if c.kind in ("plain", "float32", "tf32"))
    f32 = [c for c in full if c.kind in ("float32", "tf32")]
    assert len(f32) == 8 and all(c.Sq == bc.FLOAT32_S and c.B * c.Sq == 16384 for c in f32)
    assert {c.name.split()[0] for c in f32} == {"float32", "tf32"}
    assert sum(c.kind == "decode" for c in quick) == 1


def _result(ms, status="ok", reason=None, note=None):
    return {"ms": ms, "status": status, "reason": reason, "note": note}


def test_row_ratios_targets_and_table():
    case = bc.plain_case(2048, 128, True)
    results = {"attnext": {"fwd": _result(1.0),
                           "bwd": _result(None, "error", "NotImplementedError: x")},
               "flash": {"fwd": _result(1.25), "bwd": _result(2.0)},
               "cudnn": {"fwd": _result(0.8), "bwd": _result(1.0)},
               "efficient": {"fwd": _result(None, "error", "RuntimeError: no kernel")},
               "flex": {"fwd": _result(None, "WRONG", "out off by 1")}}
    fwd = bc._finish(case, "fwd", results, 3.0)
    assert fwd["attnext_rate"] == pytest.approx(case.flops() / 1e9)
    assert fwd["ratio_flash"] == pytest.approx(1.25) and fwd["ratio_best"] == pytest.approx(0.8)
    assert fwd["best_peer"] == "cudnn"
    assert fwd["target"] == ">=1.0x cudnn" and fwd["target_met"] is False     # 0.8x cuDNN
    bwd = bc._finish(case, "bwd", results, 3.0)
    assert bwd["attnext_rate"] is None and bwd["ratio_flash"] is None and bwd["target_met"] is None
    assert bwd["flex_status"] == "skipped"
    assert bwd["flash_rate"] == pytest.approx(2.5 * case.flops() / 2e9)

    line = bc.format_row(fwd)
    cells = line.split()
    assert line.startswith(case.name) and "WRONG" in cells and "1.25x" in cells
    assert "MISS >=1.0x cudnn" in line
    title = bc.format_header("plain")
    assert title.index("flash") < title.index("cudnn") < title.index("ax/flash")
    assert len(line.split("MISS")[0]) == len(title.split("target")[0])   # columns line up
    assert bc.format_row(bwd).split()[len(case.name.split()):][:3] == ["bwd", "-", "-"]
    text = "\n".join(bc.notes([fwd, bwd]))
    assert "attnext error" in text and "NotImplementedError: x" in text
    assert "flex WRONG" in text and "efficient error" in text


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bc.write_plot([], str(tmp_path / "p.png")).startswith("no plot: matplotlib")
    assert not (tmp_path / "p.png").exists()


def test_plot_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    case = bc.plain_case(2048, 128, False)
    rows = [bc._finish(case, d, {"attnext": {d: _result(1.0)}, "flash": {d: _result(1.1)}}, 1.0)
            for d in ("fwd", "bwd")]
    path = tmp_path / "p.png"
    assert bc.write_plot(rows, str(path)) == f"plot written to {path}"
    assert path.read_bytes()[:4] == b"\x89PNG"


# --- the row logic end to end, on CPU torch tensors with a stand-in for attnext's GPU API ---

SOFTCAP_REFERENCE = bc.softcap_reference      # the stand-in's own, whatever a test patches into bc


class FakeAttnext:
    """attnext's CUDA-facing API on CPU torch tensors, computed by the benchmark's own float32
    reference; `fault` makes it return wrong numbers ("wrong") or raise in the backward."""

    def __init__(self, fault=None):
        self.fault = fault
        self.precisions = []       # (precision, torch's allow_tf32) of each forward and backward

    def _note(self, precision):
        import torch
        self.precisions.append((precision, torch.backends.cuda.matmul.allow_tf32))

    def _give(self, out_f32, out, q, lse_shape, return_lse):
        import torch
        res = out_f32.to(torch.bfloat16 if q is None else q.dtype) + (1 if self.fault == "wrong" else 0)
        if out is not None:
            out.copy_(res)
            res = out
        return (res, torch.zeros(lse_shape)) if return_lse else res

    def attention(self, q, k, v, *, causal=False, device=None, out=None, return_lse=False, precision=None,
                  score_mod=None):
        assert device == "cuda"
        self._note(precision)
        if isinstance(q, np.ndarray):
            qkv = [bc._numpy_to_bf16(x, "cpu") for x in (q, k, v)]
            if score_mod is not None:       # the bench's one NumPy score_mod: softcap
                s = np.linspace(-90.0, 90.0, 7)
                assert np.allclose(score_mod(s, 0, 0, 0, 0), bc.SOFTCAP * np.tanh(s / bc.SOFTCAP))
                o = SOFTCAP_REFERENCE(*qkv)
            else:
                o, _ = bc.reference(*qkv, causal=causal)
            return bc._bf16_to_numpy(self._give(o, None, None, None, False))
        o, _ = bc.reference(q, k, v, causal=causal)
        return self._give(o, out, q, (q.shape[0], q.shape[2], q.shape[1]), return_lse)

    def attention_backward(self, dout, q, k, v, out, lse, *, causal=False, device=None, deterministic=True,
                           precision=None):
        self._note(precision)
        if self.fault == "raise":
            raise NotImplementedError("the CUDA backward is not built yet")
        _, g = bc.reference(q, k, v, dout, causal)
        return self._grads(g, q)

    def _grads(self, g, q):
        shift = 1 if self.fault == "wrong" else 0
        return attnext.Grads(*(x.to(q.dtype) + shift for x in g), None, {})

    def varlen_attention(self, q, k, v, cu_q, cu_k, *, max_seqlen_q, max_seqlen_k, causal,
                         device, out=None, return_lse=False):
        assert max_seqlen_q == int(np.diff(np.asarray(cu_q)).max())
        o, _ = bc.packed_reference(q, k, v, q, np.diff(np.asarray(cu_q)))
        return self._give(o, out, q, (q.shape[1], q.shape[0]), return_lse)

    def varlen_attention_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, **kw):
        if self.fault == "raise":
            raise NotImplementedError("the CUDA backward is not built yet")
        _, g = bc.packed_reference(q, k, v, dout, np.diff(np.asarray(cu_q)))
        return self._grads(g, q)


def _cpu_run(monkeypatch, fault=None, peers=("flash", "cudnn")):
    pytest.importorskip("torch")
    monkeypatch.setattr(bc, "attnext", FakeAttnext(fault))

    def one_call(fn):
        fn()
        return 1.0
    return bc.Run("cpu", one_call, peers)


def test_plain_rows_on_cpu(monkeypatch):
    run = _cpu_run(monkeypatch)
    case = bc.Case("plain", 2, 96, 96, 4, 4, 32, True)
    fwd, bwd, bwd_nd = bc.case_rows(run, case)
    for row in (fwd, bwd, bwd_nd):
        assert row["attnext_status"] == "ok", row["attnext_reason"]
        assert row["attnext_ms"] == 1.0 and _positive(row["attnext_wall_ms"])
        assert all(e < bc.TOL for e in row["attnext_rel_errors"].values())
        assert row["flash_status"] == "ok", row["flash_reason"]   # CPU SDPA has a flash kernel
        assert row["ratio_flash"] == pytest.approx(1.0)
        assert row["cudnn_status"] == "error" and row["cudnn_reason"]
        assert row["efficient_status"] == row["flex_status"] == row["math_status"] == "skipped"
    assert set(bwd["attnext_rel_errors"]) == set(bwd_nd["attnext_rel_errors"]) == {"dq", "dk", "dv"}
    assert bwd_nd["flash_ms"] == bwd["flash_ms"]     # the peers' one backward beside both
    json.dumps([fwd, bwd, bwd_nd])


@pytest.mark.parametrize("kind", ["float32", "tf32"])
def test_float32_rows_on_cpu(monkeypatch, kind):
    """float32 tensors; tf32 rows pass precision="tf32" to attnext and time torch's peers with TF32
    allowed, restored afterwards; both held to >= 1.5x / 2x the best SDPA backend."""
    torch = pytest.importorskip("torch")
    run = _cpu_run(monkeypatch)
    before = torch.backends.cuda.matmul.allow_tf32
    fwd, bwd, bwd_nd = bc.case_rows(run, bc.Case(kind, 2, 96, 96, 4, 4, 32, True))
    assert torch.backends.cuda.matmul.allow_tf32 == before
    for row in (fwd, bwd, bwd_nd):
        assert row["attnext_status"] == "ok", row["attnext_reason"]
        assert row["flash_status"] == "ok", row["flash_reason"]
        assert row["target"] == (">=1.5x sdpa" if kind == "float32" else ">=2.0x sdpa")
    tf32 = kind == "tf32"
    assert set(bc.attnext.precisions) == {("tf32" if tf32 else None, tf32)}
    assert {r["section"] for r in (fwd, bwd, bwd_nd)} == {kind} and fwd["case"].startswith(f"{kind} B2")
    assert bc.format_header(kind) == bc.format_header("plain")     # the plain table's columns


def test_math_runs_on_the_float32_rows_alone(monkeypatch):
    """SDPA's math backend is timed (and validated) on the float32 and tf32 rows, and counts
    toward their "sdpa" target; on the bf16 rows it is skipped, even when --peers names it."""
    pytest.importorskip("torch")
    run = _cpu_run(monkeypatch, peers=("efficient", "math"))
    for kind in ("float32", "tf32"):
        for row in bc.case_rows(run, bc.Case(kind, 2, 96, 96, 4, 4, 32, True)):
            assert row["math_status"] == "ok" and row["math_ms"] == 1.0, row["math_reason"]
            assert row["math_rel_errors"] and all(e < bc.TOL for e in row["math_rel_errors"].values())
    for row in bc.case_rows(run, bc.Case("plain", 2, 96, 96, 4, 4, 32, True)):
        assert row["math_status"] == "skipped" and "float32" in row["math_reason"]
    case = bc.plain_case(bc.FLOAT32_S, 128, False, "tf32")
    results = {"attnext": {"fwd": _result(1.0)}, "efficient": {"fwd": _result(2.5)},
               "math": {"fwd": _result(1.5)}}
    row = bc._finish(case, "fwd", results, 1.0)
    assert row["best_peer"] == "math" and row["target_ratio"] == pytest.approx(1.5)
    assert row["target_met"] is False
    assert "math" in bc.format_header("float32")


def test_wrong_results_are_not_timed(monkeypatch):
    run = _cpu_run(monkeypatch, "wrong", peers=())
    fwd, bwd, _ = bc.case_rows(run, bc.Case("plain", 1, 64, 64, 2, 2, 16, False))
    assert fwd["attnext_status"] == "WRONG" and fwd["attnext_ms"] is None
    assert "out off by" in fwd["attnext_reason"]
    assert bwd["attnext_status"] == "WRONG" and "dq off by" in bwd["attnext_reason"]
    assert "WRONG" in bc.format_row(fwd).split()


def test_attnext_exception_is_a_dash_with_its_text(monkeypatch):
    run = _cpu_run(monkeypatch, "raise", peers=())
    fwd, bwd, _ = bc.case_rows(run, bc.Case("plain", 1, 64, 64, 2, 2, 16, True))
    assert fwd["attnext_status"] == "ok"
    assert bwd["attnext_status"] == "error" and bwd["attnext_ms"] is None
    assert bwd["attnext_reason"] == "NotImplementedError: the CUDA backward is not built yet"
    assert "the CUDA backward is not built yet" in "\n".join(bc.notes([fwd, bwd]))


@pytest.mark.parametrize("lengths", ["host", "cuda"])
def test_packed_rows_on_cpu(lengths, monkeypatch):
    """attnext varlen and SDPA flash on the padded batch both match the per-document reference;
    the "cuda" lengths row passes cu_seqlens as torch tensors on the run's device (here the CPU)."""
    run = _cpu_run(monkeypatch)
    lens = (5, 37, 18)
    case = bc.Case("packed", 1, sum(lens), sum(lens), 2, 2, 16, True, lens, lengths=lengths)
    assert case.name.endswith(" cuda-lens") == (lengths == "cuda")
    fwd, bwd, bwd_nd = bc.case_rows(run, case)
    for row in (fwd, bwd, bwd_nd):
        assert row["attnext_status"] == "ok", row["attnext_reason"]
        assert row["flash_status"] == "ok", row["flash_reason"]
        assert row["target"] == ">=1.3x flex" and row["target_met"] is None   # flex not run
    assert fwd["attnext_rate"] == pytest.approx(case.flops() / 1e9)


def test_decode_rows_on_cpu(monkeypatch):
    run = _cpu_run(monkeypatch)
    case = bc.Case("decode", 3, 1, 50, 4, 2, 16, False)
    (row,) = bc.case_rows(run, case)
    assert row["unit"] == "GB/s" and row["attnext_rate"] == pytest.approx(case.kv_bytes() / 1e6)
    assert row["attnext_status"] == "ok", row["attnext_reason"]
    assert row["flash_status"] == "ok", row["flash_reason"]
    assert row["target"] == ">=0.95x best" and row["target_met"] is True


def test_numpy_row_on_cpu(monkeypatch):
    """The NumPy path validates and times; the pinned floor needs CUDA and says so."""
    torch = pytest.importorskip("torch")
    run = _cpu_run(monkeypatch)
    (row,) = bc.case_rows(run, bc.plain_case(64, 16, True, "numpy", B=2))
    assert row["attnext_status"] == "ok", row["attnext_reason"]
    assert _positive(row["attnext_ms"])
    assert row["bytes_in"] == 3 * row["bytes_out"] == 3 * 2 * 64 * (2048 // 16) * 16 * 2
    if not torch.cuda.is_available():
        assert row["floor_ms"] is None and row["floor_status"] == "error"
        assert row["target_met"] is None
    assert bc.format_row(row).startswith("numpy B2 S64")
    q = np.random.default_rng(0).standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    assert (bc._bf16_to_numpy(bc._numpy_to_bf16(q, "cpu")) == q).all()


def test_numpy_softcap_row_on_cpu(monkeypatch):
    """The NumPy score_mod row validates against the softcap reference and is timed against the
    plain NumPy call of its shape (<= 1.2x)."""
    pytest.importorskip("torch")
    run = _cpu_run(monkeypatch)
    (case,) = [c for c in bc.cases() if c.mod]
    assert (case.kind, case.B, case.Sq, case.Hq, case.D, case.causal) == ("numpy", 2, 4096, 16, 64, False)
    assert case.name == "numpy softcap30 B2 S4096 H16 D64"
    (row,) = bc.case_rows(run, bc.Case("numpy", 1, 40, 40, 2, 2, 16, False, mod="softcap"))
    assert row["attnext_status"] == "ok", row["attnext_reason"]
    assert _positive(row["attnext_ms"]) and _positive(row["floor_ms"]) and row["pinned_gbps"] is None
    assert row["target"] == "<=1.2x plain" and row["target_ratio"] == pytest.approx(
        row["attnext_ms"] / row["floor_ms"])
    monkeypatch.setattr(bc, "softcap_reference", lambda q, k, v: 2 * bc.reference(q, k, v)[0])
    (wrong,) = bc.case_rows(run, bc.Case("numpy", 1, 40, 40, 2, 2, 16, False, mod="softcap"))
    assert wrong["attnext_status"] == "WRONG" and wrong["attnext_ms"] is None


def test_adapter_rows_on_cpu(monkeypatch):
    """attnext.torch against the direct calls, on CPU tensors through attnext's CPU backend (in
    float32: attnext's API reads no torch bfloat16 CPU tensor): both directions validated against
    each other, timed, their ratio in the row."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bc, "_randn", lambda run, *shape, dtype=None: torch.randn(shape))
    run = bc.Run("cpu", lambda fn: (fn(), 2.0)[1], ())
    rows = bc.case_rows(run, bc.Case("adapter", 1, 40, 40, 2, 2, 16, True))
    assert [r["direction"] for r in rows] == ["fwd", "fwd+bwd"]
    for row in rows:
        assert row["attnext_status"] == "ok", row["attnext_reason"]
        assert all(e == 0 for e in row["attnext_rel_errors"].values())      # the same kernels
        assert row["attnext_ms"] == row["floor_ms"] == 2.0 and row["target_ratio"] == 1.0
    assert bc.format_row(rows[1]).split()[:8] == ["adapter", "B1", "S40", "H2", "D16", "causal",
                                                   "fwd+bwd", "2.00"]


def test_paged_rows_on_cpu(monkeypatch):
    """The paged decode row on CPU tensors (attnext's CPU backend, float32): the shuffled pages
    give the contiguous call's result, both timed, their GB/s ratio in the row."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bc, "_randn", lambda run, *shape, dtype=None: torch.randn(shape))
    run = bc.Run("cpu", lambda fn: (fn(), 2.0)[1], ())
    [row] = bc.case_rows(run, bc.Case("paged", 3, 1, 96, 4, 2, 16, False, page=16))
    assert row["attnext_status"] == "ok", row["attnext_reason"]
    assert all(e == 0 for e in row["attnext_rel_errors"].values())      # the same keys, bit for bit
    assert row["attnext_ms"] == row["floor_ms"] == 2.0 and row["target_ratio"] == 1.0 and row["target_met"]
    assert row["attnext_rate"] == pytest.approx(bc.gbps(2 * 3 * 96 * 2 * 16 * 2, 2.0))
    assert bc.format_row(row).split()[:2] == ["paged16", "B3"]


def _main_on_cpu(monkeypatch, fault=None):
    """main() as on the GPU, its rows run on CPU tensors: bench_cuda's sections through
    FakeAttnext, the mods section (tiny cases) through attnext's CPU backend."""
    torch = pytest.importorskip("torch")
    from attnext.bench import mods as bench_mods
    _cpu_run(monkeypatch, fault)
    monkeypatch.setattr(bench_mods, "attnext", ModAttnext())
    monkeypatch.setattr(bench_mods, "cases", lambda quick: TINY_MODS[:2])
    monkeypatch.setattr(bc, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bc, "header", lambda timing: ["GPU name, date", f"times: {timing}"])
    monkeypatch.setattr(bc, "make_timer", lambda warmup, rep: ((lambda fn: (fn(), 1.0)[1]), "fake"))
    tiny = [bc.Case("plain", 1, 80, 80, 2, 2, 16, c) for c in (False, True)] + [
        bc.Case(kind, 1, 48, 48, 2, 2, 16, True) for kind in ("float32", "tf32")] + [
        bc.Case("packed", 1, 40, 40, 2, 2, 16, True, (9, 31)),
        bc.Case("decode", 2, 1, 70, 4, 2, 16, False), bc.plain_case(32, 16, False, "numpy", B=1)]
    monkeypatch.setattr(bc, "cases", lambda quick: tiny)


@pytest.mark.parametrize("fault, status", [(None, 0), ("wrong", 1)])
def test_main_end_to_end_on_cpu(monkeypatch, tmp_path, capsys, fault, status):
    """main() as on the GPU (sections, table, notes, JSON, plot line, exit status), with the
    rows run on CPU tensors: exit 1 when an attnext result is WRONG."""
    from attnext.bench import mods as bench_mods
    _main_on_cpu(monkeypatch, fault)
    path = tmp_path / "rows.json"
    assert cli.main(["--device", "cuda", "--peers", "flash", "--json", str(path),
                    "--plot", str(tmp_path / "p.png")]) == status
    text = capsys.readouterr().out
    for title in [t for name, t in bc.SECTION_TITLES.items() if name not in ("adapter", "paged")] + [bench_mods.MODS_TITLE]:
        assert title in text           # (the adapter and paged rows: test_adapter_rows_on_cpu, test_paged_rows_on_cpu)
    assert bench_mods.FIRST_CALL_TITLE not in text            # only with --first-call
    assert "total" in text and ("no plot" in text or "plot written" in text)
    saved = json.loads(path.read_text())
    assert saved["header"][1] == "times: fake"
    rows = saved["rows"]
    assert len(rows) == 4 * 3 + 3 + 1 + 1 + 2 * 2     # plain, float32, tf32, packed: fwd, bwd, bwd_nd; mods: fwd, bwd
    want = "WRONG" if fault else "ok"
    assert {r["attnext_status"] for r in rows if r["section"] != "mods"} == {want}
    assert all(r["cudnn_status"] == "skipped" for r in rows if r["section"] not in ("numpy", "mods"))
    mods = [r for r in rows if r["section"] == "mods"]
    assert [r["case"] for r in mods] == [c.name for c in TINY_MODS[:2] for _ in "fb"]
    assert all(r["attnext_status"] == "ok" and r["flex_status"] == "skipped" for r in mods)


def test_main_rows_filter_reaches_the_mods_sections(monkeypatch, tmp_path, capsys):
    """--rows picks mods rows by name as any other; --first-call adds their fresh-process rows."""
    from attnext.bench import mods as bench_mods
    _main_on_cpu(monkeypatch)
    seen = []
    monkeypatch.setattr(bench_mods, "first_call_row",
                        lambda case: seen.append(case) or {"section": "first_call", "case": case.name,
                                                           "direction": "first call", "case_s": 0.0,
                                                           "target": "t", "target_met": None})
    path = tmp_path / "rows.json"
    assert cli.main(["--device", "cuda", "--peers", "flash", "--rows", "relbias", "--first-call",
                    "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert bench_mods.MODS_TITLE in text and bench_mods.FIRST_CALL_TITLE in text
    assert bc.SECTION_TITLES["plain"] not in text
    rows = json.loads(path.read_text())["rows"]
    assert [(r["section"], r["case"]) for r in rows] == (
        [("mods", TINY_MODS[1].name)] * 2 + [("first_call", TINY_MODS[1].name)])
    assert seen == [TINY_MODS[1]]


def test_main_sections_picks_whole_sections(monkeypatch, tmp_path, capsys):
    """--sections runs only the sections named (mods among them), each whole; a name that is not
    a section is an argparse error that lists the names."""
    from attnext.bench import mods as bench_mods
    _main_on_cpu(monkeypatch)
    path = tmp_path / "rows.json"
    assert cli.main(["--device", "cuda", "--peers", "flash", "--sections", "packed,mods",
                    "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert bc.SECTION_TITLES["packed"] in text and bench_mods.MODS_TITLE in text
    assert bc.SECTION_TITLES["plain"] not in text and bc.SECTION_TITLES["float32"] not in text
    rows = json.loads(path.read_text())["rows"]
    assert {r["section"] for r in rows} == {"packed", "mods"}
    assert cli.main(["--device", "cuda", "--peers", "flash", "--sections", "float32",
                    "--json", str(path)]) == 0
    assert {r["section"] for r in json.loads(path.read_text())["rows"]} == {"float32"}
    with pytest.raises(SystemExit):
        cli.main(["--device", "cuda", "--sections", "plain,nope"])
    assert "unknown sections ['nope']" in capsys.readouterr().err


def test_rows_takes_texts_between_bars():
    """--rows: a case is picked when its name holds one of the texts between '|'s; empty ones
    are left out (a trailing '|' picks nothing extra)."""
    case = bc.Case("plain", 2, 8192, 8192, 16, 16, 128, True)
    assert case.name == "B2 S8192 H16 D128 causal"
    assert cli._chosen(case, None) and cli._chosen(case, "") and cli._chosen(case, "|")
    assert cli._chosen(case, "S8192") and cli._chosen(case, "nothing|D128")
    assert not cli._chosen(case, "nothing|") and not cli._chosen(case, "softcap|relbias")


def test_float32_targets_are_against_sdpa_not_flex():
    """[3/7]'s float32 / tf32 targets name PyTorch SDPA's fastest float32 backend: a faster Flex
    column is shown but does not move the target."""
    case = bc.plain_case(bc.FLOAT32_S, 128, False, "tf32")
    results = {"attnext": {"fwd": _result(1.0)}, "efficient": {"fwd": _result(2.5)},
               "flex": {"fwd": _result(0.9)}}
    row = bc._finish(case, "fwd", results, 1.0)
    assert row["best_peer"] == "flex" and row["ratio_best"] == pytest.approx(0.9)
    assert row["target"] == ">=2.0x sdpa" and row["target_ratio"] == pytest.approx(2.5)
    assert row["target_met"] is True
