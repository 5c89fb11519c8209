"""attnext.distributed: context-parallel (ring) attention over a torch.distributed group, checked
in 2 and 3 processes on the gloo backend against the single-process call on the whole sequence.

Each world size is one spawned run (starting a process that imports torch costs seconds): every
rank builds the same whole q, k, v from the run's seed, takes its part with shard(), runs
ring_attention / ring_varlen_attention forward and backward, and holds out, lse and the
gradients of q, k, v to its part (as the API's docstring defines the parts, written out here in
_part) of the float64 truth: attnext.torch's call on the whole tensors, the inputs converted to
float64 exactly (the three-way rule, attnext.testing.assert_close). A rank records each case's
failure (its traceback) in a file; each case is its own test here, which reports every rank's
or, for a run that died or outlived RUN_SECONDS (then killed), the case each rank was in. The
bad-input checks run in this process, in a gloo group of one.
"""
import datetime
import json
import os
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is unavailable in this torch build", allow_module_level=True)

import attnext.testing  # noqa: E402
import attnext.torch as axt  # noqa: E402
from conftest import poisoned, seed_of  # noqa: E402
from helpers import mods  # noqa: E402

WORLDS = [2, 3]
B, HQ, HK, D = 2, 4, 2, 16
S_PER_RANK = 12                 # the whole sequence is S_PER_RANK * world: 2 * world zigzag chunks of 6
# A healthy run takes a few seconds; a rank stuck in a collective gives up after GLOO_SECONDS
# (its case then fails) and the parent kills a run still going after RUN_SECONDS.
GLOO_SECONDS = 20
RUN_SECONDS = 180

# ring_attention cases: options of the call, plus dtype, dv (v's head dim, else D), which
# score_mod / mask_mod (by name: _mods draws their captured arrays), lse: False (out only), True
# (out, lse; lse unused by the loss), "grad" (the loss reads lse too) or "only" (the loss reads
# lse alone: out gets no gradient), dead: rows that keep no key, and group "tail": the ranks 1..
# of the world only (group ranks are not global ranks; rank 0 sits the case out).
RING_CASES = {
    "plain": dict(lse=False),
    "subgroup_causal": dict(causal=True, group="tail"),
    "causal": dict(causal=True),
    "causal_bhsd": dict(causal=True, layout="bhsd"),
    "causal_f64": dict(causal=True, dtype=torch.float64),
    "window_causal": dict(causal=True, window=(5, 0)),
    "window_two_sided_dv8": dict(window=(4, 3), dv=8),
    "alibi_causal": dict(causal=True, score_mod="alibi"),
    "alibi_tensor_requiring_grad": dict(causal=True, score_mod="alibi_tensor"),
    "rel_pos_scale": dict(score_mod="rel_pos", scale=0.3),
    "mask_mod_dead_row": dict(causal=True, mask_mod="stride", dead=True),
    "documents_alibi": dict(mask_mod="documents", score_mod="alibi"),
    "int64_positions": dict(mask_mod="big_products", dead=True),
    "softcap_causal": dict(causal=True, softcap=1.5),
    "lse_grad_causal": dict(causal=True, lse="grad"),
    "lse_only_documents": dict(mask_mod="documents", lse="only"),
}

# ring_varlen_attention cases (the keys as RING_CASES', and empty: documents of no rows, the first
# and one inside a rank's part); the documents cross the ranks' boundaries (_cu_seqlens)
VARLEN_CASES = {
    "varlen": dict(),
    "varlen_causal_lse_grad": dict(causal=True, lse="grad"),
    "varlen_window_key_bias": dict(window=(5, 2), score_mod="key_bias"),
    "varlen_causal_window_dead_rows": dict(causal=True, window=(4, 0), mask_mod="stride", dead=True),
    "varlen_empty_docs_doc_scale": dict(empty=True, score_mod="doc_scale"),
    "varlen_subgroup_causal": dict(causal=True, group="tail"),
    "varlen_softcap_scale": dict(softcap=2.0, scale=0.3),
}

