"""Preemptible runs (01_single_gpu/runtime/preemption.py and `--resume auto`): a job that is stopped or
killed, run again with the same command, ends as if nothing had happened.

Compared: a run sent SIGUSR1 in the middle of step 2 on one rank only, then the same command again, against
the uninterrupted run: every logged loss, and every tensor of the final checkpoint (parameters and AdamW's
moments), bitwise. Bitwise because the stop saves the exact state of its step and the rest of a run is
deterministic on the CPU in the same layout. On 2 ranks (02, dp 2) and on 4 (08, dp 2 × pp 2: the signal
reaches the last pipeline stage of the second replica, in its first backward, with the step's pipeline
messages and gradient all-reduce still ahead). A run killed (SIGKILL) while saving its first checkpoint
leaves only a scratch folder: the same command starts again from step 1. float32 on the CPU throughout.
"""
import contextlib
import json
import multiprocessing
import os
import signal
from importlib import import_module
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import common
from harness import layout_results, run_layouts

import checkpoint
import optim
import preemption

STEPS, STOP_IN = 4, 2          # the signal arrives in step 2 of 4: the stop saves step 2
TRAINERS = {"02": ("02_data_parallel.train", ["--dp", 2]),
            "08": ("08_5d_combined.train", ["--dp", 2, "--pp", 2])}


@contextlib.contextmanager
def signal_in_step(step: int, sig, times: int = 1):
    """Send `sig` to this process in step `step` (1-based), `times` times: in its first backward, or as the
    step starts if it has none. A real signal, through the kernel, to the handler the loop installed."""
    lr_at, backward, now = optim.lr_at, torch.autograd.backward, {"step": 0, "sent": False}

    def send():
        if now["step"] == step and not now["sent"]:
            now["sent"] = True
            for _ in range(times):
                os.kill(os.getpid(), sig)

    def lr_at_step(index, args):               # the loop sets each step's learning rate first
        now["step"] = index + 1
        return lr_at(index, args)

    def backward_sending(*args, **kwargs):
        send()
        return backward(*args, **kwargs)
    with mock.patch.object(optim, "lr_at", lr_at_step), mock.patch.object(torch.autograd, "backward",
                                                                          backward_sending):
        yield
    assert now["sent"], f"step {step} never ran a backward"


def command(trainer: str, folder: Path) -> list:
    """The job's command line: the same for the first run and every rerun."""
    _, flags = TRAINERS[trainer]
    return common.argv(*flags, "--checkpoint-dir", folder / "ckpt", "--json-log", folder / "log.jsonl",
                       "--resume", "auto", steps=STEPS, mbs=2, grad_acc=2)


def exit_status(main, argv) -> int:
    try:
        main(argv)
    except SystemExit as stop:
        return stop.code
    return 0


def _phase(phase, trainer, tmp, signalled_rank):
    """On every rank: "whole" (an uninterrupted run in its own folder), "stopped" (SIGUSR1 to one rank in
    step 2) or "again" (the same command as "stopped", no signal). Returns the exit status."""
    main = import_module(TRAINERS[trainer][0]).main
    folder = Path(tmp) / ("whole" if phase == "whole" else "preempted")
    signalled = phase == "stopped" and dist.get_rank() == signalled_rank
    with signal_in_step(STOP_IN, signal.SIGUSR1) if signalled else contextlib.nullcontext():
        return exit_status(main, command(trainer, folder))


def tensors(step_folder: Path) -> dict:
    """(file, tensor name) -> tensor, for every rank file of a checkpoint."""
    files = sorted(step_folder.glob("*.safetensors"))
    return {(f.name, name): value for f in files for name, value in load_file(f).items()}


