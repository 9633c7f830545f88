"""Sequence parallelism (with TP) and context parallelism (ring attention): 04's step, sequence-split.

Playbook §2.4–2.5. On top of 04's tensor parallelism:
  --sp          Megatron sequence parallelism: the norm regions sharded along the sequence over the tp
                ranks (sequence_parallel.py); same communication volume as TP, norm-region activations / tp.
  --cp N        context parallelism: every rank keeps T/cp tokens of each sequence (its labels and RoPE
                positions too), attention runs as a ring (context_parallel.py); activations / cp, cp−1 K/V
                hops per layer forward. Gradients are averaged over the cp×dp ranks.
  --cp-layout   contiguous (rank r: chunk r) or zigzag (rank r: chunks r and 2cp−1−r, balanced).
  --cp-attn     ring (default), allgather (K/V all-gathered once per layer, allgather_kv.py) or ulysses:
                all-to-all from sequence- to head-sharded and back (ulysses.py).
The ranks form the grid arange(world).view(dp, 1, cp, tp).

    torchrun --nproc_per_node 4 05_sequence_context_parallel/train.py --tp 2 --sp --cp 2 --cp-layout zigzag
    torchrun --nproc_per_node 4 05_sequence_context_parallel/train.py --cp 2 --dp 2 --mbs 4

New in the step compared with 04: each rank feeds its tokens of every sequence (CP); SP's norm gradients are
summed over tp after the cp×dp average. --partition-activations is 04's P_a (with TP, not with SP).
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "04_tensor_parallel"),
                os.path.join(ROOT, "05_sequence_context_parallel")]

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
import sequence_parallel
import context_parallel
import sequence_context_layout as layout_mod


def train_step(model, optimizer, micro_batches, ddp, norm_weights, grid, args):
    """04's step on this rank's tokens of every sequence; returns (global loss, gradient norm)."""
    optimizer.zero_grad(set_to_none=True)
    layout = context_parallel.CPLayout(args.cp_layout, grid.cp_size)
    positions = layout.positions(grid.cp_rank, args.seq_len, micro_batches[0][0].device)   # (T/cp,)
    loss = 0.0
    with mixed_precision.autocast(args, micro_batches[0][0].device):
        for i, (x, y) in enumerate(micro_batches):              # x, y: (mbs, T), this dp rank's rows
            with ddp.no_sync(enabled=i < len(micro_batches) - 1):   # only the last backward communicates
                # SP's g / ḡ and the ring's K/V hops run inside forward and backward
                micro_loss = model(x[:, positions], labels=y[:, positions],   # (mbs, T/cp) each
                                   position_ids=positions) / len(micro_batches)
                # overlap/bucket: hooks all-reduce here (bf16-20: the fp32 accumulators)
                optimizer.scale(micro_loss).backward()
            loss += micro_loss.detach()
    # over the cp×dp ranks: `ddp` was built on grid.cp_dp_group
    ddp.finish_gradients()                                      # wait (naive: all-reduce now); the mean
    grad_owners = optimizer.unscale_gradients()                 # fp16: ÷ S; bf16-20: the fp32 masters
    kv_replication.all_reduce_kv_replica_gradients(grad_owners)  # tp > kv heads: Σ over a head's copies
    # SP: each tp rank's norms saw T/(cp·tp) tokens, so their gradients are summed over tp, after
    # DP's asynchronous all-reduces (which read these gradients)
    if args.sp:
        sequence_parallel.all_reduce_norm_gradients(norm_weights, grid.tp_group)
    # ‖g‖² summed over the tp shards: the same on every rank, so are fp16's skipped steps
    grad_norm = tensor_parallel.clip_grad_norm_tp(grad_owners, args.grad_clip, grid.tp_group)
    optimizer.step(grad_norm)                                   # fp32 masters; fp16 overflow: skipped
    return data_parallel.global_mean(loss, grid.cp_dp_group), grad_norm


def eval_step(model, micro_batches, grid, args):
    """A held-out global batch's loss, forward only: this rank's tokens of its rows, mean over cp×dp."""
    positions = context_parallel.CPLayout(args.cp_layout, grid.cp_size).positions(
        grid.cp_rank, args.seq_len, micro_batches[0][0].device)                                # (T/cp,)
    return data_parallel.global_mean(loop.mean_loss(model, micro_batches, args, positions), grid.cp_dp_group)


def build_parser():
    parser = cli.core_parser(__doc__.splitlines()[0])
    process_grid.add_degree_arguments(parser, "dp", "cp", "tp")
    data_parallel.add_arguments(parser)
    layout_mod.add_arguments(parser)
    partition_activations.add_arguments(parser)
    mixed_precision.add_arguments(parser)
    return parser


def check_layout(args, config):
    """Every layout error, raised before any process group exists."""
    layout_mod.check_sequence_layout(args, config)                  # CP, SP and attention rules
    tensor_parallel.check_tensor_parallel(config, args.tp)
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp, cp=args.cp, tp=args.tp)
    data_parallel.check_data_parallel(args.bucket_mb)
    partition_activations.check_partition_activations(args, sp=args.sp)   # SP's checkpoints are 1/tp already
    mixed_precision.check_precision(args)


def run(args, config, dataset, grid):
    """Returns (records, model) (each rank's model holds its tp shards)."""
    model = build.build_model(args, config)                         # on meta: shapes only
    layout_mod.parallelize(model, args, grid)                       # TP (+ SP), then CP, on shapes
    build.materialize(model, args)                                  # then this rank's shards get their values
    # 04's P_a: (B, T/cp, C) checkpoints kept as (B, T/cp, C/tp)
    partition_activations.apply_recompute(model, args.recompute, args.partition_activations, grid.tp_group)
    optimizer = mixed_precision.MixedPrecisionOptimizer(model.parameters(), args)  # hooks before DP's
    ddp = data_parallel.wrap(model.parameters(), grid.cp_dp_group, args.dp_mode, args.bucket_mb,
                             grad_owners=optimizer.grad_owners_of(model.parameters()))
    norm_weights = optimizer.grad_owners_of(sequence_parallel.norm_weights(model) if args.sp else [])
    if grid.rank == 0:
        activations = memory.activation_bytes_estimate(config, args.mbs, args.seq_len,
                                                       build.activation_element_bytes(args), args.recompute,
                                                       tp=grid.tp_size, sp=args.sp, cp=grid.cp_size)
        if args.partition_activations:                      # full recompute's L·2·(s/cp)·b·h, 1/tp of it
            activations //= grid.tp_size
        memory.print_report(model, optimizer, activations, args, config,
                            f"memory per rank (dp {grid.dp_size}, cp {grid.cp_size}, tp {grid.tp_size})")
    step = functools.partial(train_step, model, optimizer, ddp=ddp, norm_weights=norm_weights, grid=grid,
                             args=args)
    with comm.CommMeter(grid.group_names()) as meter:
        records = loop.train(args, step, model, optimizer, dataset,
                             metrics.flops_per_token(config, args.seq_len),
                             grid=grid, layout={"dp": grid.dp_size, "cp": grid.cp_size, "tp": grid.tp_size},
                             eval_step=meter.unmetered(functools.partial(eval_step, model, grid=grid,
                                                                         args=args)))
    if grid.rank == 0 and records:
        print(meter.table(f"communication per rank over {len(records)} steps"))
    return records, model


def main(argv=None):
    args, config, dataset = cli.setup(build_parser(), argv, check_layout)
    with process_grid.distributed(args.device, dp=args.dp, cp=args.cp, tp=args.tp,
                                  timeout_s=args.timeout_s) as grid:
        return run(args, config, dataset, grid)


if __name__ == "__main__":
    main()
