"""Pipeline schedules: in which order each stage runs the forward (F) and backward (B, W) passes.

Playbook §2.6 (AFAB, 1F1B, interleaving, zero bubble), Megatron-LM §4.2.1 (interleaved 1F1B),
Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241, ZB-H1). m micro-batches,
p stages, V chunks per rank; t_F, t_B, t_W the times of one micro-batch's passes on one stage.
Bubble fraction = idle time / useful time of a rank (playbook: t_pb / t_id):

    schedule      bubble                                   micro-batches held per stage
    afab          (p−1)/m                                  m        (all forwards, then all backwards)
    1f1b          (p−1)/m          (same bubble, erratum E16)  p − rank (warm-up, steady 1F1B, cool-down)
    interleaved   (p−1)/(V·m)      (chunks are V× shorter)  ≈ p per chunk; m must be a multiple of p
    zb-h1         (p−1)(t_F+t_B−t_W)/(m(t_F+t_B+t_W))        p  (ZB paper §3.1, "ZB-H1")
                  = (p−1)/(3m) for t_F = t_B = t_W
    zb-v, dualpipev  two chunks per rank placed V-wise: v_schedules.py

Every schedule gives exactly the single-device gradients: the loss of micro-batch i is divided by m
on the last stage and every stage accumulates its parameters' gradients over all micro-batches.
Each schedule is `train_step_*(pipe, micro_batches)` -> the local mean loss (0 off the last stage);
passes.py's `Pipeline` runs the passes, talks to the neighbours and records the timeline with its pass
clock (the host's on the CPU, CUDA events on a GPU). ZB-H1's B/W split is zero_bubble.py's.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule zb-h1 --grad-acc 8
New compared with 02: the micro-batch loop of the step becomes one of these orders of passes.
"""

import v_schedules

SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev")        # schedules whose B leaves dW to a W pass


# ======================================================================================
# All forward, all backward (GPipe)
# ======================================================================================
def train_step_afab(pipe, micro_batches):
    pipe.begin(micro_batches)
    # exercise 06.1: the AFAB schedule
    # hint: [PB] §2.6 "All-forward-all-backward" (GPipe; 06's README, "The schedules"): a stage's passes are
    #   pipe.forward(i) and pipe.backward(i) for each of the pipe.m micro-batches (Pipeline receives and sends
    #   for them); a backward can start only after the forward it reverses, and this order holds all m.
    # test: tests/test_pipeline.py::test_afab_order_holds_every_micro_batch_and_replays_to_the_theory_bubble
    # === all forward: every micro-batch's activations stay until its backward ===
    for i in range(pipe.m):
        pipe.forward(i)
    # === all backward ===
    for i in range(pipe.m):
        pipe.backward(i)
    # end exercise
    return pipe.finish()


# ======================================================================================
# One forward, one backward (PipeDream-Flush)
# ======================================================================================
def train_step_1f1b(pipe, micro_batches):
    pipe.begin(micro_batches)
    m = pipe.m
    # exercise 06.2: the 1F1B schedule
    # hint: [PB] §2.6 "One-forward-one-backward" (06's README, "The schedules"): a stage starts its first
    #   backward as soon as the last stage can have sent its gradient back, and from then on alternates,
    #   so it never holds more than p − rank micro-batches; AFAB (06.1) runs the same passes in another order.
    #   ZB-H1 below runs the same order, its backward split (its B, then the due Ws).
    # test: tests/test_pipeline.py::test_1f1b_order_replays_to_the_theory_bubble_holding_p_minus_rank
    warmup = min(pipe.p - pipe.rank - 1, m)   # later stages start backward sooner
    # === warm-up ===
    for i in range(warmup):
        pipe.forward(i)
    # === steady 1F1B ===
    for i in range(m - warmup):
        pipe.forward(warmup + i)
        pipe.backward(i)
    # === cool-down ===
    for i in range(m - warmup, m):
        pipe.backward(i)
    # end exercise
    return pipe.finish()


# ======================================================================================
# Interleaved 1F1B (Megatron-LM §4.2.1, forward_backward_pipelining_with_interleaving)
# ======================================================================================
def interleaved_order(k: int, p: int, chunks: int, forward: bool):
    """(micro-batch, chunk) of the k-th forward (or backward) pass of a rank: groups of p
    micro-batches go through chunk 0, then chunk 1, …; backward runs the chunks in reverse."""
    # exercise 06.3: the interleaved 1F1B order
    # hint: Megatron-LM §2.2.2 (06's README, "The schedules"): a rank's passes come in rounds of p·V; in a
    #   round, p consecutive micro-batches go through each of the rank's V chunks in turn (the last chunk
    #   first when going backward); the warm-up of train_step_interleaved is Megatron's.
    # test: tests/test_pipeline.py::test_interleaved_order_replays_to_the_theory_bubble
    # level: 2
    chunk = (k % (p * chunks)) // p
    return (k // (p * chunks)) * p + k % p, chunk if forward else chunks - 1 - chunk
    # end exercise


def train_step_interleaved(pipe, micro_batches):
    pipe.begin(micro_batches)
    p, rank, V = pipe.p, pipe.rank, pipe.chunks
    total = pipe.m * V                                  # passes per direction on this rank
    # Megatron: enough warm-up forwards that the last chunk's first backward can start; with m == p
    # every forward comes first.
    warmup = total if pipe.m == p else min(total, (p - rank - 1) * 2 + (V - 1) * p)
    # === warm-up ===
    for k in range(warmup):
        pipe.forward(*interleaved_order(k, p, V, forward=True))
    # === steady 1F1B ===
    for k in range(total - warmup):
        pipe.forward(*interleaved_order(warmup + k, p, V, forward=True))
        pipe.backward(*interleaved_order(k, p, V, forward=False))
    # === cool-down ===
    for k in range(total - warmup, total):
        pipe.backward(*interleaved_order(k, p, V, forward=False))
    return pipe.finish()


# ======================================================================================
# ZB-H1: 1F1B with the backward split into B (input gradient) and W (weight gradient)
# ======================================================================================
def train_step_zb_h1(pipe, micro_batches):
    """1F1B's order of F and B; stage r runs micro-batch i's W only after the B of micro-batch i+r,
    so the r deferred Ws fill the cool-down, where 1F1B waits for gradients from later stages.
    Held micro-batches: (p−r−1 warm-up) + 1 + r deferred = p on every stage (1F1B's peak)."""
    if pipe.weight_store is None:
        raise ValueError("train_step_zb_h1 needs Pipeline(..., split_backward=True): its B defers dW to W")
    pipe.begin(micro_batches)
    m, lag = pipe.m, pipe.rank
    # exercise 06.2
    warmup = min(pipe.p - pipe.rank - 1, m)
    # end exercise
    deferred = []

    def input_gradient_then_due_weights(i):
        pipe.backward_input(i)
        deferred.append(i)
        while len(deferred) > lag:
            pipe.backward_weight(deferred.pop(0))
    # exercise 06.2
    # === warm-up ===
    for i in range(warmup):
        pipe.forward(i)
    # === steady: F, B, (W of micro-batch i − r) ===
    for i in range(m - warmup):
        pipe.forward(warmup + i)
        input_gradient_then_due_weights(i)
    # === cool-down: B, W ===
    for i in range(m - warmup, m):
        input_gradient_then_due_weights(i)
    # end exercise
    # === the last deferred Ws fill the end of the step ===
    for i in deferred:
        pipe.backward_weight(i)
    return pipe.finish()


# ======================================================================================
# Forward only (evaluation)
# ======================================================================================
def forward_only(pipe, micro_batches):
    """Every forward pass, chunk by chunk (AFAB's order with one chunk), nothing kept for a backward: the
    last block's mean loss (0 elsewhere). A chunk's blocks come after all earlier chunks' blocks, in both
    placements (interleaved and V), so a rank only ever waits for lower blocks: no deadlock, for any m.
    Called under torch.no_grad(); the training step's timeline, peak and sends are left as they were (the
    reports after the loop are about training)."""
    kept = pipe.events, pipe.peak_held, pipe.p2p.sent
    pipe.begin(micro_batches, backward=False)
    for chunk in range(pipe.chunks):
        for micro in range(pipe.m):
            pipe.forward(micro, chunk)
            pipe.saved.clear()                            # no backward will come for it
    loss = pipe.finish()
    pipe.events, pipe.peak_held, pipe.p2p.sent = kept
    return loss


def peak_held(schedule: str, p: int, rank: int, m: int, chunks: int = 1) -> int:
    """Micro-batches (per chunk) whose activations a rank holds at its peak, by the schedules above."""
    if schedule in v_schedules.ORDERS:
        return v_schedules.peak_held(schedule, p, rank, m)
    if schedule == "afab":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)                     # warm-up p − rank − 1, then one more before a B
    if schedule == "zb-h1":
        return min(m, p)                            # p − rank of 1F1B + rank deferred Ws
    total = m * chunks                              # interleaved: Megatron's warm-up + 1
    return total if m == p else min(total, (p - rank - 1) * 2 + (chunks - 1) * p + 1)


SCHEDULE_STEPS = {"afab": train_step_afab, "1f1b": train_step_1f1b,
                  "interleaved": train_step_interleaved, "zb-h1": train_step_zb_h1,
                  "zb-v": v_schedules.train_step_zb_v, "dualpipev": v_schedules.train_step_dualpipev}
