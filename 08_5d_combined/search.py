"""Which layout? The playbook's chapter 3 and Megatron-LM's rules of thumb, run over the planner's arithmetic.

Playbook chapter 3 (step 1 fit the model: the smallest model parallelism, TP inside a node, then PP across
nodes; step 2 reach the global batch with DP and grad-acc; step 3 throughput), Megatron-LM §4.2.2 (rule #1
t ≤ GPUs per node, #2 t·p just enough to fit then d, #3 the micro-batch). Every dp·tp·pp·cp = --gpus
layout (ep, SP, schedule, ZeRO 0-3, recompute, micro-batch) that passes the trainers' rules and fits in
memory (plan_arithmetic.stage_memory) is ranked by its estimated step time (step_time.py: FLOPs, exposed
communication, bubble); within 1% the rules decide (`rank`). `GPTConfig` is Megatron's GPT (LayerNorm,
biases, 4h GELU MLP, learned positions, tied embeddings) for the paper's models; the trainers build Llama.
Derivations and a printed search: 08's README.md.

    python 08_5d_combined/planner.py --search --gpus 64 --gpu h100 --preset 1b --seq-len 4096 \\
        --global-batch-tokens 1048576 --plot memory.png

New compared with planner.py: the planner chooses the layout instead of checking one.
"""
import argparse
import re
from collections import Counter
from dataclasses import dataclass, replace
from types import SimpleNamespace

import cli
import data
import layout_5d as layout_rules
import plan_arithmetic
import step_time


