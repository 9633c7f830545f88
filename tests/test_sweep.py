"""08_5d_combined/sweep.py and the planner's --bandwidths: layouts measured beside the planner's prediction.

The sweep runs real jobs of 08's trainer on the tiny model (gloo, 2 steps each). At world 4, forked ranks
(--launcher fork: the imports once, ~0.5 CPU-s a row), and at world 2 each alone: dp, tp, pp, cp, ep and
ZeRO-1 must run to the end with their speed, memory and communication per rank. At world 4, a row whose
model cannot fit the rank's memory cap (--memory-limit-gb 1.5; a 20,000,000-token vocabulary: 2.56 GB a
matrix, so its first allocation fails) must end as out of memory with its allocator's line; a row whose
checkpoint folder holds a named pipe nobody writes (a read that never returns, as on a hung file system)
must end at --stall-s as timed out. Afterwards no process of the sweep may be left, and a rerun must skip
every recorded row. The Slurm path: sbatch jobs emitted from train.sbatch, one of them run by bash with
test_cluster_launch's stand-ins (srun runs its command: torchrun, world 1), then --collect records it and
leaves the one not run pending.
The planner reads bench_collectives.py's records: each dimension's bytes at its collectives' bus bandwidth.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common import TINY
from test_cluster_launch import stand_ins

import measured_links
import plan_arithmetic
import planner
import search
import step_time
import sweep
import sweep_jobs

ROOT = Path(__file__).resolve().parents[1]
MODEL = [flag for flag in TINY if flag not in ("--lr", "3e-3", "--warmup-steps", "1", "--log-every", "1000",
                                               "--no-progress")]
PLANNER = ["--precision", "fp32", "--peak-tflops", "0.01", "--hbm-tbps", "0.01", "--bw-intra", "0.1",
           "--bw-inter", "0.1"]


def processes_naming(text: str) -> list:
    """Live processes (not this one) whose command line holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.name) != os.getpid() and \
                    text in (entry / "cmdline").read_bytes().decode(errors="replace") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def swept(argv: list, tmp_path) -> list:
    """The records of `sweep.py argv`, run as a process of its own, after checking that it ended well and
    that no process naming tmp_path (a row's rank, a job's launcher) outlived it."""
    done = subprocess.run([sys.executable, "08_5d_combined/sweep.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not processes_naming(str(tmp_path)), "a process of the sweep outlived it"
    out = Path(argv[argv.index("--out") + 1])
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def assert_ran(record: dict, world: int):
    """A row that ran its 2 steps: its speed, and memory and communication on every rank."""
    assert record["outcome"] == "ok" and record["exit"] == 0, record
    assert record["steps"] == 2 and record["tokens_per_s"] > 0 and record["step_s"] > 0
    assert len(record["peak_memory"]) == world and all(m > 0 for m in record["peak_memory"])
    assert len(record["comm_s"]) == world and all(s > 0 for s in record["comm_s"])   # every rank communicated
    assert record["predicted"]["step_s"] > 0 and record["left_running"] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cleanup reads /proc (Linux)")
def test_a_sweep_records_every_layout_its_failures_and_leaves_nothing_running(tmp_path, capsys):
    stuck = tmp_path / "stuck" / "step_000001"
    stuck.mkdir(parents=True)
    os.mkfifo(stuck / "manifest.json")                        # --resume reads it: open() waits for a writer
    out = tmp_path / "sweep"
    rows = ["dp=4", "tp=2,dp=2", "pp=2,dp=2", "cp=2,dp=2", "dp=4,ep=2 --num-experts 4", "dp=4,zero=1",
            "dp=4 --vocab-size 20000000 --no-memory-check",      # the allocator fails under the cap
            f"tp=2,dp=2 --checkpoint-dir {stuck.parent} --resume",
            "dp=4 --vocab-size 20000001"]                        # the trainer's memory preflight refuses it
    argv = ["--world", "4", "--global-batch", "8", "--layouts", *rows, "--out", str(out), "--launcher",
            "fork", "--steps", "2", "--stall-s", "8", "--memory-limit-gb", "1.5", "--gpus-per-node", "4",
            *PLANNER, "--", *MODEL]
    records = swept(argv, tmp_path)
    assert [r["outcome"] for r in records] == ["ok"] * 6 + ["out of memory", "timed out", "out of memory"]
    for r in records[:6]:
        assert_ran(r, 4)
    assert "can't allocate memory" in records[6]["cause"] and records[6]["exit"] != 0
    assert records[7]["cause"].startswith("no output for 8 s (--stall-s)") and records[7]["exit"] is None
    assert records[8]["cause"].startswith("refused by the memory preflight: ") and "ulimit -d" in \
        records[8]["cause"]
    ranks = [json.loads(p.read_text()) for p in (out / records[7]["row"]).glob("rank*.json")]
    assert len(ranks) == 4 and all(r["status"] is None for r in ranks)    # they started, and never ended
    assert {r["predicted"]["rank"] for r in records} == set(range(1, 10))
    table = (out / "table.txt").read_text().splitlines()
    assert [line.split(" tok/s")[0].split()[-2] for line in table[1:7]] == ["1", "2", "3", "4", "5", "6"]
    assert "timed out" in table[7] and "out of memory" in table[8] and "out of memory" in table[9]
    assert (out / "sweep.png").stat().st_size > 0
    again = sweep.main(argv)                                   # in this process: nothing left to run
    assert "9 rows, 9 of them recorded before" in capsys.readouterr().out
    assert len((out / "rows.jsonl").read_text().splitlines()) == 9
    ok = sorted(records[:6], key=lambda r: -r["tokens_per_s"])
    failed = sorted(records[6:], key=lambda r: r["predicted"]["rank"])
    assert [r["row"] for r in again] == [r["row"] for r in ok + failed]


def test_a_forked_rank_that_finds_a_bad_flag_waits_for_rank_0_to_say_it(tmp_path):
    """The fork launcher ends the other ranks when the first one fails, as torchrun's agent does. Without
    torchrun's error file a rank that found a bad flag left at once, and under load it could end rank 0
    before rank 0 printed why (the sweep's preflight row read "failed: rank exited with 2"). With the
    environment the launcher gives, rank 1 waits, and rank 0 prints the line and records it at once."""
    runtime = str(ROOT / "01_single_gpu" / "runtime")
    line = "train.py: error: --mbs 0: pass 1 or more"

    def rank(number: int) -> subprocess.Popen:
        given = sweep_jobs.torchrun_environment(number, 2, 29500, tmp_path)
        env = dict(os.environ, PYTHONPATH=runtime, **given)
        return subprocess.Popen([sys.executable, "-c", f"import rank0; rank0.fail({line!r})"], env=env,
                                stderr=subprocess.PIPE, text=True)

    silent = rank(1)
    with pytest.raises(subprocess.TimeoutExpired):
        silent.wait(timeout=3)                                   # still there: rank 0 has not spoken
    silent.kill()
    silent.communicate()
    speaker = rank(0)
    assert speaker.communicate(timeout=60)[1].strip() == line and speaker.returncode == 2
    assert json.loads((tmp_path / "error_rank0.json").read_text())["message"]["message"] == line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cleanup reads /proc (Linux)")
def test_a_sweep_at_world_2_runs_each_parallelism_and_leaves_nothing_running(tmp_path):
    """Issue 34's world of two: dp, tp, pp, cp, ep and ZeRO-1 each alone over the 2 ranks (global batch 4;
    pp 2 takes m = 2·pp = 4 micro-batches of 1), forked ranks as at world 4. Every row runs its 2 steps
    with speed, memory and communication on both ranks, in the order given, its trainer's grid line the
    layout asked, each with its own predicted rank; the failures' causes are world 4's test (the same code
    for any world)."""
    rows = ["dp=2", "tp=2", "pp=2", "cp=2", "dp=2,ep=2 --num-experts 4", "dp=2,zero=1"]
    argv = ["--world", "2", "--global-batch", "4", "--layouts", *rows, "--out", str(tmp_path / "sweep"),
            "--launcher", "fork", "--steps", "2", "--stall-s", "60", "--gpus-per-node", "2", *PLANNER, "--",
            *MODEL]
    records = swept(argv, tmp_path)
    grids = ["dp 2, pp 1, cp 1, tp 1, dp-mode naive", "dp 1, pp 1, cp 1, tp 2, dp-mode naive",
             "dp 1, pp 2, cp 1, tp 1, dp-mode naive", "dp 1, pp 1, cp 2, tp 1, dp-mode naive",
             "dp 2, pp 1, cp 1, tp 1, ep 2, 4 experts, dp-mode naive", "dp 2, pp 1, cp 1, tp 1, zero-1"]
    assert len(records) == len(grids)
    for record, grid in zip(records, grids):
        assert_ran(record, 2)
        log = (tmp_path / "sweep" / record["row"] / "output.log").read_text()
        assert log.startswith(f"grid ({grid}): "), f"{record['row']}: {log[:200]}"   # the trainer's layout
    assert records[2]["layout"]["mbs"] == 1 and records[2]["layout"]["m"] == 4
    assert sorted(r["predicted"]["rank"] for r in records) == list(range(1, 7))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's rendezvous on this host")
def test_slurm_jobs_from_the_template_run_and_are_collected(tmp_path, capsys):
    """`--slurm` writes train.sbatch per row (the header set for the row, no requeue); run under bash with the
    stand-ins, srun starting torchrun for real (one rank on this host: a world of one, as on one GPU);
    `--collect` records the row that ran and leaves the other for a later --collect."""
    out = tmp_path / "sweep"
    argv = ["--world", "1", "--gpus-per-node", "1", "--global-batch", "4", "--layouts", "mbs=2,m=2", "mbs=4",
            "--out", str(out), "--steps", "2", "--limit-s", "120", *PLANNER, "--", *MODEL]
    scripts = sweep.main(["--slurm", *argv])
    assert [p.stem for p in scripts] == ["dp1-tp1-pp1-cp1-ep1-zero0-none-1f1b1-mbs2-m2",
                                         "dp1-tp1-pp1-cp1-ep1-zero0-none-1f1b1-mbs4-m1"]
    text = scripts[0].read_text()
    assert "#SBATCH --nodes=1" in text and "#SBATCH --gpus-per-node=1" in text
    assert "#SBATCH --requeue" not in text and "#SBATCH --signal" not in text
    assert "#SBATCH --time=00:02:00" in text and "TRAINER=08_5d_combined/sweep_rank.py" in text
    env = stand_ins(tmp_path, srun_runs=True)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env.update(SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port))
    row = out / scripts[0].stem
    with open(row / "slurm-4242.out", "w") as log:
        job = subprocess.run(["bash", str(scripts[0])], cwd=ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT, timeout=180)
    assert job.returncode == 0, (row / "slurm-4242.out").read_text()[-3000:]
    collected = sweep.main(["--collect", *argv])
    assert [(r["row"], r["outcome"]) for r in collected] == [(scripts[0].stem, "ok")]
    assert collected[0]["steps"] == 2 and len(collected[0]["comm_s"]) == len(collected[0]["peak_memory"]) == 1
    assert "has no record yet" not in capsys.readouterr().out or collected[0]["predicted"]["rank"] != 1


def records_file(path, figures: dict, ranks: int = 8):
    """bench_collectives.py's records for one scope at two sizes (the larger one's figures count)."""
    lines = []
    for (collective, scope), busbw in figures.items():
        for size, bw, place in ((1 << 20, busbw / 10, "out"), (1 << 26, busbw * 2, "in"),
                                (1 << 26, busbw, "out")):
            lines.append(json.dumps(dict(collective=collective, scope=scope, place=place, bytes=size,
                                         busbw=bw, correct=True, ranks=ranks, backend="nccl", device="GPU",
                                         host="h", date="2026-11-28")))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_planner_moves_each_dimension_at_its_collectives_measured_bandwidth(tmp_path, capsys):
    """Each dimension's bytes at the busbw of its collectives at the largest size, out of place: tp with SP
    at the harmonic mean of all-gather and reduce-scatter, pp at send/recv, dp (ZeRO-1) the same pair across
    nodes; with every collective at one figure the plan is the typed plan's (to rounding: 2/(1/a + 1/a))."""
    figures = {("all_reduce", "intra"): 300, ("all_gather", "intra"): 200, ("reduce_scatter", "intra"): 100,
               ("send_recv", "intra"): 400, ("all_to_all", "intra"): 50, ("all_gather", "inter"): 40,
               ("reduce_scatter", "inter"): 10, ("all_reduce", "inter"): 20, ("send_recv", "inter"): 30}
    path = records_file(tmp_path / "links.jsonl", figures)
    flags = ["--preset", "1b", "--seq-len", "4096", "--dp", "2", "--tp", "4", "--sp", "--pp", "2",
             "--zero-stage", "1", "--grad-acc", "8", "--peak-tflops", "989", "--gpus-per-node", "8"]
    planner.main(flags + ["--bandwidths", str(path)])
    printed = capsys.readouterr().out
    assert "tp      intra-node  all_gather+reduce_scatter 133 GB/s" in printed     # 2/(1/200 + 1/100)
    assert "pp      intra-node  send_recv                 400 GB/s" in printed
    assert "dp      inter-node  all_gather+reduce_scatter 16 GB/s" in printed      # 2/(1/40 + 1/10)
    assert f"measured by intra-node: {path}: 8 ranks, nccl, GPU on h, 2026-11-28" in printed
    args = planner.cli.parse_args(planner.build_parser(), ["--search", "--gpus", "16", "--preset", "1b",
                                                           "--bandwidths", str(records_file(
                                                               tmp_path / "flat.jsonl",
                                                               {(c, s): 123 for c, s in figures})),
                                                           "--global-batch-tokens", "1048576"], files=False)
    typed = planner.cli.with_values(args, bandwidths=None, bw_intra=123, bw_inter=123)
    lay, config = plan_arithmetic.Layout(dp=2, tp=4, sp=True, pp=2, zero_stage=1), search.model_config(args)
    measured = step_time.estimate(config, lay, 4096, 1, 8, step_time.cluster_of(args))
    assert measured.times == pytest.approx(step_time.estimate(config, lay, 4096, 1, 8,
                                                              step_time.cluster_of(typed)).times, rel=1e-12)
    assert isinstance(step_time.cluster_of(args).intra, measured_links.Measured)


@pytest.mark.parametrize("content, message", [
    (None, "no such file; write it with `torchrun"),
    ("{not json\n", "line 1 is not JSON"),
    ('{"collective": "all_reduce"}\n', "is not a record of bench_collectives.py"),
    (json.dumps(dict(collective="all_reduce", scope="intra", bytes=64, busbw=1.0, correct=False)) + "\n",
     "gave a wrong result"),
    (json.dumps(dict(collective="all_reduce", scope="intra", bytes=64, busbw=0.0, correct=True, ranks=1,
                     backend="gloo", device="cpu", host="h", date="d")) + "\n",
     "measure a world of two ranks"),
], ids=["missing", "not-json", "not-a-record", "wrong-result", "world-of-one"])
def test_a_bad_bandwidths_file_is_one_line(tmp_path, content, message, capsys):
    path = tmp_path / "links.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as stop:
        planner.main(["--tp", "2", "--bandwidths", str(path)])
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, after, message", [
    (["--layouts", "dp=2,tp=2"], ["--dp", "2"], "--dp after `--`: the sweep sets these per row"),
    (["--layouts", "dp=4,mbs=3"], [], "dp·mbs·m = 4·3·1 is not the global batch 8"),
    (["--layouts", "dp=2"], [], "dp·tp·pp·cp is not --world 4"),
    (["--layouts", "tp=2,dp=2,sp=1,ep=2 --num-experts 2"], [], "--sp"),
    (["--layouts", "dp=4,pipes=2"], [], "a row is key=value"),
    (["--layouts", "dp=4", "--launcher", "fork"], ["--device", "cuda"], "--launcher fork runs CPU ranks"),
    (["--layouts", "dp=4", "--steps", "1"], [], "--steps at least 2"),
], ids=["degree-after-dashes", "batch", "world", "rules", "key", "fork-cuda", "steps"])
def test_bad_sweep_flags_stop_before_any_job(tmp_path, flags, after, message, capsys):
    with pytest.raises(SystemExit) as stop:
        sweep.main(["--world", "4", "--global-batch", "8", "--out", str(tmp_path / "s"), *flags, *PLANNER,
                    "--", *MODEL, *after])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
