"""attnext.distributed: attention over a sequence split across processes (context parallelism),
on torch.distributed: NCCL between GPUs, gloo between CPU processes.

    import attnext.distributed as axd
    q, k, v = (axd.shard(x, causal=True) for x in (Q, K, V))    # this rank's part of (B, S, H, D)
    out = axd.ring_attention(q, k, v, causal=True)               # its part of attention(Q, K, V)
    out.backward(grad)                                           # q.grad, k.grad, v.grad: its parts
    OUT = axd.unshard(out, causal=True)                          # the whole, on every rank

ring_attention: each rank keeps its queries; the K and V blocks travel round the ring (rank r
sends to r + 1 and receives from r - 1, torch.distributed batched isend / irecv: NCCL runs them
on its own stream, beside the attention of the block in hand), and the partial results are
merged by attnext.merge in float32. With causal=True the sequence is split zigzag (rank r of N
holds chunks r and 2N - 1 - r of 2N): every rank then does the same work, and every block is
one plain call (full, causal on the diagonal, or half of it). The backward sends the blocks
round the other way (to r - 1), from the block the forward ended with (kept: one more K / V block
a rank) to the rank's own, and one step behind them the dK and dV accumulators (float32), which
reach their owner under its last call; dQ is accumulated locally in float32, from the whole's out
and lse.

ring_varlen_attention: packed documents (cu_seqlens of the whole), each rank a contiguous part of
the tokens: K and V are gathered whole (all_gather; documents make a ring's blocks uneven), each
rank runs its rows against their documents' keys, and the backward sums dK and dV over the ranks
(reduce_scatter on NCCL, all_reduce on gloo).

CUDA tensors: attnext reads torch tensors on the legacy default stream (docs/gpu.md), so a call
under torch.cuda.stream(s) is refused: the transfers' waits order torch's current stream only.

score_mod, mask_mod and window see global positions: the position of a row or key in the whole
sequence (in its document, for varlen), through captured position tables. A tensor the
score_mod captures that requires grad gets its gradient, as attnext.torch gives it, summed over
the blocks and the ranks (all_reduce). torch is imported by this module alone, when it is
imported (docs/distributed.md).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from . import api, checks
from .merge import lse_shape, merge
from .torch import _arg, _detached, _device, _grad_tensors, _tensor

__all__ = ["shard", "unshard", "ring_attention", "ring_varlen_attention"]

LAYOUTS = {"bshd": 1, "bhsd": 2}      # layout -> the sequence dim of q, k, v


# ---------------------------------------------------------------- the group
class _Group:
    """This process's place in a process group: rank, size, and the global ranks of its ring
    neighbours (torch.distributed's point-to-point operations take global ranks)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group")
        self.size = dist.get_world_size(group)
        whole = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(whole, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(whole, (self.rank - 1) % self.size)

    def exchange(self, tensors, back=False):
        """Starts sending tensors to the next rank and receiving their like from the previous
        one (back: to the previous, from the next); finish() the result to wait for them."""
        if self.size == 1:
            return list(tensors), [], ()
        to, source = (self.prev, self.next) if back else (self.next, self.prev)
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, source, self.group) for t in recv]
        return recv, dist.batch_isend_irecv(ops), tuple(tensors)   # the sent kept until done

    @staticmethod
    def finish(pending):
        recv, reqs, _ = pending
        for r in reqs:
            r.wait()
        return recv

    def all_reduce(self, t):
        """t summed over the group, in place."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)

    def agree(self, device, **fields):
        """ValueError unless every rank passed the same ints (a mismatch would leave a transfer
        waiting for bytes that never come): one small all_gather."""
        if self.size == 1:
            return
        mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        every = torch.stack(every).tolist()
        for i, name in enumerate(fields):
            values = [row[i] for row in every]
            if len(set(values)) > 1:
                raise ValueError(f"the ranks of the group disagree on {name}: "
                                 + ", ".join(f"rank {r}: {x}" for r, x in enumerate(values)))


def _dtype_code(dtype):
    return (torch.float16, torch.bfloat16, torch.float32, torch.float64).index(dtype) \
        if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else -1


def _default_stream(x):
    """RuntimeError unless torch's current stream is x's device's default one (for CUDA x)."""
    if x.is_cuda and torch.cuda.current_stream(x.device) != torch.cuda.default_stream(x.device):
        raise RuntimeError("attnext.distributed runs on torch's default CUDA stream (attnext reads torch "
                           "tensors on the legacy default stream, where the ring's transfers are waited "
                           "for); call it outside torch.cuda.stream(...)")


