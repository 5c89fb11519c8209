"""Kernel lab: where the short backward rows' time goes, kernel by kernel, beside the peers.

    python bench/labs/lab_bwd_parts.py [--write] [D:S[:causal] ...]

For each case (default: the [2/4] rows the v5 bench missed, and D128 S2k for scale): the whole
backward by triton.testing.do_bench (medians, L2 flushed) for attnext (deterministic and not),
SDPA's flash and cuDNN backends, then torch.profiler's kernel times over 20 back-to-back calls of
each, so the pre / main / convert kernels can be compared one by one. bf16, B*S = 16k tokens,
H = 2048 / D, TFLOP/s counting 2.5x the forward. --write adds the deterministic backward with
ATTNEXT_BWD_DQ_WRITE=0 and =1 (attn_bwd_dq_convert against the last turns writing dq), to place
select.SHORT_KEYS. Every attnext variant (and cuDNN) is checked against flash's dq, dk, dv before
anything is timed; one that is off is dropped.
"""
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository's attnext
import attnext  # noqa: E402
from attnext import _env  # noqa: E402
import verify  # noqa: E402

DEFAULT = ["64:512", "64:1024", "64:512:causal", "64:1024:causal", "128:512:causal", "128:512", "128:2048"]


def kernel_table(f, n=20):
    """(name, us per call) of every kernel f launches, over n back-to-back calls."""
    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            f()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / n) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def with_env(name, value, f):
    """f called with the setting name = value (attnext._env; the plan cache keys on it)."""
    def call():
        old = _env.get(name)
        _env.setenv(name, value)
        try:
            return f()
        finally:
            _env.setenv(name, old)
    return call


def main(cases, write=False):
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    for case in cases:
        parts = case.split(":")
        D, S, causal = int(parts[0]), int(parts[1]), len(parts) > 2
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        qd, kd, vd = (x.detach() for x in (q, k, v))
        out, lse = attnext.attention(qd, kd, vd, causal=causal, return_lse=True)
        dout = torch.randn_like(out)
        calls = {
            "attnext": lambda: attnext.attention_backward(dout, qd, kd, vd, out, lse, causal=causal),
            "attnext_nd": lambda: attnext.attention_backward(dout, qd, kd, vd, out, lse, causal=causal,
                                                             deterministic=False),
        }
        if write:
            for value in ("0", "1"):
                calls[f"write{value}"] = with_env("ATTNEXT_BWD_DQ_WRITE", value, calls["attnext"])
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
            calls[name] = (lambda o=o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
        ref = calls["flash"]()
        print(f"\nD{D} S{S} B{B} H{H} {'causal' if causal else 'full'}")
        for name in [n for n in calls if n != "flash"]:      # each checked against flash first
            try:
                got = calls[name]()
                err = verify.check(f"  {name}", {n: (g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)})
                print(f"  {name} against flash: {err:.2g}", end="")
            except verify.WrongResult as e:
                print(f"\n{e}")
                del calls[name]
        print(flush=True)
        times = {name: triton.testing.do_bench(f, return_mode="median") for name, f in calls.items()}
        print("  " + "  ".join(f"{n} {t * 1e3:7.1f} us {flops / t / 1e9:5.0f} TF/s ({times['flash'] / t:.2f}x flash)"
                               for n, t in times.items()), flush=True)
        for name, f in calls.items():
            rows = kernel_table(f)
            print(f"  {name:10s} sum {sum(t for _, t in rows):7.1f} us: "
                  + " | ".join(f"{k[:48]} {t:.1f}" for k, t in rows[:5]), flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--write"]
    main(args or DEFAULT, write="--write" in sys.argv[1:])
