"""kernels/results/latest.md, the GPU figures and the project's targets, generated, never typed by hand.

Reads each kernels/gpu_run.py run kept in kernels/results/runs/<date>-<device>/ (records.jsonl, the
bench's JSON), newest first, then the first session's files: kernels/results/<device>.json
(kernels/bench.py), <device>-machine.txt (nvidia-smi and the versions) and
01_single_gpu/results/<device>/1b_kernels-*_attn-*.jsonl / .log (01's training runs: the log holds the
command and the allocator's peak). Throughput and MFU are medians over the steps after the first two
(step 1 compiles and autotunes, step 2 still warms the allocator).

    python kernels/report.py                            # print the page
    python kernels/report.py --write                    # write it to kernels/results/latest.md
    python kernels/report.py --import-run DIR --write   # first keep gpu_run's folder DIR under results/runs/
tests/test_repository.py checks that latest.md holds exactly what this prints; the READMEs link it.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu")]
from pathlib import Path

import argparse
import json
import re
import shlex
import shutil
import statistics

import metrics

ROOT = Path(ROOT)                                    # the repository, as a Path
KERNEL_RESULTS, TRAINING_RESULTS = ROOT / "kernels" / "results", ROOT / "01_single_gpu" / "results"
RUNS = KERNEL_RESULTS / "runs"    # one folder per `kernels/gpu_run.py` session, as --import-run keeps it
LATEST = KERNEL_RESULTS / "latest.md"
WARM_UP_STEPS = 2
# The project's targets (1B, seq 2048, bf16, a real vocabulary): MFU per GPU, the copy-bandwidth share
MFU_GOAL, BANDWIDTH_GOAL, REAL_VOCABULARY = {"H100": 0.50, "H200": 0.55}, 0.80, ("llama3-1b", "1b-v32k")
TIME_GOALS = (("attention", "sdpa-flash", "FlashAttention fwd+bwd at most SDPA (flash)'s"),
              ("linear+cross-entropy", "eager", "linear + cross-entropy fwd+bwd at most eager's"))


def training_rows(folder: Path):
    """One row per 1b run: --kernels, --attn, tokens/s, MFU, the allocator's peak (GiB)."""
    rows = []
    for log in sorted(folder.glob("1b_kernels-*_attn-*.log")):
        kernels, attn = re.fullmatch(r"1b_kernels-(\w+)_attn-(\w+)", log.stem).groups()
        steps = [json.loads(line) for line in log.with_suffix(".jsonl").read_text().splitlines()]
        timed = steps[WARM_UP_STEPS:]
        peak_gib = max(float(g) for g in re.findall(r"\| mem ([\d.]+)GiB", log.read_text()))
        rows.append((kernels, attn, statistics.median(s["tokens_per_s"] for s in timed),
                     statistics.median(s["mfu"] for s in timed), peak_gib, len(timed)))
    return rows, log.read_text().splitlines()[0].removeprefix("$ ")


def kernel_rows(result: dict):
    """Each kernel at its largest shape: ms per implementation and pass, and Triton's share of the peak."""
    largest = {r["kernel"]: r["shape"] for r in result["rows"]}    # bench.py writes shapes smallest first
    table = {}
    for r in result["rows"]:
        if r["shape"] == largest[r["kernel"]]:
            table.setdefault((r["kernel"], r["shape"], r["pass_"]), {})[r["impl"]] = r
    return table


def legacy_lines(device: str) -> list:
    """The section's part from the first session's files (bench.py's <device>.json, 01's logs)."""
    result = json.loads((KERNEL_RESULTS / f"{device}.json").read_text())
    machine = (KERNEL_RESULTS / f"{device}-machine.txt").read_text()
    driver = re.search(r"Driver Version: (\S+)", machine).group(1)
    training, command = training_rows(TRAINING_RESULTS / device)
    peaks = result["peaks"]
    lines = [f"**{result['device']}** (driver {driver}, CUDA {result['cuda']}; torch {result['torch']}, "
             f"Triton {result['triton']}), {result['date']}. Measured there: a bf16 8192³ matmul at "
             f"{peaks['matmul_bf16_tflops']:.0f} TFLOP/s, a device-to-device copy at "
             f"{peaks['copy_gbps']:.0f} GB/s.",
             "", f"Training, `{command.split(' --kernels')[0]}` (medians of steps "
             f"{WARM_UP_STEPS + 1}-{WARM_UP_STEPS + training[0][5]}; MFU against "
             f"{metrics.PEAK_TFLOPS[result['device'].split()[-1]]:.0f} TFLOP/s dense bf16; "
             f"[01_single_gpu/results/{device}/](01_single_gpu/results/{device}/)):", "",
             "| `--kernels` | `--attn` | tokens/s | MFU | allocator peak |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {a} | {tps:,.0f} | {mfu:.1%} | {gib:.1f} GiB |"
              for k, a, tps, mfu, gib, _ in training]
    lines += ["", f"Kernels at their largest shape, bf16, milliseconds (`python kernels/bench.py "
              f"--no-compile`; every shape: [kernels/results/{device}.md](kernels/results/{device}.md)):", "",
              "| kernel | shape | pass | eager | SDPA (flash) | Triton | Triton, of the measured peak |",
              "|---|---|---|---|---|---|---|"]
    for (kernel, shape, pass_), impls in kernel_rows(result).items():
        ms = [f"{impls[i]['ms']:.3f}" if i in impls and impls[i]["ms"] else "-"
              for i in ("eager", "sdpa-flash", "triton")]
        triton = impls["triton"]
        lines.append(f"| {kernel} | {shape} | {pass_} | {' | '.join(ms)} | {triton['of_peak']:.0%} "
                     f"({triton['rate']:.0f} {triton['unit']}) |")
    return lines + ["", memory_sentence(result)]