def _chunks(size, rank, causal):
    """The chunks rank holds: of `size` for a plain split, of 2 * size zigzag."""
    return (rank, 2 * size - 1 - rank) if causal else (rank,)


def _split(name, x, dim, parts):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim = {dim} is outside {name}'s {x.ndim} dims (shape {tuple(x.shape)})")
    n = x.shape[dim]
    if n % parts:
        raise ValueError(f"{name}.shape[{dim}] = {n} must be a multiple of {parts} (the parts of the "
                         f"split across the group)")
    return x.chunk(parts, dim)


def shard(x, *, group=None, dim=1, causal=False):
    """This rank's part of a whole sequence along dim: part r of N equal parts, or with
    causal=True the zigzag split ring_attention(causal=True) takes: chunks r and 2N - 1 - r of
    2N, in that order. x's length along dim must be a multiple of N (2N)."""
    g = _Group(group)
    chunks = _split("x", x, dim, 2 * g.size if causal else g.size)
    return torch.cat([chunks[i] for i in _chunks(g.size, g.rank, causal)], dim)


def unshard(x, *, group=None, dim=1, causal=False):
    """The whole sequence from every rank's part (shard's inverse), on every rank."""
    g = _Group(group)
    _split("x", x, dim, 2 if causal else 1)          # a zigzag part is two equal chunks
    parts = [torch.empty_like(x) for _ in range(g.size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if not causal:
        return torch.cat(parts, dim)
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def _positions(n, size, rank, causal, device):
    """The global positions of rank's n rows (int64: the callbacks' own index type)."""
    if not causal:
        return torch.arange(rank * n, (rank + 1) * n, dtype=torch.int64, device=device)
    c = n // 2
    return torch.cat([torch.arange(i * c, (i + 1) * c, dtype=torch.int64, device=device)
                      for i in _chunks(size, rank, True)])


# ---------------------------------------------------------------- callbacks on global positions
def _window(window):
    return None if window is None else checks.window_pair(window)


def _window_keeps(window):
    left, right = window

    def keeps(d):                  # d = query position - key position
        kept = d == d
        if left >= 0:
            kept = kept & (d <= left)
        if right >= 0:
            kept = kept & (d >= -right)
        return kept
    return keeps


def _global_mods(score_mod, mask_mod, window, _ring_qpos, _ring_kpos, _ring_qoff=None, _ring_b0=None):
    """score_mod / mask_mod of a call on part of the whole, handed the whole's positions:
    _ring_qpos[q_idx], _ring_kpos[kv_idx] (ring_attention), or for varlen's documents
    q_idx + _ring_qoff[b] and document b + _ring_b0[0]; window (None or (left, right)) becomes
    part of the mask. The tables are captured arrays: a call of another block reuses the
    compiled code."""
    if _ring_qoff is not None:
        def at(b, q, kv):
            return b + _ring_b0[0], q + _ring_qoff[b], kv
    else:
        def at(b, q, kv):
            return b, _ring_qpos[q], _ring_kpos[kv]
    mods = {}
    if score_mod is not None:
        def global_score(s, b, h, q, kv):
            gb, gq, gk = at(b, q, kv)
            return score_mod(s, gb, h, gq, gk)
        mods["score_mod"] = global_score
    if mask_mod is not None or window is not None:
        keeps = None if window is None else _window_keeps(window)

        def global_mask(b, h, q, kv):
            gb, gq, gk = at(b, q, kv)
            kept = mask_mod(gb, h, gq, gk) if mask_mod is not None else None
            if keeps is not None:
                kept = keeps(gq - gk) if kept is None else kept & keeps(gq - gk)
            return kept
        mods["mask_mod"] = global_mask
    return mods


def _captured(score_mod):
    """name -> each floating tensor score_mod captures that requires grad, in name order."""
    found = _grad_tensors(score_mod)
    return {n: found[n] for n in sorted(found)}


def _acc(t):
    """The accumulation dtype of a tensor's sums: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _sum_captured(ring, total, grads):
    """total (name -> its sum in _acc's dtype, or None) plus one backward call's dtensors."""
    for n, t in ring.captured.items():
        g = _tensor(grads.dtensors[n]).to(_acc(t))
        total[n] = g if total[n] is None else total[n] + g


def _captured_grads(ring, total):
    """The captured tensors' gradients: each rank's sums added over the group, in their dtypes."""
    out = []
    for n, t in ring.captured.items():
        g = total[n].contiguous()                # every rank's backward ran at least one call
        ring.g.all_reduce(g)
        out.append(g.to(t.dtype))
    return out


# ---------------------------------------------------------------- ring attention
class _Ring:
    """One ring_attention call's fixed parts: the group, the options, the local layout."""

    def __init__(self, q, k, v, group, causal, window, scale, softcap, score_mod, mask_mod, layout):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.ndim != 4:
                raise TypeError(f"{name} must be a 4-d torch.Tensor, got "
                                f"{getattr(x, 'shape', type(x).__name__)}")
        _default_stream(q)
        self.dim = LAYOUTS[layout]
        self.n = q.shape[self.dim]
        if k.shape[self.dim] != self.n or v.shape[self.dim] != self.n:
            raise ValueError(f"q, k and v must hold the same rows of the sequence (layout {layout!r}: "
                             f"dim {self.dim}), got {q.shape[self.dim]}, {k.shape[self.dim]} and "
                             f"{v.shape[self.dim]}")
        if causal is not True and causal is not False:
            raise ValueError(f"causal must be True or False (the whole sequence's causal mask), got {causal!r}")
        if causal and self.n % 2:
            raise ValueError(f"causal=True takes the zigzag split (shard(..., causal=True)): two equal "
                             f"chunks a rank, got {self.n} rows")
        window = _window(window)
        self.g = _Group(group)
        self.g.agree(q.device, rows=self.n, batch=q.shape[0], q_heads=q.shape[3 - self.dim],
                     kv_heads=k.shape[3 - self.dim], head_dim=q.shape[3], v_head_dim=v.shape[3],
                     causal=int(causal), layout=self.dim, dtype=_dtype_code(q.dtype))
        self.causal, self.window, self.layout = causal, window, layout
        self.captured = _captured(score_mod)
        self.score_mod, self.mask_mod = _detached(score_mod), _detached(mask_mod)
        self.opts = dict(scale=scale, softcap=softcap, layout=layout, device=_device(q))
        self.device = q.device

    def blocks(self, j):
        """The calls for the key block of rank j: (query rows, key rows, causal), as (start,
        length) along the sequence dim; none where the causal mask keeps nothing."""
        whole = (0, self.n)
        if not self.causal:
            return [(whole, whole, False)]
        c = self.n // 2                      # zigzag: chunks r, 2N-1-r against j, 2N-1-j
        if j < self.g.rank:
            return [(whole, (0, c), False)]  # both query chunks see all of chunk j, none of the other
        if j == self.g.rank:
            return [(whole, whole, True)]
        return [((c, c), whole, False)]      # only chunk 2N-1-r sees them, all of both

    def rows(self, x, span):
        return x.narrow(self.dim, *span)

    def mods(self, qspan, j, kspan):
        """The callbacks of the call on these rows of block j, on global positions (none
        without score_mod, mask_mod or window: no position tables made)."""
        if self.score_mod is None and self.mask_mod is None and self.window is None:
            return {}
        qpos = _positions(self.n, self.g.size, self.g.rank, self.causal, self.device)
        kpos = _positions(self.n, self.g.size, j, self.causal, self.device)
        return _global_mods(self.score_mod, self.mask_mod, self.window, qpos.narrow(0, *qspan),
                            kpos.narrow(0, *kspan))


def _ring_forward(ring, q, k, v):
    """(out, lse, the K and V block the ring ended with: rank + 1's, the backward's first)."""
    g = ring.g
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=_acc(q), device=q.device)
    lse = torch.empty(lse_shape(q.shape, ring.layout), dtype=_acc(q), device=q.device)
    kv = (k.contiguous(), v.contiguous())
    for step in range(g.size):
        j = (g.rank - step) % g.size
        pending = g.exchange(kv) if step + 1 < g.size else None
        for qspan, kspan, causal in ring.blocks(j):
            o, l = api.attention(_arg(ring.rows(q, qspan)), _arg(ring.rows(kv[0], kspan)),
                                 _arg(ring.rows(kv[1], kspan)), causal=causal, return_lse=True,
                                 **ring.opts, **ring.mods(qspan, j, kspan))
            o_rows, l_rows = ring.rows(out, qspan), lse.narrow(2, *qspan)
            if step:
                o, l = merge([o_rows, _tensor(o).to(out.dtype)], [l_rows, _tensor(l)], layout=ring.layout)
            o_rows.copy_(_tensor(o))          # step 0: the rank's own block, every row
            l_rows.copy_(_tensor(l))
        if pending is not None:
            kv = tuple(g.finish(pending))
    return out.to(q.dtype), lse, kv


def _ring_backward(ring, dout, dlse, q, k, v, out, lse, kv):
    """The ring backward. It visits the blocks the other way round, starting with the one the
    forward ended with (kv: rank + 1's) and ending with this rank's own: K and V, and one step
    behind them the float32 dK / dV accumulators of each block, pass to the previous rank, and a
    block's accumulators end their way at its owner's last step, under its own call: no transfer
    is left after the last step."""
    g = ring.g
    acc = _acc(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = None                                # the (dK, dV) accumulators on their way
    dtensors = {n: None for n in ring.captured}
    for step in range(g.size):
        j = (g.rank + 1 + step) % g.size
        pending = g.exchange(kv, back=True) if step + 1 < g.size else None
        dk = torch.zeros(kv[0].shape, dtype=acc, device=q.device)
        dv = torch.zeros(kv[1].shape, dtype=acc, device=q.device)
        for qspan, kspan, causal in ring.blocks(j):
            grads = api.attention_backward(
                _arg(ring.rows(dout, qspan)), _arg(ring.rows(q, qspan)), _arg(ring.rows(kv[0], kspan)),
                _arg(ring.rows(kv[1], kspan)), _arg(ring.rows(out, qspan)), _arg(lse.narrow(2, *qspan)),
                causal=causal, dtensors=list(ring.captured) or False,
                dlse=None if dlse is None else _arg(dlse.narrow(2, *qspan)), **ring.opts,
                **ring.mods(qspan, j, kspan))
            _sum_captured(ring, dtensors, grads)
            ring.rows(dq, qspan).add_(_tensor(grads.dq))
            ring.rows(dk, kspan).add_(_tensor(grads.dk))
            ring.rows(dv, kspan).add_(_tensor(grads.dv))
        if dkv is not None:                   # what the next rank gathered for block j
            before = g.finish(dkv)
            dk += before[0]
            dv += before[1]
        if pending is not None:               # on to the rank that visits block j next
            dkv = g.exchange((dk, dv), back=True)
            kv = tuple(g.finish(pending))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), _captured_grads(ring, dtensors)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, *captured):
        out, lse, (k_last, v_last) = _ring_forward(ring, q.detach(), k.detach(), v.detach())
        ctx.save_for_backward(q, k, v, out, lse, k_last, v_last)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, k_last, v_last = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dcaptured = _ring_backward(ctx.ring, dout, dlse, q, k, v, out, lse, (k_last, v_last))
        return (dq, dk, dv, None, *dcaptured)


def ring_attention(q, k, v, *, group=None, causal=False, window=None, scale=None, softcap=None,
                   score_mod=None, mask_mod=None, return_lse=False, layout="bshd"):
    """This rank's part of attention over the whole sequence, from this rank's parts of q, k and
    v as shard() gives them (with causal=True: shard(..., causal=True), the zigzag split).

    q (B, n, Hq, D), k (B, n, Hk, D), v (B, n, Hk, Dv) for layout "bshd" ((B, H, n, D) for
    "bhsd"), n the same on every rank, torch tensors on one device (CUDA: NCCL; CPU: gloo).
    causal: the whole sequence's causal mask (top-left: a row keeps the keys at or before its
    position). window (left, right), score_mod, mask_mod: as attnext.attention's, in global
    positions. Returns out in q's layout and dtype, and with return_lse lse (B, Hq, n) float32
    (float64 for float64 q): this rank's rows. Differentiable in q, k and v (and through lse).
    """
    ring = _Ring(q, k, v, group, causal, window, scale, softcap, score_mod, mask_mod, layout)
    out, lse = _RingAttention.apply(q, k, v, ring, *ring.captured.values())
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- packed documents (all-gather)
class _Docs:
    """The documents of rank's contiguous rows [lo, hi) of the whole packed batch: the first
    and last that meet them, each one's local query segment and its keys in the gathered K."""

    def __init__(self, cu, lo, hi, causal):
        docs = [d for d in range(len(cu) - 1) if cu[d] < hi and cu[d + 1] > lo]
        self.first = docs[0] if docs else 0
        self.key_lo = cu[self.first] if docs else lo          # the gathered K's rows used
        self.key_hi = cu[docs[-1] + 1] if docs else lo
        cu_q, cu_k, used_k, qoff = [0], [0], [], []
        for d in docs:
            a, b = max(cu[d], lo), min(cu[d + 1], hi)
            cu_q.append(cu_q[-1] + b - a)
            cu_k.append(cu[d + 1] - self.key_lo)
            used_k.append((b if causal else cu[d + 1]) - cu[d])
            qoff.append(a - cu[d])                           # the segment's first row in its document
        self.cu_q, self.cu_k, self.used_k, self.qoff = cu_q, cu_k, used_k, qoff
        self.max_q = max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)
        # the longest key segment (not the longest used part): a bound on every segment of
        # cu_seqlens_k, as device lengths require
        self.max_k = max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0)


