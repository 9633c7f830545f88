"""Sequence parallelism (with TP) and context parallelism (ring attention), alone or together.

Playbook §2.4–2.5. On top of 04's tensor parallelism:
  --sp          Megatron sequence parallelism: the norm regions sharded along the sequence over the
                tp ranks (sequence_parallel.py); same communication volume as TP, norm-region
                activations / tp.
  --cp N        context parallelism: every rank keeps T/cp tokens of each sequence (its labels and
                RoPE positions too), attention runs as a ring (context_parallel.py); activations / cp,
                cp−1 K/V hops per layer forward. Gradients are averaged over the cp×dp ranks.
  --cp-layout   contiguous (rank r: chunk r) or zigzag (rank r: chunks r and 2cp−1−r, balanced).
  --cp-attn     ring (default) or ulysses: all-to-all from sequence-sharded to head-sharded and back
                (ulysses.py; cp must divide the heads each rank holds).
The ranks form the grid arange(world).view(dp, 1, cp, tp).

    torchrun --nproc_per_node 4 05_sequence_context_parallel/train.py --tp 2 --sp --cp 2 --cp-layout zigzag
    torchrun --nproc_per_node 4 05_sequence_context_parallel/train.py --cp 4 --cp-layout contiguous
    torchrun --nproc_per_node 4 05_sequence_context_parallel/train.py --cp 2 --dp 2

It prints the per-rank memory (activations with the playbook's formula for this tp/sp/cp), one line
or bar per step (the loss equals 01's for the same global batch dp·mbs·grad_acc) and the table of
communication per rank: all-gathers/reduce-scatters in the tp group, isends in the cp group.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere; folders import by dotted name

import functools
from importlib import import_module

base = import_module("01_single_gpu.legacy_train")
process_grid = import_module("02_data_parallel.process_grid")
tp_train = import_module("04_tensor_parallel.train")
tensor_parallel = import_module("04_tensor_parallel.tensor_parallel")
sequence_parallel = import_module("05_sequence_context_parallel.sequence_parallel")
context_parallel = import_module("05_sequence_context_parallel.context_parallel")
ulysses = import_module("05_sequence_context_parallel.ulysses")


def build_parser(description):
    p = tp_train.build_parser(description)
    g = p.add_argument_group("sequence and context parallelism")
    g.add_argument("--sp", action="store_true", help="sequence parallelism in the norm regions (needs --tp 2+)")
    g.add_argument("--cp", type=int, default=1, help="context-parallel degree: ranks that split each sequence")
    g.add_argument("--cp-layout", choices=context_parallel.LAYOUTS, default="zigzag",
                   help="which chunks of the sequence each cp rank holds")
    g.add_argument("--cp-attn", choices=["ring", "ulysses"], default="ring",
                   help="attention across the cp ranks: K/V ring or all-to-all over heads")
    return p


def check_layout(args, config, pp=1):
    """Every layout error, raised before any process group exists (pp: 08's pipeline stages, for the world size)."""
    context_parallel.check_context_parallel(args.seq_len, args.cp, args.cp_layout)
    if args.sp:
        sequence_parallel.check_sequence_parallel(args.tp, args.seq_len // args.cp)
    if args.cp > 1 and args.cp_attn == "ring" and args.attn != "sdpa":
        raise ValueError(f"--cp-attn ring computes attention block by block itself, so --attn {args.attn} would "
                         "be ignored: drop --attn, or use --cp-attn ulysses (which wraps the --attn core)")
    if args.cp_attn == "ulysses":
        tensor_parallel.check_tensor_parallel(config, args.tp)       # first: the heads per rank are whole
        ulysses.check_ulysses(config.num_attention_heads // args.tp, config.num_key_value_heads // args.tp, args.cp)
    tp_train.check_layout(args, config, cp=args.cp, pp=pp)   # the model's divisibility, then the world size


def context_parallel_forward_backward(layout, cp_rank):
    """01's forward_backward on this rank's tokens: inputs, labels and RoPE positions of its chunks."""
    def forward_backward(model, micro_batches):
        positions = layout.positions(cp_rank, micro_batches[0][0].shape[1], micro_batches[0][0].device)
        shards = [(x[:, positions], y[:, positions]) for x, y in micro_batches]     # (mbs, T/cp)
        return base.forward_backward(functools.partial(model, position_ids=positions), shards)
    return forward_backward


def parallelize(model, args, grid):
    """TP (+SP) first, then CP (the order of picotron's train.py), in place; 08 applies it too.
    Returns the norm weights SP keeps replicated, whose gradients must be summed over tp."""
    norm_weights = []
    if args.sp:
        norm_weights = sequence_parallel.apply_sequence_parallel(model, grid)
    elif args.tp > 1:
        tensor_parallel.apply_tensor_parallel(model, grid)
    if args.cp > 1:
        apply = ulysses.apply_ulysses if args.cp_attn == "ulysses" else context_parallel.apply_context_parallel
        apply(model, context_parallel.CPLayout(args.cp_layout, args.cp), grid.cp_group)
    return norm_weights


def run(args, config):
    grid = process_grid.init_distributed(args.device, dp=args.dp, cp=args.cp, tp=args.tp)
    layout = context_parallel.CPLayout(args.cp_layout, args.cp)
    norm_weights = []

    plan_kw = {}
    if args.cp > 1:
        plan_kw["forward_backward"] = context_parallel_forward_backward(layout, grid.cp_rank)
    if args.sp:
        plan_kw["before_averaging"] = [lambda: sequence_parallel.all_reduce_norm_gradients(norm_weights, grid.tp_group)]
    apply_layout = lambda model: norm_weights.extend(parallelize(model, args, grid))  # noqa: E731
    return tp_train.run_parallel(args, config, grid, apply_layout,
                                 activation_layout={"tp": args.tp, "sp": args.sp, "cp": args.cp}, **plan_kw)


def main(argv=None):
    return run(*tp_train.parse_and_check(argv, __doc__.splitlines()[0], build_parser, check_layout))[0]


if __name__ == "__main__":
    main()
