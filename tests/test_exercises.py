"""tests/exercises.py: the markers, the student copy, the course, and the make / fail / pass cycle.

On a small made-up repository (seconds, no torch): the student copy replaces each block of level 1 (level
2: all) by its stub and each `hides` phrase by "…", and nothing else; `list` says which blocks are left;
`progress` there runs the written ones' tests and names the next, and in a level-1 copy shows the level-2
exercises as given and runs none of their tests; the checks find a test that fails naming the wrong
exercise or passes with its exercise stubbed; malformed markers are named by file and line.

On this repository: at least 35 exercises, 3 or more in every numbered folder and in kernels/, one in every
kernel file, each listed in its folder README; COURSE.md (at most 80 lines) holds them all once in order,
in classes whose experiments exist; no README quotes a solution, no line of a solution survives anywhere in
the student copy, and no docstring or comment there says which collective a stub runs forward and which
backward; the copy compiles; and `check` runs every exercise's test in one pytest
session per round, each with the exercises before it solved and it and the later ones stubbed: each fails,
naming its exercise and no other. That the tests pass with every exercise solved is the rest of the
suite's job (they are ordinary tests of it); `check --passing` (about a minute, not run here) shows each
passes with only the later exercises stubbed.
"""
import ast
import io
import py_compile
import re
import tokenize
from pathlib import Path

import pytest

import exercise_check
import exercise_course
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
    """Four times x: two doublings."""
    # exercise 01.2: quadruple
    # hint: double twice
    # test: tests/test_calc.py::test_quad
    # level: 2
    # hides: "two doublings"
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
    (root / "COURSE.md").write_text("| class | title | reading | exercises | experiment |\n"
                                    "|---|---|---|---|---|\n| 1 | doubling | calc.py | 01.1 01.2 | none |\n")
    # its options (no unused plugins), with its own folder on the path, as ours are
    options = re.sub(r"pythonpath = \[.*?\]", 'pythonpath = [".", "01_demo"]',
                     (ROOT / "pyproject.toml").read_text(), flags=re.S)
    (root / "pyproject.toml").write_text(options)
    return root


def test_student_copy_replaces_each_block_by_its_stub(tmp_path):
    root = made_up(tmp_path)
    found = exercises.parse(root)
    assert [(e.id, e.title, e.test, e.level, e.hides, len(e.blocks)) for e in found] == [
        ("01.1", "double it", "tests/test_calc.py::test_double", 1, [], 1),
        ("01.2", "quadruple", "tests/test_calc.py::test_quad", 2, ["two doublings"], 1)]
    assert [e.id for e in exercises.make(tmp_path / "student", root=root, level=2)] == ["01.1", "01.2"]
    student = (tmp_path / "student" / "01_demo" / "calc.py").read_text()
    assert "y = 2 * x" not in student and "double(double(x))" not in student and "return 3 * x" in student
    assert '"""Four times x: …."""' in student and "two doublings" not in student     # hidden
    assert student.count("# end exercise") == 2 and all(len(line) <= 110 for line in student.splitlines())
    namespace = {}
    exec(compile(student, "calc.py", "exec"), namespace)
    with pytest.raises(NotImplementedError) as error:
        namespace["double"](1)
    assert str(error.value) == f"exercise 01.1 (double it): {found[0].hint}"      # wrapped, then joined back
    assert '"quoted"' in str(error.value)
    assert (tmp_path / "student" / "README.md").read_text() == "# demo\n"
    assert "todo" in exercise_course.listing(tmp_path / "student")
    assert "written" in exercise_course.listing(root) and "(level 2)" in exercise_course.listing(root)

    assert [e.id for e in exercises.make(tmp_path / "level1", root=root)] == ["01.1"]     # level 1: 01.2 kept
    assert "two doublings" in (tmp_path / "level1" / "01_demo" / "calc.py").read_text()
    exercises.make(tmp_path / "only", only=["01.2"], root=root)
    assert [exercise_course.status(e, tmp_path / "only") for e in exercises.parse(tmp_path / "only")] == [
        "written", "todo"]
    with pytest.raises(exercises.ExerciseError, match="exists and is not empty"):
        exercises.make(tmp_path / "only", root=root)
    with pytest.raises(exercises.ExerciseError, match="inside the repository"):
        exercises.make(root / "student", root=root)
    with pytest.raises(exercises.ExerciseError, match="no exercise 09.9"):
        exercises.make(tmp_path / "other", only=["09.9"], root=root)


