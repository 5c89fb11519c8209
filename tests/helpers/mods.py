"""A library of named score_mods and mask_mods (as flash-attention's score_mod_definitions.py).

Each mod is a plain NumPy-style function, so its NumPy twin is the function itself called on
NumPy arrays. Factories capture arrays and constants in closures; REL_TABLE and DOC_ID are
captured as globals. Indices are positions inside a sequence of at most S_MAX rows / columns,
with H_MAX heads at most.
"""
import numpy as np

S_MAX = 16
H_MAX = 4
_rng = np.random.default_rng(1234)
REL_TABLE = _rng.standard_normal((H_MAX, 2 * S_MAX + 1))   # global: relative position bias
DOC_ID = np.repeat(np.arange(4), 4)                          # global: document of each position


# --- score_mods --------------------------------------------------------------------------------

def identity(score, b, h, q_idx, kv_idx):
    return score


def times_two(score, b, h, q_idx, kv_idx):
    return score * 2


def squared(score, b, h, q_idx, kv_idx):
    return score ** 2


def trig(score, b, h, q_idx, kv_idx):
    return np.sin(score) + np.cos(0.5 * score) * 0.25


def head_offset(score, b, h, q_idx, kv_idx):
    return score + h * 0.125 - b


def rel_bias_global(score, b, h, q_idx, kv_idx):
    return score + REL_TABLE[h, q_idx - kv_idx + S_MAX]


def rel_bias(table):
    """table (H, 2 * S_MAX + 1) captured in a closure."""
    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + S_MAX]
    return mod


def alibi(slopes):
    return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * np.abs(q_idx - kv_idx)


def softcap(cap):
    return lambda score, b, h, q_idx, kv_idx: cap * np.tanh(score / cap)


def sigmoid(score, b, h, q_idx, kv_idx):
    return 1 / (1 + np.exp(-score))


def softplus_log2(score, b, h, q_idx, kv_idx):
    return np.log(1.0 + np.exp(score)) + np.log2(np.exp2(score * 0.5) + 2.0) + np.sqrt(
        score * score + 1.0)


def where_causal_decay(score, b, h, q_idx, kv_idx):
    return np.where(q_idx >= kv_idx, score, score * 0.5 - 1.0)


def clamp(score, b, h, q_idx, kv_idx):
    return np.minimum(np.maximum(score, -1.0), np.clip(score, 0.5, 2.0) + 0.25)


def pair_product(table):
    """The same array read three times, twice at the same element when q_idx == kv_idx."""
    def mod(score, b, h, q_idx, kv_idx):
        return score * table[h, q_idx] * table[h, kv_idx] + table[h, q_idx]
    return mod


def bias_2d(bias):
    return lambda score, b, h, q_idx, kv_idx: score + bias[q_idx, kv_idx]


def doc_penalty(doc_id):
    return lambda score, b, h, q_idx, kv_idx: np.where(doc_id[q_idx] == doc_id[kv_idx],
                                                       score, score - 1.0)


def divide_pow(table):
    def mod(score, b, h, q_idx, kv_idx):
        return np.abs(score) ** 1.5 / (1.0 + np.abs(table[h, -1 - q_idx]))
    return mod