SHARD_CASES = ("shard_matches_the_parts", "shard_refuses_indivisible_lengths", "ranks_that_disagree")


# --- what the API's docstring says, written out ----------------------------------------------------

def _part(x, rank, world, dim, causal):
    """Rank `rank`'s part of the whole x along dim: the world equal parts (causal=False), or the
    zigzag: chunks rank and 2 * world - 1 - rank of 2 * world equal ones, in that order."""
    if not causal:
        return x.tensor_split(world, dim)[rank]
    chunks = x.tensor_split(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def _mods(rng, s, score_mod, mask_mod, docs=1):
    """(score_mod, mask_mod) by name, their captured arrays freshly drawn; s is the whole length
    (what q_idx and kv_idx range over), docs how many values b takes. The arrays are NumPy's but
    alibi_tensor's: a torch tensor that requires grad (ring_attention gives it its gradient)."""
    slopes = rng.uniform(0.1, 1.0, HQ)
    slopes_tensor = torch.tensor(slopes, dtype=torch.float32, requires_grad=True)
    doc_scale = rng.uniform(0.5, 1.5, (docs, HQ))
    table = rng.standard_normal((HQ, 2 * s - 1))
    key_table = rng.standard_normal((HQ, s))

    def rel_pos(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + s - 1]

    def key_bias(score, b, h, q_idx, kv_idx):       # absolute positions (alibi's are relative)
        return score + key_table[h, kv_idx]

    def doc_scale_mod(score, b, h, q_idx, kv_idx):  # a factor: a row's constant would leave out be
        return score * doc_scale[b, h]

    cuts = np.sort(rng.choice(np.arange(1, s), 3, replace=False))
    doc = np.repeat(np.arange(4), np.diff(np.concatenate([[0], cuts, [s]])))
    score_mods = {None: None, "alibi": mods.alibi(slopes), "alibi_tensor": mods.alibi(slopes_tensor),
                  "rel_pos": rel_pos, "key_bias": key_bias, "doc_scale": doc_scale_mod}
    mask_mods = {None: None,
                 # row 0 keeps no key under causal: out 0, lse -inf, zero gradients
                 "stride": lambda b, h, q_idx, kv_idx: (kv_idx > 0) & ((q_idx - kv_idx) % 3 != 1),
                 "documents": lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx],
                 # products past int32: the positions must stay int64 like the call's indices
                 "big_products": lambda b, h, q_idx, kv_idx: q_idx * 100_000_000 >= kv_idx * 100_000_000 + 300_000_000}
    return score_mods[score_mod], mask_mods[mask_mod], slopes_tensor


def _cu_seqlens(rng, t, world, empty=False):
    """cu_seqlens of 4 documents of random lengths packed into t rows by `world` ranks, no
    boundary at a rank's (each rank boundary falls inside a document); empty: 2 more documents
    of no rows, the first and the fourth (inside a rank's part)."""
    per_rank = t // world
    cuts = np.sort(rng.choice([c for c in range(1, t) if c % per_rank], 3, replace=False))
    if empty:
        cuts = np.concatenate([[0], cuts[:2], cuts[1:]])
    return torch.tensor(np.concatenate([[0], cuts, [t]]), dtype=torch.int32)


def _randn(rng, shape, dtype):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


# --- the checks each rank runs ---------------------------------------------------------------------

def _check(who, what, got, want, dtype, floor=0.0):
    """got (the result of who, a rank) against want (its part of the float64 truth): shape,
    dtype, the three-way rule."""
    name = f"{who}: {what}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}"
    attnext.testing.assert_close(got.detach(), want.detach(), dtype=np.float64 if dtype == torch.float64
                                 else np.float32, name=name, floor=floor)


def _check_grads(who, local, whole_grads, part, dtype):
    """q.grad, k.grad, v.grad of a rank against its parts of the whole problem's gradients,
    relative to the largest of them (the three-way rule's floor for gradients)."""
    floor = max(float(g.abs().max()) for g in whole_grads)
    for name, x, g in zip(("dq", "dk", "dv"), local, whole_grads):
        assert x.grad is not None, f"{who}: {name} is None (no gradient reached it)"
        _check(who, name, x.grad, part(g), dtype, floor)


