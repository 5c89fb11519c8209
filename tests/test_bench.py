"""Smoke test for `python -m attnext.bench`: the quick table runs, validates and writes its JSON."""
import json
import math
import subprocess
import sys

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
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) >= 3 and any(r["seqlens"] for r in rows)
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert "error" not in row
        for key in TIMED + ("attnext_fwd_gflops", "attnext_bwd_gflops"):
            assert _positive(row[key]), (row["case"], key, row[key])
        torch_ran = row["torch_fwd_ms"] is not None
        for key in ("torch_fwd_ms", "torch_bwd_ms", "torch_over_attnext_fwd",
                    "torch_over_attnext_bwd"):
            assert (_positive(row[key]) if torch_ran else row[key] is None), (row["case"], key)


def test_cuda_placeholder_exits_cleanly():
    proc = subprocess.run([sys.executable, "-m", "attnext.bench", "--device", "cuda"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "not available yet" in proc.stdout
