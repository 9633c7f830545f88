"""A finished run reports success: no rank aborts at exit, and every trainer lets go of its process group.

Before the trainers destroyed their process group (02's `process_grid.distributed`), a finished multi-rank
run sometimes ended with a rank aborting at interpreter exit ("terminate called without an active exception",
SIGABRT, and torchrun reporting FAILED): 05 `--cp 2 --dp 2` in 2 of 21 runs, 06 interleaved in 1 of 41; a
process that leaves with its gloo process group alive can be torn down while gloo's threads still run. The
failure is random, so the test repeats short runs: 24 runs catch a 1-in-10 failure with probability
1 − 0.9²⁴ ≈ 92%, a 1-in-20 one with 71%. The ranks are launched by tests/exit_launcher.py: torchrun's
environment and a normal interpreter exit (where the abort happened), forked after the imports so a run
costs its training, not an interpreter start per rank; every run meets through a store of its own.
"""
import os
import subprocess
from importlib import import_module
from pathlib import Path

import pytest

import common

ROOT = Path(__file__).resolve().parents[1]
# (script, ranks, repeats, flags)
RUNS = [("05_sequence_context_parallel/train.py", 4, 10, ["--cp", 2, "--dp", 2, "--mbs", 2]),
        ("06_pipeline/train.py", 2, 14, ["--pp", 2, "--pp-schedule", "interleaved", "--pp-chunks", 2,
                                         "--grad-acc", 2])]


@pytest.mark.timeout(900)
def test_short_multi_rank_runs_exit_cleanly_every_time():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    command = common.exit_launcher([(repeats, ranks, script, common.argv(*flags, steps=1, mbs=2))
                                    for script, ranks, repeats, flags in RUNS])   # one launcher: imports once
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    failures = []
    for script, ranks, repeats, _ in RUNS:
        ends = [line for line in done.stdout.splitlines() if line.startswith(f"{script} run ")]
        assert len(ends) == repeats * ranks, done.stdout[-1500:] + done.stderr[-1500:]
        failures += [line for line in ends if not line.endswith(": exit 0")]
    if done.returncode != 0 or "terminate called" in done.stderr:
        failures.append(f"exit {done.returncode}\n{done.stderr[-1500:]}")
    finals = sum(repeats for _, _, repeats, _ in RUNS)
    assert done.stdout.count("final loss") == finals, done.stdout[-1500:] + done.stderr[-1500:]
    assert not failures, "\n".join(failures)


def test_a_trainer_destroys_the_process_group_it_made():
    """In-process: a plain run (a world of one) leaves no process group behind, and no RANK/MASTER_PORT in
    the environment for the next run to trip over."""
    import torch.distributed as dist
    before = dict(os.environ)
    import_module("02_data_parallel.train").main(common.argv(steps=1))
    assert not dist.is_initialized()
    assert {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")} == \
        {k: before.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}


def _groups_after_two_runs():
    """On a rank of a world the caller made: the process groups this process holds before and after each
    of two 06 runs (a grid and the pipeline's direction groups)."""
    import torch.distributed as dist
    held = [len(dist.distributed_c10d._world.pg_map)]
    for _ in range(2):
        import_module("06_pipeline.train").main(common.argv("--pp", 2, "--pp-schedule", "interleaved",
                                                            "--pp-chunks", 2, steps=1, grad_acc=2))
        held.append(len(dist.distributed_c10d._world.pg_map))
    return held


def test_a_trainer_in_the_callers_world_gives_back_the_groups_it_made():
    """A trainer run inside a world the caller made (the test harness, a notebook) leaves that world as it
    found it: every group its grid and pipeline created is destroyed at the end. Before, each 06 run here
    left 11 gloo groups and their threads alive: 08's 24 layouts in one spawn took twice as long."""
    from harness import run_ranks
    for held in run_ranks(_groups_after_two_runs, 2):
        assert held == [held[0]] * 3, held


def test_keep_groups_around_a_run_that_made_its_own_world():
    """keep_groups() around a plain run (a world of one, created and destroyed by the run) has nothing left
    to give back, and says nothing: before, it waited in a barrier of the destroyed world and raised."""
    import torch.distributed as dist
    import process_grid
    with process_grid.keep_groups():
        import_module("02_data_parallel.train").main(common.argv(steps=1))
    assert not dist.is_initialized()
