"""GPU score_mod / mask_mod rows against FlexAttention, and the first calls' compile times: two
sections of `python -m attnext.bench --device cuda` (attnext/bench/cli.py runs them after
the plain sections; bench/lab_mods.py runs them alone, with per-launch kernel times).

mods        bf16, forward and backward, attnext against torch.compile(flex_attention):
  softcap30 B2 S8192 H16 D128 causal    score_mod 30 * tanh(s / 30), causal=True
  relbias B2 S8192 H16 D128 causal      score_mod s + table[h, q_idx - kv_idx + S], a float32
                                        (H, 2S) table, causal=True; both sides return the table's
                                        gradient (attnext: dtensors["table"]; Flex: the captured
                                        table requires grad and the timed autograd.grad takes it)
  alibi0.0625 B2 S8192 H16 D128 causal  score_mod s - 0.0625 * |q_idx - kv_idx| (one constant
                                        slope: no captured array), causal=True
  alibi[h] nograd B2 S8192 H16 D128 causal
                                        score_mod s - slopes[h] * |q_idx - kv_idx| over a captured
                                        float32 (H,) array of ALiBi's slopes 2^(-8 (h + 1) / H),
                                        causal=True; the backward with dtensors=False (no slopes
                                        gradient, as Flex's slopes require none): the kernels of
                                        the constant-slope row, which it should match
  doc7 mask T16384 H16 D128             16384 tokens in the bench's 7 documents (B = 1), the
                                        document-causal mask as a mask_mod alone
  doc7 causal+mask T16384 H16 D128      the same as causal=True plus a document mask_mod
  window1024 mask B2 S8192 H16 D128     a causal sliding window of 1024 as a mask_mod
  Flex gets the same functions in torch and a block mask made once, outside its timing; attnext
  builds (or finds kept) its block mask inside every call. TFLOP/s count the pairs each mask
  keeps: 4 * H * D * kept pairs a forward, 2.5x that a backward.

first call  (with --first-call) for each mods row: attnext's first forward and first backward in
  a fresh Python process (python -c, torch and attnext imported before the timing), each call
  timed alone and synchronised: cold, with a fresh empty ATTNEXT_CACHE_DIR (every kernel the calls
  use is compiled, mod-free ones that `python -m attnext.warmup` would have cached included;
  where the machine has the cores, the first forward starts the backward's compiles:
  nvrtc.compile_ahead, which ATTNEXT_COMPILE_AHEAD=0 turns off); disk, in another fresh
  process with that same, now filled, folder (the issue's < 50 ms); new, in a fresh process
  with a second folder that a process running the row's plain twin (causal=True, no mods, the
  same shapes) filled: what a new mod costs a user who has run attention without it (the mod's
  own kernels compiled; a mask_mod lowered to a band or documents compiles none). Each of the
  FIRST_CALL_REPS repeats with folders of its own: the table has the medians (the H100 hosts'
  NVRTC time moves ~25% from one process to the next), the JSON every repeat's times too.

Every result is validated before it is timed (the kernel lab rule): attnext's and Flex's out, dq,
dk, dv and the captured tables' gradients against a float32 reference that materialises the
scores on the same bf16 inputs (the torch functions Flex gets, applied to index grids), max|x -
ref| / max|ref| < cuda.TOL. err/flex is attnext against Flex: the largest max|ax - flex| /
max|flex| over out (fwd) or dq, dk, dv and the tables' gradients (bwd).

torch is imported only when a section runs: `import attnext.bench.mods` needs no torch.
"""
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

import numpy as np

import attnext
from ..cuda import nvrtc
from . import cuda as bc

