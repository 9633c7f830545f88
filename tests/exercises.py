"""Exercises mode: the solution blocks of the technique files, a student copy without them, and the proof.

A solution block sits between two comments that stay readable in the solution (`//` in a .cu file):

    # exercise 02.1: ring all-reduce
    # hint: the idea and where it is derived (a README section, a formula), continued on lines that start
    #   with "#   "; never the code
    # test: tests/test_collectives.py::test_collectives_match_playbook_and_ring_all_reduce
    # level: 2   (optional: the harder form of an idea, stubbed by `make --level 2` only)
    # hides: "a phrase of a docstring or comment (in any source file) that would give the block away"
    ...the solution: complete statements inside a function...
    # end exercise

An exercise may have more blocks, each opened by a bare `# exercise 02.1`. IDs are NN.M for the folder
NN_*, K.M for kernels/, and the list is the course, in that order (COURSE.md groups it into classes).
`make` copies the repository's files into OUT (no history) with every block of level 1 (`--level 2`: all)
replaced by a stub that raises NotImplementedError("exercise 02.1 (ring all-reduce): <hint>") (#error in
CUDA), and each `hides` phrase replaced by "…" in every source file outside tests/ (a docstring or comment
that states the answer; the READMEs stay: they derive it). The markers stay, so `list` and `progress` run
there say which are left; MADE records what was stubbed (a level-1 copy's level-2 exercises are given).
`check` (tests/exercise_check.py) proves the cycle a student lives through, in order: with the exercises
before k solved and k and the later ones stubbed, k's test fails naming k and no other; `check
--passing`: with k solved too, it passes.

    python tests/exercises.py list                           # the course, each exercise's test and status
    python tests/exercises.py make ../student                # or --level 2, or --only 04.1 04.2
    python tests/exercises.py progress                       # in the copy: which pass, the next one to do
    python tests/exercises.py check [--passing] [--only ID]  # the proof (exercise_check.py)
"""
import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (".py", ".cu", ".cuh", ".h", ".cpp")
OPEN = re.compile(r"^(\s*)(#|//) exercise ([0-9]{2}|K)\.([0-9]+)(?:: (.+))?$")
STUB_NAME = re.compile(r"exercise ((?:[0-9]{2}|K)\.[0-9]+) \(")   # how a stub's message names its exercise
SKIP_DIRS = {"__pycache__", "venv", "node_modules"}     # and hidden folders (.git, .cache, .venv, ...)
MADE = ".exercises-made.json"      # in a student copy: {"level": 1 or 2, "stubbed": [IDs]} (make writes it)


class ExerciseError(ValueError):
    pass


@dataclass
class Block:
    path: str                      # relative to the root
    line: int                      # 1-based line of the opening marker
    indent: str
    comment: str                   # "#" or "//"
    body: tuple                    # (first, last) 0-based line indices of the solution lines


@dataclass
class Exercise:
    id: str
    title: str = ""
    hint: str = ""
    test: str = ""
    level: int = 1
    hides: list = field(default_factory=list)      # phrases the student copy's sources hold as "…"
    blocks: list = field(default_factory=list)

    @property
    def order(self):               # the course: folders 01-08, then kernels/
        folder, number = self.id.split(".")
        return (100 if folder == "K" else int(folder), int(number))

    def message(self):
        return f"exercise {self.id} ({self.title}): {self.hint}"


