"""kernels/gpu_run.py's MFU matrix: 01's trainer on both 1B shapes, every combination of five flags.

The headline has every speed technique on (the Triton kernels, SDPA, bf16 weights with fp32 gradient
accumulation, torch.compile, no gradient accumulation), the baseline none (eager PyTorch under autocast);
every other row changes one or more of the five axes, and the order puts the rows one axis away from the
headline first, since each of them shows what one technique adds.
"""
import itertools
from dataclasses import dataclass

SHAPES = {"llama3-1b": ["--preset", "llama3-1b"],                  # Llama-3.2-1B, vocab 128256, tied
          "1b-v32k": ["--preset", "1b", "--vocab-size", "32000"]}  # TinyLlama-1.1B's shape


@dataclass(frozen=True)
class Row:
    """One cell of the MFU matrix: 01's trainer with these flags."""
    shape: str
    kernels: str
    attn: str
    precision_layout: str
    compile: bool
    grad_acc: int

    @property
    def name(self):
        return (f"{self.shape}_{self.kernels}_{self.attn}_{self.precision_layout}_"
                f"{'compile' if self.compile else 'eager'}_ga{self.grad_acc}")

    def flags(self):
        return ["--kernels", self.kernels, "--attn", self.attn, "--precision-layout", self.precision_layout,
                "--grad-acc", str(self.grad_acc), *(["--compile"] if self.compile else [])]


HEADLINE = dict(kernels="triton", attn="sdpa", precision_layout="bf16-20", compile=True, grad_acc=1)
BASELINE = dict(kernels="torch", attn="sdpa", precision_layout="autocast", compile=False, grad_acc=1)
# The headline's value first; the axes in the order their effect is wanted
AXES = {"kernels": ("triton", "torch"), "compile": (True, False), "attn": ("sdpa", "triton"),
        "precision_layout": ("bf16-20", "autocast"), "grad_acc": (1, 4)}


def matrix():
    """Every row, most wanted first: the headline on both shapes, the baseline, then by how many axes a
    row changes from the headline (one axis at a time shows what each technique adds), then by which."""
    rows = [Row(shape, **dict(zip(AXES, values))) for values in itertools.product(*AXES.values())
            for shape in SHAPES]

    def priority(row):
        axes = {k: getattr(row, k) for k in AXES}
        kept = [axes[k] == HEADLINE[k] for k in AXES]
        return axes != HEADLINE, axes != BASELINE, kept.count(False), kept
    return sorted(rows, key=priority)