MOD_B, MOD_S, MOD_H, MOD_D = 2, 8192, 16, 128
QUICK_B, QUICK_S = 8, 2048
SOFTCAP = 30.0
WINDOW = 1024
TABLE_SEED = 0
ALIBI_SLOPE = 0.0625
KINDS = ("softcap", "relbias", "alibi_const", "alibi_slopes", "doc", "doc_causal", "window")
QUICK_KINDS = ("relbias", "doc_causal")     # one score_mod with a table gradient, one mask_mod
REF_SCORE_BYTES = 1 << 29          # float32 scores per reference chunk (autograd keeps ~8 such)
MOD_TARGET = 1.3                   # attnext's rate over Flex's, both directions ([6/7]'s bar)
COLD_TARGET_S = 2.0                # a new score_mod's first call, compiles included
DISK_TARGET_S = 0.05               # the same from the disk cache in a fresh process
CHILD_TIMEOUT_S = 600
FIRST_CALL_REPS = 3                # repeats of a row's first-call processes (PHASES): the medians
CHILD_MARK = "attnext-first-call "
NO_BUFFER_GRAD = "Flex: no captured-buffer gradient"
MODS_TITLE = "score_mod / mask_mod against FlexAttention (TFLOP/s of the kept pairs)"
FIRST_CALL_TITLE = "first call in a fresh process (s): cold = empty ATTNEXT_CACHE_DIR, disk = filled"


# --- the cases (no torch) ---

class ModCase(NamedTuple):
    kind: str                      # one of KINDS
    B: int
    S: int                         # tokens per sequence (doc: all documents packed, B = 1)
    H: int
    D: int
    lens: Optional[tuple] = None   # doc: the documents' lengths (sum = S)
    window: int = WINDOW

    @property
    def name(self):
        shape = f"B{self.B} S{self.S} H{self.H} D{self.D}"
        if self.kind == "softcap":
            return f"softcap{SOFTCAP:g} {shape} causal"
        if self.kind == "relbias":
            return f"relbias {shape} causal"
        if self.kind == "alibi_const":
            return f"alibi{ALIBI_SLOPE:g} {shape} causal"
        if self.kind == "alibi_slopes":
            return f"alibi[h] nograd {shape} causal"
        if self.kind in ("doc", "doc_causal"):
            mask = "causal+mask" if self.kind == "doc_causal" else "mask"
            return f"doc{len(self.lens)} {mask} T{self.S} H{self.H} D{self.D}"
        return f"window{self.window} mask {shape}"

    def kept_pairs(self):
        """(b, q_idx, kv_idx) pairs the mask keeps, per head."""
        if self.kind in ("doc", "doc_causal"):
            return sum(n * (n + 1) // 2 for n in self.lens)
        if self.kind == "window":
            w = min(self.window, self.S)      # row i keeps min(i + 1, w) keys
            return self.B * (w * (w + 1) // 2 + (self.S - w) * w)
        return self.B * self.S * (self.S + 1) // 2

    def flops(self, backward=False):
        f = 4.0 * self.H * self.D * self.kept_pairs()
        return f * bc.BWD_FLOPS_FACTOR if backward else f


def mod_case(kind, quick=False):
    """The row of `kind` at the bench's size (quick: B8 S2048; the documents stay 16k tokens)."""
    if kind not in KINDS:
        raise ValueError(f"unknown mod case {kind!r}; choose from {KINDS}")
    if kind in ("doc", "doc_causal"):
        lens = bc.document_lengths()
        return ModCase(kind, 1, sum(lens), MOD_H, MOD_D, lens)
    B, S = (QUICK_B, QUICK_S) if quick else (MOD_B, MOD_S)
    return ModCase(kind, B, S, MOD_H, MOD_D)


def cases(quick=False):
    return [mod_case(kind, quick) for kind in (QUICK_KINDS if quick else KINDS)]


def relbias_table(case):
    """The relative-bias table (H, 2S), float32, seeded: entry S + q_idx - kv_idx."""
    return np.random.default_rng(TABLE_SEED).standard_normal((case.H, 2 * case.S)).astype(np.float32)


def alibi_slopes(case):
    """ALiBi's slopes 2^(-8 (h + 1) / H), float32 (H,)."""
    return np.exp2(-8.0 * np.arange(1, case.H + 1) / case.H).astype(np.float32)


def doc_ids(case):
    """The document of each packed token."""
    return np.repeat(np.arange(len(case.lens)), case.lens)


def attnext_mods(case):
    """attnext's keyword arguments of the row: causal and its score_mod / mask_mod over NumPy
    arrays (the captured table's gradient comes back as dtensors["table"])."""
    S, window = case.S, case.window
    if case.kind == "softcap":
        return dict(causal=True,
                    score_mod=lambda score, b, h, q_idx, kv_idx: SOFTCAP * np.tanh(score / SOFTCAP))
    if case.kind == "relbias":
        table = relbias_table(case)
        return dict(causal=True,
                    score_mod=lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + S])
    if case.kind == "alibi_const":
        return dict(causal=True,
                    score_mod=lambda score, b, h, q_idx, kv_idx: score - ALIBI_SLOPE * np.abs(q_idx - kv_idx))
    if case.kind == "alibi_slopes":
        slopes = alibi_slopes(case)
        return dict(causal=True,
                    score_mod=lambda score, b, h, q_idx, kv_idx: score - slopes[h] * np.abs(q_idx - kv_idx))
    if case.kind == "doc":
        doc = doc_ids(case)
        return dict(mask_mod=lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx))
    if case.kind == "doc_causal":
        doc = doc_ids(case)
        return dict(causal=True, mask_mod=lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx])
    return dict(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < window))


