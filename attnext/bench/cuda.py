"""GPU timings: attnext on torch CUDA tensors against PyTorch SDPA and FlexAttention, same run.

    python -m attnext.bench --device cuda [--quick] [--rows TEXT] [--peers LIST] [--first-call]
                                          [--warmup MS] [--rep MS] [--json PATH] [--plot PATH]

Sections, bf16 unless said:
  plain   B*S = 16384 tokens, H = 2048 / D heads, D = 64 and 128, S = 512 ... 16384, causal and
          not, forward and backward.
  float32, tf32  the plain rows at S = 4096 in float32: attnext's default (float32 accuracy:
          split TF32 products; on Hopper the backward at D 64 and 128 on bfloat16 planes)
          against SDPA's float32 backends (efficient: cutlass's 3xTF32; math: the attention
          matrix materialised, cuBLAS's products; these rows alone) and
          FlexAttention; tf32: attnext's precision="tf32" against the same peers with TF32
          allowed in torch (torch.backends.cuda.matmul.allow_tf32, which Flex's and math's
          products follow).
          Targets: 1.5x (float32) and 2x (tf32) the fastest SDPA backend ("sdpa"); Flex is shown.
  packed  16384 tokens in 7 documents (a seeded random split), document-causal, D = 128, H = 16:
          attnext.varlen_attention on the packed tokens; FlexAttention at B = 1 with a document
          block mask; SDPA's backends on the padded batch (the documents padded to the longest).
          Twice: cu_seqlens as NumPy arrays, then ("cuda-lens") as torch CUDA int32 tensors with
          max_seqlen_* (device lengths: within 5% of the first).
  decode  Sq = 1, (B, Sk) = (1, 32768), (8, 8192), (64, 4096), Hq = 32, Hk = 8, D = 128; rates are
          GB/s of K and V read.
  numpy   attnext.attention on ml_dtypes.bfloat16 NumPy arrays in ordinary (pageable) memory,
          NumPy out, against the floor: the same bytes through pinned torch tensors to the device
          and back (measured in the same run); wall-clock medians. The softcap row: a score_mod
          (30 tanh(s / 30)) over NumPy arrays of (2, 4096, 16, 64), its floor the plain NumPy call
          of the same shape (<= 1.2x: the score_mod's generated kernels run on the GPU).
  adapter attnext.torch.attention (custom ops, autograd) against attnext.attention and
          attention_backward called directly on the same tensors, B4 S4096 H16 D128 causal:
          the forward, and the forward with its backward (the adapter's out.backward(dout)
          against attention(return_lse=True) + attention_backward); its overhead, no target.
  paged   decode (Sq = 1, Hq = 32, Hk = 8, D = 128) over a paged KV cache of shuffled pages
          ((B, Sk, page size) = (8, 8192, 16), (8, 8192, 64), (64, 4096, 16); the block table and
          seqlens_k CUDA int32 tensors) against the same keys contiguous: GB/s of K and V, >= 0.9x
          the contiguous.
  mods    score_mod / mask_mod rows against FlexAttention: softcap, a relative-bias table (its
          gradient on both sides), the document mask (as a mask_mod alone and with causal=True),
          a causal sliding window; TFLOP/s of the pairs each mask keeps (attnext/bench/mods.py).
  first call  (--first-call) each mods row's first forward and backward in a fresh process:
          cold (empty ATTNEXT_CACHE_DIR, compiles included), from the disk cache, and new
          (beside the kernels of a plain twin's earlier process: the mod's own compiles); the
          medians of mods.FIRST_CALL_REPS repeats.

Every result, attnext's and each peer's, is validated before it is timed (the kernel lab rule):
out, dq, dk and dv against SDPA's math backend in float32 on the same bf16 inputs (mods: a float32
reference that materialises the modded scores, and the tables' gradients too), max|x - ref| /
max|ref| < TOL. A failing result reads WRONG and is not timed. An attnext call or a peer that raises
(not implemented, unsupported, out of memory, compile error) reads "-", its reason goes to the JSON
and to the notes under the table, and the run goes on.

Exit status: 0 when every attnext result that ran matched the reference; 1 when one was WRONG;
2 when nothing was measured (torch missing, or no CUDA device visible to torch).
torch is imported only when the benchmark runs: `import attnext.bench.cuda` needs no torch.
"""
import datetime
import math
import time
from typing import NamedTuple, Optional

import ml_dtypes
import numpy as np

import attnext
from ..cuda import nvrtc

TOKENS = 16384                     # B * S of every plain row and of the packed batch
HEAD_FEATURES = 2048               # H * D of the plain and packed rows
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DOCS, DOC_SEED, DOC_D = 7, 0, 128
DECODE = ((1, 32768), (8, 8192), (64, 4096))      # (B, Sk)
DECODE_HQ, DECODE_HK, DECODE_D = 32, 8, 128
NUMPY_CASES = ((8, 2048, 128, False), (2, 8192, 128, True))   # (B, S, D, causal)
BF16_BYTES = 2
TOL = 2e-2                         # max |x - ref| / max |ref| for a bf16 result
BWD_FLOPS_FACTOR = 2.5             # the backward's five products against the forward's two
REF_SCORE_BYTES = 1 << 30          # float32 score matrix per reference chunk
WALL_CALLS = 5                     # back-to-back calls of the wall-clock cross-check
WALL_SUSPECT = 0.5                 # do_bench / wall below this marks an attnext time "?"
NUMPY_REPS = 20                    # wall-clock repetitions of the NumPy rows and their floor
NUMPY_WARMUP = 3                   # untimed calls before them (a NumPy input's registration is
                                   # kept from its second call on: the steady state is timed)
DEVICE = "cuda"                    # where the torch tensors live (the tests run the rows on "cpu")
PEERS = ("flash", "cudnn", "efficient", "math", "flex")
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
# SDPA's math backend (the attention matrix materialised, cuBLAS's products: TF32 ones where
# allowed) runs on the float32 and tf32 rows alone, where with TF32 it is SDPA's fastest float32
# backend on non-causal rows (bench/NOTES.md, float32); elsewhere it is "skipped"
MATH_KINDS = ("float32", "tf32")
# [6/7]'s bars: the plain rows at least cuDNN (SDPA's cuDNN backend), the document-causal packed
# rows 1.3x FlexAttention, decode 0.95x the best of torch's backends
TARGETS = {("plain", "fwd"): ("cudnn", 1.0), ("plain", "bwd"): ("cudnn", 1.0),
           ("plain", "bwd_nd"): ("cudnn", 1.0),
           ("packed", "fwd"): ("flex", 1.3), ("packed", "bwd"): ("flex", 1.3),
           ("packed", "bwd_nd"): ("flex", 1.3),
           ("decode", "fwd"): ("best", 0.95),
           # [3/7]: against PyTorch SDPA's fastest float32 backend ("sdpa": the best of its
           # three; FlexAttention's column is shown, not the target)
           **{("float32", d): ("sdpa", 1.5) for d in ("fwd", "bwd", "bwd_nd")},
           **{("tf32", d): ("sdpa", 2.0) for d in ("fwd", "bwd", "bwd_nd")}}
