"""Sequence parallelism (Megatron): the norm regions between TP blocks sharded along the sequence.

Playbook §2.4, Korthikanti et al. 2022 ("Reducing activation recomputation in large transformer
models"). Under plain TP every rank holds the full (B, T, C) residual stream and runs the RMSNorms on
all of it. SP keeps it sharded along the sequence, (B, T/t, C), and swaps TP's conjugate pair:

    f  ->  g = all-gather along T forward, reduce-scatter backward
    f̄  ->  ḡ = reduce-scatter along T forward, all-gather backward

g enters a block (before q/k/v and gate/up, and the lm head), ḡ leaves it (after o_proj and down_proj,
and the vocab-parallel embedding); the table of regions is in 05_sequence_context_parallel/README.md.
All-reduce = reduce-scatter + all-gather, so the volume equals TP's: per layer 2 all-gathers and 2
reduce-scatters of b·s·h elements forward, the same backward, 8·b·s·h·(t−1)/t on the wire per rank,
layer and micro-batch. The norm-region activations shrink by t: per layer s·b·h·(34 + 5·a·s/h)/t bytes
(16-bit) instead of TP's s·b·h·(10 + 24/t + 5·a·s/(h·t)). The RMSNorm weights now see only T/t of the
tokens on each rank: their gradients are partial sums, all-reduced over tp before the optimizer step
([PB] §2.4; `all_reduce_norm_gradients`, called by 05's and 08's train_step).

    torchrun --nproc_per_node 2 05_sequence_context_parallel/train.py --tp 2 --sp

New compared with 04: TP's f / f̄ regions swapped for g / ḡ (04's `Regions`), and the norm-gradient sum.
"""

import torch
import torch.distributed as dist

import mixed_precision
import comm
import mappings
import tensor_parallel


def reduce_scatter_along(x, dim, group):
    """(…, n, …) partial on each rank -> (…, n/t, …): this rank's slice of the sum over the group."""
    # exercise 05.1: sequence parallelism's g and ḡ
    # hint: Korthikanti et al. §4.2.2, [PB] §2.4 (05's README, "Sequence parallelism"): an all-reduce is a
    #   reduce-scatter then an all-gather, so TP's f and f̄ split into a pair whose forward and backward are
    #   those two along the sequence; a flat reduce-scatter (comm.py) hands out consecutive pieces, and
    #   mappings.all_gather_along is the other half.
    # test: tests/test_context_parallel.py::test_attention_and_models_match_dense_twins[sp]
    # hides: "all-gather along T forward, reduce-scatter backward"
    #   "reduce-scatter along T forward, all-gather backward"
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()                                 # (n, …)
    out = torch.empty(moved.shape[0] // size, *moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_flat(out.view(-1), moved.view(-1), group=group)   # (n/t, …)
    return out.movedim(0, dim).contiguous()
    # end exercise


class GatherFromSPRegion(torch.autograd.Function):
    """g: all-gather along T forward, reduce-scatter backward.

    Forward (B, T/t, C) -> (B, T, C); backward (B, T, C) partial dL/dx -> (B, T/t, C) summed over tp."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # exercise 05.1
        return mappings.all_gather_along(x, 1, group)
        # end exercise

    @staticmethod
    def backward(ctx, grad):
        # exercise 05.1
        return reduce_scatter_along(grad, 1, ctx.group), None
        # end exercise


class ReduceScatterToSPRegion(torch.autograd.Function):
    """ḡ: reduce-scatter along T forward, all-gather backward.

    Forward (B, T, C) partial -> (B, T/t, C) summed over tp; backward (B, T/t, C) -> (B, T, C)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # exercise 05.1
        return reduce_scatter_along(x, 1, group)
        # end exercise

    @staticmethod
    def backward(ctx, grad):
        # exercise 05.1
        return mappings.all_gather_along(grad, 1, ctx.group), None
        # end exercise


def gather_from_sp_region(x, group):
    """g: all-gather along T forward, reduce-scatter backward."""
    return GatherFromSPRegion.apply(x, group)


def reduce_scatter_to_sp_region(x, group):
    """ḡ: reduce-scatter along T forward, all-gather backward."""
    return ReduceScatterToSPRegion.apply(x, group)


SEQUENCE_PARALLEL = mappings.Regions(enter=gather_from_sp_region, exit=reduce_scatter_to_sp_region)


def check_sequence_parallel(tp: int, local_seq_len: int):
    if tp < 2:
        raise ValueError("--sp shards the norm regions over the tensor-parallel ranks: "
                         "it needs --tp 2 or more")
    if local_seq_len % tp:
        raise ValueError(f"tp={tp} does not divide the sequence each rank holds ({local_seq_len} tokens; "
                         f"seq_len/cp): choose --seq-len a multiple of tp·cp")


def apply_sequence_parallel(model, grid):
    """Tensor parallelism with SP's regions, in place; returns the model."""
    return tensor_parallel.apply_tensor_parallel(model, grid, regions=SEQUENCE_PARALLEL)


def norm_weights(model):
    """The RMSNorm gains, replicated on every tp rank: under SP each saw T/tp of the tokens."""
    return [p for name, p in model.named_parameters() if name.endswith("norm.weight")]


@torch.no_grad()
def all_reduce_norm_gradients(norm_weights, tp_group):
    """Sum the norm-weight gradients over tp (each rank saw T/t tokens): one flat all-reduce. (A ZeRO unit
    under bf16-20 holds them in fp32 `main_grad`s: 01's `main_grad` reads whichever holds them.)"""
    grads = [g for g in map(mixed_precision.main_grad, norm_weights) if g is not None]
    if not grads:                          # (08's ZeRO calls it per unit: the embedding's has no norm)
        return
    flat = torch.cat([g.flatten() for g in grads])                         # (Σ numel,)
    dist.all_reduce(flat, group=tp_group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))