def attnext_backward_mods(case):
    """The keyword arguments of the row's backward: attnext_mods', and for alibi_slopes
    dtensors=False (no gradient for the slopes)."""
    extra = dict(dtensors=False) if case.kind == "alibi_slopes" else {}
    return dict(attnext_mods(case), **extra)


def flex_mods(case, device, buffer_grad=True):
    """(score_mod or None, mask_mod, {name: captured float tensor}) for Flex and the reference:
    the row's functions in torch. buffer_grad: the relative-bias table requires grad."""
    import torch
    S, window = case.S, case.window

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    if case.kind == "softcap":
        return (lambda score, b, h, q_idx, kv_idx: SOFTCAP * torch.tanh(score / SOFTCAP)), causal, {}
    if case.kind == "relbias":
        table = torch.from_numpy(relbias_table(case)).to(device).requires_grad_(buffer_grad)
        return (lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + S]), causal, \
            {"table": table}
    if case.kind == "alibi_const":
        return (lambda score, b, h, q_idx, kv_idx: score - ALIBI_SLOPE * torch.abs(q_idx - kv_idx)), causal, {}
    if case.kind == "alibi_slopes":
        slopes = torch.from_numpy(alibi_slopes(case)).to(device)     # no gradient asked: none required
        return (lambda score, b, h, q_idx, kv_idx: score - slopes[h] * torch.abs(q_idx - kv_idx)), causal, \
            {"slopes": slopes}
    if case.kind in ("doc", "doc_causal"):
        doc = torch.from_numpy(doc_ids(case)).to(device)
        return None, lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx), {}
    return None, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < window), {}


# --- the float32 reference ---

def mod_reference(q, k, v, dout, score_mod, mask_mod, captured):
    """Attention with score_mod and mask_mod in float32 on bf16 (B, S, H, D) tensors, the scores
    materialised, chunked over batch items and heads (REF_SCORE_BYTES of scores a chunk). The
    torch functions get index grids (b a 0-d tensor, h (heads, 1, 1), q_idx (1, S, 1), kv_idx
    (1, 1, S)) and broadcast. Every row of these cases keeps its diagonal (no fully masked row).
    Returns {"out", "dq", "dk", "dv", "d<name>" for each captured tensor that requires grad},
    float32."""
    import torch
    B, S, H, D = q.shape
    dev = q.device
    scale = 1.0 / math.sqrt(D)
    heads = max(1, min(H, REF_SCORE_BYTES // (4 * S * S)))
    captured = {n: t for n, t in captured.items() if t.requires_grad}
    leaves = list(captured.values())
    ref = {"out": torch.empty(q.shape, dtype=torch.float32, device=dev)}
    for name, x in (("dq", q), ("dk", k), ("dv", v)):
        ref[name] = torch.empty(x.shape, dtype=torch.float32, device=dev)
    for name, x in captured.items():
        ref[f"d{name}"] = torch.zeros(x.shape, dtype=torch.float32, device=dev)
    idx = torch.arange(S, device=dev)
    q_idx, kv_idx = idx.view(1, S, 1), idx.view(1, 1, S)
    with torch.enable_grad():
        for b in range(B):
            bt = torch.tensor(b, device=dev)
            for h0 in range(0, H, heads):
                hs = slice(h0, min(H, h0 + heads))
                ht = torch.arange(hs.start, hs.stop, device=dev).view(-1, 1, 1)
                qc, kc, vc = (x[b, :, hs].detach().float().transpose(0, 1).requires_grad_()
                              for x in (q, k, v))                    # (heads, S, D)
                s = (qc @ kc.transpose(1, 2)) * scale
                if score_mod is not None:
                    s = score_mod(s, bt, ht, q_idx, kv_idx)
                s = s.masked_fill(~mask_mod(bt, ht, q_idx, kv_idx), -math.inf)
                o = torch.softmax(s, dim=-1) @ vc
                ref["out"][b, :, hs] = o.detach().transpose(0, 1)
                grads = torch.autograd.grad(o, [qc, kc, vc] + leaves,
                                            dout[b, :, hs].float().transpose(0, 1),
                                            allow_unused=True)
                for name, g in zip(("dq", "dk", "dv"), grads):
                    ref[name][b, :, hs] = g.transpose(0, 1)
                for name, g in zip(captured, grads[3:]):
                    if g is not None:
                        ref[f"d{name}"] += g
                del s, o, grads
    return ref


# --- the rows ---

def _as_torch(x, device):
    """A gradient attnext returned (NumPy, or a device array) as a float32 torch tensor."""
    import torch
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)).to(device).float()
    return torch.as_tensor(x, device=device).float()


