"""A layout's memory, communication and overlap per rank: the playbook's chapter-3 arithmetic.

Playbook chapter 3 (finding the best configuration), App. 5.3 and its cheat-sheet (overlap ratios),
ZeRO §5 and §7, Korthikanti et al. 2022 (activations), Megatron-LM §4.2.2 (communication), the ZB paper
§3.1 (bubble). Per rank of a pipeline stage:

  memory     weights, gradients and optimizer states of Ψ parameters (--precision mixed: ZeRO's
             2 + 2 + 12 bytes, not the cheat-sheet's 18, E8), ZeRO-1/2/3 sharding over the N = dp·cp
             ranks; activations by 01's Korthikanti estimate for the micro-batches the schedule holds;
             the last stage's fp32 logits
  traffic    bytes each dimension sends per step (tp, cp, pp, dp, ep), by 02-07's formulas
  overlap    t_comm/t_compute per dimension (App. 5.3), e.g. dp e·(N−1)/(2N·tokens)·peak/bw (E6: the
             playbook's form is dimensionally wrong) and tp e·(t−1)/(2h)·peak/bw (E9)

Every formula, term by term: README.md; tests/test_5d_combined.py checks them against the ranks' bytes.
planner.py prints them for one layout (plan_report.py), step_time.py and search.py rank layouts by them.

    python 08_5d_combined/planner.py --preset 1b --seq-len 4096 --mbs 1 --grad-acc 16 --dp 4 --tp 2 --pp 2

New compared with 02-07: their formulas gathered into one plan of any layout, ZeRO-2/3 included.
"""
from dataclasses import dataclass
from types import SimpleNamespace

import memory
import mixed_precision
import pipeline
import schedules

# Each --precision is the layout a trainer holds (01's mixed_precision.py, whose table gives the weights,
# gradients, optimizer bytes per parameter): "mixed" = --dtype bfloat16 --precision-layout bf16-16 (bf16
# weights and gradients, fp32 master + AdamW: 2 + 2 + 12); "mixed-fp32-grads" = bf16-20, an fp32 gradient
# accumulation buffer beside the bf16 gradients (playbook §2.1's 20 bytes, nanotron's default), the copy
# reduced over dp. (--precision-layout autocast holds fp32's 4 + 4 + 8 with 2-byte activations.)
TRAINER_LAYOUT = {"mixed": "bf16-16", "mixed-fp32-grads": "bf16-20", "fp32": "fp32", "fp64": "fp64"}
STATE_BYTES = {name: mixed_precision.LAYOUTS[layout].bytes_per_parameter()
               for name, layout in TRAINER_LAYOUT.items()}
GRADIENT_WIRE_BYTES = {"mixed": 2, "mixed-fp32-grads": 4, "fp32": 4, "fp64": 8}
ACTIVATION_BYTES = {"mixed": 2, "mixed-fp32-grads": 2, "fp32": 4, "fp64": 8}


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_attn: str = "ring"
    pp: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    ep: int = 1
    num_experts: int = 0       # 0: dense MLPs
    top_k: int = 1
    shared_experts: int = 0    # 07's dense shared experts, replicated like the router
    zero_stage: int = 0
    recompute: str = "none"
    precision: str = "mixed"
    partition_activations: bool = False   # 04's P_a: full recompute's checkpoints in 1/tp slices


