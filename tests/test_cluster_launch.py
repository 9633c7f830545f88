"""08_5d_combined/train.sbatch: the Slurm template starts torchrun with flags torchrun and the trainer accept.

No Slurm here: the script runs under bash with stand-ins for `scontrol` (prints 2000 host names: a
reader that stops early would SIGPIPE it) and `srun` (records its arguments), and the Slurm variables a
2-node allocation sets. Then the recorded
command line is parsed by torchrun's own parser (torch.distributed.run) and its trainer flags by the
trainer's parser and layout check, for the command the script's header documents (2 nodes × 8 GPUs).
"""
import os
import shlex
import subprocess
from importlib import import_module
from pathlib import Path

import torch
from torch.distributed.run import get_args_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "08_5d_combined" / "train.sbatch"
cli = import_module("01_single_gpu.cli")
layout = import_module("08_5d_combined.layout")


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


def test_sbatch_template_passes_flags_torchrun_and_the_trainer_accept(tmp_path, monkeypatch):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0            # the syntax
    command = documented_command()
    assert command[:4] == ["sbatch", "--nodes", "2", "08_5d_combined/train.sbatch"]
    bin_dir, recorded = tmp_path / "bin", tmp_path / "srun.args"
    bin_dir.mkdir()
    hosts = "".join(f"gpu-node-{i:02d}\\n" for i in range(7, 7 + 2000))   # long: a reader that stops early
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\nprintf '{hosts}'\n")     # would SIGPIPE it
    (bin_dir / "srun").write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {recorded}\n")
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[07-08]",
               SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(ROOT))
    subprocess.run(["bash", str(SCRIPT), *command[4:]], env=env, check=True, timeout=30)
    srun_args = recorded.read_text().splitlines()
    assert srun_args[:2] == ["--kill-on-bad-exit=1", "torchrun"]
    torchrun = get_args_parser().parse_args(srun_args[2:])
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend, torchrun.rdzv_endpoint,
            torchrun.rdzv_id) == ("2", "8", "c10d", "gpu-node-07:29500", "4242")
    assert torchrun.training_script == "08_5d_combined/train.py"
    assert torchrun.training_script_args == command[4:]
    # the trainer's flags exist and form a layout of 2 × 8 ranks (as on the cluster: CUDA visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "16")
    args = cli.parse_args(layout.build_parser("train"), torchrun.training_script_args, files=False)
    layout.check_layout(args, cli.model_config(args, 257))
    assert args.dp * args.tp * args.pp * args.cp == 16