def _checked(refs, names, keep, direction):
    """checks() for bc._attempt: compares the named results with refs and keeps them (for the
    error against the other contender)."""
    def checks(results):
        keep[direction] = results
        missing = [n for n in names if n not in results]
        if missing:
            raise ValueError(f"no {', '.join(missing)} in the results")
        return {n: (results[n], refs[n]) for n in names}
    return checks


def _measure_attnext(run, q, k, v, dout, kw, refs, keep, bwd_kw=None):
    """attnext's forward (out=, no lse: the timed form) and backward from a prior forward's out and
    lse, each validated against refs before it is timed; keep receives what they returned.
    bwd_kw: the backward's keyword arguments (kw's by default)."""
    bwd_kw = kw if bwd_kw is None else bwd_kw
    grad_names = [n for n in refs if n != "out"]
    o = q.new_empty(q.shape)

    def fwd():
        return attnext.attention(q, k, v, out=o, **kw)

    def first():
        fwd()                      # a first call may start compiling a faster tile in the background
        nvrtc.finish_ahead()       # (cuda/select.py: fwd_ws_widens): that tile is checked and timed
        o.fill_(math.nan)          # an element the kernel does not write fails the check
        fwd()
        return {"out": o.clone()}
    res = {"fwd": bc._attempt(run.time, first, _checked(refs, ["out"], keep, "fwd"), fwd, run.wall)}
    saved = []

    def bwd():
        return attnext.attention_backward(dout, q, k, v, *saved, **bwd_kw)

    def first_bwd():
        saved.extend(attnext.attention(q, k, v, return_lse=True, **kw))
        g = bwd()
        got = {"dq": g.dq, "dk": g.dk, "dv": g.dv}
        got.update({f"d{n}": _as_torch(x, q.device) for n, x in (g.dtensors or {}).items()})
        return got
    res["bwd"] = bc._attempt(run.time, first_bwd, _checked(refs, grad_names, keep, "bwd"), bwd,
                             run.wall)
    return res


