"""Child processes with a time limit, ended with everything they started: kernels/gpu_run.py's stages.

A stage is a trainer, pytest (several at once, `run_logged`: the test shards) or the bench; a trainer
may be torchrun with ranks of their own. At the limit each child's process group gets SIGTERM (torchrun
then stops its ranks), and every process below a child still alive 10 s later gets SIGKILL: torchrun
starts each rank in a session of its own, out of the group's reach, and a rank left behind would hold the
GPU the next stage needs.
"""
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10          # between SIGTERM and SIGKILL


def run_child(command, limit_s: float, log, env=None):
    """(status, seconds, output) of one child process writing into the open `log`: 'ok', 'failed' (non-zero
    exit) or 'timeout'."""
    log.write(f"\n$ {' '.join(command)}\n".encode())
    log.flush()
    start = log.tell()
    [(status, seconds)] = run_children([command], limit_s, [log], env)
    output = Path(log.name).read_bytes()[start:].decode(errors="replace")
    return status, seconds, output


def run_children(commands, limit_s: float, logs, env=None):
    """[(status, seconds)] of child processes run at once, each writing into its open log, all ended at
    limit_s after the first started."""
    t0 = time.perf_counter()
    children = []
    for command, log in zip(commands, logs):
        # A process group of its own, so a timeout reaches the child's children (pytest's trainers) too
        children.append(subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))))
    ended, late = {}, []
    for child in children:
        try:
            code = child.wait(timeout=max(t0 + max(limit_s, 1) - time.perf_counter(), 0.01))
            ended[child.pid] = ("ok" if code == 0 else "failed", time.perf_counter() - t0)
        except subprocess.TimeoutExpired:
            late.append(child)
    end_trees(late)
    for log in logs:
        log.flush()
    return [ended.get(c.pid, ("timeout", time.perf_counter() - t0)) for c in children]


def run_logged(commands, limit_s, scratch: Path, log, env):
    """[(status, output)] of commands run at once, each into its own file in `scratch` (the shards of a
    test stage), then all appended to `log`."""
    paths = [scratch / f"child-{time.monotonic_ns()}-{i}.log" for i in range(len(commands))]
    files = [open(path, "wb") for path in paths]
    try:
        results = run_children(commands, limit_s, files, env)
    finally:
        for file in files:
            file.close()
    outputs = [path.read_bytes() for path in paths]
    for command, output in zip(commands, outputs):
        log.write(f"\n$ {' '.join(command)}\n".encode() + output)
    log.flush()
    return [(status, output.decode(errors="replace")) for (status, _), output in zip(results, outputs)]


def end_trees(children):
    """SIGTERM to each child's group (torchrun then stops its ranks), then, after GRACE_S for them all,
    SIGKILL to every process below each child: torchrun starts each rank in a session of its own."""
    trees = {child.pid: descendants(child.pid) for child in children}
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
    deadline = time.perf_counter() + GRACE_S
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=max(deadline - time.perf_counter(), 0.01))
    for child in children:
        for pid in [child.pid, *trees[child.pid], *descendants(child.pid)]:
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
