"""ZeRO-1, 2 and 3 in the 5D trainer (`--zero-stage`): model states sharded over the data-parallel ranks.

Playbook §2.2 (ZeRO) with §2.8 and chapter 3 ("ZeRO-1/2 + PP fine"), Megatron-LM's distributed
optimizer, Rajbhandari et al. §5. Every (pp, tp) rank holds its own parameters; the N = cp·dp ranks
that hold the same ones (`cp_dp_group`) split them with 03's flat units (the embedding, each decoder
layer, the final norm, the head of the stage chunks this rank holds), and AdamW (01's) steps only this
rank's slice. The experts form units of their own, sharded over the N/ep ranks that hold them
(`expert_dp_group`), whose gradient is the sum divided by N (07's rule). Under a pipeline schedule a
chunk runs m forwards and m backwards per step (06's Pipeline says which backward is its last):

    stage 1  after the schedule: reduce-scatter (U,) -> (U/N,) per unit
    stage 2  in the chunk's last backward (B, or ZB's W): each unit reduce-scattered as it completes
    stage 3  + before the chunk's first forward: its units all-gathered, kept until that reduce-scatter
    then     / N, clip, AdamW, stages 1-2 all-gather; SP's and the kv replicas' sums over tp run on a
             unit's full gradients (bf16-20: their fp32 `main_grad`) just before its reduce-scatter

    ‖g‖² = Σ_pp [ Σ_tp Σ_dp ‖tp-sharded shard‖² + Σ_dp ‖replicated shard‖² + Σ_ep Σ_expert_dp ‖experts‖² ]

Wire bytes per step in the dp group: 2·(N−1)/N·eΨ at every stage (e bytes per element, Ψ this rank's
padded parameters) plus the norm squares; the experts' bytes, and what stages 2-3 give up under PP: README.md.

    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --tp 2 --pp 2 --zero-stage 3 --grad-acc 4

New compared with 03: the units are the stages' modules, the schedule says when a chunk's gradients are
complete, and the norm follows 04's and 07's rules.
"""
import contextlib

import torch
import torch.distributed as dist

import zero
import kv_replication
import sequence_parallel
import moe


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
    """ZeRO over the process grid: dense units over cp×dp, expert units over expert_dp; the pipeline's
    `grad_sync` (forward and backward contexts) and the calls of 08's step."""

    def __init__(self, stages, grid, stage: int, expert_view=None, norm_weights=(), grad_dtype=None,
                 source=None):
        """`grad_dtype`: 01's bf16-20 accumulation dtype (fp32 buffers under bf16 weights; 03's ZeRO).
        `source`: stage 3 on meta stages (01's materialize.Source): each unit's shard is drawn from it
        one parameter at a time, so the stage never exists whole on the rank (03's flat_unit.py)."""
        # by global name: stage 3 replaces the meta parameters by views of its units (new Parameters)
        self.grid, self.stage, self.norm_names = grid, stage, {p.global_name for p in norm_weights}
        blocks = moe.moe_blocks(expert_view) if expert_view is not None else []
        experts = [p for block in blocks for p in block.experts.parameters()]
        self.dense = zero.ZeRO(stage_units(stages), grid.cp_dp_group, stage, exclude=experts, pipelined=True,
                               before_reduce=self.sum_over_tp, source=source, grad_dtype=grad_dtype)
        self.experts = (zero.ZeRO([block.experts for block in blocks], grid.expert_dp_group, stage,
                                  divisor=grid.cp_size * grid.dp_size, pipelined=True, source=source,
                                  grad_dtype=grad_dtype)
                        if experts else None)
        self.zeros = [z for z in (self.dense, self.experts) if z is not None]
        self.chunk_units = []              # per chunk: [(zero, its units in it)], for stage 3's gathers
        for chunk in stages:
            mine = {id(m) for m in chunk.modules()}
            self.chunk_units.append([(z, [u for u in z.units if id(u.module) in mine]) for z in self.zeros])

    @property
    def events(self):
        """03's of the dense units, this step: ("grad", u), ("reduce_scatter", u), ("finish", None), …"""
        return self.dense.events

    @property
    def shards(self):
        """What 01's AdamW steps: this rank's pieces of every unit (dense and experts)."""
        return [shard for z in self.zeros for shard in z.shards]

    def zero_gradients(self):
        """Before the schedule: stage 1 points every .grad at its unit's zeroed buffer; 2-3 zero shards."""
        for z in self.zeros:
            z.zero_gradients()

    @contextlib.contextmanager
    def forward(self, chunk):
        """06's Pipeline runs every F inside: stage 3 gathers the chunk's units if they are not here (its
        first forward of the step); they stay for its other micro-batches, the playbook's advice for
        ZeRO-3 with PP, until their reduce-scatter frees them."""
        if self.stage == 3:
            for z, units in self.chunk_units[chunk]:
                z.gather(units)
        yield

    def release(self):
        """After an evaluation's forwards: no backward, so no reduce-scatter, will free what stage 3 gathered
        (03's forward hooks free each unit after its forward); the full units are dropped here."""
        for z in self.zeros if self.stage == 3 else ():
            for unit in z.units:
                unit.free()

    @contextlib.contextmanager
    def backward(self, chunk, final):
        """06's Pipeline runs every B and W inside: stages 2-3 reduce-scatter the dense units in the
        chunk's last pass of each kind (their hooks: 03's), the others only accumulate."""
        with self.dense.no_sync(enabled=not final), contextlib.ExitStack() as stack:
            if self.experts is not None:          # after the schedule, in unit order on every rank
                stack.enter_context(self.experts.no_sync())
            yield

    def sum_over_tp(self, params):
        """Before their reduce-scatter: SP's norm gradients summed over tp (each tp rank saw T/(cp·tp) of
        the tokens, 05) and each replicated kv head's over the ranks holding it (04)."""
        norms = [p for p in params if p.global_name in self.norm_names]
        sequence_parallel.all_reduce_norm_gradients(norms, self.grid.tp_group)
        kv_replication.all_reduce_kv_replica_gradients(params)

    def finish_gradients(self):
        """After the schedule: stage 1 reduce-scatters every unit, 2-3 the units not reduced yet (the
        experts'); then / N (experts: / cp·dp). Each unit's tp sums come first (`sum_over_tp`)."""
        for z in self.zeros:
            z.finish_gradients()

    def full_state_dict(self, stages):
        """name -> tensor (a copy) of the stages' state, stage 3's units gathered for it (collective)."""
        with contextlib.ExitStack() as stack:
            for z in self.zeros:
                stack.enter_context(z.gathered())
            return {k: v.detach().clone() for k, v in stages.state_dict().items()}

    def gather_shards(self):
        """After the optimizer step (stages 1-2): every rank's updated shards all-gathered into the model."""
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