class _VarlenRing:
    def __init__(self, q, k, v, cu_seqlens, max_seqlen, group, causal, window, scale, softcap,
                 score_mod, mask_mod):
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.ndim != 3:
                raise TypeError(f"{name} must be a 3-d torch.Tensor (T, H, D), got "
                                f"{getattr(x, 'shape', type(x).__name__)}")
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            raise ValueError(f"q, k and v must hold the same rows of the packed batch, got {q.shape[0]}, "
                             f"{k.shape[0]} and {v.shape[0]}")
        _default_stream(q)
        self.g = _Group(group)
        n = q.shape[0]
        cu = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
        self.g.agree(q.device, rows=n, q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[2],
                     v_head_dim=v.shape[2], causal=int(bool(causal)), documents=len(cu) - 1,
                     cu_seqlens_checksum=sum((i + 1) * c for i, c in enumerate(cu)) % (1 << 61))
        if not cu or cu[0] != 0 or cu[-1] != n * self.g.size or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to the whole batch's {n * self.g.size} rows "
                             f"({self.g.size} ranks of {n}), got {cu}")
        longest = max(b - a for a, b in zip(cu, cu[1:])) if len(cu) > 1 else 0
        if not isinstance(max_seqlen, (int, np.integer)) or isinstance(max_seqlen, bool):
            raise TypeError(f"max_seqlen must be an int (the longest document), got {max_seqlen!r}")
        if max_seqlen < longest:
            raise ValueError(f"max_seqlen = {max_seqlen} is shorter than the longest document "
                             f"({longest} rows in cu_seqlens)")
        window = _window(window)
        self.n, self.causal = n, causal
        self.captured = _captured(score_mod)
        score_mod, mask_mod = _detached(score_mod), _detached(mask_mod)
        self.docs = _Docs(cu, self.g.rank * n, (self.g.rank + 1) * n, causal)
        self.opts = dict(scale=scale, softcap=softcap, device=_device(q))
        # bottom-right causal with the keys cut at the segment's last row is the whole's causal
        # mask, and its window too; without causal, a window is a mask on document positions
        native_window = window if causal else None
        mask_window = None if causal else window
        if native_window is not None:
            self.opts["window"] = native_window
        self.mods = {}
        dev = q.device
        if score_mod is not None or mask_mod is not None or mask_window is not None:
            self.mods = _global_mods(score_mod, mask_mod, mask_window, None, None,
                                     torch.tensor(self.docs.qoff or [0], dtype=torch.int64, device=dev),
                                     torch.tensor([self.docs.first], dtype=torch.int64, device=dev))
        d = self.docs
        self.lengths = dict(cu_seqlens_q=torch.tensor(d.cu_q, dtype=torch.int32, device=dev),
                            cu_seqlens_k=torch.tensor(d.cu_k, dtype=torch.int32, device=dev),
                            seqused_k=torch.tensor(d.used_k, dtype=torch.int32, device=dev),
                            max_seqlen_q=d.max_q, max_seqlen_k=d.max_k)

    def gather(self, x):
        """The rows of the whole x this rank's documents use (a copy: the whole is not kept)."""
        parts = [torch.empty_like(x) for _ in range(self.g.size)]
        dist.all_gather(parts, x.contiguous(), group=self.g.group)
        return torch.cat(parts, 0)[self.docs.key_lo:self.docs.key_hi].clone()

    def reduce(self, dx, dtype):
        """Each rank's rows of the sum over ranks of dx (rows key_lo.. of the whole)."""
        whole = torch.zeros((self.n * self.g.size,) + tuple(dx.shape[1:]), dtype=dx.dtype, device=dx.device)
        whole.narrow(0, self.docs.key_lo, dx.shape[0]).copy_(dx)
        if dist.get_backend(self.g.group) == "nccl":
            mine = torch.empty((self.n,) + tuple(dx.shape[1:]), dtype=dx.dtype, device=dx.device)
            dist.reduce_scatter_tensor(mine, whole, group=self.g.group)
        else:                                # gloo: older torch releases have no reduce_scatter there
            dist.all_reduce(whole, group=self.g.group)
            mine = whole.narrow(0, self.g.rank * self.n, self.n)
        return mine.to(dtype)

    def call(self, q, k, v):
        return api.varlen_attention(_arg(q), _arg(k), _arg(v), causal=self.causal and "bottom_right",
                                    return_lse=True, **self.lengths, **self.opts, **self.mods)


