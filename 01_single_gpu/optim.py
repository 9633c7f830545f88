"""The optimizer and its learning-rate schedule: plumbing every trainer shares, not a technique.

AdamW (Loshchilov & Hutter) with Llama's β = (0.9, 0.95), decoupled weight decay on the matrices and
embeddings only, and the schedule of playbook §2.1's training runs: a linear warm-up to --lr over
--warmup-steps, then a cosine decay to lr·min_lr_ratio at step --lr-decay-steps (default --steps), flat
after it. AdamW runs as its fused kernel (`fused`). Parallel folders keep this optimizer and change only
which tensors it steps (ZeRO: shards).
`SkipNonFinite` makes a step with NaN/inf gradients change nothing (--on-nonfinite skip).
"""
import math

import torch
import torch.distributed as dist

FUSED_DEVICES = ("cpu", "cuda")   # the devices this project trains on; torch ≥ 2.4 has fused AdamW for both


def decays(p) -> bool:
    """Weight decay applies to the matrices and the embedding (2-D), not to the RMSNorm gains (1-D):
    nanoGPT's and Megatron's rule, since shrinking a gain only rescales its layer. A ZeRO shard is a
    flat 1-D piece of several parameters: it says what it holds through a `decays` attribute."""
    return getattr(p, "decays", p.dim() >= 2)


def fused(params) -> bool:
    """AdamW's fused kernel (one kernel per step for all tensors) wherever torch has one for their device:
    CUDA and, since torch 2.4, the CPU. It reads each tensor once per step, where the default `foreach`
    path runs a dozen element-wise passes. Per element it is the same arithmetic whatever the tensor's
    shape, so ZeRO's flat shards (03) and host masters (offload) step exactly as 01's whole parameters.
    The kernel walks a parameter's memory as if it were contiguous: a strided one keeps the `foreach` path
    (04's tp 2 from --init-from with tied embeddings diverged from 01 at step 2 without this rule)."""
    return all(p.device.type in FUSED_DEVICES and p.is_floating_point() and p.is_contiguous() for p in params)


def make_optimizer(params, args):
    """AdamW (β = 0.9, 0.95, as Llama) with decoupled weight decay on the parameters `decays` picks."""
    params = list(params)
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": args.weight_decay},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    fast = fused(params)
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=fast)
    if fast:
        optimizer.register_step_pre_hook(match_gradient_layouts)
    return optimizer


def match_gradient_layouts(optimizer, args, kwargs):
    """Before a fused step: a strided gradient (a transposed view) is made contiguous, as its parameter
    is. The fused kernel walks both memories in step, element by element: torch's CPU kernel misreads
    such a gradient without a word."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()


def lr_at(step: int, args) -> float:
    """Linear warm-up to --lr, then cosine decay to lr·min_lr_ratio at step --lr-decay-steps (default:
    the last step), and lr·min_lr_ratio after it."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    decay_steps = args.lr_decay_steps or args.steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, decay_steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def total_norm(grads) -> torch.Tensor:
    """‖g‖ over `grads`, accumulated in fp32 at least. torch's get_total_norm returns the gradients' dtype:
    bf16-16's bf16 gradients would get a norm of 3 significant digits, and be clipped by it. Megatron takes
    the norm of its fp32 main gradients; 03's, 04's and 06's norms sum their squares in fp32 too."""
    grads = [g for g in grads if g is not None]
    if not grads or grads[0].dtype not in (torch.float16, torch.bfloat16):
        return torch.nn.utils.get_total_norm(grads)            # fp32, fp64: torch's own
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])   # (n,) fp32
    return torch.linalg.vector_norm(norms)


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ by `total_norm` (0: no clip, only the norm); returns the norm."""
    params = [p for p in params if p.grad is not None]
    norm = total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm or float("inf"), norm)
    return norm


def set_lr(optimizer, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr


class SkipNonFinite:
    """While installed, `optimizer.step()` changes nothing when a gradient holds NaN or inf on any rank.

    The check runs as a step pre-hook, after the trainer clipped (a NaN norm makes every clipped gradient
    NaN): every gradient is dropped before AdamW runs, and AdamW skips parameters without one, so neither
    the parameters nor the moments nor the step count move. All ranks decide together, through one
    all-reduce (max) of the flag, as mixed-precision loss scalers do (Megatron's found_inf): a rank holding
    a shard of finite gradients skips with the rank whose shard overflowed. `skipped` says what the last
    step did. `device`: where the flag is all-reduced (the trainer's: NCCL takes only CUDA tensors, and
    03's offloaded optimizer steps host tensors); default: the first stepped tensor's.
    """

    def __init__(self, optimizer, device=None):
        self.skipped, self.device = False, device
        self.handle = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        bad = torch.zeros((), device=self.device or params[0].device)
        # host gradients (offloaded): the flag is copied to the device
        if grads:
            bad = torch.stack([~torch.isfinite(g).all() for g in grads]).any().to(bad)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.skipped = bool(bad)
        if self.skipped:
            for p in params:
                p.grad = None

    def remove(self):
        self.handle.remove()
