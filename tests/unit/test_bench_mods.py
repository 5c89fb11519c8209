"""The GPU benchmark's score_mod / mask_mod and first-call sections (attnext/bench_mods.py) without
a GPU: the cases and their kept pairs, the rows and the table, the fresh-process harness (with a
stub child), and, where torch is installed, the rows end to end on CPU tensors (attnext's CPU
backend behind the CUDA-facing calls, a materialising stand-in for Flex). Nothing here is timed."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import attnext
from attnext.bench import cuda as bc
from attnext.bench import mods as bm
from attnext import reference

TINY = [bm.ModCase("softcap", 2, 64, 2, 16), bm.ModCase("relbias", 2, 64, 2, 16),
        bm.ModCase("doc", 1, 96, 2, 16, (20, 50, 26)),
        bm.ModCase("doc_causal", 1, 96, 2, 16, (20, 50, 26)),
        bm.ModCase("window", 2, 64, 2, 16, window=8)]


def test_imports_without_torch():
    code = "import sys, attnext.bench.mods; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_cases_names_and_sizes():
    full = bm.cases()
    assert [c.kind for c in full] == list(bm.KINDS)
    assert len({c.name for c in full}) == len(full)
    for c in full:
        if c.lens:
            assert c.lens == bc.document_lengths() and (c.B, c.S) == (1, 16384)
        else:
            assert (c.B, c.S, c.H, c.D) == (2, 8192, 16, 128)
    assert bm.mod_case("window").name == "window1024 mask B2 S8192 H16 D128"
    assert bm.mod_case("softcap").name == "softcap30 B2 S8192 H16 D128 causal"
    assert [c.kind for c in bm.cases(quick=True)] == list(bm.QUICK_KINDS)
    assert all(c.S == bm.QUICK_S for c in bm.cases(quick=True) if not c.lens)
    with pytest.raises(ValueError, match="unknown mod case"):
        bm.mod_case("alibi")
    # --rows selects by substring, as the other sections
    assert [c.kind for c in full if "doc7" in c.name] == ["doc", "doc_causal"]
    assert bm.case_from_json(json.dumps(full[2]._asdict())) == full[2]


@pytest.mark.parametrize("case", TINY + [bm.ModCase("window", 1, 50, 1, 8, window=64)],
                         ids=lambda c: c.kind)
def test_kept_pairs_count_what_attnext_keeps(case):
    """kept_pairs (the TFLOP/s' work) against attnext's own causal flag and mask_mod evaluated on
    every (q_idx, kv_idx)."""
    mods = bm.attnext_mods(case)
    qi, ki = np.arange(case.S)[:, None], np.arange(case.S)[None, :]
    keep = np.ones((case.S, case.S), bool)
    if mods.get("causal"):
        keep &= ki <= qi
    if "mask_mod" in mods:
        keep &= np.broadcast_to(mods["mask_mod"](0, 0, qi, ki), keep.shape)
    assert case.kept_pairs() == case.B * int(keep.sum())
    assert case.flops() == 4 * case.H * case.D * case.kept_pairs()
    assert case.flops(backward=True) == 2.5 * case.flops()


def test_full_size_kept_pairs():
    window = bm.mod_case("window")
    assert window.kept_pairs() == 2 * sum(min(i + 1, 1024) for i in range(8192))
    assert bm.mod_case("softcap").kept_pairs() == 2 * 8192 * 8193 // 2
    doc = bm.mod_case("doc")
    assert doc.kept_pairs() == sum(n * (n + 1) // 2 for n in doc.lens)


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.kind)
def test_attnext_mods_run_on_the_cpu_backend(case, rng):
    """The rows' NumPy functions trace and run (forward against the reference); relbias's
    backward returns the table's gradient under its name."""
    q, k, v, dout = (rng.standard_normal((case.B, case.S, case.H, case.D)).astype(np.float32)
                     for _ in range(4))
    mods = bm.attnext_mods(case)
    out, lse = attnext.attention(q, k, v, return_lse=True, **mods)
    want = reference.attention(q, k, v, **mods)
    assert float(np.max(np.abs(out - want))) < 1e-4
    if case.kind == "relbias":
        g = attnext.attention_backward(dout, q, k, v, out, lse, **mods)
        assert set(g.dtensors) == {"table"} and g.dtensors["table"].shape == (case.H, 2 * case.S)


# --- rows and tables, from hand-made results ---

def _res(ms, status="ok", reason=None, errs=None):
    return {"ms": ms, "status": status, "reason": reason, "rel_errors": errs or {}}


def test_rows_ratio_target_error_and_table():
    case = bm.mod_case("relbias")
    results = {"attnext": {"fwd": _res(2.0, errs={"out": 3e-3}), "bwd": _res(10.0)},
               "flex": {"fwd": _res(3.0), "bwd": _res(None, "error", f"{bm.NO_BUFFER_GRAD} (x)")}}
    cross = {"fwd": {"out": 4e-3}, "bwd": {}}
    fwd, bwd = (bm.finish(case, d, results, cross, 12.0) for d in ("fwd", "bwd"))
    assert fwd["attnext_rate"] == pytest.approx(case.flops() / 2e9)
    assert fwd["ratio_flex"] == pytest.approx(1.5) and fwd["target_met"] is True
    assert fwd["ax_vs_flex"] == pytest.approx(4e-3)
    assert bwd["work"] == case.flops(backward=True)
    assert bwd["ratio_flex"] is None and bwd["target_met"] is None and bwd["ax_vs_flex"] is None
    line, title = bm.format_row(fwd), bm.format_header("mods")
    assert line.startswith(case.name) and "1.50x" in line.split() and "4.0e-03" in line.split()
    assert "ok >=1.3x flex" in line
    assert len(line.split("ok")[0]) == len(title.split("target")[0])   # columns line up
    assert bm.format_row(bwd).split()[len(case.name.split()):][:4] == ["bwd", "10.0", "-", "-"]
    assert bm.NO_BUFFER_GRAD in "\n".join(bc.notes([fwd, bwd]))
    assert bm.format_row(bwd).endswith(bm.NO_BUFFER_GRAD)
    json.dumps([fwd, bwd])


# --- first calls: the fresh-process harness with a stub child ---

STUB = r"""
import json, os, sys
folder, case, mode = os.environ["ATTNEXT_CACHE_DIR"], json.loads(sys.argv[1]), sys.argv[2]
had = set(os.listdir(folder))
open(os.path.join(folder, "plain.cubin"), "w").write(case["kind"])
if mode == "mods":
    open(os.path.join(folder, "mod.cubin"), "w").write(case["kind"])
print("some other output")
cold, twin = "mod.cubin" not in had, "plain.cubin" in had     # twin: the plain kernels were there
print("attnext-first-call " + json.dumps({
    "fwd_s": (0.9 if twin else 1.5) if cold else 0.01, "bwd_s": (1.1 if twin else 2.5) if cold else 0.02,
    "compiles": (1 if twin else 3) if cold else 0, "fwd_again_s": 0.004, "bwd_again_s": 0.005,
    "compile_s": 1.0 if cold else 0.0, "disk_hits": 0 if cold else 3, "cache_dir": folder}))
"""


def _stub(monkeypatch, code):
    monkeypatch.setattr(bm, "child_command", lambda case, plain=False: [
        sys.executable, "-c", code, json.dumps(case._asdict()), "plain" if plain else "mods"])


def test_first_call_cold_then_disk_in_fresh_processes(monkeypatch):
    """cold: an empty folder; disk: that folder again; new: a second folder the plain twin
    filled (its process's report is not a phase's)."""
    _stub(monkeypatch, STUB)
    a, b = (bm.first_call_row(c) for c in TINY[:2])
    for row in (a, b):
        assert row["attnext_status"] == "ok", row["attnext_reason"]
        assert (row["cold_fwd_s"], row["cold_bwd_s"]) == (1.5, 2.5)     # the folder was empty
        assert (row["disk_fwd_s"], row["disk_bwd_s"]) == (0.01, 0.02)   # the same, filled
        assert (row["new_fwd_s"], row["new_bwd_s"], row["new_compiles"]) == (0.9, 1.1, 1)   # beside the twin's
        assert (row["disk_fwd_again_s"], row["disk_bwd_again_s"]) == (0.004, 0.005)
        assert row["cold_cache_dir"] == row["disk_cache_dir"] != row["new_cache_dir"]
        assert row["cold_entries_after"] == row["new_entries_after"] == 2 and row["disk_compiles"] == 0
        assert not os.path.exists(row["cold_cache_dir"]) and not os.path.exists(row["new_cache_dir"])
        assert row["target_met"] is False and row["target_misses"] == ["cold bwd"]
        assert "twin_fwd_s" not in row and "attnext_note" not in row
    assert a["cold_cache_dir"] != b["cold_cache_dir"]                    # one folder per case
    line = bm.format_row(a)
    assert line.startswith(TINY[0].name) and "MISS cold bwd" in line and "3/0/1" in line.split()
    assert "0.90" in line.split() and "1.10" in line.split()
    assert len(line.split("MISS")[0]) == len(bm.format_header("first_call").split("target")[0])
    json.dumps([a, b])


COUNTING_STUB = r"""
import json, os, sys
folder, counter = os.environ["ATTNEXT_CACHE_DIR"], os.environ["STUB_COUNTER"]
n = int(open(counter).read())
open(counter, "w").write(str(n + 1))
cold = not os.listdir(folder)
open(os.path.join(folder, "entry.cubin"), "w").write("x")
rep = n // 4                      # four processes a repeat: cold, disk, the twin, new
print("attnext-first-call " + json.dumps({
    "fwd_s": [1.0, 3.0, 1.5][rep] if cold else [0.03, 0.01, 0.02][rep], "bwd_s": 0.5 if cold else 0.01,
    "compiles": 3 if cold else 0, "fwd_again_s": 0.004, "bwd_again_s": 0.005,
    "compile_s": 1.0 if cold else 0.0, "disk_hits": 0 if cold else 3, "cache_dir": folder}))
"""


def test_first_call_takes_the_median_of_its_repeats(monkeypatch, tmp_path):
    """reps repeats, each with empty folders of its own: the row has the medians, and every
    repeat's values in *_all."""
    counter = tmp_path / "n"
    counter.write_text("0")
    monkeypatch.setenv("STUB_COUNTER", str(counter))
    _stub(monkeypatch, COUNTING_STUB)
    row = bm.first_call_row(TINY[0], reps=3)
    assert row["attnext_status"] == "ok" and counter.read_text() == "12"
    assert row["cold_fwd_s_all"] == [1.0, 3.0, 1.5] and row["cold_fwd_s"] == 1.5
    assert row["disk_fwd_s_all"] == [0.03, 0.01, 0.02] and row["disk_fwd_s"] == 0.02
    assert row["cold_compiles_all"] == [3, 3, 3] and row["disk_compiles"] == 0   # each cold was cold
    assert row["reps"] == 3 and row["target_met"] is True


def test_a_failed_repeat_leaves_the_row_an_error(monkeypatch, tmp_path):
    """A child that fails in the second repeat's twin: the first repeat's values are kept, the
    row is an error and its target not met (not "ok" beside the medians of the rest)."""
    counter = tmp_path / "n"
    counter.write_text("0")
    monkeypatch.setenv("STUB_COUNTER", str(counter))
    _stub(monkeypatch, COUNTING_STUB.replace('open(counter, "w").write(str(n + 1))\n',
                                             'open(counter, "w").write(str(n + 1))\n'
                                             'if n == 6: sys.exit("twin broke")\n'))
    row = bm.first_call_row(TINY[0], reps=3)
    assert counter.read_text() == "7"                      # no third repeat
    assert row["attnext_status"] == "error" and row["attnext_reason"].startswith("twin: ")
    assert row["reps_done"] == 1 and row["cold_fwd_s_all"] == [1.0] and row["new_fwd_s"] == 0.03
    assert row["target_met"] is None and "- <2 s cold" in bm.format_row(row)


def test_first_call_children_keep_their_bytecode(monkeypatch):
    """The children write and read attnext's bytecode in a folder of their own, as an installed
    attnext would have it, whatever PYTHONDONTWRITEBYTECODE says in the parent."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = bm._child_env("/tmp/k", "/tmp/b")
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"] == "/tmp/b"
    assert env["ATTNEXT_CACHE_DIR"] == "/tmp/k" and env["CUDA_CACHE_DISABLE"] == "1"
    assert "PYTHONDONTWRITEBYTECODE" in os.environ                      # the parent's is kept


def test_first_call_disk_run_that_compiles_is_noted(monkeypatch):
    _stub(monkeypatch, STUB.replace('"compiles": (1 if twin else 3) if cold else 0', '"compiles": 3'))
    row = bm.first_call_row(TINY[0])
    assert row["disk_compiles"] == 3 and "disk cache did not serve" in row["attnext_note"]


def test_first_call_child_failure_is_reported(monkeypatch):
    _stub(monkeypatch, "import sys; print('loading'); sys.stderr.write('boom: no GPU\\n'); sys.exit(3)")
    row = bm.first_call_row(TINY[0])
    assert row["attnext_status"] == "error" and row["target_met"] is None
    assert row["attnext_reason"].startswith("cold: RuntimeError") and "status 3" in row["attnext_reason"]
    assert "boom: no GPU" in row["attnext_reason"] and "disk_fwd_s" not in row
    assert bm.format_row(row).split()[len(TINY[0].name.split()):][:4] == ["-"] * 4
    assert "boom: no GPU" in "\n".join(bc.notes([row]))


def _torch_has_cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_torch_has_cuda(), reason="this machine has CUDA: the child would compile")
def test_real_child_without_cuda_fails_cleanly():
    row = bm.first_call_row(TINY[0], timeout=120)
    assert row["attnext_status"] == "error" and "exited with status" in row["attnext_reason"]


# --- the rows end to end on CPU torch tensors ---

class ModAttnext:
    """attnext's CUDA-facing calls for the mods rows, run by the real CPU backend on float32 NumPy
    copies of CPU torch tensors; fault="table" doubles the table's gradient."""

    def __init__(self, fault=None):
        self.fault = fault

    def attention(self, q, k, v, *, device=None, out=None, return_lse=False, **kw):
        import torch
        assert device == "cuda"
        o, lse = attnext.attention(*(x.detach().float().numpy() for x in (q, k, v)),
                                   return_lse=True, **kw)
        res = torch.from_numpy(o).to(q.dtype)
        if out is not None:
            out.copy_(res)
            res = out
        return (res, torch.from_numpy(lse)) if return_lse else res

    def attention_backward(self, dout, q, k, v, out, lse, *, device=None, **kw):
        import torch
        g = attnext.attention_backward(*(x.detach().float().numpy() for x in (dout, q, k, v, out)),
                                       lse.numpy(), **kw)
        dt = {n: x * (2 if self.fault == "table" else 1) for n, x in g.dtensors.items()}
        return attnext.Grads(*(torch.from_numpy(x).to(q.dtype) for x in (g.dq, g.dk, g.dv)), None, dt)


def _captures_grad(fn):
    import torch
    return any(isinstance(c.cell_contents, torch.Tensor) and c.cell_contents.requires_grad
               for c in (getattr(fn, "__closure__", None) or ()))


def _fake_flex(no_buffer_grad=False):
    """flex_attention's call on (B, H, S, D) tensors, materialised in float32 (CPU Flex has no
    backward); no_buffer_grad: refuse captured tensors that require grad, as old Flex did."""
    import torch

    def flex(q, k, v, score_mod=None, block_mask=None):
        if no_buffer_grad and torch.is_grad_enabled() and _captures_grad(score_mod):
            raise AssertionError("Captured buffers that require grad are not yet supported.")
        B, H, S, D = q.shape
        b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
        qi, ki = torch.arange(S).view(1, 1, S, 1), torch.arange(S).view(1, 1, 1, S)
        s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(D)
        if score_mod is not None:
            s = score_mod(s, b, h, qi, ki)
        s = s.masked_fill(~block_mask.mask_mod(b, h, qi, ki), -math.inf)
        return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)
    return flex


