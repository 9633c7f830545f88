"""Data parallelism: every rank holds the whole model and averages its gradients with the others.

Playbook §2.2 (data parallelism: naive, overlap, bucketing), PyTorch DDP (Li et al., 2020).
Each of N ranks runs forward/backward on its own 1/N of the global batch; before the optimizer
step the gradients are averaged, so every rank takes the same step as one device would on the
whole batch. Three ways to do the averaging, each a step further toward DDP:

    naive    after backward, all-reduce every gradient, one call each         (average_gradients)
    overlap  a hook per parameter launches an async all-reduce as soon as its
             gradient is accumulated, so communication runs while backward goes on   (OverlapDP)
    bucket   gradients are packed into flat buckets of ~bucket_mb (reverse parameter order,
             the order backward produces them); a full bucket is all-reduced at once   (BucketDP)

Communication per rank per step (ring all-reduce, see comm.py), Ψ = gradient bytes:
    wire bytes = 2(N−1)/N · Ψ         for every mode: overlapping hides it, it does not shrink it.
With gradient accumulation only the last micro-batch synchronises (`no_sync`, like DDP's
`require_backward_grad_sync`): summing local gradients first and averaging once is the same sum.

    torchrun --nproc_per_node 4 02_data_parallel/train.py --dp 4 --dp-mode bucket --bucket-mb 0.05

New compared with 01: the gradient synchronisation; the loop, model and optimizer are unchanged.
"""
import contextlib

import torch
import torch.distributed as dist


# ======================================================================================
# naive: one blocking all-reduce per gradient, after backward
# ======================================================================================
def average_gradients(params, group):
    """grad <- mean over the ranks of `group` of grad (all-reduce SUM, then divide by N).

    Parameters without a gradient are skipped. Blocking: nothing overlaps with backward.
    """
    size = dist.get_world_size(group)
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)   # (*p.shape) summed over ranks
            p.grad.div_(size)
