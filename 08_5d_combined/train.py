"""5D parallelism in one trainer: data × tensor (+ sequence) × context × pipeline × expert, with the kernels.

Playbook §2.8 (combining the techniques) and chapter 3 (choosing a layout); Megatron-LM's PTD-P
(Narayanan et al. 2021); Llama 3's rank order [TP, CP, PP, DP] (playbook §4.1). Nothing new is
implemented here: layout_5d.py applies the earlier folders' modules to the seeded full 01 model (TP/SP,
CP, MoE/EP, PP, recompute), and `train_step` below runs their step: the schedule's passes on this rank's
tokens, the reduction over the cp×dp ranks (02's DP in any --dp-mode or 03's ZeRO-1/2/3, inside the
schedule's last backward of each chunk where it can: gradient_sync.py), SP's norm sum, the norm over
every shard and stage. The grid is arange(world).view(dp, pp, cp, tp) (02's process_grid). Every rank logs the
global batch's mean loss, the same number as 01's (07's with experts).

    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --tp 2 --pp 2 --grad-acc 4 --mbs 4
    torchrun --nproc_per_node 8 08_5d_combined/train.py --tp 2 --sp --cp 2 --pp 2 --pp-schedule zb-h1 \\
        --grad-acc 4
    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --tp 2 --pp 2 --zero-stage 3 --grad-acc 4
    python 08_5d_combined/planner.py --preset 1b --tp 2 --pp 2 --dp 2 --seq-len 4096   # the arithmetic first

It prints the memory per rank (per pipeline stage), one line or bar per step, the communication of the
first rank of each stage per process group, the bubble of the last step, and with --capacity-factor
07's rows dropped over capacity, the whole model's (experts.log_dropped). Not composed: experts with --sp.
New in the step compared with 06: the lines of 02-05 and 07 around its schedule, in device order.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "03_zero"),
                os.path.join(ROOT, "04_tensor_parallel"), os.path.join(ROOT, "05_sequence_context_parallel"),
                os.path.join(ROOT, "06_pipeline"), os.path.join(ROOT, "07_expert_parallel"),
                os.path.join(ROOT, "08_5d_combined")]

import functools

import torch
import torch.distributed as dist

import build
import cli
import loop
import memory
import metrics
import mixed_precision
import process_grid
import comm
import sequence_parallel
import pipeline
import passes
import schedules
import timeline
import moe
import experts
import gradient_sync
import layout_5d as layout


def train_step(pipe, optimizer, micro_batches, sync, grid, args):
    """The composition of 02-07's steps; returns (global loss, gradient norm)."""
    optimizer.zero_grad(set_to_none=True)
    sync.zero_gradients()                                       # ZeRO-1: .grad views of the flat buffers
    positions = pipe.stages[0].position_ids                     # (T/cp,) this rank's tokens (05)
    with mixed_precision.autocast(args, micro_batches[0][0].device):
        # F, B (, W) of every micro-batch in the schedule's order; p2p between the stages inside
        # TP/SP/CP/EP run inside the passes; ZeRO-3 gathers a chunk before its first F
        # DP overlap/bucket and ZeRO-2/3 reduce in a chunk's last B or W (gradient_sync.py)
        loss = schedules.SCHEDULE_STEPS[args.pp_schedule](
            pipe, [(x[:, positions], y[:, positions]) for x, y in micro_batches])   # (mbs, T/cp) each
    # DP naive and ZeRO-1 reduce over cp×dp now, the others wait; then / N, and SP's norm and
    # 04's kv-copy gradients are summed over tp
    sync.finish_gradients()
    optimizer.unscale_gradients()                               # fp16: ÷ S (ZeRO: the shards' gradients)
    # ‖g‖² over every shard, replica and stage (04, 07): the same on every rank, so are fp16's skipped steps
    grad_norm = sync.clip_gradients(args.grad_clip)
    optimizer.step(grad_norm)                                   # fp32 masters; fp16 overflow: skipped
    sync.gather_shards()                                        # ZeRO-1/2: all-gather the updated shards
    return global_loss(loss, micro_batches[0][0].device, pipe, grid, args), grad_norm


