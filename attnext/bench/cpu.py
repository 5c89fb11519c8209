"""Forward and backward timings: attnext against PyTorch's SDPA and the float64 reference, and a
score_mod (tanh softcap, run by the CPU interpreter) against its built-in twin softcap=.

    python -m attnext.bench [--device cpu] [--quick] [--reps N] [--rows TEXT] [--json PATH]
    python -m attnext.bench --device cuda ...     the GPU benchmark: attnext/bench/cuda.py (its
                                                  score_mod / mask_mod rows: bench/mods.py)

Every row is validated before it is timed (the kernel lab rule): attnext's out, lse, dq, dk and
dv are compared with `attnext.reference` on the row's own shape when the reference is timed there
(S <= --reference-max-s), else on the same problem shrunk to about VALIDATE_S tokens per sequence.
A row that fails prints FAIL and is not timed; the exit status is then 1.

Times are medians of wall-clock times, attnext and torch taking turns each round (float32;
layout "bshd" for attnext; torch gets contiguous (B, H, S, D) copies made outside the timed
region). Forward: attnext with return_lse=True, torch under no_grad. Backward:
attnext.attention_backward from a prior forward's out and lse; torch's autograd.grad on a graph
built outside the timed region. The reference runs once per row (its backward recomputes the
forward). torch is optional: without it, its columns read "-".

The header names the SIMD path and the threads attnext runs with, and the machine's float32
matrix-product rate (NumPy's matmul of 2048^3, `sgemm_gflops`); fwd/sg and bwd/sg are attnext's
GF/s over it: how close a row runs to what these cores multiply at.
"""
import argparse
import json
import math
import time
from typing import NamedTuple, Optional

import numpy as np

import attnext
from attnext import _env, reference

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

H = 8
VALIDATE_S = 256             # longest sequence of the shrunk problem a big row is validated on
TOL = 1e-4                   # max |attnext - reference| / max |reference|, per tensor
BIG_ROW_FLOPS = 2e10         # forward FLOPs above which a row is timed with at most 3 reps
VARLEN_LENS = (512, 1536, 768, 1280)
SGEMM_N = 2048               # the machine's rate: NumPy's float32 matmul of SGEMM_N^3
# OpenBLAS's worker threads spin for ~0.1 s after each NumPy product (its THREAD_TIMEOUT, 2^28
# cycles) before they sleep, taking a core from whatever runs next: on a 2-core Zen 2, attnext's
# and torch's calls alike ran up to 2x slower for ~130 ms after the reference's products
BLAS_IDLE_S = 0.25
TORCH_VARLEN_NOTE = "torch runs each sequence separately (one SDPA call per sequence)"