@dataclass(frozen=True)
class GPTConfig:
    """Megatron-LM's GPT (§5.1): P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) plus the final LayerNorm;
    the attribute names of 01's LlamaConfig, so the planner's functions read either."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int = 51200                 # GPT-2's 50,257 padded to a multiple of 1024 (Megatron-LM §5.1)
    max_position_embeddings: int = 2048
    architecture = "gpt"
    tie_word_embeddings = True

    @property
    def intermediate_size(self):
        return 4 * self.hidden_size

    @property
    def num_key_value_heads(self):
        return self.num_attention_heads

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads


def add_arguments(parser):
    g = parser.add_argument_group("search (--search)")
    g.add_argument("--search", action="store_true", help="choose the layout instead of checking one")
    g.add_argument("--arch", choices=["llama", "gpt"], default="llama",
                   help="gpt: Megatron-LM's GPT of --hidden-size, --num-layers, --num-heads, --vocab-size")
    g.add_argument("--gpus", type=int, help="GPUs in all (the product of the degrees)")
    g.add_argument("--gpu", choices=sorted(step_time.GPUS), default="h100",
                   help="peak, memory and links (datasheets)")
    g.add_argument("--hbm-tbps", type=float, help="HBM bandwidth in TB/s (the roofline's ridge point)")
    g.add_argument("--mfu", type=float, default=0.45, help="assumed fraction of peak on every FLOP executed")
    g.add_argument("--mem-reserve", type=float, default=4.0, help="GB kept free (CUDA context, NCCL buffers)")
    g.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (× --seq-len)")
    g.add_argument("--train-tokens", type=float, help="training tokens: print the days it takes")
    g.add_argument("--search-zero", default="0,1,2,3", help="ZeRO stages to try")
    g.add_argument("--search-recompute", default="none,selective,full", help="recomputation modes to try")
    g.add_argument("--search-schedules", default="1f1b,interleaved,zb-h1,zb-v,dualpipev",
                   help="pipeline schedules to try (zb-v and dualpipev with their 2 chunks)")
    g.add_argument("--search-sp", choices=["yes", "no"], default="yes", help="SP with every tp > 1, or none")
    g.add_argument("--max-chunks", type=int, default=4, help="largest interleaving V tried")
    g.add_argument("--max-mbs", type=int, default=16, help="largest micro-batch tried")
    g.add_argument("--max-cp", type=int, default=8, help="largest context-parallel degree tried")
    g.add_argument("--top", type=int, default=5, help="layouts printed")
    g.conflict_handler = "resolve"   # the planner trains nothing: this replaces the trainers' --plot DIR
    g.add_argument("--plot", metavar="PNG", help="the chosen layout's memory per pipeline stage")


def model_config(args):
    """The model the flags describe: 01's Llama (--preset, flags, --init-from) or Megatron's GPT."""
    if args.arch == "llama":
        return cli.model_config(args, data.load_tokenizer(args.tokenizer).vocab_size)   # shapes only
    if args.init_from or args.num_experts:
        raise ValueError("--arch gpt takes its shapes from --hidden-size, --num-layers, --num-heads, "
                         "--vocab-size and --seq-len: drop --init-from and --num-experts")
    if args.hidden_size % args.num_heads:
        raise ValueError(f"--num-heads {args.num_heads} does not divide --hidden-size {args.hidden_size}")
    vocab = args.vocab_size or GPTConfig.vocab_size
    return GPTConfig(args.hidden_size, args.num_layers, args.num_heads, vocab, args.seq_len)


def check_rules(args, config, **degrees):
    """The trainers' rules (layout.check_degrees) for `args` with `degrees` replaced, in a world of their
    product. A GPT's tied embedding may span stages: Megatron keeps a copy on the last stage, which the
    planner counts (06's pipeline, which builds Llama, refuses the tie)."""
    trial = argparse.Namespace(**{**vars(args), **degrees})
    if getattr(config, "architecture", "llama") == "gpt":
        config = SimpleNamespace(**{k: getattr(config, k) for k in (
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "hidden_size")}, tie_word_embeddings=False)
    with layout_rules.world_size(trial.dp * trial.pp * trial.cp * trial.tp):
        layout_rules.check_degrees(trial, config)


# ======================================================================================
# The search: step 1 fit, step 2 the batch, step 3 rank by step time
# ======================================================================================
RULE_1 = "Megatron rule #1: tp at most the GPUs of a node (TP's all-reduces stay on NVLink)"
MEMORY = "do not fit at any ZeRO stage and recomputation tried"
TIES = 0.01        # step times closer than 1% are below what this model's assumptions can tell apart


def divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, num_layers: int, names, max_chunks: int):
    """(schedule, V) pairs; AFAB is left out: 1F1B's bubble with more micro-batches held (E16). The V-shaped
    ZB-V and DualPipeV run two chunks per rank (06's v_schedules.py), whatever --max-chunks."""
    if pp == 1:
        return [("1f1b", 1)]
    pairs = [(name, 1) for name in names if name in ("1f1b", "zb-h1")]
    if "interleaved" in names:
        pairs += [("interleaved", v) for v in divisors(num_layers // pp)[1:] if v <= max_chunks]
    return pairs + [(name, 2) for name in names if name in ("zb-v", "dualpipev")]


def search(args, config, cluster: step_time.Cluster, batch: int):
    """All fitting plans, fastest first, and what was pruned by which rule (a Counter)."""
    zero = [int(z) for z in args.search_zero.split(",")]
    recomputes = [r for r in ("none", "selective", "full") if r in args.search_recompute.split(",")]
    plans, pruned, experts = [], Counter(), args.num_experts
    for tp in divisors(cluster.gpus):
        for pp in divisors(cluster.gpus // tp):
            for cp in divisors(cluster.gpus // (tp * pp)):
                dp = cluster.gpus // (tp * pp * cp)
                for ep in divisors(dp) if experts else [1]:
                    if tp > cluster.per_node:
                        pruned[RULE_1] += 1
                    elif cp > args.max_cp:
                        pruned[f"cp above --max-cp {args.max_cp}"] += 1
                    elif batch % dp:
                        pruned[f"step 2: dp does not divide the global batch of {batch} sequences"] += 1
                    else:
                        sp = args.search_sp == "yes" and tp > 1 and not experts   # SP: TP's bytes, act./t
                        for schedule, chunks in schedules(pp, config.num_hidden_layers,
                                                          args.search_schedules.split(","), args.max_chunks):
                            base = plan_arithmetic.Layout(
                                dp=dp, tp=tp, sp=sp, cp=cp, pp=pp, schedule=schedule, chunks=chunks, ep=ep,
                                num_experts=experts, top_k=args.top_k, cp_attn=args.cp_attn,
                                precision=args.precision)
                            try:   # grad-acc 2·pp passes every schedule's rule; _options checks each m
                                check_rules(args, config, dp=dp, tp=tp, sp=sp, cp=cp, pp=pp, ep=ep,
                                            pp_schedule=schedule, pp_chunks=chunks, grad_acc=2 * pp)
                            except ValueError as error:
                                pruned[re.split(r"[:;(]", str(error))[0].strip()] += 1
                                continue
                            plans += _options(config, base, args.seq_len, batch, zero, recomputes, cluster,
                                              args.max_mbs, pruned)
    return rank(plans), pruned


def rank(plans):
    """Fastest first; within TIES of the fastest the rules decide: the least model parallelism (Megatron
    rule #2), the lowest ZeRO stage (fewer collectives), the smallest micro-batch (rule #3)."""
    best = min((plan.times["step"] for plan in plans), default=0.0)
    return sorted(plans, key=lambda plan: (plan.times["step"] > best * (1 + TIES), plan.model_parallel,
                                           plan.layout.zero_stage, plan.mbs, plan.times["step"])
                  if plan.times["step"] <= best * (1 + TIES) else (True, 0, 0, 0, plan.times["step"]))


def _options(config, base, seq_len, batch, zero, recomputes, cluster, max_mbs, pruned):
    """Micro-batch sizes, ZeRO stages and, per stage, the least recomputation that fits (more only adds
    FLOPs: the GPT-175B talk's tuning order, selective before full)."""
    plans = []
    for mbs in [b for b in divisors(batch // base.dp) if b <= max_mbs]:
        m = batch // (base.dp * mbs)
        if base.schedule == "interleaved" and m % base.pp:
            pruned["interleaving needs the micro-batches a multiple of pp (Megatron-LM §2.2.2)"] += 1
            continue
        if base.schedule == "dualpipev" and m < 2 * base.pp:
            pruned["DualPipeV needs at least 2·pp micro-batches (DeepSeek's DualPipeV)"] += 1
            continue
        fitted = []
        for stage in zero:
            for recompute in recomputes:
                layout = replace(base, zero_stage=stage, recompute=recompute)
                memory = step_time.peak_memory(config, layout, seq_len, mbs, m)
                if memory <= cluster.memory:
                    fitted.append(step_time.estimate(config, layout, seq_len, mbs, m, cluster, memory))
                    break
        if not fitted:                    # a larger micro-batch holds at least as much: stop here
            pruned[MEMORY] += 1
            break
        plans += fitted
    return plans