FLOAT32_S = 4096                   # the float32 and tf32 rows' sequence length
NUMPY_TARGET = 1.3                 # attnext's NumPy-in/NumPy-out time over the pinned-copy floor
NUMPY_MOD = (2, 4096, 16, 64)      # (B, S, H, D) of the NumPy softcap score_mod row
NUMPY_MOD_TARGET = 1.2             # its time over the plain NumPy call of the same shape
SOFTCAP = 30.0
SECTION_TITLES = {"plain": "plain attention (TFLOP/s)",
                  "float32": "float32 at float32 accuracy (TFLOP/s)",
                  "tf32": "float32 with precision=\"tf32\" (peers with TF32 allowed; TFLOP/s)",
                  "packed": "document-causal packed batch (TFLOP/s)",
                  "decode": "KV-cache decode (GB/s of K and V read)",
                  "numpy": "NumPy in, NumPy out (wall-clock ms)",
                  "adapter": "attnext.torch against direct calls on the same tensors (ms)",
                  "paged": "decode over a paged KV cache against the same keys contiguous (ms)"}
PAGED = ((8, 8192, 16), (8, 8192, 64), (64, 4096, 16))     # (B, Sk, page_size) of the paged rows
PAGED_TARGET = 0.9                 # the paged call's GB/s over the contiguous call's
ADAPTER = (4096, 128, True)        # (S, D, causal) of the adapter rows


# --- pure helpers (no torch) ---

def attention_flops(B, H, Sq, Sk, D, causal=False, backward=False):
    """4 * B * H * Sq * Sk * D (QK^T and PV), halved for causal, times 2.5 for the backward."""
    flops = 4.0 * B * H * Sq * Sk * D
    if causal:
        flops /= 2
    return flops * BWD_FLOPS_FACTOR if backward else flops


def kv_bytes(B, Sk, Hk, D, itemsize=BF16_BYTES):
    """Bytes of K and V together."""
    return 2 * B * Sk * Hk * D * itemsize


def tflops(flops, ms):
    return None if ms is None else flops / (ms * 1e9)


def gbps(nbytes, ms):
    return None if ms is None else nbytes / (ms * 1e6)