def _measure_flex(run, case, q, k, v, dout, refs, keep):
    """Flex with the row's torch functions and a block mask made here, outside the timing.
    Forward under no_grad; backward: autograd.grad over q, k, v and every captured tensor (the
    relative-bias table requires grad) on a graph built before the timing. If that backward
    cannot run but one without the captured tensors' gradients can, the row says so
    (NO_BUFFER_GRAD) and Flex's backward is not timed: that would be less work than attnext's."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    score_mod, mask_mod, captured = flex_mods(case, run.device)
    block_mask = create_block_mask(mask_mod, None, None, case.S, case.S, device=run.device)
    flex = run.flex()

    def call(q_, k_, v_, score=score_mod):
        return flex(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), score_mod=score,
                    block_mask=block_mask).transpose(1, 2)
    with torch.no_grad():
        res = {"fwd": bc._attempt(run.time, lambda: {"out": call(q, k, v)},
                                  _checked(refs, ["out"], keep, "fwd"), lambda: call(q, k, v))}
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    extra = [t for t in captured.values() if t.requires_grad]
    names = ["dq", "dk", "dv"] + [f"d{n}" for n, t in captured.items() if t.requires_grad]
    graph = []

    def bwd():
        return torch.autograd.grad(graph[0], leaves + extra, dout, retain_graph=True)

    def first():
        graph.append(call(*leaves))
        return dict(zip(names, bwd()))
    res["bwd"] = bc._attempt(run.time, first, _checked(refs, names, keep, "bwd"), bwd)
    graph.clear()
    if res["bwd"]["status"] == "error" and extra:
        plain_score, _, _ = flex_mods(case, run.device, buffer_grad=False)
        try:
            out = call(*leaves, score=plain_score)
            torch.autograd.grad(out, leaves, dout)
        except Exception:       # it fails without them too: the reason stands as it is
            pass
        else:
            res["bwd"]["reason"] = f"{NO_BUFFER_GRAD} ({res['bwd']['reason']})"
    return res


def _cross_errors(keep_ax, keep_flex):
    """{direction: {name: max|ax - flex| / max|flex|}} where both kept a result."""
    out = {}
    for d in ("fwd", "bwd"):
        a, f = keep_ax.get(d) or {}, keep_flex.get(d) or {}
        errs = {n: bc.rel_error(a[n], f[n].float()) for n in a if n in f}
        out[d] = {n: (e if math.isfinite(e) else str(e)) for n, e in errs.items()}
    return out


def mod_results(run, case):
    """({"attnext": {fwd, bwd}, "flex": {fwd, bwd}}, {direction: errors of attnext against Flex})."""
    q, k, v, dout = (bc._randn(run, case.B, case.S, case.H, case.D) for _ in range(4))
    score_mod, mask_mod, captured = flex_mods(case, run.device)
    refs = mod_reference(q, k, v, dout, score_mod, mask_mod, captured)
    del score_mod, mask_mod, captured
    kw = dict(attnext_mods(case), device="cuda")
    keep_ax, keep_flex = {}, {}
    results = {"attnext": _measure_attnext(run, q, k, v, dout, kw, refs, keep_ax,
                                           dict(attnext_backward_mods(case), device="cuda"))}
    if "flex" in run.peers:
        try:
            results["flex"] = _measure_flex(run, case, q, k, v, dout, refs, keep_flex)
        except Exception as e:     # e.g. create_block_mask or torch.compile refusing
            results["flex"] = bc._failed(bc._reason(e), ("fwd", "bwd"))
    else:
        results["flex"] = {d: {"ms": None, "status": "skipped", "reason": "not in --peers"}
                           for d in ("fwd", "bwd")}
    return results, _cross_errors(keep_ax, keep_flex)


def finish(case, direction, results, cross, case_s):
    """One table/JSON row of the mods section."""
    row = {"section": "mods", "case": case.name, "kind": case.kind, "direction": direction,
           "B": case.B, "S": case.S, "H": case.H, "D": case.D,
           "seqlens": list(case.lens) if case.lens else None, "kept_pairs": case.kept_pairs(),
           "unit": "TFLOP/s", "work": case.flops(direction == "bwd"), "case_s": case_s}
    for who in ("attnext", "flex"):
        res = results.get(who, {}).get(direction) or {"status": "skipped", "reason": "not run"}
        row[f"{who}_ms"] = res.get("ms")
        row[f"{who}_rate"] = bc.tflops(row["work"], res.get("ms"))
        for key in ("status", "reason", "rel_errors", "note"):
            row[f"{who}_{key}"] = res.get(key)
    wall = (results.get("attnext", {}).get(direction) or {}).get("wall_ms")
    row["attnext_wall_ms"] = wall
    row["attnext_suspect"] = bool(wall and row["attnext_ms"]
                                  and row["attnext_ms"] < bc.WALL_SUSPECT * wall)
    errs = cross.get(direction) or {}
    row["ax_vs_flex_errors"] = errs
    finite = [e for e in errs.values() if isinstance(e, float)]
    row["ax_vs_flex"] = (max(finite) if len(finite) == len(errs) else math.inf) if errs else None
    ax, fx = row["attnext_rate"], row["flex_rate"]
    row["ratio_flex"] = ax / fx if ax and fx else None
    row["target"] = f">={MOD_TARGET:.1f}x flex"
    row["target_ratio"] = row["ratio_flex"]
    row["target_met"] = None if row["ratio_flex"] is None else row["ratio_flex"] >= MOD_TARGET
    return row


def case_rows(run, case):
    """The fwd and bwd rows of one case; an unexpected failure becomes rows that say so."""
    t0 = time.perf_counter()
    try:
        results, cross = mod_results(run, case)
    except Exception as e:      # e.g. out of memory making the inputs or the reference
        reason = bc._reason(e)
        results = {who: bc._failed(reason, ("fwd", "bwd")) for who in ("attnext", "flex")}
        cross = {}
    return [finish(case, d, results, cross, time.perf_counter() - t0) for d in ("fwd", "bwd")]


# --- first calls, each in a fresh process ---

def child_command(case, plain=False):
    """The command that runs first_call_child(case, plain) in a fresh interpreter."""
    code = ("import sys; from attnext.bench import mods as bench_mods; "
            "sys.exit(bench_mods.first_call_child(sys.argv[1], sys.argv[2] == 'plain'))")
    return [sys.executable, "-c", code, json.dumps(case._asdict()), "plain" if plain else "mods"]


def case_from_json(text):
    """The ModCase that child_command wrote as JSON."""
    fields = json.loads(text)
    fields["lens"] = tuple(fields["lens"]) if fields.get("lens") else None
    return ModCase(**fields)


def first_call_child(case_json, plain=False):
    """In the fresh process: attnext's first forward and first backward of the case, each timed
    alone from the call to a synchronisation after it (imports, inputs and the CUDA context come
    before the timing). plain: the case's plain twin instead (causal=True, no mods: every mods
    row is causal), which fills a cache folder with the kernels a user who has run attention
    without the mod has. Prints one line: CHILD_MARK and a JSON object."""
    import torch
    case = case_from_json(case_json)
    q, k, v, dout = (torch.randn(case.B, case.S, case.H, case.D, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    kw = dict(dict(causal=True) if plain else attnext_mods(case), device="cuda")
    bwd_kw = dict(dict(causal=True) if plain else attnext_backward_mods(case), device="cuda")

    def forward_then_backward():
        """(forward s, backward s), each from the call to a synchronisation after it."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, lse = attnext.attention(q, k, v, return_lse=True, **kw)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        attnext.attention_backward(dout, q, k, v, out, lse, **bwd_kw)
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1
    fwd_s, bwd_s = forward_then_backward()
    from attnext.cuda import nvrtc
    cubins = nvrtc.cache_info() or {}
    # the same calls again, timed alike: what the first ones cost beyond the work itself
    fwd_again_s, bwd_again_s = forward_then_backward()
    print(CHILD_MARK + json.dumps({
        "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_again_s": fwd_again_s, "bwd_again_s": bwd_again_s,
        "compiles": cubins.get("compiles", 0),
        "compile_s": cubins.get("compile_seconds", 0.0), "disk_hits": cubins.get("disk_hits", 0),
        "cache_dir": cubins.get("cache_dir")}), flush=True)
    return 0


