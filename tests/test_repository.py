"""The repository stands alone: nothing in it points at files its users do not have.

The project was written beside a folder of source documents, house rules and a digest of the papers
(`../shared/`) that is not part of it. Every tracked file is read: a path into that folder, a reference
to the digest's item numbers or to line numbers of its copies of the papers fails the test, with the
place. Errata are cited by number (E6, ...) and every number cited must be explained in the README.
Also the comment rule a reader relies on: no trailing comment continues onto the next code line.
"""
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(STYLE|seeds|reference|tools)\b|STYLE\.md|seed[ _-]digest|"
                     r"\bthe seeds?'s?\b|\[PB\] L\d+|\b(SG|DP|Z|TP|SP|CP|PP|EP|C|K)-\d+\b")
ERRATUM = re.compile(r"\b(?:errat(?:um|a)|\[PB\]) (E\d+)|\((E\d+)\)|^\s*(E\d+):|\b(E\d+) (?:and|identity)|"
                     r"(?<=[ (])(E\d+)(?=[:)])")


def tracked_text_files():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    for name in filter(None, names):
        path = ROOT / name
        if (path.suffix not in (".png", ".safetensors") and path.is_file()
                and name != "tests/test_repository.py"):
            yield name, path.read_text(errors="replace").splitlines()


