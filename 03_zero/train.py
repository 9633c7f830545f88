"""ZeRO training: 02's data parallelism with the model states sharded over the dp ranks.

Playbook §2.2 "ZeRO", Rajbhandari et al. The full model is built and seeded exactly as in 01, then
zero.py regroups its parameters into flat per-module units and shards them; 01's AdamW steps only this
rank's shards. Losses equal 01's (and 02's) for the same global batch; what changes is the memory per
rank and where the collectives happen (formulas in zero.py and the folder's README):

    torchrun --nproc_per_node 4 03_zero/train.py --dp 4 --zero-stage 1 --mbs 2 --steps 50
    torchrun --nproc_per_node 4 03_zero/train.py --dp 4 --zero-stage 3 --mbs 2

New in the step compared with 02: the gradient buffers are ZeRO's (`zero_gradients`), the reduction is a
reduce-scatter (stage 1 after the last micro-batch, stages 2-3 from backward hooks), the norm is summed over
the shards, AdamW steps 1/N of the states, and stages 1-2 all-gather the updated shards after it.
With --offload optimizer (offload.py, ZeRO-Offload) that 1/N lives on the host and the step runs there;
with --offload param (ZeRO-3) the parameter shards and their gradients too (the copies: zero's hooks).
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "03_zero")]

import functools

import build
import cli
import loop
import mixed_precision
import metrics
import recompute
import process_grid
import comm
import data_parallel
import flat_unit
import zero as zero_mod
import offload as offload_mod
import zero_layout as layout_mod


def train_step(model, optimizer, micro_batches, zero, offload, grid, args):
    """02's step on ZeRO's shards; returns (global loss, gradient norm)."""
    if offload and offload.device_stale:                        # the masters may come from a checkpoint
        offload.parameters_to_device()
    optimizer.zero_grad(set_to_none=True)
    zero.zero_gradients()                                       # stage 1: .grad views of flat buffers
    loss = 0.0
    with mixed_precision.autocast(args, micro_batches[0][0].device):
        for x, y in micro_batches:                              # x, y: (mbs, T), this dp rank's rows
            micro_loss = model(x, labels=y) / len(micro_batches)
            # stages 2-3: each unit is reduce-scattered as its gradients complete
            # stage 3: each unit is all-gathered before its forward and backward, freed after them
            optimizer.scale(micro_loss).backward()
            loss += micro_loss.detach()
    zero.finish_gradients()                                     # stage 1: reduce-scatter now; all stages: / N
    optimizer.unscale_gradients(zero.shards)                    # fp16: the shards' gradients ÷ S
    grad_norm = zero.clip_gradients(args.grad_clip)             # ‖g‖² = Σ over the ranks of ‖shard‖²
    if offload:
        offload.gradients_to_host()                             # ZeRO-Offload: the gradient shard to the host
    # AdamW on this rank's 1/N of the states (offload: on the host; --offload param: the shards too)
    optimizer.step(grad_norm)                                   # fp32 masters; fp16 overflow: skipped
    if offload:
        offload.parameters_to_device()                          # the updated shard, host -> device
    zero.gather_shards()                                        # stages 1-2: all-gather the updated shards
    return data_parallel.global_mean(loss, grid.dp_group), grad_norm


def build_parser():
    parser = cli.core_parser(__doc__.splitlines()[0])
    process_grid.add_degree_arguments(parser, "dp")
    layout_mod.add_arguments(parser)
    mixed_precision.add_arguments(parser)
    return parser


def check_layout(args, config):
    """Every layout error, raised before any process group exists."""
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp)
    layout_mod.check_zero(args)
    layout_mod.check_offload(args)
    mixed_precision.check_precision(args)


def run(args, config, dataset, grid):
    """Returns (records, the ZeRO object, model, optimizer, meter, the OptimizerOffload or None)."""
    model = build.build_model(args, config)                 # on meta: ZeRO materialises the flat units itself
    recompute.apply_recompute(model, args.recompute)
    precision = mixed_precision.layout_of(args)             # bf16-20: gradients reduced and summed in fp32
    # stage 3: only this rank's shard of each unit ever exists
    units, source = flat_unit.llama_units(model), build.source(model, args)
    if args.offload == "param":
        zero = offload_mod.ParameterOffload(units, grid.dp_group, source,      # ZeRO-3, shards on the host
                                            grad_dtype=precision.accumulation)
    else:
        zero = zero_mod.ZeRO(units, grid.dp_group, args.zero_stage, source=source,
                             grad_dtype=precision.accumulation)
    offload = (offload_mod.OptimizerOffload(zero.shards, precision.master) if args.offload == "optimizer"
               else None)
    optimizer = mixed_precision.MixedPrecisionOptimizer(   # AdamW on the fp32 masters (offloaded: the host's)
        offload.master if offload else zero.shards, args, hooks=False,
        layout=mixed_precision.LAYOUTS["fp32"] if offload and precision.master else None)
    if grid.rank == 0:
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters in "
              f"{len(zero.units)} flat units (Ψ = {zero.padded_numel} padded elements), {config}")
    step = functools.partial(train_step, model, optimizer, zero=zero, offload=offload, grid=grid, args=args)
    with comm.CommMeter(grid.group_names()) as meter:
        records = loop.train(args, step, model, optimizer, dataset,
                             metrics.flops_per_token(config, args.seq_len),
                             grid=grid, layout={"dp": grid.dp_size, "zero_stage": args.zero_stage},
                             eval_step=meter.unmetered(functools.partial(
                                 data_parallel.eval_step, model, group=grid.dp_group, args=args)))
    if grid.rank == 0 and records:
        print(meter.table(f"communication per rank per step (average of {len(records)} steps)",
                          steps=len(records)))
        layout_mod.print_memory(zero, offload, model, optimizer, args, config, grid.dp_size, precision)
    return records, zero, model, optimizer, meter, offload


def main(argv=None):
    args, config, dataset = cli.setup(build_parser(), argv, check_layout)
    with process_grid.distributed(args.device, dp=args.dp, timeout_s=args.timeout_s) as grid:
        return run(args, config, dataset, grid)


if __name__ == "__main__":
    main()