def int_arith(score, b, h, q_idx, kv_idx):
    return score + (q_idx % 3) * 0.1 - (kv_idx // 2) + (q_idx - kv_idx) ** 2 / 64


def int32_ops(score, b, h, q_idx, kv_idx):
    """Integer ops the GPU code generator computes in int32 (their operands and results within
    int32 for every call: codegen's _SMALL_INT_OPS), |.| converted as the float's fabsf."""
    d = -(q_idx - kv_idx)
    spread = np.maximum(q_idx, kv_idx) - np.minimum(q_idx, kv_idx)
    return score + 0.01 * spread - 0.02 * np.abs(d) + 0.5 * (d > -3) + 0.003 * np.abs(q_idx - kv_idx)


def scalar_array(scale):
    """scale is a 0-d float array: a scalar lookup with its own gradient."""
    return lambda score, b, h, q_idx, kv_idx: score * scale + scale


def softcap_alibi_rel(cap, slopes, table):
    def mod(score, b, h, q_idx, kv_idx):
        s = cap * np.tanh(score / cap)
        return s - slopes[h] * np.abs(q_idx - kv_idx) + table[h, q_idx - kv_idx + S_MAX]
    return mod


def score_mods():
    """name -> score_mod, with freshly drawn captured arrays."""
    rng = np.random.default_rng(7)
    table = rng.standard_normal((H_MAX, 2 * S_MAX + 1))
    slopes = rng.uniform(0.1, 1.0, H_MAX)
    return {
        "identity": identity, "times_two": times_two, "squared": squared, "trig": trig,
        "head_offset": head_offset, "rel_bias_global": rel_bias_global,
        "rel_bias": rel_bias(table), "alibi": alibi(slopes), "softcap": softcap(2.5),
        "sigmoid": sigmoid, "softplus_log2": softplus_log2,
        "where_causal_decay": where_causal_decay, "clamp": clamp,
        "pair_product": pair_product(rng.standard_normal((H_MAX, S_MAX))),
        "bias_2d": bias_2d(rng.standard_normal((S_MAX, S_MAX)).astype(np.float32)),
        "doc_penalty": doc_penalty(DOC_ID), "divide_pow": divide_pow(table),
        "int_arith": int_arith, "int32_ops": int32_ops, "scalar_array": scalar_array(np.array(0.75)),
        "softcap_alibi_rel": softcap_alibi_rel(3.0, slopes, table),
    }


# --- mask_mods ---------------------------------------------------------------------------------

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(w):
    return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx >= 0) & (q_idx - kv_idx < w)


def prefix_lm(n):
    return lambda b, h, q_idx, kv_idx: (kv_idx < n) | (q_idx >= kv_idx)


def document_global(b, h, q_idx, kv_idx):
    return DOC_ID[q_idx] == DOC_ID[kv_idx]


def document_causal(doc_id):
    return lambda b, h, q_idx, kv_idx: (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)


def not_diagonal(b, h, q_idx, kv_idx):
    return ~(q_idx == kv_idx)


def keep_all(b, h, q_idx, kv_idx):
    return True


def head_dependent(b, h, q_idx, kv_idx):
    return (h % 2 == 0) | np.logical_and(q_idx >= kv_idx, np.logical_not(kv_idx == 0))


def allowed_table(allowed):
    """allowed: a captured bool array (S_MAX, S_MAX)."""
    return lambda b, h, q_idx, kv_idx: allowed[q_idx, kv_idx] ^ (b == 1)


def mask_mods():
    rng = np.random.default_rng(8)
    return {
        "causal": causal, "sliding_window": sliding_window(3), "prefix_lm": prefix_lm(5),
        "document_global": document_global, "document_causal": document_causal(DOC_ID),
        "not_diagonal": not_diagonal, "keep_all": keep_all, "head_dependent": head_dependent,
        "allowed_table": allowed_table(rng.random((S_MAX, S_MAX)) < 0.5),
    }


# The score_mod zoo combined with the built-in options (tests/cpu/test_score_mod.py; its NumPy-call
# twins on the GPU: tests/host/test_numpy_mods_gpu.py): a score_mod by name, and the options.
COMBOS = {
    "causal_rel_bias": dict(score="rel_bias", causal=True),
    "window_alibi_doc": dict(score="alibi", mask_mod="document_causal", window=(6, 2)),
    "softcap_bias_trig": dict(score="trig", softcap=3.0, bias=True),
    "builtin_alibi_softcap_mod": dict(score="softcap_alibi_rel", alibi=True, mask_mod="prefix_lm"),
    "mask_and_mask_mod": dict(score="pair_product", bool_mask=True, mask_mod="sliding_window"),
    "bhsd_top_left": dict(score="clamp", causal="top_left", layout="bhsd"),
    "scale_head_dep": dict(score="head_offset", mask_mod="head_dependent", scale=0.7),
}
