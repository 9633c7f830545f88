"""The trainer's fast path and its speed-run inputs: fused AdamW, SDPA's grouped-query heads, norm and RoPE
outputs in the compute dtype, --compile, --dataset synthetic and the 1B presets.

Each speed-up is checked against what it replaced: the same numbers (bitwise where the arithmetic is the same,
within a stated tolerance where it is reordered), and the switch itself (the fused kernel is chosen, no K/V
copy is made, the layers are compiled). float32/float64 on the CPU, except where autocast is the subject.
"""
import json
import math
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch

import common
import cli
import data
import sampling
import model as modeling
import rope
import optim

ROOT = Path(__file__).resolve().parents[1]
train = import_module("01_single_gpu.train")


def test_fused_adamw_steps_flat_shards_exactly_as_whole_parameters():
    """make_optimizer picks AdamW's fused kernel on the CPU (and CUDA). Its arithmetic is per element, so a
    flat buffer of two parameters (ZeRO's shards, 03) steps bitwise as the two parameters do (01): the
    parallel folders' comparisons with 01 hold with it. float64, three steps, weight decay on both."""
    args = common.argv()
    args = cli.parse_args(cli.core_parser("t"), args, files=False)
    torch.manual_seed(0)
    whole = [torch.randn(7, 5, dtype=torch.float64), torch.randn(11, dtype=torch.float64).unsqueeze(0)]
    grads = [[torch.randn_like(p) for p in whole] for _ in range(3)]
    params = [p.clone().requires_grad_() for p in whole]
    flat = torch.cat([p.reshape(-1) for p in whole]).requires_grad_()
    flat.decays = True
    per_param, flattened = optim.make_optimizer(params, args), optim.make_optimizer([flat], args)
    assert all(g["fused"] for g in per_param.param_groups + flattened.param_groups)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        flat.grad = torch.cat([g.reshape(-1) for g in step_grads])
        per_param.step()
        flattened.step()
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), flat.detach())


def test_fused_adamw_reads_a_gradient_of_another_layout():
    """A gradient whose memory is laid out unlike its parameter's (a transposed view, as 04's tied
    vocab-parallel head gets one) steps as its contiguous copy does, bitwise: torch's fused CPU kernel
    reads both memories in step and misreads it unless make_optimizer's pre-hook copies it first."""
    args = cli.parse_args(cli.core_parser("t"), common.argv(), files=False)
    torch.manual_seed(0)
    start, grad = torch.randn(4, 6), torch.randn(6, 4).t()                     # grad: (4, 6), strides (1, 4)
    stepped = []
    for g in (grad, grad.contiguous()):
        p = start.clone().requires_grad_()
        optimizer = optim.make_optimizer([p], args)
        p.grad = g
        optimizer.step()
        stepped.append(p.detach())
    assert torch.equal(*stepped)


def test_sdpa_attention_reads_shared_kv_heads_without_copying_them(monkeypatch):
    """sdpa_attention with 8 query heads over 2 key/value heads equals SDPA over K/V repeated per query head
    (query head h reads K/V head h // 4, what it did before) in float64, to float64's rounding, and makes no
    copy of K or V: repeat_interleave is never called."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 16, 8, dtype=torch.float64), torch.randn(2, 2, 16, 8, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                                                v.repeat_interleave(4, 1), is_causal=True)

    def no_copies(*args, **kwargs):
        raise AssertionError("K/V were repeated")
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", no_copies)
    torch.testing.assert_close(modeling.sdpa_attention(q, k, v), expected, rtol=1e-12, atol=1e-12)


def _autocast_step(model, x, y):
    """Loss and gradients of one bf16-autocast forward/backward of the fp32 `model` (the autocast layout)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, labels=y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def old_rotary(q, k, cos, sin):   # before: fp32 angles promoted q and k to fp32
    return q * cos + rope.rotate_half(q) * sin, k * cos + rope.rotate_half(k) * sin


