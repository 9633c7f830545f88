"""Each row of a sweep as a job of its own: launched, held to its limits, cleaned up, and what it measured.

The playbook's §3.5 lists what went wrong when it benchmarked every layout: processes left running,
jobs that hung, a crash that stopped the rest. So a row's job runs in a session of its own and

    ends at --limit-s, or after --stall-s without a new line of output (a hung job prints nothing);
    then its whole tree is ended (kernels/child_process.py: SIGTERM to its group, SIGKILL below it);
    anything of it still alive afterwards (an orphan, reparented to the sweep: PR_SET_CHILD_SUBREAPER)
    is killed too, and counted in the record;

and whatever happens is a record: ok, out of memory (a rank's allocator failed), timed out, or failed,
with the line that says why. Two launchers: torchrun (python -m torch.distributed.run --standalone, as a
user starts it), or `fork` on the CPU: the sweep imported torch and the trainer once, and each row's
leader forks its ranks with torchrun's environment, ending them all when one fails, as torchrun's agent
does (a fresh interpreter per rank costs ~2 CPU-s of imports; a forked rank a fraction of that).
Either way every rank runs sweep_rank.py, which writes what it measured.
"""
import contextlib
import ctypes
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import cli_checks
import watchdog
from kernels import child_process
import sweep_rank

PR_SET_CHILD_SUBREAPER = 36     # <linux/prctl.h>: orphans below this process are reparented to it


def adopt_orphans():
    """Linux: a process left behind by a row's job becomes the sweep's child, so it can be found and ended."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class ForkedJob:
    """A row's ranks forked from this process under a leader in a session of its own. It has what
    child_process.end_trees uses of a Popen: pid, wait(timeout) and returncode."""

    def __init__(self, world: int, probe_argv: list, log_path: Path):
        self.returncode = None
        sys.stdout.flush()                        # else the children would print the sweep's buffer again
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:                         # the leader
            os.setsid()
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(log, 1)
            os.dup2(log, 2)
            exit_as(self._lead, world, probe_argv, log_path.parent)

    @staticmethod
    def _lead(world: int, probe_argv: list, row_dir: Path) -> int:
        # the store torchrun's agent serves its workers, on a port the system gives it
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=300))
        ranks = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                os.environ.update(torchrun_environment(rank, world, store.port, row_dir))
                torch.set_num_threads(1)          # torchrun's default: one thread per worker
                watchdog.exit_with_parent(signal.SIGKILL)
                exit_as(sweep_rank.main, probe_argv)
            ranks[pid] = rank
        status = 0
        while ranks:
            pid, wait_status = os.wait()
            code = os.waitstatus_to_exitcode(wait_status)
            ranks.pop(pid, None)
            if code and not status:               # the first failure ends the others (torchrun's agent)
                status = code if code > 0 else 128 - code
                print(f"fork launcher: rank exited with {code}; ending the other ranks", flush=True)
                for other in ranks:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
        return status

    def poll(self):
        if self.returncode is None:
            pid, wait_status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(wait_status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"row leader {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def torchrun_environment(rank: int, world: int, port: int, row_dir: Path) -> dict:
    """What torchrun's agent gives a worker, its error file included: with one, a rank that finds a bad
    flag waits for rank 0 to print it (rank0.fail) instead of leaving first and having rank 0 killed."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_ERROR_FILE=str(row_dir / f"error_rank{rank}.json"), OMP_NUM_THREADS="1")


def exit_as(main, *args):
    """End this forked process with `main(*args)`'s status, as the interpreter would (SystemExit's code, 1
    and the traceback for an exception), without running the sweep's code above it on the stack."""
    code = 1
    try:
        code = main(*args)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def start(launcher: str, world: int, probe_argv: list, log_path: Path):
    """The row's job, started: torchrun in a session of its own, or the forked leader."""
    if launcher == "fork":
        return ForkedJob(world, probe_argv, log_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               sweep_rank.__file__, *probe_argv]
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=child_process.ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def watch(job, log_path: Path, limit_s: float, stall_s: float) -> tuple:
    """(exit status or None, how it ended: 'exited' | 'limit' | 'stall', seconds, processes left killed)."""
    t0 = last = time.monotonic()
    size, ended = 0, "exited"
    while job.poll() is None:
        time.sleep(0.1)
        now, grown = time.monotonic(), log_path.stat().st_size
        if grown != size:
            size, last = grown, now
        if now - t0 > limit_s or now - last > stall_s:
            ended = "limit" if now - t0 > limit_s else "stall"
            child_process.end_trees([job])
            break
    seconds = time.monotonic() - t0
    left = child_process.descendants(os.getpid())         # orphans of the job, now the sweep's children
    running = [pid for pid in left if not exited(pid)]
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in left:                                      # and the exited ones' zombies are reaped
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return (job.returncode if ended == "exited" else None), ended, seconds, len(running)


def exited(pid: int) -> bool:
    """Whether the process is gone or a zombie (it has exited; its parent has not read its status yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ======================================================================================
# What a row measured, and why it ended as it did
# ======================================================================================
def read_ranks(row_dir: Path) -> list:
    ranks = []
    for path in sorted(row_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        with contextlib.suppress(json.JSONDecodeError):
            ranks.append(json.loads(path.read_text()))
    return ranks


def read_steps(row_dir: Path) -> list:
    path = row_dir / "log.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def last_reason(output: str) -> str:
    """The line of a job's output that says why it ended: the last error-like line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip() and not line.startswith("W1")]
    errors = [line for line in lines if re.search(r"error|exception|killed|no progress", line, re.I)]
    return (errors or lines or ["(no output)"])[-1][:300]