def test_no_file_points_outside_the_repository():
    files = dict(tracked_text_files())
    assert len(files) > 50                                   # the listing worked: the whole tree is read
    found = [f"{name}:{number}: {line.strip()}" for name, lines in files.items()
             for number, line in enumerate(lines, 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


def test_every_cited_erratum_is_explained_in_the_readme():
    files = dict(tracked_text_files())
    explained = set(re.findall(r"^\| (E\d+) \|", "\n".join(files["README.md"]), re.M))
    cited = {(name, number, next(g for g in match.groups() if g))
             for name, lines in files.items() for number, line in enumerate(lines, 1)
             for match in ERRATUM.finditer(line)}
    assert {"E6", "E16"} <= {erratum for _, _, erratum in cited}        # the pattern finds the citations
    missing = [f"{name}:{number}: {erratum}" for name, number, erratum in sorted(cited)
               if erratum not in explained]
    assert not missing, "\n".join(missing)


def test_gpu_figures_are_generated_from_the_committed_results_and_linked():
    """No GPU figure is typed by hand: kernels/results/latest.md is what kernels/report.py makes of the
    results files (rerun `python kernels/report.py --write` after committing new ones), and the README
    links it instead of carrying figures that a GPU session would change."""
    from importlib import import_module
    report = import_module("kernels.report")
    assert report.LATEST.read_text() == report.page()
    assert "(kernels/results/latest.md)" in (ROOT / "README.md").read_text()


CONTINUES = re.compile(r"[,;:(]$|\b(?:the|a|an|of|and|or|to|on|in|by|for|with|its|their)$")


def continued_comments(source: str) -> list:
    """Trailing comments that go on in the next line's comment: an open parenthesis, a last character or word
    that cannot end a thought (',', ';', ':', 'the', 'and', ...), or a next comment indented as a
    continuation ('#   the rest'). Returns the (line, comment) pairs of the first lines."""
    comments, code = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:].rstrip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code.update(range(tok.start[0], tok.end[0] + 1))
    found = []
    for line, text in sorted(comments.items()):
        following = comments.get(line + 1)
        opened = text.count("(") > text.count(")")
        if line in code and following is not None and (
                opened or CONTINUES.search(text) or re.match(r"\s{2,}\S", following)):
            found.append((line, text.strip()))
    return found


def test_one_thought_a_line():
    """One thought a line: no trailing comment in the folders' Python files continues onto the next line
    (a note of several clauses is a block comment above its statement). The detector on lines it must
    flag and lines it must pass, then every .py file under NN_*/ and kernels/, subfolders included."""
    assert continued_comments("x = 1  # Σ over tp:\ny = 2  #   every rank skips\n") == [(1, "Σ over tp:")]
    assert continued_comments("x = 1  # the same on\ny = 2  # rank\n") == [(1, "the same on")]
    assert continued_comments("x = 1  # (bf16-20: a\ny = 2  # b)\n") == [(1, "(bf16-20: a")]
    assert continued_comments("x = 1  # x, y: (mbs, T)\ny = 2  # fp16: ÷ S; the grad owners\n") == []
    files = technique_files()
    assert len(files) > 60
    found = [f"{path.relative_to(ROOT)}:{line}: #{text}" for path in files
             for line, text in continued_comments(path.read_text())]
    assert not found, "\n".join(found)


LESSON_LINES = 200


def test_readmes_are_a_lesson_then_a_reference():
    """Each folder README (01-08, kernels/) opens with its lesson: what is new, the derivation, a run and the
    exercises, within LESSON_LINES lines. Worked outputs, test tables, measured tables and errata follow
    under a `## Reference` heading. The top README stays within LESSON_LINES lines in all."""
    readmes = sorted(ROOT.glob("[0-9][0-9]_*/README.md")) + [ROOT / "kernels" / "README.md"]
    assert len(readmes) == 9                                 # 01-08 and kernels/
    problems = []
    for path in readmes:
        lines = path.read_text().splitlines()
        name = path.relative_to(ROOT)
        if "## Reference" not in lines:
            problems.append(f"{name}: no `## Reference` heading; put the worked outputs, test tables, "
                            f"measured tables and errata under one, after the lesson")
            continue
        lesson = lines.index("## Reference")
        if lesson > LESSON_LINES:
            problems.append(f"{name}: the lesson (the lines before `## Reference`) is {lesson} lines, "
                            f"more than {LESSON_LINES}; move worked outputs, measured tables or detail "
                            f"below `## Reference`")
    top = len((ROOT / "README.md").read_text().splitlines())
    if top > LESSON_LINES:
        problems.append(f"README.md: {top} lines, more than {LESSON_LINES}; move detail into the folders' "
                        f"READMEs, below their `## Reference` headings")
    assert not problems, "\n".join(problems)


def long_functions(source: str, limit: int = 40) -> list:
    """(name, lines) of each function or method of `source` longer than `limit` lines (docstring included)."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def short_function_files() -> list:
    """The files whose functions must each fit on a screen: 01's runtime/ (the loop and the plumbing around
    every step) and every NN_*/train.py (the step and the run that wires it)."""
    return sorted(ROOT.glob("01_single_gpu/runtime/**/*.py")) + sorted(ROOT.glob("[0-9][0-9]_*/train.py"))


def test_the_trainers_and_runtime_read_as_short_phases():
    """loop.train is the order of its phases, a trainer's run the order of its parts, and each fits on a
    screen: no function of runtime/ or of a train.py is longer than 40 lines."""
    assert long_functions("def f():\n" + "    x = 1\n" * 40) == [("f", 41)]
    assert long_functions("def f():\n" + "    x = 1\n" * 39) == []
    files = short_function_files()
    names = {str(path.relative_to(ROOT)) for path in files}
    assert "01_single_gpu/runtime/loop.py" in names and sum(n.endswith("/train.py") for n in names) == 8
    found = [f"{path.relative_to(ROOT)}: {name} is {lines} lines" for path in files
             for name, lines in long_functions(path.read_text())]
    fix = "\nsplit it into named phases of at most 40 lines each (one function a phase, called in order)"
    assert not found, "\n".join(found) + fix


def writes_into_args(source: str) -> list:
    """Line numbers where `source` assigns to an attribute of `args` (`args.x = ...`, `args.x += ...`,
    `args.x, y = ...`, `setattr(args, ...)`, `vars(args)[...] = ...`)."""
    def is_args(node):
        return isinstance(node, ast.Name) and node.id == "args"

    def writes(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(writes(t) for t in target.elts)
        if isinstance(target, ast.Starred):
            return writes(target.value)
        if isinstance(target, ast.Attribute):
            return is_args(target.value)
        return (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Call)
                and getattr(target.value.func, "id", None) == "vars" and any(map(is_args, target.value.args)))
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        called = (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                  and node.args and is_args(node.args[0]))
        if called or any(map(writes, targets)):
            found.append(node.lineno)
    return sorted(found)


def test_no_trainer_writes_into_its_flags():
    """The flags are what the user passed, completed once by cli.parse_args into a new namespace: no
    NN_*/*.py assigns to an attribute of `args` (a derived value is a local, a return value or a field of
    a small object, such as loop.Run.lr_decay_steps)."""
    sample = "args.a = 1\nargs.b += 1\nx, args.c = 1, 2\nsetattr(args, 'd', 1)\nvars(args)['e'] = 1\n"
    assert writes_into_args(sample) == [1, 2, 3, 4, 5]
    assert writes_into_args("a = args.a\nother.a = 1\nargs = argparse.Namespace(**vars(args))\n") == []
    files = sorted(ROOT.glob("[0-9][0-9]_*/**/*.py"))
    assert len(files) > 40
    found = [f"{path.relative_to(ROOT)}:{line}" for path in files
             for line in writes_into_args(path.read_text())]
    fix = ("\nthese lines write into the flags: keep the derived value in a local, return it, or give it a "
           "field of a small object (where parsing completes the flags, cli.with_values makes a new one)")
    assert not found, "\n".join(found) + fix


# ======================================================================================
# Rules that keep themselves: short files, short docstrings, a pinned linter
# ======================================================================================
MAX_FILE_LINES, MAX_DOCSTRING_LINES = 300, 25


def technique_files() -> list:
    """Every .py file under the NN_* folders and kernels/, subfolders included: what a student reads."""
    return sorted(ROOT.glob("[0-9][0-9]_*/**/*.py")) + sorted(ROOT.glob("kernels/**/*.py"))