def test_norms_and_rope_hand_the_compute_dtype_on_under_autocast(monkeypatch):
    """Under bf16 autocast over fp32 weights, RMSNorm and RoPE now return bf16, where they returned fp32 that
    each reader cast to bf16 again. The casts move, the values do not: the loss is bitwise that of the old
    outputs (emulated: `to_compute_dtype` leaving its input as it is, the old fp32 rotation). The gradients
    differ only in where they are summed: a norm output read by q, k, v (gate, up) sums its three (two)
    bf16 gradients in bf16 now, in fp32 before, so they agree to bf16's rounding (2^-8 relative,
    accumulated over 4 layers: 5e-2 of the largest gradient)."""
    config = modeling.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = modeling.LlamaForCausalLM(config)
    x, y = torch.randint(96, (2, 16)), torch.randint(96, (2, 16))
    norm = model.model.layers[0].input_layernorm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.randn(2, 3, 64)).dtype == torch.bfloat16
        q, k = torch.randn(1, 4, 3, 16, dtype=torch.bfloat16), torch.randn(1, 2, 3, 16, dtype=torch.bfloat16)
        cos, sin = rope.rotary_cos_sin(torch.arange(3), config, torch.float32)
        assert all(t.dtype == torch.bfloat16 for t in rope.apply_rotary(q, k, cos, sin))
    new_loss, new_grads = _autocast_step(model, x, y)
    monkeypatch.setattr(modeling, "to_compute_dtype", lambda x: x)
    for layer in model.model.layers:
        layer.self_attn.rope_fn = old_rotary
    old_loss, old_grads = _autocast_step(model, x, y)
    assert torch.equal(new_loss, old_loss)
    for name, grad in new_grads.items():
        torch.testing.assert_close(grad, old_grads[name], rtol=0,
                                   atol=5e-2 * old_grads[name].abs().max().item())


@pytest.mark.timeout(900)
def test_compile_matches_eager():
    """--compile (each decoder layer through torch.compile's inductor, C++ kernels on the CPU) trains the tiny
    model as eager does: 3 float32 steps, losses within 1e-5 relative (inductor fuses and reorders float32
    arithmetic, ~1e-7 per operation), the same parameter names (`Module.compile` compiles in place), and one
    graph for all four layers: they share its code."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled_records, compiled = train.main(common.argv("--compile", steps=3))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eager_records, eager = train.main(common.argv(steps=3))
    assert graphs == 1
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    assert ([r["loss"] for r in compiled_records]
            == pytest.approx([r["loss"] for r in eager_records], rel=1e-5))


def test_synthetic_windows_are_seeded_uniform_token_ids():
    """Window i is a pure function of (seed, i): read twice, the same; another seed, others. The ids cover
    [0, vocab_size) and only it. The data-parallel ranks' rows of a global batch are the one-device
    batch's."""
    windows = data.SyntheticWindows(vocab_size=1000, seq_len=511, seed=5)
    assert len(windows) == data.SYNTHETIC_WINDOWS and windows[3]["input_ids"].shape == (512,)
    assert (windows[3]["input_ids"] == windows[3]["input_ids"]).all()
    assert not (windows[3]["input_ids"] == data.SyntheticWindows(1000, 511, seed=6)[3]["input_ids"]).all()
    ids = torch.cat([torch.from_numpy(windows[i]["input_ids"]) for i in range(40)])
    assert ids.min() == 0 and ids.max() == 999 and len(ids.unique()) > 990
    one = sampling.GlobalBatchSampler(windows, seed=5, mbs=4, grad_acc=1).micro_batch(2, 0)[0]
    dp2 = [sampling.GlobalBatchSampler(windows, seed=5, mbs=2, grad_acc=1, dp_size=2).micro_batch(2, 0, r)[0]
           for r in (0, 1)]
    assert torch.equal(one, torch.cat(dp2))


SYNTHETIC_RUN = """
import runpy, sys
sys.modules["datasets"] = None          # `import datasets` now raises ImportError
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("01_single_gpu/train.py", run_name="__main__")
"""


