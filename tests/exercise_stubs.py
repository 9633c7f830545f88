"""pytest plugin of `python tests/exercises.py check`: each named test runs under its own exercise stubs.

EXERCISES_PLAN names a JSON file {test node id: [exercise IDs stubbed for it]}. Before a test's fixtures
are set up, EXERCISES_STUBBED (read by the guarded stubs of check's copy; ranks spawned by the test
inherit it) and NVCC_APPEND_FLAGS (-DEXERCISE_STUB_<ID> for the CUDA stubs) are set to its list.
"""
import json
import os
import re

import pytest

PLAN = json.loads(open(os.environ["EXERCISES_PLAN"]).read())
HARMLESS = {"data_cache"}          # kept fixtures that run no exercise (conftest's build of the data cache)


def stubbed(item):
    matches = (ids for test, ids in PLAN.items() if item.nodeid == test or item.nodeid.startswith(test + "["))
    return next(matches, [])


def pytest_collection_modifyitems(session, config, items):
    """A fixture kept across tests (scope above function) keeps what it computed under the first test's
    stubs: two tests that share one must not run under different stubs."""
    users = {}
    for item in items:
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            scope = defs[-1].scope
            if scope != "function" and name not in HARMLESS:
                # one value per definition and module or class (a module's copy, check's later round, has
                # its own)
                owner = {"module": item.module.__name__, "class": getattr(item, "cls", None)}.get(scope)
                users.setdefault((name, id(defs[-1]), owner), set()).add(tuple(stubbed(item)))
    shared = sorted({key[0] for key, stubs in users.items() if len(stubs) > 1})
    if shared:
        raise pytest.UsageError(f"exercise tests under different stubs share the fixtures {shared}: "
                                f"name tests that do not share them")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    ids = stubbed(item)
    os.environ["EXERCISES_STUBBED"] = ",".join(ids)
    os.environ["NVCC_APPEND_FLAGS"] = " ".join("-DEXERCISE_STUB_" + re.sub(r"\W", "_", i) for i in ids)
