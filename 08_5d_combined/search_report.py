"""What `planner.py --search` prints: the playbook's three steps, the fastest layouts term by term, why the
first one wins, the training time, and (--plot) its memory per pipeline stage as a PNG.

The arithmetic is search.py's and step_time.py's; this file only reads their plans. A plan's step time is
printed as the sum of its parts: compute, the exposed communication of each dimension, and the bubble's
share (the bubble stretches every per-micro-batch term: (compute + tp + cp + pp + ep) · bubble).

    python 08_5d_combined/planner.py --search --gpus 1024 --gpu a100 --arch gpt --hidden-size 12288 \\
        --num-layers 96 --num-heads 96 --seq-len 2048 --global-batch-tokens 3145728 --train-tokens 300e9

New compared with planner.py's table: the reasons, in the words of the rules that chose.
"""
import math

import cli_checks
import measured_links
import search
import step_time
import plan_arithmetic

PARTS = ("compute", "tp", "cp", "pp", "ep", "dp", "bubble")
RECOMPUTE = ("none", "selective", "full")


def parts(plan) -> dict:
    """Seconds per step by cause; they add up to plan.times['step']."""
    out = {k: plan.times[k] for k in PARTS[:-1]}
    out["bubble"] = plan.times["step"] - sum(out.values())
    return out


def describe(plan) -> str:
    lay = plan.layout
    schedule = f"{lay.schedule}{f' V{lay.chunks}' if lay.chunks > 1 else ''}" if lay.pp > 1 else "-"
    return (f"{lay.dp:>5}{lay.tp:>4}{lay.pp:>4}{lay.cp:>4}{lay.ep:>4}{'yes' if lay.sp else 'no':>4}"
            f"{lay.zero_stage:>5}  {lay.recompute:<10}{schedule:<15}{plan.mbs:>4}{plan.m:>6}")


def row(rank, plan, flops_per_step, gpus) -> str:
    step, split = plan.times["step"], parts(plan)
    tflops = flops_per_step / (step * gpus) / 1e12
    return (f"{rank:>3}{describe(plan)}{plan.memory / 1e9:>7.1f}{step:>9.3f}"
            + "".join(f"{100 * split[k] / step:>7.1f}" for k in PARTS) + f"{tflops:>6.0f}")


def versus(plans, best, label, keep) -> str:
    """The fastest plan that `keep`s, against `best`: how much slower, and which part costs it."""
    others = [plan for plan in plans if plan is not best and keep(plan)]
    if not others:
        return f"{label}: nothing fits"
    other, split = others[0], parts(best)
    diff = {k: v - split[k] for k, v in parts(other).items()}
    worst, slower = max(diff, key=diff.get), other.times["step"] / best.times["step"] - 1
    name = f"#{plans.index(other) + 1}"
    if slower <= search.TIES:
        return f"{label}: {name} is as fast (within {search.TIES:.0%}); the rules rank it after"
    heavier = RECOMPUTE.index(other.layout.recompute) > RECOMPUTE.index(best.layout.recompute)
    cause = f" (recompute {other.layout.recompute})" if worst == "compute" and heavier else ""
    return f"{label}: {name} is {slower:.1%} slower, mostly its {worst}{cause} (+{diff[worst]:.3f} s)"


def why(plans, best, cluster) -> list:
    """The rules that chose `best`, and what each of its choices saves (the fastest plan without it)."""
    lay, split, step = best.layout, parts(best), best.times["step"]
    share = lambda seconds: f"{seconds:.3f} s ({seconds / step:.1%})"                        # noqa: E731
    lines = [f"fit: {best.memory / 1e9:.1f} GB of {cluster.memory / 1e9:.0f} usable per rank"]
    if lay.tp > 1:
        node = "inside a node" if lay.tp <= cluster.per_node else "across nodes"
        lines.append(f"tp {lay.tp}{' + SP' if lay.sp else ''}: {node} (Megatron rule #1), on the critical "
                     f"path (playbook §2.5): {share(split['tp'])} exposed")
    if lay.pp > 1:
        lines.append(f"pp {lay.pp}: {lay.schedule} bubble {best.bubble:.1%} of the useful time, m = "
                     f"{best.m}{f', V = {lay.chunks}' if lay.chunks > 1 else ''}: {share(split['bubble'])}")
    if lay.cp > 1:
        lines.append(f"cp {lay.cp}: each sequence split {lay.cp} ways (activations / cp): "
                     f"{share(split['cp'])} exposed")
    if lay.ep > 1:
        lines.append(f"ep {lay.ep}: the experts split over {lay.ep} dp ranks: {share(split['ep'])} of "
                     f"all-to-alls exposed")
    lines.append(f"dp {lay.dp}: the rest (Megatron rule #2: model parallelism to fit, then dp): "
                 f"{share(split['dp'])} exposed")
    for dim in ("tp", "pp", "cp"):
        if getattr(lay, dim) > 1:
            lines.append(versus(plans, best, f"with {dim} 1", lambda p, d=dim: getattr(p.layout, d) == 1))
    if lay.zero_stage:
        lines.append(versus(plans, best, "with ZeRO-0", lambda p: p.layout.zero_stage == 0))
    if lay.recompute != "none":
        lines.append(versus(plans, best, "without recomputation", lambda p: p.layout.recompute == "none"))
    ridge = cluster.peak / cluster.hbm
    bound = "compute-bound" if best.intensity >= ridge else f"memory-bound, × {ridge / best.intensity:.2f}"
    lines.append(f"mbs {best.mbs}: its GEMMs reach {best.intensity:.0f} FLOP/byte, ridge point {ridge:.0f} "
                 f"({bound}; Megatron rule #3)")
    same = lambda p: p.layout == lay and p.mbs != best.mbs                                   # noqa: E731
    lines.append(versus(plans, best, "with another micro-batch size", same))
    least = min(plan.model_parallel for plan in plans)
    if least < best.model_parallel:
        lines.append(versus(plans, best, f"with the least model parallelism, tp·pp·cp = {least}",
                            lambda p: p.model_parallel == least))
    return lines