class Case(NamedTuple):
    B: int
    S: int
    D: int
    causal: bool
    lens: Optional[tuple] = None     # packed varlen: the sequence lengths (B = len(lens), S = max)

    @property
    def name(self):
        c = " causal" if self.causal else ""
        if self.lens:
            return f"varlen {self.B} seqs T{sum(self.lens)} H{H} D{self.D}{c}"
        return f"B{self.B} H{H} S{self.S} D{self.D}{c}"

    def flops(self):
        """Forward FLOPs: 4 * H * S^2 * D per sequence (QK^T and PV), halved for causal."""
        per_seq = [self.S] * self.B if not self.lens else self.lens
        return sum(4 * H * s * s * self.D for s in per_seq) / (2 if self.causal else 1)

    def shrunk(self):
        """The same problem with about VALIDATE_S tokens per sequence."""
        f = math.ceil(self.S / VALIDATE_S)
        lens = tuple(max(1, n // f) for n in self.lens) if self.lens else None
        return self._replace(S=max(lens) if lens else max(1, self.S // f), lens=lens)


def cases(quick):
    if quick:
        return [Case(1, 256, 64, False), Case(1, 256, 64, True),
                Case(4, 192, 64, True, (64, 192, 128, 128))]
    grid = [Case(B, S, D, c) for S in (1024, 2048, 4096) for B in (1, 2) for D in (64, 128)
            for c in (False, True)]
    return grid + [Case(len(VARLEN_LENS), max(VARLEN_LENS), 64, True, VARLEN_LENS)]


def _time(fns, warmup=1, reps=5):
    """Median wall time in ms of each fn in the dict fns, keyed alike.

    The fns take turns, one call each per round, so that a burst of load from elsewhere on a
    shared machine slows every contender alike and the ratios stay honest. NumPy's BLAS threads
    (the reference, the sgemm rate) are left BLAS_IDLE_S to go to sleep first.
    """
    time.sleep(BLAS_IDLE_S)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {key: [] for key in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: 1e3 * float(np.median(t)) for key, t in times.items()}


def _inputs(case):
    """q, k, v, dout in attnext's layout (B, S, H, D), or packed (T, H, D) with cu_seqlens."""
    rng = np.random.default_rng(0)
    shape = (sum(case.lens), H, case.D) if case.lens else (case.B, case.S, H, case.D)
    q, k, v, dout = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    cu = np.concatenate([[0], np.cumsum(case.lens)]).astype(np.int32) if case.lens else None
    return q, k, v, dout, cu


def _forward(lib, case, q, k, v, cu):
    """(out, lse) from attnext or attnext.reference (they share the public signatures)."""
    if case.lens:
        return lib.varlen_attention(q, k, v, cu, cu, causal=case.causal, return_lse=True)
    return lib.attention(q, k, v, causal=case.causal, return_lse=True)


def _backward(lib, case, dout, q, k, v, out, lse, cu):
    if case.lens:
        return lib.varlen_attention_backward(dout, q, k, v, out, lse, cu, cu, causal=case.causal)
    return lib.attention_backward(dout, q, k, v, out, lse, causal=case.causal)


def _validate(case, ref=None):
    """Raises ValueError unless attnext matches the reference on `case` (ref: its precomputed
    (out, lse, grads) there, if any)."""
    q, k, v, dout, cu = _inputs(case)
    if ref is None:
        r_out, r_lse = _forward(reference, case, q, k, v, cu)
        ref = r_out, r_lse, _backward(reference, case, dout, q, k, v, r_out, r_lse, cu)
    out, lse = _forward(attnext, case, q, k, v, cu)
    grads = _backward(attnext, case, dout, q, k, v, out, lse, cu)
    (r_out, r_lse, r_grads) = ref
    for name, got, want in (("out", out, r_out), ("lse", lse, r_lse), ("dq", grads.dq, r_grads.dq),
                            ("dk", grads.dk, r_grads.dk), ("dv", grads.dv, r_grads.dv)):
        err = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)
        if not err <= TOL:   # NaN fails too
            raise ValueError(f"{name} off by {err:.2e} (relative to max |reference|; "
                             f"tolerance {TOL}) on {case.name}")


def _time_reference(case):
    """One timed run of the reference forward and backward; also returns its results."""
    q, k, v, dout, cu = _inputs(case)
    t0 = time.perf_counter()
    out, lse = _forward(reference, case, q, k, v, cu)
    t1 = time.perf_counter()
    grads = _backward(reference, case, dout, q, k, v, out, lse, cu)
    t2 = time.perf_counter()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), (out, lse, grads)


def _torch_fns(case, q, k, v, dout):
    """(forward, backward) closures for torch SDPA; varlen runs each sequence separately."""
    if case.lens:   # per sequence (1, H, L, D)
        bounds = np.cumsum((0,) + case.lens)
        pieces = [[torch.from_numpy(x[a:b]).transpose(0, 1)[None].contiguous()
                   for x in (q, k, v, dout)] for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        pieces = [[torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v, dout)]]
    leaves = [[x.detach().requires_grad_() for x in p[:3]] for p in pieces]
    outs = [F.scaled_dot_product_attention(*lv, is_causal=case.causal) for lv in leaves]

    def forward():
        with torch.no_grad():
            for tq, tk, tv, _ in pieces:
                F.scaled_dot_product_attention(tq, tk, tv, is_causal=case.causal)

    def backward():
        torch.autograd.grad(outs, [x for lv in leaves for x in lv],
                            grad_outputs=[p[3] for p in pieces], retain_graph=True)
    return forward, backward


def run_case(case, args):
    row = {"case": case.name, "B": case.B, "H": H, "S": case.S, "D": case.D,
           "causal": case.causal, "seqlens": list(case.lens) if case.lens else None,
           "note": TORCH_VARLEN_NOTE if case.lens and torch else ""}
    row["reps"] = reps = min(args.reps, 3) if case.flops() > BIG_ROW_FLOPS else args.reps
    for key in ("attnext", "torch", "reference"):
        row[f"{key}_fwd_ms"] = row[f"{key}_bwd_ms"] = None
    ref = None
    if case.S <= args.reference_max_s:
        row["reference_fwd_ms"], row["reference_bwd_ms"], ref = _time_reference(case)
    check = case if ref is not None else case.shrunk()
    row["validated_on"] = check.name
    try:
        _validate(check, ref)
    except ValueError as e:
        row["error"] = f"FAIL: {e}"
        return row

    q, k, v, dout, cu = _inputs(case)
    out, lse = _forward(attnext, case, q, k, v, cu)
    fns = {"attnext_fwd_ms": lambda: _forward(attnext, case, q, k, v, cu),
           "attnext_bwd_ms": lambda: _backward(attnext, case, dout, q, k, v, out, lse, cu)}
    if torch is not None:
        fns["torch_fwd_ms"], fns["torch_bwd_ms"] = _torch_fns(case, q, k, v, dout)
    row.update(_time(fns, args.warmup, reps))
    for d, mult in (("fwd", 1.0), ("bwd", 2.5)):
        ax = row[f"attnext_{d}_ms"]
        row[f"torch_over_attnext_{d}"] = _ratio(row[f"torch_{d}_ms"], ax)
        row[f"reference_over_attnext_{d}"] = _ratio(row[f"reference_{d}_ms"], ax)
        row[f"attnext_{d}_gflops"] = gf = mult * case.flops() / (ax * 1e6)
        row[f"attnext_{d}_of_sgemm"] = gf / args.sgemm_gflops if args.sgemm_gflops else None
    return row


def _ratio(a, b):
    return None if a is None or b is None else a / b


def sgemm_gflops(n=SGEMM_N, reps=5):
    """The machine's float32 matrix-product rate, GFLOP/s: NumPy's matmul (its BLAS, at the BLAS's
    own thread count) of two n x n float32 matrices, the median of reps runs after one untimed.
    What the GF/s columns are read against: attention's products are matrix products."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    np.matmul(a, b, out=c)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / (float(np.median(times)) * 1e9)


# --- score_mod against its built-in twin --------------------------------------------------------

SOFTCAP = 20.0
SCORE_MOD_TARGET = 1.5       # the bound: a score_mod at most 1.5x its built-in twin


def _softcap_mod(cap):
    return lambda score, b, h, q_idx, kv_idx: cap * np.tanh(score / cap)


def score_mod_cases(quick):
    if quick:
        return [Case(1, 256, 64, True)]
    return [Case(1, S, 64, c) for S in (1024, 4096) for c in (False, True)] + [
        Case(1, 2048, 128, True)]


def run_score_mod_case(case, args):
    """score_mod tanh softcap against softcap= on one shape, forward and backward, validated
    against the reference (on the shape shrunk to about VALIDATE_S) before timing."""
    name = f"softcap score_mod vs softcap= {case.name}"
    row = {"case": name, "B": case.B, "H": H, "S": case.S, "D": case.D, "causal": case.causal,
           "softcap": SOFTCAP}
    mod = _softcap_mod(SOFTCAP)
    variants = {"builtin": dict(softcap=SOFTCAP), "score_mod": dict(score_mod=mod)}
    small = case.shrunk()
    q, k, v, dout, _ = _inputs(small)
    r_out, r_lse = reference.attention(q, k, v, causal=small.causal, softcap=SOFTCAP,
                                       return_lse=True)
    r_g = reference.attention_backward(dout, q, k, v, r_out, r_lse, causal=small.causal,
                                       softcap=SOFTCAP)
    for key, opts in variants.items():
        out, lse = attnext.attention(q, k, v, causal=small.causal, return_lse=True, **opts)
        g = attnext.attention_backward(dout, q, k, v, out, lse, causal=small.causal, **opts)
        for what, got, want in (("out", out, r_out), ("dq", g.dq, r_g.dq), ("dk", g.dk, r_g.dk)):
            err = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)
            if not err <= TOL:
                row["error"] = f"FAIL: {key} {what} off by {err:.2e} on {small.name}"
                return row
    q, k, v, dout, _ = _inputs(case)
    fns = {}
    for key, opts in variants.items():
        out, lse = attnext.attention(q, k, v, causal=case.causal, return_lse=True, **opts)
        fns[f"{key}_fwd_ms"] = (lambda o=opts: attnext.attention(
            q, k, v, causal=case.causal, return_lse=True, **o))
        fns[f"{key}_bwd_ms"] = (lambda o=opts, out=out, lse=lse: attnext.attention_backward(
            dout, q, k, v, out, lse, causal=case.causal, **o))
    row["reps"] = reps = min(args.reps, 3) if case.flops() > BIG_ROW_FLOPS else args.reps
    row.update(_time(fns, args.warmup, reps))
    for d in ("fwd", "bwd"):
        row[f"score_mod_over_builtin_{d}"] = row[f"score_mod_{d}_ms"] / row[f"builtin_{d}_ms"]
    return row


MOD_COLUMNS = [("case", "case", 58), ("builtin_fwd_ms", "softcap=", 9),
               ("score_mod_fwd_ms", "score_mod", 10), ("score_mod_over_builtin_fwd", "mod/b", 6),
               ("builtin_bwd_ms", "softcap=", 9), ("score_mod_bwd_ms", "score_mod", 10),
               ("score_mod_over_builtin_bwd", "mod/b", 6)]


def _format_mod_row(row):
    if "error" in row:
        return f"{row['case']:<{MOD_COLUMNS[0][2]}} {row['error']}"
    return " ".join([f"{row['case']:<{MOD_COLUMNS[0][2]}}"]
                    + [f"{_cell(row[key]):>{w}}" for key, _, w in MOD_COLUMNS[1:]])


COLUMNS = [("case", "case", 35), ("attnext_fwd_ms", "fwd ms", 9), ("torch_fwd_ms", "torch", 9),
           ("torch_over_attnext_fwd", "t/ax", 6), ("reference_fwd_ms", "ref", 9),
           ("reference_over_attnext_fwd", "ref/ax", 7), ("attnext_bwd_ms", "bwd ms", 9),
           ("torch_bwd_ms", "torch", 9), ("torch_over_attnext_bwd", "t/ax", 6),
           ("reference_bwd_ms", "ref", 9), ("reference_over_attnext_bwd", "ref/ax", 7),
           ("attnext_fwd_gflops", "GF/s fwd", 9), ("attnext_bwd_gflops", "GF/s bwd", 9),
           ("attnext_fwd_of_sgemm", "fwd/sg", 7), ("attnext_bwd_of_sgemm", "bwd/sg", 7)]


def _cell(x):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.0f}" if x >= 1000 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _format_row(row):
    if "error" in row:
        return f"{row['case']:<{COLUMNS[0][2]}} {row['error']}"
    name = row["case"] + (" *" if row["note"] else "")
    return " ".join([f"{name:<{COLUMNS[0][2]}}"]
                    + [f"{_cell(row[key]):>{w}}" for key, _, w in COLUMNS[1:]])


def _header(threads, ref_max_s, sgemm):
    cpu = attnext.info()["backends"]["cpu"]
    env = _env.get("ATTNEXT_NUM_THREADS") or "unset"
    lines = [f"attnext {attnext.__version__} CPU backend: {cpu}; threads {threads} "
             f"(ATTNEXT_NUM_THREADS={env}, OpenMP default {attnext._C.openmp_threads()})",
             f"the machine: NumPy's float32 matmul ({SGEMM_N}^3, its BLAS's threads) runs at "
             f"{sgemm:.1f} GFLOP/s; fwd/sg, bwd/sg = attnext's GF/s over that rate"]
    if torch is not None:
        torch.set_num_threads(threads)
        lines.append(f"torch {torch.__version__} CPU SDPA, torch.set_num_threads({threads}) "
                     f"-> get_num_threads()={torch.get_num_threads()}")
    else:
        lines.append("torch: not installed (its columns read '-')")
    lines.append(f"float32, H={H}; ms = median wall time; t/ax = torch/attnext and ref/ax = "
                 f"reference/attnext (>1: attnext faster); GF/s: attnext, 4*B*H*S^2*D per forward "
                 f"(halved if causal), backward 2.5x")
    lines.append(f"ref = attnext.reference (float64 NumPy, its backward recomputes the forward), "
                 f"1 run, only where S <= {ref_max_s}; every row is validated against it before "
                 f"timing (on the row's shape where ref is timed, else shrunk to S ~ {VALIDATE_S})")
    return lines


def _count(least):
    """argparse type: an int >= least."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
        return n
    return parse


def parser():
    """The CPU table's command line: its whole description and every option's help."""
    p = argparse.ArgumentParser(prog="python -m attnext.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="The GPU benchmark's own options: python -m attnext.bench "
                                       "--device cuda --help")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default): this table; cuda: the GPU benchmark, with its own options "
                        "(--device cuda --help)")
    p.add_argument("--quick", action="store_true", help="a few small rows (smoke test)")
    p.add_argument("--reps", type=_count(1), default=5, metavar="N",
                   help="timed repetitions per row, medians reported (default 5; big rows: at "
                        "most 3)")
    p.add_argument("--warmup", type=_count(0), default=1, metavar="N",
                   help="untimed calls of each function before the timed ones (default 1)")
    p.add_argument("--reference-max-s", type=_count(0), default=2048, metavar="S",
                   help="time the float64 reference only on rows with S at most this, 1 "
                        "repetition (default 2048); larger rows are validated on a shrunk copy")
    p.add_argument("--rows", metavar="TEXT", help="only the rows whose case name contains TEXT")
    p.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    return p


