"""One command for a GPU session: every figure of results/latest.md, the most wanted first, in one call.

A GPU is lent by chance, for about 15 minutes, on a machine without network or `datasets`, in calls of at
most 600 s. This runs each stage in a child process with its own time limit, in order of value (`--plan`
prints them):
  machine   nvidia-smi (clocks too), the driver, torch / CUDA / Triton versions, device and capability
  train     the llama3-1b eager baseline (the row known to run)
  bench     FlashAttention vs SDPA-flash, then the fused linear + cross-entropy vs eager, then RMSNorm, SwiGLU
            and RoPE: kernels/bench.py at each kernel's largest shape, every row written as it finishes
  train     the compiled headline, llama3-1b then 1b-v32k (the first step, compiles, timed apart)
  tests     tests/test_kernels.py and tests/test_fp8.py compiled on the GPU, in parallel shards
  nccl      02's bench_collectives.py and 08's sweep.py (a 1B row, the planner's prediction beside it) at
            world 1: the NCCL path (its bus bandwidth is 0 at n = 1 by definition)
  train     the rest of the MFU matrix, one axis away from the headline first, tests/test_gpu_trainers.py
The stages up to the tests fit the default budget even if each runs to its limit; the rest start only while
--budget-s lasts (else recorded as skipped). Each appends one JSON record to DIR/records.jsonl as it ends;
a failed or cut one records "failed" / "timeout" and its output's tail (all of it: DIR/log.txt). Last,
kernels/report.py turns the records into DIR/section.md, the part of results/latest.md they give.

    python3 kernels/gpu_run.py --out DIR                # on the GPU (DIR: the device tool's $OUT)
    python kernels/gpu_run.py --plan                    # the stages and their limits, nothing run
    python kernels/report.py --import-run DIR --write   # back here: keep the run, rewrite results/latest.md
    python kernels/gpu_run.py --out DIR --smoke         # CPU, tiny shapes (tests/test_gpu_run.py)
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime")]
from pathlib import Path

import argparse
import json
import math
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

import cli
from kernels import gpu_records, report
from kernels.gpu_matrix import AXES, BASELINE, HEADLINE, SHAPES, Row, matrix  # noqa: F401 (tests read them here)
from kernels.gpu_records import machine
from kernels.child_process import GRACE_S, run_child, run_logged

ROOT = Path(ROOT)                                    # the repository, as a Path
DEVICE_CALL_S = 600    # the device tool's longest call
DEFAULT_BUDGET_S = 540
# The machine probe (inside the budget); after the last stage: its children's SIGTERM grace, the report
PROBE_S, AFTER_S = 15, GRACE_S + 20
STEPS = 10                       # report.WARM_UP_STEPS of them warm up, the rest are timed
TRAIN_FLAGS = ["--device", "cuda", "--dtype", "bfloat16", "--seq-len", "2048", "--mbs", "4",
               "--dataset", "synthetic"]
# The smoke run's model: the tiny preset on synthetic tokens (flags every checkout has)
SMOKE_FLAGS = ["--device", "cpu", "--dtype", "bfloat16", "--preset", "tiny", "--seq-len", "32", "--mbs", "1",
               "--dataset", "synthetic"]
KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_fp8.py"]
TEST_SHARDS = 8       # pytest processes at once: Triton's compiles are CPU work, the machine has 16 cores
# Timed on the GPU: run after the shards, alone, so no other process shares the GPU's time
ALONE = ["tests/test_kernels.py::test_gpu_time_hides_the_host"]
# The bench's stages: kernels/bench.py --only each group, at its largest shape, with the GPU time
BENCH_GROUPS = [("attention",), ("linear+cross-entropy",), ("rmsnorm", "swiglu", "rope")]
BENCH_ARGV = ["--largest", "--no-compile"]
# 08's sweep at world 1: one 1B row on the GPU (tiny on the CPU), measured beside the planner's prediction
SWEEP_MODEL = ["--preset", "1b", "--vocab-size", "32000", "--seq-len", "2048", "--dataset", "synthetic"]


# Triton's interpreter would take minutes a row on a CPU: tests/test_kernels.py covers those kernels there
SMOKE_ROWS = [Row("tiny", "torch", "sdpa", "bf16-20", False, 1),
              Row("tiny", "torch", "sdpa", "autocast", False, 2)]
SMOKE_TESTS = ["tests/test_fp8.py", "-k", "quantization and e4m3 and (tensor or 1x128)"]


@dataclass(frozen=True)
class Stage:
    kind: str          # "train", "bench", "tests" or "nccl"
    what: object       # a Row; the bench's kernels; pytest's arguments; ("collectives",) or ("sweep",)
    limit_s: float     # its time limit (cut to what is left of the budget)
    least_s: float     # it starts only with this much of the budget left
    shards: int = 1    # tests: pytest processes at once

    @property
    def name(self):
        return self.what.name if self.kind == "train" else " ".join(self.what)


def plan(smoke: bool):
    """The stages in order. Those before the rest of the matrix (`priority`) fit DEFAULT_BUDGET_S together."""
    if smoke:
        return [Stage("train", SMOKE_ROWS[0], 300, 0), Stage("bench", ("attention", "rmsnorm"), 300, 0),
                Stage("train", SMOKE_ROWS[1], 300, 0), Stage("tests", SMOKE_TESTS, 300, 0, shards=2),
                Stage("nccl", ("collectives",), 300, 0), Stage("nccl", ("sweep",), 300, 0)]
    baseline, headline, headline_v32k = (Row("llama3-1b", **BASELINE), Row("llama3-1b", **HEADLINE),
                                         Row("1b-v32k", **HEADLINE))
    rest = [r for r in matrix() if r not in (baseline, headline, headline_v32k)]

    train = lambda row: Stage("train", row, *((150, 60) if row.compile else (120, 40)))  # noqa: E731
    return ([Stage("train", baseline, 60, 40), Stage("bench", BENCH_GROUPS[0], 50, 30),
             Stage("bench", BENCH_GROUPS[1], 35, 25), Stage("bench", BENCH_GROUPS[2], 35, 25),
             Stage("train", headline, 150, 90), Stage("train", headline_v32k, 100, 60),
             Stage("tests", KERNEL_TESTS, 95, 45, shards=TEST_SHARDS),
             Stage("nccl", ("collectives",), 60, 30), Stage("nccl", ("sweep",), 120, 60)]
            + [train(r) for r in rest[:12]] + [Stage("tests", ["tests/test_gpu_trainers.py"], 240, 120)]
            + [train(r) for r in rest[12:]])


def priority(stages):
    """The stages the default budget always reaches: every one before the rest of the matrix."""
    return stages[:next(i for i, s in enumerate(stages) if s.kind == "tests") + 1]


def show_plan(stages, budget_s: float):
    print(f"{'':>3} {'stage':<6} {'what':<58} {'limit s':>8} {'starts with s left':>19}")
    for i, s in enumerate(stages, 1):
        shards = f" ({s.shards} shards)" if s.shards > 1 else ""
        print(f"{i:>3} {s.kind:<6} {s.name + shards:<58} {s.limit_s:>8.0f} {s.least_s:>19.0f}")
    first = priority(stages)
    print(f"stages 1-{len(first)} take at most {sum(s.limit_s for s in first):.0f} s, the machine probe "
          f"{PROBE_S} s: within --budget-s {budget_s:.0f}; the rest run while it lasts")


def run_stage(stage: Stage, limit_s, out: Path, scratch: Path, smoke: bool, log, env, device: str) -> dict:
    """Run one stage in its child process(es) and return its record."""
    if stage.kind == "train":
        row = stage.what
        flags = [*(SMOKE_FLAGS if smoke else TRAIN_FLAGS + SHAPES[row.shape]), *row.flags()]
        json_log = scratch / f"{row.name}.jsonl"
        command = [sys.executable, "01_single_gpu/train.py", *flags, "--steps", str(3 if smoke else STEPS),
                   "--log-every", "1", "--no-progress", "--json-log", str(json_log)]
        status, seconds, output = run_child(command, limit_s, log, env)
        record = gpu_records.train_record(row, flags, status, output, json_log, device)
    elif stage.kind == "nccl":
        command, written = nccl_command(stage.what[0], limit_s, scratch, smoke, device)
        status, seconds, output = run_child(command, limit_s, log, env)
        record = gpu_records.nccl_record(stage.what[0], status, written)
    elif stage.kind == "tests":
        command, status, seconds, shards = run_tests(stage, limit_s, scratch, log, env)
        record = gpu_records.tests_record(stage.what, status, shards)
        output = "".join(text for _, text in shards)
    else:
        bench = (["kernels/gpu_run.py", "--out", str(out), "--bench-child", "--smoke"] if smoke
                 else ["kernels/bench.py", *BENCH_ARGV, "--append", "--results", str(out)])
        command = [sys.executable, *bench, "--only", *stage.what]
        status, seconds, output = run_child(command, limit_s, log, env)
        record = gpu_records.bench_record(out, stage.what, status, BENCH_ARGV)
    record.update(what=stage.name, seconds=round(seconds, 1), limit_s=round(limit_s),
                  command=" ".join(command[1:]))
    if record["status"] != "ok":
        record["output_tail"] = output[-3000:]
    return record


def run_tests(stage: Stage, limit_s, scratch: Path, log, env):
    """pytest in stage.shards processes at once (kernels/pytest_shard.py), then the ALONE tests by
    themselves; each prints a line per test as it ends (-v) and writes JUnit XML when it finishes."""
    selected = [t for t in ALONE if t.split("::")[0] in stage.what]
    t0 = time.perf_counter()

    def pytest(name, *argv):
        junit = scratch / f"junit-{name}-{time.monotonic_ns()}.xml"
        return junit, [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={junit}",
                       *argv]
    runs = [pytest(f"shard{i}", "-p", "kernels.pytest_shard", "--shard", f"{i}/{stage.shards}", *stage.what,
                   *(f"--deselect={t}" for t in selected)) for i in range(stage.shards)]
    statuses = run_logged([c for _, c in runs], limit_s, scratch, log, env)
    if selected and time.perf_counter() - t0 < limit_s - 1:
        runs.append(pytest("alone", *selected))
        statuses += run_logged([runs[-1][1]], limit_s - (time.perf_counter() - t0), scratch, log, env)
    worst = next((s for s in ("timeout", "failed") if s in [status for status, _ in statuses]), "ok")
    shards = [(junit, text) for (junit, _), (_, text) in zip(runs, statuses)]
    return runs[0][1], worst, time.perf_counter() - t0, shards


def nccl_command(what: str, limit_s, scratch: Path, smoke: bool, device: str):
    """(command, the JSON lines it writes) of an nccl stage: 02's collectives in a world of one (its own
    store, no torchrun), or one row of 08's sweep under torchrun (forked ranks on the CPU)."""
    if what == "collectives":
        written = scratch / "collectives.jsonl"
        size = ["--device", "cpu", "--max-bytes", "4K", "--iters", "2"] if smoke else ["--device", "cuda"]
        command = [sys.executable, "02_data_parallel/bench_collectives.py", *size, "--out", str(written)]
        return command, written
    # the planner's datasheet for this GPU (its peak FLOP/s): step_time.GPUS's names
    gpu = [["--gpu", name] for name in ("h200", "h100", "a100") if name in device.lower()][:1]
    where = ["--launcher", "fork", "--steps", "2"] if smoke else ["--steps", str(STEPS), *sum(gpu, [])]
    model = ["--seq-len", "32", "--dataset", "synthetic"] if smoke else [*SWEEP_MODEL, "--device", "cuda"]
    batch = "2" if smoke else "4"
    limit = f"{max(limit_s - 20, 10):.0f}"           # the sweep's own report after the row fits the stage's
    return [sys.executable, "08_5d_combined/sweep.py", "--world", "1", "--global-batch", batch, "--layouts",
            f"mbs={batch}", "--out", str(scratch / "sweep"), "--limit-s", limit, *where, "--", *model], \
        scratch / "sweep" / "rows.jsonl"


