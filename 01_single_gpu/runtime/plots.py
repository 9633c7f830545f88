"""Pictures of a run (--plot DIR): the loss curve and the memory of every rank (plumbing, not a technique).

    loss.png     training loss per step, and the held-out loss where --eval-every evaluated
    memory.png   one stacked bar per rank: parameters, gradients, optimizer states, activations (MiB),
                 measured after the last step (memory.measured_state; activations: the peak autograd
                 held during the first step), so ZeRO's shards or a pipeline's uneven stages show as such

    python 01_single_gpu/train.py --steps 200 --eval-every 20 --plot plots

matplotlib is imported only here, with its file-only backend (no display needed).
"""
from pathlib import Path

MEMORY_PARTS = (("parameters", "parameters", "#4C72B0"), ("gradients", "gradients", "#DD8452"),
                ("optimizer", "optimizer states", "#55A868"),
                ("activations", "activations (step 1 peak)", "#C44E52"))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")   # files only: works without a display, on every rank
    import matplotlib.pyplot as plt
    return plt


def loss_curve(records, folder) -> Path:
    """loss.png in `folder`: the training loss of every record and the eval loss where there is one."""
    plt = _pyplot()
    path = Path(folder) / "loss.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", color="#4C72B0")
    evaluated = [r for r in records if "eval_loss" in r]
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o-", label="eval loss",
                color="#C44E52")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def memory_bars(per_rank, folder) -> Path:
    """memory.png in `folder`: per_rank[r] = {"parameters", "gradients", "optimizer", "activations"} bytes."""
    plt = _pyplot()
    path = Path(folder) / "memory.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(0.7 * len(per_rank) + 5.5, 4))
    ranks = list(range(len(per_rank)))
    bottom = [0.0] * len(per_rank)
    for part, label, color in MEMORY_PARTS:
        mib = [r[part] / 2**20 for r in per_rank]
        ax.bar(ranks, mib, bottom=bottom, label=label, color=color, width=0.6)
        bottom = [b + m for b, m in zip(bottom, mib)]
    for rank, total in zip(ranks, bottom):
        ax.annotate(f"{total:.1f}", (rank, total), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(ranks)
    ax.set_xlabel("rank")
    ax.set_ylabel("MiB")
    ax.set_ylim(0, max(bottom) * 1.15 or 1)
    ax.set_title("memory per rank, measured")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))   # beside the bars, never on them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
