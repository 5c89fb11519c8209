"""attnext in a notebook: a packed batch of three sequences, causal, with a broadcast mask.

Prints the output's shape and its largest difference from the float64 NumPy reference.
"""
import numpy as np

import attnext

rng = np.random.default_rng(0)
lengths = [37, 113, 64]                      # three sequences packed into one tensor
cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
T, Hq, Hk, D = int(cu[-1]), 8, 2, 64         # grouped-query attention: 4 query heads per kv head
q = rng.standard_normal((T, Hq, D), dtype=np.float32)
k = rng.standard_normal((T, Hk, D), dtype=np.float32)
v = rng.standard_normal((T, Hk, D), dtype=np.float32)

# A mask shared by every sequence and head: drop keys at positions 5..9. Broadcast from
# (max_seqlen_k,) to (B, H, max_seqlen_q, max_seqlen_k) without copying.
mask = np.ones(max(lengths), dtype=bool)
mask[5:10] = False

out, lse = attnext.varlen_attention(q, k, v, cu, cu, causal=True, mask=mask, return_lse=True)
ref = attnext.reference.varlen_attention(q, k, v, cu, cu, causal=True, mask=mask)

print("backend:", attnext.info()["backends"]["cpu"])
print("out shape:", out.shape, "lse shape:", lse.shape)
print("max |out - reference|: %.2e" % np.abs(out - ref).max())