def document_lengths(total=TOKENS, parts=DOCS, seed=DOC_SEED):
    """A seeded random split of `total` tokens into `parts` documents, each at least 1 long."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, total), parts - 1, replace=False))
    return tuple(int(n) for n in np.diff(np.concatenate([[0], cuts, [total]])))


class Case(NamedTuple):
    kind: str                      # "plain", "float32", "tf32", "packed", "decode", "numpy", "adapter", "paged"
    B: int
    Sq: int
    Sk: int
    Hq: int
    Hk: int
    D: int
    causal: bool
    lens: Optional[tuple] = None   # packed: the documents' lengths (B = 1, Sq = Sk = their sum)
    mod: Optional[str] = None      # numpy: "softcap" for the score_mod row
    lengths: str = "host"          # packed: cu_seqlens as NumPy arrays, or "cuda" (torch, in place)
    page: int = 0                  # paged: the cache's page size

    @property
    def name(self):
        c = " causal" if self.causal else ""
        if self.kind == "packed":
            where = " cuda-lens" if self.lengths == "cuda" else ""
            return f"docs{len(self.lens)} T{self.Sq} H{self.Hq} D{self.D}{c}{where}"
        if self.kind == "decode":
            return f"decode B{self.B} Sk{self.Sk} Hq{self.Hq} Hk{self.Hk} D{self.D}"
        if self.kind == "paged":
            return f"paged{self.page} B{self.B} Sk{self.Sk} Hq{self.Hq} Hk{self.Hk} D{self.D}"
        prefix = "" if self.kind == "plain" else f"{self.kind} "
        if self.mod:
            prefix += f"{self.mod}{SOFTCAP:g} "
        return f"{prefix}B{self.B} S{self.Sq} H{self.Hq} D{self.D}{c}"

    def flops(self, backward=False):
        """Useful FLOPs: a packed batch counts its documents only (padding is the peer's waste)."""
        if self.lens:
            return sum(attention_flops(1, self.Hq, n, n, self.D, self.causal, backward)
                       for n in self.lens)
        return attention_flops(self.B, self.Hq, self.Sq, self.Sk, self.D, self.causal, backward)

    def kv_bytes(self):
        return kv_bytes(self.B, self.Sk, self.Hk, self.D)


def plain_case(S, D, causal, kind="plain", B=None):
    H = HEAD_FEATURES // D
    return Case(kind, B or TOKENS // S, S, S, H, H, D, causal)


def cases(quick=False):
    """The rows, in table order; quick: one of each section, D = 128, S = 2048."""
    if quick:
        plain = [plain_case(2048, 128, c) for c in (False, True)]
        plain += [plain_case(2048, 128, False, kind) for kind in ("float32", "tf32")]
        decode = [DECODE[1]]
        numpy_ = NUMPY_CASES[:1]
    else:
        plain = [plain_case(S, D, c) for D in HEAD_DIMS for c in (False, True) for S in SEQLENS]
        plain += [plain_case(FLOAT32_S, D, c, kind) for kind in ("float32", "tf32") for D in HEAD_DIMS
                  for c in (False, True)]
        decode = DECODE
        numpy_ = NUMPY_CASES
    H = HEAD_FEATURES // DOC_D
    packed = [Case("packed", 1, TOKENS, TOKENS, H, H, DOC_D, True, document_lengths(), lengths=where)
              for where in ("host", "cuda")]
    B, S, H, D = NUMPY_MOD
    return (plain + packed
            + [Case("decode", B, 1, Sk, DECODE_HQ, DECODE_HK, DECODE_D, False) for B, Sk in decode]
            + [plain_case(S, D, c, "numpy", B) for B, S, D, c in numpy_]
            + [Case("numpy", B, S, S, H, H, D, False, mod="softcap")]
            + [plain_case(*ADAPTER, kind="adapter")]
            + [Case("paged", B, 1, Sk, DECODE_HQ, DECODE_HK, DECODE_D, False, page=ps)
               for B, Sk, ps in (PAGED[:1] if quick else PAGED)])


def _reason(e):
    """An exception as one string for the JSON."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:2000]


def _check(pairs):
    """{name: relative error} of each (got, want) pair and the failure text ("" when all pass)."""
    errs = {name: rel_error(got, want) for name, (got, want) in pairs.items()}
    bad = [f"{n} off by {e:.2e}" for n, e in errs.items() if not e < TOL]
    fail = f"{'; '.join(bad)} (max|x - ref| / max|ref|, tolerance {TOL:g})" if bad else ""
    return {n: (e if math.isfinite(e) else str(e)) for n, e in errs.items()}, fail


def rel_error(got, want):
    """max |got - want| / max |want| in float32; NaN anywhere or a shape mismatch gives inf."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    err = float((got.float() - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    return err if math.isfinite(err) else math.inf


# --- the table ---

def _num(x):
    return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else (
        f"{x:.2f}" if x >= 0.1 else f"{x:.3f}")


def _rate_cell(row, who):
    status = row.get(f"{who}_status")
    if status == "WRONG":
        return "WRONG"
    rate = row.get(f"{who}_rate")
    return "-" if rate is None else _num(rate) + ("*" if row.get(f"{who}_note") else "")


def _ms_cell(row):
    if row.get("attnext_status") == "WRONG":
        return "WRONG"
    ms = row.get("attnext_ms")
    return "-" if ms is None else _num(ms) + ("?" if row.get("attnext_suspect") else "")


def _ratio_cell(x):
    return "-" if x is None else f"{x:.2f}x"


def _target_cell(row):
    if row.get("target") is None:
        return ""
    verdict = "-" if row["target_met"] is None else "ok" if row["target_met"] else "MISS"
    return f"{verdict} {row['target']}"


RATE_COLUMNS = [("case", 28, lambda r: r["case"]), ("dir", 3, lambda r: r["direction"]),
                ("ax ms", 8, _ms_cell), ("attnext", 7, lambda r: _rate_cell(r, "attnext")),
                ("flash", 7, lambda r: _rate_cell(r, "flash")),
                ("cudnn", 7, lambda r: _rate_cell(r, "cudnn")),
                ("effic", 7, lambda r: _rate_cell(r, "efficient")),
                ("math", 7, lambda r: _rate_cell(r, "math")),
                ("flex", 7, lambda r: _rate_cell(r, "flex")),
                ("ax/flash", 8, lambda r: _ratio_cell(r["ratio_flash"])),
                ("ax/best", 7, lambda r: _ratio_cell(r["ratio_best"])),
                ("s", 4, lambda r: f"{r['case_s']:.0f}"), ("target", 0, _target_cell)]
NUMPY_COLUMNS = [("case", 28, lambda r: r["case"]), ("ax ms", 8, _ms_cell),
                 ("floor ms", 8, lambda r: _num(r["floor_ms"])),
                 ("ax/floor", 8, lambda r: _ratio_cell(r["target_ratio"])),
                 ("pinned GB/s", 11, lambda r: _num(r["pinned_gbps"])),
                 ("s", 4, lambda r: f"{r['case_s']:.0f}"), ("target", 0, _target_cell)]


ADAPTER_COLUMNS = [("case", 28, lambda r: r["case"]), ("dir", 7, lambda r: r["direction"]),
                   ("axt ms", 8, _ms_cell), ("direct ms", 9, lambda r: _num(r["floor_ms"])),
                   ("axt/direct", 10, lambda r: _ratio_cell(r["target_ratio"])),
                   ("s", 4, lambda r: f"{r['case_s']:.0f}")]


PAGED_COLUMNS = [("case", 28, lambda r: r["case"]), ("paged ms", 8, _ms_cell),
                 ("contig ms", 9, lambda r: _num(r["floor_ms"])),
                 ("paged GB/s", 10, lambda r: _num(r["attnext_rate"])),
                 ("paged/contig", 12, lambda r: _ratio_cell(r["target_ratio"])),
                 ("s", 4, lambda r: f"{r['case_s']:.0f}"), ("target", 0, _target_cell)]


def columns_for(section):
    return {"numpy": NUMPY_COLUMNS, "adapter": ADAPTER_COLUMNS, "paged": PAGED_COLUMNS}.get(section, RATE_COLUMNS)


def format_line(cells, columns):
    """One table line: the first column left-aligned, the others right-aligned, the last as is."""
    out = []
    for i, (cell, (_, width, _)) in enumerate(zip(cells, columns)):
        out.append(f"{cell:<{width}}" if i == 0 else f"{cell:>{width}}" if width else cell)
    return " ".join(out).rstrip()


def format_header(section):
    cols = columns_for(section)
    return format_line([title for title, _, _ in cols], cols)


def format_row(row):
    cols = columns_for(row["section"])
    return format_line([cell(row) for _, _, cell in cols], cols)


def notes(rows):
    """One line per distinct reason a result is missing or WRONG, and per peer note (the "*")."""
    seen = {}
    for row in rows:
        where = f"{row['case']} {row['direction']}"
        for who in ("attnext",) + PEERS + ("floor",):
            status = row.get(f"{who}_status")
            reason = row.get(f"{who}_reason") if status in ("WRONG", "error") else None
            for label, text in ((status, reason), ("*", row.get(f"{who}_note"))):
                if text:
                    seen.setdefault((who, label, text[:200]), []).append(where)
    lines = []
    for (who, label, text), where in seen.items():
        more = f" and {len(where) - 2} more" if len(where) > 2 else ""
        lines.append(f"- {who} {label} on {', '.join(where[:2])}{more}: {text}")
    return lines


# --- the rows ---

def _finish(case, direction, results, case_s):
    """One table/JSON row from {contender: result dict} of one direction."""
    section = case.kind
    row = {"section": section, "case": case.name, "direction": direction, "B": case.B,
           "Sq": case.Sq, "Sk": case.Sk, "Hq": case.Hq, "Hk": case.Hk, "D": case.D,
           "causal": case.causal, "seqlens": list(case.lens) if case.lens else None,
           "case_s": case_s}
    if section == "decode":
        row["unit"], row["work"] = "GB/s", case.kv_bytes()
        rate = gbps
    else:
        row["unit"], row["work"] = "TFLOP/s", case.flops(direction != "fwd")
        rate = tflops
    for who in ("attnext",) + PEERS:
        res = results.get(who, {}).get(direction) or {"status": "skipped", "reason": "not run"}
        row[f"{who}_ms"] = res.get("ms")
        row[f"{who}_rate"] = rate(row["work"], res.get("ms"))
        for key in ("status", "reason", "rel_errors", "note"):
            row[f"{who}_{key}"] = res.get(key)
    row["attnext_wall_ms"] = wall = (results.get("attnext", {}).get(direction) or {}).get("wall_ms")
    row["attnext_suspect"] = bool(wall and row["attnext_ms"]
                                  and row["attnext_ms"] < WALL_SUSPECT * wall)
    ax = row["attnext_rate"]
    peers = {p: row[f"{p}_rate"] for p in PEERS if row[f"{p}_rate"] is not None}
    row["best_peer"] = max(peers, key=peers.get) if peers else None
    row["ratio_flash"] = ax / peers["flash"] if ax and "flash" in peers else None
    row["ratio_best"] = ax / peers[row["best_peer"]] if ax and peers else None
    target = TARGETS.get((section, direction))
    if target:
        peer, least = target
        row["target"] = f">={least:.1f}x {peer}" if round(least, 1) == least else f">={least:.2f}x {peer}"
        sdpa = [peers[p] for p in SDPA_BACKENDS if p in peers]
        row["target_ratio"] = (row["ratio_best"] if peer == "best"
                               else (ax / max(sdpa) if ax and sdpa else None) if peer == "sdpa"
                               else ax / peers[peer] if ax and peer in peers else None)
        row["target_met"] = None if row["target_ratio"] is None else row["target_ratio"] >= least
    else:
        row["target"] = row["target_ratio"] = row["target_met"] = None
    return row


class Run:
    """What every section needs: the device, the timers, the chosen peers, the compiled Flex."""

    def __init__(self, device, time_ms, peers, sync=lambda: None):
        self.device = device
        self.time = time_ms            # fn -> median milliseconds
        self.peers = tuple(peers)
        self.sync = sync
        self._flex = None

    def wall(self, fn, calls=WALL_CALLS):
        """Milliseconds per call of `calls` back-to-back calls, synchronised at both ends."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        self.sync()
        return 1e3 * (time.perf_counter() - t0) / calls

    def wall_median(self, fn, reps=NUMPY_REPS, warmup=NUMPY_WARMUP):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(times))

    def flex(self):
        """torch.compile(flex_attention), static shapes; one compiled entry per shape and grad mode,
        so dynamo's recompile limit (8 by default) is raised past the number of rows."""
        if self._flex is None:
            import torch
            from torch.nn.attention.flex_attention import flex_attention
            cfg = torch._dynamo.config
            for names, value in (
                    (("recompile_limit", "cache_size_limit"), 1024),
                    (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 8192)):
                name = next((n for n in names if hasattr(cfg, n)), None)
                if name:
                    setattr(cfg, name, max(getattr(cfg, name), value))
            self._flex = torch.compile(flex_attention, dynamic=False)
        return self._flex


def _attempt(time_ms, first, checks, timed, wall=None):
    """Runs first(), validates what it returns with checks(result) -> {name: (got, ref)}, and only
    then times timed(). Returns {"ms", "status" (ok / WRONG / error), "reason", "rel_errors"}."""
    try:
        errs, fail = _check(checks(first()))
        if fail:
            return {"ms": None, "status": "WRONG", "reason": fail, "rel_errors": errs}
        res = {"ms": time_ms(timed), "status": "ok", "reason": None, "rel_errors": errs}
        if wall is not None:
            res["wall_ms"] = wall(timed)
        return res
    except Exception as e:   # not implemented, unsupported, out of memory, compile error
        return {"ms": None, "status": "error", "reason": _reason(e)}


def _grad_checks(grads, refs, view=lambda x: x):
    return {n: (view(g), r) for n, g, r in zip(("dq", "dk", "dv"), grads, refs)}


def reference(q, k, v, dout=None, causal=False):
    """SDPA's math backend in float32 on bf16 (B, S, H, D) tensors: out (B, Sq, Hq, D) and, with
    dout, (dq, dk, dv), all float32. GQA by repeat_interleave of k and v. Runs in chunks of batch
    items and kv-head groups so that no score matrix exceeds REF_SCORE_BYTES."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, Sq, Hq, _ = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    group = Hq // Hk
    score_bytes = 4 * Sq * Sk * group
    heads = max(1, min(Hk, REF_SCORE_BYTES // score_bytes))           # kv heads per chunk
    batch = max(1, min(B, REF_SCORE_BYTES // (score_bytes * heads)))
    grad = dout is not None
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    grads = [torch.empty(x.shape, dtype=torch.float32, device=x.device)
             for x in (q, k, v)] if grad else None
    with sdpa_kernel(SDPBackend.MATH), torch.set_grad_enabled(grad):
        for b0 in range(0, B, batch):
            for h0 in range(0, Hk, heads):
                bs, ks = slice(b0, b0 + batch), slice(h0, h0 + heads)
                qs = slice(h0 * group, (h0 + heads) * group)
                qc, kc, vc = (x[bs, :, s].detach().float().requires_grad_(grad)
                              for x, s in ((q, qs), (k, ks), (v, ks)))
                kr, vr = (x.transpose(1, 2).repeat_interleave(group, dim=1) for x in (kc, vc))
                o = F.scaled_dot_product_attention(qc.transpose(1, 2), kr, vr,
                                                   is_causal=causal).transpose(1, 2)
                out[bs, :, qs] = o.detach()
                if grad:
                    dqkv = torch.autograd.grad(o, (qc, kc, vc), dout[bs, :, qs].float())
                    for dst, s, g in zip(grads, (qs, ks, ks), dqkv):
                        dst[bs, :, s] = g
    return out, grads


def _randn(run, *shape, dtype=None):
    import torch
    return torch.randn(shape, device=run.device, dtype=dtype or torch.bfloat16)


def _measure_attnext(run, attend, attend_backward, o, dout, refs):
    """attend(**kw): attnext's forward with out= (the timed form) or return_lse=True;
    attend_backward(out, lse, **kw): its backward. Returns {"fwd": result[, "bwd": result,
    "bwd_nd": result]}: bwd_nd is the backward with deterministic=False (dq's additions in any
    order, as FlashAttention's), bwd the default (the same bits every run)."""
    def fwd():
        return attend(out=o)

    def first():
        o.fill_(math.nan)          # an element the kernel does not write fails the check
        fwd()
        return o
    res = {"fwd": _attempt(run.time, first, lambda out: {"out": (out, refs[0])}, fwd, run.wall)}
    if dout is not None:
        saved = []

        def bwd():
            return attend_backward(*saved)

        def first_bwd():
            saved.extend(attend(return_lse=True))
            return bwd()
        res["bwd"] = _attempt(run.time, first_bwd,
                              lambda g: _grad_checks((g.dq, g.dk, g.dv), refs[1]), bwd, run.wall)

        def bwd_nd():
            return attend_backward(*saved, deterministic=False)
        res["bwd_nd"] = _attempt(run.time, bwd_nd,
                                 lambda g: _grad_checks((g.dq, g.dk, g.dv), refs[1]), bwd_nd, run.wall)
    return res


def _peer_backward_for_both(results):
    """The peers' one backward stands beside both of attnext's (bwd and bwd_nd)."""
    for who, res in results.items():
        if who != "attnext" and "bwd" in res:
            res["bwd_nd"] = res["bwd"]
    return results


def _measure_peer(run, call, inputs, dout, refs, grad_forward=False, view=lambda x: x):
    """A torch contender: call(q, k, v) -> out. Forward under no_grad (grad_forward: on inputs that
    require grad, so that one compiled graph serves both directions); backward: autograd.grad on
    a graph built outside the timed region. view maps out and grads to the reference's layout."""
    import torch
    leaves = [x.detach().requires_grad_() for x in inputs]
    fwd_in = leaves if grad_forward else inputs
    with torch.set_grad_enabled(grad_forward):
        res = {"fwd": _attempt(run.time, lambda: call(*fwd_in),
                               lambda out: {"out": (view(out), refs[0])}, lambda: call(*fwd_in))}
    if grad_forward and res["fwd"]["status"] == "error":   # e.g. no backward for this case
        refused = f"with requires_grad inputs: {res['fwd']['reason']}"
        res = _measure_peer(run, call, inputs, None, refs, view=view)
        if res["fwd"]["status"] == "error":
            res["fwd"]["reason"] = f"{refused}; under no_grad: {res['fwd']['reason']}"
        else:
            res["fwd"]["note"] = f"forward timed under no_grad; {refused}"
    if dout is not None:
        graph = []

        def bwd():
            return torch.autograd.grad(graph[0], leaves, dout, retain_graph=True)

        def first():
            graph.append(call(*leaves))
            return bwd()
        res["bwd"] = _attempt(run.time, first, lambda g: _grad_checks(g, refs[1], view), bwd)
    return res


def _sdpa_call(causal, gqa=False):
    """SDPA on (B, H, S, D) transposed views of bshd tensors, as a user holding bshd calls it."""
    import torch.nn.functional as F
    extra = {"enable_gqa": True} if gqa else {}

    def call(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=causal,
                                              **extra).transpose(1, 2)
    return call


def _flex_call(flex, block_mask, gqa=False):
    def call(q, k, v):
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                    enable_gqa=gqa).transpose(1, 2)
    return call


def _sdpa_backend(peer):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[peer]))


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _failed(reason, directions):
    return {d: {"ms": None, "status": "error", "reason": reason} for d in directions}


