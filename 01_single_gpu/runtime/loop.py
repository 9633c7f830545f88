"""The loop every trainer runs around its own `train_step` (plumbing, not a technique).

`train` is the loop itself, at one level: for each step, its learning rate (optim.lr_at), this rank's
micro-batches of the step's global batch (sampling.GlobalBatchSampler), `train_step`, the log line
(metrics.StepLog, the eval loss every --eval-every steps), the checkpoint when due (checkpoint.py).
What watches over the steps is one call away, in `Supervision`: a NaN/inf loss or norm stops the run
or was skipped (--on-nonfinite, optim.SkipNonFinite, fp16's loss scaler); a SIGTERM/SIGUSR1 on any rank
saves that step on every rank and exits 75 (preemption.py: all ranks agree, one scalar); the watchdog
(watchdog.py); the profiler's schedule (--profile); the first step's measured activation memory.
After the last step, `report`: the profile's place, --plot's pictures, the final loss.

Each `NN_*/train.py` defines `train_step` and hands it here, so its step reads top to bottom in its own
file and nothing else differs between folders. `--resume` first restores the checkpoint `cli.parse_args`
chose and checked (the newest usable one of the same run and layout). Evaluation reads the held-out
windows through the same sampler and the trainer's `eval_step` (forward only, the global batch's mean
loss), so every layout evaluates the same batches and logs the same eval loss.
"""
import contextlib
import math

import torch
import torch.distributed as dist

import build
import checkpoint
import memory
import metrics
import mixed_precision
import optim
import plots
import preemption
import rank0
import sampling
import watchdog


def train(args, train_step, model, optimizer, dataset, flops_per_token: int, grid=None, layout=None,
          eval_step=None):
    """Run --steps optimizer steps of `train_step(micro_batches) -> (global loss, grad norm)`.

    `model` is what this rank checkpoints (its shards, its stages), `grid` (02's ProcessGrid, None on one
    device) says which rows of each global batch this rank reads (its dp coordinate) and who logs, and
    `layout` (the parallel degrees) is saved with checkpoints and checked on --resume. `flops_per_token`
    is the model's (MFU). `eval_step(micro_batches) -> global mean loss`: forward only (--eval-every).
    """
    run = Run(args, model, optimizer, dataset, grid, layout or {}, eval_step)
    start = resume(run)                                       # --resume: the checkpoint's step, else 0
    log = step_log(run, start, flops_per_token)
    with Supervision(run, start, log) as watch:    # stop signals, watchdog, profiler, NaN guard, meter
        for step in range(start, args.steps):
            log.start_step()                                  # tokens/s counts the batches' loading too
            lr = optim.lr_at(step, args)                      # linear warm-up, then cosine decay
            optim.set_lr(optimizer, lr)
            micro_batches = run.batches(run.sampler, step)    # grad_acc × (x, y), (mbs, T) each
            with watch.measuring(step):                       # the first step: activation memory
                loss, grad_norm = train_step(micro_batches)
            log.end_step(step, loss, lr, grad_norm, watch.skipped(), getattr(optimizer, "log_fields", dict)(),
                         run.evaluate if run.eval_due(step) else None)
            watch.after_step(step, loss, grad_norm)          # NaN/inf: the run stops, or the step was skipped
            stopped_by = watch.stop_agreed(step)             # SIGTERM/SIGUSR1 on any rank, agreed by all
            if stopped_by == preemption.LOG_FAILED:
                break                   # the step is not saved: --resume runs it, and logs it, again
            save_if_due(run, step, stopped_by)               # every --checkpoint-every, the last, a stop
            watch.step_ended(step)                           # the watchdog's beat, the profiler's clock
            if stopped_by:
                break
    log.close()
    watch.leave(run)                                         # exit 75 after a stop, 1 if the log failed
    report(run, log, start, watch.profiler, watch.activation_peak)
    return log.records


class Run:
    """What the phases of `train` share: the flags, the model and optimizer, this rank's place in the grid,
    its training and held-out batches, and the schedule's length (--lr-decay-steps, default --steps)."""

    def __init__(self, args, model, optimizer, dataset, grid, layout: dict, eval_step):
        self.args, self.model, self.optimizer, self.layout = args, model, optimizer, layout
        self.eval_step, self.device = eval_step, build.device_of(args)
        self.rank, self.world_size = (grid.rank, grid.world_size) if grid else (0, 1)
        self.dp_rank, dp_size = (grid.dp_rank, grid.dp_size) if grid else (0, 1)
        self.is_logging_rank, self.several = self.rank == 0, self.world_size > 1
        global_batch = args.mbs * args.grad_acc * dp_size
        dataset, held_out = sampling.split_held_out(dataset, args.eval_batches * global_batch)
        self.sampler = sampling.GlobalBatchSampler(dataset, args.seed, args.mbs, args.grad_acc, dp_size)
        self.eval_sampler = sampling.GlobalBatchSampler(held_out, args.seed, args.mbs, args.grad_acc, dp_size)
        self.lr_decay_steps = args.lr_decay_steps or args.steps     # optim.lr_at's; checkpoints record it

    def batches(self, of, step: int) -> list:
        """This rank's grad_acc × (x, y), (mbs, T) each, of global batch `step` of the sampler `of`."""
        return [tuple(t.to(self.device) for t in of.micro_batch(step, m, self.dp_rank))
                for m in range(self.args.grad_acc)]

    def eval_due(self, step: int) -> bool:
        """--eval-every N: after every N-th step and after the last."""
        every = self.args.eval_every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == self.args.steps)

    def evaluate(self) -> float:
        """The mean loss over the held-out global batches, the same in every layout."""
        count = self.args.eval_batches
        return sum(self.eval_step(self.batches(self.eval_sampler, k)) for k in range(count)) / count


