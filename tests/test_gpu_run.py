"""kernels/gpu_run.py, the one command a GPU session runs, works before a GPU is lent.

Its --smoke run goes through every kind of stage on the CPU at tiny shapes (two trainer rows, a pytest
subset, bench.py's code path), importing nothing that needs `datasets`, and the records must name what
they measured; the budget, the per-stage time limit and the priority order are checked on their own;
report.py must read the run back. The CPU run has no peak FLOP/s and no CUDA allocator, so its MFU and
peak memory are null, as recorded.
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
    assert [r["stage"] for r in records] == ["machine", "train", "train", "tests", "bench"]
    for r in records:
        assert all(k in r for k in MACHINE_FIELDS), r
        assert r["device"] == "cpu" and r["torch"] == torch.__version__ and r["smoke"] is True
        assert r["status"] == "ok", r.get("output_tail")
    train = [r for r in records if r["stage"] == "train"]
    assert [r["name"] for r in train] == [row.name for row in gpu_run.SMOKE_ROWS]
    for r, row in zip(train, gpu_run.SMOKE_ROWS):
        assert all(k in r for k in TRAIN_FIELDS), r
        assert (r["kernels"], r["attn"], r["precision_layout"], r["grad_acc"]) == \
            (row.kernels, row.attn, row.precision_layout, row.grad_acc)
        assert (r["vocab_size"], r["seq_len"], r["mbs"], r["steps"], r["timed_steps"]) == (320, 32, 1, 3, 1)
        assert r["tokens_per_s"] > 0 and all(math.isfinite(x) for x in r["losses"])
        assert r["mfu"] is None and r["peak_memory_gib"] is None    # the CPU: no peak, no CUDA allocator
        assert "12·L·h·s" in r["mfu_convention"]
    tests = records[3]
    assert tests["passed"] >= 1 and tests["failure"] == tests["error"] == 0
    bench = records[4]
    assert bench["rows"] > 0 and bench["failed_rows"] == 0 and (out / bench["file"]).exists()
    # The device tool brings back at most 8 files from $OUT
    assert len(list(out.iterdir())) <= 8


def test_smoke_run_writes_its_readme_section(smoke):
    out, records = smoke
    text = (out / "section.md").read_text()
    assert text == report.run_section(out) + "\n"
    for r in records[1:3]:
        cells = ("tiny", 320, r["kernels"], r["attn"], r["precision_layout"], "no", r["grad_acc"])
        assert "".join(f"| {c} " for c in cells) + "|" in text
    assert "1 passed, 0 failed" in text and "| rmsnorm |" in text
    assert_tables_are_rectangular(text)


def assert_tables_are_rectangular(text: str):
    """Every markdown table's header, separator and rows have the same number of cells."""
    for table in re.findall(r"(?:^\|.*\|\n)+", text + "\n", re.MULTILINE):
        assert len({line.count("|") for line in table.splitlines()}) == 1, table


def test_bench_table_shows_gpu_time_and_launches_where_bench_wrote_them(smoke, tmp_path):
    """bench.py's "gpu_ms" and "launches" (measured on a GPU only) get their columns. The smoke's rows,
    given placeholder values here, stand in for a GPU's: this checks the table, not a figure."""
    out, records = smoke
    bench = dict(records[4], fields=records[4]["fields"] + ["gpu_ms", "launches"])
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
    assert with_run.startswith(report.BEGIN + "\n\n" + report.run_section(kept))
    assert with_run.endswith(legacy.removeprefix(report.BEGIN + "\n\n"))


def test_matrix_puts_the_headline_and_baseline_first_then_one_axis_changes():
    rows = gpu_run.matrix()
    assert len(set(rows)) == len(rows) == 2 ** len(gpu_run.AXES) * len(gpu_run.SHAPES)
    axes = lambda row: {k: getattr(row, k) for k in gpu_run.AXES}  # noqa: E731
    assert [axes(r) for r in rows[:4]] == [gpu_run.HEADLINE] * 2 + [gpu_run.BASELINE] * 2
    assert {r.shape for r in rows[:2]} == {r.shape for r in rows[2:4]} == set(gpu_run.SHAPES)
    assert all(sum(axes(r)[k] != gpu_run.HEADLINE[k] for k in gpu_run.AXES) == 1 for r in rows[4:14])
    stages = gpu_run.plan(smoke=False)
    assert [kind for kind, *_ in stages][:7] == ["train"] * 4 + ["tests", "bench", "train"]
    assert sum(kind == "train" for kind, *_ in stages) == len(rows)
    assert ("tests", ["tests/test_gpu_trainers.py"]) in [(kind, what) for kind, what, *_ in stages]


def test_budget_skips_the_stages_it_cannot_start(smoke, tmp_path, monkeypatch):
    """--budget-s 0: the machine is probed, every other stage is recorded as skipped, and the section
    says that no training row ran. The probe answers as it did for the smoke run (whose test checks it):
    a second one would only start another interpreter."""
    out, records = smoke
    probed = {k: v for k, v in records[0].items() if k not in ("stage", "status", "smoke", "budget_s")}
    monkeypatch.setattr(gpu_run, "machine", lambda log, env: (probed, (out / "machine.txt").read_text()))
    gpu_run.main(["--out", str(tmp_path), "--smoke", "--budget-s", "0"])
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


def test_an_imported_run_can_be_committed():
    """report.py --import-run keeps a run in kernels/results/runs/<run>/: git must not ignore it (a
    TensorBoard `runs/` folder elsewhere stays ignored)."""
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert not ignored("kernels/results/runs/2026-11-28-nvidia-h100/records.jsonl")
    assert ignored("runs/tensorboard-events") and ignored("05_sequence_context_parallel/runs/x")
