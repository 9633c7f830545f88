"""Run a function on N real gloo ranks on the CPU and collect what each rank returns.

    results = run_ranks(fn, world_size=4, args=(...))   # results[r] is fn's return value on rank r
    outcomes = run_layouts(run_one, {"tp2": ..., "cp2": ...}, world_size=2)   # one spawn, layouts in turn
    layout_results(outcomes, "cp2")     # every rank's run_one(layouts["cp2"]), or the error naming "cp2"

Every rank is a new process with the caller's environment plus what `torchrun` would give it (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) and an initialised gloo
process group, so code under test can call `dist.*` directly or read the environment like a `torchrun`
script. A rank that raises makes the call fail with that rank's traceback; a rank that hangs (a
mismatched collective) makes it fail after `timeout` seconds instead of hanging the test suite. `fn` must
be importable by name (a module-level function), as it is pickled to the ranks. Results may hold tensors:
they are copied. The ranks are forked from a `forkserver` that has imported torch once: a `spawn`ed rank
paid ~2-3 s of imports (torch, and torch._dynamo, which the first parameter initialisation imports) on 2
cores, and its exit ~2 s more. A start still costs seconds, so a test file runs its layouts in one spawn
with `run_layouts` and checks each in its own parametrised test: a layout that fails names itself, on the
ranks or in its test, and leaves the others' results standing.
"""
import os
import pickle
import traceback
from contextlib import contextmanager
from datetime import timedelta
from queue import Empty

import torch.distributed as dist
import torch.multiprocessing as mp

import common
import rank_server

_RANKS = mp.get_context("forkserver")   # rank_server.py: the server and what it imports once


class RankError(RuntimeError):
    pass