def _members(rank, world, spec):
    """(group, this rank's place in it, its size) for a case: the default group, or with group
    "tail" a new one of ranks 1.. (every rank takes part in making it); None where this rank
    sits the case out."""
    if spec.pop("group", None) != "tail":
        return None, rank, world
    tail = list(range(1, world))
    group = dist.new_group(tail)
    return (group, tail.index(rank), len(tail)) if rank in tail else None


def _loss(out, lse, g, gl, mode):
    """What both sides differentiate: out . g, plus lse . gl (mode "grad"), or lse . gl alone
    ("only")."""
    if mode == "only":
        return (lse * gl).sum()
    loss = (out * g).sum()
    return loss + (lse * gl).sum() if mode == "grad" else loss


def _check_dead_rows(who, out, dq, dead):
    """Rows that keep no key (dead: a mask over out's leading dims) have out and dq exactly 0."""
    assert (out.detach()[dead] == 0).all(), f"{who}: out of a row that keeps no key is not 0"
    assert (dq[dead] == 0).all(), f"{who}: dq of a row that keeps no key is not 0"


def _run_ring_case(rank, world, rng, case):
    """One ring_attention case on this rank."""
    from attnext import distributed as axd
    spec = dict(RING_CASES[case])
    place = _members(rank, world, spec)
    if place is None:
        return
    group, me, members = place
    who = f"rank {rank}/{world}" + ("" if group is None else f" (rank {me} of the group of ranks 1..)")
    dtype = spec.pop("dtype", torch.float32)
    dv = spec.pop("dv", D)
    lse_mode = spec.pop("lse", True)
    dead_rows = spec.pop("dead", False)
    s = S_PER_RANK * members
    score_name = spec.pop("score_mod", None)
    score_mod, mask_mod, captured = _mods(rng, s, score_name, spec.pop("mask_mod", None))
    learned = score_name == "alibi_tensor"          # its slopes get a gradient
    opts = dict(spec, score_mod=score_mod, mask_mod=mask_mod)
    layout = opts.get("layout", "bshd")
    causal = opts.get("causal", False)
    dim = 1 if layout == "bshd" else 2

    def shape(h, d=D):
        return (B, s, h, d) if layout == "bshd" else (B, h, s, d)

    q, k, v, g = (_randn(rng, shape(h, d), dtype) for h, d in ((HQ, D), (HK, D), (HK, dv), (HQ, dv)))
    gl = _randn(rng, (B, HQ, s), dtype)

    whole = [x.double().requires_grad_() for x in (q, k, v)]
    w_out, w_lse = axt.attention(*whole, return_lse=True, **opts)
    assert bool(w_lse.isneginf().any()) == dead_rows, \
        f"{case}: the whole problem {'lacks' if dead_rows else 'has'} rows that keep no key (a test bug)"
    w_grads = torch.autograd.grad(_loss(w_out, w_lse, g.double(), gl.double(), lse_mode),
                                  whole + [captured] * learned)

    def part(x, along=dim):
        return _part(x, me, members, along, causal)

    # every collective first, every check after: a rank whose check fails leaves no other waiting
    local = [axd.shard(x, group=group, dim=dim, causal=causal).detach().requires_grad_() for x in (q, k, v)]
    res = axd.ring_attention(*local, group=group, return_lse=bool(lse_mode), **opts)
    out, lse = res if lse_mode else (res, None)
    whole_out = axd.unshard(out.detach(), group=group, dim=dim, causal=causal)
    whole_lse = None if lse is None else axd.unshard(lse.detach(), group=group, dim=2, causal=causal)
    _loss(out, lse, part(g), None if lse is None else part(gl, 2), lse_mode).backward()

    _check(who, "out", out, part(w_out), dtype)
    _check(who, "unshard(out)", whole_out, w_out, dtype)
    if lse is not None:
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32   # attnext's lse
        _check(who, "lse", lse, part(w_lse, 2), lse_dtype)
        _check(who, "unshard(lse)", whole_lse, w_lse, lse_dtype)
    _check_grads(who, local, w_grads[:3], part, dtype)
    dead = part(w_lse.isneginf(), 2)               # (B, Hq, S_local)
    _check_dead_rows(who, out, local[0].grad, dead if layout == "bhsd" else dead.transpose(1, 2))
    if learned:                                    # every rank: the sum over the whole's rows
        _check(who, "the captured slopes' gradient", captured.grad, w_grads[3], torch.float32)
    else:
        assert captured.grad is None, f"{who}: a tensor no score_mod of this case reads got a gradient"


