"""V-shaped schedules: two chunks per rank placed V-wise, the backward split into B and W.

Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241) §6, ZB-V; DeepSeek-V3 report
(arXiv 2412.19437) §3.2.1 and deepseek-ai/DualPipe's DualPipeV (DualPipe "cut in half"); playbook §2.6.
Rank r of p holds blocks r and 2p−1−r of 2p (pipeline.block_index): a micro-batch goes down the
ranks in chunk 0 and back up in chunk 1, so rank 0 holds the embedding and the loss. With t one
chunk pass (t_F = t_B = t_W, a whole backward 2t) a rank works 6m·t per step and idles

    zb-v       (p−1)·t: no idle inside a rank's span (ZB paper §6) once m ≥ 2p−1, only the staggered
               start and end; bubble (p−1)/(6m); peak 2p micro-batch·chunks (= 1F1B's p stages)
    dualpipev  (PP/2−1)(F&B + B − 3W) = 2(p−1)·t with PP = 2p (DeepSeek-V3 Table 2, F&B = 3t: the
               pair's F and whole B, B = 2t, W = t); bubble (p−1)/(3m); peak 2p + 1 (Table 2's PP + 1)

An order is a list per rank of (op, micro-batch, chunk), op F, B (whole backward), I (input gradient,
its dW queued) or W (a queued dW, zero_bubble.py), built in the phases of torch.distributed.pipelining's
ScheduleZBVZeroBubble and ScheduleDualPipeV (tests/test_v_schedules.py compares the orders);
`run_order` runs one on passes.Pipeline. DualPipe overlaps each F&B pair on a GPU; here its F runs,
then its B.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-chunks 2 --pp-schedule zb-v --grad-acc 8
New compared with zb-h1: two chunks V-wise, so one rank's chunk-1 work fills its chunk-0 bubbles.
"""
from collections import Counter


def zb_v_order(p: int, rank: int, m: int) -> list:
    """ZB-V (ZB paper §6): every B is an input gradient, its W follows at once in the
    steady state and fills the cool-down at the end."""
    n = max(m, 2 * p - 1)               # the pattern fills with 2p − 1 micro-batches; extra ones dropped
    order, counts = [], Counter()

    def add(op, chunk):
        order.append((op, counts[op, chunk], chunk))
        counts[op, chunk] += 1
    # exercise 06.5: ZB-V's order
    # hint: Qi et al. 2023 §6 (06's README, "V-shaped schedules"): warm-up forwards down chunk 0
    #   and back up chunk 1, a steady pattern of F, B (input gradient) and W on each chunk in turn, and a
    #   cool-down where the Ws deferred fill the gaps; torch.distributed.pipelining's ScheduleZBVZeroBubble
    #   builds the same order.
    # test: tests/test_v_schedules.py::test_orders_match_torch_pipelining[zb-v]
    # level: 2
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
    # end exercise
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
    # exercise 06.6: DualPipeV's order
    # hint: DeepSeek-V3 §3.2.1, deepseek-ai/DualPipe's DualPipeV (06's README, "V-shaped schedules"):
    #   eight phases per rank, the counts of each set by p and rank; in the main phase every F
    #   of one chunk is paired with a whole backward of the other; the last phases defer Ws to fill the
    #   cool-down. torch.distributed.pipelining's ScheduleDualPipeV builds the same order.
    # test: tests/test_v_schedules.py::test_orders_match_torch_pipelining[dualpipev]
    # level: 2
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
    # end exercise
    return order


ORDERS = {"zb-v": zb_v_order, "dualpipev": dualpipev_order}


def run_order(pipe, micro_batches, order):
    """Run one rank's order of passes on passes.Pipeline (split_backward: I defers dW to W)."""
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