def _cpu_run(monkeypatch, fault=None, no_buffer_grad=False, peers=("flex",)):
    pytest.importorskip("torch")
    monkeypatch.setattr(bm, "attnext", ModAttnext(fault))
    run = bc.Run("cpu", lambda fn: (fn(), 1.0)[1], peers)
    run._flex = _fake_flex(no_buffer_grad)
    return run


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.kind)
def test_mod_rows_on_cpu(monkeypatch, case):
    run = _cpu_run(monkeypatch)
    fwd, bwd = bm.case_rows(run, case)
    names = {"dq", "dk", "dv"} | ({"dtable"} if case.kind == "relbias" else set())
    for row, want in ((fwd, {"out"}), (bwd, names)):
        for who in ("attnext", "flex"):
            assert row[f"{who}_status"] == "ok", row[f"{who}_reason"]
            assert set(row[f"{who}_rel_errors"]) == want
            assert all(e < bc.TOL for e in row[f"{who}_rel_errors"].values())
        assert set(row["ax_vs_flex_errors"]) == want and row["ax_vs_flex"] < bc.TOL
        assert row["attnext_ms"] == row["flex_ms"] == 1.0 and row["ratio_flex"] == pytest.approx(1.0)
        # equal times: 1.0x Flex, under the 1.3x bar
        assert row["target_met"] is False and row["kept_pairs"] == case.kept_pairs()
        json.dumps(row)
        assert bm.format_row(row).startswith(case.name)