def _peers(run, directions, measure, kind=None):
    """{peer: measure(peer)} for the chosen peers; a peer whose set-up raises is "-" for every
    direction, one left out by --peers is "skipped", and so is math outside MATH_KINDS (kind:
    the case's)."""
    out = {}
    for peer in PEERS:
        why = ("not in --peers" if peer not in run.peers
               else "float32 and tf32 rows only" if peer == "math" and kind not in MATH_KINDS else None)
        if why:
            out[peer] = {d: {"ms": None, "status": "skipped", "reason": why} for d in directions}
            continue
        try:
            out[peer] = measure(peer)
        except Exception as e:
            out[peer] = _failed(_reason(e), directions)
    return out


def plain_results(run, case):
    """B*S tokens in bshd: attnext, then each peer, forward and backward. float32 and tf32 rows:
    float32 tensors; tf32 passes precision="tf32" and lets torch's peers use TF32 too."""
    import torch
    dtype = torch.bfloat16 if case.kind == "plain" else torch.float32
    q, k, v, dout = (_randn(run, case.B, case.Sq, case.Hq, case.D, dtype=dtype) for _ in range(4))
    refs = reference(q, k, v, dout, case.causal)
    kw = {"causal": case.causal, "device": "cuda"}
    if case.kind == "tf32":
        kw["precision"] = "tf32"
    with _allow_tf32(case.kind == "tf32"):
        return _plain_contenders(run, case, q, k, v, dout, refs, kw)


