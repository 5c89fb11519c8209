"""attnext.distributed's ring with its ranks as threads of one process: a stand-in for the group
hands each rank's sends to its neighbour's queue (in order, as NCCL and gloo pair them), so every
step of the ring runs on one device: the calls on row ranges of the blocks, the merges, the dK /
dV hand-off. On the CPU it runs in CI beside the gloo tests; under -m gpu with CUDA tensors it is
the multi-rank CUDA run one GPU allows (NCCL refuses two ranks on one GPU)."""
import queue
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import attnext.distributed as axd  # noqa: E402
from attnext import reference  # noqa: E402
from attnext.testing import assert_close, assert_grads_close, to_numpy  # noqa: E402
from helpers import mods as named_mods  # noqa: E402
from test_distributed import _part  # noqa: E402  (the parts as the API's docstring defines them)


class _Member:
    """Rank `rank` of a ring of threads: what attnext.distributed reads of its _Group (shared:
    a queue for each (receiver, sender) pair, in order as NCCL and gloo pair a peer's messages,
    a barrier and a board for all_reduce)."""

    def __init__(self, shared, rank):
        self.boxes, self.barrier, self.board = shared
        self.rank, self.size, self.group = rank, len(self.board), None
        self.next, self.prev = (rank + 1) % self.size, (rank - 1) % self.size

    def all_reduce(self, t):
        self.board[self.rank] = t.clone()
        self.barrier.wait()
        t.copy_(sum(self.board))
        self.barrier.wait()

    def exchange(self, tensors, back=False):
        to, source = (self.prev, self.next) if back else (self.next, self.prev)
        self.boxes[to, self.rank].put([t.clone() for t in tensors])
        return source, [], tuple(tensors)

    def finish(self, pending):
        return self.boxes[self.rank, pending[0]].get(timeout=120)

    def agree(self, device, **fields):
        pass


def _unpart(parts, world, dim, causal):
    """The whole x from its ranks' parts along dim: _part's inverse."""
    if not causal:
        return torch.cat(parts, dim)
    halves = [x.tensor_split(2, dim) for x in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("world, causal, mods", [(3, True, False), (4, True, True), (3, False, True)])
def test_ring_of_threads_matches_the_whole(monkeypatch, device, world, causal, mods):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    monkeypatch.setattr(axd, "_Group", lambda group: group)
    seed = int(np.random.default_rng().integers(1 << 31))
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    B, S, Hq, Hk, D = 2, 16 * world if device == "cpu" else 512 * world, 4, 2, 32

    def randn(*shape):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    Q, K, V, dO = randn(B, S, Hq, D), randn(B, S, Hk, D), randn(B, S, Hk, D), randn(B, S, Hq, D)
    slopes = torch.linspace(0.05, 0.4, Hq, device=device, requires_grad=True)
    opts = {}
    if mods:
        opts = dict(score_mod=named_mods.alibi(slopes), mask_mod=lambda b, h, q, kv: (q - kv) % 5 != 2, window=(3 * S // 4, -1))
    boxes = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
    shared = (boxes, threading.Barrier(world, timeout=120), [None] * world)
    got, errors = [None] * world, []

    def rank(r):
        try:
            q, k, v = (_part(x, r, world, 1, causal).requires_grad_() for x in (Q, K, V))
            out = axd.ring_attention(q, k, v, group=_Member(shared, r), causal=causal, **opts)
            dout = _part(dO, r, world, 1, causal)
            if device == "cpu":
                grads = torch.autograd.grad(out, [q, k, v] + ([slopes] if mods else []), dout)
            else:   # torch's engine runs every thread's CUDA backward nodes on one thread: the
                #     ranks would wait for each other there, so each calls its node itself
                dq, dk, dv, _, *dcaptured = out.grad_fn.apply(dout, None)
                grads = (dq, dk, dv, *dcaptured[:int(mods)])
            got[r] = (out.detach(), *grads)
        except Exception as e:              # reported below, with the rank
            errors.append((r, e))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, f"seed {seed}: " + "; ".join(f"rank {r}: {e!r}" for r, e in errors)
    # The ring's whole out and gradients (its parts put back together) against the float64 truth
    # by the rules of the fuzzer and the CPU tests (attnext.testing): two bfloat16 calls, the ring
    # and one attnext call on the whole, may part by more than the rule for one against the truth
    # allows, and d slopes sums dS |q - kv| over every pair, terms much larger than the result,
    # from out rounded to q's dtype (assert_grads_close allows for both).
    if mods:                                 # every rank holds the whole's d slopes, the same
        for r in range(1, world):
            assert torch.equal(got[r][4], got[0][4]), f"seed {seed}: rank {r}'s d slopes is not rank 0's"
    whole = [_unpart([got[r][i] for r in range(world)], world, 1, causal) for i in range(4)]
    ropts = dict(causal=causal and "top_left")
    if mods:
        ropts.update(opts, score_mod=named_mods.alibi(slopes.detach().cpu().numpy()))
    qn, kn, vn, dn = (to_numpy(x) for x in (Q, K, V, dO))
    ref_out, ref_lse = reference.attention(qn, kn, vn, return_lse=True, **ropts)
    expected = reference.attention_backward(dn, qn, kn, vn, ref_out, ref_lse, **ropts)
    try:
        assert_close(whole[0], ref_out, dtype=qn.dtype, name="out")
        assert_grads_close((*whole[1:], None, {"slopes": got[0][4]} if mods else {}), expected,
                           q=qn, k=kn, v=vn, dout=dn, out=whole[0], **ropts)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}, world {world}: the ring against the reference: {e}") from None
