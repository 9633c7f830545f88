"""No rank waits forever, and none outlives its launcher (plumbing for runs of several ranks).

A rank whose peer stops without dying (SIGSTOP, a deadlock, a hung file system) waits in its next
collective. In the training loop `Watchdog` ends it: a thread that ends the process (exit status 1, one
line naming the rank and its last step) when no step has finished for --timeout-s seconds, wherever the
rank is stuck. Outside the loop (setup, the last save) the process group's timeout ends a collective
that waited `group_timeout_s` with an error: a margin later, so in the loop the watchdog's line is
always what the user reads, never a race with gloo's traceback. The stalled rank itself cannot act:
torchrun's agent kills it once its peers have exited.

A worker whose torchrun agent is killed would otherwise train on as an orphan: `exit_with_parent` asks
the Linux kernel to send it SIGHUP when its parent dies (prctl PR_SET_PDEATHSIG), which the loop takes as a
stop (preemption.py: the step is saved, then every rank leaves), and which ends it outside the loop. The
watchdog's thread also checks the parent's pid while the loop runs, on every system, and asks for the stop.
"""
import ctypes
import json
import os
import signal
import sys
import threading
import time

# a few minutes: far longer than any step of the presets, far shorter than a lost night
DEFAULT_TIMEOUT_S = 300.0
PR_SET_PDEATHSIG = 1        # <linux/prctl.h>


def group_timeout_s(timeout_s: float) -> float:
    """The process group's timeout for --timeout-s: 10% + 5 s more. A collective begins after the last
    beat, and the watchdog checks once a second (poll_s), so it speaks up to ~1 s after --timeout-s."""
    return timeout_s * 1.1 + 5.0


def record_for_torchrun(line: str):
    """Under torchrun, write `line` into this worker's error file (TORCHELASTIC_ERROR_FILE, in the format of
    torch.distributed.elastic's @record): torchrun's summary of failed workers then shows it as the cause."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)


def exit_with_parent(sig: int = signal.SIGHUP):
    """Linux: the kernel sends `sig` to this process when its parent (the launcher) exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


class Watchdog:
    """`with Watchdog(timeout_s, rank, orphaned) as dog:` ... `dog.beat("step 12")` after every step.

    Ends the process with `exit(1)` after one line on stderr if `timeout_s` pass without a beat; calls
    `orphaned()` once if the parent process is gone (the loop then stops after the step, and saves it).
    `exit` is os._exit: the main thread may be blocked inside C code (a collective), where no exception can
    reach it.
    """

    def __init__(self, timeout_s: float, rank: int, orphaned=lambda: None, exit=os._exit,
                 poll_s: float | None = None):
        self.timeout_s, self.rank, self.orphaned, self.exit = timeout_s, rank, orphaned, exit
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self.parent = os.getppid()
        self.last, self.where = time.monotonic(), "the first step began"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def __enter__(self):
        self.beat("the first step began")
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join()

    def beat(self, where: str):
        self.last, self.where = time.monotonic(), where

    def _watch(self):
        while not self.stopped.wait(self.poll_s):
            if os.getppid() != self.parent:
                self.parent = os.getppid()      # the new parent (init): asked once
                self.orphaned()
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                return self._end(f"rank {self.rank}: no progress for {idle:.0f} s since {self.where} "
                                 f"(--timeout-s {self.timeout_s:g}): a peer stalled, died or deadlocked; "
                                 f"exiting")

    def _end(self, line: str):
        print(line, file=sys.stderr, flush=True)
        record_for_torchrun(line)
        self.exit(1)
