"""kernels/bench.py's files: <device>.json (every row, the machine, the measured peaks) and <device>.md.

Both are rewritten whole after every row (a sibling file renamed over the old), so a bench cut short by
its time limit leaves every row it measured and never a half-written file; `--append` keeps the rows of
earlier runs into the same folder, replacing those measured again (kernels/gpu_run.py runs the bench as
one stage per kernel group).
"""
import json
import os
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def format_row(r):
    if r.get("ms") is None:
        return f"| {r['kernel']} | {r['shape']} | {r['impl']} | {r['pass_']} | failed: {r['error']} | | | | |"
    gpu = f"{r['gpu_ms']:.3f} ({100 * r['gpu_of_peak']:.0f}%)" if r.get("gpu_ms") is not None else "-"
    launches = r.get("launches")
    return (f"| {r['kernel']} | {r['shape']} | {r['impl']} | {r['pass_']} | {r['ms']:.3f} | "
            f"{r['rate']:.1f} {r['unit']} | {100 * r['of_peak']:.0f}% | {gpu} | "
            f"{'-' if launches is None else launches} |")


def gib_text(gib):
    return "failed" if gib is None else f"{gib:.2f}"


def write_results(meta, peaks, rows, memory, results: Path, quiet: bool = False):
    """<device>.json and .md in the folder `results` (bench.py's default: RESULTS), each replaced whole."""
    results.mkdir(exist_ok=True)
    stem = re.sub(r"[^a-z0-9]+", "-", meta["device"].lower()).strip("-")
    replace_file(results / f"{stem}.json", json.dumps(dict(meta, peaks=peaks, rows=rows, memory=memory),
                                                      indent=1))
    lines = [f"# Kernel benchmark: {meta['device']}", "",
             f"torch {meta['torch']}, Triton {meta['triton']}, CUDA {meta['cuda']}, {meta['date']}. "
             f"Written by `python kernels/bench.py`.", "",
             f"Measured peaks in this run: bf16 matmul {peaks['matmul_bf16_tflops']:.0f} TFLOP/s, "
             f"device-to-device copy {peaks['copy_gbps']:.0f} GB/s.", "",
             "ms: CUDA events around each call; GPU ms: the same with the host's enqueue hidden "
             "(kernels/gpu_timer.py), and its fraction of the peak; launches: GPU operations per call.", "",
             "| kernel | shape | impl | pass | ms | rate | of peak | GPU ms | launches |",
             "|---|---|---|---|---|---|---|---|---|",
             *map(format_row, rows), "",
             "## Linear + cross-entropy: peak extra memory of forward + backward", "",
             "| shape | impl | peak extra GiB | bf16 logits alone GiB |", "|---|---|---|---|",
             *(f"| {m['shape']} | {m['impl']} | {gib_text(m['peak_extra_gib'])} | {m['logits_gib']:.2f} |"
               for m in memory)]
    replace_file(results / f"{stem}.md", "\n".join(lines) + "\n")
    if not quiet:
        print(f"wrote {results / stem}.md and .json")
    return results / stem


def replace_file(path: Path, text: str):
    """Write a sibling, then rename it over `path`: a reader sees the old file or the new, never a part."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def earlier_results(results: Path, device: str) -> tuple:
    """(rows, memory) already in results/<device>.json (--append), or two empty lists."""
    path = results / (re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") + ".json")
    try:
        earlier = json.loads(path.read_text())
    except FileNotFoundError:
        return [], []
    except (OSError, json.JSONDecodeError) as error:
        sys.exit(f"kernels/bench.py --append: {path} is unreadable ({error}): remove it or drop --append")
    return earlier["rows"], earlier["memory"]


def merged(earlier, rows, memory) -> tuple:
    """(rows, memory): the earlier run's, less what this run measured again, then this run's."""
    earlier_rows, earlier_memory = earlier
    again = {(r["kernel"], r["shape"], r["impl"], r["pass_"]) for r in rows}
    shapes = {(m["shape"], m["impl"]) for m in memory}
    return ([r for r in earlier_rows if (r["kernel"], r["shape"], r["impl"], r["pass_"]) not in again] + rows,
            [m for m in earlier_memory if (m["shape"], m["impl"]) not in shapes] + memory)