def _plain_contenders(run, case, q, k, v, dout, refs, kw):
    results = {"attnext": _measure_attnext(
        run, lambda **o: attnext.attention(q, k, v, **kw, **o),
        lambda out, lse, **o: attnext.attention_backward(dout, q, k, v, out, lse, **kw, **o),
        q.new_empty(q.shape), dout, refs)}

    def measure(peer):
        if peer == "flex":
            from torch.nn.attention.flex_attention import create_block_mask
            mask = (create_block_mask(_causal_mask, None, None, case.Sq, case.Sk, device=run.device)
                    if case.causal else None)
            return _measure_peer(run, _flex_call(run.flex(), mask), (q, k, v), dout, refs,
                                 grad_forward=True)
        with _sdpa_backend(peer):
            return _measure_peer(run, _sdpa_call(case.causal), (q, k, v), dout, refs)
    results.update(_peers(run, ("fwd", "bwd"), measure, case.kind))
    return _peer_backward_for_both(results)


class _allow_tf32:
    """torch.backends.cuda.matmul.allow_tf32 (and cuDNN's) set to `on` inside, restored after."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        import torch
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.on

    def __exit__(self, *exc):
        import torch
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def packed_reference(q, k, v, dout, lens):
    """reference() on each document of packed (T, H, D) tensors, concatenated."""
    import torch
    outs, grads = [], []
    bounds = np.concatenate([[0], np.cumsum(lens)])
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, g = reference(*(x[a:b][None] for x in (q, k, v, dout)), causal=True)
        outs.append(o[0])
        grads.append([x[0] for x in g])
    return torch.cat(outs), [torch.cat(list(parts)) for parts in zip(*grads)]


def packed_results(run, case):
    """Document-causal packed batch: attnext varlen, Flex with a document block mask, SDPA on the
    padded batch."""
    import torch
    T, lens, longest = case.Sq, case.lens, max(case.lens)
    q, k, v, dout = (_randn(run, T, case.Hq, case.D) for _ in range(4))
    refs = packed_reference(q, k, v, dout, lens)
    # cu_seqlens as a data loader has them: NumPy (checked on the host), or int32 on the device
    # with max_seqlen_* (read in place, no synchronisation: docs/design.md, device lengths)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    starts = cu[:-1].tolist()
    if case.lengths == "cuda":
        cu = torch.from_numpy(cu).to(run.device)
    kw = {"max_seqlen_q": longest, "max_seqlen_k": longest, "causal": True, "device": "cuda"}
    results = {"attnext": _measure_attnext(
        run, lambda **o: attnext.varlen_attention(q, k, v, cu, cu, **kw, **o),
        lambda out, lse, **o: attnext.varlen_attention_backward(dout, q, k, v, out, lse, cu, cu, **kw, **o),
        q.new_empty(q.shape), dout, refs)}

    def pad(x, fill):
        """(T, H, D) -> (docs, longest, H, D); the rows past a document's end hold `fill`."""
        xp = fill((len(lens), longest) + tuple(x.shape[1:]))
        for i, (a, n) in enumerate(zip(starts, lens)):
            xp[i, :n] = x[a:a + n]
        return xp

    def unpad(xp):
        return torch.cat([xp[i, :n] for i, n in enumerate(lens)])

    def measure(peer):
        if peer == "flex":
            from torch.nn.attention.flex_attention import create_block_mask
            doc = torch.repeat_interleave(torch.arange(len(lens), device=run.device),
                                          torch.tensor(lens, device=run.device))

            def document_causal(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
            mask = create_block_mask(document_causal, None, None, T, T, device=run.device)
            flex = _flex_call(run.flex(), mask)
            return _measure_peer(run, lambda q, k, v: flex(q[None], k[None], v[None])[0],
                                 (q, k, v), dout, refs, grad_forward=True)
        # padding rows get random q/k/v (causal keeps them out of the real rows) and a zero dout
        # (so they add nothing to dk, dv)
        padded = [pad(x, lambda s: _randn(run, *s)) for x in (q, k, v)]
        dout_p = pad(dout, lambda s: torch.zeros(s, dtype=dout.dtype, device=run.device))
        with _sdpa_backend(peer):
            return _measure_peer(run, _sdpa_call(True), padded, dout_p, refs, view=unpad)
    results.update(_peers(run, ("fwd", "bwd"), measure))
    return _peer_backward_for_both(results)


def decode_results(run, case):
    """One query row against a long KV cache, GQA; forward only."""
    q = _randn(run, case.B, 1, case.Hq, case.D)
    k, v = (_randn(run, case.B, case.Sk, case.Hk, case.D) for _ in range(2))
    refs = reference(q, k, v)
    results = {"attnext": _measure_attnext(
        run, lambda **o: attnext.attention(q, k, v, causal=False, device="cuda", **o), None,
        q.new_empty(q.shape), None, refs)}

    def measure(peer):
        if peer == "flex":
            return _measure_peer(run, _flex_call(run.flex(), None, gqa=True), (q, k, v), None, refs)
        with _sdpa_backend(peer):
            res = _measure_peer(run, _sdpa_call(False, gqa=True), (q, k, v), None, refs)
            if res["fwd"]["status"] != "error":
                return res
            # the backend refuses enable_gqa: the user's other way, K/V repeated outside the timing
            refused = f"enable_gqa=True: {res['fwd']['reason']}"
            group = case.Hq // case.Hk
            kv = [x.repeat_interleave(group, dim=2) for x in (k, v)]
            res = _measure_peer(run, _sdpa_call(False), (q, *kv), None, refs)
            if res["fwd"]["status"] == "error":
                res["fwd"]["reason"] = f"{refused}; repeat_interleave'd K/V: {res['fwd']['reason']}"
            else:
                res["fwd"]["note"] = (f"K/V repeat_interleave'd outside the timed region (it "
                                      f"reads {group}x the bytes counted); {refused}")
            return res
    results.update(_peers(run, ("fwd",), measure))
    return results


def _bf16_to_numpy(t):
    """A torch bf16 tensor as an ml_dtypes.bfloat16 NumPy array in ordinary (pageable) memory."""
    import torch
    return t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()


def _numpy_to_bf16(a, device):
    import torch
    if not isinstance(a, np.ndarray) or a.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"expected a bfloat16 NumPy result, got {type(a).__name__} "
                        f"{getattr(a, 'dtype', '')}")
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(device)


