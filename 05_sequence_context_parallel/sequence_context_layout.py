"""05's flags, their rules and the order of its transforms: TP (+ SP) first, then CP (picotron's order).

Playbook §2.4–2.5. Shared by 05's train.py and 08's composition, so both apply sequence and context
parallelism the same way:

    --sp         sequence_parallel.py: 04's TP with the norm regions sharded along T (needs --tp 2+)
    --cp-layout  context_parallel.py: which chunks of every sequence each cp rank holds
    --cp-attn    ring (context_parallel.py), allgather (allgather_kv.py) or ulysses (ulysses.py) attention
                 across the cp ranks

`check_sequence_layout` raises every rule's error before any process group exists; `parallelize`
applies the transforms to the seeded full model in place.

    torchrun --nproc_per_node 4 05_sequence_context_parallel/train.py --tp 2 --sp --cp 2
New compared with 04: the trainer's rules and transforms gathered here, so that 08 applies them alike.
"""

import tensor_parallel
import sequence_parallel
import context_parallel
import ulysses
import allgather_kv

CP_ATTENTION = ("ring", "allgather", "ulysses")


def add_arguments(parser):
    """--sp --cp-layout --cp-attn (the degree --cp is process_grid's)."""
    g = parser.add_argument_group("sequence and context parallelism (05)")
    g.add_argument("--sp", action="store_true",
                   help="sequence parallelism in the norm regions (needs --tp 2+)")
    g.add_argument("--cp-layout", choices=context_parallel.LAYOUTS, default="zigzag",
                   help="which chunks of the sequence each cp rank holds")
    g.add_argument("--cp-attn", choices=CP_ATTENTION, default="ring",
                   help="attention across the cp ranks: K/V ring, K/V all-gather, or all-to-all over heads")
    return g


def check_sequence_layout(args, config):
    """The CP, SP and attention rules (the world size is the trainer's check)."""
    context_parallel.check_context_parallel(args.seq_len, args.cp, args.cp_layout)
    if args.sp:
        sequence_parallel.check_sequence_parallel(args.tp, args.seq_len // args.cp)
    if args.cp > 1 and args.cp_attn in ("ring", "allgather") and args.attn != "sdpa":
        raise ValueError(f"--cp-attn {args.cp_attn} computes attention block by block itself, so --attn "
                         f"{args.attn} would be ignored: drop --attn, or use --cp-attn ulysses (which wraps "
                         "the --attn core)")
    if args.cp_attn == "ulysses":
        tensor_parallel.check_tensor_parallel(config, args.tp)       # first: the heads per rank are whole
        ulysses.check_ulysses(config.num_attention_heads // args.tp,
                              max(1, config.num_key_value_heads // args.tp), args.cp)


def parallelize(model, args, grid):
    """TP (+ SP), then CP, in place (on the meta model's shapes); returns the model."""
    if args.sp:
        sequence_parallel.apply_sequence_parallel(model, grid)
    elif grid.tp_size > 1:
        tensor_parallel.apply_tensor_parallel(model, grid)
    if grid.cp_size > 1:
        apply = {"ring": context_parallel.apply_context_parallel,
                 "allgather": allgather_kv.apply_allgather_kv, "ulysses": ulysses.apply_ulysses}[args.cp_attn]
        apply(model, context_parallel.CPLayout(args.cp_layout, grid.cp_size), grid.cp_group)
    return model
