"""Mixture of experts with expert parallelism (× data parallelism): 02's step on an MoE Llama.

Playbook §2.7. The 01 model is built and seeded as everywhere, its MLPs are replaced by MoE blocks
(moe.apply_moe: E seeded experts, top-k router, load-balancing loss returned by every layer; optional
shared experts, capacity factor and router z-loss) and expert_parallel.apply_expert_parallel keeps E/ep
experts per rank and routes tokens by all-to-all.
`--dp D --ep P`: D data-parallel ranks, each reading 1/D of the global batch (dp·mbs·grad_acc sequences);
every P consecutive ones split the experts (P divides D). Dense gradients are averaged over dp, expert
gradients summed over the D/P replicas and divided by D. Per rank: expert parameters, gradients and
optimizer states 1/ep; all-to-all bytes per MoE layer and micro-batch 2·(s_out + s_in)·C·b + 8·(ep−1)·E/ep.

    python 07_expert_parallel/train.py --num-experts 4 --top-k 2 --mbs 8          # one device: the reference
    torchrun --nproc_per_node 4 07_expert_parallel/train.py --dp 4 --ep 2 --mbs 2
    torchrun --nproc_per_node 2 07_expert_parallel/train.py --dp 2 --ep 2 --shared-experts 1 \
        --capacity-factor 1

New in the step compared with 02: the loss includes α·aux, the experts' gradients are synchronised over
other ranks than the dense ones (`sync_gradients`), and the norm counts each expert once; with a
capacity factor the rows dropped are counted per micro-batch and logged at the end.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "07_expert_parallel")]

import functools

import torch
import torch.distributed as dist

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
import moe
import expert_parallel


def train_step(model, optimizer, micro_batches, dense, experts, grid, args, dropped):
    """02's step on the MoE model; returns (global loss, gradient norm); appends this rank's rows dropped
    over capacity to `dropped`."""
    optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    with mixed_precision.autocast(args, micro_batches[0][0].device):
        for x, y in micro_batches:                              # x, y: (mbs, T), this dp rank's rows
            micro_loss = model(x, labels=y) / len(micro_batches)   # cross-entropy + α·Σ aux + β·Σ z-loss
            dropped.append(moe.dropped_rows(model))             # before backward: a recompute repeats forward
            # EP: the all-to-alls' backward sends the gradients home
            optimizer.scale(micro_loss).backward()
            loss += micro_loss.detach()
    optimizer.unscale_gradients()                               # fp16: ÷ S; `dense`, `experts`: grad owners
    # dense: the mean over dp; experts: Σ over expert_dp, / dp
    expert_parallel.sync_gradients(dense, experts, grid)
    # the experts' ‖g‖² summed over ep, each expert once: the same on every rank, so are fp16's skipped steps
    grad_norm = expert_parallel.clip_grad_norm_ep(dense + experts, args.grad_clip, experts, grid.ep_group)
    optimizer.step(grad_norm)                                   # fp32 masters; fp16 overflow: skipped
    return data_parallel.global_mean(loss, grid.dp_group), grad_norm


def build_parser():
    parser = cli.core_parser(__doc__.splitlines()[0])
    process_grid.add_degree_arguments(parser, "dp", "ep")
    moe.add_arguments(parser)
    mixed_precision.add_arguments(parser)
    return parser


def check_layout(args, config):
    """Every layout error, raised before any process group exists."""
    moe.check_moe(args.num_experts, args.top_k, args.aux_loss_coef, **moe.extras(args))
    expert_parallel.check_expert_parallel(args.num_experts, args.ep, args.dp)
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp, ep=args.ep)
    mixed_precision.check_precision(args)


def expert_memory(args, config, model, ep):
    """The experts this rank holds, measured, beside E·L·3·C·F elements / ep."""
    _, experts = moe.split_parameters(model)
    element = experts[0].element_size()
    total = (args.num_experts * config.num_hidden_layers * 3 * config.hidden_size * config.intermediate_size
             * element)
    held = len(moe.moe_blocks(model)[0].experts)
    return (f"experts per rank: {held} of {args.num_experts} per layer, parameters "
            f"{memory.tensor_bytes(experts) / 2**20:.2f} MiB measured, "
            f"E·L·3·C·F/ep = {total / ep / 2**20:.2f} MiB")


def run(args, config, dataset, grid):
    """Returns (records, model, meter). Plain `python`: one device (a world of one)."""
    model = build.build_model(args, config)                 # on meta: shapes only
    moe.apply_moe(model, args.num_experts, args.top_k, args.aux_loss_coef, args.seed, **moe.extras(args))
    if grid.ep_size > 1:
        expert_parallel.apply_expert_parallel(model, grid)  # this rank keeps E/ep experts (still shapes)
    build.materialize(model, args)                          # then they, and the dense weights, get values
    recompute.apply_recompute(model, args.recompute)
    optimizer = mixed_precision.MixedPrecisionOptimizer(model.parameters(), args)   # AdamW on fp32 masters
    dense, experts = map(optimizer.grad_owners_of, moe.split_parameters(model))  # whose .grad is reduced
    if grid.rank == 0:
        activations = memory.activation_bytes_estimate(config, args.mbs, args.seq_len,
                                                       build.activation_element_bytes(args), args.recompute)
        memory.print_report(model, optimizer, activations, args, config,
                            f"memory per rank (dp {grid.dp_size}, "
                            f"ep {grid.ep_size}; activations: the dense Llama's estimate)")
        print(expert_memory(args, config, model, grid.ep_size))
    flops = moe.flops_per_token(metrics.flops_per_token(config, args.seq_len), config, args.num_experts,
                                args.top_k, args.shared_experts)
    dropped = []                                            # rows over capacity, per micro-batch
    step = functools.partial(train_step, model, optimizer, dense=dense, experts=experts, grid=grid, args=args,
                             dropped=dropped)
    with comm.CommMeter(grid.group_names()) as meter:
        records = loop.train(args, step, model, optimizer, dataset, flops, grid=grid,
                             layout={"dp": grid.dp_size, "ep": grid.ep_size},
                             eval_step=meter.unmetered(functools.partial(
                                 data_parallel.eval_step, model, group=grid.dp_group, args=args)))
    if grid.rank == 0 and grid.world_size > 1 and records:
        print(meter.table(f"communication per rank per step (average of {len(records)} steps)",
                          steps=len(records)))
    if args.capacity_factor and records:
        log_dropped(dropped, args, config, grid)
    if grid.rank == 0 and records:
        rows = args.mbs * args.seq_len * args.top_k
        print(f"expert load in the last forward on rank 0 (rows per expert; {rows} rows a layer, "
              f"{rows / args.num_experts:g} each if balanced):")
        print("\n".join(moe.load_lines(model)))
    return records, model, meter


def log_dropped(dropped, args, config, grid):
    """Rows dropped over capacity, summed over the dp ranks (after the meter: not training traffic)."""
    total = torch.tensor(sum(dropped), dtype=torch.float64)
    if grid.dp_size > 1:
        dist.all_reduce(total, group=grid.dp_group)
    rows = len(dropped) * grid.dp_size * args.mbs * args.seq_len * args.top_k * config.num_hidden_layers
    if grid.rank == 0:
        print(moe.dropped_line(int(total), rows, args.capacity_factor, len(dropped) // args.grad_acc))
    return int(total)


def main(argv=None):
    args, config, dataset = cli.setup(build_parser(), argv, check_layout)
    with process_grid.distributed(args.device, dp=args.dp, ep=args.ep, timeout_s=args.timeout_s) as grid:
        return run(args, config, dataset, grid)


if __name__ == "__main__":
    main()