def _run_varlen_case(rank, world, rng, case):
    """One ring_varlen_attention case on this rank: contiguous parts of a packed batch."""
    from attnext import distributed as axd
    spec = dict(VARLEN_CASES[case])
    place = _members(rank, world, spec)
    if place is None:
        return
    group, me, members = place
    lse_mode = spec.pop("lse", True)
    dead_rows = spec.pop("dead", False)
    t = S_PER_RANK * members
    cu = _cu_seqlens(rng, t, members, spec.pop("empty", False))
    who = (f"rank {rank}/{world}" + ("" if group is None else f" (rank {me} of the group of ranks 1..)")
           + f", cu_seqlens {cu.tolist()}")
    max_seqlen = int(cu.diff().max())
    score_mod, mask_mod, _ = _mods(rng, t, spec.pop("score_mod", None), spec.pop("mask_mod", None),
                                   docs=len(cu) - 1)
    opts = dict(spec, score_mod=score_mod, mask_mod=mask_mod)
    q, k, v, g = (_randn(rng, (t, h, D), torch.float32) for h in (HQ, HK, HK, HQ))
    gl = _randn(rng, (HQ, t), torch.float32)

    whole = [x.double().requires_grad_() for x in (q, k, v)]
    w_out, w_lse = axt.varlen_attention(*whole, cu, cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                        return_lse=True, **opts)
    assert bool(w_lse.isneginf().any()) == dead_rows, \
        f"{case}: the whole problem {'lacks' if dead_rows else 'has'} rows that keep no key (a test bug)"
    w_grads = torch.autograd.grad(_loss(w_out, w_lse, g.double(), gl.double(), lse_mode), whole)

    def part(x, along=0):
        return _part(x, me, members, along, False)

    local = [axd.shard(x, group=group, dim=0).detach().requires_grad_() for x in (q, k, v)]
    out, lse = axd.ring_varlen_attention(*local, cu, max_seqlen, group=group, return_lse=True, **opts)
    whole_out = axd.unshard(out.detach(), group=group, dim=0)
    _loss(out, lse, part(g), part(gl, 1), lse_mode).backward()

    _check(who, "out", out, part(w_out), torch.float32)
    _check(who, "lse", lse, part(w_lse, 1), torch.float32)
    _check(who, "unshard(out)", whole_out, w_out, torch.float32)
    _check_grads(who, local, w_grads, part, torch.float32)
    _check_dead_rows(who, out, local[0].grad, part(w_lse.isneginf(), 1).T)


def _run_shard_case(rank, world, rng, case):
    """shard() against _part on every dim, both ways of cutting; unshard() its exact inverse; a
    length shard cannot cut is refused, naming it."""
    from attnext import distributed as axd
    if case == "shard_matches_the_parts":
        x = _randn(rng, (2 * world, 4 * world, 6 * world, 3), torch.float32)
        ways = [(dim, causal) for dim in (0, 1, 2) for causal in (False, True)]
        parts = [axd.shard(x, dim=dim, causal=causal) for dim, causal in ways]
        backs = [axd.unshard(p, dim=dim, causal=causal) for p, (dim, causal) in zip(parts, ways)]
        for got, back, (dim, causal) in zip(parts, backs, ways):
            assert torch.equal(got, _part(x, rank, world, dim, causal)), \
                f"rank {rank}/{world}: shard(dim={dim}, causal={causal}) is not the API's part"
            assert torch.equal(back, x), \
                f"rank {rank}/{world}: unshard(shard(x), dim={dim}, causal={causal}) != x"
        return
    n = 7 * world                   # divisible by world, not by 2 * world
    x = _randn(rng, (1, n, 2, 3), torch.float32)
    assert axd.shard(x, causal=False).shape[1] == 7
    with pytest.raises(ValueError, match=rf"\b{n}\b"):
        axd.shard(x, causal=True)
    y = _randn(rng, (1, n + 1, 2, 3), torch.float32)
    with pytest.raises(ValueError, match=rf"\b{n + 1}\b"):
        axd.shard(y)


