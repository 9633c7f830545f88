"""ZeRO-1 in the 5D trainer (`--zero-stage 1`): the optimizer states sharded over the data-parallel ranks.

Playbook §2.2 (ZeRO) with §2.8 and chapter 3 ("ZeRO-1/2 + PP fine"), Megatron-LM's distributed
optimizer, Rajbhandari et al. §5.1. Every (pp, tp) rank holds its own parameters; the N = cp·dp ranks
that hold the same ones (`cp_dp_group`) split them with 03's flat units (the embedding, each decoder
layer, the final norm, the head of the stage chunks this rank holds), and AdamW (01's) steps only this
rank's slice. The experts form units of their own, sharded over the N/ep ranks that hold them
(`expert_dp_group`), whose gradient is the sum divided by N (07's rule). After the last micro-batch:

    SP's norm gradients summed over tp (05)  ->  reduce-scatter (U,) -> (U/N,) per unit, / N
    -> clip by the whole model's norm        ->  AdamW on the shards  ->  all-gather (U/N,) -> (U,)

    ‖g‖² = Σ_pp [ Σ_tp Σ_dp ‖tp-sharded shard‖² + Σ_dp ‖replicated shard‖² + Σ_ep Σ_expert_dp ‖experts‖² ]

Memory per rank (e bytes per element, Ψ this rank's padded parameters): weights eΨ, gradients eΨ,
AdamW states 2eΨ/N (experts: /(N/ep)). Wire bytes per step in the dp group: 2·(N−1)/N·eΨ, DP's
all-reduce volume (03), plus the norm squares. Derivation: 08_5d_combined/README.md. Stages 2 and 3 are
refused (`check_zero_stage` says why).

    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --tp 2 --pp 2 --zero-stage 1 --grad-acc 4

New compared with 03: the units are the stages' modules, and the norm follows 04's and 07's rules.
"""
from importlib import import_module

import torch
import torch.distributed as dist

zero = import_module("03_zero.zero")
moe = import_module("07_expert_parallel.moe")


def check_zero_stage(zero_stage: int):
    """Before any process group: 08 composes ZeRO-1 only."""
    if zero_stage > 1:
        raise ValueError(f"--zero-stage {zero_stage} is not composed in 08: 03's stages 2-3 reduce-scatter "
                         "(and stage 3 gathers) from hooks that fire once per unit per backward, while the "
                         "pipeline schedules run one partial backward per micro-batch and chunk (ZB-H1 "
                         "splits each into B and W) and SP sums the norm gradients over tp afterwards; use "
                         "--zero-stage 1 here, or 03_zero/train.py --zero-stage 2/3 (data parallelism alone)")


def stage_units(stages):
    """03's units (`llama_units`) for the stage chunks this rank holds, in forward order."""
    units = []
    for stage in stages:
        units += [stage.model.embed_tokens] if stage.is_first else []
        units += list(stage.model.layers.values())
        units += [stage.model.norm, stage.lm_head] if stage.is_last else []
    return units


def is_tp_sharded(p):
    return getattr(p, "tp_sharded", False)      # set by 04's sharding: a disjoint piece on each tp rank


class DistributedOptimizer:
    """ZeRO-1 over the process grid: dense units over cp×dp, expert units over expert_dp."""

    def __init__(self, stages, grid, expert_view=None):
        self.grid = grid
        blocks = moe.moe_blocks(expert_view) if expert_view is not None else []
        experts = [p for block in blocks for p in block.experts.parameters()]
        self.dense = zero.ZeRO(stage_units(stages), grid.cp_dp_group, stage=1, exclude=experts)
        self.experts = (zero.ZeRO([block.experts for block in blocks], grid.expert_dp_group, stage=1,
                                  divisor=grid.cp_size * grid.dp_size) if experts else None)
        self.zeros = [z for z in (self.dense, self.experts) if z is not None]

    @property
    def shards(self):
        """What 01's AdamW steps: this rank's pieces of every unit (dense and experts)."""
        return [shard for z in self.zeros for shard in z.shards]

    def zero_gradients(self):
        """Before the schedule: the .grad of every parameter becomes a view of its unit's zeroed buffer."""
        for z in self.zeros:
            z.zero_gradients()

    def finish_gradients(self):
        """After the last micro-batch (and SP's norm sum): reduce-scatter over the ranks with the same
        weights."""
        for z in self.zeros:
            z.finish_gradients()

    def gather_shards(self):
        """After the optimizer step: every rank's updated shards all-gathered into the model."""
        for z in self.zeros:
            z.gather_shards()

    def clip_gradients(self, max_norm):
        """01's clipping by the whole model's norm (the module docstring's sum), on the shards."""
        grid = self.grid
        squares = torch.stack([self.dense.shard_squares(is_tp_sharded),
                               self.dense.shard_squares(lambda p: not is_tp_sharded(p))])
        dist.all_reduce(squares, group=grid.cp_dp_group)                 # (2,): Σ over the dp shards
        sharded = squares[0].clone()
        dist.all_reduce(sharded, group=grid.tp_group)                    # (): Σ over the tp shards
        total = sharded + squares[1]                                     # replicated: once
        dist.all_reduce(total, group=grid.pp_group)                      # (): Σ over the stages
        if self.experts is not None:                                     # experts.py's order of sums
            expert_sq = self.experts.shard_squares()
            dist.all_reduce(expert_sq, group=grid.expert_dp_group)       # (): Σ over the expert shards
            dist.all_reduce(expert_sq, group=grid.ep_group)              # (): each expert once
            dist.all_reduce(expert_sq, group=grid.pp_group)              # (): over the stages
            total = total + expert_sq
        norm = total.sqrt()
        if max_norm > 0:   # torch.nn.utils.clip_grad_norm_'s coefficient
            for z in self.zeros:
                z.scale_gradients((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm
