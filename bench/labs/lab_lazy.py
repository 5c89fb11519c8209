"""Kernel lab (NumPy, no GPU): how often the Hopper WS forward's lazy step would fail its check on
random scores, replayed in float64 on the kernel's layout.

    python bench/labs/lab_lazy.py [--D 64] [--S 2048] [--heads 8] [--lift 0 2 4 8] [--full]

attn_fwd_sm90.cu (LAZY_MAX) visits a 128-row query tile's 128-key tiles diagonal first under a
causal mask; a row's m is the first tile's maximum, and each later tile is kept (one FFMA and an
exp2 a score, no maxima) where every thread's partial sum of each of its rows, the 32 keys
nt * 8 + 2 t4 + {0, 1} of its quad position t4, is at most 2^STALE_MAX_LOG2; else the warp's 16
rows take softmax_update with the threshold at 0, which moves m to the tile's maximum wherever
it rose. A failed warp-tile costs its lazy pass again (scores_from_p, the maxima, O's rescale).
--lift adds that many log2 units to m after the first tile (bench/NOTES.md, forward "tried
(s69)"); --full drops the causal mask. Prints the share of warp-tiles not kept, and of those on
a visit's second tile. randn q and k with D's scale, as the bench's inputs."""
import argparse

import numpy as np

STALE_MAX_LOG2, BM, BN, WARP_ROWS = 8.0, 128, 128, 16


def replay(D, S, heads, lift, causal, rng):
    c = np.log2(np.e) / np.sqrt(D)
    quad = (np.arange(BN) % 8) // 2                      # the quad position holding each key column
    fails = second = total = 0
    for _ in range(heads):
        q, k = rng.standard_normal((S, D)), rng.standard_normal((S, D))
        s = (q @ k.T) * c                                # scores in log2 units
        if causal:
            s[np.triu_indices(S, 1)] = -np.inf
        for x in range(S // BM):
            rows = slice(x * BM, (x + 1) * BM)
            n_last = x if causal else S // BN - 1
            m = s[rows, n_last * BN:(n_last + 1) * BN].max(1) + lift
            for n in range(n_last - 1, -1, -1):
                t = s[rows, n * BN:(n + 1) * BN]
                p = np.exp2(t - m[:, None])
                part = np.stack([p[:, quad == j].sum(1) for j in range(4)], 1)
                warp_bad = (part > 2 ** STALE_MAX_LOG2).any(1).reshape(BM // WARP_ROWS, WARP_ROWS).any(1)
                fails += warp_bad.sum()
                second += warp_bad.sum() if n == n_last - 1 else 0
                total += warp_bad.size
                moved = np.repeat(warp_bad, WARP_ROWS) & (t.max(1) > m)
                m = np.where(moved, t.max(1), m)
    return fails / max(total, 1), second / max(total, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--S", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lift", type=float, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--full", action="store_true")
    a = ap.parse_args()
    for lift in a.lift:
        f, f2 = replay(a.D, a.S, a.heads, lift, not a.full, np.random.default_rng(0))
        print(f"D{a.D} S{a.S} {'full' if a.full else 'causal'} lift {lift:g}: warp-tiles not kept "
              f"{100 * f:.2f}% (on a visit's second tile: {100 * f2:.2f}%)")


if __name__ == "__main__":
    main()
