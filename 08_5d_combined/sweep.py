"""Which layout is fastest here, and how far off is the planner? Each layout run a few steps, side by side.

Playbook §3.5 (lessons from benchmarking every layout) and chapter 3's planner (planner.py --search). For a
model (the trainer's flags after `--`), a world size and a global batch, the rows are the planner's ranked
layouts (--search, its --top) or the user's (--layouts dp=2,tp=2 ...). Each row is a job of its own
(sweep_jobs.py: torchrun, or forked ranks on the CPU) running 08's trainer for --steps steps under a time
limit, every rank under sweep_rank.py. Each finished row appends one JSON record to OUT/rows.jsonl: tokens/s,
MFU, peak memory and communication per rank, the outcome (ok / out of memory / timed out / failed, with the
line that says why), and the planner's prediction for the same layout (step_time.estimate, with the links
of --bandwidths FILE or the typed ones). A rerun skips the rows recorded. At the end: the table sorted by
measured speed, the predicted rank beside it, and OUT/sweep.png, measured against predicted step time
(sweep_report.py). --slurm writes one sbatch job per row from train.sbatch instead; --collect gathers them.

    python 08_5d_combined/sweep.py --world 4 --global-batch 16 --search --top 6 --out sweep \\
        --precision fp32 --peak-tflops 0.05 --bandwidths links.jsonl -- --seq-len 128 --dataset synthetic
    python 08_5d_combined/sweep.py --world 4 --global-batch 16 --layouts dp=4 tp=2,dp=2 pp=2,dp=2,m=2 \\
        --out sweep --precision fp32 -- --seq-len 128

A row: `dp=2,tp=2,pp=1,cp=1,ep=1,sp=1,zero=1,recompute=full,schedule=1f1b,chunks=1,mbs=2,m=4` (any subset;
mbs and m follow from the batch), then trainer flags of that row alone after a space.
New compared with planner.py: the machine's answer beside the planner's.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel"), os.path.join(ROOT, "03_zero"),
                os.path.join(ROOT, "04_tensor_parallel"), os.path.join(ROOT, "05_sequence_context_parallel"),
                os.path.join(ROOT, "06_pipeline"), os.path.join(ROOT, "07_expert_parallel"),
                os.path.join(ROOT, "08_5d_combined")]

import argparse
import gc
import hashlib
import importlib
import json
import runpy
import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import cli
import plan_arithmetic
import planner
import search
import search_report
import step_time
import sweep_jobs
import sweep_report
import sweep_slurm

KEYS = dict(dp="dp", tp="tp", pp="pp", cp="cp", ep="ep", sp="sp", zero="zero_stage", recompute="recompute",
            schedule="schedule", chunks="chunks")
PRECISION = {"fp32": ["--dtype", "float32"], "fp64": ["--dtype", "float64"],
             "mixed": ["--dtype", "bfloat16", "--precision-layout", "bf16-16"],
             "mixed-fp32-grads": ["--dtype", "bfloat16", "--precision-layout", "bf16-20"]}
SET_BY_THE_SWEEP = ("--dp", "--tp", "--pp", "--cp", "--ep", "--sp", "--zero-stage", "--recompute", "--mbs",
                    "--grad-acc", "--pp-schedule", "--pp-chunks", "--steps", "--json-log", "--dtype",
                    "--precision-layout")


@dataclass(frozen=True)
class Row:
    """One layout of the sweep: its Layout, micro-batch, micro-batches per step, and its own flags."""
    layout: plan_arithmetic.Layout
    mbs: int
    m: int
    extra: tuple = ()

    @property
    def key(self) -> str:
        lay = self.layout
        name = (f"dp{lay.dp}-tp{lay.tp}{'sp' if lay.sp else ''}-pp{lay.pp}-cp{lay.cp}-ep{lay.ep}-zero"
                f"{lay.zero_stage}-{lay.recompute}-{lay.schedule}{lay.chunks}-mbs{self.mbs}-m{self.m}")
        extra = hashlib.sha1(shlex.join(self.extra).encode()).hexdigest()[:6]
        return name + (f"-{extra}" if self.extra else "")

    def flags(self) -> list:
        lay = self.layout
        return [*(f"--{d}={getattr(lay, d)}" for d in ("dp", "tp", "pp", "cp", "ep")), *["--sp"] * lay.sp,
                f"--zero-stage={lay.zero_stage}", f"--recompute={lay.recompute}",
                f"--pp-schedule={lay.schedule}", f"--pp-chunks={lay.chunks}", f"--mbs={self.mbs}",
                f"--grad-acc={self.m}", *self.extra]


def parse_row(spec: str, base: plan_arithmetic.Layout, batch: int) -> Row:
    """`dp=2,tp=2,...[ trainer flags]` -> Row; a ValueError naming the fix."""
    words = shlex.split(spec)
    values = dict(part.split("=", 1) for part in words[0].split(",") if "=" in part) if words else {}
    unknown = sorted(set(values) - set(KEYS) - {"mbs", "m"})
    if not words or unknown or len(values) != words[0].count(",") + 1:
        raise ValueError(f"--layouts {spec!r}: a row is key=value[,key=value...] with keys "
                         f"{', '.join([*KEYS, 'mbs', 'm'])}, then that row's own trainer flags")
    try:
        fields = {KEYS[k]: (v if k in ("recompute", "schedule") else int(v)) for k, v in values.items()
                  if k in KEYS}
        layout = replace(base, **{**fields, "sp": bool(fields.get("sp", 0))})
        m = int(values.get("m", 1 if layout.pp == 1 else 2 * layout.pp))
        mbs = int(values.get("mbs", batch // max(layout.dp * m, 1)))
    except ValueError:
        raise ValueError(f"--layouts {spec!r}: the degrees, zero, chunks, mbs and m are integers") from None
    if layout.dp * mbs * m != batch:
        raise ValueError(f"--layouts {spec!r}: dp·mbs·m = {layout.dp}·{mbs}·{m} is not the global batch "
                         f"{batch}")
    return Row(layout, mbs, m, tuple(words[1:]))


def estimate(config, row: Row, args, cluster):
    """step_time's plan of the row: its step time and parts (seconds), and its memory."""
    memory = step_time.peak_memory(config, row.layout, args.seq_len, row.mbs, row.m)
    return step_time.estimate(config, row.layout, args.seq_len, row.mbs, row.m, cluster, memory)