def _run_disagree_case(rank, world, rng):
    """Ranks whose parts differ (rows, heads, a causal flag, cu_seqlens) get a ValueError naming
    what and every rank's value, on every rank, instead of a transfer that never completes."""
    from attnext import distributed as axd
    rows = 4 + 2 * rank                        # even, so causal's own check passes everywhere
    q, k, v = (_randn(rng, (1, rows, h, 8), torch.float32) for h in (HQ, HK, HK))
    with pytest.raises(ValueError, match="disagree on rows: rank 0: 4, rank 1: 6"):
        axd.ring_attention(q, k, v, causal=True)
    q, k, v = (_randn(rng, (1, 4, h, 8), torch.float32) for h in (HQ, HK, HK))
    with pytest.raises(ValueError, match="disagree on causal"):
        axd.ring_attention(q, k, v, causal=rank == 0)
    t = 4 * world
    cu = torch.tensor([0, 1 + (rank == 0), t], dtype=torch.int32)
    with pytest.raises(ValueError, match="disagree on cu_seqlens_checksum"):
        axd.ring_varlen_attention(q[0], k[0], v[0], cu, t)


def _runner(case):
    if case in RING_CASES:
        return _run_ring_case
    if case == "ranks_that_disagree":
        return lambda rank, world, rng, case: _run_disagree_case(rank, world, rng)
    return _run_varlen_case if case in VARLEN_CASES else _run_shard_case


ALL_CASES = [*RING_CASES, *VARLEN_CASES, *SHARD_CASES]


def _record(out_dir, rank, done, running):
    """This rank's progress, replaced whole (a rank killed mid-write leaves the last one): each
    finished case's failure (its traceback) or None, and the case under way."""
    path = Path(out_dir, f"rank{rank}.json")
    Path(f"{path}.part").write_text(json.dumps({"done": done, "running": running}))
    os.replace(f"{path}.part", path)


def _worker(rank, world, store_path, seed, out_dir):
    """One rank of a run: every case in turn, its progress recorded before and after each. The
    ranks agree through the store after each case; where one failed, each makes a fresh group:
    a rank that raised inside a collective leaves the others' group out of step (a rank that
    gave up waiting, after GLOO_SECONDS, leaves it closed), which the next cases must not
    inherit. Result buffers start as NaN, as the suite's (conftest's poison_results)."""
    import attnext.api
    attnext.api._new_output = poisoned
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    timeout = datetime.timedelta(seconds=GLOO_SECONDS)

    def join(generation):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"group{generation}", store), rank=rank,
                                world_size=world, timeout=timeout)

    generation = 0
    join(generation)
    done = {}
    for i, case in enumerate(ALL_CASES):
        _record(out_dir, rank, done, case)
        try:
            _runner(case)(rank, world, np.random.default_rng([seed, i]), case)
            done[case] = None
        except Exception:               # noqa: BLE001 - reported by the case's test
            done[case] = traceback.format_exc()
        store.set(f"{case}/{rank}", "failed" if done[case] else "ok")
        keys = [f"{case}/{r}" for r in range(world)]
        store.wait(keys, datetime.timedelta(seconds=RUN_SECONDS))
        if any(store.get(key) == b"failed" for key in keys):
            dist.destroy_process_group()
            generation += 1
            join(generation)
    _record(out_dir, rank, done, None)
    dist.destroy_process_group()


