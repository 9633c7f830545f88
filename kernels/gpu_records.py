"""What each kernels/gpu_run.py stage measured, read from the files its child process left.

A child can be cut off mid-write (its time limit, the lease ending): a JSON log whose last line is half a
record, a JUnit file never written or cut short. Each reader here takes what is whole and says what was
not, so a torn file makes that stage's record "failed" (with the reason) and the run goes on:
  train_record   01's --json-log (one JSON object per step) and its printed lines
  tests_record   pytest's JUnit XML per shard, else the per-test lines `pytest -v` printed as each test ended
  bench_record   the <device>.json bench.py rewrites after every row
and `machine`, the fields every record carries, from a probe of its own.
"""
import importlib.util
import json
import math
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

import metrics
from kernels.child_process import run_child
from kernels.report import WARM_UP_STEPS
MFU_CONVENTION = ("model FLOPs per token 6·N (matmul parameters) + 12·L·h·s (causal attention scores, "
                  "counted in full as PaLM does): 01_single_gpu/metrics.py")
CLOCKS = "clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu"
OUTCOMES = ("passed", "failure", "error", "skipped")
# pytest -v: "tests/test_x.py::test_y[param] PASSED  [ 12%]", printed as each test ends
TEST_LINE = re.compile(r"^(\S+\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)
VERDICT = {"PASSED": "passed", "XFAIL": "passed", "XPASS": "passed", "FAILED": "failure", "ERROR": "error",
           "SKIPPED": "skipped"}


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


def json_lines(path: Path) -> tuple:
    """(records, problem): the whole JSON objects of a JSON-lines file, and what was wrong, if anything."""
    if not path.exists():
        return [], None
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            return records, f"{path.name} line {number} is not whole JSON (a write cut short)"
    return records, None


def train_record(row, flags, status: str, output: str, json_log: Path, device: str) -> dict:
    """What a trainer run measured: medians over the timed steps, the allocator's peak, its shape, and the
    first step's seconds apart from a timed step's (the difference: torch.compile's tracing and Inductor's
    compile, Triton's autotuning, the first allocations). The peak is the largest `mem X GiB` of 01's step
    lines (torch.cuda.max_memory_allocated; none on a CPU)."""
    steps, problem = json_lines(json_log)
    timed = steps[WARM_UP_STEPS:]
    vocab = re.search(r"LlamaConfig\(vocab_size=(\d+)", output)
    parameters = re.search(r"model: ([\d.]+)M parameters", output)
    peaks = [float(g) for g in re.findall(r"\| mem ([\d.]+)GiB", output)]
    tokens_per_step = int(flag(flags, "--mbs")) * int(flag(flags, "--seq-len")) * int(flag(flags,
                                                                                             "--grad-acc"))
    seconds = [tokens_per_step / s["tokens_per_s"] for s in steps]

    def median(key):   # MFU is null where the trainer knows no peak FLOP/s (a CPU)
        return statistics.median(s[key] for s in timed) if timed and timed[0][key] is not None else None
    losses = [s["loss"] for s in steps]
    if status == "ok" and not (timed and all(v is not None and math.isfinite(v) for v in losses)):
        status = "failed"
    if problem:
        status = "failed"
    step_s = statistics.median(seconds[WARM_UP_STEPS:]) if timed else None
    return dict(asdict(row), stage="train", name=row.name, status=status,
                **({"problem": problem} if problem else {}),
                vocab_size=int(vocab.group(1)) if vocab else None,
                parameters_m=float(parameters.group(1)) if parameters else None,
                dataset=flag(flags, "--dataset") if "--dataset" in flags else "stdlib",
                seq_len=int(flag(flags, "--seq-len")), mbs=int(flag(flags, "--mbs")), steps=len(steps),
                timed_steps=len(timed), tokens_per_s=median("tokens_per_s"), mfu=median("mfu"),
                hfu=median("hfu"), mfu_convention=MFU_CONVENTION,
                peak_tflops=next((v for k, v in metrics.PEAK_TFLOPS.items() if k in device), None),
                peak_memory_gib=max(peaks) if peaks else None, losses=losses,
                first_step_s=round(seconds[0], 4) if seconds else None,
                step_s=round(step_s, 4) if step_s else None,
                per_step=[{k: s[k] for k in ("tokens_per_s", "mfu")} for s in steps])


def junit_outcomes(junit: Path) -> tuple:
    """({test: outcome}, problem) from one JUnit XML file."""
    if not junit.exists():
        return None, f"{junit.name} was not written (pytest did not finish)"
    try:
        cases = list(ET.parse(junit).getroot().iter("testcase"))
    except ET.ParseError as error:
        return None, f"{junit.name} is not whole XML ({error})"
    outcome = lambda case: next((t.tag for t in case if t.tag in OUTCOMES), "passed")  # noqa: E731
    # classname "tests.test_kernels" is the node id's "tests/test_kernels.py" (the tests are functions)
    return {f"{c.get('classname').replace('.', '/')}.py::{c.get('name')}": outcome(c) for c in cases}, None


def line_outcomes(output: str) -> dict:
    """{test: outcome} from the lines `pytest -v` printed; a test with two lines (an error in its
    teardown after it passed) keeps the worse."""
    outcomes = {}
    for test, word in TEST_LINE.findall(output):
        verdict = VERDICT[word]
        if outcomes.get(test) not in ("failure", "error"):
            outcomes[test] = verdict
    return outcomes


def tests_record(files, status: str, shards) -> dict:
    """Counts and failing names over the shards [(junit path, output)]: each shard's JUnit where whole,
    else its per-test lines (then the stage is 'failed' unless it timed out, and says why)."""
    outcomes, problems = {}, []
    for junit, output in shards:
        found, problem = junit_outcomes(junit)
        if problem:
            problems.append(problem)
            found = line_outcomes(output)
        outcomes.update(found)
    counts = [outcomes[t] for t in outcomes]
    if problems and status == "ok":
        status = "failed"
    record = dict(stage="tests", files=files, status=status, shards=len(shards),
                  **{k: counts.count(k) for k in OUTCOMES},
                  failed_names=[t for t, o in outcomes.items() if o in ("failure", "error")],
                  source="JUnit" if not problems else "per-test lines where JUnit was missing")
    return dict(record, problems=problems) if problems else record


def bench_record(out: Path, kernels, status: str, argv) -> dict:
    """This stage's rows of the <device>.json the bench rewrites after each row (gpu_ms and launches where
    bench.py measured them)."""
    written = sorted(out.glob("*.json"))
    problem, result = None, {}
    if written:
        try:
            result = json.loads(written[-1].read_text())
        except (OSError, json.JSONDecodeError) as error:
            problem = f"{written[-1].name} is unreadable ({error})"
    rows = [r for r in result.get("rows", []) if r["kernel"] in kernels]
    record = dict(stage="bench", kernels=list(kernels), status=status if rows else "failed", argv=argv,
                  file=written[-1].name if written else None, rows=len(rows),
                  failed_rows=sum(r.get("ms") is None for r in rows),
                  fields=sorted({k for r in rows for k in r}),
                  peaks=result.get("peaks"))
    return dict(record, problem=problem) if problem else record


def nccl_record(what: str, status: str, written: Path) -> dict:
    """02's collectives at world 1 (every result checked; bus bandwidth 0 but for broadcast's, by definition)
    or 08's sweep row beside the planner's prediction, from the JSON lines the child wrote."""
    rows, problem = json_lines(written)
    status = status if rows and not problem else "failed"
    if what == "collectives":
        wrong = [f"{r['collective']} {r['place']} {r['bytes']}" for r in rows if not r["correct"]]
        largest = {r["collective"]: r["algbw"] for r in rows if r["bytes"] == max(x["bytes"] for x in rows)}
        record = dict(stage="nccl", what=what, status="failed" if wrong else status, rows=len(rows),
                      wrong=wrong, backend=rows[0]["backend"] if rows else None, largest_algbw=largest)
    else:
        record = dict(stage="nccl", what=what, status=status, rows=rows)
        if rows and rows[0]["outcome"] != "ok":
            record["status"] = "failed"
    return dict(record, problem=problem) if problem else record
