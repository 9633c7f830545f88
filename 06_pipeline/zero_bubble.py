"""Zero Bubble's backward split: B computes dX = dY·W at once, W runs dW = dYᵀ·X later.

Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241) §2 and Megatron-LM's
`WeightGradStore`; playbook §2.6 (zero bubble). For a linear layer Y = X·Wᵀ the backward is two
independent matmuls:

    B (input gradient, on the critical path)   dX = dY·W       (…, out)·(out, in) -> (…, in)
    W (weight gradient, can wait)              dW = dYᵀ·X      (out, N)·(N, in)   -> (out, in)

`split_linear` is that layer as an autograd Function: its backward computes dX, and dW too unless a
`WeightGradStore` is collecting, in which case it queues (W, X, dY) under the store's key. A ZB B pass
is then an ordinary backward run while the store collects for (micro-batch, chunk); its W pass
(`WeightGradStore.run`) does the queued matmuls and adds them into `.grad` in place (ZeRO-1's `.grad`
is a view into a flat buffer) through autograd's AccumulateGrad, whose gradient hooks 08's data
parallelism listens to: matmuls only, no communication of its own. The split sits at the local matmul,
before a row-parallel layer's exit collective (04's `linear_fn`), so every collective's backward runs
once, in B. What gets its gradient in B anyway, and how full recomputation composes: README.md.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule zb-h1 --grad-acc 8

`split_weight_gradients(stages, store)` applies it from outside: 04's parallel linears get their
`linear_fn` swapped, every plain nn.Linear (q/k/v/o, gate/up/down, lm_head, 07's router and shared
experts) its forward. New compared with 1F1B: the backward in two passes (`train_step_zb_h1`).
Shape legend: N tokens (…), in / out the layer's input / output features.
"""
import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """The deferred dW matmuls of this rank, one queue per (micro-batch, chunk) key."""

    def __init__(self):
        self.queues, self.collecting = {}, None

    @contextlib.contextmanager
    def collect(self, key):
        """While open, split linears queue their dW under `key` instead of computing it (a ZB B pass)."""
        self.queues[key], self.collecting = [], key
        try:
            yield
        finally:
            self.collecting = None

    def pending(self) -> int:
        """Keys whose W has not run yet (their X and dY are held)."""
        return len(self.queues)

    def run(self, key):
        """The W pass of `key`: dW = dYᵀ·X for every queued linear, added into its weight's .grad."""
        dws = {}                    # weight -> its Σ dW (one hook call per weight and pass, as in a B)
        with torch.no_grad():
            for weight, x, dy in self.queues.pop(key):
                dw = weight_gradient(x, dy).to(weight.dtype)       # bf16 dW into the fp32 master gradient
                dws[weight] = dws[weight] + dw if weight in dws else dw   # tensors hash by identity
        for weight, dw in dws.items():
            accumulate_grad(weight, dw)


def weight_gradient(x, dy):
    """dW = dYᵀ·X: x (…, in), dy (…, out) -> (out, in), in their (autocast) dtype."""
    return dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])    # (out, N)·(N, in)


def accumulate_grad(weight, dw):
    """Autograd's own AccumulateGrad: `dw` added into .grad in place (set if None), then the weight's
    post-accumulate-grad hooks run, so 02's and 03's gradient-ready hooks fire on a W pass as on a B."""
    torch.autograd.backward(weight, dw)         # a leaf: its only node is AccumulateGrad


class SplitLinear(torch.autograd.Function):
    """Y = X·Wᵀ; backward: dX now, dW now or queued in `store` (see the module docstring). The weight comes
    in a box autograd does not look into: dW always enters .grad through `accumulate_grad`, at once or in
    W, so its gradient hooks run once per contribution (autograd runs an input's hooks even when its
    backward gives it no gradient: a B would run them on what earlier Ws left in .grad)."""

    @staticmethod
    def forward(ctx, x, weight_box, dtype, store):
        weight, = weight_box
        w = weight.detach().to(dtype)              # autocast's cast of the fp32 master weight (bf16)
        ctx.save_for_backward(x, w)                # through save_for_backward: recomputation manages them
        ctx.store, ctx.weight = store, weight
        return F.linear(x, w)                      # (…, in) -> (…, out)

    @staticmethod
    def backward(ctx, dy):                         # dy (…, out)
        x, w = ctx.saved_tensors
        # exercise 06.4: zero bubble's B and W
        # hint: Qi et al. 2023 §2 (06's README, "Zero bubble: B and W"): of a linear layer's two backward
        #   matmuls only dX is on the critical path; dW waits in the store while it is collecting (a B
        #   pass) and enters .grad through accumulate_grad either way; the Function returns one gradient
        #   per forward input.
        # test: tests/test_zero_bubble.py::test_split_linear_under_bf16_autocast_matches_f_linear
        if ctx.weight.requires_grad:
            if ctx.store.collecting is not None:
                ctx.store.queues[ctx.store.collecting].append((ctx.weight, x, dy))
            else:
                accumulate_grad(ctx.weight, weight_gradient(x, dy).to(ctx.weight.dtype))
        return dy @ w, None, None, None            # (…, out)·(out, in) -> (…, in)
        # end exercise


def split_linear(x, weight, store):
    """F.linear(x, weight) (no bias) whose dW the store can defer; computes in autocast's dtype when
    autocast is on (bf16 matmuls, fp32 master weight), as F.linear does."""
    if not x.requires_grad:        # autograd would never run the backward (the weight is not its input)
        return F.linear(x, weight)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):     # the Function casts itself: no second cast inside
        return SplitLinear.apply(x.to(dtype), (weight,), dtype, store)


def _split_forward(module, store):
    def forward(x):                                                          # (…, in) -> (…, out)
        return split_linear(x, module.weight, store)
    return forward


def split_weight_gradients(model: nn.Module, store: WeightGradStore):
    """Route every linear layer's dW of `model` through `store`, in place; returns the model."""
    for name, module in model.named_modules():
        if hasattr(module, "linear_fn"):           # 04's Column/RowParallelLinear: the local matmul
            module.linear_fn = functools.partial(split_linear, store=store)
        elif isinstance(module, nn.Linear):
            if module.bias is not None:
                raise ValueError(f"{name} has a bias: the split linear (ZB-H1) handles weight-only layers")
            module.forward = _split_forward(module, store)
    return model