# --- the parent ----------------------------------------------------------------------------------

def _spawn(world, seed, tmp):
    """Runs _worker on `world` ranks. Returns (progress, trouble): progress {rank: its last
    record}; trouble None, or why the run ended early: a worker that raised outside the cases or
    died (torch.multiprocessing's message, its traceback included), or a run past RUN_SECONDS,
    terminated."""
    import torch.multiprocessing as torch_mp
    from torch.multiprocessing.spawn import ProcessException
    with pytest.MonkeyPatch.context() as mp:      # the workers' environment, one core each
        for name in ("ATTNEXT_NUM_THREADS", "OMP_NUM_THREADS"):
            mp.setenv(name, "1")
        ctx = torch_mp.spawn(_worker, args=(world, str(tmp / "store"), seed, str(tmp)), nprocs=world,
                             join=False)
    deadline = time.monotonic() + RUN_SECONDS
    trouble = None
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                trouble = f"ranks still running after {RUN_SECONDS} s (a hang?): terminated"
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(10)
                break
    except ProcessException as e:        # join() has stopped the other ranks
        trouble = f"rank {e.error_index}: {e}"
    progress = {}
    for r in range(world):
        path = tmp / f"rank{r}.json"
        progress[r] = json.loads(path.read_text()) if path.exists() else {"done": {}, "running": None}
    return progress, trouble


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def run(request, tmp_path_factory):
    """(world, seed, progress, trouble) of one spawned run of every case (_spawn's), seeded from
    this file's node id and the world size (fresh data per world, identical on a rerun)."""
    world = request.param
    seed = seed_of(f"{request.node.nodeid}::world{world}")
    return (world, seed, *_spawn(world, seed, tmp_path_factory.mktemp(f"ring_world{world}")))


def _report(run, case):
    """Fails with every rank's traceback for the case, or with why the run never finished it."""
    world, seed, progress, trouble = run
    where = f"{case}, world {world}, seed {seed}"
    failed = {r: p["done"][case] for r, p in progress.items() if p["done"].get(case)}
    assert not failed, f"{where}:\n" + "\n".join(
        f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
    unfinished = [r for r, p in progress.items() if case not in p["done"]]
    running = {r: p["running"] for r, p in progress.items() if p["running"]}
    when = "during this case" if case in running.values() else "before this case"
    assert not unfinished, (f"{where}: not finished on ranks {unfinished}: the run ended {when}, with "
                            f"ranks in cases {running}: {trouble}")


@pytest.mark.parametrize("case", RING_CASES)
def test_ring_attention(run, case):
    """ring_attention on each rank's part gives its part of out, lse and dq, dk, dv of the
    single-process call on the whole sequence (score_mod / mask_mod / window in global positions)."""
    _report(run, case)


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_ring_varlen_attention(run, case):
    """ring_varlen_attention on contiguous parts of a packed batch whose documents cross the ranks'
    boundaries gives each rank's rows of the single-process varlen_attention, and their gradients."""
    _report(run, case)


@pytest.mark.parametrize("case", SHARD_CASES)
def test_shard(run, case):
    """shard() cuts as the API says (contiguous or zigzag) and unshard() undoes it on every rank;
    ranks whose parts disagree are refused on every rank."""
    _report(run, case)


# --- bad inputs, in a group of one -------------------------------------------------------------

@pytest.fixture
def solo(tmp_path):
    """A gloo group of this process alone (the default group while the test runs)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=GLOO_SECONDS))
    yield
    dist.destroy_process_group()


def _local(rng, sq, sk, dtype=torch.float32):
    """A rank's q (B, sq, Hq, D), k and v (B, sk, Hk, D)."""
    return (_randn(rng, (B, sq, HQ, D), dtype), _randn(rng, (B, sk, HK, D), dtype),
            _randn(rng, (B, sk, HK, D), dtype))


def test_shard_refuses_a_length_it_cannot_cut(solo, rng):
    """Zigzag cuts 2 * world chunks: a length of 7 in a world of 1 cannot be, and the error names it."""
    from attnext import distributed as axd
    x = _randn(rng, (B, 7, HQ, D), torch.float32)
    with pytest.raises(ValueError, match=r"\b7\b"):
        axd.shard(x, causal=True)


def test_ring_attention_refuses_q_and_k_of_different_lengths(solo, rng):
    """Each rank holds the same rows of q, k and v: 6 query rows beside 8 key rows is no part."""
    from attnext import distributed as axd
    with pytest.raises(ValueError, match=r"same rows.*got 6, 8 and 8"):
        axd.ring_attention(*_local(rng, 6, 8))


def test_ring_attention_causal_refuses_an_odd_local_length(solo, rng):
    """A causal part is two zigzag chunks of equal length: an odd local length is no such part."""
    from attnext import distributed as axd
    with pytest.raises(ValueError, match=r"zigzag.*got 7 rows"):
        axd.ring_attention(*_local(rng, 7, 7), causal=True)


def test_bad_options_are_named(solo, rng):
    """window, max_seqlen, dim and unshard's parts: a clear error naming the argument and value."""
    from attnext import distributed as axd
    q, k, v = _local(rng, 8, 8)
    for window in (5, (1.5, 2), (True, 2), (-2, 0)):
        with pytest.raises(ValueError, match="window"):
            axd.ring_attention(q, k, v, window=window)
    with pytest.raises(ValueError, match=r"dim = 5 .* 4 dims"):
        axd.shard(q, dim=5)
    with pytest.raises(TypeError, match="torch.Tensor"):
        axd.shard(q.numpy())
    with pytest.raises(ValueError, match=r"x.shape\[1\] = 7"):
        axd.unshard(q[:, :7], causal=True)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="max_seqlen must be an int"):
        axd.ring_varlen_attention(q[0], k[0], v[0], cu, None)
    with pytest.raises(ValueError, match=r"max_seqlen = 4 is shorter .* \(5 rows"):
        axd.ring_varlen_attention(q[0], k[0], v[0], cu, 4)


