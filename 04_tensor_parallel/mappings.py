"""Megatron's region functions: how activations enter and leave a tensor-parallel region.

Playbook §2.3, Megatron-LM (Shoeybi et al. 2019 §3, Fig. 3; `mappings.py` of its code). Four
autograd functions in two pairs, one's forward the other's backward:

    f   copy_to_tp_region      forward identity          backward all-reduce (sum)
    f̄   reduce_from_tp_region  forward all-reduce (sum)  backward identity
        gather_from_tp_region  forward all-gather        backward keep this rank's slice
        scatter_to_tp_region   forward keep the slice    backward all-gather

A column-then-row block is entered through f and left through f̄ (tensor_parallel.py); `Regions` names
the pair a model uses, so sequence parallelism (05) swaps in its all-gather / reduce-scatter.

    torchrun --nproc_per_node 4 04_tensor_parallel/train.py --tp 4 --num-kv-heads 4

New compared with 02: collectives inside forward and backward, not after backward.
Shape legend (model.py): B batch, T sequence, C hidden, t = tp size.
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import comm


# ======================================================================================
# The four region functions (Megatron's f, f̄ and the gather/scatter pair)
# ======================================================================================
def all_gather_along(x, dim, group):
    """(…, n/t, …) on each rank -> (…, n, …): the shards concatenated along `dim` in rank order."""
    size = dist.get_world_size(group)
    flat = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather_flat(flat, x.movedim(dim, 0).contiguous().flatten(), group=group)   # (t·numel,)
    gathered = flat.view(size * x.shape[dim], *x.movedim(dim, 0).shape[1:])              # (n, …)
    return gathered.movedim(0, dim).contiguous()


def split_along(x, dim, group):
    """(…, n, …) -> this rank's (…, n/t, …) slice; no communication."""
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class CopyToTPRegion(torch.autograd.Function):
    """f (enters a column-parallel block): forward identity, backward all-reduce (sum) over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # exercise 04.1: Megatron's f and f̄
        # hint: [MEG] §3 Fig. 3 (04's README, "Derivations"): each rank's column shard gives only its part of
        #   dL/dX, and each row shard only a partial Y; the other direction of each needs nothing. An
        #   all-reduce works in place, so it must not overwrite a tensor autograd still holds. A backward
        #   returns one gradient per forward input.
        # test: tests/test_tensor_parallel.py::test_parallel_layers_match_dense_twins[f-and-f-bar]
        # hides: "forward identity          backward all-reduce (sum)"
        #   "forward all-reduce (sum)  backward identity"
        #   "forward identity, backward all-reduce (sum) over the group"
        #   "forward all-reduce (sum) over the group, backward identity"
        #   "identity forward, all-reduce backward" "all-reduce forward, identity backward"
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)                     # (B, T, C) summed over tp
        return grad, None
        # end exercise


class ReduceFromTPRegion(torch.autograd.Function):
    """f̄ (leaves a row-parallel block): forward all-reduce (sum) over the group, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        # exercise 04.1
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)                            # (B, T, C) summed over tp
        return x
        # end exercise

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTPRegion(torch.autograd.Function):
    """Forward all-gather along the last dim ((…, n/t) -> (…, n)); backward keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, -1, ctx.group), None


class ScatterToTPRegion(torch.autograd.Function):
    """Forward keep this rank's slice of the last dim ((…, n) -> (…, n/t)); backward all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, -1, ctx.group), None


def copy_to_tp_region(x, group):
    """f: identity forward, all-reduce backward."""
    return CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x, group):
    """f̄: all-reduce forward, identity backward."""
    return ReduceFromTPRegion.apply(x, group)


def gather_from_tp_region(x, group):
    return GatherFromTPRegion.apply(x, group)


def scatter_to_tp_region(x, group):
    return ScatterToTPRegion.apply(x, group)


@dataclass(frozen=True)
class Regions:
    """How activations enter the column-parallel linears and leave the row-parallel ones (and the
    vocab-parallel embedding). Sequence parallelism (05) swaps in all-gather / reduce-scatter."""
    enter: Callable   # (x, group) -> x as every column shard needs it
    exit: Callable    # (partial x, group) -> x summed over the group


TENSOR_PARALLEL = Regions(enter=copy_to_tp_region, exit=reduce_from_tp_region)
