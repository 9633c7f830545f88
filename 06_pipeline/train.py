"""Pipeline parallelism (optionally × data parallelism): the 01 model cut into `pp` stages.

Playbook §2.6, Megatron-LM §4.2.1, Zero Bubble (arXiv 2401.10241). The full model is built and
seeded exactly as in 01, then each rank keeps only its stage (pipeline.py) and runs the chosen
schedule over the --grad-acc micro-batches (schedules.py); the last stage's loss is broadcast so
every rank logs the same number, and the gradient norm is taken over all stages. With --dp, the dp
pipelines average their gradients once, after the last micro-batch (02's `average_gradients`).
Bubble (idle / useful per rank): (p−1)/m for afab and 1f1b, (p−1)/(V·m) interleaved, (p−1)/(3m) zb-h1.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule 1f1b --grad-acc 8 --timeline 1f1b.png
    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule interleaved --pp-chunks 2 --grad-acc 8 --num-layers 8
    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 2 --dp 2 --pp-schedule zb-h1 --grad-acc 4 --mbs 4
    python 06_pipeline/train.py --pp 3          # fails at once: pp·pp-chunks = 3 does not divide num_layers=4

It prints the per-rank memory, one line or bar per step (the loss equals 01's for the same global
batch dp·mbs·grad_acc), the communication of rank 0, and the last step's bubble: measured
(wall clock), replayed (the executed order with ideal pass times) and the theory.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere; folders import by dotted name

import functools
import os
from importlib import import_module

import torch
import torch.distributed as dist

base = import_module("01_single_gpu.legacy_train")
cli, memory = base.cli, base.memory
process_grid = import_module("02_data_parallel.process_grid")
comm = import_module("02_data_parallel.comm")
data_parallel = import_module("02_data_parallel.data_parallel")
pipeline = import_module("06_pipeline.pipeline")
schedules = import_module("06_pipeline.schedules")
timeline = import_module("06_pipeline.timeline")


def add_pipeline_arguments(parser):
    """--pp, --pp-schedule, --pp-chunks, --timeline (also 08's); returns the argument group."""
    g = parser.add_argument_group("pipeline parallelism (--grad-acc is the number of micro-batches m)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks per pipeline)")
    g.add_argument("--pp-schedule", choices=pipeline.SCHEDULES, default="1f1b")
    g.add_argument("--pp-chunks", type=int, default=1, help="model chunks per rank (V, interleaved schedule)")
    g.add_argument("--timeline", metavar="PATH.png", help="draw the last step's executed timeline (needs matplotlib)")
    return g


def build_parser():
    p = cli.core_parser(__doc__.splitlines()[0])
    g = add_pipeline_arguments(p)
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree: pipelines that split the global batch")
    return p


def parse(argv=None):
    """args, or exit with the layout error (status 2) before any process group exists."""
    parser = build_parser()
    args = cli.parse_args(parser, argv)
    try:
        pipeline.check_pipeline(args.num_layers, args.pp, args.pp_chunks, args.pp_schedule, args.grad_acc,
                                args.tie_embeddings)
        process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp, pp=args.pp)
    except ValueError as error:
        parser.error(str(error))
    return args


def make_plan(args, grid, stages, pipe):
    params = [p for p in stages.parameters() if p.requires_grad]
    step = schedules.SCHEDULE_STEPS[args.pp_schedule]

    def finish_gradients():                 # once per step, after the last micro-batch
        if grid.dp_size > 1:
            data_parallel.average_gradients(params, grid.dp_group)

    return base.TrainPlan(
        dp_rank=grid.dp_rank, dp_size=grid.dp_size, is_logging_rank=grid.rank == 0,
        forward_backward=lambda model, micro_batches: step(pipe, micro_batches),
        finish_gradients=finish_gradients,
        clip_gradients=functools.partial(pipeline.clip_grad_norm_pp, pp_group=grid.pp_group),
        global_loss=functools.partial(pipeline.broadcast_loss, device=base.device_of(args), pp_ranks=grid.pp_ranks,
                                      pp_group=grid.pp_group, dp_group=grid.dp_group, dp_size=grid.dp_size),
        layout={"dp": grid.dp_size, "pp": grid.pp_size, "pp_chunks": args.pp_chunks}, world_size=grid.world_size)


