"""What planner.py prints for one layout: per rank of the first and last pipeline stage, the memory
(weights, gradients, optimizer states, activations, logits) and whether it fits, the bytes each
dimension sends per step, the bubble, and the overlap ratios with their EXPOSED marks.

The arithmetic is planner.py's; this file only lays it out.

    python 08_5d_combined/planner.py --preset 1b --seq-len 4096 --mbs 1 --grad-acc 16 --dp 4 --tp 2 --pp 2
"""

import measured_links
import plan_arithmetic
import timeline


def print_plan(args, config, layout):
    """Print the plan of `layout` for the parsed flags; returns ({stage: memory}, {stage: bytes sent})."""
    world = args.dp * args.pp * args.cp * args.tp
    m, stages = args.grad_acc, sorted({0, min(1, args.pp - 1), args.pp - 1})
    whole = plan_arithmetic.Layout(num_experts=args.num_experts)            # the whole model on one rank
    total = sum(plan_arithmetic.stage_parameters(config, whole, 0))
    print(f"layout: dp {args.dp} × pp {args.pp} × cp {args.cp} × tp {args.tp}{' (sp)' if args.sp else ''} = "
          f"{world} ranks; zero-{args.zero_stage}, recompute {args.recompute}, {args.precision} precision "
          f"({'+'.join(map(str, plan_arithmetic.STATE_BYTES[args.precision]))} bytes/param: the trainers' "
          f"{plan_arithmetic.TRAINER_LAYOUT[args.precision]} layout, 01_single_gpu/mixed_precision.py)")
    print(f"model: {total / 1e9:.3f}B parameters, h {config.hidden_size}, L {config.num_hidden_layers}, "
          f"heads {config.num_attention_heads}/{config.num_key_value_heads}, ffn {config.intermediate_size}, "
          f"vocab {config.vocab_size}; global batch {args.dp * args.mbs * m} × {args.seq_len} tokens")
    mem, com = ({s: formula(config, layout, args.seq_len, args.mbs, m, s) for s in stages}
                for formula in (plan_arithmetic.stage_memory, plan_arithmetic.stage_communication))
    totals = {s: sum(v for k, v in mem[s].items() if k != "held") for s in stages}
    unit, scale, label = ("GB", 1e9, "1e9") if max(totals.values()) >= 1e9 else ("MB", 1e6, "1e6")  # decimal
    header = "".join(f"{'pp stage ' + str(s):>14}" for s in stages)
    print(f"\nper rank ({unit} = {label} bytes)" + header)
    for key in ("parameters", "gradients", "optimizer", "activations", "logits"):
        print(f"  {key:<24}" + "".join(f"{mem[s][key] / scale:>14.3f}" for s in stages))
    print(f"  {'total':<24}" + "".join(f"{totals[s] / scale:>14.3f}" for s in stages))
    if args.gpu_mem:
        print(f"  {'fits in ' + format(args.gpu_mem, 'g') + ' GB':<24}" +
              "".join(f"{'yes' if totals[s] <= args.gpu_mem * 1e9 else 'DOES NOT FIT':>14}" for s in stages))
    print(f"communication sent per rank per step ({unit})")
    for dim in ("tp", "cp", "pp", "dp", "ep"):
        print(f"  {dim:<24}" + "".join(f"{com[s][dim] / scale:>14.4f}" for s in stages))
    if args.pp > 1:
        print(f"pipeline bubble ({args.pp_schedule}, p={args.pp}, m={m}, V={args.pp_chunks}): "
              f"{timeline.theory_bubble(args.pp_schedule, args.pp, m, args.pp_chunks):.2%} of useful time")
    links = dict(zip(("intra", "inter"), measured_links.links_of(args)))
    where = measured_links.bandwidths(layout, args.gpus_per_node, "intra", "inter")
    lacking = sorted({where[dim] for dim in measured_links.dimensions(layout) if links[where[dim]] is None})
    if args.peak_tflops and any(links.values()) and not lacking:
        bw = measured_links.bandwidths(layout, args.gpus_per_node, links["intra"], links["inter"])
        peak = args.peak_tflops * 1e12
        ratios = plan_arithmetic.overlap_ratios(config, layout, args.seq_len, args.mbs, peak, bw)
        print("overlap t_comm/t_compute (> 1: the communication cannot hide behind compute)")
        for dim, r in ratios.items():
            print(f"  {dim:<8}{r:>10.3f}  ({where[dim]}-node){'  EXPOSED' if r > 1 else ''}")
        if args.bandwidths:
            print("bus bandwidth per dimension (measured at the largest size; --bw-intra/--bw-inter where "
                  "the file lacks a scope):")
            print("\n".join(measured_links.used(layout, where, bw)))
            print(f"  measured by {measured_links.sources(*links.values())}")
    elif args.bandwidths and lacking:
        print(f"overlap ratios: the measurement has no {lacking[0]}-node groups, which this layout "
              f"uses: give --bw-{lacking[0]} (GB/s) too")
    else:
        print("overlap ratios: give --peak-tflops, --bw-intra and --bw-inter (GB/s)")
    return mem, com
