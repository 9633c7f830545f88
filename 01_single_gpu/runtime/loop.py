"""The loop every trainer runs around its own `train_step` (plumbing, not a technique).

`train` calls its phases in order: `Run` (this rank's place and batches), `resume`, `step_log`, `run_steps`
(each step: `one_step`, then `save_if_due`), `report`. What they do:

    for step in range(start, --steps):
        set the learning rate                                   optim.lr_at
        this rank's micro-batches of the step's global batch    sampling.GlobalBatchSampler
        loss, grad_norm = train_step(micro_batches)             the folder's step: what the devices run
        a NaN/inf loss or norm stops the run (or was skipped)   --on-nonfinite, optim.SkipNonFinite,
                                                                fp16's loss scaler (mixed_precision.py)
        every --eval-every steps, eval_step(held-out batches)    sampling.split_held_out, the trainer's step
        log the step; checkpoint every --checkpoint-every       metrics.StepLog, checkpoint.py
        --profile DIR: the profiler's schedule advances         metrics.profiler
        a SIGTERM/SIGUSR1 on any rank: save this step, exit 75  preemption.py (all ranks agree, one scalar)
    --plot: the loss curve and every rank's measured memory     plots.py

Each `NN_*/train.py` defines `train_step` and hands it here, so its step reads top to bottom in its own
file and nothing else differs between folders. `--resume` first restores the checkpoint `cli.parse_args`
chose and checked (the newest usable one of the same run and layout). The first step of a run is
measured: the peak of what autograd saved for backward is the rank's activation memory
(memory.saved_activation_bytes). With several ranks a watchdog ends a rank whose step has not finished
for --timeout-s seconds (a stalled peer: watchdog.py). Evaluation reads the held-out windows through the
same sampler and the trainer's `eval_step` (forward only, the global batch's mean loss), so every layout
evaluates the same batches and logs the same eval loss.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import build
import checkpoint
import memory
import metrics
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
    is the model's (MFU); --recompute's extra forward is added here (HFU).
    `eval_step(micro_batches) -> global mean loss` runs forward only (--eval-every). Returns the records.
    """
    run = Run(args, model, optimizer, dataset, grid, layout or {}, eval_step)
    start = resume(run)
    log = step_log(run, start, flops_per_token)
    guard = optim.SkipNonFinite(optimizer, run.device) if args.on_nonfinite == "skip" else None
    profiler = metrics.profiler(args.profile, run.device, run.rank)
    ended = run_steps(run, train_step, start, log, guard, profiler)
    if guard:
        guard.remove()
    log.close()
    if ended.stopped_by == preemption.LOG_FAILED:      # the logging rank's line; the others end quietly
        rank0.fail(log.failure or "", status=1)
    if ended.stopped_by:
        preemption.leave(ended.stopped_by, ended.step, args.checkpoint_dir, run.is_logging_rank)
    report(run, log, start, profiler, ended.activation_peak)
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

    def evaluate(self) -> float:
        """The mean loss over the held-out global batches, the same in every layout."""
        count = self.args.eval_batches
        return sum(self.eval_step(self.batches(self.eval_sampler, k)) for k in range(count)) / count


@dataclass
class Ended:
    step: int                 # the optimizer steps done
    stopped_by: int           # the signal that stopped the run before --steps, else 0 (preemption.py)
    activation_peak: int      # bytes autograd saved for backward in the run's first step (0: no step ran)


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


def run_steps(run: Run, train_step, start: int, log, guard, profiler) -> Ended:
    """Steps start..--steps under the watchdog (several ranks), the profiler and the stop request: each
    trains and logs (`one_step`), checkpoints when due, and the run ends early on an agreed signal."""
    args, stopped_by, activation_peak, step = run.args, 0, 0, start - 1
    params = [p for p in run.model.parameters() if p.requires_grad]
    with preemption.StopRequest(run.device, run.several) as stop, profiler or contextlib.nullcontext(), \
            watchdog.Watchdog(args.timeout_s, run.rank, stop.hang_up) if run.several else \
            contextlib.nullcontext() as dog:
        for step in range(start, args.steps):
            # The run's first step follows what autograd saves for backward: its peak is the measured
            # activation memory (the setup table shows Korthikanti's estimate).
            meter = memory.saved_activation_bytes(exclude=params) if step == start else None
            one_step(run, train_step, step, log, guard, meter)
            activation_peak = meter.peak if meter else activation_peak
            stopped_by = stop.agreed(log.failure is not None)            # a collective at every step's end
            if stopped_by == preemption.LOG_FAILED:
                break                   # the step is not saved: --resume runs it, and logs it, again
            stopped_by = stopped_by if step + 1 < args.steps else 0     # the last step ends the run anyway
            save_if_due(run, step, stopped_by)
            if dog:
                dog.beat(f"step {step + 1} ended")
            if profiler:
                profiler.step()         # the schedule's clock: wait 1, warm up 1, record 3 (metrics.profiler)
            if stopped_by:
                break
    return Ended(step + 1, stopped_by, activation_peak)


def one_step(run: Run, train_step, step: int, log, guard, meter):
    """Step `step`: its learning rate and batches, `train_step` (under `meter`, if any), the log line (and
    the eval loss when due), then a non-finite loss or norm stops the run or is reported as skipped."""
    args, optimizer = run.args, run.optimizer
    log.start_step()
    lr = optim.lr_at(step, args)
    optim.set_lr(optimizer, lr)
    micro_batches = run.batches(run.sampler, step)                   # grad_acc × (x, y), (mbs, T) each
    with meter or contextlib.nullcontext():
        loss, grad_norm = train_step(micro_batches)
    scaler_skipped = getattr(optimizer, "skipped", False)      # an fp16 overflow (mixed_precision.py)
    skipped = (guard is not None and guard.skipped) or scaler_skipped
    due = args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps)
    log.end_step(step, loss, lr, grad_norm, skipped, getattr(optimizer, "log_fields", dict)(),
                 run.evaluate if due else None)
    if not (skipped or finite(loss, grad_norm)):
        log.close()
        stop_nonfinite(step, loss, grad_norm, guard is not None)
    if skipped:
        why = "fp16 overflow: the loss scale halves" if scaler_skipped else "--on-nonfinite skip"
        log.write(f"step {step + 1}: loss {loss}, gradient norm {float(grad_norm)}: skipped "
                  f"({why}; parameters and optimizer state unchanged)")
    if meter:
        log.write(f"activations saved for backward in step {step + 1}, measured on this rank: peak "
                  f"{meter.peak / 2**20:.2f} MiB (the memory table's line is the estimate)")


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
    with torch.no_grad(), build.autocast(args, micro_batches[0][0].device):
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
