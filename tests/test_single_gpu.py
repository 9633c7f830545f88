"""01_single_gpu: the reference every other folder is measured against.

Compared here: the model against Hugging Face's `LlamaForCausalLM` (same weights -> same logits),
the training loop against itself under regrouping (micro-batches, recomputation, checkpoints), and
the accounting (parameters, memory) against the formulas in the docstrings. float32/float64 on the
CPU, so a difference means a bug, not rounding; each tolerance says why it is what it is.
"""
import functools
import json
import math
from importlib import import_module

import pytest
import torch

import common

import checkpoint
import model as modeling
import rope
import hf_io
import optim
import memory
import metrics
import recompute
import data
import sampling
train = import_module("01_single_gpu.train")


def tiny_config(**kw):
    base = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    return modeling.LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("kv_heads,tied", [(4, False), (2, True)], ids=["mha", "gqa-tied"])
def test_hf_parity_and_round_trip(tmp_path, kv_heads, tied):
    """Same random weights in transformers' Llama and in ours give the same logits.

    float64 on both sides, and our eager attention, which (like HF's) takes the softmax in float32:
    then only the order of a few float64 operations differs, so 1e-10 is far below anything a
    layout or RoPE convention mistake would produce. The default SDPA core (softmax in float64)
    agrees with the eager one to float32 rounding of the attention weights (1e-6).
    """
    import transformers                  # in requirements.txt: a missing package must fail, not skip
    torch.manual_seed(0)
    ours = modeling.LlamaForCausalLM(tiny_config(num_key_value_heads=kv_heads,
                                                 tie_word_embeddings=tied)).double()
    with torch.no_grad():                # gains ≠ 1, so a norm weight ignored or misplaced shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    hf_io.save_hf(ours, tmp_path / "ckpt")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", torch_dtype=torch.float64,
                                                           attn_implementation="eager").eval()
    ids = torch.randint(0, 96, (2, 19))
    with torch.no_grad():
        sdpa_logits = ours(ids)
        for layer in ours.model.layers:
            layer.self_attn.attn_fn = modeling.eager_attention
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(sdpa_logits, ours(ids), rtol=1e-6, atol=1e-6)
    # ... and back: HF's own save loads into ours and gives the same logits again.
    theirs.save_pretrained(tmp_path / "hf_saved", safe_serialization=True)
    config = hf_io.config_from_hf(tmp_path / "hf_saved", modeling.LlamaConfig)
    reloaded = modeling.LlamaForCausalLM(config).double()
    hf_io.load_hf_into(reloaded, tmp_path / "hf_saved")
    for layer in reloaded.model.layers:
        layer.self_attn.attn_fn = modeling.eager_attention
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids), ours(ids), rtol=0, atol=0)


def test_parameter_count_formula():
    """The docstring's N = 2Vh + L(2h² + 2h·h_kv + 3hf + 2h) + h is what the module holds."""
    c = tiny_config()
    h, f, L, V, hkv = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size, 2 * c.head_dim
    expected = 2 * V * h + L * (2 * h * h + 2 * h * hkv + 3 * h * f + 2 * h) + h
    assert sum(p.numel() for p in modeling.LlamaForCausalLM(c).parameters()) == expected


