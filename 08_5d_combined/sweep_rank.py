"""One rank of a sweep's row (sweep.py): the trainer as torchrun runs it, watched from inside the rank.

It runs the trainer (08's train.py) as `__main__` with the flags it was given, and writes DIR/rank<r>.json
with what the trainer's --json-log does not hold per rank:

    peak memory     the GPU allocator's peak (max_memory_allocated), or on the CPU the process's peak
                    resident memory (VmHWM: the interpreter and torch's libraries included)
    communication   seconds per step this rank spent blocked in communication: 02's CommMeter wraps every
                    collective and point-to-point call, and this clock times each call and each wait on an
                    asynchronous one (CUDA events on the current stream on a GPU: an NCCL call counts while
                    it holds the compute stream back). That is the exposed communication plus the time spent
                    waiting for a slower peer (a pipeline's bubble). A step is the time between two optimizer
                    steps (torch.optim's global step hook); the first holds the setup
    outcome         the exit status, and the line of the exception that ended the rank; written when it
                    starts (its pid) and again when it ends, even when the trainer raises

--probe-memory-gb G caps the rank's private writable memory (RLIMIT_DATA: the heap and anonymous maps)
at G GB, a CPU stand-in for a device's memory: a layout that needs more fails in its allocator, as on a GPU.

    torchrun --nproc_per_node 4 08_5d_combined/sweep_rank.py --probe-out row/ --dp 4 --steps 5
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "08_5d_combined")]

import argparse
import contextlib
import functools
import json
import re
import resource
import runpy
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

import comm

TRAINER = os.path.join(ROOT, "08_5d_combined", "train.py")
OUT_OF_MEMORY = re.compile(r"out of memory|(can't|cannot) allocate memory|not enough memory", re.I)


class CommClock(comm.CommMeter):
    """02's meter whose wrappers also time each call, and `Work.wait` while active; spans are summed per
    window between optimizer steps (`step_ended`). Only the outermost call of a nest is timed (a blocking
    collective waits on its own work inside)."""

    def __init__(self):
        super().__init__()
        self.spans, self.windows, self.step_ends, self.depth = [], [], [time.perf_counter()], 0

    @contextlib.contextmanager
    def span(self):
        self.depth += 1
        cuda = self.depth == 1 and torch.cuda.is_available() and torch.cuda.is_initialized()
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            start.record()
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0 and cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.spans.append((start, end))
            elif self.depth == 0:
                self.spans.append(time.perf_counter() - start)

    def _timed(self, fn, wrapped):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.span():
                return wrapped(*args, **kwargs)
        timed.unmetered = fn
        return timed

    def _wrap(self, op, fn):
        return self._timed(fn, super()._wrap(op, fn))

    def _wrap_batch(self, fn):
        return self._timed(fn, super()._wrap_batch(fn))

    def __enter__(self):
        self._wait = dist.Work.wait
        dist.Work.wait = self._timed(self._wait, self._wait)
        return super().__enter__()

    def __exit__(self, *exc):
        dist.Work.wait = self._wait
        return super().__exit__(*exc)

    def step_ended(self, *_):
        """torch.optim's post-step hook: the window since the last optimizer step closes."""
        self.windows.append(self.spans)
        self.spans = []
        self.step_ends.append(time.perf_counter())

    def seconds(self) -> list:
        """Seconds blocked in communication per window (window 0: the setup and the first step)."""
        if any(isinstance(s, tuple) for window in self.windows for s in window):
            torch.cuda.synchronize()
        return [sum(s[0].elapsed_time(s[1]) / 1e3 if isinstance(s, tuple) else s for s in window)
                for window in self.windows]


def peak_memory() -> tuple:
    """(bytes, what they are): the CUDA allocator's peak, or the process's peak resident memory."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated(), "GPU allocator peak"
    with contextlib.suppress(OSError, AttributeError):
        return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024, \
            "peak resident memory (VmHWM)"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak resident memory (ru_maxrss)"


def write(out: Path, record: dict):
    scratch = out / f".rank{record['rank']}.json.tmp"
    scratch.write_text(json.dumps(record))
    os.replace(scratch, out / f"rank{record['rank']}.json")


def cause(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' '.join(lines)[:300]}"


def main(argv=None) -> int:
    """Run the trainer on this rank; returns its exit status. argv: --probe-* flags and the trainer's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--probe-out", required=True, help="the row's folder: rank<r>.json")
    parser.add_argument("--probe-memory-gb", type=float, help="RLIMIT_DATA of this rank, in GB")
    parser.add_argument("--probe-trainer", default=TRAINER, help="the script the rank runs")
    probe, trainer_argv = parser.parse_known_args(argv)
    out = Path(probe.probe_out)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(rank=int(os.environ.get("RANK", 0)), pid=os.getpid(), status=None)
    write(out, record)
    if probe.probe_memory_gb:
        limit = int(probe.probe_memory_gb * 1e9)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    clock, status, error = CommClock(), 0, None
    hook = register_optimizer_step_post_hook(clock.step_ended)
    try:
        sys.argv = [probe.probe_trainer, *trainer_argv]
        with clock:
            runpy.run_path(probe.probe_trainer, run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException as raised:      # MemoryError, torch's OutOfMemoryError, any crash: recorded
        traceback.print_exc()
        status, error = 1, raised
    finally:
        hook.remove()
        memory, kind = peak_memory()
        record.update(status=status, error=cause(error) if error else None,
                      out_of_memory=bool(error and (isinstance(error, (MemoryError, torch.OutOfMemoryError))
                                                    or OUT_OF_MEMORY.search(str(error)))),
                      peak_memory=memory, memory=kind, comm_s=clock.seconds(),
                      step_s=[b - a for a, b in zip(clock.step_ends, clock.step_ends[1:])])
        write(out, record)
        sys.stdout.flush()
        sys.stderr.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