def outcome(status, ended: str, ranks: list, output: str, limits: tuple) -> tuple:
    """(ok | out of memory | timed out | failed, the line that says why)."""
    if ended in ("limit", "stall"):
        why = (f"no output for {limits[1]:g} s" if ended == "stall" else f"still running at {limits[0]:g} s")
        return "timed out", f"{why} (--{ended}-s); last line: {last_reason(output)}"
    oom = [r for r in ranks if r.get("out_of_memory")]
    if oom:
        return "out of memory", f"rank {oom[0]['rank']}: {oom[0]['error']}"
    # the trainer's preflight refused it before allocating (cli_checks.check_memory): its estimate, not a run
    refused = [line for line in output.splitlines() if cli_checks.MEMORY_REFUSAL in line]
    if status and refused:
        return "out of memory", f"refused by the memory preflight: {refused[-1].strip()[:300]}"
    if status == 0 and ranks and all(r.get("status") == 0 for r in ranks):
        return "ok", ""
    failed = [r for r in ranks if r.get("error")]
    if failed:
        return "failed", f"rank {failed[0]['rank']}: {failed[0]['error']}"
    return "failed", f"exit status {status}: {last_reason(output)}"


def measured(row_dir: Path, tokens_per_step: int) -> dict:
    """The row's speed, memory and communication: medians over the steps after the first."""
    steps, ranks = read_steps(row_dir), read_ranks(row_dir)
    timed = steps[1:] or steps
    speed = statistics.median(s["tokens_per_s"] for s in timed) if timed else None
    mfu = [s["mfu"] for s in timed if s.get("mfu") is not None]
    comm = [statistics.median(r["comm_s"][1:] or r["comm_s"]) for r in ranks if r.get("comm_s")]
    return dict(steps=len(steps), tokens_per_s=speed, step_s=tokens_per_step / speed if speed else None,
                mfu=statistics.median(mfu) if mfu else None,
                peak_memory=[r.get("peak_memory") for r in ranks], memory=next(
                    (r["memory"] for r in ranks if r.get("memory")), None),
                comm_s=comm, pids=[r["pid"] for r in ranks])


# ======================================================================================
# The rows, one job after the other
# ======================================================================================
@dataclass(frozen=True)
class Job:
    key: str              # the row's name and folder
    flags: list           # its trainer flags (degrees, ZeRO, recompute, schedule, mbs, grad-acc, its own)
    predicted: dict       # sweep.prediction: the planner's step time, its parts, memory and rank
    layout: dict


def read_records(out: Path) -> dict:
    """{row key: record} of OUT/rows.jsonl (a torn last line, from a killed sweep, is left out)."""
    path, records = out / "rows.jsonl", {}
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            records[record["row"]] = record
    return records


def record_of(job: Job, row_dir: Path, status, ended: str, seconds: float, left: int, limits: tuple,
              tokens_per_step: int) -> dict:
    output = (row_dir / "output.log").read_text(errors="replace") if (row_dir / "output.log").exists() else ""
    ranks = read_ranks(row_dir)
    result, why = outcome(status, ended, ranks, output, limits)
    return dict(row=job.key, layout=job.layout, flags=job.flags, outcome=result, cause=why, exit=status,
                seconds=seconds, left_running=left, **measured(row_dir, tokens_per_step),
                predicted=job.predicted)


def probe_argv(row_dir: Path, trainer: list, job: Job, sweep) -> list:
    """sweep_rank.py's flags for the row: where to write, the memory cap, then the trainer's."""
    limit = ["--probe-memory-gb", str(sweep.memory_limit_gb)] if sweep.memory_limit_gb else []
    return ["--probe-out", str(row_dir), *limit, *trainer, *job.flags, f"--steps={sweep.steps}",
            "--no-progress", "--log-every=1", f"--json-log={row_dir / 'log.jsonl'}"]


def append(out: Path, record: dict):
    with open(out / "rows.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def run_all(out: Path, jobs: list, trainer: list, sweep, tokens_per_step: int) -> dict:
    """Run every job not yet recorded, one after the other; append each record to OUT/rows.jsonl."""
    records = read_records(out)
    todo = [job for job in jobs if job.key not in records]
    print(f"sweep: {len(jobs)} rows, {len(jobs) - len(todo)} of them recorded before", flush=True)
    limits = (sweep.limit_s, sweep.stall_s)
    for k, job in enumerate(todo, 1):
        row_dir = out / job.key
        row_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*row_dir.glob("rank*.json"), *row_dir.glob("error_rank*.json"), row_dir / "log.jsonl"]:
            stale.unlink(missing_ok=True)              # an unrecorded row's leftovers (a killed sweep)
        log = row_dir / "output.log"
        log.write_bytes(b"")
        process = start(sweep.launcher, sweep.world, probe_argv(row_dir, trainer, job, sweep), log)
        status, ended, seconds, left = watch(process, log, *limits)
        records[job.key] = r = record_of(job, row_dir, status, ended, seconds, left, limits, tokens_per_step)
        append(out, r)
        speed = f", {r['tokens_per_s']:.0f} tokens/s" if r["outcome"] == "ok" else f": {r['cause']}"
        print(f"[{k}/{len(todo)}] {job.key}: {r['outcome']}{speed} ({seconds:.1f} s)", flush=True)
    return records