def memory_sentence(result: dict) -> str:
    memory = {(m["shape"], m["impl"]): m["peak_extra_gib"] for m in result["memory"]}
    return "The linear + cross-entropy's peak extra memory, forward + backward: " + "; ".join(
        f"{shape}: eager {gib_text(memory[shape, 'eager'])}, Triton {gib_text(memory[shape, 'triton'])}"
        for shape in dict.fromkeys(m["shape"] for m in result["memory"])) + "."


def gib_text(gib):
    return "failed" if gib is None else f"{gib:.2f} GiB"


def run_section(folder: Path) -> str:
    """The part of one `kernels/gpu_run.py` run: its machine, tests, training matrix and kernel bench."""
    records = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
    m = records[0]
    where = folder.resolve().relative_to(ROOT) if folder.resolve().is_relative_to(ROOT) else folder
    lines = [f"**{m['device']}** (driver {m['driver']}, CUDA {m['cuda']}, capability {m['capability']}; "
             f"torch {m['torch']}, Triton {m['triton']}), {m['date']}: `python kernels/gpu_run.py --budget-s "
             f"{m['budget_s']:.0f}` ([{where}/]({where}/): records.jsonl, log.txt, machine.txt)."]
    for t in (r for r in records if r["stage"] == "tests"):
        counts = (f"{t['passed']} passed, {t['failure'] + t['error']} failed, {t['skipped']} skipped"
                  + (f" ({t['status']}; counted from {t['source']})" if t["status"] != "ok" else "")
                  if "passed" in t else t["status"])
        failed = f" (failed: {', '.join(t['failed_names'])})" if t.get("failed_names") else ""
        lines += ["", f"Tests, `pytest {shlex.join(t.get('files') or t['what'].split())}`: {counts}{failed}."]
    lines += train_lines([r for r in records if r["stage"] == "train"])
    lines += nccl_lines([r for r in records if r["stage"] == "nccl"])
    benches = [r for r in records if r["stage"] == "bench"]
    written = [r for r in benches if r.get("file")]     # one <device>.json: every bench stage adds its rows
    if written:
        record = dict(written[0], fields=sorted({f for r in written for f in r["fields"]}))
        lines += bench_lines(json.loads((folder / record["file"]).read_text()), record, where)
    not_ok = [f"{' '.join(r.get('kernels') or r['what'].split())}: {r['status']}" for r in benches
              if r["status"] != "ok"]
    lines += ["", f"Kernel bench stages not finished: {'; '.join(not_ok)}."] if not_ok else []
    return "\n".join(lines)