def pinned_copies(bytes_in, bytes_out, device):
    """The NumPy rows' floor: a function that copies bytes_in from pinned host memory to the
    device and bytes_out back, one after the other on torch's current stream (time it with a
    synchronisation after it: Run.wall_median)."""
    import torch
    host_in, host_out = (torch.empty(n, dtype=torch.uint8, pin_memory=True)
                         for n in (bytes_in, bytes_out))
    dev_in, dev_out = (torch.empty(n, dtype=torch.uint8, device=device) for n in (bytes_in, bytes_out))

    def copies():
        dev_in.copy_(host_in, non_blocking=True)
        host_out.copy_(dev_out, non_blocking=True)
    return copies


def softcap_reference(q, k, v):
    """Attention with scores 30 tanh(s / 30) in float32 on bf16 (B, S, H, D) tensors, a head at a
    time (the scores materialised); out (B, S, H, D) float32."""
    import torch
    B, S, H, D = q.shape
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(H):
            s = (q[b, :, h].float() @ k[b, :, h].float().T) / math.sqrt(D)
            out[b, :, h] = torch.softmax(SOFTCAP * torch.tanh(s / SOFTCAP), dim=-1) @ v[b, :, h].float()
    return out


def numpy_row(run, case, case_s_start):
    """attnext on host NumPy arrays (copies in and out included) against the pinned-copy floor;
    the softcap row against the plain NumPy call of its shape."""
    import torch
    shape = (case.B, case.Sq, case.Hq, case.D)
    qt, kt, vt = (_randn(run, *shape) for _ in range(3))
    ref_out = (softcap_reference(qt, kt, vt) if case.mod else reference(qt, kt, vt, causal=case.causal)[0])
    q, k, v = (_bf16_to_numpy(x) for x in (qt, kt, vt))
    del qt, kt, vt
    kw = {"causal": case.causal, "device": "cuda"}

    def plain():
        return attnext.attention(q, k, v, **kw)

    def call():
        if not case.mod:
            return plain()
        return attnext.attention(q, k, v, **kw,
                                 score_mod=lambda s, b, h, q_idx, kv_idx: SOFTCAP * np.tanh(s / SOFTCAP))
    def first():
        call()                     # a score_mod's faster tile, compiled in the background, is the one
        nvrtc.finish_ahead()       # checked and timed (cuda/select.py: fwd_ws_widens)
        return call()
    res = _attempt(run.wall_median, first,
                   lambda out: {"out": (_numpy_to_bf16(out, run.device), ref_out)}, call)
    bytes_in, bytes_out = q.nbytes + k.nbytes + v.nbytes, q.nbytes
    floor_ms, floor_reason = None, None
    try:
        if case.mod:
            floor_ms = run.wall_median(plain)
        else:
            copies = pinned_copies(bytes_in, bytes_out, run.device)
            copies()
            floor_ms = run.wall_median(copies)
    except Exception as e:
        floor_reason = _reason(e)
    target = NUMPY_MOD_TARGET if case.mod else NUMPY_TARGET
    floor_name = "plain" if case.mod else "floor"
    ratio = res["ms"] / floor_ms if res["ms"] and floor_ms else None
    row = {"section": "numpy", "case": case.name, "direction": "fwd", "B": case.B, "Sq": case.Sq,
           "Sk": case.Sk, "Hq": case.Hq, "Hk": case.Hk, "D": case.D, "causal": case.causal,
           "bytes_in": bytes_in, "bytes_out": bytes_out,
           "attnext_ms": res["ms"], "attnext_status": res["status"],
           "attnext_reason": res["reason"], "attnext_rel_errors": res.get("rel_errors"),
           "floor_ms": floor_ms,
           "floor_status": "error" if floor_reason else "ok", "floor_reason": floor_reason,
           "pinned_gbps": None if case.mod else gbps(bytes_in + bytes_out, floor_ms),
           "target": f"<={target:.1f}x {floor_name}", "target_ratio": ratio,
           "target_met": None if ratio is None else ratio <= target}
    row["case_s"] = time.perf_counter() - case_s_start
    return [row]


