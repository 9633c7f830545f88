"""One command for a GPU session: every figure the README shows, recorded in a few minutes.

A GPU is lent by chance, for about 15 minutes, on a machine without network or `datasets`. This runs, in
order of priority, each stage in a child process with its own time limit:
  machine   nvidia-smi (clocks too), the driver, torch / CUDA / Triton versions, device and capability
  train     01's trainer on both 1B shapes, synthetic tokens: the headline rows and the baseline first
  tests     tests/test_kernels.py and tests/test_fp8.py compiled on the GPU
  bench     kernels/bench.py --quick; its .json and .md land in DIR
  train     the MFU matrix, one axis away from the headline first; then tests/test_gpu_trainers.py;
            then the rest of the matrix
A stage starts only while --budget-s lasts (the others are recorded as skipped). Each stage appends one
JSON record to DIR/records.jsonl as it ends, so a run cut short keeps what ran; one that fails or times
out records "failed" / "timeout" and the tail of its output (all of it: DIR/log.txt). Last,
kernels/report.py turns the records into DIR/section.md, the README section they give.

    python3 kernels/gpu_run.py --out DIR --budget-s 480   # on the GPU (DIR: the device tool's $OUT)
    python kernels/report.py --import-run DIR --write     # back here: keep the run, regenerate the README
    python kernels/gpu_run.py --out DIR --smoke           # CPU, tiny shapes (tests/test_gpu_run.py)
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu")]
from pathlib import Path

import argparse
import importlib.util
import itertools
import json
import math
import re
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

from kernels import report
from kernels.child_process import run_child
import metrics

ROOT = Path(ROOT)                                    # the repository, as a Path
STEPS = 10                       # report.WARM_UP_STEPS of them warm up, the rest are timed
SHAPES = {"llama3-1b": ["--preset", "llama3-1b"],                  # Llama-3.2-1B, vocab 128256, tied
          "1b-v32k": ["--preset", "1b", "--vocab-size", "32000"]}  # TinyLlama-1.1B's shape
TRAIN_FLAGS = ["--device", "cuda", "--dtype", "bfloat16", "--seq-len", "2048", "--mbs", "4",
               "--dataset", "synthetic"]
# The smoke run's model: the tiny preset on the default corpus (flags every checkout has)
SMOKE_FLAGS = ["--device", "cpu", "--dtype", "bfloat16", "--preset", "tiny", "--seq-len", "32", "--mbs", "1",
               "--dataset", "synthetic"]
MFU_CONVENTION = ("model FLOPs per token 6·N (matmul parameters) + 12·L·h·s (causal attention scores, "
                  "counted in full as PaLM does): 01_single_gpu/metrics.py")
KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_fp8.py"]
# The first shape of each kernel; torch.compile's column would cost a compile per kernel and pass
BENCH_ARGV = ["--quick", "--no-compile"]
CLOCKS = "clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu"


@dataclass(frozen=True)
class Row:
    """One cell of the MFU matrix: 01's trainer with these flags."""
    shape: str
    kernels: str
    attn: str
    precision_layout: str
    compile: bool
    grad_acc: int

    @property
    def name(self):
        return (f"{self.shape}_{self.kernels}_{self.attn}_{self.precision_layout}_"
                f"{'compile' if self.compile else 'eager'}_ga{self.grad_acc}")

    def flags(self):
        return ["--kernels", self.kernels, "--attn", self.attn, "--precision-layout", self.precision_layout,
                "--grad-acc", str(self.grad_acc), *(["--compile"] if self.compile else [])]


HEADLINE = dict(kernels="triton", attn="sdpa", precision_layout="bf16-20", compile=True, grad_acc=1)
BASELINE = dict(kernels="torch", attn="sdpa", precision_layout="autocast", compile=False, grad_acc=1)
# The headline's value first; the axes in the order their effect is wanted
AXES = {"kernels": ("triton", "torch"), "compile": (True, False), "attn": ("sdpa", "triton"),
        "precision_layout": ("bf16-20", "autocast"), "grad_acc": (1, 4)}


def matrix():
    """Every row, most wanted first: the headline on both shapes, the baseline, then by how many axes a
    row changes from the headline (one axis at a time shows what each technique adds), then by which."""
    rows = [Row(shape, **dict(zip(AXES, values))) for values in itertools.product(*AXES.values())
            for shape in SHAPES]

    def priority(row):
        axes = {k: getattr(row, k) for k in AXES}
        kept = [axes[k] == HEADLINE[k] for k in AXES]
        return axes != HEADLINE, axes != BASELINE, kept.count(False), kept
    return sorted(rows, key=priority)


