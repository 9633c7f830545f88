"""Sampling: which windows each (step, micro-batch, data-parallel rank) reads, a pure function of the seed.

Playbook §2.2 (data parallelism: each rank its own slice of the global batch). The global batch of step s
is the samples [s·G, (s+1)·G) of a seeded permutation per epoch, with G = dp·mbs·grad_acc. Data-parallel
rank r reads its own M rows of each micro-batch, so `--dp D --mbs M` sees exactly the global batch of
`--mbs D·M` on one device, and resuming only needs the step number. With --eval-every the last
eval_batches·G windows are held out (`split_held_out`) and sampled the same way for evaluation.

    python 01_single_gpu/train.py --steps 200 --eval-every 50

Plumbing written once and reused by every folder; the windows come from data.py.
"""
import numpy as np
import torch


class WindowRange:
    """Windows [start, stop) of a dataset, indexed from 0 (the training part or the held-out part)."""

    def __init__(self, dataset, start: int, stop: int):
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict:
        return self.dataset[self.start + i]


def split_held_out(dataset, held_out: int):
    """(training windows, held-out windows): the last `held_out` windows are never trained on.

    A contiguous tail, not a random sample: windows are packed from a stream of documents, so random
    windows would share documents with the training ones. The split depends only on the dataset and
    `held_out` (eval batches × the global batch), the same in every parallel layout."""
    return WindowRange(dataset, 0, len(dataset) - held_out), WindowRange(dataset, len(dataset) - held_out,
                                                                        len(dataset))


class GlobalBatchSampler:
    """Which windows each (step, micro-batch, data-parallel rank) reads; a pure function of the seed."""

    def __init__(self, dataset, seed: int, mbs: int, grad_acc: int, dp_size: int = 1):
        self.dataset, self.seed = dataset, seed
        self.mbs, self.grad_acc, self.dp_size = mbs, grad_acc, dp_size
        self.global_batch = mbs * grad_acc * dp_size
        self._perm_epoch, self._perm = None, None

    def _index(self, sample: int) -> int:
        epoch, i = divmod(sample, len(self.dataset))
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=g), epoch
        return int(self._perm[i])

    def micro_batch(self, step: int, micro: int, dp_rank: int = 0):
        """(inputs, labels), each (mbs, seq_len) int64: rows of the global batch of `step`."""
        first = step * self.global_batch + (micro * self.dp_size + dp_rank) * self.mbs
        rows = [self._index(s) for s in range(first, first + self.mbs)]
        windows = torch.from_numpy(np.stack([self.dataset[r]["input_ids"] for r in rows]))  # (mbs, T+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