def resume(run: Run) -> int:
    """--resume: the checkpoint `cli.parse_args` chose, into the model and optimizer; returns its step
    (else 0). It is the same run: same data, batch and schedule (the length of a fresh one is --steps)."""
    if not run.args.resume:
        return 0
    start = checkpoint.load_checkpoint(run.args.checkpoint_dir, run.model, run.optimizer, run.layout,
                                       run.args.resume_step)
    if hasattr(run.optimizer, "copy_masters_to_weights"):   # the checkpoint filled the fp32 masters
        run.optimizer.copy_masters_to_weights()
    if run.is_logging_rank:
        print(f"resumed from {run.args.checkpoint_dir}/step_{start:06d}: step {start} done, training steps "
              f"{start + 1}-{run.args.steps}", flush=True)
    return start


def step_log(run: Run, start: int, flops_per_token: int):
    """The per-step log (metrics.StepLog), with the tokens and FLOPs of one step for tok/s, MFU and HFU."""
    args = run.args
    tokens_per_step = run.sampler.global_batch * args.seq_len
    config = next(m.config for m in run.model.modules() if hasattr(m, "config"))    # a pipeline stage's too
    hardware_flops_per_token = metrics.hardware_flops_per_token(flops_per_token, config, args.seq_len,
                                                                args.recompute)   # + what recompute reruns
    return metrics.StepLog(args, start, tokens_per_step, flops_per_token * tokens_per_step, run.world_size,
                           run.device, run.is_logging_rank, hardware_flops_per_token * tokens_per_step)


class Supervision:
    """What watches the steps, one call away from `train`: the stop request (preemption.py: a signal on
    any rank stops every rank after the same step), the watchdog (several ranks: a step that never ends),
    --profile's schedule, --on-nonfinite skip's guard, and the first step's activation meter."""

    def __init__(self, run: Run, start: int, log):
        self.run, self.start, self.log = run, start, log
        skip = run.args.on_nonfinite == "skip"
        self.guard = optim.SkipNonFinite(run.optimizer, run.device) if skip else None
        self.profiler = metrics.profiler(run.args.profile, run.device, run.rank)
        self.stopped_by, self.step, self.activation_peak = 0, start, 0
        self.contexts = contextlib.ExitStack()

    def __enter__(self):
        run = self.run
        self.stop = self.contexts.enter_context(preemption.StopRequest(run.device, run.several))
        if self.profiler:
            self.contexts.enter_context(self.profiler)
        self.dog = self.contexts.enter_context(watchdog.Watchdog(run.args.timeout_s, run.rank,
                                                                 self.stop.hang_up)) if run.several else None
        return self

    def __exit__(self, *exc):
        if self.guard:
            self.guard.remove()
        return self.contexts.__exit__(*exc)

    @contextlib.contextmanager
    def measuring(self, step: int):
        """The run's first step follows what autograd saves for backward: its peak is the measured
        activation memory (the setup table shows Korthikanti's estimate)."""
        if step != self.start:
            yield
            return
        params = [p for p in self.run.model.parameters() if p.requires_grad]
        with memory.saved_activation_bytes(exclude=params) as meter:
            yield
        self.activation_peak = meter.peak

    def skipped(self) -> bool:
        """The step changed nothing: --on-nonfinite skip's guard, or an fp16 overflow (mixed_precision.py)."""
        return (self.guard is not None and self.guard.skipped) or self.scaler_skipped()

    def scaler_skipped(self) -> bool:
        return getattr(self.run.optimizer, "skipped", False)

    def after_step(self, step: int, loss: float, grad_norm):
        """After the step's log line: a NaN/inf loss or norm that was not skipped stops the run; a skipped
        step says so, and the first step its measured activation memory."""
        if not (self.skipped() or finite(loss, grad_norm)):
            self.log.close()
            stop_nonfinite(step, loss, grad_norm, self.guard is not None)
        if self.skipped():
            why = "fp16 overflow: the loss scale halves" if self.scaler_skipped() else "--on-nonfinite skip"
            self.log.write(f"step {step + 1}: loss {loss}, gradient norm {float(grad_norm)}: skipped "
                           f"({why}; parameters and optimizer state unchanged)")
        if step == self.start:
            self.log.write(f"activations saved for backward in step {step + 1}, measured on this rank: "
                           f"peak {self.activation_peak / 2**20:.2f} MiB (the memory table's line is the "
                           f"estimate)")

    def stop_agreed(self, step: int) -> int:
        """The signal every rank agrees stopped the run after `step` (a collective), else 0; the last step
        ends the run anyway. preemption.LOG_FAILED: the logging rank could not write its log."""
        self.step = step + 1
        stopped_by = self.stop.agreed(self.log.failure is not None)
        if stopped_by != preemption.LOG_FAILED and step + 1 == self.run.args.steps:
            stopped_by = 0
        self.stopped_by = stopped_by
        return stopped_by

    def step_ended(self, step: int):
        if self.dog:
            self.dog.beat(f"step {step + 1} ended")
        if self.profiler:
            self.profiler.step()        # the schedule's clock: wait 1, warm up 1, record 3 (metrics.profiler)

    def leave(self, run: Run):
        """After a stop: exit 1 where the log failed (its line), else the stop's save is done: exit 75."""
        if self.stopped_by == preemption.LOG_FAILED:      # the logging rank's line; the others end quietly
            rank0.fail(self.log.failure or "", status=1)
        if self.stopped_by:
            preemption.leave(self.stopped_by, self.step, run.args.checkpoint_dir, run.is_logging_rank)