def losses(folder: Path) -> list:
    records = map(json.loads, (folder / "log.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records]


@pytest.mark.parametrize("trainer, world, signalled_rank", [("02", 2, 1), ("08", 4, 3)],
                         ids=["02-dp2", "08-dp2-pp2"])
@pytest.mark.timeout(300)
def test_a_signalled_run_exits_75_and_the_same_command_finishes_it(tmp_path, trainer, world, signalled_rank):
    """One spawn runs three commands in turn on every rank: the uninterrupted run; the job's command with
    SIGUSR1 sent to one rank in step 2 (every rank exits 75 after saving step 2, none left in a collective:
    the harness would report a hang); the same command again (exit 0, steps 3-4). The folder then holds
    steps 2 and 4; the log holds steps 1-4 once, with the uninterrupted run's losses, and step 4's
    checkpoint equals the uninterrupted run's tensor for tensor."""
    phases, whole, preempted = ("whole", "stopped", "again"), tmp_path / "whole", tmp_path / "preempted"
    whole.mkdir(), preempted.mkdir()
    outcomes = run_layouts(_phase, {p: p for p in phases}, world,
                           args=(trainer, str(tmp_path), signalled_rank), timeout=180)
    codes = {p: layout_results(outcomes, p) for p in phases}
    assert codes == {"whole": [0] * world, "stopped": [preemption.EXIT_PREEMPTED] * world,
                     "again": [0] * world}
    assert sorted(p.name for p in (preempted / "ckpt").iterdir()) == ["step_000002", "step_000004"]
    assert losses(preempted) == losses(whole) and [s for s, _ in losses(whole)] == [1, 2, 3, 4]
    mine, reference = tensors(preempted / "ckpt" / "step_000004"), tensors(whole / "ckpt" / "step_000004")
    assert mine.keys() == reference.keys() and len(mine) > 0
    for key, value in reference.items():
        assert torch.equal(mine[key], value), key


def test_a_signal_without_checkpoint_dir_stops_saying_nothing_was_saved(tmp_path, capsys):
    """01 (one process, no collective) sent SIGTERM in step 2 of 4 without --checkpoint-dir: it still stops
    after step 2 (a scheduler that signals wants the job gone), says in one line that nothing was saved, and
    exits 75. The test's own handler, there before the run (so that a loop without one cannot end pytest),
    is back after it and saw nothing."""
    train01 = import_module("01_single_gpu.train")
    reached_the_test = []
    before = signal.signal(signal.SIGTERM, lambda *_: reached_the_test.append(True))
    try:
        capsys.readouterr()
        with signal_in_step(2, signal.SIGTERM):
            code = exit_status(train01.main, common.argv("--json-log", tmp_path / "log.jsonl", steps=STEPS))
        handler_after = signal.getsignal(signal.SIGTERM)
    finally:
        ours = signal.signal(signal.SIGTERM, before)
    assert not reached_the_test and handler_after is ours
    err = capsys.readouterr().err.strip().splitlines()
    assert code == preemption.EXIT_PREEMPTED and len(err) == 1, err
    assert err[0] == ("SIGTERM received: stopped after step 2, nothing saved (no --checkpoint-dir): the same "
                      "command starts again from step 1 (exit status 75)")
    assert [s for s, _ in losses(tmp_path)] == [1, 2]


def _killed_in_first_save(argv):
    """01's run, killed (SIGKILL: nothing can catch it) once its first checkpoint's tensors are on disk."""
    save_file = checkpoint.save_file

    def write_then_die(tensors, path):
        save_file(tensors, path)
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.save_file = write_then_die
    import_module("01_single_gpu.train").main(argv)


def test_killed_before_its_first_checkpoint_the_same_command_starts_from_step_1(tmp_path, capsys):
    """The job is killed while writing its first checkpoint (step 2): the folder holds only step_000002.tmp.
    The same command (`--resume auto`) says there is no checkpoint yet, trains from step 1, and equals an
    uninterrupted run bitwise. Plain --resume still refuses that folder (no checkpoint to continue), as it
    did before --resume auto existed: a requeued job's repeated command failed there."""
    flags = ["--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", 2, "--resume", "auto"]
    argv = common.argv(*flags, steps=STEPS)
    killed = multiprocessing.get_context("forkserver").Process(target=_killed_in_first_save, args=(argv,))
    killed.start()
    killed.join(timeout=120)
    assert killed.exitcode == -signal.SIGKILL
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000002.tmp"]
    refused = common.argv("--checkpoint-dir", tmp_path / "ckpt", "--resume", steps=STEPS)
    capsys.readouterr()
    assert exit_status(import_module("01_single_gpu.train").main, refused) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    again, again_state = common.single_device_run(*flags, steps=STEPS)
    said = f"--resume auto: no checkpoint in {tmp_path / 'ckpt'} yet: a new run, from step 1"
    assert said in capsys.readouterr().out
    whole, whole_state = common.single_device_run(steps=STEPS)
    assert again == whole and len(again) == STEPS
    for name, value in whole_state.items():
        assert torch.equal(again_state[name], value), name
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000002", "step_000004"]


def _ctrl_c_twice(argv):
    """01's run, sent Ctrl-C (SIGINT) twice in step 2."""
    with signal_in_step(2, signal.SIGINT, times=2):
        import_module("01_single_gpu.train").main(argv)


def test_ctrl_c_stops_like_sigterm_and_a_second_one_leaves_at_once(tmp_path, capsys):
    """Ctrl-C (SIGINT) in step 2 of 4 stops 01 after that step as SIGTERM does: one line, step 2 saved, exit
    status 130 (the shell's for an interrupted command), no KeyboardInterrupt traceback (the old loop's,
    which saved nothing). Ctrl-C twice: the second ends the process at once (SIGINT's default action, so
    the process dies by SIGINT), and step 1's checkpoint is intact."""
    flags = ["--checkpoint-dir", tmp_path / "once", "--checkpoint-every", 1]
    capsys.readouterr()
    before = signal.signal(signal.SIGINT, lambda *_: None)     # a loop without a handler cannot end pytest
    try:
        with signal_in_step(2, signal.SIGINT):
            code = exit_status(import_module("01_single_gpu.train").main, common.argv(*flags, steps=STEPS))
    finally:
        signal.signal(signal.SIGINT, before)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and err == [f"SIGINT (Ctrl-C) received: stopped after step 2, saved "
                                   f"{tmp_path / 'once'}/step_000002; the same command with --resume auto "
                                   f"continues from it (exit status 130)"], err
    assert checkpoint.newest_usable(tmp_path / "once").step == 2
    argv = common.argv("--checkpoint-dir", tmp_path / "twice", "--checkpoint-every", 1, steps=STEPS)
    twice = multiprocessing.get_context("forkserver").Process(target=_ctrl_c_twice, args=(argv,))
    twice.start()
    twice.join(timeout=120)
    assert twice.exitcode == -signal.SIGINT
    assert sorted(p.name for p in (tmp_path / "twice").iterdir()) == ["step_000001"]
    assert checkpoint.verify(tmp_path / "twice" / "step_000001")[0] is None
