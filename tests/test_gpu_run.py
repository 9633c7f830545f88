"""kernels/gpu_run.py, the one command a GPU session runs, works before a GPU is lent.

Its --smoke run goes through every kind of stage on the CPU at tiny shapes (two trainer rows, bench.py's
code path, a pytest subset in two shards), importing nothing that needs `datasets`, and the records must
name what they measured; report.py must read the run back. The CPU run has no peak FLOP/s and no CUDA
allocator, so its MFU and peak memory are null, as recorded. Checked on their own: the plan's order and
limits against the budget and the device call, the budget's skips, a stage's time limit (its children
ended too), a test stage cut off before pytest wrote its JUnit file, torn child files, and bad input.
"""
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kernels import gpu_run
from kernels import gpu_records
from kernels import child_process
from kernels import report

ROOT = Path(__file__).resolve().parents[1]

MACHINE_FIELDS = ("device", "driver", "cuda", "torch", "triton", "capability", "python", "date", "clocks")
TRAIN_FIELDS = ("vocab_size", "seq_len", "mbs", "grad_acc", "precision_layout", "kernels", "attn", "compile",
                "tokens_per_s", "mfu", "mfu_convention", "peak_memory_gib", "dataset", "losses",
                "timed_steps")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    # The lent GPU machines have no `datasets`: gpu_run (and report, which it imports) must not need it
    code = ("import runpy, sys; sys.modules['datasets'] = None; "
            f"sys.argv = ['kernels/gpu_run.py', '--out', {str(out)!r}, '--smoke']; "
            "runpy.run_path('kernels/gpu_run.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_smoke_run_records_every_stage(smoke):
    out, records = smoke
    assert [r["stage"] for r in records] == ["machine", "train", "bench", "train", "tests", "nccl", "nccl"]
    for r in records:
        assert all(k in r for k in MACHINE_FIELDS), r
        assert r["device"] == "cpu" and r["torch"] == torch.__version__ and r["smoke"] is True
        assert r["status"] == "ok", r.get("output_tail")
    train = [r for r in records if r["stage"] == "train"]
    assert [r["name"] for r in train] == [row.name for row in gpu_run.SMOKE_ROWS]
    # the first step's seconds apart from the steady ones (on a GPU its compile and warm-up; a CPU's tiny
    # model may take no longer in its first step, so only where each comes from is checked here)
    for r in train:
        tokens = r["mbs"] * r["seq_len"] * r["grad_acc"]
        assert r["first_step_s"] == round(tokens / r["per_step"][0]["tokens_per_s"], 4) > 0
        assert r["step_s"] > 0
    for r, row in zip(train, gpu_run.SMOKE_ROWS):
        assert all(k in r for k in TRAIN_FIELDS), r
        assert (r["kernels"], r["attn"], r["precision_layout"], r["grad_acc"]) == \
            (row.kernels, row.attn, row.precision_layout, row.grad_acc)
        assert (r["vocab_size"], r["seq_len"], r["mbs"], r["steps"], r["timed_steps"]) == (320, 32, 1, 3, 1)
        assert r["tokens_per_s"] > 0 and all(math.isfinite(x) for x in r["losses"])
        assert r["mfu"] is None and r["peak_memory_gib"] is None    # the CPU: no peak, no CUDA allocator
        assert "12·L·h·s" in r["mfu_convention"]
    tests = records[4]
    assert tests["passed"] == 2 and tests["failure"] == tests["error"] == 0 and tests["shards"] == 2
    bench = records[2]
    assert bench["rows"] == 10 and bench["failed_rows"] == 0 and (out / bench["file"]).exists()
    written = json.loads((out / bench["file"]).read_text())["rows"]
    assert {r["kernel"] for r in written} == {"attention", "rmsnorm"}
    collectives, sweep = records[5:]         # at world 1: every result right, bus bandwidth 0 but broadcast's
    assert collectives["what"] == "collectives" and collectives["rows"] == 14 and not collectives["wrong"]
    assert collectives["backend"] == "gloo" and collectives["largest_algbw"]["broadcast"] > 0
    [row] = sweep["rows"]
    assert sweep["what"] == "sweep" and row["outcome"] == "ok" and row["steps"] == 2
    assert row["tokens_per_s"] > 0 and row["predicted"]["step_s"] > 0
    # The device tool brings back at most 8 files from $OUT
    assert len(list(out.iterdir())) <= 8


def test_smoke_run_writes_its_readme_section(smoke):
    out, records = smoke
    text = (out / "section.md").read_text()
    assert text == report.run_section(out) + "\n"
    for r in (records[1], records[3]):
        cells = ("tiny", 320, r["kernels"], r["attn"], r["precision_layout"], "no", r["grad_acc"])
        assert "".join(f"| {c} " for c in cells) + "|" in text
    assert "2 passed, 0 failed" in text and "| rmsnorm |" in text
    assert "`02_data_parallel/bench_collectives.py`: 14 rows over gloo, every result right" in text
    assert "08's `sweep.py` at world 1 (dp1-tp1-pp1-cp1-ep1-zero0-none-1f1b1-mbs2-m1): " in text
    assert_tables_are_rectangular(text)


def assert_tables_are_rectangular(text: str):
    """Every markdown table's header, separator and rows have the same number of cells."""
    for table in re.findall(r"(?:^\|.*\|\n)+", text + "\n", re.MULTILINE):
        assert len({line.count("|") for line in table.splitlines()}) == 1, table


def test_bench_table_shows_gpu_time_and_launches_where_bench_wrote_them(smoke, tmp_path):
    """bench.py's "gpu_ms" and "launches" (measured on a GPU only) get their columns. The smoke's rows,
    given placeholder values here, stand in for a GPU's: this checks the table, not a figure."""
    out, records = smoke
    bench = dict(records[2], fields=records[2]["fields"] + ["gpu_ms", "launches"])
    result = json.loads((out / bench["file"]).read_text())
    for i, row in enumerate(result["rows"]):
        row.update(gpu_ms=0.001 * i, launches=i)
    lines = report.bench_lines(result, bench, tmp_path)
    assert "| Triton, GPU time | launches, eager / Triton |" in lines[3]
    assert_tables_are_rectangular("\n".join(lines))


def test_report_keeps_imported_runs_and_refuses_smoke_ones(smoke, tmp_path, monkeypatch):
    """--import-run copies a run under kernels/results/runs/<date>-<device>/; section() puts it before the
    first session's results, which stay as they were. A smoke run is refused: its figures are no results."""
    out, _ = smoke
    with pytest.raises(SystemExit, match="smoke"):
        report.import_run(out)
    real = tmp_path / "real"
    shutil.copytree(out, real)
    lines = (real / "records.jsonl").read_text().splitlines()
    (real / "records.jsonl").write_text("".join(json.dumps(dict(json.loads(x), smoke=False)) + "\n"
                                                for x in lines))
    monkeypatch.setattr(report, "RUNS", tmp_path / "runs")
    kept = report.import_run(real)
    assert kept.parent == tmp_path / "runs" and kept.name.endswith("-cpu")
    assert sorted(p.name for p in kept.iterdir()) == sorted(p.name for p in out.iterdir())
    legacy = report.section(runs=tmp_path / "empty")
    with_run = report.section(runs=tmp_path / "runs")
    assert with_run == report.run_section(kept) + "\n\n" + legacy


def test_matrix_puts_the_headline_and_baseline_first_then_one_axis_changes():
    rows = gpu_run.matrix()
    assert len(set(rows)) == len(rows) == 2 ** len(gpu_run.AXES) * len(gpu_run.SHAPES)
    axes = lambda row: {k: getattr(row, k) for k in gpu_run.AXES}  # noqa: E731
    assert [axes(r) for r in rows[:4]] == [gpu_run.HEADLINE] * 2 + [gpu_run.BASELINE] * 2
    assert {r.shape for r in rows[:2]} == {r.shape for r in rows[2:4]} == set(gpu_run.SHAPES)
    assert all(sum(axes(r)[k] != gpu_run.HEADLINE[k] for k in gpu_run.AXES) == 1 for r in rows[4:14])


def test_plan_spends_the_first_minutes_on_the_most_wanted_numbers_within_one_device_call():
    """The order of value: the eager baseline known to run, the bench (FlashAttention vs SDPA, the fused
    loss vs eager, the memory-bound kernels), the compiled headline on llama3-1b with its own cap, on
    1b-v32k, the GPU tests in parallel shards, then the rest of the matrix (every row once). The stages up
    to the tests fit the default budget together with the machine probe even if each runs to its limit, and
    the budget, plus what a call needs after its last stage, fits the device tool's call."""
    stages = gpu_run.plan(smoke=False)
    first = gpu_run.priority(stages)
    assert [(s.kind, s.what) for s in first] == [
        ("train", gpu_run.Row("llama3-1b", **gpu_run.BASELINE)), ("bench", ("attention",)),
        ("bench", ("linear+cross-entropy",)), ("bench", ("rmsnorm", "swiglu", "rope")),
        ("train", gpu_run.Row("llama3-1b", **gpu_run.HEADLINE)),
        ("train", gpu_run.Row("1b-v32k", **gpu_run.HEADLINE)), ("tests", gpu_run.KERNEL_TESTS)]
    # then 02's collectives and 08's sweep at world 1 over NCCL, before the rest of the matrix
    assert [(s.kind, s.what) for s in stages[len(first):len(first) + 2]] == [("nccl", ("collectives",)),
                                                                             ("nccl", ("sweep",))]
    assert first[4].limit_s <= 150 and first[-1].shards > 1
    assert sum(s.limit_s for s in first) + gpu_run.PROBE_S <= gpu_run.DEFAULT_BUDGET_S
    assert gpu_run.DEFAULT_BUDGET_S + gpu_run.AFTER_S <= gpu_run.DEVICE_CALL_S
    assert all(0 < s.least_s <= s.limit_s for s in stages)
    trained = [s.what for s in stages if s.kind == "train"]
    assert sorted(trained, key=str) == sorted(gpu_run.matrix(), key=str)
    assert ("tests", ["tests/test_gpu_trainers.py"]) in [(s.kind, s.what) for s in stages[len(first):]]


def test_plan_prints_the_stages_without_running_them(tmp_path, capsys, monkeypatch):
    """--plan on this CPU machine: the stages in order with their limits, nothing started, nothing written."""
    monkeypatch.chdir(tmp_path)
    gpu_run.main(["--plan"])
    lines = capsys.readouterr().out.splitlines()
    stages = gpu_run.plan(smoke=False)
    assert len(lines) == len(stages) + 2 and lines[1].split()[:3] == ["1", "train", stages[0].name]
    assert lines[5].split()[1:4] == ["train", stages[4].name, "150"]
    assert f"within --budget-s {gpu_run.DEFAULT_BUDGET_S}" in lines[-1] and not list(tmp_path.iterdir())


def test_budget_skips_the_stages_it_cannot_start(smoke, tmp_path, monkeypatch):
    """--budget-s 0.5: the machine is probed, every other stage is recorded as skipped, and the section
    says that no training row ran. The probe answers as it did for the smoke run (whose test checks it):
    a second one would only start another interpreter."""
    out, records = smoke
    probed = {k: v for k, v in records[0].items() if k not in ("stage", "status", "smoke", "budget_s")}
    monkeypatch.setattr(gpu_run, "machine", lambda log, env: (probed, (out / "machine.txt").read_text()))
    gpu_run.main(["--out", str(tmp_path), "--smoke", "--budget-s", "0.5"])
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert records[0]["stage"] == "machine" and len(records) == 1 + len(gpu_run.plan(smoke=True))
    assert all(r["status"] == "skipped" and r["reason"].startswith("budget") for r in records[1:])
    assert "no row ran within the budget" in (tmp_path / "section.md").read_text()


def test_a_stage_past_its_limit_is_ended_with_its_children(tmp_path):
    """A stage's time limit ends its child and every process below it, also one in a session of its own
    (as torchrun starts its ranks), and keeps the output the child had printed."""
    grandchild = ("import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; "
                  "time.sleep(60)'], start_new_session=True); print('grandchild', g.pid, flush=True); "
                  "time.sleep(60)")
    with open(tmp_path / "log.txt", "wb") as log:
        t0 = time.perf_counter()
        status, seconds, output = child_process.run_child([sys.executable, "-c", grandchild], 3, log)
    assert status == "timeout" and time.perf_counter() - t0 < 30
    pid = int(output.split("grandchild ")[1].split()[0])
    time.sleep(0.5)
    stat = Path(f"/proc/{pid}/stat")
    # Killed: gone, or a zombie its new parent has not reaped yet
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_test_stage_cut_off_counts_from_the_lines_pytest_printed(tmp_path):
    """A shard past the stage's limit never writes its JUnit file (pytest writes it when it ends): its
    counts come from the line `pytest -v` printed as each test ended, the other shard's from its JUnit,
    and the record says how it counted. Real pytest processes, one of them stuck in a test."""
    tests = tmp_path / "test_cut.py"
    tests.write_text("import time\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
                     "def test_c():\n    time.sleep(120)\n")
    # the suite's options; node ids relative to tmp_path
    what = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tests)]
    stage = gpu_run.Stage("tests", what, 12, 0, shards=2)     # shard 0: test_a, test_c; shard 1: test_b
    with open(tmp_path / "log.txt", "wb") as log:
        _, status, seconds, shards = gpu_run.run_tests(stage, stage.limit_s, tmp_path, log, {})
    record = gpu_records.tests_record(what, status, shards)
    assert record["status"] == "timeout" and record["passed"] == 2
    assert record["failure"] == record["error"] == 0
    assert record["source"] == "per-test lines where JUnit was missing"
    assert len(record["problems"]) == 1 and "was not written" in record["problems"][0]
    assert "test_cut.py::test_a PASSED" in (tmp_path / "log.txt").read_text()


