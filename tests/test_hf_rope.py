"""01_single_gpu/runtime/hf_io.py and the model's RoPE: Llama 3's rope_theta and the RoPE scalings load
both ways.

Compared: logits of transformers' `LlamaForCausalLM` and of ours holding the same weights, after a trip
through a `config.json` + `model.safetensors` directory in each direction, for rope_theta 500000 alone,
Llama 3.1's `llama3` scaling and `linear` scaling; the config.json in the layout the installed transformers
writes (`rope_parameters`) and in the older top-level one (`rope_theta` + `rope_scaling`). float64 on both
sides and eager attention (softmax in float32 on both sides), as test_single_gpu.py's parity test: the
inverse frequencies are float32 on both sides, so equal formulas give bit-equal angles and only the order
of a few float64 operations differs; 1e-10 is far below what a wrong theta or scaling does (asserted:
each case also checks that dropping what it tests moves the logits by more than 1e-3).
"""
import dataclasses
import json

import pytest
import torch

import model as modeling
import hf_io


@pytest.fixture(scope="module")
def transformers():
    """Imported by the tests that compare with it (~1 s), not when pytest collects this file."""
    return pytest.importorskip("transformers")


SHAPES = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
# head_dim 12: six frequencies, wavelengths 2π·500000^(i/6) ≈ 6, 56, 500, 4400, 40000, 350000 tokens. With
# original_max_position_embeddings 64, llama3's bands (< 64/4 kept, > 64/1 divided by factor) hold one,
# one and four of them, so all three branches of the formula are exercised; T = 80 runs past 64.
ROPE = {
    "theta500k": {"rope_type": "default", "rope_theta": 500000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
}
T = 80


def transformers_model(transformers, rope_parameters):
    """transformers' Llama in float64 with weights of std 0.3: sharp attention, so the angles matter."""
    config = transformers.LlamaConfig(**SHAPES, rope_parameters=dict(rope_parameters),
                                      attn_implementation="eager", max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def ours_from(directory):
    model = modeling.LlamaForCausalLM(hf_io.config_from_hf(directory, modeling.LlamaConfig)).double()
    hf_io.load_hf_into(model, directory)
    for layer in model.model.layers:
        layer.self_attn.attn_fn = modeling.eager_attention
    return model.eval()


def logits_without(model, case, ids):
    """Our logits with what `case` tests removed: theta back to 10000, or the scaling dropped."""
    dropped = ({"rope_theta": 10000.0} if case == "theta500k" else {"rope_scaling": None})
    other = modeling.LlamaForCausalLM(dataclasses.replace(model.config, **dropped)).double()
    other.load_state_dict(model.state_dict())
    for layer in other.model.layers:
        layer.self_attn.attn_fn = modeling.eager_attention
    return other(ids)


def check_same_logits(ours, theirs, case):
    ids = torch.randint(0, SHAPES["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-10, atol=1e-10)
        assert (logits_without(ours, case, ids) - expected).abs().max() > 1e-3   # the test is not vacuous


@pytest.mark.parametrize("case", ROPE)
def test_transformers_save_pretrained_loads_into_ours(transformers, tmp_path, case):
    """transformers -> save_pretrained (rope_parameters layout) -> our loaders: the same logits."""
    theirs = transformers_model(transformers, ROPE[case])
    theirs.save_pretrained(tmp_path)
    check_same_logits(ours_from(tmp_path), theirs, case)


@pytest.mark.parametrize("case", ROPE)
def test_older_top_level_layout_loads_into_ours(transformers, tmp_path, case):
    """The same checkpoint with config.json in the pre-transformers-5 layout, written by hand as Llama 2 /
    Llama 3.1 checkpoints ship it: top-level rope_theta, rope_scaling naming its kind `type` (linear, the
    older spelling) or `rope_type` (llama3)."""
    theirs = transformers_model(transformers, ROPE[case])
    theirs.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    rope.pop("type", None)
    spelling = "type" if kind == "linear" else "rope_type"
    raw["rope_scaling"] = None if kind == "default" else {spelling: kind, **rope}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    check_same_logits(ours_from(tmp_path), theirs, case)


@pytest.mark.parametrize("case", ROPE)
def test_ours_save_hf_loads_into_transformers(transformers, tmp_path, case):
    """ours (loaded from transformers' save) -> save_hf -> transformers from_pretrained: same logits, and
    config.json holds the RoPE fields exactly as transformers' own save_pretrained writes them."""
    theirs = transformers_model(transformers, ROPE[case])
    theirs.save_pretrained(tmp_path / "theirs")
    ours = ours_from(tmp_path / "theirs")
    hf_io.save_hf(ours, tmp_path / "ours")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float64,
                                                             attn_implementation="eager").eval()
    check_same_logits(ours, reloaded, case)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    reference = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert written["rope_parameters"] == reference["rope_parameters"]
    assert "rope_theta" not in written and "rope_scaling" not in written


@pytest.mark.parametrize("layout", ["rope_parameters", "top-level"])
@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_other_rope_scalings_are_refused_by_name(tmp_path, kind, layout):
    """Any other scaling is one ValueError naming it and the supported ones, never a silent default."""
    rope = {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 64}
    raw = {**SHAPES, "model_type": "llama"}
    raw.update({"rope_parameters": {**rope, "rope_theta": 500000.0}} if layout == "rope_parameters" else
               {"rope_theta": 500000.0, "rope_scaling": rope})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"'{kind}'.*supported: default, linear, llama3"):
        hf_io.config_from_hf(tmp_path, modeling.LlamaConfig)


def test_pipeline_stage_uses_the_scaled_frequencies():
    """06's PipelineStage builds its own cos/sin: one stage holding the whole llama3-scaled model gives the
    model's loss bit for bit (the same operations in the same order), which the unscaled model does not."""
    import pipeline
    scaling = {k: v for k, v in ROPE["llama3"].items() if k != "rope_theta"}
    config = modeling.LlamaConfig(**SHAPES, rope_theta=500000.0, rope_scaling=scaling)
    full = modeling.LlamaForCausalLM(config).double()
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    ids = torch.randint(0, SHAPES["vocab_size"], (2, T + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        stage = pipeline.build_stages(full, pp_rank=0, pp_size=1)[0]
        loss, aux = stage(inputs, labels)
        assert aux == 0.0 and torch.equal(loss, full(inputs, labels))
        unscaled = modeling.LlamaForCausalLM(dataclasses.replace(config, rope_scaling=None)).double()
        unscaled.load_state_dict(full.state_dict())
        assert abs(unscaled(inputs, labels) - full(inputs, labels)) > 1e-3
