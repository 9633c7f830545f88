"""Run a function on N real gloo ranks on the CPU and collect what each rank returns.

    results = run_ranks(fn, world_size=4, args=(...))   # results[r] is fn's return value on rank r

Every rank is a fresh `spawn`ed process with the environment `torchrun` would give it (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and an initialised gloo process group, so code
under test can call `dist.*` directly or read the environment like a `torchrun` script. A rank that
raises makes the call fail with that rank's traceback; a rank that hangs (a mismatched collective)
makes it fail after `timeout` seconds instead of hanging the test suite. `fn` must be importable by
name (a module-level function), as `spawn` pickles it. Results may hold tensors: they are copied.
"""
import os
import pickle
import traceback
from datetime import timedelta
from importlib import import_module

import torch.distributed as dist
import torch.multiprocessing as mp

free_port = import_module("02_data_parallel.process_grid").free_port


class RankError(RuntimeError):
    pass


def _rank_main(rank, world_size, port, fn, args, kwargs, queue, timeout):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        torch.set_num_threads(1)  # N ranks share 2 cores; more threads only oversubscribe them
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        # Plain pickle copies tensors into the bytes. The queue's own pickler would pass them as shared-
        # memory handles, which die with this process, often before the parent has read them.
        queue.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, args=(), kwargs=None, timeout: float = 240.0):
    """Spawn `world_size` gloo ranks running fn(*args, **kwargs); return the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, kwargs or {}, queue, timeout),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results, failures = {}, []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception:
                missing = sorted(set(range(world_size)) - results.keys() - {r for r, _ in failures})
                raise RankError(f"ranks {missing} gave no result within {timeout:.0f}s (a hang? "
                                f"collectives issued in different orders on different ranks)") from None
            if ok:
                results[rank] = pickle.loads(value)
            else:
                failures.append((rank, value))
                break  # the other ranks are likely blocked in a collective with the failed one
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.kill()
    if failures:
        rank, tb = failures[0]
        raise RankError(f"rank {rank} of {world_size} failed:\n{tb}")
    return [results[r] for r in range(world_size)]
