"""float32 on the GPU: attnext's default (split TF32; Hopper's backward at D 64 / 128 on bfloat16
planes) and single-pass TF32 (precision="tf32")
against torch SDPA's float32 backends (efficient; math with and without TF32 matmuls), TFLOP/s,
same run, forward and (--bwd) backward (2.5x the forward's FLOPs; attnext from a prior forward's
out and lse, torch by autograd.grad on a graph built before timing). Every result is checked
first against SDPA's math backend in float64 (max|x - ref| / max|ref|), and its
error printed beside its rate (the backward: the worst of dq, dk and dv).

    python bench/labs/lab_f32.py [--rows "4,2048,16,64;1,8192,16,128,causal"] [--tiles "128,64,4;64,64,4"]
                                 [--sm90 0|1] [--bwd] [--bwd-tiles "16,4,0,2,64,32,4,2;..."] [--atomic]
                                 [--presplit] [--split-tf32]

--tiles: attnext's float32 rows again under each forward tile (ATTNEXT_TILE_FWD), beside the default.
--sm90: attnext's forward rows again with ATTNEXT_FWD_F32_SM90 set to this (the TF32 wgmma forward
on or off), labelled "sm90=" the value.
--bwd-tiles: attnext's backward (both precisions) again under each backward tile (ATTNEXT_TILE_BWD).
attnext's backward runs deterministic (the default) and with deterministic=False ("nodet": dQ added
by atomics in the dK/dV kernel where select.bwd_dq_mode takes it).
--atomic: attnext's backward (both precisions) again with those atomics forced
(ATTNEXT_BWD_DQ=atomic, deterministic=False), each backward tile too.
--presplit: every attnext backward row twice, its shared tiles split once and at each use
(ATTNEXT_BWD_F32_PRESPLIT=1 / 0: by default three passes split once, one pass not), labelled
"split" and "unsplit".
--split-tf32: attnext's float32 backward (both precisions) again on attn_bwd.cu's split TF32
(ATTNEXT_BWD_F32_X3=0 and ATTNEXT_BWD_TF32_F16=0: in place of Hopper's defaults there, the
bfloat16 planes of attn_bwd_sm90_x3.cu and, for precision="tf32", the scaled float16 copies),
labelled "x3=0".
The backward's peers: SDPA efficient, and math in float32 (cuBLAS SGEMM: on an H200 the fastest
float32 backward at D128) and with TF32.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import attnext
from attnext import _env

ROWS = "8,1024,16,64;4,4096,16,64;4,4096,16,64,causal;2,4096,16,128;1,8192,16,128,causal"


def _rel(x, ref):
    """The largest error relative to ref's largest magnitude (of each of a tuple's, the worst)."""
    if isinstance(ref, tuple):
        return max(_rel(a, b) for a, b in zip(x, ref))
    return float((x.double() - ref).abs().max() / ref.abs().max())


def _report(name, label, fn, ref, flops, tf32=False):
    """fn's result checked against ref, then timed and printed (TF32 allowed in torch with tf32);
    a refusal prints "-", a wrong result WRONG, and neither is timed."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        try:
            err = _rel(fn(), ref)
        except Exception as e:       # a backend that refuses the shape
            print(f"{name:28} {label:16} {'-':>8} {'-':>8} {type(e).__name__}")
            return
        if not err < 2e-2:
            print(f"{name:28} {label:16} WRONG {err:.3g}")
            return
        ms = do_bench(fn, warmup=25, rep=100)
        print(f"{name:28} {label:16} {ms:8.3f} {flops / ms / 1e9:8.1f} {err:9.2e}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=ROWS, help="B,S,H,D[,causal] separated by ';'")
    ap.add_argument("--tiles", default="", help="BLOCK_M,BLOCK_N,WARPS separated by ';'")
    ap.add_argument("--sm90", default=None, help="ATTNEXT_FWD_F32_SM90 for a second set of attnext rows")
    ap.add_argument("--bwd", action="store_true", help="time the backward too")
    ap.add_argument("--bwd-tiles", default="", help="ATTNEXT_TILE_BWD values separated by ';'")
    ap.add_argument("--atomic", action="store_true", help="the backward with atomic dQ too")
    ap.add_argument("--presplit", action="store_true", help="the backward split once and at each use, each")
    ap.add_argument("--split-tf32", action="store_true", help="the float32 backward on split TF32 too")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'row':28} {'impl':16} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
    for spec in args.rows.split(";"):
        parts = spec.split(",")
        B, S, H, D = (int(x) for x in parts[:4])
        causal = len(parts) > 4
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(*(x.double() for x in (qt, kt, vt)), is_causal=causal).transpose(1, 2)
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        out = torch.empty_like(q)

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
            return run

        def ax(precision=None):
            return lambda: attnext.attention(q, k, v, causal=causal, out=out, precision=precision)

        # per label the lab's settings: a forward tile, or the TF32 wgmma forward on or off
        knobs = {f"attnext {t}": {"ATTNEXT_TILE_FWD": t} for t in filter(None, args.tiles.split(";"))}
        if args.sm90 is not None:
            knobs.update({f"attnext{p} sm90={args.sm90}": {"ATTNEXT_FWD_F32_SM90": args.sm90} for p in ("", " tf32")})
        impls = {label: (ax("tf32" if " tf32" in label else None), False) for label in knobs}   # (the call, TF32 in torch)
        impls.update({"attnext": (ax(), False), "attnext tf32": (ax("tf32"), False),
                      "sdpa efficient": (sdpa(SDPBackend.EFFICIENT_ATTENTION), False),
                      "sdpa math": (sdpa(SDPBackend.MATH), False),
                      "sdpa math tf32": (sdpa(SDPBackend.MATH), True)})
        name = f"B{B} S{S} H{H} D{D}{' causal' if causal else ''}"
        for label, (fn, tf32) in impls.items():
            for knob, value in knobs.get(label, {}).items():
                _env.setenv(knob, value)
            try:
                _report(name, label, fn, ref, flops, tf32)
            finally:
                for knob in knobs.get(label, {}):
                    _env.setenv(knob, None)
        if args.bwd:
            _backward(name, q, k, v, causal, flops * 2.5, list(filter(None, args.bwd_tiles.split(";"))), args.atomic,
                      args.presplit, args.split_tf32)
        del q, k, v, ref, out
        torch.cuda.empty_cache()


