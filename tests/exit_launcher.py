"""Launch the ranks of trainer runs as processes forked from an interpreter that has already imported
them (torch included), each ending through Python's normal exit, as a torchrun worker does.

    python tests/exit_launcher.py RUNS RANKS SCRIPT ARG... [--then RUNS RANKS SCRIPT ARG...]...

Each rank is `SCRIPT ARG...` as `__main__` with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR/PORT). A rank leaves by raising SystemExit up to this file's top level, so the interpreter
finalises as usual: atexit, module teardown and C++ static destructors, where a live gloo process group
aborted a finished run ("terminate called without an active exception"). Only the imports are shared (a
fresh interpreter costs ~2 s of CPU per rank, and this one ~7 s: one launcher serves several groups). Each
group's run is repeated RUNS times, one after the other, each meeting through a new store this launcher
serves, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE); the groups run in order. Prints one line
per rank and run, `SCRIPT run K rank R: exit CODE` (or `signal N`), and exits 1 if any rank of any run did
not exit 0.
"""
import gc
import os
import runpy
import sys
from pathlib import Path

groups, words = [], []
for word in sys.argv[1:] + ["--then"]:
    if word != "--then":
        words.append(word)
        continue
    runs, ranks, script, *argv = words                           # RUNS RANKS SCRIPT ARG...
    groups.append((int(runs), int(ranks), script, argv))
    words = []
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for script in dict.fromkeys(script for _, _, script, _ in groups):
    runpy.run_path(script, run_name="exit_launcher_preload")     # the imports, without running main()
import torch._dynamo  # noqa: E402,F401  (imported by the first parameter init: once here, not per rank)
import common  # noqa: E402  (tests/, this script's folder)
# The imported objects move out of the collector's sight: each rank's exit still collects what the rank made
# (its process group, model, threads), but no longer traverses torch's ~10^5 objects, which wrote to every
# page a rank shared with this parent (copy-on-write): a rank's exit cost ~2.2 CPU-s, now ~0.7.
gc.freeze()
failed = False
for runs, ranks, script, argv in groups:
    for run in range(runs):
        pids, port_pipes = {}, {}
        for rank in range(ranks):
            port_pipes[rank] = os.pipe()
            pid = os.fork()
            if pid == 0:                                          # the rank: runs, then exits like a worker
                os.close(port_pipes[rank][1])
                port = int(os.read(port_pipes[rank][0], 16))      # waits for the store below
                os.environ.update(common.torchrun_environment(rank, ranks, port))
                sys.argv = [script, *argv]
                runpy.run_path(script, run_name="__main__")
                sys.exit(0)                                       # propagates to the top: a normal exit
            pids[rank] = pid
        store = common.launcher_store(ranks)                      # after the forks (common.py says why)
        for read_end, write_end in port_pipes.values():
            os.close(read_end)
            os.write(write_end, str(store.port).encode())
            os.close(write_end)
        for rank, pid in pids.items():
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                print(f"{script} run {run} rank {rank}: signal {os.WTERMSIG(status)}", flush=True)
                failed = True
            else:
                print(f"{script} run {run} rank {rank}: exit {os.WEXITSTATUS(status)}", flush=True)
                failed |= os.WEXITSTATUS(status) != 0
        del store
sys.exit(1 if failed else 0)