def test_eager_attention_is_causal_attention_over_shared_kv_heads():
    """`eager_attention` written out equals PyTorch's fused causal attention with each key/value head
    repeated for its 2 query heads (GQA 4:2), and is causal: moving the last position's key and value
    leaves every earlier output bit for bit as it was. float32 (eager's softmax runs in float32): 1e-6."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 7, 8, generator=g) for heads in (4, 2, 2))   # (B, nh or nkv, T, hd)
    out = modeling.eager_attention(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fused = sdpa(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, fused, rtol=1e-6, atol=1e-6)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 1.0
    v2[:, :, -1] += 1.0
    moved = modeling.eager_attention(q, k2, v2)
    assert torch.equal(moved[:, :, :-1], out[:, :, :-1])
    assert not torch.allclose(moved[:, :, -1], out[:, :, -1])


def test_sdpa_with_repeated_kv_heads_equals_sdpa_with_gqa():
    """float32 on CUDA takes `sdpa_repeated_kv` (SDPA's GQA would run its math backend there): the same
    attention as enable_gqa's, head h reading key/value head h // 2 (GQA 4:2), outputs and gradients.
    float32, only the kernels' summation order differs: 1e-6. (That the memory-efficient backend then runs
    is checked on a GPU: tests/test_kernels.py::test_sdpa_float32_gqa_runs_without_the_math_backend.)"""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, heads, 7, 8, generator=g, requires_grad=True) for heads in (4, 2, 2)]
    dy = torch.randn(2, 4, 7, 8, generator=g)
    results = []
    for attention in (modeling.sdpa_attention, modeling.sdpa_repeated_kv):
        out = attention(*inputs)
        results.append([out, *torch.autograd.grad(out, inputs, dy)])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_rotary_embedding_turns_each_pair_by_position_times_frequency():
    """RoPE (RoFormer): the model's `rotary_cos_sin` + `apply_rotary` turn the pair (x_i, x_{i+hd/2}) of
    position m, read as the complex number x_i + i·x_{i+hd/2}, by the angle m·ω_i (ω from `rope_inv_freq`),
    so q·k depends on the positions only through their difference. The angles are float32 as in the model,
    the rest float64: 1e-6 is float32's rounding of angles up to ~30 rad."""
    config = tiny_config(hidden_size=32)                                            # hd = 8
    positions = torch.arange(31)
    cos, sin = rope.rotary_cos_sin(positions, config, torch.float64)            # (T, hd)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 31, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 31, 8, generator=g,
                                                                                     dtype=torch.float64)
    turned_q, turned_k = rope.apply_rotary(q, k, cos, sin)
    angles = (positions.float()[:, None] * rope.rope_inv_freq(config)[None, :]).double()   # (T, hd/2)
    for x, turned in ((q, turned_q), (k, turned_k)):
        z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angles), angles)
        torch.testing.assert_close(turned, torch.cat([z.real, z.imag], dim=-1), rtol=1e-6, atol=1e-6)
    shift = 5                                  # every q and k 5 positions later: the same (T−5, T−5) scores
    scores = turned_q[0, 0, :-shift] @ turned_k[0, 0, :-shift].T
    q_later, k_later = rope.apply_rotary(q[:, :, :-shift], k[:, :, :-shift], cos[shift:], sin[shift:])
    torch.testing.assert_close(q_later[0, 0] @ k_later[0, 0].T, scores, rtol=1e-5, atol=1e-5)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=4"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_heads=5 does not divide hidden_size=48"):
        tiny_config(num_attention_heads=5, num_key_value_heads=5)


def test_sampler_is_deterministic_and_shards_the_global_batch():
    """dp ranks with mbs M read exactly the rows one device reads with mbs dp·M."""
    ds = data.build_dataset("stdlib", data.ByteTokenizer(), common.SEQ_LEN)
    one = sampling.GlobalBatchSampler(ds, seed=5, mbs=6, grad_acc=2)
    sharded = [sampling.GlobalBatchSampler(ds, seed=5, mbs=2, grad_acc=2, dp_size=3) for _ in range(3)]
    for step in (0, 7):
        for micro in range(2):
            x, y = one.micro_batch(step, micro)
            parts = [s.micro_batch(step, micro, dp_rank=r) for r, s in enumerate(sharded)]
            assert torch.equal(x, torch.cat([p[0] for p in parts]))
            assert torch.equal(y, torch.cat([p[1] for p in parts]))
            assert torch.equal(x[:, 1:], y[:, :-1])   # labels are the inputs shifted by one
    assert not torch.equal(one.micro_batch(0, 0)[0], one.micro_batch(1, 0)[0])


def test_loss_falls_on_default_corpus():
    losses, _ = common.single_device_run(steps=25, mbs=8)
    assert losses[0] > 5.0   # ~ln(320): an untrained model guesses uniformly
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


