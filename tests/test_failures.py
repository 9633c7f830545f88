"""What a run does when training goes wrong: NaN/inf, a stalled peer, a killed launcher.

Compared here: a step with NaN gradients under --on-nonfinite skip against the state before it (the
parameters and every optimizer tensor bitwise equal: nothing may move), the --json-log lines against
strict JSON, and, on real 2-rank gloo runs under torchrun on the CPU, the seconds until every process of
a run whose rank 1 was stopped (SIGSTOP), or whose torchrun agent was killed, is gone.
"""
import json
import os
import re
import signal
import sys
import time
from importlib import import_module
from pathlib import Path

import pytest
import torch

import common
import torchrun_runs
from torchrun_runs import STALLED, alive, cleanup, start_torchrun, workers

import cli
import hf_io
import loop
import model as modeling
train01 = import_module("01_single_gpu.train")
ROOT = Path(__file__).resolve().parents[1]


def strict_json(line):
    """json.loads that refuses NaN and Infinity, which are not JSON."""
    return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in --json-log: not JSON"))


@pytest.fixture
def nan_weights(tmp_path):
    """An HF directory of the TINY model with one NaN in the last norm: every loss is NaN from step 1."""
    config = modeling.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)
    model = modeling.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    hf_io.save_hf(model, tmp_path / "nan")
    return tmp_path / "nan"


def test_nonfinite_loss_stops_the_run_in_one_line(tmp_path, capsys, nan_weights):
    """Default --on-nonfinite stop: step 1's loss is NaN, the run ends with status 1 and one line, and the
    --json-log line of that step is strict JSON (null for NaN). The old loop trained on with exit status 0."""
    log = tmp_path / "log.jsonl"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        common.single_device_run("--init-from", nan_weights, "--json-log", log, steps=3)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 1 and len(err) == 1 and "step 1: the loss is nan" in err[0], err
    assert "pass --on-nonfinite skip" in err[0]
    assert [strict_json(line) for line in log.read_text().splitlines()][0]["loss"] is None


