"""5D parallelism in one trainer: data × tensor (+ sequence) × context × pipeline × expert, with the kernels.

Playbook §2.8 (combining the techniques) and chapter 3 (choosing a layout); Megatron-LM's PTD-P
(Narayanan et al. 2021); Llama 3's rank order [TP, CP, PP, DP] (playbook §4.1, Fig. 5). Nothing new
is implemented here: every technique is the earlier folder's module, applied to the seeded full 01
model from outside, in this order (each step needs the previous one's result):

    1. kernels      --kernels/--attn (kernels/patch.py, inside 01's build_model): swaps norms, SwiGLU,
                    RoPE, the attention core and the loss for Triton ones
    2. TP (+ SP)    --tp/--sp (04, 05): slices every matrix; SP shards the norm regions along T
    3. CP           --cp/--cp-layout (05): ring attention (or --cp-attn ulysses) replaces the core
       MoE, EP      --num-experts/--ep (07, via experts.py): MoE blocks replace the MLPs, 1/ep of the experts
                    (under CP their load-balancing statistics are summed over the cp group)
    4. PP           --pp/--pp-schedule/--pp-chunks (06): keeps this rank's layers as stage chunks
    5. recompute    --recompute (01): wraps the layers / the (ring) attention core the stages hold
    6. DP           --dp (02): gradients averaged over the cp×dp ranks after the last micro-batch
                    (with experts, 07's: dense over cp×dp, experts summed over the cp·dp/ep replicas, /(cp·dp))
       ZeRO-1       --zero-stage 1 (03, via distributed_optimizer.py): instead, reduce-scattered over
                    those ranks, AdamW on this rank's 1/N of the states, the parameters all-gathered

The grid is arange(world).view(dp, pp, cp, tp) (02's process_grid): tp neighbours fastest, dp slowest.
What crosses a stage boundary is the residual stream of this rank's tokens, (mbs, T/cp, C), or
(mbs, T/(cp·tp), C) under SP (06's `boundary_shape`). Every rank logs the last stage's loss, averaged
over the cp×dp replicas: the mean over the global batch dp·mbs·grad_acc, the same number as 01's.
The gradient norm sums the tp shards and the pp stages (04's `clip_grad_norm_tp`; experts.py adds the
experts; under ZeRO-1 the dp shards too). With experts, what pipeline stages change (the load-balancing
loss) is in experts.py.

    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --tp 2 --pp 2 --grad-acc 4 --mbs 4
    torchrun --nproc_per_node 8 08_5d_combined/train.py --tp 2 --sp --cp 2 --pp 2 --pp-schedule zb-h1 --grad-acc 4
    torchrun --nproc_per_node 4 08_5d_combined/train.py --cp 2 --pp 2 --pp-schedule interleaved --pp-chunks 2 --grad-acc 4
    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --ep 2 --tp 2 --pp 2 --num-experts 4 --grad-acc 2
    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --tp 2 --pp 2 --zero-stage 1 --grad-acc 4
    python 08_5d_combined/planner.py --preset 1b --tp 2 --pp 2 --dp 2 --seq-len 4096   # the arithmetic first

It prints the memory per rank (per pipeline stage), one line or bar per step, the communication of the
first rank of each stage per process group, and the bubble of the last step.

Not composed here: ZeRO-2 and -3 (the planner does their arithmetic; `check_zero` says why), and experts
with --sp (experts.py says why; experts with --cp sum their load-balancing statistics over the cp group).
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere; folders import by dotted name

import dataclasses
import functools
from importlib import import_module

import torch
import torch.distributed as dist

base = import_module("01_single_gpu.legacy_train")
memory = base.memory
process_grid = import_module("02_data_parallel.process_grid")
comm = import_module("02_data_parallel.comm")
tp_train = import_module("04_tensor_parallel.train")
tensor_parallel = import_module("04_tensor_parallel.tensor_parallel")
sequence_parallel = import_module("05_sequence_context_parallel.sequence_parallel")
context_parallel = import_module("05_sequence_context_parallel.context_parallel")
cp_train = import_module("05_sequence_context_parallel.train")
pipeline = import_module("06_pipeline.pipeline")
schedules = import_module("06_pipeline.schedules")
pp_train = import_module("06_pipeline.train")
moe = import_module("07_expert_parallel.moe")
expert_parallel = import_module("07_expert_parallel.expert_parallel")
experts = import_module("08_5d_combined.experts")
distributed_optimizer = import_module("08_5d_combined.distributed_optimizer")


def build_parser(description=__doc__.splitlines()[0]):
    p = cp_train.build_parser(description)          # core flags, --tp --dp, --sp --cp --cp-layout --cp-attn
    pp_train.add_pipeline_arguments(p)              # --pp --pp-schedule --pp-chunks --timeline
    experts.add_arguments(p)                        # --num-experts --top-k --aux-loss-coef --ep
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=0,
                   help="0: gradients all-reduced (02); 1: optimizer states sharded over the cp×dp ranks "
                        "(03's ZeRO-1); 2 and 3: the planner only (03_zero/train.py trains them)")
    return p


def check_layout(args, config):
    """Every rule of every folder, and the world size dp·pp·cp·tp, before any process group exists."""
    distributed_optimizer.check_zero_stage(args.zero_stage)
    check_degrees(args, config)


def check_degrees(args, config):
    """The rules of 02-07 (the planner checks these too: it also plans ZeRO-2/3)."""
    experts.check_experts(args)
    pipeline.check_pipeline(config.num_hidden_layers, args.pp, args.pp_chunks, args.pp_schedule, args.grad_acc,
                            config.tie_word_embeddings)
    cp_train.check_layout(args, config, pp=args.pp)  # cp/sp/attention rules, tp divisibility, world size


def parallelize(full, args, grid):
    """Steps 2-5 of the docstring on the full model; returns (stages, norm weights SP must sync)."""
    cp_train.parallelize(full, args, grid)                                 # 2. TP (+ SP), 3. CP (05)
    if args.num_experts:                                                   # 3b. MoE, EP (07)
        experts.apply_experts(full, args, grid)
    stages = pipeline.build_stages(full, grid.pp_rank, grid.pp_size, args.pp_chunks)   # 4. PP
    base.recompute.apply_recompute(full, args.recompute)                   # 5. the stages hold these layers
    positions = context_parallel.CPLayout(args.cp_layout, args.cp).positions(grid.cp_rank, args.seq_len)
    for stage in stages:
        stage.position_ids = positions.to(base.device_of(args))            # (T/cp,) this rank's tokens
    norm_weights = [p for name, p in stages.named_parameters() if args.sp and name.endswith("norm.weight")]
    return stages, norm_weights


def make_plan(args, grid, stages, pipe, norm_weights, zero1=None):
    """04's plan (SP's norm all-reduce, then the cp×dp average) with 06's schedule, norm and loss;
    with experts, 07's gradient synchronisation and experts.py's norm and loss; with ZeRO-1, its
    reduce-scatter and norm in place of the averaging and the norm."""
    step = schedules.SCHEDULE_STEPS[args.pp_schedule]
    positions = stages[0].position_ids
    aux = args.num_experts > 0

    def forward_backward(model, micro_batches):            # this rank's T/cp tokens and their labels
        return step(pipe, [(x[:, positions], y[:, positions]) for x, y in micro_batches])   # (mbs, T/cp)

    sync = [lambda: sequence_parallel.all_reduce_norm_gradients(norm_weights, grid.tp_group)] if args.sp else []
    plan = tp_train.make_plan(args, grid, stages, forward_backward=forward_backward, before_averaging=sync)
    replicas = grid.cp_size * grid.dp_size
    layout = {"dp": grid.dp_size, "pp": grid.pp_size, "cp": grid.cp_size, "tp": grid.tp_size, "sp": args.sp,
              "pp_chunks": args.pp_chunks, "ep": grid.ep_size, "num_experts": args.num_experts,
              "zero_stage": args.zero_stage}                      # --resume: ZeRO-1 saves optimizer shards
    if aux:
        view = experts.stage_view(stages)
        plan = dataclasses.replace(
            plan, finish_gradients=expert_parallel.make_finish_gradients(view, grid),
            clip_gradients=functools.partial(experts.clip_grad_norm_experts, grid=grid,
                                             expert_params=moe.split_parameters(view)[1]),
            global_loss=functools.partial(experts.sum_over_stages, device=base.device_of(args), grid=grid),
            flops_per_token=lambda config, seq_len: moe.flops_per_token(base.flops_per_token(config, seq_len), config,
                                                                        args.num_experts, args.top_k), layout=layout)   # MFU: the k experts a token uses
    else:
        plan = dataclasses.replace(
            plan,
            clip_gradients=functools.partial(tensor_parallel.clip_grad_norm_tp, tp_group=grid.tp_group,
                                             pp_group=grid.pp_group),
            global_loss=functools.partial(pipeline.broadcast_loss, device=base.device_of(args),
                                          pp_ranks=grid.pp_ranks, pp_group=grid.pp_group, dp_group=grid.cp_dp_group,
                                          dp_size=replicas),
            layout=layout)
    return zero1.in_plan(plan, before_reduction=sync) if zero1 else plan   # (sync: SP only, never with experts)


def state_bytes(stages, optimizer):
    """(parameters, gradients, optimizer states) this rank holds, from its tensors (gradients: one per
    parameter, as large as it, since the loop frees them after each step)."""
    params = [p for p in stages.parameters() if p.requires_grad]
    return memory.tensor_bytes(params), memory.tensor_bytes(params), memory.optimizer_state_bytes(optimizer)


def process_grid_peers(grid, dim):
    return dist.get_process_group_ranks(getattr(grid, f"{dim}_group"))


def report(grid, stages, optimizer, meter, activations, steps):
    """Rank 0 prints the measured memory of every stage and the communication of each stage's first rank."""
    mine = dict(coords=(grid.dp_rank, grid.pp_rank, grid.cp_rank, grid.tp_rank),
                states=state_bytes(stages, optimizer), activations=activations,
                comm={key: (meter.calls[key], meter.payload[key], meter.wire[key]) for key in meter.calls})
    everyone = [None] * grid.world_size
    dist.all_gather_object(everyone, mine)
    if grid.rank == 0:
        print("memory per rank, measured after the last step (MiB; activations: the playbook's estimate for "
              "the micro-batches a stage holds)")
        print(f"  {'pp stage':<9}{'ranks':<16}{'parameters':>11}{'gradients':>11}{'optimizer':>11}{'activations':>12}")
        for stage in range(grid.pp_size):
            ranks = [r for r, e in enumerate(everyone) if e["coords"][1] == stage]
            (params, grads, states), act = everyone[ranks[0]]["states"], everyone[ranks[0]]["activations"]
            print(f"  {stage:<9}{','.join(map(str, ranks))[:15]:<16}" +
                  "".join(f"{v / 2**20:>11.2f}" for v in (params, grads, states)) + f"{act / 2**20:>12.2f}")
        for stage in range(grid.pp_size):
            first = next(r for r, e in enumerate(everyone) if e["coords"] == (0, stage, 0, 0))
            stage_meter = comm.CommMeter()
            for key, (calls, payload, wire) in everyone[first]["comm"].items():
                stage_meter.calls[key], stage_meter.payload[key], stage_meter.wire[key] = calls, payload, wire
            print(stage_meter.table(f"communication of rank {first} (pp stage {stage}) per step", steps=steps))
    return everyone


