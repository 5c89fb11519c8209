"""attnext inside Hugging Face transformers: a small randomly initialised gpt-oss (attention sinks,
a sliding-window layer, GQA) run with attn_implementation="attnext" beside the same weights under
"eager", then one training step through attnext's backward, and greedy generation with a cache.

Prints the largest logit difference, the sinks' gradient and the generated tokens.
"""
import copy

import torch
import transformers

import attnext.torch as axt

axt.register_transformers()                 # attn_implementation="attnext" from here on
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
config = transformers.GptOssConfig(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
models = {}
for impl in ("eager", "attnext"):
    c = copy.deepcopy(config)
    c._attn_implementation = impl
    models[impl] = transformers.GptOssForCausalLM(c).to(device)
models["attnext"].load_state_dict(models["eager"].state_dict())

ids = torch.randint(0, 128, (2, 24), device=device)
mask = torch.ones_like(ids)
mask[1, :6] = 0                             # left padding: the layers get this (2, 24) mask, no 24 x 24 one
with torch.no_grad():
    eager, ours = (models[k](input_ids=ids, attention_mask=mask).logits for k in ("eager", "attnext"))
print("largest logit difference on real tokens:", (eager - ours)[mask.bool()].abs().max().item())

model = models["attnext"]
out = model(input_ids=ids, attention_mask=mask, labels=ids)
out.loss.backward()                         # attnext's backward: q, k, v and the sinks
print("layer 0 sinks' gradient:", model.model.layers[0].self_attn.sinks.grad)

with torch.no_grad():
    tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                            pad_token_id=0)
print("generated:", tokens[:, -5:].tolist())
