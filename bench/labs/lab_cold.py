"""Kernel lab: the mods rows' cold first calls (a new score_mod's compiles, the [3/4] target: under
2 s) under several settings of attnext's environment knobs, in one run, the settings taking turns.

    python3 bench/labs/lab_cold.py [--cases softcap,window,relbias,doc_causal] [--repeat 3]
                              [--config "NAME=V NAME=V" ...]

Each measurement is bench_mods.first_call_row's (the bench's first-call section): the case's first
forward and backward in a fresh process with an empty ATTNEXT_CACHE_DIR (cold) and CUDA's compute
cache off, then in another fresh process with that folder (disk). A config is the variables set
for those processes (the others as this process has them); the defaults compare the compile
levers of attnext/cuda/nvrtc.py against their absence:
  before   ATTNEXT_COMPILE_AHEAD=0   (no backward compiled during the forward)
  after    (nothing set: nvrtc.compile_ahead as nvrtc.py has it)
Prints each case's cold and disk seconds per config: the median and every repeat.
"""
import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attnext.bench import mods as bench_mods  # noqa: E402

DEFAULT_CONFIGS = ("ATTNEXT_COMPILE_AHEAD=0", "")
KEYS = ("cold_fwd_s", "cold_bwd_s", "disk_fwd_s", "disk_bwd_s")


def parse(config):
    return dict(item.split("=", 1) for item in config.split())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="softcap,window,relbias,doc_causal")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--config", action="append", help="variables for one setting, 'NAME=V NAME=V'")
    args = ap.parse_args()
    configs = args.config or list(DEFAULT_CONFIGS)
    names = {k for c in configs for k in parse(c)}
    base = {k: os.environ.get(k) for k in names}
    cases = [bench_mods.mod_case(kind) for kind in args.cases.split(",")]
    got = {}
    for rep in range(args.repeat):
        for case in cases:
            for config in configs:
                for k, v in {**base, **parse(config)}.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                row = bench_mods.first_call_row(case)
                if row["attnext_status"] != "ok":
                    print(f"{case.name} [{config or 'defaults'}]: {row['attnext_reason']}", flush=True)
                    continue
                got.setdefault((case.name, config), []).append(row)
                print(f"repeat {rep}: {case.name} [{config or 'defaults'}] "
                      + " ".join(f"{k} {row[k]:.3f}" for k in KEYS), flush=True)
    print("\ncold / disk first calls, s: median [each repeat]")
    for case in cases:
        print(case.name)
        for config in configs:
            rows = got.get((case.name, config), [])
            cells = []
            for k in KEYS:
                vals = [r[k] for r in rows if r.get(k) is not None]
                if vals:
                    cells.append(f"{k[:-2]} {statistics.median(vals):.3f} [{' '.join('%.2f' % x for x in vals)}]")
            print(f"    {config or 'defaults':50s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