def source_files(root: Path):
    """The repository's source files, relative: git's tracked files when it is a clone, else a walk."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True)
        names = [n for n in out.stdout.split("\0") if n and (root / n).is_file()]
    else:
        names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not any(
                 part in SKIP_DIRS or part.startswith(".") for part in p.relative_to(root).parts[:-1])]
    return sorted(names)


def _header(lines, i, comment):
    """The fields after an opening marker: -> ({hint, test, level, hides: text}, index of the first body
    line)."""
    fields, key = {"hint": [], "test": [], "level": [], "hides": []}, None
    while i < len(lines):
        text = lines[i].strip()
        match = re.match(rf"{re.escape(comment)} (hint|test|level|hides): (.*)$", text)
        if match:
            key = match.group(1)
            fields[key].append(match.group(2).strip())
        elif key and lines[i].lstrip().startswith(comment + "   "):
            fields[key].append(text[len(comment):].strip())
        else:
            break
        i += 1
    return {k: ("" if k == "test" else " ").join(v) for k, v in fields.items()}, i


def parse(root: Path = ROOT) -> list:
    """Every exercise of the technique files (tests/ is not searched), in course order; a malformed marker
    raises ExerciseError naming its file and line."""
    exercises = {}
    for name in source_files(root):
        if not name.endswith(SOURCES) or name.startswith("tests/"):
            continue
        lines = (root / name).read_text().splitlines()
        functions = None   # parsed at this file's first marker: most files have none
        i = 0
        while i < len(lines):
            match = OPEN.match(lines[i])
            if not match:
                if re.match(r"\s*(#|//) (end exercise\s*$|exercise \S+\.[0-9])", lines[i]):
                    raise ExerciseError(f"{name}:{i + 1}: a marker outside 'exercise ID: title' ... "
                                        f"'end exercise'")
                i += 1
                continue
            indent, comment, folder, number, title = match.groups()
            where, ex_id = f"{name}:{i + 1}", f"{folder}.{number}"
            expected = "kernels/" if folder == "K" else f"{folder}_"
            if not name.startswith(expected):
                raise ExerciseError(f"{where}: exercise {ex_id} belongs in a file under {expected}*")
            header, start = _header(lines, i + 1, comment)
            hint, test = header["hint"], header["test"]
            end = next((j for j in range(start, len(lines)) if OPEN.match(lines[j]) or
                        lines[j].strip() == f"{comment} end exercise"), None)
            if end is None or lines[end].rstrip() != f"{indent}{comment} end exercise":
                raise ExerciseError(f"{where}: exercise {ex_id} has no '{comment} end exercise' at its "
                                    f"indentation")
            if not any(lines[j].strip() for j in range(start, end)):
                raise ExerciseError(f"{where}: exercise {ex_id} has no solution lines")
            if any(lines[j].strip() and not lines[j].startswith(indent) for j in range(start, end)):
                raise ExerciseError(f"{where}: a solution line is indented less than its marker")
            if name.endswith(".py") and functions is None:
                tree = ast.parse("\n".join(lines))
                functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
            if name.endswith(".py") and not any(f.lineno < i + 1 and f.end_lineno >= end for f in functions):
                raise ExerciseError(f"{where}: exercise {ex_id} is not inside a function (its stub would run "
                                    f"when the module is imported)")
            exercise = exercises.setdefault(ex_id, Exercise(ex_id))
            if title:
                if exercise.title:
                    raise ExerciseError(f"{where}: exercise {ex_id} is defined twice (more blocks: "
                                        f"'# exercise {ex_id}')")
                if not hint or not test:
                    raise ExerciseError(f"{where}: exercise {ex_id} needs a 'hint:' and a 'test:' line")
                exercise.title, exercise.hint, exercise.test = title.strip(), hint, test
                if header["level"] not in ("", "1", "2"):
                    raise ExerciseError(f"{where}: exercise {ex_id}'s level is 1 or 2, not "
                                        f"{header['level']!r}")
                exercise.level = int(header["level"] or 1)
                # a student copy's header holds "…" for each phrase it hid
                exercise.hides = [h for h in re.findall(r'"([^"]+)"', header["hides"]) if h != "…"]
            elif any(header.values()):
                raise ExerciseError(f"{where}: hint, test, level and hides go with the title, in the first "
                                    f"block")
            exercise.blocks.append(Block(name, i + 1, indent, comment, (start, end - 1)))
            i = end + 1
    texts = None            # the source files' text outside the blocks, read at the first `hides`
    for exercise in exercises.values():
        where = f"{exercise.blocks[0].path}:{exercise.blocks[0].line}"
        if not exercise.title:
            raise ExerciseError(f"{where}: exercise {exercise.id} has no block with its title")
        if '"' in exercise.message() and any(b.comment == "//" for b in exercise.blocks):
            raise ExerciseError(f"{where}: no '\"' in a CUDA hint")
        if exercise.hides and texts is None:
            texts = prose_texts(root, exercises.values())
        for phrase in exercise.hides:
            if any(phrase in other.message() for other in exercises.values()):
                raise ExerciseError(f"{where}: exercise {exercise.id} hides {phrase!r}, which a hint holds "
                                    f"(its stub would change)")
            if not any(phrase in text for text in texts.values()):
                raise ExerciseError(f"{where}: exercise {exercise.id} hides {phrase!r}, which no source file "
                                    f"holds outside the blocks")
    return sorted(exercises.values(), key=lambda e: e.order)


def lesson_sources(root: Path) -> list:
    """The source files a `hides` phrase may be in: every one but tests/'s."""
    return [name for name in source_files(root) if name.endswith(SOURCES) and not name.startswith("tests/")]


