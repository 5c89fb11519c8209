"""Smoke test for `torchrun -m attnext.bench.distributed`: two CPU processes (gloo) run a tiny
row of the ring against one process and write its JSON: times, speedup, the
stalls behind the hidden share, and the transfers' cost."""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")


def test_two_process_bench_writes_rows(tmp_path):
    path = tmp_path / "dist.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", "-m", "attnext.bench.distributed", "--device", "cpu",
                           "--seqlens", "64,128", "--heads", "2", "--dim", "8", "--reps", "3",
                           "--json", str(path)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(path.read_text())
    assert [r["S"] for r in rows] == [64, 128] and all(r["ranks"] == 2 and r["causal"] for r in rows)
    for row in rows:
        for name in ("fwd", "fwd_bwd"):
            for what in ("one", "ring", "compute", "comm"):
                t = row[f"{name}_{what}_s"]
                assert math.isfinite(t) and t > 0, (name, what, t)
            assert row[f"{name}_speedup"] == pytest.approx(row[f"{name}_one_s"] / row[f"{name}_ring_s"])
            assert 0 <= row[f"{name}_stalled_s"] and math.isfinite(row[f"{name}_stalled_s"])
            assert 0 <= row[f"{name}_hidden"] <= 1
            assert row[f"{name}_cost_iqr"] >= 0 and math.isfinite(row[f"{name}_cost"])
    assert "2 ranks (gloo)" in proc.stdout and "S    128" in proc.stdout
