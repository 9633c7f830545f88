"""Data-parallel training: 01's step on `dp` ranks, each reading 1/dp of every global batch.

Playbook §2.2. Every rank builds the full model seeded exactly as in 01; the sampler gives rank r rows
r·mbs … (r+1)·mbs−1 of each micro-batch slot (so `--dp D --mbs M` trains on the global batch of 01's
`--mbs D·M`), and data_parallel.py averages the gradients (--dp-mode naive | overlap | bucket). The
logged loss is the mean over the global batch (all-reduced over dp), so it equals 01's.
Communication per rank per step: the gradients' all-reduce, 2(N−1)/N · Ψ bytes (ring). 01's
--precision-layout and --dtype float16 apply as they are: bf16-20 all-reduces its fp32 accumulators, and
the norm after the all-reduce, fp16's overflow check, is the same on every rank, hence so are the skips.

    torchrun --nproc_per_node 4 02_data_parallel/train.py --dp 4 --mbs 2 --steps 50
    torchrun --nproc_per_node 4 02_data_parallel/train.py --dp 4 --mbs 2 --dp-mode overlap
    python 01_single_gpu/train.py --mbs 8 --steps 50          # the same losses on one device

New in the step compared with 01: `no_sync` on all micro-batches but the last, and `finish_gradients`.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel")]

import functools

import build
import cli
import loop
import memory
import metrics
import mixed_precision
import optim
import recompute
import process_grid
import comm
import data_parallel


def train_step(model, optimizer, micro_batches, ddp, grid, args):
    """01's step, with the gradients averaged over the dp ranks; returns (global loss, gradient norm)."""
    optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    with mixed_precision.autocast(args, micro_batches[0][0].device):
        for i, (x, y) in enumerate(micro_batches):              # x, y: (mbs, T), this dp rank's rows
            with ddp.no_sync(enabled=i < len(micro_batches) - 1):   # only the last backward communicates
                micro_loss = model(x, labels=y) / len(micro_batches)
                # overlap/bucket: hooks all-reduce here (bf16-20: the fp32 accumulators)
                optimizer.scale(micro_loss).backward()
            loss += micro_loss.detach()
    ddp.finish_gradients()                                      # wait (naive: all-reduce now); the mean
    grad_owners = optimizer.unscale_gradients()                 # fp16: ÷ S; bf16-20: the fp32 masters
    # the norm of the all-reduced gradients: the same on every rank, so are fp16's skipped steps
    grad_norm = optim.clip_grad_norm(grad_owners, args.grad_clip)  # summed in fp32 (bf16-16 too)
    optimizer.step(grad_norm)                                   # fp32 masters; fp16 overflow: skipped
    return data_parallel.global_mean(loss, grid.dp_group), grad_norm


def build_parser():
    parser = cli.core_parser(__doc__.splitlines()[0])
    process_grid.add_degree_arguments(parser, "dp")
    data_parallel.add_arguments(parser)
    mixed_precision.add_arguments(parser)
    return parser


def check_layout(args, config):
    """Every layout error, raised before any process group exists."""
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp)
    data_parallel.check_data_parallel(args.bucket_mb)
    mixed_precision.check_precision(args)


def run(args, config, dataset, grid):
    """Returns (records, model, the DataParallel object, the communication meter)."""
    model = build.materialize(build.build_model(args, config), args)      # a full replica on every rank
    recompute.apply_recompute(model, args.recompute)
    optimizer = mixed_precision.MixedPrecisionOptimizer(model.parameters(), args)  # hooks before DP's
    ddp = data_parallel.wrap(model.parameters(), grid.dp_group, args.dp_mode, args.bucket_mb,
                             grad_owners=optimizer.grad_owners_of(model.parameters()))  # bf16-20: fp32
    if grid.rank == 0:
        activations = memory.activation_bytes_estimate(config, args.mbs, args.seq_len,
                                                       build.activation_element_bytes(args), args.recompute)
        memory.print_report(model, optimizer, activations, args, config,
                            f"memory per rank (dp {grid.dp_size}, {args.dp_mode}: a full replica everywhere)")
    step = functools.partial(train_step, model, optimizer, ddp=ddp, grid=grid, args=args)
    with comm.CommMeter(grid.group_names()) as meter:
        records = loop.train(args, step, model, optimizer, dataset,
                             metrics.flops_per_token(config, args.seq_len),
                             grid=grid, layout={"dp": grid.dp_size},
                             eval_step=meter.unmetered(functools.partial(
                                 data_parallel.eval_step, model, group=grid.dp_group, args=args)))
    if grid.rank == 0 and records:
        print(meter.table(f"communication per rank per step (average of {len(records)} steps)",
                          steps=len(records)))
    return records, model, ddp, meter


def main(argv=None):
    args, config, dataset = cli.setup(build_parser(), argv, check_layout)
    with process_grid.distributed(args.device, dp=args.dp, timeout_s=args.timeout_s) as grid:
        return run(args, config, dataset, grid)


if __name__ == "__main__":
    main()
