"""attnext in a PyTorch training step: a relative-position score_mod whose table learns, gradients
through attnext.torch.attention (eager, then torch.compile(fullgraph=True)), on the CPU or a GPU.

Prints the loss of a few steps and the largest difference between eager and compiled gradients.
"""
import torch

import attnext.torch as axt

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
B, S, H, D = 2, 128, 4, 32
q, k, v = (torch.randn(B, S, H, D, device=device, requires_grad=True) for _ in range(3))
table = torch.zeros(H, 2 * S, device=device, requires_grad=True)      # learned relative bias


def rel_bias(score, b, h, q_idx, kv_idx):           # FlexAttention-style: a new score per pair
    return score + table[h, q_idx - kv_idx + S]


def loss_fn(q, k, v):
    out = axt.attention(q, k, v, causal=True, score_mod=rel_bias)
    return out.square().sum() / B


opt = torch.optim.SGD([q, k, v, table], lr=0.02)
for step in range(3):
    opt.zero_grad()
    loss = loss_fn(q, k, v)
    loss.backward()                                  # q, k, v and table get .grad
    opt.step()
    print(f"step {step}: loss {loss.item():.5f}")

grads = []
for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
    opt.zero_grad()
    fn(q, k, v).backward()
    grads.append([x.grad.clone() for x in (q, k, v, table)])
print("max |eager - compiled| gradient:", max((a - b).abs().max().item() for a, b in zip(*grads)))
