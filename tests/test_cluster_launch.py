"""08_5d_combined/train.sbatch: the Slurm template starts torchrun with flags torchrun and the trainer accept,
and a signal from Slurm stops the trainers (and, before the time limit, requeues the job).

No Slurm here: the script runs under bash with stand-ins for `scontrol` (prints 2000 host names: a
reader that stops early would SIGPIPE it; records a `requeue`) and `srun` (records its arguments, and a
SIGTERM it receives), and the Slurm variables a 2-node allocation sets. Then the recorded
command line is parsed by torchrun's own parser (torch.distributed.run) and its trainer flags by the
trainer's parser and layout check, for the command the script's header documents (2 nodes × 8 GPUs).
"""
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.run import get_args_parser
import cli
import layout_5d as layout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "08_5d_combined" / "train.sbatch"


def documented_command() -> list:
    """The `sbatch ...` line of the script's header (with its continuation), split like a shell would."""
    lines = [line[1:].strip() for line in SCRIPT.read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("sbatch "))
    command = []
    for line in lines[start:]:
        command.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(command))


def stand_ins(tmp_path, srun_waits: bool = False, srun_runs: bool = False) -> dict:
    """The environment of a 2-node job whose `srun` and `scontrol` are the stand-ins, in tmp_path/bin. The
    waiting srun stays until a SIGTERM, which it records, then exits 1 (as torchrun does when signalled).
    `srun_runs`: srun runs its command (08's sweep test), on this host, which scontrol names first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hosts = "".join(f"gpu-node-{i:02d}\\n" for i in range(7, 7 + 2000))   # long: a reader that stops early
    hosts = "127.0.0.1\\n" * srun_runs + hosts
    (bin_dir / "scontrol").write_text("#!/bin/bash\n"
                                      f"[ \"$1\" = requeue ] && echo \"$@\" > {tmp_path}/requeued && exit 0\n"
                                      f"printf '{hosts}'\n")      # would SIGPIPE it
    trap = f"trap 'echo TERM > {tmp_path}/srun.signal; kill $!; exit 1' TERM\n" if srun_waits else ""
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{trap}printf '%s\\n' \"$@\" > {tmp_path}/srun.args\n"
                                  + ("sleep 60 & wait $!\n" if srun_waits else "")
                                  + ('shift\nexec "$@"\n' if srun_runs else ""))
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[07-08]",
                SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_JOB_NAME="picotron-5d",
                SLURM_SUBMIT_DIR=str(ROOT))


def test_sbatch_template_passes_flags_torchrun_and_the_trainer_accept(tmp_path, monkeypatch):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0            # the syntax
    command = documented_command()
    assert command[:4] == ["sbatch", "--nodes", "2", "08_5d_combined/train.sbatch"]
    recorded = tmp_path / "srun.args"
    subprocess.run(["bash", str(SCRIPT), *command[4:]], env=stand_ins(tmp_path), check=True, timeout=30)
    srun_args = recorded.read_text().splitlines()
    assert srun_args[:2] == ["--kill-on-bad-exit=1", "torchrun"]
    torchrun = get_args_parser().parse_args(srun_args[2:])
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend, torchrun.rdzv_endpoint,
            torchrun.rdzv_id) == ("2", "8", "c10d", "gpu-node-07:29500", "4242")
    assert torchrun.training_script == "08_5d_combined/train.py"
    # a checkpoint folder per job name, resumed by every start of the job (the user's flags last: they win)
    assert torchrun.training_script_args == ["--checkpoint-dir", "checkpoints/picotron-5d",
                                             "--resume", "auto", *command[4:]]
    # the trainer's flags exist and form a layout of 2 × 8 ranks (as on the cluster: CUDA visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "16")
    args = cli.parse_args(layout.build_parser("train"), torchrun.training_script_args, files=False)
    layout.check_layout(args, cli.model_config(args, 257))
    assert args.dp * args.tp * args.pp * args.cp == 16 and args.resume == "auto"


def test_sbatch_asks_for_a_warning_signal_and_requeueing():
    """USR1 to the batch shell (B:) 300 s before the time limit, and a job Slurm may requeue."""
    directives = [line.split()[1] for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "--signal=B:USR1@300" in directives and "--requeue" in directives


@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)],
                         ids=["usr1-time-limit", "term-preemption"])
def test_a_signal_to_the_job_stops_the_trainers(tmp_path, sig, requeued):
    """The script, its srun running: USR1 (Slurm's warning before the time limit) makes it send SIGTERM to
    srun (which forwards it to torchrun, torchrun to the trainers) and, once srun has ended, requeue the job
    (`scontrol requeue 4242`); TERM (preemption, scancel) forwards the SIGTERM and leaves requeueing to
    Slurm. The script exits with srun's status either way."""
    job = subprocess.Popen(["bash", str(SCRIPT), "--dp", "2"], env=stand_ins(tmp_path, srun_waits=True))
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "srun.args").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        job.send_signal(sig)
        assert job.wait(timeout=30) == 1
    finally:
        if job.poll() is None:
            job.kill()
    assert (tmp_path / "srun.signal").read_text() == "TERM\n"
    assert (tmp_path / "requeued").exists() == requeued
    if requeued:
        assert (tmp_path / "requeued").read_text() == "requeue 4242\n"
