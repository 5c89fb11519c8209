"""Context-parallel attention against one device: `torchrun --nproc-per-node N -m attnext.bench.distributed`.

    torchrun --nproc-per-node 2 -m attnext.bench.distributed [--seqlens 32768,65536,131072,262144]
        [--heads 16] [--dim 128] [--no-causal] [--reps 5] [--json PATH]
    torchrun --nproc-per-node 2 -m attnext.bench.distributed --device cpu --seqlens 256 --heads 2 --dim 16

Each row: one sequence of S tokens (B 1, bf16 on CUDA, float32 on the CPU; causal unless
--no-causal, split zigzag), forward and forward + backward:
  1 dev     attnext.torch.attention on the whole sequence on rank 0's device alone
  N dev     attnext.distributed.ring_attention over the N ranks (NCCL on CUDA, gloo on the CPU)
  speedup   1 dev's time / N dev's time (the issue's bound at S >= 128k causal: 1.8x on 2 GPUs)
  hidden    the share of the ring's communication hidden under its attention: 1 - stalled / comm,
            where stalled is the time the attention's stream spent waiting for a transfer (CUDA
            events recorded on it before and after each wait, summed over the run; the largest
            rank's median; on the CPU the host's time in the waits) and comm the ring's transfers
            alone (the same hops, nothing else running)
  cost      the ring's time past the same ring with every rank using its own K and V at each
            step (no transfer), run alternately: the median of the paired differences over the
            no-transfer ring's median, +- their interquartile range over it; what the transfers
            cost in all (stalls, and the copies' share of the SMs and memory), resolved to about
            the run-to-run noise, a percent or two
Times are medians of --reps runs (wall clock between barriers, the devices synchronised), after
the ring's out is checked against the one-device call's (relative difference under 2%).
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from .. import distributed as axd
from .. import torch as axt


def _parser():
    p = argparse.ArgumentParser(prog="torchrun -m attnext.bench.distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seqlens", default="32768,65536,131072,262144",
                   help="whole sequence lengths, comma-separated (multiples of 2 x ranks)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file (rank 0)")
    return p


def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _run_s(fn, device, together=True):
    """Wall seconds of one run of fn, the device synchronised before and after; together:
    every rank starts and ends it at a barrier."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if together:
            dist.barrier()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def _median_s(fn, device, reps, together=True):
    """Median wall seconds of fn over reps runs (_run_s) after one untimed run (compiles, plans,
    NCCL's first connection)."""
    fn()
    return statistics.median(_run_s(fn, device, together) for _ in range(reps))


def _paired_s(fn_a, fn_b, device, reps):
    """(median of fn_a, median of fn_b, median of a - b, interquartile range of a - b) in wall
    seconds: a and b alternate, each difference taken between a run and its neighbour, so that
    drift between runs (clocks, the other ranks, the host) cancels instead of landing in the
    difference of two medians taken apart."""
    fn_a()
    fn_b()
    a, b = [], []
    for _ in range(reps):
        a.append(_run_s(fn_a, device))
        b.append(_run_s(fn_b, device))
    diff = [x - y for x, y in zip(a, b)]
    q = statistics.quantiles(diff, n=4) if len(diff) > 1 else [diff[0]] * 3
    return statistics.median(a), statistics.median(b), statistics.median(diff), q[2] - q[0]


def _validate(out, want, causal):
    """The ring's out, gathered whole, against the one-device call's (rank 0): max |diff| /
    max |want| under VALIDATE_TOL, else the row is not timed."""
    whole = axd.unshard(out.detach(), causal=causal)
    if dist.get_rank() == 0:
        err = ((whole.float() - want.float()).abs().max() / want.float().abs().max()).item()
        if not err < VALIDATE_TOL:
            raise RuntimeError(f"the ring's out differs from the one-device call's by {err:.3g} "
                               f"(relative): not timed")


VALIDATE_TOL = 0.02


class _NoTransfer:
    """A ring whose exchange hands back the tensors sent: the same attention, no transfer."""

    def __init__(self):
        self.saved = axd._Group.exchange

    def __enter__(self):
        axd._Group.exchange = lambda self, tensors, back=False: (list(tensors), [], ())

    def __exit__(self, *exc):
        axd._Group.exchange = self.saved