def _backward(name, q, k, v, causal, flops, tiles=(), atomic=False, presplit=False, split_tf32=False):
    dout = torch.randn_like(q)
    qd, kd, vd = (x.double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref = tuple(g.transpose(1, 2) for g in torch.autograd.grad(
        F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal), (qd, kd, vd), dout.double().transpose(1, 2)))
    impls = {}
    for precision in (None, "tf32"):
        out, lse = attnext.attention(q, k, v, causal=causal, return_lse=True, precision=precision)
        for tile, split in [(t, s) for t in [None, *tiles] for s in (("0", "1") if presplit else (None,))]:
            # (label, deterministic, ATTNEXT_BWD_DQ): the default, deterministic=False's own choice
            # (select.bwd_dq_mode), and with --atomic the atomic dQ forced
            for mode, deterministic, dq in (("", True, None), (" nodet", False, None)) + \
                    ((" atomic", False, "atomic"),) * atomic:
                def run(out=out, lse=lse, precision=precision, tile=tile, deterministic=deterministic, dq=dq,
                        split=split):
                    _env.setenv("ATTNEXT_TILE_BWD", tile)
                    _env.setenv("ATTNEXT_BWD_DQ", dq)
                    _env.setenv("ATTNEXT_BWD_F32_PRESPLIT", split)
                    try:
                        return attnext.attention_backward(dout, q, k, v, out, lse, causal=causal, precision=precision,
                                                          deterministic=deterministic)[:3]
                    finally:
                        _env.setenv("ATTNEXT_TILE_BWD", None)
                        _env.setenv("ATTNEXT_BWD_DQ", None)
                        _env.setenv("ATTNEXT_BWD_F32_PRESPLIT", None)
                label = f"attnext{' tf32' if precision else ''} bwd{mode}{({'0': ' unsplit', '1': ' split'}).get(split, '')}"
                impls[label + (" " + tile if tile else "")] = (run, False)
    for precision in (None, "tf32") if split_tf32 else ():
        out, lse = attnext.attention(q, k, v, causal=causal, return_lse=True, precision=precision)

        def run_split(out=out, lse=lse, precision=precision):
            _env.setenv("ATTNEXT_BWD_F32_X3", "0")
            _env.setenv("ATTNEXT_BWD_TF32_F16", "0")
            try:
                return attnext.attention_backward(dout, q, k, v, out, lse, causal=causal, precision=precision)[:3]
            finally:
                _env.setenv("ATTNEXT_BWD_F32_X3", None)
                _env.setenv("ATTNEXT_BWD_TF32_F16", None)
        impls[f"attnext{' tf32' if precision else ''} bwd x3=0"] = (run_split, False)
    for label, backend, tf32 in (("sdpa efficient bwd", SDPBackend.EFFICIENT_ATTENTION, False),
                                 ("sdpa math bwd", SDPBackend.MATH, False),
                                 ("sdpa math tf32 bwd", SDPBackend.MATH, True)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        torch.backends.cuda.matmul.allow_tf32 = False
        impls[label] = (lambda o=o, qt=qt, kt=kt, vt=vt: tuple(g.transpose(1, 2) for g in torch.autograd.grad(
            o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)), tf32)
    for label, (fn, tf32) in impls.items():
        _report(name, label, fn, ref, flops, tf32)


if __name__ == "__main__":
    main()