SECTIONS = {"plain": plain_results, "float32": plain_results, "tf32": plain_results,
            "packed": packed_results, "decode": decode_results}


def adapter_rows(run, case, case_s_start):
    """attnext.torch.attention against attnext.attention (+ attention_backward) on the same bf16
    CUDA tensors: the forward, then the forward with its backward. Validated against each other
    (the same kernels: equal bits) before timing."""
    import torch
    import attnext.torch as axt
    shape = (case.B, case.Sq, case.Hq, case.D)
    q, k, v = (_randn(run, *shape).requires_grad_() for _ in range(3))
    qd, kd, vd = (x.detach() for x in (q, k, v))
    dout = _randn(run, *shape)
    kw = {"causal": case.causal}

    def direct_fwd():
        return attnext.attention(qd, kd, vd, **kw)

    def direct_both():
        out, lse = attnext.attention(qd, kd, vd, return_lse=True, **kw)
        return out, attnext.attention_backward(dout, qd, kd, vd, out, lse, **kw)

    def adapter_fwd():
        return axt.attention(q, k, v, **kw)

    def adapter_both():
        for x in (q, k, v):
            x.grad = None
        out = axt.attention(q, k, v, **kw)
        out.backward(dout)
        return out
    rows = []
    for direction, mine, theirs, checks in (
            ("fwd", adapter_fwd, direct_fwd, lambda out: {"out": (out.detach(), direct_fwd())}),
            ("fwd+bwd", adapter_both, direct_both,
             lambda out: (lambda g: {"dq": (q.grad, g.dq), "dk": (k.grad, g.dk)})(direct_both()[1]))):
        res = _attempt(run.time, mine, checks, mine)
        direct = run.time(theirs)
        ratio = res["ms"] / direct if res["ms"] and direct else None
        rows.append({"section": "adapter", "case": case.name, "direction": direction, "B": case.B,
                     "Sq": case.Sq, "Sk": case.Sk, "Hq": case.Hq, "Hk": case.Hk, "D": case.D,
                     "causal": case.causal, "attnext_ms": res["ms"], "attnext_status": res["status"],
                     "attnext_reason": res["reason"], "attnext_rel_errors": res.get("rel_errors"),
                     "floor_ms": direct, "target": None, "target_ratio": ratio, "target_met": None,
                     "case_s": time.perf_counter() - case_s_start})
    return rows


def paged_rows(run, case, case_s_start):
    """Decode (one query row, GQA) over a paged cache whose pages are shuffled, against the same
    call on the keys laid out contiguously: GB/s of K and V read, the ratio of the two (target:
    PAGED_TARGET). The block table and seqlens_k are CUDA int32 tensors, as a serving loop keeps
    them: read in place, checked on the GPU by attn_pages, no synchronisation (a host table is
    checked and uploaded each call: host-bound at these sizes). Validated against the contiguous
    call's result before timing."""
    import torch
    B, Sk, Hk, D, ps = case.B, case.Sk, case.Hk, case.D, case.page
    q = _randn(run, B, 1, case.Hq, D)
    k, v = (_randn(run, B, Sk, Hk, D) for _ in range(2))
    n = Sk // ps
    perm = torch.randperm(B * n, device=run.device)
    kp, vp = (torch.empty((B * n, ps, Hk, D), dtype=x.dtype, device=run.device) for x in (k, v))
    kp[perm], vp[perm] = k.reshape(B * n, ps, Hk, D), v.reshape(B * n, ps, Hk, D)
    table = perm.reshape(B, n).to(torch.int32)
    lens = torch.full((B,), Sk, dtype=torch.int32, device=run.device)
    out_p, out_c = q.new_empty(q.shape), q.new_empty(q.shape)

    def paged():
        return attnext.attention(q, kp, vp, block_table=table, seqlens_k=lens, out=out_p)

    def contiguous():
        return attnext.attention(q, k, v, out=out_c)
    res = _attempt(run.time, paged, lambda out: {"out": (out.float(), contiguous().float())}, paged)
    direct = run.time(contiguous)
    ratio = direct / res["ms"] if res["ms"] and direct else None
    return [{"section": "paged", "case": case.name, "direction": "fwd", "B": B, "Sq": 1, "Sk": Sk,
             "Hq": case.Hq, "Hk": Hk, "D": D, "causal": False, "attnext_ms": res["ms"],
             "attnext_rate": gbps(case.kv_bytes(), res["ms"]), "attnext_status": res["status"],
             "attnext_reason": res["reason"], "attnext_rel_errors": res.get("rel_errors"),
             "floor_ms": direct, "target": f">={PAGED_TARGET:.1f}x contiguous", "target_ratio": ratio,
             "target_met": None if ratio is None else ratio >= PAGED_TARGET,
             "case_s": time.perf_counter() - case_s_start}]


