"""The GPU bench's ALiBi rows (attnext/bench/mods.py) without a GPU: a constant slope, and the
slopes read from a captured array with the backward's dtensors=False, whose kernels are the
constant row's (tests/test_dtensors_select.py). Their names and sizes, the functions on the CPU
backend, and the rows end to end on CPU torch tensors (test_bench_mods' stand-ins), validated
as every row is before it is timed. Nothing here is timed."""
import json

import numpy as np
import pytest

import attnext
from attnext import reference
from attnext.bench import cuda as bc
from attnext.bench import mods as bm

from test_bench_mods import ModAttnext, _cpu_run

ALIBI = [bm.ModCase("alibi_const", 2, 64, 4, 16), bm.ModCase("alibi_slopes", 2, 64, 4, 16)]


def test_alibi_rows_names_and_sizes():
    full = {c.kind: c for c in bm.cases()}
    assert full["alibi_const"].name == "alibi0.0625 B2 S8192 H16 D128 causal"
    assert full["alibi_slopes"].name == "alibi[h] nograd B2 S8192 H16 D128 causal"
    assert [k for k in bm.KINDS if k.startswith("alibi")] == ["alibi_const", "alibi_slopes"]
    for case in (full["alibi_const"], full["alibi_slopes"]):
        assert case.kept_pairs() == 2 * 8192 * 8193 // 2 and len(case.name) <= bm.MOD_COLUMNS[0][1]
        assert bm.case_from_json(json.dumps(case._asdict())) == case
    slopes = bm.alibi_slopes(full["alibi_slopes"])
    assert slopes.dtype == np.float32 and np.allclose(slopes, 2.0 ** (-8.0 * np.arange(1, 17) / 16))
    assert bm.attnext_backward_mods(full["alibi_slopes"])["dtensors"] is False
    assert "dtensors" not in bm.attnext_backward_mods(full["alibi_const"])
    assert "dtensors" not in bm.attnext_mods(full["alibi_slopes"])     # the forward takes none


@pytest.mark.parametrize("case", ALIBI, ids=lambda c: c.kind)
def test_alibi_functions_on_the_cpu_backend(case, rng):
    """The rows' NumPy functions against the reference; the slopes row's backward returns no
    array gradient."""
    q, k, v, dout = (rng.standard_normal((case.B, case.S, case.H, case.D)).astype(np.float32)
                     for _ in range(4))
    mods = bm.attnext_mods(case)
    out, lse = attnext.attention(q, k, v, return_lse=True, **mods)
    assert float(np.max(np.abs(out - reference.attention(q, k, v, **mods)))) < 1e-4
    g = attnext.attention_backward(dout, q, k, v, out, lse, **bm.attnext_backward_mods(case))
    assert g.dtensors == {}
    if case.kind == "alibi_slopes":      # the default would return the slopes' gradient
        assert list(attnext.attention_backward(dout, q, k, v, out, lse, **mods).dtensors) == ["slopes"]


class RecordingAttnext(ModAttnext):
    """ModAttnext that keeps the keyword arguments of every backward."""

    def __init__(self):
        super().__init__()
        self.backward_kw = []

    def attention_backward(self, *args, **kw):
        self.backward_kw.append(dict(kw))
        return super().attention_backward(*args, **kw)


@pytest.mark.parametrize("case", ALIBI, ids=lambda c: c.kind)
def test_alibi_rows_on_cpu(monkeypatch, case):
    """Both rows validate (out; dq, dk, dv, no slopes gradient on either side) and time; the
    slopes row's backward is called with dtensors=False."""
    run = _cpu_run(monkeypatch)
    recording = RecordingAttnext()
    monkeypatch.setattr(bm, "attnext", recording)
    fwd, bwd = bm.case_rows(run, case)
    for row, want in ((fwd, {"out"}), (bwd, {"dq", "dk", "dv"})):
        for who in ("attnext", "flex"):
            assert row[f"{who}_status"] == "ok", row[f"{who}_reason"]
            assert set(row[f"{who}_rel_errors"]) == want
            assert all(e < bc.TOL for e in row[f"{who}_rel_errors"].values())
        # equal times: 1.0x Flex, under the 1.3x bar
        assert row["ax_vs_flex"] < bc.TOL and row["target_met"] is False
        assert bm.format_row(row).startswith(case.name)
        json.dumps(row)
    assert recording.backward_kw
    assert all(kw.get("dtensors") is (False if case.kind == "alibi_slopes" else None)
               for kw in recording.backward_kw), recording.backward_kw