def run(args, config):
    """Returns (records, stages, pipe, everyone's measured states and communication)."""
    grid = process_grid.init_distributed(args.device, dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep)
    _, dataset = base.load_data(args)
    device = base.device_of(args)
    full = base.build_model(args, config)                  # 1. every rank: the same seeded model, kernels applied
    stages, norm_weights = parallelize(full, args, grid)
    stages.to(device)
    del full                                               # the other stages' layers are freed
    zero1 = distributed_optimizer.DistributedOptimizer(stages, grid, experts.stage_view(stages) if args.num_experts
                                                       else None) if args.zero_stage == 1 else None   # 6. ZeRO-1
    make_optimizer = functools.partial(base.make_optimizer, args=args)
    optimizer = zero1.make_optimizer(make_optimizer) if zero1 else make_optimizer(stages.parameters())
    shape = pipeline.boundary_shape(args.mbs, args.seq_len, config.hidden_size, args.cp, args.tp, args.sp)
    p2p = pipeline.P2P(grid.pp_ranks, grid.pp_rank, pipeline.direction_groups(grid, args.pp_chunks), args.pp_chunks,
                       shape, base.param_dtype(args), device)                      # (mbs, T/cp[/tp], C)
    pipe = schedules.Pipeline(stages, p2p, schedules.pass_clock(device),          # ZB-H1: split dW off B
                              split_backward=args.pp_schedule == "zb-h1")
    plan = make_plan(args, grid, stages, pipe, norm_weights, zero1)                # 6. DP inside
    element = 2 if args.dtype == "bfloat16" else torch.empty(0, dtype=base.param_dtype(args)).element_size()
    held = schedules.peak_held(args.pp_schedule, grid.pp_size, grid.pp_rank, args.grad_acc, args.pp_chunks)
    per_micro_batch = memory.activation_bytes_estimate(config, args.mbs, args.seq_len, element, args.recompute,
                                                       tp=args.tp, sp=args.sp, cp=args.cp)
    activations = per_micro_batch * held // (grid.pp_size * args.pp_chunks)       # one chunk's layers × held
    if plan.is_logging_rank:
        extras = (", sp" if args.sp else "") + (f", ep {args.ep}, {args.num_experts} experts"
                                                 if args.num_experts else "") + (", zero-1" if zero1 else "")
        peers = {dim: process_grid_peers(grid, dim) for dim in ("tp", "cp", "dp", "ep")}
        print(f"grid (dp {args.dp}, pp {args.pp}, cp {args.cp}, tp {args.tp}{extras}): rank 0 shares tp with "
              f"{peers['tp']}, cp with {peers['cp']}, pp with {list(grid.pp_ranks)}, dp with {peers['dp']}"
              + (f", ep with {peers['ep']}" if args.num_experts else "") + f"; model {config}")
    with comm.CommMeter({**grid.group_names(), **p2p.group_names()}) as meter:
        records = base.train(args, stages, optimizer, plan, dataset, config)
    if plan.is_logging_rank and records:
        print(f"final loss {records[-1]['loss']:.4f} after {records[-1]['step']} steps")
    everyone = report(grid, stages, optimizer, meter, activations, max(len(records), 1))
    if grid.pp_size > 1:
        pp_train.report_timeline(args, grid, pipe)         # measured, replayed and theory bubble
    return records, stages, pipe, everyone


def main(argv=None):
    return run(*tp_train.parse_and_check(argv, __doc__.splitlines()[0], build_parser, check_layout))[0]


if __name__ == "__main__":
    main()
