"""Run many command lines of scripts, each in a process of its own, importing every script once.

    python tests/forkrun.py --limit 60 < cases.json > results.json

`cases.json` is a list of {"script": path, "argv": [...], "env": {name: value or null}} and, optionally,
"memory_limit": bytes (`ulimit -v`: RLIMIT_AS, that much address space above what the child holds at its
start, so a size that is not refused fails to allocate instead of taking the host); each case
runs in a child forked from a parent that has already imported the scripts' modules (torch included),
so a case costs milliseconds instead of the ~2 s of a fresh interpreter, while keeping what a separate
run has: its own exit status, its own stderr and stdout, and a traceback only where Python would print
one. Each result is {"code", "stdout", "stderr", "seconds"}; a case still running after `--limit`
seconds is killed (code -9).
"""
import json
import os
import resource
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _child(script: str, argv: list, env: dict, out_path: str, err_path: str, memory_limit=None):
    """Runs in the forked child: the script as `__main__`, then exits with Python's exit status."""
    code = 1
    try:
        if memory_limit:
            held = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (held + memory_limit, resource.RLIM_INFINITY))
        for fd, path in ((1, out_path), (2, err_path)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        sys.argv = [script, *argv]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:   # what the interpreter does with it
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def run_cases(cases: list, limit: float) -> list:
    for script in dict.fromkeys(case["script"] for case in cases):
        sys.path.insert(0, str(Path(script).resolve().parents[1]))
        runpy.run_path(script, run_name="forkrun_preload")   # the imports, without running main()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        out_path, err_path = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        for case in cases:
            sys.stdout.flush()
            sys.stderr.flush()
            start = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                _child(case["script"], case["argv"], case.get("env", {}), out_path, err_path,
                       case.get("memory_limit"))
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.perf_counter() - start > limit:
                    os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    break
                time.sleep(0.005)
            seconds = time.perf_counter() - start
            results.append({"code": os.waitstatus_to_exitcode(status), "seconds": seconds,
                            "stdout": Path(out_path).read_text(errors="replace"),
                            "stderr": Path(err_path).read_text(errors="replace")})
    return results


def run_in_fresh_process(cases: list, limit: float, timeout: float = 900, **options) -> list:
    """From a test: run_cases in a new interpreter (its forks must not copy the test process), with
    subprocess.run's `options` (env, cwd); the results in the order of the cases."""
    done = subprocess.run([sys.executable, __file__, "--limit", str(limit)], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=timeout, **options)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


if __name__ == "__main__":
    limit = float(sys.argv[sys.argv.index("--limit") + 1]) if "--limit" in sys.argv else 60.0
    json.dump(run_cases(json.load(sys.stdin), limit), sys.stdout)
