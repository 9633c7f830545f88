"""The planner: check a layout with the trainers' rules and print its chapter-3 arithmetic, or search.

Playbook chapter 3 (finding the best configuration). Give it the model (the train.py flags), the batch
and the degrees; it checks the layout with the trainers' own rules and prints, per rank of the first and
last pipeline stage, the memory and whether it fits, the bytes each dimension sends per step, the bubble
(06's theory) and the overlap ratios, intra- or inter-node by the rank order [TP, CP, PP, DP], EXPOSED
where a ratio exceeds 1 (plan_arithmetic.py computes, plan_report.py prints). `--search` chooses the
layout instead (search.py, step_time.py, search_report.py; --arch gpt plans Megatron's GPT).

    python 08_5d_combined/planner.py --preset 1b --seq-len 4096 --mbs 1 --grad-acc 16 --dp 4 --tp 2 \\
        --pp 2 --zero-stage 1 --recompute selective --gpu-mem 80 --peak-tflops 989 --bw-intra 450 \\
        --bw-inter 50

New compared with 02-07: their formulas gathered into one plan of any layout, ZeRO-2/3 included.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "03_zero"),
                os.path.join(ROOT, "04_tensor_parallel"), os.path.join(ROOT, "05_sequence_context_parallel"),
                os.path.join(ROOT, "06_pipeline"), os.path.join(ROOT, "07_expert_parallel"),
                os.path.join(ROOT, "08_5d_combined")]

import math

import cli
import layout_5d as layout_rules
import measured_links
import plan_arithmetic
import plan_report
import search
import search_report


def build_parser():
    p = layout_rules.build_parser("Plan a layout: memory, communication, bubble and overlap per rank")
    g = p.add_argument_group("planner")
    g.add_argument("--precision", choices=sorted(plan_arithmetic.STATE_BYTES), default="mixed")
    g.add_argument("--gpu-mem", type=float, help="GB per device: flag stages that do not fit")
    measured_links.add_arguments(g)                   # --bw-intra, --bw-inter, --bandwidths FILE
    g.add_argument("--gpus-per-node", type=int, default=8)
    search.add_arguments(p)                           # --search: search.py chooses the layout
    return p


def layout_of(args) -> plan_arithmetic.Layout:
    return plan_arithmetic.Layout(
        dp=args.dp, tp=args.tp, sp=args.sp, cp=args.cp, cp_attn=args.cp_attn, pp=args.pp,
        schedule=args.pp_schedule, chunks=args.pp_chunks, ep=args.ep, num_experts=args.num_experts,
        top_k=args.top_k, shared_experts=args.shared_experts, zero_stage=args.zero_stage,
        recompute=args.recompute, partition_activations=args.partition_activations, precision=args.precision)


def main(argv=None):
    parser = build_parser()
    args = cli.parse_args(parser, argv, files=False)   # no data, and only --init-from's config.json
    for name in ("gpu_mem", "bw_intra", "bw_inter", "hbm_tbps", "train_tokens"):   # search.py's last two
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive finite number, got {value}")
    if args.gpus_per_node < 1:                    # else every group would count as crossing nodes
        parser.error(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    if args.search:
        return search_report.main(args, parser)
    layout = layout_of(args)
    try:   # the config (--init-from: only its shapes are used), then the trainers' own rules for this world
        config = search.model_config(args)
        search.check_rules(args, config)               # the trainers' degree rules (ZeRO: any stage)
    except ValueError as error:
        parser.error(str(error))
    return plan_report.print_plan(args, config, layout)


if __name__ == "__main__":
    main()
