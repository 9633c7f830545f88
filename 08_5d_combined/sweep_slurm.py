"""A sweep on a Slurm cluster: one sbatch job per row, made from train.sbatch, and their records gathered.

`sweep.py --slurm` writes OUT/slurm/<row>.sbatch for every row not yet recorded: 08's train.sbatch with its
header set for the row (job name, nodes = --world / --gpus-per-node, --time = --limit-s, the output in the
row's folder; no requeue and no early warning: a row that reaches its limit is recorded as timed out, not
run again) and, before its body, the row: TRAINER=08_5d_combined/sweep_rank.py, CHECKPOINT_DIR in the
row's folder (the template saves the last step there) and its flags. OUT/slurm/submit.sh submits them all.
`sweep.py --collect` (the same flags) then reads what each job's ranks wrote (sweep_rank.py) into
OUT/rows.jsonl: a job whose ranks all ended is recorded; one Slurm ended at its time limit (its output says
"DUE TO TIME LIMIT", or its trainers stopped on the signal, exit 75) is recorded as timed out; one still
queued or running is left for the next --collect.

    python 08_5d_combined/sweep.py --slurm --world 16 --gpus-per-node 8 ... && bash sweep/slurm/submit.sh
"""
import re
import shlex
from pathlib import Path

import sweep_jobs

TEMPLATE = Path(__file__).with_name("train.sbatch")
DROPPED = ("#SBATCH --requeue", "#SBATCH --signal=")         # a sweep's row runs once, to its limit
STOPPED_BY_SIGNAL = 75                                          # 01's preemption.py: saved, then exited


def script(job, row_dir: Path, probe: list, sweep) -> str:
    """train.sbatch for one row: its header set, the row's trainer and flags before the body."""
    minutes, per_node = -(-int(sweep.limit_s) // 60), min(sweep.world, sweep.gpus_per_node)
    header = {"--job-name": f"sweep-{job.key}"[:64], "--nodes": str(sweep.world // per_node),
              "--gpus-per-node": str(per_node), "--time": f"{minutes // 60:02d}:{minutes % 60:02d}:00",
              "--output": f"{row_dir}/slurm-%j.out"}
    lines = []
    for line in TEMPLATE.read_text().splitlines():
        if line.startswith(DROPPED):
            continue
        match = re.match(r"#SBATCH (--[\w-]+)=", line)
        flag = match.group(1) if match else None
        lines.append(f"#SBATCH {flag}={header[flag]}" if flag in header else line)
        if line.startswith("set -euo pipefail"):
            lines += [f"# sweep row {job.key} (08_5d_combined/sweep.py --slurm): the template for one row,",
                      "# without --requeue and USR1: a row runs once, to its time limit",
                      "TRAINER=08_5d_combined/sweep_rank.py", f"GPUS_PER_NODE={per_node}",
                      f"CHECKPOINT_DIR={shlex.quote(str(row_dir / 'checkpoints'))}",
                      f"set -- {shlex.join(probe)} \"$@\""]
    return "\n".join(lines) + "\n"


def emit(out: Path, jobs: list, trainer: list, sweep) -> list:
    """Write OUT/slurm/<row>.sbatch for the rows not recorded, and OUT/slurm/submit.sh; returns the paths."""
    records, folder = sweep_jobs.read_records(out), out / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for job in [job for job in jobs if job.key not in records]:
        row_dir = (out / job.key).resolve()
        row_dir.mkdir(parents=True, exist_ok=True)
        path = folder / f"{job.key}.sbatch"
        path.write_text(script(job, row_dir, sweep_jobs.probe_argv(row_dir, trainer, job, sweep), sweep))
        written.append(path)
    (folder / "submit.sh").write_text("#!/bin/bash\n# from the repository root: one job per row\nset -e\n"
                                      + "".join(f"sbatch {shlex.quote(str(p))}\n" for p in written))
    print(f"{len(written)} jobs written to {folder}; from the repository root: bash {folder / 'submit.sh'}, "
          f"then the same sweep.py command with --collect instead of --slurm")
    return written


def collect(out: Path, records: dict, manifest: dict) -> dict:
    """Every finished row's record, appended to OUT/rows.jsonl; returns all records."""
    for row in manifest["rows"]:
        job, row_dir = sweep_jobs.Job(**row), out / row["key"]
        ranks = sweep_jobs.read_ranks(row_dir)
        slurm = "".join(p.read_text(errors="replace") for p in sorted(row_dir.glob("slurm-*.out")))
        if job.key in records or not (ranks or slurm):
            continue
        ended = all(r.get("status") is not None for r in ranks) and len(ranks) == manifest["world"]
        statuses = [r["status"] for r in ranks if r.get("status") is not None]
        status = next((s for s in statuses if s), 0) if ended else None
        if "DUE TO TIME LIMIT" in slurm or status == STOPPED_BY_SIGNAL:
            how = "limit"
        elif ended:
            how = "exited"
        else:
            continue                                            # queued or running: the next --collect
        (row_dir / "output.log").write_text(slurm)
        records[job.key] = sweep_jobs.record_of(job, row_dir, status, how, 0.0, 0,
                                                (manifest["limit_s"], manifest["stall_s"]),
                                                manifest["tokens_per_step"])
        sweep_jobs.append(out, records[job.key])
    return records