def eval_step(pipe, micro_batches, grid, args):
    """A held-out global batch's loss: 06's forward passes on this rank's tokens, reduced as train_step's."""
    positions = pipe.stages[0].position_ids          # (T/cp,)
    device = micro_batches[0][0].device
    with torch.no_grad(), mixed_precision.autocast(args, device):
        loss = schedules.forward_only(pipe, [(x[:, positions], y[:, positions]) for x, y in micro_batches])
    pipe.grad_sync.release()                         # ZeRO-3: the units its forwards gathered
    return global_loss(loss, device, pipe, grid, args)


def global_loss(loss, device, pipe, grid, args):
    """The global batch's mean loss on every rank, from this rank's share of it."""
    if args.num_experts:                             # every stage holds a share of the loss (its aux)
        return experts.sum_over_stages(loss, device, grid)
    return pipeline.broadcast_loss(loss, device, grid.pp_ranks[pipe.loss_rank], grid.pp_group,
                                   grid.cp_dp_group, grid.cp_size * grid.dp_size)


def state_bytes(stages, optimizer, sync):
    """(parameters, gradients, optimizer states) this rank holds after a step, split as the planner's rows:
    parameters from their storages (ZeRO-3: the shards, the full units are freed); gradients one per
    parameter, as large as it (what a step holds at its end before ZeRO-2/3 reduce them), plus bf16-20's
    fp32 buffers (01's accumulators, ZeRO-1's flat units, or ZeRO-2/3's, held until that reduce-scatter
    frees them); AdamW's states plus bf16's fp32 masters."""
    params = [p for p in stages.parameters() if p.requires_grad]
    units = [(z.stage, u) for z in getattr(sync, "zeros", []) for u in z.units if not u.grad_views]
    fp32_grads = [*optimizer.accumulators, *(u.grad_full for stage, u in units if stage == 1)]
    freed = sum(u.padded * u.shard_grad.element_size() for stage, u in units if stage > 1)    # (U,) fp32 each
    masters = optimizer.masters if optimizer.masters is not optimizer.params else []
    return (memory.held_bytes([*params, *sync.shards]),
            memory.tensor_bytes(params) + memory.held_bytes(fp32_grads) + freed,
            memory.optimizer_state_bytes(optimizer) + memory.held_bytes(masters))


def report(args, config, grid, stages, optimizer, meter, steps, sync):
    """Rank 0 prints the measured memory of every stage and the communication of each stage's first rank."""
    per_micro_batch = memory.activation_bytes_estimate(config, args.mbs, args.seq_len,
                                                       build.activation_element_bytes(args), args.recompute,
                                                       tp=args.tp, sp=args.sp, cp=args.cp)
    per_micro_batch //= args.tp if args.partition_activations else 1          # P_a: 1/tp of each checkpoint
    held = schedules.peak_held(args.pp_schedule, grid.pp_size, grid.pp_rank, args.grad_acc, args.pp_chunks)
    activations = per_micro_batch * held // (grid.pp_size * args.pp_chunks)       # one chunk's layers × held
    mine = dict(coords=(grid.dp_rank, grid.pp_rank, grid.cp_rank, grid.tp_rank),
                states=state_bytes(stages, optimizer, sync), activations=activations,
                gathered=sum(z.peak_gathered_bytes for z in getattr(sync, "zeros", [])),   # ZeRO-3
                comm={key: (meter.calls[key], meter.payload[key], meter.wire[key]) for key in meter.calls})
    everyone = [None] * grid.world_size
    dist.all_gather_object(everyone, mine)
    if grid.rank == 0:
        print("memory per rank, measured after the last step (MiB; activations: the playbook's estimate for "
              "the micro-batches a stage holds)")
        print(f"  {'pp stage':<9}{'ranks':<16}{'parameters':>11}{'gradients':>11}{'optimizer':>11}"
              f"{'activations':>12}")
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
            print(stage_meter.table(f"communication of rank {first} (pp stage {stage}) per step",
                                    steps=steps))
    return everyone


