"""Attention over a sequence split across processes (attnext.distributed), checked against one
device's attention on the whole: forward, and the gradients of q, k and v.

    torchrun --nproc-per-node 2 examples/ring_attention.py          # GPUs, NCCL
    torchrun --nproc-per-node 2 examples/ring_attention.py --cpu    # CPU processes, gloo

Prints, on rank 0, the largest differences between the ring's results (gathered whole) and the
single-device ones.
"""
import sys

import torch
import torch.distributed as dist

import attnext.distributed as axd
import attnext.torch as axt

cpu = "--cpu" in sys.argv or not torch.cuda.is_available()
dist.init_process_group("gloo" if cpu else "nccl")
rank = dist.get_rank()
device = torch.device("cpu") if cpu else torch.device("cuda", rank % torch.cuda.device_count())
if not cpu:
    torch.cuda.set_device(device)
dtype = torch.float32 if cpu else torch.bfloat16
S = 64 * dist.get_world_size() if cpu else 8192 * dist.get_world_size()

g = torch.Generator(device=device).manual_seed(0)   # the same whole tensors on every rank
Q, K, V, dO = (torch.randn(1, S, 8, 64, device=device, dtype=dtype, generator=g) for _ in range(4))


def alibi(score, b, h, q_idx, kv_idx):              # sees positions in the whole sequence
    return score - 0.05 * (h + 1) * (q_idx - kv_idx)


q, k, v = (axd.shard(x, causal=True).requires_grad_() for x in (Q, K, V))
out = axd.ring_attention(q, k, v, causal=True, score_mod=alibi)
out.backward(axd.shard(dO, causal=True))
got = [axd.unshard(x, causal=True) for x in (out.detach(), q.grad, k.grad, v.grad)]

Qw, Kw, Vw = (x.clone().requires_grad_() for x in (Q, K, V))
want = axt.attention(Qw, Kw, Vw, causal="top_left", score_mod=alibi)
want.backward(dO)
if rank == 0:
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (want.detach(), Qw.grad, Kw.grad, Vw.grad)):
        print(f"{name}: max |ring - one device| = {(a.float() - b.float()).abs().max().item():.2e}")
dist.barrier()
dist.destroy_process_group()