def number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def train_lines(rows: list) -> list:
    """The MFU matrix as a table, the rows that did not run in one sentence."""
    ran = [r for r in rows if r["status"] != "skipped"]
    if not ran:
        return ["", "Training: no row ran within the budget."]
    first = ran[0]
    lines = ["", f"Training, `01_single_gpu/train.py --dataset {first['dataset']}`, seq {first['seq_len']}, "
             f"micro-batch {first['mbs']} (medians of steps {WARM_UP_STEPS + 1}-{first['steps']}; MFU "
             f"against {number(first['peak_tflops'], '.0f')} TFLOP/s dense bf16, {first['mfu_convention']}):",
             "", "| model | vocab | `--kernels` | `--attn` | `--precision-layout` | compile | grad-acc "
             "| tokens/s | MFU | allocator peak (GiB) | step, first step (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ran:
        measured = (f"{number(r['tokens_per_s'], ',.0f')} | {number(r['mfu'], '.1%')} | "
                    f"{number(r['peak_memory_gib'], '.1f')} | {number(r.get('step_s'), '.2f')}, "
                    f"{number(r.get('first_step_s'), '.1f')}" if r["status"] == "ok"
                    else f"{r['status']} | | | ")
        lines.append(f"| {r['shape']} | {r['vocab_size']} | {r['kernels']} | {r['attn']} | "
                     f"{r['precision_layout']} | {'yes' if r['compile'] else 'no'} | {r['grad_acc']} | "
                     f"{measured} |")
    if len(ran) < len(rows):
        lines += ["", f"Not run within the budget: {len(rows) - len(ran)} more rows of the matrix "
                  f"(records.jsonl names them)."]
    return lines


def nccl_lines(records: list) -> list:
    """02's collectives and 08's sweep row at world 1 (the NCCL path; no bus bandwidth at n = 1)."""
    lines = []
    for r in records:
        if r["status"] == "skipped" or r["what"] == "collectives" and r["status"] != "ok":
            lines.append(f"At world 1, {r['what']}: {r['status']}.")
        elif r["what"] == "collectives":
            broadcast = r["largest_algbw"].get("broadcast", 0)
            lines.append(f"At world 1, `02_data_parallel/bench_collectives.py`: {r['rows']} rows over "
                         f"{r['backend']}, every result right; bus bandwidth 0 by definition at n = 1, "
                         f"broadcast's algbw at the largest size {broadcast:.3g} GB/s.")
        elif r["rows"]:
            row, planned = r["rows"][0], r["rows"][0]["predicted"]
            measured = (f"{row['tokens_per_s']:,.0f} tokens/s, {row['step_s']:.3f} s a step, MFU "
                        f"{number(row['mfu'], '.1%')}" if row["outcome"] == "ok" else
                        f"{row['outcome']} ({row['cause']})")
            error = (f" ({planned['step_s'] / row['step_s'] - 1:+.0%})" if row["outcome"] == "ok" else "")
            lines.append(f"08's `sweep.py` at world 1 ({row['row']}): {measured}; the planner predicted "
                         f"{planned['step_s']:.3f} s{error}.")
        else:
            lines.append(f"08's `sweep.py` at world 1: {r['status']}, no row recorded.")
    return ["", *lines] if lines else []


def bench_lines(result: dict, record: dict, where) -> list:
    """Each kernel at its largest shape: ms per implementation; Triton's GPU time (the host's enqueue
    hidden) and the launches per call of eager and Triton where bench.py measured them."""
    gpu = "gpu_ms" in record["fields"]
    impls = ("eager", "torch.compile", "sdpa-flash", "triton")
    lines = ["", f"Kernels, bf16, milliseconds (`python kernels/bench.py {' '.join(record['argv'])}`; "
             f"[{where}/{record['file']}]({where}/{record['file']}) and .md):", "",
             "| kernel | shape | pass | eager | torch.compile | SDPA (flash) | Triton | "
             + ("Triton, GPU time | launches, eager / Triton | " if gpu else "")
             + "Triton, of the measured peak |",
             "|---|---|---|---|---|---|---|---|" + "---|---|" * gpu]
    for (kernel, shape, pass_), by_impl in kernel_rows(result).items():
        ms = [number(by_impl[i].get("ms"), ".3f") if i in by_impl else "-" for i in impls]
        eager, triton = by_impl.get("eager", {}), by_impl.get("triton", {})
        launches = f"{number(eager.get('launches'), 'd')} / {number(triton.get('launches'), 'd')}"
        of_peak = (f"{triton['of_peak']:.0%} ({triton['rate']:.0f} {triton['unit']})"
                   if triton.get("ms") else "failed")
        lines.append(f"| {kernel} | {shape} | {pass_} | {' | '.join(ms)} | "
                     + (f"{number(triton.get('gpu_ms'), '.3f')} | {launches} | " if gpu else "")
                     + f"{of_peak} |")
    return lines + ["", memory_sentence(result)] if result["memory"] else lines


def import_run(source: Path) -> Path:
    """Copy a gpu_run folder (the device tool's files) to kernels/results/runs/<date>-<device>/."""
    machine = json.loads((source / "records.jsonl").read_text().splitlines()[0])
    if machine["smoke"]:
        raise SystemExit(f"{source} holds a --smoke run (CPU, tiny shapes): its figures are no results")
    name = re.sub(r"[^a-z0-9]+", "-", f"{machine['date'][:16]} {machine['device']}".lower()).strip("-")
    target = RUNS / name
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        shutil.copy(file, target / file.name)
    return target


def section(device: str = "nvidia-h200", runs: Path = RUNS) -> str:
    """Every run: gpu_run's under `runs`, newest first, then the first session's results."""
    parts = [run_section(folder) for folder in sorted((p.parent for p in runs.glob("*/records.jsonl")),
                                                      reverse=True)]
    return "\n\n".join(parts + ["\n".join(legacy_lines(device))])


def newest(device: str = "nvidia-h200", runs: Path = RUNS):
    """(the device, the newest bench result, the training records of that run; the first session's else)."""
    for folder in sorted((p.parent for p in runs.glob("*/records.jsonl")), reverse=True):
        records = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
        bench = next((r["file"] for r in records if r["stage"] == "bench" and r.get("file")), None)
        if bench:
            return (records[0]["device"], json.loads((folder / bench).read_text()),
                    [r for r in records if r["stage"] == "train" and r["status"] == "ok"])
    result = json.loads((KERNEL_RESULTS / f"{device}.json").read_text())
    return result["device"], result, []    # its 1B runs used the byte vocabulary: no MFU row counts


def goal_lines(device: str, result: dict, train: list) -> list:
    """Each target against the newest figures: met, missed, or not measured yet."""
    table = {(k, p): impls for (k, _, p), impls in kernel_rows(result).items()}
    ms = {(k, i): table.get((k, "fwd+bwd"), {}).get(i, {}).get("ms") for k, _ in table for i in
          ("eager", "sdpa-flash", "triton")}
    mfu = max((r["mfu"] for r in train if r["shape"] in REAL_VOCABULARY and r.get("mfu")), default=None)
    mfu_goal = next((v for k, v in MFU_GOAL.items() if k in device), None)
    largest = result["memory"][-1]["shape"] if result["memory"] else None    # bench.py: smallest first
    memory = {m["impl"]: m["peak_extra_gib"] for m in result["memory"] if m["shape"] == largest}
    rows = [(f"1B training MFU ≥ {number(mfu_goal, '.0%')} (seq 2048, bf16, {' or '.join(REAL_VOCABULARY)})",
             number(mfu, ".1%"), None if mfu is None or mfu_goal is None else mfu >= mfu_goal)]
    for kernel, against, name in TIME_GOALS:
        mine, theirs = ms.get((kernel, "triton")), ms.get((kernel, against))
        met = None if not (mine and theirs) else mine <= theirs
        rows.append((f"{name} time", f"{number(mine, '.3f')} ms against {number(theirs, '.3f')} ms", met))
    for kernel in ("rmsnorm", "rope", "swiglu"):
        share = table.get((kernel, "fwd+bwd"), {}).get("triton", {}).get("of_peak")
        rows.append((f"{kernel} fwd+bwd ≥ {BANDWIDTH_GOAL:.0%} of the copy bandwidth", number(share, ".0%"),
                     None if share is None else share >= BANDWIDTH_GOAL))
    ratio = (memory["triton"] / memory["eager"]) if memory.get("triton") and memory.get("eager") else None
    rows.append(("linear + cross-entropy memory at most 1/3 of eager's", number(ratio, ".2f") + " of eager's",
                 None if ratio is None else ratio <= 1 / 3))
    verdict = {True: "met", False: "missed", None: "not measured yet"}
    return [f"The newest figures: {device}, {result['date']}, each kernel at its largest shape "
            "(bf16; the tables below say which).", "", "| target | newest figure | |", "|---|---|---|"] + [
        f"| {target} | {figure} | {verdict[met]} |" for target, figure, met in rows]


def page() -> str:
    """latest.md: the targets against the newest figures, then every run (links made relative to it)."""
    runs = re.sub(r"\]\((?!https?:|#)", "](../../", section())
    return "\n".join([
        "# The latest GPU figures", "",
        "Generated by `python kernels/report.py --write` from the committed results (kernels/results/, "
        "01_single_gpu/results/): never typed by hand. A GPU session runs `python3 kernels/gpu_run.py --out "
        "$OUT`; `python kernels/report.py --import-run DIR --write` keeps its files and rewrites this page.",
        "", "## The targets", "", *goal_lines(*newest()), "", "## Every run, newest first", "", runs, ""])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {LATEST.relative_to(ROOT)}")
    parser.add_argument("--import-run", type=Path, metavar="DIR",
                        help="first copy a kernels/gpu_run.py folder into kernels/results/runs/")
    args = parser.parse_args(argv)
    if args.import_run:
        print(f"kept the run in {import_run(args.import_run)}")
    text = page()
    if args.write:
        LATEST.write_text(text)
        print(f"wrote {LATEST.relative_to(ROOT)}")
    else:
        print(text)

if __name__ == "__main__":
    main()