def main(argv=None):
    """The CPU table (`python -m attnext.bench [--device cpu]`); exit status 1 when a row failed."""
    args = parser().parse_args(argv)
    threads = int(_env.get("ATTNEXT_NUM_THREADS") or attnext._C.openmp_threads() or 1)
    args.sgemm_gflops = sgemm_gflops(SGEMM_N // 4 if args.quick else SGEMM_N)
    header = _header(threads, args.reference_max_s, args.sgemm_gflops)
    print("\n".join(header))
    print(" ".join(f"{title:<{w}}" if key == "case" else f"{title:>{w}}"
                   for key, title, w in COLUMNS), flush=True)
    rows = []
    for case in cases(args.quick):
        if args.rows and args.rows not in case.name:
            continue
        rows.append(run_case(case, args))
        print(_format_row(rows[-1]), flush=True)
    for note in sorted({r["note"] for r in rows if r["note"]}):
        print(f"* {note}")
    mod_rows = []
    mod_cases = [c for c in score_mod_cases(args.quick)
                 if not args.rows or args.rows in f"softcap score_mod vs softcap= {c.name}"]
    if mod_cases:
        print(f"\nscore_mod tanh softcap (cap {SOFTCAP}, the CPU interpreter) against the built-in "
              f"softcap=: forward and backward ms, mod/b = score_mod / built-in (target <= "
              f"{SCORE_MOD_TARGET})")
        print(" ".join(f"{title:<{w}}" if key == "case" else f"{title:>{w}}"
                       for key, title, w in MOD_COLUMNS), flush=True)
    for case in mod_cases:
        mod_rows.append(run_score_mod_case(case, args))
        print(_format_mod_row(mod_rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "sgemm_gflops": args.sgemm_gflops, "rows": rows,
                       "score_mod_rows": mod_rows}, f, indent=1)
    return 1 if any("error" in r for r in rows + mod_rows) else 0
