"""`python tests/exercises.py check`: the proof of every exercise's make / fail / pass cycle.

Without --passing, exercise k's test, with the exercises before k solved and k and the later ones stubbed,
fails naming k and no other; with --passing, k solved too, it passes. The tests run in one pytest session
per core, side by side, in a copy of the repository where every solution block is guarded by the
environment variable EXERCISES_STUBBED (tests/exercise_stubs.py, a pytest plugin, sets it per test). A test
function named by two exercises goes to two rounds: a later round's test runs from a copy of its module
(tests/test_x__round2.py), whose module fixtures are its own, in the same session.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from exercises import ROOT, STUB_NAME, ExerciseError, guarded_lines, parse, select, write_copy


@dataclass
class Outcome:
    exercise: str
    status: str                    # "ok", "wrong" (the cycle is broken), "skipped" (the test skipped itself)
    detail: str = ""


def _cases(xml_path: Path) -> dict:
    """{test node id: (outcome, text)} from pytest's JUnit XML (outcome: passed, failed, skipped)."""
    cases = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        nodeid = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
        kids = {child.tag: child for child in case}
        kind = next((k for k in ("failure", "error", "skipped") if k in kids), "passed")
        text = "" if kind == "passed" else f"{kids[kind].get('message', '')}\n{kids[kind].text or ''}"
        cases[nodeid] = ("skipped" if kind == "skipped" else "failed" if kind != "passed" else "passed", text)
    return cases


def raised(text: str) -> str:
    """What a failure raised: the message, and the `E ` lines of pytest's report, not the source lines it
    quotes (an interpreted Triton kernel's listing holds the guarded stubs of other exercises)."""
    message, _, report = text.partition("\n")
    return "\n".join([message, *(line for line in report.splitlines() if line.startswith("E "))])


def _judge(exercise, cases, passing, known):
    mine = {k: v for k, v in cases.items() if k == exercise.test or k.startswith(exercise.test + "[")}
    if not mine:
        return Outcome(exercise.id, "wrong", f"pytest collected no test {exercise.test}")
    for nodeid, (kind, text) in mine.items():
        named = set(STUB_NAME.findall(raised(text))) & known
        if kind == "skipped":
            return Outcome(exercise.id, "skipped", f"{nodeid} skipped: {text.strip().splitlines()[0]}")
        if passing and kind != "passed":
            return Outcome(exercise.id, "wrong", f"{nodeid} fails with {exercise.id} solved and the later "
                                                 f"exercises stubbed:\n{text[-3000:]}")
        if not passing and (kind != "failed" or named != {exercise.id}):
            what = "passes" if kind == "passed" else f"fails naming {sorted(named) or 'no exercise'}"
            return Outcome(exercise.id, "wrong", f"{nodeid} {what} with {exercise.id} and the later "
                                                 f"exercises stubbed (it must fail naming {exercise.id} "
                                                 f"alone):\n{text[-3000:]}")
    return Outcome(exercise.id, "ok", f"{len(mine)} test(s)")


def check(passing: bool = False, only=None, root: Path = ROOT, timeout: float = 1800) -> list:
    """The cycle for every exercise (or `only`): [Outcome] in course order. Without `passing`: exercise k's
    test, with the exercises before k solved and k and the later ones stubbed, fails naming k alone. With
    `passing`: with k solved too, it passes."""
    exercises = parse(root)
    chosen, ids = select(exercises, only), [e.id for e in exercises]
    # One session per round. A round runs each test function once: exercises naming the same function
    # (or its parameters, which may share its module's fixtures) go to different rounds.
    rounds = []
    for exercise in chosen:
        function = exercise.test.split("[")[0]
        free = next((r for r in rounds if all(t.split("[")[0] != function for t in r)), None)
        if free is None:
            free = {}
            rounds.append(free)
        free[exercise.test] = (exercise, ids[ids.index(exercise.id) + passing:])
    outcomes = {}
    with tempfile.TemporaryDirectory(prefix="exercises-") as scratch:
        scratch = Path(scratch)
        tree = write_copy(root, scratch / "tree", exercises, guarded_lines)
        if (root / ".cache").is_dir():    # the data cache conftest builds: shared, not rebuilt
            (tree / ".cache").symlink_to(root / ".cache")
        env = {k: v for k, v in os.environ.items()    # not the suite's: its stubs, path, xdist worker
               if k not in ("PYTHONPATH", "EXERCISES_STUBBED") and not k.startswith("PYTEST_XDIST")}
        env.update(PYTHONPATH=str(tree / "tests"), CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")  # CPU
        # {node id to run: (exercise, stubs, the id it stands for)}: round k > 0 from its module's copy
        planned = {}
        for k, plan in enumerate(rounds):
            for test, (exercise, stubs) in plan.items():
                path, name = test.split("::", 1)
                copy = path if k == 0 else path.removesuffix(".py") + f"__round{k + 1}.py"
                if not (tree / copy).exists():
                    shutil.copy2(tree / path, tree / copy)
                planned[f"{copy}::{name}"] = (exercise, stubs, test)
        # The tests in as many sessions as the machine has cores (at most 4), run side by side: a session
        # is mostly one Python thread, so one per core. Inside a worker of the suite's `pytest -n 2` the
        # other core has its own worker: one session (its start, with its rank server, costs ~15 CPU-s).
        cores = 1 if "PYTEST_XDIST_WORKER" in os.environ else max(1, min(4, os.cpu_count() or 1))
        sessions = [dict(list(planned.items())[k::cores]) for k in range(cores)]

        def run(n, plan):
            plan_env = dict(env, EXERCISES_PLAN=str(scratch / f"plan{n}.json"))
            Path(plan_env["EXERCISES_PLAN"]).write_text(json.dumps({t: s for t, (_, s, _) in plan.items()}))
            xml = scratch / f"session{n}.xml"
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                                   "exercise_stubs", f"--junitxml={xml}", *plan], cwd=tree, env=plan_env,
                                  capture_output=True, text=True, timeout=timeout)
            if not xml.exists():
                raise ExerciseError(f"pytest did not run the exercise tests:\n{done.stdout[-3000:]}"
                                    f"{done.stderr[-3000:]}")
            return plan, _cases(xml)
        with ThreadPoolExecutor(cores) as pool:
            for plan, cases in pool.map(run, *zip(*[(n, plan) for n, plan in enumerate(sessions) if plan])):
                for ran, (exercise, _, test) in plan.items():      # judged under the id it stands for
                    mine = {test + nodeid[len(ran):]: case for nodeid, case in cases.items()
                            if nodeid == ran or nodeid.startswith(ran + "[")}
                    outcomes[exercise.id] = _judge(exercise, mine, passing, set(ids))
    return [outcomes[e.id] for e in chosen]
