"""Mixture of experts and expert parallelism (07) inside the 4D trainer: what pipeline stages change.

Playbook §2.7-2.8; Megatron-core's MoE (its `MoEAuxLossAutoScaler` is the idea of 06's `AttachSideLoss`).
07 builds the MoE blocks (`moe.apply_moe`), shards the experts over the ep ranks carved out of dp
(`expert_parallel.apply_expert_parallel`) and synchronises the gradients (`sync_gradients`).
What does not carry over to pipeline stages, tensor and context parallelism is done here:

  * the load-balancing loss α·Σ_layers aux: every layer returns its block's share and a stage chunk
    returns their sum; 06's Pipeline adds it to the loss on the last stage and, on the others, attaches
    it to the activations sent on (`AttachSideLoss`: gradient 1/m, the 1/m every micro-batch's loss
    gets), so every router learns as on one device;
  * the logged loss is then the sum over the stages (cross-entropy + the last stage's aux, plus every
    other stage's aux), averaged over the cp×dp replicas;
  * under CP each rank holds T/cp tokens of every sequence, while the load-balancing statistics are
    per sequence (moe.py): every block's `stats_group` is the cp group, so f's counts and P's sums are
    summed over it (P's with an all-reduce in backward too: `moe.SumOverRanks` derives it) and every
    cp rank adds the whole sequences' aux. The router and the experts work token by token, so the
    MoE output needs nothing new; the all-to-all runs in ep groups of one cp rank each (02's grid);
  * the gradient norm: ‖g‖² = ‖dense‖² (04's: tp shards summed once, stages summed)
                               + Σ_stages Σ_ep ‖experts‖² (each expert lives on one ep rank).
Under TP (without SP) the experts are not split: every tp rank holds the same input rows, runs the
same experts and gets the same gradients, like the norm weights (Megatron's expert-TP = 1).
Gradients under CP (07's `sync_gradients` with the cp·dp replicas): the loss is
L = (1/(cp·dp))·Σ_{c,d} L_{c,d}; an expert's owner already holds Σ over its ep group (one cp rank),
and the cp ranks of one dp rank hold the same experts (`expert_dp` spans dp/ep and cp), so
∇L = (1/(cp·dp))·Σ_{expert_dp}: the dense rule (mean over cp·dp) with 07's sum-then-divide.
Not composed: --sp. The MoE block replaces the MLP together with TP's regions, so under SP each tp
rank's block would see only its T/(cp·tp) tokens: the router's and experts' gradients would be partial
sums over tp (SP syncs only the norm weights) and the statistics would need the tp group too.

    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --ep 2 --tp 2 --pp 2 --num-experts 4 --grad-acc 2
    torchrun --nproc_per_node 4 08_5d_combined/train.py --dp 2 --ep 2 --cp 2 --cp-layout zigzag --num-experts 4
"""
from importlib import import_module

import torch
import torch.distributed as dist
from torch import nn

tensor_parallel = import_module("04_tensor_parallel.tensor_parallel")
moe = import_module("07_expert_parallel.moe")
expert_parallel = import_module("07_expert_parallel.expert_parallel")


def check_experts(args):
    """07's rules, and what 08 does not compose; before any process group exists."""
    if not args.num_experts:
        if args.ep > 1:
            raise ValueError(f"--ep {args.ep} splits experts: it needs --num-experts (a multiple of {args.ep})")
        return
    moe.check_moe(args.num_experts, args.top_k, args.aux_loss_coef)
    expert_parallel.check_expert_parallel(args.num_experts, args.ep, args.dp)
    if args.sp:
        raise ValueError("--num-experts with --sp is not supported: each tp rank's MoE block would see only its "
                         "T/tp tokens, so router and expert gradients would be partial sums over tp; drop --sp "
                         "(--tp and --cp compose with experts)")
    if args.init_from and args.tp > 1:
        raise ValueError("--init-from with --num-experts and --tp > 1: upcycling copies each dense MLP into the "
                         "experts, which TP keeps whole, after TP has split that MLP; upcycle with --tp 1")


def apply_experts(full, args, grid):
    """MoE blocks in place of the (TP-split) MLPs, then 1/ep of the experts per rank; under CP, the
    load-balancing statistics summed over the cp group; returns the blocks."""
    blocks = moe.apply_moe(full, args.num_experts, args.top_k, args.aux_loss_coef, args.seed,
                           upcycle=bool(args.init_from))   # its loss hook is on `full`, which stages never call
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
    return expert_parallel.clip_grad_norm_ep(params, max_norm, expert_params, grid.ep_group, dense_norm=dense_norm,
                                             pp_group=grid.pp_group)


def sum_over_stages(loss, device, grid):
    """Every stage's share of the loss (the last: cross-entropy and its aux; the others: their aux),
    summed over the pipeline and averaged over the cp×dp replicas: the global batch's loss."""
    loss = torch.tensor(float(loss), dtype=torch.float64, device=device)
    dist.all_reduce(loss, group=grid.pp_group)
    dist.all_reduce(loss, group=grid.cp_dp_group if grid.cp_size > 1 else grid.dp_group)
    return float(loss / (grid.cp_size * grid.dp_size))
