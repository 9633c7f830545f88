"""Switch a Llama between PyTorch and the Triton kernels of this folder, from outside the model.

Playbook chapter 4 applied to the model of 01_single_gpu. The model is not edited: it exposes each
fusable piece as a swappable attribute, and `apply_kernels(model, kernels, attn)` assigns them:
RMSNorm modules (rmsnorm.py), every MLP's `act_fn` (swiglu.py), `self_attn.rope_fn` (rope.py) and
`model.loss_fn` (fused_linear_cross_entropy.py) with `--kernels triton`; `self_attn.attn_fn` with
`--attn sdpa | eager | triton` (flash_attention.py). The table is in kernels/README.md.

`apply_kernels(model, "torch", "sdpa")` restores the defaults, so the switch works in both directions.
An RMSNorm is replaced by a `KernelRMSNorm` that holds the *same* weight Parameter: parameter names,
optimizer state and checkpoints do not change.

Order with other transforms: kernels first (01's build_model), then recompute (`apply_recompute` wraps
whatever `attn_fn` it finds; FlashAttention already recomputes P, so "selective" adds little on top),
then the parallel wrappers.

    python 01_single_gpu/train.py --device cuda --dtype bfloat16 --kernels triton --attn triton
    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py     # CPU: same loss and grads as PyTorch
New compared with 01: the model's eager pieces swapped for this folder's kernels; nothing else changes.
"""

import torch
from torch import nn

import model as modeling                          # 01_single_gpu/model.py
import rope

KERNEL_CHOICES = ("torch", "triton")
ATTN_CHOICES = ("sdpa", "eager", "triton")


class KernelRMSNorm(modeling.RMSNorm):
    """The model's RMSNorm with its forward replaced by `kernel(x, weight, eps)`; it shares the weight."""

    def __init__(self, norm: nn.Module, kernel):
        nn.Module.__init__(self)           # skip RMSNorm.__init__: it would create a weight we do not want
        self.weight = norm.weight          # the same Parameter object, not a copy
        self.eps = norm.eps
        self.kernel = kernel

    def forward(self, x):  # (B, T, C)
        return self.kernel(x, self.weight, self.eps)


def _torch_rmsnorm(norm):
    plain = modeling.RMSNorm(norm.weight.shape[0], norm.eps)
    plain.weight = norm.weight
    return plain


def _replace_norms(model: nn.Module, make):
    """Replace every RMSNorm (plain or kernel) by make(old_norm), in place in its parent module."""
    for name, module in list(model.named_modules()):
        if isinstance(module, modeling.RMSNorm):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, make(module))


def _check_triton_can_run():
    # Not the model's device: train.py applies kernels before it moves the model to the GPU.
    import triton
    if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        raise RuntimeError("Triton kernels need a CUDA GPU and none is visible. On CPU, start Python with "
                           "TRITON_INTERPRET=1 to run them in Triton's interpreter (slow: for tests only)")


def apply_kernels(model, kernels: str = "torch", attn: str = "sdpa"):
    """Point every swappable piece of a LlamaForCausalLM at PyTorch or Triton; returns the model.

    kernels: "torch" (eager PyTorch, the model's defaults) or "triton" (RMSNorm, SwiGLU, RoPE and the
             fused linear + cross-entropy of this folder)
    attn:    "sdpa" (F.scaled_dot_product_attention), "eager" (scores materialised) or "triton"
             (kernels/flash_attention.py), always causal
    """
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r}: choose one of {KERNEL_CHOICES}")
    if attn not in ATTN_CHOICES:
        raise ValueError(f"attn={attn!r}: choose one of {ATTN_CHOICES}")
    if "triton" in (kernels, attn):
        _check_triton_can_run()

    if kernels == "triton":   # imported here: the torch path never loads Triton
        from kernels.rmsnorm import rmsnorm
        make_norm = lambda norm: KernelRMSNorm(norm, rmsnorm)  # noqa: E731
        from kernels.swiglu import swiglu as act_fn
        from kernels.rope import apply_rotary as rope_fn
        from kernels.fused_linear_cross_entropy import fused_lm_head_loss as loss_fn
    else:
        make_norm, act_fn, rope_fn, loss_fn = (_torch_rmsnorm, modeling.silu_mul, rope.apply_rotary,
                                               modeling.cross_entropy_loss)
    if attn == "triton":
        from kernels.flash_attention import causal_flash_attention as attn_fn
    else:
        attn_fn = {"sdpa": modeling.sdpa_attention, "eager": modeling.eager_attention}[attn]

    _replace_norms(model, make_norm)
    for layer in model.model.layers:
        layer.self_attn.attn_fn = attn_fn
        layer.self_attn.rope_fn = rope_fn
        layer.mlp.act_fn = act_fn
    model.loss_fn = loss_fn
    return model