def test_skip_leaves_parameters_and_optimizer_state_untouched(tmp_path):
    """--on-nonfinite skip with step 2's logits poisoned with NaN (a forward hook, that step only): the step
    is logged as skipped, the parameters and every optimizer tensor (moments, step counts) after it are
    bitwise those before it, and the steps around it train normally."""
    args, config, dataset = cli.setup(train01.build_parser(),
                                      common.argv("--on-nonfinite", "skip",
                                                  "--json-log", tmp_path / "log.jsonl", steps=4))
    model = train01.build.materialize(train01.build.build_model(args, config), args)
    optimizer = train01.mixed_precision.MixedPrecisionOptimizer(model.parameters(), args)   # as train.run
    calls, seen = [], {}

    def snapshot():
        return ([p.detach().clone() for p in model.parameters()],
                [v.clone() for s in optimizer.state.values() for v in s.values()])

    def poisoned_step(micro_batches):
        calls.append(len(calls) + 1)
        if calls[-1] != 2:
            return train01.train_step(model, optimizer, micro_batches, args)
        seen["before"] = snapshot()
        hook = model.lm_head.register_forward_hook(lambda module, inputs, out: out * float("nan"))
        try:
            result = train01.train_step(model, optimizer, micro_batches, args)
        finally:
            hook.remove()
        seen["after"] = snapshot()
        return result

    records = loop.train(args, poisoned_step, model, optimizer, dataset, 1)
    assert [r.get("skipped", False) for r in records] == [False, True, False, False]
    (params_before, state_before), (params_after, state_after) = seen["before"], seen["after"]
    assert len(state_before) == len(state_after) > 0
    for before, after in zip(params_before + state_before, params_after + state_after):
        assert torch.equal(before, after)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for i, r in enumerate(records) if i != 1)
    lines = [strict_json(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert (lines[1]["loss"] is None and lines[1]["skipped"] is True
            and records[3]["loss"] < records[0]["loss"])


def test_a_parallel_trainer_stops_and_skips_too(tmp_path, capsys, nan_weights):
    """02 in a world of one (`--dp 1`, its own train_step on 01's loop; run in-process, as 01 above): with
    NaN weights, stop ends in one line with status 1 and gives its process group back; skip skips every
    step (each logged with a null loss) and ends normally."""
    import torch.distributed as dist
    main = import_module("02_data_parallel.train").main
    argv = common.argv("--dp", 1, "--init-from", nan_weights, "--json-log", tmp_path / "log.jsonl", steps=2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 1 and len(lines) == 1 and "step 1: the loss is nan" in lines[0], lines
    assert not dist.is_initialized()
    main(argv + ["--on-nonfinite", "skip"])
    records = [strict_json(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["loss"], r["skipped"]) for r in records] == [(None, True), (None, True)]


def test_watchdog_ends_a_loop_without_progress(capfd):
    """No beat for 0.3 s: the watchdog prints one line naming the rank and the last step, and exits 1 (here
    into a list instead of os._exit). A loop that beats faster than that is left alone."""
    import watchdog
    exits = []
    with watchdog.Watchdog(0.3, rank=1, exit=exits.append, poll_s=0.05) as dog:
        for step in range(8):
            time.sleep(0.05)
            dog.beat(f"step {step + 1} ended")
        assert exits == []
        time.sleep(1.0)
    assert exits == [1]
    assert "rank 1: no progress for 0 s since step 8 ended (--timeout-s 0.3)" in capfd.readouterr().err


# ======================================================================================
# Real 2-rank runs under torchrun
# ======================================================================================
def wait_for(condition, seconds, what, run):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline or run.poll() is not None:
            pytest.fail(f"{what} did not happen within {seconds} s:\n{''.join(run.lines)[-4000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module", autouse=True)
def stalled_run(request, tmp_path_factory):
    """The record of test_a_stalled_rank_ends_every_rank's run, made in the background (torchrun_runs.py):
    under `pytest -n` by the xdist controller (conftest), else started here before this file's first test
    when that test is selected. Yields the record's path."""
    started = getattr(request.config, "workerinput", {}).get("stalled_run_record")
    if started or not sys.platform.startswith("linux") or all(item.name != STALLED
                                                              for item in request.session.items):
        yield started
        return
    run = torchrun_runs.StalledRun(tmp_path_factory.mktemp("stalled"))
    yield run.path
    run.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the workers")
def test_a_stalled_rank_ends_every_rank(stalled_run):
    """Rank 1 is stopped (SIGSTOP) in the middle of training. Rank 0 waits in its next collective; its
    watchdog ends it --timeout-s (10 s) after its last step, torchrun then kills the stopped rank and exits
    non-zero. Every process is gone within the timeout plus torchrun's 30 s grace before SIGKILL, plus slack.
    (The old code had no --timeout-s; without it, rank 0 waited for gloo's 30-minute default.)"""
    run = torchrun_runs.read_record(stalled_run)
    assert run is not None, f"the stalled run left no record at {stalled_run} within 300 s"
    assert run["error"] is None, run["error"]
    output = run["output"]
    assert "stopped_at" in run, f"rank 1 was not stopped at step 3 (workers {run['pids']}):\n{output}"
    assert run["returncode"] not in (0, None), output
    assert "rank 0: no progress for" in output, output
    assert "a peer stalled, died or deadlocked" in output, output
    assert not run["alive"], output
    assert run["seconds"] < 80, run["seconds"]


# The signals that end torchrun's agent, and what its workers receive: SIGKILL and SIGUSR1 (whose default
# action ends the agent) leave them orphans, whom the kernel sends SIGHUP (watchdog.exit_with_parent); the
# agent forwards a SIGHUP it receives. Two ranks under SIGKILL: the stop's collectives with the agent gone.
AGENT_SIGNALS = [(signal.SIGKILL, 2), (signal.SIGUSR1, 1), (signal.SIGHUP, 1)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the workers")
@pytest.mark.parametrize("sig, ranks", AGENT_SIGNALS, ids=[s.name for s, _ in AGENT_SIGNALS])
def test_workers_save_and_exit_when_their_agent_dies(tmp_path, sig, ranks):
    """torchrun's agent gets `sig` after step 3. Its workers end within seconds, instead of training on as
    orphans (the old code's), with the stop save of SIGTERM: one line, the step they stopped after saved
    and verified, exit status 75. (Before, the watchdog's "launcher is gone" exit raced that save.)"""
    import checkpoint
    run = start_torchrun(tmp_path, "--checkpoint-dir", tmp_path / "ckpt", ranks=ranks)
    pids = {}
    try:
        wait_for(lambda: any(line.startswith("step     3 ") for line in run.lines), 180, "step 3", run)
        pids = workers(run.pid)
        assert sorted(pids) == list(range(ranks)), pids
        os.kill(run.pid, sig)
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in pids.values()), "workers still running after their agent died"
        run.closed.wait(timeout=10)
    finally:
        cleanup(run, pids.values())
    output = "".join(run.lines)
    said = re.findall(r"SIGHUP \(the launcher or the terminal is gone\) received: stopped after step (\d+), "
                      r"saved \S+; the same command with --resume auto continues from it \(exit status 75\)",
                      output)
    # one line; torchrun, when it lives (SIGHUP), still prints its own traceback, with no frame of ours
    assert len(said) == 1 and not re.search(r'File ".*/0\d_\w+/', output), output[-4000:]
    assert checkpoint.newest_usable(tmp_path / "ckpt").step == int(said[0]) >= 3
