"""What sweep.py prints at the end: the rows sorted by measured speed with the planner's rank beside them, how
far the planner's step time is off, and OUT/sweep.png (measured against predicted step time).

Reading the table: the first `#` is the measured order (tokens/s, fastest first), the second the planner's
order of the same rows; `error` is (predicted − measured) / measured step time. `comm` is the median over
the ranks of the seconds per step each spent blocked in communication (sweep_rank.py: exposed communication
and waiting for slower peers, the bubble included), beside the planner's exposed communication (`plan comm`).
Rows that did not run to the end come last, with their outcome and the line that says why.

    python 08_5d_combined/sweep.py --collect --out sweep ...     # the table again, from OUT/rows.jsonl
"""
import statistics
from pathlib import Path


def label(record: dict) -> str:
    """A row in a few words: degrees above 1, SP, ZeRO, recomputation, schedule, mbs × m, its own flags."""
    layout, flags = record["layout"], record["flags"]
    extra = flags[flags.index(f"--grad-acc={layout['m']}") + 1:]          # the row's own trainer flags
    parts = [f"{d}{layout[d]}" for d in ("dp", "tp", "pp", "cp", "ep") if layout[d] > 1] or ["dp1"]
    parts += ["sp"] * bool(layout["sp"]) + [f"zero{layout['zero_stage']}"] * bool(layout["zero_stage"])
    parts += [layout["recompute"]] * (layout["recompute"] != "none")
    if layout["pp"] > 1:
        parts.append(layout["schedule"] + (f"-v{layout['chunks']}" if layout["chunks"] > 1 else ""))
    return " ".join(parts + [f"mbs{layout['mbs']}×{layout['m']}", *extra])


def table(records: list) -> list:
    """The lines of the table; `records` sorted fastest first, the rows that did not finish last."""
    width = max([len(label(r)) for r in records] + [12]) + 1
    lines = [f"{'layout':<{width}}{'#':>3}{'speed':>12}{'step':>9}{'MFU':>6}{'mem GB':>7}{'comm':>8} |"
             f"{'plan step':>10}{'#':>3}{'error':>6}{'plan comm':>10}  outcome"]
    for k, r in enumerate(records, 1):
        p, ok = r["predicted"], r["outcome"] == "ok"
        mem = max((m for m in r["peak_memory"] if m), default=0)
        mfu = f"{r['mfu']:>6.1%}" if ok and r["mfu"] else f"{'-':>6}"
        measured = (f"{k:>3}{r['tokens_per_s']:>6.0f} tok/s{r['step_s']:>7.3f} s{mfu}{mem / 1e9:>7.2f}"
                    f"{statistics.median(r['comm_s'] or [0]):>6.3f} s" if ok else f"{'-':>3}{'':>42}")
        error = f"{(p['step_s'] - r['step_s']) / r['step_s']:>+6.0%}" if ok else f"{'':>6}"
        lines.append(f"{label(r):<{width}}{measured} |{p['step_s']:>8.3f} s{p['rank']:>3}{error}"
                     f"{p['comm_s']:>8.3f} s  {r['outcome']}" + (f": {r['cause']}" if r["cause"] else ""))
    return lines


def summary(records: list) -> list:
    """Whether the planner's fastest is the measured fastest, by how much not, and its step-time error."""
    ran = [r for r in records if r["outcome"] == "ok"]
    if not ran:
        return ["no row ran to the end"]
    best = ran[0]
    chosen = next((r for r in records if r["predicted"]["rank"] == 1), None)
    lines = [f"measured fastest: {label(best)}, {best['tokens_per_s']:.0f} tok/s ({best['step_s']:.3f} s a "
             f"step); the planner ranked it #{best['predicted']['rank']}"]
    if chosen is best:
        lines.append("the planner's fastest is the measured fastest")
    elif chosen is None:
        lines.append("the planner's fastest has no record yet")
    elif chosen["outcome"] == "ok":
        lines.append(f"the planner's fastest, {label(chosen)}, ran #{ran.index(chosen) + 1}: "
                     f"{chosen['step_s']:.3f} s a step, {chosen['step_s'] / best['step_s']:.2f}× the "
                     f"fastest's")
    else:
        lines.append(f"the planner's fastest, {label(chosen)}, did not run: {chosen['outcome']}")
    errors = sorted(((r["predicted"]["step_s"] - r["step_s"]) / r["step_s"], r) for r in ran)
    middle = errors[len(errors) // 2][1]
    lines.append(f"the planner's step time against the measured one: median error "
                 f"{errors[len(errors) // 2][0]:+.0%} ({middle['predicted']['step_s']:.3f} s predicted, "
                 f"{middle['step_s']:.3f} s measured: {label(middle)}), from {errors[0][0]:+.0%} to "
                 f"{errors[-1][0]:+.0%} over the {len(ran)} rows that ran")
    left = sum(r["left_running"] for r in records)
    lines.append(f"processes left running after their row: {left}" + (" (killed)" if left else ""))
    return lines


def plot(records: list, path: Path):
    """Measured against predicted step time, one point per row that ran, labelled by its measured #."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ran = [r for r in records if r["outcome"] == "ok"]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    xs, ys = [r["predicted"]["step_s"] for r in ran], [r["step_s"] for r in ran]
    ax.scatter(xs, ys, color="C0")
    for k, (x, y) in enumerate(zip(xs, ys), 1):
        ax.annotate(f"#{k}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if ran:
        low, high = min(xs + ys) / 1.5, max(xs + ys) * 1.5
        ax.plot([low, high], [low, high], color="grey", linewidth=1, label="measured = predicted")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set_xlabel("planner's step time (s)")
    ax.set_ylabel("measured step time (s, median)")
    ax.set_title(f"{len(ran)} of {len(records)} layouts ran", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(out: Path, records: dict) -> list:
    """Print the table and the summary, write OUT/table.txt and OUT/sweep.png; returns the sorted records."""
    ordered = sorted(records.values(), key=lambda r: (r["outcome"] != "ok", -(r["tokens_per_s"] or 0)
                                                       if r["outcome"] == "ok" else r["predicted"]["rank"]))
    lines = table(ordered) + summary(ordered)
    print("\n".join(lines))
    (out / "table.txt").write_text("\n".join(lines) + "\n")
    plot(ordered, out / "sweep.png")
    print(f"table: {out / 'table.txt'}, plot: {out / 'sweep.png'}")
    return ordered
