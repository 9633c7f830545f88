"""Mixture of experts and expert parallelism (07) inside the 4D trainer: what pipeline stages change.

Playbook §2.7-2.8; Megatron-core's MoE (its `MoEAuxLossAutoScaler` is the idea of 06's `AttachSideLoss`).
07 builds the MoE blocks (`moe.apply_moe`), shards the experts over the ep ranks carved out of dp
(`expert_parallel.apply_expert_parallel`) and synchronises the gradients (`sync_gradients`). What does
not carry over to pipeline stages, tensor and context parallelism is done here:

  * the load-balancing loss: a stage chunk returns its layers' α·aux; 06's Pipeline adds it to the loss
    on the last stage and attaches it to the activations sent on elsewhere (gradient 1/m); the logged
    loss is the sum over the stages (`sum_over_stages`), averaged over the cp×dp replicas;
  * under CP every block's `stats_group` is the cp group, so the per-sequence statistics are summed
    over the ranks that split each sequence (07's `routing.SumOverRanks`, whose backward all-reduces too);
    expert gradients are summed over expert_dp (dp/ep and cp) and divided by cp·dp;
  * the gradient norm: ‖g‖² = ‖dense‖² (04's: tp shards summed once, stages summed)
                               + Σ_stages Σ_ep ‖experts‖² (each expert lives on one ep rank).
Under TP (without SP) the experts are whole on every tp rank, like the norm weights (Megatron's
expert-TP = 1). What is not composed (--sp; --capacity-factor with --cp), and the derivations (why
SumOverRanks' backward sums): 08_5d_combined/README.md.

    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --ep 2 --tp 2 --pp 2 --num-experts 4 \\
        --grad-acc 2

New compared with 07: the side loss across stages, the statistics over cp, the norm over stages and tp,
the rows dropped over capacity counted per chunk and summed over the stages.
"""

import torch
import torch.distributed as dist
from torch import nn

import tensor_parallel
import moe
import expert_parallel


def check_experts(args):
    """07's rules, and what 08 does not compose; before any process group exists."""
    if not args.num_experts:
        if args.ep > 1:
            raise ValueError(f"--ep {args.ep} splits experts: it needs --num-experts "
                             f"(a multiple of {args.ep})")
        return
    moe.check_moe(args.num_experts, args.top_k, args.aux_loss_coef, **moe.extras(args))
    expert_parallel.check_expert_parallel(args.num_experts, args.ep, args.dp)
    if args.sp:
        raise ValueError("--num-experts with --sp is not supported: each tp rank's MoE block would see only "
                         "its T/tp tokens, so router and expert gradients would be partial sums over tp; "
                         "drop --sp (--tp and --cp compose with experts)")
    if args.capacity_factor and args.cp > 1:
        raise ValueError("--capacity-factor with --cp > 1 is not supported: the capacity is per sequence "
                         "and each cp rank holds only T/cp of its tokens; drop --capacity-factor (dropless) "
                         "or --cp")
    if args.init_from and args.tp > 1:
        raise ValueError("--init-from with --num-experts and --tp > 1: upcycling copies each dense MLP into "
                         "the experts, which TP keeps whole, after TP has split that MLP; upcycle with "
                         "--tp 1")


def apply_experts(full, args, grid):
    """MoE blocks in place of the (TP-split) MLPs, then 1/ep of the experts per rank; under CP, the
    load-balancing statistics summed over the cp group; returns the blocks."""
    blocks = moe.apply_moe(full, args.num_experts, args.top_k, args.aux_loss_coef, args.seed,   # on shapes
                           **moe.extras(args))
    if grid.ep_size > 1:
        expert_parallel.apply_expert_parallel(full, grid)
    for block in blocks:
        block.stats_group = grid.cp_group if grid.cp_size > 1 else None
    return blocks


def stage_view(stages):
    """A module whose `model.layers` lists this rank's layers and whose parameters are its stages', the
    shape 07's `split_parameters` reads."""
    view = nn.Module()
    view.stages, view.model = stages, nn.Module()
    view.model.layers = nn.ModuleList(layer for stage in stages for layer in stage.model.layers.values())
    return view


def clip_grad_norm_experts(params, max_norm, grid, expert_params):
    """01's clipping by the whole model's norm: 07's rule with 04's norm of the dense part and the stages."""
    def dense_norm(dense):   # max_norm 0: only the norm, 07 clips everything together
        return tensor_parallel.clip_grad_norm_tp(dense, 0, grid.tp_group, pp_group=grid.pp_group)
    return expert_parallel.clip_grad_norm_ep(params, max_norm, expert_params, grid.ep_group,
                                             dense_norm=dense_norm, pp_group=grid.pp_group)


def count_dropped(stages, dropped: list):
    """--capacity-factor: after each training forward of a stage chunk (an F pass), append the rows its MoE
    blocks dropped over capacity (07's per-micro-batch count, by chunk). Evaluation (under no_grad) is not
    counted, nor a recomputation: --recompute full reruns the layers in backward, never the chunk."""
    for stage in stages:
        def forward(*args, inner=stage.forward, stage=stage, **kwargs):
            out = inner(*args, **kwargs)
            if torch.is_grad_enabled():
                dropped.append(moe.dropped_rows(stage_view([stage])))
            return out
        stage.forward = forward
    return dropped


def log_dropped(dropped, steps, args, config, grid):
    """07's line for the whole model: this rank's counts summed over the stages (different layers) and the
    dp ranks (different rows; ep is carved out of dp), not over tp (every tp rank routes the same tokens;
    --capacity-factor with --cp is refused). Returns the total, which every rank holds."""
    total = torch.tensor(sum(dropped), dtype=torch.float64)
    for group, size in ((grid.pp_group, grid.pp_size), (grid.dp_group, grid.dp_size)):
        if size > 1:
            dist.all_reduce(total, group=group)
    rows = (steps * args.grad_acc * grid.dp_size * args.mbs * args.seq_len * args.top_k    # token-choices
            * config.num_hidden_layers)
    if grid.rank == 0:
        print(moe.dropped_line(int(total), rows, args.capacity_factor, steps))
    return int(total)


def sum_over_stages(loss, device, grid):
    """Every stage's share of the loss (the last: cross-entropy and its aux; the others: their aux),
    summed over the pipeline and averaged over the cp×dp replicas: the global batch's loss."""
    loss = torch.tensor(float(loss), dtype=torch.float64, device=device)
    dist.all_reduce(loss, group=grid.pp_group)
    dist.all_reduce(loss, group=grid.cp_dp_group if grid.cp_size > 1 else grid.dp_group)
    return float(loss / (grid.cp_size * grid.dp_size))
