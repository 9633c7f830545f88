"""A pytest plugin: `-p kernels.pytest_shard --shard I/N` runs every N-th collected test from the I-th on.

kernels/gpu_run.py runs the GPU tests as N such pytest processes at once: the Triton compiles that fill
their time are CPU work, and a GPU machine has many cores. Taking every N-th test (not a contiguous block)
spreads the parametrised, equally costly cases of one test over the shards. It splits what `-k` and the
other selections kept, and a shard left with no test (more shards than tests) ends with status 0.
"""
import pytest


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="I/N", help="run only the collected tests I, I+N, I+2N, ... "
                                                    "(0 <= I < N)")


@pytest.hookimpl(trylast=True)       # after -k / -m / --deselect have taken their share
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("shard")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise ValueError(f"--shard {shard}: pass I/N with 0 <= I < N")
    kept = items[index::count]
    kept_ids = set(map(id, kept))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
    items[:] = kept


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("shard") and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK
