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
`Pipeline` (below) runs the passes, talks to the neighbours and records the timeline with its pass
clock (the host's on the CPU, CUDA events on a GPU). ZB-H1's B/W split is zero_bubble.py's.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule zb-h1 --grad-acc 8
New compared with 02: the micro-batch loop of the step becomes one of these orders of passes.
"""
import contextlib
import time
from dataclasses import dataclass
from importlib import import_module

import torch

pipeline = import_module("06_pipeline.pipeline")
zero_bubble = import_module("06_pipeline.zero_bubble")
v_schedules = import_module("06_pipeline.v_schedules")
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev")        # schedules whose B leaves dW to a W pass


@dataclass(frozen=True)
class Event:
    """One pass that a rank really ran: op F (forward), B (backward, or input-gradient only in
    ZB-H1), W (weight gradient, ZB-H1); start and end in seconds of the host clock (time.time(),
    comparable across processes of one machine), measured by the pipeline's pass clock."""
    rank: int
    op: str
    micro: int
    chunk: int
    start: float
    end: float


# ======================================================================================
# Pass clocks: when a pass really ran
# ======================================================================================
class HostClock:
    """CPU: a pass runs while the host runs it, so the host clock times it."""

    def begin_step(self):
        pass

    def stamp(self):
        return time.time()

    def seconds(self, stamps):
        return list(stamps)


class DeviceClock:
    """CUDA: the host only queues kernels, and does not wait for an irecv (the stream does), so host
    time would say when a pass was queued. Events recorded on the stream say when it ran: at the step's
    start one wait for the reference event, then host time t0; a pass's time is t0 + the device time
    elapsed since the reference, resolved after one more wait at the end of the step (none per pass)."""

    def __init__(self, event_class):
        self.event_class = event_class            # torch.cuda.Event (a fake one in the tests)

    def begin_step(self):
        self.reference = self.stamp()
        self.reference.synchronize()              # the stream has drained up to now
        self.t0 = time.time()

    def stamp(self):
        event = self.event_class(enable_timing=True)
        event.record()
        return event

    def seconds(self, stamps):
        if stamps:
            stamps[-1].synchronize()              # the last event ran, so did every earlier one (one stream)
        return [self.t0 + self.reference.elapsed_time(e) / 1e3 for e in stamps]   # elapsed_time: ms


def pass_clock(device):
    """The clock for `device`: CUDA events on a GPU; the host clock (and no torch.cuda call) on the CPU."""
    return DeviceClock(torch.cuda.Event) if device.type == "cuda" else HostClock()


class NoGradientSync:
    """The `grad_sync` of a pipeline whose gradients are reduced after the schedule (06's train.py)."""

    def forward(self, chunk):
        return contextlib.nullcontext()

    def backward(self, chunk, final):
        return contextlib.nullcontext()


class Pipeline:
    """This rank's chunks and their passes on micro-batches; `held` counts micro-batches (per
    chunk) whose activations are kept for a backward (or, under ZB-H1, a W) not yet run.

    split_backward (ZB-H1, ZB-V, DualPipeV): the linear layers' dW can be split off the backward
    (zero_bubble.py) into `weight_store`, which this pipeline owns; `backward_input` and
    `backward_weight` run the halves, `backward` still runs both at once.

    grad_sync (08): every pass runs inside `grad_sync.forward(chunk)` or `grad_sync.backward(chunk,
    final)`. A chunk gets one B and, split, one W per micro-batch (a whole backward counts as both), so
    the pipeline counts them: `final` is True on the pass that completes the chunk's m-th of every kind
    it does, after which the gradients it adds to (W: the split linears', B: the others') are complete
    for the step, whatever the schedule's order. Data parallelism reduces them then (02's `no_sync` on
    the other passes; 08's gradient_sync.py; what no final pass reduced, finish_gradients does)."""

    def __init__(self, stages, p2p, clock=None, split_backward=False, grad_sync=None):
        self.stages, self.p2p, self.clock = stages, p2p, clock or HostClock()
        self.grad_sync = grad_sync or NoGradientSync()
        self.rank, self.p, self.chunks = p2p.rank, p2p.p, len(stages)
        # the pp rank of the last block, which computes the loss: p − 1, or 0 V-wise
        self.loss_rank = pipeline.rank_of_block(self.p * self.chunks - 1, self.p, p2p.v_shape)
        self.events, self.peak_held = [], 0
        self.weight_store = zero_bubble.WeightGradStore() if split_backward else None
        if split_backward:
            zero_bubble.split_weight_gradients(stages, self.weight_store)

    def begin(self, micro_batches, backward: bool = True):
        """A new step; `backward=False` for forward passes only (evaluation): no backward passes to count."""
        self.micro_batches, self.m = micro_batches, len(micro_batches)
        self.saved, self.loss, self.events, self.peak_held, self._stamps = {}, 0.0, [], 0, []
        kinds = (("B", "W") if self.weight_store else ("B",)) if backward else ()
        self.passes_left = {(kind, c): self.m for kind in kinds for c in range(self.chunks)}
        self.p2p.sent = []
        self.clock.begin_step()

    def _timed(self, op, micro, chunk, fn):
        start = self.clock.stamp()
        result = fn()
        self._stamps.append((op, micro, chunk, start, self.clock.stamp()))
        return result

    def _final(self, kind, chunk):
        """Count a pass of `kind` on `chunk`: True if it is the chunk's last of that kind in the step."""
        self.passes_left[kind, chunk] -= 1
        return self.passes_left[kind, chunk] == 0

    def _held(self):
        return len(self.saved) + (self.weight_store.pending() if self.weight_store else 0)

    def forward(self, micro: int, chunk: int = 0):
        """F: receive the input, run the chunk, send the output (or keep the loss / m on the last stage)."""
        stage = self.stages[chunk]
        x, labels = self.micro_batches[micro]                                 # (mbs, T) each
        if not stage.is_first:
            x = self.p2p.recv_forward(micro, chunk)                           # (mbs, T, C)
        with self.grad_sync.forward(chunk):                                  # ZeRO-3: the chunk gathered
            out, aux = self._timed("F", micro, chunk, lambda: stage(x, labels if stage.is_last else None))
        if stage.is_last:
            out = (out + aux) / self.m                                        # 01 averages over micro-batches
            self.loss += out.detach()
        else:
            if torch.is_tensor(aux):   # a side loss (07's MoE): it trains through the backward of `out`
                out = pipeline.AttachSideLoss.apply(out, aux, 1.0 / self.m)
                self.loss += aux.detach() / self.m                            # this stage's share of the loss
            self.p2p.send_forward(out, micro, chunk)
        self.saved[micro, chunk] = (None if stage.is_first else x, out)
        self.peak_held = max(self.peak_held, self._held())

    def backward(self, micro: int, chunk: int = 0):
        """B (weights included): receive d out, backpropagate through the chunk, send d input."""
        stage = self.stages[chunk]
        x, out = self.saved.pop((micro, chunk))
        dout = None if stage.is_last else self.p2p.recv_backward(micro, chunk)   # (mbs, T, C)
        whole = self.weight_store is not None and self.weight_store.collecting is None   # B and W at once
        final = all([self._final(kind, chunk) for kind in ("B", "W")[:1 + whole]])     # count each kind
        with self.grad_sync.backward(chunk, final=final):                   # the last: DP may reduce
            self._timed("B", micro, chunk, lambda: torch.autograd.backward(out, dout))
        if x is not None:
            self.p2p.send_backward(x.grad, micro, chunk)

    def backward_input(self, micro: int, chunk: int = 0):
        """ZB's B: the same backward, every collective's backward included, but the linear layers'
        dW = dYᵀ·X are queued in the weight store (their X and dY are held until W)."""
        with self.weight_store.collect((micro, chunk)):
            self.backward(micro, chunk)

    def backward_weight(self, micro: int, chunk: int = 0):
        """ZB's W: the queued dW matmuls of (micro, chunk), added into .grad; no communication."""
        with self.grad_sync.backward(chunk, final=self._final("W", chunk)):
            self._timed("W", micro, chunk, lambda: self.weight_store.run((micro, chunk)))

    def finish(self):
        self.p2p.finish()
        deferred = self.weight_store.queues if self.weight_store else {}
        assert not self.saved and not deferred and not any(self.passes_left.values()), \
            f"unfinished: B of {sorted(self.saved)}, W of {sorted(deferred)}, passes {self.passes_left}"
        times = self.clock.seconds([t for *_, start, end in self._stamps for t in (start, end)])
        self.events = [Event(self.rank, op, micro, chunk, start, end) for (op, micro, chunk, *_), start, end
                       in zip(self._stamps, times[::2], times[1::2])]
        return self.loss


# ======================================================================================
# All forward, all backward (GPipe)
# ======================================================================================
def train_step_afab(pipe, micro_batches):
    pipe.begin(micro_batches)
    # === all forward: every micro-batch's activations stay until its backward ===
    for i in range(pipe.m):
        pipe.forward(i)
    # === all backward ===
    for i in range(pipe.m):
        pipe.backward(i)
    return pipe.finish()


# ======================================================================================
# One forward, one backward (PipeDream-Flush)
# ======================================================================================
def train_step_1f1b(pipe, micro_batches):
    pipe.begin(micro_batches)
    m = pipe.m
    # exercise 06.1: the 1F1B schedule
    # hint: warm-up: p − rank − 1 forwards (at most m); steady state: the forward of the next micro-batch,
    #   then the backward of the oldest one held, until every forward has run; cool-down: the backwards left.
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
    chunk = (k % (p * chunks)) // p
    return (k // (p * chunks)) * p + k % p, chunk if forward else chunks - 1 - chunk


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
    warmup = min(pipe.p - pipe.rank - 1, m)
    deferred = []

    def input_gradient_then_due_weights(i):
        pipe.backward_input(i)
        deferred.append(i)
        while len(deferred) > lag:
            pipe.backward_weight(deferred.pop(0))
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