def test_synthetic_run_needs_no_datasets_package_and_writes_no_cache(tmp_path):
    """A run on --dataset synthetic with `datasets` unimportable, in a fresh interpreter: it trains, writes
    nothing under the data cache, and its first loss is that of a uniform guess, ln(vocab_size) within 0.1
    (the initial weights' logits are ~0.02·√C from uniform)."""
    before = sorted(data.DEFAULT_CACHE.rglob("*")) if data.DEFAULT_CACHE.exists() else []
    log = tmp_path / "log.jsonl"
    flags = common.argv("--dataset", "synthetic", "--vocab-size", 512, "--json-log", log, steps=2)
    done = subprocess.run([sys.executable, "-c", SYNTHETIC_RUN, *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    after = sorted(data.DEFAULT_CACHE.rglob("*")) if data.DEFAULT_CACHE.exists() else []
    assert after == before
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 2 and losses[0] == pytest.approx(math.log(512), abs=0.1)


def _parameters(preset):
    args = cli.parse_args(cli.core_parser("t"), ["--preset", preset], files=False)
    with torch.device("meta"):
        model = modeling.LlamaForCausalLM(cli.model_config(args, 257))
    return model.config, sum(p.numel() for p in model.parameters())    # a tied weight is counted once


def test_presets_are_the_published_models():
    """llama3-1b is Llama-3.2-1B as its config.json describes it, with its published 1,235,814,400 parameters
    (tied embeddings); 1b is TinyLlama-1.1B with its 32000-token vocabulary: 1,100,048,384 parameters."""
    config, n = _parameters("llama3-1b")
    assert n == 1_235_814_400
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads) == (128256, 2048, 8192, 16, 32, 8)
    assert config.tie_word_embeddings and config.rope_theta == 500000.0
    assert config.max_position_embeddings == 131072
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config, n = _parameters("1b")
    assert n == 1_100_048_384 and config.vocab_size == 32000 and not config.tie_word_embeddings


@pytest.mark.parametrize("preset, lr", [("tiny", 3e-3), ("small", 3e-3), ("1b", 4e-4), ("llama3-1b", 3e-4)])
def test_default_lr_is_the_presets(preset, lr):
    """Without --lr a run takes its preset's peak learning rate: the published ones for the 1B models
    (TinyLlama 4e-4; Llama 3 3e-4), since 3e-3 made the 1B loss climb (6.2 to 15.3) before it fell.
    --lr wins."""
    parser = cli.core_parser("t")
    assert cli.parse_args(parser, ["--preset", preset], files=False).lr == lr
    assert cli.parse_args(parser, ["--preset", preset, "--lr", "1e-5"], files=False).lr == 1e-5


def test_synthetic_tokens_use_the_models_vocabulary():
    """--dataset synthetic draws from the model's vocabulary: the preset's (llama3-1b: 128256), or
    --vocab-size."""
    small = ["--hidden-size", 32, "--intermediate-size", 64, "--num-layers", 1, "--num-heads", 4,
             "--num-kv-heads", 2]
    for extra, vocab in ((["--preset", "llama3-1b"], 128256), (["--vocab-size", 4096], 4096)):
        argv = [*map(str, extra + small), "--dataset", "synthetic", "--seq-len", "64"]
        _, config, dataset = cli.setup(train.build_parser(), argv)
        assert config.vocab_size == dataset.vocab_size == vocab
        assert max(int(dataset[i]["input_ids"].max()) for i in range(20)) >= vocab * 0.9


@pytest.mark.parametrize("folder", sorted(p.name for p in ROOT.glob("0*_*") if (p / "train.py").exists()))
def test_every_folder_takes_the_fast_path_flags(folder, capsys):
    """Every trainer parses --compile, --dataset synthetic and --preset llama3-1b (they come with 01's
    cli.core_parser), with the preset's values resolved; where the folder's model has MoE layers by default
    (07), --compile is refused in one line naming the fix."""
    trainer = import_module(f"{folder}.train")
    parser = (trainer.build_parser() if hasattr(trainer, "build_parser")
              else trainer.layout.build_parser("t"))
    argv = ["--dataset", "synthetic", "--preset", "llama3-1b"]
    if parser.get_default("num_experts"):
        with pytest.raises(SystemExit) as stop:
            cli.parse_args(parser, ["--compile", *argv], files=False)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and "drop --compile" in err, err
    else:
        argv.append("--compile")
    args = cli.parse_args(parser, argv, files=False)
    assert args.dataset == "synthetic" and args.vocab_size == 128256 and args.lr == 3e-4
    assert args.compile == ("--compile" in argv)