def checkpoint_layout(args, grid) -> dict:
    """What a checkpoint records of the layout (01's loop refuses to resume another)."""
    return {"dp": grid.dp_size, "pp": grid.pp_size, "cp": grid.cp_size, "tp": grid.tp_size, "sp": args.sp,
            "pp_chunks": args.pp_chunks, "ep": grid.ep_size, "num_experts": args.num_experts,
            "zero_stage": args.zero_stage}


def print_grid(args, grid, config):
    peers = {dim: dist.get_process_group_ranks(getattr(grid, f"{dim}_group"))
             for dim in ("tp", "cp", "dp", "ep")}
    extras = (", sp" if args.sp else "") + (f", ep {args.ep}, {args.num_experts} experts" if args.num_experts
                                             else "") + (f", zero-{args.zero_stage}" if args.zero_stage
                                                         else f", dp-mode {args.dp_mode}")
    print(f"grid (dp {args.dp}, pp {args.pp}, cp {args.cp}, tp {args.tp}{extras}): rank 0 shares tp with "
          f"{peers['tp']}, cp with {peers['cp']}, pp with {list(grid.pp_ranks)}, dp with {peers['dp']}"
          + (f", ep with {peers['ep']}" if args.num_experts else "") + f"; model {config}")


def run(args, config, dataset, grid):
    """Returns (records, stages, pipe, everyone's measured states and communication)."""
    device = build.device_of(args)
    full = build.build_model(args, config)                 # 1. on meta, kernels applied: shapes only
    stages = layout.parallelize(full, args, grid, device)  # 2-5. TP/SP, CP, MoE/EP, PP, recompute (shapes)
    # ZeRO-3 (6.) draws only its flat shards from `source`, by global name and block (03)
    source = build.source(full, args) if args.zero_stage == 3 else None
    if source is None:
        # only this rank's shards of its stages get values
        build.materialize(full, args, keep=stages.parameters())
    del full                                               # the other stages' layers never existed
    norm_weights = sequence_parallel.norm_weights(stages) if args.sp else []
    dense, expert_params = moe.split_parameters(experts.stage_view(stages))   # (every parameter, []) if dense
    dropped = experts.count_dropped(stages, []) if args.capacity_factor else []   # rows over capacity (07)
    # 6. DP or ZeRO, and 01's AdamW (fp32 masters) on its shards
    sync, optimizer = gradient_sync.make(stages, dense, expert_params, norm_weights, grid, args, source)
    shape = pipeline.boundary_shape(args.mbs, args.seq_len, config.hidden_size, args.cp, args.tp, args.sp)
    # (mbs, T/cp[/tp], C) messages; DP or ZeRO reduce in a chunk's last backward; fp16: × S
    pipe = passes.build_pipeline(stages, grid, args, shape, device, optimizer.scale, grad_sync=sync)
    if grid.rank == 0:
        print_grid(args, grid, config)
    flops = metrics.flops_per_token(config, args.seq_len)
    if args.num_experts:                                   # MFU: the k experts a token uses (07)
        flops = moe.flops_per_token(flops, config, args.num_experts, args.top_k, args.shared_experts)
    step = functools.partial(train_step, pipe, optimizer, sync=sync, grid=grid, args=args)
    with comm.CommMeter({**grid.group_names(), **pipe.p2p.group_names()}) as meter:
        evaluate = meter.unmetered(functools.partial(eval_step, pipe, grid=grid, args=args))
        records = loop.train(args, step, stages, optimizer, dataset, flops, grid=grid,
                             layout=checkpoint_layout(args, grid), eval_step=evaluate)
    everyone = report(args, config, grid, stages, optimizer, meter, max(len(records), 1), sync)
    if args.capacity_factor and records:                   # after the meter: not training traffic
        experts.log_dropped(dropped, len(records), args, config, grid)
    if grid.pp_size > 1:
        timeline.report(args, grid, pipe.events)           # measured, replayed and theory bubble
    return records, stages, pipe, everyone


def main(argv=None):
    args, config, dataset = cli.setup(layout.build_parser(__doc__.splitlines()[0]), argv, layout.check_layout)
    with process_grid.distributed(args.device, dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep,
                                  timeout_s=args.timeout_s) as grid:
        return run(args, config, dataset, grid)


if __name__ == "__main__":
    main()
