"""A child process with a time limit, ended with everything it started: kernels/gpu_run.py's stages.

A stage is a trainer, pytest or the bench; a trainer may be torchrun with ranks of their own. At the
limit the child's process group gets SIGTERM (torchrun then stops its ranks), and every process below
the child still alive gets SIGKILL: torchrun starts each rank in a session of its own, out of the
group's reach, and a rank left behind would hold the GPU the next stage needs.
"""
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_child(command, limit_s: float, log, env=None):
    """(status, seconds, output) of one child process: 'ok', 'failed' (non-zero exit) or 'timeout'."""
    log.write(f"\n$ {' '.join(command)}\n".encode())
    log.flush()
    start, t0 = log.tell(), time.perf_counter()
    # A process group of its own, so a timeout reaches the child's children (pytest's trainers) too
    child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    try:
        status = "ok" if child.wait(timeout=max(limit_s, 1)) == 0 else "failed"
    except subprocess.TimeoutExpired:
        end_tree(child)
        status = "timeout"
    log.flush()
    output = Path(log.name).read_bytes()[start:].decode(errors="replace")
    return status, time.perf_counter() - t0, output


def end_tree(child):
    """SIGTERM to the child's group (torchrun then stops its ranks), then SIGKILL to every process below
    the child: torchrun starts each rank in a session of its own, out of the group's reach."""
    tree = descendants(child.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=10)
    for pid in [child.pid, *tree, *descendants(child.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    child.wait()


def descendants(pid: int) -> list:
    """The live processes below pid, read from /proc (Linux)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])    # the fields after "(name)"
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found
