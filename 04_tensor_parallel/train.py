"""Tensor parallelism (optionally × data parallelism): the 01 model split over `tp` ranks.

Playbook §2.3, Megatron-LM. The full model is built and seeded exactly as in 01, then split from
outside (`tensor_parallel.apply_tensor_parallel`); each rank keeps 1/tp of every linear, of the
embedding and of the head, and the loss is computed on vocab-sharded logits. With `--dp`, the `dp`
replicas average their gradients (02's `average_gradients`). Communication per layer and
micro-batch: 2 all-reduces of b·s·h elements forward and 2 backward in the tp group
(8·b·s·h·(t−1)/t elements on the wire per rank, forward and backward, [MEG] §4.2.2). Activations per layer:
s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes (16-bit), the norm regions are not divided (05's SP does).

    torchrun --nproc_per_node 4 04_tensor_parallel/train.py --tp 4 --num-kv-heads 4
    torchrun --nproc_per_node 4 04_tensor_parallel/train.py --tp 2 --dp 2 --mbs 4
    python 04_tensor_parallel/train.py --tp 3      # fails at once: tp=3 does not divide num_attention_heads=4

It prints the per-rank parameters and memory, one line or bar per step (the loss equals 01's for the
same global batch dp·mbs·grad_acc), and a table of the communication every rank issued.
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
cli, data, memory = base.cli, base.data, base.memory
process_grid = import_module("02_data_parallel.process_grid")
comm = import_module("02_data_parallel.comm")
data_parallel = import_module("02_data_parallel.data_parallel")
tensor_parallel = import_module("04_tensor_parallel.tensor_parallel")


def build_parser(description):
    p = cli.core_parser(description)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: ranks that split every weight matrix")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree: replicas that split the global batch")
    return p


def config_of(args):
    """The model config, known before any process group exists (the tokenizer fixes the vocabulary)."""
    return cli.model_config(args, data.load_tokenizer(args.tokenizer).vocab_size)


def check_layout(args, config, cp=1, pp=1):
    """Every layout error, raised before `init_distributed` creates a group."""
    tensor_parallel.check_tensor_parallel(config, args.tp)
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp, pp=pp, cp=cp, tp=args.tp)


def make_plan(args, grid, model, forward_backward=base.forward_backward, before_averaging=()):
    """The 01 loop's plan for a tp (× cp) (× dp) grid."""
    params = [p for p in model.parameters() if p.requires_grad]
    replicas = grid.cp_size * grid.dp_size   # ranks with the same weights that saw different tokens

    def finish_gradients():
        for sync in before_averaging:        # e.g. sequence parallelism's norm-weight all-reduce
            sync()
        if replicas > 1:
            data_parallel.average_gradients(params, grid.cp_dp_group)

    def global_loss(loss):                   # every replica's mean loss -> the global batch's mean
        loss = torch.as_tensor(loss).detach().clone()
        if replicas > 1:
            dist.all_reduce(loss, group=grid.cp_dp_group)
            loss /= replicas
        return float(loss)

    layout = {"dp": grid.dp_size, "cp": grid.cp_size, "tp": grid.tp_size}
    return base.TrainPlan(dp_rank=grid.dp_rank, dp_size=grid.dp_size, is_logging_rank=grid.rank == 0,
                          forward_backward=forward_backward, finish_gradients=finish_gradients,
                          clip_gradients=functools.partial(tensor_parallel.clip_grad_norm_tp, tp_group=grid.tp_group),
                          global_loss=global_loss, layout=layout, world_size=grid.world_size)


def run_parallel(args, config, grid, parallelize, activation_layout=None, **plan_kw):
    """Build the full model, `parallelize(model)` it in place, train; returns (records, model)."""
    _, dataset = base.load_data(args)
    model = base.build_model(args, config).to(base.device_of(args))
    parallelize(model)
    base.recompute.apply_recompute(model, args.recompute)
    optimizer = base.make_optimizer(model.parameters(), args)
    plan = make_plan(args, grid, model, **plan_kw)
    element = 2 if args.dtype == "bfloat16" else torch.empty(0, dtype=base.param_dtype(args)).element_size()
    activations = memory.activation_bytes_estimate(config, args.mbs, args.seq_len, element, args.recompute,
                                                   **(activation_layout or {"tp": grid.tp_size}))
    base.print_setup(args, config, model, optimizer, activations, plan=plan,
                     title=f"memory per rank ({', '.join(f'{k} {v}' for k, v in plan.layout.items())})")
    with comm.CommMeter(grid.group_names()) as meter:
        records = base.train(args, model, optimizer, plan, dataset, config)
    if plan.is_logging_rank and records:
        print(meter.table(f"communication per rank over {len(records)} steps"))
        print(f"final loss {records[-1]['loss']:.4f} after {records[-1]['step']} steps")
    return records, model


def run(args, config):
    grid = process_grid.init_distributed(args.device, dp=args.dp, tp=args.tp)
    return run_parallel(args, config, grid, lambda model: tensor_parallel.apply_tensor_parallel(model, grid))


def parse_and_check(argv, description, build_parser, check_layout):
    """(args, config), or exit with the layout error (status 2) before any process group exists."""
    parser = build_parser(description)
    args = cli.parse_args(parser, argv)
    config = config_of(args)
    try:
        check_layout(args, config)
    except ValueError as error:
        parser.error(str(error))
    return args, config


def main(argv=None):
    return run(*parse_and_check(argv, __doc__.splitlines()[0], build_parser, check_layout))[0]


if __name__ == "__main__":
    main()