def model_states(params: float, n: int, zero_stage: int, precision: str = "mixed"):
    """(weights, gradients, optimizer) bytes of `params` parameters with ZeRO over n ranks (ZeRO §5.1).
    ZeRO-2/3 keep the gradient shard in the dtype it is reduce-scattered in: bf16-20's fp32 buffer (4 bytes),
    not its bf16 .grad beside it (03's flat_unit.py frees both full-size copies at the reduce-scatter)."""
    w, g, o = STATE_BYTES[precision]
    # exercise 08.1: ZeRO's memory per rank
    # hint: ZeRO §5.1, [PB] §2.2 (03's README, "How it works"; 08's, "The planner"): bytes per parameter
    #   of weights, gradients and optimizer states by precision, each stage dividing one more of the three
    #   by n; the gradient a stage keeps sharded is the one it reduce-scatters.
    # test: tests/test_5d_combined.py::test_planner_zero_paper_example
    g = GRADIENT_WIRE_BYTES[precision] if zero_stage >= 2 else g
    return (w * params / (n if zero_stage >= 3 else 1), g * params / (n if zero_stage >= 2 else 1),
            o * params / (n if zero_stage >= 1 else 1))
    # end exercise


def loss_stage(layout: Layout) -> int:
    """The pp stage holding the last layers, the head and the loss: p − 1, or 0 for the V-shaped schedules."""
    v_shape = layout.schedule in pipeline.V_SHAPED
    return pipeline.rank_of_block(layout.pp * layout.chunks - 1, layout.pp, v_shape)


