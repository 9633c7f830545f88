"""ZeRO training: 02's data parallelism with the model states sharded over the dp ranks.

Playbook §2.2 "ZeRO" and Rajbhandari et al. The full model is built and seeded exactly as in 01,
then `zero.py` regroups its parameters into flat per-module units and shards them; 01's AdamW
steps only this rank's shards. Losses equal 01's (and 02's) for the same global batch; what
changes is the memory per rank and the communication (formulas in zero.py's docstring):

    torchrun --nproc_per_node 4 03_zero/train.py --dp 4 --zero-stage 1 --mbs 2 --steps 50
    torchrun --nproc_per_node 4 03_zero/train.py --dp 4 --zero-stage 2 --mbs 2 --grad-acc 2
    torchrun --nproc_per_node 4 03_zero/train.py --dp 4 --zero-stage 3 --mbs 2

It prints one line or bar per step, the communication every rank issued per step (reduce-scatter
and all-gather in the dp group) and the model states this rank holds, measured from its tensors,
beside the ZeRO paper's prediction.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere; folders import by dotted name

import os
from importlib import import_module

base = import_module("01_single_gpu.legacy_train")
memory = base.memory
dp_train = import_module("02_data_parallel.train")
zero_mod = import_module("03_zero.zero")


def build_parser(description):
    p = base.cli.core_parser(description)
    g = p.add_argument_group("ZeRO")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree: ranks that split the batch and the states")
    g.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=1,
                   help="1: optimizer states, 2: + gradients, 3: + parameters sharded")
    return p


def check_layout(args):
    """Every layout error, raised before `init_distributed` creates a group."""
    dp_train.process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp)
    if args.zero_stage == 3:
        if args.tie_embeddings:
            raise ValueError("--zero-stage 3 gathers each module's own parameters: drop --tie-embeddings "
                             "or use --zero-stage 1 or 2")
        if args.kernels != "torch":
            raise ValueError("--zero-stage 3 gathers the head in lm_head's forward hook, which the fused "
                             "loss of --kernels triton bypasses: use --kernels torch")
        if args.checkpoint_dir or args.resume:
            raise ValueError("--zero-stage 3 keeps only parameter shards, which checkpoint.py does not save: "
                             "drop --checkpoint-dir/--resume or use --zero-stage 1 or 2")


def expected_state_bytes(stage, n, padded_bytes):
    """The ZeRO paper's split, for AdamW (2 states) in the parameters' dtype: (params, grads, optimizer)."""
    psi = padded_bytes
    return (psi // n if stage >= 3 else psi, psi // n if stage >= 2 else psi, 2 * psi // n)


def run(args):
    """Train with ZeRO; returns (records, the ZeRO object, model, optimizer, meter)."""
    grid, dataset, config, model = dp_train.setup(args)
    zero = zero_mod.ZeRO(zero_mod.llama_units(model), grid.dp_group, args.zero_stage)
    optimizer = zero.make_optimizer(lambda params: base.make_optimizer(params, args))
    plan = base.TrainPlan(dp_rank=grid.dp_rank, dp_size=grid.dp_size, is_logging_rank=grid.rank == 0,
                          forward_backward=zero.forward_backward, finish_gradients=zero.finish_gradients,
                          clip_gradients=zero.clip_gradients, global_loss=dp_train.mean_over(grid.dp_group),
                          layout={"dp": grid.dp_size, "zero_stage": args.zero_stage}, world_size=grid.world_size)
    if plan.is_logging_rank:
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters in {len(zero.units)} "
              f"flat units (Ψ = {zero.padded_numel} padded elements), {config}")
    records, meter = dp_train.train_metered(args, model, optimizer, plan, dataset, config, grid)
    params, grads, states = zero.model_state_bytes(model, optimizer)
    if plan.is_logging_rank:
        report = memory.MemoryReport(params, grads, states, dp_train.activation_estimate(args, config))
        print(report.table(f"memory per rank, measured (ZeRO-{args.zero_stage}, dp {grid.dp_size})"))
        expected = expected_state_bytes(args.zero_stage, grid.dp_size, zero.padded_bytes)
        print("  ZeRO paper: " + ", ".join(f"{name} {v / 2**20:.2f} MiB" for name, v in
                                           zip(("parameters", "gradients", "optimizer states"), expected)))
    return records, zero, model, optimizer, meter


def main(argv=None):
    return run(dp_train.parse_and_check(argv, __doc__.splitlines()[0], build_parser, check_layout))[0]


if __name__ == "__main__":
    main()
