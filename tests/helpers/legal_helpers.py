"""Helpers that tests/cpu/test_legal_mods.py's score_mods and mask_mods call from another module:
each reads this module's own global array, which tracing captures under its global name."""
import numpy as np

SPAN = 9
DIST_BIAS = np.random.default_rng(77).standard_normal(2 * SPAN + 1)    # float: it has a gradient
BUCKET = np.arange(2 * SPAN + 1) // 3                                  # int: bucket of a distance


def distance_bias(score, q_idx, kv_idx):
    """score plus a learned bias of the clipped distance q_idx - kv_idx."""
    return score + DIST_BIAS[np.clip(q_idx - kv_idx, -SPAN, SPAN) + SPAN]


def same_bucket(q_idx, kv_idx):
    """Whether the two positions' distance falls in an even bucket (through a helper of its own)."""
    return _bucket(q_idx - kv_idx) % 2 == 0


def _bucket(d):
    return BUCKET[np.clip(d, -SPAN, SPAN) + SPAN]
