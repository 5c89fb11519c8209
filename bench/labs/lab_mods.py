"""Kernel lab: score_mod / mask_mod on the GPU against FlexAttention, plus the time of each kernel
launch of a call (--kernels).

    python3 bench/labs/lab_mods.py [--cases softcap,relbias,doc,doc_causal,window] [--quick]
                              [--kernels] [--first-call] [--json PATH]

The rows, their validation and the first-call section are attnext/bench/mods.py's (the mods and
first-call sections of `python -m attnext.bench --device cuda`): this script runs them for the
chosen cases only, Flex as the one peer, and adds --kernels, the per-launch times. Every row is
checked before it is timed (bench_mods' rule); --kernels then times the same case's kernels.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import attnext  # noqa: E402
from attnext.bench import cuda as bench_cuda, mods as bench_mods  # noqa: E402


def kernel_times(call, reps=5):
    """[(grid, ms)] of the launches one call makes: CUDA events around each launch on its stream,
    the median over reps calls (a replay alone would read the call's scratch after its end)."""
    from attnext import _C
    launch, seen = _C.cuda_launch_attention, []

    def timed(*args):
        stream = torch.cuda.ExternalStream(args[4]) if args[4] else torch.cuda.default_stream()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        launch(*args)
        e1.record(stream)
        seen.append(("x".join(map(str, args[1])), e0, e1))
    _C.cuda_launch_attention = timed
    runs = []
    try:
        for _ in range(reps):
            seen.clear()
            call()
            torch.cuda.synchronize()
            runs.append([(g, e0.elapsed_time(e1)) for g, e0, e1 in seen])
    finally:
        _C.cuda_launch_attention = launch
    return [(runs[0][i][0], float(np.median([r[i][1] for r in runs]))) for i in range(len(runs[0]))]


def print_kernels(case):
    q, k, v, dout = (torch.randn(case.B, case.S, case.H, case.D, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    kw = dict(bench_mods.attnext_mods(case), device="cuda")
    bwd_kw = dict(bench_mods.attnext_backward_mods(case), device="cuda")
    out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
    for d, call in (("fwd", lambda: attnext.attention(q, k, v, **kw)),
                    ("bwd", lambda: attnext.attention_backward(dout, q, k, v, out, lse, **bwd_kw))):
        print(f"  {case.name} {d} kernels: "
              + ", ".join(f"{g} {ms:.3f} ms" for g, ms in kernel_times(call)), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(bench_mods.KINDS))
    ap.add_argument("--quick", action="store_true", help="the bench's --quick sizes (B8 S2048)")
    ap.add_argument("--kernels", action="store_true", help="also time each launch of a call alone")
    ap.add_argument("--first-call", action="store_true",
                    help="also the first calls in fresh processes, cold and from the disk cache")
    ap.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    args = ap.parse_args()
    cases = [bench_mods.mod_case(kind, args.quick) for kind in args.cases.split(",")]
    torch.set_float32_matmul_precision("highest")     # the float32 reference stays float32
    time_ms, timing = bench_cuda.make_timer(25, 100)
    run = bench_cuda.Run("cuda", time_ms, ("flex",), torch.cuda.synchronize)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, attnext "
          f"{attnext.__version__}, bf16; {timing}", flush=True)
    rows = bench_mods.sections(run, cases, args.first_call)
    print()
    for line in bench_cuda.notes(rows):
        print(line)
    if args.kernels:
        for case in cases:
            print_kernels(case)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