def test_progress_runs_the_written_exercises_and_names_the_next(tmp_path):
    """In a copy with 01.1 written wrongly and 01.2 still a stub: 01.1 fails (its test's message shown),
    01.2 is todo, and the next one to do is 01.1; solved, it passes and the next is 01.2."""
    root = made_up(tmp_path)
    exercises.make(tmp_path / "student", root=root, level=2)
    calc = tmp_path / "student" / "01_demo" / "calc.py"
    stub = exercises.stub_lines(exercises.parse(root)[0], exercises.parse(root)[0].blocks[0])
    calc.write_text(calc.read_text().replace("\n".join(stub), "    return 3 * x"))
    report = exercise_course.progress(tmp_path / "student")
    assert report.splitlines()[0].startswith("0 pass, 1 fail, 1 todo")
    assert "class 1  doubling" in report and "01.1 FAIL  01.2 todo" in report
    assert "01.1 fails: assert 9 == 6" in report and "next: 01.1 double it" in report
    calc.write_text(calc.read_text().replace("return 3 * x", "return 2 * x"))
    report = exercise_course.progress(tmp_path / "student")
    assert "01.1 pass  01.2 todo" in report and "next: 01.2 quadruple" in report


def test_progress_in_a_level_1_copy_gives_the_level_2_exercises_and_runs_none_of_their_tests(tmp_path,
                                                                                           monkeypatch):
    """make without --level 2 leaves 01.2 (level 2) solved: `list` and `progress` there say "given", and
    progress runs only the tests of the exercises the copy stubbed that the student wrote (01.2's test_quad
    is made to fail in the copy: it would show as FAIL if it ran). An --only copy gives the others alike."""
    root = made_up(tmp_path)
    student = tmp_path / "student"
    exercises.make(student, root=root)
    tests = student / "tests" / "test_calc.py"
    tests.write_text(tests.read_text().replace("== 12", "== 13"))
    ran, run_tests = [], exercise_course.run_tests
    monkeypatch.setattr(exercise_course, "run_tests", lambda chosen, where: ran.extend(chosen) or
                        run_tests(chosen, where))
    report = exercise_course.progress(student)
    assert report.splitlines()[0].startswith("0 pass, 0 fail, 1 todo, 0 skipped, 1 given")
    assert "01.1 todo  01.2 given (level 2)" in report and "next: 01.1 double it" in report and ran == []
    assert re.search(r"01\.2 +given +quadruple", exercise_course.listing(student))
    calc = student / "01_demo" / "calc.py"
    stub = exercises.stub_lines(exercises.parse(root)[0], exercises.parse(root)[0].blocks[0])
    calc.write_text(calc.read_text().replace("\n".join(stub), "    return 2 * x"))
    report = exercise_course.progress(student)
    assert "01.1 pass  01.2 given (level 2)" in report and ran == ["tests/test_calc.py::test_double"]
    assert "next: nothing left" in report
    exercises.make(tmp_path / "only", only=["01.2"], root=root)
    assert "01.1 given  01.2 todo" in exercise_course.progress(tmp_path / "only")


