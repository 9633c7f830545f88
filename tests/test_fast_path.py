"""The trainer's fast path: fused AdamW, SDPA's grouped-query heads, norm and RoPE outputs in the compute
dtype.

Each speed-up is checked against what it replaced: the same numbers (bitwise where the arithmetic is the same,
within a stated tolerance where it is reordered), and the switch itself (the fused kernel is chosen, no K/V
copy is made). float32/float64 on the CPU, except where autocast is the subject.
"""
from importlib import import_module

import torch

import common

cli = import_module("01_single_gpu.cli")
modeling = import_module("01_single_gpu.model")
optim = import_module("01_single_gpu.optim")


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
    return q * cos + modeling.rotate_half(q) * sin, k * cos + modeling.rotate_half(k) * sin


def test_norms_and_rope_hand_the_compute_dtype_on_under_autocast(monkeypatch):
    """Under bf16 autocast over fp32 weights, RMSNorm and RoPE now return bf16, where they returned fp32 that
    each reader cast to bf16 again. The casts move, the values do not: the loss is bitwise that of the old
    outputs (emulated: `compute_dtype` giving the input's dtype, the old fp32 rotation). The gradients differ
    only in where they are summed: a norm output read by q, k, v (gate, up) sums its three (two) bf16
    gradients in bf16 now, in fp32 before, so they agree to bf16's rounding (2^-8 relative, accumulated over
    4 layers: 5e-2 of the largest gradient)."""
    config = modeling.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = modeling.LlamaForCausalLM(config)
    x, y = torch.randint(96, (2, 16)), torch.randint(96, (2, 16))
    norm = model.model.layers[0].input_layernorm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.randn(2, 3, 64)).dtype == torch.bfloat16
        q, k = torch.randn(1, 4, 3, 16, dtype=torch.bfloat16), torch.randn(1, 2, 3, 16, dtype=torch.bfloat16)
        cos, sin = modeling.rotary_cos_sin(torch.arange(3), config, torch.float32)
        assert all(t.dtype == torch.bfloat16 for t in modeling.apply_rotary(q, k, cos, sin))
    new_loss, new_grads = _autocast_step(model, x, y)
    monkeypatch.setattr(modeling, "compute_dtype", lambda x: x.dtype)
    for layer in model.model.layers:
        layer.self_attn.rope_fn = old_rotary
    old_loss, old_grads = _autocast_step(model, x, y)
    assert torch.equal(new_loss, old_loss)
    for name, grad in new_grads.items():
        torch.testing.assert_close(grad, old_grads[name], rtol=0, atol=5e-2 * old_grads[name].abs().max().item())