def playbook_step1(params: float, gpus: int, seq_len: int, num_experts: int) -> str:
    """The playbook's §3.1 (step 1, GPU-rich) advice for this model size and GPU count, in its words."""
    if gpus >= 1024:
        advice = "TP = 8 with DP (ZeRO-2) and PP"
    elif gpus >= 512:
        advice = "DP combined with TP or PP (pure DP/ZeRO-3 turns inefficient at 512+ GPUs)"
    elif params < 10e9:
        advice = "a single technique: TP, or ZeRO-3/DP with full recomputation, on 8 GPUs"
    else:
        advice = "TP = 8 with PP, TP = 8 with ZeRO-3, or ZeRO-3 alone"
    extra = (["CP across nodes for very long sequences"] if seq_len > 8192 else []) + \
        (["EP across nodes for the experts"] if num_experts else [])
    return "; ".join([advice, *extra])


def check_search(args):
    """The search's flags, before any work: a ValueError naming the flag and the fix."""
    if not args.gpus or args.gpus < 1:
        raise ValueError("--search needs --gpus N (all the GPUs the layout spreads over)")
    if not args.global_batch_tokens or args.global_batch_tokens % args.seq_len:
        raise ValueError(f"--search needs --global-batch-tokens, a multiple of --seq-len {args.seq_len}")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    for name in ("gpus_per_node", "max_chunks", "max_mbs", "max_cp", "top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not (math.isfinite(args.mem_reserve) and args.mem_reserve >= 0):
        raise ValueError(f"--mem-reserve must be 0 or more GB (a finite number), got {args.mem_reserve}")
    for flag, value, allowed in (("--search-zero", args.search_zero, "0 1 2 3"),
                                 ("--search-recompute", args.search_recompute, "none selective full"),
                                 ("--search-schedules", args.search_schedules,
                                  "1f1b interleaved zb-h1 zb-v dualpipev")):
        if not set(value.split(",")) <= set(allowed.split()):
            raise ValueError(f"{flag} {value}: a comma-separated list of {', '.join(allowed.split())}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot {args.plot}: the plot is a PNG; name the file *.png")
    cli_checks.check_output_file(args.plot, "--plot")


def main(args, parser):
    try:
        config = search.model_config(args)
        check_search(args)
        cluster = step_time.cluster_of(args)
    except ValueError as error:
        parser.error(str(error))
    batch = args.global_batch_tokens // args.seq_len
    plans, pruned = search.search(args, config, cluster, batch)
    whole = plan_arithmetic.Layout(num_experts=args.num_experts)            # the whole model on one rank
    params = sum(plan_arithmetic.stage_parameters(config, whole, 0))
    flops = step_time.flops_per_token(config, args.seq_len, "none", args.num_experts, args.top_k)
    print(f"model: {params / 1e9:.1f}B parameters ({args.arch}), h {config.hidden_size}, L "
          f"{config.num_hidden_layers}, heads {config.num_attention_heads}/{config.num_key_value_heads}, "
          f"ffn {config.intermediate_size}, vocab {config.vocab_size}; {args.precision} precision")
    print(f"cluster: {cluster.gpus} × {args.gpu}, {cluster.per_node} per node: {cluster.peak / 1e12:g} "
          f"TFLOP/s, {cluster.memory / 1e9 + args.mem_reserve:g} GB ({cluster.memory / 1e9:g} usable), HBM "
          f"{cluster.hbm / 1e12:g} TB/s,\n         links per GPU "
          + (f"{cluster.intra / 1e9:g} GB/s in a node, {cluster.inter / 1e9:g} GB/s across (the {args.gpu} "
             f"datasheet's unless flags say)" if not args.bandwidths else
             f"(bus bandwidth)\n           in a node: {measured_links.describe(cluster.intra)}\n"
             f"           across nodes: {measured_links.describe(cluster.inter)}\n           measured by "
             f"{measured_links.sources(cluster.intra, cluster.inter)}"))
    print(f"assumed MFU {cluster.mfu:.0%} of peak on every FLOP executed (--mfu)")
    print(f"global batch {batch} × {args.seq_len} = {batch * args.seq_len:,} tokens; "
          f"{flops * batch * args.seq_len:.3g} model FLOPs per step (6·N·tokens + attention)")
    print(f"step 1, fit: the playbook (§3.1) advises for {params / 1e9:.1f}B parameters on {cluster.gpus} "
          f"GPUs:\n  {playbook_step1(params, cluster.gpus, args.seq_len, args.num_experts)}\n"
          f"  the search tries every layout; pruned ({sum(pruned.values())} in all):")
    for rule, count in pruned.most_common():
        print(f"  {count:>7}  {rule}")
    if not plans:
        print("nothing fits: try --search-recompute full, --search-zero 3, more --gpus or a larger --gpu")
        return plans
    smallest = min(p.model_parallel for p in plans)
    print(f"  {len(plans)} layouts fit; the smallest model parallelism that fits is tp·pp·cp = {smallest}")
    print(f"step 2, batch: every layout kept splits {batch} sequences as dp × mbs × m (grad-acc)")
    print("step 3, throughput: the fastest by estimated step time, and its parts in % of it: compute, the")
    print("  exposed communication, the bubble's share (X: TFLOP/s per GPU, recomputation included)")
    parts = "".join(f"{k[:4] if k == 'compute' else k:>7}" for k in PARTS)
    print(f"{'#':>3}{'dp':>5}{'tp':>4}{'pp':>4}{'cp':>4}{'ep':>4}{'sp':>4}{'zero':>5}  {'recompute':<10}"
          f"{'schedule':<15}{'mbs':>4}{'m':>6}{'GB':>7}{'step s':>9}" + parts + f"{'X':>6}")
    for rank, plan in enumerate(plans[:args.top], 1):
        executed = step_time.flops_per_token(config, args.seq_len, plan.layout.recompute, args.num_experts,
                                          args.top_k) * batch * args.seq_len
        print(row(rank, plan, executed, cluster.gpus))
    print("why #1:")
    for line in why(plans, plans[0], cluster):
        print(f"  {line}")
    if args.train_tokens:
        best = plans[0]
        per_token = step_time.flops_per_token(config, args.seq_len, best.layout.recompute, args.num_experts,
                                           args.top_k)
        x = per_token * batch * args.seq_len / (best.times["step"] * cluster.gpus)
        days = args.train_tokens / (batch * args.seq_len) * best.times["step"] / 86400
        megatron_days = step_time.training_days(args.train_tokens, params, cluster.gpus, x)
        print(f"training on {args.train_tokens:.3g} tokens: {days:.1f} days at #1's step time;\n"
              f"  Megatron-LM §5.1's 8·T·P/(n·X) (8: full recomputation) with its X = {x / 1e12:.0f} "
              f"TFLOP/s: {megatron_days:.1f} days")
    if args.plot:
        gpu_gb = cluster.memory / 1e9 + args.mem_reserve
        plot_memory(config, plans[0], args.seq_len, cluster, args.plot, gpu_gb)
        print(f"memory per stage of #1: {args.plot}")
    return plans


def plot_memory(config, plan, seq_len, cluster, path, gpu_gb):
    """Stacked bars: each pipeline stage's bytes per rank by kind, under the usable and the whole memory."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lay, kinds = plan.layout, ("parameters", "gradients", "optimizer", "activations", "logits")
    stages = [plan_arithmetic.stage_memory(config, lay, seq_len, plan.mbs, plan.m, s) for s in range(lay.pp)]
    fig, ax = plt.subplots(figsize=(min(4.0 + 0.3 * lay.pp, 16.0), 4.5))
    bottom = [0.0] * lay.pp
    for kind in kinds:
        values = [stage[kind] / 1e9 for stage in stages]
        ax.bar(range(lay.pp), values, width=0.6, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    for stage, total in enumerate(bottom):
        ax.annotate(f"{total:.1f}", (stage, total), ha="center", va="bottom", fontsize=7)
    ax.axhline(gpu_gb, color="black", linewidth=1, label=f"GPU memory {gpu_gb:g} GB")
    ax.axhline(cluster.memory / 1e9, color="black", linestyle="--", linewidth=1, label="usable (− reserve)")
    ax.set_xticks(range(0, lay.pp, max(1, lay.pp // 16)))
    ax.set_xlim(-0.75, lay.pp - 0.25)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GB per rank (1e9 bytes)")
    schedule = f", {lay.schedule}{f' V{lay.chunks}' if lay.chunks > 1 else ''}" if lay.pp > 1 else ""
    sp = " (sp)" if lay.sp else ""
    ax.set_title(f"dp {lay.dp} × tp {lay.tp}{sp} × pp {lay.pp} × cp {lay.cp}{schedule}\n"
                 f"ZeRO-{lay.zero_stage}, recompute {lay.recompute}, mbs {plan.mbs}, m {plan.m}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