def save_if_due(run: Run, step: int, stopped_by: int):
    """The checkpoint of step+1 (--checkpoint-dir): every --checkpoint-every, at the last step, at a stop."""
    args = run.args
    every = args.checkpoint_every and (step + 1) % args.checkpoint_every == 0
    if not (args.checkpoint_dir and (stopped_by or step + 1 == args.steps or every)):
        return
    flags = {**vars(args), "lr_decay_steps": run.lr_decay_steps}    # --resume keeps the schedule's length
    meta = {"layout": run.layout, "global_batch": run.sampler.global_batch, "args": flags}
    try:
        checkpoint.save_checkpoint(args.checkpoint_dir, step + 1, run.model, run.optimizer, meta,
                                   args.keep_last, args.overwrite)
    except checkpoint.SaveFailed as problem:
        stop = stopped_by and f"{preemption.name(stopped_by)} received, stopped after step {step + 1}: "
        rank0.fail(f"{stop or ''}--checkpoint-dir {args.checkpoint_dir}: saving step {step + 1} failed "
                   f"({problem}): free space there or pass another --checkpoint-dir; the checkpoints saved "
                   f"before it are intact (--resume continues from the last one)", status=1)


def report(run: Run, log, start: int, profiler, activation_peak: int):
    """After the last step: where the profile went, the plots of --plot, the final loss."""
    args = run.args
    if profiler and run.is_logging_rank:
        last = min(args.steps, start + 2 + metrics.PROFILE_ACTIVE)
        print(f"profile: a trace of steps {start + 3}-{last} in {args.profile} (open it in ui.perfetto.dev "
              f"or TensorBoard)")
    if args.plot and start < args.steps:
        mine = memory.measured_state(run.model, run.optimizer, activation_peak)          # this rank's bytes
        everyone = gather_to_all(mine, run.world_size) if run.several else [mine]
        if run.is_logging_rank:
            print(f"plots: {plots.loss_curve(log.records, args.plot)}, "
                  f"{plots.memory_bars(everyone, args.plot)}")
    if log.records and run.is_logging_rank:
        print(f"final loss {log.records[-1]['loss']:.4f} after {log.records[-1]['step']} steps")


def mean_loss(model, micro_batches, args, positions=None) -> torch.Tensor:
    """Forward only: this rank's mean loss over its micro-batches (the local part of every eval_step).
    `positions` (T/cp,): context parallelism's tokens of each sequence (05)."""
    with torch.no_grad(), mixed_precision.autocast(args, micro_batches[0][0].device):
        if positions is None:
            return sum(model(x, labels=y) for x, y in micro_batches) / len(micro_batches)
        return sum(model(x[:, positions], labels=y[:, positions], position_ids=positions)   # (mbs, T/cp)
                   for x, y in micro_batches) / len(micro_batches)


def gather_to_all(mine, world_size: int) -> list:
    """Every rank's `mine`, in rank order, on every rank."""
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def finite(loss: float, grad_norm) -> bool:
    return math.isfinite(loss) and math.isfinite(float(grad_norm))


def stop_nonfinite(step: int, loss: float, grad_norm, skipping: bool):
    """End the run (exit status 1) after a step with a NaN or inf loss or gradient norm that was not skipped.
    Every rank sees the same global loss and norm, so all stop together, before the step's checkpoint."""
    why = ("its gradients were finite (the norm overflowed), so the step could not be skipped" if skipping
           else "--on-nonfinite stop")
    rank0.fail(f"step {step + 1}: the loss is {loss}, the gradient norm {float(grad_norm)}: stopping "
               f"({why}). Lower --lr, check the data, resume from the last checkpoint, or pass "
               f"--on-nonfinite skip", status=1)
