"""`python -m attnext.bench`: the CPU table (attnext/bench/cpu.py) or, with --device cuda, the
GPU tables (attnext/bench/cuda.py, then the score_mod / mask_mod rows of attnext/bench/mods.py).

    python -m attnext.bench [--device cpu] [--quick] [--reps N] [--rows TEXT] [--json PATH]
    python -m attnext.bench --device cuda [--quick] [--rows TEXT] [--peers LIST] [--first-call]
                                          [--warmup MS] [--rep MS] [--json PATH] [--plot PATH]

torch is imported only when a GPU table runs.
"""
import argparse
import gc
import json
import sys
import time

from . import cpu, cuda, mods

SECTIONS = (*cuda.SECTION_TITLES, "mods")       # --sections' names, in table order


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(prog="python -m attnext.bench", add_help=False)
    pre.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    if pre.parse_known_args(argv)[0].device == "cuda":
        return cuda_main(argv)
    return cpu.main(argv)


def _peer_list(text):
    peers = tuple(p for p in text.split(",") if p)
    unknown = set(peers) - set(cuda.PEERS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peers {sorted(unknown)}; choose from {cuda.PEERS}")
    return peers


def _section_list(text):
    sections = tuple(s for s in text.split(",") if s)
    unknown = set(sections) - set(SECTIONS)
    if unknown or not sections:
        raise argparse.ArgumentTypeError(f"unknown sections {sorted(unknown)} in {text!r}; choose from "
                                         f"{','.join(SECTIONS)}")
    return sections


def _ms(text):
    """argparse type: a positive whole number of milliseconds."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ms, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 ms, got {n}")
    return n


def cuda_parser():
    """The GPU benchmark's command line: its whole description and every option's help."""
    p = argparse.ArgumentParser(prog="python -m attnext.bench --device cuda", description=cuda.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="The CPU table's options: python -m attnext.bench --help")
    p.add_argument("--device", choices=("cuda",), default="cuda",
                   help="cuda: these GPU tables (--device cpu, the default, is the CPU table)")
    p.add_argument("--quick", action="store_true",
                   help="one row per section (D=128, S=2048; decode B=8; mods: relbias B8 S2048 "
                        "and the document causal+mask row): a smoke run")
    p.add_argument("--rows", metavar="TEXT", help="only the cases whose name contains this text (or one of the "
                                  "texts between '|'s: 'softcap|relbias')")
    p.add_argument("--sections", type=_section_list, metavar="LIST", default=SECTIONS,
                   help=f"comma-separated sections to run (default: all, {','.join(SECTIONS)})")
    p.add_argument("--peers", type=_peer_list, metavar="LIST", default=cuda.PEERS,
                   help=f"comma-separated peers to run (default: {','.join(cuda.PEERS)})")
    p.add_argument("--warmup", type=_ms, default=25, metavar="MS",
                   help="do_bench warm-up time per measurement, ms (default 25)")
    p.add_argument("--rep", type=_ms, default=100, metavar="MS",
                   help="do_bench measuring time per measurement, ms (default 100)")
    p.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    p.add_argument("--plot", metavar="PATH", help="a PNG of TFLOP/s against S (needs matplotlib)")
    p.add_argument("--first-call", action="store_true",
                   help="also time each mods row's first forward and backward in fresh processes, "
                        "cold (an empty ATTNEXT_CACHE_DIR), from the disk cache and beside the "
                        "plain twin's kernels, medians of three repeats (slow: twelve processes "
                        "and their compiles per row)")
    return p


def parse_args(argv=None):
    return cuda_parser().parse_args(argv)


def _chosen(case, rows):
    """Whether --rows (None, or texts between '|'s; empty ones left out) picks the case: its name
    holds one of them."""
    texts = [text for text in (rows or "").split("|") if text]
    return not texts or any(text in case.name for text in texts)


def cuda_main(argv=None):
    """The GPU tables (`python -m attnext.bench --device cuda`): attnext/bench/cuda.py's
    sections, then attnext/bench/mods.py's."""
    args = parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"CUDA benchmark: torch is not importable ({e}); nothing measured")
        return 2
    if not torch.cuda.is_available():
        print(f"CUDA benchmark: no CUDA device visible to torch {torch.__version__} "
              f"(built for CUDA {torch.version.cuda}); nothing measured. Run it where "
              f"torch.cuda.is_available() is True.")
        return 2
    torch.set_float32_matmul_precision("highest")     # the float32 reference stays float32
    time_ms, timing = cuda.make_timer(args.warmup, args.rep)
    run = cuda.Run(cuda.DEVICE, time_ms, args.peers, torch.cuda.synchronize)
    lines = cuda.header(timing)
    print("\n".join(lines), flush=True)
    t_start = time.perf_counter()
    rows, section = [], None
    for case in cuda.cases(args.quick):
        if case.kind not in args.sections or not _chosen(case, args.rows):
            continue
        if case.kind != section:
            section = case.kind
            print(f"\n{cuda.SECTION_TITLES[section]}\n{cuda.format_header(section)}", flush=True)
        torch.manual_seed(len(rows))
        new = cuda.case_rows(run, case)
        gc.collect()
        torch.cuda.empty_cache()
        rows += new
        for row in new:
            print(cuda.format_row(row), flush=True)
    rows += mods.sections(
        run, [c for c in mods.cases(args.quick) if "mods" in args.sections and _chosen(c, args.rows)],
        args.first_call)
    total_s = time.perf_counter() - t_start
    print()
    for line in cuda.notes(rows):
        print(line)
    print(f"total {total_s:.0f} s")
    if args.plot:
        print(cuda.write_plot(rows, args.plot, lines[0]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": lines, "total_s": total_s, "rows": rows}, f, indent=1)
    return 1 if any(r.get("attnext_status") == "WRONG" for r in rows) else 0
