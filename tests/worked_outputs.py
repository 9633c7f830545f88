"""The folders' worked outputs, re-run from their own commands: is each still what the code prints?

    python tests/worked_outputs.py list            # every worked output: file, line, command
    python tests/worked_outputs.py check [NN ...]  # re-run them; print the lines a run no longer prints
    python tests/worked_outputs.py write [NN ...]  # ... replace those lines with the run's, date the file

The worked outputs of a folder live in its results/worked_outputs.md, which its README links (so a re-run
changes no README). A worked output there is a plain ``` block (no language) whose paragraph just above
names its command in backticks (`python ...` or `torchrun ...`, possibly over two lines). Its lines are
the run's, in order: `…` stands for lines left out, and a line ending in ` …` was cut there. A line the
run still prints is kept; one it no longer prints is replaced by the run's line with the same label
(`step     N |`, or the same first 12 characters), cut at the same width. Timings (tok/s, seconds,
wall-clock bubbles, GB/s) are the machine's: `check` passes over them, `write` refreshes them with the
lines around them, and rewrites the file's `Last written by` line: the date, the commit and the machine
with its load. Runs on the CPU, from the repository root, one command after the other (a few minutes in
all), so the suite does not run it: tests/test_worked_outputs.py checks that every block is found with
a command and that every README link to one resolves.
"""
import datetime
import difflib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import timings

ROOT = Path(__file__).resolve().parents[1]
TIMING = re.compile(r"tok/s|measured [\d.]+% \(wall clock\)|\d s\b|seconds|GB/s")
NOISE = ("W1", "[W", "*****", "Setting OMP_NUM_THREADS")   # torchrun's warnings, not the trainer's output
RESULTS = "results/worked_outputs.md"
WRITTEN = "Last written by "


@dataclass
class WorkedOutput:
    file: Path         # a folder's results/worked_outputs.md
    line: int          # the opening ``` (1-based)
    command: str
    block: str

    def runnable(self) -> bool:
        return "{" not in self.command and self.command.split()[0] in ("python", "torchrun")


def find(folders=()) -> list:
    """Every worked output of the folders' results files (01-08; `folders`: their number prefixes)."""
    found = []
    for file in sorted(ROOT.glob(f"[0-9][0-9]_*/{RESULTS}")):
        if folders and not file.parents[1].name.startswith(tuple(folders)):
            continue
        lines = file.read_text().splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("```"):
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if lines[i] == "```":
                above = " ".join(_paragraph_above(lines, i).split())    # a command may break at any space
                commands = re.findall(r"`((?:torchrun|python) [^`]*)`", above)
                if commands:
                    found.append(WorkedOutput(file, i + 1, " ".join(commands[0].split()),
                                              "\n".join(lines[i + 1:end])))
            i = end + 1
    return found


def _paragraph_above(lines, i) -> str:
    k = i - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    paragraph = []
    while k >= 0 and lines[k].strip() and not lines[k].startswith(("```", "#")):
        paragraph.insert(0, lines[k])
        k -= 1
    return "\n".join(paragraph)


