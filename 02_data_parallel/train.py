"""Data-parallel training: 01's loop on `dp` ranks, each reading 1/dp of every global batch.

Playbook §2.2. The full model is built and seeded exactly as in 01 on every rank, the sampler gives
rank r rows r·mbs … (r+1)·mbs−1 of each micro-batch slot (so `--dp D --mbs M` trains on the same
global batch as 01's `--mbs D·M`), and `data_parallel.py` averages the gradients in one of three
ways (--dp-mode naive | overlap | bucket). The logged loss is the mean over the global batch
(all-reduced over dp), so it equals 01's. Communication per rank per step:
    all-reduce of the gradients  2(N−1)/N · Ψ bytes  (+ 2(N−1)/N · 4 bytes for the logged loss)

    torchrun --nproc_per_node 4 02_data_parallel/train.py --dp 4 --mbs 2 --steps 50
    torchrun --nproc_per_node 4 02_data_parallel/train.py --dp 4 --mbs 2 --dp-mode overlap
    torchrun --nproc_per_node 4 02_data_parallel/train.py --dp 4 --mbs 2 --dp-mode bucket --bucket-mb 0.05
    python 01_single_gpu/train.py --mbs 8 --steps 50          # the same losses on one device

It prints the memory per rank (every rank holds everything: DP alone saves no memory), one line or
bar per step, and the communication every rank issued, per step.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere; folders import by dotted name

import os
from importlib import import_module

import torch
import torch.distributed as dist

base = import_module("01_single_gpu.legacy_train")
cli, memory = base.cli, base.memory
process_grid = import_module("02_data_parallel.process_grid")
comm = import_module("02_data_parallel.comm")
data_parallel = import_module("02_data_parallel.data_parallel")


def build_parser(description):
    p = cli.core_parser(description)
    g = p.add_argument_group("data parallelism")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree: replicas that split the global batch")
    g.add_argument("--dp-mode", choices=["naive", "overlap", "bucket"], default="bucket",
                   help="all-reduce after backward, per-parameter async hooks, or flat buckets")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size for --dp-mode bucket (DDP's 25 MB)")
    return p


def check_layout(args):
    """Every layout error, raised before `init_distributed` creates a group."""
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp)
    if args.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb must be positive, got {args.bucket_mb}")


def parse_and_check(argv, description, build_parser=build_parser, check_layout=check_layout):
    """args, or exit with the layout error (status 2) before any process group exists."""
    parser = build_parser(description)
    args = cli.parse_args(parser, argv)
    try:
        check_layout(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def mean_over(group):
    """this rank's mean loss -> the mean over the ranks of `group` (the global batch's loss)."""
    def global_loss(loss):
        loss = torch.as_tensor(loss).detach().clone()                   # () on every rank
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)        # gloo has no ReduceOp.AVG
        return float(loss / dist.get_world_size(group))
    return global_loss


def activation_estimate(args, config):
    element = 2 if args.dtype == "bfloat16" else torch.empty(0, dtype=base.param_dtype(args)).element_size()
    return memory.activation_bytes_estimate(config, args.mbs, args.seq_len, element, args.recompute)


def train_metered(args, model, optimizer, plan, dataset, config, grid):
    """01's loop under the communication meter; prints the per-step table on the logging rank."""
    with comm.CommMeter(grid.group_names()) as meter:
        records = base.train(args, model, optimizer, plan, dataset, config)
    if plan.is_logging_rank and records:
        print(meter.table(f"communication per rank per step (average of {len(records)} steps)", steps=len(records)))
        print(f"final loss {records[-1]['loss']:.4f} after {records[-1]['step']} steps")
    return records, meter


def setup(args):
    """Grid, data, and the full 01 model on this rank's device: (grid, dataset, config, model)."""
    grid = process_grid.init_distributed(args.device, dp=args.dp)
    tokenizer, dataset = base.load_data(args)
    config = cli.model_config(args, tokenizer.vocab_size)
    model = base.build_model(args, config).to(base.device_of(args))
    base.recompute.apply_recompute(model, args.recompute)
    return grid, dataset, config, model


def run(args):
    """Train with data parallelism; returns (records, model, the DataParallel object, the meter)."""
    grid, dataset, config, model = setup(args)
    ddp = data_parallel.wrap(model, grid.dp_group, args.dp_mode, args.bucket_mb)
    optimizer = base.make_optimizer(model.parameters(), args)
    plan = base.TrainPlan(dp_rank=grid.dp_rank, dp_size=grid.dp_size, is_logging_rank=grid.rank == 0,
                          forward_backward=ddp.forward_backward, finish_gradients=ddp.finish_gradients,
                          global_loss=mean_over(grid.dp_group), layout={"dp": grid.dp_size},
                          world_size=grid.world_size)
    base.print_setup(args, config, model, optimizer, activation_estimate(args, config), plan=plan,
                     title=f"memory per rank (dp {grid.dp_size}, {args.dp_mode}: a full replica everywhere)")
    records, meter = train_metered(args, model, optimizer, plan, dataset, config, grid)
    return records, model, ddp, meter


def main(argv=None):
    return run(parse_and_check(argv, __doc__.splitlines()[0]))[0]


if __name__ == "__main__":
    main()
