"""Preemptible runs: SIGTERM, SIGUSR1, SIGHUP or Ctrl-C ends training after the step, with a checkpoint.

A cluster stops a job with a signal: Slurm sends SIGTERM at the time limit, on preemption and on
`scancel` (SIGKILL follows after KillWait or GraceTime), and `--signal=USR1@N` warns N seconds before the
limit; torchrun forwards a SIGTERM, SIGINT or SIGHUP it receives to its workers and kills those left 30 s
later. A worker whose launcher died (SIGKILL) gets SIGHUP from the kernel (watchdog.exit_with_parent).
Megatron-LM's --exit-signal-handler is the model: save, then leave. A second Ctrl-C ends the process at once.

    torchrun --nproc_per_node 2 02_data_parallel/train.py --dp 2 --checkpoint-dir ck --resume auto
    kill -TERM <torchrun's pid>          # then the same command again: it continues from ck's newest step

    signal handler:   signalled = signum               nothing else: it may land inside a collective
    every step:       stop = all_reduce(signalled, MAX)     one scalar, the trainer's device and backend
    stop:             save the step (--checkpoint-dir), one line, exit status EXIT_PREEMPTED

Every rank leaves after the same step, so none waits in a collective the others have left. The same
command with `--resume auto` then continues from that checkpoint (or starts, where none was saved yet).
Exit status 75 is sysexits.h's EX_TEMPFAIL, "try again later": not 0 (the run is not finished), not 1 (a
failure) nor 2 (bad flags), so a launcher can tell a stopped run from a broken one and requeue it; after
Ctrl-C, 130 (128 + SIGINT, as a shell reports an interrupted command: not to be requeued).
"""
import signal
import sys
import threading

import torch
import torch.distributed as dist

import watchdog

EXIT_PREEMPTED, EXIT_INTERRUPTED = 75, 130
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
MEANINGS = {signal.SIGHUP: "SIGHUP (the launcher or the terminal is gone)", signal.SIGINT: "SIGINT (Ctrl-C)"}
# Not a signal (above them all): the logging rank's --json-log failed (metrics.StepLog), so every rank stops
# after the step, without saving it
LOG_FAILED = 256


class StopRequest:
    """`with StopRequest(device, several) as stop:` ... `if stop.agreed(): save and leave` after every step.

    Installs the handlers for SIGNALS while training runs (the previous ones come back after). `several`: a
    world of more than one rank, where the decision is a collective. `hang_up()`: the launcher is gone."""

    def __init__(self, device, several: bool):
        self.device, self.several = device, several
        self.signum, self.previous = 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():   # Python runs handlers there only
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
                # A system call the signal interrupts restarts instead of failing (gloo's socket reads).
                signal.siginterrupt(sig, False)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.signum = signum
        if signum == signal.SIGINT:         # a second Ctrl-C: the kernel's default, the process ends at once
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def hang_up(self):
        """The watchdog saw the launcher gone: a SIGHUP, as Linux's kernel sends it (exit_with_parent)."""
        self.signum = self.signum or signal.SIGHUP

    def agreed(self, log_failed: bool = False) -> int:
        """Collective (every rank, at the same step boundary): LOG_FAILED if the log failed on any rank, else
        the signal any rank received, or 0."""
        mine = LOG_FAILED if log_failed else self.signum
        if not self.several:
            return mine
        flag = torch.tensor([float(mine)], device=self.device)   # (1,)
        # torch's function itself, not `dist.all_reduce`, which 02's CommMeter replaces while a trainer runs:
        # its tables are the technique's traffic per step, and these 4 bytes are plumbing (as evaluation is).
        dist.distributed_c10d.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def name(signum: int) -> str:
    return MEANINGS.get(signum, signal.Signals(signum).name)


def leave(signum: int, step: int, checkpoint_dir, is_logging_rank: bool):
    """One line (rank 0; also into torchrun's error file), then exit EXIT_PREEMPTED on every rank (after
    Ctrl-C: EXIT_INTERRUPTED)."""
    status = EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED
    if checkpoint_dir:
        saved = (f"saved {checkpoint_dir}/step_{step:06d}; the same command with --resume auto continues "
                 f"from it")
    else:
        saved = "nothing saved (no --checkpoint-dir): the same command starts again from step 1"
    line = f"{name(signum)} received: stopped after step {step}, {saved} (exit status {status})"
    if is_logging_rank:
        print(line, file=sys.stderr, flush=True)
        watchdog.record_for_torchrun(line)
    sys.exit(status)