def _child_env(cache_dir, pycache_dir):
    """The environment with ATTNEXT_CACHE_DIR set, this attnext first on PYTHONPATH, and Python's
    bytecode written to and read from pycache_dir: the cold child compiles attnext's modules as
    it compiles its kernels, the disk child finds both, as an installed attnext (byte-compiled by
    pip) would (run_gpu.sh sets PYTHONDONTWRITEBYTECODE, which would make every child compile
    the modules it imports lazily: ~20 ms)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(attnext.__file__)))
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, ATTNEXT_CACHE_DIR=cache_dir, PYTHONPYCACHEPREFIX=pycache_dir,
               PYTHONPATH=root + (os.pathsep + path if path else ""),
               CUDA_CACHE_DISABLE="1")     # NVRTC 12.9+ also caches in the driver's compute cache
    # (~/.nv/ComputeCache): with it a "cold" child found its compiles there (0.06 s)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run_child(case, env, timeout, plain=False):
    """The child's report (dict), or raises RuntimeError with the end of its output."""
    try:
        proc = subprocess.run(child_command(case, plain), env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the child ran past {timeout} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise RuntimeError(f"the child exited with status {proc.returncode}: {tail}")
    return json.loads(lines[-1][len(CHILD_MARK):])


def _cache_entries(folder):
    return sum(len(files) for _, _, files in os.walk(folder))


CHILD_KEYS = ("fwd_s", "bwd_s", "fwd_again_s", "bwd_again_s", "compiles", "compile_s", "disk_hits")
# (phase, folder, plain twin): the mod cold, then from that folder; the twin, then the mod beside
# its kernels
PHASES = (("cold", "own", False), ("disk", "own", False), ("twin", "twin", True), ("new", "twin", False))


def first_call_row(case, timeout=CHILD_TIMEOUT_S, reps=FIRST_CALL_REPS):
    """The case's first forward and backward in a fresh process with an empty cache folder
    (cold), then in another fresh process with that folder (disk); then (new) in a fresh process
    with a second folder that a process running the plain twin filled (first_call_child's
    plain): the mod's own compiles alone. reps times, each with folders of their own (removed
    after): {phase}_{key} the median over the repeats that finished (the largest count of
    compiles), {phase}_{key}_all each one's; after a failed child no further repeat runs, the row
    is an error and its target unmet or unmeasured."""
    row = {"section": "first_call", "case": case.name, "kind": case.kind,
           "direction": "first call", "attnext_status": "ok", "attnext_reason": None, "reps": reps}
    t0 = time.perf_counter()
    done = []                           # each finished repeat's {phase_key: value}
    for _ in range(reps):
        one = {}
        with tempfile.TemporaryDirectory(prefix="attnext-first-call-") as top:
            folder = os.path.join(top, "kernels")
            os.mkdir(folder)
            env = _child_env(folder, os.path.join(top, "bytecode"))
            twin = os.path.join(top, "twin")
            os.mkdir(twin)
            twin_env = _child_env(twin, os.path.join(top, "bytecode"))
            try:
                for phase, where, plain in PHASES:
                    here, here_env = (folder, env) if where == "own" else (twin, twin_env)
                    rep = _run_child(case, here_env, timeout, plain)
                    if plain:
                        continue
                    for key in CHILD_KEYS:
                        one[f"{phase}_{key}"] = rep.get(key)
                    row[f"{phase}_cache_dir"] = rep.get("cache_dir")
                    one[f"{phase}_entries_after"] = _cache_entries(here)
            except Exception as e:
                row["attnext_status"], row["attnext_reason"] = "error", f"{phase}: {bc._reason(e)}"
                break
        done.append(one)
    row["reps_done"] = len(done)        # the repeats the medians are of
    for name in done[0] if done else ():
        values = [one[name] for one in done]
        if None not in values:
            integral = name.endswith(("compiles", "disk_hits", "entries_after"))
            row[name] = max(values) if integral else statistics.median(values)
            row[name + "_all"] = values
    row["case_s"] = time.perf_counter() - t0
    misses = [f"{phase} {d}" for phase, bound in (("cold", COLD_TARGET_S), ("disk", DISK_TARGET_S))
              for d in ("fwd", "bwd")
              if row.get(f"{phase}_{d}_s") is not None and not row[f"{phase}_{d}_s"] < bound]
    measured = all(row.get(f"{p}_{d}_s") is not None for p in ("cold", "disk") for d in ("fwd", "bwd"))
    row["target"] = f"<{COLD_TARGET_S:g} s cold, <{DISK_TARGET_S:g} s disk"
    row["target_misses"] = misses
    row["target_met"] = (not misses) if measured else (False if misses else None)
    if row["attnext_status"] != "ok" and not misses:     # a repeat failed: not a whole measurement
        row["target_met"] = None
    if row.get("disk_compiles"):
        row["attnext_note"] = (f"the disk run compiled {row['disk_compiles']} kernels: the disk "
                               f"cache did not serve every kernel")
    return row


# --- the tables ---

def _ms_cell(row, who):
    if row.get(f"{who}_status") == "WRONG":
        return "WRONG"
    ms = row.get(f"{who}_ms")
    suspect = who == "attnext" and row.get("attnext_suspect")
    return "-" if ms is None else bc._num(ms) + ("?" if suspect else "")


def _err_cell(row):
    e = row.get("ax_vs_flex")
    return "-" if e is None else f"{e:.1e}"


def _target_cell(row):
    reason = row.get("flex_reason") or ""
    return reason[:len(NO_BUFFER_GRAD)] if reason.startswith(NO_BUFFER_GRAD) else bc._target_cell(row)


def _first_cell(row, phase, d):
    x = row.get(f"{phase}_{d}_s")
    return "-" if x is None else bc._num(x)


def _first_target_cell(row):
    if row["target_met"] is None:
        return f"- {row['target']}"
    return f"ok {row['target']}" if row["target_met"] else f"MISS {', '.join(row['target_misses'])}"


MOD_COLUMNS = [("case", 40, lambda r: r["case"]), ("dir", 3, lambda r: r["direction"]),
               ("ax ms", 8, lambda r: _ms_cell(r, "attnext")),
               ("flex ms", 8, lambda r: _ms_cell(r, "flex")),
               ("ax/flex", 7, lambda r: bc._ratio_cell(r["ratio_flex"])),
               ("attnext", 7, lambda r: bc._rate_cell(r, "attnext")),
               ("flex", 7, lambda r: bc._rate_cell(r, "flex")),
               ("err/flex", 8, _err_cell), ("s", 4, lambda r: f"{r['case_s']:.0f}"),
               ("target", 0, _target_cell)]
FIRST_COLUMNS = [("case", 40, lambda r: r["case"]),
                 ("cold fwd", 8, lambda r: _first_cell(r, "cold", "fwd")),
                 ("cold bwd", 8, lambda r: _first_cell(r, "cold", "bwd")),
                 ("disk fwd", 8, lambda r: _first_cell(r, "disk", "fwd")),
                 ("disk bwd", 8, lambda r: _first_cell(r, "disk", "bwd")),
                 ("new fwd", 8, lambda r: _first_cell(r, "new", "fwd")),
                 ("new bwd", 8, lambda r: _first_cell(r, "new", "bwd")),
                 ("2nd fwd", 8, lambda r: _first_cell(r, "disk", "fwd_again")),
                 ("2nd bwd", 8, lambda r: _first_cell(r, "disk", "bwd_again")),
                 ("compiles", 8, lambda r: "/".join(str(r.get(f"{p}_compiles", "-")) for p in ("cold", "disk", "new"))),
                 ("s", 4, lambda r: f"{r['case_s']:.0f}"), ("target", 0, _first_target_cell)]
SECTION_NOTES = {
    "mods": [
        "ms: the bench's medians; attnext: attention(out=) and attention_backward (dtensors "
        "included, but for alibi[h] nograd: dtensors=False), bshd;",
        "flex: forward under no_grad, backward = autograd.grad over q, k, v and the captured "
        "tables, block mask made outside the timing;",
        "err/flex: max|ax - flex| / max|flex| over out (fwd) or dq, dk, dv, d<table> (bwd); both "
        "validated first against a float32 reference"],
    "first_call": [
        f"medians of {FIRST_CALL_REPS} repeats (each one's in the JSON); each call timed alone, "
        "synchronised, in a fresh process after its imports; cold: an empty ATTNEXT_CACHE_DIR",
        "(every kernel compiled); disk: the same folder in another fresh process; 2nd: the disk "
        "child's second forward and backward, timed alike",
        "(what the first calls cost beyond the work itself); new: a fresh process whose folder a "
        "process running the plain twin (causal=True, no mods) filled:",
        "the mod's own compiles alone; compiles: NVRTC compiles cold/disk/new; target: cold and "
        "disk"],
}


def columns_for(section):
    return FIRST_COLUMNS if section == "first_call" else MOD_COLUMNS


def format_header(section):
    cols = columns_for(section)
    return bc.format_line([title for title, _, _ in cols], cols)


def format_row(row):
    cols = columns_for(row["section"])
    return bc.format_line([cell(row) for _, _, cell in cols], cols)


def sections(run, mod_cases, first_call=False):
    """The mods section over mod_cases (and, with first_call, the first-call section), printed as
    they go; returns the rows."""
    import gc

    import torch
    rows = []
    for section, title in (("mods", MODS_TITLE), ("first_call", FIRST_CALL_TITLE)):
        if not mod_cases or (section == "first_call" and not first_call):
            continue
        print(f"\n{title}\n" + "\n".join(SECTION_NOTES[section]) + f"\n{format_header(section)}",
              flush=True)
        for case in mod_cases:
            torch.manual_seed(len(rows))
            new = case_rows(run, case) if section == "mods" else [first_call_row(case)]
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            rows += new
            for row in new:
                print(format_row(row), flush=True)
    return rows
