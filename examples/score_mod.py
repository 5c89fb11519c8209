import numpy as np
import attnext

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 256, 4, 64), dtype=np.float32) for _ in range(3))  # (B, S, H, D)
slopes = np.array([0.5, 0.25, 0.125, 0.0625], dtype=np.float32)

def alibi(score, b, h, q_idx, kv_idx):          # score_mod: a new score for each (q, k) pair
    return score - slopes[h] * (q_idx - kv_idx)

def sliding_window(b, h, q_idx, kv_idx):         # mask_mod: True = attend
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 128)

out, lse = attnext.attention(q, k, v, score_mod=alibi, mask_mod=sliding_window, return_lse=True)
grads = attnext.attention_backward(np.ones_like(out), q, k, v, out, lse, score_mod=alibi,
                                   mask_mod=sliding_window)   # dq, dk, dv and dtensors["slopes"]
ref = attnext.reference.attention(q, k, v, score_mod=alibi, mask_mod=sliding_window)
print("max |out - reference|:", np.abs(out - ref).max(), " d slopes:", grads.dtensors["slopes"])