def run(output: WorkedOutput) -> list:
    """The lines the command prints now (stdout and stderr, torchrun's own warnings left out)."""
    argv = shlex.split(output.command)
    launcher = [sys.executable, "-m", "torch.distributed.run"] if argv[0] == "torchrun" else [sys.executable]
    done = subprocess.run(launcher + argv[1:], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{output.file.relative_to(ROOT)}:{output.line}: `{output.command}` failed:\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    return [line.rstrip() for line in (done.stdout + done.stderr).splitlines() if not line.startswith(NOISE)]


def refreshed(block: str, printed: list) -> tuple:
    """(the block with each line the run no longer prints replaced by the run's, the stale lines).

    The block's lines are the run's in order, so each is looked for after the line matched before it."""
    new, stale, at = [], [], 0
    for line in block.splitlines():
        cut = line.endswith(" …")
        stem = line[:-2] if cut else line
        label = re.match(r"step\s+\d+ \|", stem)
        if line.strip() in ("", "…"):
            new.append(line)
            continue
        kept = None if label else _after(printed, at, stem)
        if kept is not None:
            new.append(line)
            at = kept + 1
            continue
        found = _after(printed, at, label.group(0) if label else stem[:12])
        if found is None:
            raise ValueError(f"the run prints no line like {line!r}")
        match, at = printed[found], found + 1
        fresh = match[:len(stem)] + " …" if cut and len(match) > len(stem) else match
        if _untimed(fresh) != _untimed(line):
            stale.append((line, fresh))
        new.append(fresh)
    return "\n".join(new), stale


def _untimed(line: str) -> str:
    """What of a line is the code's, not the machine's: a step line less its throughput, MFU and memory
    fields (its loss and learning rate stay); nothing of any other line that holds a timing."""
    if re.match(r"step\s+\d+ \|", line):
        return " | ".join(f for f in line.split(" | ") if not f.startswith(("tok/s", "mfu", "hfu", "mem")))
    return "" if TIMING.search(line) else line


def _after(printed: list, at: int, prefix: str):
    """The index of the first printed line from `at` on that starts with `prefix` (None: there is none)."""
    return next((j for j in range(at, len(printed)) if printed[j].startswith(prefix)), None)


def written_line(folder: str) -> str:
    """The results file's line that says when, at which commit and on what its outputs were last run."""
    m = timings.machine()
    return (f"{WRITTEN}`python tests/worked_outputs.py write {folder}` on {datetime.date.today()}, at commit "
            f"{timings.commit(ROOT)}: {m['cpu']}, {m['cores']} cores, load average {m['load_before']} when "
            f"it began; Python {m['python']}, torch {m['torch']}.")


def dated(text: str, folder: str) -> str:
    """`text` with its `Last written by` line replaced (added under the title when it has none)."""
    lines = text.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(WRITTEN)), None)
    if at is None:
        lines[1:1] = ["", written_line(folder)]
    else:
        lines[at] = written_line(folder)
    return "\n".join(lines) + "\n"


COMMANDS = ("list", "check", "write")


def usage_error(message):
    """One line naming the fix, exit status 2 (argparse's status for a usage error)."""
    print(f"worked_outputs.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def folder_prefix(name: str) -> str:
    """'04', '04_tensor_parallel' or './04_tensor_parallel/' -> '04'; a usage error for anything else."""
    prefix = name.rstrip("/").removeprefix("./")[:2]
    if prefix.isdigit() and len(prefix) == 2 and list(ROOT.glob(f"{prefix}_*/README.md")):
        return prefix
    padded = list(ROOT.glob(f"{int(name):02d}_*/README.md")) if name.isdigit() else []
    hint = f" ({int(name):02d} for {padded[0].parent.name})" if padded else ""
    usage_error(f"no folder {name!r}: name one of 01 .. 08{hint}")


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if not args:
        usage_error(f"name a command: {', '.join(COMMANDS[:-1])} or {COMMANDS[-1]} (the docstring: --help)")
    if args[0] in ("-h", "--help"):
        print(__doc__)
        return
    if args[0] not in COMMANDS:
        close = difflib.get_close_matches(args[0], COMMANDS, n=1)
        usage_error(f"no command {args[0]!r}: use list, check or write"
                    + (f" (did you mean {close[0]}?)" if close else ""))
    folders = [folder_prefix(name) for name in args[1:]]
    outputs = find(folders)
    failed = False
    refreshed_text = {}    # file -> its text with the blocks run so far refreshed, written when all have run
    for output in outputs:
        where = f"{output.file.relative_to(ROOT)}:{output.line}"
        if args[0] == "list" or not output.runnable():
            skipped = "" if output.runnable() else "  (not one command: skipped)"
            print(f"{where}: {output.command}{skipped}")
            continue
        block, stale = refreshed(output.block, run(output))
        print(f"{where}: {len(stale)} stale line(s)", flush=True)
        for old, new in stale:
            print(f"    file: {old}\n    now:  {new}")
        failed |= bool(stale)
        text = refreshed_text.get(output.file, output.file.read_text())
        refreshed_text[output.file] = text.replace(output.block, block, 1)
    if args[0] == "write":
        for file, text in refreshed_text.items():
            file.write_text(dated(text, file.parents[1].name[:2]))
    sys.exit(1 if failed and args[0] == "check" else 0)


if __name__ == "__main__":
    main()