def report_timeline(args, grid, pipe):
    """Gather the last step's events of this pipeline; rank 0 prints the bubble and draws the picture."""
    events = [None] * grid.pp_size
    dist.all_gather_object(events, pipe.events, group=grid.pp_group)
    events = [e for rank_events in events for e in rank_events]
    p, m, V = grid.pp_size, args.grad_acc, args.pp_chunks
    theory = timeline.theory_bubble(args.pp_schedule, p, m, V)
    measured, replayed = timeline.measured_bubble(events), timeline.replayed_bubble(events, p, V)
    if grid.rank == 0:
        print(f"bubble ({args.pp_schedule}, p={p}, m={m}, V={V}): measured {measured:.1%} (wall clock), "
              f"replayed {replayed:.1%} (ideal pass times), theory {theory:.1%}")
        if args.timeline:
            title = (f"{args.pp_schedule}: p={p}, m={m}" + (f", V={V}" if V > 1 else "") +
                     f" | bubble: measured {measured:.0%}, replayed {replayed:.1%}, theory {theory:.1%}")
            timeline.render_png(events, args.timeline, title, p, V)
            print(f"timeline written to {args.timeline}")
    return events


def run(args):
    """Returns (records, stages, pipe, the last step's events of this pipeline, the communication meter)."""
    grid = process_grid.init_distributed(args.device, dp=args.dp, pp=args.pp)
    tokenizer, dataset = base.load_data(args)
    config = cli.model_config(args, tokenizer.vocab_size)
    device = base.device_of(args)
    full = base.build_model(args, config)                   # every rank: the same seeded full model
    base.recompute.apply_recompute(full, args.recompute)
    stages = pipeline.build_stages(full, grid.pp_rank, grid.pp_size, args.pp_chunks).to(device)
    del full                                                # the other stages' layers are freed
    optimizer = base.make_optimizer(stages.parameters(), args)
    shape = pipeline.boundary_shape(args.mbs, args.seq_len, config.hidden_size)          # (mbs, T, C)
    p2p = pipeline.P2P(grid.pp_ranks, grid.pp_rank, pipeline.direction_groups(grid, args.pp_chunks), args.pp_chunks,
                       shape, base.param_dtype(args), device)
    pipe = schedules.Pipeline(stages, p2p, schedules.pass_clock(device),          # ZB-H1: split dW off B
                              split_backward=args.pp_schedule == "zb-h1")
    plan = make_plan(args, grid, stages, pipe)
    element = 2 if args.dtype == "bfloat16" else torch.empty(0, dtype=base.param_dtype(args)).element_size()
    held = schedules.peak_held(args.pp_schedule, grid.pp_size, grid.pp_rank, args.grad_acc, args.pp_chunks)
    per_micro_batch = memory.activation_bytes_estimate(config, args.mbs, args.seq_len, element, args.recompute)
    activations = per_micro_batch * held // (grid.pp_size * args.pp_chunks)     # layers of one chunk × held
    base.print_setup(args, config, stages, optimizer, activations, plan=plan,
                     title=f"memory of rank 0 (dp {grid.dp_size}, pp {grid.pp_size}, "
                           f"activations of {held} micro-batch·chunks held)")
    with comm.CommMeter({**grid.group_names(), **p2p.group_names()}) as meter:
        records = base.train(args, stages, optimizer, plan, dataset, config)
    if plan.is_logging_rank and records:
        print(meter.table(f"communication of rank 0 over {len(records)} steps"))
        print(f"final loss {records[-1]['loss']:.4f} after {records[-1]['step']} steps")
    events = report_timeline(args, grid, pipe)
    return records, stages, pipe, events, meter


def main(argv=None):
    return run(parse(argv))[0]


if __name__ == "__main__":
    main()
