"""attnext as transformers' attn_implementation="attnext" (attnext.torch.register_transformers):
small randomly initialised models built from transformers' own config classes, their logits and
every parameter's gradient against the same weights under "sdpa" (a Llama: GQA, padding on
either side) and "eager" (a gpt-oss: sinks, a sliding-window layer, which sdpa cannot run);
greedy generation with a cache; the masks the layers get stay (B, Sk)-sized; refusals. CPU in
float32; on a GPU (-m gpu) in bfloat16."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnext.torch as axt  # noqa: E402
from attnext import hf  # noqa: E402

axt.register_transformers()

V, S = 101, 17


def _llama_config():
    return transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _gpt_oss_config():
    # every expert a token: a top-2 router's choice is discontinuous, so in bfloat16 attention's
    # rounding could flip a token's experts and move its logits past any tolerance (1 seed in 5
    # against eager on the CPU); with all four the router's weights move smoothly
    return transformers.GptOssConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_local_experts=4, num_experts_per_tok=4, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"],
                                     max_position_embeddings=128, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 10000.0})


def _pair(config, model_class, peer, seed, dtype=torch.float32, device="cpu"):
    """The same random weights as (peer model, attnext model); sinks (gpt-oss) drawn at random."""
    torch.manual_seed(seed)
    models = []
    for impl in (peer, "attnext"):
        c = copy.deepcopy(config)
        c._attn_implementation = impl
        models.append(model_class(c).to(device=device, dtype=dtype).eval())
    with torch.no_grad():
        for m in models[0].modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_()
    models[1].load_state_dict(models[0].state_dict())
    return models


def _batch(seed, device="cpu"):
    """Token ids (3, S) and a padding mask: row 1 padded on the left, row 2 on the right."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, S), generator=g)
    am = torch.ones(3, S, dtype=torch.long)
    am[1, :5] = 0
    am[2, 12:] = 0
    return ids.to(device), am.to(device)


def _run(model, ids, am):
    """Logits and every parameter's gradient of a loss over the real tokens."""
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=am).logits
    (logits.float() * am[..., None]).square().sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def seed():
    return int(np.random.default_rng().integers(1 << 30))


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_logits_and_gradients_match_the_peer(kind, seed):
    if kind == "llama":
        peer, attn = _pair(_llama_config(), transformers.LlamaForCausalLM, "sdpa", seed)
    else:
        peer, attn = _pair(_gpt_oss_config(), transformers.GptOssForCausalLM, "eager", seed)
    ids, am = _batch(seed)
    want, want_g = _run(peer, ids, am)
    got, got_g = _run(attn, ids, am)
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    assert set(got_g) == set(want_g)
    if kind == "gpt_oss":
        assert any("sinks" in n for n in got_g)             # the sinks get their gradient
    for name in want_g:
        scale = want_g[name].abs().max().item() + 1e-6
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-3, atol=1e-4 * scale, msg=name)


def test_layers_get_lengths_sized_masks(seed, monkeypatch):
    """The standard causal and sliding masks reach the layers as the (B, Sk) padding mask (None
    without padding), never an Sq x Sk one."""
    seen = []
    def spy(module, query, key, value, attention_mask, **kw):
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return hf.attention_forward(axt.attention, module, query, key, value, attention_mask, **kw)
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "attnext", spy)
    _, attn = _pair(_gpt_oss_config(), transformers.GptOssForCausalLM, "eager", seed)
    ids, am = _batch(seed)
    with torch.no_grad():
        attn(input_ids=ids, attention_mask=am)
        assert seen == [(3, S), (3, S)], seen
        seen.clear()
        attn(input_ids=ids, attention_mask=torch.ones_like(am))
        assert seen == [None, None], seen


def test_generation_with_a_cache_matches_the_peer(seed):
    """Greedy decoding (prefill, then one query row a step over the cache) gives the peer's tokens."""
    peer, attn = _pair(_llama_config(), transformers.LlamaForCausalLM, "sdpa", seed)
    ids, am = _batch(seed)
    ids, am = ids[:2, :12], am[:2, :12]                  # left padding only, as generate() wants
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = peer.generate(input_ids=ids, attention_mask=am, **kw)
        got = attn.generate(input_ids=ids, attention_mask=am, **kw)
    assert torch.equal(got, want)


def test_refusals_name_what_is_missing(seed):
    _, attn = _pair(_llama_config(), transformers.LlamaForCausalLM, "sdpa", seed)
    layer = attn.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16)
    kv = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="dropout=0.1 is not supported"):
        hf.attention_forward(axt.attention, layer, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="output_attentions"):
        hf.attention_forward(axt.attention, layer, q, kv, kv, None, output_attentions=True)


def test_a_custom_4d_mask_is_passed_through(seed):
    """A 4D float mask the caller built (transformers returns it as given) is added as bias=."""
    peer, attn = _pair(_llama_config(), transformers.LlamaForCausalLM, "sdpa", seed)
    ids, _ = _batch(seed)
    allowed = torch.ones(S, S, dtype=torch.bool).tril() & (torch.rand(S, S) < 0.8)
    allowed |= torch.eye(S, dtype=torch.bool)
    bias = torch.zeros(3, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = peer(input_ids=ids, attention_mask=bias).logits
        got = attn(input_ids=ids, attention_mask=bias).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_cuda_bfloat16_models(kind, seed):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    if kind == "llama":
        peer, attn = _pair(_llama_config(), transformers.LlamaForCausalLM, "sdpa", seed, torch.bfloat16, "cuda")
    else:
        peer, attn = _pair(_gpt_oss_config(), transformers.GptOssForCausalLM, "eager", seed, torch.bfloat16, "cuda")
    ids, am = _batch(seed, "cuda")
    want, want_g = _run(peer, ids, am)
    got, got_g = _run(attn, ids, am)
    real = am.bool()
    torch.testing.assert_close(got[real].float(), want[real].float(), rtol=3e-2, atol=3e-2)
    for name in want_g:
        scale = want_g[name].float().abs().max().item() + 1e-6
        torch.testing.assert_close(got_g[name].float(), want_g[name].float(), rtol=5e-2, atol=5e-2 * scale,
                                   msg=name)
