"""02_data_parallel: the process grid, and data parallelism against the single-device run."""
from importlib import import_module

import pytest

process_grid = import_module("02_data_parallel.process_grid")


def test_grid_layout_llama3_16_ranks():
    """Llama-3's layout with every degree 2: tp neighbours, then cp, pp, and dp farthest apart."""
    grid = process_grid.grid_layout(16, dp=2, pp=2, cp=2, tp=2)                 # (dp, pp, cp, tp)
    assert grid.shape == (2, 2, 2, 2)
    assert grid[0, 0, 0, :].tolist() == [0, 1]      # TP group of rank 0
    assert grid[0, 0, :, 0].tolist() == [0, 2]      # CP group
    assert grid[0, :, 0, 0].tolist() == [0, 4]      # PP group
    assert grid[:, 0, 0, 0].tolist() == [0, 8]      # DP group
    with pytest.raises(ValueError, match="does not equal the world size 16"):
        process_grid.grid_layout(16, dp=2, pp=2, cp=2, tp=1)
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        process_grid.grid_layout(4, dp=4, ep=3)
    with pytest.raises(ValueError, match="--tp must be at least 1"):
        process_grid.grid_layout(4, dp=4, tp=0)


def _average_gradients_rank():
    import torch
    import torch.distributed as dist
    dp = import_module("02_data_parallel.data_parallel")
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.full((3,), float(dist.get_rank() + 1))
    dp.average_gradients([a, b], dist.group.WORLD)
    return a.grad.tolist(), b.grad


def test_average_gradients_two_ranks():
    """Each rank's gradient is rank+1: the average is 1.5 everywhere; a None gradient stays None."""
    from harness import run_ranks
    for grad, none in run_ranks(_average_gradients_rank, 2):
        assert grad == [1.5, 1.5, 1.5] and none is None
