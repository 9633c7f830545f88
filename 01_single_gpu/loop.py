"""The loop every trainer runs around its own `train_step` (plumbing, not a technique).

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
from importlib import import_module

import torch
import torch.distributed as dist

build = import_module("01_single_gpu.build")
checkpoint = import_module("01_single_gpu.checkpoint")
cli = import_module("01_single_gpu.cli")
data = import_module("01_single_gpu.data")
sampling = import_module("01_single_gpu.sampling")
memory = import_module("01_single_gpu.memory")
metrics = import_module("01_single_gpu.metrics")
optim = import_module("01_single_gpu.optim")
plots = import_module("01_single_gpu.plots")
preemption = import_module("01_single_gpu.preemption")
watchdog = import_module("01_single_gpu.watchdog")


def train(args, train_step, model, optimizer, dataset, flops_per_token: int, grid=None, layout=None,
          eval_step=None):
    """Run --steps optimizer steps of `train_step(micro_batches) -> (global loss, grad norm)`.

    `model` is what this rank checkpoints (its shards, its stages), `grid` (02's ProcessGrid, None on one
    device) says which rows of each global batch this rank reads (its dp coordinate) and who logs, and
    `layout` (the parallel degrees) is saved with checkpoints and checked on --resume. `flops_per_token`
    is the model's (MFU); --recompute's extra forward is added here (HFU).
    `eval_step(micro_batches) -> global mean loss` runs forward only (--eval-every). Returns the records.
    """
    device = build.device_of(args)
    dp_rank, dp_size = (grid.dp_rank, grid.dp_size) if grid else (0, 1)
    is_logging_rank = grid is None or grid.rank == 0
    layout = layout or {}
    global_batch = args.mbs * args.grad_acc * dp_size
    dataset, held_out = sampling.split_held_out(dataset, args.eval_batches * global_batch)
    sampler = sampling.GlobalBatchSampler(dataset, args.seed, args.mbs, args.grad_acc, dp_size)
    eval_sampler = sampling.GlobalBatchSampler(held_out, args.seed, args.mbs, args.grad_acc, dp_size)

    def batches(of, step):   # this rank's grad_acc × (x, y), (mbs, T) each, of global batch `step`
        return [tuple(t.to(device) for t in of.micro_batch(step, m, dp_rank)) for m in range(args.grad_acc)]

    def evaluate():          # the mean over the held-out global batches, the same in every layout
        return sum(eval_step(batches(eval_sampler, k)) for k in range(args.eval_batches)) / args.eval_batches
    start = 0
    if args.resume:   # the same run: same data, batch and schedule (the length of a fresh one is --steps)
        start = checkpoint.load_checkpoint(args.checkpoint_dir, model, optimizer, layout, args.resume_step)
        if hasattr(optimizer, "copy_masters_to_weights"):   # the checkpoint filled the fp32 masters
            optimizer.copy_masters_to_weights()
    args.lr_decay_steps = args.lr_decay_steps or args.steps
    tokens_per_step = sampler.global_batch * args.seq_len
    config = next(m.config for m in model.modules() if hasattr(m, "config"))    # a pipeline stage's too
    hardware_flops_per_token = metrics.hardware_flops_per_token(flops_per_token, config, args.seq_len,
                                                                args.recompute)   # + what recompute reruns
    log = metrics.StepLog(args, start, tokens_per_step, flops_per_token * tokens_per_step,
                          grid.world_size if grid else 1, device, is_logging_rank,
                          hardware_flops_per_token * tokens_per_step)
    params = [p for p in model.parameters() if p.requires_grad]
    guard = optim.SkipNonFinite(optimizer, device) if args.on_nonfinite == "skip" else None
    several = grid is not None and grid.world_size > 1
    activation_peak = 0
    profiler = metrics.profiler(args.profile, device, grid.rank if grid else 0)
    stopped_by = 0                       # the signal that stopped the run before --steps (preemption.py)
    with watchdog.Watchdog(args.timeout_s, grid.rank) if several else contextlib.nullcontext() as dog, \
            profiler or contextlib.nullcontext(), preemption.StopRequest(device, several) as stop:
        for step in range(start, args.steps):
            log.start_step()
            lr = optim.lr_at(step, args)
            optim.set_lr(optimizer, lr)
            micro_batches = batches(sampler, step)                   # grad_acc × (x, y), (mbs, T) each
            # The run's first step follows what autograd saves for backward: its peak is the measured
            # activation memory (the setup table shows Korthikanti's estimate).
            meter = memory.saved_activation_bytes(exclude=params) if step == start else None
            with meter or contextlib.nullcontext():
                loss, grad_norm = train_step(micro_batches)
            scaler_skipped = getattr(optimizer, "skipped", False)      # an fp16 overflow (mixed_precision.py)
            skipped = (guard is not None and guard.skipped) or scaler_skipped
            due = args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps)
            log.end_step(step, loss, lr, grad_norm, skipped, getattr(optimizer, "log_fields", dict)(),
                         evaluate if due else None)
            if not (skipped or finite(loss, grad_norm)):
                log.close()
                stop_nonfinite(step, loss, grad_norm, guard is not None)
            if skipped:
                why = "fp16 overflow: the loss scale halves" if scaler_skipped else "--on-nonfinite skip"
                log.write(f"step {step + 1}: loss {loss}, gradient norm {float(grad_norm)}: skipped "
                          f"({why}; parameters and optimizer state unchanged)")
            if meter:
                activation_peak = meter.peak
                log.write(f"activations saved for backward in step {step + 1}, measured on this rank: peak "
                          f"{meter.peak / 2**20:.2f} MiB (the memory table's line is the estimate)")
            stopped_by = stop.agreed() if step + 1 < args.steps else 0    # a collective at every step's end
            if args.checkpoint_dir and (stopped_by or step + 1 == args.steps or
                                        (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)):
                checkpoint.save_checkpoint(args.checkpoint_dir, step + 1, model, optimizer,
                                           {"layout": layout, "global_batch": sampler.global_batch,
                                            "args": vars(args)}, args.keep_last, args.overwrite)
            if dog:
                dog.beat(f"step {step + 1} ended")
            if profiler:
                profiler.step()         # the schedule's clock: wait 1, warm up 1, record 3 (metrics.profiler)
            if stopped_by:
                break
    if guard:
        guard.remove()
    log.close()
    if stopped_by:
        preemption.leave(stopped_by, step + 1, args.checkpoint_dir, is_logging_rank)
    if profiler and is_logging_rank:
        print(f"profile: a trace of steps {start + 3}-{min(args.steps, start + 2 + metrics.PROFILE_ACTIVE)} in "
              f"{args.profile} (open it in ui.perfetto.dev or TensorBoard)")
    if args.plot and start < args.steps:
        mine = memory.measured_state(model, optimizer, activation_peak)          # this rank's bytes
        everyone = gather_to_all(mine, grid.world_size) if several else [mine]
        if is_logging_rank:
            print(f"plots: {plots.loss_curve(log.records, args.plot)}, "
                  f"{plots.memory_bars(everyone, args.plot)}")
    if log.records and is_logging_rank:
        print(f"final loss {log.records[-1]['loss']:.4f} after {log.records[-1]['step']} steps")
    return log.records


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
    cli.fail(f"step {step + 1}: the loss is {loss}, the gradient norm {float(grad_norm)}: stopping ({why}). Lower "
             f"--lr, check the data, resume from the last checkpoint, or pass --on-nonfinite skip", status=1)
