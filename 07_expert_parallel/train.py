"""Mixture of experts with expert parallelism (× data parallelism): 01's loop on an MoE Llama.

Playbook §2.7. The 01 model is built and seeded as everywhere, its MLPs are replaced by MoE blocks
(`moe.apply_moe`: E seeded experts, top-k router, load-balancing loss) and, under torchrun,
`expert_parallel.apply_expert_parallel` keeps E/ep experts per rank and routes tokens by
all-to-all. `--dp D --ep P`: D data-parallel ranks, each reading 1/D of the global batch
(dp·mbs·grad_acc sequences); every P consecutive ones split the experts (P divides D). Dense
gradients are averaged over dp, expert gradients summed over the D/P replicas and divided by D.
Per rank: expert parameters, gradients and optimizer states 1/ep; all-to-all bytes per MoE layer
and micro-batch 2·(s_out + s_in)·C·b + 8·(ep−1)·E/ep (expert_parallel.py).

    python 07_expert_parallel/train.py --num-experts 4 --top-k 2 --mbs 8          # one device: the reference
    torchrun --nproc_per_node 2 07_expert_parallel/train.py --dp 2 --ep 2 --mbs 4
    torchrun --nproc_per_node 4 07_expert_parallel/train.py --dp 4 --ep 2 --mbs 1 --grad-acc 2
    python 07_expert_parallel/train.py --ep 3      # fails at once: ep=3 does not divide num_experts=4

Run with plain `python` it is the single-device MoE (01's plan, no process group); the same seed
and global batch give the same losses in every EP × DP layout. It prints the memory per rank, the
experts each rank holds, one line or bar per step (the loss includes α·aux) and, distributed, the
communication per rank per step. `--init-from` a dense checkpoint upcycles its MLPs into the experts.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere; folders import by dotted name

import functools
import os
from importlib import import_module

base = import_module("01_single_gpu.legacy_train")
cli, memory = base.cli, base.memory
process_grid = import_module("02_data_parallel.process_grid")
dp_train = import_module("02_data_parallel.train")
moe = import_module("07_expert_parallel.moe")
expert_parallel = import_module("07_expert_parallel.expert_parallel")


def add_moe_arguments(parser, num_experts=4):
    """--num-experts --top-k --aux-loss-coef --ep (also 08's, where 0 experts is the dense Llama)."""
    g = parser.add_argument_group("mixture of experts and expert parallelism (07)")
    g.add_argument("--num-experts", type=int, default=num_experts,
                   help="experts per MoE layer (every layer is MoE; 0 in 08: the dense Llama)")
    g.add_argument("--top-k", type=int, default=2, help="experts each token is sent to (Mixtral: 2)")
    g.add_argument("--aux-loss-coef", type=float, default=0.01,
                   help="α of the per-sequence load-balancing loss added to the cross-entropy (Switch: 0.01)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree: dp ranks that split the experts")
    return g


def build_parser(description):
    p = cli.core_parser(description)
    g = add_moe_arguments(p)
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree: ranks that split the global batch")
    return p


def check_layout(args):
    """Every layout error, raised before `init_distributed` creates a group."""
    moe.check_moe(args.num_experts, args.top_k, args.aux_loss_coef)
    expert_parallel.check_expert_parallel(args.num_experts, args.ep, args.dp)
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp=args.dp, ep=args.ep)


def moe_flops_per_token(args):
    """01's count for the parameters a token really uses: k experts and the router instead of one MLP,
    (k−1)·3·C·F + C·E more matmul parameters per layer (moe.py), 6 FLOPs each."""
    def count(config, seq_len):
        extra = (args.top_k - 1) * 3 * config.hidden_size * config.intermediate_size + config.hidden_size * args.num_experts
        return base.flops_per_token(config, seq_len) + 6 * config.num_hidden_layers * extra
    return count


def make_plan(grid, model, args):
    """01's plan for one device (grid None), else the EP × DP plan; MFU counts the active parameters."""
    if grid is None:
        return base.TrainPlan(flops_per_token=moe_flops_per_token(args))
    _, experts = moe.split_parameters(model)
    return base.TrainPlan(flops_per_token=moe_flops_per_token(args), dp_rank=grid.dp_rank, dp_size=grid.dp_size, is_logging_rank=grid.rank == 0,
                          finish_gradients=expert_parallel.make_finish_gradients(model, grid),
                          clip_gradients=functools.partial(expert_parallel.clip_grad_norm_ep,
                                                           expert_params=experts, ep_group=grid.ep_group),
                          global_loss=dp_train.mean_over(grid.dp_group),
                          layout={"dp": grid.dp_size, "ep": grid.ep_size}, world_size=grid.world_size)


def expert_memory(args, config, model, ep):
    """The experts this rank holds, measured, beside E·L·3·C·F elements / ep."""
    _, experts = moe.split_parameters(model)
    element = experts[0].element_size()
    total = args.num_experts * config.num_hidden_layers * 3 * config.hidden_size * config.intermediate_size * element
    held = len(moe.moe_blocks(model)[0].experts)
    return (f"experts per rank: {held} of {args.num_experts} per layer, parameters "
            f"{memory.tensor_bytes(experts) / 2**20:.2f} MiB measured, E·L·3·C·F/ep = {total / ep / 2**20:.2f} MiB")


def run(args):
    """Train; returns (records, model, meter or None). Plain `python`: one device, no process group."""
    distributed = "RANK" in os.environ                                   # torchrun, or the test harness
    grid = process_grid.init_distributed(args.device, dp=args.dp, ep=args.ep) if distributed else None
    tokenizer, dataset = base.load_data(args)
    config = cli.model_config(args, tokenizer.vocab_size)
    model = base.build_model(args, config)
    moe.apply_moe(model, args.num_experts, args.top_k, args.aux_loss_coef, args.seed, upcycle=bool(args.init_from))
    if grid is not None and grid.ep_size > 1:
        expert_parallel.apply_expert_parallel(model, grid)
    model.to(base.device_of(args))
    base.recompute.apply_recompute(model, args.recompute)
    optimizer = base.make_optimizer(model.parameters(), args)
    plan = make_plan(grid, model, args)
    dp, ep = (grid.dp_size, grid.ep_size) if grid else (1, 1)
    base.print_setup(args, config, model, optimizer, dp_train.activation_estimate(args, config), plan=plan,
                     title=f"memory per rank (dp {dp}, ep {ep}; activations: the dense Llama's estimate)")
    if plan.is_logging_rank:
        print(expert_memory(args, config, model, ep))
    if grid is None:
        records, meter = base.train(args, model, optimizer, plan, dataset, config), None
        if records:
            print(f"final loss {records[-1]['loss']:.4f} after {records[-1]['step']} steps")
    else:
        records, meter = dp_train.train_metered(args, model, optimizer, plan, dataset, config, grid)
    return records, model, meter


def main(argv=None):
    return run(dp_train.parse_and_check(argv, __doc__.splitlines()[0], build_parser, check_layout))[0]


if __name__ == "__main__":
    main()