def test_the_parts_follow_the_api(rng):
    """_part and _cu_seqlens, which the spawned checks rely on, do as they say (a check of the
    test itself): contiguous parts and zigzag chunks r, 2w - 1 - r, on positions; documents that
    cross every rank boundary, the first and the fourth empty where asked."""
    world, n = 3, 4
    pos = torch.arange(2 * world * n)
    for r in range(world):
        zigzag = list(range(n * r, n * (r + 1))) + list(range(n * (2 * world - 1 - r), n * (2 * world - r)))
        assert _part(pos, r, world, 0, False).tolist() == list(range(2 * n * r, 2 * n * (r + 1)))
        assert _part(pos, r, world, 0, True).tolist() == zigzag
    t = S_PER_RANK * world
    for empty in (False, True):
        cu = _cu_seqlens(rng, t, world, empty)
        lengths = cu.diff()
        assert cu[0] == 0 and cu[-1] == t and (lengths >= 0).all(), cu.tolist()
        assert (lengths == 0).nonzero().flatten().tolist() == ([0, 3] if empty else []), cu.tolist()
        assert not [c for c in cu.tolist() if 0 < c < t and c % S_PER_RANK == 0], \
            f"a document boundary at a rank's: {cu.tolist()}"


def example_diffs(*args, timeout=180):
    """examples/ring_attention.py under torchrun with 2 processes (args: its own): the largest
    difference it prints for out, dq, dk and dv, by name."""
    import re
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(root / "examples" / "ring_attention.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    diffs = dict(re.findall(r"^(\w+): max \|ring - one device\| = (\S+)$", proc.stdout, re.M))
    assert sorted(diffs) == ["dk", "dq", "dv", "out"], proc.stdout
    return {name: float(d) for name, d in diffs.items()}


def test_the_example_matches_one_process():
    """examples/ring_attention.py under torchrun (2 CPU processes, gloo): the ring's out and
    gradients, gathered whole, within float32 rounding of one process's."""
    diffs = example_diffs("--cpu")
    assert all(d < 1e-4 for d in diffs.values()), diffs
