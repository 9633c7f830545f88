"""generate.py: the KV cache changes the cost of decoding, not its tokens.

Greedy decoding with the cache (each step feeds one token, its keys and values appended to each layer's
cache) gives the tokens of decoding without it (the whole prefix recomputed each step), and those of
transformers' `LlamaForCausalLM.generate` (its own cache) on the same weights written by save_hf. In
float64 the logits of the three paths agree to ~1e-15, far below the gap between a random model's two
likeliest tokens, so equal token ids are a sharp check (a cache off by one position changes them at once).
Sampling with the same seed draws the same tokens with and without the cache too.
"""

import pytest
import torch

import generate
import hf_io
import model as modeling


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = modeling.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    return modeling.LlamaForCausalLM(config).double().eval()


def test_kv_cache_gives_the_tokens_of_full_recomputation_and_of_transformers(model, tmp_path):
    import transformers
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))     # (B, T) prompts
    cached = generate.generate(model, ids, 24, use_cache=True)
    recomputed = generate.generate(model, ids, 24, use_cache=False)
    assert cached.shape == (2, 31) and torch.equal(cached[:, :7], ids)
    assert torch.equal(cached, recomputed)
    assert all(layer.self_attn.attn_fn is modeling.sdpa_attention for layer in model.model.layers)  # restored
    hf_io.save_hf(model, tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    expected = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
    assert torch.equal(cached, expected)
    draws = [generate.generate(model, ids, 16, temperature=0.9, top_k=10, use_cache=cache,
                               generator=torch.Generator().manual_seed(3)) for cache in (True, False)]
    assert torch.equal(*draws) and not torch.equal(draws[0], cached[:, :23])


def test_top_k_and_temperature():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    assert generate.next_token(logits, 0.0, 0).item() == 1                       # greedy
    drawn = {generate.next_token(logits, 1.0, 2, torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert drawn == {1, 2}                                                       # only the two likeliest


def test_bad_input_names_the_fix(capsys):
    with pytest.raises(SystemExit):
        generate.main(["--checkpoint-dir", "no/such/ckpt", "--prompt", "x"])
    assert "--checkpoint-dir no/such/ckpt does not exist" in capsys.readouterr().err
