"""What a job says once: every rank of a torchrun job finds the same mistake, rank 0 prints it.

Before any process group exists the ranks cannot agree on who speaks, so each reads RANK from the
environment torchrun sets (a plain `python train.py` is rank 0).
"""
import os
import sys
import time

import watchdog


def fail(line: str, status: int = 2):
    """Exit with `line`, printed once: by rank 0 of a torchrun job (every rank finds the same mistake).

    torchrun still prints its summary of the failed workers; rank 0 also writes the line into the error
    file torchrun gives each worker (TORCHELASTIC_ERROR_FILE), so that summary names it as the root cause.
    Under torchrun the other ranks wait (at most 10 s) before exiting: the first worker to fail makes
    torchrun stop the rest, and a silent rank leaving first could stop rank 0 before it printed the line.
    """
    line = " ".join(line.splitlines())
    print0(line, file=sys.stderr)
    if int(os.environ.get("RANK", 0)) == 0:
        watchdog.record_for_torchrun(line)
    elif os.environ.get("TORCHELASTIC_ERROR_FILE"):
        time.sleep(10)
    sys.exit(status)


def print0(*args, **kwargs):
    """print on rank 0 only (every rank of a job checks the same flags: one says what they found)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)