@pytest.mark.parametrize("broken, message", [
    (CALC.replace("    # end exercise\n\n\ndef quad", "\n\ndef quad"), "has no '# end exercise'"),
    (CALC.replace("# test: tests/test_calc.py::test_quad", ""), "needs a 'hint:' and a 'test:' line"),
    (CALC.replace("exercise 01.2: quadruple", "exercise 01.1: quadruple"), "defined twice"),
    (CALC.replace("exercise 01.2", "exercise 02.2"), "belongs in a file under 02_"),
    (CALC.replace("def triple(x):", "def triple(x):\n    # exercise 01.1 more"), "a marker outside"),
    (CALC.replace("\n\ndef triple(x):\n    return 3 * x",
                  "\n# exercise 01.3: t\n# hint: h\n# test: t\nX = 3\n# end exercise"),
     "not inside a function"),
    (CALC.replace("# level: 2", "# level: 3"), "level is 1 or 2, not '3'"),
    (CALC.replace('"two doublings"', '"three doublings"'), "hides 'three doublings', which no source file"),
    (CALC.replace('"two doublings"', '"hint long enough"'), "hides 'hint long enough', which a hint holds"),
], ids=["no-end", "no-test", "twice", "wrong-folder", "stray-marker", "module-level", "level", "hides",
        "hides-a-hint"])
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
    """At least 35 exercises: 3 or more in every numbered folder and in kernels/, one in every Triton kernel
    file and the CUDA kernels; IDs numbered 1, 2, … in each folder, listed folder by folder; each names a
    test that its test file defines, and its folder README's table lists it."""
    steps = {p.name[:2]: p.name for p in ROOT.iterdir() if p.is_dir() and p.name[:2].isdigit()}
    assert {e.id.split(".")[0] for e in FOUND} == set(steps) | {"K"} and len(FOUND) >= 35
    # A kernel whose backward has a file of its own (flash_attention_backward.py) is one technique: its
    # exercise may sit in either file.
    triton_files = {p.name.replace("_backward.py", ".py") for p in (ROOT / "kernels").glob("*.py")
                    if "@triton.jit" in p.read_text()}
    kernel_blocks = {b.path.split("/")[1].replace("_backward.py", ".py")
                     for e in FOUND if e.id.startswith("K.") for b in e.blocks}
    assert triton_files | {"cuda"} <= kernel_blocks and len(triton_files) >= 5
    for folder in set(steps) | {"K"}:
        numbers = [int(e.id.split(".")[1]) for e in FOUND if e.id.startswith(folder + ".")]
        assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 3, folder
    assert [e.id for e in FOUND] == sorted((e.id for e in FOUND), key=lambda i: (i[0] == "K", i))
    for e in FOUND:
        path, name = e.test.split("::")
        assert f"\ndef {name.split('[')[0]}(" in (ROOT / path).read_text(), f"{e.id}: {e.test}"
        readme = (ROOT / steps.get(e.id[:2], "kernels") / "README.md").read_text()
        assert f"| {e.id} | {e.title}{' (level 2)' if e.level == 2 else ''} |" in readme, f"{e.id}: its table"


def test_the_course_holds_every_exercise_once_in_classes_of_reading_exercises_and_experiment():
    """COURSE.md: at most 80 lines; its classes, numbered 1, 2, …, list every exercise once, in course order
    (`exercise_course.course` raises otherwise); each names a reading and an experiment, a folder README's
    "Try it" or "Run", which exists; every folder's "Try it" is some class's experiment."""
    assert len((ROOT / "COURSE.md").read_text().splitlines()) <= 80
    classes = exercise_course.course()
    assert [c.number for c in classes] == list(range(1, len(classes) + 1)) and len(classes) >= 9
    folders = {p.name[:2]: p.name for p in ROOT.glob("0[1-8]_*")} | {"kernels": "kernels"}
    tried = set()
    for c in classes:
        assert c.reading and c.exercises, c
        folder, section = re.match(r"(\w+): (Try it|Run)\b", c.experiment).groups()
        assert f"## {section}" in (ROOT / folders[folder] / "README.md").read_text().splitlines(), c
        tried |= {folders[folder]} if section == "Try it" else set()
    assert tried == set(folders.values()), "a folder's Try it that no class runs"


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
    assert len(exercises.make(student, level=2)) == len(FOUND) >= 35
    copy = exercises.parse(student)
    assert [(e.id, e.title, e.test) for e in copy] == [(e.id, e.title, e.test) for e in FOUND]
    assert all(exercises.is_stub(e, b, student) for e in copy for b in e.blocks)
    for path in {b.path for e in copy for b in e.blocks if b.path.endswith(".py")}:
        py_compile.compile(str(student / path), doraise=True)
    assert [exercise_course.status(e, student) for e in copy] == ["todo"] * len(FOUND)


# Solution lines the repository also holds outside every block, and why that gives no block away.
SHARED = {
    'if recompute == "full":': "the recomputation modes' switch (metrics.py's HFU)",
    "if p.grad is not None:": "every loop over gradients",
    "size = dist.get_world_size(group)": "every collective's helper",
    "dist.all_reduce(grad, group=ctx.group)": "07's SumOverRanks, a later chapter's Function",
    "dist.all_reduce(x, group=group)": "07's SumOverRanks again",
    "self._launch(bucket)": "finish_gradients launches the buckets no hook completed",
    "self._reduce_scatter(unit)": "_end_of_backward flushes the units a backward did not complete",
    "self._materialize(unit)": "the method every use of a stage-3 unit calls",
    "kv = torch.stack([k, v])": "ring attention's backward walks the same hops (05's README derives both)",
    "for step in range(size):": "the same",
    "for i, j, causal in _tiles(layout, rank, (rank - step) % size):": "the same",
    "logits = logits.to(torch.promote_types(logits.dtype, torch.float32))": "the loss's fp32 logits (01, 04)",
    "order = expert_of_row.argsort(stable=True)": "the MoE block's own grouping of rows by expert",
    "chunk_layers = config.num_hidden_layers": "a planner test writes the pp ratio's formula out",
    "input_gradient_then_due_weights(i)": "ZB-H1's B pass, a function its order calls, defined above it",
    "w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)": "RMSNorm's backward kernel loads w so too",
    'with torch.device("meta"):': "every model built as shapes only (01's runtime, 07, the hardware FLOPs)",
    "if args.num_experts:": "every trainer's switch for the experts (07, 08's step and report)",
    "positions = context_parallel.CPLayout(args.cp_layout, grid.cp_size).positions(":
        "05's trainer finds its rank's tokens so (08.4 composes earlier chapters' calls)",
    "v_shape=args.pp_schedule in pipeline.V_SHAPED)": "06's trainer cuts its stages so (the same)",
    "mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()":
        "kernels' attention_reference (v0), a later chapter's eager attention that K.6's test compares with",
    'scores = scores.masked_fill(~mask, float("-inf"))': "the same",
}


