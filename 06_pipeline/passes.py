"""The passes a schedule orders: F, B and W of one micro-batch on one of this rank's chunks, timed.

Playbook §2.6. `Pipeline` holds this rank's chunks (stages) and, per step, the activations each micro-batch
keeps for its backward: `forward` receives the input from the previous block, runs the chunk and sends
the output (the last block keeps loss/m); `backward` receives d output, backpropagates and sends d input;
ZB's `backward_input` / `backward_weight` run the two halves of a backward (zero_bubble.py). A schedule
(schedules.py, v_schedules.py) is only the order of these calls. Each pass is stamped by a pass clock
(the host's on the CPU, CUDA events on a GPU), from which timeline.py draws what really ran.

    pipe = build_pipeline(stages, grid, args, (mbs, T, C), device, optimizer.scale)     # 06's train.py
    pipe.begin(micro_batches); pipe.forward(0); pipe.backward(0); loss = pipe.finish()
"""
import contextlib
import time
from dataclasses import dataclass

import torch

import build
import pipeline
import point_to_point
import schedules
import zero_bubble


@dataclass(frozen=True)
class Event:
    """One pass a rank really ran: op F, B (a split one: the input gradient) or W; start and end in host
    seconds (time.time(), comparable across the processes of one machine), by the pass clock."""
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
    """This rank's chunks and their passes on micro-batches; `peak_held` counts the micro-batches (per
    chunk) kept for a backward (or a ZB W) not yet run. split_backward (ZB-H1, ZB-V, DualPipeV): dW split
    off into `weight_store` (zero_bubble.py), run by `backward_input` and `backward_weight`.

    grad_sync (08): every pass runs inside `grad_sync.forward(chunk)` or `grad_sync.backward(chunk,
    final)`; `final` is True on the pass that completes the chunk's m-th of every kind it does (a whole
    backward counts as B and W), after which its gradients are complete for the step, whatever the
    schedule's order: data parallelism reduces them then (08's gradient_sync.py).
    scale_loss: what backward starts from, given a loss (01's MixedPrecisionOptimizer.scale: fp16's × S)."""

    def __init__(self, stages, p2p, clock=None, split_backward=False, grad_sync=None, scale_loss=None):
        self.stages, self.p2p, self.clock = stages, p2p, clock or HostClock()
        self.scale_loss = scale_loss or (lambda loss: loss)
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
            out = self.scale_loss(out)                                        # fp16: backward from S·loss
        else:
            if torch.is_tensor(aux):   # a side loss (07's MoE): it trains through the backward of `out`
                out = pipeline.AttachSideLoss.apply(out, self.scale_loss(aux), 1.0 / self.m)
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


def build_pipeline(stages, grid, args, shape, device, scale_loss, grad_sync=None) -> Pipeline:
    """This rank's Pipeline over `stages` under --pp-schedule: messages of `shape` in the dtype of the
    parameters, each direction in its own process group (collective: every rank creates every pipeline's),
    the pass clock of `device`, and ZB's split backward for the schedules whose W runs apart."""
    groups = point_to_point.direction_groups(grid, args.pp_chunks)                      # collective
    p2p = point_to_point.P2P(grid.pp_ranks, grid.pp_rank, groups, args.pp_chunks, shape,
                             build.param_dtype(args), device, v_shape=args.pp_schedule in pipeline.V_SHAPED)
    return Pipeline(stages, p2p, pass_clock(device), grad_sync=grad_sync, scale_loss=scale_loss,
                    split_backward=args.pp_schedule in schedules.SPLIT_BACKWARD)