def stage_parameters(config, layout: Layout, stage: int):
    """(dense, expert) parameters a rank of pipeline stage `stage` holds: exactly what the trainers build."""
    h, f, V, t = config.hidden_size, config.intermediate_size, config.vocab_size, layout.tp
    h_kv = config.num_key_value_heads * config.head_dim
    gpt = getattr(config, "architecture", "llama") == "gpt"          # search.GPTConfig: Megatron-LM's GPT
    norm = 2 * h if gpt else h                                       # LayerNorm has a bias, RMSNorm none
    layers = config.num_hidden_layers // layout.pp                           # L_r, over its V chunks
    kv_per_rank = h_kv // t if h_kv >= t * config.head_dim else config.head_dim   # tp > kv heads: one head
    attention = 2 * h * h // t + 2 * h * kv_per_rank                        # q, o (C, C/t); k, v (C, C_kv/t)
    dense = layers * (attention + 2 * norm)                                  # + the two replicated norms
    if gpt:                          # biases: qkv's and fc1's split with their columns, proj's, fc2's whole
        dense += layers * ((3 * h + f) // t + 2 * h)
    expert = 0
    if layout.num_experts:       # router (E, C), shared experts replicated; whole experts, E/ep of them
        dense += layers * (h * layout.num_experts + 3 * h * f * layout.shared_experts)
        expert = layers * 3 * h * f * layout.num_experts // layout.ep
    else:                        # gate, up (F/t, C), down (C, F/t); GPT: fc1 (F/t, C), fc2 (C, F/t)
        dense += layers * (2 if gpt else 3) * h * f // t
    first, last = stage == 0, stage == loss_stage(layout)
    positions = gpt * config.max_position_embeddings * h                     # GPT's learned positions (s, C)
    head = 0 if config.tie_word_embeddings and first else V * h // t         # Megatron: a tied copy if pp > 1
    return dense + first * (V * h // t + positions) + last * (norm + head), expert


def stage_memory(config, layout: Layout, seq_len: int, mbs: int, grad_acc: int, stage: int) -> dict:
    """Bytes per rank of `stage`: weights, gradients, optimizer states, activations, logits."""
    dense, expert = stage_parameters(config, layout, stage)
    n = layout.dp * layout.cp
    states = [a + b for a, b in zip(model_states(dense, n, layout.zero_stage, layout.precision),
                                    model_states(expert, max(n // layout.ep, 1), layout.zero_stage,
                                                 layout.precision))]
    # 08 under a schedule reduces once per step (gradient_sync.py): the full gradients accumulate beside
    # the shards until a chunk's last B/W reduce-scatters them, and ZeRO-3 keeps the stage's units
    # gathered from its first F
    if layout.pp > 1 and layout.zero_stage >= 2:
        w, g, _ = STATE_BYTES[layout.precision]
        states[1] += g * (dense + expert)           # the full gradients
        if layout.zero_stage == 3:
            states[0] += w * (dense + expert)
    e = ACTIVATION_BYTES[layout.precision]
    chunk = SimpleNamespace(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                            num_hidden_layers=config.num_hidden_layers // (layout.pp * layout.chunks))
    held = schedules.peak_held(layout.schedule, layout.pp, stage, grad_acc, layout.chunks)
    activations = held * memory.activation_bytes_estimate(chunk, mbs, seq_len, e, layout.recompute,
                                                          tp=layout.tp, sp=layout.sp, cp=layout.cp)
    activations //= layout.tp if layout.partition_activations else 1
    last_held = schedules.peak_held(layout.schedule, layout.pp, loss_stage(layout), grad_acc, layout.chunks)
    logits = ((stage == loss_stage(layout)) * last_held * mbs * seq_len // layout.cp * config.vocab_size
              // layout.tp * 4)
    return dict(parameters=states[0], gradients=states[1], optimizer=states[2], activations=activations,
                logits=logits, held=held)


def stage_communication(config, layout: Layout, seq_len: int, mbs: int, m: int, stage: int) -> dict:
    """Bytes a rank of `stage` sends per step, per dimension (see the module docstring)."""
    h, t, cp, p, V = config.hidden_size, layout.tp, layout.cp, layout.pp, layout.chunks
    h_kv = config.num_key_value_heads * config.head_dim
    e = ACTIVATION_BYTES[layout.precision]
    first, last = stage == 0, stage == loss_stage(layout)
    turn = layout.schedule in pipeline.V_SHAPED and stage == p - 1      # the V turns on the rank: no message
    layers = config.num_hidden_layers // p
    tokens = mbs * seq_len // cp                                             # b·s_r
    ring = lambda n, k: 2 * (n - 1) * k // n                       # all-reduce wire bytes  # noqa: E731
    norm_bytes = max(GRADIENT_WIRE_BYTES[layout.precision], 4)               # ‖g‖² in fp32, or fp64
    scalar = lambda n: ring(n, norm_bytes)                         # the gradient-norm squares  # noqa: E731
    comm = {}
    # --- tensor parallelism (+ SP) ---
    per_layer = 4 if layout.num_experts else 8                               # attention (+ the dense MLP)
    passes = per_layer * layers + 2 * first + 2 * last
    # full recompute runs the forward's collectives again: all of them under Megatron's (reentrant)
    # checkpoint; 01's non-reentrant one stops before the MLP's exit all-reduce, once backward's tensors
    # are back (torch's early stop)
    if layout.recompute == "full":
        whole = getattr(config, "architecture", "llama") == "gpt"
        passes += (per_layer // 2 if whole else 2) * layers
    tp = m * passes * ((t - 1) * tokens * h * e // t)
    tp += m * layers * layout.partition_activations * ((t - 1) * tokens * h * e // t)   # P_a's all-gathers
    tp += m * last * 3 * ring(t, tokens * 4)
    if layout.sp:
        tp += ring(t, (2 * h * layers + h * last) * e)
    comm["tp"] = tp + scalar(t) if t > 1 else 0
    # --- context parallelism ---
    if cp > 1 and layout.cp_attn in ("ring", "allgather"):     # K/V blocks 2·b·s_r·h_kv/t, fp32 or wider
        hops = 3 * cp - 2 if layout.cp_attn == "ring" else 2 * (cp - 1)   # allgather_kv.py: one AG, one RS
        hops += (cp - 1) * (layout.recompute != "none")                    # the forward's again
        comm["cp"] = m * layers * hops * 2 * tokens * max(h_kv // t, config.head_dim) * max(e, 4)
    elif cp > 1:
        passes = 2 + (layout.recompute != "none")                            # 4 all-to-alls each
        comm["cp"] = m * layers * passes * (cp - 1) * tokens * (2 * h + 2 * h_kv) // t // cp * e
    else:
        comm["cp"] = 0
    if cp > 1 and layout.num_experts:   # f's counts, P's sums ((b, E) each) and P's gradient, per MoE layer
        calls = 3 + 2 * (layout.recompute == "full")
        comm["cp"] += m * layers * calls * ring(cp, mbs * layout.num_experts * norm_bytes)
    # --- pipeline: activations forward, gradients backward; the loss broadcast and the norm ---
    boundary = tokens // (t if layout.sp else 1) * h * e
    logged = ring(p, 8) + scalar(p) if layout.num_experts else (p - 1) * 8 // p   # loss summed / broadcast
    comm["pp"] = m * (2 * V - first - last - 2 * turn) * boundary + (logged + scalar(p) if p > 1 else 0)
    # --- data parallelism over the cp×dp ranks that hold the same weights ---
    n = layout.dp * cp
    dense, expert = stage_parameters(config, layout, stage)
    grads = dense * GRADIENT_WIRE_BYTES[layout.precision]
    factor = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[layout.zero_stage]   # 03: ZeRO-2/3 per micro-batch
    if p > 1:                          # 08 under a schedule: one reduce-scatter and one all-gather per step
        factor = 2
    shard_norms = ring(n, 2 * norm_bytes) if layout.zero_stage else 0        # ZeRO: Σ_dp of the shards' ‖g‖²
    comm["dp"] = (factor * (n - 1) * grads // n + ring(n, 8) + shard_norms     # ring(n, 8): the logged loss
                  if n > 1 else 0)
    n_expert = n // layout.ep                                                # ranks holding the same experts
    comm["dp"] += factor * (n_expert - 1) * expert * GRADIENT_WIRE_BYTES[layout.precision] // n_expert
    comm["dp"] += scalar(n_expert) if layout.zero_stage and layout.num_experts else 0
    # --- expert parallelism ---
    routed = tokens * h * layout.top_k * e                                   # b·s_r·h·k·e bytes of rows
    comm["ep"] = (m * layers * 4 * (layout.ep - 1) * routed // layout.ep + scalar(layout.ep)
                  if layout.num_experts else 0)
    return comm


def overlap_ratios(config, layout: Layout, seq_len: int, mbs: int, peak_flops: float, bw: dict) -> dict:
    """t_comm/t_compute per dimension (playbook App. 5.3, errata E6 and E9 as in the module docstring)."""
    h, e = config.hidden_size, ACTIVATION_BYTES[layout.precision]
    h_kv = config.num_key_value_heads * config.head_dim
    n, tokens = layout.dp * layout.cp, mbs * seq_len // layout.cp
    # exercise 08.3: overlap ratios
    # hint: t_comm/t_compute of every dimension whose degree is above 1 (App. 5.3): the bytes a rank sends
    #   over the bandwidth, against the FLOPs that can hide them over the peak; the forms term by term are in
    #   08_5d_combined/README.md (dp: erratum E6, tp: E9).
    # test: tests/test_5d_combined.py::test_planner_overlap_ratios_follow_their_derivations
    ratios = {}
    if n > 1:
        key = "zero3" if layout.zero_stage == 3 else "dp"
        ratios[key] = e * (n - 1) / n / (2 * tokens) * peak_flops / bw["dp"]
    if layout.tp > 1:
        ratios["tp"] = e * (layout.tp - 1) / (2 * h) * peak_flops / bw["tp"]
    if layout.pp > 1:
        chunk_layers = config.num_hidden_layers // (layout.pp * layout.chunks)
        ratios["pp"] = e * peak_flops / (32 * h * chunk_layers * bw["pp"])
    if layout.cp > 1:
        ratios["cp"] = e * layout.cp * h_kv / (2 * seq_len * h) * peak_flops / bw["cp"]
    if layout.num_experts and layout.ep > 1:
        ratios["ep"] = (e * (layout.ep - 1) / (3 * layout.ep * config.intermediate_size) * peak_flops
                        / bw["ep"])
    return ratios
    # end exercise