class _Stalls:
    """The ring's waits for its transfers timed on the stream that waits (_Group.finish wrapped):
    CUDA events recorded before and after each wait on the attention's stream (the time it
    stood still: the transfer's end past the end of the work queued before the wait); on the
    CPU the host's seconds in the wait. seconds() after a run: the sum, then cleared."""

    def __init__(self, device):
        self.device, self.marks = device, []
        self.saved, self.wait = axd._Group.__dict__["finish"], axd._Group.finish

    def finish(self, pending):
        if self.device.type == "cuda":
            before, after = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            before.record()
            recv = self.wait(pending)
            after.record()
            self.marks.append((before, after))
        else:
            t = time.perf_counter()
            recv = self.wait(pending)
            self.marks.append(time.perf_counter() - t)
        return recv

    def seconds(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            total = sum(b.elapsed_time(a) for b, a in self.marks) / 1e3
        else:
            total = sum(self.marks)
        self.marks = []
        return total

    def __enter__(self):
        axd._Group.finish = staticmethod(self.finish)
        return self

    def __exit__(self, *exc):
        axd._Group.finish = self.saved


def _stalled_s(fn, device, reps):
    """The largest rank's median, over reps runs, of the seconds its attention waited for the
    ring's transfers (_Stalls)."""
    with _Stalls(device) as stalls:
        fn()
        stalls.seconds()
        runs = []
        for _ in range(reps):
            _run_s(fn, device)
            runs.append(stalls.seconds())
    mine = torch.tensor([statistics.median(runs)], dtype=torch.float64,
                        device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def _without_transfers(fn):
    """fn run as a ring whose ranks each keep their own K and V (_NoTransfer)."""
    def run():
        with _NoTransfer():
            fn()
    return run


def run_row(S, args, device, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device=device).manual_seed(S)
    shape = (1, S, args.heads, args.dim)
    Q, K, V, dO = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4))
    q, k, v, do = (axd.shard(x, causal=args.causal) for x in (Q, K, V, dO))
    for x in (q, k, v):
        x.requires_grad_()

    def ring_fwd():
        with torch.no_grad():
            axd.ring_attention(q, k, v, causal=args.causal)

    def ring_both():
        out = axd.ring_attention(q, k, v, causal=args.causal)
        torch.autograd.grad(out, (q, k, v), do)

    blocks = (k.detach().contiguous(), v.detach().contiguous())
    group = axd._Group(None)

    def comm(sends):                           # the forward's transfers, then the backward's
        def run():                             # (K / V and the float32 dK / dV, N - 1 hops each)
            x = blocks
            for _ in range(world - 1):
                x = group.finish(group.exchange(x))
            if sends > 1:
                x, d = blocks, tuple(torch.zeros_like(b, dtype=torch.float32) for b in blocks)
                for _ in range(world - 1):
                    x = group.finish(group.exchange(x, back=True))
                    d = group.finish(group.exchange(d, back=True))
        return run

    row = {"S": S, "heads": args.heads, "dim": args.dim, "causal": args.causal, "ranks": world,
           "device": _device_name(device)}
    with torch.no_grad():                      # validated before anything is timed
        out = axd.ring_attention(q, k, v, causal=args.causal)
        want = axt.attention(Q, K, V, causal="top_left" if args.causal else False) if rank == 0 else None
    _validate(out, want, args.causal)
    del out, want
    for name, fn, sends in (("fwd", ring_fwd, 1), ("fwd_bwd", ring_both, 2)):
        ring, compute, extra, spread = _paired_s(fn, _without_transfers(fn), device, args.reps)
        row[f"{name}_ring_s"], row[f"{name}_compute_s"] = ring, compute
        row[f"{name}_cost"], row[f"{name}_cost_iqr"] = extra / compute, spread / compute
        row[f"{name}_stalled_s"] = _stalled_s(fn, device, args.reps)
        row[f"{name}_comm_s"] = _median_s(comm(sends), device, args.reps)
    if rank == 0:                              # the whole on one device, the others waiting
        Qw, Kw, Vw = (x.clone().requires_grad_() for x in (Q, K, V))
        causal = "top_left" if args.causal else False

        def one_fwd():
            with torch.no_grad():
                axt.attention(Qw, Kw, Vw, causal=causal)

        def one_both():
            out = axt.attention(Qw, Kw, Vw, causal=causal)
            torch.autograd.grad(out, (Qw, Kw, Vw), dO)
        for name, fn in (("fwd", one_fwd), ("fwd_bwd", one_both)):
            row[f"{name}_one_s"] = _median_s(fn, device, args.reps, together=False)
    dist.barrier()
    for name in ("fwd", "fwd_bwd"):
        if rank == 0:
            row[f"{name}_speedup"] = row[f"{name}_one_s"] / row[f"{name}_ring_s"]
            comm_s = row[f"{name}_comm_s"]
            row[f"{name}_hidden"] = max(0.0, 1 - row[f"{name}_stalled_s"] / comm_s) if comm_s else 1.0
    return row


def _format(row):
    cells = [f"S{row['S']:>7}"]
    for name in ("fwd", "fwd_bwd"):
        cells.append(f"{name:>7}: 1 dev {1e3 * row[f'{name}_one_s']:9.2f} ms  {row['ranks']} dev "
                     f"{1e3 * row[f'{name}_ring_s']:9.2f} ms  {row[f'{name}_speedup']:5.2f}x  "
                     f"hidden {100 * row[f'{name}_hidden']:5.1f}% (stalled {1e3 * row[f'{name}_stalled_s']:.2f} "
                     f"of comm {1e3 * row[f'{name}_comm_s']:.2f} ms)  "
                     f"cost {100 * row[f'{name}_cost']:+.1f}% +- {100 * row[f'{name}_cost_iqr']:.1f}")
    return "\n    ".join(cells)


def main(argv=None):
    args = _parser().parse_args(argv)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    if rank == 0:
        print(f"attnext.distributed: {dist.get_world_size()} ranks ({dist.get_backend()}), "
              f"{_device_name(device)}, {'causal (zigzag)' if args.causal else 'not causal'}, "
              f"B1 H{args.heads} D{args.dim} {str(dtype).replace('torch.', '')}", flush=True)
    for S in (int(s) for s in args.seqlens.split(",") if s):
        row = run_row(S, args, device, dtype)
        if rank == 0:
            rows.append(row)
            print(_format(row), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()



if __name__ == "__main__":
    main()
