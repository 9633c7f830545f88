"""tests/timings.py, the maintainers' record of how long the suite takes: what a run records and the table
the READMEs link, on real commands (a few CPU-tenths each)."""
import json
from pathlib import Path

import timings

ROOT = Path(__file__).resolve().parents[1]
BUSY = "import time; t = time.process_time(); [0 for _ in iter(lambda: time.process_time() - t > 0.3, True)]"


def test_a_run_records_its_seconds_machine_and_pytest_summary(tmp_path, capsys):
    """A command that spins 0.3 CPU-s and prints a pytest summary line: its record holds the CPU seconds of
    the processes it started, the summary, the commit and the machine; the table shows it, newest first. A
    command that fails is recorded as failed, and its exit status is the tool's."""
    summary = "print('==== 3 passed, 1 skipped in 0.31s ====')"
    assert timings.main(["run", "--name", "busy", "--results", str(tmp_path), "--",
                         "python", "-c", f"{BUSY}; {summary}"]) == 0
    assert timings.main(["run", "--name", "broken", "--results", str(tmp_path), "--",
                         "python", "-c", "raise SystemExit(3)"]) == 3
    busy, broken = [json.loads(line) for line in (tmp_path / "timings.jsonl").read_text().splitlines()]
    assert busy["summary"] == "3 passed, 1 skipped in 0.31s" and busy["exit"] == 0
    assert busy["cpu_s"] >= 0.3 and busy["wall_s"] >= 0.3 and busy["commit"]
    assert busy["machine"]["cores"] >= 1 and busy["machine"]["cpu"] and busy["date"][:2] == "20"
    assert busy["machine"]["torch"].startswith("2.")    # the version of the torch the runs used
    table = (tmp_path / "timings.md").read_text().splitlines()
    rows = [line for line in table if line.startswith(f"| {busy['date'][:4]}")]
    assert " broken " in rows[0] and "FAILED, exit 3" in rows[0] and "| 3 passed, 1 skipped" in rows[1]


def test_the_suite_command_is_the_readmes_and_ci_runs_it():
    """`suite` times the README's second set-up command, the one .ci/run runs (CI's entry point)."""
    command = timings.readme_test_command()
    assert command.startswith("pip install -r requirements.txt && python -m pytest")
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == command