def files_called_from(functions, run) -> dict:
    """{file: names of its functions} of the repository's code that `functions` (code objects) call
    directly, torch's own frames in between skipped (a module's __call__ reaches its forward), in `run()`."""
    import os
    import sys
    root, called = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), {}

    def own(frame):
        return frame.f_code.co_filename.startswith(root) and "/tests/" not in frame.f_code.co_filename

    def on_call(frame, event, arg):
        if event != "call" or not own(frame):
            return
        caller = frame.f_back
        while caller is not None and not own(caller):
            caller = caller.f_back
        if caller is not None and caller.f_code in functions:
            name = os.path.relpath(frame.f_code.co_filename, root)
            called.setdefault(name, set()).add(frame.f_code.co_name)
    sys.setprofile(on_call)
    try:
        run()
    finally:
        sys.setprofile(None)
    return called


def test_one_step_and_its_loop_read_through_six_files(tmp_path):
    """A student follows one step and the loop around it through six files: what loop.train and 01's
    train_step call (a checkpoint saved, so the save is in it) lies in train.py, loop.py, model.py, optim.py,
    mixed_precision.py and metrics.py. The rest (RoPE, the sampler, the checkpoint writer, the stop request,
    the watchdog, the activation meter) is one call further, behind a name in one of them. Autograd calls
    the meter's saved-tensor hooks back during the first step's backward: not a call a student follows."""
    import loop
    functions = {loop.train.__code__, train.train_step.__code__}
    called = files_called_from(functions, lambda: common.single_device_run(
        "--checkpoint-dir", tmp_path / "ckpt", steps=2))
    assert called.pop("01_single_gpu/memory.py") <= {"<lambda>", "__del__"}    # the hooks' unpack, release
    assert set(called) == {"01_single_gpu/train.py", "01_single_gpu/runtime/loop.py",
                           "01_single_gpu/model.py", "01_single_gpu/optim.py",
                           "01_single_gpu/mixed_precision.py", "01_single_gpu/metrics.py"}, called
    assert {"save_if_due", "batches", "stop_agreed"} <= called["01_single_gpu/runtime/loop.py"]
    assert {"lr_at", "set_lr", "clip_grad_norm"} <= called["01_single_gpu/optim.py"]


def test_micro_batches_equal_one_batch():
    """--mbs 4 == --mbs 2 --grad-acc 2: accumulation averages gradients, so only rounding differs
    (float64 to make the comparison tight: 1e-12)."""
    big, big_state = common.single_device_run(steps=3, mbs=4, dtype="float64")
    acc, acc_state = common.single_device_run(steps=3, mbs=2, grad_acc=2, dtype="float64")
    torch.testing.assert_close(torch.tensor(acc), torch.tensor(big), rtol=1e-12, atol=1e-12)
    for name in big_state:
        torch.testing.assert_close(acc_state[name], big_state[name], rtol=1e-10, atol=1e-12)


def test_recompute_modes_give_identical_gradients_and_save_less():
    """Recomputation changes what is stored, never what is computed: gradients are bitwise equal
    (same kernels, same order). Saved activation bytes shrink none > selective > full."""
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 33))
    grads, saved = {}, {}
    for mode in recompute.RECOMPUTE_MODES:
        torch.manual_seed(1)
        model = recompute.apply_recompute(modeling.LlamaForCausalLM(tiny_config()), mode)
        with memory.saved_activation_bytes(exclude=model.parameters()) as meter:
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        grads[mode] = [p.grad for p in model.parameters()]
        saved[mode] = meter.bytes
    for mode in ("selective", "full"):
        for a, b in zip(grads["none"], grads[mode]):
            assert torch.equal(a, b)
    assert saved["none"] > saved["selective"] > saved["full"] > 0