def case_rows(run, case):
    """The rows of one case (one per direction); an unexpected failure becomes rows that say so."""
    t0 = time.perf_counter()
    directions = ("fwd",) if case.kind == "decode" else ("fwd", "bwd", "bwd_nd")
    try:
        if case.kind == "numpy":
            return numpy_row(run, case, t0)
        if case.kind == "adapter":
            return adapter_rows(run, case, t0)
        if case.kind == "paged":
            return paged_rows(run, case, t0)
        results = SECTIONS[case.kind](run, case)
    except Exception as e:   # e.g. out of memory making the inputs or the reference
        reason = _reason(e)
        if case.kind == "numpy":
            return [{"section": "numpy", "case": case.name, "direction": "fwd", "attnext_ms": None,
                     "attnext_status": "error", "attnext_reason": reason, "floor_ms": None,
                     "pinned_gbps": None, "target": f"<={NUMPY_TARGET:.1f}x floor",
                     "target_ratio": None, "target_met": None, "case_s": time.perf_counter() - t0}]
        results = {who: _failed(reason, directions) for who in ("attnext",) + PEERS}
    return [_finish(case, d, results, time.perf_counter() - t0) for d in directions]


# --- plot, header, main ---

def write_plot(rows, path, title=""):
    """A PNG of TFLOP/s against S for the plain rows, one panel per direction, D and causal.
    Returns a line saying what was written, or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is not importable ({e})"
    plain = [r for r in rows if r["section"] == "plain"]
    if not plain:
        return "no plot: no plain rows"
    directions = [d for d in ("fwd", "bwd") if any(r["direction"] == d for r in plain)]
    groups = sorted({(r["D"], r["causal"]) for r in plain})
    fig, axes = plt.subplots(len(directions), len(groups), squeeze=False, sharex=True,
                             figsize=(4 * len(groups), 3.5 * len(directions)))
    for i, d in enumerate(directions):
        for j, (D, causal) in enumerate(groups):
            ax = axes[i][j]
            sel = sorted((r for r in plain if r["direction"] == d
                          and (r["D"], r["causal"]) == (D, causal)), key=lambda r: r["Sq"])
            for who in ("attnext",) + PEERS:
                pts = [(r["Sq"], r[f"{who}_rate"]) for r in sel if r.get(f"{who}_rate") is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=who,
                            linewidth=2.5 if who == "attnext" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{d}, D={D}{', causal' if causal else ''}")
            ax.set_xlabel("S")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def header(timing):
    import torch
    props = torch.cuda.get_device_properties(0)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not importable"
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    cuda = attnext.info()["backends"].get("cuda")
    return [
        f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.0f} GiB), {date}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
        f"{torch.backends.cudnn.version()}), triton {triton_version}, "
        f"attnext {attnext.__version__} (cuda backend: {cuda})",
        f"bf16, torch.randn inputs (each plain/packed tensor 64 MiB, decode K/V >= 128 MiB: beyond "
        f"L2); times: {timing}",
        "attnext: attnext.attention / varlen_attention on torch CUDA tensors in place, bshd; the "
        "forward is timed with out= (no allocation in the timed region, no lse); the backward from "
        "a prior forward's out and lse",
        "flash, cudnn, effic, math: torch SDPA under sdpa_kernel(FLASH_ATTENTION / CUDNN_ATTENTION / "
        "EFFICIENT_ATTENTION / MATH; math on the float32 and tf32 rows only) on transposed "
        "(B, H, S, D) views of the same tensors; forward under no_grad, backward = autograd.grad "
        "on a graph built before timing; packed: the padded batch (documents padded to the "
        "longest, causal); decode: enable_gqa=True",
        "flex: torch.compile(flex_attention, dynamic=False) with create_block_mask (causal; "
        "document mask for packed, B=1); forward timed on requires_grad inputs (one compile "
        "serves both directions); decode: no_grad, enable_gqa=True",
        "rates: TFLOP/s = 4*B*H*Sq*Sk*D / time, halved if causal, backward 2.5x; packed: the "
        "documents' useful FLOPs for every column; decode: GB/s of K and V read",
        "ax/flash, ax/best: attnext's rate over flash's / the best peer's (>1: attnext faster); "
        "target: the goal for the row (ok, MISS, - not measured); s: seconds the case took, "
        "compiles and validation included",
        f"validated before timing against SDPA math in float32 on the same inputs (out, dq, dk, "
        f"dv: max|x - ref| / max|ref| < {TOL:g}): WRONG = failed, not timed; - = did not run (why: "
        f"notes below, JSON); * = see notes; ? = do_bench under {WALL_SUSPECT:g}x the synchronous "
        f"wall time per call (host-bound, or attnext's work not ordered on torch's stream)",
    ]


def make_timer(warmup, rep):
    """(fn -> median ms, description): triton.testing.do_bench, else CUDA events."""
    try:
        from triton.testing import do_bench
    except ImportError as e:
        def events(fn):
            return _event_median(fn, warmup, rep)
        return events, (f"CUDA-event medians, L2 flushed before each call (triton not importable: "
                        f"{e}), warmup {warmup} ms, rep {rep} ms")

    def timer(fn):
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return timer, (f"triton.testing.do_bench medians (warmup {warmup} ms, rep {rep} ms, "
                   f"L2 flushed before each call); NumPy rows: wall-clock medians of {NUMPY_REPS} after "
                   f"{NUMPY_WARMUP} untimed calls")


def _event_median(fn, warmup, rep):
    """do_bench's method without triton: estimate, warm up, then one event pair per call."""
    import torch
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate = max(1e3 * (time.perf_counter() - t0), 1e-3)
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(max(1, int(rep / estimate)))]
    for start, end in pairs:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(np.median([start.elapsed_time(end) for start, end in pairs]))
