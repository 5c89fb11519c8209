"""The A / B labs' driver (not a lab): lab_fwd_ab.py and lab_bwd_ab.py run each configuration in
its own child process, every configuration once a round, rounds alternating, so that one
configuration's compiles, allocator and clocks do not carry into the next.

    alternate.main(__doc__, __file__, child)      # child(name, rows), run in the child process

A configuration is NAME=ENV: space-separated VAR=VALUE settings of the child's environment (the
labs' knobs: ATTNEXT_KERNEL_DIR for a copy of kernels/ ...), empty for the defaults.
"""
import argparse
import os
import subprocess
import sys


def main(doc, script, child):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", required=True, help="D:S[:causal] ...")
    ap.add_argument("--config", action="append", default=[], help="NAME=VAR=VALUE VAR=VALUE ... (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rows)
        return
    if not args.config:
        ap.error("at least one --config")
    configs = []
    for c in args.config:
        name, _, env = c.partition("=")
        configs.append((name, dict(kv.split("=", 1) for kv in env.split())))
    for _ in range(args.rounds):
        for name, env in configs:
            subprocess.run([sys.executable, script, "--child", name, "--rows", *args.rows],
                           env={**os.environ, **env}, check=False)
