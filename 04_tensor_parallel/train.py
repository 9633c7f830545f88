"""Tensor parallelism (× data parallelism): 02's step on the 01 model split over `tp` ranks.

Playbook §2.3, Megatron-LM. The full model is built and seeded exactly as in 01, then split from outside
(tensor_parallel.apply_tensor_parallel): each rank keeps 1/tp of every linear, of the embedding and of the
head, and the loss is computed on vocab-sharded logits. The dp replicas average their gradients (02).
Communication per layer and micro-batch: 2 all-reduces of b·s·h elements forward and 2 backward in the tp
group, 8·b·s·h·(t−1)/t elements on the wire per rank ([MEG] §4.2.2). Activations per layer:
s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes (16-bit); the norm regions are not divided (05's SP does).

    torchrun --nproc_per_node 4 04_tensor_parallel/train.py --tp 4 --num-kv-heads 4
    torchrun --nproc_per_node 4 04_tensor_parallel/train.py --tp 2 --dp 2 --mbs 4

New in the step compared with 02: the collectives inside forward and backward (the model's f and f̄), and
the gradient norm summed over the tp shards (`clip_grad_norm_tp`). --partition-activations (ZeRO-R's P_a,
partition_activations.py) keeps 1/tp of each --recompute full checkpoint per rank.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "04_tensor_parallel")]

import functools

import build
import cli
import loop
import memory
import metrics
import mixed_precision
import process_grid
import comm
import data_parallel
import tensor_parallel
import kv_replication
import partition_activations


def train_step(model, optimizer, micro_batches, ddp, grid, args):
    """02's step on the tensor-parallel model; returns (global loss, gradient norm)."""
    optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    with mixed_precision.autocast(args, micro_batches[0][0].device):
        for i, (x, y) in enumerate(micro_batches):              # x, y: (mbs, T), this dp rank's rows
            with ddp.no_sync(enabled=i < len(micro_batches) - 1):   # only the last backward communicates
                # f / f̄ all-reduce over tp inside every block, forward and backward (print(model) shows them)
                micro_loss = model(x, labels=y) / len(micro_batches)
                # overlap/bucket: hooks all-reduce here (bf16-20: the fp32 accumulators)
                optimizer.scale(micro_loss).backward()
            loss += micro_loss.detach()
    ddp.finish_gradients()                                      # wait (naive: all-reduce now); the mean
    grad_owners = optimizer.unscale_gradients()                 # fp16: ÷ S; bf16-20: the fp32 masters
    kv_replication.all_reduce_kv_replica_gradients(grad_owners)  # tp > kv heads: Σ over a head's copies
    # ‖g‖² summed over the tp shards: the same on every rank, so are fp16's skipped steps
    grad_norm = tensor_parallel.clip_grad_norm_tp(grad_owners, args.grad_clip, grid.tp_group)
    optimizer.step(grad_norm)                                   # fp32 masters; fp16 overflow: skipped
    return data_parallel.global_mean(loss, grid.dp_group), grad_norm


def build_parser():
    parser = cli.core_parser(__doc__.splitlines()[0])
    process_grid.add_degree_arguments(parser, "dp", "tp")
    data_parallel.add_arguments(parser)
    partition_activations.add_arguments(parser)
    mixed_precision.add_arguments(parser)
    return parser


def check_layout(args, config):
    """Every layout error, raised before any process group exists."""
    tensor_parallel.check_tensor_parallel(config, args.tp)
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp, tp=args.tp)
    data_parallel.check_data_parallel(args.bucket_mb)
    partition_activations.check_partition_activations(args)
    mixed_precision.check_precision(args)


def run(args, config, dataset, grid):
    """Returns (records, model) (each rank's model holds its shards)."""
    model = build.build_model(args, config)                 # on meta: shapes only
    tensor_parallel.apply_tensor_parallel(model, grid)      # sliced on shapes
    build.materialize(model, args)                          # then this rank's shards get their values
    # ZeRO-R's P_a: with --partition-activations, each checkpoint kept in 1/tp slices
    partition_activations.apply_recompute(model, args.recompute, args.partition_activations, grid.tp_group)
    optimizer = mixed_precision.MixedPrecisionOptimizer(model.parameters(), args)  # hooks before DP's
    ddp = data_parallel.wrap(model.parameters(), grid.dp_group, args.dp_mode, args.bucket_mb,
                             grad_owners=optimizer.grad_owners_of(model.parameters()))
    if grid.rank == 0:
        activations = memory.activation_bytes_estimate(config, args.mbs, args.seq_len,
                                                       build.activation_element_bytes(args), args.recompute,
                                                       tp=grid.tp_size)
        if args.partition_activations:                      # full recompute's L·2·s·b·h, 1/tp of it per rank
            activations //= grid.tp_size
        memory.print_report(model, optimizer, activations, args, config,
                            f"memory per rank (dp {grid.dp_size}, tp {grid.tp_size})")
    step = functools.partial(train_step, model, optimizer, ddp=ddp, grid=grid, args=args)
    with comm.CommMeter(grid.group_names()) as meter:
        records = loop.train(args, step, model, optimizer, dataset,
                             metrics.flops_per_token(config, args.seq_len),
                             grid=grid, layout={"dp": grid.dp_size, "cp": grid.cp_size, "tp": grid.tp_size},
                             eval_step=meter.unmetered(functools.partial(
                                 data_parallel.eval_step, model, group=grid.dp_group, args=args)))
    if grid.rank == 0 and records:
        print(meter.table(f"communication per rank over {len(records)} steps"))
    return records, model


def main(argv=None):
    args, config, dataset = cli.setup(build_parser(), argv, check_layout)
    with process_grid.distributed(args.device, dp=args.dp, tp=args.tp, timeout_s=args.timeout_s) as grid:
        return run(args, config, dataset, grid)


if __name__ == "__main__":
    main()