def test_flex_without_buffer_gradient_is_said_not_compared(monkeypatch):
    run = _cpu_run(monkeypatch, no_buffer_grad=True)
    fwd, bwd = bm.case_rows(run, TINY[1])
    assert fwd["flex_status"] == "ok" and fwd["ratio_flex"] is not None   # same work: timed
    assert bwd["flex_status"] == "error" and bwd["flex_ms"] is None
    assert bwd["flex_reason"].startswith(bm.NO_BUFFER_GRAD)
    assert bwd["attnext_status"] == "ok" and "dtable" in bwd["attnext_rel_errors"]
    assert bwd["ratio_flex"] is None and bwd["target_met"] is None and bwd["ax_vs_flex"] is None
    assert bm.format_row(bwd).endswith(bm.NO_BUFFER_GRAD)


def test_wrong_table_gradient_is_not_timed(monkeypatch):
    run = _cpu_run(monkeypatch, fault="table")
    fwd, bwd = bm.case_rows(run, TINY[1])
    assert fwd["attnext_status"] == "ok"
    assert bwd["attnext_status"] == "WRONG" and bwd["attnext_ms"] is None
    assert "dtable off by" in bwd["attnext_reason"]
    assert bwd["ax_vs_flex_errors"]["dtable"] > 0.5 and bwd["ax_vs_flex_errors"]["dq"] < bc.TOL
    assert "WRONG" in bm.format_row(bwd).split()


def test_without_flex_in_peers(monkeypatch):
    run = _cpu_run(monkeypatch, peers=("flash",))
    fwd, bwd = bm.case_rows(run, TINY[0])
    assert fwd["attnext_status"] == bwd["attnext_status"] == "ok"
    assert fwd["flex_status"] == "skipped" and fwd["ratio_flex"] is None and fwd["ax_vs_flex"] is None