def prose_texts(root: Path, exercises) -> dict:
    """{lesson source file: its text without any exercise's blocks}."""
    return {name: outside_blocks(root, name, exercises) for name in lesson_sources(root)}


def outside_blocks(root: Path, path: str, exercises) -> str:
    """The text of `path` without any exercise's blocks (from the opening marker to `end exercise`)."""
    lines = (root / path).read_text().splitlines()
    inside = {j for e in exercises for b in e.blocks if b.path == path
              for j in range(b.line - 1, b.body[1] + 2)}
    return "\n".join(line for j, line in enumerate(lines) if j not in inside)


def stub_lines(exercise: Exercise, block: Block) -> list:
    """The student's lines in place of a block: a raise (Python), an #error (CUDA)."""
    if block.comment == "//":
        return [f"{block.indent}#error \"{exercise.message()}\""]
    width = max(40, 110 - len(block.indent) - 6)
    pieces = textwrap.wrap(exercise.message(), width, drop_whitespace=False) or [""]
    literals = [json.dumps(piece, ensure_ascii=False) for piece in pieces]
    if len(literals) == 1 and len(block.indent) + 27 + len(literals[0]) <= 110:
        return [f"{block.indent}raise NotImplementedError({literals[0]})"]
    return ([f"{block.indent}raise NotImplementedError("] +
            [f"{block.indent}    {text}" for text in literals[:-1]] + [f"{block.indent}    {literals[-1]})"])


def guarded_lines(exercise: Exercise, block: Block, lines: list) -> list:
    """check's copy: the stub, active only while EXERCISES_STUBBED names the exercise, then the solution."""
    first, last = block.body
    if block.comment == "//":
        macro = "EXERCISE_STUB_" + re.sub(r"\W", "_", exercise.id)
        return ["#ifdef " + macro, *stub_lines(exercise, block), "#endif", *lines[first:last + 1]]
    condition = f'"{exercise.id}" in __import__("os").environ.get("EXERCISES_STUBBED", "").split(",")'
    inner = Block(block.path, block.line, block.indent + "    ", block.comment, block.body)
    return [f"{block.indent}if {condition}:", *stub_lines(exercise, inner), *lines[first:last + 1]]


def write_copy(root: Path, out: Path, exercises: list, replace, hide: bool = False) -> Path:
    """Copy the repository's files into out, each block replaced by replace(exercise, block, lines); with
    `hide`, each exercise's `hides` phrases replaced by "…" in every lesson source file."""
    given, out = out, Path(out).resolve()
    if out == root or root in out.parents:
        raise ExerciseError(f"{out} is inside the repository: write the copy somewhere else")
    if out.exists() and not out.is_dir():
        raise ExerciseError(f"{given} is a file: pass a new folder you can write (e.g. ../student)")
    if out.exists() and any(out.iterdir()):
        raise ExerciseError(f"{out} exists and is not empty: choose a new folder")
    by_file = {}
    for exercise in exercises:
        for block in exercise.blocks:
            by_file.setdefault(block.path, []).append((exercise, block))
    rewritten = {}
    for name, blocks in by_file.items():
        lines = (root / name).read_text().splitlines()
        for exercise, block in sorted(blocks, key=lambda eb: -eb[1].line):     # bottom up: indices hold
            first, last = block.body
            lines[first:last + 1] = replace(exercise, block, lines)
        rewritten[name] = "\n".join(lines) + "\n"
    phrases = {p for exercise in exercises for p in exercise.hides} if hide else set()
    for name in lesson_sources(root) if phrases else ():
        text = rewritten.get(name) or (root / name).read_text()
        if any(phrase in text for phrase in phrases):
            for phrase in phrases:
                text = text.replace(phrase, "…")
            rewritten[name] = text
    made = not out.exists()
    try:
        for name in source_files(root):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            if name in rewritten:
                (out / name).write_text(rewritten[name])
                shutil.copymode(root / name, out / name)
            else:
                shutil.copy2(root / name, out / name)
    except OSError as error:          # no such parent (/proc), read-only, full: nothing half-made is left
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise ExerciseError(f"cannot write the copy into {given} ({error.strerror}): pass a new folder you "
                            f"can write (e.g. ../student)") from None
    return out