def skipped(stage: Stage, left_s: float) -> dict:
    return dict(dict(asdict(stage.what), name=stage.name) if stage.kind == "train" else {"what": stage.name},
                stage=stage.kind, status="skipped", reason=f"budget: {left_s:.0f} s left, it needs "
                                                           f"{stage.least_s:.0f} s")


def bench_child(out: Path, only):
    """--smoke's bench stage: kernels/bench.py's CPU code path at tiny shapes, written into `out`."""
    from kernels import bench
    import torch
    import triton
    bench.DEVICE, bench.DTYPE = "cpu", torch.float32
    bench.ROW_SHAPES, bench.ATTN_SHAPES = [(20, 256, 48)], [(1, 2, 1, 20, 16)]    # hd 128 RoPE: C >= 128
    bench.CE_SHAPES = [(12, 32, 96)]

    def wall_clock_ms(fn):   # no CUDA events on the CPU: this checks the code path, not the speed
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    peaks = {"matmul_bf16_tflops": 1.0, "copy_gbps": 1.0}
    meta = dict(device="cpu smoke", torch=torch.__version__, triton=triton.__version__, cuda=None,
                date=time.strftime("%Y-%m-%d"))
    write = lambda rows, memory: bench.write_results(meta, peaks, rows, memory, out, quiet=True)  # noqa: E731
    bench.run_all(argparse.Namespace(quick=False, largest=True, compile=False, only=only), wall_clock_ms,
                  peaks, on_row=write)


