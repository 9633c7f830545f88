"""ZeRO-R's P_a: the activation checkpoints of full recomputation partitioned over the tensor-parallel ranks.

ZeRO §6.1 and §8 (Rajbhandari et al. 2020), Megatron-LM's --distribute-saved-activations; playbook §2.1
(recomputation) and §2.3 (TP). Under --recompute full each layer keeps only its input (B, T, C) for
backward (01's recompute.py). Under TP that input is replicated: the t ranks keep t identical copies.
P_a keeps 1/t of it per rank and all-gathers it when backward reaches the layer:

    forward   y = layer(x) without keeping its activations; keep x's slice tp_rank along C: (B, T, C/t)
    backward  x = all-gather of the t slices (B, T, C); rerun y = layer(x) with grad; backpropagate dL/dy

Checkpoint bytes per rank: L·b·s·h·e → L·b·s·h·e/t ("reduced by the MP degree", ZeRO §6.1), e bytes per
element. Cost: one all-gather per layer and micro-batch, (t−1)/t·b·s·h·e wire bytes, beside the 12·b·s·h
of TP's all-reduces with recompute (ZeRO §8: under 10% of MP's volume). Numerics are unchanged: the same
forward is rerun on the same input. With 05's sequence parallelism the layer input is already sharded
along T, (B, T/t, C), and there is nothing left to partition: P_a is for TP without SP.

    torchrun --nproc_per_node 2 04_tensor_parallel/train.py --tp 2 --recompute full --partition-activations

New compared with 01's recompute.py: the checkpoint is an autograd Function here, so that what it saves for
backward is a slice. Shape legend as in tensor_parallel.py (t = tp size).
"""
import functools
from importlib import import_module

import torch

tensor_parallel = import_module("04_tensor_parallel.tensor_parallel")


class PartitionedCheckpoint(torch.autograd.Function):
    """forward: `layer(x, cos, sin)` without storing its activations, saving x's (B, T, C/t) slice;
    backward: all-gather x (B, T, C), recompute the layer with grad, return dL/dx and the parameters'
    gradients. The parameters are inputs of the Function, so autograd accumulates their gradients in the
    model's own backward (02's gradient hooks fire there, as without P_a)."""

    @staticmethod
    def forward(ctx, layer, group, x, cos, sin, *params):                # x (B, T, C), equal on every tp rank
        device = x.device.type
        ctx.layer, ctx.group, ctx.params = layer, group, params
        ctx.autocast = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        ctx.save_for_backward(tensor_parallel.split_along(x, -1, group), cos, sin)   # (B, T, C/t)
        y, aux = layer(x, cos, sin)                                      # grad is off inside forward
        if torch.is_tensor(aux):
            raise ValueError("--partition-activations recomputes layers without an auxiliary loss (no MoE)")
        return y                                                         # (B, T, C)

    @staticmethod
    def backward(ctx, grad_y):                                           # (B, T, C)
        shard, cos, sin = ctx.saved_tensors
        x = tensor_parallel.all_gather_along(shard, -1, ctx.group)      # (B, T, C/t) -> (B, T, C)
        x.requires_grad_(True)
        enabled, dtype = ctx.autocast
        # The recomputed activations live only during this layer's backward. Kept out of 01's meter
        # (memory.saved_activation_bytes) as torch's checkpoint keeps its own: both report the checkpoints.
        with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y, _ = ctx.layer(x, cos, sin)                                # the forward again, TP's f/f̄ included
        grads = torch.autograd.grad(y, (x, *ctx.params), grad_y, allow_unused=True)
        return None, None, grads[0], None, None, *grads[1:]


def apply_partitioned_recompute(model, tp_group):
    """--recompute full with P_a: every decoder layer's forward becomes a PartitionedCheckpoint."""
    for layer in model.model.layers:
        inner, params = layer.forward, tuple(p for p in layer.parameters() if p.requires_grad)

        @functools.wraps(inner)
        def forward(x, cos, sin, inner=inner, params=params):
            return PartitionedCheckpoint.apply(inner, tp_group, x, cos, sin, *params), 0.0
        layer.forward = forward
    return model


def add_arguments(parser):
    g = parser.add_argument_group("ZeRO-R P_a (04)")
    g.add_argument("--partition-activations", action="store_true",
                   help="with --recompute full: each tp rank keeps 1/tp of every layer's checkpointed input")
    return g


def check_partition_activations(args):
    """P_a partitions full recomputation's checkpoints over tp ranks: it needs both."""
    if args.partition_activations and (args.recompute != "full" or args.tp < 2):
        raise ValueError("--partition-activations splits the checkpoints of --recompute full over the tp "
                         "ranks: add --recompute full and --tp 2 or more")
