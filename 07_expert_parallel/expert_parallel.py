"""Expert parallelism: each rank keeps E/ep experts; tokens travel to their experts by all-to-all.

Playbook §2.7 and §2.8 (4) ("the key communication of EP is all-to-all"); GShard (Lepikhin et al.
2020), DeepSpeed-MoE, Megatron-core's all-to-all token dispatcher. EP is carved out of data parallelism
(02's process grid; §2.7 "EP as a sub-case of DP"): rank r of an `ep_group` owns experts
[r·E/ep, (r+1)·E/ep) and reads its own slice of the batch. In each MoE layer, once the router has
sorted a rank's rows (token-choices) by expert: the counts are exchanged, the rows dispatched to their
experts' owners by an uneven all-to-all, and the outputs combined back by the reverse one (`AllToAll`:
its backward is the same exchange with the splits swapped).

Per rank, MoE layer and micro-batch (s_out rows sent to other ranks, s_in received, b bytes each):
    2·(s_out + s_in)·C·b + 8·(ep−1)·E/ep bytes ≈ 4·N·k·C·b·(ep−1)/ep for uniform routing (5 calls)
Gradients, with L the mean of the dp ranks' losses: dense weights averaged over dp; an expert's owner
already holds the sum over its ep group, so expert gradients are summed over the replicas holding the
same experts (`expert_dp_group`) and divided by dp (08: cp·dp). Expert parameters, gradients and AdamW
states are 1/ep per rank. The overlap ratio (ep−1)·b·flops/(3·ep·F·bw), the derivations and errata E2
and E3 (the cheat-sheet's ep glossary, DeepSeek-V3's layout): 07_expert_parallel/README.md.

API: check_expert_parallel(num_experts, ep, dp) before any process group; apply_expert_parallel
(model, grid) after moe.apply_moe; sync_gradients and clip_grad_norm_ep in the step.

    torchrun --nproc_per_node 4 07_expert_parallel/train.py --dp 4 --ep 2 --num-experts 4

New compared with moe.py: the experts are sharded and the rows move; routing and maths are equal.
Shape legend (moe.py): C hidden, E experts, n rows (token-choices) of this rank, ep group size.
"""
import functools

import torch
import torch.distributed as dist

import moe
import optim
import data_parallel


# ======================================================================================
# The all-to-all, forward and backward
# ======================================================================================
def all_to_all_rows(x, output_splits, input_splits, group):
    """x (Σ input_splits, …): input_splits[j] rows go to rank j -> (Σ output_splits, …), by source."""
    out = x.new_empty(sum(output_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Forward: all_to_all_rows with (output_splits, input_splits); backward: the same exchange
    reversed (splits swapped), which returns every row's gradient to the rank it came from."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return all_to_all_rows(grad, input_splits, output_splits, ctx.group), None, None, None


def expert_parallel_experts(experts, rows, counts, group):
    """The MoE block's experts_fn under EP: rows (n, C) grouped by expert, counts (E,) -> (n, C)."""
    # exercise 07.4: all-to-all dispatch
    # hint: GShard §2.2, [PB] §2.7 (07's README, "Expert parallelism": counts, dispatch, combine): a rank
    #   must learn how many rows it will receive before it can receive them; the rows arrive grouped by
    #   source rank, while the local experts want them grouped by expert (and given back in the order
    #   they came); the combine is the dispatch reversed.
    # test: tests/test_expert_parallel.py::
    #   test_ep2_layer_twin_and_dp2_ep2_matches_single_device[layer-twin-ep2]
    ep = dist.get_world_size(group)
    send_counts = counts.view(ep, -1)                                      # (ep, E/ep): to rank j's experts
    recv_counts = all_to_all_rows(send_counts, [1] * ep, [1] * ep, group)   # (ep, E/ep): from rank j to mine
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = AllToAll.apply(rows, recv_splits, send_splits, group)        # (Σ recv, C): source, expert
    local = torch.arange(recv_counts.shape[1], device=rows.device)
    expert_of_row = local.repeat(ep).repeat_interleave(recv_counts.flatten())   # (Σ recv,) local expert index
    order = expert_of_row.argsort(stable=True)                             # group the sources' rows by expert
    out = moe.run_experts(experts, received[order], recv_counts.sum(0))     # (Σ recv, C)
    out = out[order.argsort()]                                             # back to (source, expert) order
    return AllToAll.apply(out, send_splits, recv_splits, group)            # combine: (n, C)
    # end exercise


# ======================================================================================
# Sharding the experts, and the gradients
# ======================================================================================
def check_expert_parallel(num_experts: int, ep: int, dp: int):
    """Layout errors, raised before any process group exists."""
    if ep < 1:
        raise ValueError(f"--ep must be at least 1, got {ep}")
    if num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={num_experts}: every rank holds "
                         f"num_experts/ep whole experts; choose --ep among the divisors of {num_experts}")
    if dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp}: expert parallelism splits the data-parallel "
                         f"ranks; use --dp {ep * max(1, dp // ep)} or another --ep")


def shard_experts(block, ep_rank: int, ep_size: int, ep_group):
    """Keep experts [ep_rank·E/ep, (ep_rank+1)·E/ep) of one MoE block, the slice (E/ep, …) of its stacks,
    under their global names, and route its rows by all-to-all over `ep_group`. The full, identically
    seeded block must exist (on meta in the trainers: only the slice is ever materialised)."""
    per_rank = block.num_experts // ep_size
    block.experts.keep(ep_rank * per_rank, (ep_rank + 1) * per_rank)      # (E/ep, F, C), (E/ep, C, F)
    block.experts_fn = functools.partial(expert_parallel_experts, group=ep_group)
    return block


def apply_expert_parallel(model, grid):
    """shard_experts on every MoE block of the model (after moe.apply_moe), over the grid's ep group."""
    for block in moe.moe_blocks(model):
        shard_experts(block, grid.ep_rank, grid.ep_size, grid.ep_group)
    return model


def sync_gradients(dense, experts, grid):
    """After the last micro-batch: dense weights averaged over the dp ranks, expert weights summed over
    expert_dp and divided by dp (the derivation in the module docstring; 08: over cp_dp, / cp·dp)."""
    data_parallel.average_gradients(dense, grid.cp_dp_group if grid.cp_size > 1 else grid.dp_group)
    if dist.get_world_size(grid.expert_dp_group) > 1:
        for p in experts:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=grid.expert_dp_group)   # (*p.shape)
    for p in experts:
        p.grad.div_(grid.cp_size * grid.dp_size)


def clip_grad_norm_ep(params, max_norm, expert_params, ep_group, dense_norm=None, pp_group=None):
    """torch's clip_grad_norm_ on the whole model: ‖g‖² = ‖dense‖² + Σ_ep ‖this rank's experts‖².

    08 passes `dense_norm` (04's rule: tp shards summed, stages summed) and `pp_group` (its stages hold
    different experts); by default the dense weights are whole and there is one stage."""
    expert_ids = {id(p) for p in expert_params}
    dense = [p for p in params if id(p) not in expert_ids]
    dense_norm = (dense_norm or (lambda ps: optim.total_norm([p.grad for p in ps])))(dense)   # fp32
    expert_sq = optim.total_norm([p.grad for p in expert_params]).pow(2)
    dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=ep_group)        # (): Σ over the ep group
    if pp_group is not None:
        dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=pp_group)    # (): Σ over the stages
    total = (dense_norm.pow(2) + expert_sq).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm if max_norm > 0 else float("inf"), total)
    return total