def test_torn_child_files_make_that_stage_failed(smoke, tmp_path):
    """A child cut off mid-write leaves half a JSON line (01's --json-log), half a JUnit file or half the
    bench's JSON: each reader keeps what is whole, and the stage's record is "failed" with the reason."""
    out, records = smoke
    train = records[1]
    steps = [json.dumps(dict(step=i + 1, loss=loss, hfu=None, **per_step)) for i, (loss, per_step)
             in enumerate(zip(train["losses"], train["per_step"]))]
    json_log = tmp_path / "steps.jsonl"
    json_log.write_text(steps[0] + "\n" + steps[1] + "\n" + steps[2][:len(steps[2]) // 2])
    row = gpu_run.SMOKE_ROWS[0]
    flags = [*gpu_run.SMOKE_FLAGS, *row.flags()]
    torn = gpu_records.train_record(row, flags, "ok", "", json_log, "cpu")
    assert torn["status"] == "failed" and torn["steps"] == 2 and "line 3 is not whole JSON" in torn["problem"]

    junit = tmp_path / "junit.xml"
    junit.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2">'
                     '<testcase classname="tests.test_fp8" name="test_a" time="0.1" /><testcase classname=')
    printed = "tests/test_fp8.py::test_a PASSED [ 50%]\ntests/test_fp8.py::test_b FAILED [100%]\n"
    counted = gpu_records.tests_record(["tests/test_fp8.py"], "ok", [(junit, printed)])
    assert counted["status"] == "failed" and (counted["passed"], counted["failure"]) == (1, 1)
    assert "is not whole XML" in counted["problems"][0]
    assert counted["failed_names"] == ["tests/test_fp8.py::test_b"]

    bench_out = tmp_path / "bench"
    bench_out.mkdir()
    text = (out / records[2]["file"]).read_text()
    (bench_out / records[2]["file"]).write_text(text[:len(text) // 2])
    bench = gpu_records.bench_record(bench_out, ("attention",), "ok", gpu_run.BENCH_ARGV)
    assert bench["status"] == "failed" and "is unreadable" in bench["problem"]


@pytest.mark.parametrize("argv,fix", [
    (["--budget-s", "nan", "--smoke"], "--budget-s must be a positive number of seconds, got nan"),
    (["--budget-s", "inf", "--smoke"], "--budget-s must be a positive number of seconds, got inf"),
    (["--budget-s", "0", "--smoke"], "--budget-s must be a positive number of seconds, got 0.0"),
    (["--budget-s", "-1", "--smoke"], "--budget-s must be a positive number of seconds, got -1.0"),
    (["--smoke", "--out", "{file}"], "is a file: pass a folder"),
    (["--smoke", "--out", "/proc/gpu_run_out"], "cannot be written (No such file or directory)"),
    ([], "no CUDA GPU is visible: run this on the GPU machine, or pass --smoke"),
], ids=["budget-nan", "budget-inf", "budget-0", "budget-negative", "out-a-file", "out-cannot-be-made", "cpu"])
def test_bad_input_is_refused_in_one_line(argv, fix, tmp_path, capsys):
    """Exit status 2 and one line naming the fix, before anything is started or written."""
    if not argv and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the run would start")
    (tmp_path / "file").write_text("kept")
    out = tmp_path / "out"
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    with pytest.raises(SystemExit) as stop:
        gpu_run.main((["--out", str(out)] if "--out" not in argv else []) + argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and fix in err, err
    assert not out.exists() and (tmp_path / "file").read_text() == "kept"


def test_an_imported_run_can_be_committed():
    """report.py --import-run keeps a run in kernels/results/runs/<run>/: git must not ignore it (a
    TensorBoard `runs/` folder elsewhere stays ignored)."""
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert not ignored("kernels/results/runs/2026-11-28-nvidia-h100/records.jsonl")
    assert ignored("runs/tensorboard-events") and ignored("05_sequence_context_parallel/runs/x")


def test_the_targets_read_met_missed_or_not_measured_from_the_figures():
    def row(kernel, impl, ms, of_peak=None):
        return dict(kernel=kernel, shape="big", impl=impl, pass_="fwd+bwd", ms=ms, of_peak=of_peak)
    result = {"date": "2026-12-02",
              "rows": [row("attention", "sdpa-flash", 6.0), row("attention", "triton", 5.9),
                       row("linear+cross-entropy", "eager", 40.0),
                       row("linear+cross-entropy", "triton", 41.0),
                       row("rmsnorm", "triton", 0.2, of_peak=0.81), row("rope", "triton", 0.2, of_peak=0.79)],
              "memory": [{"shape": "small", "impl": "eager", "peak_extra_gib": 1.0},
                         {"shape": "small", "impl": "triton", "peak_extra_gib": 0.1},
                         {"shape": "big", "impl": "eager", "peak_extra_gib": 9.0},
                         {"shape": "big", "impl": "triton", "peak_extra_gib": 3.1}]}
    train = [{"shape": "llama3-1b", "mfu": 0.52}, {"shape": "tiny", "mfu": 0.9}]   # tiny: not a target
    verdicts = {line.split(" | ")[0][2:]: line.split(" | ")[-1][:-2]
                for line in report.goal_lines("NVIDIA H200", result, train) if line.startswith("| ")}
    assert verdicts == {"target": "",
                        "1B training MFU ≥ 55% (seq 2048, bf16, llama3-1b or 1b-v32k)": "missed",
                        "FlashAttention fwd+bwd at most SDPA (flash)'s time": "met",
                        "linear + cross-entropy fwd+bwd at most eager's time": "missed",
                        "rmsnorm fwd+bwd ≥ 80% of the copy bandwidth": "met",
                        "rope fwd+bwd ≥ 80% of the copy bandwidth": "missed",
                        "swiglu fwd+bwd ≥ 80% of the copy bandwidth": "not measured yet",
                        "linear + cross-entropy memory at most 1/3 of eager's": "missed"}
    h100 = report.goal_lines("NVIDIA H100 80GB HBM3", result, train)
    assert "| 1B training MFU ≥ 50% (seq 2048, bf16, llama3-1b or 1b-v32k) | 52.0% | met |" in h100
