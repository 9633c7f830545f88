"""The maintainers' timings: how long the suite, its quick tier and the exercises' proof take, recorded.

Each run appends one record to tests/results/timings.jsonl (the date, the commit, the machine, the wall and
CPU seconds of every process the command started, pytest's summary line) and rewrites timings.md, the
table the READMEs link. Re-measuring changes that file, never a README's prose.

    python tests/timings.py suite                  # the README's test command, in this checkout
    python tests/timings.py suite --fresh-clone    # the same in a fresh clone of HEAD, as CI runs it
    python tests/timings.py quick                  # python -m pytest -m quick
    python tests/timings.py check                  # python tests/exercises.py check
    python tests/timings.py run NAME -- COMMAND... # any command, recorded as NAME
"""
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from exercises import Parser      # one-line errors, exit status 2

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "results"
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+, )*\d+ \w+ in [\d.]+s.*?)\s*=*$")   # pytest's last line


def readme_test_command() -> str:
    """The README's second set-up command (.ci/run's too): install, then the suite in two workers."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("pip install -r requirements.txt && ")]
    if len(lines) != 2:
        raise SystemExit("timings.py: error: README.md should hold exactly two set-up commands "
                         f"('pip install -r requirements.txt && ...'), found {len(lines)}")
    return lines[1]


COMMANDS = {"quick": "python -m pytest -m quick -q", "check": "python tests/exercises.py check"}


def machine() -> dict:
    """What the figures depend on: the CPU, its cores, the memory, the load when the run began."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
               platform.processor() or platform.machine())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory, 1),
            "load_before": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "torch": _installed("torch"), "system": f"{platform.system()} {platform.machine()}"}


def _installed(package: str) -> str:
    """The package's installed version, read without importing it (torch takes seconds to import)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def commit(folder: Path) -> str:
    found = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=folder, capture_output=True,
                           text=True)
    return found.stdout.strip() or "not a git checkout"


def measure(name: str, command: str, folder: Path) -> dict:
    """Run `command` in `folder` through the shell; its record (its output goes to this terminal)."""
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    record = {"what": name, "command": command, "date": time.strftime("%Y-%m-%d %H:%M"),
              "commit": commit(folder), "machine": machine()}
    run = subprocess.Popen(command, shell=True, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "CI": "true"})
    summary = ""
    for line in run.stdout:
        sys.stdout.write(line)
        summary = m.group(1) if (m := SUMMARY.match(line.strip())) else summary
    status = run.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)     # the command's processes, once waited for
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {**record, "exit": status, "wall_s": round(time.monotonic() - started, 1),
            "cpu_s": round(cpu, 1), "summary": summary}


def fresh_clone(into: Path) -> Path:
    """A clone of HEAD's committed files (what CI checks out), without this checkout's other files."""
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(into)], check=True)
    return into


def write(record: dict, results: Path):
    """Append the record, then the table of every record, newest first."""
    results.mkdir(parents=True, exist_ok=True)
    with open(results / "timings.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")
    records = [json.loads(line) for line in (results / "timings.jsonl").read_text().splitlines() if line]
    rows = ["# Timings", "",
            "Written by `python tests/timings.py` (its docstring says what each row ran), newest first.", "",
            "| date | what | commit | machine (load when it began) | wall | CPU | result |",
            "|---|---|---|---|---|---|---|"]
    for r in reversed(records):
        m = r["machine"]
        where = (f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB (load {m['load_before']})"
                 + (f"; Python {m['python']}, torch {m['torch']}" if "torch" in m else ""))
        result = r["summary"] or "exit 0"
        if r["exit"] != 0:
            result = f"FAILED, exit {r['exit']}" + (f": {r['summary']}" if r["summary"] else "")
        rows.append(f"| {r['date']} | {r['what']} | {r['commit']} | {where} | {r['wall_s']:.0f} s | "
                    f"{r['cpu_s']:.0f} s | {result} |")
    (results / "timings.md").write_text("\n".join(rows) + "\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    argv, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = Parser(prog="python tests/timings.py", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["suite", "quick", "check", "run"])
    parser.add_argument("--fresh-clone", action="store_true", help="suite: in a fresh clone of HEAD")
    parser.add_argument("--name", help="run: the record's name (its command follows --)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of timings.jsonl and .md")
    args = parser.parse_args(argv)
    if args.results.exists() and not args.results.is_dir():
        parser.error(f"--results {args.results} is a file: pass a folder")
    if not (args.what == "run") == bool(args.name) == bool(command):      # run: both; the others: neither
        parser.error("run takes --name NAME and a command after --, e.g. run --name demo -- python -V; "
                     "suite, quick and check take no command")
    if args.fresh_clone and args.what != "suite":
        parser.error("--fresh-clone times the suite only: pass `suite --fresh-clone`")
    command = shlex.join(command) if command else {"suite": readme_test_command(), **COMMANDS}[args.what]
    name = args.name or args.what + (" (fresh clone)" if args.fresh_clone else "")
    with tempfile.TemporaryDirectory(prefix="timings-") as scratch:
        folder = fresh_clone(Path(scratch) / "clone") if args.fresh_clone else ROOT
        record = measure(name, command, folder)
    write(record, args.results)
    print(f"{name}: {record['wall_s']:.0f} s wall, {record['cpu_s']:.0f} CPU-s, exit {record['exit']}, "
          f"{record['summary'] or 'no pytest summary'} -> {args.results / 'timings.md'}")
    return record["exit"]


if __name__ == "__main__":
    sys.exit(main())