def test_no_line_of_a_solution_survives_in_the_student_copy(tmp_path):
    """Every exercise stubbed (level 2): no code line of any solution (20 characters or more, its trailing
    comment left out) appears anywhere in the copy (a docstring or comment above a stub that wrote it out,
    a README, a test, another file) but the repository's shared lines (SHARED, each with its reason), and
    each `hides` phrase is gone from every source file outside tests/ (the READMEs keep theirs: they derive
    what the hint points to)."""
    student = tmp_path / "student"
    exercises.make(student, level=2)
    texts = {name: (student / name).read_text() for name in exercises.source_files(student)
             if name.endswith((*exercises.SOURCES, ".md"))}
    survivors = [f"{e.id}: {line!r} in {name}" for e in FOUND for b in e.blocks for line in code_lines(b)
                 for name, text in texts.items() if line in text and line not in SHARED]
    assert not survivors, "\n".join(survivors)
    sources = set(exercises.lesson_sources(student))
    hidden = [f"{e.id}: {phrase!r} in {name}" for e in FOUND for phrase in e.hides
              for name, text in texts.items() if phrase in text and name in sources]
    assert not hidden, "\n".join(hidden)


# Prose that states a stub's collectives: a direction beside a collective its block calls ("backward
# all-reduce", "all-gather along T forward", "backward  x = all-gather"), as the docstrings above 04.1's and
# 05.1's stubs did. Each found line of the student copy, with why it gives nothing away.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
STATED_ALLOWED = {
    "whose backward is an all-reduce too": "07.1's hint names SumOverRanks: given code, derived there",
    "# The all-to-all, forward and backward": "07.4's section banner: it names no direction's collective",
}


def stated(collective):
    word = collective.replace("-", "[-_ ]?") + "s?"
    return re.compile(rf"\b(forward|backward)\W{{1,4}}(\S{{1,3}}\s+){{0,2}}{word}\b|"
                      rf"\b{word}(\s+along\s+\S+)?\W{{1,3}}(forward|backward)\b", re.I)


def prose_lines(path: Path) -> dict:
    """{line number: text} of a Python file's docstrings and comments (hint lines too)."""
    source = path.read_text()
    lines, prose = source.splitlines(), {}
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            prose.update({n: lines[n - 1] for n in range(body[0].lineno, body[0].end_lineno + 1)})
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            prose[token.start[0]] = token.string
    return prose


def test_no_docstring_or_comment_states_a_stubs_collectives(tmp_path):
    """Every exercise stubbed (level 2): in the files that hold an exercise's stubs, no docstring or comment
    (the hints included) says which of the collectives its solution calls runs forward and which backward
    (checked line by line, so a statement broken over two lines escapes; its `hides` phrases and the
    survivors' test above catch what is written otherwise, e.g. 02.1's chunk indices and K.5's formula)."""
    student = tmp_path / "student"
    exercises.make(student, level=2)
    found = []
    for e in FOUND:
        for path in sorted({b.path for b in e.blocks if b.path.endswith(".py")}):
            calls = " ".join(" ".join(code_lines(b)) for b in e.blocks if b.path == path)
            used = [c for c in COLLECTIVES if re.search(rf"\b{c.replace('-', '_')}\w*\(", calls)]
            for number, text in prose_lines(student / path).items():
                if any(stated(c).search(text) for c in used) and not any(a in text for a in STATED_ALLOWED):
                    found.append(f"{e.id}: {path}:{number}: {text.strip()}")
    assert not found, "\n".join(found)


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