# Triton's interpreter would take minutes a row on a CPU: tests/test_kernels.py covers those kernels there
SMOKE_ROWS = [Row("tiny", "torch", "sdpa", "bf16-20", False, 1),
              Row("tiny", "torch", "sdpa", "autocast", False, 2)]


def machine(log, env):
    """The machine's fields every record carries, and DIR/machine.txt's text."""
    probe = ("import json, platform, torch, triton; cuda = torch.cuda.is_available(); print(json.dumps(dict("
             "device=torch.cuda.get_device_name() if cuda else 'cpu', torch=torch.__version__, "
             "cuda=torch.version.cuda, triton=triton.__version__, python=platform.python_version(), "
             "capability='.'.join(map(str, torch.cuda.get_device_capability())) if cuda else None)))")
    status, _, output = run_child([sys.executable, "-c", probe], 120, log, env)
    if status != "ok":
        raise SystemExit(f"the machine probe failed:\n{output[-3000:]}")
    fields = json.loads(output.strip().splitlines()[-1])
    text, clocks = [f"$ python: {fields}"], None
    for command in (["nvidia-smi"], ["nvidia-smi", f"--query-gpu={CLOCKS}", "--format=csv"],
                    ["nvidia-smi", "-q", "-d", "CLOCK"], ["nvcc", "--version"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            text.append(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as error:
            text.append(f"$ {' '.join(command)}\n{type(error).__name__}: {error}")
            continue
        lines = done.stdout.splitlines()
        if CLOCKS in command[1] and done.returncode == 0 and len(lines) >= 2:
            # csv: a header naming each field and its unit, then the first GPU's values
            clocks = dict(zip(lines[0].split(", "), lines[1].split(", ")))
    driver = re.search(r"Driver Version: (\S+)", "\n".join(text))
    fields.update(driver=driver.group(1) if driver else None, clocks=clocks,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  datasets_installed=importlib.util.find_spec("datasets") is not None)
    return fields, "\n".join(text)


def flag(flags, name: str) -> str:
    return flags[flags.index(name) + 1]


def train_record(row: Row, flags, status: str, output: str, json_log: Path, device: str) -> dict:
    """What a trainer run measured: medians over the timed steps, the allocator's peak, its shape. The
    peak is the largest `mem X GiB` of 01's step lines (torch.cuda.max_memory_allocated; none on a CPU)."""
    steps = [json.loads(line) for line in json_log.read_text().splitlines()] if json_log.exists() else []
    timed = steps[report.WARM_UP_STEPS:]
    vocab = re.search(r"LlamaConfig\(vocab_size=(\d+)", output)
    parameters = re.search(r"model: ([\d.]+)M parameters", output)
    peaks = [float(g) for g in re.findall(r"\| mem ([\d.]+)GiB", output)]

    def median(key):   # MFU is null where the trainer knows no peak FLOP/s (a CPU)
        return statistics.median(s[key] for s in timed) if timed and timed[0][key] is not None else None
    losses = [s["loss"] for s in steps]
    if status == "ok" and not (timed and all(v is not None and math.isfinite(v) for v in losses)):
        status = "failed"
    return dict(asdict(row), stage="train", name=row.name, status=status,
                vocab_size=int(vocab.group(1)) if vocab else None,
                parameters_m=float(parameters.group(1)) if parameters else None,
                dataset=flag(flags, "--dataset") if "--dataset" in flags else "stdlib",
                seq_len=int(flag(flags, "--seq-len")), mbs=int(flag(flags, "--mbs")), steps=len(steps),
                timed_steps=len(timed), tokens_per_s=median("tokens_per_s"), mfu=median("mfu"),
                hfu=median("hfu"), mfu_convention=MFU_CONVENTION,
                peak_tflops=next((v for k, v in metrics.PEAK_TFLOPS.items() if k in device), None),
                peak_memory_gib=max(peaks) if peaks else None, losses=losses,
                per_step=[{k: s[k] for k in ("tokens_per_s", "mfu")} for s in steps])


def tests_record(files, status: str, junit: Path) -> dict:
    """Counts and failing names from pytest's JUnit XML."""
    record = dict(stage="tests", files=files, status=status)
    if junit.exists():
        import xml.etree.ElementTree as ET
        cases = list(ET.parse(junit).getroot().iter("testcase"))
        counts = [next((t.tag for t in c if t.tag in ("failure", "error", "skipped")), "passed")
                  for c in cases]
        record.update({k: counts.count(k) for k in ("passed", "failure", "error", "skipped")},
                      failed_names=[f"{c.get('classname')}::{c.get('name')}" for c, o in zip(cases, counts)
                                    if o in ("failure", "error")])
    return record


def bench_child(out: Path, smoke: bool):
    """kernels/bench.py with its results written into `out`; --smoke: its CPU code path, tiny shapes."""
    from kernels import bench
    bench.RESULTS = out
    if not smoke:
        return bench.main(BENCH_ARGV)
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
    rows, memory = bench.run_all(argparse.Namespace(quick=True, compile=False), wall_clock_ms, peaks)
    meta = dict(device="cpu smoke", torch=torch.__version__, triton=triton.__version__, cuda=None,
                date=time.strftime("%Y-%m-%d"))
    bench.write_results(meta, peaks, rows, memory)


def bench_record(out: Path, status: str) -> dict:
    """The bench's rows as it wrote them (with "gpu_ms" / "launches" where this bench.py writes them)."""
    written = sorted(p for p in out.glob("*.json"))
    result = json.loads(written[-1].read_text()) if written else {}
    rows = result.get("rows", [])
    return dict(stage="bench", status=status if rows else "failed", argv=BENCH_ARGV, file=written[-1].name
                if written else None, rows=len(rows), failed_rows=sum(r.get("ms") is None for r in rows),
                fields=sorted({k for r in rows for k in r}), peaks=result.get("peaks"))


def plan(smoke: bool):
    """The stages in order: (kind, what, time limit s, least time left to start it)."""
    if smoke:
        return ([("train", row, 300, 0) for row in SMOKE_ROWS]
                + [("tests", ["tests/test_fp8.py", "-k", "quantization and e4m3 and tensor"], 300, 0),
                   ("bench", None, 300, 0)])
    rows = matrix()

    def train(rows):   # compiling a layer takes about a minute the first time
        return [("train", r, 240 if r.compile else 120, 60 if r.compile else 40) for r in rows]
    return (train(rows[:4]) + [("tests", KERNEL_TESTS, 200, 60), ("bench", None, 180, 60)] + train(rows[4:14])
            + [("tests", ["tests/test_gpu_trainers.py"], 240, 120)] + train(rows[14:]))


def run_stage(kind, what, limit_s, out: Path, scratch: Path, smoke: bool, log, env, device: str) -> dict:
    """Run one stage in a child process and return its record."""
    if kind == "train":
        flags = [*(SMOKE_FLAGS if smoke else TRAIN_FLAGS + SHAPES[what.shape]), *what.flags()]
        json_log = scratch / f"{what.name}.jsonl"
        command = [sys.executable, "01_single_gpu/train.py", *flags, "--steps", str(3 if smoke else STEPS),
                   "--log-every", "1", "--no-progress", "--json-log", str(json_log)]
        status, seconds, output = run_child(command, limit_s, log, env)
        record = train_record(what, flags, status, output, json_log, device)
    elif kind == "tests":
        junit = scratch / f"junit-{time.monotonic_ns()}.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                   *what]
        status, seconds, output = run_child(command, limit_s, log, env)
        record = tests_record(what, status, junit)
    else:
        command = [sys.executable, "kernels/gpu_run.py", "--out", str(out), "--bench-child",
                   *(["--smoke"] if smoke else [])]
        status, seconds, output = run_child(command, limit_s, log, env)
        record = bench_record(out, status)
    record.update(seconds=round(seconds, 1), command=" ".join(command[1:]))
    if record["status"] != "ok":
        record["output_tail"] = output[-3000:]
    return record


def skipped(kind, what, left_s: float, least_s: float) -> dict:
    record = dict(asdict(what), name=what.name) if kind == "train" else {"files": what} if what else {}
    return dict(record, stage=kind, status="skipped",
                reason=f"budget: {left_s:.0f} s left, it needs {least_s} s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for this run's files (on the GPU: $OUT)")
    p.add_argument("--budget-s", type=float, default=480, help="start no stage after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few stages: checks this script")
    p.add_argument("--bench-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.bench_child:
        return bench_child(args.out, args.smoke)
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
            print(f"gpu_run: {record['stage']} {record.get('name') or record.get('files') or ''}: "
                  f"{record['status']} ({record.get('seconds', 0)} s)", flush=True)
        keep(dict(stage="machine", status="ok"))
        for kind, what, limit_s, least_s in plan(args.smoke):
            left = deadline - time.perf_counter()
            if left < max(least_s, 1):
                keep(skipped(kind, what, left, least_s))
                continue
            keep(run_stage(kind, what, min(limit_s, left), args.out, Path(scratch), args.smoke, log, env,
                           fields["device"]))
    (args.out / "section.md").write_text(report.run_section(args.out) + "\n")
    print(f"gpu_run: wrote {args.out}/records.jsonl, log.txt, machine.txt, section.md")


if __name__ == "__main__":
    main()