def prediction(plan, rank: int) -> dict:
    """What a record keeps of the planner's plan: the step time, its compute and exposed communication, the
    bubble, the memory, and its rank among the rows (search.rank's order: within 1% the rules decide)."""
    exposed = sum(plan.times[d] for d in ("tp", "cp", "pp", "ep", "dp"))
    return dict(step_s=plan.times["step"], compute_s=plan.times["compute"], bubble=plan.bubble,
                memory=plan.memory, comm_s=exposed, rank=rank)


def rows_and_predictions(sweep, args_of, parser) -> list:
    """[(Row, prediction)]: the planner's --top fastest (--search), or the user's rows ranked by the model.
    `args_of(extra)`: the planner's flags with a row's own trainer flags (its model) added."""
    args, batch = args_of([]), sweep.global_batch
    config, cluster = search.model_config(args), step_time.cluster_of(args)
    if sweep.search:
        plans = search.search(args, config, cluster, batch)[0][:args.top]
        rows = [Row(plan.layout, plan.mbs, plan.m) for plan in plans]
        return [(row, prediction(estimate(config, row, args, cluster), k)) for k, row in enumerate(rows, 1)]
    rows, plans = [], []
    for spec in sweep.layouts:
        try:
            args = args_of(shlex.split(spec)[1:])
            config = search.model_config(args)
            base = plan_arithmetic.Layout(num_experts=args.num_experts, top_k=args.top_k,
                                          cp_attn=args.cp_attn, shared_experts=args.shared_experts,
                                          precision=args.precision)
            row = parse_row(spec, base, batch)
            lay = row.layout
            search.check_rules(args, config, dp=lay.dp, tp=lay.tp, sp=lay.sp, cp=lay.cp, pp=lay.pp, ep=lay.ep,
                               pp_schedule=lay.schedule, pp_chunks=lay.chunks, grad_acc=row.m,
                               zero_stage=lay.zero_stage, recompute=lay.recompute)
            check(sweep, row.extra)
        except ValueError as error:
            parser.error(str(error) if spec in str(error) else f"--layouts {spec!r}: {error}")
        if lay.dp * lay.tp * lay.pp * lay.cp != sweep.world:
            parser.error(f"--layouts {spec!r}: dp·tp·pp·cp is not --world {sweep.world}")
        rows.append(row)
        plans.append(estimate(config, row, args, step_time.cluster_of(args)))
    order = [id(plan) for plan in search.rank(plans)]
    return [(row, prediction(plan, order.index(id(plan)) + 1)) for row, plan in zip(rows, plans)]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                epilog="Other flags before `--` go to the planner (--precision, "
                                       "--peak-tflops, --bandwidths, --gpu, --mfu, --search-*, --top); after "
                                       "`--`, the model's and trainer's flags, passed to every job.")
    p.add_argument("--world", type=int, required=True, help="ranks per job (the planner's --gpus)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    rows = p.add_mutually_exclusive_group(required=True)
    rows.add_argument("--search", action="store_true", help="the planner's --top fastest layouts")
    rows.add_argument("--layouts", nargs="+", metavar="ROW", help="rows such as dp=2,tp=2 (module docstring)")
    p.add_argument("--out", required=True, help="the sweep's folder: rows.jsonl, a folder per row, the plot")
    p.add_argument("--steps", type=int, default=5, help="steps per row; the first is left out of the medians")
    p.add_argument("--limit-s", type=float, default=900.0, help="a row still running then is ended")
    p.add_argument("--stall-s", type=float, default=300.0, help="a row silent this long is ended (a hang)")
    p.add_argument("--memory-limit-gb", type=float, help="RLIMIT_DATA per rank (CPU: a device's memory)")
    p.add_argument("--launcher", choices=["torchrun", "fork"], default="torchrun",
                   help="fork: ranks forked from the sweep, which imported torch once (CPU only)")
    p.add_argument("--slurm", action="store_true", help="write one sbatch job per row instead of running")
    p.add_argument("--collect", action="store_true", help="gather the Slurm jobs' records")
    p.add_argument("--gpus-per-node", type=int, default=8, help="per node (Slurm jobs; the planner's intra)")
    return p


def check(sweep, model_argv: list):
    """The sweep's own flags: a ValueError naming the fix, before any job."""
    if sweep.world < 1 or sweep.global_batch < 1 or sweep.steps < 2:
        raise ValueError("--world and --global-batch must be at least 1, --steps at least 2 (the first step "
                         "is left out of the medians)")
    if not (0 < sweep.limit_s and 0 < sweep.stall_s) or (sweep.memory_limit_gb or 1) <= 0:
        raise ValueError("--limit-s, --stall-s and --memory-limit-gb are positive numbers of seconds, GB")
    given = sorted({word.split("=")[0] for word in model_argv} & set(SET_BY_THE_SWEEP))
    if given:
        raise ValueError(f"{', '.join(given)} after `--`: the sweep sets these per row; give the layouts "
                         f"with --search or --layouts, the precision with --precision")
    if sweep.launcher == "fork" and "cuda" in model_argv:
        raise ValueError("--launcher fork runs CPU ranks only: use torchrun for --device cuda")


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    sweep, planner_argv = parser.parse_known_args(argv[:split])
    model_argv = argv[split + 1:]
    try:
        check(sweep, model_argv)
    except ValueError as error:
        parser.error(str(error))
    def args_of(extra: list):
        args = cli.parse_args(planner.build_parser(), planner_argv + model_argv + extra, files=False)
        return cli.with_values(args, gpus=sweep.world, global_batch_tokens=sweep.global_batch * args.seq_len)
    args = args_of([])
    try:
        search.model_config(args)
        search_report.check_search(args)
    except ValueError as error:
        parser.error(str(error))
    out, manifest = Path(sweep.out), Path(sweep.out) / "sweep.json"
    settings = dict(world=sweep.world, global_batch=sweep.global_batch, steps=sweep.steps, model=model_argv,
                    planner=planner_argv)
    before = json.loads(manifest.read_text()) if manifest.exists() else None
    if before and {k: before.get(k) for k in settings} != settings:
        parser.error(f"--out {out} holds a sweep of other settings ({manifest}): pass another --out")
    if sweep.collect:
        if not before:
            parser.error(f"--collect: {manifest} does not exist; run sweep.py --slurm with --out {out} first")
        return sweep_report.finish(out, sweep_slurm.collect(out, sweep_jobs.read_records(out), before))
    rows = rows_and_predictions(sweep, args_of, parser)
    jobs = [sweep_jobs.Job(row.key, row.flags(), predicted, asdict(row.layout) | dict(mbs=row.mbs, m=row.m))
            for row, predicted in rows]
    out.mkdir(parents=True, exist_ok=True)
    known = {row["key"]: row for row in (before or {}).get("rows", [])}
    known.update({job.key: asdict(job) for job in jobs})       # a rerun may add rows
    manifest.write_text(json.dumps(dict(settings, limit_s=sweep.limit_s, stall_s=sweep.stall_s,
                                        tokens_per_step=sweep.global_batch * args.seq_len,
                                        rows=list(known.values())), indent=1))
    trainer = model_argv + PRECISION[args.precision] + (["--peak-tflops", str(args.peak_tflops)]
                                                       if args.peak_tflops else [])
    if sweep.slurm:
        return sweep_slurm.emit(out, jobs, trainer, sweep)
    if any(job.key not in sweep_jobs.read_records(out) for job in jobs):
        if sweep.launcher == "fork":   # the imports every forked rank shares, out of the collector's sight
            runpy.run_path(os.path.join(ROOT, "08_5d_combined", "train.py"), run_name="sweep_preload")
            importlib.import_module("torch._dynamo")  # what the first parameter initialisation imports
            gc.freeze()
        sweep_jobs.adopt_orphans()
    records = sweep_jobs.run_all(out, jobs, trainer, sweep, sweep.global_batch * args.seq_len)
    return sweep_report.finish(out, records)


if __name__ == "__main__":
    main()