def test_every_file_is_at_most_300_lines():
    """One technique per file, short enough to read in one sitting: every .py file under NN_*/ and kernels/
    (subfolders included) holds at most 300 lines. A longer one is split by idea (a technique, its
    primitives, its bookkeeping), never at an arbitrary line."""
    files = technique_files()
    assert len(files) > 60                                   # the listing worked: every folder is read
    assert ROOT / "01_single_gpu" / "runtime" / "loop.py" in files               # subfolders too
    found = [f"{path.relative_to(ROOT)}: {lines} lines, more than {MAX_FILE_LINES}: split it by idea into a "
             f"file of its own (one technique per file), then update the importers and the folder README's "
             f"file table"
             for path in files if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not found, "\n".join(found)


def long_docstrings(source: str, limit: int = MAX_DOCSTRING_LINES) -> list:
    """(line, name, lines) of the module, class and function docstrings of `source` with more than `limit`
    lines of text (as `ast.get_docstring` cleans it: its indentation and surrounding blank lines removed)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text is not None and len(text.splitlines()) > limit:
                found.append((node.body[0].lineno, getattr(node, "name", "module"), len(text.splitlines())))
    return found


def test_every_docstring_is_at_most_25_lines():
    """A docstring says what a thing is, where it comes from and how to run it, in at most 25 lines; the
    derivations, worked outputs and errata belong in the folder's README. The detector on docstrings it
    must flag and pass (module, class, function), then every .py file under NN_*/ and kernels/."""
    def text(n):
        return '"""' + "\n".join(f"line {i}" for i in range(n)) + '"""'
    assert long_docstrings(text(26)) == [(1, "module", 26)]
    assert long_docstrings(f"class A:\n    {text(26)}\n") == [(2, "A", 26)]
    assert long_docstrings(f"def f():\n    {text(30)}\n    return 1\n") == [(2, "f", 30)]
    assert long_docstrings(f"{text(25)}\ndef f():\n    {text(25)}\n") == []
    found = [f"{path.relative_to(ROOT)}:{line}: the docstring of {name} has {lines} lines, more than "
             f"{MAX_DOCSTRING_LINES}: move its derivation or worked example to the folder's README.md and "
             f"point there"
             for path in technique_files() for line, name, lines in long_docstrings(path.read_text())]
    assert not found, "\n".join(found)


def pinned_ruff() -> str:
    """The ruff version requirements.txt pins."""
    pins = re.findall(r"^ruff==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    assert len(pins) == 1, "requirements.txt pins ruff once (ruff==X.Y.Z)"
    return pins[0]


def test_ruff_finds_nothing():
    """The pinned linter on the whole repository: pyproject.toml's [tool.ruff] (the 110-column rule,
    pycodestyle's errors and warnings, pyflakes). The installed ruff must be the pinned one, since another
    version flags other lines; its own report is the message."""
    version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True)
    assert version.stdout.split()[-1:] == [pinned_ruff()], (
        f"ruff {pinned_ruff()} is not what runs here ({(version.stdout or version.stderr).strip()}): "
        f"pip install -r requirements.txt")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, (f"ruff check found what pyproject.toml's [tool.ruff] forbids; fix each "
                                    f"line it names (wrap a long line as the code around it reads):\n"
                                    f"{result.stdout}{result.stderr}")


def test_03_reuses_02s_no_sync():
    """The one technique that lived in two folders: DDP's no_sync. 03's ZeRO takes 02's, not a copy."""
    import data_parallel
    import zero
    assert zero.ZeRO.no_sync is data_parallel.DataParallel.no_sync is data_parallel.GradientSyncSwitch.no_sync
