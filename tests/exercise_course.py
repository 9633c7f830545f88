"""The course (COURSE.md) and a student's progress through it: `python tests/exercises.py list | progress`.

COURSE.md's table holds one row per class of about 90 minutes: its number, title, reading, exercises (their
IDs, in course order) and experiment (a folder README's "Try it"). `list` prints the classes with each
exercise's test and status (todo: still a stub; written: not a stub; given: solved in the copy `make` wrote,
as a level-1 copy's level-2 exercises are); `progress`, in a student copy, runs the tests of the written
exercises (in as many pytest sessions as there are cores, at most 2), not the given ones', and prints which
pass, which fail, which are todo and the next one to do, on one screen.
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from exercise_check import _cases
from exercises import ROOT, ExerciseError, is_stub, made, parse

ID = re.compile(r"\b(?:[0-9]{2}|K)\.[0-9]+\b")


@dataclass
class Class:
    number: int
    title: str
    reading: str
    exercises: list                # IDs
    experiment: str


def course(root: Path = ROOT) -> list:
    """COURSE.md's classes; ExerciseError if its table does not hold every exercise once, in order."""
    path = root / "COURSE.md"
    if not path.exists():
        raise ExerciseError(f"{path} is missing: the course order lives there")
    classes = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit() and len(cells) == 5:
            classes.append(Class(int(cells[0]), cells[1], cells[2], ID.findall(cells[3]), cells[4]))
    listed = [i for c in classes for i in c.exercises]
    known = [e.id for e in parse(root)]
    if listed != known:
        raise ExerciseError(f"COURSE.md's classes list {' '.join(listed)}; the exercises, in course "
                            f"order, are {' '.join(known)}")
    return classes


def status(exercise, root: Path, record=None) -> str:
    """todo (a stub), given (`record`, what make stubbed, leaves it solved) or written."""
    if any(is_stub(exercise, b, root) for b in exercise.blocks):
        return "todo"
    return "given" if record is not None and exercise.id not in record["stubbed"] else "written"


def listing(root: Path = ROOT) -> str:
    exercises = {e.id: e for e in parse(root)}
    classes, record = course(root), made(root)
    rows = [f"COURSE.md: {len(classes)} classes of about 90 minutes, {len(exercises)} exercises; run each "
            f"test from the repository root (todo: still a stub; given: solved in this copy; level 2: `make "
            f"--level 2` stubs it)"]
    for c in classes:
        rows += ["", f"class {c.number}: {c.title}", f"  read: {c.reading}"]
        for e in map(exercises.get, c.exercises):
            where = ", ".join(f"{b.path}:{b.line}" for b in e.blocks)
            level = "  (level 2)" if e.level == 2 else ""
            rows += [f"  {e.id:<5} {status(e, root, record):<8} {e.title}{level}   ({where})",
                     f"  {'':14}python -m pytest -q {shlex.quote(e.test)}"]
        rows.append(f"  try: {c.experiment}")
    return "\n".join(rows)


def run_tests(tests: list, root: Path) -> dict:
    """{node id: (outcome, text)} of `tests` run from `root`, in min(2, cores) pytest sessions at once."""
    cores = max(1, min(2, os.cpu_count() or 1))
    sessions = [tests[k::cores] for k in range(cores) if tests[k::cores]]
    env = {k: v for k, v in os.environ.items() if k not in ("EXERCISES_STUBBED", "PYTEST_XDIST_WORKER")}

    def run(n_and_tests):
        n, chosen = n_and_tests
        xml = Path(scratch) / f"session{n}.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                        *chosen], cwd=root, env=env, capture_output=True, text=True, timeout=1800)
        return _cases(xml) if xml.exists() else {}
    with tempfile.TemporaryDirectory(prefix="progress-") as scratch, ThreadPoolExecutor(cores) as pool:
        results = {}
        for cases in pool.map(run, enumerate(sessions)):
            results.update(cases)
    return results


def progress(root: Path = ROOT) -> str:
    """One screen: per class its exercises' states (pass, FAIL, todo, skip, given: solved in the copy make
    wrote, its test not run), then what to do next."""
    exercises = parse(root)
    classes, record = course(root), made(root)
    kinds = {e.id: status(e, root, record) for e in exercises}
    written = [e for e in exercises if kinds[e.id] == "written"]
    cases = run_tests(sorted({e.test for e in written}), root) if written else {}
    states, notes = {}, {}
    for e in exercises:
        mine = [v for k, v in cases.items() if k == e.test or k.startswith(e.test + "[")]
        if kinds[e.id] != "written":
            states[e.id] = kinds[e.id] + (" (level 2)" if kinds[e.id] == "given" and e.level == 2 else "")
        elif not mine or any(kind == "failed" for kind, _ in mine):
            states[e.id] = "FAIL"
            text = next((t for kind, t in mine if kind == "failed"), "pytest collected no test")
            notes[e.id] = next((line.strip() for line in text.splitlines() if line.strip()), "")[:100]
        else:
            states[e.id] = "skip" if all(kind == "skipped" for kind, _ in mine) else "pass"
    counts = {s: sum(v.split()[0] == s for v in states.values())
              for s in ("pass", "FAIL", "todo", "skip", "given")}
    given = f", {counts['given']} given (solved in this copy, not run)" if counts["given"] else ""
    rows = [f"{counts['pass']} pass, {counts['FAIL']} fail, {counts['todo']} todo, {counts['skip']} skipped"
            f"{given} (of {len(exercises)}; COURSE.md's {len(classes)} classes)"]
    for c in classes:                  # a class's marks, on lines of at most 110 characters
        lines = [[]]
        for mark in (f"{i} {states[i]}" for i in c.exercises):
            if lines[-1] and 38 + len("  ".join(lines[-1] + [mark])) > 110:
                lines.append([])
            lines[-1].append(mark)
        head = f"class {c.number:<2} {c.title[:28]:<28}"
        rows += [f"{head if k == 0 else '':<37} " + "  ".join(part) for k, part in enumerate(lines)]
    rows += [f"  {i} fails: {note}" for i, note in notes.items()]
    following = next((e for e in exercises if states[e.id] in ("FAIL", "todo")), None)
    if following is None:
        rows.append("next: nothing left (`python tests/exercises.py make ../student --level 2`: the harder "
                    "forms too)")
    else:
        where = f"{following.blocks[0].path}:{following.blocks[0].line}"
        rows += [f"next: {following.id} {following.title} ({where}), class "
                 f"{next(c.number for c in classes if following.id in c.exercises)}",
                 f"      python -m pytest -q {shlex.quote(following.test)}"]
    return "\n".join(rows)
