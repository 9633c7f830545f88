"""Pipeline parallelism (× data parallelism): the 01 model cut into `pp` stages, a schedule per step.

Playbook §2.6, Megatron-LM §4.2.1, Zero Bubble (arXiv 2401.10241). The full model is built and seeded
exactly as in 01, then each rank keeps only its stage (pipeline.py) and runs the chosen schedule over the
--grad-acc micro-batches (schedules.py); the last stage's loss is broadcast so every rank logs the same
number, and the gradient norm is taken over all stages. With --dp, the dp pipelines average their
gradients once, after the last micro-batch (02's `average_gradients`).
Bubble (idle / useful per rank): (p−1)/m for afab and 1f1b, (p−1)/(V·m) interleaved, (p−1)/(3m) zb-h1
and dualpipev, (p−1)/(6m) zb-v (v_schedules.py; --pp-chunks 2, blocks placed V-wise).

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule 1f1b --grad-acc 8 \\
        --timeline 1f1b.png
    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 2 --dp 2 --pp-schedule zb-h1 --grad-acc 4 --mbs 4

New in the step compared with 02: the micro-batch loop is a schedule of F/B(/W) passes with point-to-point
sends between stages; the norm is summed over the stages and the loss comes from the last stage.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "06_pipeline")]

import functools

import torch

import build
import cli
import loop
import memory
import metrics
import mixed_precision
import recompute
import process_grid
import comm
import data_parallel
import pipeline
import passes
import schedules
import timeline


def train_step(pipe, optimizer, micro_batches, grid, args):
    """02's step with the micro-batches run as a pipeline schedule; returns (global loss, gradient norm)."""
    optimizer.zero_grad(set_to_none=True)
    with mixed_precision.autocast(args, micro_batches[0][0].device):
        # F, B (, W) of every micro-batch in the schedule's order; p2p between the stages inside
        loss = schedules.SCHEDULE_STEPS[args.pp_schedule](pipe, micro_batches)
    grad_owners = optimizer.unscale_gradients()                 # fp16: ÷ S; bf16-20: the fp32 masters
    if grid.dp_size > 1:
        data_parallel.average_gradients(grad_owners, grid.dp_group)  # mean over the dp pipelines
    # ‖g‖² summed over the stages: the same on every rank, so are fp16's skipped steps
    grad_norm = pipeline.clip_grad_norm_pp(grad_owners, args.grad_clip, grid.pp_group)
    optimizer.step(grad_norm)                                   # fp32 masters; fp16 overflow: skipped
    return pipeline.broadcast_loss(loss, micro_batches[0][0].device, grid.pp_ranks[pipe.loss_rank],
                                   grid.pp_group, grid.dp_group, grid.dp_size), grad_norm


def eval_step(pipe, micro_batches, grid, args):
    """A held-out global batch's loss: the forward passes only, then the last stage's loss to every rank."""
    with torch.no_grad(), mixed_precision.autocast(args, micro_batches[0][0].device):
        loss = schedules.forward_only(pipe, micro_batches)
    return pipeline.broadcast_loss(loss, micro_batches[0][0].device, grid.pp_ranks[pipe.loss_rank],
                                   grid.pp_group, grid.dp_group, grid.dp_size)


def build_parser():
    parser = cli.core_parser(__doc__.splitlines()[0])
    process_grid.add_degree_arguments(parser, "dp", "pp")
    pipeline.add_arguments(parser)
    mixed_precision.add_arguments(parser)
    return parser


def check_layout(args, config):
    """Every layout error, raised before any process group exists."""
    pipeline.check_pipeline(config.num_hidden_layers, args.pp, args.pp_chunks, args.pp_schedule,
                            args.grad_acc, config.tie_word_embeddings)
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp, pp=args.pp)
    mixed_precision.check_precision(args)


def run(args, config, dataset, grid):
    """Returns (records, stages, pipe, the last step's events of this pipeline, the communication meter)."""
    device = build.device_of(args)
    full = build.build_model(args, config)                  # on meta: shapes only
    recompute.apply_recompute(full, args.recompute)
    # zb-v, dualpipev: rank r holds blocks r and 2p−1−r
    stages = pipeline.build_stages(full, grid.pp_rank, grid.pp_size, args.pp_chunks,
                                   v_shape=args.pp_schedule in pipeline.V_SHAPED)
    build.materialize(full, args, keep=stages.parameters())  # only this rank's stages get values
    del full                                                # the other stages' layers never existed
    optimizer = mixed_precision.MixedPrecisionOptimizer(stages.parameters(), args)   # AdamW on fp32 masters
    shape = pipeline.boundary_shape(args.mbs, args.seq_len, config.hidden_size)          # (mbs, T, C)
    pipe = passes.build_pipeline(stages, grid, args, shape, device, optimizer.scale)     # fp16: × S
    held = schedules.peak_held(args.pp_schedule, grid.pp_size, grid.pp_rank, args.grad_acc, args.pp_chunks)
    if grid.rank == 0:
        per_micro_batch = memory.activation_bytes_estimate(config, args.mbs, args.seq_len,
                                                           build.activation_element_bytes(args),
                                                           args.recompute)
        memory.print_report(stages, optimizer, per_micro_batch * held // (grid.pp_size * args.pp_chunks),
                            args, config, f"memory of rank 0 (dp {grid.dp_size}, pp {grid.pp_size}, "
                                          f"activations of {held} micro-batch·chunks held)")
    step = functools.partial(train_step, pipe, optimizer, grid=grid, args=args)
    with comm.CommMeter({**grid.group_names(), **pipe.p2p.group_names()}) as meter:
        records = loop.train(args, step, stages, optimizer, dataset,
                             metrics.flops_per_token(config, args.seq_len), grid=grid,
                             layout={"dp": grid.dp_size, "pp": grid.pp_size, "pp_chunks": args.pp_chunks},
                             eval_step=meter.unmetered(functools.partial(eval_step, pipe, grid=grid,
                                                                         args=args)))
    if grid.rank == 0 and records:
        print(meter.table(f"communication of rank 0 over {len(records)} steps"))
    events = timeline.report(args, grid, pipe.events)      # the last step: bubble, picture
    return records, stages, pipe, events, meter


def main(argv=None):
    args, config, dataset = cli.setup(build_parser(), argv, check_layout)
    with process_grid.distributed(args.device, dp=args.dp, pp=args.pp, timeout_s=args.timeout_s) as grid:
        return run(args, config, dataset, grid)


if __name__ == "__main__":
    main()
