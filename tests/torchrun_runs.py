"""Real 2-rank torchrun runs of 02 on the CPU, watched from outside, for test_failures.py.

The stalled run (test_a_stalled_rank_ends_every_rank) is mostly waiting: once rank 1 is stopped (SIGSTOP),
rank 0's watchdog waits --timeout-s (10 s), then torchrun gives the stopped rank its fixed 30 s grace
before SIGKILL. So it runs in the background and leaves a record (a JSON file) that the test reads: under
`pytest -n` the xdist controller, which runs no test, starts it as soon as a worker has collected that test
(conftest.py), and no worker waits for it; run alone, test_failures starts it before its first test.
Imports no torch: the controller does not need it.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]
STALLED = "test_a_stalled_rank_ends_every_rank"
STALLED_ID = f"tests/test_failures.py::{STALLED}"


def start_torchrun(cwd, *extra, ranks: int = 2):
    """torchrun --nproc_per_node 2 of 02 (dp 2, an endless run logging every step; or `ranks` 1); its
    stdout lines are collected in the background, and `closed_at` is when its output pipe closed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                            str(ROOT / "02_data_parallel" / "train.py"),
                            *common.argv("--dp", ranks, "--log-every", 1, *extra, steps=100_000, mbs=2)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    run.lines, run.closed = [], threading.Event()

    def read():
        run.lines.extend(iter(run.stdout.readline, ""))
        run.closed_at = time.monotonic()     # the pipe's end: the agent and every rank holding it are gone
        run.closed.set()
    threading.Thread(target=read, daemon=True).start()
    return run


def workers(agent_pid):
    """{rank: pid} of the processes whose parent is torchrun's agent."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit()
                    and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent_pid):
                env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
                found[int(env["RANK"])] = int(entry.name)
        except (OSError, KeyError, ValueError):
            pass
    return found


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def cleanup(run, pids):
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if run.poll() is None:
        run.kill()
    run.wait(timeout=60)


class StalledRun:
    """The stalled run in a background thread; its record lands in `path` (written whole, then renamed)."""

    def __init__(self, directory):
        self.path, self.run = Path(directory) / "stalled_run.json", None
        self.thread = threading.Thread(target=self._watch, args=(Path(directory),), daemon=True)
        self.thread.start()

    def _watch(self, directory):
        record, pids = {"error": None}, {}
        try:
            self.run = run = start_torchrun(directory, "--timeout-s", 10)
            deadline = time.monotonic() + 180
            while not any(line.startswith("step     3 ") for line in run.lines):
                if time.monotonic() > deadline or run.poll() is not None:
                    break
                time.sleep(0.2)
            else:
                pids = workers(run.pid)
                if sorted(pids) == [0, 1]:
                    os.kill(pids[1], signal.SIGSTOP)
                    record["stopped_at"] = time.monotonic()
            if "stopped_at" in record:   # every process gone within the test's bound, plus slack
                try:
                    run.wait(timeout=10 + 30 + 40)
                except subprocess.TimeoutExpired:
                    pass
                run.closed.wait(timeout=10)
            record.update(pids=pids, returncode=run.poll())
            record["alive"] = [pid for pid in pids.values() if alive(pid)]
            record["seconds"] = getattr(run, "closed_at", time.monotonic()) - record.get("stopped_at", 0)
            record["output"] = "".join(run.lines)[-4000:]
        except Exception as error:      # the test shows it
            record["error"] = f"{type(error).__name__}: {error}"
        finally:
            if self.run is not None:
                cleanup(self.run, pids.values())
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        partial.rename(self.path)

    def stop(self):
        """End the run now (a session that ends before its test ran)."""
        if self.run is not None and self.run.poll() is None:
            cleanup(self.run, workers(self.run.pid).values())


def read_record(path, seconds=300):
    """The stalled run's record, once written; None if it did not come within `seconds`."""
    deadline = time.monotonic() + seconds
    while not Path(path).exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return json.loads(Path(path).read_text())
