"""Each folder's "Try it": its commands run at the tiny size, and what the text says to look for is printed.

A folder README's lesson (01-08, kernels/) holds a section `## Try it`: a ```bash block of one or two
commands, a paragraph that begins "Look for" naming in backticks what the output shows, and a question. The
commands run here as a student runs them, with the interpreter starts left out: `python SCRIPT ARG...` runs
SCRIPT as `__main__` with that argv in this process (its imports are already here); `torchrun
--nproc_per_node N SCRIPT ARG...` runs it as `__main__` on N real gloo ranks with torchrun's environment,
forked from the rank server (tests/harness.py), every such command in turn in one spawn. Each runs in a
scratch folder (a picture it writes lands there), its stdout and stderr captured (rank 0's: the trainers
print there). A command that two folders share runs once.
"""
import contextlib
import io
import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from harness import layout_results, run_layouts, selected

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p.parent.name for p in ROOT.glob("[0-9][0-9]_*/README.md")) + ["kernels"]


def try_it(folder: str):
    """(commands, look-fors, question) of the folder README's `## Try it`."""
    lines = (ROOT / folder / "README.md").read_text().splitlines()
    start = lines.index("## Try it")
    end = next((k for k in range(start + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    section = lines[start + 1:end]
    fence = [k for k, line in enumerate(section) if line.startswith("```")]
    commands = [line.split("  #")[0].strip() for line in section[fence[0] + 1:fence[1]]
                if line.startswith(("python ", "torchrun "))]
    prose = " ".join(line.strip() for line in section[fence[1] + 1:])
    look, _, question = prose.partition("Question:")
    return commands, re.findall(r"`([^`]+)`", look[look.index("Look for"):]), question.strip()


def split(command: str):
    """(ranks or None for `python`, script, argv) of one command."""
    words = shlex.split(command)
    if words[0] == "python":
        return None, words[1], words[2:]
    assert words[:2] == ["torchrun", "--nproc_per_node"], command
    return int(words[2]), words[3], words[4:]


def run_python(script: str, argv: list, folder: str) -> str:
    """`script` as `__main__` with `argv`, from `folder`: what it printed (stdout and stderr); a non-zero exit
    fails with that output."""
    out, saved = io.StringIO(), (sys.argv, os.getcwd())
    sys.argv = [script, *argv]
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (None, 0), f"{script} {shlex.join(argv)} exited {stop.code}:\n{out.getvalue()}"
    finally:
        sys.argv = saved[0]
        os.chdir(saved[1])
    return out.getvalue()


def _rank(command, folder):
    """One torchrun command on this rank (the harness's process group is the trainer's world)."""
    _, script, argv = split(command)
    return run_python(script, argv, folder)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, request):
    """{command: what it printed}, the commands of the folders whose tests run, each once."""
    folder = str(tmp_path_factory.mktemp("try_it"))
    chosen = selected(request, {f: f for f in FOLDERS})
    commands = list(dict.fromkeys(c for f in chosen for c in try_it(f)[0]))
    printed = {c: run_python(*split(c)[1:], folder) for c in commands if split(c)[0] is None}
    for ranks in sorted({split(c)[0] for c in commands} - {None}):
        mine = [c for c in commands if split(c)[0] == ranks]
        spawn = run_layouts(_rank, dict(zip(mine, mine)), ranks, args=(folder,), timeout=300)
        printed.update({c: layout_results(spawn, c)[0] for c in mine})
    return printed


@pytest.mark.parametrize("folder", FOLDERS)
def test_try_it_prints_what_it_says_to_look_for(outputs, folder):
    commands, look_for, question = try_it(folder)
    assert 1 <= len(commands) <= 2 and look_for and question.endswith("?"), (commands, look_for, question)
    printed = "\n".join(outputs[c] for c in commands)
    missing = [fragment for fragment in look_for if fragment not in printed]
    assert not missing, f"{folder}: its Try it says to look for {missing}; it printed:\n{printed[-3000:]}"
