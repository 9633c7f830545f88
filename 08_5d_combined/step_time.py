"""The search's cost model: a layout's FLOPs, memory and step time on a cluster of GPUs.

Playbook chapter 3 (step 3: throughput), Megatron-LM §5.1 (FLOPs per iteration,
F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full recomputation; training time ≈ 8·T·P/(n·X)).
One layout (dp·tp·pp·cp, ep, SP, schedule, ZeRO stage, recompute, micro-batch) is costed as

    step      = (t_compute + exposed tp, cp, pp, ep) · (1 + bubble) + exposed dp
    t_compute = FLOPs of the slowest stage's rank / (peak · MFU) · max(1, ridge / GEMM intensity)
    exposed   = bytes / link bandwidth · max(0, 1 − 1/overlap ratio)   (tp: all of it, critical path)

with plan_arithmetic.py's stage_communication bytes and overlap_ratios and 06's bubble; the DP term
follows the flush. The GPUs' numbers are their datasheets'. search.py ranks every layout by this `estimate`.

    python 08_5d_combined/planner.py --search --gpus 64 --gpu h100 --preset 1b --seq-len 4096

New compared with planner.py: time, not only bytes.
"""
from dataclasses import dataclass

import timeline
import plan_arithmetic
import measured_links


@dataclass(frozen=True)
class GPU:
    peak_tflops: float      # dense bf16 tensor-core peak
    memory_gb: float
    hbm_tbps: float
    nvlink_gbps: float      # per GPU, each direction: NCCL's bus bandwidth inside a node at best
    network_gbps: float     # per GPU across nodes


GPUS = {   # vendor datasheets (NVIDIA H100, H200 and A100 Tensor Core GPU); the flags override each value
    "h100": GPU(989, 80, 3.35, 450, 50),        # SXM5; NVLink 900 GB/s total; one 400 Gb/s NIC per GPU
    "h200": GPU(989, 141, 4.8, 450, 50),        # SXM; the H100's compute with 141 GB of HBM3e
    "a100": GPU(312, 80, 2.039, 300, 25),       # SXM4 80 GB; NVLink 600 GB/s total; 200 Gb/s HDR per GPU
    "a100-40gb": GPU(312, 40, 1.555, 300, 25),  # (Selene: 8 HDR HCAs per 8-GPU node, Megatron-LM §5)
}


@dataclass(frozen=True)
class Cluster:
    gpus: int
    per_node: int
    peak: float             # FLOP/s per GPU
    memory: float           # bytes a rank may fill (GPU memory − reserve)
    hbm: float              # bytes/s
    intra: float            # bytes/s per GPU inside a node (measured_links.Measured: per collective)
    inter: float            # bytes/s per GPU across nodes
    mfu: float


def cluster_of(args) -> Cluster:
    gpu = GPUS[args.gpu]
    pick = lambda flag, default: default if flag is None else flag                  # noqa: E731
    intra, inter = measured_links.links_of(args, gpu.nvlink_gbps * 1e9, gpu.network_gbps * 1e9)
    return Cluster(args.gpus, args.gpus_per_node, pick(args.peak_tflops, gpu.peak_tflops) * 1e12,
                   (pick(args.gpu_mem, gpu.memory_gb) - args.mem_reserve) * 1e9,
                   pick(args.hbm_tbps, gpu.hbm_tbps) * 1e12, intra, inter, args.mfu)


def layer_flops(config, seq_len: int, recompute: str, num_experts: int = 0, top_k: int = 1):
    """(dense, expert) FLOPs per token of one layer, forward + backward (2×) + what `recompute` runs again.

    Forward: 2 FLOPs per weight the token multiplies, plus QKᵀ and AV over the whole sequence (4·s·h,
    unmasked, as Megatron-LM §5.1 counts). Selective recomputation repeats those 4·s·h; full, the forward."""
    h, f, s = config.hidden_size, config.intermediate_size, seq_len
    h_kv = config.num_key_value_heads * config.head_dim
    gpt = getattr(config, "architecture", "llama") == "gpt"
    # exercise 08.2: Megatron's FLOPs per token
    # hint: Megatron-LM §5.1's F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full recomputation, taken
    #   apart (08's README, "The search, in detail", FLOPs): 2 FLOPs per weight a token multiplies forward,
    #   twice that backward, QKᵀ and AV over the whole sequence, and what each recomputation mode runs
    #   again; a GPT MLP has two matrices, a SwiGLU three, an MoE layer a router and k experts.
    # test: tests/test_published_numbers.py::test_megatron_flops_per_iteration_and_throughput
    dense = 2 * (2 * h * h + 2 * h * h_kv) + 4 * s * h                       # q, o, k, v; QKᵀ, AV
    mlp = 2 * (2 if gpt else 3) * h * f
    expert = top_k * mlp if num_experts else 0
    dense += 2 * h * num_experts if num_experts else mlp                     # the router, or the dense MLP
    extra = {"none": (0, 0), "selective": (4 * s * h, 0), "full": (dense, expert)}[recompute]
    return 3 * dense + extra[0], 3 * expert + extra[1]
    # end exercise


def flops_per_token(config, seq_len: int, recompute: str, num_experts: int = 0, top_k: int = 1) -> float:
    """Every FLOP of a training step per token: the layers, and the logits' 2·h·V forward, 4·h·V backward."""
    dense, expert = layer_flops(config, seq_len, recompute, num_experts, top_k)
    return config.num_hidden_layers * (dense + expert) + 6 * config.hidden_size * config.vocab_size


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Megatron-LM §5.1: end-to-end time ≈ 8·T·P/(n·X) (6·T·P for the passes, 2·T·P recomputed)."""
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86400


@dataclass(frozen=True)
class Plan:
    layout: object
    mbs: int
    m: int
    memory: float           # the fullest stage's bytes per rank
    times: dict             # seconds: compute, tp, cp, pp, ep, dp (exposed), step
    bubble: float
    intensity: float        # FLOPs per byte of the rank's (b·s/cp, h) × (h, h/t) GEMM

    @property
    def model_parallel(self):
        return self.layout.tp * self.layout.pp * self.layout.cp


def peak_memory(config, layout, seq_len, mbs, m) -> float:
    """The fullest of the first and last stage (most activations held; the logits and the head)."""
    mem = [plan_arithmetic.stage_memory(config, layout, seq_len, mbs, m, s)
           for s in sorted({0, layout.pp - 1})]
    return max(sum(v for k, v in stage.items() if k != "held") for stage in mem)


def estimate(config, layout, seq_len: int, mbs: int, m: int, cluster: Cluster, memory: float = 0.0) -> Plan:
    """The step time of one layout, term by term (module docstring)."""
    t, cp, p = layout.tp, layout.cp, layout.pp
    tokens = m * mbs * seq_len // cp                                         # per rank per step
    dense, expert = layer_flops(config, seq_len, layout.recompute, layout.num_experts, layout.top_k)
    layers, logits = config.num_hidden_layers // p, 6 * config.hidden_size * config.vocab_size / t
    # the slowest rank is the last stage's: its layers and the logits; experts are whole on every tp rank
    stage_flops = tokens * (layers * (dense / t + expert) + logits)          # (08's experts.py): not / t
    e = plan_arithmetic.ACTIVATION_BYTES[layout.precision]
    rows, k, n = mbs * seq_len // cp, config.hidden_size, max(config.hidden_size // t, 1)
    intensity = 2 * rows * k * n / (e * (rows * k + k * n + rows * n))
    rate = cluster.peak * cluster.mfu
    times = {"compute": stage_flops / rate * max(1.0, cluster.peak / cluster.hbm / intensity)}
    bw = measured_links.bandwidths(layout, cluster.per_node, cluster.intra, cluster.inter)
    ratios = plan_arithmetic.overlap_ratios(config, layout, seq_len, mbs, rate, bw)
    sent = [plan_arithmetic.stage_communication(config, layout, seq_len, mbs, m, s)
            for s in sorted({0, p - 1})]
    for dim in ("tp", "cp", "pp", "ep", "dp"):
        key = "zero3" if dim == "dp" and layout.zero_stage == 3 else dim
        hidden = 0.0 if dim == "tp" else min(1.0, 1 / ratios[key]) if ratios.get(key) else 1.0
        times[dim] = max(s[dim] for s in sent) / bw[key] * (1 - hidden)
    bubble = timeline.theory_bubble(layout.schedule, p, m, layout.chunks) if p > 1 else 0.0
    per_micro_batch = sum(times[d] for d in ("compute", "tp", "cp", "pp", "ep"))
    times["step"] = per_micro_batch * (1 + bubble) + times["dp"]
    return Plan(layout, mbs, m, memory, times, bubble, intensity)