class _VarlenRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, *captured):
        kw, vw = ring.gather(k.detach()), ring.gather(v.detach())
        o, l = ring.call(q.detach(), kw, vw)
        out, lse = _tensor(o), _tensor(l)
        ctx.save_for_backward(q, kw, vw, out, lse)
        ctx.ring, ctx.dtypes = ring, (k.dtype, v.dtype)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kw, vw, out, lse = ctx.saved_tensors
        ring = ctx.ring
        if dout is None:
            dout = torch.zeros_like(out)
        grads = api.varlen_attention_backward(
            _arg(dout), _arg(q), _arg(kw), _arg(vw), _arg(out), _arg(lse),
            causal=ring.causal and "bottom_right", dtensors=list(ring.captured) or False,
            dlse=None if dlse is None else _arg(dlse), **ring.lengths, **ring.opts, **ring.mods)
        dtensors = {n: None for n in ring.captured}
        _sum_captured(ring, dtensors, grads)
        dk = ring.reduce(_tensor(grads.dk).to(_acc(q)), ctx.dtypes[0])
        dv = ring.reduce(_tensor(grads.dv).to(_acc(q)), ctx.dtypes[1])
        return (_tensor(grads.dq), dk, dv, None, *_captured_grads(ring, dtensors))


def ring_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, group=None, causal=False, window=None,
                          scale=None, softcap=None, score_mod=None, mask_mod=None, return_lse=False):
    """This rank's rows of attnext.varlen_attention over a packed batch of documents split across
    the group: q (n, Hq, D), k (n, Hk, D), v (n, Hk, Dv) this rank's contiguous part
    (shard(x, dim=0)), n the same on every rank; cu_seqlens (int, the same on every rank) the
    whole batch's cumulative lengths, max_seqlen its longest document. K and V are gathered
    whole. causal (top-left in each document, as varlen_attention's with equal q and k
    lengths), window, score_mod and mask_mod see positions in the whole document and its index
    in the whole batch. Returns out (n, Hq, Dv), and with return_lse lse (Hq, n); differentiable
    in q, k and v."""
    if causal is not True and causal is not False:
        raise ValueError(f"causal must be True or False, got {causal!r}")
    ring = _VarlenRing(q, k, v, cu_seqlens, max_seqlen, group, causal, window, scale, softcap,
                       score_mod, mask_mod)
    out, lse = _VarlenRingAttention.apply(q, k, v, ring, *ring.captured.values())
    return (out, lse) if return_lse else out
