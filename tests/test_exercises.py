"""tests/exercises.py: the markers, the student copy, and the make / fail / pass cycle of every exercise.

On a small made-up repository (seconds, no torch): the student copy replaces each block by its stub and
nothing else, `list` says which blocks are left, the checks find a test that fails naming the wrong
exercise or passes with its exercise stubbed, and malformed markers are named by file and line.

On this repository: every numbered folder and every kernel file holds an exercise, the course order is
the folders' order, no README quotes a solution, the student copy compiles, and `check` runs every
exercise's test in one pytest session per round, each with the exercises before it solved and it and
the later ones stubbed: each fails, naming its exercise and no other. That the tests pass with every
exercise solved is the rest of the suite's job (they are ordinary tests of it); `check --passing`
(several minutes, not run here) shows each passes with only the later exercises stubbed.
"""
import py_compile
import re
from pathlib import Path

import pytest

import exercise_check
import exercises

ROOT = Path(__file__).resolve().parents[1]

# ======================================================================================
# A made-up repository
# ======================================================================================
CALC = '''"""Two exercises and a function that is not one."""


def double(x):
    # exercise 01.1: double it
    # hint: twice x, a hint long enough to be wrapped over several lines of the stub, since a line of
    #   this repository holds at most 110 characters and this hint alone is longer than that "quoted"
    # test: tests/test_calc.py::test_double
    y = 2 * x
    return y
    # end exercise


def quad(x):
    # exercise 01.2: quadruple
    # hint: double twice
    # test: tests/test_calc.py::test_quad
    return double(double(x))
    # end exercise


def triple(x):
    return 3 * x
'''
TESTS = '''from importlib import import_module
import calc


def test_double():
    assert calc.double(3) == 6


def test_quad():
    assert calc.quad(3) == 12


def test_double_through_quad():
    assert calc.quad(1) == 2 * calc.double(1)
'''


def made_up(tmp_path, calc=CALC):
    root = tmp_path / "repo"
    (root / "01_demo").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "01_demo" / "calc.py").write_text(calc)
    (root / "tests" / "test_calc.py").write_text(TESTS)
    (root / "tests" / "exercise_stubs.py").write_text((ROOT / "tests" / "exercise_stubs.py").read_text())
    (root / "README.md").write_text("# demo\n")
    # its options (no unused plugins), with its own folder on the path, as ours are
    options = re.sub(r"pythonpath = \[.*?\]", 'pythonpath = [".", "01_demo"]',
                     (ROOT / "pyproject.toml").read_text(), flags=re.S)
    (root / "pyproject.toml").write_text(options)
    return root


def test_student_copy_replaces_each_block_by_its_stub(tmp_path):
    root = made_up(tmp_path)
    found = exercises.parse(root)
    assert [(e.id, e.title, e.test, len(e.blocks)) for e in found] == [
        ("01.1", "double it", "tests/test_calc.py::test_double", 1),
        ("01.2", "quadruple", "tests/test_calc.py::test_quad", 1)]
    exercises.make(tmp_path / "student", root=root)
    student = (tmp_path / "student" / "01_demo" / "calc.py").read_text()
    assert "y = 2 * x" not in student and "double(double(x))" not in student and "return 3 * x" in student
    assert student.count("# end exercise") == 2 and all(len(line) <= 110 for line in student.splitlines())
    namespace = {}
    exec(compile(student, "calc.py", "exec"), namespace)
    with pytest.raises(NotImplementedError) as error:
        namespace["double"](1)
    assert str(error.value) == f"exercise 01.1 (double it): {found[0].hint}"      # wrapped, then joined back
    assert '"quoted"' in str(error.value)
    assert (tmp_path / "student" / "README.md").read_text() == "# demo\n"
    assert "todo" in exercises.listing(tmp_path / "student") and "written" in exercises.listing(root)

    exercises.make(tmp_path / "only", only=["01.2"], root=root)
    only = exercises.listing(tmp_path / "only").splitlines()
    assert [line.split()[:2] for line in only if line[:1].isdigit() and "." in line[:4]] == [
        ["01.1", "written"], ["01.2", "todo"]]
    with pytest.raises(exercises.ExerciseError, match="exists and is not empty"):
        exercises.make(tmp_path / "only", root=root)
    with pytest.raises(exercises.ExerciseError, match="inside the repository"):
        exercises.make(root / "student", root=root)
    with pytest.raises(exercises.ExerciseError, match="no exercise 09.9"):
        exercises.make(tmp_path / "other", only=["09.9"], root=root)


@pytest.mark.parametrize("broken, message", [
    (CALC.replace("    # end exercise\n\n\ndef quad", "\n\ndef quad"), "has no '# end exercise'"),
    (CALC.replace("# test: tests/test_calc.py::test_quad", ""), "needs a 'hint:' and a 'test:' line"),
    (CALC.replace("exercise 01.2: quadruple", "exercise 01.1: quadruple"), "defined twice"),
    (CALC.replace("exercise 01.2", "exercise 02.2"), "belongs in a file under 02_"),
    (CALC.replace("def triple(x):", "def triple(x):\n    # exercise 01.1 more"), "a marker outside"),
    (CALC.replace("\n\ndef triple(x):\n    return 3 * x",
                  "\n# exercise 01.3: t\n# hint: h\n# test: t\nX = 3\n# end exercise"),
     "not inside a function"),
], ids=["no-end", "no-test", "twice", "wrong-folder", "stray-marker", "module-level"])
def test_malformed_markers_name_their_file_and_line(tmp_path, broken, message):
    with pytest.raises(exercises.ExerciseError, match=rf"01_demo/calc.py:\d+: .*{re.escape(message)}"):
        exercises.parse(made_up(tmp_path, broken))


