"""The forkserver every rank of tests/harness.py is forked from, and its early start.

Its imports (torch, torch._dynamo: ~4 CPU-s) run in a process of their own: started from conftest
before pytest imports torch and collects, they overlap that work on the second core, so a session that
spawns ranks (one exercise's test) does not wait for them serially at its first spawn.
"""
import multiprocessing.forkserver

PRELOAD = ["torch", "torch._dynamo", "torch.distributed"]


def start():
    """Start the forkserver now (it returns at once; the server imports PRELOAD in the background)."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
