"""V-shaped schedules: two chunks per rank placed V-wise, the backward split into B and W.

Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241) §6, ZB-V; DeepSeek-V3 report
(arXiv 2412.19437) §3.2.1 and deepseek-ai/DualPipe's DualPipeV (its V form, "cut in half").
Rank r of p holds blocks r and 2p−1−r of 2p (pipeline.block_index): a micro-batch runs down the
ranks in chunk 0 and back up in chunk 1, so rank 0 holds the embedding and the loss. With t_F, t_B,
t_W the times of one chunk's passes (B: input gradient; a full backward is B+W), the idle time of a
rank in one step (the replayed timeline, timeline.py):

    zb-v        (p−1)·(t_F + t_B − 2t_W)/... = 0 when t_F = t_B = t_W inside each rank's span
    dualpipev   (p−1)·(F&B + B_full − 3t_W)   (DeepSeek-V3 Table 2 with PP = 2p stages; here F&B
                 = t_F + B_full: on one stream the paired F and B run one after the other)

Each schedule is an order of passes per rank, ("F" | "B" | "I" | "W", micro-batch, chunk) with B the
whole backward and I the input gradient whose W runs later (zero_bubble.py), written as the same
phases as `torch.distributed.pipelining`'s ScheduleZBVZeroBubble and ScheduleDualPipeV (the test
compares the two orders); `run_order` executes one with schedules.Pipeline.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-chunks 2 --pp-schedule zb-v --grad-acc 8
New compared with zb-h1: two chunks V-wise, so the cool-down of chunk 0 overlaps chunk 1's work.
"""
from collections import Counter


def zb_v_order(p: int, rank: int, m: int) -> list:
    """ZB-V (ZB paper §6, its Fig. 8): every B is an input gradient, its W follows at once in the
    steady state and fills the cool-down at the end."""
    n = max(m, 2 * p - 1)               # the pattern fills with 2p − 1 micro-batches; extra ones dropped
    order, counts = [], Counter()

    def add(op, chunk):
        order.append((op, counts[op, chunk], chunk))
        counts[op, chunk] += 1
    # === warm-up: chunk 0 forwards, then chunk 1's first forwards between them ===
    for _ in range(2 * (p - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    # === the first micro-batches turn round on chunk 1: F, B, W ===
    for _ in range(p - rank):
        add("F", 1), add("I", 1), add("W", 1)
    # === steady: F B W on chunk 0, then on chunk 1 ===
    while counts["F", 1] < counts["F", 0] or counts["F", 0] < n:
        if counts["F", 0] < n:
            add("F", 0)
        add("I", 0), add("W", 0), add("F", 1), add("I", 1), add("W", 1)
    # === cool-down: Bs first (the W of the last ones deferred), then the deferred Ws ===
    for _ in range(rank):
        add("I", 0), add("I", 1)
    for _ in range(p - rank):
        add("I", 0), add("W", 0)
    for chunk in (1, 0):
        while counts["W", chunk] < counts["I", chunk]:
            add("W", chunk)
    return [(op, micro, chunk) for op, micro, chunk in order if micro < m]


def dualpipev_order(p: int, rank: int, m: int) -> list:
    """DualPipeV (DeepSeek's DualPipe cut in half): eight phases; in the main one every F of one chunk
    is paired with a full backward of the other ("F&B", overlapped on a GPU to hide the all-to-all;
    here one after the other). A W runs the oldest deferred input gradient's weight gradient."""
    order, counts, deferred = [], Counter(), []

    def add(op, chunk=None):
        if op == "W":                   # the oldest I's weight gradient (DualPipe's WeightGradStore)
            if deferred:
                order.append(("W", *deferred.pop(0)))
            return
        kind = "F" if op == "F" else "B"                # B and I count the same backwards
        order.append((op, counts[kind, chunk], chunk))
        if op == "I":
            deferred.append((counts[kind, chunk], chunk))
        counts[kind, chunk] += 1
    # === 1: chunk 0 forwards (nF0) ===
    for _ in range(2 * (p - rank - 1)):
        add("F", 0)
    # === 2: F0 F1 ===
    for _ in range(rank + 1):
        add("F", 0), add("F", 1)
    # === 3: I1 W F1 (zero bubble) ===
    for _ in range(p - rank - 1):
        add("I", 1), add("W"), add("F", 1)
    # === 4, main: F0&B1, F1&B0 ===
    for _ in range(m - 2 * p + rank + 1):
        add("F", 0), add("B", 1), add("F", 1), add("B", 0)
    # === 5: B1, F1&B0 ===
    for _ in range(p - rank - 1):
        add("B", 1), add("F", 1), add("B", 0)
    # === 6: B1 B0, the second half as input gradients (W deferred) ===
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add("I" if split else "B", 1)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add("I" if split else "B", 0)
    # === 7: W I0 ===
    for _ in range(p - rank - 1):
        add("W"), add("I", 0)
    # === 8: the remaining Ws ===
    for _ in range(rank + 1):
        add("W")
    return order


ORDERS = {"zb-v": zb_v_order, "dualpipev": dualpipev_order}


def run_order(pipe, micro_batches, order):
    """Run one rank's order of passes on schedules.Pipeline (split_backward: I defers dW to W)."""
    pipe.begin(micro_batches)
    passes = {"F": pipe.forward, "B": pipe.backward, "I": pipe.backward_input, "W": pipe.backward_weight}
    for op, micro, chunk in order:
        passes[op](micro, chunk)
    return pipe.finish()


def train_step_zb_v(pipe, micro_batches):
    return run_order(pipe, micro_batches, zb_v_order(pipe.p, pipe.rank, len(micro_batches)))


def train_step_dualpipev(pipe, micro_batches):
    return run_order(pipe, micro_batches, dualpipev_order(pipe.p, pipe.rank, len(micro_batches)))


def peak_held(schedule: str, p: int, rank: int, m: int) -> int:
    """Micro-batch·chunks whose activations (or, after an I, the X and dY its W needs) rank r holds
    at its peak: ZB-V 2p = p stage-sized micro-batches, 1F1B's rank 0 (ZB paper §6), fewer while
    m < 2p − 1; DualPipeV 2p + 1 (DeepSeek-V3 Table 2: PP + 1 for PP = 2p stages)."""
    if schedule == "zb-v":
        return min(2 * p, 2 * m, m + 1 + rank)
    return 2 * p + 1