def test_checkpoint_resume_is_bitwise(tmp_path):
    """3 steps + save + resume for 3 more == 6 uninterrupted steps, exactly (losses and weights)."""
    full, full_state = common.single_device_run(steps=6)
    ckpt = tmp_path / "ckpt"
    first, _ = common.single_device_run("--checkpoint-dir", ckpt, "--checkpoint-every", 3, steps=6)
    assert first == full
    import shutil
    shutil.rmtree(ckpt / "step_000006")  # pretend the run stopped after step 3
    log = tmp_path / "resumed.jsonl"
    resumed, resumed_state = common.single_device_run("--checkpoint-dir", ckpt, "--resume", "--json-log", log,
                                                      steps=6)
    assert resumed == full[3:]
    for name in full_state:
        assert torch.equal(resumed_state[name], full_state[name]), name
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [4, 5, 6]


def test_resume_keeps_the_learning_rate_schedule(tmp_path):
    """`--resume --steps 6` after a 3-step run keeps the 3-step cosine: steps 4-6 run at lr·min_lr_ratio
    (the schedule's length is --lr-decay-steps, saved with the checkpoint), never a jump back up."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    common.single_device_run("--checkpoint-dir", ckpt, steps=3)
    common.single_device_run("--checkpoint-dir", ckpt, "--resume", "--json-log", log, steps=6)
    lrs = [json.loads(line)["lr"] for line in log.read_text().splitlines()]
    assert lrs == pytest.approx([3e-3 * 0.1] * 3)
    # A schedule meant to be longer says so from the start; resuming it continues the same curve.
    whole, _ = common.single_device_run("--json-log", tmp_path / "whole.jsonl",
                                        "--lr-decay-steps", 6, steps=6)
    common.single_device_run("--checkpoint-dir", tmp_path / "c2", "--lr-decay-steps", 6, steps=3)
    resumed, _ = common.single_device_run("--checkpoint-dir", tmp_path / "c2", "--resume", steps=6)
    assert resumed == whole[3:]


@pytest.mark.parametrize("flags, message", [
    (["--seq-len", 16], "--seq-len 16 differs from the checkpoint's 32"),
    (["--mbs", 2], "global batch of 2 sequences differs from the checkpoint's 4"),
    (["--grad-acc", 2], "global batch of 8 sequences differs from the checkpoint's 4"),
    (["--lr-decay-steps", 9], "--lr-decay-steps 9 differs from the checkpoint's 1"),
    (["--seed", 7], "--seed 7 differs from the checkpoint's 1234"),
    (["--lr", 1e-3], "--lr 0.001 differs from the checkpoint's 0.003"),
    (["--hidden-size", 64], "--hidden-size 64 differs from the checkpoint's 32"),
    (["--num-kv-heads", 4], "--num-kv-heads 4 differs from the checkpoint's 2"),
    (["--tie-embeddings"], "--tie-embeddings True differs from the checkpoint's False"),
])
def test_resume_refuses_a_different_run(tmp_path, capsys, flags, message):
    """What fixes the model, the data, the batch and the schedule must not change under --resume: the run
    would silently become another one. Each refusal is one line naming the flag, before any training."""
    ckpt = tmp_path / "c"
    common.single_device_run("--checkpoint-dir", ckpt, steps=1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        common.single_device_run("--checkpoint-dir", ckpt, "--resume", *flags, steps=2)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_resume_into_another_model_refuses(tmp_path):
    """A checkpoint resumes into any layout, never into another model: the config is compared first."""
    ckpt = tmp_path / "c"
    common.single_device_run("--checkpoint-dir", ckpt, steps=1)
    model = modeling.LlamaForCausalLM(tiny_config())
    with pytest.raises(ValueError, match="holds another model .*hidden_size 32 vs 48"):
        checkpoint.load_checkpoint(ckpt, model, None, {})


def test_weight_decay_spares_one_dimensional_parameters():
    """AdamW decays the matrices and the embedding (2-D), not the RMSNorm gains (1-D), as nanoGPT and
    Megatron do. With every gradient zero, Adam's update is 0, so one step only applies the decay:
    a matrix shrinks by exactly (1 − lr·wd), a gain stays 1."""
    model = modeling.LlamaForCausalLM(tiny_config())
    args = type("A", (), {"lr": 0.5, "weight_decay": 0.1})()
    opt = optim.make_optimizer(model.parameters(), args)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        factor = 1.0 if p.dim() == 1 else 1 - 0.5 * 0.1
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0, msg=name)
    assert any(p.dim() == 1 for p in model.parameters())


def test_json_log_and_memory_report(tmp_path):
    log = tmp_path / "log.jsonl"
    losses, _ = common.single_device_run("--json-log", log, steps=2)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and [r["loss"] for r in records] == losses
    model = modeling.LlamaForCausalLM(tiny_config())
    opt = optim.make_optimizer(model.parameters(), type("A", (), {"lr": 1e-3, "weight_decay": 0.0})())
    n = sum(p.numel() for p in model.parameters())
    report = memory.memory_report(model.parameters(), opt, activations=0)
    # fp32: 16 bytes/param
    assert (report.parameters, report.gradients, report.optimizer) == (4 * n, 4 * n, 8 * n)
    model(torch.randint(0, 96, (1, 8)), labels=torch.randint(0, 96, (1, 8))).backward()
    opt.step()
    # measured: exp_avg + exp_avg_sq
    assert memory.memory_report(model.parameters(), opt, 0).optimizer == 8 * n


def test_hfu_counts_the_recomputed_forward_and_profile_writes_a_trace(tmp_path):
    """HFU/MFU in --json-log against the FLOP counts written out here from the model's shapes, and
    --profile's trace: Chrome-trace JSON that parses and holds the recorded step's ops.

    Per token, P matmul parameters (all but the embedding), P_L of them in the layers, L layers, h, s:
    model FLOPs 6·P + 12·L·h·s; full recompute reruns the layers' forward, + 2·P_L + 4·L·h·s, so the
    layers count 8 instead of 6 per parameter (4/3: Megatron's 96 vs 72·B·s·L·h²); selective reruns
    only the attention core, + 4·L·h·s. Both ratios hold to float rounding (1e-12): the same seconds
    divide both. The profiler skips step 1, warms up on step 2 and records step 3 (ProfilerStep#2).
    """
    config = modeling.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)   # common.TINY's model
    model = modeling.LlamaForCausalLM(config)
    P = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    P_L = sum(p.numel() for p in model.model.layers.parameters())
    attention = 4 * config.num_hidden_layers * config.hidden_size * common.SEQ_LEN      # one forward's
    model_flops = 6 * P + 3 * attention
    expected = {"full": (model_flops + 2 * P_L + attention) / model_flops,
                "selective": (model_flops + attention) / model_flops}
    assert (6 * P_L + 3 * attention) * 4 / 3 == 8 * P_L + 4 * attention          # the layers' 4/3
    for mode, steps in (("full", 3), ("selective", 1)):
        log = tmp_path / f"{mode}.jsonl"
        profile = ("--profile", tmp_path / "trace") if mode == "full" else ()
        common.single_device_run("--recompute", mode, "--peak-tflops", 1,
                                 "--json-log", log, *profile, steps=steps)
        for record in map(json.loads, log.read_text().splitlines()):
            assert record["hfu"] / record["mfu"] == pytest.approx(expected[mode], rel=1e-12), mode
    (trace,) = (tmp_path / "trace").glob("rank0.*.pt.trace.json")
    names = {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}
    assert "ProfilerStep#2" in names and "ProfilerStep#1" not in names             # step 3 only
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names                     # forward/backward, AdamW
    assert any(name.startswith("autograd::engine::evaluate_function") for name in names)   # the backward


def test_mfu_and_hfu_flops_per_token_written_out_from_the_shapes():
    """MFU's FLOPs per token ([PB] §2.1, PaLM App. B), written out from the shapes: 6 per parameter a token
    multiplies (2 forward, 4 backward): each layer's q, k, v, o, gate, up and down, the head, and the norm
    gains (2h a layer and h: counted too, 0.1% of the total); not the embedding, a lookup, unless the head
    shares its weight (then it is the head's, counted once). Plus 12·L·h·s for QKᵀ and AV. HFU adds what
    recomputation runs again: full, one forward of the layers (2 per layer parameter, 4·L·h·s); selective,
    the attention core's (4·L·h·s)."""
    for tied in (False, True):
        c = tiny_config(tie_word_embeddings=tied)
        h, f, L, V, s = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size, 64
        h_kv = c.num_key_value_heads * c.head_dim
        layers = L * (2 * h * h + 2 * h * h_kv + 3 * h * f + 2 * h)
        model_flops = 6 * (layers + h + V * h) + 12 * L * h * s
        assert metrics.flops_per_token(c, s) == model_flops, tied
        hfu = {mode: metrics.hardware_flops_per_token(model_flops, c, s, mode)
               for mode in recompute.RECOMPUTE_MODES}
        assert hfu == {"none": model_flops, "selective": model_flops + 4 * L * h * s,
                       "full": model_flops + 2 * layers + 4 * L * h * s}, tied


def test_activation_estimate_matches_playbook_formula():
    """Korthikanti et al. Table 2 (the playbook's ref. [9]), per layer in 16-bit bytes."""
    c = tiny_config()
    s, b, h, a, L = 64, 2, c.hidden_size, c.num_attention_heads, c.num_hidden_layers
    estimate = functools.partial(memory.activation_bytes_estimate, c, b, s, 2)
    assert estimate() == int(L * s * b * h * (34 + 5 * a * s / h))
    assert estimate("full") == L * 2 * s * b * h
    assert estimate("selective") == L * 34 * s * b * h
    assert estimate("none", tp=4) == int(L * s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert estimate("selective", tp=4) == int(L * s * b * h * (10 + 24 / 4))     # TP without SP
    assert estimate("none", tp=4, sp=True) == int(L * s * b * h * (34 + 5 * a * s / h) / 4)
    assert estimate("selective", tp=4, sp=True) == int(L * 34 * s * b * h / 4)


def test_measured_activations_follow_the_step(capsys):
    """The meter's peak is what is held at once: with two micro-batches the first one's activations are
    freed by its backward before the second forward, so the step's peak equals one micro-batch's saved
    bytes; each trainer prints that peak after its first step, after the table of estimates (01's, run
    in-process: a fresh interpreter costs seconds and proves nothing here)."""
    torch.manual_seed(0)
    model = modeling.LlamaForCausalLM(tiny_config())
    ids = torch.randint(0, 96, (2, 2, 33))
    with memory.saved_activation_bytes(exclude=model.parameters()) as one:
        model(ids[0, :, :-1], labels=ids[0, :, 1:])
    with memory.saved_activation_bytes(exclude=model.parameters()) as step:
        for x in ids:
            model(x[:, :-1], labels=x[:, 1:]).backward()
    assert step.peak == one.bytes == one.peak and step.bytes >= one.bytes
    assert step.live == 0                                           # everything was released by backward
    printed = {}
    for mode in ("none", "selective"):
        capsys.readouterr()
        train.main(common.argv("--recompute", mode, steps=1))
        out = capsys.readouterr().out
        line = next(stdout_line for stdout_line in out.splitlines()
                    if stdout_line.startswith("activations saved for backward in step 1"))
        printed[mode] = float(line.split("peak ")[1].split(" MiB")[0])
        assert "activations (estimate)" in out
    assert 0 < printed["selective"] < printed["none"]


def test_cli_help_documents_the_contract(capsys):
    """`--help` (in-process; `python 01_single_gpu/train.py` itself starts in gpu_run's smoke run and in
    test_bad_inputs' fresh interpreters)."""
    with pytest.raises(SystemExit) as stop:
        train.main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    for flag in ("--hidden-size", "--intermediate-size", "--num-layers", "--num-heads", "--num-kv-heads",
                 "--seq-len", "--mbs", "--grad-acc", "--steps", "--lr", "--seed", "--dtype", "--device",
                 "--recompute", "--json-log", "--checkpoint-dir", "--checkpoint-every", "--resume",
                 "--init-from"):
        assert flag in out, flag


def test_every_flag_has_help():
    """08's parser holds every trainer's flags (01's core, 02-07's degrees and techniques): none without
    help."""
    parser = import_module("layout_5d").build_parser("08")
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert bare == []


def test_init_from_hf_directory(tmp_path):
    """--init-from loads the HF weights: the first logged loss is that model's loss on batch 0."""
    torch.manual_seed(3)
    source = modeling.LlamaForCausalLM(modeling.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2))
    hf_io.save_hf(source, tmp_path / "hf")
    losses, _ = common.single_device_run("--init-from", tmp_path / "hf", steps=1)
    ds = data.build_dataset("stdlib", data.ByteTokenizer(), common.SEQ_LEN)
    x, y = sampling.GlobalBatchSampler(ds, seed=1234, mbs=4, grad_acc=1).micro_batch(0, 0)
    with torch.no_grad():
        assert losses[0] == pytest.approx(source(x, labels=y).item(), rel=1e-6)


def test_bfloat16_autocast_trains_with_fp32_master_weights():
    """bf16 autocast with fp32 master weights: the weights stay fp32, and the losses differ from the fp32
    run's by bf16 rounding (so the flag is not ignored) but by no more (so nothing else changed)."""
    losses, state = common.single_device_run(steps=2, dtype="bfloat16")
    reference, _ = common.single_device_run(steps=2)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert losses != reference and max(abs(a - b) for a, b in zip(losses, reference)) < 1e-2


def test_local_text_and_jsonl_sources(tmp_path):
    """The user paths work offline: a .txt file and a .jsonl file with a named text column."""
    (tmp_path / "a.txt").write_text("hello world " * 40)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": f"document {i} " * 20})
                                                for i in range(5)))
    tok = data.ByteTokenizer()
    txt = data.build_dataset(str(tmp_path / "a.txt"), tok, 15, cache_dir=tmp_path / "cache")
    assert len(txt) == (480 + 1) // 16 and tok.decode(txt[0]["input_ids"]) == "hello world hell"
    jsonl = data.build_dataset(str(tmp_path / "b.jsonl"), tok, 15, cache_dir=tmp_path / "cache",
                               text_column="body")
    assert tok.decode(jsonl[0]["input_ids"]).startswith("document 0")
    with pytest.raises(ValueError, match="pass --text-column"):
        data.build_dataset(str(tmp_path / "b.jsonl"), tok, 7, cache_dir=tmp_path / "cache")


def test_parquet_source_and_local_hf_tokenizer(tmp_path):
    """An HF tokenizer saved in a local directory (built here, offline) and a .parquet file, end to end
    through train.run: the vocabulary comes from the tokenizer and the windows decode to the text.
    (pandas writes the parquet file; it comes with `datasets`.)"""
    import pandas
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(30)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    text = " ".join(f"w{i % 30}" for i in range(400))
    pandas.DataFrame({"text": [text, text]}).to_parquet(tmp_path / "docs.parquet")
    tok = data.load_tokenizer(str(tmp_path / "tok"))
    windows = data.build_dataset(str(tmp_path / "docs.parquet"), tok, 7, cache_dir=tmp_path / "cache")
    assert tok.vocab_size == 32 and tok.eos_token_id == 0
    assert (list(windows[0]["input_ids"]) == [2, 3, 4, 5, 6, 7, 8, 9]
            and tok.decode(windows[0]["input_ids"][:2]) == "w0 w1")
    records, model = train.main(common.argv(steps=2, mbs=2) + [
        "--dataset", str(tmp_path / "docs.parquet"), "--tokenizer", str(tmp_path / "tok")])
    losses = [r["loss"] for r in records]
    assert model.config.vocab_size == 64 and len(records) == 2          # 32 rounded up to a multiple of 64
    # untrained: uniform over the 64 logits
    assert losses[0] == pytest.approx(math.log(64), abs=0.1)
    assert losses[1] < losses[0]
