"""How 08 reduces the gradients over the cp×dp ranks under any pipeline schedule: 02's DP or 03's ZeRO.

Playbook §2.2 (DP: overlap, bucketing, no_sync; ZeRO), §2.6 and §2.8; PyTorch's pipelining, whose stages
run every backward but a chunk's last under `no_sync`. Under a schedule a chunk's parameters get one
backward per micro-batch (ZB-H1: a B, then a W for the split linears, whose hooks fire too: 06's
zero_bubble.py accumulates through autograd), in an order each schedule chooses. 06's Pipeline counts
them and runs the chunk's last pass of each kind with final=True; only that pass may synchronise:

    --zero-stage 0  --dp-mode naive     all-reduce every gradient after the schedule (02)
                    --dp-mode overlap   an async all-reduce per parameter, from its hook in the last pass
                    --dp-mode bucket    flat buckets, each all-reduced when its last gradient is in
    --zero-stage 1, 2, 3                03's stages over the grid (distributed_optimizer.py)

Wire bytes per rank per step: 2(N−1)/N·eΨ in every DP mode (02); they change when it is sent, and
how many calls. The experts (07) are summed over expert_dp and divided by cp·dp after the schedule.

    torchrun --nproc_per_node 4 08_5d_combined/train.py --dp 2 --pp 2 --pp-schedule zb-h1 --dp-mode bucket \\
        --bucket-mb 0.1 --grad-acc 4

New compared with 02: the synchronising backward is each chunk's last of the step, not the last
micro-batch's; the step calls the same five methods whichever reduction runs.
"""
import contextlib

import mixed_precision
import data_parallel
import tensor_parallel
import kv_replication
import sequence_parallel
import expert_parallel
import experts
import distributed_optimizer


def add_arguments(parser):
    """02's --dp-mode and --bucket-mb (08 keeps the blocking all-reduce by default), and --zero-stage."""
    data_parallel.add_arguments(parser)
    parser.set_defaults(dp_mode="naive")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=0,
                        help="0: gradients all-reduced (02, --dp-mode); 1, 2, 3: optimizer states, "
                             "+ gradients, + parameters sharded over the cp×dp ranks (03)")


def check_gradient_sync(args):
    """Before any process group exists."""
    data_parallel.check_data_parallel(args.bucket_mb)
    if args.zero_stage and args.dp_mode != "naive":
        raise ValueError(f"--dp-mode {args.dp_mode} is data parallelism's all-reduce (--zero-stage 0); ZeRO "
                         f"reduce-scatters its own units: drop --dp-mode or use --zero-stage 0")
    if args.zero_stage == 3 and args.tie_embeddings:
        raise ValueError("--zero-stage 3 gathers each module's own parameters: drop --tie-embeddings "
                         "(a tying preset: pass --no-tie-embeddings) "
                         "or use --zero-stage 1 or 2")
    mixed_precision.check_precision(args)


class DataParallelSync:
    """--zero-stage 0: 02's DataParallel over the dense parameters, 07's rule for the experts."""

    def __init__(self, dense, expert_params, grid, mode: str, bucket_mb: float, norm_weights=(),
                 grad_owners_of=list):
        """`grad_owners_of`: the tensors whose .grad is each parameter's step gradient (01's bf16-20: its
        fp32 master, whose .grad is the accumulator; the optimizer's hooks, registered before DP's, filled
        it)."""
        self.ddp = data_parallel.wrap(dense, grid.cp_dp_group, mode, bucket_mb,
                                      grad_owners=grad_owners_of(dense))
        self.params = dense + expert_params
        self.dense, self.expert_params = grad_owners_of(dense), grad_owners_of(expert_params)
        self.grid, self.norm_weights = grid, grad_owners_of(norm_weights)

    @property
    def events(self):                    # 02's of the last step: ("grad", i), ("launch", k), ("finish", None)
        return self.ddp.step_events

    @property
    def shards(self):                    # what AdamW steps (bf16: through fp32 masters): every parameter
        return self.params

    def zero_gradients(self):
        pass

    def forward(self, chunk):
        return contextlib.nullcontext()

    def backward(self, chunk, final):
        """06's Pipeline runs every B and W inside: the hooks (overlap, bucket) communicate in the last.
        The experts are not in the DP object: 07's rule sums them after the schedule."""
        return self.ddp.no_sync(enabled=not final)

    def finish_gradients(self):
        """naive: all-reduce now; overlap, bucket: wait for the launched ones; / N. Experts: Σ / (cp·dp).
        Then SP's norm gradients summed over tp (each tp rank saw T/(cp·tp) of the tokens, 05) and each
        replicated kv head's over the ranks holding it (04): sums, so after the mean as well as before."""
        self.ddp.finish_gradients()
        if self.expert_params:
            expert_parallel.sync_gradients([], self.expert_params, self.grid)
        if self.norm_weights:
            sequence_parallel.all_reduce_norm_gradients(self.norm_weights, self.grid.tp_group)
        kv_replication.all_reduce_kv_replica_gradients(self.dense + self.expert_params)

    def clip_gradients(self, max_norm):
        if self.expert_params:
            return experts.clip_grad_norm_experts(self.dense + self.expert_params, max_norm, self.grid,
                                                  self.expert_params)
        return tensor_parallel.clip_grad_norm_tp(self.dense, max_norm, self.grid.tp_group, self.grid.pp_group)

    def gather_shards(self):
        pass

    def release(self):                   # every parameter stays whole: nothing was gathered
        pass

    def full_state_dict(self, stages):
        return {k: v.detach().clone() for k, v in stages.state_dict().items()}


def make(stages, dense, expert_params, norm_weights, grid, args, source=None):
    """(the gradient synchronisation of --zero-stage and --dp-mode for this rank's stage chunks, 01's
    MixedPrecisionOptimizer over what it steps). Built together: under DP the optimizer comes first, as
    bf16-20's hooks (fp32 accumulation) must run before DP's, which reduce those fp32 buffers; ZeRO keeps
    bf16-20's fp32 gradients in its own buffers (03's `grad_dtype`). `source` (01's materialize.Source):
    where ZeRO-3 draws the values of the stages' meta parameters, only its shards."""
    if args.zero_stage:
        view = experts.stage_view(stages) if args.num_experts else None
        accumulation = mixed_precision.layout_of(args).accumulation
        sync = distributed_optimizer.DistributedOptimizer(stages, grid, args.zero_stage, view, norm_weights,
                                                          accumulation, source)
        return sync, mixed_precision.MixedPrecisionOptimizer(sync.shards, args, hooks=False)
    optimizer = mixed_precision.MixedPrecisionOptimizer(dense + expert_params, args)
    return DataParallelSync(dense, expert_params, grid, args.dp_mode, args.bucket_mb, norm_weights,
                            optimizer.grad_owners_of), optimizer