def make(out, only=None, root: Path = ROOT, level: int = 1) -> list:
    """The student copy: the blocks of every exercise up to `level` (or of the IDs in `only`) stubbed, their
    `hides` phrases gone. Returns the stubbed."""
    exercises = parse(root)
    chosen = select(exercises, only) if only else [e for e in exercises if e.level <= level]
    copy = write_copy(root, out, chosen, lambda exercise, block, lines: stub_lines(exercise, block),
                      hide=True)
    (copy / MADE).write_text(json.dumps({"level": level, "stubbed": [e.id for e in chosen]}) + "\n")
    return chosen


def made(root: Path):
    """What `make` stubbed in the student copy at `root` ({"level", "stubbed"}), None elsewhere."""
    path = root / MADE
    return json.loads(path.read_text()) if path.is_file() else None


def select(exercises, only):
    known = {e.id for e in exercises}
    unknown = sorted(set(only or ()) - known)
    if unknown:
        raise ExerciseError(f"no exercise {', '.join(unknown)} (python tests/exercises.py list shows them)")
    return [e for e in exercises if not only or e.id in only]


def is_stub(exercise: Exercise, block: Block, root: Path) -> bool:
    lines = (root / block.path).read_text().splitlines()
    return lines[block.body[0]:block.body[1] + 1] == stub_lines(exercise, block)


# ======================================================================================
# Command line
# ======================================================================================
class Parser(argparse.ArgumentParser):
    def error(self, message):          # one line, no usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    import exercise_course   # the course and the progress build on this module's parse
    parser = Parser(prog="python tests/exercises.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the course (COURSE.md): its classes, each exercise's test and status")
    commands.add_parser("progress", help="in a student copy: run the written exercises' tests; which pass, "
                                         "which are todo, the next one")
    maker = commands.add_parser("make", help="write a student copy of the repository into OUT")
    maker.add_argument("out", metavar="OUT", help="a new folder outside the repository")
    maker.add_argument("--level", type=int, choices=[1, 2], default=1,
                       help="2: stub the harder forms (level-2 exercises) as well")
    checker = commands.add_parser("check", help="prove the make / fail / pass cycle of every exercise")
    checker.add_argument("--passing", action="store_true",
                         help="the passing side: k's test passes with k solved")
    for sub in (maker, checker):
        sub.add_argument("--only", nargs="+", metavar="ID", help="these exercises only (e.g. 04.1 04.2)")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(exercise_course.listing())
        elif args.command == "progress":
            print(exercise_course.progress())
        elif args.command == "make":
            done = make(args.out, args.only, level=args.level)
            print(f"{args.out}: a student copy with {len(done)} exercises stubbed; "
                  f"there: python tests/exercises.py list")
        else:
            from exercise_check import check   # it builds on this module's parse and copies
            outcomes = check(args.passing, args.only)
            for o in outcomes:
                print(f"{o.exercise:<5} {o.status:<8} {o.detail}")
            if any(o.status == "wrong" for o in outcomes):
                sys.exit(1)
    except ExerciseError as error:
        parser.error(str(error))


if __name__ == "__main__":
    # The module under its own name, so that exercise_check (which imports it) raises the ExerciseError
    # that main catches: run as a script this file is `__main__`, a second module with a class of its own.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import exercises
    exercises.main()
