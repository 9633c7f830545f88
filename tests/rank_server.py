"""The forkserver every rank of tests/harness.py is forked from, and its early start.

Its imports (torch, torch._dynamo: ~4 CPU-s) run in a process of their own: started from conftest
before pytest imports torch and collects, they overlap that work on the second core, so a session that
spawns ranks (one exercise's test) does not wait for them serially at its first spawn. It also imports
the eight trainers (and so nearly every module of the project), pytest and the harness: a rank forked
after them unpickles its test's function in ~0.04 CPU-s instead of ~0.4 (test_5d_combined's: it compiled
the project's sources, which no .pyc holds under PYTHONDONTWRITEBYTECODE): the suite forks hundreds.

A module imported here keeps what it computed at import for every rank: the project's modules read no
environment at import except kernels/ (TRITON_INTERPRET, which conftest sets before the server starts),
and the exercises' stubs are chosen when their code runs, not when it is imported.
"""
import multiprocessing.forkserver
import os
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = sorted(f"{path.parent.name}.train" for path in ROOT.glob("0[1-8]_*/train.py"))
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "pytest", "common", "harness", *TRAINERS]


@contextmanager
def _project_path():
    """PYTHONPATH holds this process's entries of sys.path inside the repository (pytest's `pythonpath`,
    conftest's tests/), for a child interpreter: Python 3.11's forkserver ignores the sys.path it is
    sent, so without them it could not import the project."""
    resolved = [Path(p).resolve() for p in sys.path if p]
    inside = [str(p) for p in resolved if ROOT in (p, *p.parents)]
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*inside, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def start():
    """Start the forkserver now if it is not running (it returns at once; the server imports PRELOAD in
    the background). A name it cannot import is left to the ranks, which then import it themselves."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    with _project_path():
        multiprocessing.forkserver.ensure_running()