def test_check_proves_the_cycle_and_finds_a_broken_one(tmp_path):
    """Both sides on the made-up repository; then 01.1 named by a test that reaches 01.2's block first."""
    root = made_up(tmp_path)
    assert ([(o.exercise, o.status) for o in exercise_check.check(root=root)]
            == [("01.1", "ok"), ("01.2", "ok")])
    assert [o.status for o in exercise_check.check(passing=True, root=root)] == ["ok", "ok"]
    wrong = made_up(tmp_path / "wrong", CALC.replace("::test_double", "::test_double_through_quad"))
    outcome = exercise_check.check(root=wrong, only=["01.1"])[0]
    assert outcome.status == "wrong" and "fails naming ['01.2']" in outcome.detail


# ======================================================================================
# This repository's exercises
# ======================================================================================
FOUND = exercises.parse(ROOT)


def code_lines(block):
    """The block's code lines, stripped, without trailing comments, those long enough to be telling."""
    lines = (ROOT / block.path).read_text().splitlines()[block.body[0]:block.body[1] + 1]
    stripped = (re.sub(r"\s+(#|//) .*$", "", line).strip() for line in lines)
    return [line for line in stripped if len(line) >= 20 and not line.startswith(("#", "//"))]


def test_every_step_and_kernel_has_exercises_in_course_order():
    """An exercise in every numbered folder, every Triton kernel file and the CUDA kernels; IDs numbered
    1, 2, … in each folder, listed folder by folder; each names a test that its test file defines, and
    the root README's table lists it."""
    steps = {p.name[:2] for p in ROOT.iterdir() if p.is_dir() and p.name[:2].isdigit()}
    assert {e.id.split(".")[0] for e in FOUND} == steps | {"K"}
    # A kernel whose backward has a file of its own (flash_attention_backward.py) is one technique: its
    # exercise may sit in either file.
    triton_files = {p.name.replace("_backward.py", ".py") for p in (ROOT / "kernels").glob("*.py")
                    if "@triton.jit" in p.read_text()}
    kernel_blocks = {b.path.split("/")[1].replace("_backward.py", ".py")
                     for e in FOUND if e.id.startswith("K.") for b in e.blocks}
    assert triton_files | {"cuda"} <= kernel_blocks and len(triton_files) >= 5
    for folder in steps | {"K"}:
        numbers = [int(e.id.split(".")[1]) for e in FOUND if e.id.startswith(folder + ".")]
        assert numbers == list(range(1, len(numbers) + 1)), folder
    assert [e.id for e in FOUND] == sorted((e.id for e in FOUND), key=lambda i: (i[0] == "K", i))
    readme = (ROOT / "README.md").read_text()
    for e in FOUND:
        path, name = e.test.split("::")
        assert f"\ndef {name.split('[')[0]}(" in (ROOT / path).read_text(), f"{e.id}: {e.test}"
        assert f"| {e.id} | {e.title} |" in readme, f"{e.id}: the README's table of exercises"


def test_no_readme_quotes_a_solution():
    """A student copy keeps the READMEs: none may hold two consecutive code lines of a solution block."""
    docs = {p: [line.strip() for line in p.read_text().splitlines()] for p in ROOT.rglob("*.md")
            if ".git" not in p.parts}
    pairs = {pair: name for name, lines in docs.items() for pair in zip(lines, lines[1:])}
    quoted = [f"{e.id} in {pairs[pair].relative_to(ROOT)}: {pair[0]}" for e in FOUND for b in e.blocks
              for pair in zip(code_lines(b), code_lines(b)[1:]) if pair in pairs]
    assert not quoted, "\n".join(quoted)


def test_student_copy_compiles_with_every_block_a_stub(tmp_path):
    """The copy holds every block as its stub and nothing of the solution there (later chapters' reference
    implementations, e.g. kernels' *_reference, stay: they are part of the course), and its files compile."""
    student = tmp_path / "student"
    assert len(exercises.make(student)) == len(FOUND) >= 19
    copy = exercises.parse(student)
    assert [(e.id, e.title, e.test) for e in copy] == [(e.id, e.title, e.test) for e in FOUND]
    assert all(exercises.is_stub(e, b, student) for e in copy for b in e.blocks)
    for path in {b.path for e in copy for b in e.blocks if b.path.endswith(".py")}:
        py_compile.compile(str(student / path), doraise=True)
    statuses = [line.split()[1] for line in exercises.listing(student).splitlines()[2::2]]
    assert statuses == ["todo"] * len(FOUND)


@pytest.fixture(scope="module")
def cycle():
    """One `check`: every exercise's test, with the exercises before it solved and it and the later ones
    stubbed (one pytest session per round: 04's and 05's exercises share a test)."""
    return {outcome.exercise: outcome for outcome in exercise_check.check()}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("exercise_id", [e.id for e in FOUND])
def test_the_stub_fails_its_test_naming_the_exercise(cycle, exercise_id):
    outcome = cycle[exercise_id]
    if outcome.status == "skipped":        # the CUDA compile test without nvcc (CI has it: there it fails)
        pytest.skip(outcome.detail)
    assert outcome.status == "ok", outcome.detail
