"""The READMEs' worked outputs, re-run from their own commands: is each still what the code prints?

    python tests/worked_outputs.py list            # every worked output: README, line, command
    python tests/worked_outputs.py check [NN ...]  # re-run them; print the lines a run no longer prints
    python tests/worked_outputs.py write [NN ...]  # ... and replace those lines with the run's

A worked output is a plain ``` block (no language) whose paragraph just above names its command in
backticks (`python ...` or `torchrun ...`, possibly over two lines). Its lines are the run's, in order:
`…` stands for lines left out, and a line ending in ` …` was cut there. A line the run still prints is kept;
one it no longer prints is replaced by the run's line with the same label (`step     N |`, or the same
first 12 characters), cut at the same width. Timings (tok/s, seconds, wall-clock bubbles, GB/s) are the
machine's: `check` passes over them, `write` refreshes them with the lines around them. Runs on the CPU,
from the repository root, one command after the other (a few minutes in all), so the suite does not run
it: tests/test_worked_outputs.py checks that every block is found with a command.
"""
import difflib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING = re.compile(r"tok/s|measured [\d.]+% \(wall clock\)|\d s\b|seconds|GB/s")
NOISE = ("W1", "[W", "*****", "Setting OMP_NUM_THREADS")   # torchrun's warnings, not the trainer's output


@dataclass
class WorkedOutput:
    readme: Path
    line: int          # the opening ``` (1-based)
    command: str
    block: str

    def runnable(self) -> bool:
        return "{" not in self.command and self.command.split()[0] in ("python", "torchrun")


def find(folders=()) -> list:
    """Every worked output of the folders' READMEs (01-08; `folders`: their number prefixes)."""
    found = []
    for readme in sorted(ROOT.glob("[0-9][0-9]_*/README.md")):
        if folders and not readme.parent.name.startswith(tuple(folders)):
            continue
        lines = readme.read_text().splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("```"):
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if lines[i] == "```":
                above = _paragraph_above(lines, i)
                commands = re.findall(r"`((?:torchrun|python) [^`]*)`", above)
                if commands:
                    found.append(WorkedOutput(readme, i + 1, " ".join(commands[0].split()),
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
        raise SystemExit(f"{output.readme.relative_to(ROOT)}:{output.line}: `{output.command}` failed:\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    return [line.rstrip() for line in (done.stdout + done.stderr).splitlines() if not line.startswith(NOISE)]


def refreshed(block: str, printed: list) -> tuple:
    """(the block with each line the run no longer prints replaced by the run's, the stale lines)."""
    new, stale = [], []
    for line in block.splitlines():
        cut = line.endswith(" …")
        stem = line[:-2] if cut else line
        label = re.match(r"step\s+\d+ \|", stem)
        if line.strip() in ("", "…") or (not label and any(p.startswith(stem) for p in printed)):
            new.append(line)
            continue
        key = label.group(0) if label else stem[:12]
        match = next((p for p in printed if p.startswith(key)), None)
        if match is None:
            raise ValueError(f"the run prints no line like {line!r}")
        fresh = match[:len(stem)] + " …" if cut and len(match) > len(stem) else match
        if fresh != line and not TIMING.search(line):
            stale.append((line, fresh))
        new.append(fresh)
    return "\n".join(new), stale


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
    for output in outputs:
        where = f"{output.readme.relative_to(ROOT)}:{output.line}"
        if args[0] == "list" or not output.runnable():
            skipped = "" if output.runnable() else "  (not one command: skipped)"
            print(f"{where}: {output.command}{skipped}")
            continue
        block, stale = refreshed(output.block, run(output))
        print(f"{where}: {len(stale)} stale line(s)", flush=True)
        for old, new in stale:
            print(f"    README: {old}\n    now:    {new}")
        failed |= bool(stale)
        if args[0] == "write" and block != output.block:
            text = output.readme.read_text()
            output.readme.write_text(text.replace(output.block, block, 1))
    sys.exit(1 if failed and args[0] == "check" else 0)


if __name__ == "__main__":
    main()
