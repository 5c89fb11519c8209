"""A kernel's SASS read offline, no GPU: NVRTC compiles it for an architecture (sm_90a by
default), ptxas reports registers and spills, nvdisasm (the nvidia-cuda-nvdisasm wheel, or one on
PATH) disassembles it, and the lab prints, per entry point, the instructions of the loop that
holds the most tensor-core products (HMMA / HGMMA; a backward branch's body), as a count, a count
per product, the spill accesses and the commonest opcodes. A static count: masked and unmasked
paths both counted, latency and dual issue not at all; read it beside a measurement.

    python bench/labs/lab_sass.py --bwd-f32 128,3,recompute [--presplit] [--entries attn_bwd_dkdv,attn_bwd_dq]
    python bench/labs/lab_sass.py --kernel attn_fwd --defines '{"HEAD_DIM": 64, ...}' --entries attn_fwd

--inner: of the innermost loops that hold products, the one with the fewest instructions a
product (a key-tile loop inside a persistent or item loop), not the one that holds the most.
--bwd-f32 D,passes,dq: attn_bwd.cu for float32 at D = Dv (passes 3 or 1: precision="tf32"; dq
recompute or atomic) with select's tiles for it; --presplit with its tiles split once
(F32_PRESPLIT). --tile: an ATTNEXT_TILE_BWD override for it.
"""
import argparse
import collections
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from attnext import _C, _env
from attnext.cuda import nvrtc, select

OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
LABEL = re.compile(r"^(\.L_x_\d+):")
TARGET = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
MMA = ("HMMA", "HGMMA")


def loop_body(lines, inner=False):
    """The opcodes of the loop that holds the most tensor-core products (a backward branch to a
    label before it, its body from the label to the branch; inner: of the loops holding products
    and no such loop inside them, the one with the fewest instructions a product), or of the
    function's span from its first product to its last where no loop holds one. Returns (opcodes,
    "loop" | "span" | "none")."""
    ops, labels, branches = [], {}, []
    for line in lines:
        m = LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(ops)
            continue
        o = OP.match(line)
        if not o:
            continue
        t = TARGET.search(line)
        if t:
            branches.append((len(ops), t.group(1)))
        ops.append(o.group(1))
    loops = {(labels[label], at) for at, label in branches if labels.get(label, at + 1) <= at}
    loops = [(a, b) for a, b in loops if any(op in MMA for op in ops[a:b + 1])]
    if inner:
        loops = [(a, b) for a, b in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    best = None
    for start, at in loops:
        body = ops[start:at + 1]
        n = sum(op in MMA for op in body)
        if inner:                 # the tightest: fewest instructions a product
            better = best is None or len(body) * best[0] < len(best[1]) * n
        else:
            better = best is None or n > best[0] or (n == best[0] and len(body) < len(best[1]))
        if better:
            best = (n, body)
    if best:
        return best[1], "loop"
    mma = [i for i, op in enumerate(ops) if op in MMA]
    return (ops[mma[0]:mma[-1] + 1], "span") if mma else ([], "none")


def _nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
        for root in nvidia.__path__:
            for path in pathlib.Path(root).glob("*/bin/nvdisasm"):
                return str(path)
    except ImportError:
        pass
    sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm")


def _bwd_f32(spec, presplit):
    D, passes, dq = spec.split(",")
    D, tf32 = int(D), passes == "1"
    tile = select.bwd_tile_config(D, D, "float32", dq != "recompute", presplit and not tf32)
    return "attn_bwd", select.bwd_defines(dtype="float32", D=D, Dv=D, vec=True, softcap=False, bias_dtype=None,
                                          alibi_dtype=None, mask=False, tile=tile, dq=dq, tf32=tf32,
                                          presplit=presplit)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", help="kernels/<kernel>.cu, with --defines")
    ap.add_argument("--defines", default="{}", help="the #defines as a JSON object")
    ap.add_argument("--bwd-f32", help="D,passes,dq: attn_bwd.cu's float32 variant")
    ap.add_argument("--presplit", action="store_true", help="with --bwd-f32: F32_PRESPLIT")
    ap.add_argument("--tile", help="with --bwd-f32: ATTNEXT_TILE_BWD")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--entries", default="", help="entry points to report, comma-separated (default: all)")
    ap.add_argument("--inner", action="store_true", help="the innermost loop holding products (a key-tile loop "
                    "inside a persistent or item loop)")
    args = ap.parse_args()
    _env.setenv("ATTNEXT_TILE_BWD", args.tile)
    if args.bwd_f32:
        kernel, defines = _bwd_f32(args.bwd_f32, args.presplit)
    elif args.kernel:
        kernel, defines = args.kernel, json.loads(args.defines)
    else:
        ap.error("--kernel or --bwd-f32")
    src, name, opts, headers = nvrtc.compile_args(kernel, defines, args.arch)
    nvrtc.nvrtc()
    cubin, log = _C.nvrtc_compile(src, name, opts + ["--ptxas-options=-v"], headers)[:2]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([_nvdisasm(), "-c", path], capture_output=True, text=True, check=True).stdout
    wanted = set(filter(None, args.entries.split(",")))
    for m in re.finditer(r"\n\.text\.(\w+):(.*?)(?=\n\.text\.|\Z)", sass, re.S):
        entry, body = m.group(1), m.group(2)
        if wanted and entry not in wanted:
            continue
        body_ops, how = loop_body(body.splitlines(), args.inner)
        usage = re.search(r"Function properties for %s\n.*?(\d+) bytes spill stores.*?Used (\d+) registers"
                          % re.escape(entry), log, re.S)
        regs = f"{usage.group(2)} registers, {usage.group(1)} B spilled" if usage else "?"
        if how == "none":
            print(f"{entry}: no tensor-core instruction; {regs}")
            continue
        span = collections.Counter(body_ops)
        n, mma = sum(span.values()), sum(span[op] for op in MMA)
        common = ", ".join(f"{op} {c}" for op, c in span.most_common(8))
        where = "its products' loop" if how == "loop" else "first to last product"
        print(f"{entry}: {regs}; {where} {n} instructions, {mma} products, {n / mma:.1f} a product, "
              f"{span['STL'] + span['LDL']} local (spill) accesses ({common})")


if __name__ == "__main__":
    main()
