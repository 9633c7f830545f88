"""ZeRO-R's P_a: the activation checkpoints of full recomputation partitioned over the tensor-parallel ranks.

ZeRO §6.1 and §8 (Rajbhandari et al. 2020), Megatron-LM's --distribute-saved-activations; playbook §2.1
(recomputation) and §2.3 (TP). Under --recompute full each layer keeps only its input (B, T, C) for
backward (01's recompute.py). Under TP that input is replicated: the t ranks keep t identical copies.
P_a keeps 1/t of it per rank and all-gathers it when backward reaches the layer:

    forward   y = layer(x) without keeping its activations; keep x's slice tp_rank along C: (B, T, C/t)
    backward  x = all-gather of the t slices (B, T, C); the layer's forward reruns from it (torch's
              checkpoint: refilling what backward needs), then dL/dy flows back through the layer

Checkpoint bytes per rank: L·b·s·h·e → L·b·s·h·e/t ("reduced by the MP degree", ZeRO §6.1), e bytes per
element. Cost: one all-gather per layer and micro-batch, (t−1)/t·b·s·h·e wire bytes (ZeRO §8: under 10%
of TP's all-reduce volume with recompute). Numerics are unchanged: the same forward reruns on the same
input. 05 and 08 apply it too: under CP the checkpoint is (B, T/cp, C), distinct per cp rank, so only tp
divides it; with 05's SP it is already (B, T/t, C) per rank and --sp refuses it (P_a is TP-without-SP's).

    torchrun --nproc_per_node 2 04_tensor_parallel/train.py --tp 2 --recompute full --partition-activations

New compared with 01's recompute.py: torch's checkpoint is given the slice as its argument (what it keeps) and
the whole input only for the forward. Shape legend as in tensor_parallel.py (t = tp size).
"""
import functools

from torch.utils.checkpoint import checkpoint

import recompute
import mappings


def partitioned_checkpoint(layer_forward, tp_group):
    """`layer_forward(x, cos, sin)`, checkpointed by torch's (non-reentrant) checkpoint on x's slice: the
    checkpoint keeps its arguments, and the argument here is (B, T, C/t). The whole x is handed to the
    first run alone (no communication in forward); the recomputation in backward all-gathers it. Backward
    runs through the forward's own graph (torch's checkpoint only refills the saved tensors), so dL/dx is
    whole and the parameters' gradients accumulate as without P_a."""
    @functools.wraps(layer_forward)
    def forward(x, cos, sin):                                            # x (B, T, C), equal on every tp rank
        # exercise 04.5: ZeRO-R's partitioned activation checkpoints
        # hint: ZeRO §6.1 (04's README, "Derivations"; 01's recompute.py): torch's non-reentrant checkpoint
        #   keeps the arguments it is given and reruns its function on them in backward, so give it this
        #   rank's 1/t slice of x and a function that uses the whole x the first time it runs (forward:
        #   no communication) and rebuilds x from the t slices when it runs again (backward).
        # test: tests/test_tensor_parallel.py::
        #   test_partitioned_checkpoint_keeps_a_slice_and_gathers_it_in_backward
        # hides: "x = all-gather of the t slices (B, T, C)"
        #   "the recomputation in backward all-gathers it"
        shard = mappings.split_along(x.detach(), -1, tp_group)   # (B, T, C/t): all that is kept
        first_run, needs_grad = [x], x.requires_grad                     # x itself, for the forward only

        def run(shard, cos, sin):
            if first_run:
                return layer_forward(first_run.pop(), cos, sin)
            full = mappings.all_gather_along(shard, -1, tp_group)   # (B, T, C/t) -> (B, T, C)
            return layer_forward(full.requires_grad_(needs_grad), cos, sin)   # saves what the forward saved
        return checkpoint(run, shard, cos, sin, use_reentrant=False)
        # end exercise
    return forward


def apply_partitioned_recompute(model, tp_group):
    """--recompute full with P_a: every decoder layer's forward checkpointed on its input's tp slice."""
    for layer in model.model.layers:
        layer.forward = partitioned_checkpoint(layer.forward, tp_group)
    return model


def apply_recompute(model, mode: str, partition: bool, tp_group):
    """01's --recompute, or with --partition-activations its full checkpoints in 1/tp slices (04, 05, 08)."""
    if partition:
        return apply_partitioned_recompute(model, tp_group)
    return recompute.apply_recompute(model, mode)


def add_arguments(parser):
    g = parser.add_argument_group("ZeRO-R P_a (04)")
    g.add_argument("--partition-activations", action="store_true",
                   help="with --recompute full: each tp rank keeps 1/tp of every layer's checkpointed input")
    return g


def check_partition_activations(args, sp: bool = False):
    """P_a partitions full recomputation's checkpoints over tp ranks: it needs both, and no SP (05), whose
    checkpoints are already 1/tp per rank."""
    if args.partition_activations and (args.recompute != "full" or args.tp < 2):
        raise ValueError("--partition-activations splits the checkpoints of --recompute full over the tp "
                         "ranks: add --recompute full and --tp 2 or more")
    if args.partition_activations and sp:
        raise ValueError("--partition-activations with --sp: SP's checkpoints are already (B, T/tp, C), 1/tp "
                         "per rank; drop --partition-activations")
