import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))   # tests/harness.py, tests/common.py


# The quick tier beside the exercises' tests (one per technique, 01-08 and kernels/): these single-process
# files; the full suite proves the rest. `python tests/timings.py quick` records how long it takes
# (tests/results/timings.md).
QUICK_FILES = ("tests/test_repository.py",)


# `pytest -n 2` (the README's suite command, pytest-xdist): each worker takes whole files, since a file's
# module fixtures spawn all its layouts at once (split between two workers, both would spawn them). The
# costliest files (wall seconds on 2 cores) go first, so the last file to start is a short one and both
# workers end together; the others follow in their usual order.
COSTLIEST_FIRST = ("test_5d_combined.py", "test_kernels.py", "test_clean_exit.py", "test_bad_inputs.py",
                   "test_exercises.py", "test_pipeline.py", "test_gpu_run.py", "test_mixed_precision.py",
                   "test_materialize.py")


def _spawns_ranks(config) -> bool:
    """Whether the session will likely fork ranks: a folder, or a test file that uses the harness."""
    paths = [Path(config.invocation_params.dir, arg.split("::")[0]) for arg in config.args]
    return any(p.is_dir() or p.suffix == ".py" and p.is_file() and "harness" in p.read_text() for p in paths)


def _xdist_controller(config) -> bool:
    """pytest -n: this process only hands tests to its workers, and spawns no ranks itself."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def _no_cuda_gpu() -> bool:
    """Whether torch sees no CUDA GPU. Without NVIDIA's driver device there is none: the answer then costs
    no `import torch` (~4 CPU-s), and the rank server starts at once."""
    if not os.path.exists("/dev/nvidiactl"):
        return True
    import torch
    return not torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (pytest -m quick): every exercise's test, "
                                       "one per technique, and the files named in conftest.QUICK_FILES")
    if _xdist_controller(config):    # hands whole files to its workers, in our order, and runs no test
        if config.option.dist == "load":    # -n alone: xdist's default, per test
            config.option.dist, config.option.loadscopereorder = "loadfile", False
        return
    if _no_cuda_gpu():
        # Triton picks the interpreter when a kernel is defined (`@triton.jit`): here when a test module first
        # imports kernels/, in a rank when it unpickles its function, before the test's environment is
        # applied. So it is set before the rank server starts
        os.environ["TRITON_INTERPRET"] = "1"
    if _spawns_ranks(config):
        import rank_server
        rank_server.start()   # its imports overlap collection on the other core


# pytest -n: test_failures' stalled-rank run (~50 s, mostly waits) runs in the controller, which runs no test,
# from the moment a worker has collected its test; the test reads its record (torchrun_runs.py).
_STALLED_RUN = {}


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Each worker learns where the stalled run's record will be."""
    if sys.platform.startswith("linux"):
        if "directory" not in _STALLED_RUN:
            _STALLED_RUN["directory"] = Path(tempfile.mkdtemp(prefix="stalled-run-"))
        node.workerinput["stalled_run_record"] = str(_STALLED_RUN["directory"] / "stalled_run.json")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    import torchrun_runs
    if "directory" in _STALLED_RUN and "run" not in _STALLED_RUN and torchrun_runs.STALLED_ID in ids:
        _STALLED_RUN["run"] = torchrun_runs.StalledRun(_STALLED_RUN["directory"])


def pytest_unconfigure(config):
    if "run" in _STALLED_RUN:
        _STALLED_RUN.pop("run").stop()
    if "directory" in _STALLED_RUN:
        shutil.rmtree(_STALLED_RUN.pop("directory"), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Mark the quick tier: every exercise's test (its parameters too) and QUICK_FILES."""
    import exercises
    try:
        tests = {e.test for e in exercises.parse()}
    except exercises.ExerciseError as error:   # test_exercises names it; the tier goes on without them
        warnings.warn(f"the quick tier has no exercise tests: {error}")
        tests = set()
    for item in items:
        function = item.nodeid.split("[")[0]
        if item.nodeid in tests or function in tests or item.nodeid.startswith(QUICK_FILES):
            item.add_marker(pytest.mark.quick)
    if hasattr(config, "workerinput"):   # a worker of pytest -n: the order the controller hands files out
        first = {name: k for k, name in enumerate(COSTLIEST_FIRST)}
        items.sort(key=lambda item: first.get(item.path.name, len(first)))   # stable: the rest as they were


@pytest.fixture(scope="session", autouse=True)
def data_cache():
    """Tokenize and pack the default corpus once, before any ranks are spawned to read it. Building it
    needs `datasets`, which the lent GPU machines lack: there only the tests that read it fail."""
    if importlib.util.find_spec("datasets") is None:
        return
    import common
    import data
    data.build_dataset("stdlib", data.ByteTokenizer(), common.SEQ_LEN)


@pytest.fixture(scope="session")
def default_reference():
    """01's (losses, gradient norms, final state dict) for common.argv()'s defaults (3 steps, mbs 4): the
    reference of every whole TP and CP run that keeps the default global batch, computed once."""
    import common
    return common.single_device_reference()
