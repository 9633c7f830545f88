"""kernels/bench.py's picture: its result tables as grouped bars, one panel per kernel.

Each bar is a row's fraction of the GPU's measured peak (copy bandwidth or bf16 matmul rate), so
kernels of different kinds share one scale; the fused loss's extra memory gets a panel of its own.

    python kernels/bench.py --plot-from kernels/results/nvidia-h200.json    # no GPU needed
"""


def plot_results(result: dict, path):
    """The tables of a result (write_results' JSON) as grouped bars: one panel per kernel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kernels = list(dict.fromkeys(r["kernel"] for r in result["rows"]))
    impls = list(dict.fromkeys(r["impl"] for r in result["rows"]))
    colours = dict(zip(impls, plt.get_cmap("tab10").colors))
    panels = len(kernels) + bool(result["memory"])
    columns, lines = min(panels, 3), -(-panels // 3)
    fig, axes = plt.subplots(lines, columns, figsize=(5.5 * columns, 4.2 * lines), squeeze=False)
    for ax, kernel in zip(axes.flat, kernels):
        rows = [r for r in result["rows"] if r["kernel"] == kernel]
        groups = list(dict.fromkeys((r["shape"], r["pass_"]) for r in rows))
        present = [impl for impl in impls if any(r["impl"] == impl for r in rows)]   # SDPA: attention only
        width = 0.8 / len(present)
        for i, impl in enumerate(present):
            for g, group in enumerate(groups):
                row = next((r for r in rows if (r["shape"], r["pass_"]) == group and r["impl"] == impl), None)
                if row is None:
                    continue
                x = g + (i - (len(present) - 1) / 2) * width
                if row.get("ms") is None:              # failed (OOM, compile error): marked, not drawn
                    ax.text(x, 1, "×", ha="center", color=colours[impl])
                else:
                    ax.bar(x, 100 * row["of_peak"], width, color=colours[impl],
                           label=impl if g == 0 else None)
        ax.set_xticks(range(len(groups)), [f"{shape}\n{p}" for shape, p in groups], fontsize=7)
        ax.set_ylabel(f"% of measured peak ({rows[0]['unit']})", fontsize=8)
        ax.set_title(kernel, fontsize=10)
        ax.set_ylim(0, 130 * max((r["of_peak"] for r in rows if r.get("ms") is not None), default=1))
        ax.legend(fontsize=7, loc="upper center", ncol=len(present))    # in the headroom above the bars
    if result["memory"]:
        ax = axes.flat[len(kernels)]
        labels = [f"{m['shape']}\n{m['impl']}" for m in result["memory"]]
        ax.barh(labels, [m["peak_extra_gib"] or 0 for m in result["memory"]],
                color=[colours.get(m["impl"], "grey") for m in result["memory"]])
        ax.tick_params(labelsize=7)
        ax.set_xlabel("peak extra memory, forward + backward (GiB; 0: failed)", fontsize=8)
        ax.set_title("linear + cross-entropy memory", fontsize=10)
    for ax in list(axes.flat)[panels:]:
        ax.set_visible(False)
    fig.suptitle(f"{result['device']}: torch {result['torch']}, Triton {result['triton']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
