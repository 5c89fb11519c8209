"""The stamp labs' harness (not a lab): globaltimer stamps written by an instrumented copy of
kernels/ into the o_accum slot of every launch while a buffer is lent (lab_stamps.py: the
backward's dK/dV CTA; lab_fwd_stamps.py: the WS forward's tiles). `shapes`, the labs' D:S[:causal]
rows, serves lab_fwd_ab.py and lab_bwd_ab.py as well; `run_probes`, the probe labs'
(lab_f32_probes.py, lab_bwd_probes.py) runs of copies of kernels/ with parts taken away.

    lend = start("attn_bwd_sm90.cu", EDITS, prefix="attnext-stamps-")   # lend(buf) ... lend(None)
    for D, S, causal, B, H in shapes(sys.argv[1:], ["64:512", ...]): ...

EDITS: (anchor, text) or (anchor, text, before) string edits, applied in the part of the file
from the first edit's anchor on (each anchor must occur there once: the lab stops otherwise).
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def macros(slots, pinned=False):
    """gtime() (the globaltimer, ns), TR(i, v): int64 i of the block's slots in p.o_accum := v,
    and SUM(i): its address (for atomicAdd). pinned: the timer's read clobbers memory, so that
    ptxas moves no load or store across a stamp (arithmetic may still move)."""
    clobber = ' :: "memory"' if pinned else ""
    return ("DEV long long gtime() { long long t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)"
            + clobber + "); return t; }\n"
            f"#define TR(i, v) do {{ if (p.o_accum) ((long long *)p.o_accum)[((blockIdx.z * gridDim.y + blockIdx.y)"
            f" * gridDim.x + blockIdx.x) * {slots} + (i)] = (v); }} while (0)\n"
            f"#define SUM(i) ((unsigned long long *)p.o_accum + ((blockIdx.z * gridDim.y + blockIdx.y)"
            f" * gridDim.x + blockIdx.x) * {slots} + (i))\n")


def instrumented(kernel_file, edits, prefix):
    """A temporary copy of kernels/ with edits made in kernel_file (see the module's docstring)."""
    out = Path(tempfile.mkdtemp(prefix=prefix)) / "kernels"
    shutil.copytree(ROOT / "kernels", out)
    src = (out / kernel_file).read_text()
    head, sep, part = src.partition(edits[0][0])
    if not sep:
        sys.exit(f"{prefix}: {kernel_file} has no {edits[0][0]!r}")
    part = sep + part
    for anchor, text, *before in edits:
        if part.count(anchor) != 1:
            sys.exit(f"{prefix}: anchor not found once in {kernel_file}'s part: {anchor!r}")
        part = part.replace(anchor, text + anchor if before and before[0] else anchor + text)
    (out / kernel_file).write_text(head + part)
    return out


def run_probes(kernel_file, probes, names, script, args, env_of=lambda name: {}):
    """The probe labs' runs (lab_f32_probes.py, lab_bwd_probes.py): for each of names, a process of
    its own runs `python -c script ROOT *args` on the kernels as they are, or, for a name in probes
    (name: its edits), on a copy of kernels/ with those edits made in kernel_file (in the order
    their anchors occur there) and a cache of its own; env_of(name) adds settings. Each line the
    script prints (row, ms and rate, tab-separated) is printed after the name."""
    src = (ROOT / "kernels" / kernel_file).read_text()
    for name in names:
        env = {**os.environ, **env_of(name)}
        if name in probes:
            kernels = instrumented(kernel_file, sorted(probes[name], key=lambda e: src.index(e[0])),
                                   f"attnext-probe-{name}-")
            env.update(ATTNEXT_KERNEL_DIR=str(kernels), ATTNEXT_CACHE_DIR=str(kernels.parent / "cache"))
        r = subprocess.run([sys.executable, "-c", script, str(ROOT), *args], env=env, capture_output=True, text=True)
        if r.returncode:
            print(f"{name:8} failed: {r.stderr.strip()[-800:]}")
            continue
        for line in r.stdout.split("\n"):
            if line:
                row, ms, rate = line.split("\t")
                print(f"{name:8} {row:24} {ms:>9} {rate:>8}")


def start(kernel_file, edits, prefix):
    """The instrumented kernels in use (ATTNEXT_KERNEL_DIR, and a cache of their own), the
    repository's attnext imported; returns into_o_accum's lend."""
    kernels_dir = instrumented(kernel_file, edits, prefix)
    os.environ["ATTNEXT_KERNEL_DIR"] = str(kernels_dir)
    os.environ["ATTNEXT_CACHE_DIR"] = str(kernels_dir.parent / "cache")   # the lab's cubins stay its own
    sys.path.insert(0, str(ROOT))
    return into_o_accum()


def shapes(specs, default):
    """(D, S, causal, B, H) of each "D:S[:causal]" (default's where specs is empty): B * S = 16k
    tokens (B = 1 past S16k), H = 2048 / D."""
    for spec in specs or default:
        D, S, *c = spec.split(":")
        yield int(D), int(S), bool(c), max(1, 16384 // int(S)), 2048 // int(D)


def into_o_accum():
    """Wraps _C.cuda_launch_attention so that while lend(buf) has lent a torch tensor, every
    launch's o_accum slot is its address; returns lend."""
    from attnext import _C
    from attnext.cuda import backend
    lent = [None]
    launch = _C.cuda_launch_attention

    def stamped(fn, grid, block, smem, stream, template, ptrs, *rest):
        if lent[0] is not None:
            ptrs = tuple(lent[0].data_ptr() if i == backend.SLOT_O_ACCUM else x for i, x in enumerate(ptrs))
        return launch(fn, grid, block, smem, stream, template, ptrs, *rest)
    _C.cuda_launch_attention = stamped

    def lend(buf):
        lent[0] = buf
    return lend


def med(xs):
    """The median in us of the differences that have both stamps (None: one is missing; a stamp
    never written reads 0)."""
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs) / 1000:7.2f}" if xs else "      -"