def _rank_main(environment, rank, world_size, port, timeout, queue, body, body_args):
    """One rank: join the job, run body; its last message is ("end", value) or ("error", traceback)."""
    os.environ.clear()                       # the server's environment is the one it started with
    os.environ.update(environment)
    os.environ.update(common.torchrun_environment(rank, world_size, port))
    try:
        import torch
        torch.set_num_threads(1)  # N ranks share 2 cores; more threads only oversubscribe them
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        queue.put((rank, "end", None, body(rank, world_size, port, timeout, queue, *body_args)))
    except BaseException:
        queue.put((rank, "error", None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _spawned(world_size, timeout, body, *body_args):
    """Start the ranks; yield receive(wait): the next message (rank, kind, layout id, value), None after
    `wait` seconds of silence. On exit the ranks get 5 s to finish if all sent their last message (a
    failed one's peers are likely blocked in a collective with it: 0.5 s), then are killed.

    The ranks meet through a store this process serves, as torchrun's agent does, on a port the system
    gives it and it holds until the end: no other process can take the port before the ranks use it."""
    rank_server.start()                      # if conftest has not started it
    store = common.launcher_store(world_size, timeout)
    queue, port, finished = _RANKS.Queue(), store.port, set()
    procs = [_RANKS.Process(target=_rank_main, daemon=True,
                            args=(dict(os.environ), r, world_size, port, timeout, queue, body, body_args))
             for r in range(world_size)]
    for p in procs:
        p.start()

    def receive(wait=timeout):
        try:
            message = queue.get(timeout=wait)
        except Empty:
            return None
        if message[1] in ("end", "error"):
            finished.add(message[0])
        return message
    try:
        yield receive
    finally:
        for p in procs:
            p.join(timeout=5 if len(finished) == world_size else 0.5)
            if p.is_alive():
                p.kill()
        del store   # the server goes only once no rank can still need it


def _call(rank, world_size, port, timeout, queue, fn, args, kwargs):
    # Plain pickle copies tensors into the bytes. The queue's own pickler would pass them as shared-
    # memory handles, which die with this process, often before the parent has read them.
    return pickle.dumps(fn(*args, **kwargs))


def run_ranks(fn, world_size: int, args=(), kwargs=None, timeout: float = 240.0):
    """Spawn `world_size` gloo ranks running fn(*args, **kwargs); return the results in rank order."""
    results = {}
    with _spawned(world_size, timeout, _call, fn, args, kwargs or {}) as receive:
        while len(results) < world_size:
            message = receive()
            if message is None:
                missing = sorted(set(range(world_size)) - results.keys())
                raise RankError(f"ranks {missing} gave no result within {timeout:.0f}s (a hang? "
                                f"collectives issued in different orders on different ranks)")
            rank, kind, _, value = message
            if kind == "error":   # the other ranks are likely blocked in a collective with the failed one
                raise RankError(f"rank {rank} of {world_size} failed:\n{value}")
            results[rank] = pickle.loads(value)
    return [results[r] for r in range(world_size)]


# ======================================================================================
# Several layouts in one spawn
# ======================================================================================
def _all_finished(store, step, rank, world_size, failed, settle, timeout):
    """After layout `step`: may the ranks go on? Only if every rank finished it, completed or raised: then
    none is left waiting in a collective for another, and the next layout starts together. A rank that
    raised waits `settle` seconds for the others (a peer blocked on it never finishes); the first rank
    to know decides for all, through the job's store (out of band: no collective can hang on it)."""
    store.set(f"layouts/{step}/finished/{rank}", "")
    try:
        store.wait([f"layouts/{step}/finished/{r}" for r in range(world_size)],
                   timedelta(seconds=settle if failed else timeout))
        decision = "go on"
    except dist.DistStoreError:       # the wait timed out
        decision = "stop"
    return store.compare_set(f"layouts/{step}/decision", "", decision) == b"go on"   # the first one stays


def _layouts_on_rank(rank, world_size, port, timeout, queue, run_one, layouts, args, settle):
    """Every layout in turn; each result (or traceback) is sent as soon as it exists, tagged."""
    # A client of the store the process group met through (the caller serves it): the ranks' agreement
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    for step, (layout_id, layout) in enumerate(layouts.items()):
        queue.put((rank, "running", layout_id, None))
        try:
            queue.put((rank, "done", layout_id, pickle.dumps(run_one(layout, *args))))
            failed = False
        except (Exception, SystemExit):   # SystemExit: a trainer's main() refusing its flags
            queue.put((rank, "failed", layout_id, traceback.format_exc()))
            failed = True
        last = step + 1 == len(layouts)
        if not last and not _all_finished(store, step, rank, world_size, failed, settle, timeout):
            queue.put((rank, "stopped", layout_id, None))
            return None
    return None


def run_layouts(run_one, layouts: dict, world_size: int, args=(), timeout: float = 240.0,
                settle: float = 20.0) -> dict:
    """Spawn `world_size` gloo ranks once; each runs run_one(layout, *args) for every {id: layout} in turn.

    Returns {id: [result on rank 0, 1, …]} for the layouts every rank completed and {id: RankError} for
    the others, whose message names the layout, the rank and its traceback, or what kept it from running.
    A layout that raises on a rank does not stop the next layouts when every rank finished it (it raised
    everywhere, or after its last collective): nobody waits on anybody. If a rank has not finished it
    `settle` seconds after another raised, it is likely blocked in a collective with the failed rank,
    and a next layout would hang or pair its messages with stale ones: the ranks stop there, and the
    layouts after it report that they were not run and why. `timeout` bounds the silence between two
    messages of the ranks (a hang), as in run_ranks.
    """
    ids = list(layouts)
    done, failed = {i: {} for i in ids}, {i: [] for i in ids}
    running, why = {}, None           # layout each rank is in; what ended the spawn before its last layout
    with _spawned(world_size, timeout, _layouts_on_rank, run_one, layouts, args, settle) as receive:
        ended = set()
        while len(ended) < world_size:
            message = receive(1.0 if why else timeout)   # once it is over, read only what is already sent
            if message is None:
                silent = {r: running.get(r) for r in range(world_size) if r not in ended}
                why = why or (f"ranks {sorted(silent)} sent nothing for {timeout:.0f}s while in layouts "
                              f"{silent} (a hang? collectives issued in different orders on different ranks)")
                break
            rank, kind, layout_id, value = message
            if kind == "running":
                running[rank] = layout_id
            elif kind == "done":
                done[layout_id][rank] = pickle.loads(value)
            elif kind == "failed":
                failed[layout_id].append((rank, value))
            elif kind == "stopped":
                why = why or (f"layout {layout_id} failed and not every rank finished it within "
                              f"{settle:.0f}s (blocked in a collective with the failed rank?), so the ranks "
                              f"stopped there")
            elif kind == "error":
                why = why or f"rank {rank} failed outside any layout:\n{value}"
            if kind in ("end", "error"):
                ended.add(rank)
    outcomes = {}
    for layout_id in ids:
        if failed[layout_id]:
            (rank, tb), *others = failed[layout_id]
            also = f" (and on ranks {[r for r, _ in others]})" if others else ""
            outcomes[layout_id] = RankError(f"layout {layout_id} failed on rank {rank} of "
                                            f"{world_size}{also}:\n{tb}")
        elif len(done[layout_id]) == world_size:
            outcomes[layout_id] = [done[layout_id][r] for r in range(world_size)]
        else:
            inside = sorted(r for r, i in running.items() if i == layout_id and r not in done[layout_id])
            state = f"did not finish on ranks {inside}" if inside else "was not run"
            outcomes[layout_id] = RankError(f"layout {layout_id} {state}: {why or 'the ranks ended early'}")
    return outcomes


def layout_results(outcomes: dict, layout_id):
    """One layout's results in rank order, from run_layouts; its RankError if it did not complete."""
    outcome = outcomes[layout_id]
    if isinstance(outcome, RankError):
        raise RankError(*outcome.args)
    return outcome


def selected(request, layouts: dict) -> dict:
    """The layouts a module fixture must run: those its collected tests name by parameter, so that
    `pytest 'file::test[id]'` (an exercise's test) spawns for that one; all of them in a full run, and
    whenever a test using the fixture is not parametrized by a layout (it reads several)."""
    wanted = set()
    for item in request.session.items:
        if item.module is not request.module or request.fixturename not in item.fixturenames:
            continue
        params = item.callspec.params.values() if hasattr(item, "callspec") else ()
        named = {v for v in params if isinstance(v, str) and v in layouts}
        if not named:
            return layouts
        wanted |= named
    return {k: v for k, v in layouts.items() if k in wanted} or layouts