def parse(argv):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for this run's files (on the GPU: $OUT)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="start no stage after this (s)")
    p.add_argument("--plan", action="store_true", help="print the stages and their limits; run nothing")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few stages: checks this script")
    p.add_argument("--bench-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--only", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bench_child:
        return args
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        p.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if args.plan:
        return args
    import torch
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA GPU is visible: run this on the GPU machine, or pass --smoke to check it on the CPU")
    if args.out is None:
        p.error("--out DIR is required: the folder for this run's files (on the GPU: $OUT)")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is a file: pass a folder (made if missing)")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "records.jsonl").write_text("")
    except OSError as error:
        p.error(f"--out {args.out} cannot be written ({error.strerror or error}): pass a folder this run can "
                f"make and write")
    return args


def main(argv=None):
    args = parse(argv)
    if args.plan:
        return show_plan(plan(args.smoke), args.budget_s)
    if args.bench_child:
        return bench_child(args.out, args.only)
    deadline = time.perf_counter() + args.budget_s
    # Triton's kernels run on the CPU only in its interpreter
    env = {"TRITON_INTERPRET": "1"} if args.smoke else {}
    with open(args.out / "log.txt", "wb") as log, open(args.out / "records.jsonl", "w") as records, \
            tempfile.TemporaryDirectory() as scratch:
        fields, text = machine(log, env)
        (args.out / "machine.txt").write_text(text)

        def keep(record):
            record = dict(fields, smoke=args.smoke, budget_s=args.budget_s, **record)
            records.write(json.dumps(record) + "\n")
            records.flush()
            print(f"gpu_run: {record['stage']} {record.get('name') or record.get('what') or ''}: "
                  f"{record['status']} ({record.get('seconds', 0)} s)", flush=True)
        keep(dict(stage="machine", status="ok"))
        for stage in plan(args.smoke):
            left = deadline - time.perf_counter()
            if left < max(stage.least_s, 1):
                keep(skipped(stage, left))
                continue
            try:
                keep(run_stage(stage, min(stage.limit_s, left), args.out, Path(scratch), args.smoke, log, env,
                               fields["device"]))
            except Exception:     # this stage's record is "failed"; the next stage still runs
                keep(dict(stage=stage.kind, what=stage.name, status="failed",
                          output_tail=traceback.format_exc()[-3000:]))
    (args.out / "section.md").write_text(report.run_section(args.out) + "\n")
    print(f"gpu_run: wrote {args.out}/records.jsonl, log.txt, machine.txt, section.md")


if __name__ == "__main__":
    main()
