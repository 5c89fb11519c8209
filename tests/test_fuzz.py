"""Differential fuzzing in CI (attnext/fuzz.py): random problems, the CPU backend against the
float64 reference, for a bounded time; and the `python -m attnext.fuzz` command line.

ATTNEXT_FUZZ_SECONDS sets the in-process budget (default 100 s). The run is reproducible: a fixed
hypothesis seed (ATTNEXT_FUZZ_SEED, default 0) and no example database, so every CI run draws the
same sequence of cases (how far along it gets depends only on the machine's speed), and a failure
names the seed and the case's spec, which `python -m attnext.fuzz --replay SPEC` reruns. A fixed
seed rather than hypothesis's derandomize: the sequence then does not change whenever the test
function's source does, and the same seed reruns it from the command line (--seed).
"""
import os
import subprocess
import sys

from attnext import fuzz

BUDGET_S = float(os.environ.get("ATTNEXT_FUZZ_SECONDS", "100"))
SEED = int(os.environ.get("ATTNEXT_FUZZ_SEED", "0"))


def test_fuzz_cpu_against_reference():
    lines = []
    ran, mismatches = fuzz.fuzz(BUDGET_S, seed=SEED, backends=fuzz.usable_backends(("cpu",)),
                                log=lines.append)
    assert ran > 0
    assert not mismatches, f"{len(mismatches)} mismatches in {ran} cases (seed {SEED}):\n" + \
        "\n".join(lines)


def test_known_cases_replay():
    """A spec printed by the fuzzer reruns exactly: here, one of each kind of case."""
    base = {"seed": 3, "backward": True, "dtype": "float16", "readonly": True, "causal": True,
            "window": (2, -1), "softcap": 5.0, "scale": None, "alibi": "h",
            "bias": {"shape": (1, 5, 7), "dtype": "bfloat16", "view": "bcast", "mag": 1.0,
                     "neginf": True},
            "mask": {"shape": (2, 1, 5, 1), "p": 0.7, "dead_rows": 1, "view": "flip"},
            "score_mod": None, "mask_mod": None, "out": "step", "deterministic": False,
            "views": {"q": ("flip", 1), "k": ("perm", (2, 0, 1, 3)), "v": ("bcast", 0)}}
    dense = dict(base, api="attention", layout="bshd", seqlens_q=[5, 3], seqlens_k=[7, 0],
                 B=2, Sq=5, Sk=7, Hq=4, Hk=2, D=9, Dv=3)
    assert fuzz.run_case(dense) == []
    packed = dict(base, api="varlen", layout="thd", seg_q=[3, 0, 2], seg_k=[4, 2, 0],
                  used_q=[2, 0, 2], used_k=[4, 1, 0], pad_q=3, pad_k=1, max_q=5, max_k=7,
                  B=3, Sq=5, Sk=7, Hq=4, Hk=1, D=9, Dv=3, score_mod="trig", mask_mod="parity",
                  bias=dict(base["bias"], shape=(3, 1, 5, 7), neginf=False), mask=None,
                  views={"q": ("step", 0), "k": ("pad", 2), "v": ("fortran",)})
    assert fuzz.run_case(packed) == []


def test_cli_runs_and_reports():
    res = subprocess.run([sys.executable, "-m", "attnext.fuzz", "--minutes", "0.05", "--seed", "1",
                          "--backends", "cpu"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "seed 1" in res.stdout
    ran = int(res.stdout.split("cases run: ")[1].split(",")[0])
    assert ran > 0 and "mismatches: 0" in res.stdout, res.stdout
